"""Runs the bad-input catalogue (tests/catalogue.py, cases in tests/catalogue_*.py) and checks its coverage."""
import pytest

import catalogue
from conftest import HAS_CUDA

CASES = catalogue.all_cases()


@pytest.mark.parametrize("module,case", [
    pytest.param(m, c, marks=[pytest.mark.gpu] if c.cuda else [], id=f"{c.target}-{c.name}") for m, c in CASES])
def test_refused_cleanly(module, case):
    if case.cuda and not HAS_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of packcuda")
    if case.risky:
        catalogue.run_in_child(module, case)
    else:
        catalogue.run_case(case)


def test_case_names_unique():
    seen = set()
    for module, c in CASES:
        key = (module, c.target, c.name)
        assert key not in seen, f"duplicate case name {key}"
        seen.add(key)


def test_every_raw_op_has_a_case():
    covered = {c.target.split(".", 1)[1] for _, c in CASES if c.target.startswith("ops.")}
    missing = [op for op in catalogue.raw_ops() if op not in covered and op not in catalogue.NO_ARGUMENT_OPS]
    assert not missing, f"raw ops without a bad-input case: {missing}"


def test_every_public_function_has_a_case():
    covered = {c.target for _, c in CASES}
    missing = [t for t in catalogue.public_targets() if t not in covered]
    assert not missing, f"public functions without a bad-input case: {missing}"
