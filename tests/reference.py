"""Plain, obviously-correct pure-PyTorch/Python references of packcuda's ops. Slow on purpose: loops over
sequences and tokens, no cleverness. Tests compare the CPU and CUDA kernels against these."""
from __future__ import annotations

import torch


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


def shard_rows(x, index, fill=0):
    """x[index] along dim 0 with `fill` where index < 0."""
    return gather_rows(x, torch.tensor(index, dtype=torch.int64), fill)


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
