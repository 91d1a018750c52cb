"""Micro-batch planning under a token cap and data-parallel balancing, by attention workload.

Host metadata work: the ops run on the CPU (C++), take sequence lengths as a list, numpy array or CPU tensor,
and never touch a device.
"""
from __future__ import annotations

from typing import List

import torch

from . import _lib
from ._meta import IntsLike, host_tensor

_lib.load()
ops = torch.ops.packcuda

__all__ = ["plan_micro_batches", "balance_across_ranks", "sequence_workloads"]

DEFAULT_WORKLOAD_COEF = 24576


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels: the number of micro-batches depends on the values, so it is a dynamic size
# ---------------------------------------------------------------------------------------------------
@torch.library.register_fake("packcuda::plan_micro_batches")
def _plan_micro_batches_fake(seqlens, max_tokens, min_micro_batches=1, multiple_of=1, workload="attention",
                             workload_coef=DEFAULT_WORKLOAD_COEF, method="karmarkar_karp", order="as_planned"):
    n_offsets = torch.library.get_ctx().new_dynamic_size(min=2)  # micro-batches + 1
    return seqlens.new_empty(seqlens.shape, dtype=torch.int64), seqlens.new_empty(n_offsets, dtype=torch.int64)


@torch.library.register_fake("packcuda::balance_across_ranks")
def _balance_across_ranks_fake(seqlens, world_size, equal_count=False, workload="attention",
                               workload_coef=DEFAULT_WORKLOAD_COEF):
    return (seqlens.new_empty(seqlens.shape, dtype=torch.int64),
            seqlens.new_empty(world_size + 1, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
def _seqlens(seqlens: IntsLike, op: str) -> torch.Tensor:
    if isinstance(seqlens, torch.Tensor) and seqlens.device.type != "cpu":
        raise ValueError(f"packcuda.{op}: seqlens must be host metadata (a list, numpy array or CPU tensor), "
                         f"got a {seqlens.device} tensor; planning runs on the host")
    return host_tensor(seqlens, "seqlens")


def _lists(indices: torch.Tensor, offsets: torch.Tensor) -> List[List[int]]:
    idx, off = indices.tolist(), offsets.tolist()
    return [idx[a:b] for a, b in zip(off[:-1], off[1:])]


def sequence_workloads(seqlens: IntsLike, workload: str = "attention",
                       workload_coef: int = DEFAULT_WORKLOAD_COEF) -> List[int]:
    """Per-sequence cost used by the planners: ``coef·L + L²`` (``"attention"``) or ``L`` (``"tokens"``)."""
    lens = _seqlens(seqlens, "sequence_workloads").tolist()
    if workload == "tokens":
        return lens
    if workload != "attention":
        raise ValueError(f"packcuda.sequence_workloads: workload must be 'attention' or 'tokens', got {workload!r}")
    return [int(workload_coef) * n + n * n for n in lens]


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
    """Split sequences into micro-batches whose token sums never exceed ``max_tokens``, balanced so that the
    largest micro-batch workload is as small as the planner can make it.

    Returns a list of micro-batches, each a list of sequence indices in ascending order; every index appears
    exactly once (a micro-batch is empty only when there are fewer sequences than micro-batches).

    - Count: ``max(ceil(sum / max_tokens), min_micro_batches)`` rounded up to ``multiple_of``; more
      micro-batches (keeping the multiple) only when the cap cannot be met with that many.
    - ``workload``: ``"attention"`` (``workload_coef·L + L²``) or ``"tokens"`` (``L``).
    - ``method``: ``"karmarkar_karp"`` (largest differencing) or ``"first_fit_decreasing"`` (sequences by
      decreasing workload, each into the least loaded micro-batch that has token room).
    - ``order``: ``"as_planned"`` (micro-batches by their smallest sequence index) or ``"pipeline"``
      (heaviest in the middle, lighter towards both ends).

    Deterministic (integer arithmetic, index tie-breaks): the same input gives the same plan on every rank.
    A sequence longer than ``max_tokens`` raises ``ValueError``. Host work only; no device sync.
    """
    s = _seqlens(seqlens, "plan_micro_batches")
    idx, off = ops.plan_micro_batches(s, int(max_tokens), int(min_micro_batches), int(multiple_of), str(workload),
                                      int(workload_coef), str(method), str(order))
    return _lists(idx, off)


def balance_across_ranks(
    seqlens: IntsLike,
    world_size: int,
    *,
    equal_count: bool = False,
    workload: str = "attention",
    workload_coef: int = DEFAULT_WORKLOAD_COEF,
) -> List[List[int]]:
    """Partition a global batch across ``world_size`` data-parallel ranks, minimizing the largest rank
    workload (Karmarkar–Karp plus a local search). Returns ``world_size`` lists of sequence indices (rank r
    gets list r, ascending). ``equal_count=True`` gives every rank the same number of sequences (needs
    ``len(seqlens) % world_size == 0``). Deterministic; host work only."""
    s = _seqlens(seqlens, "balance_across_ranks")
    idx, off = ops.balance_across_ranks(s, int(world_size), bool(equal_count), str(workload), int(workload_coef))
    return _lists(idx, off)
