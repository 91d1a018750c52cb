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
