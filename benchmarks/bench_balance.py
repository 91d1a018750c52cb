"""Micro-batch planning (host work): packcuda's C++ planner vs the plain Python Karmarkar-Karp reference.

8192 sequences with lengths log-uniform in [32, 32768], max_tokens 64k, attention workload 24576·L + L².
Baselines, measured in the same run:
  - Python KK, one pass at the start count (what a pure-Python KK costs; it ignores the cap),
  - Python KK + retry: partition again with one more micro-batch until every micro-batch fits the cap.
Reported: wall time, micro-batch count, the largest token sum, and max/mean micro-batch workload.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import packcuda  # noqa: E402
import reference as ref  # noqa: E402
from benchmarks.harness import Timer, record  # noqa: E402


def _lengths(n, seed=0, lo=32, hi=32768):
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def _stats(parts, lens, max_tokens):
    w = ref.workloads(lens)
    loads = [sum(w[i] for i in p) for p in parts]
    toks = [sum(lens[i] for i in p) for p in parts]
    return dict(micro_batches=len(parts), max_tokens_used=max(toks), cap_ok=max(toks) <= max_tokens,
                max_over_mean=f"{max(loads) / (sum(loads) / len(loads)):.4f}")


def _once_ms(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def run(quick=False, device=None) -> list[dict]:
    device = torch.device("cpu")  # planning is host work
    n = 512 if quick else 8192
    max_tokens = 65536
    lens = _lengths(n)
    timer = Timer(device, warmup=1 if quick else 2, reps=3 if quick else 10)
    shape = f"n={n}, L~logU[32,32768], cap={max_tokens}"
    rows = []

    ref_ms, ref_parts = _once_ms(lambda: ref.karmarkar_karp(ref.workloads(lens), -(-sum(lens) // max_tokens)))
    rows.append(dict(planner="Python KK, one pass (no cap)", shape=shape, ms=ref_ms,
                     **_stats(ref_parts, lens, max_tokens), speedup_vs_py_kk=1.0))
    retry_ms, retry_parts = _once_ms(lambda: ref.plan_micro_batches(lens, max_tokens))
    rows.append(dict(planner="Python KK + retry until capped", shape=shape, ms=retry_ms,
                     **_stats(retry_parts, lens, max_tokens), speedup_vs_py_kk=ref_ms / retry_ms))
    s = torch.tensor(lens)
    for method in ["karmarkar_karp", "first_fit_decreasing"]:
        ms = timer.median_ms(lambda: packcuda.plan_micro_batches(s, max_tokens, method=method))
        parts = packcuda.plan_micro_batches(s, max_tokens, method=method)
        rows.append(dict(planner=f"packcuda plan_micro_batches ({method})", shape=shape, ms=ms,
                         **_stats(parts, lens, max_tokens), speedup_vs_py_kk=ref_ms / ms))
    world = 8
    rk_ref_ms, rk_ref = _once_ms(lambda: ref.karmarkar_karp(ref.workloads(lens), world, equal_count=True))
    rk_ms = timer.median_ms(lambda: packcuda.balance_across_ranks(s, world, equal_count=True))
    rk = packcuda.balance_across_ranks(s, world, equal_count=True)
    for name, parts, ms in [("Python KK equal_count, 8 ranks", rk_ref, rk_ref_ms),
                            ("packcuda balance_across_ranks(8, equal_count)", rk, rk_ms)]:
        w = ref.workloads(lens)
        loads = [sum(w[i] for i in p) for p in parts]
        rows.append(dict(planner=name, shape=shape, ms=ms, micro_batches=world,
                         max_over_mean=f"{max(loads) / (sum(loads) / len(loads)):.4f}", speedup_vs_py_kk=rk_ref_ms / ms))
    return rows


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    rows = run(quick=quick)
    record("Micro-batch planning (host): packcuda vs Python Karmarkar-Karp" + (" [quick]" if quick else ""), rows,
           device="cpu", notes="Python rows are single runs; packcuda rows are medians. speedup_vs_py_kk: vs the "
           "Python one-pass KK of the same row group (micro-batches: the no-cap pass at the start count; ranks: "
           "the equal_count pass).", write=not quick)
