"""The build's CUDA architectures (no GPU needed).

The architecture list goes through cmake/packcudaCudaArchs.cmake, the one place the build reads it, and is
compared with the nvcc flags that torch derives from the same TORCH_CUDA_ARCH_LIST (torch.utils.cpp_extension,
whose syntax it takes).
"""
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
ARCHS_CMAKE = ROOT / "cmake" / "packcudaCudaArchs.cmake"
CMAKE = shutil.which("cmake")

needs_cmake = pytest.mark.skipif(CMAKE is None or not ARCHS_CMAKE.exists(), reason="needs cmake and the source tree")


def cmake_archs(arch_list: str) -> subprocess.CompletedProcess:
    return subprocess.run([CMAKE, f"-DTORCH_CUDA_ARCH_LIST={arch_list}", "-P", str(ARCHS_CMAKE)],
                          capture_output=True, text=True, timeout=60)


def derived(arch_list: str) -> tuple[str, str]:
    """(CMAKE_CUDA_ARCHITECTURES, the list with names expanded) as the build derives them."""
    r = cmake_archs(arch_list)
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return out["CMAKE_CUDA_ARCHITECTURES"], out["TORCH_CUDA_ARCH_LIST"]


def gencode(cmake_archs: str) -> set[str]:
    """nvcc's -gencode flags for CMAKE_CUDA_ARCHITECTURES: "90-real" is machine code, "90" machine code and PTX."""
    flags = set()
    for a in cmake_archs.split(";"):
        num = a.removesuffix("-real")
        flags.add(f"-gencode=arch=compute_{num},code=sm_{num}")
        if not a.endswith("-real"):
            flags.add(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def torch_gencode(arch_list: str, monkeypatch) -> set[str]:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    return set(cpp_extension._get_cuda_arch_flags())


@needs_cmake
@pytest.mark.parametrize("arch_list", [
    "9.0", "8.0;8.6;8.9;9.0+PTX", "8.0 9.0+PTX", "7.5;8.0+PTX", "9.0a", "9.0;10.0a;12.0+PTX", "8.0;8.0;9.0",
    "Ampere;Hopper", "Ada", "Blackwell", "Turing;Ampere;Ada;Hopper", "Ampere+Tegra;9.0",
])
def test_arch_list_read_as_torch_reads_it(arch_list, monkeypatch):
    archs, expanded = derived(arch_list)
    assert gencode(archs) == torch_gencode(arch_list, monkeypatch)
    assert derived(expanded)[0] == archs  # the expanded form (which the library reports) means the same


@needs_cmake
def test_default_arch_list(monkeypatch):
    """By default: machine code for Ampere (8.0, 8.6), Ada (8.9) and Hopper (9.0), and PTX of 9.0 that the driver
    compiles for newer GPUs."""
    archs, expanded = derived("")
    assert expanded == "8.0;8.6;8.9;9.0+PTX"
    assert gencode(archs) == torch_gencode(expanded, monkeypatch)


@needs_cmake
@pytest.mark.parametrize("arch_list", ["sm_90", "9", "90", "9.0+ptx", "Hoppper", ";"])
def test_bad_arch_list_refused(arch_list):
    r = cmake_archs(arch_list)
    assert r.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST" in r.stderr
    if arch_list != ";":
        assert f"'{arch_list}'" in r.stderr
