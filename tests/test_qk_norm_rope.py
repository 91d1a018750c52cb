"""Fused per-head QK norm + rotary embedding (packcuda.apply_qk_norm_rope / apply_qk_norm_rope_), against
transformers' own norm modules (Qwen3VLTextRMSNorm, Qwen3_5RMSNorm) and apply_rotary_pos_emb."""
import contextlib
import zlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

import packcuda
import reference as ref
from helpers import capture_cuda_graph, no_sync, requires_cuda

NORMS = ["rms", "rms_offset"]


def _seed(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


class _Fp64(TorchFunctionMode):
    """transformers' modules evaluated in fp64: their fp32 up-casts (``.float()``, ``.to(torch.float32)``) keep
    fp64 tensors fp64, everything else runs as written."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float and args[0].dtype == torch.float64:
            return args[0]
        if func is torch.Tensor.to and args[0].dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {n: (torch.float64 if v is torch.float32 else v) for n, v in kwargs.items()}
        return func(*args, **kwargs)


def _hf():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m5
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m3

    return m3, m5


# (name, head_dim, rotary_dim, mrope_section, interleaved, rope_theta)
LAYOUTS = [
    ("qwen3-plain", 128, 128, None, False, 1e6),
    ("qwen3_vl", 128, 128, [24, 20, 20], True, 5e6),
    ("qwen3_5-partial", 256, 64, [11, 11, 10], True, 1e7),
]


def _norm_module(norm, D, eps, weight):
    m3, m5 = _hf()
    mod = m3.Qwen3VLTextRMSNorm(D, eps=eps) if norm == "rms" else m5.Qwen3_5RMSNorm(D, eps=eps)
    with torch.no_grad():
        mod.weight.copy_(weight)
    return mod


def _hf_cos_sin(pos, inv_freq, rd, section, interleaved, dtype):
    """cos/sin [T, rd] as transformers' rotary modules build them (fp32 angles, then the model dtype)."""
    n = rd // 2
    axes = torch.tensor(ref.hf_rope_axes(n, section, interleaved))
    p = (pos if pos.dim() == 2 else pos[None].expand(3, -1)).float()[axes, :].T
    freqs = p * inv_freq.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    if dtype == torch.float64:  # the fp64 truth: cos/sin of the fp32 angles, in fp64
        emb = emb.double()
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _hf_forward(q, k, pos, wq, wk, eps, norm, layout, fp64=False):
    """transformers' path on token-major q [T, Hq, D], k [T, Hk, D]: the norm modules, then the model's own
    apply_rotary_pos_emb (partial rotary: the rotary channels only, as Qwen3.5's attention does)."""
    m3, m5 = _hf()
    _, D, rd, section, inter, theta = layout
    inv = ref.rope_inv_freq(theta, rd)
    nq, nk = _norm_module(norm, D, eps, wq).to(q.dtype), _norm_module(norm, D, eps, wk).to(q.dtype)
    if wq.requires_grad:
        nq._parameters["weight"], nk._parameters["weight"] = wq, wk  # the caller's leaves, so grads reach them
    apply = m5.apply_rotary_pos_emb if rd < D else m3.apply_rotary_pos_emb
    with (_Fp64() if fp64 else contextlib.nullcontext()):
        qn, kn = nq(q), nk(k)
        cos, sin = _hf_cos_sin(pos, inv, rd, section, inter, q.dtype)
        # [T, H, D] -> [1, H, T, D] (transformers' layout), cos/sin [1, T, rd]
        qo, ko = apply(qn.transpose(0, 1)[None], kn.transpose(0, 1)[None], cos[None], sin[None])
    return qo[0].transpose(0, 1), ko[0].transpose(0, 1)


def _inputs(layout, T, Hq, Hk, dtype, norm, key, device="cpu", big=False):
    _, D, rd, section, inter, theta = layout
    g = _seed(key)
    scale = torch.rand(T, 1, 1, generator=g) * 4 + 0.1  # rows of different magnitudes
    q = (torch.randn(T, Hq, D, generator=g) * scale).to(dtype)
    k = (torch.randn(T, Hk, D, generator=g) * scale).to(dtype)
    hi = 1 << 18 if big else 4096
    pos = torch.randint(0, hi, (3, T) if section else (T,), generator=g)
    if section:
        pos[:, : T // 3] = torch.arange(T // 3)[None]
    w0 = 1.0 if norm == "rms" else 0.0  # trained Qwen3 weights sit around 1, Qwen3.5's around 0
    wq = (w0 + 0.5 * torch.randn(D, generator=g)).to(dtype)
    wk = (w0 + 0.5 * torch.randn(D, generator=g)).to(dtype)
    kw = dict(rope_theta=theta, rotary_dim=rd, mrope_section=section, mrope_interleaved=inter)
    return [x.to(device) for x in (q, k, pos, wq, wk)], kw


# ------------------------------------------------------------------------------------ transformers oracle
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_transformers_oracle(device, layout, norm, dtype):
    (q, k, pos, wq, wk), kw = _inputs(layout, 96, 4, 2, dtype, norm, ("oracle", layout[0], norm, dtype), device)
    eps = 1e-6
    ours = packcuda.apply_qk_norm_rope(q, k, pos, q_weight=wq, k_weight=wk, eps=eps, norm=norm, **kw)
    cpu = [x.cpu() for x in (q, k, pos, wq, wk)]
    with torch.no_grad():
        hf = _hf_forward(*cpu, eps, norm, layout)
        truth = _hf_forward(*[x.double() if x.is_floating_point() else x for x in cpu], eps, norm, layout,
                            fp64=True)
    for o, h, t in zip(ours, hf, truth):
        assert o.dtype == dtype and o.shape == t.shape
        e_ours, e_hf = (o.double().cpu() - t).abs(), (h.double() - t).abs()
        if dtype == torch.float32:  # both are a few fp32 roundings away from the truth
            assert e_ours.max() <= 4 * e_hf.max() + 1e-5 * float(t.abs().max())
        else:
            assert e_ours.max() <= e_hf.max() * 1.001 + 1e-12, (float(e_ours.max()), float(e_hf.max()))
            assert e_ours.mean() <= e_hf.mean(), (float(e_ours.mean()), float(e_hf.mean()))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("norm", NORMS)
def test_grads_fp64_vs_transformers(layout, norm):
    """Gradients of q, k and both weights equal autograd through transformers' modules (fp64) to 1e-10."""
    (q, k, pos, wq, wk), kw = _inputs(layout, 40, 3, 2, torch.float64, norm, ("grad", layout[0], norm))
    eps = 1e-6
    g = _seed("g", layout[0], norm)
    gq, gk = torch.randn(q.shape, generator=g, dtype=torch.float64), torch.randn(k.shape, generator=g,
                                                                                  dtype=torch.float64)

    def grads(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, wq, wk)]
        qo, ko = fn(*leaves)
        torch.autograd.backward((qo, ko), (gq, gk))
        return (qo.detach(), ko.detach()), [x.grad for x in leaves]

    y1, g1 = grads(lambda q_, k_, wq_, wk_: packcuda.apply_qk_norm_rope(
        q_, k_, pos, q_weight=wq_, k_weight=wk_, eps=eps, norm=norm, **kw))
    y2, g2 = grads(lambda q_, k_, wq_, wk_: _hf_forward(q_, k_, pos, wq_, wk_, eps, norm, layout, fp64=True))
    for a, b in zip(y1 + tuple(g1), y2 + tuple(g2)):
        assert a.dtype == torch.float64
        rel = (a - b).abs().max() / b.abs().max()
        assert rel < 1e-10, float(rel)


@pytest.mark.parametrize("norm", NORMS)
def test_gradcheck_gptj_and_scaling(norm):
    """gptj pairs and attention_scaling (no transformers module has them): gradcheck in fp64."""
    g = _seed("gradcheck", norm)
    T, D = 5, 12
    q = torch.randn(T, 2, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 1, D, generator=g, dtype=torch.float64, requires_grad=True)
    wq = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    wk = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 100, (T,), generator=g)

    def f(q, k, wq, wk):
        return packcuda.apply_qk_norm_rope(q, k, pos, q_weight=wq, k_weight=wk, eps=1e-3, norm=norm, rope_theta=1e4,
                                           rotary_dim=8, rotary_style="gptj", attention_scaling=0.7)

    assert torch.autograd.gradcheck(f, (q, k, wq, wk))


def test_rms_rounds_before_the_weight():
    """norm='rms' rounds x * rstd to the data dtype before the weight (transformers' .to(input_dtype)); with a
    weight of 1, no rotation (positions 0) and bf16 data, the output is exactly transformers' norm output."""
    m3, _ = _hf()
    g = _seed("round")
    D = 64
    q = torch.randn(17, 3, D, generator=g).bfloat16()
    w = torch.ones(D, dtype=torch.bfloat16)
    qo, _ = packcuda.apply_qk_norm_rope(q, q[:, :1].clone(), torch.zeros(17, dtype=torch.long), q_weight=w,
                                        k_weight=w, norm="rms", rope_theta=1e4)
    mod = m3.Qwen3VLTextRMSNorm(D).bfloat16()
    assert torch.equal(qo, mod(q))


# ------------------------------------------------------------------------------------ in place, fused views
@pytest.mark.parametrize("norm", NORMS)
def test_inplace_on_fused_projection_views(device, norm):
    """Qwen3.5's q is a strided view interleaved with its gate ([T, H, 2D] chunked), k / v views of one
    projection: the in-place op writes exactly q's and k's elements, equal to the out-of-place op, and the
    gradients (through the in-place op, mark-dirty) equal the out-of-place ones."""
    g = _seed("fused", norm)
    T, Hq, Hk, D, rd = 33, 4, 2, 64, 16
    base = torch.randn(T, Hq * 2 * D + 2 * Hk * D, generator=g).to(device)
    wq, wk = (1 + 0.3 * torch.randn(2, D, generator=g)).to(device).unbind(0)
    pos = torch.randint(0, 999, (3, T), generator=g).to(device)
    kw = dict(q_weight=wq, k_weight=wk, norm=norm, rope_theta=1e7, rotary_dim=rd, mrope_section=[3, 3, 2],
              mrope_interleaved=True)

    def views(buf):
        qg = buf[:, : Hq * 2 * D].view(T, Hq, 2 * D)
        q = qg[..., :D]  # strided: every other D-block is the gate
        k = buf[:, Hq * 2 * D: Hq * 2 * D + Hk * D].view(T, Hk, D)
        return q, k

    want = packcuda.apply_qk_norm_rope(*views(base), pos, **kw)
    buf = base.clone()
    q, k = views(buf)
    out = packcuda.apply_qk_norm_rope_(q, k, pos, **kw)
    assert out[0] is q and out[1] is k
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    mask = torch.ones_like(buf, dtype=torch.bool)
    qm, km = views(mask)
    qm.zero_()
    km.zero_()
    assert torch.equal(buf[mask], base[mask])  # gate and v untouched

    # gradients through the in-place op (views of a non-leaf) == out of place
    x = base.clone().requires_grad_()
    wq2, wk2 = wq.clone().requires_grad_(), wk.clone().requires_grad_()
    gq = torch.randn(T, Hq, D, generator=g).to(device)
    gk = torch.randn(T, Hk, D, generator=g).to(device)

    def run(inplace):
        for t in (x, wq2, wk2):
            t.grad = None
        b = x * 1.0
        q, k = views(b)
        kk = dict(kw, q_weight=wq2, k_weight=wk2)
        qo, ko = (packcuda.apply_qk_norm_rope_ if inplace else packcuda.apply_qk_norm_rope)(q, k, pos, **kk)
        torch.autograd.backward((qo, ko), (gq, gk))
        return qo.detach().clone(), x.grad.clone(), wq2.grad.clone(), wk2.grad.clone()

    a, b = run(True), run(False)
    assert torch.equal(a[0], b[0])
    for u, v in zip(a[1:], b[1:]):
        assert torch.allclose(u, v, rtol=1e-5, atol=1e-5)


def test_4d_and_partial_passthrough_is_normalized():
    """[B, S, H, D] inputs with [3, B, S] positions; with partial rotary the pass-through channels come out
    normalized (not copied)."""
    g = _seed("4d")
    B, S, D, rd = 2, 7, 32, 8
    q = torch.randn(B, S, 3, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, 1, D, generator=g, dtype=torch.float64)
    w = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
    pos = torch.randint(0, 50, (3, B, S), generator=g)
    kw = dict(q_weight=w, k_weight=w, eps=1e-6, rope_theta=1e4, rotary_dim=rd, mrope_section=[2, 1, 1])
    qo, ko = packcuda.apply_qk_norm_rope(q, k, pos, **kw)
    qf, kf = packcuda.apply_qk_norm_rope(q.reshape(B * S, 3, D), k.reshape(B * S, 1, D), pos.reshape(3, B * S), **kw)
    assert torch.equal(qo.reshape(B * S, 3, D), qf) and torch.equal(ko.reshape(B * S, 1, D), kf)
    nq = w * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(qo[..., rd:], nq[..., rd:], rtol=1e-13, atol=1e-13)
    want, _ = ref.apply_rope(nq.reshape(B * S, 3, D), nq.reshape(B * S, 3, D)[:, :1], pos.reshape(3, B * S),
                             ref.rope_inv_freq(1e4, rd), rd, [2, 1, 1])
    assert torch.allclose(qf, want, rtol=1e-12, atol=1e-12)


def test_empty_and_fp32_weights():
    q = torch.zeros(0, 2, 16)
    w = torch.ones(16)
    qo, ko = packcuda.apply_qk_norm_rope(q, q[:, :1], torch.zeros(0, dtype=torch.long), q_weight=w, k_weight=w,
                                         rope_theta=1e4)
    assert qo.shape == (0, 2, 16) and ko.shape == (0, 1, 16)
    # bf16 data with fp32 weights: output in the data dtype, weight gradients in the weights' dtype
    g = _seed("w32")
    q = torch.randn(9, 2, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(16, generator=g, requires_grad=True)
    qo, ko = packcuda.apply_qk_norm_rope(q, q.detach()[:, :1].clone(), torch.arange(9), q_weight=w, k_weight=w,
                                         rope_theta=1e4)
    assert qo.dtype == torch.bfloat16
    (qo.float().sum() + ko.float().sum()).backward()
    assert w.grad.dtype == torch.float32 and q.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float64, torch.float32), (torch.float64, torch.float64)])
@pytest.mark.parametrize("D,strided", [(16, False), (14, True), (6, False)])
def test_weight_dtypes_and_strides(device, dtype, wdtype, D, strided):
    """Weights in the data dtype (or fp32 with fp64 data), contiguous or strided, any head_dim: the same outputs as
    the weights in the compute type, and weight gradients equal to the compute type's rounded once to the weights'
    dtype."""
    g = _seed(f"wdt{D}{strided}")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q = torch.randn(11, 3, D, generator=g).to(device, dtype)
    k = torch.randn(11, 2, D, generator=g).to(device, dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pos = torch.randint(0, 50, (11,), generator=g).to(device)
    wide = torch.randn(2, 2 * D if strided else D, generator=g).to(device, wdtype)
    w = [wide[i, ::2] if strided else wide[i] for i in range(2)]
    for norm in NORMS:
        def run(ws):
            leaves = [x.detach().requires_grad_() for x in (q, k, *ws)]
            out = packcuda.apply_qk_norm_rope(leaves[0], leaves[1], pos, q_weight=leaves[2], k_weight=leaves[3],
                                              norm=norm, rope_theta=1e4)
            return out, torch.autograd.grad(out, leaves, (gq, gk))

        (o, gr), (o_acc, gr_acc) = run(w), run([x.to(acc).contiguous() for x in w])
        assert torch.equal(o[0], o_acc[0]) and torch.equal(o[1], o_acc[1])
        assert torch.equal(gr[0], gr_acc[0]) and torch.equal(gr[1], gr_acc[1])
        for dw, dw_acc in zip(gr[2:], gr_acc[2:]):
            assert dw.dtype == wdtype and dw.shape == (D,)
            assert torch.equal(dw, dw_acc.to(wdtype))


# ------------------------------------------------------------------------------------ torch.library
def test_opcheck(device):
    from torch.library import opcheck

    g = _seed("opcheck")
    D = 16
    q = torch.randn(7, 2, D, generator=g).to(device)
    k = torch.randn(7, 1, D, generator=g).to(device)
    pos = torch.randint(0, 50, (3, 7), generator=g).to(device)
    inv = ref.rope_inv_freq(1e4, D).to(device)
    wq, wk = torch.rand(2, D, generator=g).to(device).unbind(0)
    op = torch.ops.packcuda
    opcheck(op.apply_qk_norm_rope.default, (q.requires_grad_(), k.requires_grad_(), pos, inv, wq.requires_grad_(),
                                      wk.requires_grad_(), 1e-6, "rms", D, [2, 3, 3], True, False, 1.0))
    opcheck(op.apply_qk_norm_rope.default, (q, k, pos[0], inv[:4], wq, wk, 1e-5, "rms_offset", 8, [], False, True, 0.5))
    opcheck(op.apply_qk_norm_rope_.default, (q.detach().clone(), k.detach().clone(), pos, inv, wq.detach(), wk.detach(),
                                       1e-6, "rms_offset", D, [2, 3, 3], False, False, 1.0))
    opcheck(op.apply_qk_norm_rope_backward.default,
            (torch.randn_like(q), torch.randn_like(k), q.detach(), k.detach(), pos, inv, wq.detach(), wk.detach(), 1e-6,
             "rms", D, [2, 3, 3], True, False, 1.0))


def test_compile_fullgraph(device):
    g = _seed("compile")
    T, D = 13, 32
    q = torch.randn(T, 4, D, generator=g).to(device).requires_grad_()
    k = torch.randn(T, 2, D, generator=g).to(device).requires_grad_()
    wq = (1 + torch.randn(D, generator=g)).to(device).requires_grad_()
    wk = (1 + torch.randn(D, generator=g)).to(device).requires_grad_()
    pos = torch.randint(0, 1000, (3, T), generator=g).to(device)
    kw = dict(rope_theta=5e6, mrope_section=[6, 5, 5], mrope_interleaved=True, norm="rms_offset")

    def f(q, k, wq, wk, pos):
        qo, ko = packcuda.apply_qk_norm_rope(q * 1.5, k, pos, q_weight=wq, k_weight=wk, **kw)
        return (qo.sum(-1) + 1).sin(), ko

    backend = "aot_eager" if device == "cpu" else "inductor"
    cf = torch.compile(f, fullgraph=True, backend=backend)
    a, b = f(q, k, wq, wk, pos), cf(q, k, wq, wk, pos)
    # the compiled sum and sine may add in another order (inductor's reduction): a few ulps
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-5) and torch.equal(a[1], b[1])
    g1 = torch.autograd.grad(a[0].sum() + a[1].sum(), (q, k, wq, wk))
    g2 = torch.autograd.grad(b[0].sum() + b[1].sum(), (q, k, wq, wk))
    assert all(torch.allclose(u, v, atol=1e-5, rtol=1e-5) for u, v in zip(g1, g2))

    def h(q, k, pos):
        q2, k2 = q.clone(), k.clone()
        packcuda.apply_qk_norm_rope_(q2, k2, pos, q_weight=wq, k_weight=wk, **kw)
        return q2, k2

    with torch.no_grad():
        ch = torch.compile(h, fullgraph=True, backend=backend)
        r1, r2 = h(q, k, pos), ch(q, k, pos)
    assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])


# ------------------------------------------------------------------------------------ CUDA
def _cuda_case(layout, norm, dtype, T=700, Hq=8, Hk=2, key="cuda"):
    (q, k, pos, wq, wk), kw = _inputs(layout, T, Hq, Hk, dtype, norm, (key, layout[0], norm, dtype), big=True)
    return (q, k, pos, wq, wk), dict(kw, norm=norm, eps=1e-6)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_cuda_matches_cpu(layout, norm, dtype, style):
    (q, k, pos, wq, wk), kw = _cuda_case(layout, norm, dtype)
    kw["rotary_style"] = style
    gq, gk = torch.randn_like(q.float()).to(dtype), torch.randn_like(k.float()).to(dtype)

    def run(dev):
        leaves = [x.detach().to(dev).requires_grad_() for x in (q, k, wq, wk)]
        out = packcuda.apply_qk_norm_rope(leaves[0], leaves[1], pos.to(dev), q_weight=leaves[2], k_weight=leaves[3],
                                          **kw)
        torch.autograd.backward(out, (gq.to(dev), gk.to(dev)))
        return [o.detach().cpu().double() for o in out] + [x.grad.cpu().double() for x in leaves]

    c, d = run("cpu"), run("cuda")
    # the row sums run in another order on the GPU: agreement to a couple of roundings of the output dtype
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for a, b in zip(c, d):
        scale = float(a.abs().max()) + 1e-30
        assert float((a - b).abs().max()) <= tol * scale, (float((a - b).abs().max()), scale)


def _interleaved_kw(norm, rd):
    """Keywords of an interleaved mRoPE over rotary_dim rd (its n = rd / 2 slots split t, h, w as evenly as they
    go, t taking the remainder)."""
    n = rd // 2
    return dict(norm=norm, eps=1e-6, rope_theta=1e6, rotary_dim=rd,
                mrope_section=[n - 2 * (n // 3), n // 3, n // 3], mrope_interleaved=True)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("D,rd,Hq,Hk", [(64, 64, 9, 3), (64, 16, 1, 1), (128, 32, 6, 0), (128, 128, 5, 7),
                                        (256, 64, 3, 1), (256, 256, 2, 2), (256, 48, 0, 3)])
@pytest.mark.parametrize("shape", [(1,), (37,), (3, 7), (1500,)], ids=["T1", "T37", "B3S7", "T1500"])
def test_cuda_backward_head_and_token_layouts(D, rd, Hq, Hk, shape):
    """Head counts that are not a multiple of the rows a warp step takes (or zero), few tokens, [B, S, H, D]
    inputs, partial and full rotary: CUDA forward and all four gradients agree with the CPU kernels, and the
    backward is bitwise reproducible."""
    g = _seed("cuda-layouts", D, rd, Hq, Hk, shape)
    q = torch.randn(*shape, Hq, D, generator=g).bfloat16()
    k = torch.randn(*shape, Hk, D, generator=g).bfloat16()
    wq, wk = (1 + 0.3 * torch.randn(2, D, generator=g)).unbind(0)
    pos = torch.randint(0, 5000, (3, *shape), generator=g)
    kw = _interleaved_kw("rms", rd)
    gq, gk = torch.randn_like(q.float()).bfloat16(), torch.randn_like(k.float()).bfloat16()

    def run(dev):
        leaves = [x.detach().to(dev).requires_grad_() for x in (q, k, wq, wk)]
        out = packcuda.apply_qk_norm_rope(leaves[0], leaves[1], pos.to(dev), q_weight=leaves[2], k_weight=leaves[3],
                                          **kw)
        torch.autograd.backward(out, (gq.to(dev), gk.to(dev)))
        return [o.detach().cpu().double() for o in out] + [x.grad.cpu().double() for x in leaves]

    c, d1, d2 = run("cpu"), run("cuda"), run("cuda")
    for a, b, b2 in zip(c, d1, d2):
        assert torch.equal(b, b2)
        scale = float(a.abs().max()) + 1e-30 if a.numel() else 1.0
        assert a.shape == b.shape and (a.numel() == 0 or float((a - b).abs().max()) <= 2e-2 * scale)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("D,rd,Hq,Hk", [(64, 64, 9, 3), (64, 16, 1, 1), (128, 128, 5, 7), (128, 32, 6, 0),
                                        (256, 64, 3, 1), (256, 48, 0, 3)])
@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (3, 1500)], ids=["T1", "T37", "B3S1500"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_forward_layouts_in_place_on_fused_views(D, rd, Hq, Hk, shape, norm, dtype):
    """The forward over head counts that are not a multiple of a warp step's rows (or zero), few tokens and more
    tokens than a grid's warps, on [B, S, H, D] views of one fused projection (q, k, v heads per token): CUDA
    agrees with the CPU kernel, and the in-place op writes exactly q's and k's elements, bitwise equal to the
    out-of-place op."""
    g = _seed("cuda-fwd-fused", D, rd, Hq, Hk, shape, norm, dtype)
    B, S = shape
    base = torch.randn(B, S, (Hq + 2 * Hk) * D, generator=g).to(dtype)

    def views(buf):
        return (buf[..., : Hq * D].view(B, S, Hq, D), buf[..., Hq * D: (Hq + Hk) * D].view(B, S, Hk, D))

    wq, wk = (1 + 0.3 * torch.randn(2, D, generator=g)).unbind(0)
    pos = torch.randint(0, 5000, (3, B, S), generator=g)
    kw = _interleaved_kw(norm, rd)
    want = packcuda.apply_qk_norm_rope(*views(base), pos, q_weight=wq, k_weight=wk, **kw)
    base = base.cuda()
    dkw = dict(kw, q_weight=wq.cuda(), k_weight=wk.cuda())
    got = packcuda.apply_qk_norm_rope(*views(base), pos.cuda(), **dkw)
    buf = base.clone()
    qi, ki = views(buf)
    packcuda.apply_qk_norm_rope_(qi, ki, pos.cuda(), **dkw)
    assert torch.equal(qi, got[0]) and torch.equal(ki, got[1])
    assert torch.equal(buf[..., (Hq + Hk) * D:], base[..., (Hq + Hk) * D:])  # v untouched
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    for a, b in zip(want, got):
        assert a.shape == b.shape
        if a.numel():
            scale = float(a.double().abs().max()) + 1e-30
            assert float((b.cpu().double() - a.double()).abs().max()) <= tol * scale


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_strided_views_inplace_and_odd_alignment(norm):
    """Fused-QKV views (16-byte path), an odd head offset (scalar path), in place == out of place."""
    g = _seed("cuda-views", norm)
    T, Hq, Hk, D = 257, 6, 2, 128
    for off in (0, 1):
        base = torch.randn(T, off + (Hq + 2 * Hk) * D, generator=g).bfloat16().cuda()
        q = base[:, off: off + Hq * D].view(T, Hq, D)
        k = base[:, off + Hq * D: off + (Hq + Hk) * D].view(T, Hk, D)
        w = (1 + 0.2 * torch.randn(2, D, generator=g)).bfloat16().cuda()
        pos = torch.randint(0, 10000, (3, T), generator=g).cuda()
        kw = dict(q_weight=w[0], k_weight=w[1], norm=norm, rope_theta=5e6, mrope_section=[24, 20, 20],
                  mrope_interleaved=True)
        want = packcuda.apply_qk_norm_rope(q.cpu(), k.cpu(), pos.cpu(), **{**kw, "q_weight": w[0].cpu(),
                                                                          "k_weight": w[1].cpu()})
        got = packcuda.apply_qk_norm_rope(q, k, pos, **kw)
        buf = base.clone()
        qi = buf[:, off: off + Hq * D].view(T, Hq, D)
        ki = buf[:, off + Hq * D: off + (Hq + Hk) * D].view(T, Hk, D)
        packcuda.apply_qk_norm_rope_(qi, ki, pos, **kw)
        assert torch.equal(qi, got[0]) and torch.equal(ki, got[1])
        assert torch.equal(buf[:, off + (Hq + Hk) * D:], base[:, off + (Hq + Hk) * D:])
        for a, b in zip(got, want):
            assert (a.cpu().double() - b.double()).abs().max() <= 2e-2 * b.double().abs().max()


@requires_cuda
@pytest.mark.gpu
def test_cuda_no_sync_graph_capture_and_bitwise_deterministic():
    (q, k, pos, wq, wk), kw = _cuda_case(LAYOUTS[2], "rms_offset", torch.bfloat16, T=4096, Hq=24, Hk=4, key="graph")
    q, k, wq, wk = [x.cuda() for x in (q, k, wq, wk)]
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def step(pos_):
        leaves = [x.detach().requires_grad_() for x in (q, k, wq, wk)]
        out = packcuda.apply_qk_norm_rope(leaves[0], leaves[1], pos_, q_weight=leaves[2], k_weight=leaves[3], **kw)
        grads = torch.autograd.grad(out, leaves, (gq, gk))
        return [o.detach() for o in out] + list(grads)

    dpos = pos.cuda()  # (a pageable host -> device copy syncs: made before the no-sync block)
    step(dpos)  # warm-up (frequency cache, allocations)
    with no_sync():
        r1 = step(pos)     # host positions: uploaded without a sync
        r2 = step(dpos)    # device positions
    torch.cuda.synchronize()
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)  # bitwise, the weight gradients included
    r3 = step(pos.cuda())
    assert all(torch.equal(a, b) for a, b in zip(r1, r3))

    # CUDA-graph capture of the forward op, the backward op and the in-place op (device positions and frequencies)
    dpos = pos.cuda()
    _, D, rd, section, inter, theta = LAYOUTS[2]
    inv = packcuda.default_inv_freq(theta, rd).cuda()
    # eps, norm (rms_offset), rotary_dim, section, interleaved, gptj, scaling
    bw = (1e-6, "rms_offset", rd, section, inter, False, 1.0)
    op = torch.ops.packcuda.apply_qk_norm_rope_backward

    def captured():
        fo = packcuda.apply_qk_norm_rope(q, k, dpos, q_weight=wq, k_weight=wk, **kw)
        bo = op(gq, gk, q, k, dpos, inv, wq, wk, *bw)
        packcuda.apply_qk_norm_rope_(qi, ki, dpos, q_weight=wq, k_weight=wk, **kw)
        return fo, bo

    qi, ki = q.clone(), k.clone()
    graph, (fo, bo) = capture_cuda_graph(captured)
    qi.copy_(q)
    ki.copy_(k)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(fo[0], r1[0]) and torch.equal(fo[1], r1[1])
    assert torch.equal(bo[0], r1[2]) and torch.equal(bo[1], r1[3])
    assert torch.equal(bo[2], r1[4]) and torch.equal(bo[3], r1[5])
    assert torch.equal(qi, r1[0]) and torch.equal(ki, r1[1])
