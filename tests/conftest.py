import contextlib
import os

import pytest
import torch

import packcuda

HAS_CUDA = torch.cuda.is_available() and packcuda.built_with_cuda()

# Under pytest-xdist every worker would start as many CPU threads as there are cores (the reference computations
# then oversubscribe the machine): share the cores between the workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

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


def _gpu_test(skip):
    """A decorator: the test is gpu-marked (``-m gpu`` selects it) and skipped under ``skip``."""
    def mark(test):
        return pytest.mark.gpu(skip(test))
    return mark


requires_cuda = _gpu_test(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda"))
requires_two_gpus_nccl = _gpu_test(pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="needs 2 CUDA devices, NCCL and a CUDA build of packcuda"))


def spawn_ranks(worker, world: int, tmp_path) -> dict:
    """Runs worker(rank, world, init_method, results) in `world` spawned processes (a file:// rendezvous under
    tmp_path); returns what the ranks put into `results` (a shared dict)."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(worker, args=(world, f"file://{tmp_path}/init", results), nprocs=world, join=True)
    return dict(results)


@contextlib.contextmanager
def nccl_rank(rank: int, world: int, init: str):
    """In a rank spawned by spawn_ranks: its GPU as the current device and an NCCL process group (destroyed on
    exit); yields the rank's device."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world)
    try:
        yield torch.device("cuda", rank)
    finally:
        dist.destroy_process_group()


def capture_cuda_graph(fn, warmup: int = 1):
    """fn() captured into a CUDA graph after `warmup` calls on a side stream (allocations, caches and lazy
    set-up stay out of the capture): (graph, fn's outputs in the capture), to be read after graph.replay()."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


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



def _hf_int_seconds() -> bool:
    try:
        from packcuda.integrations.transformers import truncates_video_seconds

        return truncates_video_seconds()
    except Exception:
        return False


# Older transformers releases drop fractional video seconds (Qwen2.5-VL); oracle tests then use whole seconds.
HF_INT_SECONDS = _hf_int_seconds()
