"""Loads the compiled op library (it has no Python API: ops are reached through torch.ops.packcuda)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
LIB_DIR = _HERE / "lib"
_loaded = False


def _installed_lib_dir() -> Path | None:
    """The lib/ folder of an installed packcuda distribution (used when this module is imported from a
    source checkout without an in-place build, e.g. `python -m packcuda` run from the repository root)."""
    try:
        from importlib.metadata import distributions

        for d in distributions(name="packcuda"):
            p = Path(d.locate_file("packcuda/lib"))
            if (p / "libpackcuda_torch.so").exists():
                return p
    except Exception:  # broken metadata: behave as if nothing were installed
        pass
    return None


def library_dir() -> Path:
    if (LIB_DIR / "libpackcuda_torch.so").exists():
        return LIB_DIR
    return _installed_lib_dir() or LIB_DIR


def library_path() -> Path:
    return library_dir() / "libpackcuda_torch.so"


def load() -> None:
    global _loaded
    if _loaded:
        return
    path = library_path()
    if not path.exists():
        raise ImportError(
            f"packcuda: compiled library not found at {path}. Install the package with `pip install .` "
            "(or `pip install -e .` for development)."
        )
    torch.ops.load_library(os.fspath(path))
    _loaded = True


def built_with_cuda() -> bool:
    """True when the library carries CUDA kernels."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key("packcuda::gather_rows", "CUDA")


def cmake_prefix_path() -> str:
    """Directory to put on CMAKE_PREFIX_PATH so that `find_package(packcuda CONFIG)` finds this install."""
    return os.fspath(library_dir() / "cmake")
