import os

import pytest
import torch

from helpers import HAS_CUDA

# Under pytest-xdist every worker would start as many CPU threads as there are cores (the reference computations
# then oversubscribe the machine): share the cores between the workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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
