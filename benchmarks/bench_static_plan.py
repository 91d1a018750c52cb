"""Static shard plans: the whole packed CP data path of one step in one CUDA graph, against the eager host-plan path.

Workload (full mode): batches of up to 1024 sequences (max_seqs = 1024), lengths uniform in 64..8128
(random.Random(7 + batch)), at most capacity = 4M tokens (2**22) each; cp = 8 on one GPU, rank 0; model width
C = 2 heads x 64 (bf16), conv kernel 4. The step, on both paths:
  plan -> shard input_ids / positions / labels -> embedding -> 1D RoPE (apply_rope) -> causal_conv1d
  over the plan's pieces -> unshard of [cp, T_local, C] (this rank's output repeated cp times stands in for the
  all-gather of the other ranks).
  - static: ``static_shard_plan`` from device cu_seqlens / num_seqs (padded to max_seqs + 1 entries), the conv
    prefix from ``StaticShardPlan.local_conv_prefix`` (single rank: the local part of the exchange), captured once
    in a CUDA graph and replayed for every batch (inputs copied into the graph's buffers first, not timed);
  - eager host-plan path: ``shard_plan(host cu_seqlens, bucket=capacity)`` per batch and the same ops eagerly
    (conv over the pieces without a prefix: no exchange on one GPU).
Rows: per-step time (CUDA events) of the graph replay and of the eager static step against the eager host-plan
step; host time per step (perf_counter around the call, no sync inside: what the CPU spends enqueuing) of the
replay against the eager host-plan path's; the plan alone. The static path is checked for zero syncs under
``torch.cuda.set_sync_debug_mode("error")`` and its plan tables against the host plan's.

    python -m benchmarks.bench_static_plan [--quick] [--device cuda] [--no-write]
"""
from __future__ import annotations

import random
import time

import torch

import packcuda
from benchmarks.harness import Timer, cli
from packcuda._meta import cu_from_lengths as _cu

H, D, K = 2, 64, 4


def _batches(count: int, max_seqs: int, capacity: int, lo: int, hi: int):
    """Host lengths of `count` batches that fit `capacity` (each at most max_seqs sequences)."""
    out = []
    b = 0
    while len(out) < count:
        rng = random.Random(7 + b)
        b += 1
        lens, total = [], 0
        while len(lens) < max_seqs:
            n = rng.randint(lo, hi)
            if total + n + 16 * len(lens) > capacity - 16 * 2:  # room for the per-sequence padding
                break
            lens.append(n)
            total += n
        out.append(lens)
    return out


def _tail(plan, ids, pos, emb, w, prefix_fn, cp):
    local = plan.shard(ids)
    labels = plan.labels(ids)
    h = emb[local].view(-1, H, D)
    q, k = packcuda.apply_rope(h, h, plan.shard_positions(pos), rope_theta=10000.0)
    xc = q.reshape(-1, H * D)
    y = packcuda.causal_conv1d(xc, w, cu_seqlens=plan.pieces, prefix=prefix_fn(xc))
    return plan.unshard(y.repeat(cp, 1)), labels


def _host_ms(fn, reps: int, device) -> float:
    """Median host time of one call (no sync inside the timed region; the device is drained between calls)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times.sort()
    return times[len(times) // 2]


def run(quick: bool = False, device=None) -> list[dict]:
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu")
    if quick:
        max_seqs, capacity, cp, lo, hi, n_batches = 64, 2**16, 4, 16, 1024, 3
    else:
        max_seqs, capacity, cp, lo, hi, n_batches = 1024, 2**22, 8, 64, 8128, 5
    rank = 0
    batches = _batches(n_batches, max_seqs, capacity, lo, hi)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    emb = torch.randn(1000, H * D, generator=g).to(dev, dtype)
    w = torch.randn(H * D, K, generator=g).to(dev, dtype)
    ids_all = [torch.randint(0, 1000, (capacity,), generator=g).to(dev) for _ in batches]
    pos_all = [torch.cat([packcuda.position_ids(_cu(l)), torch.zeros(capacity - sum(l), dtype=torch.int64)]).to(dev)
               for l in batches]
    cu_all = [torch.tensor(_cu(l) + [sum(l)] * (max_seqs - len(l)), dtype=torch.int32).to(dev) for l in batches]
    n_all = [torch.tensor(len(l)).to(dev) for l in batches]

    cu_buf, n_buf, ids_buf, pos_buf = cu_all[0].clone(), n_all[0].clone(), ids_all[0].clone(), pos_all[0].clone()

    def static_step():
        plan = packcuda.static_shard_plan(cu_buf, n_buf, cp, rank, capacity=capacity, max_seqs=max_seqs)
        return _tail(plan, ids_buf, pos_buf, emb, w, lambda xc: plan.local_conv_prefix(xc, K), cp) + (plan.status,)

    state = {"b": 0}

    def host_step():
        i = state["b"] % len(batches)
        state["b"] += 1
        plan = packcuda.shard_plan(_cu(batches[i]), cp, rank, bucket=capacity, device=dev)
        T = plan.total
        return _tail(plan, ids_all[i][:T], pos_all[i][:T], emb, w, lambda xc: None, cp)

    def load(i):
        cu_buf.copy_(cu_all[i])
        n_buf.copy_(n_all[i])
        ids_buf.copy_(ids_all[i])
        pos_buf.copy_(pos_all[i])

    # the static plan equals the host plan on every batch
    for i, lens in enumerate(batches):
        load(i)
        s = packcuda.static_shard_plan(cu_buf, n_buf, cp, rank, capacity=capacity, max_seqs=max_seqs).check()
        h = packcuda.shard_plan(_cu(lens), cp, rank, bucket=capacity, device=dev)
        for name in ("index", "position_ids", "label_index"):
            assert torch.equal(getattr(s, name)[:h.total_local], getattr(h, name)), name
    n_tokens = sum(sum(l) for l in batches) // len(batches)
    shape = (f"<= {max_seqs} seqs, ~{n_tokens / 2**20:.2f}M tokens, capacity={capacity}, cp={cp}, rank {rank}, "
             f"C={H * D}")
    t = Timer(dev, warmup=2 if quick else 3, reps=5 if quick else 20)
    rows = []
    ms_host = t.median_ms(host_step)
    ms_static = t.median_ms(static_step)
    rows.append(dict(op="whole step, static plan, eager", shape=shape, packcuda_ms=ms_static,
                     baseline="eager host-plan path", baseline_ms=ms_host, speedup=ms_host / ms_static))
    host_host = _host_ms(host_step, t.reps, dev)
    if dev.type == "cuda":
        static_step()
        torch.cuda.synchronize(dev)
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static_step()  # zero syncs: raises otherwise
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                static_step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = static_step()
        for i in range(len(batches)):  # one capture serves every batch
            load(i)
            graph.replay()
            assert int(outs[2][0]) == 0
        ms_graph = t.median_ms(graph.replay)
        rows.append(dict(op="whole step, static plan, one CUDA graph replay", shape=shape, packcuda_ms=ms_graph,
                         baseline="eager host-plan path", baseline_ms=ms_host, speedup=ms_host / ms_graph))
        host_graph = _host_ms(graph.replay, t.reps, dev)
        rows.append(dict(op="host time per step: graph replay", shape=shape, packcuda_ms=host_graph,
                         baseline="host time: eager host-plan path", baseline_ms=host_host,
                         speedup=host_host / host_graph))
        plan_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plan_graph):
            packcuda.static_shard_plan(cu_buf, n_buf, cp, rank, capacity=capacity, max_seqs=max_seqs)
        ms_plan = t.median_ms(plan_graph.replay)
        ms_host_plan = t.median_ms(lambda: packcuda.shard_plan(_cu(batches[0]), cp, rank, bucket=capacity,
                                                               device=dev))
        rows.append(dict(op="plan only: static plan (graph replay)", shape=shape, packcuda_ms=ms_plan,
                         baseline="shard_plan from host cu_seqlens (eager)", baseline_ms=ms_host_plan,
                         speedup=ms_host_plan / ms_plan))
        del graph, plan_graph, outs
    else:
        host_static = _host_ms(static_step, t.reps, dev)
        rows.append(dict(op="host time per step: static plan, eager", shape=shape, packcuda_ms=host_static,
                         baseline="host time: eager host-plan path", baseline_ms=host_host,
                         speedup=host_host / host_static))
    return rows


if __name__ == "__main__":
    cli(run, "static shard plans: whole step in one CUDA graph (cp=8, rank 0, single GPU)",
        notes="speedup = baseline_ms / packcuda_ms. Step = plan, shard ids/positions/labels, embedding, apply_rope, "
              "causal_conv1d over the pieces (static: local conv prefix), unshard of [cp, T_local, C]. Host time: "
              "perf_counter around one call, device drained between calls.")
