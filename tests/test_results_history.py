"""benchmarks/RESULTS.md is append-only history: the recorded part must stay as it was (new runs append)."""
import hashlib
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"
# the first RECORDED_LINES lines of RESULTS.md as recorded; raise RECORDED_LINES (and the digest) only by
# appending, never by editing what is above it
RECORDED_LINES = 715
DIGEST = "453c71c458afd6846a552c83c740eae5ea3058c9c461c64aed6d3230985c67f0"


def test_results_history_is_append_only():
    lines = RESULTS.read_text().splitlines(keepends=True)
    assert len(lines) >= RECORDED_LINES, "RESULTS.md lost history"
    got = hashlib.sha256("".join(lines[:RECORDED_LINES]).encode()).hexdigest()
    assert got == DIGEST, "the recorded part of RESULTS.md changed: history is append-only"
