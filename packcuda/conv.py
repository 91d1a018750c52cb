"""Varlen causal depthwise conv1d and the conv-prefix exchange for context parallelism.

``causal_conv1d`` convolves every segment of a packed ``[T, C]`` stream on its own (zero history at a
segment start, or the K-1 rows given in ``prefix``). ``conv_prefix`` fetches, for each local piece of a CP
shard plan, the K-1 rows that precede it in its own sequence — from whichever rank holds them — so that
``causal_conv1d(x_local, w, b, cu_seqlens=plan.pieces, prefix=conv_prefix(x_local, plan, K, group))``
equals the unsharded conv on this rank's slots, values and gradients.
"""
from __future__ import annotations

import os
import weakref

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


# ---------------------------------------------------------------------------------------------------
# conv-prefix exchange under context parallelism
# ---------------------------------------------------------------------------------------------------
_LAYOUT_CODES = {"zigzag": 0, "contiguous": 1}


class ConvPrefixSchedule:
    """Which rows of which rank fill each local piece's K-1 prefix rows, for one rank of a shard plan.

    A pure function of the plan and K, computed once on the host (``O(cp * pieces * K)``) and cached on the
    plan. Host lists: ``send_index`` (local rows to send, grouped by peer in rank order), ``send_counts`` /
    ``recv_counts`` (rows per peer), ``unpack`` (for prefix slot ``piece*(K-1)+j``: a local row, ``n_local + i``
    for row i of the receive buffer, or -1 for a zero row before the sequence start). Backward:
    ``bwd_send_index`` (prefix slots whose gradients go back to their owners, grouped by peer) and
    ``bwd_unpack`` ``[n_local, bwd_m]`` (for every local row, the gradient rows it sums, in a fixed order).
    """

    def __init__(self, plan, kernel_size: int):
        bucket = getattr(plan, "bucket", None)
        t = ops.conv_prefix_schedule(
            torch.tensor(plan.cu_seqlens_host, dtype=torch.int64), int(plan.cp_size), int(plan.cp_rank),
            _LAYOUT_CODES[plan.layout], int(plan.align), None if bucket is None else int(bucket), int(kernel_size))
        send_index, send_counts, recv_counts, unpack, bwd_send_index, bwd_unpack, info = t
        self.kernel_size = int(kernel_size)
        self.cp_size, self.rank = int(plan.cp_size), int(plan.cp_rank)
        self.n_pieces, self.n_local = (int(v) for v in info.tolist())
        self.send_counts = send_counts.tolist()
        self.recv_counts = recv_counts.tolist()
        self.send_index, self.unpack = send_index, unpack
        self.bwd_send_index, self.bwd_unpack = bwd_send_index, bwd_unpack
        self.fingerprint = _plan_fingerprint(plan, kernel_size)
        self._dev = {}

    def on(self, device: torch.device):
        """(send_index, unpack [n,1], bwd_send_index, bwd_unpack) on ``device``, uploaded once, no sync."""
        device = torch.device(device)
        key = str(device)
        if key not in self._dev:
            from ._meta import to_device_async

            self._dev[key] = tuple(
                to_device_async(t, device) for t in
                (self.send_index, self.unpack[:, None].contiguous(), self.bwd_send_index, self.bwd_unpack))
        return self._dev[key]

    @property
    def rows_moved(self) -> int:
        """Rows this rank receives per forward call (the exchange's payload, in rows of C elements)."""
        return int(sum(self.recv_counts))


def _plan_fingerprint(plan, kernel_size) -> int:
    import zlib

    key = repr((list(plan.cu_seqlens_host), plan.cp_size, plan.layout, plan.align, getattr(plan, "bucket", None),
                int(kernel_size)))
    return zlib.crc32(key.encode())


def conv_prefix_schedule(plan, kernel_size: int) -> ConvPrefixSchedule:
    """The (cached) exchange schedule of ``plan`` for kernel size ``kernel_size``."""
    cache = plan.__dict__.setdefault("_conv_prefix_schedules", {})
    k = int(kernel_size)
    if k not in cache:
        cache[k] = ConvPrefixSchedule(plan, k)
    return cache[k]


_NCCL_COMMS = {}


def _nccl_comm(group, device: torch.device) -> int:
    """A dedicated NCCL communicator over ``group``'s ranks (created once per group and device)."""
    import torch.distributed as dist

    key = (id(group), str(device))
    if key not in _NCCL_COMMS:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        uid = ops.conv_nccl_unique_id() if rank == 0 else torch.empty(128, dtype=torch.uint8)
        buf = uid.to(device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        _NCCL_COMMS[key] = ops.conv_nccl_comm_init(buf.cpu(), world, rank, device.index or 0)
    return _NCCL_COMMS[key]


def _group_backend(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # pragma: no cover
        return ""


def _exchange_torch(src, send_index, send_counts, recv_counts, unpack_index, group, rank):
    """One exchange through torch.distributed: rows src[send_index] go to the peers, then
    out = gather_sum(src, received, unpack_index)."""
    import torch.distributed as dist

    C = src.shape[1]
    send_buf = ops.gather_rows(src, send_index, 0.0)
    recv_buf = src.new_empty((int(sum(recv_counts)), C))
    p2p = []
    so = ro = 0
    for p in range(len(send_counts)):
        if p == rank:
            continue
        peer = dist.get_global_rank(group, p) if group is not None else p
        if send_counts[p]:
            p2p.append(dist.P2POp(dist.isend, send_buf[so:so + send_counts[p]], peer, group))
        if recv_counts[p]:
            p2p.append(dist.P2POp(dist.irecv, recv_buf[ro:ro + recv_counts[p]], peer, group))
        so += send_counts[p]
        ro += recv_counts[p]
    if p2p:
        for req in dist.batch_isend_irecv(p2p):
            req.wait()
    return ops.conv_gather_sum(src, recv_buf, unpack_index)


class _ConvPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, call):
        ctx.call = call
        return call.forward(x_local)

    @staticmethod
    def backward(ctx, grad):
        return ctx.call.backward(grad), None


def _check_plans(sched, x_local, group):
    """Debug mode: every rank exchanges (fingerprint, cp_rank) and raises on a mismatch instead of hanging."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dev = x_local.device if _group_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([sched.fingerprint, sched.rank, x_local.shape[1]], dtype=torch.int64, device=dev)
    allv = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(allv, mine, group=group)
    rows = torch.stack(allv).cpu().tolist()  # host read: this mode syncs once per call
    fps = {r[0] for r in rows}
    if len(fps) != 1 or [r[1] for r in rows] != list(range(world)) or len({r[2] for r in rows}) != 1:
        raise ValueError(
            "packcuda.conv_prefix: the ranks of the group disagree on the plan "
            f"(per rank [plan fingerprint, cp_rank, channels]: {rows}); every rank must pass its own rank's plan "
            "of the same cu_seqlens / cp_size / layout / align / bucket and the same kernel_size")


def conv_prefix(
    x_local: torch.Tensor,
    plan,
    kernel_size: int,
    group=None,
    *,
    check: Optional[bool] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``[S, K-1, C]``: for every local piece of ``plan`` (``plan.pieces``), the K-1 rows at padded offsets
    ``[o-(K-1), o)`` of the piece's own sequence (o = ``plan.piece_offset``), fetched from whichever rank holds
    them (this one included: zigzag chunks cp-1 and cp share a rank). Offsets before the sequence start give
    zero rows; pieces shorter than K-1 are fine (a prefix may gather rows from several earlier pieces/ranks).

    ``x_local`` ``[T_local, C]`` is this rank's buffer in the plan's layout; ``group`` the CP process group
    (size ``plan.cp_size``, this rank = ``plan.cp_rank``). Every rank of the group must call this, with the
    same kernel size, even when it has nothing to send or receive. Differentiable: the backward sends each
    prefix row's gradient back to its owner and sums it into ``x_local``'s gradient in a fixed order.

    ``backend``: ``"nccl"`` (CUDA with an NCCL group: pack kernel, one ``ncclGroupStart/End`` of
    ``ncclSend``/``ncclRecv`` per peer on the current stream, unpack kernel; a dedicated communicator built
    once per group), ``"torch"`` (``torch.distributed.batch_isend_irecv``, any backend incl. gloo), or
    ``"auto"`` (nccl when available). ``check`` (default: env ``PACKCUDA_CONV_CHECK=1``): exchange a plan
    fingerprint first and raise ``ValueError`` on a mismatch instead of hanging — costs one all_gather and one
    host sync per call. Syncs otherwise: none on the nccl path (the schedule is cached on the plan).
    """
    K = int(kernel_size)
    if not isinstance(x_local, torch.Tensor) or x_local.dim() != 2 or x_local.shape[0] != plan.total_local:
        raise ValueError(f"packcuda.conv_prefix: x_local must be [T_local, C] with T_local = {plan.total_local}, "
                         f"got {tuple(getattr(x_local, 'shape', ()))}")
    if check is None:
        check = os.environ.get("PACKCUDA_CONV_CHECK", "0") not in ("", "0")
    # Everything that depends only on (plan, K, group, device, backend) is resolved once and cached on the plan:
    # group size/rank checks, backend choice, communicator, schedule and its device tensors. The per-call host
    # work is then a dict lookup, the shape check above and one op call.
    cache = plan.__dict__.setdefault("_conv_prefix_calls", {})
    key = (K, group, x_local.device, backend)
    call = cache.get(key)
    if call is None:
        call = cache[key] = _prepare_call(x_local, plan, K, group, backend)
    sched = call.sched
    if check:
        _check_plans(sched, x_local, group)
    if torch.is_grad_enabled() and x_local.requires_grad:
        return _ConvPrefix.apply(x_local, call)
    return call.forward(x_local)


# handle -> lead dims of conv_exchange_run's output (the fake kernel's shape; handles are never reused)
_EXCHANGE_LEAD: dict = {}


def _prepare_exchange(send_index, send_counts, recv_counts, send_first, unpack, comm, rank, n_src, out_lead) -> int:
    """conv_exchange_prepare, with the output shape kept for the fake kernel of conv_exchange_run."""
    h = ops.conv_exchange_prepare.default(send_index, send_counts, recv_counts, send_first, unpack, comm, rank,
                                          n_src, list(out_lead))
    _EXCHANGE_LEAD[h] = tuple(out_lead)
    return h


@torch.library.register_fake("packcuda::conv_exchange_run")
def _exchange_run_fake(src, handle):
    return src.new_empty((*_EXCHANGE_LEAD[handle], src.shape[-1]))


def _first_rows(index: torch.Tensor, counts) -> list:
    """Per peer: the first row when the peer's rows of ``index`` (grouped by peer) are consecutive, else -1."""
    out, o = [], 0
    for c in counts:
        seg = index[o:o + c]
        o += c
        if c > 0 and bool((seg == torch.arange(int(seg[0]), int(seg[0]) + c)).all()):
            out.append(int(seg[0]))
        else:
            out.append(-1)
    return out


class _PreparedCall:
    """The resolved exchange of one (plan, kernel size, group, device, backend). On the NCCL path both
    directions are prepared once on the C++ side (schedule tensors, counts, communicator, output shape; peers
    whose rows are consecutive are sent straight from the source, without a pack kernel), so a call is one op
    with one tensor and a handle."""

    def __init__(self, sched, group, backend, device):
        self.sched, self.group, self.backend = sched, group, backend
        self.send_index, self.unpack, self.bwd_send_index, self.bwd_unpack = sched.on(device)
        self.send_counts, self.recv_counts = sched.send_counts, sched.recv_counts
        self.comm = _nccl_comm(group, device) if backend == "nccl" else 0
        S, K1 = sched.n_pieces, sched.kernel_size - 1
        self.shape_tail = (S, K1)
        self.handles = None
        if backend == "nccl":
            fwd = _prepare_exchange(self.send_index, self.send_counts, self.recv_counts,
                                    _first_rows(sched.send_index, self.send_counts), self.unpack, self.comm,
                                    sched.rank, sched.n_local, (S, K1))
            bwd = _prepare_exchange(self.bwd_send_index, self.recv_counts, self.send_counts,
                                    _first_rows(sched.bwd_send_index, self.recv_counts), self.bwd_unpack, self.comm,
                                    sched.rank, S * K1, (sched.n_local,))
            self.handles = (fwd, bwd)
            weakref.finalize(self, _release_exchanges, fwd, bwd)

    def forward(self, x_local):
        if self.handles is not None:
            return ops.conv_exchange_run.default(x_local, self.handles[0])
        out = _exchange_torch(x_local.contiguous(), self.send_index, self.send_counts, self.recv_counts,
                              self.unpack, self.group, self.sched.rank)
        return out.view(*self.shape_tail, x_local.shape[1])

    def backward(self, grad):
        # every rank runs the mirror exchange, even when it has nothing to send or receive
        if self.handles is not None:
            return ops.conv_exchange_run.default(grad, self.handles[1])
        g = grad.reshape(self.shape_tail[0] * self.shape_tail[1], grad.shape[-1]).contiguous()
        return _exchange_torch(g, self.bwd_send_index, self.recv_counts, self.send_counts, self.bwd_unpack,
                               self.group, self.sched.rank)


def _release_exchanges(*handles):
    for h in handles:
        _EXCHANGE_LEAD.pop(h, None)
        try:
            ops.conv_exchange_release.default(h)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


_NCCL_BUILT: Optional[bool] = None


def _nccl_built() -> bool:
    global _NCCL_BUILT
    if _NCCL_BUILT is None:
        _NCCL_BUILT = bool(ops.conv_nccl_available())
    return _NCCL_BUILT


def _prepare_call(x_local, plan, K, group, backend) -> _PreparedCall:
    import torch.distributed as dist

    if not 1 <= K <= 8:
        raise ValueError(f"packcuda.conv_prefix: kernel_size must be in [1, 8], got {K}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.cp_size or rank != plan.cp_rank:
        raise ValueError(f"packcuda.conv_prefix: plan is for rank {plan.cp_rank} of {plan.cp_size} but this process "
                         f"is rank {rank} of {world} in the group")
    if backend not in ("auto", "nccl", "torch"):
        raise ValueError(f"packcuda.conv_prefix: backend must be 'auto', 'nccl' or 'torch', got {backend!r}")
    nccl_ok = x_local.is_cuda and _group_backend(group) == "nccl" and _nccl_built()
    if backend == "auto":
        backend = "nccl" if nccl_ok else "torch"
    elif backend == "nccl" and not nccl_ok:
        raise ValueError("packcuda.conv_prefix: backend='nccl' needs a CUDA x_local, an NCCL group and a build "
                         "with NCCL")
    return _PreparedCall(conv_prefix_schedule(plan, K), group, backend, x_local.device)


__all__ += ["conv_prefix", "conv_prefix_schedule", "ConvPrefixSchedule"]
