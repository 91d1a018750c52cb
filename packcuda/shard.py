"""Shard plans for context parallelism: how a global packed stream maps to one CP rank's local buffer.

A ``ShardPlan`` is built once per batch from host ``cu_seqlens`` (no device sync) and then moves any
tensor laid out on the original stream to the rank's local layout (``ShardPlan.shard``,
``ShardPlan.labels``) and back (``ShardPlan.unshard``, ``ShardPlan.gather``). Two layouts:

``zigzag`` (Megatron / TransformerEngine THD): sequence ``i`` is padded at its tail to
``P_i = roundup(L_i, align)`` and cut into ``2*cp`` chunks of ``h_i = P_i / (2*cp)`` rows; rank ``r`` holds
chunks ``r`` and ``2*cp-1-r`` of every sequence, sequence after sequence (causal attention work balances).

``contiguous`` (Ulysses SP / FLA CP): sequences padded to ``align`` (default 1), the stream padded to a
multiple of ``cp`` (and of ``bucket``), rank ``r`` holds padded rows ``[r*Tp/cp, (r+1)*Tp/cp)``.

``bucket`` appends one extra trailing pad segment (its own entry in ``cu_seqlens_padded``, positions
from 0) so that the padded total is a multiple of ``bucket``; it is present only when its length
(``pad_size``) is non-zero, and it never lengthens a real sequence.

``static_shard_plan`` builds the same plan on the device from device ``cu_seqlens`` with shapes fixed by
``(capacity, max_seqs, cp_size)`` (a ``StaticShardPlan``: no host read, capturable in a CUDA graph).
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from . import _lib
from ._meta import (
    IntsLike,
    check_int,
    fake_kernel,
    host_tensor,
    is_device_tensor,
    output_device,
    resolve_device,
    tensor_device,
)
from .exchange import Field, check_agreement
from .pack import _fill_arg, _gather

_lib.load()
ops = torch.ops.packcuda

__all__ = ["ShardPlan", "shard_plan"]

# Largest padded total of a plan (its boundary tensors are int32, as varlen attention kernels expect); cp_size,
# align and bucket are bounded by it too (csrc/shard/shard.h: kMaxPaddedTotal).
MAX_PADDED_TOTAL = 2**31 - 1


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
@fake_kernel("shard_plan", host_only=["cu_seqlens"])
def _shard_plan_fake(cu_seqlens, cp_size, cp_rank, layout, align, bucket=None, device=None):
    ctx = torch.library.get_ctx()
    dev = output_device("shard_plan", cu_seqlens, device)
    total_local, nseg, npieces, n_meta = (ctx.new_dynamic_size() for _ in range(4))
    cpu = torch.device("cpu")
    e = lambda n, dt, d=dev: torch.empty(n, dtype=dt, device=d)  # noqa: E731
    i32, i64 = torch.int32, torch.int64
    return (e(total_local, i64), e(total_local, i64), e(total_local, i64), e(nseg + 1, i32), e(nseg + 1, i32),
            e(npieces + 1, i32), e(npieces, i64), e(npieces, i32), e(n_meta, i32, cpu), e(_N_INFO, i64, cpu))


@fake_kernel("shard_unshard_index", host_only=["cu_seqlens", "cu_seqlens_padded"])
def _shard_unshard_index_fake(cu_seqlens, cu_seqlens_padded, cp_size, layout, total_local, device=None):
    dev = output_device("shard_unshard_index", cu_seqlens, device)
    return torch.empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64, device=dev)


# What packcuda::shard_plan's host outputs hold, named by the op library itself (csrc/shard/shard_ops.cpp:
# PlanScalar, PlanSection): info is the scalars, then the start of every section of the host buffer and its end.
_FIELDS = dict(part.split(":") for part in ops.shard_plan_fields().split("; "))
_INFO_NAMES = tuple(_FIELDS["info"].split())
_SECTIONS = {name: k for k, name in enumerate(_FIELDS["sections"].split())}
_N_INFO = len(_INFO_NAMES) + len(_SECTIONS) + 1


# ---------------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------------
class ShardPlan:
    """One CP rank's share of a padded packed stream (build it with ``shard_plan``).

    The device tensors come from one upload and one kernel launch; the host lists are made on first use.

    Attributes:
        index: int64 ``[T_local]`` on ``device``: the original row of each local slot, -1 for padding.
        position_ids: int64 ``[T_local]`` on ``device``: the offset inside the padded sequence (pads keep
            counting, the bucket segment counts from 0).
        label_index: int64 ``[T_local]`` on ``device``: the original row of the next token of the same sequence,
            -1 at a sequence's last token and on pads.
        cu_seqlens_padded: int32 ``[N' + 1]`` on ``device``: the global padded boundaries (bucket segment
            included).
        cu_seqlens_local: int32 ``[N' + 1]`` on ``device``: this rank's boundaries of the same segments, for
            varlen attention.
        pieces: int32 ``[S + 1]`` on ``device``: runs of consecutive padded offsets of one segment in the local
            buffer (two per segment in zigzag, the window intersections in contiguous).
        piece_offset: int64 ``[S]`` on ``device``: each piece's first padded offset in its segment.
        piece_seq: int32 ``[S]`` on ``device``: each piece's segment.
        total: host int, the tokens of the original stream (``T``).
        total_padded: host int, the padded stream's length.
        total_local: host int, this rank's slots (``T_local``).
        pad_size: host int, the rows of the bucket segment (0 without one).
        max_seqlen_padded: host int, the longest padded segment.
        max_seqlen_local: host int, the longest local segment.
        layout: ``"zigzag"`` or ``"contiguous"``.
        cp_size: host int.
        cp_rank: host int.
        align: host int.
        bucket: host int or None.
        cu_seqlens_host: list, the original boundaries (also ``cu_seqlens_padded_host``,
            ``cu_seqlens_local_host``, ``pieces_host``, ``piece_offset_host``, ``piece_seq_host``).
    """

    def __init__(self, built, *, layout: str, cp_size: int, cp_rank: int, align: int, bucket: Optional[int],
                 device: torch.device):
        # built: the outputs of packcuda::shard_plan (see csrc/shard/shard_ops.cpp)
        (self.index, self.position_ids, self.label_index, self.cu_seqlens_padded, self.cu_seqlens_local,
         self.pieces, self.piece_offset, self.piece_seq, self._host_meta, info) = built
        info = info.tolist()
        # total, total_padded, total_local, pad_size, max_seqlen_padded, max_seqlen_local (named by the op)
        self.__dict__.update(zip(_INFO_NAMES, info))
        self._starts = info[len(_INFO_NAMES):]  # start of every section of the host buffer, then its end
        self.layout, self.cp_size, self.cp_rank = layout, cp_size, cp_rank
        self.align, self.bucket, self.device = align, bucket, device
        self._unshard_index: Optional[torch.Tensor] = None
        self._memo: dict = {}  # what is made on first use, by purpose (schedules, tables, host lists, masks)

    def __repr__(self) -> str:
        sequences = len(self._host_section("cu_seqlens")) - 1
        return (f"ShardPlan(layout={self.layout!r}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, "
                f"align={self.align}, bucket={self.bucket}, sequences={sequences}, "
                f"total={self.total}, total_padded={self.total_padded}, total_local={self.total_local}, "
                f"pad_size={self.pad_size}, device={self.device})")

    @property
    def fingerprint(self) -> int:
        """A signed 64-bit hash of what makes the plans of the ranks of one CP group one plan (cu_seqlens,
        cp_size, layout, align, bucket; not the rank): the collectives that take a plan compare it between the
        ranks before they move data."""
        fp = self._memo.get("fingerprint")
        if fp is None:
            fp = self._memo["fingerprint"] = _hash64(
                (list(self.cu_seqlens_host), self.cp_size, self.layout, self.align, self.bucket))
        return fp

    def _agree(self, op: str, x_local: torch.Tensor, group) -> None:
        """The agreement check of a collective over this plan (once per group, row shape and dtype): every rank
        passed its own rank's plan of the same batch and rows of one shape and dtype, or every rank raises the
        same ValueError."""
        key = (group, x_local.shape[1:], x_local.dtype)
        agreed = self._memo.setdefault("agreed", set())
        if key in agreed:
            return
        check_agreement(op, group, [
            Field(f"the plan ({self._identity})", self.fingerprint, show=False),
            Field("plan.cp_rank", self.cp_rank, per_rank=True),
            Field("x_local.shape[1:]", tuple(x_local.shape[1:])), Field("x_local.dtype", x_local.dtype)],
            hint=f"Every rank must pass its own rank's plan of the same batch ({self._identity}) and an x_local "
                 "of the same row shape and dtype", join_hint=" with its own rank's plan of the same batch")
        agreed.add(key)

    _identity = "cu_seqlens / cp_size / layout / align / bucket"

    # host copies (Python lists), made on first use from the plan's host buffer
    @property
    def cu_seqlens_host(self) -> List[int]:
        return self._host("cu_seqlens")

    @property
    def cu_seqlens_padded_host(self) -> List[int]:
        return self._host("cu_seqlens_padded")

    @property
    def cu_seqlens_local_host(self) -> List[int]:
        return self._host("cu_seqlens_local")

    @property
    def pieces_host(self) -> List[int]:
        return self._host("pieces")

    @property
    def piece_offset_host(self) -> List[int]:
        return self._host("piece_offset")

    @property
    def piece_seq_host(self) -> List[int]:
        return self._host("piece_seq")

    def _host_section(self, name: str) -> torch.Tensor:
        """The named section of the host buffer (a CPU int32 view)."""
        k = _SECTIONS[name]
        return self._host_meta[self._starts[k]:self._starts[k + 1]]

    def _host(self, name: str) -> List[int]:
        cache = self._memo.setdefault("host_lists", {})
        if name not in cache:
            cache[name] = self._host_section(name).tolist()
        return cache[name]

    @property
    def unshard_index(self) -> torch.Tensor:
        """int64 ``[T]`` on the plan's device: the row of each original token in the rank-major concatenation
        ``[cp*T_local]`` of all ranks' local buffers. Built on first use (one launch, no sync)."""
        if self._unshard_index is None:
            self._unshard_index = ops.shard_unshard_index(
                self._host_section("cu_seqlens"), self._host_section("cu_seqlens_padded"), self.cp_size,
                self.layout, self.total_local, self.device)
        return self._unshard_index

    def _rows(self, what: str, x: torch.Tensor, dim: int, want: int, name: str) -> int:
        """``dim`` made non-negative, after checking that ``x`` is a tensor with ``want`` rows along it."""
        if type(dim) is not int:
            dim = check_int(f"ShardPlan.{what}", "dim", dim)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"packcuda.ShardPlan.{what}: {name} must be a tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"packcuda.ShardPlan.{what}: {name} is on {x.device}, but the plan is on {self.device}")
        try:
            if x.shape[dim] == want:
                return dim % x.dim()
        except IndexError:
            pass
        if x.dim() == 0:
            raise ValueError(f"packcuda.ShardPlan.{what}: {name} must have at least 1 dimension")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"packcuda.ShardPlan.{what}: dim={dim} is out of range for {name} of shape "
                             f"{tuple(x.shape)}")
        d = dim % x.dim()
        raise ValueError(f"packcuda.ShardPlan.{what}: {name} has {x.shape[d]} rows along dim {d}, expected {want}")

    def shard(self, x: torch.Tensor, dim: int = 0, fill: float = 0) -> torch.Tensor:
        """This rank's rows of a tensor laid out on the original stream; pad slots get ``fill``.

        Every leading slice moves in one launch (no flattened index). Differentiable: the backward scatters the
        gradients back to the original rows (deterministic).

        Args:
            x: ``[T, ...]`` (``dim=0``) or e.g. mRoPE positions ``[3, T]`` / ``[4, T]`` (``dim=1``; strided views
                such as ``pos[:, 0, :]`` without a copy), any dtype, on the plan's device.
            dim: the dimension of the tokens.
            fill: the value of pad slots (one ``x``'s dtype holds).

        Returns:
            ``x``'s shape with ``T_local`` along ``dim``, ``x``'s dtype and device. No sync.
        """
        d = self._rows("shard", x, dim, self.total, "x")
        return _gather(x, self.index, _fill_arg("ShardPlan.shard", fill, "fill", x.dtype), d)

    def shard_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of position ids, with pad slots that never split a run of pads into one-token sequences.

        Real slots get the token's positions; pad slots get the plan's own ``position_ids`` there on every row: a
        sequence's tail pads continue counting from its padded offset (``L_i, L_i+1, ...``, above every real
        position of the sequence, which starts at 0 and grows by at most 1 per token) and the bucket segment counts
        from 0. So positions restart at 0 only where a segment starts, as position-based packed-sequence detection
        (transformers' ``find_packed_sequence_indices`` / ``prepare_fa_kwargs_from_position_ids``) needs.

        Args:
            position_ids: int32/int64 ``[T]``, ``[1, T]``, mRoPE ``[R, T]`` (R = 3 or 4), ``[R, 1, T]``
                (transformers' and Megatron's ``[R, B, T]`` with B = 1) or ``[1, R, T]`` (verl's ``[B, R, T]``),
                tokens along the last dim, on the plan's device (other leading sizes are refused: ``[2, T]``
                could be two rows or a batch of two).

        Returns:
            ``position_ids``' form with ``T_local`` along the last dim, its dtype and device. No sync.
        """
        return self._shard_positions("ShardPlan.shard_positions", "position_ids", position_ids)

    def _shard_positions(self, op: str, name: str, position_ids) -> torch.Tensor:
        """:meth:`shard_positions` for ``op``, whose refusals name the argument ``name``."""
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(f"packcuda.{op}: {name} must be a tensor, got {type(position_ids).__name__}")
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"packcuda.{op}: {name} must be an int32/int64 tensor, got {position_ids.dtype}")
        shape = tuple(position_ids.shape)
        rows = [n for n in shape[:-1] if n != 1]  # R (3 or 4) or nothing: B is 1
        if not 1 <= len(shape) <= 3 or shape[-1] != self.total or rows not in ([], [3], [4]):
            raise ValueError(f"packcuda.{op}: {name} must be [T], [1, T], [R, T], [R, 1, T] or [1, R, T] (R = 3 "
                             f"or 4, B = 1) with T = {self.total} tokens of the plan, got shape {shape}")
        if position_ids.device != self.device:
            raise ValueError(f"packcuda.{op}: {name} is on {position_ids.device}, but the plan is on {self.device}")
        out = _gather(position_ids, self.index, 0.0, len(shape) - 1)
        return torch.where(self._pad_mask, self.position_ids.to(out.dtype), out)

    @property
    def _pad_mask(self) -> torch.Tensor:
        """bool ``[T_local]``: the pad slots (made on first use, on the plan's device, no sync)."""
        m = self._memo.get("pad_mask")
        if m is None:
            m = self._memo["pad_mask"] = self.index < 0
        return m

    def labels(self, input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """This rank's next-token labels: the next token of the same sequence, right across chunk boundaries.

        Args:
            input_ids: integer ``[T]``, the original stream, on the plan's device.
            ignore_index: the label at each sequence's last token and on pads.

        Returns:
            ``[T_local]``, ``input_ids``' dtype and device. No sync.
        """
        self._rows("labels", input_ids, 0, self.total, "input_ids")
        ignore_index = check_int("ShardPlan.labels", "ignore_index", ignore_index)
        return _gather(input_ids, self.label_index,
                       _fill_arg("ShardPlan.labels", ignore_index, "ignore_index", input_ids.dtype), 0)

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """All ranks' local outputs back in the original order; pads are dropped.

        Differentiable.

        Args:
            gathered: ``[cp, T_local, ...]`` (or already flattened ``[cp*T_local, ...]``), any dtype, on the plan's
                device.

        Returns:
            ``[T, ...]``, ``gathered``'s dtype and device. No sync.
        """
        if not isinstance(gathered, torch.Tensor):
            raise TypeError(f"packcuda.ShardPlan.unshard: gathered must be a tensor, got {type(gathered).__name__}")
        if gathered.device != self.device:
            raise ValueError(f"packcuda.ShardPlan.unshard: gathered is on {gathered.device}, but the plan is on "
                             f"{self.device}")
        if gathered.dim() >= 2 and gathered.shape[0] == self.cp_size and gathered.shape[1] == self.total_local:
            flat = gathered.reshape(self.cp_size * self.total_local, *gathered.shape[2:])
        else:
            self._rows("unshard", gathered, 0, self.cp_size * self.total_local, "gathered")
            flat = gathered
        return _gather(flat, self.unshard_index, 0.0)

    def gather(self, x_local: torch.Tensor, group=None) -> torch.Tensor:
        """All-gather this rank's rows over the CP group, then ``unshard``: the whole stream on every rank.

        Works with gloo (CPU) and NCCL. Backward (the semantics of ``torch.distributed.nn.all_gather``): the
        gradients that all ranks hold for the full output are summed (a reduce-scatter; gloo: all-reduce then
        slice), and this rank receives the part for its own local rows; pad rows get zero gradient. If every rank
        computes the same loss on the gathered tensor, the gradient is therefore ``cp_size`` times that of one copy.

        The first call per group, row shape and dtype checks that the ranks agree (one all_gather of the plan's
        ``fingerprint``, ``cp_rank``, ``x_local.shape[1:]`` and dtype, one host sync): ranks holding plans of
        different batches, or rows of different shapes, all raise the same ``ValueError`` before any data moves.
        Every rank of the group must call it.

        Args:
            x_local: ``[T_local, ...]``, on the plan's device.
            group: the CP process group (size ``cp_size``); None for the default group.

        Returns:
            ``[T, ...]`` in the original order, ``x_local``'s dtype and device. The collective only, no host sync.
        """
        import torch.distributed as dist

        op = "packcuda.ShardPlan.gather"
        self._rows("gather", x_local, 0, self.total_local, "x_local")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{op}: group: no process group is initialized (torch.distributed.init_process_group)")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{op}: group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(group).__name__}")
        ws, rk = dist.get_world_size(group), dist.get_rank(group)
        if rk < 0:
            raise ValueError(f"{op}: group: this process is not a member of the group")
        if ws != self.cp_size or rk != self.cp_rank:
            raise ValueError(f"{op}: the process group has size {ws} and rank {rk}, but the plan is for "
                             f"cp_size={self.cp_size}, cp_rank={self.cp_rank}")
        self._agree("ShardPlan.gather", x_local, group)
        return _Gather.apply(x_local, self, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, plan: ShardPlan, group):
        import torch.distributed as dist

        ctx.plan, ctx.group = plan, group
        buf = x_local.new_empty((plan.cp_size * plan.total_local, *x_local.shape[1:]))
        dist.all_gather_into_tensor(buf, x_local.contiguous(), group=group)
        return ops.gather_rows(buf, plan.unshard_index, 0.0)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        plan, group = ctx.plan, ctx.group
        gbuf = ops.scatter_rows(grad.contiguous(), plan.unshard_index, plan.cp_size * plan.total_local)
        if dist.get_backend(group) == "nccl":
            out = gbuf.new_empty((plan.total_local, *gbuf.shape[1:]))
            dist.reduce_scatter_tensor(out, gbuf, op=dist.ReduceOp.SUM, group=group)
            return out, None, None
        dist.all_reduce(gbuf, op=dist.ReduceOp.SUM, group=group)
        lo = plan.cp_rank * plan.total_local
        return gbuf[lo:lo + plan.total_local].clone(), None, None


def _hash64(value) -> int:
    """A signed 64-bit hash of a value's repr (stable across processes, unlike hash())."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
def _check_layout_type(op: str, layout) -> None:
    """A layout is a name; which names are layouts is the op's to say (it refuses any other, naming the op)."""
    if not isinstance(layout, str):
        raise TypeError(f"packcuda.{op}: layout must be 'zigzag' or 'contiguous', got {layout!r}")


def shard_plan(
    cu_seqlens: IntsLike,
    cp_size: int,
    cp_rank: int,
    *,
    layout: str = "zigzag",
    align: Optional[int] = None,
    bucket: Optional[int] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> ShardPlan:
    """The plan of CP rank ``cp_rank`` of ``cp_size`` for a packed stream: everything CP-related derives from it.

    Args:
        cu_seqlens: ``[N + 1]`` boundaries, from 0, non-decreasing (zero-length sequences allowed). Host (list,
            numpy array, CPU tensor): no sync. A device tensor is read back once (``.cpu()``: one sync), because
            the layout's sizes depend on its values.
        cp_size: the CP group's size.
        cp_rank: this rank, in ``[0, cp_size)``.
        layout: ``"zigzag"`` (Megatron / TransformerEngine THD: rank r holds chunks r and 2*cp-1-r of every
            sequence) or ``"contiguous"`` (Ulysses SP / FLA CP: rank r holds one window of the padded stream).
        align: every sequence is padded to a multiple of it; zigzag: default ``2*cp_size``, must be a multiple
            of it (e.g. ``2*cp*tp``); contiguous: default 1.
        bucket: round the padded total up to a multiple of it with one trailing pad segment (zigzag: a multiple
            of ``align``; contiguous: the stream is padded to a multiple of ``lcm(bucket, cp_size)``); None for
            no bucket.
        device: where the plan's tensors live; default: ``cu_seqlens``'s device (CPU for host metadata).

    Returns:
        A ``ShardPlan``.
    """
    op = "shard_plan"
    _check_layout_type(op, layout)
    # integers that are really integers; their ranges are checked by the op (cp_size here already: the
    # default zigzag align is 2 * cp_size)
    cp_size = check_int(op, "cp_size", cp_size, lo=1, hi=MAX_PADDED_TOTAL)
    cp_rank = check_int(op, "cp_rank", cp_rank)
    if isinstance(cu_seqlens, torch.Tensor):
        src = tensor_device(op, "cu_seqlens", cu_seqlens)
        device = src if device is None else resolve_device(op, "device", device)
    else:
        device = _CPU if device is None else resolve_device(op, "device", device)
    if is_device_tensor(cu_seqlens):
        cu_seqlens = cu_seqlens.cpu()  # the one documented sync of device metadata
    cu = host_tensor(cu_seqlens, "cu_seqlens", op=op)
    align = (2 * cp_size if layout == "zigzag" else 1) if align is None else check_int(op, "align", align)
    bucket = None if bucket is None else check_int(op, "bucket", bucket)
    built = _shard_plan_op(cu, cp_size, cp_rank, layout, align, bucket, device)
    return ShardPlan(built, layout=layout, cp_size=cp_size, cp_rank=cp_rank, align=align, bucket=bucket,
                     device=device)


_CPU = torch.device("cpu")


_shard_plan_op = ops.shard_plan.default




# ---------------------------------------------------------------------------------------------------
# static plans: fixed shapes, built on the device
# ---------------------------------------------------------------------------------------------------
@fake_kernel("static_shard_plan")
def _static_shard_plan_fake(cu_seqlens, num_seqs, num_seqs_host, cp_size, cp_rank, layout, align, capacity,
                            max_seqs):
    dev = cu_seqlens.device
    nseg = max_seqs + 1
    npieces = 2 * nseg if layout == "zigzag" else nseg
    e = lambda n, dt: torch.empty(n, dtype=dt, device=dev)  # noqa: E731
    i32, i64 = torch.int32, torch.int64
    t_local = capacity // cp_size
    return (e(t_local, i64), e(t_local, i64), e(t_local, i64), e(nseg + 1, i32), e(nseg + 1, i32),
            e(npieces + 1, i32), e(npieces, i64), e(npieces, i32), e(nseg, i32), e(_N_STATUS, i64))


@fake_kernel("shard_static_unshard_index")
def _shard_static_unshard_index_fake(cu_seqlens, cu_seqlens_padded, cp_size, layout, capacity):
    return torch.empty(capacity, dtype=torch.int64, device=cu_seqlens.device)


# a static plan's status entries and flags, named by the op library (csrc/shard/shard_math.h: StaticStatusEntry,
# StaticStatus; flag k is bit 1 << k)
_STATUS_NAMES = tuple(_FIELDS["status"].split())
_STATUS_FLAGS = {name: 1 << k for k, name in enumerate(_FIELDS["flags"].split())}
_N_STATUS = len(_STATUS_NAMES)


class StaticShardPlan(ShardPlan):
    """A ``ShardPlan`` whose every shape is fixed by ``(capacity, max_seqs, cp_size)``, built on the device.

    Build it with ``static_shard_plan``. Building it reads nothing back and allocates nothing that depends on
    values, so it can be captured in a CUDA graph or compiled with static shapes, and one capture serves every
    batch of the same capacity. The original stream has ``total = capacity`` rows (a bucketed batch: the real
    tokens first, then rows the plan never reads): ``shard``, ``labels`` and ``shard_positions`` take
    ``[capacity, ...]`` inputs and ``unshard`` / ``gather`` return ``[capacity, ...]`` with zero rows past the
    real tokens. On everything the host plan ``shard_plan(cu_seqlens[:num_seqs + 1], ..., bucket=capacity)``
    has, the two are equal slot for slot. A batch that does not fit (padded total above ``capacity``,
    ``num_seqs`` outside ``[0, max_seqs]``, ``cu_seqlens`` not starting at 0 or decreasing) gives an all-pad
    plan (every ``index`` is -1; one pad segment covers the stream) and sets ``status``; ``check`` reads it
    (one sync) and raises. ``pad_size`` and the ``*_host`` lists are device values here and are refused.

    Attributes:
        index: int64 ``[capacity / cp_size]`` on ``device`` (also ``position_ids``, ``label_index``).
        cu_seqlens_padded: int32 ``[max_seqs + 2]`` on ``device``: the sequences, the bucket pad segment, then
            trailing repeats of the end (zero-length segments for varlen attention); also ``cu_seqlens_local``.
        pieces: int32 ``[S + 1]`` on ``device`` with ``S = 2 (max_seqs + 1)`` (zigzag) or ``max_seqs + 1``
            (contiguous; extra pieces are empty); ``piece_offset`` int64 ``[S]``, ``piece_seq`` int32 ``[S]``.
        cu_seqlens: int32 ``[max_seqs + 1]`` on ``device``: the batch's boundaries, entries past ``num_seqs``
            repeating the total.
        status: int64 ``[4]`` on ``device``: nonzero when the batch did not fit.
        total_local: host int, ``capacity / cp_size``.
        max_seqlen_local: host int, ``total_local``: a static bound for varlen attention (the real maximum is
            a device value).
        max_seqlen_padded: host int, ``capacity``: a static bound.
    """

    def __init__(self, built, *, layout: str, cp_size: int, cp_rank: int, align: int, capacity: int,
                 max_seqs: int, num_seqs, device: torch.device):
        (self.index, self.position_ids, self.label_index, self.cu_seqlens_padded, self.cu_seqlens_local,
         self.pieces, self.piece_offset, self.piece_seq, self.cu_seqlens, self.status) = built
        self.layout, self.cp_size, self.cp_rank = layout, cp_size, cp_rank
        self.align, self.bucket, self.device = align, capacity, device
        self.capacity, self.max_seqs, self.num_seqs = capacity, max_seqs, num_seqs
        self.total = self.total_padded = self.max_seqlen_padded = capacity
        self.total_local = self.max_seqlen_local = capacity // cp_size
        self._unshard_index: Optional[torch.Tensor] = None
        self._memo: dict = {}

    _identity = "capacity / max_seqs / cp_size / layout / align"

    @property
    def fingerprint(self) -> int:
        """A signed 64-bit hash of the plan's static shape (capacity, max_seqs, cp_size, layout, align; the batch
        itself is a device value and is not part of it)."""
        return _hash64(("static", self.capacity, self.max_seqs, self.cp_size, self.layout, self.align))

    def __repr__(self) -> str:
        return (f"StaticShardPlan(layout={self.layout!r}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, "
                f"align={self.align}, capacity={self.capacity}, max_seqs={self.max_seqs}, "
                f"total_local={self.total_local}, device={self.device})")

    def _device_value(self, name: str):
        raise ValueError(f"packcuda.StaticShardPlan.{name}: a static plan keeps this on the device (reading it "
                         f"would sync); use the device tensors (cu_seqlens, cu_seqlens_padded, "
                         f"cu_seqlens_local, pieces, ...) or build a host plan with packcuda.shard_plan")

    pad_size = property(lambda self: self._device_value("pad_size"))
    cu_seqlens_host = property(lambda self: self._device_value("cu_seqlens_host"))
    cu_seqlens_padded_host = property(lambda self: self._device_value("cu_seqlens_padded_host"))
    cu_seqlens_local_host = property(lambda self: self._device_value("cu_seqlens_local_host"))
    pieces_host = property(lambda self: self._device_value("pieces_host"))
    piece_offset_host = property(lambda self: self._device_value("piece_offset_host"))
    piece_seq_host = property(lambda self: self._device_value("piece_seq_host"))

    @property
    def unshard_index(self) -> torch.Tensor:
        """int64 ``[capacity]`` on the plan's device: the row of each original token in the rank-major
        concatenation ``[cp*T_local]`` of all ranks' local buffers, -1 past the real tokens. Built on first use
        (one launch, no sync)."""
        if self._unshard_index is None:
            self._unshard_index = ops.shard_static_unshard_index(
                self.cu_seqlens, self.cu_seqlens_padded, self.cp_size, self.layout, self.capacity)
        return self._unshard_index

    def check(self) -> "StaticShardPlan":
        """Raise if the batch did not fit the plan; call it outside captured regions (e.g. every N steps).

        Returns:
            The plan itself. Reads ``status`` (one device sync); raises ``ValueError`` naming the sizes when the
            batch did not fit.
        """
        status = dict(zip(_STATUS_NAMES, self.status.tolist()))
        flags, n, total, bad = status["flags"], status["num_seqs"], status["padded_total"], status["first_bad_cu"]
        why = []
        if flags & _STATUS_FLAGS["too_many_seqs"]:
            why.append(f"num_seqs={n} is outside [0, max_seqs={self.max_seqs}]")
        if flags & _STATUS_FLAGS["bad_cu"]:
            why.append("cu_seqlens[0] is not 0" if bad == 0 else
                       f"cu_seqlens decreases at entry {bad} (cu_seqlens[{bad}] < cu_seqlens[{bad - 1}])")
        if flags & _STATUS_FLAGS["over_capacity"]:
            why.append(f"the padded total of the batch ({'at least ' if total >= 2**31 else ''}{total} rows, "
                       f"sequences padded to align={self.align}) exceeds capacity={self.capacity}")
        if why:
            raise ValueError("packcuda.StaticShardPlan.check: the batch does not fit the static plan (its outputs "
                             "are all padding): " + "; ".join(why))
        return self


def static_shard_plan(
    cu_seqlens: torch.Tensor,
    num_seqs: Union[int, torch.Tensor],
    cp_size: int,
    cp_rank: int,
    *,
    capacity: int,
    max_seqs: int,
    layout: str = "zigzag",
    align: Optional[int] = None,
) -> StaticShardPlan:
    """A static-shape plan of CP rank ``cp_rank`` of ``cp_size``, built on ``cu_seqlens``'s device without a host read.

    Capturable in a CUDA graph; ``torch.compile(dynamic=False)`` compiles it once per ``(capacity, max_seqs,
    cp_size)``. The plan equals ``shard_plan(cu_seqlens[:num_seqs + 1], cp_size, cp_rank, layout=layout,
    align=align, bucket=capacity)`` on every slot that plan has. A batch that does not fit is not an exception
    here (that would need a host read): the plan is all padding and ``StaticShardPlan.check`` raises (one sync).

    Args:
        cu_seqlens: int32/int64 ``[max_seqs + 1]``, CPU or CUDA; its first ``num_seqs + 1`` entries are the
            batch's boundaries (entries past ``num_seqs`` are not read).
        num_seqs: a host int in ``[0, max_seqs]`` (baked into a capture), or a 0-dim int32/int64 tensor on
            ``cu_seqlens``' device (read by the kernel: use this for graphs and compiled steps).
        cp_size: the CP group's size.
        cp_rank: this rank, in ``[0, cp_size)``.
        capacity: the static padded total (the bucket); zigzag: a multiple of ``align``; contiguous: a multiple
            of ``cp_size``.
        max_seqs: the most sequences a batch may have.
        layout: ``"zigzag"`` or ``"contiguous"``.
        align: zigzag: default ``2*cp_size``, must be a multiple of it; contiguous: default 1.

    Returns:
        A ``StaticShardPlan`` on ``cu_seqlens``' device. No sync.
    """
    op = "static_shard_plan"
    _check_layout_type(op, layout)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"packcuda.{op}: cu_seqlens must be an int32/int64 tensor of max_seqs + 1 entries, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"packcuda.{op}: cu_seqlens must be an int32/int64 tensor, got {cu_seqlens.dtype}")
    device = tensor_device(op, "cu_seqlens", cu_seqlens)
    cp_size = check_int(op, "cp_size", cp_size, lo=1, hi=MAX_PADDED_TOTAL)
    cp_rank = check_int(op, "cp_rank", cp_rank)
    capacity = check_int(op, "capacity", capacity)
    max_seqs = check_int(op, "max_seqs", max_seqs)
    align = (2 * cp_size if layout == "zigzag" else 1) if align is None else check_int(op, "align", align)
    if isinstance(num_seqs, torch.Tensor):
        if num_seqs.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"packcuda.{op}: num_seqs must be a host int or a 0-dim int32/int64 tensor, got "
                            f"{num_seqs.dtype}")
        n_dev, n_host = num_seqs, 0
    else:
        n_dev, n_host = None, check_int(op, "num_seqs", num_seqs)
    built = ops.static_shard_plan.default(cu_seqlens, n_dev, n_host, cp_size, cp_rank, layout, align, capacity,
                                          max_seqs)
    return StaticShardPlan(built, layout=layout, cp_size=cp_size, cp_rank=cp_rank, align=align, capacity=capacity,
                           max_seqs=max_seqs, num_seqs=num_seqs, device=device)


__all__ += ["StaticShardPlan", "static_shard_plan"]
