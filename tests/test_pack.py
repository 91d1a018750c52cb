import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, no_sync, requires_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.bool]


def _rand(shape, dtype, g=None):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _mask(B, S, g, kind):
    if kind == "random":
        return torch.rand(B, S, generator=g) > 0.4
    lens = torch.randint(0, S + 1, (B,), generator=g)
    ar = torch.arange(S)[None]
    m = ar < lens[:, None]
    return m.flip(1) if kind == "left" else m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trailing", [(), (3,), (8, 16), (5, 7)])
@pytest.mark.parametrize("kind", ["right", "left", "random"])
def test_unpad_pad_matches_reference(device, dtype, trailing, kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype, trailing, kind)).encode()))
    B, S = 5, 37
    x = _rand((B, S, *trailing), dtype, g)
    m = _mask(B, S, g, kind)
    want = ref.unpad(x, m)
    got = packcuda.unpad(x.to(device), m.to(device))
    assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got[1].cpu(), want[1])
    assert got[2].dtype == torch.int32 and torch.equal(got[2].cpu(), want[2])
    assert got[3] == want[3] and isinstance(got[3], int)
    back = packcuda.pad(got[0], got[1], B, S)
    assert torch.equal(back.cpu(), ref.pad(want[0], want[1], B, S))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
def test_unpad_lengths_equals_mask(device, dtype):
    g = torch.Generator().manual_seed(1)
    B, S = 6, 50
    lens = [0, 50, 13, 1, 49, 7]
    x = _rand((B, S, 4), dtype, g).to(device)
    m = (torch.arange(S)[None] < torch.tensor(lens)[:, None]).to(device)
    a = packcuda.unpad(x, m)
    b = packcuda.unpad(x, lengths=lens)
    for u, v in zip(a[:3], b[:3]):
        assert torch.equal(u, v)
    assert a[3] == b[3] == 50


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    ignore=st.integers(-1000, -1),
    wide=st.booleans(),
)
def test_positions_and_labels_hypothesis(lens, ignore, wide):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    ids = torch.randint(0, 50000, (cu[-1],), dtype=torch.int64 if wide else torch.int32)
    for device in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        pos = packcuda.position_ids(cu, device=device)
        assert torch.equal(pos.cpu(), ref.position_ids(cu))
        lab = packcuda.next_token_labels(ids.to(device), cu, ignore)
        assert lab.dtype == ids.dtype
        assert torch.equal(lab.cpu(), ref.next_token_labels(ids, cu, ignore))
        # device cu_seqlens give the same result
        cu_dev = torch.tensor(cu, dtype=torch.int32, device=device)
        assert torch.equal(packcuda.next_token_labels(ids.to(device), cu_dev, ignore).cpu(), lab.cpu())
        assert torch.equal(packcuda.position_ids(cu_dev).cpu(), pos.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", [0.0, -100.0, 1.0])
def test_gather_rows_fill(device, dtype, fill):
    if dtype == torch.bool and fill not in (0.0, 1.0):
        pytest.skip("bool holds only 0 and 1 (other fills are refused: see catalogue_pack.py)")
    g = torch.Generator().manual_seed(3)
    src = _rand((20, 6), dtype, g)
    index = torch.tensor([3, -1, 0, 19, -1, 7], dtype=torch.int64)
    got = packcuda.gather_rows(src.to(device), index.to(device), fill)
    assert torch.equal(got.cpu(), ref.gather_rows(src, index, fill))


def test_gather_rows_unaligned_rows(device):
    # rows of 3 bytes and a source that starts at an odd byte offset: the kernel falls back to narrow loads
    base = torch.randint(0, 255, (1 + 50 * 3,), dtype=torch.uint8)
    src = base[1:].view(50, 3)
    index = torch.randperm(50)[:20]
    got = packcuda.gather_rows(src.to(device), index.to(device))
    assert torch.equal(got.cpu(), src[index])


@pytest.mark.parametrize("dtype", [torch.float64])
def test_unpad_pad_gradcheck(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 2, dtype=dtype, generator=g, requires_grad=True)
    m = _mask(3, 7, g, "random")

    def f(x):
        xp, idx, cu, _ = packcuda.unpad(x, m)
        return packcuda.pad(xp * 2, idx, 3, 7)

    torch.autograd.gradcheck(f, (x,))
    xp = torch.randn(int(m.sum()), 2, dtype=dtype, requires_grad=True)
    idx = packcuda.unpad(x.detach(), m)[1]
    torch.autograd.gradcheck(lambda v: packcuda.pad(v, idx, 3, 7), (xp,))


def test_unpad_grad_matches_reference(device):
    x = torch.randn(4, 9, 8, device=device, requires_grad=True)
    m = (torch.rand(4, 9) > 0.3).to(device)
    xp, idx, _, _ = packcuda.unpad(x, m)
    w = torch.randn_like(xp)
    (xp * w).sum().backward()
    want = torch.zeros_like(x).view(36, 8)
    want[idx] = w
    assert torch.equal(x.grad.view(36, 8), want)


def test_opcheck(device):
    from torch.library import opcheck

    x = torch.randn(10, 4, device=device)
    idx = torch.tensor([2, -1, 9, 0], device=device)
    opcheck(torch.ops.packcuda.gather_rows.default, (x.requires_grad_(), idx, 0.0))
    opcheck(torch.ops.packcuda.scatter_rows.default, (torch.randn(4, 4, device=device).requires_grad_(), idx, 10))
    cu = torch.tensor([0, 3, 3, 10])
    opcheck(torch.ops.packcuda.segment_positions.default, (cu, 10, torch.device(device)))
    opcheck(torch.ops.packcuda.next_token_labels.default, (torch.arange(10, device=device), cu, -100))
    opcheck(torch.ops.packcuda.right_pad_indices.default, (cu, 7, 10, torch.device(device)))
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)
    opcheck(torch.ops.packcuda.mask_indices.default, (mask, torch.tensor([0, 2, 4]), 4))


def test_compile_fullgraph(device):
    x = torch.randn(3, 6, 4, device=device, requires_grad=True)
    idx = torch.tensor([0, 1, 2, 6, 7, 12], device=device)

    def f(x, idx):
        xp = packcuda.gather_rows(x.reshape(18, 4), idx)
        return packcuda.pad(xp.sin(), idx, 3, 6)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    y1, y2 = f(x, idx), cf(x, idx)
    assert torch.allclose(y1, y2)
    (g1,) = torch.autograd.grad(y1.sum(), x)
    (g2,) = torch.autograd.grad(y2.sum(), x)
    assert torch.allclose(g1, g2)


# ------------------------------------------------------------------------------------ bad input
def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0"):
        packcuda.position_ids([1, 3])
    with pytest.raises(ValueError, match="non-decreasing"):
        packcuda.position_ids([0, 5, 3])
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="does not match the number of tokens"):
        packcuda.next_token_labels(ids, [0, 4, 9])
    with pytest.raises(ValueError, match="dtype"):
        packcuda.next_token_labels(ids.float(), [0, 10])
    with pytest.raises(TypeError, match="integer"):
        packcuda.position_ids([0, 1.5])


def test_bad_gather_scatter():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"index\[1\]=5 is out of range"):
        packcuda.gather_rows(x, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="int64"):
        packcuda.gather_rows(x, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="appears twice"):
        packcuda.scatter_rows(x[:2], torch.tensor([1, 1]), 4)
    with pytest.raises(ValueError, match="index has 2 entries but src has 3 rows"):
        packcuda.scatter_rows(x[:3], torch.tensor([1, 2]), 4)


def test_bad_unpad():
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="exactly one"):
        packcuda.unpad(x)
    with pytest.raises(ValueError, match="shape"):
        packcuda.unpad(x, torch.ones(2, 5))
    with pytest.raises(ValueError, match="exceeds seqlen"):
        packcuda.unpad(x, lengths=[2, 5])
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        packcuda.unpad(x, lengths=[1, 1, 1])
    with pytest.raises(ValueError, match="negative"):
        packcuda.unpad(x, lengths=[1, -1])


@requires_cuda
def test_cuda_device_mismatch():
    x = torch.randn(5, 3, device="cuda")
    with pytest.raises(ValueError, match="is on cpu but src is on cuda"):
        packcuda.gather_rows(x, torch.tensor([0, 1]))


# ------------------------------------------------------------------------------------ no syncs
@requires_cuda
def test_host_metadata_paths_do_not_sync():
    B, S = 8, 1000
    lens = [1000, 3, 0, 999, 500, 1, 2, 700]
    x = torch.randn(B, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 1000, (sum(lens),), device="cuda")
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    packcuda.unpad(x, lengths=lens)  # warm-up (allocator, module load)
    with no_sync():
        xp, idx, cu_dev, mx = packcuda.unpad(x, lengths=lens)
        y = packcuda.pad(xp * 2, idx, B, S)
        y.sum().backward()
        pos = packcuda.position_ids(cu, device="cuda")
        lab = packcuda.next_token_labels(ids, cu)
        lab2 = packcuda.next_token_labels(ids, cu_dev)
    torch.cuda.synchronize()
    assert torch.equal(pos.cpu(), ref.position_ids(cu))
    assert torch.equal(lab.cpu(), ref.next_token_labels(ids.cpu(), cu))
    assert torch.equal(lab2, lab)


# ------------------------------------------------------------------------------------ rows along any dim
def _views(dtype, g, n):
    """(name, src, dim): contiguous and strided sources of n rows along dim."""
    base4 = _rand((4, 1, n), dtype, g)
    wide = _rand((2, 3, n, 5), dtype, g)
    t2 = _rand((n, 4), dtype, g)
    pad = _rand((3, n + 3, 2), dtype, g)
    return [
        ("[3, T] dim 1", _rand((3, n), dtype, g), 1),
        ("[3, T] dim -1", _rand((3, n), dtype, g), -1),
        ("[2, 3, T, 5] dim 2", wide, 2),
        ("[4, 1, T][:, 0] (strided lead, no copy)", base4[:, 0, :], 1),
        ("[T, 4].t() (needs a copy)", t2.t(), 1),
        ("expanded lead (stride 0)", _rand((1, n), dtype, g).expand(3, n), 1),
        ("lead stride not a multiple of the row", pad[:, 1:n + 1, :], 1),
        ("[T, 4] dim 0", t2, 0),
        ("[T, 2, 2][:, 1] dim 0 (strided rows, needs a copy)", _rand((n, 2, 2), dtype, g)[:, 1], 0),
    ]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_gather_scatter_rows_dim(device, dtype):
    g = torch.Generator().manual_seed(11)
    n = 37
    index = torch.tensor([5, -1, 0, 36, 12, -1, 7, 8, 9, 30, 2], dtype=torch.int64)
    perm = torch.randperm(n + 2, generator=g)[:n]
    perm[::5] = -1
    fill = 1.0 if dtype == torch.bool else 3.0  # bool holds only 0 and 1
    for name, src, dim in _views(dtype, g, n):
        got = packcuda.gather_rows(src.to(device), index.to(device), fill, dim=dim)
        want = ref.gather_rows_dim(src, index, fill, dim)
        assert got.shape == want.shape and got.is_contiguous(), name
        assert torch.equal(got.cpu(), want), name
        back = packcuda.scatter_rows(got, index.to(device), n, dim=dim)
        assert torch.equal(back.cpu(), ref.scatter_rows_dim(want, index, n, dim)), name
        # scatter straight from the (strided) source view
        got = packcuda.scatter_rows(src.to(device), perm.to(device), n + 2, dim=dim)
        assert torch.equal(got.cpu(), ref.scatter_rows_dim(src, perm, n + 2, dim)), name


@pytest.mark.parametrize("inner", [1, 2, 9, 16])
def test_rows_dim_vector_widths(device, inner):
    # rows of 8, 16, 72 and 128 bytes, a lead stride that breaks 16-byte alignment, and wide rows (> 64 bytes)
    # that take the invert-and-gather scatter path on CUDA
    g = torch.Generator().manual_seed(inner)
    n = 50
    base = torch.randint(0, 1 << 40, (3, n + 1, inner), generator=g)
    src = base[:, 1:]  # lead stride (n+1)*inner*8 bytes; first row offset by one row
    index = torch.randperm(n, generator=g)[:33]
    index[::7] = -1
    got = packcuda.gather_rows(src.to(device), index.to(device), -5, dim=1)
    assert torch.equal(got.cpu(), ref.gather_rows_dim(src, index, -5, 1))
    back = packcuda.scatter_rows(src[:, :33].to(device), index.to(device), n, dim=1)
    assert torch.equal(back.cpu(), ref.scatter_rows_dim(src[:, :33], index, n, 1))


def test_rows_dim_gradients(device):
    g = torch.Generator().manual_seed(2)
    index = torch.tensor([4, -1, 0, 2, 9], device=device)
    x = torch.randn(3, 10, 2, dtype=torch.float64, generator=g).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: packcuda.gather_rows(t, index, 1.0, dim=1), (x,))
    y = torch.randn(2, 5, dtype=torch.float64, generator=g).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: packcuda.scatter_rows(t, index, 12, dim=-1), (y,))
    # the backward is a scatter along the same dim: deterministic, bit-identical across runs
    w = torch.randn(3, 5, 2, dtype=torch.float64, generator=g).to(device)
    grads = [torch.autograd.grad((packcuda.gather_rows(x, index, 0.0, dim=1) * w).sum(), x)[0] for _ in range(2)]
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0].cpu(), ref.scatter_rows_dim(w.cpu(), index.cpu(), 10, 1))


def test_rows_dim_opcheck_and_compile(device):
    from torch.library import opcheck

    x = torch.randn(3, 10, 4, device=device)
    idx = torch.tensor([2, -1, 9, 0], device=device)
    opcheck(torch.ops.packcuda.gather_rows.default, (x.requires_grad_(), idx, 0.0, 1))
    opcheck(torch.ops.packcuda.scatter_rows.default, (torch.randn(3, 4, device=device).requires_grad_(), idx, 10, -1))

    def f(x):
        return packcuda.gather_rows(x.sin(), idx, 0.0, dim=1) * 2

    cf = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    x = torch.randn(3, 10, 4, device=device, requires_grad=True)
    y1, y2 = f(x), cf(x)
    assert torch.allclose(y1, y2)
    assert torch.allclose(torch.autograd.grad(y1.sum(), x)[0], torch.autograd.grad(y2.sum(), x)[0])


def test_bad_rows_dim():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="dim=2 is out of range for src of shape"):
        packcuda.gather_rows(x, torch.tensor([0]), dim=2)
    with pytest.raises(ValueError, match="dim=-3 is out of range"):
        packcuda.scatter_rows(x, torch.tensor([0, 1, 2]), 4, dim=-3)
    with pytest.raises(ValueError, match=r"index\[0\]=5 is out of range \[-1, 5\)"):
        packcuda.gather_rows(x, torch.tensor([5]), dim=1)
    with pytest.raises(ValueError, match="index has 2 entries but src has 5 rows along dim 1"):
        packcuda.scatter_rows(x, torch.tensor([0, 1]), 7, dim=1)
    with pytest.raises(ValueError, match="appears twice"):
        packcuda.scatter_rows(x, torch.tensor([0, 1, 1, 2, 3]), 7, dim=1)


# ------------------------------------------------------------------------------------ valid edge inputs
def _gather_ref(src, index, fill, dim):
    """Plain torch: rows along dim, -1 gives a row of fill."""
    d = dim % src.dim()
    moved = src.movedim(d, 0)
    out = torch.full((index.numel(), *moved.shape[1:]), fill, dtype=src.dtype)
    keep = index >= 0
    out[keep] = moved[index[keep]]
    return out.movedim(0, d)


def _scatter_ref(src, index, num_rows, dim):
    d = dim % src.dim()
    moved = src.movedim(d, 0)
    out = torch.zeros((num_rows, *moved.shape[1:]), dtype=src.dtype)
    keep = index >= 0
    out[index[keep]] = moved[keep]
    return out.movedim(0, d)


def _strided_empties():
    """Zero-size sources with non-default strides: (name, src, dim)."""
    return [
        ("[0, 2, 0].transpose(0, 2) dim -1", torch.empty(0, 2, 0).transpose(0, 2), -1),
        ("[1, 2, 1, 0].transpose(0, -1) dim -1", torch.empty(1, 2, 1, 0).transpose(0, -1), -1),
        ("[0, 2].t() dim 0", torch.empty(0, 2).t(), 0),
        ("[0, 2].t() dim 1", torch.empty(0, 2).t(), 1),
        ("[3, 0, 4] dim 1", torch.empty(3, 0, 4), 1),
        ("[3, 0, 4].transpose(0, 2) dim 1", torch.empty(3, 0, 4).transpose(0, 2), 1),
        ("[0, 5] dim 0 (zero lead)", torch.empty(0, 5), 1),
        ("[4, 0] dim 0 (zero row)", torch.empty(4, 0), 0),
        ("[2, 3, 0] dim -2 (zero trailing)", torch.empty(2, 3, 0), -2),
        ("expanded [0] -> [3, 0]", torch.empty(1, 0).expand(3, 0), 1),
        ("expanded zero rows", torch.empty(1, 0, 2).expand(4, 0, 2), 1),
        ("[0] 1-D", torch.empty(0), 0),
        ("[2, 0, 3][:, :, ::2]", torch.empty(2, 0, 3)[:, :, ::2], -1),
    ]


@pytest.mark.parametrize("case", range(len(_strided_empties())))
def test_rows_empty_any_strides_work(device, case):
    name, src, dim = _strided_empties()[case]
    n = src.shape[dim]
    for index in ([-1], [-1, -1, -1], [], list(range(n)) + [-1]):
        idx = torch.tensor(index, dtype=torch.int64)
        got = packcuda.gather_rows(src.to(device), idx.to(device), 2.0, dim=dim)
        want = _gather_ref(src, idx, 2.0, dim)
        assert got.shape == want.shape and torch.equal(got.cpu(), want), name
    m = src.shape[dim]
    idx = torch.full((m,), -1, dtype=torch.int64)
    if m:
        idx[0] = 2
    got = packcuda.scatter_rows(src.to(device), idx.to(device), 3, dim=dim)
    assert torch.equal(got.cpu(), _scatter_ref(src, idx, 3, dim)), name


def test_gather_fill_exact_values(device):
    src = torch.zeros(2, 3, dtype=torch.int64, device=device)
    idx = torch.tensor([-1, 0], device=device)
    for fill in (2**53 + 1, -(2**63), 2**63 - 1):
        got = packcuda.gather_rows(src, idx, fill)
        assert got[0].tolist() == [fill] * 3 and got[1].tolist() == [0] * 3
    i32 = torch.zeros(2, 1, dtype=torch.int32, device=device)
    assert packcuda.gather_rows(i32, idx[:1], -(2**31))[0, 0].item() == -(2**31)
    assert packcuda.gather_rows(i32, idx[:1], 7.0)[0, 0].item() == 7  # an integral float is exact
    b = torch.zeros(2, 1, dtype=torch.bool, device=device)
    assert packcuda.gather_rows(b, idx[:1], True)[0, 0].item() is True
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        f = torch.zeros(2, 2, dtype=dtype, device=device)
        assert torch.isnan(packcuda.gather_rows(f, idx[:1], float("nan"))).all()
        assert (packcuda.gather_rows(f, idx[:1], float("-inf")) == float("-inf")).all()
        assert packcuda.gather_rows(f, idx[:1], 3)[0, 0].item() == 3.0
    assert packcuda.gather_rows(torch.zeros(1, 1, dtype=torch.float64), torch.tensor([-1]), 1e300).item() == 1e300
    # 65519 rounds to 65504 (finite in float16): rounded, not refused
    assert packcuda.gather_rows(torch.zeros(1, 1, dtype=torch.float16), torch.tensor([-1]), 65519.0).item() == 65504


def test_ignore_index_extremes(device):
    cu = [0, 2, 3]
    ids32 = torch.tensor([5, 6, 7], dtype=torch.int32, device=device)
    for ig in (-(2**31), 2**31 - 1):
        assert packcuda.next_token_labels(ids32, cu, ig).tolist() == [6, ig, ig]
    ids64 = ids32.long()
    for ig in (2**53 + 1, -(2**63)):
        assert packcuda.next_token_labels(ids64, cu, ig).tolist() == [6, ig, ig]


def test_scatter_huge_num_rows_of_empty_rows():
    # rows of zero bytes: a huge output is still empty (and the repeat check does not allocate num_rows bytes)
    out = packcuda.scatter_rows(torch.empty(3, 0), torch.tensor([0, 2**50, -1]), 2**60)
    assert out.shape == (2**60, 0)


def test_pad_empty_and_zero_sizes(device):
    x = torch.empty(0, 4, device=device)
    idx = torch.empty(0, dtype=torch.int64, device=device)
    assert packcuda.pad(x, idx, 0, 5).shape == (0, 5, 4)
    assert torch.equal(packcuda.pad(x, idx, 2, 3).cpu(), torch.zeros(2, 3, 4))
    xp, ind, cu, mx = packcuda.unpad(torch.empty(0, 3, 2, device=device), lengths=[])
    assert xp.shape == (0, 2) and ind.numel() == 0 and cu.tolist() == [0] and mx == 0


def test_index_sharing_src_storage(device):
    # the index may be a view of the same storage as the data (both are only read)
    buf = torch.tensor([2, 0, 1, -1, 9, 8, 7], dtype=torch.int64, device=device)
    src, index = buf[:3], buf[:4]
    got = packcuda.gather_rows(src, index, -5)
    assert got.tolist() == [1, 2, 0, -5]


def test_meta_tensors_only_through_fake_kernels():
    # all-meta inputs to a raw op: its meta (fake) kernel gives the output's shape; mixing is refused
    ops = torch.ops.packcuda
    x = torch.empty(4, 3, device="meta")
    idx = torch.empty(2, dtype=torch.int64, device="meta")
    assert ops.gather_rows(x, idx, 0.0, 0).shape == (2, 3)
    assert ops.scatter_rows(x, torch.empty(4, dtype=torch.int64, device="meta"), 7, 0).shape == (7, 3)
    with pytest.raises(ValueError, match="packcuda.gather_rows: index is on cpu but src is on meta"):
        ops.gather_rows(x, torch.tensor([0]), 0.0, 0)


def test_fake_tensor_mode_keeps_working():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5, 2)
        idx = torch.empty(4, dtype=torch.int64)
        assert packcuda.gather_rows(x, idx, 0.0, dim=1).shape == (3, 4, 2)
        assert packcuda.scatter_rows(x, torch.empty(5, dtype=torch.int64), 9, dim=1).shape == (3, 9, 2)
        assert packcuda.next_token_labels(torch.empty(6, dtype=torch.int32), torch.tensor([0, 6])).shape == (6,)
        assert packcuda.pad(torch.empty(4, 2), idx, 2, 3).shape == (2, 3, 2)


def test_mask_indices_strided_mask():
    m = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool).t()  # [4, 2], not contiguous
    got = torch.ops.packcuda.mask_indices(m, torch.tensor([0, 1, 2, 4, 5]), 5)
    assert got.tolist() == [i for i, v in enumerate(m.flatten().tolist()) if v]


@requires_cuda
def test_indexless_cuda_device():
    cu = [0, 3, 5]
    cu_dev = torch.tensor(cu, device="cuda")
    want = ref.position_ids(cu)
    assert torch.equal(packcuda.position_ids(cu_dev, device="cuda").cpu(), want)
    assert torch.equal(packcuda.position_ids(cu, device="cuda").cpu(), want)
    assert torch.equal(packcuda.position_ids(cu_dev, device="cpu"), want)
    ops = torch.ops.packcuda
    assert torch.equal(ops.segment_positions(cu_dev, 5, torch.device("cuda")).cpu(), want)
    assert torch.equal(ops.right_pad_indices(cu_dev, 3, 5, torch.device("cuda")).cpu(),
                       torch.tensor([0, 1, 2, 3, 4]))


# ------------------------------------------------------------------------------------ hypothesis parity
@st.composite
def _row_case(draw):
    nd = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 4), min_size=nd, max_size=nd))
    dim = draw(st.integers(-nd, nd - 1))
    view = draw(st.sampled_from(["plain", "transpose", "expand", "slice"]))
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.int16, torch.bfloat16, torch.bool]))
    n = shape[dim]
    index = draw(st.lists(st.integers(-1, n - 1), max_size=6))
    perm = draw(st.permutations(list(range(n + 2))))[:n]
    perm = [p if draw(st.booleans()) else -1 for p in perm]
    return shape, dim, view, dtype, index, perm


def _make_view(shape, view, dtype, dim, seed):
    g = torch.Generator().manual_seed(seed)
    nd = len(shape)
    if view == "transpose" and nd >= 2:
        base = _rand(tuple(reversed(shape[:2])) + tuple(shape[2:]), dtype, g)
        return base.transpose(0, 1)
    if view == "expand" and nd >= 2 and dim % nd != 0:
        return _rand((1, *shape[1:]), dtype, g).expand(*shape)
    if view == "slice":
        return _rand((*shape[:-1], 2 * shape[-1]), dtype, g)[..., ::2]
    return _rand(tuple(shape), dtype, g)


@settings(max_examples=250, deadline=None)
@given(c=_row_case(), seed=st.integers(0, 2**16))
def test_gather_scatter_hypothesis(c, seed):
    shape, dim, view, dtype, index, perm = c
    src = _make_view(shape, view, dtype, dim, seed)
    fill = 1 if dtype == torch.bool else -3
    idx = torch.tensor(index, dtype=torch.int64)
    devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])
    for device in devices:
        got = packcuda.gather_rows(src.to(device), idx.to(device), fill, dim=dim)
        assert torch.equal(got.cpu(), _gather_ref(src, idx, fill, dim))
        p = torch.tensor(perm, dtype=torch.int64)
        got = packcuda.scatter_rows(src.to(device), p.to(device), len(perm) + 2, dim=dim)
        assert torch.equal(got.cpu(), _scatter_ref(src, p, len(perm) + 2, dim))


@settings(max_examples=120, deadline=None)
@given(lens=st.lists(st.integers(0, 6), min_size=0, max_size=5), S=st.integers(0, 7), seed=st.integers(0, 99),
       use_mask=st.booleans())
def test_unpad_pad_hypothesis(lens, S, seed, use_mask):
    lens = [min(n, S) for n in lens]
    B = len(lens)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, 2, generator=g)
    m = torch.arange(S)[None] < torch.tensor(lens, dtype=torch.int64).view(B, 1)
    if use_mask and B and S:
        m = torch.rand(B, S, generator=g) > 0.5
    xp, idx, cu, mx = packcuda.unpad(x, m) if use_mask else packcuda.unpad(x, lengths=lens)
    flat = m.reshape(-1)
    assert torch.equal(idx, torch.nonzero(flat).flatten())
    assert torch.equal(xp, x.reshape(B * S, 2)[flat])
    assert cu.tolist() == [0] + torch.cumsum(m.sum(1), 0).tolist()
    assert mx == (int(m.sum(1).max()) if B else 0)
    assert torch.equal(packcuda.pad(xp, idx, B, S), x * m[..., None])
