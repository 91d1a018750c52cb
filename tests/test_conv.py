import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, capture_cuda_graph, cumulative, keyed_generator, no_sync, requires_cuda

TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _close(got, want, dtype, what):
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got - want).abs().max().item() / scale if want.numel() else 0.0
    assert err <= TOL[dtype], f"{what}: max error {err:.3g} (scaled) > {TOL[dtype]}"


def _run_vs_reference(device, dtype, lens, K, C, act, with_prefix, with_bias, g):
    cu = cumulative(lens)
    T = cu[-1]
    x = torch.randn(T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64) / K
    b = torch.randn(C, generator=g, dtype=torch.float64) if with_bias else None
    p = torch.randn(len(lens), K - 1, C, generator=g, dtype=torch.float64) if with_prefix else None
    dy = torch.randn(T, C, generator=g, dtype=torch.float64)
    leaves = [t.to(dtype) if t is not None else None for t in (x, w, b, p)]
    # reference in fp64 on the values rounded to dtype
    rl = [t.double().requires_grad_() if t is not None else None for t in leaves]
    yr = ref.causal_conv1d(rl[0], rl[1], rl[2], cu, rl[3], act)
    gr = torch.autograd.grad(yr, [t for t in rl if t is not None], dy, allow_unused=True, materialize_grads=True)
    dl = [t.to(device).requires_grad_() if t is not None else None for t in leaves]
    y = packcuda.causal_conv1d(dl[0], dl[1], dl[2], cu_seqlens=cu, prefix=dl[3], activation=act)
    assert y.dtype == dtype and y.shape == (T, C) and y.device.type == device
    _close(y, yr, dtype, "y")
    gs = torch.autograd.grad(y, [t for t in dl if t is not None], dy.to(dtype).to(device))
    for name, a, r in zip(["dx", "dweight", "dbias" if with_bias else "dprefix", "dprefix"], gs, gr):
        _close(a, r, dtype, name)
    return y, gs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("act", [None, "silu"])
def test_causal_conv1d_matches_reference(device, dtype, K, act):
    g = keyed_generator(dtype, K, act)
    # empty segments, segments shorter than K-1, one long segment spanning several tiles
    lens = [5, 0, 1, 2, 300, 0, 3, 700, 1]
    _run_vs_reference(device, dtype, lens, K, 33, act, True, True, g)
    _run_vs_reference(device, dtype, lens, K, 8, act, False, False, g)


@pytest.mark.parametrize("K", [1, 5, 8])
def test_causal_conv1d_other_kernel_sizes(device, K):
    g = keyed_generator(K)
    _run_vs_reference(device, torch.float32, [9, 0, 2, 130], K, 5, "silu", True, True, g)
    _run_vs_reference(device, torch.float32, [1, 40], K, 3, None, False, True, g)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [2, 4, 5, 8])
def test_causal_conv1d_vector_width_channels(device, dtype, K):
    # C a multiple of every vector width (the CUDA vector path), segments crossing tile boundaries
    g = keyed_generator("vec", dtype, K)
    _run_vs_reference(device, dtype, [3, 0, 200, 1, 90, 2], K, 48, "silu", True, True, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_unaligned_storage(device, dtype):
    # contiguous views starting one element into their storage take the scalar path on CUDA
    g = keyed_generator("unaligned", dtype)
    T, C, K = 150, 16, 4
    base = torch.randn(T * C + 1, generator=g).to(device, dtype)
    x = base[1:].view(T, C)
    w = torch.randn(C, K, generator=g).to(device, dtype)
    cu = [0, 70, 70, 150]
    y = packcuda.causal_conv1d(x, w, cu_seqlens=cu, activation="silu")
    _close(y, ref.causal_conv1d(x.double(), w.double(), None, cu, None, "silu"), dtype, "y")
    dyb = torch.randn(T * C + 1, generator=g).to(device, dtype)
    outs = torch.ops.packcuda.causal_conv1d_bwd(dyb[1:].view(T, C), x, w, None, torch.tensor(cu), None, "silu")
    ref_outs = torch.ops.packcuda.causal_conv1d_bwd(dyb[1:].clone().view(T, C), x.clone(), w, None,
                                                    torch.tensor(cu), None, "silu")
    for a, r in zip(outs, ref_outs):
        if a is not None and r is not None:
            _close(a, r, dtype, "grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C", [8, 264, 257])
def test_causal_conv1d_block_tiles(device, dtype, C):
    # The CUDA kernels stage slabs of channels (512 bytes of a row) over spans of token sub-tiles: C = 264 ends in
    # a partial slab, 257 takes the element-wise path, and C = 8 over a long stream gives every block several
    # sub-tiles. Segments start and end on and off the sub-tile edges (multiples of 32 and 64), some are empty,
    # one token long or shorter than K - 1.
    g = keyed_generator("block", dtype, C)
    T = (40000 if C == 8 else 3000) if device == "cuda" else 900  # the CPU kernel has no such tiles
    lens, left = [64, 32, 0, 1], T - 97
    while left > 0:  # long segments (up to 600 tokens) alternating with short ones (0..4 tokens)
        hi = 600 if len(lens) % 2 else 5
        n = min(left, int(torch.randint(0, hi, (1,), generator=g)))
        lens.append(n)
        left -= n
    for K in (2, 4):
        _run_vs_reference(device, dtype, lens, K, C, "silu", K == 4, True, g)


@pytest.mark.parametrize("K", [2, 3, 4, 8])
def test_causal_conv1d_prefix_rows_near_tile_edges(device, K):
    # Segments start on every offset around the CUDA backward's 32-token sub-tile edges, one to four per
    # sub-tile, with empty ones between, so a tile walk enters segments (and reads their prefix rows) at every
    # position; a prefix given as a view one element into its storage gives bitwise the same gradients.
    g = keyed_generator("prefix-edges", K)
    lens = []
    for r in range(34):  # a start r tokens after an edge, then one, two or three more inside the sub-tile
        lens += [32 + r % 7, 0] + [1 + r % 3] * (r % 4) + [29 - r % 4]
    C = 256
    _run_vs_reference(device, torch.bfloat16, lens, K, C, "silu", True, True, g)
    cu = cumulative(lens)
    S, T = len(lens), cu[-1]
    x = torch.randn(T, C, generator=g).to(device, torch.bfloat16)
    w = torch.randn(C, K, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(T, C, generator=g).to(device, torch.bfloat16)
    p = torch.randn(S, K - 1, C, generator=g).to(device, torch.bfloat16)
    p_off = torch.empty(p.numel() + 1, device=device, dtype=p.dtype)[1:].view_as(p).copy_(p)
    bias = torch.randn(C, generator=g).to(device, torch.bfloat16)
    a = torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, bias, torch.tensor(cu), p, "silu")
    b = torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, bias, torch.tensor(cu), p_off, "silu")
    for name, i in (("dx", 0), ("dweight", 1), ("dbias", 2), ("dprefix", 3)):
        assert torch.equal(b[i], a[i]), name


def test_causal_conv1d_no_cu_seqlens_equals_conv1d(device):
    g = keyed_generator("plain")
    x = torch.randn(257, 16, generator=g).to(device)
    w = torch.randn(16, 4, generator=g).to(device)
    b = torch.randn(16, generator=g).to(device)
    y = packcuda.causal_conv1d(x, w, b)
    want = torch.nn.functional.conv1d(x.t()[None], w[:, None], b, padding=3, groups=16)[0, :, :257].t()
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    K=st.integers(1, 6),
    C=st.integers(1, 9),
    act=st.sampled_from([None, "silu"]),
    with_prefix=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_causal_conv1d_hypothesis(lens, K, C, act, with_prefix, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    for device in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        _run_vs_reference(device, torch.float64, lens, K, C, act, with_prefix, with_bias, g)


def test_causal_conv1d_gradcheck():
    g = keyed_generator("gradcheck")
    cu = [0, 3, 3, 4, 11]
    K, C = 3, 3
    x = torch.randn(11, C, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.randn(4, K - 1, C, dtype=torch.float64, generator=g, requires_grad=True)
    for act in [None, "silu"]:
        torch.autograd.gradcheck(
            lambda x, w, b, p: packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation=act),
            (x, w, b, p))
    torch.autograd.gradcheck(lambda x, w: packcuda.causal_conv1d(x, w, cu_seqlens=cu), (x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv1d_backward_is_deterministic(device, dtype):
    g = keyed_generator("det", dtype)
    cu = cumulative([1000, 17, 0, 2, 1500])
    x = torch.randn(cu[-1], 64, generator=g).to(device, dtype)
    w = torch.randn(64, 4, generator=g).to(device, dtype)
    b = torch.randn(64, generator=g).to(device, dtype)
    p = torch.randn(5, 3, 64, generator=g).to(device, dtype)
    dy = torch.randn(cu[-1], 64, generator=g).to(device, dtype)
    outs = [torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, torch.tensor(cu), p, "silu") for _ in range(3)]
    for o in outs[1:]:
        for a, b_ in zip(outs[0], o):
            assert torch.equal(a, b_)


def test_causal_conv1d_device_cu_seqlens(device):
    g = keyed_generator("devcu")
    cu = cumulative([4, 0, 9, 2])
    x = torch.randn(cu[-1], 6, generator=g).to(device)
    w = torch.randn(6, 4, generator=g).to(device)
    p = torch.randn(4, 3, 6, generator=g).to(device)
    a = packcuda.causal_conv1d(x, w, cu_seqlens=cu, prefix=p)
    b = packcuda.causal_conv1d(x, w, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), prefix=p)
    assert torch.equal(a, b)


def test_causal_conv1d_host_list_changed_in_place(device):
    """The same host list object, its values changed between calls: each call reads the values it is given."""
    g = keyed_generator("cu_in_place")
    x = torch.randn(12, 5, generator=g).to(device)
    w = torch.randn(5, 3, generator=g).to(device)
    cu = [0, 4, 12]
    a = packcuda.causal_conv1d(x, w, cu_seqlens=cu)
    assert torch.equal(packcuda.causal_conv1d(x, w, cu_seqlens=cu), a)
    cu[1] = 7
    b = packcuda.causal_conv1d(x, w, cu_seqlens=cu)
    assert torch.equal(b, packcuda.causal_conv1d(x, w, cu_seqlens=[0, 7, 12]))
    assert not torch.equal(a, b)
    cu.insert(1, 2)
    want = packcuda.causal_conv1d(x, w, cu_seqlens=(0, 2, 7, 12))
    assert torch.equal(packcuda.causal_conv1d(x, w, cu_seqlens=cu), want)
    with pytest.raises(ValueError, match="causal_conv1d"):
        cu[-1] = 11
        packcuda.causal_conv1d(x, w, cu_seqlens=cu)


@pytest.mark.parametrize("nseg", [7, 478, 479, 480, 700])
def test_causal_conv1d_many_segments(device, nseg):
    # On CUDA, host cu_seqlens of up to 479 segments travel in the kernels' parameters and longer ones are
    # uploaded: both give the results of a device cu_seqlens (bitwise) and of the reference, with prefix rows
    # and their gradient.
    g = keyed_generator("manyseg", nseg)
    lens = [int(v) for v in torch.randint(0, 7, (nseg,), generator=g)]
    lens[0], lens[-1] = 40, 33
    _run_vs_reference(device, torch.float32, lens, 4, 24, "silu", True, True, g)
    cu = cumulative(lens)
    x = torch.randn(cu[-1], 24, generator=g).to(device)
    w = torch.randn(24, 4, generator=g).to(device)
    b = torch.randn(24, generator=g).to(device)
    p = torch.randn(nseg, 3, 24, generator=g).to(device)
    dy = torch.randn(cu[-1], 24, generator=g).to(device)
    cu_dev = torch.tensor(cu, device=device)
    assert torch.equal(packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation="silu"),
                       packcuda.causal_conv1d(x, w, b, cu_seqlens=cu_dev, prefix=p, activation="silu"))
    host = torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, torch.tensor(cu), p, "silu")
    dev = torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, cu_dev, p, "silu")
    for a, b_ in zip(host, dev):
        assert torch.equal(a, b_)


def test_opcheck(device):
    from torch.library import opcheck

    g = keyed_generator("opcheck")
    cu = torch.tensor([0, 3, 3, 10])
    x = torch.randn(10, 4, generator=g).to(device).requires_grad_()
    w = torch.randn(4, 3, generator=g).to(device).requires_grad_()
    b = torch.randn(4, generator=g).to(device).requires_grad_()
    p = torch.randn(3, 2, 4, generator=g).to(device).requires_grad_()
    opcheck(torch.ops.packcuda.causal_conv1d_fwd.default, (x, w, b, cu, p, "silu"))
    opcheck(torch.ops.packcuda.causal_conv1d_fwd.default, (x, w, None, None, None, None))
    dy = torch.randn(10, 4, generator=g).to(device)
    opcheck(torch.ops.packcuda.causal_conv1d_bwd.default, (dy, x.detach(), w.detach(), b.detach(), cu,
                                                           p.detach(), "silu"))
    a, bb = torch.randn(5, 4).to(device), torch.randn(3, 4).to(device)
    idx = torch.tensor([[0, 7], [-1, -1], [5, 2]], device=device)
    opcheck(torch.ops.packcuda.exchange_gather_sum.default, (a, bb, idx))


def test_compile_fullgraph(device):
    g = keyed_generator("compile")
    x = torch.randn(20, 8, generator=g).to(device).requires_grad_()
    w = torch.randn(8, 4, generator=g).to(device).requires_grad_()
    p = torch.randn(3, 3, 8, generator=g).to(device).requires_grad_()
    cu = torch.tensor([0, 5, 6, 20])

    def f(x, w, p):
        return packcuda.causal_conv1d(x * 2, w, None, cu_seqlens=cu, prefix=p, activation="silu").sin()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    y1, y2 = f(x, w, p), cf(x, w, p)
    assert torch.allclose(y1, y2, atol=1e-6)
    g1 = torch.autograd.grad(y1.sum(), (x, w, p))
    g2 = torch.autograd.grad(y2.sum(), (x, w, p))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)


def test_gather_sum_matches_reference(device):
    g = keyed_generator("gsum")
    for dtype in [torch.float32, torch.bfloat16]:
        a = torch.randn(6, 5, generator=g).to(dtype)
        b = torch.randn(4, 5, generator=g).to(dtype)
        idx = torch.tensor([[0, 9, -1], [-1, -1, -1], [6, 6, 2], [3, -1, 1]])
        got = torch.ops.packcuda.exchange_gather_sum(a.to(device), b.to(device), idx.to(device)).cpu()
        both = torch.cat([a, b]).float()
        want = torch.stack([sum((both[i] for i in row if i >= 0), torch.zeros(5)) for row in idx.tolist()])
        assert torch.allclose(got.float(), want.to(dtype).float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


# ------------------------------------------------------------------------------------ bad input
def test_bad_causal_conv1d():
    x = torch.randn(10, 4)
    w = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"causal_conv1d: weight must be \[C, K\] with C = 4"):
        packcuda.causal_conv1d(x, torch.randn(5, 3))
    with pytest.raises(ValueError, match=r"kernel size K = weight.size\(1\) must be in \[1, 8\], got 9"):
        packcuda.causal_conv1d(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="weight has dtype float64 but x has dtype float32"):
        packcuda.causal_conv1d(x, w.double())
    with pytest.raises(ValueError, match=r"bias must be \[C\] with C = 4, got \[3\]"):
        packcuda.causal_conv1d(x, w, torch.randn(3))
    with pytest.raises(ValueError, match=r"prefix must be \[S, K-1, C\] = \[2, 2, 4\], got \[2, 3, 4\]"):
        packcuda.causal_conv1d(x, w, cu_seqlens=[0, 4, 10], prefix=torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=9 does not match the number of tokens \(10\)"):
        packcuda.causal_conv1d(x, w, cu_seqlens=[0, 4, 9])
    with pytest.raises(ValueError, match="non-decreasing"):
        packcuda.causal_conv1d(x, w, cu_seqlens=[0, 6, 4, 10])
    with pytest.raises(ValueError, match="activation must be None or 'silu', got 'relu'"):
        packcuda.causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match="x must have dtype in"):
        packcuda.causal_conv1d(x.int(), w.int())
    with pytest.raises(ValueError, match="x must be 2-D"):
        packcuda.causal_conv1d(x[None], w)
    with pytest.raises(ValueError, match=r"index\[0\]=10 is out of range"):
        torch.ops.packcuda.exchange_gather_sum(x, x[:0], torch.tensor([[10]]))


@requires_cuda
def test_cuda_device_mismatch():
    x = torch.randn(10, 4, device="cuda")
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        packcuda.causal_conv1d(x, torch.randn(4, 3))


# ------------------------------------------------------------------------------------ no syncs
@requires_cuda
def test_causal_conv1d_host_metadata_does_not_sync():
    cu = cumulative([1000, 3, 0, 999, 1])
    x = torch.randn(cu[-1], 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.randn(5, 3, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation="silu").sum().backward()  # warm-up
    with no_sync():
        y = packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation="silu")
        y.backward(torch.ones_like(y))
    torch.cuda.synchronize()


@requires_cuda
def test_causal_conv1d_graph_capture_host_metadata():
    # Host cu_seqlens are part of the captured launches (kernel parameters or an uploaded copy): replays with new
    # data give eager's results, forward and backward.
    g = keyed_generator("graph-host")
    for lens in ([300, 2, 0, 511, 1], [3] * 600):
        cu = cumulative(lens)
        T, C = cu[-1], 264
        x, dy = (torch.randn(T, C, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        w = torch.randn(C, 4, generator=g).to("cuda", torch.bfloat16)
        b = torch.randn(C, generator=g).to("cuda", torch.bfloat16)
        p = torch.randn(len(lens), 3, C, generator=g).to("cuda", torch.bfloat16)
        cu_t = torch.tensor(cu)

        def step():
            return (packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation="silu"),
                    *torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, cu_t, p, "silu"))

        graph, outs = capture_cuda_graph(step)
        for _ in range(2):
            x.copy_(torch.randn(T, C, generator=g).to("cuda", torch.bfloat16))
            dy.copy_(torch.randn(T, C, generator=g).to("cuda", torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            for a, b_ in zip(outs, step()):
                assert torch.equal(a, b_)
