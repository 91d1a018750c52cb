"""The plain implementations the benchmarks time packcuda against, which the tests also take as oracles (one
copy, here; ``tests/reference.py`` loads this file): Python Karmarkar-Karp micro-batch planning, and the
position ids of a packed row computed the way trainers do today (transformers' ``get_rope_index`` per sample)."""
from __future__ import annotations

import torch

# ------------------------------------------------------------------------------------------ balance
# Plain Python multi-way Karmarkar-Karp (largest differencing). A state is a list of exactly k subsets
# (sum, items in the order they joined), ordered by (sum, item count, first item), the larger first (empty
# subsets last). The two states of largest spread (ties: the one whose heaviest subset comes first in that
# order) are merged by joining the i-th heaviest subset of the first with the i-th lightest of the second (its
# items listed first), until one state is left. The tie-break rule is verl's (get_seqlen_balanced_partitions).
_EMPTY = (0, ())


def workloads(seqlens, workload="attention", coef=24576):
    return [n if workload == "tokens" else coef * n + n * n for n in seqlens]


def _subset_key(s):
    return (-s[0], -len(s[1]), -s[1][0] if s[1] else 1)


def karmarkar_karp(weights, k, equal_count=False):
    import heapq

    states = []
    if equal_count:
        order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
        for g in range(len(weights) // k):
            states.append(sorted(((weights[i], (i,)) for i in order[g * k:(g + 1) * k]), key=_subset_key))
    else:
        for i, w in enumerate(weights):
            states.append([(w, (i,))] + [_EMPTY] * (k - 1))
    heap = [(-(s[0][0] - s[-1][0]), _subset_key(s[0]), sid) for sid, s in enumerate(states)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)[-1]
        b = heapq.heappop(heap)[-1]
        A, B = states[a], states[b]
        merged = sorted(((x[0] + y[0], x[1] + y[1]) for x, y in zip(A, reversed(B))), key=_subset_key)
        states[a] = states[b] = None
        states.append(merged)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), _subset_key(merged[0]), len(states) - 1))
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(s[1]) for s in states[heap[0][-1]]]


def plan_micro_batches(seqlens, max_tokens, min_micro_batches=1, multiple_of=1, workload="attention",
                       coef=24576):
    """KK micro-batches; while one exceeds max_tokens, add `multiple_of` micro-batches and partition again."""
    assert all(n <= max_tokens for n in seqlens)
    k = max(-(-sum(seqlens) // max_tokens), min_micro_batches)
    k = -(-k // multiple_of) * multiple_of
    w = workloads(seqlens, workload, coef)
    while True:
        parts = karmarkar_karp(w, k)
        if all(sum(seqlens[i] for i in p) <= max_tokens for p in parts):
            return parts
        k += multiple_of



# =====================================================================================================
# HF integration (packcuda.integrations.transformers): positions through the model's own get_rope_index
# =====================================================================================================
def _hf_grid(g, name, fn):
    from packcuda.mrope import _grid

    g = _grid(g, name, op=fn).to(torch.int64)
    if g.dim() != 2 or g.shape[1] != 3:  # (the op checks it where it runs; this reference never calls it)
        raise ValueError(f"packcuda.{fn}: {name} must have shape [n, 3] (rows [t, h, w]), got {list(g.shape)}")
    return g if g.shape[0] else None


def hf_packed_position_ids(model, input_ids, cu_seqlens, *, image_grid_thw=None, video_grid_thw=None,
                           second_per_grid_ts=None):
    """The ``[4, 1, T]`` positions of :func:`packcuda.integrations.transformers.packed_position_ids` computed
    the way trainers do today: the model's own ``get_rope_index`` called on every sample alone (a Python loop
    with host syncs), then concatenated. The reference of the tests and the baseline of the benchmarks."""
    import itertools

    from packcuda._meta import host_list
    from packcuda.integrations.transformers import UnsupportedModelError, mm_token_type_ids
    from packcuda.integrations.transformers._common import _family_of
    from packcuda.integrations.transformers.positions import _flat_ids

    fn = "hf_packed_position_ids"
    fam = _family_of(model, fn)
    base = model.model if hasattr(getattr(model, "model", None), "get_rope_index") else model
    if not hasattr(base, "get_rope_index"):
        raise UnsupportedModelError(f"packcuda.{fn}: model ({type(model).__name__}) has no get_rope_index")
    ids = _flat_ids(input_ids, fn)
    cu = host_list(cu_seqlens, "cu_seqlens", op=fn)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != ids.numel():
        raise ValueError(f"packcuda.{fn}: cu_seqlens must start at 0, be non-decreasing and end at the number of "
                         f"tokens ({ids.numel()}), got {cu}")
    tt = mm_token_type_ids(ids, model)
    igrid, vgrid = _hf_grid(image_grid_thw, "image_grid_thw", fn), _hf_grid(video_grid_thw, "video_grid_thw", fn)
    if second_per_grid_ts is not None:
        from packcuda.mrope import _seconds

        secs = _seconds(second_per_grid_ts, op=fn)
    else:
        secs = None
    ii = vi = 0
    frames_left = 0
    rows, text = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        seg_ids, seg_tt = ids[a:b], tt[a:b]
        n_img = n_vid = 0
        for key, _ in itertools.groupby(seg_tt.tolist()):
            if key == 1:
                n_img += 1
            elif key == 2:
                if fam.video_frames == "whole":
                    n_vid += 1
                else:
                    if frames_left == 0:
                        if vgrid is None or vi + n_vid >= vgrid.shape[0]:
                            raise ValueError(f"packcuda.{fn}: input_ids has more videos than video_grid_thw "
                                             f"describes (sample [{a}, {b}))")
                        frames_left = int(vgrid[vi + n_vid, 0])
                        n_vid += 1
                    frames_left -= 1
        if frames_left:
            raise ValueError(f"packcuda.{fn}: a video's frames cross the end of sample [{a}, {b})")
        if (n_img > (0 if igrid is None else igrid.shape[0]) - ii
                or n_vid > (0 if vgrid is None else vgrid.shape[0]) - vi):
            raise ValueError(f"packcuda.{fn}: input_ids has more vision blocks than image_grid_thw / video_grid_thw "
                             f"describe (sample [{a}, {b}))")
        L = b - a
        if n_img == 0 and n_vid == 0:
            pos = torch.arange(L, device=ids.device).expand(3, L)
        else:
            kw = dict(image_grid_thw=igrid[ii:ii + n_img] if n_img else None,
                      video_grid_thw=vgrid[vi:vi + n_vid] if n_vid else None)
            if fam.video_seconds and n_vid and secs is not None:
                kw["second_per_grid_ts"] = secs[vi:vi + n_vid]
            pos, _ = base.get_rope_index(seg_ids[None], mm_token_type_ids=seg_tt[None], **kw)
            pos = pos[:, 0]
        ii += n_img
        vi += n_vid
        rows.append(pos.to(torch.int64))
        text.append(torch.arange(L, device=ids.device))
    pos = torch.cat(rows, dim=1) if rows else ids.new_zeros(3, 0, dtype=torch.int64)
    txt = torch.cat(text) if text else ids.new_zeros(0, dtype=torch.int64)
    return torch.cat([txt[None].to(pos.device), pos], dim=0)[:, None, :]
