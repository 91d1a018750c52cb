"""Layout bridge: relayout of a 32k-token pack between the zigzag and contiguous layouts (bf16, hidden 4096 / 2048).

Workload: lengths uniform in 64..4096 (random.Random(11)) up to 32768 tokens, plans from packcuda.hybrid_plans
(align = 2*cp). Rows, each against baselines measured in the same run:
  - relayout zigzag -> contiguous (forward; forward + backward) against a copy_ of the same bytes (the floor of a
    move) and against all-gather-then-index (all_gather_into_tensor of every rank's rows, then one index_select
    of this rank's dst rows: what frameworks without a move do);
  - device time: 20 calls captured in one CUDA graph, replays timed (host overhead drops out), against a copy_
    of the same bytes timed the same way;
  - host µs per call: wall time per call with the GPU running ahead (20 back-to-back calls), forward and
    forward + backward, beside a bare torch.autograd.Function wrapping one index_select each way (the floor of
    any autograd-aware Python op), the four measured in turns.

One GPU (cp = 1): the move is a local gather (backend auto), and the NCCL path (backend nccl) runs over a
one-rank NCCL group (its unpack kernel alone: no peers). Several GPUs (torchrun --nproc_per_node=N, N in 2, 4,
8): relayout per layer against the all-gather of the whole sequence; without such a machine those rows are
listed as not run.

    python -m benchmarks.bench_relayout [--quick] [--device cuda] [--no-write]
    torchrun --nproc_per_node=8 benchmarks/bench_relayout.py
"""
from __future__ import annotations

import random

import torch

import packcuda
from benchmarks.harness import Timer, copy_floor_ms, graph_copy_floor_ms, graph_ms, host_us_in_turns, record

HIDDEN = (4096, 2048)
TOKENS = 32768


def _workload(total: int, seed: int = 11):
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < total:
        cu.append(min(total, cu[-1] + rng.randint(64, 4096)))
    return cu


class _BareGather(torch.autograd.Function):
    """The floor of an autograd-aware Python op: one index_select forward, one index_add backward."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.idx, ctx.n = idx, x.shape[0]
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        return g.new_zeros((ctx.n, *g.shape[1:])).index_add_(0, ctx.idx, g), None


def _gathered_index(src, dst, device):
    """Row of the rank-major concatenation of every rank's src buffer that each of dst's slots takes."""
    cp, tl = src.cp_size, src.total_local
    pos = {}
    for r in range(cp):
        p = packcuda.shard_plan(src.cu_seqlens_host, cp, r, layout=src.layout, align=src.align, bucket=src.bucket)
        for k in range(len(p.pieces_host) - 1):
            base = p.cu_seqlens_padded_host[p.piece_seq_host[k]] + p.piece_offset_host[k]
            for i in range(p.pieces_host[k + 1] - p.pieces_host[k]):
                pos[base + i] = r * tl + p.pieces_host[k] + i
    rows = []
    P, off, seq, cup = dst.pieces_host, dst.piece_offset_host, dst.piece_seq_host, dst.cu_seqlens_padded_host
    for k in range(len(P) - 1):
        base = cup[seq[k]] + off[k]
        rows.extend(pos[base + i] for i in range(P[k + 1] - P[k]))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _rows_for(cp, rank, cu, H, dev, t, group, quick, multi):
    zz, ct = packcuda.hybrid_plans(cu, cp, rank, device=dev)
    shape = f"T={cu[-1]} ({len(cu) - 1} seqs), H={H}, bf16, cp={cp}"
    x = torch.randn(zz.total_local, H, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    gy = torch.randn(ct.total_local, H, device=dev, dtype=torch.bfloat16)
    nbytes = ct.total_local * H * 2
    idx = _gathered_index(zz, ct, dev)
    buf = x.new_empty((cp * zz.total_local, H))

    def gather_index():
        import torch.distributed as dist

        dist.all_gather_into_tensor(buf, x, group=group)
        return buf.index_select(0, idx)

    # one GPU: the local move and the NCCL path over a one-rank group; several: the NCCL path (auto)
    backends = ["auto"] + (["nccl"] if cp == 1 and group is not None and packcuda.exchange.nccl_built() else [])
    rows = []
    floor = copy_floor_ms(t, nbytes, nbytes)
    ag = t.median_ms(gather_index) if group is not None else float("nan")
    for be in backends:
        name = f"relayout zigzag->contiguous ({'local' if cp == 1 and be == 'auto' else be})"
        fwd = lambda: packcuda.relayout(x, zz, ct, group, backend=be)  # noqa: E731
        ms = t.median_ms(fwd)
        rows.append(dict(op=name, shape=shape, packcuda_ms=ms, baseline="copy floor (same bytes)", baseline_ms=floor,
                         speedup=floor / ms, pct_copy_bw=100 * floor / ms))
        if group is not None:
            rows.append(dict(op=name, shape=shape, packcuda_ms=ms, baseline="all_gather + index_select",
                             baseline_ms=ag, speedup=ag / ms))
        fb = lambda: packcuda.relayout(xg, zz, ct, group, backend=be).backward(gy)  # noqa: E731
        ms_fb = t.median_ms(fb)
        rows.append(dict(op=name + " fwd+bwd", shape=shape, packcuda_ms=ms_fb, baseline="copy floor x2",
                         baseline_ms=2 * floor, speedup=2 * floor / ms_fb, pct_copy_bw=200 * floor / ms_fb))
        if dev.type == "cuda" and not multi:
            gms = graph_ms(t, fwd)
            gfl = graph_copy_floor_ms(t, nbytes)
            rows.append(dict(op=name + " (device time, CUDA graph)", shape=shape, packcuda_ms=gms,
                             baseline="copy floor (same bytes, CUDA graph)", baseline_ms=gfl, speedup=gfl / gms,
                             pct_copy_bw=100 * gfl / gms))
        if dev.type == "cuda":
            perm = torch.arange(zz.total_local, device=dev)
            h = host_us_in_turns({"bare": lambda: _BareGather.apply(x, perm),
                                  "bare_fb": lambda: _BareGather.apply(xg, perm).backward(gy),
                                  "fwd": fwd, "fb": fb}, dev, rounds=3 if quick else 7)
            rows.append(dict(op=name + " host µs/call fwd", shape=shape, packcuda_ms=h["fwd"] / 1e3,
                             baseline="bare autograd.Function (index_select)", baseline_ms=h["bare"] / 1e3,
                             speedup=h["bare"] / h["fwd"]))
            rows.append(dict(op=name + " host µs/call fwd+bwd", shape=shape, packcuda_ms=h["fb"] / 1e3,
                             baseline="bare autograd.Function (index_select)", baseline_ms=h["bare_fb"] / 1e3,
                             speedup=h["bare_fb"] / h["fb"]))
    return rows


def run(quick: bool = False, device=None) -> list[dict]:
    import torch.distributed as dist

    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu")
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    cu = _workload(4096 if quick else TOKENS)
    t = Timer(dev, warmup=2 if quick else 5, reps=5 if quick else 50)
    rows = []
    own_group = False
    if multi:
        cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    else:
        cp, rank, group = 1, 0, None
        if dev.type == "cuda" and dist.is_available() and dist.is_nccl_available():
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            group, own_group = dist.group.WORLD, True
    try:
        for H in (HIDDEN[1:] if quick else HIDDEN):
            rows += _rows_for(cp, rank, cu, H, dev, t, group, quick, multi)
    finally:
        if own_group:
            dist.destroy_process_group()
    if not multi:
        for n in (2, 4, 8):
            for H in HIDDEN:
                rows.append(dict(op="relayout zigzag->contiguous per GDN layer (nccl)",
                                 shape=f"T={cu[-1]}, H={H}, bf16, cp={n}", packcuda_ms=float("nan"),
                                 baseline="all_gather of the whole sequence", baseline_ms=float("nan"),
                                 speedup=float("nan"),
                                 note=f"not run: needs {n} GPUs (torchrun --nproc_per_node={n} "
                                      "benchmarks/bench_relayout.py)"))
    return rows


NOTES = ("Workload: lengths uniform in 64..4096 up to 32768 tokens, plans from packcuda.hybrid_plans. speedup = "
         "baseline_ms / packcuda_ms; for copy-floor rows it is the fraction of copy speed. cp=1: the 'local' rows "
         "are the move without communication (one gather kernel), the 'nccl' rows the raw-NCCL path over a "
         "one-rank group; all_gather + index_select is the all-gather of every rank's rows then an index of this "
         "rank's dst rows. Host µs rows: wall time per call with the GPU running ahead (20 back-to-back calls), "
         "against a bare autograd.Function of one index_select (backward index_add_) timed the same way.")


if __name__ == "__main__":
    import argparse
    import os

    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun: one rank per GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    rows = run(quick=args.quick, device=args.device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        dev = args.device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu")
        record("layout bridge: relayout zigzag <-> contiguous" + (" (quick)" if args.quick else ""), rows,
               device=dev, notes=NOTES, write=not (args.quick or args.no_write))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
