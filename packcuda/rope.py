"""Fused rotary position embeddings: 1D RoPE and mRoPE (sectioned, interleaved, partial) applied to q and k
in one pass, forward and backward, out of place or in place."""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Optional, Sequence, Tuple

import torch

from . import _lib
from ._families import rotary_family
from ._meta import check_float, check_int, fake_kernel

_lib.load()
ops = torch.ops.packcuda

__all__ = ["apply_rope", "apply_rope_", "apply_qk_norm_rope", "apply_qk_norm_rope_", "default_inv_freq",
           "rope_kwargs_from_config"]

_STYLES = {"neox": False, "gptj": True}

# Largest rotary_dim the kernels accept (rope::kMaxRotaryDim in csrc/rope/rope_apply.h).
_MAX_ROTARY_DIM = 8192

# norm kinds of apply_qk_norm_rope (rope::kNormRms / kNormRmsOffset in csrc/rope/rope_math.h)
_NORMS = {"rms": 0, "rms_offset": 1}


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
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    D = q.shape[-1]
    return torch.empty_like(q), torch.empty_like(k), q.new_empty(D, dtype=acc), q.new_empty(D, dtype=acc)


# ---------------------------------------------------------------------------------------------------
# autograd: the backward of a rotation by angle a is the rotation by -a (it saves only the positions and
# the frequencies, never activations)
# ---------------------------------------------------------------------------------------------------
def _last_dim_contiguous(g: torch.Tensor) -> torch.Tensor:
    return g if g.shape[-1] <= 1 or g.stride(-1) == 1 else g.contiguous()


def _rope_setup(ctx, inputs, output):
    q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, inverse = inputs
    ctx.save_for_backward(positions, inv_freq)
    ctx.cfg = (rotary_dim, list(section), interleaved, gptj, scaling, inverse)


def _rope_backward(ctx, gq, gk):
    positions, inv_freq = ctx.saved_tensors
    rotary_dim, section, interleaved, gptj, scaling, inverse = ctx.cfg
    dq, dk = ops.apply_rope(_last_dim_contiguous(gq), _last_dim_contiguous(gk), positions, inv_freq, rotary_dim,
                            section, interleaved, gptj, scaling, not inverse)
    return dq, dk, None, None, None, None, None, None, None, None


torch.library.register_autograd("packcuda::apply_rope", _rope_backward, setup_context=_rope_setup)


# Eager fast path of the facade (packcuda._lib.EagerOp): without a gradient to track the backend kernel is
# called below autograd; with one, a plain Function wraps it; under torch.compile the facade keeps calling the
# registered op (and its registered autograd). The math and the kernel launches are the same.
class _ApplyRope(torch.autograd.Function):
    """Out-of-place rotation; the backward rotates the incoming gradients by the negated angle (one launch for
    dq and dk, gradients read with their own strides). Differentiable again under create_graph."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, inverse):
        ctx.save_for_backward(positions, inv_freq)
        ctx.cfg = (rotary_dim, section, interleaved, gptj, scaling, inverse)
        return _ROPE.below(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, inverse)

    @staticmethod
    def backward(ctx, gq, gk):
        positions, inv_freq = ctx.saved_tensors
        rotary_dim, section, interleaved, gptj, scaling, inverse = ctx.cfg
        dq, dk = _rope_call(_last_dim_contiguous(gq), _last_dim_contiguous(gk), positions, inv_freq, rotary_dim,
                            section, interleaved, gptj, scaling, not inverse)
        return dq, dk, None, None, None, None, None, None, None, None


_ROPE = _lib.EagerOp(ops.apply_rope, _ApplyRope)


def _rope_call(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, inverse):
    """ops.apply_rope with the same semantics (autograd included), without the Python autograd kernel's
    overhead in eager mode."""
    return _ROPE(q.requires_grad or k.requires_grad, q, k, positions, inv_freq, rotary_dim, section, interleaved,
                 gptj, scaling, inverse)


class _ApplyRopeInplace(torch.autograd.Function):
    """In-place rotation with mark-dirty semantics: q and k are modified and returned; the backward rotates
    the incoming gradients by the negated angle."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling):
        ops.apply_rope_(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, False)
        ctx.mark_dirty(q, k)
        ctx.save_for_backward(positions, inv_freq)
        ctx.cfg = (rotary_dim, section, interleaved, gptj, scaling)
        return q, k

    @staticmethod
    def backward(ctx, gq, gk):
        positions, inv_freq = ctx.saved_tensors
        rotary_dim, section, interleaved, gptj, scaling = ctx.cfg
        dq, dk = _rope_call(_last_dim_contiguous(gq), _last_dim_contiguous(gk), positions, inv_freq,
                            rotary_dim, section, interleaved, gptj, scaling, True)
        return dq, dk, None, None, None, None, None, None, None


def _save_rotated(ctx, x, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling):
    """One tensor rotated in place: marked dirty, with what :func:`_rotate_back` needs."""
    ctx.mark_dirty(x)
    ctx.save_for_backward(positions, inv_freq)
    ctx.cfg = (rotary_dim, section, interleaved, gptj, scaling)


def _rotate_back(ctx, g):
    """Gradient of one tensor rotated in place: g rotated by the negated angle."""
    positions, inv_freq = ctx.saved_tensors
    rotary_dim, section, interleaved, gptj, scaling = ctx.cfg
    g = _last_dim_contiguous(g)
    dx, _ = _rope_call(g, g.narrow(-2, 0, 0), positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling,
                       True)
    return dx


class _ApplyRopeInplaceViewQ(torch.autograd.Function):
    """In-place rotation of views (e.g. q and k slices of a fused QKV buffer). Autograd lets a Function that
    modifies a view in place return only one tensor, so this one rotates q and k together in one op call (every
    argument of both is checked before anything is written) and returns q marked dirty; :class:`_MarkRotated`
    then marks k."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling):
        ops.apply_rope_(q, k, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling, False)
        _save_rotated(ctx, q, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling)
        return q

    @staticmethod
    def backward(ctx, g):
        return (_rotate_back(ctx, g),) + (None,) * 8


class _MarkRotated(torch.autograd.Function):
    """k of :class:`_ApplyRopeInplaceViewQ`: already rotated there; marked dirty here, its backward rotates the
    incoming gradient by the negated angle."""

    @staticmethod
    def forward(ctx, x, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling):
        _save_rotated(ctx, x, positions, inv_freq, rotary_dim, section, interleaved, gptj, scaling)
        return x

    @staticmethod
    def backward(ctx, g):
        return (_rotate_back(ctx, g),) + (None,) * 7


# ---------------------------------------------------------------------------------------------------
# QK norm + rotation: autograd. The backward reads the forward's inputs (q, k) and the incoming gradients once,
# recomputes the row statistics, and returns dq, dk and the weight gradients (reduced in a fixed order).
# ---------------------------------------------------------------------------------------------------
def _qk_norm_backward(gq, gk, q, k, positions, inv_freq, wq, wk, cfg):
    dq, dk, dwq, dwk = ops.apply_qk_norm_rope_backward(_last_dim_contiguous(gq), _last_dim_contiguous(gk), q, k,
                                                 positions, inv_freq, wq, wk, *cfg)
    return dq, dk, dwq.to(wq.dtype), dwk.to(wk.dtype)


def _qk_norm_setup(ctx, inputs, output):
    q, k, positions, inv_freq, wq, wk = inputs[:6]
    ctx.save_for_backward(q, k, positions, inv_freq, wq, wk)
    ctx.cfg = tuple(inputs[6:])


def _qk_norm_autograd(ctx, gq, gk):
    dq, dk, dwq, dwk = _qk_norm_backward(gq, gk, *ctx.saved_tensors, ctx.cfg)
    return (dq, dk, None, None, dwq, dwk) + (None,) * 7


torch.library.register_autograd("packcuda::apply_qk_norm_rope", _qk_norm_autograd, setup_context=_qk_norm_setup)


class _QkNormRope(torch.autograd.Function):
    """Out-of-place norm + rotation (eager fast path of the registered op, same math and launches)."""

    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, wq, wk, *cfg):
        ctx.save_for_backward(q, k, positions, inv_freq, wq, wk)
        ctx.cfg = cfg
        return _QK_NORM.below(q, k, positions, inv_freq, wq, wk, *cfg)

    @staticmethod
    def backward(ctx, gq, gk):
        return _qk_norm_autograd(ctx, gq, gk)


_QK_NORM = _lib.EagerOp(ops.apply_qk_norm_rope, _QkNormRope)


def _qk_norm_call(q, k, positions, inv_freq, wq, wk, cfg):
    return _QK_NORM(any(x.requires_grad for x in (q, k, wq, wk)), q, k, positions, inv_freq, wq, wk, *cfg)


def _norm_back_one(ctx, g):
    """Gradients (dx, dw) of one tensor normalized and rotated in place, from its saved input."""
    x, positions, inv_freq, w = ctx.saved_tensors
    g = _last_dim_contiguous(g)
    dx, _, dw, _ = _qk_norm_backward(g, g.narrow(-2, 0, 0), x, x.narrow(-2, 0, 0), positions, inv_freq, w, w,
                                     ctx.cfg)
    return dx, dw


class _QkNormRopeInplaceQ(torch.autograd.Function):
    """In-place norm + rotation of q and k in one op call (everything checked before anything is written);
    returns q marked dirty (autograd lets a Function that modifies views return one tensor) and saves q's
    input (``xq``, a copy taken before the call) for the backward. :class:`_MarkNormed` marks k."""

    @staticmethod
    def forward(ctx, q, k, xq, positions, inv_freq, wq, wk, *cfg):
        ops.apply_qk_norm_rope_(q, k, positions, inv_freq, wq, wk, *cfg)
        ctx.mark_dirty(q)
        ctx.save_for_backward(xq, positions, inv_freq, wq)
        ctx.cfg = cfg
        return q

    @staticmethod
    def backward(ctx, g):
        dx, dw = _norm_back_one(ctx, g)
        return (dx, None, None, None, None, dw, None) + (None,) * len(ctx.cfg)


class _MarkNormed(torch.autograd.Function):
    """k of :class:`_QkNormRopeInplaceQ`: already normalized and rotated there; marked dirty here, its backward
    uses the saved input of k."""

    @staticmethod
    def forward(ctx, k, xk, positions, inv_freq, wk, *cfg):
        ctx.mark_dirty(k)
        ctx.save_for_backward(xk, positions, inv_freq, wk)
        ctx.cfg = cfg
        return k

    @staticmethod
    def backward(ctx, g):
        dx, dw = _norm_back_one(ctx, g)
        return (dx, None, None, None, dw) + (None,) * len(ctx.cfg)


# ---------------------------------------------------------------------------------------------------
# facade
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
    return _default_inv_freq("default_inv_freq", rope_theta, rotary_dim)


def _check_rotary_dim(op, rotary_dim, name="rotary_dim") -> int:
    rd = check_int(op, name, rotary_dim, lo=2, hi=_MAX_ROTARY_DIM)
    if rd % 2:
        raise ValueError(f"packcuda.{op}: {name} must be a positive even number, got {rd}")
    return rd


def _default_inv_freq(op, rope_theta, rotary_dim) -> torch.Tensor:
    theta = check_float(op, "rope_theta", rope_theta, lo=0.0, lo_open=True)
    rd = _check_rotary_dim(op, rotary_dim)
    t = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"packcuda.{op}: rope_theta={theta} gives non-finite fp32 frequencies (1 / rope_theta "
                         "overflows fp32)")
    return t


def _inv_freq_for(op, rope_theta, rotary_dim, device) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _default_inv_freq(op, rope_theta, rotary_dim)
    key = (rope_theta, rotary_dim, device)
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = _default_inv_freq(op, rope_theta, rotary_dim)
        if device.type != "cpu":
            t = t.to(device, non_blocking=True)
        _INV_FREQ_CACHE[key] = t
    return t


def _is_bool(v) -> bool:
    return isinstance(v, bool) or type(v).__name__ == "bool_"  # Python or numpy bool


def _positions_tensor(op, positions) -> torch.Tensor:
    """positions as a tensor of integers: floats (or bools) are refused, never truncated."""
    if not isinstance(positions, torch.Tensor):
        if positions is None or isinstance(positions, (str, bytes, numbers.Number)):
            raise TypeError(f"packcuda.{op}: positions must be an integer tensor or a (nested) list of integers, "
                            f"got {type(positions).__name__}")
        try:
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"packcuda.{op}: positions must be an integer tensor or a (nested) list of integers "
                            f"({e})") from e
        if positions.dtype in (torch.int8, torch.int16, torch.uint8):
            positions = positions.to(torch.int64)
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"packcuda.{op}: positions must hold integers (int32/int64), got {positions.dtype}")
    return positions


def _resolve(name, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section, mrope_interleaved,
             rotary_style, attention_scaling):
    for arg, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"packcuda.{name}: {arg} must be a tensor, got {type(x).__name__}")
        if x.dim() < 3:
            raise ValueError(f"packcuda.{name}: {arg} must be [..., H, D] with at least one token dim, got shape "
                             f"{tuple(x.shape)}")
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2]:
        raise ValueError(f"packcuda.{name}: q and k must have the same tokens (leading dims), got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    if not isinstance(rotary_style, str) or rotary_style not in _STYLES:
        raise ValueError(f"packcuda.{name}: rotary_style must be 'neox' or 'gptj', got {rotary_style!r}")
    if not _is_bool(mrope_interleaved):
        raise TypeError(f"packcuda.{name}: mrope_interleaved must be a bool, got {mrope_interleaved!r}")
    scale = check_float(name, "attention_scaling", attention_scaling)
    positions = _positions_tensor(name, positions)
    D = q.shape[-1]
    if inv_freq is None:
        if rope_theta is None:
            raise ValueError(f"packcuda.{name}: give rope_theta or inv_freq")
        rd = D if rotary_dim is None else check_int(name, "rotary_dim", rotary_dim)
        if rd > D:
            raise ValueError(f"packcuda.{name}: rotary_dim ({rd}) must be <= head_dim ({D})")
        inv = _inv_freq_for(name, check_float(name, "rope_theta", rope_theta, lo=0.0, lo_open=True),
                            _check_rotary_dim(name, rd), q.device)
    else:
        if not isinstance(inv_freq, torch.Tensor):
            raise TypeError(f"packcuda.{name}: inv_freq must be a float32 tensor, got {type(inv_freq).__name__}")
        inv = inv_freq
        rd = 2 * inv.numel() if rotary_dim is None else check_int(name, "rotary_dim", rotary_dim)
    meta = q.device.type == "meta"
    for arg, x in (("k", k), ("positions", positions), ("inv_freq", inv)):
        if (x.device.type == "meta") != meta:  # a meta tensor mixed with real ones would give no real result
            raise ValueError(f"packcuda.{name}: {arg} is on {x.device} but q is on {q.device}")
    section = []
    if mrope_section is not None:
        if isinstance(mrope_section, (str, bytes)) or not hasattr(mrope_section, "__len__"):
            raise TypeError(f"packcuda.{name}: mrope_section must be a sequence of 3 integers, got "
                            f"{mrope_section!r}")
        if len(mrope_section) != 3:
            raise ValueError(f"packcuda.{name}: mrope_section must have 3 entries (t, h, w), got "
                             f"{list(mrope_section)}")
        if all(type(v) is int and 0 <= v < 2**63 for v in mrope_section):  # the common case, checked
            section = list(mrope_section)
        else:
            section = [check_int(name, f"mrope_section[{i}]", v, lo=0) for i, v in enumerate(mrope_section)]
    return positions, inv, rd, section, bool(mrope_interleaved), _STYLES[rotary_style], scale


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
    """q/k with more than one leading token dim beyond [B, S]: flatten them (a view for the in-place op)."""
    if x.dim() <= 4:
        return x
    shape = (-1, x.shape[-2], x.shape[-1])
    if inplace:
        try:
            return x.view(shape)
        except RuntimeError as e:
            raise ValueError(f"packcuda.{name}: the leading dims of a tensor of shape {tuple(x.shape)} cannot be "
                             f"flattened into tokens without a copy") from e
    return x.reshape(shape)


def _flatten_positions(name, positions, section, q):
    """positions of a q with more than two token dims: [*tokens] / [3, *tokens] (q's token dims) or already flat
    [T] / [3, T]; flattened to the latter."""
    if q.dim() <= 4:
        return positions
    rows = 1 if section else 0
    lead = tuple(q.shape[:-2])
    T = q.shape[:-2].numel()
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
        positions: int32/int64 (or a nested list of ints; floats are refused, never truncated): ``[T]`` for
            plain RoPE or ``[3, T]`` (t, h, w rows) with ``mrope_section`` (``[B, S]`` / ``[3, B, S]`` for 4-D
            q/k). Per token: packed sequences restart wherever the positions restart; CP shards pass their own.
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
    positions, inv, rd, section, inter, gptj, scale = _resolve(
        "apply_rope", q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section, mrope_interleaved,
        rotary_style, attention_scaling)
    if q.dim() > 4:
        qf, kf = _flatten_tokens("apply_rope", q, False), _flatten_tokens("apply_rope", k, False)
        qo, ko = _rope_call(qf, kf, _flatten_positions("apply_rope", positions, section, q), inv, rd, section,
                            inter, gptj, scale, False)
        return qo.view(q.shape), ko.view(k.shape)
    return _rope_call(q, k, positions, inv, rd, section, inter, gptj, scale, False)


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
    positions, inv, rd, section, inter, gptj, scale = _resolve(
        "apply_rope_", q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section, mrope_interleaved,
        rotary_style, attention_scaling)
    qf, kf = _flatten_tokens("apply_rope_", q, True), _flatten_tokens("apply_rope_", k, True)
    pos = _flatten_positions("apply_rope_", positions, section, q)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        _check_differentiable_inplace("apply_rope_", q, k, qf, kf, "apply_rope")
        if q._is_view() or k._is_view():
            q = _ApplyRopeInplaceViewQ.apply(q, k, pos, inv, rd, section, inter, gptj, scale)
            k = _MarkRotated.apply(k, pos, inv, rd, section, inter, gptj, scale)
            return q, k
        return _ApplyRopeInplace.apply(q, k, pos, inv, rd, section, inter, gptj, scale)
    ops.apply_rope_(qf, kf, pos, inv, rd, section, inter, gptj, scale, False)
    return q, k


def _resolve_norm(name, q, k, q_weight, k_weight, eps, norm):
    for arg, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"packcuda.{name}: {arg} must be a tensor [head_dim], got {type(w).__name__}")
        if (w.device.type == "meta") != (q.device.type == "meta"):
            raise ValueError(f"packcuda.{name}: {arg} is on {w.device} but q is on {q.device}")
    if not isinstance(norm, str) or norm not in _NORMS:
        raise ValueError(f"packcuda.{name}: norm must be 'rms' or 'rms_offset', got {norm!r}")
    return check_float(name, "eps", eps, lo=0.0), _NORMS[norm]


def _qk_norm_args(name, q, k, positions, q_weight, k_weight, eps, norm, rope_theta, inv_freq, rotary_dim,
                  mrope_section, mrope_interleaved, rotary_style, attention_scaling, inplace):
    positions, inv, rd, section, inter, gptj, scale = _resolve(
        name, q, k, positions, rope_theta, inv_freq, rotary_dim, mrope_section, mrope_interleaved, rotary_style,
        attention_scaling)
    eps, kind = _resolve_norm(name, q, k, q_weight, k_weight, eps, norm)
    qf, kf = _flatten_tokens(name, q, inplace), _flatten_tokens(name, k, inplace)
    pos = _flatten_positions(name, positions, section, q)
    return qf, kf, pos, inv, (eps, kind, rd, section, inter, gptj, scale)


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
    name = "apply_qk_norm_rope"
    qf, kf, pos, inv, cfg = _qk_norm_args(name, q, k, positions, q_weight, k_weight, eps, norm, rope_theta,
                                          inv_freq, rotary_dim, mrope_section, mrope_interleaved, rotary_style,
                                          attention_scaling, False)
    qo, ko = _qk_norm_call(qf, kf, pos, inv, q_weight, k_weight, cfg)
    if q.dim() > 4:
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
    name = "apply_qk_norm_rope_"
    qf, kf, pos, inv, cfg = _qk_norm_args(name, q, k, positions, q_weight, k_weight, eps, norm, rope_theta,
                                          inv_freq, rotary_dim, mrope_section, mrope_interleaved, rotary_style,
                                          attention_scaling, True)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, q_weight, k_weight)):
        _check_differentiable_inplace(name, q, k, qf, kf, "apply_qk_norm_rope")
        xq, xk = q.detach().clone(), k.detach().clone()  # the inputs the backward reads
        q = _QkNormRopeInplaceQ.apply(q, k, xq, pos, inv, q_weight, k_weight, *cfg)
        k = _MarkNormed.apply(k, xk, pos, inv, k_weight, *cfg)
        return q, k
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
