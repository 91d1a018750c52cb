"""Helpers shared by the test modules (``from helpers import ...``): device availability and GPU marks, spawned
ranks, CUDA graphs, sync checks, the installed transformers' video-seconds rule, and small numerics. Spawned
workers and tests run as scripts import it by name as well; conftest.py holds pytest's hooks and fixtures."""
import contextlib
import zlib

import pytest
import torch

import packcuda

HAS_CUDA = torch.cuda.is_available() and packcuda.built_with_cuda()


def _gpu_test(skip):
    """A decorator: the test is gpu-marked (``-m gpu`` selects it) and skipped under ``skip``."""
    def mark(test):
        return pytest.mark.gpu(skip(test))
    return mark


requires_cuda = _gpu_test(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda"))
requires_two_gpus_nccl = _gpu_test(pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="needs 2 CUDA devices, NCCL and a CUDA build of packcuda"))


def _spawned_rank(rank: int, worker, args) -> None:
    """One spawned process: worker(rank, *args), then an exit without the interpreter's teardown, where a
    background thread of torch's process groups can abort a process whose checks all passed ("terminate called
    without an active exception"). An exception still ends the process through torch's spawn wrapper, which
    hands its traceback to the test."""
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, args: tuple, nprocs: int) -> None:
    """Runs worker(rank, *args) in `nprocs` spawned processes (spawn, not fork: a forked worker cannot run
    backward once an earlier test in this process started autograd's worker threads) and waits for them."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned_rank, args=(worker, args), nprocs=nprocs, join=True, start_method="spawn")


def spawn_ranks(worker, world: int, tmp_path) -> dict:
    """Runs worker(rank, world, init_method, results) in `world` spawned processes (a file:// rendezvous under
    tmp_path); returns what the ranks put into `results` (a shared dict)."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Manager().dict()
    spawn(worker, (world, f"file://{tmp_path}/init", results), world)
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


# ------------------------------------------------------------------------------------ numerics
def keyed_generator(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (the CRC-32 of its repr): every test case draws its own stream."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def cumulative(lens) -> list:
    """cu_seqlens of segment lengths: [0, l0, l0 + l1, ...]."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


# (mantissa bits, smallest normal exponent) of each float dtype
MANT = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126), torch.float64: (52, -1022)}


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """One unit in the last place of dtype at |x| (x float64)."""
    mant, emin = MANT[dtype]
    _, e = torch.frexp(x.abs())
    e = torch.clamp(e.to(torch.float64) - 1, min=emin)
    return torch.pow(2.0, e - mant)


def assert_close_ulp(got: torch.Tensor, want64: torch.Tensor, dtype, scale: float, ulps: float = 1.0):
    """|got - want| <= ulps * ulp(want) + (fp32-level slack for cancellation near zero)."""
    err = (got.double().cpu() - want64).abs()
    tol = ulps * ulp(want64, dtype) + 4e-7 * scale
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} elements off by more than {ulps} ulp; worst {float((err - tol).max())}"
