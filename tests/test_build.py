"""The build's CUDA architectures and the refusal of a GPU the build has no code for (no GPU needed).

The architecture list goes through cmake/packcudaCudaArchs.cmake, the one place the build reads it, and is
compared with the nvcc flags that torch derives from the same TORCH_CUDA_ARCH_LIST (torch.utils.cpp_extension,
whose syntax it takes). The refusal message comes from the core (csrc/common/build_info.cpp), compiled here
into a small program.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
ARCHS_CMAKE = ROOT / "cmake" / "packcudaCudaArchs.cmake"
CMAKE = shutil.which("cmake")
CXX = shutil.which(os.environ.get("CXX", "c++"))

needs_cmake = pytest.mark.skipif(CMAKE is None or not ARCHS_CMAKE.exists(), reason="needs cmake and the source tree")
needs_cxx = pytest.mark.skipif(CXX is None or not (ROOT / "csrc").exists(), reason="needs a C++ compiler and csrc/")


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


@pytest.fixture(scope="module")
def refusal(tmp_path_factory):
    """Runs the core's device_refusal_message for (device, name, major, minor, error) in a build whose
    TORCH_CUDA_ARCH_LIST is "8.0;8.6;8.9;9.0+PTX"."""
    d = tmp_path_factory.mktemp("refusal")
    (d / "main.cpp").write_text(
        '#include <cstdio>\n#include <cstdlib>\n#include "common/build_info.h"\n'
        "int main(int, char** v) {\n"
        "  packcuda::DeviceRefusal r{std::atoi(v[1]), v[2], std::atoi(v[3]), std::atoi(v[4]), v[5],\n"
        "                            packcuda::cuda_arch_list()};\n"
        "  std::fputs(packcuda::device_refusal_message(r).c_str(), stdout);\n}\n")
    exe = d / "refusal"
    subprocess.run([CXX, "-std=c++17", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}",
                    '-DPACKCUDA_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"', str(d / "main.cpp"),
                    str(ROOT / "csrc" / "common" / "build_info.cpp"), "-o", str(exe)], check=True, timeout=300)

    def run(device, name, major, minor, error):
        return subprocess.run([str(exe), str(device), name, str(major), str(minor), error], capture_output=True,
                              text=True, check=True).stdout
    return run


@needs_cxx
@pytest.mark.parametrize("error", ["cudaErrorNoKernelImageForDevice", "cudaErrorInvalidDeviceFunction"])
def test_refusal_names_device_build_and_rebuild(refusal, error):
    msg = refusal(1, "Tesla T4", 7, 5, error)
    assert msg.startswith("packcuda: CUDA device 1 (Tesla T4, compute capability 7.5) cannot run this build")
    assert 'TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX"' in msg and error in msg
    rebuild = re.findall(r'TORCH_CUDA_ARCH_LIST="([^"]*)" pip install', msg)
    assert rebuild == ["7.5", "7.5"]
    if CMAKE is not None and ARCHS_CMAKE.exists():  # the list it tells the user to build with is one the build takes
        assert derived(rebuild[0])[0] == "75-real"


@needs_cxx
def test_refusal_of_ptx_newer_than_the_driver(refusal):
    msg = refusal(0, "NVIDIA B200", 10, 0, "cudaErrorUnsupportedPtxVersion")
    assert "compute capability 10.0" in msg and "driver" in msg and "cudaErrorUnsupportedPtxVersion" in msg
    assert 'TORCH_CUDA_ARCH_LIST="10.0" pip install' in msg


@needs_cxx
def test_refusal_of_other_errors_names_the_error(refusal):
    msg = refusal(3, "NVIDIA H100", 9, 0, "cudaErrorJitCompilerNotFound")
    assert "CUDA device 3 (NVIDIA H100" in msg and "cudaErrorJitCompilerNotFound" in msg
    assert 'TORCH_CUDA_ARCH_LIST="9.0" pip install' in msg
