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


def run(device: str | None = None, seed: int = 0) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu"))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packcuda demo on {dev} (torch {torch.__version__}, CUDA kernels: {packcuda.built_with_cuda()})")
    rep = _Report()
    _packing(rep, dev, rng)
    _shard(rep, dev, rng)
    n_ok = sum(r[1] for r in rep.rows)
    print(f"demo: {n_ok}/{len(rep.rows)} checks passed")
    return 0 if rep.ok else 1
