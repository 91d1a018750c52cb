"""benchmarks/results/ is append-only history: one file per run, never edited or removed. The runs recorded in
the former single log (benchmarks/RESULTS.md) were split into run files once; their totals are recorded here."""
import datetime
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is not installed with the package: load its harness from the checkout
_spec = importlib.util.spec_from_file_location("_bench_harness", ROOT / "benchmarks" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
RESULTS = ROOT / "benchmarks" / "results"
SPLIT_DATE = "2026-12-04"
# totals of benchmarks/RESULTS.md as it was split (3,736 lines: a 6-line preamble, now the top of README.md, and
# 67 runs); a table row is a line starting with "|" that is not a separator line ("|---")
SPLIT_RUNS, SPLIT_LINES, SPLIT_TABLE_ROWS = 67, 3736, 3033
PREAMBLE_LINES = 6
INDEX_ROW = re.compile(r"^\| (\d+)–(\d+) \| \[([^]]+)\]\(\3\) \|")


def _split_index():
    """(first line, last line, file name) of every run of the split, from the table in results/README.md."""
    rows = [INDEX_ROW.match(line) for line in (RESULTS / "README.md").read_text().splitlines()]
    return [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in rows if m]


def _table_rows(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith("|") and not line.startswith("|---"))


def test_split_totals_agree_with_the_former_log():
    index = _split_index()
    assert len(index) == SPLIT_RUNS
    texts = [(RESULTS / name).read_text() for _, _, name in index]
    expect_first = PREAMBLE_LINES + 1
    for (first, last, name), text in zip(index, texts):
        assert first == expect_first, f"{name}: the index's line ranges must follow each other"
        assert last - first + 1 == text.count("\n"), f"{name}: line count differs from its range in the index"
        expect_first = last + 1
    assert PREAMBLE_LINES + sum(t.count("\n") for t in texts) == SPLIT_LINES
    assert sum(_table_rows(t) for t in texts) == SPLIT_TABLE_ROWS
    assert sum(t.startswith("### ") and t.count("\n### ") == 0 for t in texts) == SPLIT_RUNS  # one run per file


def test_run_files_are_named_by_date_and_bench():
    split = {name for _, _, name in _split_index()}
    for path in RESULTS.iterdir():
        if path.name == "README.md":
            continue
        m = harness.RUN_NAME.match(path.name)
        assert m, f"{path.name}: not a run file name (<date>-<bench>[-N].md)"
        datetime.date.fromisoformat(m.group(1))
        text = path.read_text()
        assert text.startswith("### "), f"{path.name}: a run file starts with its report title"
        if path.name not in split:  # written by the harness after the split
            assert m.group(1) >= SPLIT_DATE and f"\ndate {m.group(1)} " in text, path.name


def test_run_files_are_only_ever_added():
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run([git, "log", "--no-renames", "--diff-filter=MD", "--name-only", "--format=", "--",
                          "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    changed = sorted({line for line in out.splitlines() if line and not line.endswith("/README.md")})
    assert not changed, f"committed run files were modified or removed: {changed}"


def test_write_run_never_overwrites(tmp_path):
    first = harness.write_run("### a\n", "conv", date="2026-12-05", directory=tmp_path)
    second = harness.write_run("### b\n", "conv", date="2026-12-05", directory=tmp_path)
    assert (first.name, second.name) == ("2026-12-05-conv.md", "2026-12-05-conv-2.md")
    assert first.read_text() == "### a\n" and second.read_text() == "### b\n"
    with pytest.raises(ValueError, match="bench"):
        harness.write_run("### c\n", "Conv Bench", directory=tmp_path)
