"""Vision towers under context parallelism: each CP rank encodes a share of the images / video frames of a packed
batch, and each merged-token embedding row goes only to the rank that holds its placeholder token.

:func:`vision_plan` finds every vision block of the packed stream (the block rules and errors of
:func:`packcuda.mrope_position_ids`), cuts the blocks into *units* (an image, a whole video, or with
``unit="frame"`` one temporal step of a video: the Qwen-VL towers attend within one temporal step, so a video
splits between ranks exactly), assigns every unit to an *encoding rank* by a deterministic cost balance that
every rank computes alike from host metadata, and knows from the shard plan which rank and local slot holds every
placeholder token. Its :class:`VisionPlan` gives the rank what its tower needs (:meth:`VisionPlan.local_pixel_values`,
:attr:`VisionPlan.local_grid_thw`), routes the tower's output rows to the ranks that hold their tokens
(:meth:`VisionPlan.route`, one grouped exchange, differentiable) and merges them into the local input embeddings
(:meth:`VisionPlan.merge`)::

    vplan = packcuda.vision_plan(input_ids, cu_seqlens, plan, image_grid_thw=..., video_grid_thw=...,
                                 image_token_id=..., video_token_id=..., unit="frame")
    embeds = tower(vplan.local_pixel_values(pixel_values, pixel_values_videos), vplan.local_grid_thw)
    inputs_embeds_local = vplan.merge(inputs_embeds_local, vplan.route(embeds, group))
"""
from __future__ import annotations

import hashlib
import math
import numbers
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import _lib
from ._meta import IntsLike, check_float, check_int, host_list, to_device_async

_lib.load()
ops = torch.ops.packcuda

__all__ = ["VisionPlan", "vision_plan", "VISION_COST_WIDTH"]

# The default cost of a unit is patches + (sum over its temporal steps of patches_per_step**2) / (6 * width): a
# ViT layer of width d with a 4d MLP does 12 d**2 multiply-adds per patch in its projections and 2 d per pair of
# patches of one temporal step in attention (QK^T and AV). The width of the Qwen2-VL / Qwen2.5-VL towers:
VISION_COST_WIDTH = 1280
_UNITS = ("image", "frame")
_FRAMES = ("whole", "per_frame")
_OP = "vision_plan"


# ---------------------------------------------------------------------------------------------------
# cost model and assignment
# ---------------------------------------------------------------------------------------------------
def _cost_fn(cost) -> Callable[[int, int, int], float]:
    """cost(t, h, w) of a unit of t temporal steps of an h x w patch grid (patches before the spatial merge)."""
    if cost is None:
        cost = (1.0, 1.0 / (6 * VISION_COST_WIDTH))
    if isinstance(cost, tuple):
        if len(cost) != 2:
            raise ValueError(f"packcuda.{_OP}: cost must be None, a pair (a, b) or a callable cost(t, h, w), got a "
                             f"tuple of {len(cost)}")
        a = check_float(_OP, "cost[0]", cost[0], lo=0.0)
        b = check_float(_OP, "cost[1]", cost[1], lo=0.0)
        return lambda t, h, w: a * (t * h * w) + b * (t * float(h * w) ** 2)
    if not callable(cost):
        raise TypeError(f"packcuda.{_OP}: cost must be None, a pair (a, b) or a callable cost(t, h, w), got "
                        f"{type(cost).__name__}")
    return cost


def _unit_costs(cost, grids: List[Tuple[int, int, int]]) -> List[float]:
    fn = _cost_fn(cost)
    out = []
    for k, (t, h, w) in enumerate(grids):
        c = fn(t, h, w)
        if isinstance(c, torch.Tensor) and c.dim() == 0:
            c = c.item()
        if isinstance(c, bool) or not isinstance(c, numbers.Real):
            raise TypeError(f"packcuda.{_OP}: cost({t}, {h}, {w}) of unit {k} must be a real number, got "
                            f"{type(c).__name__}")
        c = float(c)
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"packcuda.{_OP}: cost({t}, {h}, {w}) of unit {k} must be finite and >= 0, got {c}")
        out.append(c)
    return out


def _assign(costs: Sequence[float], affinity: Sequence[Sequence[int]], cp: int) -> List[int]:
    """Longest processing time first: units in decreasing cost (ties: lower unit first), each to the rank of least
    load; among equally loaded ranks the one holding most of the unit's tokens, then the lowest rank. The largest
    rank load is at most (4/3 - 1/(3 cp)) times the optimum (Graham 1969); the tie rule only saves traffic."""
    load = [0.0] * cp
    out = [0] * len(costs)
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        low = min(load)
        aff = affinity[u]
        r = max((r for r in range(cp) if load[r] == low), key=lambda r: (aff[r], -r))
        out[u] = r
        load[r] += costs[u]
    return out


# ---------------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------------
def _blake(*parts) -> int:
    """A signed 64-bit hash of the parts (tensors by their bytes, anything else by its repr), stable across
    processes."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.numpy().tobytes() if isinstance(p, torch.Tensor) else repr(p).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def _ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """int64 concatenation of arange(s, s + n) over (starts, lens) (host, vectorized)."""
    total = int(lens.sum()) if lens.numel() else 0
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    first = torch.cumsum(lens, 0) - lens
    return torch.repeat_interleave(starts - first, lens) + torch.arange(total, dtype=torch.int64)


class VisionPlan:
    """One CP rank's part of the vision work of a packed batch (build it with :func:`vision_plan`).

    Host values, the same on every rank: ``image_token_id``, ``video_token_id``, ``spatial_merge_size``,
    ``video_frames``, ``unit``, ``n_grid_rows`` (image and video grid rows). Units are numbered in *global order*:
    the image grid rows in order, then the video grid rows in order, a row's temporal steps in order with
    ``unit="frame"``; ``n_units``, ``unit_modality`` (0 image, 1 video), ``unit_row`` (grid row), ``unit_step``
    (first temporal step), ``unit_grid`` (``[t, h, w]`` of the unit: t temporal steps of an h x w patch grid),
    ``unit_cost``, ``assignment`` (encoding rank of every unit), and per rank ``rank_units``, ``rank_patches``,
    ``rank_attention`` (sum over the rank's temporal steps of patches_per_step**2), ``rank_cost``,
    ``rank_rows`` (merged-token rows it encodes), ``rank_slots`` (vision slots it holds) and ``traffic``
    (``[cp, cp]`` rows from each encoding rank to each holding rank; the diagonal stays local).

    This rank: ``local_units`` (its units in global order: the order of its tower's input and output),
    :attr:`local_grid_thw`, ``n_encoded`` (its tower's output rows), ``n_slots`` (its vision slots),
    :attr:`vision_slots`, the route's moves (:attr:`moves`), ``fingerprint`` (a hash of everything the ranks must
    agree on: the shard plan, the grids, the token positions, the units and their assignment)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self._dev = {}
        self._schedule = None

    def __repr__(self) -> str:
        return (f"VisionPlan(cp_size={self.cp_size}, cp_rank={self.cp_rank}, unit={self.unit!r}, "
                f"units={self.n_units}, local_units={len(self.local_units)}, n_encoded={self.n_encoded}, "
                f"n_slots={self.n_slots})")

    # ---- what this rank's tower needs --------------------------------------------------------------
    @property
    def local_grid_thw(self) -> torch.Tensor:
        """int64 ``[n_local_units, 3]`` (host): the grid rows ``[t, h, w]`` of this rank's units in tower order,
        so that the tower runs unchanged on :meth:`local_pixel_values`; a frame unit is ``[1, h, w]``."""
        return self._local_grid

    def local_pixel_values(self, pixel_values: Optional[torch.Tensor] = None,
                           pixel_values_videos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[P_local, D]``: the patch rows of this rank's units, images then videos, in the processor's
        ``pixel_values`` layout (per grid row: temporal step, then the merge blocks, row-major, then the
        ``merge x merge`` patches of a block; a temporal step's ``h*w`` rows are consecutive). ``pixel_values``
        holds every image's rows (``sum t*h*w`` over ``image_grid_thw``), ``pixel_values_videos`` every video's.
        One row gather per modality (and one copy when both contribute); differentiable; no sync (the index
        is uploaded once per device)."""
        op = "VisionPlan.local_pixel_values"
        parts = []
        for m, (name, pv) in enumerate((("pixel_values", pixel_values), ("pixel_values_videos",
                                                                          pixel_values_videos))):
            need = self._pixel_rows[m]
            if pv is None:
                if need:
                    raise ValueError(f"packcuda.{op}: {name} is None but the batch has {need} "
                                     f"{('image', 'video')[m]} patch rows")
                continue
            if not isinstance(pv, torch.Tensor):
                raise TypeError(f"packcuda.{op}: {name} must be a tensor or None, got {type(pv).__name__}")
            if pv.dim() != 2:
                raise ValueError(f"packcuda.{op}: {name} must be [patches, D], got shape {list(pv.shape)}")
            if pv.shape[0] != need:
                raise ValueError(f"packcuda.{op}: {name} has {pv.shape[0]} rows but the "
                                 f"{('image', 'video')[m]}_grid_thw rows describe {need} patches (sum t*h*w)")
            if pv.device.type not in ("cpu", "cuda"):
                raise ValueError(f"packcuda.{op}: {name} is on {pv.device}; packcuda runs on cpu and cuda")
            parts.append((m, pv))
        if len(parts) == 2 and (parts[0][1].shape[1] != parts[1][1].shape[1] or
                                parts[0][1].dtype != parts[1][1].dtype or parts[0][1].device != parts[1][1].device):
            a, b = parts[0][1], parts[1][1]
            raise ValueError(f"packcuda.{op}: pixel_values ({a.shape[1]} columns, {a.dtype}, {a.device}) and "
                             f"pixel_values_videos ({b.shape[1]} columns, {b.dtype}, {b.device}) must agree")
        if not parts:
            return torch.empty(0, 0)
        from .pack import _gather

        outs = [_gather(pv, self._on(pv.device, f"pixel_index{m}"), 0.0, 0) for m, pv in parts]
        outs = [o for o in outs if o.shape[0]] or outs[:1]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # ---- where the embeddings go ------------------------------------------------------------------
    @property
    def vision_slots(self) -> torch.Tensor:
        """int64 ``[n_slots]`` on the shard plan's device: the local slots of this rank that hold vision tokens,
        ascending (the rows of :meth:`route`'s output). ``inputs_embeds_local[vplan.vision_slots] = routed``
        places the embeddings; :meth:`merge` does it differentiably."""
        return self._on(self.device, "slots")

    @property
    def moves(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The route's moves that involve this rank, host int64 ``(src_rank, src_row, dst_rank, dst_slot)``: row
        ``src_row`` of the tower output of rank ``src_rank`` goes to row ``dst_slot`` of the route output of rank
        ``dst_rank`` (one move per vision token; rows with ``src_rank == dst_rank`` stay local)."""
        return self._moves

    def route(self, embeds_local, group=None, *, backend: str = "auto", check: Optional[bool] = None):
        """The merged-token embeddings this rank's vision slots need, ``[n_slots, H]`` in :attr:`vision_slots`
        order, from whichever ranks encoded them.

        ``embeds_local``: this rank's tower output ``[n_encoded, H]`` (its units' merged tokens in
        :attr:`local_grid_thw` order; ``[0, H]`` on a rank that encodes nothing), or a list / tuple of such
        tensors of one dtype and device (e.g. Qwen3-VL's pooled output and its deepstack levels; widths may
        differ), which travel together in one exchange and come back as a list. ``group``: the CP process group
        (size ``cp_size``, this process its rank ``cp_rank``); every rank of it must call ``route`` with its own
        plan of the same batch. Rows encoded and held by this rank are copied, never sent.

        One grouped exchange through :func:`packcuda.exchange.exchange_rows` (``backend``: ``"auto"``,
        ``"nccl"`` on the current stream, ``"torch"`` through torch.distributed, gloo included). Agreement: on
        the first call of this plan (so once per batch; again for a new group, device, backend, feature widths or
        dtype; every call with ``check=True`` or ``PACKCUDA_EXCHANGE_CHECK=1``) the ranks compare
        :attr:`fingerprint`, the feature widths, dtype and ranks in one all_gather (one host sync), and every
        rank raises the same ``ValueError`` naming ``packcuda.VisionPlan.route`` when they differ, before a row
        moves. Later NCCL calls do not sync and can be captured in a CUDA graph. Differentiable: each slot's
        gradient goes back to its encoding rank (each tower output row feeds one slot, so nothing is summed:
        deterministic). The backward is collective too: where the features require grad on one rank they must
        on every rank (a rank that encodes nothing passes e.g. ``torch.zeros(0, H, requires_grad=True)``;
        ``packcuda.integrations.transformers.patch_qwen_vl_vision`` does this). ``cp_size == 1``: a local
        gather, no group needed."""
        from .exchange import Field, RowSchedule, exchange_rows

        op = "VisionPlan.route"
        single = isinstance(embeds_local, torch.Tensor)
        if not single and not (isinstance(embeds_local, (list, tuple)) and embeds_local):
            raise TypeError(f"packcuda.{op}: embeds_local must be a tensor or a non-empty list / tuple of tensors, "
                            f"got {type(embeds_local).__name__}")
        feats = [embeds_local] if single else list(embeds_local)
        for i, f in enumerate(feats):
            name = "embeds_local" if single else f"embeds_local[{i}]"
            if not isinstance(f, torch.Tensor):
                raise TypeError(f"packcuda.{op}: {name} must be a tensor, got {type(f).__name__}")
            if f.dim() != 2 or f.shape[0] != self.n_encoded:
                raise ValueError(f"packcuda.{op}: {name} must be [n_encoded, H] with n_encoded = {self.n_encoded} "
                                 f"(this rank's tower output rows), got {list(f.shape)}")
            if f.dtype != feats[0].dtype or f.device != feats[0].device:
                raise ValueError(f"packcuda.{op}: {name} is {f.dtype} on {f.device}, embeds_local[0] is "
                                 f"{feats[0].dtype} on {feats[0].device}: the features travel together")
        widths = [f.shape[1] for f in feats]
        x = feats[0] if single else torch.cat(feats, dim=1)
        if self._schedule is None:
            self._schedule = RowSchedule.from_moves(self.cp_size, self.cp_rank, self.n_encoded, self.n_slots,
                                                    *self._moves)
        fields = [Field("the vision plan (the shard plan, the grids, the vision tokens, the units and their encoding "
                        "ranks)", self.fingerprint, show=False),
                  Field("the widths of the feature tensors", tuple(widths))]
        out = exchange_rows(x, self._schedule, group, op=op, fingerprint=fields, backend=backend, check=check)
        return out if single else list(out.split(widths, dim=1))

    def _on(self, device: torch.device, what: str) -> torch.Tensor:
        key = (what, str(device))
        t = self._dev.get(key)
        if t is None:
            host = {"slots": self._slots_host, "grid": self._local_grid, "pixel_index0": self._pixel_index[0],
                    "pixel_index1": self._pixel_index[1], "image_rows": self._modality_rows[0],
                    "video_rows": self._modality_rows[1]}[what]
            t = self._dev[key] = to_device_async(host, device)
        return t

    def merge(self, inputs_embeds_local: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``inputs_embeds_local`` (``[T_local, H]`` or ``[1, T_local, H]``) with the rows at
        :attr:`vision_slots` replaced by ``routed`` (``[n_slots, H]``, :meth:`route`'s output), out of place.
        Differentiable in both (the replaced rows get no gradient from the first); deterministic; no sync."""
        op = "VisionPlan.merge"
        for name, t in (("inputs_embeds_local", inputs_embeds_local), ("routed", routed)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"packcuda.{op}: {name} must be a tensor, got {type(t).__name__}")
        x = inputs_embeds_local
        batched = x.dim() == 3
        if not (x.dim() == 2 or (batched and x.shape[0] == 1)) or x.shape[-2] != self.total_local:
            raise ValueError(f"packcuda.{op}: inputs_embeds_local must be [T_local, H] or [1, T_local, H] with "
                             f"T_local = {self.total_local}, got {list(x.shape)}")
        if routed.dim() != 2 or routed.shape[0] != self.n_slots or routed.shape[1] != x.shape[-1]:
            raise ValueError(f"packcuda.{op}: routed must be [n_slots, H] = [{self.n_slots}, {x.shape[-1]}], got "
                             f"{list(routed.shape)}")
        if routed.dtype != x.dtype or routed.device != x.device:
            raise ValueError(f"packcuda.{op}: routed ({routed.dtype}, {routed.device}) and inputs_embeds_local "
                             f"({x.dtype}, {x.device}) must have one dtype and device")
        flat = x.reshape(x.shape[-2], x.shape[-1])
        out = flat.index_put((self._on(x.device, "slots"),), routed)
        return out.view(x.shape) if batched else out


def _host_unshard_index(plan) -> torch.Tensor:
    """The plan's unshard index on the host (the plan's own when it lives there; else the same op on the host
    sections of the plan, without a device read)."""
    if plan.device.type == "cpu":
        return plan.unshard_index
    return ops.shard_unshard_index(plan._host_section("cu_seqlens"), plan._host_section("cu_seqlens_padded"),
                                   plan.cp_size, plan.layout, plan.total_local, torch.device("cpu"))


def _validated_blocks(ids: torch.Tensor, cu: torch.Tensor, igrid, vgrid, image_token_id, video_token_id, merge,
                      video_frames):
    """Runs the block rules of mrope_position_ids on the host stream; its errors are re-raised naming this op."""
    from .mrope import mrope_position_ids

    try:
        mrope_position_ids(ids, cu, image_grid_thw=igrid, video_grid_thw=vgrid, image_token_id=image_token_id,
                           video_token_id=video_token_id, spatial_merge_size=merge, video_frames=video_frames)
    except (ValueError, TypeError) as e:
        msg = str(e)
        for prefix in ("packcuda.mrope_position_ids: ", "packcuda::mrope_position_ids: "):
            msg = msg.replace(prefix, "")
        raise type(e)(f"packcuda.{_OP}: {msg}") from e


def _units(grids, unit: str, merge: int):
    """The units of the grid rows, in global order (images, then videos; a row's temporal steps in order):
    per unit its modality, grid row, first temporal step, grid [t, h, w], first token and token count in the
    stream's vision tokens (image tokens, then video tokens, each in stream order), first patch row in its
    modality's pixel rows; and the pixel rows of each modality."""
    u_mod, u_row, u_step, u_grid, u_tok, u_len, u_pix = [], [], [], [], [], [], []
    tok0 = 0
    pixel_rows = [0, 0]
    m2 = merge * merge
    for m in (0, 1):
        for r, (t, h, w) in enumerate(grids[m].tolist()):
            per_step = h * w
            for s, n in ([(s, 1) for s in range(t)] if unit == "frame" else [(0, t)]):
                u_mod.append(m)
                u_row.append(r)
                u_step.append(s)
                u_grid.append((n, h, w))
                u_tok.append(tok0 + s * (per_step // m2))
                u_len.append(n * (per_step // m2))
                u_pix.append(pixel_rows[m] + s * per_step)
            tok0 += t * (per_step // m2)
            pixel_rows[m] += t * per_step
    return u_mod, u_row, u_step, u_grid, u_tok, u_len, u_pix, pixel_rows


def _rank_loads(assignment, grids, costs, cp):
    """Per rank: units, patches, attention pairs (sum over temporal steps of patches_per_step**2), cost."""
    units, patches, attention, cost = [0] * cp, [0] * cp, [0] * cp, [0.0] * cp
    for u, r in enumerate(assignment):
        t, h, w = grids[u]
        units[r] += 1
        patches[r] += t * h * w
        attention[r] += t * (h * w) ** 2
        cost[r] += costs[u]
    return units, patches, attention, cost


def vision_plan(
    input_ids: torch.Tensor,
    cu_seqlens: IntsLike,
    plan,
    *,
    image_grid_thw=None,
    video_grid_thw=None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int = 2,
    video_frames: str = "whole",
    unit: str = "image",
    cost=None,
) -> VisionPlan:
    """This rank's :class:`VisionPlan` of the packed batch ``input_ids`` ``[T]`` / ``cu_seqlens`` under the shard
    plan ``plan`` (a host :class:`packcuda.ShardPlan` of this rank, built from the same ``cu_seqlens``; zigzag or
    contiguous, with or without a bucket).

    Vision blocks are found as :func:`packcuda.mrope_position_ids` finds them (same rules, same errors, named
    ``packcuda.vision_plan``): maximal runs of ``image_token_id`` / ``video_token_id`` inside a segment take the
    rows of ``image_grid_thw`` / ``video_grid_thw`` in stream order; ``video_frames="per_frame"`` (Qwen3-VL,
    Qwen3.5) when each temporal step of a video is its own run, ``"whole"`` (Qwen2-VL, Qwen2.5-VL) otherwise.

    ``unit``: ``"image"`` (an image or a whole video per unit) or ``"frame"`` (every temporal step of a grid row
    is a unit of grid ``[1, h, w]``; the Qwen-VL towers attend within one temporal step, so a split video encodes
    exactly as a whole one). ``cost``: the balance weight of a unit of ``t`` temporal steps of an ``h x w`` patch
    grid: ``None`` for ``a * patches + b * t * (h*w)**2`` with ``a = 1`` and ``b = 1 / (6 * 1280)`` (a ViT
    layer of width d does 12 d**2 multiply-adds per patch in its projections and 2 d per pair of patches of one
    temporal step in attention; d = 1280 in the Qwen2-VL / Qwen2.5-VL towers; for a unit of one temporal step it
    is ``a * patches + b * patches**2``), a pair ``(a, b)``, or a callable ``cost(t, h, w) -> float`` (finite,
    >= 0; it must give every rank the same values). Units go to ranks by longest-processing-time first (largest
    unit first, to the least loaded rank, ties to the rank that holds most of the unit's tokens, then the lowest
    rank): deterministic, and the largest rank cost is at most ``4/3 - 1/(3 cp)`` times the optimum. A rank may
    encode nothing (fewer units than ranks) or hold no vision token.

    Refused before anything is computed or sent (``ValueError`` / ``TypeError`` naming the argument): grid rows
    that do not match the token runs; ``input_ids`` or ``cu_seqlens`` of another batch than ``plan``'s; a static
    plan (its layout lives on the device).

    Syncs: the plan is host work. ``input_ids`` on the host (the trainer's CPU copy) costs none; a device
    ``input_ids`` is read back once (one sync per plan), as are device ``cu_seqlens`` and device grids. Build the
    plan once per batch, e.g. in the data loader; every rank builds its own with its own shard plan."""
    from .mrope import _grid
    from .shard import ShardPlan, StaticShardPlan

    if not isinstance(plan, ShardPlan):
        raise TypeError(f"packcuda.{_OP}: plan must be a ShardPlan (packcuda.shard_plan), got {type(plan).__name__}")
    if isinstance(plan, StaticShardPlan):
        raise ValueError(f"packcuda.{_OP}: plan is a StaticShardPlan, whose layout lives on the device; the vision "
                         "plan needs a host plan (packcuda.shard_plan)")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"packcuda.{_OP}: input_ids must be a 1-D integer tensor, got {type(input_ids).__name__}")
    if input_ids.device.type == "meta":
        raise ValueError(f"packcuda.{_OP}: input_ids is on meta: the plan reads the token ids (host work), a meta "
                         "tensor has none")
    if input_ids.dim() != 1 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"packcuda.{_OP}: input_ids must be a 1-D int32/int64 tensor (the packed stream), got "
                         f"{input_ids.dtype} of shape {list(input_ids.shape)}")
    if input_ids.shape[0] != plan.total:
        raise ValueError(f"packcuda.{_OP}: input_ids has {input_ids.shape[0]} tokens but plan describes a stream of "
                         f"{plan.total} (a plan of another batch)")
    if unit not in _UNITS:
        raise ValueError(f"packcuda.{_OP}: unit must be 'image' or 'frame', got {unit!r}")
    if video_frames not in _FRAMES:
        raise ValueError(f"packcuda.{_OP}: video_frames must be 'whole' or 'per_frame', got {video_frames!r}")
    image_token_id = check_int(_OP, "image_token_id", image_token_id)
    video_token_id = check_int(_OP, "video_token_id", video_token_id)
    merge = check_int(_OP, "spatial_merge_size", spatial_merge_size, lo=1)
    cu = host_list(cu_seqlens, "cu_seqlens", op=_OP)  # a device tensor: one read
    if cu != plan.cu_seqlens_host:
        raise ValueError(f"packcuda.{_OP}: cu_seqlens differs from the plan's (a plan of another batch): "
                         f"{len(cu) - 1} sequences ending at {cu[-1] if cu else None}, the plan has "
                         f"{len(plan.cu_seqlens_host) - 1} ending at {plan.total}")
    _cost_fn(cost)  # the cost's type before any work
    grids = [_grid(image_grid_thw, "image_grid_thw", _OP).to(torch.int64),
             _grid(video_grid_thw, "video_grid_thw", _OP).to(torch.int64)]
    ids = input_ids if input_ids.is_cpu else input_ids.cpu()  # the one read of a device stream
    _validated_blocks(ids, torch.tensor(cu, dtype=torch.int64), grids[0], grids[1], image_token_id, video_token_id,
                      merge, video_frames)

    # tokens of every modality in stream order (validated: exactly the blocks' tokens, block after block)
    pos = [torch.nonzero(ids == tok).flatten() for tok in (image_token_id, video_token_id)]
    cp, rank = plan.cp_size, plan.cp_rank
    u_mod, u_row, u_step, u_grid, u_tok, u_len, u_pix, pixel_rows = _units(grids, unit, merge)
    U = len(u_mod)
    costs = _unit_costs(cost, u_grid)

    all_pos = torch.cat(pos)
    V = all_pos.numel()
    TL = plan.total_local
    lens_t = torch.tensor(u_len, dtype=torch.int64)
    unit_of = torch.repeat_interleave(torch.arange(U, dtype=torch.int64), lens_t)
    if V:
        where = _host_unshard_index(plan).index_select(0, all_pos)
        holder = torch.div(where, TL, rounding_mode="floor")
        slot = where - holder * TL
        affinity = torch.bincount(unit_of * cp + holder, minlength=U * cp).view(U, cp).tolist()
    else:
        where = holder = slot = torch.empty(0, dtype=torch.int64)
        affinity = [[0] * cp for _ in range(U)]
    assignment = _assign(costs, affinity, cp)

    # the tower output row of every token on its encoding rank
    assign_t = torch.tensor(assignment, dtype=torch.int64)
    unit_off = [0] * U
    rank_rows = [0] * cp
    for u in range(U):
        unit_off[u] = rank_rows[assignment[u]]
        rank_rows[assignment[u]] += u_len[u]
    src_rank = assign_t[unit_of]
    tok_start = torch.tensor(u_tok, dtype=torch.int64)
    src_row = torch.tensor(unit_off, dtype=torch.int64)[unit_of] + torch.arange(V, dtype=torch.int64) - \
        tok_start[unit_of]
    # the route output row of every token on its holding rank: rank of its slot among the rank's vision slots
    order = torch.argsort(where)
    rank_slots = torch.bincount(holder, minlength=cp)
    first = torch.cumsum(rank_slots, 0) - rank_slots
    sorted_pos = torch.empty(V, dtype=torch.int64)
    sorted_pos[order] = torch.arange(V, dtype=torch.int64)
    dst_slot = sorted_pos - first[holder]

    mine = (src_rank == rank) | (holder == rank)
    moves = (src_rank[mine], src_row[mine], holder[mine], dst_slot[mine])
    lo, n_slots = int(first[rank]), int(rank_slots[rank])
    local_tokens = order[lo:lo + n_slots]
    slots_host = slot[local_tokens].contiguous()
    modality = (local_tokens >= pos[0].numel()).to(torch.int64)
    modality_rows = [torch.nonzero(modality == m).flatten() for m in (0, 1)]

    local_units = [u for u in range(U) if assignment[u] == rank]
    pixel_index = []
    for m in (0, 1):
        sel = [u for u in local_units if u_mod[u] == m]
        pixel_index.append(_ranges(torch.tensor([u_pix[u] for u in sel], dtype=torch.int64),
                                   torch.tensor([u_grid[u][0] * u_grid[u][1] * u_grid[u][2] for u in sel],
                                                dtype=torch.int64)))
    local_grid = torch.tensor([list(u_grid[u]) for u in local_units], dtype=torch.int64).view(-1, 3)

    rank_units, rank_patches, rank_attention, rank_cost = _rank_loads(assignment, u_grid, costs, cp)
    traffic = torch.bincount(src_rank * cp + holder, minlength=cp * cp).view(cp, cp)
    fingerprint = _blake(plan.fingerprint, merge, unit, video_frames, grids[0], grids[1], all_pos, assign_t)
    return VisionPlan(
        cp_size=cp, cp_rank=rank, unit=unit, video_frames=video_frames, spatial_merge_size=merge,
        image_token_id=image_token_id, video_token_id=video_token_id, n_grid_rows=(len(grids[0]), len(grids[1])),
        device=plan.device, total_local=TL, n_units=U, unit_modality=u_mod, unit_row=u_row, unit_step=u_step,
        unit_grid=u_grid, unit_cost=costs, assignment=assignment, rank_units=rank_units,
        rank_patches=rank_patches, rank_attention=rank_attention, rank_cost=rank_cost, rank_rows=rank_rows,
        rank_slots=rank_slots.tolist(), traffic=traffic, local_units=local_units, n_encoded=rank_rows[rank],
        n_slots=n_slots, fingerprint=fingerprint, _local_grid=local_grid, _pixel_rows=pixel_rows,
        _pixel_index=pixel_index, _slots_host=slots_host, _modality_rows=modality_rows, _moves=moves)
