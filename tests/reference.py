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


# ------------------------------------------------------------------------------------------ conv (causal conv1d, conv-prefix)
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
    return torch.cat(outs, 0) if outs else x.new_zeros(0, C)
