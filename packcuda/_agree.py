"""Agreement between the ranks of a group: every rank raises the same ValueError, naming the op and what differs,
when what they were given does not fit together (the row exchange's first-use check, ``plan.gather``, ...).
Public through :mod:`packcuda.exchange` (``Field``, ``check_agreement``)."""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch


def check_group(op: str, group) -> None:
    """torch.distributed is initialized and group is a ProcessGroup (or None: the default group)."""
    import torch.distributed as dist

    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"packcuda.{op}: group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"packcuda.{op}: group: torch.distributed is not initialized (call init_process_group)")



class Field(NamedTuple):
    """One thing every rank of a group must agree on.

    ``what``: how the message names it (e.g. ``"kernel_size"``). ``value``: any picklable, compared with ``==``.
    ``show``: the message lists the values per rank (False: only says that it differs, e.g. for a hash).
    ``per_rank``: the value must be the rank's index in the group (e.g. a plan's ``cp_rank``)."""

    what: str
    value: Any
    show: bool = True
    per_rank: bool = False


def _shown(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return v


def _group_timeout(group, device) -> Optional[Any]:
    """The process group's timeout (what its collectives wait at most), or None when it cannot be read."""
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(device).options._timeout
    except Exception:
        return None


def _gather_objects(op: str, group, obj, join_hint: str) -> list:
    """all_gather_object over the group; a rank that does not join makes the others raise RuntimeError naming
    `op` and `group` once the process group's timeout has passed."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        timeout = _group_timeout(group, torch.device("cpu"))
        raise RuntimeError(
            f"packcuda.{op}: group: not every rank of the group joined the agreement check within the process "
            f"group's timeout ({timeout if timeout is not None else 'unknown'}); every rank must call {op}"
            f"{join_hint} ({type(e).__name__}: {e})") from e
    return out


def _field_diffs(fields: Sequence[Field], rows: list) -> list:
    """The messages of the fields that differ between ranks (rows[r] = rank r's values)."""
    world = len(rows)
    diffs = []
    for i, f in enumerate(fields):
        col = [row[i] if i < len(row) else None for row in rows]
        if f.per_rank:
            if col != list(range(world)):
                diffs.append(f"{f.what} per rank is {[_shown(v) for v in col]}, expected {list(range(world))}")
        elif any(v != col[0] for v in col):
            if not f.show:
                diffs.append(f"{f.what} differs between ranks")
            else:
                shown = [_shown(v) for v in col]
                if all(isinstance(v, tuple) and len(v) == 1 for v in shown):
                    shown = [v[0] for v in shown]
                diffs.append(f"{f.what} per rank is {shown}")
    if any(len(row) != len(fields) for row in rows):
        diffs.append("the calls differ between ranks (different checks)")
    return diffs


def _raise_disagreement(op: str, what: str, diffs: list, hint: str) -> None:
    raise ValueError(f"packcuda.{op}: the ranks of the group disagree on {what}: " + "; ".join(diffs)
                     + (f". {hint}" if hint else ""))


def check_agreement(op: str, group, fields: Sequence[Field], *, hint: str = "",
                    what: str = "the plan or the call", join_hint: str = "") -> None:
    """One all_gather_object of ``fields``' values over ``group``: every rank raises the same ``ValueError``
    ("packcuda.<op>: the ranks of the group disagree on <what>: ...; <hint>") when they differ, before the caller
    moves any data. One host sync (the gathered values are read on the host). A rank that never calls makes the
    others raise ``RuntimeError`` ("packcuda.<op>: group: not every rank ...") after the group's timeout."""
    if not isinstance(op, str):
        raise TypeError(f"packcuda.check_agreement: op must be a str, got {type(op).__name__}")
    fields = list(fields) if isinstance(fields, (list, tuple)) else fields
    if not isinstance(fields, list) or not all(isinstance(f, Field) for f in fields):
        raise TypeError(f"packcuda.{op}: fields must be a list of packcuda.exchange.Field")
    check_group(op, group)
    rows = _gather_objects(op, group, tuple(f.value for f in fields), join_hint)
    diffs = _field_diffs(fields, rows)
    if diffs:
        _raise_disagreement(op, what, diffs, hint)


def _schedule_mismatch(rows: list) -> list:
    """Where the ranks' schedules do not fit together: what rank p sends rank q must be what q expects."""
    out = []
    for p, (send_p, _) in enumerate(rows):
        for q, (_, recv_q) in enumerate(rows):
            if q != p and send_p[q] != recv_q[p]:
                out.append(f"rank {p} sends rank {q} {send_p[q]} rows, rank {q} expects {recv_q[p]}")
    return out[:4] + ([f"... ({len(out) - 4} more)"] if len(out) > 4 else [])
