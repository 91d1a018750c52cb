"""Fused rotary position embeddings: 1D RoPE and mRoPE (sectioned, interleaved, partial) applied to q and k
in one pass, forward and backward, out of place or in place."""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Optional, Sequence, Tuple

import torch

from . import _lib
from ._families import rotary_family
from ._meta import INT64_MAX, INT64_MIN, check_float, check_int, fake_kernel

_lib.load()
ops = torch.ops.packcuda

__all__ = ["apply_rope", "apply_rope_", "apply_qk_norm_rope", "apply_qk_norm_rope_", "default_inv_freq",
           "rope_kwargs_from_config"]

_STYLES = {"neox": False, "gptj": True}


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
@fake_kernel("apply_rope", host=["positions", "inv_freq"])
def _apply_rope_fake(q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved=False, gptj=False,
                     attention_scaling=1.0, inverse=False):
    return torch.empty_like(q), torch.empty_like(k)


@fake_kernel("apply_rope_", host=["positions", "inv_freq"])
def _apply_rope_inplace_fake(q, k, positions, inv_freq, rotary_dim, mrope_section, mrope_interleaved=False,
                             gptj=False, attention_scaling=1.0, inverse=False):
    return None


@fake_kernel("apply_qk_norm_rope", host=["positions", "inv_freq"])
def _qk_norm_rope_fake(q, k, positions, inv_freq, q_weight, k_weight, eps, norm, rotary_dim, mrope_section,
                       mrope_interleaved=False, gptj=False, attention_scaling=1.0):
    return torch.empty_like(q), torch.empty_like(k)


@fake_kernel("apply_qk_norm_rope_", host=["positions", "inv_freq"])
def _qk_norm_rope_inplace_fake(q, k, positions, inv_freq, q_weight, k_weight, eps, norm, rotary_dim, mrope_section,
                               mrope_interleaved=False, gptj=False, attention_scaling=1.0):
    return None


@fake_kernel("apply_qk_norm_rope_backward", host=["positions", "inv_freq"])
def _qk_norm_rope_backward_fake(grad_q, grad_k, q, k, positions, inv_freq, q_weight, k_weight, eps, norm,
                                rotary_dim, mrope_section, mrope_interleaved=False, gptj=False,
                                attention_scaling=1.0):
    D = q.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), q.new_empty(D, dtype=q_weight.dtype),
            q.new_empty(D, dtype=q_weight.dtype))


# ---------------------------------------------------------------------------------------------------
# autograd, written once per op: one setup and one backward, registered for the op (torch.compile) and used by
# the facade's eager path (packcuda._lib.EagerOp). The backward of a rotation by angle a is the rotation by -a
# (it saves only the positions and the frequencies, never activations); the QK-norm backward reads the forward's
# inputs and the incoming gradients once, recomputes the row statistics and reduces the weight gradients in a
# fixed order.
# ---------------------------------------------------------------------------------------------------
def _last_dim_contiguous(g: torch.Tensor) -> torch.Tensor:
    return g if g.stride(-1) == 1 or g.shape[-1] <= 1 else g.contiguous()


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])  # positions, inv_freq
    ctx.cfg = inputs[4:]  # rotary_dim, section, interleaved, gptj, scaling, inverse


def _rope_backward(ctx, gq, gk):
    positions, inv_freq = ctx.saved_tensors
    rotary_dim, section, interleaved, gptj, scaling, inverse = ctx.cfg
    dq, dk = _rope_call(_last_dim_contiguous(gq), _last_dim_contiguous(gk), positions, inv_freq, rotary_dim,
                        section, interleaved, gptj, scaling, not inverse)
    return dq, dk, None, None, None, None, None, None, None, None


_ROPE = _lib.EagerOp(ops.apply_rope, _rope_setup, _rope_backward, differentiable=(0, 1))


def _rope_call(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, inverse):
    """ops.apply_rope with its autograd, without the Python autograd kernel's overhead in eager mode."""
    return _ROPE(q.requires_grad or k.requires_grad, q, k, positions, inv_freq, rotary_dim, section, interleaved,
                 gptj, scaling, inverse)


def _qk_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])  # q, k, positions, inv_freq, q_weight, k_weight
    ctx.cfg = inputs[6:]  # eps, norm, rotary_dim, section, interleaved, gptj, scaling


_QK_NORM_GRADS = _lib.EagerOp(ops.apply_qk_norm_rope_backward)  # (no autograd of its own: no double backward)


def _qk_norm_grads(gq, gk, q, k, positions, inv_freq, wq, wk, cfg):
    """(dq, dk, dq_weight, dk_weight) of the norm + rotation (the op writes the weight gradients in the weights'
    dtype)."""
    gq, gk = _last_dim_contiguous(gq), _last_dim_contiguous(gk)
    return _QK_NORM_GRADS(gq.requires_grad or gk.requires_grad, gq, gk, q, k, positions, inv_freq, wq, wk, *cfg)


def _qk_norm_backward(ctx, gq, gk):
    dq, dk, dwq, dwk = _qk_norm_grads(gq, gk, *ctx.saved_tensors, ctx.cfg)
    return dq, dk, None, None, dwq, dwk, None, None, None, None, None, None, None


_QK_NORM = _lib.EagerOp(ops.apply_qk_norm_rope, _qk_norm_setup, _qk_norm_backward, differentiable=(0, 1, 4, 5))


class _InPlace(torch.autograd.Function):
    """One of the two tensors an in-place op on q and k modifies: ``x``, marked dirty and returned. The Function
    of q runs the op (``run``: one call for both, everything checked before anything is written); the Function of
    k only marks k (autograd lets a Function that modifies views in place return one tensor). The backward is
    ``back(g, *saved, *cfg) -> (dx, dw)``, ``dw`` the gradient of ``w`` (None without a weight)."""

    @staticmethod
    def forward(ctx, x, w, run, back, saved, cfg):
        if run is not None:
            run()
        ctx.mark_dirty(x)
        ctx.save_for_backward(*saved)
        ctx.back, ctx.cfg = back, cfg
        return x

    @staticmethod
    def backward(ctx, g):
        dx, dw = ctx.back(g, *ctx.saved_tensors, *ctx.cfg)
        return dx, dw, None, None, None, None


def _in_place(q, k, wq, wk, run, back, saved_q, saved_k, cfg):
    return (_InPlace.apply(q, wq, run, back, saved_q, cfg), _InPlace.apply(k, wk, None, back, saved_k, cfg))


def _rotate_back(g, positions, inv_freq, *cfg):
    """(dx, None) of one tensor rotated in place: g rotated by the negated angle."""
    g = _last_dim_contiguous(g)
    return _rope_call(g, g.narrow(-2, 0, 0), positions, inv_freq, *cfg, True)[0], None


def _norm_back(g, x, positions, inv_freq, w, *cfg):
    """(dx, dw) of one tensor normalized and rotated in place, from its saved input x."""
    dx, _, dw, _ = _qk_norm_grads(g, g.narrow(-2, 0, 0), x, x.narrow(-2, 0, 0), positions, inv_freq, w, w, cfg)
    return dx, dw


# ---------------------------------------------------------------------------------------------------
# facade: it checks only what the op cannot see (Python types, list conversion, the frequencies it computes,
# flattening); the op checks everything else before it writes anything, with messages naming the function
# ---------------------------------------------------------------------------------------------------
_INV_FREQ_CACHE: dict = {}


def default_inv_freq(rope_theta: float, rotary_dim: int) -> torch.Tensor:
    """The default rotary frequencies, bit-identical to a transformers model's ``inv_freq`` buffer.

    ``1 / rope_theta ** (arange(0, rotary_dim, 2) / rotary_dim)``, computed with the same float32 torch ops, in
    the same order, as transformers' default rope init.

    Args:
        rope_theta: a finite number > 0 whose frequencies are finite in fp32.
        rotary_dim: an even integer in [2, 8192].

    Returns:
        fp32 ``[rotary_dim // 2]`` on the CPU.
    """
    op = "default_inv_freq"
    return _frequencies(op, _theta(op, rope_theta), _check_rotary_dim(op, rotary_dim))


def _check_rotary_dim(op, rotary_dim, name="rotary_dim") -> int:
    """rotary_dim where no op sees it (frequencies, configs): an even integer in [2, the op's largest]."""
    rd = check_int(op, name, rotary_dim, lo=2, hi=ops.rope_max_rotary_dim())
    if rd % 2:
        raise ValueError(f"packcuda.{op}: {name} must be a positive even number, got {rd}")
    return rd


def _theta(op, rope_theta) -> float:
    if type(rope_theta) is float and 0.0 < rope_theta < math.inf:
        return rope_theta
    return check_float(op, "rope_theta", rope_theta, lo=0.0, lo_open=True)


def _frequencies(op, theta, rd) -> torch.Tensor:
    t = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"packcuda.{op}: rope_theta={theta} gives non-finite fp32 frequencies (1 / rope_theta "
                         "overflows fp32)")
    return t


def _inv_freq_for(op, theta, rd, device) -> torch.Tensor:
    """The frequencies of (theta, rd) on ``device``, computed and uploaded once (no sync)."""
    if torch.compiler.is_compiling():
        return _frequencies(op, theta, rd)
    key = (theta, rd, device)
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = _frequencies(op, theta, rd)
        if device.type != "cpu":
            t = t.to(device, non_blocking=True)
        _INV_FREQ_CACHE[key] = t
    return t


def _is_bool(v) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # Python or numpy bool


def _real(op, name, v) -> float:
    """A real-number argument as a float (its range is the op's to check); bools and non-numbers are a
    TypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"packcuda.{op}: {name} must be a real number, got {v!r} ({type(v).__name__})")
    try:
        return float(v)
    except OverflowError as e:
        raise ValueError(f"packcuda.{op}: {name}={v} is out of the range of a float") from e


def _positions_tensor(op, positions) -> torch.Tensor:
    """Positions given as a (nested) list of integers, as a tensor: floats (or bools) are refused, never
    truncated. (The dtype of a tensor is the op's to check.)"""
    if positions is None or isinstance(positions, (str, bytes, numbers.Number)):
        raise TypeError(f"packcuda.{op}: positions must be an integer tensor or a (nested) list of integers, "
                        f"got {type(positions).__name__}")
    try:
        t = torch.as_tensor(positions)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"packcuda.{op}: positions must be an integer tensor or a (nested) list of integers "
                        f"({e})") from e
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"packcuda.{op}: positions must hold integers, got {t.dtype}")
    return t.to(torch.int64) if t.dtype in (torch.int8, torch.int16, torch.uint8) else t


def _section(op, section):
    """mrope_section as the op takes it: integers within int64 (their count, signs and sum are the op's to
    check)."""
    if type(section) in (list, tuple) and section and all(type(v) is int for v in section) and (
            INT64_MIN <= min(section) and max(section) <= INT64_MAX):
        s = section
    elif isinstance(section, (str, bytes)) or not hasattr(section, "__len__"):
        raise TypeError(f"packcuda.{op}: mrope_section must be a sequence of 3 integers, got {section!r}")
    else:
        s = [check_int(op, f"mrope_section[{i}]", v) for i, v in enumerate(section)]
    if not s:  # (the op takes [] for plain RoPE)
        raise ValueError(f"packcuda.{op}: mrope_section must have 3 entries (t, h, w), got []")
    return s


def _rope_args(op, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section, mrope_interleaved,
               rotary_style, attention_scaling, inplace):
    """``(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling)`` as the rotary ops take
    them: q / k (and positions) with more than two token dims flattened to one, the frequencies computed from
    rope_theta when inv_freq is not given."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        arg, x = ("q", q) if not isinstance(q, torch.Tensor) else ("k", k)
        raise TypeError(f"packcuda.{op}: {arg} must be a tensor, got {type(x).__name__}")
    if not isinstance(positions, torch.Tensor):
        positions = _positions_tensor(op, positions)
    gptj = _STYLES.get(rotary_style) if type(rotary_style) is str else None
    if gptj is None:
        raise ValueError(f"packcuda.{op}: rotary_style must be 'neox' or 'gptj', got {rotary_style!r}")
    if type(mrope_interleaved) is not bool:
        if not _is_bool(mrope_interleaved):
            raise TypeError(f"packcuda.{op}: mrope_interleaved must be a bool, got {mrope_interleaved!r}")
        mrope_interleaved = bool(mrope_interleaved)
    scale = attention_scaling if type(attention_scaling) is float else _real(op, "attention_scaling",
                                                                              attention_scaling)
    section = [] if mrope_section is None else _section(op, mrope_section)
    if inv_freq is None:
        if rope_theta is None:
            raise ValueError(f"packcuda.{op}: give rope_theta or inv_freq")
        theta = _theta(op, rope_theta)
        D = q.shape[-1] if q.dim() else 0
        rd = D if rotary_dim is None else check_int(op, "rotary_dim", rotary_dim)
        # frequencies for a rotary_dim the op takes; for any other one it gets none and refuses rotary_dim
        inv = (_inv_freq_for(op, theta, rd, q.device) if 0 < rd <= D and rd % 2 == 0
               else q.new_empty(0, dtype=torch.float32))
    elif isinstance(inv_freq, torch.Tensor):
        inv = inv_freq
        rd = 2 * inv.numel() if rotary_dim is None else check_int(op, "rotary_dim", rotary_dim)
    else:
        raise TypeError(f"packcuda.{op}: inv_freq must be a float32 tensor, got {type(inv_freq).__name__}")
    if q.dim() > 4:
        if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2]:
            raise ValueError(f"packcuda.{op}: q and k must have the same tokens (leading dims), got q "
                             f"{tuple(q.shape)} and k {tuple(k.shape)}")
        positions = _flatten_positions(op, positions, section, q.shape[:-2])
        q, k = _flatten_tokens(op, q, inplace), _flatten_tokens(op, k, inplace)
    return q, k, positions, inv, rd, section, mrope_interleaved, gptj, scale


def _check_differentiable_inplace(name, q, k, qf, kf, out_of_place):
    """What autograd needs of q and k modified in place (qf / kf: their flattened forms)."""
    if qf is not q or kf is not k:
        raise ValueError(f"packcuda.{name}: differentiable in-place use needs q and k with at most 4 dims")
    for arg, x in (("q", q), ("k", k)):
        root = x._base if x._is_view() else x
        if x.requires_grad and root.is_leaf:
            what = "a view of a leaf" if x._is_view() else "a leaf"
            raise ValueError(f"packcuda.{name}: {arg} is {what} tensor that requires grad; it cannot be modified "
                             f"in place (use {out_of_place}, or a non-leaf tensor)")


def _flatten_tokens(name, x, inplace):
    """q/k with more than one leading token dim beyond [B, S]: flattened to [T, H, D] (a view for the in-place
    op)."""
    shape = (-1, x.shape[-2], x.shape[-1])
    if inplace:
        try:
            return x.view(shape)
        except RuntimeError as e:
            raise ValueError(f"packcuda.{name}: the leading dims of a tensor of shape {tuple(x.shape)} cannot be "
                             f"flattened into tokens without a copy") from e
    return x.reshape(shape)


def _flatten_positions(name, positions, section, lead):
    """positions of a q with more than two token dims ``lead``: [*lead] / [3, *lead] or already flat [T] /
    [3, T]; flattened to the latter."""
    rows = 1 if section else 0
    lead = tuple(lead)
    T = math.prod(lead)
    if positions.dim() == rows + 1 and positions.shape[rows] == T:
        return positions
    if positions.dim() != rows + len(lead) or tuple(positions.shape[rows:]) != lead:
        want = ("[3, " if rows else "[") + ", ".join(map(str, lead)) + "]"
        raise ValueError(f"packcuda.{name}: positions must be {want} or flat over the {T} tokens of q, got shape "
                         f"{tuple(positions.shape)}")
    return positions.reshape(*positions.shape[:rows], T)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    rope_theta: Optional[float] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    rotary_style: str = "neox",
    attention_scaling: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings of ``q`` and ``k`` in one fused pass (out of place).

    Math in fp32 (angle = float32(pos) * inv_freq[j], accurate sin/cos), one rounding to the output dtype.
    Channels ``>= rotary_dim`` are copied unchanged. Differentiable in q and k; the backward is the same kernel
    with the negated angle. CUDA-graph capturable with device positions and ``inv_freq``.

    Args:
        q: ``[T, Hq, D]`` (or ``[B, S, Hq, D]``; more leading token dims are flattened), bf16 / fp16 / fp32
            (fp64 too), CPU or CUDA; any strides on the token and head dims (views into a fused QKV buffer are
            fine, no copies), last dim contiguous.
        k: ``[T, Hk, D]`` (or ``[B, S, Hk, D]``), ``q``'s dtype and device.
        positions: int32/int64 (or a nested list of ints; floats are refused, never truncated): ``[T]`` (or
            ``[1, T]``) for plain RoPE, or ``[3, T]`` / ``[3, 1, T]`` (t, h, w rows) with ``mrope_section``; the
            4-row form of transformers' Qwen-VL / Qwen3.5 models (``[4, 1, T]`` or ``[4, T]``, text positions
            first) is read as its last three rows (``[B, S]`` / ``[3, B, S]`` / ``[4, B, S]`` for 4-D q/k). Per
            token: packed sequences restart wherever the positions restart; CP shards pass their own.
            On ``q``'s device (no sync), or host positions with CUDA q/k (uploaded without a sync).
        rope_theta: the base of the default frequencies (ignored with ``inv_freq``).
        inv_freq: fp32 ``[rotary_dim / 2]``; default: computed from ``rope_theta`` over ``rotary_dim`` exactly
            as transformers does.
        rotary_dim: the rotated channels, even, <= D; default D.
        mrope_section: ``[sT, sH, sW]`` summing to ``rotary_dim / 2``: the slot -> axis map of mRoPE; None for
            plain RoPE.
        mrope_interleaved: False: sectioned (Qwen2/2.5-VL); True: interleaved (Qwen3-VL, Qwen3.5).
        rotary_style: ``"neox"`` pairs channel j with j + rotary_dim/2 (rotate_half), ``"gptj"`` pairs 2j with
            2j+1.
        attention_scaling: multiplies cos and sin.

    Returns:
        q_out: ``q``'s shape (contiguous), dtype and device.
        k_out: ``k``'s shape (contiguous), dtype and device.
    """
    args = _rope_args("apply_rope", q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section,
                      mrope_interleaved, rotary_style, attention_scaling, False)
    qo, ko = _ROPE(q.requires_grad or k.requires_grad, *args, False)
    if args[0] is not q:  # flattened
        return qo.view(q.shape), ko.view(k.shape)
    return qo, ko


def apply_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    rope_theta: Optional[float] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    rotary_style: str = "neox",
    attention_scaling: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In-place twin of ``apply_rope``: rotates ``q`` and ``k`` where they are and returns them.

    Only the rotated channels are read and written: with partial rotary (``rotary_dim < D``) the passthrough
    channels are never touched, and on views into a fused QKV buffer every other byte of the buffer stays as it
    was. q and k must share no element with each other (views of one buffer that interleave, e.g. q and k heads
    of a fused QKV row, are fine), neither may repeat an element (no stride 0, e.g. an expanded tensor), and
    ``positions`` / ``inv_freq`` may not lie in their memory; everything is checked before anything is
    written. Differentiable (mark-dirty semantics, like other in-place torch ops: q and k must not be leaves,
    or views of leaves, that require grad).

    Args:
        q: as in ``apply_rope``; written in place.
        k: as in ``apply_rope``; written in place.
        positions: as in ``apply_rope``.
        rope_theta: as in ``apply_rope``, and so is every other keyword.

    Returns:
        ``(q, k)``, the same tensors. No sync with device positions.
    """
    op = "apply_rope_"
    qf, kf, pos, inv, *cfg = _rope_args(op, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section,
                                        mrope_interleaved, rotary_style, attention_scaling, True)
    if (q.requires_grad or k.requires_grad) and torch.is_grad_enabled():
        _check_differentiable_inplace(op, q, k, qf, kf, "apply_rope")
        return _in_place(q, k, None, None, lambda: ops.apply_rope_(q, k, pos, inv, *cfg, False), _rotate_back,
                         (pos, inv), (pos, inv), cfg)
    ops.apply_rope_(qf, kf, pos, inv, *cfg, False)
    return q, k


def _norm_args(op, q_weight, k_weight, eps, norm):
    """(eps, norm) as the QK-norm ops take them, after the weights' Python type."""
    for arg, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"packcuda.{op}: {arg} must be a tensor [head_dim], got {type(w).__name__}")
    if not isinstance(norm, str):
        raise TypeError(f"packcuda.{op}: norm must be 'rms' or 'rms_offset', got {norm!r} ({type(norm).__name__})")
    return (eps if type(eps) is float else _real(op, "eps", eps)), norm


def apply_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float = 1e-6,
    norm: str = "rms",
    rope_theta: Optional[float] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    rotary_style: str = "neox",
    attention_scaling: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of ``q`` and ``k`` followed by their rotary embedding, in one fused pass (out of place).

    The norm covers the whole head (all ``head_dim`` channels); the rotation only the first ``rotary_dim``
    channels, the others come out normalized.

    - ``norm="rms"`` (transformers' Qwen3 / Qwen3-VL ``RMSNorm``): ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``
      — the normalized value is rounded to q's dtype before the weight, exactly as transformers does, then the
      product with the weight and the rotation are computed in fp32 and rounded once.
    - ``norm="rms_offset"`` (Qwen3.5's ``Qwen3_5RMSNorm``): ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32,
      rotated in fp32, rounded once.

    Differentiable in q, k, ``q_weight`` and ``k_weight``; the backward reads q, k and the gradients once and
    reduces the weight gradients in a fixed order (bitwise reproducible, no atomics). CUDA-graph capturable
    with device positions.

    Args:
        q: ``[T, Hq, D]`` as in ``apply_rope`` (``D <= 512``).
        k: ``[T, Hk, D]``, ``q``'s dtype and device.
        positions: as in ``apply_rope``.
        q_weight: ``[D]``, fp32 or ``q``'s dtype, on ``q``'s device.
        k_weight: ``[D]``, fp32 or ``q``'s dtype, on ``q``'s device.
        eps: finite, >= 0.
        norm: ``"rms"`` or ``"rms_offset"``.
        rope_theta: as in ``apply_rope`` (and every other rotary keyword: ``inv_freq``, ``rotary_dim``,
            ``mrope_section``, ``mrope_interleaved``, ``rotary_style``, ``attention_scaling``).

    Returns:
        q_out: ``q``'s shape (contiguous), dtype and device. No sync with device positions.
        k_out: ``k``'s shape (contiguous), dtype and device.
    """
    op = "apply_qk_norm_rope"
    qf, kf, pos, inv, rd, *cfg = _rope_args(op, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section,
                                            mrope_interleaved, rotary_style, attention_scaling, False)
    eps, norm = _norm_args(op, q_weight, k_weight, eps, norm)
    qo, ko = _QK_NORM(q.requires_grad or k.requires_grad or q_weight.requires_grad or k_weight.requires_grad, qf, kf,
                      pos, inv, q_weight, k_weight, eps, norm, rd, *cfg)
    if qf is not q:  # flattened
        return qo.view(q.shape), ko.view(k.shape)
    return qo, ko


def apply_qk_norm_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float = 1e-6,
    norm: str = "rms",
    rope_theta: Optional[float] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: Optional[int] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    rotary_style: str = "neox",
    attention_scaling: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """In-place twin of ``apply_qk_norm_rope``: normalizes and rotates ``q`` and ``k`` where they are.

    Every channel of every head is written. Works on strided views of one fused projection output (e.g.
    Qwen3.5's q, interleaved with its gate); the memory rules are those of ``apply_rope_`` (q and k share no
    element, neither repeats one, the read-only tensors - positions, inv_freq, the weights - do not lie in their
    memory), all checked before anything is written. Differentiable with mark-dirty semantics (q and k must not
    be leaves, or views of leaves, that require grad). When a gradient is needed, the inputs are saved (one copy
    of q and k) for the backward, which needs them.

    Args:
        q: as in ``apply_qk_norm_rope``; written in place.
        k: as in ``apply_qk_norm_rope``; written in place.
        positions: as in ``apply_rope``.
        q_weight: as in ``apply_qk_norm_rope``, and so is every other keyword.

    Returns:
        ``(q, k)``, the same tensors. No sync with device positions.
    """
    op = "apply_qk_norm_rope_"
    qf, kf, pos, inv, rd, *cfg = _rope_args(op, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section,
                                            mrope_interleaved, rotary_style, attention_scaling, True)
    cfg = (*_norm_args(op, q_weight, k_weight, eps, norm), rd, *cfg)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or q_weight.requires_grad
                                    or k_weight.requires_grad):
        _check_differentiable_inplace(op, q, k, qf, kf, "apply_qk_norm_rope")
        xq, xk = q.detach().clone(), k.detach().clone()  # the inputs the backward reads
        return _in_place(q, k, q_weight, k_weight,
                         lambda: ops.apply_qk_norm_rope_(q, k, pos, inv, q_weight, k_weight, *cfg), _norm_back,
                         (xq, pos, inv, q_weight), (xk, pos, inv, k_weight), cfg)
    ops.apply_qk_norm_rope_(qf, kf, pos, inv, q_weight, k_weight, *cfg)
    return q, k


def _config_rope_parameters(op, config) -> dict:
    """The flat rope parameter dict of a transformers config: ``rope_parameters`` (transformers 5), else the
    legacy ``rope_scaling`` dict, else empty; ``rope_theta`` / ``partial_rotary_factor`` may also sit on the
    config itself (legacy form)."""
    rp = getattr(config, "rope_parameters", None)
    field = "rope_parameters"
    if rp is None:
        rp, field = getattr(config, "rope_scaling", None), "rope_scaling"
    if rp is None:
        return {}
    if not isinstance(rp, Mapping):
        raise TypeError(f"packcuda.{op}: config.{field} must be a dict, got {type(rp).__name__}")
    nested = [key for key, v in rp.items() if isinstance(v, Mapping)]
    if nested:
        raise ValueError(f"packcuda.{op}: config.{field} holds one rope per layer type ({nested}); not supported "
                         "(pass rope_theta / inv_freq of the layer type explicitly)")
    return dict(rp)


def rope_kwargs_from_config(config) -> dict:
    """The keyword arguments of ``apply_rope`` for a transformers text config.

    ``rope_theta``, ``rotary_dim`` (``head_dim * partial_rotary_factor``) and, for the Qwen-VL / Qwen3.5
    families, the ``mrope_section`` and layout their rotary modules use (the config's section, else the
    module's default; Qwen2/2.5-VL sectioned, Qwen3-VL and Qwen3.5 interleaved). Other models: ``mrope_section``
    from ``rope_parameters`` if present, with its ``mrope_interleaved`` flag. Default rope type only.

    The parameters are read from ``config.rope_parameters`` (transformers 5), else the legacy
    ``config.rope_scaling``, with ``rope_theta`` / ``partial_rotary_factor`` on the config itself as fallbacks.
    Sections are taken the way the models' rotary modules take them: a sectioned layout splits the
    ``rotary_dim / 2`` slots by the section, so it must sum to that (else refused); the interleaved layout
    assigns slot ``j`` to h when ``j % 3 == 1 and j < 3 * sH``, to w when ``j % 3 == 2 and j < 3 * sW``, else to
    t, so a section that over- or under-covers the slots is clipped to the equivalent one summing to
    ``rotary_dim / 2``. Anything else that the model could not run is refused with a ValueError/TypeError.

    Args:
        config: a transformers text config (``model.config.get_text_config()``) or its dict.

    Returns:
        A dict with ``rope_theta``, ``rotary_dim``, ``mrope_section`` and ``mrope_interleaved``.
    """
    op = "rope_kwargs_from_config"
    if config is None:
        raise TypeError(f"packcuda.{op}: config must be a transformers config, got None")
    rp = _config_rope_parameters(op, config)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "mrope":  # legacy Qwen2-VL rope_scaling: the default frequencies, sectioned
        rope_type = "default"
    if rope_type != "default":
        raise ValueError(f"packcuda.{op}: rope_type {rope_type!r} is not supported (pass inv_freq and "
                         "attention_scaling from the model's rotary module instead)")
    theta = rp.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"packcuda.{op}: the config has no rope_theta (neither rope_parameters['rope_theta'] nor "
                         "config.rope_theta)")
    theta = check_float(op, "rope_theta", theta, lo=0.0, lo_open=True)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        if hidden is None or heads is None:
            raise ValueError(f"packcuda.{op}: the config has no head_dim and no hidden_size / num_attention_heads "
                             "to derive it from")
        head_dim = check_int(op, "hidden_size", hidden, lo=1) // check_int(op, "num_attention_heads", heads, lo=1)
    head_dim = check_int(op, "head_dim", head_dim, lo=1)
    mt = getattr(config, "model_type", "") or ""
    family = rotary_family(mt)
    factor = rp.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None)
    factor = 1.0 if factor is None or (family is not None and not family.partial_rotary) else factor
    factor = check_float(op, "partial_rotary_factor", factor, lo=0.0, hi=1.0, lo_open=True)
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"packcuda.{op}: rotary_dim = int(head_dim * partial_rotary_factor) = int({head_dim} * "
                         f"{factor}) = {rotary_dim} must be a positive even number")
    kw = dict(rope_theta=theta, rotary_dim=_check_rotary_dim(op, rotary_dim))
    section = rp.get("mrope_section")
    if family is not None:
        section, interleaved = (section if section is not None else family.mrope_section), family.interleaved
    elif section is not None:
        interleaved = rp.get("mrope_interleaved", False)
        if not _is_bool(interleaved):
            raise TypeError(f"packcuda.{op}: rope_parameters['mrope_interleaved'] must be a bool, got "
                            f"{interleaved!r}")
    if section is not None:
        kw.update(mrope_section=_config_section(op, section, rotary_dim // 2, bool(interleaved)),
                  mrope_interleaved=bool(interleaved))
    return kw


def _config_section(op, section, n, interleaved) -> list:
    """A config's mrope_section as the rotary module applies it over n = rotary_dim / 2 slots (see
    rope_kwargs_from_config)."""
    if isinstance(section, (str, bytes, Mapping)) or not hasattr(section, "__len__"):
        raise TypeError(f"packcuda.{op}: mrope_section must be a list of 3 integers, got {section!r}")
    if len(section) != 3:
        raise ValueError(f"packcuda.{op}: mrope_section must have 3 entries (t, h, w), got {list(section)}")
    s = [check_int(op, f"mrope_section[{i}]", v, lo=0) for i, v in enumerate(section)]
    if sum(s) == n:
        return s
    if not interleaved:
        raise ValueError(f"packcuda.{op}: mrope_section {s} sums to {sum(s)} but rotary_dim / 2 = {n} (the sectioned "
                         "layout splits the rotary slots by the section)")
    # interleaved: h takes the slots j % 3 == 1 below 3 * sH, w those j % 3 == 2 below 3 * sW, t the rest; the
    # slots that exist below n are (n + 1) // 3 and n // 3
    s_h, s_w = min(s[1], (n + 1) // 3), min(s[2], n // 3)
    return [n - s_h - s_w, s_h, s_w]
