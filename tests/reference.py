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
