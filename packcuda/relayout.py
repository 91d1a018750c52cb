"""The layout bridge: one batch, two CP layouts, and the move between them.

Hybrid models mix softmax attention (balanced causal work wants the zigzag layout) with linear-attention
recurrences (their CP backends want each rank to hold one contiguous slice of the stream). A zigzag plan and a
contiguous plan of the same batch with the same alignment (``align=2*cp``, the same ``bucket``) index the same
padded stream; only the rows each rank holds differ. :func:`hybrid_plans` builds the pair, :func:`relayout`
moves a tensor from one layout to the other (the inverse is the same call with the plans swapped). The move is
the row exchange's (:mod:`packcuda.exchange`): the layout bridge only says which rows go where (built in C++
from the two plans' layouts, once per plan pair, cached on the source plan).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _lib
from ._meta import IntsLike, check_int, fake_kernel
from .exchange import (
    Field,
    RowSchedule,
    StaticRowSchedule,
    check_backend,
    check_flag,
    check_group,
    check_group_matches,
    check_rows,
    move,
    refuse,
    schedule_fake,
    static_move,
)
from .shard import MAX_PADDED_TOTAL, ShardPlan, StaticShardPlan, shard_plan

_lib.load()
ops = torch.ops.packcuda

__all__ = ["relayout", "hybrid_plans"]

@fake_kernel("relayout_schedule", host_only=["cu_seqlens"])
def _relayout_schedule_fake(cu_seqlens, cp_size, cp_rank, src_layout, src_align, src_bucket, dst_layout, dst_align,
                            dst_bucket):
    return schedule_fake(cp_size)


@fake_kernel("relayout_static_tables")
def _relayout_static_tables_fake(cu_seqlens_padded, cp_size, cp_rank, src_layout, dst_layout, capacity):
    e = lambda *n: torch.empty(n, dtype=torch.int64, device=cu_seqlens_padded.device)  # noqa: E731
    return e(capacity), e(capacity // cp_size), e(capacity // cp_size, 1)


def _pair_problem(src, dst) -> Optional[str]:
    """Why two plans of one rank are no pair for relayout (None: they are). Host values only."""
    if type(src) is not type(dst):
        return (f"src_plan is a {type(src).__name__} but dst_plan is a {type(dst).__name__} (both host plans, or "
                "both static plans)")
    if src.cp_size != dst.cp_size or src.cp_rank != dst.cp_rank:
        return (f"src_plan is for rank {src.cp_rank} of {src.cp_size} but dst_plan for rank {dst.cp_rank} of "
                f"{dst.cp_size}")
    if isinstance(src, StaticShardPlan):
        a = (src.capacity, src.max_seqs, src.align)
        b = (dst.capacity, dst.max_seqs, dst.align)
        if a != b:
            return (f"src_plan has (capacity, max_seqs, align) = {a} but dst_plan {b}: the two static plans must "
                    "index one padded stream (the same batch, capacity, max_seqs and align)")
        if src.device != dst.device:
            return f"src_plan is on {src.device} but dst_plan on {dst.device}"
        return None
    if src.cu_seqlens_host != dst.cu_seqlens_host:
        return ("src_plan and dst_plan are plans of different batches (their cu_seqlens differ: "
                f"{_short(src.cu_seqlens_host)} and {_short(dst.cu_seqlens_host)})")
    if src.cu_seqlens_padded_host != dst.cu_seqlens_padded_host:
        return (f"src_plan (align={src.align}, bucket={src.bucket}) and dst_plan (align={dst.align}, "
                f"bucket={dst.bucket}) do not index one padded stream (their cu_seqlens_padded differ: "
                f"{_short(src.cu_seqlens_padded_host)} and {_short(dst.cu_seqlens_padded_host)}); build both with "
                "the same align (a multiple of 2*cp) and bucket, e.g. with packcuda.hybrid_plans")
    return None


def _short(v: list) -> str:
    return str(v) if len(v) <= 8 else f"[{', '.join(map(str, v[:4]))}, ..., {', '.join(map(str, v[-2:]))}]"


def _schedule(src: ShardPlan, dst: ShardPlan) -> RowSchedule:
    """The (cached) host schedule of the move from src's layout to dst's (one C++ call per plan pair)."""
    cache = src._memo.setdefault("relayout_schedules", {})
    key = (dst.layout, dst.align, dst.bucket)
    if key not in cache:
        b = (lambda p: None if p.bucket is None else int(p.bucket))
        cache[key] = RowSchedule(ops.relayout_schedule(
            torch.tensor(src.cu_seqlens_host, dtype=torch.int64), int(src.cp_size), int(src.cp_rank),
            src.layout, int(src.align), b(src), dst.layout, int(dst.align), b(dst)))
    return cache[key]


def _static_schedule(src: StaticShardPlan, dst: StaticShardPlan) -> StaticRowSchedule:
    """The (cached) fixed-size move between two static plans' layouts (tables made on first use: one launch)."""
    cache = src._memo.setdefault("relayout_static", {})
    if dst.layout not in cache:
        send, unpack, bwd = ops.relayout_static_tables(src.cu_seqlens_padded, src.cp_size, src.cp_rank,
                                                       src.layout, dst.layout, src.capacity)
        cache[dst.layout] = StaticRowSchedule(src.cp_size, src.cp_rank, src.total_local, dst.total_local, send,
                                              unpack, bwd)
    return cache[dst.layout]


def _fields(src: ShardPlan, dst: ShardPlan) -> list:
    return [Field("the plan pair (cu_seqlens / cp_size / layouts / align / bucket)", (src.fingerprint, dst.fingerprint),
                  show=False),
            Field("src_plan.cp_rank", src.cp_rank, per_rank=True),
            Field("src_plan.layout", src.layout), Field("dst_plan.layout", dst.layout)]


_PAIR_HINT = ("Every rank must pass a src_plan and a dst_plan of its own rank over one padded stream (the same batch, "
              "cp_size, align and bucket: packcuda.hybrid_plans)")

_HINT = ("Every rank must pass its own rank's src_plan and dst_plan of the same batch and an x_local of the same row "
         "shape and dtype")


def relayout(
    x_local: torch.Tensor,
    src_plan: ShardPlan,
    dst_plan: ShardPlan,
    group=None,
    *,
    backend: str = "auto",
    check: Optional[bool] = None,
) -> torch.Tensor:
    """This rank's rows of ``dst_plan`` (``[dst_plan.total_local, ...]``) from every rank's rows of ``src_plan``.

    Args:
        x_local: ``[src_plan.total_local, ...]``, any dtype and trailing shape, cpu or cuda: this rank's buffer
            in ``src_plan``'s layout (pad slots included).
        src_plan: this rank's plan of the batch in the layout of ``x_local``.
        dst_plan: this rank's plan of the batch in the layout wanted. The two are plans of one batch in two
            layouts over one padded stream (the same ``cu_seqlens``, ``cp_size``, ``cp_rank`` and
            ``cu_seqlens_padded``: build them with
            :func:`hybrid_plans`, or with the same ``align`` (a multiple of ``2*cp``) and ``bucket``). Both
            :class:`ShardPlan` (host plans) or both :class:`StaticShardPlan` of one capacity (fixed sizes: every
            rank sends every peer ``total_local`` rows in one equal-split ``all_to_all_single``, zero rows where it
            holds none — ``cp`` times the payload —; no host read, no agreement check, capturable in a CUDA graph;
            the two static plans must come from the same batch, which is a device value and is not checked).
        group: the CP process group (``cp_size`` ranks, this one = ``cp_rank``); not needed with ``cp_size == 1``.
        backend: ``"nccl"`` (pack kernel, one grouped ``ncclSend``/``ncclRecv`` per peer on a dedicated
            communicator, unpack kernel, on the current stream), ``"torch"`` (``batch_isend_irecv``, any backend
            incl. gloo) or ``"auto"`` (host plans).
        check: run the agreement check on every call (default: env ``PACKCUDA_EXCHANGE_CHECK=1``).

    Returns:
        ``[dst_plan.total_local, ...]``, ``x_local``'s dtype and trailing shape. The inverse move is
        ``relayout(y, dst_plan, src_plan, group)``. Rows that stay on the rank are copied, never sent.

    Differentiable (the backward is the reverse move: every row comes from exactly one source, so gradients are
    copied back, bitwise); deterministic. A pair that is no pair (other batch, other cp / rank, other padded
    stream) is refused with a ``ValueError`` before any communication: with host plans over a group, the rank
    that holds it joins the agreement check of the first call (below) with its problem, so that every rank raises
    the same ``ValueError`` naming the rank(s) with a bad pair, even where the other ranks' pairs are good (with
    static plans, or without a group, only the rank with the bad pair raises). Host plans: the schedule is built
    once per plan pair (C++, from the two layouts) and cached on ``src_plan``; the first call per (plan pair,
    group, device, backend, row shape, dtype) runs the agreement check (one all_gather, one host sync: every rank
    raises the same ``ValueError`` when the ranks hold plans of different batches); later calls do not sync
    (the NCCL path is capturable after that warm-up call). Every rank of the group must call it.
    """
    op = "relayout"
    for name, p in (("src_plan", src_plan), ("dst_plan", dst_plan)):
        if not isinstance(p, ShardPlan):
            raise TypeError(f"packcuda.{op}: {name} must be a ShardPlan (packcuda.shard_plan / hybrid_plans) or a "
                            f"StaticShardPlan, got {type(p).__name__}")
    check_rows(op, "x_local", x_local, src_plan.total_local, "src_plan.total_local")
    backend = check_backend(op, backend)
    check = check_flag(op, check)
    problem = _pair_problem(src_plan, dst_plan)
    if problem is not None and isinstance(src_plan, StaticShardPlan):
        # static plans run no agreement check (no host read, capturable): the refusal is this rank's own
        raise ValueError(f"packcuda.{op}: src_plan and dst_plan are no pair: {problem}")
    if problem is not None:
        # joins the agreement check of the other ranks' first call: every rank raises the same ValueError
        refuse(x_local, src_plan.cp_size, src_plan.cp_rank, group, op=op, problem=problem,
               problem_what="src_plan and dst_plan are no pair", backend=backend, hint=_PAIR_HINT,
               name="x_local", join_hint=" with its own rank's plans of the same batch")
    if isinstance(src_plan, StaticShardPlan):
        if x_local.device != src_plan.device:
            raise ValueError(f"packcuda.{op}: x_local is on {x_local.device}, but the static plans are on "
                             f"{src_plan.device}")
        local = src_plan.cp_size == 1
        if not local:
            check_group(op, group)
            check_group_matches(op, src_plan.cp_size, src_plan.cp_rank, group)
        return static_move(x_local, _static_schedule(src_plan, dst_plan), group, local)
    sched = _schedule(src_plan, dst_plan)
    return move(x_local, sched, group, op=op, key=(src_plan.fingerprint, dst_plan.layout, dst_plan.align),
                fields=lambda: _fields(src_plan, dst_plan), backend=backend, check=check, hint=_HINT,
                name="x_local", join_hint=" with its own rank's plans of the same batch")


def hybrid_plans(
    cu_seqlens: IntsLike,
    cp_size: int,
    cp_rank: int,
    *,
    bucket: Optional[int] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> Tuple[ShardPlan, ShardPlan]:
    """``(zigzag_plan, contiguous_plan)``: the two plans of CP rank ``cp_rank`` of ``cp_size`` for the packed
    stream ``cu_seqlens`` that a hybrid model needs (attention on zigzag, linear attention on contiguous), with
    ``align = 2*cp_size`` and the same ``bucket`` (a multiple of ``2*cp_size``), so that both index one padded
    stream and :func:`relayout` moves between them. Arguments as :func:`packcuda.shard_plan`. Syncs: as
    :func:`packcuda.shard_plan` (none for host ``cu_seqlens``)."""
    op = "hybrid_plans"
    cp_size = check_int(op, "cp_size", cp_size, lo=1, hi=MAX_PADDED_TOTAL // 2)
    align = 2 * cp_size
    try:
        zz = shard_plan(cu_seqlens, cp_size, cp_rank, layout="zigzag", align=align, bucket=bucket, device=device)
    except (TypeError, ValueError) as e:  # shard_plan's checks, named as this function's
        msg = str(e)
        if not msg.startswith("packcuda.shard_plan: "):
            raise
        raise type(e)(f"packcuda.{op}: " + msg[len("packcuda.shard_plan: "):]) from None
    ct = shard_plan(zz.cu_seqlens_host, cp_size, cp_rank, layout="contiguous", align=align, bucket=bucket,
                    device=zz.device)
    return zz, ct
