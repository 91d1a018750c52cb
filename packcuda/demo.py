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


def _balance(rep: _Report, device: torch.device, rng: random.Random):
    print("micro-batch planning (host)")
    lens = [int(2 ** rng.uniform(5, 13)) for _ in range(200)]
    cap = 16384
    parts = packcuda.plan_micro_batches(lens, cap, multiple_of=2, order="pipeline")
    flat = sorted(i for p in parts for i in p)
    toks = [sum(lens[i] for i in p) for p in parts]
    start = -(-max(-(-sum(lens) // cap), 1) // 2) * 2
    rep.check("every sequence in exactly one micro-batch", flat == list(range(len(lens))))
    rep.check("token cap holds", max(toks) <= cap, f"{len(parts)} micro-batches (start count {start}), "
              f"largest {max(toks)} <= {cap} tokens")
    w = [24576 * n + n * n for n in lens]
    loads = [sum(w[i] for i in p) for p in parts]
    top = loads.index(max(loads))
    rep.check("pipeline order: heaviest in the middle",
              all(loads[j] <= loads[j + 1] for j in range(top))
              and all(loads[j] >= loads[j + 1] for j in range(top, len(loads) - 1)),
              f"max/mean workload {max(loads) / (sum(loads) / len(loads)):.3f}")
    ranks = packcuda.balance_across_ranks(lens, 4, equal_count=True)
    rep.check("balance_across_ranks(equal_count) gives 50 sequences per rank", [len(r) for r in ranks] == [50] * 4)

def _conv(rep: _Report, device: torch.device, rng: random.Random):
    print("conv-prefix exchange + varlen causal conv1d (cp=2 zigzag, K=4; the exchange is simulated in this one")
    print("  process by moving rows exactly as each rank's schedule says, instead of through a process group)")
    K, C, cp = 4, 16, 2
    lens = [rng.randint(1, 40) for _ in range(5)] + [1, 2]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], C, device=device)
    w, b = torch.randn(C, K, device=device), torch.randn(C, device=device)
    y = packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, activation="silu")
    want = torch.cat([torch.nn.functional.silu(torch.nn.functional.conv1d(
        x[a:e].t()[None], w[:, None], b, padding=K - 1, groups=C)[0, :, :e - a].t()) for a, e in zip(cu[:-1], cu[1:])])
    rep.check("causal_conv1d == F.conv1d per sequence", torch.allclose(y, want, atol=1e-5),
              f"{len(lens)} sequences, {cu[-1]} tokens")
    plans = [packcuda.shard_plan(cu, cp, r, layout="zigzag", device=device) for r in range(cp)]
    scheds = [packcuda.conv_prefix_schedule(p, K) for p in plans]
    # the global padded stream and every rank's local buffer
    cup = plans[0].cu_seqlens_padded_host
    X = torch.randn(cup[-1], C, device=device)

    def local_rows(p):
        rows = []
        for k in range(len(p.pieces_host) - 1):
            base = cup[p.piece_seq_host[k]] + p.piece_offset_host[k]
            rows.extend(range(base, base + p.pieces_host[k + 1] - p.pieces_host[k]))
        return torch.tensor(rows, device=device)

    rows = [local_rows(p) for p in plans]
    xs = [X[r] for r in rows]
    Y = torch.cat([torch.nn.functional.conv1d(X[a:e].t()[None], w[:, None], b, padding=K - 1, groups=C)[0, :, :e - a].t()
                   for a, e in zip(cup[:-1], cup[1:])])
    ok = True
    for q in range(cp):
        recv = []
        for p in range(cp):  # what rank p's schedule sends to rank q
            off = sum(scheds[p].send_counts[:q])
            idx = scheds[p].send_index[off:off + scheds[p].send_counts[q]].to(device)
            recv.append(xs[p][idx])
        prefix = torch.ops.packcuda.conv_gather_sum(xs[q], torch.cat(recv), scheds[q].on(device)[1])
        prefix = prefix.view(scheds[q].n_pieces, K - 1, C)
        yq = packcuda.causal_conv1d(xs[q], w, b, cu_seqlens=plans[q].pieces, prefix=prefix)
        ok &= torch.allclose(yq, Y[rows[q]], atol=1e-5)
        print(f"    rank {q}: {len(plans[q].pieces_host) - 1} pieces, receives {scheds[q].rows_moved} rows, "
              f"sends {sum(scheds[q].send_counts)}")
    rep.check("sharded conv (schedule exchange + prefix) == unsharded conv on every rank's slots", ok)


def run(device: str | None = None, seed: int = 0) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu"))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packcuda demo on {dev} (torch {torch.__version__}, CUDA kernels: {packcuda.built_with_cuda()})")
    rep = _Report()
    _packing(rep, dev, rng)
    _shard(rep, dev, rng)
    _balance(rep, dev, rng)
    _conv(rep, dev, rng)
    n_ok = sum(r[1] for r in rep.rows)
    print(f"demo: {n_ok}/{len(rep.rows)} checks passed")
    return 0 if rep.ok else 1
