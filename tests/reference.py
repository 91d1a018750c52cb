"""Plain, obviously-correct pure-PyTorch/Python references of packcuda's ops. Slow on purpose: loops over
sequences and tokens, no cleverness. Tests compare the CPU and CUDA kernels against these."""
from __future__ import annotations

import torch


def _load_baselines():
    """benchmarks/baselines.py: the plain implementations the benchmarks time, oracles here too (one copy).
    Loaded from its file, as the repository root is not on sys.path when pytest runs the tests of an installed
    packcuda."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "_packcuda_benchmark_baselines"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" /
                                                      "baselines.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_baselines = _load_baselines()
# Karmarkar-Karp micro-batch planning (plain Python) and positions through transformers' own get_rope_index
workloads = _baselines.workloads
karmarkar_karp = _baselines.karmarkar_karp
plan_micro_batches = _baselines.plan_micro_batches
hf_packed_position_ids = _baselines.hf_packed_position_ids


# ------------------------------------------------------------------------------------------ packing
def unpad(x, attention_mask):
    B, S = attention_mask.shape
    idx = [b * S + s for b in range(B) for s in range(S) if attention_mask[b, s]]
    lens = [int(attention_mask[b].sum()) for b in range(B)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    indices = torch.tensor(idx, dtype=torch.int64)
    return x.reshape(B * S, *x.shape[2:])[indices], indices, torch.tensor(cu, dtype=torch.int32), max(lens or [0])


def pad(x_packed, indices, B, S):
    out = torch.zeros(B * S, *x_packed.shape[1:], dtype=x_packed.dtype)
    for i, r in enumerate(indices.tolist()):
        out[r] = x_packed[i]
    return out.view(B, S, *x_packed.shape[1:])


def position_ids(cu):
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        out.extend(range(b - a))
    return torch.tensor(out, dtype=torch.int64)


def next_token_labels(ids, cu, ignore_index=-100):
    out = torch.full_like(ids, ignore_index)
    for a, b in zip(cu[:-1], cu[1:]):
        for t in range(a, b - 1):
            out[t] = ids[t + 1]
    return out


def gather_rows(src, index, fill=0.0):
    out = torch.full((len(index), *src.shape[1:]), fill, dtype=src.dtype)
    for i, r in enumerate(index.tolist()):
        if r >= 0:
            out[i] = src[r]
    return out


# ===================================================================================================
# shard plans (context parallelism)
# ===================================================================================================
def shard_layout(cu, cp, rank, layout="zigzag", align=None, bucket=None):
    """Plain layout of one CP rank, built token by token. Returns a dict with cu_padded, cu_local,
    index / position / label_index (lists over local slots), total_local and pad_size."""
    import math

    if align is None:
        align = 2 * cp if layout == "zigzag" else 1
    segs = []  # (first original row, real length, padded length)
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        segs.append((a, n, -(-n // align) * align))
    seq_total = sum(p for _, _, p in segs)
    unit = bucket or 1
    if layout == "contiguous":
        unit = unit * cp // math.gcd(unit, cp)
    total_padded = -(-seq_total // unit) * unit
    pad = total_padded - seq_total
    if pad:
        segs.append((0, 0, pad))
    cu_padded = [0]
    stream = []  # (row, position, label row) of every padded token
    for start, n, p in segs:
        cu_padded.append(cu_padded[-1] + p)
        for o in range(p):
            stream.append((start + o if o < n else -1, o, start + o + 1 if o + 1 < n else -1))
    total_local = total_padded // cp
    local, cu_local = [], [0]
    if layout == "zigzag":
        for k in range(len(segs)):
            h = (cu_padded[k + 1] - cu_padded[k]) // (2 * cp)
            for c in (rank, 2 * cp - 1 - rank):
                local += stream[cu_padded[k] + c * h: cu_padded[k] + (c + 1) * h]
            cu_local.append(len(local))
    else:
        lo, hi = rank * total_local, (rank + 1) * total_local
        local = stream[lo:hi]
        cu_local = [min(max(c, lo), hi) - lo for c in cu_padded]
    return dict(
        cu_padded=cu_padded,
        cu_local=cu_local,
        index=[s[0] for s in local],
        position=[s[1] for s in local],
        label_index=[s[2] for s in local],
        total_local=total_local,
        pad_size=pad,
    )


def thd_partitioned_indices(cu_padded, total_padded, cp, rank):
    """Indices into the padded stream of the tokens rank `rank` holds under the THD zigzag split: for each
    sequence (length divisible by 2*cp) cut into 2*cp chunks, chunks `rank` and `2*cp-1-rank`, in order."""
    out = []
    for a, b in zip(cu_padded[:-1], cu_padded[1:]):
        chunk = (b - a) // (2 * cp)
        out += list(range(a + rank * chunk, a + (rank + 1) * chunk))
        out += list(range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk))
    assert len(out) == total_padded // cp
    return out


def local_padded_rows(plan):
    """Global padded row of every local slot of `plan` (from its pieces)."""
    rows = []
    P, off, seq, cup = plan.pieces_host, plan.piece_offset_host, plan.piece_seq_host, plan.cu_seqlens_padded_host
    for k in range(len(P) - 1):
        base = cup[seq[k]] + off[k]
        rows.extend(range(base, base + P[k + 1] - P[k]))
    return torch.tensor(rows, dtype=torch.int64)


def exchange_by_hand(scheds, xs, gs=None):
    """Every rank's row-exchange schedule (packcuda.exchange.RowSchedule, rank r = scheds[r]) run by hand in one
    process: what rank p sends rank q is scheds[p].send_index's block for q, received in rank order, then the
    unpack (exchange_gather_sum); with gs (each rank's output gradients) the reverse move too. Returns (outputs,
    source gradients or None), one per rank."""
    import torch as _torch

    gsum = _torch.ops.packcuda.exchange_gather_sum
    cp = len(scheds)
    outs, dxs = [], []
    for q in range(cp):
        recv, brecv = [], []
        for p in range(cp):
            assert scheds[p].send_counts[q] == scheds[q].recv_counts[p]
            off = sum(scheds[p].send_counts[:q])
            recv.append(xs[p][scheds[p].send_index[off:off + scheds[p].send_counts[q]]])
            if gs is not None:
                boff = sum(scheds[p].recv_counts[:q])
                brecv.append(gs[p][scheds[p].bwd_send_index[boff:boff + scheds[p].recv_counts[q]]])
        outs.append(gsum(xs[q], _torch.cat(recv), scheds[q].unpack[:, None]))
        if gs is not None:
            dxs.append(gsum(gs[q], _torch.cat(brecv), scheds[q].bwd_unpack))
    return outs, (dxs if gs is not None else None)


def shard_rows(x, index, fill=0):
    """x[index] along dim 0 with `fill` where index < 0."""
    return gather_rows(x, torch.tensor(index, dtype=torch.int64), fill)


# ------------------------------------------------------------------------------------------ balance
def max_workload(parts, seqlens, workload="attention", coef=24576):
    w = workloads(seqlens, workload, coef)
    return max((sum(w[i] for i in p) for p in parts), default=0)


def optimal_max_workload(seqlens, k, max_tokens=None, workload="attention", coef=24576):
    """Exhaustive search over all assignments of sequences to k parts (small inputs only): the smallest
    possible largest part workload with every part's token sum <= max_tokens (None: no cap)."""
    import itertools

    w = workloads(seqlens, workload, coef)
    best = None
    for assign in itertools.product(range(k), repeat=len(seqlens)):
        if assign and assign[0] != 0:  # parts are interchangeable: fix the first sequence's part
            continue
        W, T = [0] * k, [0] * k
        for i, p in enumerate(assign):
            W[p] += w[i]
            T[p] += seqlens[i]
        if max_tokens is not None and max(T) > max_tokens:
            continue
        m = max(W)
        if best is None or m < best:
            best = m
    return best
# ------------------------------------------------------------------------------------ rotary application
def rope_axis(j, mrope_section=None, mrope_interleaved=False):
    """Position row (0 = t, 1 = h, 2 = w) of frequency slot j."""
    if mrope_section is None:
        return 0
    s_t, s_h, s_w = mrope_section
    if mrope_interleaved:
        if j % 3 == 1 and j < 3 * s_h:
            return 1
        if j % 3 == 2 and j < 3 * s_w:
            return 2
        return 0
    if j < s_t:
        return 0
    if j < s_t + s_h:
        return 1
    return 2


def rope_inv_freq(theta, rotary_dim):
    """transformers' default inverse frequencies (float32)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def apply_rope(q, k, positions, inv_freq, rotary_dim=None, mrope_section=None, mrope_interleaved=False,
               rotary_style="neox", attention_scaling=1.0, inverse=False):
    """float64 rotary embedding of token-major q [T, Hq, D] and k [T, Hk, D] (any leading token dims).

    positions: [T] (one row) or [3, T] (t, h, w). The angle of slot j at token t is the float32 product
    float32(positions[axis(j), t]) * inv_freq[j] (as specified); cos, sin and the rotation are float64.
    Channels >= rotary_dim are copied. inverse rotates by the negated angle."""
    D = q.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    n = rd // 2
    pos = positions.reshape(1 if positions.dim() == 1 or mrope_section is None else 3, -1)
    T = pos.shape[1]
    # angle table [T, n]: column j uses the position row of slot j
    rows = [rope_axis(j, mrope_section, mrope_interleaved) for j in range(n)]
    pos_sel = torch.stack([pos[r] for r in rows], dim=1) if n else torch.zeros(T, 0, dtype=pos.dtype)
    angle = pos_sel.to(torch.float32) * inv_freq.to(torch.float32)[None, :]  # elementwise fp32 multiply
    cos = torch.cos(angle.double()) * attention_scaling
    sin = torch.sin(angle.double()) * attention_scaling
    if inverse:
        sin = -sin
    if rotary_style == "gptj":
        lo = [2 * j for j in range(n)]
        hi = [2 * j + 1 for j in range(n)]
    else:
        lo = list(range(n))
        hi = [j + n for j in range(n)]
    outs = []
    for x in (q, k):
        x64 = x.double().reshape(T, x.shape[-2], D)
        y = x64.clone()
        c, s = cos[:, None, :], sin[:, None, :]
        y[:, :, lo] = x64[:, :, lo] * c - x64[:, :, hi] * s
        y[:, :, hi] = x64[:, :, hi] * c + x64[:, :, lo] * s
        outs.append(y.reshape(x.shape))
    return outs[0], outs[1]
# ------------------------------------------------------------------------------------------ mRoPE position ids
def mrope_interval(tokens_per_second, second_per_grid_t):
    """float32(tokens_per_second) * float32(second_per_grid_t), one float32 multiply (Qwen2.5-VL videos)."""
    return torch.tensor(float(tokens_per_second), dtype=torch.float32) * torch.tensor(
        float(second_per_grid_t), dtype=torch.float32)


def mrope_position_ids(ids, cu, image_grid_thw=(), video_grid_thw=(), second_per_grid_ts=None, *,
                       image_token_id, video_token_id, spatial_merge_size=2, tokens_per_second=None,
                       video_frames="whole", text_after_vision="grid"):
    """Segment by segment, run by run, token by token.

    Text token: (cur, cur, cur), cur += 1. Vision block starting at cur = s with merged grid (T', H', W'):
    token (ti, hi, wi) -> (s + floor(ti * interval), s + hi, s + wi), ti computed as float32(ti) * interval in
    float32 then truncated. Text after the block resumes at
      "grid": s + max(H', W')
      "max":  max(every position of the segment so far) + 1   (transformers 4.x rule)
    deltas[i] = max position of segment i + 1 - length of segment i (0 when the segment is empty)."""
    ids = [int(v) for v in ids]
    cu = [int(v) for v in cu]
    m = spatial_merge_size
    blocks = {image_token_id: [], video_token_id: []}
    for g in image_grid_thw:
        blocks[image_token_id].append((int(g[0]), int(g[1]) // m, int(g[2]) // m, torch.tensor(1.0)))
    for v, g in enumerate(video_grid_thw):
        t, h, w = int(g[0]), int(g[1]) // m, int(g[2]) // m
        if video_frames == "per_frame":
            blocks[video_token_id].extend((1, h, w, torch.tensor(1.0)) for _ in range(t))
        else:
            iv = torch.tensor(1.0)
            if tokens_per_second is not None:
                sec = 1.0 if second_per_grid_ts is None else float(second_per_grid_ts[v])
                iv = mrope_interval(tokens_per_second, sec)
            blocks[video_token_id].append((t, h, w, iv))
    used = {image_token_id: 0, video_token_id: 0}
    rows = [[], [], []]
    deltas = []
    for a, b in zip(cu[:-1], cu[1:]):
        seg = []  # (t, h, w) of each token
        cur = 0
        i = a
        while i < b:
            tok = ids[i]
            if tok not in blocks:
                seg.append((cur, cur, cur))
                cur += 1
                i += 1
                continue
            j = i
            while j < b and ids[j] == tok:
                j += 1
            T, H, W, iv = blocks[tok][used[tok]]
            used[tok] += 1
            assert j - i == T * H * W, "run length does not match its grid"
            s = cur
            for ti in range(T):
                tpos = int((torch.tensor(float(ti), dtype=torch.float32) * iv.to(torch.float32)).item())
                for hi in range(H):
                    for wi in range(W):
                        seg.append((s + tpos, s + hi, s + wi))
            if text_after_vision == "grid":
                cur = s + max(H, W)
            else:
                cur = max(max(p) for p in seg) + 1
            i = j
        for p in seg:
            for r in range(3):
                rows[r].append(p[r])
        deltas.append(max(max(p) for p in seg) + 1 - len(seg) if seg else 0)
    assert used[image_token_id] == len(blocks[image_token_id]) and used[video_token_id] == len(blocks[video_token_id])
    text_pos = position_ids(cu)
    return torch.tensor(rows, dtype=torch.int64).reshape(3, -1), text_pos, torch.tensor(deltas, dtype=torch.int64)

# -------------------------------------------------------------------------------- conv (causal conv1d, conv-prefix)
def causal_conv1d(x, weight, bias=None, cu_seqlens=None, prefix=None, activation=None):
    """torch.nn.functional.conv1d per segment, with the segment's K-1 prefix rows (or zeros) in front."""
    T, C = x.shape
    K = weight.shape[1]
    cu = list(cu_seqlens) if cu_seqlens is not None else [0, T]
    outs = []
    for s in range(len(cu) - 1):
        seg = x[cu[s]:cu[s + 1]]
        if seg.shape[0] == 0:
            continue
        if prefix is not None:
            head = prefix[s]
        else:
            head = x.new_zeros(K - 1, C)
        full = torch.cat([head, seg], 0)  # [K-1+L, C]
        y = torch.nn.functional.conv1d(full.t()[None], weight[:, None, :], bias, groups=C)[0].t()
        if activation == "silu":
            y = torch.nn.functional.silu(y)
        outs.append(y)
    return torch.cat(outs, 0) if outs else x[:0] * 1


# =====================================================================================================
# HF integration (packcuda.integrations.transformers): plain rotary rotation driven by positions
# =====================================================================================================
def hf_rope_axes(n, mrope_section, interleaved):
    """Which position row (0 t, 1 h, 2 w) drives frequency slot j < n."""
    if mrope_section is None:
        return [0] * n
    sT, sH, sW = mrope_section
    axes = []
    for j in range(n):
        if interleaved:
            axes.append(1 if (j % 3 == 1 and j < 3 * sH) else 2 if (j % 3 == 2 and j < 3 * sW) else 0)
        else:
            axes.append(0 if j < sT else 1 if j < sT + sH else 2)
    return axes


def hf_rope_apply(q, k, positions, *, inv_freq, rotary_dim=None, mrope_section=None, mrope_interleaved=False,
                  attention_scaling=1.0, **_):
    """q [T, Hq, D], k [T, Hk, D] rotated (rotate-half pairs j, j + n) by per-token positions [T] or [3, T]:
    angle = float32(pos) * inv_freq[j] in float32 as transformers computes it, rotation in the input dtype's
    autograd-friendly torch ops; channels >= rotary_dim pass through."""
    n = inv_freq.numel()
    rotary_dim = rotary_dim or 2 * n
    assert rotary_dim == 2 * n
    pos = positions if positions.dim() == 2 else positions[None].expand(3, -1)
    axes = torch.tensor(hf_rope_axes(n, mrope_section, mrope_interleaved), device=pos.device)
    p = pos.float()[axes, :].T  # [T, n]
    ang = p * inv_freq.float().to(pos.device)[None]
    cos = (ang.cos() * attention_scaling)[:, None, :]
    sin = (ang.sin() * attention_scaling)[:, None, :]

    def rot(x):
        x1, x2, rest = x[..., :n], x[..., n:2 * n], x[..., 2 * n:]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    return rot(q), rot(k)


# ===================================================================================================
# row gathers / scatters along any dim (shard plans move [A, T, ...] tensors along dim 1)
# ===================================================================================================
def gather_rows_dim(src, index, fill=0.0, dim=0):
    """gather_rows along `dim`: every slice of the leading dims gathers the same rows."""
    moved = src.movedim(dim, 0)
    return gather_rows(moved, index, fill).movedim(0, dim)


def scatter_rows_dim(src, index, num_rows, dim=0):
    """Zeros with num_rows rows along `dim`; row index[i] (when >= 0) gets src's row i."""
    moved = src.movedim(dim, 0)
    out = torch.zeros((num_rows, *moved.shape[1:]), dtype=src.dtype)
    for i, r in enumerate(index.tolist()):
        if r >= 0:
            out[r] = moved[i]
    return out.movedim(0, dim)


# ------------------------------------------------------------------------------------------ vision under CP
def vision_replicated(ids, local_index, image_token_id, video_token_id):
    """What a rank keeps when it encodes every image and video itself (transformers concatenates the tower's image
    rows, then its video rows, and scatters them over the placeholder tokens in stream order; the rank keeps its
    slots), token by token: (the local slots holding vision tokens, the row of each in the concatenation
    [image rows; video rows]). ids: the packed stream [T]; local_index: the original row of every local slot
    (-1 for pads)."""
    ids = ids.tolist()
    n_img = sum(1 for tok in ids if tok == image_token_id)
    k_of, seen = {}, {image_token_id: 0, video_token_id: n_img}
    for t, tok in enumerate(ids):
        if tok in seen:
            k_of[t] = seen[tok]
            seen[tok] += 1
    slots, rows = [], []
    for s, t in enumerate(local_index.tolist()):
        if t >= 0 and t in k_of:
            slots.append(s)
            rows.append(k_of[t])
    return slots, torch.tensor(rows, dtype=torch.int64)


def vision_balance_optimum(costs, cp):
    """The smallest possible largest per-rank sum of `costs` over cp ranks (every assignment, the first unit
    on rank 0 without loss of generality)."""
    import itertools

    if not costs:
        return 0.0
    best = float("inf")
    for rest in itertools.product(range(cp), repeat=len(costs) - 1):
        load = [0.0] * cp
        for c, r in zip(costs, (0,) + rest):
            load[r] += c
        best = min(best, max(load))
    return best
