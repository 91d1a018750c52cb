"""Bad-input cases: rotary application (rope.py and the apply_rope raw ops)."""
from types import SimpleNamespace

import torch

import packcuda
from catalogue import Case, call

ops = torch.ops.packcuda
F = packcuda.apply_rope
I = packcuda.apply_rope_
T, D = 5, 16


def qk(dtype=torch.float32, hq=2, hk=1, d=D, t=T):
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hk, d, generator=g).to(dtype)


def pos(t=T):
    return torch.arange(t)


def inv(rd=D):
    return packcuda.default_inv_freq(1e4, rd)


def fused(t=T, heads=4, d=D):
    return torch.randn(t, heads, d, generator=torch.Generator().manual_seed(1))


def grad_views():
    """q and k views of a non-leaf buffer that requires grad (the differentiable view path)."""
    x = torch.randn(T, 4 * D, requires_grad=True)
    buf = (x * 2).view(T, 4, D)
    return buf


def _k_int32_view():
    buf = grad_views()
    return call(I, buf[:, 0:2], torch.zeros(T, 1, D, dtype=torch.int32), pos(), rope_theta=1e4)


def _k_tokens_view():
    buf = grad_views()
    return call(I, buf[:, 0:2], buf[:4, 2:3], pos(), rope_theta=1e4)


def _k_head_dim_view():
    buf = grad_views()
    return call(I, buf[:, 0:2], buf[:, 2:3, :8], pos(), rope_theta=1e4)


def _k_float64_view():
    buf = grad_views()
    return call(I, buf[:, 0:2], torch.zeros(T, 1, D, dtype=torch.float64, requires_grad=True) * 1, pos(),
                rope_theta=1e4)


def _overlap_view():
    buf = grad_views()
    return call(I, buf[:, 0:2], buf[:, 1:3], pos(), rope_theta=1e4)


def _leaf_view():
    x = torch.randn(T, 4, D, requires_grad=True)
    return call(I, x[:, 0:2], x[:, 2:3], pos(), rope_theta=1e4)


def _positions_alias_q():
    buf = torch.zeros(T * 4 * D, dtype=torch.float32)
    q, k = buf[: T * 2 * D].view(T, 2, D), buf[T * 2 * D: T * 3 * D].view(T, 1, D)
    p = buf.view(torch.int32)[T * 2 * D - T:T * 2 * D]  # the last T elements of q, as int32
    return call(I, q, k, p, rope_theta=1e4)


def _inv_freq_alias_k():
    buf = fused()
    q, k = buf[:, 0:2], buf[:, 2:3]
    return call(I, q, k, pos(), inv_freq=buf[0, 2, : D // 2])


def _raw(fn, **over):
    q, k = qk()
    a = dict(q=q, k=k, positions=pos(), inv_freq=inv(), rotary_dim=D, mrope_section=[], mrope_interleaved=False,
             gptj=False, attention_scaling=1.0, inverse=False)
    a.update(over)
    return call(fn, *a.values())


def cfg(**kw):
    base = dict(model_type="qwen3_vl_text", head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=1e4))
    base.update(kw)
    return SimpleNamespace(**base)


def cfg_rp(**rp):
    return cfg(rope_parameters=dict(dict(rope_type="default", rope_theta=1e4), **rp))


def _fp(name, fn, make, **kw):
    return Case(f"packcuda.{fn.__name__}", name, make, **kw)


CASES = [
    # ---- packcuda.apply_rope: dtypes, shapes, strides, metadata, scalars
    _fp("q_not_tensor", F, lambda: call(F, [[1.0]], qk()[1], pos(), rope_theta=1e4), exc=TypeError, arg="q"),
    _fp("k_none", F, lambda: call(F, qk()[0], None, pos(), rope_theta=1e4), exc=TypeError, arg="k"),
    _fp("q_2d", F, lambda: call(F, torch.zeros(T, D), torch.zeros(T, D), pos(), rope_theta=1e4), arg="q"),
    _fp("q_int", F, lambda: call(F, *[x.long() for x in qk()], pos(), rope_theta=1e4), arg="q"),
    _fp("k_dtype_mismatch", F, lambda: call(F, qk()[0], qk()[1].double(), pos(), rope_theta=1e4), arg="k"),
    _fp("k_tokens", F, lambda: call(F, qk()[0], qk(t=4)[1], pos(), rope_theta=1e4), arg="tokens"),
    _fp("k_lead_dims_swapped", F, lambda: call(F, torch.zeros(2, 3, 4, 2, D), torch.zeros(3, 2, 4, 1, D),
                                               torch.arange(24), rope_theta=1e4), arg="tokens"),
    _fp("k_head_dim", F, lambda: call(F, qk()[0], qk(d=8)[1], pos(), rope_theta=1e4), arg="head_dim"),
    _fp("q_last_dim_strided", F, lambda: call(F, qk(d=2 * D)[0][..., ::2], qk()[1], pos(), rope_theta=1e4),
        arg="q must be contiguous"),
    _fp("positions_float_tensor", F, lambda: call(F, *qk(), pos().float() + 0.5, rope_theta=1e4), arg="positions"),
    _fp("positions_float_list", F, lambda: call(F, *qk(), [0.5, 1.5, 2.5, 3.5, 4.5], rope_theta=1e4),
        exc=TypeError, arg="positions"),
    _fp("positions_bool", F, lambda: call(F, *qk(), torch.ones(T, dtype=torch.bool), rope_theta=1e4),
        arg="positions"),
    _fp("positions_none", F, lambda: call(F, *qk(), None, rope_theta=1e4), exc=TypeError, arg="positions"),
    _fp("positions_ragged", F, lambda: call(F, *qk(), [[0, 1], [2]], rope_theta=1e4), exc=TypeError,
        arg="positions"),
    _fp("positions_tokens", F, lambda: call(F, *qk(), pos(4), rope_theta=1e4), arg="positions"),
    _fp("positions_rows", F, lambda: call(F, *qk(), torch.zeros(2, T, dtype=torch.long), rope_theta=1e4,
                                          mrope_section=[2, 3, 3]), arg="positions"),
    _fp("positions_batch_not_1", F, lambda: call(F, *qk(), torch.zeros(3, T, 1, dtype=torch.long), rope_theta=1e4,
                                                 mrope_section=[2, 3, 3]), arg="positions"),
    _fp("positions_plain_batch_not_1", F, lambda: call(F, *qk(), torch.zeros(T, 1, dtype=torch.long),
                                                       rope_theta=1e4), arg="positions"),
    _fp("positions_five_rows", F, lambda: call(F, *qk(), torch.zeros(5, 1, T, dtype=torch.long), rope_theta=1e4,
                                               mrope_section=[2, 3, 3]), arg="positions"),
    _fp("positions_rows_without_section", F, lambda: call(F, *qk(), torch.zeros(4, 1, T, dtype=torch.int32),
                                                          rope_theta=1e4), arg="positions"),
    _fp("positions_lead_shape", F, lambda: call(F, torch.zeros(2, 3, 4, 2, D), torch.zeros(2, 3, 4, 1, D),
                                                torch.zeros(4, 3, 2, dtype=torch.long), rope_theta=1e4),
        arg="positions"),
    _fp("theta_nan", F, lambda: call(F, *qk(), pos(), rope_theta=float("nan")), arg="rope_theta"),
    _fp("theta_zero", F, lambda: call(F, *qk(), pos(), rope_theta=0.0), arg="rope_theta"),
    _fp("theta_negative", F, lambda: call(F, *qk(), pos(), rope_theta=-1e4), arg="rope_theta"),
    _fp("theta_tiny", F, lambda: call(F, *qk(), pos(), rope_theta=1e-300), arg="rope_theta"),
    _fp("theta_str", F, lambda: call(F, *qk(), pos(), rope_theta="1e4"), exc=TypeError, arg="rope_theta"),
    _fp("no_theta_no_inv_freq", F, lambda: call(F, *qk(), pos()), arg="rope_theta"),
    _fp("rotary_dim_odd", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_dim=7), arg="rotary_dim"),
    _fp("rotary_dim_zero", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_dim=0), arg="rotary_dim"),
    _fp("rotary_dim_float", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_dim=8.0), exc=TypeError,
        arg="rotary_dim"),
    _fp("rotary_dim_bool", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_dim=True), exc=TypeError,
        arg="rotary_dim"),
    _fp("rotary_dim_above_head_dim", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_dim=18),
        arg="rotary_dim"),
    _fp("rotary_dim_huge", F, lambda: call(F, *qk(), pos(), inv_freq=inv(), rotary_dim=2**62), arg="rotary_dim"),
    _fp("inv_freq_list", F, lambda: call(F, *qk(), pos(), inv_freq=[1.0] * 8), exc=TypeError, arg="inv_freq"),
    _fp("inv_freq_float64", F, lambda: call(F, *qk(), pos(), inv_freq=inv().double()), arg="inv_freq"),
    _fp("inv_freq_entries", F, lambda: call(F, *qk(), pos(), inv_freq=inv(8), rotary_dim=16), arg="inv_freq"),
    _fp("inv_freq_2d", F, lambda: call(F, *qk(), pos(), inv_freq=inv().view(2, 4), rotary_dim=16),
        arg="inv_freq"),
    _fp("section_negative", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                            mrope_section=[10, -1, -1]), arg="mrope_section"),
    _fp("section_sum", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                       mrope_section=[2, 3, 2]), arg="mrope_section"),
    _fp("section_sum_zero", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                            mrope_section=[0, 0, 0]), arg="mrope_section"),
    _fp("section_count", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                         mrope_section=[4, 4]), arg="mrope_section"),
    _fp("section_float", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                         mrope_section=[2.5, 3, 2.5]), exc=TypeError, arg="mrope_section"),
    _fp("section_str", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                       mrope_section="233"), exc=TypeError, arg="mrope_section"),
    _fp("section_overflow", F, lambda: call(F, *qk(), torch.zeros(3, T, dtype=torch.long), rope_theta=1e4,
                                            mrope_section=[2**62, 2**62, 2**62]), arg="mrope_section"),
    _fp("interleaved_without_section", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, mrope_interleaved=True),
        arg="mrope_interleaved"),
    _fp("interleaved_not_bool", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, mrope_interleaved="yes"),
        exc=TypeError, arg="mrope_interleaved"),
    _fp("style", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_style="half"), arg="rotary_style"),
    _fp("style_unhashable", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, rotary_style=["neox"]),
        arg="rotary_style"),
    _fp("scaling_nan", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, attention_scaling=float("nan")),
        arg="attention_scaling"),
    _fp("scaling_inf", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, attention_scaling=float("inf")),
        arg="attention_scaling"),
    _fp("scaling_str", F, lambda: call(F, *qk(), pos(), rope_theta=1e4, attention_scaling="1"), exc=TypeError,
        arg="attention_scaling"),
    _fp("positions_meta_q_cuda", F, cuda=True, arg="positions",
        make=lambda: call(F, *[x.cuda() for x in qk()], pos().to("meta"), inv_freq=inv().cuda())),
    _fp("k_on_other_cuda", F, cuda=True, arg="k",  # index-less "cuda" is the current device, k is elsewhere
        make=lambda: call(F, qk()[0].to("cuda"), qk()[1].to(f"cuda:{torch.cuda.device_count() - 1}"), pos(),
                          rope_theta=1e4) if torch.cuda.device_count() > 1 else call(F, qk()[0].to("cuda"),
                                                                                     qk()[1], pos(), rope_theta=1e4)),
    _fp("inv_freq_cuda_q_cpu", F, cuda=True, arg="inv_freq",
        make=lambda: call(F, *qk(), pos(), inv_freq=inv().to("cuda"))),
    _fp("positions_cuda_q_cpu", F, cuda=True, arg="positions",
        make=lambda: call(F, *qk(), pos().to("cuda"), rope_theta=1e4)),

    # ---- packcuda.apply_rope_: everything checked before any write, on every path
    _fp("k_tokens", I, lambda: call(I, *(lambda a: (a[0], a[1][:4]))(qk()), pos(), rope_theta=1e4),
        arg="tokens"),
    _fp("view_path_k_int32", I, _k_int32_view, arg="k"),
    _fp("view_path_k_tokens", I, _k_tokens_view, arg="tokens"),
    _fp("view_path_k_head_dim", I, _k_head_dim_view, arg="head_dim"),
    _fp("view_path_k_float64", I, _k_float64_view, arg="k"),
    _fp("view_path_overlap", I, _overlap_view, arg="overlap"),
    _fp("view_path_positions_short", I, lambda: call(I, grad_views()[:, 0:2], grad_views()[:, 2:3], pos(3),
                                                     rope_theta=1e4), arg="positions"),
    _fp("leaf_requires_grad", I, lambda: call(I, *[x.requires_grad_() for x in qk()], pos(), rope_theta=1e4),
        arg="leaf"),
    _fp("view_of_leaf_requires_grad", I, _leaf_view, arg="leaf"),
    _fp("same_tensor", I, lambda: (lambda q: call(I, q, q, pos(), rope_theta=1e4))(qk()[0]), arg="overlap"),
    _fp("overlapping_views", I, lambda: (lambda b: call(I, b[:, 0:2], b[:, 1:3], pos(), rope_theta=1e4))(fused()),
        arg="overlap"),
    _fp("overlapping_views_4d", I, lambda: (lambda b: call(I, b[:, :, 0:2], b[:, :, 1:2], torch.zeros(2, 3).long(),
                                                           rope_theta=1e4))(torch.zeros(2, 3, 4, D)),
        arg="overlap"),
    _fp("q_expanded", I, lambda: call(I, torch.zeros(1, 2, D).expand(T, 2, D), qk()[1], pos(), rope_theta=1e4),
        arg="stride 0"),
    _fp("k_expanded_heads", I, lambda: call(I, qk()[0], torch.zeros(T, 1, D).expand(T, 3, D), pos(),
                                            rope_theta=1e4), arg="stride 0"),
    _fp("q_self_overlap", I, lambda: call(I, torch.zeros(64 * T).as_strided((T, 2, D), (D, D // 2, 1)), qk()[1],
                                          pos(), rope_theta=1e4), arg="overlaps itself"),
    _fp("positions_alias_q", I, _positions_alias_q, arg="positions"),
    _fp("inv_freq_alias_k", I, _inv_freq_alias_k, arg="inv_freq"),
    _fp("theta_nan", I, lambda: call(I, *qk(), pos(), rope_theta=float("nan")), arg="rope_theta"),
    _fp("positions_float_list", I, lambda: call(I, *qk(), [0.5, 1, 2, 3, 4], rope_theta=1e4), exc=TypeError,
        arg="positions"),
    _fp("scaling_nan", I, lambda: call(I, *qk(), pos(), rope_theta=1e4, attention_scaling=float("nan")),
        arg="attention_scaling"),
    _fp("section_float", I, lambda: call(I, *qk(), torch.zeros(3, T).long(), rope_theta=1e4,
                                         mrope_section=[2, 3.0, 3]), exc=TypeError, arg="mrope_section"),
    _fp("not_flattenable", I, lambda: call(I, torch.zeros(2, 3, 4, 2, D).transpose(0, 1),
                                           torch.zeros(3, 2, 4, 1, D), torch.arange(24), rope_theta=1e4),
        arg="flattened"),
    _fp("cuda_q_cpu_k", I, cuda=True, arg="k",
        make=lambda: call(I, qk()[0].cuda(), qk()[1], pos(), rope_theta=1e4)),
    _fp("cuda_inv_freq_float64", I, cuda=True, arg="inv_freq",
        make=lambda: call(I, *[x.to("cuda") for x in qk()], pos(), inv_freq=inv().to("cuda").double())),

    # ---- packcuda.default_inv_freq
    _fp("theta_nan", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, float("nan"), 16),
        arg="rope_theta"),
    _fp("theta_zero", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 0.0, 16),
        arg="rope_theta"),
    _fp("theta_negative", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, -2.0, 16),
        arg="rope_theta"),
    _fp("theta_inf", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, float("inf"), 16),
        arg="rope_theta"),
    _fp("theta_subnormal", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e-45, 16),
        arg="rope_theta"),
    _fp("theta_none", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, None, 16),
        exc=TypeError, arg="rope_theta"),
    _fp("rotary_dim_odd", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e4, 7),
        arg="rotary_dim"),
    _fp("rotary_dim_zero", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e4, 0),
        arg="rotary_dim"),
    _fp("rotary_dim_negative", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e4, -4),
        arg="rotary_dim"),
    _fp("rotary_dim_float", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e4, 16.0),
        exc=TypeError, arg="rotary_dim"),
    _fp("rotary_dim_huge", packcuda.default_inv_freq, lambda: call(packcuda.default_inv_freq, 1e4, 2**40),
        arg="rotary_dim"),

    # ---- packcuda.rope_kwargs_from_config
    _fp("none", packcuda.rope_kwargs_from_config, lambda: call(packcuda.rope_kwargs_from_config, None),
        exc=TypeError, arg="config"),
    _fp("no_rope_parameters", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, SimpleNamespace(model_type="qwen3", head_dim=8)),
        arg="rope_theta"),
    _fp("rope_parameters_not_dict", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(rope_parameters=[1e4])), exc=TypeError,
        arg="rope_parameters"),
    _fp("nested_per_layer", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(rope_parameters=dict(
            full_attention=dict(rope_theta=1e4), sliding_attention=dict(rope_theta=1e4)))), arg="rope_parameters"),
    _fp("rope_type", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(rope_type="yarn")), arg="rope_type"),
    _fp("theta_nan", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(rope_theta=float("nan"))), arg="rope_theta"),
    _fp("theta_zero", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(rope_theta=0)), arg="rope_theta"),
    _fp("theta_negative", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(rope_theta=-1.0)), arg="rope_theta"),
    _fp("no_head_dim", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(head_dim=None)), arg="head_dim"),
    _fp("head_dim_float", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(head_dim=8.5)), exc=TypeError, arg="head_dim"),
    _fp("heads_zero", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(head_dim=None, hidden_size=64, num_attention_heads=0)),
        arg="num_attention_heads"),
    _fp("odd_rotary_dim", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(model_type="llama", head_dim=7)), arg="rotary_dim"),
    _fp("partial_factor_zero", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(model_type="qwen3_5_text", head_dim=64,
                                                           rope_parameters=dict(rope_theta=1e4,
                                                                                partial_rotary_factor=0.0))),
        arg="partial_rotary_factor"),
    _fp("partial_factor_nan", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(model_type="llama", rope_parameters=dict(
            rope_theta=1e4, partial_rotary_factor=float("nan")))), arg="partial_rotary_factor"),
    _fp("section_negative", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(mrope_section=[4, -1, 1])), arg="mrope_section"),
    _fp("section_float", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(mrope_section=[2, 1.0, 1])), exc=TypeError,
        arg="mrope_section"),
    _fp("section_count", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(mrope_section=[2, 2])), arg="mrope_section"),
    _fp("section_not_list", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg_rp(mrope_section=4)), exc=TypeError,
        arg="mrope_section"),
    _fp("sectioned_sum", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(model_type="qwen2_vl_text", rope_parameters=dict(
            rope_theta=1e4, mrope_section=[16, 8, 8]))), arg="mrope_section"),
    _fp("interleaved_flag_not_bool", packcuda.rope_kwargs_from_config,
        lambda: call(packcuda.rope_kwargs_from_config, cfg(model_type="llama", rope_parameters=dict(
            rope_theta=1e4, mrope_section=[2, 1, 1], mrope_interleaved="true"))), exc=TypeError,
        arg="mrope_interleaved"),

    # ---- raw ops
    Case("ops.apply_rope", "q_2d", lambda: _raw(ops.apply_rope, q=torch.zeros(T, D)), arg="q"),
    Case("ops.apply_rope", "k_head_dim", lambda: _raw(ops.apply_rope, k=qk(d=8)[1]), arg="head_dim"),
    Case("ops.apply_rope", "k_dtype", lambda: _raw(ops.apply_rope, k=qk()[1].double()), arg="k"),
    Case("ops.apply_rope", "positions_float", lambda: _raw(ops.apply_rope, positions=pos().float()),
         arg="positions"),
    Case("ops.apply_rope", "positions_tokens", lambda: _raw(ops.apply_rope, positions=pos(4)), arg="positions"),
    Case("ops.apply_rope", "inv_freq_entries", lambda: _raw(ops.apply_rope, inv_freq=inv(8)), arg="inv_freq"),
    Case("ops.apply_rope", "inv_freq_int", lambda: _raw(ops.apply_rope, inv_freq=torch.ones(8, dtype=torch.int32)),
         arg="inv_freq"),
    Case("ops.apply_rope", "rotary_dim_odd", lambda: _raw(ops.apply_rope, rotary_dim=7), arg="rotary_dim"),
    Case("ops.apply_rope", "rotary_dim_negative", lambda: _raw(ops.apply_rope, rotary_dim=-2), arg="rotary_dim"),
    Case("ops.apply_rope", "rotary_dim_huge", lambda: _raw(ops.apply_rope, rotary_dim=2**62), arg="rotary_dim"),
    Case("ops.apply_rope", "section_overflow", lambda: _raw(ops.apply_rope, positions=torch.zeros(3, T).long(),
                                                            mrope_section=[2**62, 2**62, 2**62]),
         arg="mrope_section"),
    Case("ops.apply_rope", "section_negative", lambda: _raw(ops.apply_rope, positions=torch.zeros(3, T).long(),
                                                            mrope_section=[10, -1, -1]), arg="mrope_section"),
    Case("ops.apply_rope", "section_count", lambda: _raw(ops.apply_rope, positions=torch.zeros(3, T).long(),
                                                         mrope_section=[8]), arg="mrope_section"),
    Case("ops.apply_rope", "scaling_nan", lambda: _raw(ops.apply_rope, attention_scaling=float("nan")),
         arg="attention_scaling"),
    Case("ops.apply_rope", "interleaved_no_section", lambda: _raw(ops.apply_rope, mrope_interleaved=True),
         arg="mrope_interleaved"),
    Case("ops.apply_rope", "positions_four_rows_tokens", arg="positions",
         make=lambda: _raw(ops.apply_rope, positions=torch.zeros(4, 1, T - 1, dtype=torch.int32),
                           mrope_section=[2, 3, 3])),
    Case("ops.apply_rope", "positions_cuda_q_cpu", cuda=True, arg="positions",
         make=lambda: _raw(ops.apply_rope, positions=pos().cuda())),
    Case("ops.apply_rope_", "k_tokens", lambda: _raw(ops.apply_rope_, k=qk(t=4)[1]), arg="tokens"),
    Case("ops.apply_rope_", "k_int32", lambda: _raw(ops.apply_rope_, k=torch.zeros(T, 1, D, dtype=torch.int32)),
         arg="k"),
    Case("ops.apply_rope_", "same_tensor", lambda: (lambda q: _raw(ops.apply_rope_, q=q, k=q))(qk()[0]),
         arg="overlap"),
    Case("ops.apply_rope_", "overlapping_views", arg="overlap",
         make=lambda: (lambda b: _raw(ops.apply_rope_, q=b[:, 0:2], k=b[:, 1:3]))(fused())),
    Case("ops.apply_rope_", "overlap_other_token", arg="overlap",  # k's token t is q's token t + 1
         make=lambda: (lambda b: _raw(ops.apply_rope_, q=b[0:T, 0:2], k=b[1:T + 1, 0:1]))(fused(t=T + 1))),
    Case("ops.apply_rope_", "q_expanded", arg="stride 0",
         make=lambda: _raw(ops.apply_rope_, q=torch.zeros(T, 1, D).expand(T, 2, D))),
    Case("ops.apply_rope_", "q_self_overlap", arg="overlaps itself",
         make=lambda: _raw(ops.apply_rope_, q=torch.zeros(64 * T).as_strided((T, 2, D), (D, D // 2, 1)))),
    Case("ops.apply_rope_", "inv_freq_alias_q", arg="inv_freq",
         make=lambda: (lambda q: _raw(ops.apply_rope_, q=q, inv_freq=q[0, 1, : D // 2]))(qk()[0])),
    Case("ops.apply_rope_", "positions_alias_k", arg="positions",
         make=lambda: (lambda k: _raw(ops.apply_rope_, k=k, positions=k.view(torch.int32).view(-1)[:T]))(qk()[1])),
    Case("ops.apply_rope_", "section_sum", arg="mrope_section",
         make=lambda: _raw(ops.apply_rope_, positions=torch.zeros(3, T).long(), mrope_section=[1, 1, 1])),
]


# ---- packcuda.apply_qk_norm_rope / apply_qk_norm_rope_ and their raw ops
N = packcuda.apply_qk_norm_rope
NI = packcuda.apply_qk_norm_rope_


def w(d=D, dtype=torch.float32):
    return torch.ones(d, dtype=dtype)


def _n(fn, *args, **over):
    q, k = qk()
    a = dict(q_weight=w(), k_weight=w(), rope_theta=1e4)
    a.update(over)
    return call(fn, *(args or (q, k, pos())), **a)


def _nraw(fn, **over):
    q, k = qk()
    a = dict(q=q, k=k, positions=pos(), inv_freq=inv(), q_weight=w(), k_weight=w(), eps=1e-6, norm="rms",
             rotary_dim=D, mrope_section=[], mrope_interleaved=False, gptj=False, attention_scaling=1.0)
    a.update(over)
    return call(fn, *a.values())


def _nraw_bwd(**over):
    q, k = qk()
    a = dict(grad_q=torch.ones_like(q), grad_k=torch.ones_like(k), q=q, k=k, positions=pos(), inv_freq=inv(),
             q_weight=w(), k_weight=w(), eps=1e-6, norm="rms", rotary_dim=D, mrope_section=[],
             mrope_interleaved=False, gptj=False, attention_scaling=1.0)
    a.update(over)
    return call(ops.apply_qk_norm_rope_backward, *a.values())


def _ni_weight_alias_q():
    q, k = qk()
    return call(NI, q, k, pos(), q_weight=q[0, 0], k_weight=w(), rope_theta=1e4)


def _ni_grad_views_weight_wrong():
    buf = grad_views()
    return call(NI, buf[:, 0:2], buf[:, 2:3], pos(), q_weight=w(8), k_weight=w(), rope_theta=1e4)


CASES += [
    _fp("q_weight_missing_tensor", N, lambda: _n(N, q_weight=[1.0] * D), exc=TypeError, arg="q_weight"),
    _fp("k_weight_none", N, lambda: _n(N, k_weight=None), exc=TypeError, arg="k_weight"),
    _fp("q_weight_shape", N, lambda: _n(N, q_weight=w(8)), arg="q_weight"),
    _fp("k_weight_2d", N, lambda: _n(N, k_weight=w().view(2, 8)), arg="k_weight"),
    _fp("q_weight_int", N, lambda: _n(N, q_weight=torch.ones(D, dtype=torch.int32)), arg="q_weight"),
    _fp("q_weight_float64", N, lambda: _n(N, q_weight=w(dtype=torch.float64)), arg="q_weight"),
    _fp("weights_dtype_mismatch", N, lambda: _n(N, *(x.bfloat16() for x in qk()), pos(), q_weight=w(),
                                                k_weight=w(dtype=torch.bfloat16)), arg="k_weight"),
    _fp("weight_meta", N, lambda: _n(N, q_weight=w().to("meta")), arg="q_weight"),
    _fp("eps_nan", N, lambda: _n(N, eps=float("nan")), arg="eps"),
    _fp("eps_inf", N, lambda: _n(N, eps=float("inf")), arg="eps"),
    _fp("eps_negative", N, lambda: _n(N, eps=-1e-6), arg="eps"),
    _fp("eps_str", N, lambda: _n(N, eps="1e-6"), exc=TypeError, arg="eps"),
    _fp("eps_bool", N, lambda: _n(N, eps=True), exc=TypeError, arg="eps"),
    _fp("norm_unknown", N, lambda: _n(N, norm="layer"), arg="norm"),
    _fp("norm_int", N, lambda: _n(N, norm=0), exc=TypeError, arg="norm"),
    _fp("head_dim_too_large", N, lambda: _n(N, *qk(d=520), pos(), q_weight=w(520), k_weight=w(520)),
        arg="head_dim"),
    _fp("gptj_odd_head_dim", N, lambda: _n(N, *qk(d=9), pos(), q_weight=w(9), k_weight=w(9), rotary_dim=8,
                                           rotary_style="gptj"), arg="head_dim"),
    _fp("q_int", N, lambda: _n(N, *[x.long() for x in qk()], pos()), arg="q"),
    _fp("k_dtype_mismatch", N, lambda: _n(N, qk()[0], qk()[1].double(), pos()), arg="k"),
    _fp("k_tokens", N, lambda: _n(N, qk()[0], qk(t=4)[1], pos()), arg="tokens"),
    _fp("q_last_dim_strided", N, lambda: _n(N, qk(d=2 * D)[0][..., ::2], qk()[1], pos()), arg="q must be contiguous"),
    _fp("positions_float", N, lambda: _n(N, *qk(), pos().float()), arg="positions"),
    _fp("positions_tokens", N, lambda: _n(N, *qk(), pos(4)), arg="positions"),
    _fp("rotary_dim_odd", N, lambda: _n(N, rotary_dim=7), arg="rotary_dim"),
    _fp("section_sum", N, lambda: _n(N, *qk(), torch.zeros(3, T).long(), mrope_section=[2, 3, 2]),
        arg="mrope_section"),
    _fp("scaling_nan", N, lambda: _n(N, attention_scaling=float("nan")), arg="attention_scaling"),
    _fp("style", N, lambda: _n(N, rotary_style="half"), arg="rotary_style"),
    _fp("no_theta", N, lambda: _n(N, rope_theta=None), arg="rope_theta"),
    _fp("weight_cuda_q_cpu", N, cuda=True, arg="q_weight", make=lambda: _n(N, q_weight=w().cuda())),
    _fp("weight_cpu_q_cuda", N, cuda=True, arg="k_weight",
        make=lambda: _n(N, *[x.cuda() for x in qk()], pos(), q_weight=w().cuda(), k_weight=w())),

    _fp("q_weight_shape", NI, lambda: _n(NI, q_weight=w(8)), arg="q_weight"),
    _fp("eps_nan", NI, lambda: _n(NI, eps=float("nan")), arg="eps"),
    _fp("norm_unknown", NI, lambda: _n(NI, norm="rms_gated"), arg="norm"),
    _fp("same_tensor", NI, lambda: (lambda q: _n(NI, q, q, pos()))(qk()[0]), arg="overlap"),
    _fp("overlapping_views", NI, lambda: (lambda b: _n(NI, b[:, 0:2], b[:, 1:3], pos()))(fused()), arg="overlap"),
    _fp("q_expanded", NI, lambda: _n(NI, torch.zeros(1, 2, D).expand(T, 2, D), qk()[1], pos()), arg="stride 0"),
    _fp("q_weight_alias_q", NI, _ni_weight_alias_q, arg="q_weight"),
    _fp("leaf_requires_grad", NI, lambda: _n(NI, *[x.requires_grad_() for x in qk()], pos()), arg="leaf"),
    _fp("view_of_leaf_requires_grad", NI, lambda: (lambda x: _n(NI, x[:, 0:2], x[:, 2:3], pos()))(
        torch.randn(T, 4, D, requires_grad=True)), arg="leaf"),
    _fp("view_path_weight_shape", NI, _ni_grad_views_weight_wrong, arg="q_weight"),
    _fp("view_path_overlap", NI, lambda: (lambda b: _n(NI, b[:, 0:2], b[:, 1:3], pos()))(grad_views()),
        arg="overlap"),
    _fp("positions_float_list", NI, lambda: _n(NI, *qk(), [0.5, 1, 2, 3, 4]), exc=TypeError, arg="positions"),
    _fp("not_flattenable", NI, lambda: _n(NI, torch.zeros(2, 3, 4, 2, D).transpose(0, 1), torch.zeros(3, 2, 4, 1, D),
                                          torch.arange(24)), arg="flattened"),

    Case("ops.apply_qk_norm_rope", "q_2d", lambda: _nraw(ops.apply_qk_norm_rope, q=torch.zeros(T, D)), arg="q"),
    Case("ops.apply_qk_norm_rope", "q_weight_shape", lambda: _nraw(ops.apply_qk_norm_rope, q_weight=w(8)),
         arg="q_weight"),
    Case("ops.apply_qk_norm_rope", "k_weight_dtype",
         lambda: _nraw(ops.apply_qk_norm_rope, k_weight=torch.ones(D).long()), arg="k_weight"),
    Case("ops.apply_qk_norm_rope", "weights_mixed",
         lambda: _nraw(ops.apply_qk_norm_rope, q=qk()[0].double(), k=qk()[1].double(),
                       k_weight=w(dtype=torch.float64)), arg="k_weight"),
    Case("ops.apply_qk_norm_rope", "eps_nan", lambda: _nraw(ops.apply_qk_norm_rope, eps=float("nan")), arg="eps"),
    Case("ops.apply_qk_norm_rope", "eps_negative", lambda: _nraw(ops.apply_qk_norm_rope, eps=-1.0), arg="eps"),
    Case("ops.apply_qk_norm_rope", "norm_kind", lambda: _nraw(ops.apply_qk_norm_rope, norm="layer"), arg="norm"),
    Case("ops.apply_qk_norm_rope", "head_dim_too_large", arg="head_dim",
         make=lambda: _nraw(ops.apply_qk_norm_rope, q=qk(d=514)[0], k=qk(d=514)[1], q_weight=w(514),
                            k_weight=w(514))),
    Case("ops.apply_qk_norm_rope", "rotary_dim_odd", lambda: _nraw(ops.apply_qk_norm_rope, rotary_dim=7),
         arg="rotary_dim"),
    Case("ops.apply_qk_norm_rope", "positions_tokens", lambda: _nraw(ops.apply_qk_norm_rope, positions=pos(4)),
         arg="positions"),
    Case("ops.apply_qk_norm_rope", "weight_cuda_q_cpu", cuda=True, arg="q_weight",
         make=lambda: _nraw(ops.apply_qk_norm_rope, q_weight=w().cuda())),
    Case("ops.apply_qk_norm_rope_", "same_tensor",
         lambda: (lambda q: _nraw(ops.apply_qk_norm_rope_, q=q, k=q))(qk()[0]), arg="overlap"),
    Case("ops.apply_qk_norm_rope_", "k_weight_alias_k", arg="k_weight",
         make=lambda: (lambda k: _nraw(ops.apply_qk_norm_rope_, k=k, k_weight=k[1, 0]))(qk()[1])),
    Case("ops.apply_qk_norm_rope_", "q_weight_shape", lambda: _nraw(ops.apply_qk_norm_rope_, q_weight=w(4)),
         arg="q_weight"),
    Case("ops.apply_qk_norm_rope_", "eps_inf", lambda: _nraw(ops.apply_qk_norm_rope_, eps=float("inf")), arg="eps"),
    Case("ops.apply_qk_norm_rope_", "q_expanded", arg="stride 0",
         make=lambda: _nraw(ops.apply_qk_norm_rope_, q=torch.zeros(T, 1, D).expand(T, 2, D))),
    Case("ops.apply_qk_norm_rope_backward", "grad_q_shape", lambda: _nraw_bwd(grad_q=torch.ones(T, 1, D)),
         arg="grad_q"),
    Case("ops.apply_qk_norm_rope_backward", "grad_k_dtype", lambda: _nraw_bwd(grad_k=torch.ones(T, 1, D).double()),
         arg="grad_k"),
    Case("ops.apply_qk_norm_rope_backward", "grad_q_last_dim_strided", arg="grad_q",
         make=lambda: _nraw_bwd(grad_q=torch.ones(T, 2, 2 * D)[..., ::2])),
    Case("ops.apply_qk_norm_rope_backward", "q_weight_shape", lambda: _nraw_bwd(q_weight=w(8)), arg="q_weight"),
    Case("ops.apply_qk_norm_rope_backward", "eps_nan", lambda: _nraw_bwd(eps=float("nan")), arg="eps"),
    Case("ops.apply_qk_norm_rope_backward", "grad_cuda_q_cpu", cuda=True, arg="grad_q",
         make=lambda: _nraw_bwd(grad_q=torch.ones(T, 2, D).cuda())),
]
