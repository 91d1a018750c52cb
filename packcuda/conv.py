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
from ._meta import IntsLike, check_int, fake_kernel, host_tensor
from .exchange import (
    Field,
    RowSchedule,
    StaticRowSchedule,
    check_backend,
    check_flag,
    check_group,
    check_group_matches,
    move,
    schedule_fake,
    static_move,
)
from .shard import ShardPlan, StaticShardPlan

_lib.load()
ops = torch.ops.packcuda

__all__ = ["causal_conv1d"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_tensor(op: str, name: str, value, *, optional: bool = False) -> None:
    """TypeError naming ``packcuda.<op>`` and `name` unless `value` is a tensor (or None when optional)."""
    if value is None and optional:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"packcuda.{op}: {name} must be a tensor{' or None' if optional else ''}, got "
                        f"{type(value).__name__}")


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
@fake_kernel("causal_conv1d_fwd", host=["cu_seqlens"])
def _conv_fwd_fake(x, weight, bias, cu_seqlens, prefix, activation=None):
    return x.new_empty(x.shape)


@fake_kernel("causal_conv1d_bwd", host=["cu_seqlens"])
def _conv_bwd_fake(grad_y, x, weight, bias, cu_seqlens, prefix, activation=None):
    C, K = weight.shape
    S = prefix.shape[0] if prefix is not None else 0
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty((C,)), x.new_empty((S, K - 1, C))


# ---------------------------------------------------------------------------------------------------
# autograd (one setup and one backward: registered for the op and used by the facade's eager path,
# packcuda._lib.EagerOp)
# ---------------------------------------------------------------------------------------------------
def _conv_setup(ctx, inputs, output):
    x, weight, bias, cu, prefix, act = inputs
    ctx.save_for_backward(x, weight, bias, cu, prefix)
    ctx.act = act
    ctx.has_bias = bias is not None
    ctx.has_prefix = prefix is not None


_CONV_GRADS = _lib.EagerOp(ops.causal_conv1d_bwd)  # (no autograd of its own: no double backward)


def _conv_backward(ctx, grad_y):
    x, weight, bias, cu, prefix = ctx.saved_tensors
    dx, dw, db, dp = _CONV_GRADS(grad_y.requires_grad, grad_y.contiguous(), x, weight, bias, cu, prefix, ctx.act)
    return (
        dx,
        dw,
        db if ctx.has_bias else None,
        None,
        dp if ctx.has_prefix else None,
        None,
    )


_CONV = _lib.EagerOp(ops.causal_conv1d_fwd, _conv_setup, _conv_backward, differentiable=(0, 1, 2, 4))


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
_last_cu = (None, None, None)  # (the host list last given, a copy of its values, their CPU tensor)


def _host_cu(cu):
    """Host cu_seqlens as the op takes them (a CPU int64 tensor). The layers of one step pass the same list: the
    tensor made for the list last given is reused while that list holds the same values (checked every call)."""
    global _last_cu
    if type(cu) not in (list, tuple):
        return host_tensor(cu, op="causal_conv1d")
    last, values, t = _last_cu
    if cu is last and cu == values:
        return t
    t = host_tensor(cu, op="causal_conv1d")
    _last_cu = (cu, cu.copy() if type(cu) is list else cu, t)
    return t


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

    ``y[t] = act(bias + sum_k weight[:, k] * x[t - (K-1) + k])``, where taps before the start of t's segment
    read ``prefix[s, K-1 + (u - start)]`` (one slab of K-1 rows per segment), or zero without ``prefix``. Equal
    to ``torch.nn.functional.conv1d(x_seg.T[None], weight[:, None], bias, padding=K-1, groups=C)[..., :L]`` run
    per segment. Differentiable in ``x``, ``weight``, ``bias`` and ``prefix``; the ``weight`` / ``bias``
    gradients are reduced in a fixed order (deterministic, no atomics). Every argument is checked before
    anything is computed (``ValueError`` / ``TypeError`` naming ``packcuda.causal_conv1d`` and the argument).

    Args:
        x: ``[T, C]``, bf16 / fp16 / fp32 / fp64 (fp32 accumulation; fp64 for fp64), CPU or CUDA.
        weight: ``[C, K]`` with ``1 <= K <= 8``, ``x``'s dtype and device.
        bias: ``[C]``, ``x``'s dtype and device, or None.
        cu_seqlens: ``[S + 1]`` segment boundaries, or None for one segment. Host: validated on the host; on
            CUDA up to 479 segments travel in the kernels' launch parameters, more are uploaded without waiting
            (no sync). Device: its values are not read back (no sync), so they must already be valid: 0,
            non-decreasing, ending at T.
        prefix: ``[S, K-1, C]``, ``x``'s dtype and device: the K-1 rows before each segment (from
            ``conv_prefix`` under CP), or None for zeros.
        activation: None or ``"silu"``.

    Returns:
        ``[T, C]``, ``x``'s dtype and device. No sync.
    """
    op = "causal_conv1d"
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and (
            bias is None or isinstance(bias, torch.Tensor)) and (prefix is None or isinstance(prefix, torch.Tensor))):
        _check_tensor(op, "x", x)
        _check_tensor(op, "weight", weight)
        _check_tensor(op, "bias", bias, optional=True)
        _check_tensor(op, "prefix", prefix, optional=True)
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"packcuda.{op}: activation must be None or 'silu', got {activation!r} "
                        f"({type(activation).__name__})")
    # host lists become a CPU tensor here; a tensor goes to the op as it is (the op checks it)
    cu = cu_seqlens if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor) else _host_cu(cu_seqlens)
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad) or (
        prefix is not None and prefix.requires_grad)
    return _CONV(needs_grad, x, weight, bias, cu, prefix, activation)


# ---------------------------------------------------------------------------------------------------
# conv-prefix exchange under context parallelism: the conv prefix says which rows go where (its moves, built in
# C++ from the plan's layout), the row exchange (packcuda/exchange.py) moves them
# ---------------------------------------------------------------------------------------------------
class ConvPrefixSchedule(RowSchedule):
    """Which rows of which rank fill each local piece's K-1 prefix rows, for one rank of a shard plan: the row
    exchange's schedule (:class:`packcuda.exchange.RowSchedule`) of the conv prefix's moves, with output slot
    ``piece*(K-1)+j`` = prefix row j of the piece.

    A pure function of the plan and K, computed once on the host (``O(cp * pieces * K)``) and cached on the
    plan. Host lists: ``send_index`` (local rows to send, grouped by peer in rank order), ``send_counts`` /
    ``recv_counts`` (rows per peer), ``unpack`` (for prefix slot ``piece*(K-1)+j``: a local row, ``n_local + i``
    for row i of the receive buffer, or -1 for a zero row before the sequence start). Backward:
    ``bwd_send_index`` (prefix slots whose gradients go back to their owners, grouped by peer) and
    ``bwd_unpack`` ``[n_local, bwd_m]`` (for every local row, the gradient rows it sums, in a fixed order).
    ``send_first`` / ``bwd_send_first``: per peer, the first row when the rows sent to it are consecutive (they
    are then sent straight from the source), else -1. ``n_pieces``, ``n_local``, ``kernel_size``.
    """

    def __init__(self, plan, kernel_size: int):
        kernel_size = _check_schedule_args("conv_prefix_schedule", plan, kernel_size)
        bucket = plan.bucket
        super().__init__(ops.conv_prefix_schedule(
            torch.tensor(plan.cu_seqlens_host, dtype=torch.int64), int(plan.cp_size), int(plan.cp_rank),
            plan.layout, int(plan.align), None if bucket is None else int(bucket), kernel_size))
        self.kernel_size = kernel_size
        self.n_pieces, self.n_local = len(plan.piece_offset_host), self.n_src
        self.fingerprint = (plan.fingerprint, kernel_size)


def _check_x_local(op: str, x_local, plan, *, same_device: bool = False) -> None:
    """x_local must be a [plan.total_local, C] tensor of a float dtype on cpu or cuda (on the plan's device
    when same_device)."""
    _check_tensor(op, "x_local", x_local)
    if x_local.dim() != 2 or x_local.shape[0] != plan.total_local:
        raise ValueError(f"packcuda.{op}: x_local must be [T_local, C] with T_local = {plan.total_local}, "
                         f"got {tuple(x_local.shape)}")
    if x_local.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"packcuda.{op}: x_local must have dtype bfloat16, float16, float32 or float64, got "
                         f"{x_local.dtype}")
    if x_local.device.type not in ("cpu", "cuda"):
        raise ValueError(f"packcuda.{op}: x_local must be on cpu or cuda, got {x_local.device}")
    if same_device and x_local.device != plan.device:
        raise ValueError(f"packcuda.{op}: x_local is on {x_local.device}, but the plan is on {plan.device}")


def _check_schedule_args(op: str, plan, kernel_size, *, static_ok: bool = False) -> int:
    """The plan must be a ShardPlan (a StaticShardPlan only where static_ok) and kernel_size an integer in
    [1, 8]; returns kernel_size."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"packcuda.{op}: plan must be a ShardPlan (from packcuda.shard_plan), got "
                        f"{type(plan).__name__}")
    if isinstance(plan, StaticShardPlan) and not static_ok:
        raise ValueError(f"packcuda.{op}: plan is a StaticShardPlan, whose layout lives on the device; the host "
                         "exchange schedule needs a host plan (packcuda.shard_plan)")
    return check_int(op, "kernel_size", kernel_size, lo=1, hi=8)


def conv_prefix_schedule(plan, kernel_size: int) -> ConvPrefixSchedule:
    """The exchange schedule of a shard plan for one kernel size, computed once and cached on the plan.

    Args:
        plan: a ``ShardPlan`` (host metadata).
        kernel_size: K, an integer in [1, 8].

    Returns:
        The plan's ``ConvPrefixSchedule`` for K (host work only, no sync).
    """
    k = _check_schedule_args("conv_prefix_schedule", plan, kernel_size)
    cache = plan._memo.setdefault("conv_prefix_schedules", {})
    if k not in cache:
        cache[k] = ConvPrefixSchedule(plan, k)
    return cache[k]


def _agreement_fields(plan, K: int) -> list:
    """What the ranks of a conv_prefix call must agree on besides the rows' shape, dtype and backend."""
    return [Field("the plan (cu_seqlens / cp_size / layout / align / bucket)", plan.fingerprint, show=False),
            Field("kernel_size", K), Field("plan.cp_rank", plan.cp_rank, per_rank=True),
            Field("plan.layout", plan.layout)]


_HINT = ("Every rank must pass its own rank's plan of the same cu_seqlens / cp_size / layout / align / bucket, the "
         "same kernel_size and an x_local of the same channel count and dtype")


def conv_prefix(
    x_local: torch.Tensor,
    plan,
    kernel_size: int,
    group=None,
    *,
    check: Optional[bool] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The conv halo under CP: for every local piece of ``plan``, the K-1 rows before it in its own sequence.

    For piece ``p`` (``plan.pieces``, at padded offset ``o = plan.piece_offset[p]``), the rows at padded offsets
    ``[o-(K-1), o)`` of the piece's sequence, fetched from whichever rank holds them (this one included: zigzag
    chunks cp-1 and cp share a rank). Offsets before the sequence start give zero rows; pieces shorter than K-1
    are fine (a prefix may gather rows from several earlier pieces and ranks). Every rank of the group must call
    this, with the same kernel size, even when it has nothing to send or receive. Differentiable: the backward
    sends each prefix row's gradient back to its owner and sums it into ``x_local``'s gradient in a fixed order.

    The move is the row exchange's (``packcuda.exchange``).

    Agreement between ranks: the first call of an exchange (per plan, kernel size, group, device and backend,
    and again for each new channel count / dtype) runs one all_gather of a few int64 per rank — a fingerprint
    of the plan (cu_seqlens / cp_size / layout / align / bucket), K, C, dtype, cp_rank and backend — and every
    rank raises the same ``ValueError`` naming what differs, before any row moves. That first call syncs once
    (the gathered values are read on the host); later calls do not. A rank that never calls makes the others
    raise (``RuntimeError`` naming ``conv_prefix`` and ``group``) once the process group's timeout runs out
    (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``; gloo's default is 30 minutes). Run one
    call before capturing a CUDA graph (communicator, peer connections and the check happen there).

    Args:
        x_local: ``[T_local, C]``, bf16 / fp16 / fp32 / fp64, CPU or CUDA: this rank's buffer in the plan's
            layout.
        plan: a ``ShardPlan``, or a ``StaticShardPlan`` (fixed sizes: every rank sends every peer one row per
            prefix slot of the peer, ``S*(K-1)`` rows, zero rows where it holds none, in one equal-split
            ``all_to_all_single``; no host read, no agreement check, capturable; with ``cp_size == 1`` no group
            is needed).
        kernel_size: K, an integer in [1, 8].
        group: the CP process group (size ``plan.cp_size``; this rank is ``plan.cp_rank``).
        check: run the agreement check on every call (one all_gather and one host sync per call); default: the
            environment variable ``PACKCUDA_CONV_CHECK=1``.
        backend: ``"nccl"`` (CUDA with an NCCL group: pack kernel, one ``ncclGroupStart/End`` of
            ``ncclSend`` / ``ncclRecv`` per peer on the current stream, unpack kernel; a dedicated communicator
            built once per group), ``"torch"`` (``torch.distributed.batch_isend_irecv``, any backend incl.
            gloo), or ``"auto"`` (nccl when available).

    Returns:
        ``[S, K-1, C]`` (``S`` = the plan's local pieces), ``x_local``'s dtype and device. No sync on the nccl
        path after the first call (the schedule is cached on the plan).
    """
    op = "conv_prefix"
    K = _check_schedule_args(op, plan, kernel_size, static_ok=True)
    if isinstance(plan, StaticShardPlan):
        # fixed sizes (every rank sends every peer one row per prefix slot): no host read, capturable
        if plan.cp_size == 1:
            return _static_prefix(op, x_local, plan, K, None)
        check_group(op, group)
        check_group_matches(op, plan.cp_size, plan.cp_rank, group)
        return _static_prefix(op, x_local, plan, K, group)
    _check_x_local(op, x_local, plan)
    check = check_flag(op, check, "PACKCUDA_CONV_CHECK")
    backend = check_backend(op, backend)
    sched = plan._memo.get("conv_prefix_schedules", {}).get(K) or conv_prefix_schedule(plan, K)
    out = move(x_local, sched, group, op=op, key=sched.fingerprint, fields=lambda: _agreement_fields(plan, K),
               backend=backend, check=check, hint=_HINT, row_what="the channel count x_local.shape[1]",
               name="x_local", join_hint=" with its own rank's plan and the same kernel_size")
    return out.view(sched.n_pieces, K - 1, x_local.shape[1])


# ---------------------------------------------------------------------------------------------------
# static plans: the fixed-size move with the conv prefix's device tables
# ---------------------------------------------------------------------------------------------------
@fake_kernel("conv_prefix_schedule", host_only=["cu_seqlens"])
def _prefix_schedule_fake(cu_seqlens, cp_size, cp_rank, layout, align, bucket, kernel_size):
    return schedule_fake(cp_size)


@fake_kernel("conv_static_prefix_tables")
def _conv_static_prefix_tables_fake(pieces, piece_offset, piece_seq, cu_seqlens_padded, cp_size, cp_rank, layout,
                                    capacity, kernel_size):
    sq = piece_offset.shape[0] * (kernel_size - 1)
    e = lambda *n: torch.empty(n, dtype=torch.int64, device=piece_offset.device)  # noqa: E731
    return e(cp_size * sq), e(sq), e(capacity // cp_size, kernel_size - 1)


def _static_schedule(plan, K: int) -> StaticRowSchedule:
    """The conv prefix's fixed-size move of a static plan for kernel size K >= 2 (tables made on first use: one
    launch, no sync)."""
    cache = plan._memo.setdefault("conv_static_schedules", {})
    if K not in cache:
        send, unpack, bwd = ops.conv_static_prefix_tables(plan.pieces, plan.piece_offset, plan.piece_seq,
                                                          plan.cu_seqlens_padded, plan.cp_size, plan.cp_rank,
                                                          plan.layout, plan.capacity, K)
        cache[K] = StaticRowSchedule(plan.cp_size, plan.cp_rank, plan.total_local, unpack.shape[0], send, unpack, bwd)
    return cache[K]


def _static_prefix(op: str, x_local, plan, kernel_size, group) -> torch.Tensor:
    """The prefix rows of a static plan: exchanged over group, or (group None) the rows this rank holds."""
    K = check_int(op, "kernel_size", kernel_size, lo=1, hi=8)
    _check_x_local(op, x_local, plan, same_device=True)
    S, C = plan.piece_offset.shape[0], x_local.shape[1]
    if K == 1:
        return x_local.new_zeros((S, 0, C))
    return static_move(x_local, _static_schedule(plan, K), group, group is None).view(S, K - 1, C)


def _local_conv_prefix(self, x_local: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The conv prefix rows of every piece that this rank holds itself; zeros for the rows other ranks hold.

    Rows at padded offsets ``[o-(K-1), o)`` of each piece's sequence, zero rows before the sequence start. With
    ``cp_size == 1`` this is the whole prefix (what ``packcuda.conv_prefix`` returns): ``causal_conv1d(x_local,
    w, cu_seqlens=plan.pieces, prefix=plan.local_conv_prefix(x_local, K))`` equals the unsharded conv on every
    real slot. For ``cp_size > 1`` it is the local part of the exchange (``packcuda.conv_prefix`` with a group
    does the whole exchange). Differentiable (deterministic backward); capturable.

    Args:
        x_local: ``[T_local, C]`` on the plan's device.
        kernel_size: K, an integer in [1, 8].

    Returns:
        ``[S, K-1, C]``, ``x_local``'s dtype and device. No sync.
    """
    return _static_prefix("StaticShardPlan.local_conv_prefix", x_local, self, kernel_size, None)


# The conv prefix of a static plan is conv's (shard knows nothing of conv): the method is attached here.
StaticShardPlan.local_conv_prefix = _local_conv_prefix


__all__ += ["conv_prefix", "conv_prefix_schedule", "ConvPrefixSchedule"]
