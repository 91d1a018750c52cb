"""Build driver: setuptools whose build_ext step configures, builds and installs the CMake project.

The CMake project (CMakeLists.txt) is the single source of truth; this file only runs it and puts the
installed tree (libraries, headers, CMake package) inside the ``packcuda`` Python package.

Environment knobs:
  MAX_JOBS               parallel compile jobs (default 2)
  TORCH_CUDA_ARCH_LIST   CUDA architectures in torch's syntax, e.g. "9.0" or "8.0;9.0+PTX"; by default
                         "8.0;8.6;8.9;9.0+PTX" (cmake/packcudaCudaArchs.cmake)
  PACKCUDA_CUDA          "0" forces a CPU-only build; "1" requires CUDA; unset: auto-detect nvcc
  PACKCUDA_BUILD_TYPE    CMake build type (default Release)
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        for ext in self.extensions:
            self.build_cmake(ext)

    def get_outputs(self):
        return []

    def build_cmake(self, ext):
        import torch  # the build environment's torch; the binary targets the stable ABI (2.10)

        if self.inplace or getattr(self, "editable_mode", False):
            pkg_dir = ROOT / "packcuda"
        else:
            pkg_dir = Path(self.build_lib).resolve() / "packcuda"
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        jobs = os.environ.get("MAX_JOBS", "2")
        cfg = os.environ.get("PACKCUDA_BUILD_TYPE", "Release")
        args = [
            "cmake", "-S", str(ROOT), "-B", str(build_temp), "-G", "Ninja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_INSTALL_PREFIX={pkg_dir}",
            "-DPACKCUDA_PYTHON_LAYOUT=ON",
        ]
        if shutil.which("ninja") is None:
            args.remove("-G")
            args.remove("Ninja")
        cuda = os.environ.get("PACKCUDA_CUDA")
        args.append(f"-DPACKCUDA_CUDA={'AUTO' if cuda is None else ('ON' if cuda == '1' else 'OFF')}")
        print("packcuda: building against torch", torch.__version__, "->", pkg_dir, flush=True)
        subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", str(build_temp), "--parallel", jobs])
        # the installed headers are exactly the public ones: none left over from an earlier build
        shutil.rmtree(pkg_dir / "include" / "packcuda", ignore_errors=True)
        subprocess.check_call(["cmake", "--install", str(build_temp)])


class bdist_wheel(_bdist_wheel):
    """The shared libraries have no Python API: tag the wheel py3-none-<platform>."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    ext_modules=[CMakeExtension("packcuda._libs")],
    cmdclass={"build_ext": CMakeBuild, "bdist_wheel": bdist_wheel},
    zip_safe=False,
)
