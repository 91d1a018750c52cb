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
