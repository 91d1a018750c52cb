"""The plan-driven row exchange between the ranks of a CP group: one engine for every move of rows by a plan.

Every rank holds a source buffer ``x`` ``[n_src, *trail]`` and fills an output ``[n_out, *trail]``. A *move*
``(src_rank, src_row, dst_rank, dst_slot)`` says that row ``src_row`` of rank ``src_rank``'s source fills slot
``dst_slot`` of rank ``dst_rank``'s output. A user of the engine (the conv prefix, the layout bridge, ...) only
says which rows go where; the engine does the rest: one host schedule per (plan(s), purpose), built in C++ and
cached by the caller; per (schedule, group, device, backend) a prepared call; on first use an agreement check
between the ranks; the move itself (NCCL: pack kernel, one grouped send/recv on a dedicated communicator, unpack
kernel; rows that stay on the rank are copied, never sent; gloo / CPU: ``torch.distributed.batch_isend_irecv``);
autograd (the backward is the reverse move: each slot's gradient goes back to its source row, and a row that fed
several slots sums them in a fixed order, deterministic).

Contract (what the users of the engine call)::

    RowSchedule.from_moves(cp, rank, n_src, n_out, src_rank, src_row, dst_rank, dst_slot) -> RowSchedule
        The schedule of rank `rank` of `cp` from host int64 tensors / lists of moves (any order; moves that
        involve neither this rank's source nor its output are ignored, so every rank may pass the same global
        list). A slot has at most one source (slots without one are zero rows); a source row may feed several
        slots. Both sides derive the order of the rows on the wire alike (by dst_rank, then dst_slot): no
        handshake. Bad moves are refused (ValueError naming packcuda.exchange_schedule). Build it once and keep it
        (e.g. on the plan it comes from): the prepared calls and device tables are cached on the object.

    exchange_rows(x, schedule, group=None, *, op="exchange_rows", fingerprint=0, backend="auto", check=None)
        -> [n_out, *trail]
        Differentiable; any dtype (sums in the backward need a floating dtype); trailing shapes are flattened to
        rows. `op` names the caller in every error; `fingerprint` (an int, or a list of Field) says what the
        caller's schedule is for: on the first call of a (schedule, group, device, backend), and again for each
        new row shape / dtype / fingerprint, the ranks all_gather it with the row shape, dtype and backend and
        every rank raises the same ValueError naming `op` and what differs, before any row moves (`check=True`,
        or env PACKCUDA_EXCHANGE_CHECK=1: on every call). cp == 1 (and backend != "nccl"): a local gather, no
        group needed. backend: "nccl" (CUDA and an NCCL group), "torch" (torch.distributed, any backend), "auto".
        No host sync after the first call on the NCCL path; capturable in a CUDA graph after one warm-up call.

    StaticRowSchedule(cp, rank, n_src, n_out, send, unpack, bwd) and
    exchange_rows_static(x, schedule, group=None, *, local=False, op="exchange_rows_static") -> [n_out, *trail]
        The fixed-size move for static plans: device tables (csrc/exchange/exchange_static.h) built by the user,
        every rank sends every peer block = send.shape[0] / cp rows, one equal-split all_to_all_single; no host
        read, no agreement check, capturable. local=True: only the rows this rank holds itself (no group).

    refuse(x, cp, rank, group, *, op, problem, problem_what, backend, ...)  (always raises)
        For a rank whose arguments have a problem only it can see (e.g. relayout's plan pair that is no pair):
        instead of its move it joins the agreement check of the other ranks' first call with the problem, so that
        every rank raises the same ValueError naming `op` and the rank(s) with a problem, before any row moves.

    check_agreement(op, group, fields, *, hint="", what="the plan or the call")
        The agreement check itself, for any collective (plan.gather, ...): every rank raises the same ValueError
        when a Field differs between ranks (or a per-rank Field is not the rank's index).

The raw ops (torch.ops.packcuda.exchange_*) are described in csrc/exchange/exchange_ops.cpp.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Callable, Optional

import torch

from . import _lib
from ._agree import (  # noqa: F401 (Field, check_agreement, check_group: public here)
    Field,
    _field_diffs,
    _gather_objects,
    _raise_disagreement,
    _schedule_mismatch,
    check_agreement,
    check_group,
)
from ._meta import fake_kernel, resolve_device

_lib.load()
ops = torch.ops.packcuda

__all__: list = []

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# dtypes the row kernels move element-wise; any other dtype travels as its bytes
_ROW_DTYPES = _FLOAT_DTYPES + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
@fake_kernel("exchange_gather_sum")
def _gather_sum_fake(a, b, index):
    return a.new_empty((index.shape[0], a.shape[1]))


def schedule_fake(cp_size: int) -> list:
    """The host lists of a schedule op (RowSchedule reads them in this order); their lengths depend on values."""
    ctx = torch.library.get_ctx()
    n_send, n_unpack, n_bwd_send, n_src, bwd_m = (ctx.new_dynamic_size() for _ in range(5))
    e = lambda *n: torch.empty(n, dtype=torch.int64)  # noqa: E731
    return [e(n_send), e(cp_size), e(cp_size), e(n_unpack), e(n_bwd_send), e(n_src, bwd_m), e(2), e(cp_size),
            e(cp_size)]


@fake_kernel("exchange_schedule", host_only=["src_rank", "src_row", "dst_rank", "dst_slot"])
def _exchange_schedule_fake(cp_size, cp_rank, n_src, n_out, src_rank, src_row, dst_rank, dst_slot):
    return schedule_fake(cp_size)


@torch.library.register_fake("packcuda::exchange_run")
def _exchange_run_fake(src, handle, out_lead):
    return src.new_empty((*out_lead, src.shape[-1]))


# ---------------------------------------------------------------------------------------------------
# host schedules
# ---------------------------------------------------------------------------------------------------
class RowSchedule:
    """One rank's schedule of a row exchange (build it with :meth:`from_moves`, or a user's schedule op).

    Host values: ``cp``, ``rank``, ``n_src``, ``n_out``; int64 CPU tensors ``send_index`` (source rows to send,
    grouped by peer in rank order), ``unpack`` ``[n_out]`` (per output slot: a source row r, ``n_src + i`` for
    row i of the receive buffer, or -1 for a zero row), ``bwd_send_index`` (output slots whose gradients go back
    to their sources, grouped by peer) and ``bwd_unpack`` ``[n_src, bwd_m]`` (per source row, the gradient rows
    it sums, in a fixed order: a value j < n_out is slot j, ``n_out + i`` row i received back, -1 nothing);
    lists ``send_counts`` / ``recv_counts`` (rows per peer) and ``send_first`` / ``bwd_send_first`` (per peer,
    the first row when the rows sent to it are consecutive — they are then sent straight from the source —
    else -1)."""

    def __init__(self, built):
        # built: the outputs of a schedule op (csrc/exchange/exchange_ops.h: schedule_tensors), in that order
        (self.send_index, send_counts, recv_counts, self.unpack, self.bwd_send_index, self.bwd_unpack, info,
         send_first, bwd_send_first) = built
        self.cp, self.rank, self.n_src, self.n_out = (int(v) for v in info.tolist())
        self.send_counts, self.recv_counts = send_counts.tolist(), recv_counts.tolist()
        self.send_first, self.bwd_send_first = send_first.tolist(), bwd_send_first.tolist()
        self._dev: dict = {}
        self._calls: dict = {}
        self._agreed: dict = {}  # (group, device, backend) -> agreement keys the ranks were checked to agree on

    @classmethod
    def from_moves(cls, cp: int, rank: int, n_src: int, n_out: int, src_rank, src_row, dst_rank,
                   dst_slot) -> "RowSchedule":
        """The schedule of rank ``rank`` of ``cp`` from the moves (host int64 tensors or lists of equal length,
        any order). Refused with ``ValueError`` naming ``packcuda.exchange_schedule``: ranks outside ``[0, cp)``,
        negative rows / slots, a row of this rank's source ``>= n_src``, a slot of its output ``>= n_out``, two
        moves filling one slot."""
        from ._meta import check_int, host_tensor

        op = "exchange_schedule"
        args = [check_int(op, n, v) for n, v in (("cp", cp), ("rank", rank), ("n_src", n_src), ("n_out", n_out))]
        cols = []
        for name, v in (("src_rank", src_rank), ("src_row", src_row), ("dst_rank", dst_rank),
                        ("dst_slot", dst_slot)):
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu":
                    raise ValueError(f"packcuda.{op}: {name} must be host metadata (a CPU tensor or a list), got a "
                                     f"tensor on {v.device}")
                cols.append(v)
            else:
                cols.append(host_tensor(v, name, op=op))
        return cls(ops.exchange_schedule(*args, *cols))

    def on(self, device) -> tuple:
        """(send_index, unpack [n_out, 1], bwd_send_index, bwd_unpack) on ``device`` (cpu or cuda; an
        index-less ``"cuda"`` is the current device), uploaded once, no sync."""
        from ._meta import to_device_async

        op = f"{type(self).__name__}.on"
        if device is None:
            raise TypeError(f"packcuda.{op}: device must be a device, got None")
        device = resolve_device(op, "device", device)
        key = str(device)
        if key not in self._dev:
            self._dev[key] = tuple(
                to_device_async(t, device) for t in
                (self.send_index, self.unpack[:, None].contiguous(), self.bwd_send_index, self.bwd_unpack))
        return self._dev[key]

    @property
    def rows_moved(self) -> int:
        """Rows this rank receives per forward call (the exchange's payload, in rows)."""
        return int(sum(self.recv_counts))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(cp={self.cp}, rank={self.rank}, n_src={self.n_src}, n_out={self.n_out}, "
                f"rows_moved={self.rows_moved})")


# ---------------------------------------------------------------------------------------------------
# groups, backends, communicators
# ---------------------------------------------------------------------------------------------------
def check_group_matches(op: str, cp: int, rank: int, group) -> None:
    """This process is rank `rank` of a group of `cp` ranks (host values, no collective)."""
    import torch.distributed as dist

    world, me = dist.get_world_size(group), dist.get_rank(group)
    if world != cp or me != rank:
        raise ValueError(f"packcuda.{op}: plan is for rank {rank} of {cp} but this process is rank {me} of {world} "
                         "in the group")


def group_backend(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # pragma: no cover
        return ""


_NCCL_BUILT: Optional[bool] = None


def nccl_built() -> bool:
    """Whether the library was built with NCCL (the raw-NCCL move)."""
    global _NCCL_BUILT
    if _NCCL_BUILT is None:
        _NCCL_BUILT = bool(ops.exchange_nccl_available())
    return _NCCL_BUILT


_NCCL_COMMS: dict = {}


def _nccl_comm(group, device: torch.device) -> int:
    """A dedicated NCCL communicator over ``group``'s ranks (created once per group and device)."""
    import torch.distributed as dist

    key = (id(group), str(device))
    if key not in _NCCL_COMMS:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        uid = ops.exchange_nccl_unique_id() if rank == 0 else torch.empty(128, dtype=torch.uint8)
        buf = uid.to(device)
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        _NCCL_COMMS[key] = ops.exchange_nccl_comm_init(buf.cpu(), world, rank, device.index or 0)
    return _NCCL_COMMS[key]


def _resolve_backend(op: str, x: torch.Tensor, group, backend: str) -> str:
    """The backend ("torch" or "nccl") a call uses."""
    nccl_ok = x.is_cuda and group_backend(group) == "nccl" and nccl_built()
    if backend == "auto":
        return "nccl" if nccl_ok else "torch"
    if backend == "nccl" and not nccl_ok:
        raise ValueError(f"packcuda.{op}: backend='nccl' needs a CUDA tensor, an NCCL group and a build with NCCL")
    return backend


def check_rows(op: str, name: str, x, n: int, n_what: str) -> None:
    """x must be a tensor [n, ...] on cpu or cuda (a TypeError / ValueError naming op, name and n_what)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"packcuda.{op}: {name} must be a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[0] != n:
        raise ValueError(f"packcuda.{op}: {name} must be [{n_what}, ...] with {n_what} = {n}, got {tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"packcuda.{op}: {name} must be on cpu or cuda, got {x.device}")


def check_backend(op: str, backend) -> str:
    if not isinstance(backend, str) or backend not in ("auto", "nccl", "torch"):
        raise ValueError(f"packcuda.{op}: backend must be 'auto', 'nccl' or 'torch', got {backend!r}")
    return backend


def check_flag(op: str, check, env: str = "PACKCUDA_EXCHANGE_CHECK") -> bool:
    """check=None: the environment variable `env` ('1': check every call); else a bool."""
    if check is None:
        return os.environ.get(env, "0") not in ("", "0")
    if not isinstance(check, bool):
        raise TypeError(f"packcuda.{op}: check must be None or a bool, got {check!r}")
    return check


# ---------------------------------------------------------------------------------------------------
# the move
# ---------------------------------------------------------------------------------------------------
def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [n, *trail] as contiguous rows [n, C] of a dtype the row kernels move (other dtypes as bytes)."""
    x2 = x.reshape(n, math.prod(x.shape[1:])) if x.dim() != 2 else x
    x2 = x2.contiguous()
    if x2.dtype not in _ROW_DTYPES:
        x2 = x2.view(torch.uint8)
    return x2


def _like(out2: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """Rows [n, C] back in x's dtype and trailing shape."""
    if out2.dtype != x.dtype:
        out2 = out2.view(x.dtype)
    return out2.view(n, *x.shape[1:]) if x.dim() != 2 else out2


def _p2p(src2, send_index, send_counts, recv_counts, unpack_index, group, rank):
    """One move through torch.distributed (rows travel as bytes): rows src2[send_index] go to the peers, then
    out = gather_sum(src2, received, unpack_index)."""
    import torch.distributed as dist

    send_buf = ops.gather_rows(src2, send_index, 0.0)
    recv_buf = src2.new_empty((int(sum(recv_counts)), src2.shape[1]))
    sb, rb = send_buf.view(torch.uint8), recv_buf.view(torch.uint8)
    p2p = []
    so = ro = 0
    for p in range(len(send_counts)):
        if p == rank:
            continue
        peer = dist.get_global_rank(group, p) if group is not None else p
        if send_counts[p]:
            p2p.append(dist.P2POp(dist.isend, sb[so:so + send_counts[p]], peer, group))
        if recv_counts[p]:
            p2p.append(dist.P2POp(dist.irecv, rb[ro:ro + recv_counts[p]], peer, group))
        so += send_counts[p]
        ro += recv_counts[p]
    if p2p:
        for req in dist.batch_isend_irecv(p2p):
            req.wait()
    return ops.exchange_gather_sum(src2, recv_buf, unpack_index)


class _Call:
    """The resolved move of one (schedule, group, device, backend). On the NCCL path both directions are prepared
    once on the C++ side (index tensors, counts, communicator, output shape; peers whose rows are consecutive are
    sent straight from the source, without a pack kernel), so a call is one op with one tensor and a handle.
    backend "local": cp == 1, a gather of this rank's own rows (no group)."""

    def __init__(self, sched: RowSchedule, group, backend: str, device: torch.device):
        self.sched, self.group, self.backend = sched, group, backend
        self.send_index, self.unpack, self.bwd_send_index, self.bwd_unpack = sched.on(device)
        self.handles = None
        if backend == "nccl":
            comm = _nccl_comm(group, device)
            prep = ops.exchange_prepare.default
            fwd = prep(self.send_index, sched.send_counts, sched.recv_counts, sched.send_first, self.unpack, comm,
                       sched.rank, sched.n_src, [sched.n_out])
            bwd = prep(self.bwd_send_index, sched.recv_counts, sched.send_counts, sched.bwd_send_first,
                       self.bwd_unpack, comm, sched.rank, sched.n_out, [sched.n_src])
            self.handles = (fwd, bwd)
            weakref.finalize(self, _release, fwd, bwd)
        self._run_nccl = ops.exchange_run.default

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        s = self.sched
        if self.handles is not None:
            return self._run_nccl(x2, self.handles[0], [s.n_out])
        if self.backend == "local":
            return ops.exchange_gather_sum(x2, x2[:0], self.unpack)
        return _p2p(x2, self.send_index, s.send_counts, s.recv_counts, self.unpack, self.group, s.rank)

    def backward(self, g2: torch.Tensor) -> torch.Tensor:
        # every rank runs the reverse move, even when it has nothing to send or receive
        s = self.sched
        if self.handles is not None:
            return self._run_nccl(g2, self.handles[1], [s.n_src])
        if self.backend == "local":
            return ops.exchange_gather_sum(g2, g2[:0], self.bwd_unpack)
        return _p2p(g2, self.bwd_send_index, s.recv_counts, s.send_counts, self.bwd_unpack, self.group, s.rank)


def _release(*handles):
    for h in handles:
        try:
            ops.exchange_release.default(h)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, call):
        ctx.call, ctx.x_shape, ctx.x_dtype = call, x.shape, x.dtype
        s = call.sched
        return _like(call.forward(_rows(x, s.n_src)), x, s.n_out)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.call.sched
        g2 = _rows(grad, s.n_out)
        gx = ctx.call.backward(g2)
        return gx.view(ctx.x_shape) if gx.dtype == ctx.x_dtype else gx.view(ctx.x_dtype).view(ctx.x_shape), None


def _resolve(op: str, x: torch.Tensor, cp: int, rank: int, group, backend: str) -> str:
    """The backend a call of rank `rank` of `cp` resolves to ("local", "torch" or "nccl"), with the group checks
    (host values only, no communication)."""
    if group is not None:
        check_group(op, group)
    if cp == 1 and backend != "nccl":
        return "local"
    check_group(op, group)
    check_group_matches(op, cp, rank, group)
    return _resolve_backend(op, x, group, backend)


def _agree(op: str, group, backend: str, x: torch.Tensor, counts: tuple, fields: Callable[[], list], hint: str,
           row_what: str, name: str, join_hint: str, problem: Optional[tuple] = None) -> None:
    """The agreement check of a call (first use of a key, or every call with check=True): one all_gather of the
    caller's fields, the row shape, dtype and backend, the schedule's counts and this rank's local problem
    (``(what, why, hint)``: what is wrong with this rank's arguments, found on this rank only; None: nothing).
    Every rank raises the same ValueError (built from the gathered values only): first for the ranks with a
    problem (naming them), else for fields that differ or schedules that do not fit together."""
    all_fields = list(fields()) + [Field(row_what, tuple(x.shape[1:])), Field(f"{name}.dtype", x.dtype),
                                   Field("the exchange backend", backend)]
    rows = _gather_objects(op, group, (tuple(f.value for f in all_fields), counts[0], counts[1], problem),
                           join_hint)
    bad = [(r, row[3]) for r, row in enumerate(rows) if row[3] is not None]
    if bad:
        what, _, bad_hint = bad[0][1]
        if len(bad) == 1:
            where = f"on rank {bad[0][0]} of the group's {len(rows)}: {bad[0][1][1]}"
        else:
            shown = "; ".join(f"rank {r}: {p[1]}" for r, p in bad[:2])
            more = f"; ... ({len(bad) - 2} more)" if len(bad) > 2 else ""
            where = f"on ranks {[r for r, _ in bad]} of the group's {len(rows)}: {shown}{more}"
        raise ValueError(f"packcuda.{op}: {what} {where} (refused on every rank before any data moved)"
                         + (f". {bad_hint}" if bad_hint else ""))
    if problem is not None:  # pragma: no cover - this rank's own row carries it
        raise AssertionError("packcuda: a local problem was not gathered")
    diffs = _field_diffs(all_fields, [r[0] for r in rows])
    if not diffs:
        mismatch = _schedule_mismatch([(r[1], r[2]) for r in rows])
        if mismatch:
            diffs = ["the schedules do not fit together (" + "; ".join(mismatch) + ")"]
    if diffs:
        _raise_disagreement(op, "the plan or the call", diffs, hint)


def move(x: torch.Tensor, sched: RowSchedule, group, *, op: str, key, fields: Callable[[], list], backend: str,
         check: bool, hint: str = "", row_what: Optional[str] = None, name: str = "x",
         join_hint: str = "") -> torch.Tensor:
    """The engine's call for users that checked their arguments already (x: [sched.n_src, *trail], a tensor on
    cpu or cuda; backend and check resolved): agreement check on first use of `key` (a hashable fingerprint of
    the caller's purpose; fields() builds its Fields only then) per (schedule, group, device, backend), before
    anything communicates (the NCCL communicator included), then the prepared call and autograd."""
    ckey = (group, x.device, backend)
    call = sched._calls.get(ckey)
    resolved = call.backend if call is not None else _resolve(op, x, sched.cp, sched.rank, group, backend)
    if resolved != "local":
        agreed = sched._agreed.setdefault(ckey, set())  # agreement keys every rank was checked to agree on
        akey = (key, x.shape[1:], x.dtype)
        if check or akey not in agreed:
            _agree(op, group, resolved, x, (sched.send_counts, sched.recv_counts), fields, hint,
                   row_what or f"{name}.shape[1:]", name, join_hint)
            agreed.add(akey)
    if call is None:
        call = sched._calls[ckey] = _Call(sched, group, resolved, x.device)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exchange.apply(x, call)
    s = sched
    return _like(call.forward(_rows(x, s.n_src)), x, s.n_out)


def refuse(x: torch.Tensor, cp: int, rank: int, group, *, op: str, problem: str, problem_what: str,
           backend: str, hint: str = "", name: str = "x", join_hint: str = "") -> None:
    """Always raises: the call of a rank whose arguments have a local `problem` (found on this rank only, e.g. a
    plan pair that is no pair) that would otherwise move rows of rank `rank` of `cp` over `group`. Where the move
    needs no group (cp == 1, backend not "nccl") or torch.distributed is not initialized, the ValueError is local
    ("packcuda.<op>: <problem_what>: <problem>"); else this rank joins the agreement check that the other ranks'
    first call runs (:func:`move`), so that every rank raises the same ValueError naming `op`, `problem_what` and
    the rank(s) with a problem, before any row moves (the other ranks' check must not have been cached already,
    i.e. the problem shows on the first call of a plan pair)."""
    import torch.distributed as dist

    local = f"packcuda.{op}: {problem_what}: {problem}"
    if (cp == 1 and backend != "nccl") or not (dist.is_available() and dist.is_initialized()):
        raise ValueError(local)
    resolved = _resolve(op, x, cp, rank, group, backend)
    if resolved == "local":
        raise ValueError(local)
    _agree(op, group, resolved, x, ([], []), list, hint, f"{name}.shape[1:]", name, join_hint,
           problem=(problem_what, problem, hint))
    raise ValueError(local)  # pragma: no cover - _agree raised


def exchange_rows(x: torch.Tensor, schedule: RowSchedule, group=None, *, op: str = "exchange_rows",
                  fingerprint=0, backend: str = "auto", check: Optional[bool] = None) -> torch.Tensor:
    """``[n_out, *trail]``: this rank's output of the move ``schedule`` describes, from every rank's ``x``
    ``[n_src, *trail]`` (any dtype; cpu or cuda). Slots without a source are zero rows. Every rank of ``group``
    (``schedule.cp`` ranks, this one = ``schedule.rank``) must call it, even with nothing to send or receive.

    Differentiable: the backward is the reverse move (each slot's gradient goes back to its source row; a row
    that fed several slots sums them in a fixed order; deterministic). ``op`` names the caller in every error;
    ``fingerprint`` (an int or a list of :class:`Field`) says what the schedule is for: it takes part in the
    agreement check (first call per schedule, group, device, backend and row shape / dtype / fingerprint: one
    all_gather, one host sync; every rank raises the same ``ValueError`` when the ranks disagree). ``check``
    (default: env ``PACKCUDA_EXCHANGE_CHECK=1``): run that check on every call. ``backend``: ``"nccl"``,
    ``"torch"`` or ``"auto"``. ``schedule.cp == 1`` (backend not ``"nccl"``): a local gather, no group needed.
    Syncs otherwise: none on the NCCL path (run one call before capturing a CUDA graph)."""
    if not isinstance(op, str):
        raise TypeError(f"packcuda.exchange_rows: op must be a str, got {type(op).__name__}")
    if not isinstance(schedule, RowSchedule):
        raise TypeError(f"packcuda.{op}: schedule must be a RowSchedule, got {type(schedule).__name__}")
    check_rows(op, "x", x, schedule.n_src, "n_src")
    backend = check_backend(op, backend)
    check = check_flag(op, check)
    if isinstance(fingerprint, bool) or not isinstance(fingerprint, (int, list, tuple)):
        raise TypeError(f"packcuda.{op}: fingerprint must be an int or a list of Field, got "
                        f"{type(fingerprint).__name__}")
    if isinstance(fingerprint, int):
        fields = [Field(f"the purpose of the exchange ({op})", fingerprint, show=False)]
    else:
        fields = list(fingerprint)
        if not all(isinstance(f, Field) for f in fields):
            raise TypeError(f"packcuda.{op}: fingerprint must be an int or a list of Field")
    fields.append(Field("the schedule's rank", schedule.rank, per_rank=True))
    key = tuple((f.what, f.value) for f in fields)
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"packcuda.{op}: fingerprint Field values must be hashable") from None
    return move(x, schedule, group, op=op, key=key, fields=lambda: fields, backend=backend, check=check)


# ---------------------------------------------------------------------------------------------------
# the fixed-size (static) move
# ---------------------------------------------------------------------------------------------------
class StaticRowSchedule:
    """The fixed-size move of a static plan (csrc/exchange/exchange_static.h): device int64 tables ``send``
    ``[cp * block]`` (source row for position i of peer p's block, -1: a zero row), ``unpack`` ``[n_out]`` (row
    of the received ``[cp * block]`` buffer for each output slot, -1: none; each received row feeds at most one
    slot) and ``bwd`` ``[n_src, M]`` (rows of the gradient buffer sent back that each source row sums, -1:
    none). Nothing is read back to the host."""

    def __init__(self, cp: int, rank: int, n_src: int, n_out: int, send: torch.Tensor, unpack: torch.Tensor,
                 bwd: torch.Tensor):
        from ._meta import check_int

        op = "StaticRowSchedule"
        cp = check_int(op, "cp", cp, lo=1)
        rank = check_int(op, "rank", rank, lo=0, hi=cp - 1)
        n_src, n_out = check_int(op, "n_src", n_src, lo=0), check_int(op, "n_out", n_out, lo=0)
        for name, t, dim in (("send", send, 1), ("unpack", unpack, 1), ("bwd", bwd, 2)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != dim:
                raise TypeError(f"packcuda.{op}: {name} must be a {dim}-D int64 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if t.device != send.device:
                raise ValueError(f"packcuda.{op}: {name} is on {t.device}, but send is on {send.device}")
        if send.shape[0] % cp:
            raise ValueError(f"packcuda.{op}: send must have cp * block rows (cp={cp}), got {send.shape[0]}")
        if unpack.shape[0] != n_out:
            raise ValueError(f"packcuda.{op}: unpack must have n_out={n_out} entries, got {unpack.shape[0]}")
        if bwd.shape[0] != n_src:
            raise ValueError(f"packcuda.{op}: bwd must have n_src={n_src} rows, got {bwd.shape[0]}")
        self.cp, self.rank, self.n_src, self.n_out = cp, rank, n_src, n_out
        self.send, self.unpack, self.bwd = send, unpack, bwd
        self.block = send.shape[0] // cp
        self._local = None

    def _local_tables(self):
        """(fwd [n_out], bwd [n_src, M]): the move restricted to this rank's own rows — fwd: the source row of
        each slot this rank fills itself (-1 elsewhere), bwd: the slots each own row sums. Made on first use from
        the tables (a few launches, no sync)."""
        if self._local is None:
            lo, B = self.rank * self.block, self.block
            u = self.unpack
            own = (u >= lo) & (u < lo + B)
            fwd = torch.where(own, self.send[torch.where(own, u, lo)], -1)
            # inverse of unpack on the own block: the slot that takes received row lo + i
            slots = torch.arange(1, self.n_out + 1, dtype=torch.int64, device=u.device)[:, None]
            inv = ops.scatter_rows(slots, torch.where(own, u - lo, -1), B)[:, 0] - 1
            b = self.bwd
            mine = (b >= lo) & (b < lo + B)
            bwd = torch.where(mine, inv[torch.where(mine, b - lo, 0)], -1)
            self._local = (fwd, bwd)
        return self._local


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all of the peer-major rows of x (cp blocks) over the group (rows travel as bytes)."""
    import torch.distributed as dist

    out = torch.empty_like(x)
    dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), group=group)
    return out


class _StaticExchange(torch.autograd.Function):
    """Forward: every rank sends each peer its block of rows (zero rows where it holds none), one equal-split
    all-to-all, then this rank's slots are gathered from the received buffer. Backward: the slot gradients
    scattered back into the block layout, the mirror all-to-all, and a fixed-order sum per source row. Local:
    only the rows this rank holds itself."""

    @staticmethod
    def forward(ctx, x2, sched, group, local):
        ctx.sched, ctx.group, ctx.local = sched, group, local
        return _static_forward(x2, sched, group, local)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.sched
        g = grad.contiguous()
        if ctx.local:
            return ops.exchange_gather_sum(g, g[:0], s._local_tables()[1]), None, None, None
        g_send = _all_to_all(ops.scatter_rows(g, s.unpack, s.cp * s.block), ctx.group)
        return ops.exchange_gather_sum(g_send, g_send[:0], s.bwd), None, None, None


def _static_forward(x2, s: StaticRowSchedule, group, local: bool):
    if local:
        return ops.gather_rows(x2, s._local_tables()[0], 0.0)
    return ops.gather_rows(_all_to_all(ops.gather_rows(x2, s.send, 0.0), group), s.unpack, 0.0)


def exchange_rows_static(x: torch.Tensor, schedule: StaticRowSchedule, group=None, *, local: bool = False,
                         op: str = "exchange_rows_static") -> torch.Tensor:
    """``[n_out, *trail]``: the fixed-size move of ``schedule`` (a :class:`StaticRowSchedule`) from every rank's
    ``x`` ``[n_src, *trail]`` (any dtype, on the tables' device) over ``group`` (``schedule.cp`` ranks, this one
    = ``schedule.rank``); ``local=True``: only the rows this rank holds itself, no group. Differentiable
    (fixed-order sums), no host read, no sync, no agreement check, capturable in a CUDA graph."""
    if not isinstance(schedule, StaticRowSchedule):
        raise TypeError(f"packcuda.{op}: schedule must be a StaticRowSchedule, got {type(schedule).__name__}")
    if not isinstance(local, bool):
        raise TypeError(f"packcuda.{op}: local must be a bool, got {local!r}")
    check_rows(op, "x", x, schedule.n_src, "n_src")
    if x.device != schedule.send.device:
        raise ValueError(f"packcuda.{op}: x is on {x.device}, but the schedule's tables are on "
                         f"{schedule.send.device}")
    if not local:
        check_group(op, group)
        check_group_matches(op, schedule.cp, schedule.rank, group)
    return static_move(x, schedule, group, local)


def static_move(x: torch.Tensor, schedule: StaticRowSchedule, group, local: bool) -> torch.Tensor:
    """exchange_rows_static for users that checked their arguments."""
    x2 = _rows(x, schedule.n_src)
    if torch.is_grad_enabled() and x.requires_grad:
        out2 = _StaticExchange.apply(x2, schedule, group, local)
    else:
        out2 = _static_forward(x2, schedule, group, local)
    return _like(out2, x, schedule.n_out)


__all__ += ["RowSchedule", "StaticRowSchedule", "Field", "exchange_rows", "exchange_rows_static",
            "check_agreement"]
