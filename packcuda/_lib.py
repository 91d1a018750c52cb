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


_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


class _EagerFunction(torch.autograd.Function):
    """The autograd Function of every :class:`EagerOp` in eager mode: the op's own ``setup_context`` and
    ``backward`` (the ones registered for the op) around its kernel called below autograd. ``args`` are the op's
    arguments; the ones that can take a gradient travel again as inputs of their own (``grad_inputs``), the others
    inside the tuple (fewer Function inputs: less host time per call)."""

    @staticmethod
    def forward(ctx, eager, args, *grad_inputs):
        eager.setup_context(ctx, args, None)
        ctx.eager = eager
        with _below_autograd():
            return eager.default(*args)

    @staticmethod
    def backward(ctx, *grads):
        eager = ctx.eager
        g = eager.backward(ctx, *grads)
        return (None, None, *[g[i] for i in eager.differentiable])


class EagerOp:
    """A registered op as the facades call it: the same semantics (autograd included), without the host cost of
    the Python autograd kernel that register_autograd installs (schema default filling, a generated Function, a
    redispatch, on every call forward and backward), which is larger than the kernel itself for small inputs.

    ``EagerOp(op, setup_context, backward, differentiable)`` registers ``backward`` / ``setup_context`` as the op's
    autograd (``torch.library.register_autograd``), so each op's autograd is written once; ``differentiable``: the
    positions of the arguments that can take a gradient. ``eager_op(needs_grad, *args)``, with ``needs_grad``
    whether an input requires grad: under torch.compile the registered op (and its registered autograd); in eager
    mode, with grad mode on and a gradient to track, the same setup and backward in a plain autograd Function whose
    forward calls the kernel below autograd (the registered op when the op has no autograd); otherwise the backend
    kernel, called below autograd. Same kernel, same result."""

    __slots__ = ("op", "default", "setup_context", "backward", "differentiable")

    def __init__(self, op, setup_context=None, backward=None, differentiable=()):
        # the overload's C++ callable: what OpOverload.__call__ calls, without its Python frame
        self.op, self.default = op, getattr(op.default, "_op", op.default)
        self.setup_context, self.backward, self.differentiable = setup_context, backward, tuple(differentiable)
        if backward is not None:
            torch.library.register_autograd(op.default, backward, setup_context=setup_context)

    def __call__(self, needs_grad: bool, *args):
        if _is_compiling():
            return self.op(*args)
        if needs_grad and _grad_enabled():
            if self.backward is None:
                return self.op(*args)
            return _EagerFunction.apply(self, args, *[args[i] for i in self.differentiable])
        with _below_autograd():  # (below, inlined: this sits on every facade call)
            return self.default(*args)
