"""End-to-end demo on a synthetic packed batch: every step is checked against a plain Python version."""
from __future__ import annotations

import random

import torch

import packcuda


class _Report:
    def __init__(self):
        self.rows = []

    def check(self, name: str, ok: bool, detail: str = ""):
        self.rows.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{(': ' + detail) if detail else ''}")

    @property
    def ok(self) -> bool:
        return all(r[1] for r in self.rows)


def _packing(rep: _Report, device: torch.device, rng: random.Random):
    print("packing")
    B, S, H = 6, 64, 32
    lens = [rng.randint(0, S) for _ in range(B)]
    x = torch.randn(B, S, H, device=device)
    mask = torch.arange(S, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    xp, idx, cu, mx = packcuda.unpad(x, lengths=lens)
    rep.check("unpad (host lengths)", torch.equal(xp, x[mask]), f"{B}x{S} -> {xp.shape[0]} tokens, max_seqlen {mx}")
    xp2, idx2, cu2, _ = packcuda.unpad(x, mask)
    rep.check("unpad (attention_mask) == unpad (lengths)", torch.equal(xp, xp2) and torch.equal(cu, cu2))
    rep.check("pad(unpad(x)) == x * mask", torch.equal(packcuda.pad(xp, idx, B, S), x * mask[..., None]))
    cu_host = [0]
    for n in lens:
        cu_host.append(cu_host[-1] + n)
    pos = packcuda.position_ids(cu_host, device=device)
    want = torch.cat([torch.arange(n) for n in lens])
    rep.check("position_ids restart per sequence", torch.equal(pos.cpu(), want))
    ids = torch.randint(0, 1000, (cu_host[-1],), device=device)
    lab = packcuda.next_token_labels(ids, cu_host)
    ok = all(
        (lab[t].item() == (ids[t + 1].item() if t + 1 < cu_host[i + 1] else -100))
        for i in range(B)
        for t in range(cu_host[i], cu_host[i + 1])
    )
    rep.check("next_token_labels never cross a sequence boundary", ok)


def _shard(rep: _Report, device: torch.device, rng: random.Random):
    print("shard plans (context parallelism)")
    cp = 4
    lens = [rng.randint(1, 40) for _ in range(5)] + [0]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    plans = [packcuda.shard_plan(cu, cp, r, device=device, bucket=64) for r in range(cp)]
    print(f"  lengths {lens} -> padded {plans[0].cu_seqlens_padded_host} (bucket segment of {plans[0].pad_size})")
    for p in plans:
        runs = [f"s{q}[{o}:{o + b - a})" for a, b, o, q in
                zip(p.pieces_host[:-1], p.pieces_host[1:], p.piece_offset_host, p.piece_seq_host) if b > a]
        print(f"  rank {p.cp_rank}: {p.total_local} slots  " + " ".join(runs))
    x = torch.randn(T, 8, device=device)
    ids = torch.randint(0, 1000, (T,), device=device)
    shards = [p.shard(x) for p in plans]
    rep.check("every token on exactly one rank",
              sorted(i for p in plans for i in p.index.tolist() if i >= 0) == list(range(T)))
    rep.check("unshard(all ranks' shards) == x", all(torch.equal(p.unshard(torch.stack(shards)), x) for p in plans))
    ok = True
    for p in plans:
        lab = p.labels(ids).tolist()
        for s, (row, pos) in enumerate(zip(p.index.tolist(), p.position_ids.tolist())):
            if row < 0:
                ok &= lab[s] == -100
                continue
            i = max(j for j in range(len(lens)) if cu[j] <= row)  # plain: the sequence holding the row
            ok &= pos == row - cu[i]
            ok &= lab[s] == (ids[row + 1].item() if row + 1 < cu[i + 1] else -100)
    rep.check("positions and labels match the per-sequence definition on every rank", ok)


def _mrope(rep: _Report, device: torch.device, rng: random.Random):
    print("mRoPE position ids")
    IMG, VID, m, tps = 151655, 151656, 2, 2
    ids, cu, images, videos, secs = [], [0], [], [], []
    for _ in range(5):  # five samples: text, images, a video with fractional seconds per grid
        for _ in range(rng.randint(0, 3)):
            ids += [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
            if rng.random() < 0.6:
                g = [1, m * rng.randint(1, 4), m * rng.randint(1, 4)]
                images.append(g)
                ids += [IMG] * (g[1] * g[2] // m**2)
            else:
                g = [rng.randint(1, 4), m * rng.randint(1, 3), m * rng.randint(1, 3)]
                videos.append(g)
                secs.append(rng.choice([0.5, 1.0, 2.0 / 3.0]))
                ids += [VID] * (g[0] * g[1] * g[2] // m**2)
        ids += [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
        cu.append(len(ids))
    x = torch.tensor(ids, device=device)
    pos, text_pos, deltas = packcuda.mrope_position_ids(
        x, cu, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=secs, image_token_id=IMG,
        video_token_id=VID, spatial_merge_size=m, tokens_per_second=tps)

    # plain version: walk every sample token by token
    want, it = [], {IMG: iter(images), VID: iter(videos)}
    si = iter(secs)
    for a, b in zip(cu[:-1], cu[1:]):
        cur, i = 0, a
        while i < b:
            if ids[i] not in it:
                want.append((cur, cur, cur))
                cur, i = cur + 1, i + 1
                continue
            t, h, w = next(it[ids[i]])
            h, w = h // m, w // m
            iv = torch.tensor(float(tps)) * torch.tensor(next(si)) if ids[i] == VID else torch.tensor(1.0)
            for ti in range(t):
                tt = int(torch.tensor(float(ti)) * iv)
                want += [(cur + tt, cur + hi, cur + wi) for hi in range(h) for wi in range(w)]
            i += t * h * w
            cur += max(h, w)
    want = torch.tensor(want).T
    rep.check("mrope_position_ids == plain per-sample walk", torch.equal(pos.cpu(), want),
              f"{len(cu) - 1} samples, {len(ids)} tokens, {len(images)} images, {len(videos)} videos")
    rep.check("text_pos restarts per sample", torch.equal(text_pos.cpu(), packcuda.position_ids(cu)))
    d = [int(want[:, a:b].max()) + 1 - (b - a) for a, b in zip(cu[:-1], cu[1:])]
    rep.check("deltas = max position + 1 - length", deltas.cpu().tolist() == d)
    if hasattr(packcuda, "shard_plan"):
        pos4 = torch.cat([text_pos[None], pos])
        parts = []
        for r in range(2):
            plan = packcuda.shard_plan(cu, 2, r, device=device)
            local = plan.shard(pos4, dim=1)
            keep = plan.index >= 0
            parts.append(torch.equal(local[:, keep], pos4[:, plan.index[keep]]))
        rep.check("cp=2 shards: plan.shard(pos, dim=1) gives each rank its tokens' positions", all(parts))


def run(device: str | None = None, seed: int = 0) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu"))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packcuda demo on {dev} (torch {torch.__version__}, CUDA kernels: {packcuda.built_with_cuda()})")
    rep = _Report()
    _packing(rep, dev, rng)
    _shard(rep, dev, rng)
    _mrope(rep, dev, rng)
    n_ok = sum(r[1] for r in rep.rows)
    print(f"demo: {n_ok}/{len(rep.rows)} checks passed")
    return 0 if rep.ok else 1
