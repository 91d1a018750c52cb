import os

import pytest
import torch

import packcuda

HAS_CUDA = torch.cuda.is_available() and packcuda.built_with_cuda()

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


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


requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")


class no_sync:
    """Context manager: any device synchronization inside raises (torch sync debug mode 'error')."""

    def __enter__(self):
        torch.cuda.synchronize()
        self._prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._prev)
        return False


def hf_truncates_video_seconds() -> bool:
    """Older transformers 5.x releases (e.g. 5.17) computed Qwen2.5-VL's video time interval as
    ``tokens_per_second * int(second_per_grid_ts)``, dropping fractional seconds; later releases use the float
    product, which is the rule packcuda implements. Oracle tests use whole seconds on the older releases."""
    try:
        import inspect

        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

        return "int(next(second_per_grid_ts))" in inspect.getsource(m.Qwen2_5_VLModel.get_rope_index)
    except Exception:
        return False


HF_INT_SECONDS = hf_truncates_video_seconds()
