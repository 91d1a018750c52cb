"""Conv-prefix exchange and varlen causal conv1d.

Single process (any device): ``causal_conv1d`` forward+backward on a packed stream (T=32k, C=8192, K=4,
bf16, 64 sequences) vs the pure-PyTorch reference (``F.conv1d`` per sequence), ``torch.compile`` of that
reference, FLA's varlen causal conv (when ``fla`` is importable) and the copy floor.

Two or more processes (``torchrun --nproc_per_node=2 benchmarks/bench_conv.py``, NCCL): the conv-prefix
exchange of a cp=2 plan (C=8192 bf16, K=4, 64 sequences; zigzag and contiguous) — packcuda's raw-NCCL path
and its torch.distributed path vs a bare ``batch_isend_irecv`` of the same bytes, and vs FLA's conv-prefix
exchange (``conv_cp_send_recv_fwd``; contiguous layout only, skipped with a note when ``fla`` is missing).
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import packcuda  # noqa: E402
from benchmarks.harness import Timer, graph_ms, record  # noqa: E402
from benchmarks.host_time import HOST_NOTE, host_rows  # noqa: E402
from packcuda._meta import cu_from_lengths  # noqa: E402


def _lengths(n, total, rng):
    cuts = sorted(rng.sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _reference_conv(x, w, b, cu):
    outs = []
    K = w.shape[1]
    for s in range(len(cu) - 1):
        seg = x[cu[s]:cu[s + 1]]
        y = torch.nn.functional.conv1d(seg.t()[None], w[:, None], b, padding=K - 1, groups=w.shape[0])
        outs.append(y[0, :, :seg.shape[0]].t())
    return torch.cat(outs)


def _fla_varlen_conv():
    try:
        from fla.modules.convolution import causal_conv1d as fla_conv  # noqa: F401

        return fla_conv
    except Exception:
        return None


def _configs(quick, dev):
    """(T, C, K, with_prefix) grid; the first entry is the headline shape."""
    if quick or dev.type == "cpu":
        return [(2048, 64, 4, False), (2048, 64, 4, True)]
    only = os.environ.get("PACKCUDA_BENCH_CONV_ONLY")  # "T,C,K,prefix[;T,C,K,prefix...]" (some shapes)
    if only:
        specs = [[int(v) for v in spec.split(",")] for spec in only.split(";") if spec.strip()]
        return [(T, C, K, bool(p)) for T, C, K, p in specs]
    grid = [(32768, 8192, 4, False), (32768, 8192, 4, True)]
    for T in (8192, 32768, 131072):
        for C in (2048, 8192):
            for K in (2, 3, 4):
                for p in (False, True):
                    if (T, C, K, p) not in grid:
                        grid.append((T, C, K, p))
    return grid


def run_conv(quick=False, device=None) -> list[dict]:
    """Forward, backward and forward+backward of ``causal_conv1d`` (silu, bias, bf16 on CUDA, 64 sequences), each
    also as a multiple of ``copy_`` of x measured in the same run (one read + one write of T*C elements; the
    floors are 1x forward, 1.5x backward, 2.5x forward+backward). Baselines: FLA's varlen conv (forward and
    forward+backward, as a layer calls it: ``x[None]``, int32 ``cu_seqlens``), and on the headline shape the
    per-sequence ``F.conv1d`` reference eager and under ``torch.compile``."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t = Timer(dev, warmup=2 if quick else 5, reps=5 if quick else 30)
    fla_conv = _fla_varlen_conv() if dev.type == "cuda" else None
    rows, notes = [], []
    if fla_conv is None:
        notes.append("FLA (flash-linear-attention) is not importable here: its varlen conv rows are skipped.")
    nseq = 16 if quick or dev.type == "cpu" else 64
    cfgs = _configs(quick, dev)
    try:
        for n_cfg, cfg in enumerate(cfgs):
            _one_shape(t, dev, dtype, nseq, n_cfg, cfg, fla_conv, quick, rows, notes)
    except TimeLimit:
        notes.append(f"This run reached its time limit (SIGTERM) during shape {n_cfg + 1} of {len(cfgs)} (T, C, K, "
                     f"prefix = {cfgs[n_cfg]}): that shape's remaining rows and the {len(cfgs) - n_cfg - 1} shapes "
                     "after it were not measured.")
    rows += host_rows(["causal_conv1d"], dev)
    notes.append(HOST_NOTE)
    notes.append("x_copy: time / copy_ of x in the same run (floor: fwd 1, bwd 1.5, fwd+bwd 2.5); the CUDA-graph rows "
                 "(20 calls captured, replays timed) divide by the same eager copy_ (a captured copy_ of x measured "
                 "0.396 ms against 0.258 ms eager at T=32768 C=8192 on the H200 of 2026-12-02), and their fwd+bwd "
                 "is the sum of the fwd and bwd graphs (the kernels alone: the eager fwd+bwd row also carries "
                 "autograd's host work and its hand-off to the backward thread, which a short kernel cannot hide). "
                 "bwd is the raw backward op (dx, dweight, dbias and, with a prefix, its gradient) as autograd calls "
                 "it. FLA rows: no prefix (its varlen conv takes no per-sequence prefix rows). Qwen3.5's layer shape "
                 "(transformers' Qwen3_5TextConfig: 2*16*128 key + 32*128 value channels = 8192, K=4) is the C=8192 "
                 "K=4 row.")
    return rows, notes


class TimeLimit(Exception):
    """Raised by the SIGTERM handler of the command line (a time limit): the shapes measured so far are kept."""


_FLOORS = {"fwd": 1.0, "bwd": 1.5, "fwd+bwd": 2.5}  # x copy_: the bytes each pass must move


def _one_shape(t, dev, dtype, nseq, n_cfg, cfg, fla_conv, quick, rows, notes):
    """The rows of one (T, C, K, with_prefix) shape."""
    T, C, K, with_prefix = cfg
    rng = random.Random(0)
    cu = cu_from_lengths(_lengths(nseq, T, rng))
    cu_dev = torch.tensor(cu, dtype=torch.int64)  # host metadata, as the facade passes it
    x = torch.randn(T, C, device=dev, dtype=dtype)
    w = torch.randn(C, K, device=dev, dtype=dtype) * 0.5
    b = torch.randn(C, device=dev, dtype=dtype)
    dy = torch.randn(T, C, device=dev, dtype=dtype)
    p = torch.randn(nseq, K - 1, C, device=dev, dtype=dtype) if with_prefix else None
    shape = f"T={T} C={C} K={K} {str(dtype)[6:]} seqs={nseq}" + (" prefix" if with_prefix else "")
    dst = torch.empty_like(x)
    copy_ms = t.median_ms(lambda: dst.copy_(x))
    fwd = t.median_ms(lambda: packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, prefix=p, activation="silu"))
    bwd = t.median_ms(lambda: torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, cu_dev, p, "silu"))
    leaves = [v.detach().requires_grad_() for v in (x, w, b) + ((p,) if with_prefix else ())]

    def fwd_bwd(f):
        def go():
            torch.autograd.grad(f(), leaves, dy)
        return go

    ours = fwd_bwd(lambda: packcuda.causal_conv1d(leaves[0], leaves[1], leaves[2], cu_seqlens=cu,
                                                  prefix=leaves[3] if with_prefix else None, activation="silu"))
    both = t.median_ms(ours)
    def add(op, ms, base=None):
        """One row: our time `ms` as a multiple of copy_; with `base` = (name, ms) the baseline's time and ours
        over it, else the floor of `op` (fwd 1, bwd 1.5, fwd+bwd 2.5)."""
        row = dict(op=f"causal_conv1d {op}", shape=shape, packcuda_ms=ms, copy_ms=copy_ms, x_copy=ms / copy_ms)
        if base is None:
            row.update(floor_x_copy=_FLOORS[op.split()[0]], baseline="-", baseline_ms=float("nan"),
                       speedup=float("nan"))
            print(f"{row['op']:45s} {shape:45s} {ms:.4f} ms  {ms / copy_ms:.2f}x copy", flush=True)
        else:
            row.update(baseline=base[0], baseline_ms=base[1], speedup=base[1] / ms)
        rows.append(row)

    add("fwd", fwd)
    add("bwd", bwd)
    add("fwd+bwd", both)
    if dev.type == "cuda":  # kernel time alone: the same ops captured in a CUDA graph (no host, no autograd)
        cu_d = torch.tensor(cu, dtype=torch.int64, device=dev)
        ms_fg = graph_ms(t, lambda: packcuda.causal_conv1d(x, w, b, cu_seqlens=cu_d, prefix=p, activation="silu"))
        ms_bg = graph_ms(t, lambda: torch.ops.packcuda.causal_conv1d_bwd(dy, x, w, b, cu_d, p, "silu"))
        add("fwd (CUDA graph)", ms_fg)
        add("bwd (CUDA graph)", ms_bg)
        add("fwd+bwd kernels (CUDA graph)", ms_fg + ms_bg)
    if fla_conv is not None and not with_prefix:
        try:
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            f = lambda: fla_conv(leaves[0][None], leaves[1], leaves[2], activation="silu", cu_seqlens=cu_t)[0][0]
            ms_f = t.median_ms(lambda: fla_conv(x[None], w, b, activation="silu", cu_seqlens=cu_t))
            ms_b = t.median_ms(fwd_bwd(f))
            add("fwd", fwd, ("FLA causal_conv1d (varlen)", ms_f))
            add("fwd+bwd", both, ("FLA causal_conv1d (varlen)", ms_b))
            print(f"FLA varlen conv {shape}: fwd {ms_f:.4f} ms, fwd+bwd {ms_b:.4f} ms", flush=True)
        except Exception as e:  # pragma: no cover
            notes.append(f"FLA varlen conv failed: {type(e).__name__}: {e}")
    if n_cfg == 0 and not with_prefix:  # the per-sequence reference (one F.conv1d per sequence): eager, compiled
        ref = fwd_bwd(lambda: torch.nn.functional.silu(_reference_conv(leaves[0], leaves[1], leaves[2], cu)))
        add("fwd+bwd", both, ("F.conv1d per sequence (eager)", t.median_ms(ref, reps=3 if quick else 10)))
        if not quick:
            try:
                cref = torch.compile(
                    lambda: torch.nn.functional.silu(_reference_conv(leaves[0], leaves[1], leaves[2], cu)))
                add("fwd+bwd", both, ("torch.compile(F.conv1d per sequence)", t.median_ms(fwd_bwd(cref), reps=10)))
            except Exception as e:  # pragma: no cover
                notes.append(f"torch.compile baseline skipped: {type(e).__name__}: {e}")
    del x, dy, dst, leaves


def run_exchange(quick=False) -> list[dict]:
    """Needs torch.distributed initialised (torchrun) with >= 2 ranks; uses ranks 0 and 1 as cp=2."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = (torch.device("cuda", rank % max(1, torch.cuda.device_count())) if torch.cuda.is_available()
           else torch.device("cpu"))
    C, K, nseq = (64, 4, 8) if quick else (8192, 4, 64)
    rng = random.Random(1)
    lens = [rng.randint(64, 1024) for _ in range(nseq)]
    cu = cu_from_lengths(lens)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n_back, trials = (10, 5) if quick else (100, 21)

    def loop_ms(fn):
        """Per-op time of n back-to-back calls between two CUDA events (median over trials, after a barrier):
        steady-state cost in a training loop, each rank launching without waiting for the other."""
        for _ in range(5):
            fn()
        times = []
        for _ in range(trials):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dist.barrier()
            if dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(n_back):
                    fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / n_back)
            else:
                import time as _time

                t0 = _time.perf_counter()
                for _ in range(n_back):
                    fn()
                times.append((_time.perf_counter() - t0) * 1e3 / n_back)
        times.sort()
        return times[len(times) // 2]

    rows, notes = [], []
    notes.append(f"Exchange times: {n_back} back-to-back calls between two CUDA events, median of {trials} trials "
                 "after a barrier (the same method for every row).")
    for layout in ("zigzag", "contiguous"):
        plan = packcuda.shard_plan(cu, world, rank, layout=layout, device=dev)
        x = torch.randn(plan.total_local, C, device=dev, dtype=dtype)
        sched = packcuda.conv_prefix_schedule(plan, K)
        nccl = dev.type == "cuda" and bool(torch.ops.packcuda.exchange_nccl_available())
        backends = ["torch"] + (["nccl"] if nccl else [])
        res = {}
        for be in backends:
            packcuda.conv_prefix(x, plan, K, backend=be)  # warm-up: comm creation, peer connections
            dist.barrier()
            res[be] = loop_ms(lambda: packcuda.conv_prefix(x, plan, K, backend=be))
        if "nccl" in res:  # device time alone: 20 exchanges captured in a CUDA graph, replayed
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        packcuda.conv_prefix(x, plan, K, backend="nccl")
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                dist.barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        packcuda.conv_prefix(x, plan, K, backend="nccl")
                torch.cuda.synchronize()
                res["nccl, CUDA graph"] = loop_ms(graph.replay) / 20
            except Exception as e:  # pragma: no cover
                notes.append(f"CUDA-graph exchange row skipped ({type(e).__name__}: {e}).")
        # bare send/recv of the same rows
        sb = x.new_empty(sum(sched.send_counts), C)
        rb = x.new_empty(sum(sched.recv_counts), C)

        def bare():
            p2p, so, ro = [], 0, 0
            for p in range(world):
                if sched.send_counts[p]:
                    p2p.append(dist.P2POp(dist.isend, sb[so:so + sched.send_counts[p]], p))
                if sched.recv_counts[p]:
                    p2p.append(dist.P2POp(dist.irecv, rb[ro:ro + sched.recv_counts[p]], p))
                so += sched.send_counts[p]
                ro += sched.recv_counts[p]
            if p2p:
                for r in dist.batch_isend_irecv(p2p):
                    r.wait()

        bare()
        dist.barrier()
        base = loop_ms(bare)
        best = res.get("nccl", res["torch"])
        shape = f"{layout} cp={world} C={C} K={K} seqs={nseq} rows_in={sched.rows_moved}"
        for be, ms in res.items():
            rows.append(dict(op=f"conv_prefix ({be})", shape=shape, packcuda_ms=ms,
                             baseline="bare batch_isend_irecv, same bytes", baseline_ms=base, speedup=base / ms))
        # FLA: its conv-prefix exchange as a layer runs it (build the CP context once, then per call
        # `_prepare_initial_state_for_cp`: exchange + the [N, C, K] initial state), and its bare exchange
        # (`conv_cp_send_recv_fwd`: all-gather of every rank's tail). FLA's zigzag splits the whole pack into
        # 2*cp parts (not each sequence), so its zigzag row moves different rows than ours.
        try:
            from fla.modules.causal_conv1d.cp import CausalConv1dFunctionCP
            from fla.ops.cp import build_cp_context
            from fla.ops.cp.comm import conv_cp_send_recv_fwd

            Tg = -(-cu[-1] // (2 * world)) * (2 * world)
            cu_t = torch.tensor(cu[:-1] + [Tg], dtype=torch.int32, device=dev)
            fctx = build_cp_context(cu_t, dist.group.WORLD, conv1d_kernel_size=K, cu_seqlens_cpu=cu_t.cpu(),
                                    layout=layout)
            xl = torch.randn(1, Tg // world, C, device=dev, dtype=dtype)
            wt = torch.randn(C, K, device=dev, dtype=dtype)
            prep = CausalConv1dFunctionCP._prepare_initial_state_for_cp
            prep(xl, wt, fctx.cu_seqlens, fctx, dist.group.WORLD)
            dist.barrier()
            ms = loop_ms(lambda: prep(xl, wt, fctx.cu_seqlens, fctx, dist.group.WORLD))
            rows.append(dict(op="conv_prefix", shape=shape, packcuda_ms=best,
                             baseline=f"FLA prefix-state preparation ({layout} split of the pack)", baseline_ms=ms,
                             speedup=ms / best))
            if layout == "contiguous":
                tails = x[-(K - 1):].contiguous()
                conv_cp_send_recv_fwd(tails, dist.group.WORLD)
                dist.barrier()
                ms = loop_ms(lambda: conv_cp_send_recv_fwd(tails, dist.group.WORLD))
                rows.append(dict(op="conv_prefix", shape=shape, packcuda_ms=best,
                                 baseline="FLA conv_cp_send_recv_fwd (bare all-gather of tails)", baseline_ms=ms,
                                 speedup=ms / best))
        except Exception as e:
            notes.append(f"FLA conv-prefix comparison skipped ({type(e).__name__}: {e}).")
    return rows, notes


def run(quick=False, device=None, write=False, exchange_only=False) -> list[dict]:
    """Rows of both tables; `write` records them (the one-command report records its own table)."""
    import torch.distributed as dist

    rows, notes = ([], []) if exchange_only else run_conv(quick, device)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() >= 2:
        xr, xn = run_exchange(quick)
        if dist.get_rank() == 0 and write:
            record("conv-prefix exchange (cp=2)", xr, device=dev, notes=" ".join(sorted(set(xn))))
        rows += xr
    elif dev.type == "cuda":
        notes.append("exchange rows need `torch distributed launch`: "
                     "torchrun --nproc_per_node=2 benchmarks/bench_conv.py")
    if write and not exchange_only and (not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0):
        record("causal_conv1d fwd+bwd (varlen, silu)", [r for r in rows if not r["op"].startswith("conv_prefix")],
               device=dev, notes=" ".join(notes), write=not quick)
    return rows


def _on_sigterm(signum, frame):
    raise TimeLimit()


if __name__ == "__main__":
    import signal

    import torch.distributed as dist

    signal.signal(signal.SIGTERM, _on_sigterm)

    quick = "--quick" in sys.argv
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            run(quick=quick, write=True, exchange_only="--exchange-only" in sys.argv)
        finally:
            dist.destroy_process_group()
    else:
        run(quick=quick, write=True)
