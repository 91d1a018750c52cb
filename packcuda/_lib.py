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
    """The compiled op library this package loads.

    Returns:
        The path of ``libpackcuda_torch.so``: the in-place build's when there is one, else the installed one's.
    """
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
    """Whether the library was built with its CUDA kernels (else every op runs on the CPU only).

    Returns:
        True when the ops have CUDA kernels.
    """
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key("packcuda::gather_rows", "CUDA")


def cmake_prefix_path() -> str:
    """The folder for ``CMAKE_PREFIX_PATH`` (also ``python -m packcuda cmake-prefix-path``).

    Returns:
        The directory with which ``find_package(packcuda CONFIG)`` finds this install's headers and libraries.
    """
    return os.fspath(library_dir() / "cmake")


class EagerOp:
    """A registered op as the facades call it: the same semantics (autograd included), without the host cost of
    the Python autograd kernel that register_autograd installs (schema default filling, a generated Function, a
    redispatch, on every call forward and backward), which is larger than the kernel itself for small inputs.

    ``eager_op(needs_grad, *args)``, with ``needs_grad`` whether an input requires grad: under torch.compile
    the registered op (and its registered autograd); in eager mode, with grad mode on and a gradient to track,
    ``function.apply(*args)`` (a plain autograd Function whose forward calls :meth:`below`) or, without a
    function, the registered op; otherwise the backend kernel, called below autograd. Same kernel, same
    result."""

    __slots__ = ("op", "function", "_default")
    _is_compiling = staticmethod(torch.compiler.is_compiling)
    _grad_enabled = staticmethod(torch.is_grad_enabled)
    _below_autograd = torch._C._AutoDispatchBelowAutograd

    def __init__(self, op, function=None):
        self.op, self.function, self._default = op, function, op.default

    def __call__(self, needs_grad: bool, *args):
        if self._is_compiling():
            return self.op(*args)
        if needs_grad and self._grad_enabled():
            return self.op(*args) if self.function is None else self.function.apply(*args)
        with self._below_autograd():  # (below, inlined: this sits on every facade call)
            return self._default(*args)

    def below(self, *args):
        """The backend kernel, called below autograd (no graph recorded)."""
        with self._below_autograd():
            return self._default(*args)
