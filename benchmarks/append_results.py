"""Adds run files written elsewhere (``PACKCUDA_RESULTS_DIR`` on a GPU machine, brought back here) to
benchmarks/results/. Each file keeps its date and bench and gets the first free ``-N`` here; nothing in
benchmarks/results/ is overwritten or edited.

    python -m benchmarks.append_results gpu-out/results/*.md
"""
import sys
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, RUN_NAME, write_run


def main(argv) -> int:
    if not argv:
        print(__doc__)
        return 2
    runs = []
    for name in argv:
        path = Path(name)
        m = RUN_NAME.match(path.name)
        if m is None:
            print(f"append_results: {path} is not a run file (<date>-<bench>[-N].md); refusing", file=sys.stderr)
            return 1
        text = path.read_text()
        if not text.startswith("### "):
            print(f"append_results: {path} does not start with a report title ('### '); refusing", file=sys.stderr)
            return 1
        runs.append((m.group(1), m.group(2), int(m.group(3) or 1), text))
    for date, bench, _, text in sorted(runs, key=lambda r: r[:3]):  # a machine's runs of one day keep their order
        write_run(text, bench, date=date, directory=RESULTS_DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
