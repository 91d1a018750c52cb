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
from ._meta import IntsLike, check_int, fake_kernel, host_tensor, resolve_device

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


@fake_kernel("conv_gather_sum")
def _gather_sum_fake(a, b, index):
    return a.new_empty((index.shape[0], a.shape[1]))


@fake_kernel("conv_prefix_schedule", host_only=["cu_seqlens"])
def _prefix_schedule_fake(cu_seqlens, cp_size, cp_rank, layout, align, bucket, kernel_size):
    # host lists whose lengths depend on the values (ConvPrefixSchedule reads them in this order)
    ctx = torch.library.get_ctx()
    n_send, n_unpack, n_bwd_send, n_local, bwd_m = (ctx.new_dynamic_size() for _ in range(5))
    e = lambda *n: torch.empty(n, dtype=torch.int64)  # noqa: E731
    return [e(n_send), e(cp_size), e(cp_size), e(n_unpack), e(n_bwd_send), e(n_local, bwd_m), e(2), e(cp_size),
            e(cp_size)]


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
    cu = cu_seqlens if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor) else host_tensor(cu_seqlens, op=op)
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad) or (
        prefix is not None and prefix.requires_grad)
    return _CONV(needs_grad, x, weight, bias, cu, prefix, activation)


# ---------------------------------------------------------------------------------------------------
# conv-prefix exchange under context parallelism
# ---------------------------------------------------------------------------------------------------
_LAYOUT_CODES = {"zigzag": 0, "contiguous": 1}


class ConvPrefixSchedule:
    """Which rows of which rank fill each local piece's K-1 prefix rows, for one rank of a shard plan.

    A pure function of the plan and K, computed once on the host (``O(cp * pieces * K)``) and cached on the
    plan (``conv_prefix_schedule``).

    Attributes:
        send_index: host int64 ``[n_send]``, the local rows to send, grouped by peer in rank order.
        send_counts: list of ``cp`` ints, rows sent to each peer.
        recv_counts: list of ``cp`` ints, rows received from each peer.
        unpack: host int64 ``[n_pieces * (K-1)]``: for prefix slot ``piece*(K-1)+j``, a local row, ``n_local + i``
            for row i of the receive buffer, or -1 for a zero row before the sequence start.
        bwd_send_index: host int64, the prefix slots whose gradients go back to their owners, grouped by peer.
        bwd_unpack: host int64 ``[n_local, bwd_m]``: for every local row, the gradient rows it sums, in a fixed
            order.
        send_first: list of ``cp`` ints: per peer, the first row when the rows sent to it are consecutive (they
            are then sent straight from the source), else -1.
        bwd_send_first: the same for the backward.
    """

    def __init__(self, plan, kernel_size: int):
        kernel_size = _check_schedule_args("conv_prefix_schedule", plan, kernel_size)
        bucket = plan.bucket
        t = ops.conv_prefix_schedule(
            torch.tensor(plan.cu_seqlens_host, dtype=torch.int64), int(plan.cp_size), int(plan.cp_rank),
            _LAYOUT_CODES[plan.layout], int(plan.align), None if bucket is None else int(bucket), kernel_size)
        send_index, send_counts, recv_counts, unpack, bwd_send_index, bwd_unpack, info, send_first, bwd_send_first = t
        self.kernel_size = kernel_size
        self.cp_size, self.rank = int(plan.cp_size), int(plan.cp_rank)
        self.n_pieces, self.n_local = (int(v) for v in info.tolist())
        self.send_counts = send_counts.tolist()
        self.recv_counts = recv_counts.tolist()
        self.send_first, self.bwd_send_first = send_first.tolist(), bwd_send_first.tolist()
        self.send_index, self.unpack = send_index, unpack
        self.bwd_send_index, self.bwd_unpack = bwd_send_index, bwd_unpack
        self.fingerprint = _plan_fingerprint(plan, kernel_size)
        self._dev = {}

    def on(self, device: torch.device):
        """The schedule's index tensors on ``device``, uploaded once and cached.

        Args:
            device: CPU or CUDA (an index-less ``"cuda"`` is the current device).

        Returns:
            ``(send_index, unpack [n, 1], bwd_send_index, bwd_unpack)`` on ``device``. No sync.
        """
        device = _usable_device("ConvPrefixSchedule.on", "device", device)
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


def _usable_device(op: str, name: str, device) -> torch.device:
    """A cpu or cuda device that exists here (resolve_device, and given)."""
    if device is None:
        raise TypeError(f"packcuda.{op}: {name} must be a device, got None")
    return resolve_device(op, name, device)


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
    from .shard import ShardPlan, StaticShardPlan

    if not isinstance(plan, ShardPlan):
        raise TypeError(f"packcuda.{op}: plan must be a ShardPlan (from packcuda.shard_plan), got "
                        f"{type(plan).__name__}")
    if isinstance(plan, StaticShardPlan) and not static_ok:
        raise ValueError(f"packcuda.{op}: plan is a StaticShardPlan, whose layout lives on the device; the host "
                         "exchange schedule needs a host plan (packcuda.shard_plan)")
    return check_int(op, "kernel_size", kernel_size, lo=1, hi=8)


def _plan_fingerprint(plan, kernel_size=None) -> int:
    """A signed 64-bit hash of what makes two ranks' plans one plan (cu_seqlens, cp_size, layout, align,
    bucket), and of kernel_size when given."""
    import hashlib

    key = repr((list(plan.cu_seqlens_host), plan.cp_size, plan.layout, plan.align, plan.bucket,
                None if kernel_size is None else int(kernel_size)))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def conv_prefix_schedule(plan, kernel_size: int) -> ConvPrefixSchedule:
    """The exchange schedule of a shard plan for one kernel size, computed once and cached on the plan.

    Args:
        plan: a ``ShardPlan`` (host metadata).
        kernel_size: K, an integer in [1, 8].

    Returns:
        The plan's ``ConvPrefixSchedule`` for K (host work only, no sync).
    """
    k = _check_schedule_args("conv_prefix_schedule", plan, kernel_size)
    cache = plan.__dict__.setdefault("_conv_prefix_schedules", {})
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


_BACKEND_CODES = {"torch": 0, "nccl": 1}


def _group_timeout(group, device):
    """The process group's timeout (what its collectives wait at most), or None when it cannot be read."""
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(device).options._timeout
    except Exception:
        return None


def _verify_call(plan, K, x_local, group, backend) -> None:
    """One all_gather of a few int64 per rank (plan fingerprint, K, C, dtype, cp_rank, layout, backend): every
    rank raises the same ValueError when the ranks disagree, before any row is exchanged. A rank that does
    not join makes the others fail after the process group's timeout instead of waiting forever."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dev = x_local.device if backend == "nccl" or _group_backend(group) == "nccl" else torch.device("cpu")
    fields = ("plan", "kernel_size", "C", "dtype", "cp_rank", "layout", "backend")
    mine = torch.tensor([_plan_fingerprint(plan), K, x_local.shape[1], _FLOAT_DTYPES.index(x_local.dtype),
                         plan.cp_rank, _LAYOUT_CODES[plan.layout], _BACKEND_CODES[backend]],
                        dtype=torch.int64, device=dev)
    allv = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(allv, mine, group=group)
    except RuntimeError as e:
        timeout = _group_timeout(group, dev)
        raise RuntimeError(
            "packcuda.conv_prefix: group: not every rank of the group joined the plan check within the process "
            f"group's timeout ({timeout if timeout is not None else 'unknown'}); every rank must call conv_prefix "
            f"with its own rank's plan and the same kernel_size ({type(e).__name__}: {e})") from e
    rows = torch.stack(allv).cpu().tolist()  # host read: once per prepared exchange (every call with check=True)
    col = dict(zip(fields, zip(*rows)))
    diffs = []
    if len(set(col["plan"])) > 1:
        diffs.append("the plan (cu_seqlens / cp_size / layout / align / bucket) differs between ranks")
    if len(set(col["kernel_size"])) > 1:
        diffs.append(f"kernel_size per rank is {list(col['kernel_size'])}")
    if len(set(col["C"])) > 1:
        diffs.append(f"the channel count x_local.shape[1] per rank is {list(col['C'])}")
    if len(set(col["dtype"])) > 1:
        diffs.append("x_local.dtype per rank is "
                     f"{[str(_FLOAT_DTYPES[d]).replace('torch.', '') for d in col['dtype']]}")
    if list(col["cp_rank"]) != list(range(world)):
        diffs.append(f"plan.cp_rank per rank is {list(col['cp_rank'])}, expected {list(range(world))}")
    if len(set(col["layout"])) > 1:
        diffs.append(f"plan.layout per rank is {[('zigzag', 'contiguous')[v] for v in col['layout']]}")
    if len(set(col["backend"])) > 1:
        diffs.append(f"the exchange backend per rank is {[('torch', 'nccl')[v] for v in col['backend']]}")
    if diffs:
        raise ValueError("packcuda.conv_prefix: the ranks of the group disagree on the plan or the call: "
                         + "; ".join(diffs) + ". Every rank must pass its own rank's plan of the same cu_seqlens / "
                         "cp_size / layout / align / bucket, the same kernel_size and an x_local of the same "
                         "channel count and dtype")


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
    from .shard import StaticShardPlan

    if isinstance(plan, StaticShardPlan):
        # fixed sizes (every rank sends every peer one row per prefix slot): no host read, capturable
        if plan.cp_size == 1:
            return plan._conv_prefix(op, x_local, K, None)
        _check_group(op, group)
        _check_group_matches(plan, group)
        return plan._conv_prefix(op, x_local, K, group, exchange=True)
    _check_x_local(op, x_local, plan)
    if check is None:
        check = os.environ.get("PACKCUDA_CONV_CHECK", "0") not in ("", "0")
    elif not isinstance(check, bool):
        raise TypeError(f"packcuda.{op}: check must be None or a bool, got {check!r}")
    if not isinstance(backend, str) or backend not in ("auto", "nccl", "torch"):
        raise ValueError(f"packcuda.{op}: backend must be 'auto', 'nccl' or 'torch', got {backend!r}")
    _check_group(op, group)
    # Everything that depends only on (plan, K, group, device, backend) is resolved once and cached on the plan:
    # group size/rank checks, backend choice, the agreement check, communicator, schedule and its device tensors.
    # The per-call host work is then a dict lookup, the checks above and one op call.
    cache = plan.__dict__.setdefault("_conv_prefix_calls", {})
    key = (K, group, x_local.device, backend)
    call = cache.get(key)
    agreed = (x_local.shape[1], x_local.dtype)
    if call is None:
        resolved = _resolve_backend(x_local, plan, group, backend)
        _verify_call(plan, K, x_local, group, resolved)
        call = cache[key] = _PreparedCall(conv_prefix_schedule(plan, K), group, resolved, x_local.device)
        call.agreed.add(agreed)
    elif check or agreed not in call.agreed:
        _verify_call(plan, K, x_local, group, call.backend)
        call.agreed.add(agreed)
    if torch.is_grad_enabled() and x_local.requires_grad:
        return _ConvPrefix.apply(x_local, call)
    return call.forward(x_local)


@fake_kernel("conv_exchange_run")
def _exchange_run_fake(src, handle, out_lead):
    return src.new_empty((*out_lead, src.shape[-1]))


class _PreparedCall:
    """The resolved exchange of one (plan, kernel size, group, device, backend). On the NCCL path both
    directions are prepared once on the C++ side (schedule tensors, counts, communicator, output shape; peers
    whose rows are consecutive are sent straight from the source, without a pack kernel), so a call is one op
    with one tensor and a handle."""

    def __init__(self, sched, group, backend, device):
        self.sched, self.group, self.backend = sched, group, backend
        self.agreed = set()  # (C, dtype) pairs every rank of the group was checked to agree on
        self.send_index, self.unpack, self.bwd_send_index, self.bwd_unpack = sched.on(device)
        self.send_counts, self.recv_counts = sched.send_counts, sched.recv_counts
        self.comm = _nccl_comm(group, device) if backend == "nccl" else 0
        S, K1 = sched.n_pieces, sched.kernel_size - 1
        self.shape_tail = (S, K1)
        self.handles = None
        self.out_leads = ([S, K1], [sched.n_local])  # forward, backward
        if backend == "nccl":
            prep = ops.conv_exchange_prepare.default
            fwd = prep(self.send_index, self.send_counts, self.recv_counts, sched.send_first, self.unpack, self.comm,
                       sched.rank, sched.n_local, self.out_leads[0])
            bwd = prep(self.bwd_send_index, self.recv_counts, self.send_counts, sched.bwd_send_first,
                       self.bwd_unpack, self.comm, sched.rank, S * K1, self.out_leads[1])
            self.handles = (fwd, bwd)
            weakref.finalize(self, _release_exchanges, fwd, bwd)

    def forward(self, x_local):
        if self.handles is not None:
            return ops.conv_exchange_run.default(x_local, self.handles[0], self.out_leads[0])
        out = _exchange_torch(x_local.contiguous(), self.send_index, self.send_counts, self.recv_counts,
                              self.unpack, self.group, self.sched.rank)
        return out.view(*self.shape_tail, x_local.shape[1])

    def backward(self, grad):
        # every rank runs the mirror exchange, even when it has nothing to send or receive
        if self.handles is not None:
            return ops.conv_exchange_run.default(grad, self.handles[1], self.out_leads[1])
        g = grad.reshape(self.shape_tail[0] * self.shape_tail[1], grad.shape[-1]).contiguous()
        return _exchange_torch(g, self.bwd_send_index, self.recv_counts, self.send_counts, self.bwd_unpack,
                               self.group, self.sched.rank)


def _release_exchanges(*handles):
    for h in handles:
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


def _check_group(op: str, group) -> None:
    """torch.distributed is initialized and group is a ProcessGroup (or None: the default group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"packcuda.{op}: group: torch.distributed is not initialized (call init_process_group)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"packcuda.{op}: group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")


def _check_group_matches(plan, group) -> None:
    """This process is rank plan.cp_rank of a group of plan.cp_size ranks (host values, no collective)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.cp_size or rank != plan.cp_rank:
        raise ValueError(f"packcuda.conv_prefix: plan is for rank {plan.cp_rank} of {plan.cp_size} but this process "
                         f"is rank {rank} of {world} in the group")


def _resolve_backend(x_local, plan, group, backend) -> str:
    """The group matches the plan; the exchange backend ("torch" or "nccl") this call uses."""
    _check_group_matches(plan, group)
    nccl_ok = x_local.is_cuda and _group_backend(group) == "nccl" and _nccl_built()
    if backend == "auto":
        return "nccl" if nccl_ok else "torch"
    if backend == "nccl" and not nccl_ok:
        raise ValueError("packcuda.conv_prefix: backend='nccl' needs a CUDA x_local, an NCCL group and a build "
                         "with NCCL")
    return backend


__all__ += ["conv_prefix", "conv_prefix_schedule", "ConvPrefixSchedule"]
