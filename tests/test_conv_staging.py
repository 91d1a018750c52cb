"""The CUDA forward's two stagings give bitwise the same results. The forward stages its sub-tiles in three
shared-memory buffers, or in two where a block cannot have the shared memory of three (compute capability 8.6,
8.9 and 12.x at K >= 4); PACKCUDA_CONV_SMALL_SMEM=1 gives every device the two-buffer staging. The variable is
read once per process, so each staging runs in a process of its own (this file run as a script), which records
its outputs and the buffer count of every forward kernel it launched."""
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import zlib

import pytest
import torch

import packcuda
from helpers import requires_cuda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROW_BYTES, TT, NST = 512, 64, 3  # conv_cuda.cu: a staged row, the forward's sub-tile and buffer count
# tokens per case: 30000; under compute-sanitizer (.ci/gpu sanitize sets PACKCUDA_SANITIZE) 2000, still 31 sub-tiles
# and every case, so that the two processes of instrumented kernels end in minutes
TOKENS = 2000 if os.environ.get("PACKCUDA_SANITIZE") else 30000


def _cases():
    """(K, dtype, C, with cu_seqlens, with prefix, activation): C = 264 takes the vector path (and ends in a
    partial slab), 257 the element-wise path; both activations for every K, dtype and C."""
    return [(K, dt, C, cu, pre, "silu" if cu == pre else None) for K in range(2, 9) for dt in DTYPES
            for C in (264, 257) for cu in (True, False) for pre in (True, False)]


def _digest(t):
    """dtype, shape and SHA-256 of the bytes of a tensor (bitwise comparison without keeping the outputs)."""
    t = t.detach().cpu().contiguous()
    data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
    return str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()


def _run(case):
    """Forward, then forward and backward, of one case on the current CUDA device: the outputs' digests."""
    K, dt, C, with_cu, with_pre, act = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    # TOKENS (30000 outside the sanitizer): every block of a slab column walks several sub-tiles. Segments start
    # and end on and off the sub-tile edges; some are empty, one token long or shorter than K - 1.
    lens, left = [64, 32, 0, 1], TOKENS - 97
    while left > 0:
        n = min(left, int(torch.randint(0, 600 if len(lens) % 2 else 5, (1,), generator=g)))
        lens.append(n)
        left -= n
    if not with_cu:
        lens = [sum(lens)]
    T = sum(lens)
    dtype = DTYPES[dt]
    x, w, b, dy = (torch.randn(*shape, generator=g).to("cuda", dtype) for shape in ((T, C), (C, K), (C,), (T, C)))
    w = w / K
    p = torch.randn(len(lens), K - 1, C, generator=g).to("cuda", dtype) if with_pre else None
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kw = dict(cu_seqlens=cu if with_cu else None, prefix=p, activation=act)
    y = packcuda.causal_conv1d(x, w, b, **kw)
    leaves = [t.requires_grad_() for t in (x, w, b) + ((p,) if with_pre else ())]
    y2 = packcuda.causal_conv1d(*leaves[:3], **dict(kw, prefix=leaves[3] if with_pre else None))
    grads = torch.autograd.grad(y2, leaves, dy)
    return [_digest(t) for t in (y, y2, *grads)]


# The buffer count, the forward kernel's last template argument, in its name as the profiler gives it: demangled
# (conv_fwd_kernel<..., 3>) or, where the demangler refuses the name, mangled (conv_fwd_kernelI...Li3EEEv).
KERNEL_NST = re.compile(r"conv_fwd_kernel<[^<>]*, (\d+)>|conv_fwd_kernelI.*?Li(\d+)EEEv")


def _child(out_path):
    """Runs every case, recording its outputs and the buffer counts of the forward kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    results = []
    for case in _cases():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outs = _run(case)
            torch.cuda.synchronize()
        nst = {int(m.group(1) or m.group(2)) for e in prof.events() if (m := KERNEL_NST.search(e.name))}
        results.append([case, outs, sorted(nst)])
    with open(out_path, "w") as f:
        json.dump(results, f)


def _staging(tmp_path, small):
    out = tmp_path / f"small{int(small)}.json"
    env = dict(os.environ, PACKCUDA_CONV_SMALL_SMEM="1" if small else "0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(packcuda.__file__)),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"child (small={small}) ended with code {r.returncode}\n{r.stderr[-4000:]}"
    with open(out) as f:
        return {tuple(case): (outs, nst) for case, outs, nst in json.load(f)}


@requires_cuda
@pytest.mark.spawns
def test_causal_conv1d_small_staging_is_bitwise_equal(tmp_path):
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    normal, small = _staging(tmp_path, False), _staging(tmp_path, True)
    assert set(normal) == set(small) == set(_cases())
    for case in _cases():
        K = case[0]
        km = 2 if K <= 2 else 3 if K == 3 else 4 if K == 4 else 8  # the kernel-size bucket (conv_dispatch.h)
        fits = NST * (TT + km - 1) * ROW_BYTES <= optin
        (a, nst_a), (b, nst_b) = normal[case], small[case]
        # under compute-sanitizer the profiler records no kernel (the sanitizer holds CUPTI): the buffer counts
        # are checked only outside it, the outputs everywhere
        if not os.environ.get("PACKCUDA_SANITIZE"):
            assert nst_a == [NST if fits else 2] and nst_b == [2], (case, nst_a, nst_b)
        assert len(a) == len(b) == 6 - (not case[4]), case
        for name, u, v in zip(["y", "y (autograd)", "dx", "dweight", "dbias", "dprefix"], a, b):
            assert u == v, f"{case}: {name} differs between the stagings"


if __name__ == "__main__":
    _child(sys.argv[1])
