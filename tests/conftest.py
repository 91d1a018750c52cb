import os

import pytest
import torch

from helpers import HAS_CUDA

# Under pytest-xdist every worker would start as many CPU threads as there are cores (the reference computations
# then oversubscribe the machine): share the cores between the workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# A kernel fault (an illegal address, a hardware exception a sanitizer met) leaves the process's CUDA context
# unusable: every later test of the process would fail on it. Under pytest-xdist the worker ends once the faulting
# test is reported, and xdist starts a fresh one for the tests left: the failure stays on the test that met it.
CONTEXT_LOST = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
                "hardware stack error", "device-side assert", "launch timed out", "uncorrectable ECC",
                "CUDA error: unknown error")
_context_lost = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and call.excinfo is not None and any(s in str(call.excinfo.value) for s in CONTEXT_LOST):
        item.config.stash[_context_lost] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and item.config.stash.get(_context_lost, None):
        print(f"\nCUDA context lost in {item.config.stash[_context_lost]}: this worker ends", flush=True)
        os._exit(3)
    # Under compute-sanitizer (.ci/gpu sanitize) many workers share one GPU and the sanitizer pads every
    # allocation: memory one test cached must not be what the next worker's test runs out of
    if os.environ.get("PACKCUDA_SANITIZE") and torch.cuda.is_initialized():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a context broken in a way CONTEXT_LOST does not name: the next test reports it
            pass


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist the tests that start processes of their own go first: they are the slowest to start (most
    # of all under a sanitizer, which follows every child process), and one handed out last holds up the whole run
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("spawns") is None)


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            [pytest.param(d, marks=[pytest.mark.gpu] if d == "cuda" else []) for d in ["cpu", "cuda"]],
        )


@pytest.fixture(autouse=True)
def _skip_missing_cuda(request):
    if "device" in request.fixturenames and request.getfixturevalue("device") == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device and a CUDA build of packcuda")
