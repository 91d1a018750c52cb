"""unpad / pad vs the nonzero + index_select approach (flash-attn's unpad_input) and vs a plain copy of the
same bytes (the bandwidth floor).

    python -m benchmarks.bench_pack [--quick] [--device cuda]
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

import packcuda
from benchmarks.harness import Timer, cli


def _nonzero_unpad(x, mask):
    """flash-attn style: seqlens, nonzero indices, cumsum, max via .item(), index_select."""
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices), indices, cu, max_seqlen


def _index_put_pad(xp, indices, B, S):
    out = torch.zeros(B * S, *xp.shape[1:], dtype=xp.dtype, device=xp.device)
    out[indices] = xp
    return out.view(B, S, *xp.shape[1:])


def run(quick: bool = False, device=None) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type == "cpu"
    timer = Timer(dev, warmup=3 if cpu else 5, reps=5 if cpu else 50)
    if cpu:
        shapes = [(4, 1024, 256, torch.float32)]
    elif quick:
        shapes = [(16, 4096, 1024, torch.bfloat16)]
    else:
        shapes = [(16, 8192, 4096, torch.bfloat16), (64, 4096, 1024, torch.bfloat16), (64, 16384, None, torch.int64)]
    rows = []
    rng = random.Random(0)
    for B, S, H, dtype in shapes:
        lens = [rng.randint(S // 4, S) for _ in range(B)]
        trailing = () if H is None else (H,)
        x = (torch.randn(B, S, *trailing, device=dev).to(dtype) if dtype.is_floating_point
             else torch.randint(0, 150000, (B, S), device=dev, dtype=dtype))
        mask = torch.arange(S, device=dev)[None] < torch.tensor(lens, device=dev)[:, None]
        T = sum(lens)
        row = x.element_size() * (1 if H is None else H)
        shape = f"B={B} S={S} " + (f"H={H} " if H else "") + f"{str(dtype).replace('torch.', '')} T={T}"

        # correctness in the same run
        a = packcuda.unpad(x, lengths=lens)
        b = _nonzero_unpad(x, mask)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

        t_ours = timer.median_ms(lambda: packcuda.unpad(x, lengths=lens))
        t_ours_mask = timer.median_ms(lambda: packcuda.unpad(x, mask))
        t_nz = timer.median_ms(lambda: _nonzero_unpad(x, mask))
        src = torch.empty(T * row, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        t_copy = timer.median_ms(lambda: dst.copy_(src))
        gbps = 2 * T * row / (t_ours * 1e-3) / 1e9
        rows.append(dict(op="unpad (host lengths)", shape=shape, packcuda_ms=t_ours, baseline="nonzero+index_select",
                         baseline_ms=t_nz, speedup=t_nz / t_ours, copy_ms=t_copy, pct_copy_bw=100 * t_copy / t_ours,
                         GBps=gbps))
        rows.append(dict(op="unpad (attention_mask)", shape=shape, packcuda_ms=t_ours_mask,
                         baseline="nonzero+index_select", baseline_ms=t_nz, speedup=t_nz / t_ours_mask,
                         copy_ms=t_copy, pct_copy_bw=100 * t_copy / t_ours_mask))

        xp, idx = a[0], a[1]
        assert torch.equal(packcuda.pad(xp, idx, B, S), _index_put_pad(xp, idx, B, S))
        t_pad = timer.median_ms(lambda: packcuda.pad(xp, idx, B, S))
        t_put = timer.median_ms(lambda: _index_put_pad(xp, idx, B, S))
        # floor: read T rows, write B*S rows
        n_rw = (T + B * S) * row // 2
        src2 = torch.empty(n_rw, dtype=torch.uint8, device=dev)
        dst2 = torch.empty_like(src2)
        t_copy2 = timer.median_ms(lambda: dst2.copy_(src2))
        rows.append(dict(op="pad", shape=shape, packcuda_ms=t_pad, baseline="zeros+index_put",
                         baseline_ms=t_put, speedup=t_put / t_pad, copy_ms=t_copy2,
                         pct_copy_bw=100 * t_copy2 / t_pad, GBps=(T + B * S) * row / (t_pad * 1e-3) / 1e9))
        del x, src, dst, src2, dst2
    return rows


def main():
    cli(run, "packing: unpad / pad",
           notes="copy_ms: a device copy of the same bytes (read + written); pct_copy_bw = copy_ms / packcuda_ms.")


if __name__ == "__main__":
    main()
