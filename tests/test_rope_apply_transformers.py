"""packcuda.apply_rope against transformers' own rotary modules and apply_rotary_pos_emb (Qwen2-VL, Qwen3-VL,
Qwen3.5, Qwen3), the positions forms trainers hold, and rope_kwargs_from_config on transformers 5 configs."""
import pytest
import torch

import packcuda
import reference as ref
from helpers import assert_close_ulp, keyed_generator, ulp


# ------------------------------------------------------------------------------------ transformers oracle
def _hf_models():
    tf = pytest.importorskip("transformers")  # noqa: F841
    from transformers.models.qwen2_vl import configuration_qwen2_vl as c2, modeling_qwen2_vl as m2
    from transformers.models.qwen3_5 import configuration_qwen3_5 as c5, modeling_qwen3_5 as m5
    from transformers.models.qwen3_vl import configuration_qwen3_vl as c3, modeling_qwen3_vl as m3

    common = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)
    return {
        "qwen2_vl": (c2.Qwen2VLTextConfig(**common, rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])), m2.Qwen2VLRotaryEmbedding,
            m2.apply_rotary_pos_emb),
        "qwen3_vl": (c3.Qwen3VLTextConfig(**common, head_dim=128, rope_parameters=dict(
            rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20], mrope_interleaved=True)),
            m3.Qwen3VLTextRotaryEmbedding, m3.apply_rotary_pos_emb),
        "qwen3_5": (c5.Qwen3_5TextConfig(**common, head_dim=256, rope_parameters=dict(
            rope_type="default", rope_theta=1e7, mrope_section=[11, 11, 10], mrope_interleaved=True,
            partial_rotary_factor=0.25)), m5.Qwen3_5TextRotaryEmbedding, m5.apply_rotary_pos_emb),
    }


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transformers_oracle(device, model, dtype):
    cfg, Rotary, hf_apply = _hf_models()[model]
    kw = packcuda.rope_kwargs_from_config(cfg)
    rot = Rotary(cfg).to(device)
    D = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    rd = kw["rotary_dim"]
    # inv_freq bit-identical to the model's buffer
    assert torch.equal(packcuda.default_inv_freq(kw["rope_theta"], rd), rot.inv_freq.cpu())
    g = keyed_generator("hf", model, dtype)
    T, Hq, Hk = 300, 4, 2
    # a packed batch: text, an image block (t const, h/w grid), text; positions restart per sample
    pos = []
    for L in (120, 180):
        p = torch.arange(L).repeat(3, 1)
        p[1, 40:80] = 40 + torch.arange(40) // 8
        p[2, 40:80] = 40 + torch.arange(40) % 8
        p[0, 40:80] = 40
        p[:, 80:] = torch.arange(L - 80) + 48
        pos.append(p)
    pos = torch.cat(pos, 1) + torch.randint(0, 20000, (1,), generator=g)
    q = torch.randn(1, Hq, T, D, generator=g).to(dtype).to(device)  # HF layout [B, H, S, D]
    k = torch.randn(1, Hk, T, D, generator=g).to(dtype).to(device)
    cos, sin = rot(q, pos[:, None, :].to(device))
    hq, hk = hf_apply(q, k, cos, sin)
    ours_q, ours_k = packcuda.apply_rope(q.transpose(1, 2), k.transpose(1, 2), pos[:, None, :].to(device), **kw)
    ours_q, ours_k = ours_q.transpose(1, 2), ours_k.transpose(1, 2)
    wq, wk = ref.apply_rope(q[0].transpose(0, 1).cpu(), k[0].transpose(0, 1).cpu(), pos, rot.inv_freq.cpu(), rd,
                            kw["mrope_section"], kw["mrope_interleaved"])
    wq, wk = wq.transpose(0, 1)[None], wk.transpose(0, 1)[None]
    n = rd // 2
    for x, ours, hf, want in ((q, ours_q, hq, wq), (k, ours_k, hk, wk)):
        ours, hf, x = ours.double().cpu(), hf.double().cpu(), x.double().cpu()
        e_ours, e_hf = (ours - want).abs(), (hf - want).abs()
        slack = 1.01 if dtype == torch.bfloat16 else 1.1  # fp32: both are a few fp32 roundings from the truth
        assert e_ours.max() <= e_hf.max() * slack + 1e-7, (float(e_ours.max()), float(e_hf.max()))
        assert e_ours.mean() <= e_hf.mean() * 1.01 + 1e-9
        # ours is the correctly rounded fp64 result (up to fp32 slack); transformers' eager bf16 path rounds
        # cos/sin and every product, so it can sit ~1.5 ulp of the operands away from the truth. Elementwise
        # the two agree to 1 ulp of the operand scale apart from those roundings: at most 2 such ulps.
        assert_close_ulp(ours, want, dtype, float(x.abs().max()))
        if dtype == torch.bfloat16:
            xr = x[..., :rd]
            partner = torch.cat([xr[..., n:], xr[..., :n]], -1)
            scale = torch.maximum(torch.maximum(xr.abs(), partner.abs()), hf[..., :rd].abs())
            d = (ours[..., :rd] - hf[..., :rd]).abs() / ulp(scale, dtype)
            assert d.max() <= 2.0 and (d > 1).double().mean() < 2e-3, (float(d.max()), float((d > 1).double().mean()))
        assert torch.equal(ours[..., rd:], x[..., rd:])


def _trainer_forms(pos3, text):
    """mRoPE positions [3, T] in the forms trainers hold for one packed THD sequence: [3, T], [3, 1, T] (Megatron's
    [3, B, S] with B = 1), and transformers' [4, B, S] (text positions first) as [4, 1, T] and [4, T]; int64 and
    int32."""
    pos4 = torch.cat([text[None], pos3])
    for p in (pos3, pos3[:, None], pos4[:, None], pos4):
        for dt in (torch.int64, torch.int32):
            yield p.to(dt)


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3"])
def test_thd_positions_in_trainer_forms(device, model):
    """q [T, H, D] with positions as transformers and Megatron hold them for B = 1: the result equals
    transformers' own rotary module and apply_rotary_pos_emb (which see the t, h, w rows; the text row of the
    4-row form is not a rotary input), the same bits for every form, out of place and in place."""
    pytest.importorskip("transformers")
    if model == "qwen3":
        from transformers.models.qwen3 import configuration_qwen3 as c, modeling_qwen3 as m

        cfg = c.Qwen3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            rope_parameters=dict(rope_type="default", rope_theta=1e6))
        Rotary, hf_apply = m.Qwen3RotaryEmbedding, m.apply_rotary_pos_emb
    else:
        cfg, Rotary, hf_apply = _hf_models()[model]
    kw = packcuda.rope_kwargs_from_config(cfg)
    D = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    g = keyed_generator("thd-forms", model)
    T, Hq, Hk = 97, 4, 2
    q = torch.randn(T, Hq, D, generator=g).to(device)
    k = torch.randn(T, Hk, D, generator=g).to(device)
    text = torch.arange(T) + 5000  # transformers' text row: never a rotary input
    if model == "qwen3":
        pos = torch.randint(0, 30000, (T,), generator=g)
        forms = [p.to(dt) for p in (pos, pos[None]) for dt in (torch.int64, torch.int32)]
        hf_pos = pos[None]
    else:
        pos = torch.randint(0, 30000, (3, T), generator=g)
        pos[:, :30] = torch.arange(30) + 100  # a text run: t = h = w
        forms = list(_trainer_forms(pos, text))
        hf_pos = pos[:, None]
    rot = Rotary(cfg).to(device)
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # transformers' [B, H, S, D]
    cos, sin = rot(qh, hf_pos.to(device))
    hq, hk = hf_apply(qh, kh, cos, sin)
    hq, hk = hq[0].transpose(0, 1), hk[0].transpose(0, 1)
    want = None
    for p in forms:
        p = p.to(device)
        oq, ok = packcuda.apply_rope(q, k, p, **kw)
        assert torch.allclose(oq, hq, atol=3e-5, rtol=0) and torch.allclose(ok, hk, atol=3e-5, rtol=0), p.shape
        if want is None:
            want = (oq, ok)
        assert torch.equal(oq, want[0]) and torch.equal(ok, want[1]), (p.shape, p.dtype)
        q2, k2 = q.clone(), k.clone()
        packcuda.apply_rope_(q2, k2, p, **kw)
        assert torch.equal(q2, oq) and torch.equal(k2, ok)


@pytest.mark.parametrize("inplace", [False, True])
def test_thd_positions_forms_qk_norm_and_grads(device, inplace):
    """apply_qk_norm_rope(_) takes the same positions forms: bitwise the result and the gradients of [3, T]."""
    g = keyed_generator("thd-forms-qk", inplace)
    T, D = 41, 32
    q0 = torch.randn(T, 4, D, generator=g).to(device)
    k0 = torch.randn(T, 2, D, generator=g).to(device)
    wq0, wk0 = torch.rand(2, D, generator=g).to(device).unbind(0)
    pos = torch.randint(0, 5000, (3, T), generator=g)
    kw = dict(rope_theta=1e6, mrope_section=[6, 5, 5], mrope_interleaved=True)
    fn = packcuda.apply_qk_norm_rope_ if inplace else packcuda.apply_qk_norm_rope
    want = None
    for p in _trainer_forms(pos, torch.arange(T)):
        leaves = [x.clone().requires_grad_() for x in (q0, k0, wq0, wk0)]
        q, k = (leaves[0] * 1, leaves[1] * 1) if inplace else leaves[:2]
        oq, ok = fn(q, k, p.to(device), q_weight=leaves[2], k_weight=leaves[3], **kw)
        grads = torch.autograd.grad((oq * oq).sum() + (ok * ok.sin()).sum(), leaves)
        got = (oq.detach(), ok.detach(), *grads)
        if want is None:
            want = got
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (p.shape, p.dtype)


def test_rope_kwargs_from_default_configs():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as c25, modeling_qwen2_5_vl as m25
    from transformers.models.qwen3_5 import configuration_qwen3_5 as c5, modeling_qwen3_5 as m5
    from transformers.models.qwen3_vl import configuration_qwen3_vl as c3, modeling_qwen3_vl as m3

    for C, R, inter in ((c25.Qwen2_5_VLConfig, m25.Qwen2_5_VLRotaryEmbedding, False),
                        (c3.Qwen3VLConfig, m3.Qwen3VLTextRotaryEmbedding, True),
                        (c5.Qwen3_5Config, m5.Qwen3_5TextRotaryEmbedding, True)):
        cfg = C().get_text_config()
        kw = packcuda.rope_kwargs_from_config(cfg)
        rot = R(cfg)
        assert kw["mrope_section"] == list(rot.mrope_section) and kw["mrope_interleaved"] == inter
        assert torch.equal(packcuda.default_inv_freq(kw["rope_theta"], kw["rotary_dim"]), rot.inv_freq)


# ------------------------------------------------------------------------------------ configs (transformers 5)
def _hf_rotate(cfg, Rotary, hf_apply, q, k, pos):
    rot = Rotary(cfg)
    cos, sin = rot(q, pos[:, None, :])
    return hf_apply(q, k, cos, sin), rot


@pytest.mark.parametrize("section,head_dim", [([16, 8, 8], 8), ([8, 8, 8], 64), ([2, 30, 1], 32), ([24, 20, 20], 128)])
def test_transformers_oracle_interleaved_section_clipped(section, head_dim):
    """Qwen3-VL's interleaved layout takes the h / w slots as [1 : 3 sH : 3] / [2 : 3 sW : 3] of the rotary slots,
    so a section that does not sum to rotary_dim / 2 (transformers' own test config: head_dim 8, [16, 8, 8])
    clips; rope_kwargs_from_config gives the equivalent section and the result equals transformers'."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_vl import configuration_qwen3_vl as c3, modeling_qwen3_vl as m3

    cfg = c3.Qwen3VLTextConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=head_dim, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                       mrope_section=section, mrope_interleaved=True))
    kw = packcuda.rope_kwargs_from_config(cfg)
    n = kw["rotary_dim"] // 2
    assert kw["rotary_dim"] == head_dim and sum(kw["mrope_section"]) == n and kw["mrope_interleaved"]
    if sum(section) == n:
        assert kw["mrope_section"] == section
    g = keyed_generator("clip", tuple(section), head_dim)
    T = 50
    pos = torch.randint(0, 3000, (3, T), generator=g)
    q = torch.randn(1, 4, T, head_dim, generator=g)
    k = torch.randn(1, 2, T, head_dim, generator=g)
    (hq, hk), rot = _hf_rotate(cfg, m3.Qwen3VLTextRotaryEmbedding, m3.apply_rotary_pos_emb, q, k, pos)
    oq, ok = packcuda.apply_rope(q.transpose(1, 2), k.transpose(1, 2), pos[:, None, :], **kw)
    assert torch.allclose(oq.transpose(1, 2), hq, atol=2e-5, rtol=0)
    assert torch.allclose(ok.transpose(1, 2), hk, atol=2e-5, rtol=0)
    # the slot -> axis map is transformers' exactly: a position change on one axis moves the same slots
    for axis in (1, 2):
        p2 = pos.clone()
        p2[axis] += 7
        (h2, _), _ = _hf_rotate(cfg, m3.Qwen3VLTextRotaryEmbedding, m3.apply_rotary_pos_emb, q, k, p2)
        o2, _ = packcuda.apply_rope(q.transpose(1, 2), k.transpose(1, 2), p2[:, None, :], **kw)
        moved_hf = (h2 - hq).abs().amax(dim=(0, 1, 2)) > 0
        moved = (o2 - oq).transpose(1, 2).abs().amax(dim=(0, 1, 2)) > 0
        assert torch.equal(moved, moved_hf)


def test_rope_kwargs_sectioned_section_must_cover():
    """Qwen2-VL splits the slots by the section (torch.split): a section that does not sum to rotary_dim / 2
    fails in transformers' own forward, so it is refused up front."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import configuration_qwen2_vl as c2, modeling_qwen2_vl as m2

    cfg = c2.Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[16, 8, 8]))
    with pytest.raises(ValueError, match=r"packcuda.rope_kwargs_from_config: mrope_section \[16, 8, 8\] sums to 32"):
        packcuda.rope_kwargs_from_config(cfg)
    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(RuntimeError):
        _hf_rotate(cfg, m2.Qwen2VLRotaryEmbedding, m2.apply_rotary_pos_emb, q, q, torch.zeros(3, 5, dtype=torch.long))


def test_rope_kwargs_config_forms():
    """The forms transformers 5 configs take: rope_parameters (also converted from legacy rope_theta /
    rope_scaling kwargs), a bare legacy object with rope_theta on the config, Qwen3 text (plain RoPE)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from transformers import Qwen2VLConfig, Qwen3Config

    assert packcuda.rope_kwargs_from_config(Qwen3Config()) == dict(rope_theta=10000.0, rotary_dim=128)
    assert packcuda.rope_kwargs_from_config(Qwen3Config(rope_theta=123.0))["rope_theta"] == 123.0
    legacy = Qwen2VLConfig(text_config=dict(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                                            rope_theta=1e6)).get_text_config()
    assert packcuda.rope_kwargs_from_config(legacy) == dict(rope_theta=1e6, rotary_dim=128,
                                                            mrope_section=[16, 24, 24], mrope_interleaved=False)
    bare = SimpleNamespace(model_type="llama", rope_theta=5e5, hidden_size=256, num_attention_heads=4,
                           rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    assert packcuda.rope_kwargs_from_config(bare) == dict(rope_theta=5e5, rotary_dim=64, mrope_section=[8, 12, 12],
                                                          mrope_interleaved=False)
    partial = SimpleNamespace(model_type="x", rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5),
                              head_dim=64)
    assert packcuda.rope_kwargs_from_config(partial) == dict(rope_theta=1e4, rotary_dim=32)
    # Qwen2/2.5-VL and Qwen3-VL rotary modules rotate the whole head whatever partial_rotary_factor says
    q3 = SimpleNamespace(model_type="qwen3_vl_text", head_dim=128,
                         rope_parameters=dict(rope_theta=5e6, partial_rotary_factor=0.5, mrope_section=[24, 20, 20]))
    assert packcuda.rope_kwargs_from_config(q3)["rotary_dim"] == 128
