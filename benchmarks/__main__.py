"""One-command benchmark report: ``python -m benchmarks [--quick] [--device cuda|cpu] [--only NAME ...]``.

Runs every ``benchmarks/bench_*.py`` module's ``run(quick, device)`` with its same-run baselines, prints one
table, writes it to a new run file ``benchmarks/results/<date>-report[-N].md`` and draws two PNG plots into
``--plots`` (default ``benchmarks/plots/``, not committed): ``speedups.png``, packcuda's speedup over each
baseline, and ``x_copy.png``, each row's time over a copy of the same bytes (the bandwidth floor).
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


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return None
    return plt


def _barh(plt, pts, path: Path, title: str, xlabel: str, colors, log: bool) -> None:
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(pts) + 1.5))
    ax.barh(range(len(pts)), [p[1] for p in pts], color=colors)
    ax.set_yticks(range(len(pts)), [p[0] for p in pts], fontsize=7)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and v == v


def plots(rows, directory: Path, title: str) -> None:
    """``speedups.png`` (speedup over each real baseline; rows against the copy floor are fractions of
    bandwidth, not speedups) and ``x_copy.png`` (time over a copy of the same bytes, where a row has it)."""
    plt = _pyplot()
    if plt is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    label = lambda r: f"{r.get('op')} | {r.get('shape', '')}"[:70]  # noqa: E731
    speed = [(f"{label(r)}  (vs {r.get('baseline', '')})", float(r["speedup"])) for r in rows
             if _finite(r.get("speedup")) and "floor" not in str(r.get("baseline", ""))]
    if speed:
        _barh(plt, speed, directory / "speedups.png", title, "speedup of packcuda over the baseline (log scale)",
              ["tab:green" if v >= 1 else "tab:red" for _, v in speed], log=True)
    xcopy = [(label(r), float(r["x_copy"])) for r in rows if _finite(r.get("x_copy"))]
    if xcopy:
        _barh(plt, xcopy, directory / "x_copy.png", title,
              "time over a copy_ of the same bytes (1 = the floor of one read and one write)", "tab:blue", log=False)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--quick", action="store_true", help="small subset, under a minute")
    p.add_argument("--device", default=None)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--plots", default=str(HERE / "plots"), help="folder for the PNG plots (not committed)")
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
    record(title, all_rows, device=dev, columns=cols, write=not a.no_write, bench="report")
    plots(all_rows, Path(a.plots), f"packcuda · {header(dev)}")


if __name__ == "__main__":
    main()
