import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, assert_close_ulp, keyed_generator, no_sync, requires_cuda, ulp

FLOATS = [torch.bfloat16, torch.float16, torch.float32]

# (name, head_dim, rotary_dim, mrope_section, interleaved)
LAYOUTS = [
    ("plain", 32, 32, None, False),
    ("plain-partial", 48, 16, None, False),
    ("sectioned", 32, 32, [4, 6, 6], False),
    ("interleaved", 32, 32, [6, 5, 5], False),
    ("interleaved-partial", 64, 16, [3, 3, 2], True),
]
LAYOUTS[3] = ("interleaved", 32, 32, [6, 5, 5], True)


def _positions(T, mrope, g, packed=True, big=False):
    """Positions that restart per packed sequence; mRoPE rows differ inside 'images'."""
    hi = 1 << 20 if big else 4096
    if not mrope:
        return torch.randint(0, hi, (T,), generator=g)
    pos = torch.randint(0, hi, (3, T), generator=g)
    pos[:, : T // 3] = torch.arange(T // 3)[None]  # a text run: t = h = w
    return pos


def _inv(theta, rd):
    return ref.rope_inv_freq(theta, rd)


# ------------------------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_matches_reference(device, dtype, layout, style):
    name, D, rd, section, inter = layout
    g = keyed_generator(dtype, name, style)
    T, Hq, Hk = 37, 3, 2
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k = torch.randn(T, Hk, D, generator=g).to(dtype)
    pos = _positions(T, section is not None, g, big=True)
    inv = _inv(1e6, rd)
    kw = dict(rotary_dim=rd, mrope_section=section, mrope_interleaved=inter, rotary_style=style)
    qo, ko = packcuda.apply_rope(q.to(device), k.to(device), pos.to(device), inv_freq=inv.to(device), **kw)
    wq, wk = ref.apply_rope(q, k, pos, inv, rd, section, inter, style)
    assert qo.dtype == dtype and qo.shape == q.shape and ko.shape == k.shape
    assert_close_ulp(qo, wq, dtype, 4.0)
    assert_close_ulp(ko, wk, dtype, 4.0)
    # passthrough channels are bit-identical copies
    assert torch.equal(qo[..., rd:].cpu(), q[..., rd:]) and torch.equal(ko[..., rd:].cpu(), k[..., rd:])
    # in place gives the same bits
    q2, k2 = q.clone().to(device), k.clone().to(device)
    r = packcuda.apply_rope_(q2, k2, pos.to(device), inv_freq=inv.to(device), **kw)
    assert r[0] is q2 and r[1] is k2
    assert torch.equal(q2, qo) and torch.equal(k2, ko)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaling_inverse_and_default_inv_freq(device, dtype):
    g = keyed_generator("scale", dtype)
    T, D = 21, 16
    q = torch.randn(T, 2, D, generator=g).to(dtype)
    k = torch.randn(T, 1, D, generator=g).to(dtype)
    pos = torch.randint(0, 500, (T,), generator=g)
    qo, ko = packcuda.apply_rope(q.to(device), k.to(device), pos, rope_theta=10000.0, attention_scaling=0.7)
    wq, wk = ref.apply_rope(q, k, pos, _inv(10000.0, D), attention_scaling=0.7)
    assert_close_ulp(qo, wq, dtype, 4.0)
    assert_close_ulp(ko, wk, dtype, 4.0)
    # the raw op's inverse flag undoes the rotation (fp32: up to rounding)
    if dtype == torch.float32:
        inv = _inv(10000.0, D).to(device)
        bq, bk = torch.ops.packcuda.apply_rope(qo, ko, pos.to(device), inv, D, [], False, False, 1.0 / 0.7,
                                               True)
        assert torch.allclose(bq.cpu(), q, atol=1e-5) and torch.allclose(bk.cpu(), k, atol=1e-5)
    assert torch.equal(packcuda.default_inv_freq(10000.0, D), _inv(10000.0, D))


def test_int32_positions_and_4d_layout(device):
    g = keyed_generator("4d")
    B, S, H, D = 2, 9, 3, 32
    section = [4, 6, 6]
    # HF attention layout [B, H, S, D]; the token-major view [B, S, H, D] is a transpose (no copy)
    q_hf = torch.randn(B, H, S, D, generator=g).to(device)
    k_hf = torch.randn(B, 1, S, D, generator=g).to(device)
    pos = torch.randint(0, 1000, (3, B, S), generator=g, dtype=torch.int32)
    qo, ko = packcuda.apply_rope(q_hf.transpose(1, 2), k_hf.transpose(1, 2), pos.to(device), rope_theta=1e6,
                                 mrope_section=section)
    assert qo.shape == (B, S, H, D)
    wq, wk = ref.apply_rope(q_hf.transpose(1, 2).cpu(), k_hf.transpose(1, 2).cpu(), pos.long(), _inv(1e6, D), D,
                            section)
    assert_close_ulp(qo, wq, torch.float32, 4.0)
    assert_close_ulp(ko, wk, torch.float32, 4.0)
    # flat [3, B*S] positions give the same result; an expanded (stride 0) batch dim works too
    qf, _ = packcuda.apply_rope(q_hf.transpose(1, 2), k_hf.transpose(1, 2), pos.reshape(3, -1).to(device),
                                rope_theta=1e6, mrope_section=section)
    assert torch.equal(qf, qo)
    pe = pos[:, :1].expand(3, B, S)
    qe, _ = packcuda.apply_rope(q_hf.transpose(1, 2), k_hf.transpose(1, 2), pe.to(device), rope_theta=1e6,
                                mrope_section=section)
    we, _ = ref.apply_rope(q_hf.transpose(1, 2).cpu(), k_hf.transpose(1, 2).cpu(), pe.contiguous().long(),
                           _inv(1e6, D), D, section)
    assert_close_ulp(qe, we, torch.float32, 4.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rd", [128, 32])
def test_fused_qkv_views_in_place_touch_nothing_else(device, dtype, rd):
    g = keyed_generator("qkv", dtype, rd)
    T, Hq, Hk, D = 19, 4, 2, 128
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype).to(device)
    before = qkv.clone()
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hk) * D].view(T, Hk, D)
    pos = torch.randint(0, 30000, (3, T), generator=g)
    kw = dict(rope_theta=5e6, rotary_dim=rd, mrope_section=[rd // 8, rd // 8 + rd // 16, rd // 2 - rd // 4 - rd // 16],
              mrope_interleaved=True)
    qo, ko = packcuda.apply_rope(q, k, pos.to(device), **kw)  # out of place on the strided views
    assert torch.equal(qkv, before)
    wq, wk = ref.apply_rope(q.cpu(), k.cpu(), pos, _inv(5e6, rd), rd, kw["mrope_section"], True)
    assert_close_ulp(qo, wq, dtype, 4.0)
    assert_close_ulp(ko, wk, dtype, 4.0)
    packcuda.apply_rope_(q, k, pos, **kw)  # host positions
    assert torch.equal(q, qo) and torch.equal(k, ko)
    # every byte outside the rotated channels of q and k is unchanged
    touched = torch.zeros(T, Hq + 2 * Hk, D, dtype=torch.bool)
    touched[:, : Hq + Hk, :rd] = True
    after = qkv.view(T, Hq + 2 * Hk, D).cpu()
    b = before.view(T, Hq + 2 * Hk, D).cpu()
    assert torch.equal(after[~touched], b[~touched])


@settings(max_examples=100, deadline=None)
@given(
    T=st.integers(0, 40),
    Hq=st.integers(0, 5),
    Hk=st.integers(1, 3),
    half=st.integers(1, 12),
    extra=st.integers(0, 9),
    gap=st.integers(0, 3),
    style=st.sampled_from(["neox", "gptj"]),
    kind=st.sampled_from(["plain", "sectioned", "interleaved"]),
    dtype=st.sampled_from(FLOATS),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_strides(T, Hq, Hk, half, extra, gap, style, kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rd, D = 2 * half, 2 * half + extra
    # odd paddings between heads and tokens defeat vector loads: the kernels must fall back correctly
    qb = torch.randn(T, Hq, D + gap, generator=g).to(dtype)
    kb = torch.randn(T, Hk, D + 2 * gap, generator=g).to(dtype)
    q, k = qb[..., :D], kb[..., gap: gap + D]
    section = None
    if kind != "plain":
        a = int(torch.randint(0, half + 1, (1,), generator=g))
        b = int(torch.randint(0, half - a + 1, (1,), generator=g))
        section = [a, b, half - a - b]
    pos = _positions(T, section is not None, g, big=True)
    inv = _inv(1e4, rd)
    wq, wk = ref.apply_rope(q, k, pos, inv, rd, section, kind == "interleaved", style)
    for device in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        kw = dict(inv_freq=inv, rotary_dim=rd, mrope_section=section, mrope_interleaved=kind == "interleaved",
                  rotary_style=style)
        qo, ko = packcuda.apply_rope(q.to(device), k.to(device), pos, **kw)
        assert_close_ulp(qo, wq, dtype, 4.0)
        assert_close_ulp(ko, wk, dtype, 4.0)
        qd, kd = qb.clone().to(device), kb.clone().to(device)
        packcuda.apply_rope_(qd[..., :D], kd[..., gap: gap + D], pos, **kw)
        assert torch.equal(qd[..., :D], qo) and torch.equal(kd[..., gap: gap + D], ko)
        assert torch.equal(qd[..., rd:].cpu(), qb[..., rd:]) and torch.equal(kd[..., :gap].cpu(), kb[..., :gap])


# ------------------------------------------------------------------------------------ autograd, ops, compile
@pytest.mark.parametrize("kind", ["plain", "sectioned", "interleaved"])
def test_gradcheck_fp64(kind):
    g = keyed_generator("gc", kind)
    T, D, rd = 6, 12, 8
    section = None if kind == "plain" else [1, 2, 1]
    pos = _positions(T, section is not None, g)
    kw = dict(rope_theta=100.0, rotary_dim=rd, mrope_section=section, mrope_interleaved=kind == "interleaved",
              attention_scaling=1.3)
    q = torch.randn(T, 2, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(T, 1, D, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: packcuda.apply_rope(a, b, pos, **kw), (q, k))
    torch.autograd.gradgradcheck(lambda a, b: packcuda.apply_rope(a, b, pos, **kw), (q, k))
    torch.autograd.gradcheck(lambda a, b: packcuda.apply_rope_(a * 1, b * 1, pos, rotary_style="gptj", **kw),
                             (q, k))
    # the fp64 kernel agrees with the fp64 reference to rounding
    wq, _ = ref.apply_rope(q.detach(), k.detach(), pos, _inv(100.0, rd), rd, section, kind == "interleaved",
                           attention_scaling=1.3)
    assert torch.allclose(packcuda.apply_rope(q, k, pos, **kw)[0], wq, atol=1e-12, rtol=0)


def test_inplace_grad_equals_out_of_place(device):
    g = keyed_generator("ipgrad")
    T, D = 11, 32
    x = torch.randn(T, 6 * D, generator=g).to(device).requires_grad_()
    pos = torch.randint(0, 100, (3, T), generator=g).to(device)
    kw = dict(rope_theta=1e6, mrope_section=[4, 6, 6])
    w = torch.randn(T, 6 * D, generator=g).to(device)

    def run(inplace):
        qkv = x * 2  # non-leaf buffer, like a fused projection output
        q, k = qkv[:, : 3 * D].view(T, 3, D), qkv[:, 3 * D: 4 * D].view(T, 1, D)
        if inplace:
            packcuda.apply_rope_(q, k, pos, **kw)
            y = qkv
        else:
            qo, ko = packcuda.apply_rope(q, k, pos, **kw)
            y = torch.cat([qo.reshape(T, -1), ko.reshape(T, -1), qkv[:, 4 * D:]], 1)
        (gx,) = torch.autograd.grad((y * w).sum(), x)
        return y.detach(), gx

    y1, g1 = run(True)
    y2, g2 = run(False)
    assert torch.equal(y1, y2)
    assert torch.allclose(g1, g2, atol=1e-6)


def test_opcheck(device):
    from torch.library import opcheck

    g = keyed_generator("opcheck")
    q = torch.randn(7, 2, 16, generator=g).to(device)
    k = torch.randn(7, 1, 16, generator=g).to(device)
    pos = torch.randint(0, 50, (3, 7), generator=g).to(device)
    inv = _inv(1e4, 16).to(device)
    op = torch.ops.packcuda
    opcheck(op.apply_rope.default, (q.requires_grad_(), k.requires_grad_(), pos, inv, 16, [2, 3, 3], True, False,
                                    1.0, False))
    opcheck(op.apply_rope.default, (q, k, pos[0], inv[:4], 8, [], False, True, 0.5, True))
    opcheck(op.apply_rope_.default, (q.detach().clone(), k.detach().clone(), pos, inv, 16, [2, 3, 3], False, False,
                                     1.0, False))


def test_compile_fullgraph(device):
    g = keyed_generator("compile")
    T, D = 13, 32
    q = torch.randn(T, 4, D, generator=g).to(device).requires_grad_()
    k = torch.randn(T, 2, D, generator=g).to(device).requires_grad_()
    pos = torch.randint(0, 1000, (3, T), generator=g).to(device)
    inv = _inv(5e6, D).to(device)
    kw = dict(inv_freq=inv, mrope_section=[6, 5, 5], mrope_interleaved=True)

    def f(q, k, pos):
        qo, ko = packcuda.apply_rope(q * 1.5, k, pos, **kw)
        return (qo.sum(-1) + 1).sin(), ko

    backend = "aot_eager" if device == "cpu" else "inductor"
    cf = torch.compile(f, fullgraph=True, backend=backend)
    a, b = f(q, k, pos), cf(q, k, pos)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.equal(a[1], b[1])
    g1 = torch.autograd.grad(a[0].sum() + a[1].sum(), (q, k))
    g2 = torch.autograd.grad(b[0].sum() + b[1].sum(), (q, k))
    assert all(torch.allclose(u, v, atol=1e-5) for u, v in zip(g1, g2))

    # the in-place op under compile (no grad)
    def h(q, k, pos):
        q2, k2 = q.clone(), k.clone()
        packcuda.apply_rope_(q2, k2, pos, **kw)
        return q2, k2

    with torch.no_grad():
        ch = torch.compile(h, fullgraph=True, backend=backend)
        r1, r2 = h(q, k, pos), ch(q, k, pos)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])


def test_meta_devices_facade_agrees_with_op():
    """One device rule, checked once (the fake kernels): meta q/k go with host (CPU) positions / inv_freq, as CUDA
    q/k do, and give meta results; a meta tensor among real q/k is refused naming it - the same through the
    facade as through the raw op."""
    op = torch.ops.packcuda
    q, k, pos, inv = torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.arange(5), _inv(1e4, 8)
    w = torch.ones(8)
    meta = lambda *xs: [x.to("meta") for x in xs]  # noqa: E731
    for args in [(*meta(q, k), pos, inv), (*meta(q, k, pos), inv), (*meta(q, k), pos, *meta(inv)),
                 meta(q, k, pos, inv)]:
        raw = op.apply_rope(*args, 8, [])
        out = packcuda.apply_rope(*args[:3], inv_freq=args[3])
        assert all(t.is_meta for t in (*raw, *out)) and out[0].shape == q.shape
        qn = packcuda.apply_qk_norm_rope(*args[:3], inv_freq=args[3], q_weight=w.to("meta"), k_weight=w.to("meta"))
        assert all(t.is_meta for t in qn)
    assert packcuda.apply_rope(*meta(q, k), pos.tolist(), rope_theta=1e4)[0].is_meta
    for i, name in enumerate(("k", "positions", "inv_freq")):
        args = [q, k, pos, inv]
        args[1 + i] = args[1 + i].to("meta")
        for call in (lambda: op.apply_rope(*args, 8, []), lambda: packcuda.apply_rope(*args[:3], inv_freq=args[3])):
            with pytest.raises(ValueError, match=f"packcuda.apply_rope: {name} is on meta but q is on cpu"):
                call()
    for call in (lambda: op.apply_qk_norm_rope(q, k, pos, inv, w.to("meta"), w, 1e-6, "rms", 8, []),
                 lambda: packcuda.apply_qk_norm_rope(q, k, pos, inv_freq=inv, q_weight=w.to("meta"), k_weight=w)):
        with pytest.raises(ValueError, match="packcuda.apply_qk_norm_rope: q_weight is on meta but q is on cpu"):
            call()


# ------------------------------------------------------------------------------------ bad input
def test_bad_inputs():
    q = torch.randn(5, 2, 16)
    k = torch.randn(5, 1, 16)
    pos = torch.arange(5)
    pos3 = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 2\] sums to 7 but rotary_dim / 2 = 8"):
        packcuda.apply_rope(q, k, pos3, rope_theta=1e4, mrope_section=[2, 3, 2])
    with pytest.raises(ValueError, match="rotary_dim must be a positive even number, got 7"):
        packcuda.apply_rope(q, k, pos, rope_theta=1e4, rotary_dim=7)
    with pytest.raises(ValueError, match=r"rotary_dim \(18\) must be <= head_dim \(16\)"):
        packcuda.apply_rope(q, k, pos, rope_theta=1e4, rotary_dim=18)
    with pytest.raises(ValueError, match=r"positions must be \[3, T\]"):
        packcuda.apply_rope(q, k, pos, rope_theta=1e4, mrope_section=[2, 3, 3])
    with pytest.raises(ValueError,
                       match=r"positions of shape \[3, 5\] hold mRoPE rows \(t, h, w\): give mrope_section"):
        packcuda.apply_rope(q, k, pos3, rope_theta=1e4)
    with pytest.raises(ValueError, match=r"positions must be \[T\] or \[1, T\] \(plain RoPE\)"):
        packcuda.apply_rope(q, k, pos3[None], rope_theta=1e4)
    with pytest.raises(ValueError, match="positions must have 3 rows"):
        packcuda.apply_rope(q, k, pos3[:2], rope_theta=1e4, mrope_section=[2, 3, 3])
    with pytest.raises(ValueError, match="positions has 4 tokens but q has 5"):
        packcuda.apply_rope(q, k, pos[:4], rope_theta=1e4)
    with pytest.raises(TypeError, match=r"positions must hold integers, got torch.float32"):
        packcuda.apply_rope(q, k, pos.float().tolist(), rope_theta=1e4)
    with pytest.raises(ValueError, match=r"packcuda.apply_rope: positions must have dtype in \{int32, int64\}"):
        packcuda.apply_rope(q, k, pos.float(), rope_theta=1e4)
    with pytest.raises(ValueError, match=r"positions must have dtype in \{int32, int64\}, got float32"):
        torch.ops.packcuda.apply_rope(q, k, pos.float(), torch.ones(8), 16, [], False, False, 1.0, False)
    with pytest.raises(ValueError, match="q and k must have the same tokens"):
        packcuda.apply_rope(q, k[:4], pos, rope_theta=1e4)
    with pytest.raises(ValueError, match="k has dtype bfloat16 but q has dtype float32"):
        packcuda.apply_rope(q, k.bfloat16(), pos, rope_theta=1e4)
    with pytest.raises(ValueError, match="q must be contiguous in its last dim"):
        packcuda.apply_rope(torch.randn(5, 2, 32)[..., ::2], k, pos, rope_theta=1e4)
    with pytest.raises(ValueError, match="k must be contiguous in its last dim"):
        packcuda.apply_rope(q, torch.randn(5, 1, 32)[..., ::2], pos, rope_theta=1e4)
    with pytest.raises(ValueError, match="same head_dim"):
        packcuda.apply_rope(q, torch.randn(5, 1, 8), pos, rope_theta=1e4)
    with pytest.raises(ValueError, match=r"q must have dtype in \{bfloat16, float16, float32, float64\}, got int64"):
        packcuda.apply_rope(q.long(), k.long(), pos, rope_theta=1e4)
    with pytest.raises(ValueError, match="inv_freq must have rotary_dim / 2 = 8 entries, got 4"):
        packcuda.apply_rope(q, k, pos, inv_freq=torch.ones(4), rotary_dim=16)
    with pytest.raises(ValueError, match="inv_freq must have dtype"):
        packcuda.apply_rope(q, k, pos, inv_freq=torch.ones(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="mrope_section must have 3 entries"):
        packcuda.apply_rope(q, k, pos3, rope_theta=1e4, mrope_section=[4, 4])
    with pytest.raises(ValueError, match="mrope_interleaved needs an mrope_section"):
        packcuda.apply_rope(q, k, pos, rope_theta=1e4, mrope_interleaved=True)
    with pytest.raises(ValueError, match="rotary_style must be 'neox' or 'gptj'"):
        packcuda.apply_rope(q, k, pos, rope_theta=1e4, rotary_style="half")
    with pytest.raises(ValueError, match="give rope_theta or inv_freq"):
        packcuda.apply_rope(q, k, pos)
    with pytest.raises(ValueError, match="q and k overlap in memory"):
        packcuda.apply_rope_(q, q, pos, rope_theta=1e4)
    with pytest.raises(ValueError, match=r"q must be \[T, Hq, D\] or \[B, S, Hq, D\]"):
        torch.ops.packcuda.apply_rope(q[0], k[0], pos, torch.ones(8), 16, [], False, False, 1.0, False)
    # nothing was written by a rejected in-place call
    q0 = q.clone()
    with pytest.raises(ValueError):
        packcuda.apply_rope_(q, k, pos[:3], rope_theta=1e4)
    assert torch.equal(q, q0)


# ------------------------------------------------------------------------------------ GPU only
@requires_cuda
def test_cuda_host_metadata_no_sync_and_deterministic():
    g = keyed_generator("nosync")
    T, D = 1000, 128
    q = torch.randn(T, 8, D, generator=g).bfloat16().cuda()
    k = torch.randn(T, 2, D, generator=g).bfloat16().cuda()
    pos_host = torch.randint(0, 100000, (3, T), generator=g)
    pos_dev = pos_host.cuda()
    kw = dict(rope_theta=1e6, mrope_section=[16, 24, 24])
    packcuda.apply_rope(q, k, pos_dev, **kw)  # warm the inv_freq cache
    with no_sync():
        a = packcuda.apply_rope(q, k, pos_host, **kw)  # host positions: uploaded without a sync
        b = packcuda.apply_rope(q, k, pos_dev, **kw)
        q2, k2 = q.clone(), k.clone()
        packcuda.apply_rope_(q2, k2, pos_dev, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(q2, a[0])
    c = packcuda.apply_rope(q, k, pos_dev, **kw)
    assert torch.equal(c[0], a[0]) and torch.equal(c[1], a[1])
    # same bits as the CPU kernel up to 1 ulp (sin/cos of the two libraries may differ in the last fp32 bit)
    cq, _ = packcuda.apply_rope(q.cpu(), k.cpu(), pos_host, **kw)
    # (plus fp32-level slack where the rotation cancels to almost zero)
    tol = ulp(cq.double(), torch.bfloat16) + 1e-6 * float(q.float().abs().max())
    assert ((a[0].double().cpu() - cq.double()).abs() <= tol).all()


@requires_cuda
def test_cuda_graph_capture():
    T, D = 256, 64
    q = torch.randn(T, 4, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 2, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 5000, (3, T), device="cuda")
    inv = packcuda.default_inv_freq(1e6, D).cuda()
    kw = dict(inv_freq=inv, mrope_section=[8, 12, 12])
    want = packcuda.apply_rope(q, k, pos, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        packcuda.apply_rope(q, k, pos, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = packcuda.apply_rope(q, k, pos, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_wide_heads_and_tiles(dtype, inplace):
    """The CUDA walk over (token, head, chunk) items: very wide heads (more 16-byte chunks per head than a
    block has threads, the largest cos/sin table), partial rotary (the copied channels), head counts that do
    not divide the block, tiles cut short at the end; against the fp64 reference."""
    g = keyed_generator("wide", str(dtype), inplace)
    for T, Hq, Hk, D, rd, section in [(3, 1, 1, 8192, 8192, None), (5, 2, 1, 4096, 2048, [300, 400, 324]),
                                      (37, 7, 3, 256, 64, [11, 11, 10]), (1029, 5, 1, 128, 128, [16, 24, 24])]:
        q = torch.randn(T, Hq, D, generator=g).to(dtype)
        k = torch.randn(T, Hk, D, generator=g).to(dtype)
        pos = _positions(T, section is not None, g)
        inv = _inv(1e4, rd)
        wq, wk = ref.apply_rope(q, k, pos, inv, rd, section, section is not None)
        kw = dict(inv_freq=inv, rotary_dim=rd, mrope_section=section, mrope_interleaved=section is not None)
        if inplace:
            qo, ko = q.cuda(), k.cuda()
            packcuda.apply_rope_(qo, ko, pos, **kw)
        else:
            qo, ko = packcuda.apply_rope(q.cuda(), k.cuda(), pos, **kw)
        scale = float(max(q.abs().max(), k.abs().max()))
        assert_close_ulp(qo, wq, dtype, scale, 4.0)
        assert_close_ulp(ko, wk, dtype, scale, 4.0)


# ------------------------------------------------------------------------------------ positions forms, views
def test_inplace_4d_views_of_one_buffer_and_expanded_positions():
    """Valid in-place inputs the memory checks must keep accepting: [B, S, H, D] q/k views into one fused
    buffer (extents interleave), a k whose heads sit between q's, positions expanded (stride 0, read only)."""
    g = keyed_generator("4dviews")
    B, S, D = 2, 5, 16
    buf = torch.randn(B, S, 7, D, generator=g)
    want = buf.clone()
    q, k = buf[:, :, 0:4], buf[:, :, 4:5]
    pos = torch.arange(S).expand(B, S)
    wq, wk = packcuda.apply_rope(q, k, pos, rope_theta=1e4)
    packcuda.apply_rope_(q, k, pos, rope_theta=1e4)
    assert torch.equal(q, wq) and torch.equal(k, wk) and torch.equal(buf[:, :, 5:], want[:, :, 5:])
    # q heads 0, 2, 4 and k heads 1, 3 of one buffer: disjoint elements
    buf2 = torch.randn(9, 6, D, generator=g)
    q2, k2 = buf2[:, 0:6:2], buf2[:, 1:5:2]
    wq2, wk2 = packcuda.apply_rope(q2, k2, torch.arange(9), rope_theta=1e4)
    packcuda.apply_rope_(q2, k2, torch.arange(9), rope_theta=1e4)
    assert torch.equal(q2, wq2) and torch.equal(k2, wk2)
    # partial rotary: k starting inside q's passthrough channels shares elements with q, rotated or not
    buf3 = torch.randn(4, 2 * D, generator=g)
    q3, k3 = buf3[:, :D].view(4, 1, D), buf3[:, D // 2: D // 2 + D].view(4, 1, D)
    for rd in (D, D // 2):
        with pytest.raises(ValueError, match="q and k overlap"):
            packcuda.apply_rope_(q3, k3, torch.arange(4), rope_theta=1e4, rotary_dim=rd)


def test_positions_as_lists_and_default_inv_freq_bounds():
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    a = packcuda.apply_rope(q, k, [0, 1, 2], rope_theta=1e4)
    b = packcuda.apply_rope(q, k, torch.arange(3), rope_theta=1e4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = packcuda.apply_rope(q, k, [[0, 1, 2]] * 3, rope_theta=1e4, mrope_section=[2, 1, 1])
    assert torch.equal(c[0], b[0])
    assert packcuda.default_inv_freq(1e30, 8192).shape == (4096,)
    assert torch.equal(packcuda.default_inv_freq(10000, 16), packcuda.default_inv_freq(10000.0, 16))


# ------------------------------------------------------------------------------------ hypothesis: layouts, memory
@settings(max_examples=150, deadline=None)
@given(
    B=st.integers(1, 3),
    S=st.integers(1, 12),
    Hq=st.integers(1, 4),
    Hk=st.integers(1, 3),
    half=st.integers(1, 10),
    extra=st.integers(0, 6),
    layout=st.sampled_from(["bshd", "bhsd", "fused", "flat-fused"]),
    style=st.sampled_from(["neox", "gptj"]),
    kind=st.sampled_from(["plain", "sectioned", "interleaved"]),
    batched_pos=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_4d_layouts_vs_fp64_reference(B, S, Hq, Hk, half, extra, layout, style, kind, batched_pos, dtype,
                                                 seed):
    """[B, S, H, D] q/k as HF-layout transposes, slices of one fused QKV buffer or flat [T, H, D] slices of it;
    positions [B, S] or flat; out of place and in place against the fp64 reference; in place touches only the
    rotated channels of q and k."""
    g = torch.Generator().manual_seed(seed)
    rd, D = 2 * half, 2 * half + extra
    if layout == "bhsd":
        q = torch.randn(B, Hq, S, D, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(B, Hk, S, D, generator=g).to(dtype).transpose(1, 2)
        buf = None
    else:
        buf = torch.randn(B, S, Hq + 2 * Hk, D, generator=g).to(dtype)
        q, k = buf[:, :, :Hq], buf[:, :, Hq: Hq + Hk]
        if layout == "flat-fused":
            q, k = q.reshape(B * S, Hq, D), k.reshape(B * S, Hk, D)  # views: buf is contiguous
    section = None
    if kind != "plain":
        a = int(torch.randint(0, half + 1, (1,), generator=g))
        b = int(torch.randint(0, half - a + 1, (1,), generator=g))
        section = [a, b, half - a - b]
    rows = (3,) if section else ()
    pos = torch.randint(0, 1 << 16, rows + (B, S), generator=g)
    pos_arg = pos if batched_pos and q.dim() == 4 else pos.reshape(*rows, B * S)
    inv = _inv(1e4, rd)
    kw = dict(inv_freq=inv, rotary_dim=rd, mrope_section=section, mrope_interleaved=kind == "interleaved",
              rotary_style=style)
    wq, wk = ref.apply_rope(q.reshape(B * S, Hq, D), k.reshape(B * S, Hk, D), pos.reshape(*rows, B * S), inv, rd,
                            section, kind == "interleaved", style)
    qo, ko = packcuda.apply_rope(q, k, pos_arg, **kw)
    assert qo.shape == q.shape and ko.shape == k.shape
    scale = float(max(q.abs().max(), k.abs().max()))
    assert_close_ulp(qo.reshape(B * S, Hq, D), wq, dtype, scale, 4.0)
    assert_close_ulp(ko.reshape(B * S, Hk, D), wk, dtype, scale, 4.0)
    before = None if buf is None else buf.clone()
    packcuda.apply_rope_(q, k, pos_arg, **kw)
    assert torch.equal(q, qo) and torch.equal(k, ko)
    if buf is not None:
        touched = torch.zeros(buf.shape, dtype=torch.bool)
        touched[:, :, : Hq + Hk, :rd] = True
        assert torch.equal(buf[~touched], before[~touched])


def _elements(x: torch.Tensor) -> set:
    """Storage offsets of the elements of x."""
    sizes, strides = list(x.shape), list(x.stride())
    idx = torch.zeros(sizes, dtype=torch.long) + x.storage_offset()
    for d, (n, st_) in enumerate(zip(sizes, strides)):
        shape = [1] * len(sizes)
        shape[d] = n
        idx = idx + (torch.arange(n) * st_).view(shape)
    return set(idx.flatten().tolist())


def _nested(x: torch.Tensor) -> bool:
    span = 0
    for stride, size in sorted((st_, n) for n, st_ in zip(x.shape, x.stride()) if n > 1):
        if stride <= span:
            return False
        span += (size - 1) * stride
    return True


@settings(max_examples=200, deadline=None)
@given(
    T=st.integers(1, 6),
    Hq=st.integers(1, 3),
    Hk=st.integers(1, 3),
    half=st.integers(1, 4),
    extra=st.integers(0, 4),
    ss_q=st.integers(0, 40),
    ss_k=st.integers(0, 40),
    sh_q=st.integers(0, 12),
    sh_k=st.integers(0, 12),
    off_q=st.integers(0, 60),
    off_k=st.integers(0, 60),
    same_token_stride=st.booleans(),
)
def test_hypothesis_inplace_overlap_decision(T, Hq, Hk, half, extra, ss_q, ss_k, sh_q, sh_k, off_q, off_k,
                                             same_token_stride):
    """q and k as arbitrary strided views of one buffer: the in-place op refuses whenever q and k share an element
    or one repeats an element; when q and k walk the tokens with the same stride and each is nested (dims ordered
    by stride, each stride beyond the span of the dims inside it: the rule the op applies to an in-place output)
    the decision is exact (accepted iff disjoint); accepted calls give the out-of-place result."""
    rd, D = 2 * half, 2 * half + extra
    if same_token_stride:
        ss_k = ss_q
    size = 1 + max(off_q + (T - 1) * ss_q + (Hq - 1) * sh_q + D, off_k + (T - 1) * ss_k + (Hk - 1) * sh_k + D)
    buf = torch.randn(size, generator=torch.Generator().manual_seed(T * 1000 + off_q))
    q = buf.as_strided((T, Hq, D), (ss_q, sh_q, 1), off_q)
    k = buf.as_strided((T, Hk, D), (ss_k, sh_k, 1), off_k)
    repeats = lambda x: len(_elements(x)) < x.numel()  # noqa: E731
    shared = bool(_elements(q) & _elements(k))
    pos = torch.arange(T)
    before = buf.clone()
    try:
        wq, wk = packcuda.apply_rope(q, k, pos, rope_theta=1e4, rotary_dim=rd)
        packcuda.apply_rope_(q, k, pos, rope_theta=1e4, rotary_dim=rd)
    except ValueError as e:
        assert "packcuda.apply_rope_" in str(e)
        assert torch.equal(buf, before)  # nothing written
        if ss_q == ss_k and _nested(q) and _nested(k):
            assert shared, f"refused disjoint q/k: {e}"
        return
    assert not shared and not repeats(q) and not repeats(k)
    assert torch.equal(q, wq) and torch.equal(k, wk)
