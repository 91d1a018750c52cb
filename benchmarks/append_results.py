"""Appends the reports of one benchmark run (a file written through ``PACKCUDA_RESULTS_RUN``, e.g. brought back
from a GPU machine) to benchmarks/RESULTS.md. RESULTS.md is append-only history: this never rewrites it, and
it refuses a file that is a whole RESULTS.md (a copy of the history) rather than one run's reports.

    python -m benchmarks.append_results path/to/results-run.md
"""
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    text = Path(argv[0]).read_text()
    if text.lstrip().startswith("# Benchmark results"):
        print("append_results: that file is a whole RESULTS.md, not one run's reports; refusing", file=sys.stderr)
        return 1
    if not text.strip():
        print("append_results: no reports in that file", file=sys.stderr)
        return 1
    with open(RESULTS, "a") as f:
        f.write(text if text.startswith("\n") else "\n" + text)
    print(f"append_results: appended {text.count('### ')} report(s) to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
