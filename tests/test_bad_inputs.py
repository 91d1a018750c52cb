"""Runs the bad-input catalogue (tests/catalogue.py, cases in tests/catalogue_*.py) and checks its coverage."""
import pytest
import torch

import catalogue
import catalogue_devices
from helpers import HAS_CUDA

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


def test_every_raw_op_with_a_tensor_argument_has_device_cases():
    def has_tensor(op):
        return any("Tensor" in str(a.type) for a in getattr(torch.ops.packcuda, op).default._schema.arguments)

    missing = [op for op in catalogue.raw_ops() if has_tensor(op) and op not in catalogue_devices.BASELINES]
    assert not missing, f"raw ops with tensor arguments but no baseline in catalogue_devices.BASELINES: {missing}"


@pytest.mark.parametrize("op", [op for op, b in catalogue_devices.BASELINES.items() if b.runs])
def test_device_baseline_runs(op):
    """The device cases change only devices of a call that is otherwise valid: the baseline itself runs."""
    getattr(torch.ops.packcuda, op)(**catalogue_devices.BASELINES[op].make())


def test_every_public_function_is_in_the_device_table():
    known = set(catalogue_devices.PUBLIC) | catalogue_devices.NO_TENSOR_ARGUMENT
    missing = [t for t in catalogue.public_targets() if t not in known]
    assert not missing, f"public functions in neither catalogue_devices.PUBLIC nor NO_TENSOR_ARGUMENT: {missing}"


@pytest.mark.parametrize("target", sorted(catalogue_devices.PUBLIC))
def test_public_device_baseline_runs(target):
    fn, args, kwargs = catalogue_devices.PUBLIC[target]()
    fn(*args, **kwargs)


@pytest.mark.parametrize("target,path", catalogue_devices.public_variants(),
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_public_meta_argument_refused_or_meta_result(target, path):
    """One tensor argument on meta, the rest on the CPU: refused naming packcuda and meta, or a result wholly on
    meta (the argument was the data, the rest host metadata) - never CPU tensors computed from a meta input."""
    fn, args, kwargs = catalogue_devices.public_variant(target, path)
    try:
        out = fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        assert "packcuda" in str(e) and "meta" in str(e), f"{target} {path}: {type(e).__name__}: {e}"
        return
    leaked = [t for t in catalogue._tensors(out, []) if t.device.type != "meta"]
    assert not leaked, f"{target} {path}: accepted a meta input and returned {len(leaked)} non-meta tensors"
