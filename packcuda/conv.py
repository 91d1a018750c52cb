"""Varlen causal depthwise conv1d and the conv-prefix exchange for context parallelism.

``causal_conv1d`` convolves every segment of a packed ``[T, C]`` stream on its own (zero history at a
segment start, or the K-1 rows given in ``prefix``). ``conv_prefix`` fetches, for each local piece of a CP
shard plan, the K-1 rows that precede it in its own sequence — from whichever rank holds them — so that
``causal_conv1d(x_local, w, b, cu_seqlens=plan.pieces, prefix=conv_prefix(x_local, plan, K, group))``
equals the unsharded conv on this rank's slots, values and gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _lib
from ._meta import IntsLike, op_metadata

_lib.load()
ops = torch.ops.packcuda

__all__ = ["causal_conv1d"]

_ACT = {None: 0, "silu": 1, "swish": 1}


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
@torch.library.register_fake("packcuda::causal_conv1d_fwd")
def _conv_fwd_fake(x, weight, bias, cu_seqlens, prefix, activation):
    return x.new_empty(x.shape)


@torch.library.register_fake("packcuda::causal_conv1d_bwd")
def _conv_bwd_fake(grad_y, x, weight, bias, cu_seqlens, prefix, activation):
    C, K = weight.shape
    S = prefix.shape[0] if prefix is not None else 0
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty((C,)), x.new_empty((S, K - 1, C))


@torch.library.register_fake("packcuda::conv_gather_sum")
def _gather_sum_fake(a, b, index):
    return a.new_empty((index.shape[0], a.shape[1]))


# ---------------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------------
def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu, prefix, act = inputs
    ctx.save_for_backward(x, weight, bias, cu, prefix)
    ctx.act = act
    ctx.has_bias = bias is not None
    ctx.has_prefix = prefix is not None


def _conv_backward(ctx, grad_y):
    x, weight, bias, cu, prefix = ctx.saved_tensors
    dx, dw, db, dp = ops.causal_conv1d_bwd(grad_y.contiguous(), x, weight, bias, cu, prefix, ctx.act)
    return (
        dx,
        dw,
        db if ctx.has_bias else None,
        None,
        dp if ctx.has_prefix else None,
        None,
    )


torch.library.register_autograd("packcuda::causal_conv1d_fwd", _conv_backward, setup_context=_conv_setup)


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Optional[IntsLike] = None,
    prefix: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Causal depthwise conv1d over a packed stream, one segment at a time.

    ``x`` ``[T, C]``, ``weight`` ``[C, K]`` (1 <= K <= 8), optional ``bias`` ``[C]``, all of one dtype
    (bf16 / fp16 / fp32 / fp64; fp32 accumulation, fp64 for fp64). ``y[t] = act(bias + sum_k weight[:, k] *
    x[t - (K-1) + k])`` where taps before the start of t's segment read ``prefix[s, K-1 + (u - start)]``
    (``prefix`` ``[S, K-1, C]``, one slab per segment), or zero without ``prefix``. ``cu_seqlens`` ``[S+1]``
    (host or device; ``None`` = one segment). ``activation``: ``None`` or ``"silu"``. Equal to
    ``torch.nn.functional.conv1d(x_seg.T[None], weight[:, None], bias, padding=K-1, groups=C)[..., :L]``
    run per segment.

    Differentiable in ``x``, ``weight``, ``bias`` and ``prefix``; ``weight`` / ``bias`` gradients are
    reduced in a fixed order (deterministic, no atomics). Syncs: none (host ``cu_seqlens`` is validated on
    the host and uploaded without waiting)."""
    if activation not in _ACT:
        raise ValueError(f"packcuda.causal_conv1d: activation must be None or 'silu', got {activation!r}")
    cu = op_metadata(cu_seqlens) if cu_seqlens is not None else None
    return ops.causal_conv1d_fwd(x, weight, bias, cu, prefix, _ACT[activation])
