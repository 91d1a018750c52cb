"""Micro-batch planning under a token cap and data-parallel balancing, by attention workload.

Host metadata work: the ops run on the CPU (C++), take sequence lengths as a list, numpy array or CPU tensor,
and never touch a device.
"""
from __future__ import annotations

from typing import List

import torch

from . import _lib
from ._meta import INT64_MAX, IntsLike, check_int, fake_kernel, host_tensor

_lib.load()
ops = torch.ops.packcuda

__all__ = ["plan_micro_batches", "balance_across_ranks", "sequence_workloads"]

DEFAULT_WORKLOAD_COEF = 24576

# The planners' ranges (counts, lengths, workload names and coefficients) are checked by the ops
# (csrc/balance/balance_ops.cpp). sequence_workloads has no op: it checks its own workload and coefficient, with the
# ops' bounds.
MAX_WORKLOAD_COEF = 2**40
_WORKLOADS = ("attention", "tokens")


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels: the number of micro-batches depends on the values, so it is a dynamic size
# ---------------------------------------------------------------------------------------------------
@fake_kernel("plan_micro_batches", host_only=["seqlens"])
def _plan_micro_batches_fake(seqlens, max_tokens, min_micro_batches=1, multiple_of=1, workload="attention",
                             workload_coef=DEFAULT_WORKLOAD_COEF, method="karmarkar_karp", order="as_planned"):
    n_offsets = torch.library.get_ctx().new_dynamic_size(min=2)  # micro-batches + 1
    return seqlens.new_empty(seqlens.shape, dtype=torch.int64), seqlens.new_empty(n_offsets, dtype=torch.int64)


@fake_kernel("balance_across_ranks", host_only=["seqlens"])
def _balance_across_ranks_fake(seqlens, world_size, equal_count=False, workload="attention",
                               workload_coef=DEFAULT_WORKLOAD_COEF):
    # the output size depends on world_size: its range check (the op's own, which does not run on fake tensors)
    # comes first, so that a bad value is refused by name rather than as a negative or huge fake size
    if not 1 <= world_size <= 2**20:
        raise ValueError(f"packcuda.balance_across_ranks: world_size must be in [1, 2^20], got {world_size}")
    return (seqlens.new_empty(seqlens.shape, dtype=torch.int64),
            seqlens.new_empty(world_size + 1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
def _seqlens(seqlens: IntsLike, op: str) -> torch.Tensor:
    if isinstance(seqlens, torch.Tensor) and seqlens.device.type != "cpu":
        raise ValueError(f"packcuda.{op}: seqlens must be host metadata (a list, numpy array or CPU tensor), "
                         f"got a {seqlens.device} tensor; planning runs on the host")
    return host_tensor(seqlens, "seqlens", op=op)


def _string(op: str, name: str, value) -> str:
    """A str argument as the ops take it: its Python type checked here (the schema would refuse another type
    with a RuntimeError), its value by the op."""
    if not isinstance(value, str):
        raise TypeError(f"packcuda.{op}: {name} must be a string, got {value!r} ({type(value).__name__})")
    return value


def _lists(indices: torch.Tensor, offsets: torch.Tensor) -> List[List[int]]:
    idx, off = indices.tolist(), offsets.tolist()
    return [idx[a:b] for a, b in zip(off[:-1], off[1:])]


def sequence_workloads(seqlens: IntsLike, workload: str = "attention",
                       workload_coef: int = DEFAULT_WORKLOAD_COEF) -> List[int]:
    """The per-sequence cost the planners balance: ``workload_coef·L + L²`` (``"attention"``) or ``L`` (``"tokens"``).

    Args:
        seqlens: host ``[n]`` lengths >= 0 (list, numpy array or CPU tensor; a device tensor is refused).
        workload: ``"attention"`` (linear layers plus quadratic attention) or ``"tokens"``.
        workload_coef: the linear coefficient, in ``[0, 2^40]`` (24576: verl's default for hidden size 4096).

    Returns:
        A list of ``n`` Python ints (every cost fits in int64, the planners' integer type). Host work only.
    """
    op = "sequence_workloads"
    if _string(op, "workload", workload) not in _WORKLOADS:
        raise ValueError(f"packcuda.{op}: workload must be 'attention' or 'tokens', got {workload!r}")
    coef = check_int(op, "workload_coef", workload_coef, lo=0, hi=MAX_WORKLOAD_COEF)
    lens = _seqlens(seqlens, op).tolist()
    out = []
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"packcuda.{op}: seqlens[{i}]={n} is negative")
        w = n if workload == "tokens" else coef * n + n * n
        if w > INT64_MAX:
            raise ValueError(f"packcuda.{op}: the workload of seqlens[{i}]={n} (workload_coef={coef}) is {w}, "
                             f"above int64")
        out.append(w)
    return out


def plan_micro_batches(
    seqlens: IntsLike,
    max_tokens: int,
    *,
    min_micro_batches: int = 1,
    multiple_of: int = 1,
    workload: str = "attention",
    workload_coef: int = DEFAULT_WORKLOAD_COEF,
    method: str = "karmarkar_karp",
    order: str = "as_planned",
) -> List[List[int]]:
    """Split sequences into micro-batches whose token sums never exceed ``max_tokens``, balanced by workload.

    The largest micro-batch workload is made as small as the planner can make it. Micro-batch count:
    ``max(ceil(sum / max_tokens), min_micro_batches)`` rounded up to ``multiple_of``; more micro-batches
    (keeping the multiple) only when the cap cannot be met with that many. Deterministic (integer arithmetic,
    ties broken by index): the same lengths give the same plan on every rank. Host work only: no device, no sync.

    Args:
        seqlens: host ``[n]`` lengths in ``[0, min(max_tokens, 2^30)]`` (list, numpy array or CPU tensor).
        max_tokens: the token cap of a micro-batch, >= 1.
        min_micro_batches: the fewest micro-batches, in ``[1, 2^20]``.
        multiple_of: the count is a multiple of this, in ``[1, 2^20]`` (e.g. the pipeline's micro-batch
            multiple).
        workload: ``"attention"`` (``workload_coef·L + L²``) or ``"tokens"`` (``L``); the total must stay below
            ``2^61``.
        workload_coef: the linear coefficient of ``"attention"``, in ``[0, 2^40]``.
        method: ``"karmarkar_karp"`` (largest differencing) or ``"first_fit_decreasing"`` (sequences by
            decreasing workload, each into the least loaded micro-batch that has token room); both followed
            by a local search that never raises the largest workload.
        order: ``"as_planned"`` (micro-batches by their smallest sequence index) or ``"pipeline"`` (heaviest in
            the middle, lighter towards both ends).

    With ``"karmarkar_karp"`` the plan never has more micro-batches than verl's ``rearrange_micro_batches``
    (Karmarkar–Karp, retried with ``multiple_of`` more micro-batches until the cap holds), and at the same count
    its largest workload is never higher: the Karmarkar–Karp split here is verl's (ties broken the same way), so
    where verl's split meets the cap it is the local search's start, and the search never raises the maximum
    (unless the count scan jumps, which takes ``2^19 / (n + k)`` failed counts).

    Returns:
        A list of micro-batches, each a list of sequence indices in ascending order; every index appears
        exactly once (a micro-batch is empty only when there are fewer sequences than micro-batches).
    """
    op = "plan_micro_batches"
    # Python types here (integers that are integers, within int64; strings); ranges and names in the op
    max_tokens = check_int(op, "max_tokens", max_tokens)
    min_micro_batches = check_int(op, "min_micro_batches", min_micro_batches)
    multiple_of = check_int(op, "multiple_of", multiple_of)
    workload = _string(op, "workload", workload)
    coef = check_int(op, "workload_coef", workload_coef)
    method = _string(op, "method", method)
    order = _string(op, "order", order)
    s = _seqlens(seqlens, op)
    idx, off = ops.plan_micro_batches(s, max_tokens, min_micro_batches, multiple_of, workload, coef, method, order)
    return _lists(idx, off)


def balance_across_ranks(
    seqlens: IntsLike,
    world_size: int,
    *,
    equal_count: bool = False,
    workload: str = "attention",
    workload_coef: int = DEFAULT_WORKLOAD_COEF,
) -> List[List[int]]:
    """Partition a global batch across data-parallel ranks, minimizing the largest rank workload.

    Karmarkar–Karp followed by a local search; never above verl's
    ``get_seqlen_balanced_partitions``, whose split is the search's start. Deterministic; host work only: no
    device, no sync.

    Args:
        seqlens: host ``[n]`` lengths in ``[0, 2^30]`` (list, numpy array or CPU tensor).
        world_size: the number of ranks, in ``[1, 2^20]``.
        equal_count: give every rank the same number of sequences (needs ``n % world_size == 0``).
        workload: ``"attention"`` (``workload_coef·L + L²``) or ``"tokens"`` (``L``); the total must stay below
            ``2^61``.
        workload_coef: the linear coefficient of ``"attention"``, in ``[0, 2^40]``.

    Returns:
        ``world_size`` lists of sequence indices, ascending: rank ``r`` gets list ``r``.
    """
    op = "balance_across_ranks"
    # Python types here; ranges and names in the op
    world_size = check_int(op, "world_size", world_size)
    if not isinstance(equal_count, bool):
        raise TypeError(f"packcuda.{op}: equal_count must be a bool, got {equal_count!r} "
                        f"({type(equal_count).__name__})")
    workload = _string(op, "workload", workload)
    coef = check_int(op, "workload_coef", workload_coef)
    s = _seqlens(seqlens, op)
    idx, off = ops.balance_across_ranks(s, world_size, equal_count, workload, coef)
    return _lists(idx, off)
