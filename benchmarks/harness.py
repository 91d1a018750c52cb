"""Benchmark harness: CUDA-event timing (median of many runs after warm-up, inputs rotated so they exceed
L2), same-run baselines, a printed table, and one new file per run in benchmarks/results/.

Usage in a benchmark module ``benchmarks/bench_<name>.py``::

    from benchmarks.harness import Timer, record
    def run(quick=False, device=None) -> list[dict]:
        t = Timer(device)
        ours = t.median_ms(lambda: op(x))
        base = t.median_ms(lambda: baseline(x))
        rows = [dict(op="unpad", shape="...", packcuda_ms=ours, baseline="nonzero+index_select",
                     baseline_ms=base, speedup=base / ours, pct_copy_bw=...)]
        return rows

``record(title, rows)`` prints the table and writes it (with date, device, torch version) to a new run file
``benchmarks/results/<date>-<bench>[-N].md`` (``<bench>``: the module's name without ``bench_``; ``-N`` for the
N-th run of that benchmark on that date). A run file is never edited or removed: the history is append-only by
construction. ``PACKCUDA_RESULTS_DIR`` writes the run files elsewhere (a GPU machine writes them into its
output folder; ``python -m benchmarks.append_results FILE...`` adds them here).
"""
from __future__ import annotations

import datetime as _dt
import inspect
import os
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# a run file's name: <date>-<bench>[-N].md
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9_]+?)(?:-(\d+))?\.md$")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


class Timer:
    """Median wall time of a callable, in milliseconds. CUDA: events around each call; CPU: perf_counter."""

    def __init__(self, device=None, warmup: int = 5, reps: int = 50, min_time_s: float = 0.0):
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.warmup, self.reps, self.min_time_s = warmup, reps, min_time_s

    def median_ms(self, fn: Callable[[], object], reps: Optional[int] = None, warmup: Optional[int] = None) -> float:
        reps = reps or self.reps
        for _ in range(warmup if warmup is not None else self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            for i in range(reps):
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


HOST_CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def host_us(fn: Callable[[], object], device, inner: int = 20, runs: int = 10, warmup: int = 5,
            clock: str = "wall") -> float:
    """Host time of one call of ``fn`` in microseconds, with the GPU running ahead: the median over ``runs`` of
    ``inner`` back-to-back calls (the device is synchronized before each run, outside the timing).
    ``clock="thread"`` counts this thread's CPU time instead of wall time: on a shared machine it leaves out the
    time the thread waits for a core (CPU tensors only: with a GPU, waiting for the device is host time too)."""
    device = torch.device(device)
    now = HOST_CLOCKS[clock]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        sync()
        t0 = now()
        for _ in range(inner):
            fn()
        times.append((now() - t0) / inner * 1e6)
    sync()
    return statistics.median(times)


def host_us_in_turns(cases: Dict[object, Callable[[], object]], device, rounds: int = 5, **kw) -> Dict:
    """:func:`host_us` of every case, measured in turns (``rounds`` times each, so that a drift of the machine
    hits every case alike); the median per case."""
    got: Dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            got[name].append(host_us(fn, device, **kw))
    return {name: statistics.median(v) for name, v in got.items()}


def rotating(make: Callable[[int], object], bytes_per_set: int, min_total_bytes: int = 3 * 60 * 2**20,
             max_sets: int = 8):
    """Enough input sets that cycling through them defeats the L2 cache (H200: 60 MB L2)."""
    n = max(1, min(max_sets, -(-min_total_bytes // max(1, bytes_per_set))))
    sets = [make(i) for i in range(n)]
    state = {"i": 0}

    def next_set():
        s = sets[state["i"] % n]
        state["i"] += 1
        return s

    return next_set


def copy_floor_ms(timer: Timer, nbytes_read: int, nbytes_written: int) -> float:
    """Time of a plain device copy moving the same bytes (read + write), the bandwidth floor."""
    dev = timer.device
    n = max(nbytes_read, nbytes_written)
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    if nbytes_read == nbytes_written:
        return timer.median_ms(lambda: dst.copy_(src))
    # unequal read/write: copy the larger half-size scaled (reads+writes total), approximated by a copy of
    # (read + write) / 2 bytes
    m = (nbytes_read + nbytes_written) // 2
    return timer.median_ms(lambda: dst[:m].copy_(src[:m]))


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        if abs(v) >= 100:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}"
    return str(v)


def table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> str:
    if not rows:
        return "(no rows)\n"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    out = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    for r in rows:
        out += "| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |\n"
    return out


def header(device) -> str:
    device = torch.device(device)
    return (f"date {_dt.date.today().isoformat()} · {device_name(device)} · torch {torch.__version__}"
            + (f" · CUDA {torch.version.cuda}" if device.type == "cuda" else ""))


def record(title: str, rows: Sequence[dict], device=None, notes: str = "", columns=None,
           write: bool = True, bench: Optional[str] = None) -> str:
    """Prints one report and, with ``write`` (and ``PACKCUDA_BENCH_NO_WRITE`` unset), writes it to a new run
    file (:func:`write_run`). ``bench`` defaults to the calling module's file name without ``bench_``."""
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    text = f"### {title}\n\n{header(device)}\n\n{table(rows, columns)}"
    if notes:
        text += f"\n{notes}\n"
    print("\n" + text, flush=True)
    if write and os.environ.get("PACKCUDA_BENCH_NO_WRITE") != "1":
        write_run(text, bench or bench_name(inspect.currentframe().f_back.f_code.co_filename))
    return text


def bench_name(source_file: str) -> str:
    """The ``<bench>`` of a benchmark module's run files: its file name without ``bench_`` and ``.py``."""
    stem = Path(source_file).stem
    return stem[len("bench_"):] if stem.startswith("bench_") else stem


def results_dir() -> Path:
    """Where run files go: ``PACKCUDA_RESULTS_DIR`` if set, else benchmarks/results."""
    return Path(os.environ.get("PACKCUDA_RESULTS_DIR") or RESULTS_DIR)


def write_run(text: str, bench: str, date: Optional[str] = None, directory: Optional[Path] = None) -> Path:
    """Writes ``text`` to a new file ``<date>-<bench>[-N].md`` (the first free N; the first run of a day has no
    ``-N``) and returns its path. The file is created exclusively: an existing run file is never overwritten."""
    if not re.fullmatch(r"[a-z0-9_]+", bench):
        raise ValueError(f"write_run: bench must be lower-case letters, digits and '_', got {bench!r}")
    date = date or _dt.date.today().isoformat()
    directory = Path(directory) if directory is not None else results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = directory / (f"{date}-{bench}" + (f"-{n}" if n > 1 else "") + ".md")
        try:
            with open(path, "x") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except FileExistsError:
            n += 1
            continue
        print(f"results: {path}", flush=True)
        return path


def cli(run, title: str, notes: str = "") -> None:
    """Command line of one benchmark module: ``[--quick] [--device D] [--no-write]``, then ``record``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    record(title, run(a.quick, a.device), device=a.device, write=not a.no_write, notes=notes,
           bench=bench_name(inspect.getsourcefile(run)))


def graph_ms(timer: Timer, fn: Callable[[], object], calls: int = 20) -> float:
    """Device time of one call of ``fn`` (CUDA only): ``calls`` back-to-back calls captured into one CUDA graph
    (after a warm-up on a side stream), replays timed with CUDA events, divided by ``calls``. Host overhead
    drops out, so this is kernel time (plus the launch gaps inside the graph). ``fn`` must be capturable: no
    host syncs, no host-to-device copies of new host data."""
    if timer.device.type != "cuda":
        raise ValueError("graph_ms needs a CUDA device")
    side = torch.cuda.Stream(timer.device)
    side.wait_stream(torch.cuda.current_stream(timer.device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(timer.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for _ in range(calls)]
    ms = timer.median_ms(graph.replay) / calls
    del outs, graph
    return ms


def graph_copy_floor_ms(timer: Timer, nbytes: int, calls: int = 20) -> float:
    """:func:`graph_ms` of a plain device copy of ``nbytes`` bytes (read + write), the kernel-time floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    return graph_ms(timer, lambda: dst.copy_(src), calls)
