"""One-command benchmark report: ``python -m benchmarks [--quick] [--device cuda|cpu] [--only NAME ...]``.

Runs every ``benchmarks/bench_*.py`` module's ``run(quick, device)`` with its same-run baselines, prints one
table, appends it to RESULTS.md and writes a PNG chart of the speedups (``benchmarks/speedups.png``).
Multi-GPU benchmarks (those that define ``NEEDS_WORLD``) are run separately with torchrun.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import time
import traceback
from pathlib import Path

import torch

from benchmarks.harness import header, record

HERE = Path(__file__).resolve().parent


def discover():
    return sorted(m.name for m in pkgutil.iter_modules([str(HERE)]) if m.name.startswith("bench_"))


def chart(rows, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return False
    # speedups over real baselines only: rows against the copy floor are fractions of bandwidth, not speedups
    pts = [(f"{r.get('op')} | {r.get('shape', '')}"[:70], float(r["speedup"]), r.get("baseline", ""))
           for r in rows if isinstance(r.get("speedup"), (int, float)) and r["speedup"] == r["speedup"]
           and "floor" not in str(r.get("baseline", ""))]
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(pts) + 1.5))
    labels = [f"{p[0]}  (vs {p[2]})" for p in pts]
    vals = [p[1] for p in pts]
    ax.barh(range(len(pts)), vals, color=["tab:green" if v >= 1 else "tab:red" for v in vals])
    ax.set_yticks(range(len(pts)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speedup of packcuda over the baseline (log scale)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--quick", action="store_true", help="small subset, under a minute")
    p.add_argument("--device", default=None)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--chart", default=str(HERE / "speedups.png"))
    a = p.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_rows = []
    for name in discover():
        if a.only and not any(o in name for o in a.only):
            continue
        mod = importlib.import_module(f"benchmarks.{name}")
        if getattr(mod, "NEEDS_WORLD", 0) > 1:
            print(f"{name}: multi-GPU, run with torchrun (see its docstring)")
            continue
        t0 = time.time()
        try:
            rows = mod.run(quick=a.quick, device=dev)
        except Exception:  # keep the report going; the failure is printed
            traceback.print_exc()
            rows = [dict(op=name, shape="FAILED")]
        for r in rows:
            r.setdefault("bench", name.replace("bench_", ""))
        all_rows.extend(rows)
        print(f"{name}: {len(rows)} rows in {time.time() - t0:.1f} s", flush=True)
    cols = ["bench", "op", "shape", "packcuda_ms", "baseline", "baseline_ms", "speedup", "pct_copy_bw"]
    extra = [k for r in all_rows for k in r if k not in cols]
    cols += list(dict.fromkeys(extra))
    title = "report" + (" (quick)" if a.quick else "")
    record(title, all_rows, device=dev, columns=cols, write=not a.no_write)
    chart(all_rows, Path(a.chart), f"packcuda speedups · {header(dev)}")


if __name__ == "__main__":
    main()
