"""Shard plans: build a zigzag CP plan and shard input_ids, positions and labels of a packed batch.

Workload (full mode): 1024 sequences with lengths uniform in 64..8192 (random.Random(7)), cp=8, rank 3,
int64 ids on the device. Baselines, measured in the same run:
  - a per-sequence Python loop, the way trainers shard today (host lengths, slice each sequence's two
    chunks, arange positions, next-token labels per sequence, torch.cat);
  - a vectorized pure-PyTorch version (searchsorted over the local boundaries);
  - the copy floor: a device copy of the same bytes as each shard (read + write).
Host cu_seqlens go in; packcuda needs no device sync.

Two kinds of rows for the ops on a built plan:
  - eager: CUDA events around each call. These ops are host-bound (a few microseconds of kernel), so an
    eager row is the op's host time per call; the copy floor row is likewise the host time of a copy_.
  - device time (CUDA only): 20 back-to-back calls captured into one CUDA graph (plan built before the
    capture, warm-up on a side stream), replays timed with events, divided by 20; the copy floor is timed the
    same way, so the ratio is kernel against kernel. Inputs stay in L2 across replays for both sides.

    python -m benchmarks.bench_shard [--quick] [--device cuda]
"""
from __future__ import annotations

import random

import torch

import packcuda
from benchmarks.harness import Timer, copy_floor_ms, graph_copy_floor_ms, graph_ms, record


def _workload(n_seq: int, seed: int = 7):
    rng = random.Random(seed)
    lens = [rng.randint(64, 8192) for _ in range(n_seq)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return lens, cu


def loop_shard(ids: torch.Tensor, lens, cp: int, rank: int, ignore_index: int = -100):
    """Per-sequence loop (the approach trainers use): pad each sequence to 2*cp, take chunks rank and
    2*cp-1-rank, positions from arange, labels = the next token inside the sequence."""
    out_ids, out_pos, out_lab = [], [], []
    dev = ids.device
    start = 0
    for L in lens:
        seq = ids[start:start + L]
        Lp = -(-L // (2 * cp)) * (2 * cp)
        padded = torch.zeros(Lp, dtype=ids.dtype, device=dev)
        padded[:L] = seq
        lab = torch.full((Lp,), ignore_index, dtype=ids.dtype, device=dev)
        lab[:L - 1] = seq[1:]
        pos = torch.arange(Lp, device=dev)
        h = Lp // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out_ids.append(padded[c * h:(c + 1) * h])
            out_pos.append(pos[c * h:(c + 1) * h])
            out_lab.append(lab[c * h:(c + 1) * h])
        start += L
    return torch.cat(out_ids), torch.cat(out_pos), torch.cat(out_lab)


def vectorized_shard(ids: torch.Tensor, lens, cp: int, rank: int, ignore_index: int = -100):
    """Pure PyTorch without a loop: local slot -> (sequence, offset) by searchsorted over local boundaries."""
    dev = ids.device
    L = torch.tensor(lens, dtype=torch.int64, device=dev)
    Lp = (L + 2 * cp - 1) // (2 * cp) * (2 * cp)
    h = Lp // (2 * cp)
    start = torch.cumsum(L, 0) - L
    local_cu = torch.cumsum(2 * h, 0)
    T_local = int(local_cu[-1].item())  # the size of the output: one sync
    s = torch.arange(T_local, device=dev)
    seq = torch.searchsorted(local_cu, s, right=True)
    off = s - (local_cu[seq] - 2 * h[seq])
    first = off < h[seq]
    o = torch.where(first, rank * h[seq] + off, (2 * cp - 1 - rank) * h[seq] + off - h[seq])
    valid = o < L[seq]
    row = torch.where(valid, start[seq] + o, 0)
    out_ids = torch.where(valid, ids[row], 0)
    lvalid = o + 1 < L[seq]
    out_lab = torch.where(lvalid, ids[torch.where(lvalid, row + 1, 0)], ignore_index)
    return out_ids, o, out_lab


def run(quick: bool = False, device=None) -> list[dict]:
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu")
    n_seq, cp, rank = (64, 4, 1) if quick else (1024, 8, 3)
    lens, cu = _workload(n_seq)
    T = cu[-1]
    ids = torch.randint(0, 150000, (T,), dtype=torch.int64, device=dev)
    pos3 = torch.randint(0, 8192, (3, T), dtype=torch.int64, device=dev)
    t = Timer(dev, warmup=2 if quick else 3, reps=5 if quick else 50)
    t_loop = Timer(dev, warmup=1 if quick else 2, reps=3 if quick else 20)

    def ours():
        plan = packcuda.shard_plan(cu, cp, rank, device=dev)
        return plan.shard(ids), plan.position_ids, plan.labels(ids)

    # the three implementations agree
    a, b, c = ours(), loop_shard(ids, lens, cp, rank), vectorized_shard(ids, lens, cp, rank)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    plan = packcuda.shard_plan(cu, cp, rank, device=dev)
    shape = f"{n_seq} seqs, T={T}, cp={cp}, rank={rank}, T_local={plan.total_local}"

    ms_ours = t.median_ms(ours)
    ms_loop = t_loop.median_ms(lambda: loop_shard(ids, lens, cp, rank))
    ms_vec = t.median_ms(lambda: vectorized_shard(ids, lens, cp, rank))
    rows = [
        dict(op="plan + shard ids/positions/labels", shape=shape, packcuda_ms=ms_ours,
             baseline="per-sequence Python loop", baseline_ms=ms_loop, speedup=ms_loop / ms_ours),
        dict(op="plan + shard ids/positions/labels", shape=shape, packcuda_ms=ms_ours,
             baseline="vectorized torch (searchsorted, 1 sync)", baseline_ms=ms_vec, speedup=ms_vec / ms_ours),
    ]
    # shard alone (plan built) vs a copy of the same bytes
    cases = [
        ("shard input_ids [T] int64", ids, lambda: plan.shard(ids)),
        ("labels [T] int64", ids, lambda: plan.labels(ids)),
        ("shard positions [3,T] int64 (dim=1)", pos3, lambda: plan.shard(pos3, dim=1)),
    ]
    for name, x, fn in cases:
        nbytes = plan.total_local * x.element_size() * (x.numel() // T)
        ms = t.median_ms(fn)
        floor = copy_floor_ms(t, nbytes, nbytes)
        rows.append(dict(op=name, shape=shape, packcuda_ms=ms, baseline="copy floor (same bytes)",
                         baseline_ms=floor, speedup=floor / ms, pct_copy_bw=100 * floor / ms))
    if dev.type == "cuda":  # kernel against kernel: CUDA-graph replays (host overhead drops out)
        calls = 20
        for name, x, fn in cases:
            nbytes = plan.total_local * x.element_size() * (x.numel() // T)
            ms = graph_ms(t, fn, calls)
            floor = graph_copy_floor_ms(t, nbytes, calls)
            rows.append(dict(op=f"{name} (device time, CUDA graph)", shape=shape, packcuda_ms=ms,
                             baseline="copy floor (same bytes, CUDA graph)", baseline_ms=floor, speedup=floor / ms,
                             pct_copy_bw=100 * floor / ms))
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    rows = run(quick=args.quick, device=args.device)
    dev = args.device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu")
    record("shard plans (zigzag, cp=8, rank 3)" if not args.quick else "shard plans (quick)", rows, device=dev,
           notes="speedup = baseline_ms / packcuda_ms; for the copy-floor rows it is the fraction of copy speed. "
                 "packcuda builds the plan from host cu_seqlens without a device sync. Eager rows are host-bound "
                 "(host time per call); '(device time, CUDA graph)' rows are kernel time: 20 calls per graph "
                 "replay, divided by 20, against a copy_ of the same bytes timed the same way.",
           write=not args.quick)
