"""Micro-batch planning (host work): packcuda's C++ planner vs the plain Python Karmarkar-Karp reference.

8192 sequences with lengths log-uniform in [32, 32768], max_tokens 64k, attention workload 24576·L + L².
Baselines, measured in the same run:
  - Python KK, one pass at the start count (what a pure-Python KK costs; it ignores the cap),
  - Python KK + retry: partition again with one more micro-batch until every micro-batch fits the cap.
`--adversarial`: worst-case distributions at 16k sequences (one call each, times printed).
Reported: wall time, micro-batch count, the largest token sum, and max/mean micro-batch workload.
"""
from __future__ import annotations

import math
import random
import sys
import time

import torch

import packcuda
from benchmarks.baselines import karmarkar_karp, plan_micro_batches, workloads
from benchmarks.harness import Timer, record


def _lengths(n, seed=0, lo=32, hi=32768):
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def _stats(parts, lens, max_tokens=None, prefix=""):
    w = workloads(lens)
    loads = [sum(w[i] for i in p) for p in parts]
    out = {f"{prefix}parts": len(parts), f"{prefix}max_over_mean": f"{max(loads) / (sum(loads) / len(loads)):.4f}"}
    if max_tokens is not None:
        out[f"{prefix}max_tokens_used"] = max(sum(lens[i] for i in p) for p in parts)
    return out


def _once_ms(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def run(quick=False, device=None) -> list[dict]:
    device = torch.device("cpu")  # planning is host work
    n = 512 if quick else 8192
    max_tokens = 65536
    lens = _lengths(n)
    s = torch.tensor(lens)
    timer = Timer(device, warmup=1 if quick else 2, reps=3 if quick else 10)
    shape = f"n={n} L~logU[32,32768] cap={max_tokens}"
    k0 = -(-sum(lens) // max_tokens)

    baselines = []
    ms, parts = _once_ms(lambda: karmarkar_karp(workloads(lens), k0))
    baselines.append(("Python KK, one pass at the start count (ignores the cap)", ms, parts))
    ms, parts = _once_ms(lambda: plan_micro_batches(lens, max_tokens))
    baselines.append(("Python KK, +1 micro-batch and retry until the cap holds", ms, parts))

    rows = []
    for method in ["karmarkar_karp", "first_fit_decreasing"]:
        ours_ms = timer.median_ms(lambda: packcuda.plan_micro_batches(s, max_tokens, method=method))
        ours = packcuda.plan_micro_batches(s, max_tokens, method=method)
        for name, base_ms, base in baselines:
            rows.append(dict(op=f"plan_micro_batches({method})", shape=shape, packcuda_ms=ours_ms, baseline=name,
                             baseline_ms=base_ms, speedup=base_ms / ours_ms, **_stats(ours, lens, max_tokens),
                             **_stats(base, lens, max_tokens, "baseline_")))
    world = 8
    base_ms, base = _once_ms(lambda: karmarkar_karp(workloads(lens), world, equal_count=True))
    ours_ms = timer.median_ms(lambda: packcuda.balance_across_ranks(s, world, equal_count=True))
    ours = packcuda.balance_across_ranks(s, world, equal_count=True)
    rows.append(dict(op="balance_across_ranks(8, equal_count)", shape=shape, packcuda_ms=ours_ms,
                     baseline="Python KK equal_count", baseline_ms=base_ms, speedup=base_ms / ours_ms,
                     **_stats(ours, lens), **_stats(base, lens, prefix="baseline_")))
    return rows


def adversarial(n=16384) -> None:
    """Worst-case length distributions for the planners (count scan, repair, local search, first fit): prints
    one call's wall time each; every planner call should stay well under 1 s on one core."""
    rng = random.Random(0)
    lu = _lengths(n, 1, 32, 32768)
    cases = [
        ("all equal 1000, cap 4096", [1000] * n, 4096, {}),
        ("all > cap/2", [rng.randint(5001, 10000) for _ in range(n)], 10000, {}),
        ("[3]*n, cap 4", [3] * n, 4, {}),
        ("tiny, tight cap", [rng.randint(1, 4) for _ in range(n)], 5, {}),
        ("cap exactly 2x", [4096] * n, 8192, {}),
        ("0.6 / 0.45 cap mix", [600 if i % 2 else 450 for i in range(n)], 1000, {}),
        ("cap/3 + 1", [334] * n, 1000, {}),
        ("logU, min_micro_batches=4n", lu, 65536, {"min_micro_batches": 4 * n}),
        ("logU, multiple_of=1024", lu, 65536, {"multiple_of": 1024}),
        ("logU[16,4096], cap = max", _lengths(n, 2, 16, 4096), 4096, {}),
    ]
    for name, lens, cap, kw in cases:
        s = torch.tensor(lens)
        for method in ["karmarkar_karp", "first_fit_decreasing"]:
            ms, parts = _once_ms(lambda: packcuda.plan_micro_batches(s, cap, method=method, **kw))
            print(f"{name:30s} {method:22s} {ms:9.1f} ms  {len(parts)} micro-batches")
        ms, _ = _once_ms(lambda: packcuda.balance_across_ranks(s, 64))
        print(f"{name:30s} {'balance_across_ranks(64)':22s} {ms:9.1f} ms")


if __name__ == "__main__":
    if "--adversarial" in sys.argv:
        adversarial(512 if "--quick" in sys.argv else 16384)
        sys.exit(0)
    quick = "--quick" in sys.argv
    rows = run(quick=quick)
    record("Micro-batch planning (host): packcuda vs Python Karmarkar-Karp" + (" [quick]" if quick else ""), rows,
           device="cpu", notes="Python baselines are single runs; packcuda times are medians. parts: micro-batches "
           "(or ranks); max_over_mean: largest / mean workload (24576·L + L²); max_tokens_used: largest token sum.",
           write=not quick)
