"""The bad-input catalogue: every public function and every raw op gets cases that must be refused cleanly.

A case builds its inputs, calls one function, and asserts that
  - the call raises the expected exception type (ValueError or TypeError; a raw op given a value its schema cannot
    hold, such as an int for a ``str`` argument, is refused by torch's argument parser with a RuntimeError that
    names ``packcuda::<op>`` and the argument),
  - the message names the op (``packcuda.<op>``) and the offending argument,
  - every tensor handed in (its whole storage, so a write through a view is seen too) is bitwise unchanged.
Risky cases (crash reproducers) run in a child process, so a crash fails one case, not the run.

Case modules are ``tests/catalogue_<capability>.py``; each holds ``CASES``, a list of :class:`Case`.
``tests/test_bad_inputs.py`` runs them and fails when an op or a public function has no case.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = ("catalogue_pack", "catalogue_shard", "catalogue_rope", "catalogue_mrope", "catalogue_conv",
           "catalogue_exchange", "catalogue_relayout", "catalogue_balance", "catalogue_integrations",
           "catalogue_vision", "catalogue_devices")


@dataclasses.dataclass
class Case:
    """One refused call.

    target: what it covers — ``"packcuda.<fn>"`` for a public function, ``"ops.<op>"`` for a raw
        ``torch.ops.packcuda`` op, ``"<Class>.<method>"`` for a public method, ``"transformers.<fn>"`` for
        ``packcuda.integrations.transformers``, ``"megatron.<fn>"`` for ``packcuda.integrations.megatron``,
        ``"exchange.<fn>"`` for ``packcuda.exchange``,
        ``"reference.<fn>"`` for a reference of tests/reference.py that refuses bad input.
    name: a short id, unique per target.
    make: returns ``(fn, args, kwargs)``; the inputs are built fresh each run.
    exc: the exception type(s) expected.
    arg: a word the message must contain (the offending argument's name), or a tuple of words it must all contain;
        a word given as a tuple of words is any one of them.
    op: the op name the message must contain (default: the target's last component).
    risky: run in a child process (crash reproducers).
    cuda: the case needs a CUDA device (skipped without one).
    """

    target: str
    name: str
    make: Callable[[], Tuple[Callable, Sequence[Any], dict]]
    exc: Any = ValueError
    arg: Union[str, Tuple[Union[str, Tuple[str, ...]], ...]] = ""
    op: Optional[str] = None
    risky: bool = False
    cuda: bool = False

    @property
    def op_name(self) -> str:
        return self.op if self.op is not None else self.target.rsplit(".", 1)[-1]


def call(fn, *args, **kwargs):
    """Helper for ``make``: ``lambda: call(fn, a, b, k=1)``."""
    return fn, args, kwargs


def in_process_group(fn):
    """For ``make``: a call of fn() inside a single-process gloo group (destroyed after), for cases that need
    torch.distributed; mark them risky (they run in a child process)."""
    import torch.distributed as dist

    def run():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            return fn()
        finally:
            dist.destroy_process_group()

    return run, (), {}


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


def _storage_bytes(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A copy of every byte of t's storage (not only the view's elements), or None for meta tensors."""
    if t.device.type == "meta":
        return None
    st = t.detach().untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(st, 0, (st.nbytes(),), (1,))
    return raw.clone()


def run_case(case: Case) -> None:
    """Runs one case in this process; raises AssertionError when it does not end as the catalogue demands."""
    fn, args, kwargs = case.make()
    inputs = _tensors(list(args), []) + _tensors(kwargs, [])
    before = [_storage_bytes(t) for t in inputs]
    try:
        fn(*args, **kwargs)
    except case.exc as e:
        msg = str(e)
        assert f"packcuda.{case.op_name}" in msg or f"packcuda::{case.op_name}" in msg, (
            f"{case.target}/{case.name}: message does not name the op {case.op_name!r}: {msg!r}")
        for word in (case.arg,) if isinstance(case.arg, str) else case.arg:
            assert any(w in msg for w in ((word,) if isinstance(word, str) else word)), (
                f"{case.target}/{case.name}: message does not name {word!r}: {msg!r}")
    except Exception as e:  # the wrong type: an internal error
        raise AssertionError(f"{case.target}/{case.name}: expected {case.exc}, got {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"{case.target}/{case.name}: accepted (expected {case.exc})")
    for t, b in zip(inputs, before):
        if b is not None:
            after = _storage_bytes(t)
            assert torch.equal(after, b), f"{case.target}/{case.name}: an input was written before the error"


def find(module: str, target: str, name: str) -> Case:
    mod = importlib.import_module(module)
    for c in mod.CASES:
        if c.target == target and c.name == name:
            return c
    raise KeyError(f"{module}: no case {target}/{name}")


def run_in_child(module: str, case: Case, timeout: float = 120.0) -> None:
    """Runs the case in a fresh interpreter: a crash (signal) or a hang fails this case only."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import catalogue; "
            f"catalogue.run_case(catalogue.find({module!r}, {case.target!r}, {case.name!r})); print('CASE-OK')")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{case.target}/{case.name}: hung for {timeout} s in a child process") from None
    assert r.returncode == 0 and "CASE-OK" in r.stdout, (
        f"{case.target}/{case.name}: child process ended with code {r.returncode}\n{r.stdout[-2000:]}"
        f"\n{r.stderr[-4000:]}")


def all_cases():
    """(module, case) for every catalogue module present."""
    out = []
    for m in MODULES:
        try:
            mod = importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:
                raise
            continue
        out.extend((m, c) for c in mod.CASES)
    return out


# ---------------------------------------------------------------------------------------------------
# what must be covered
# ---------------------------------------------------------------------------------------------------
# ops that take no argument at all: nothing can be passed wrongly
NO_ARGUMENT_OPS = {"version", "exchange_nccl_available", "exchange_nccl_unique_id", "shard_plan_fields",
                   "rope_max_rotary_dim"}


def raw_ops() -> list[str]:
    import packcuda  # noqa: F401  (loads the library)

    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::", 1)[1] for n in names if n.startswith("packcuda::"))


def public_targets() -> list[str]:
    """Every public callable: packcuda's functions, the public methods of its classes and the transformers
    integration's functions."""
    import inspect

    import packcuda
    from packcuda.integrations import megatron as mg, transformers as hf

    out = []
    skip = {"built_with_cuda", "cmake_prefix_path", "library_path", "integrations"}
    for n in packcuda.__all__:
        obj = getattr(packcuda, n)
        if n in skip:
            continue
        if inspect.isclass(obj):
            for m, v in vars(obj).items():
                if not m.startswith("_") and (callable(v) or isinstance(v, (staticmethod, classmethod))):
                    out.append(f"{n}.{m}")
        elif callable(obj):
            out.append(f"packcuda.{n}")
    for n in hf.__all__:
        obj = getattr(hf, n)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            for m, v in vars(obj).items():
                if not m.startswith("_") and callable(v):
                    out.append(f"{n}.{m}")
        elif callable(obj):
            out.append(f"transformers.{n}")
    out += [f"megatron.{n}" for n in mg.__all__ if callable(getattr(mg, n))]
    for n in packcuda.exchange.__all__:  # the row exchange's API for the other modules and for users
        obj = getattr(packcuda.exchange, n)
        if inspect.isclass(obj):
            if issubclass(obj, tuple):  # a record (Field)
                continue
            for m, v in vars(obj).items():
                if not m.startswith("_") and (callable(v) or isinstance(v, (staticmethod, classmethod))):
                    out.append(f"{n}.{m}")
        elif callable(obj):
            out.append(f"exchange.{n}")
    return sorted(out)
