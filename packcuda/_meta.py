"""Host/device metadata convention shared by every facade function.

``cu_seqlens`` (and similar metadata) may be given on the host (list, tuple, numpy array or CPU tensor) or
as a device tensor. Host metadata is passed to the ops as a CPU int64 tensor: the op validates the values on
the host and uploads them with a non-blocking copy, so a GPU op never waits for the device. Device metadata
is used as is; when the host needs a value from it (an output size), the facade reads it back once — a
device sync — and says so in the function's docstring.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
import struct
from typing import Optional, Sequence, Union

import torch

IntsLike = Union[Sequence[int], torch.Tensor]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# ---------------------------------------------------------------------------------------------------
# scalar arguments: integers that are really integers, finite floats, devices (one vocabulary for every op)
# ---------------------------------------------------------------------------------------------------
def _is_bool_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def check_int(op: str, name: str, value, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """`value` as a Python int, refusing what is not an integer (bool, float, 0-d float tensor) with a TypeError
    and what lies outside [lo, hi] (default: int64) with a ValueError, both naming ``packcuda.<op>`` and `name`."""
    if type(value) is int and (INT64_MIN if lo is None else lo) <= value <= (INT64_MAX if hi is None else hi):
        return value  # the common case, without the ABC checks below (these sit on per-call host paths)
    if isinstance(value, (bool, float)) or _is_bool_tensor(value) or not (
        isinstance(value, numbers.Integral) or hasattr(value, "__index__")
    ):
        raise TypeError(f"packcuda.{op}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    try:
        v = int(value.__index__())
    except TypeError as e:  # a tensor of a non-integer dtype or with several elements
        raise TypeError(f"packcuda.{op}: {name} must be an integer, got {value!r}") from e
    lo = INT64_MIN if lo is None else lo
    hi = INT64_MAX if hi is None else hi
    if not lo <= v <= hi:
        raise ValueError(f"packcuda.{op}: {name}={v} is out of range [{lo}, {hi}]")
    return v


def check_float(op: str, name: str, value, *, lo: Optional[float] = None, hi: Optional[float] = None,
                lo_open: bool = False) -> float:
    """`value` as a finite Python float in [lo, hi] (or (lo, hi] with lo_open); bools and non-numbers are a
    TypeError, NaN/inf and out-of-range values a ValueError, naming ``packcuda.<op>`` and `name`."""
    if type(value) is float and math.isfinite(value) and lo is None and hi is None:
        return value  # the common case, without the ABC checks below
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"packcuda.{op}: {name} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"packcuda.{op}: {name} must be finite, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"packcuda.{op}: {name}={v} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v > hi:
        raise ValueError(f"packcuda.{op}: {name}={v} must be <= {hi}")
    return v


def resolve_device(op: str, name: str, device) -> Optional[torch.device]:
    """A device argument as a concrete torch.device: None stays None, an index-less "cuda" means the current
    CUDA device; devices packcuda has no kernels for (meta, mps, ...) are a ValueError naming the op."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise (TypeError if not isinstance(device, (str, int)) else ValueError)(
            f"packcuda.{op}: {name}={device!r} is not a device") from e
    if isinstance(device, str) and ":" in device:
        # torch keeps the index in 8 bits ("cuda:4096" would silently become cuda:0): compare with the text
        idx = device.rsplit(":", 1)[1].strip()
        if not idx.isdigit() or int(idx) != d.index:
            raise ValueError(f"packcuda.{op}: {name}={device!r} is not a device index torch can hold")
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0 or (d.index is not None and not 0 <= d.index < n):
            raise ValueError(f"packcuda.{op}: {name}={d} is not available here (CUDA devices: {n})")
        return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())
    return _kernel_device(op, f"{name}={d}", d)


def tensor_device(op: str, name: str, t: torch.Tensor) -> torch.device:
    """The device of a tensor argument (it exists, so no device query: traceable by torch.compile); devices
    packcuda has no kernels for (meta, mps, ...) are a ValueError naming the op."""
    return _kernel_device(op, f"{name} on {t.device}", t.device)


def _kernel_device(op: Optional[str], what: str, d: torch.device) -> torch.device:
    """d itself when packcuda has kernels for its type (cpu, cuda), else a ValueError naming the op."""
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"{_who(op)}: {what} is not supported (packcuda runs on cpu and cuda)")
    return d


# ---------------------------------------------------------------------------------------------------
# devices of an op's tensor arguments: the rule every packcuda op follows (the C++ ops check it on real
# tensors; the fake kernels, which run for meta tensors, under FakeTensor and torch.compile, check it here)
# ---------------------------------------------------------------------------------------------------
def check_devices(op: str, tensors, device=None, host: Sequence[str] = (), host_only: Sequence[str] = ()) -> None:
    """Every tensor argument on the data's device, else a ValueError naming ``packcuda.<op>`` and the argument.

    tensors: ``(name, tensor or None)`` in schema order. The data's device is `device` (an op's output device
    argument) when given, else that of the first tensor not in `host` / `host_only`, else that of the first
    tensor. Arguments in `host` (metadata) may also be on the CPU; those in `host_only` must be. A meta tensor
    therefore passes only with meta data (under FakeTensor / torch.compile every tensor carries its real device):
    mixed with real tensors it is refused instead of yielding an uninitialized result."""
    ref = ref_desc = None
    if device is not None:
        ref = resolve_device(op, "device", device)
        ref_desc = f"the output device is {ref}"
    for name, t in tensors:
        if t is None:
            continue
        if name in host_only:
            if t.device.type != "cpu":
                raise ValueError(f"packcuda.{op}: {name} must be host metadata (a CPU tensor), got a tensor on "
                                 f"{t.device}")
        elif ref is None and name not in host:
            ref, ref_desc = t.device, f"{name} is on {t.device}"
    for name, t in tensors:
        if t is None or name in host_only or (name in host and t.device.type == "cpu"):
            continue
        if ref is None:
            ref, ref_desc = t.device, f"{name} is on {t.device}"
        elif t.device != ref:
            raise ValueError(f"packcuda.{op}: {name} is on {t.device} but {ref_desc}")


def _unwrap(t):
    return t.getElementType() if isinstance(t, torch._C.OptionalType) else t


def _tensor_kind(t) -> Optional[str]:
    """"one" for a Tensor / Tensor? schema type, "list" for Tensor[] / Tensor?[], else None."""
    t = _unwrap(t)
    if isinstance(t, torch._C.TensorType):
        return "one"
    if isinstance(t, torch._C.ListType) and isinstance(_unwrap(t.getElementType()), torch._C.TensorType):
        return "list"
    return None


def fake_kernel(op: str, *, host: Sequence[str] = (), host_only: Sequence[str] = ()):
    """Decorator: registers the function as the fake kernel of ``packcuda::<op>`` behind :func:`check_devices`.
    The tensor arguments (``Tensor``, ``Tensor?``, ``Tensor[]``) and an output ``device`` argument are read from
    the op's schema, so none can be left unchecked; `host` / `host_only` name the metadata arguments that may
    (must) be on the CPU, as the C++ op takes them."""
    args = getattr(torch.ops.packcuda, op).default._schema.arguments
    tensor_args = [(i, a.name, kind == "list") for i, a in enumerate(args) if (kind := _tensor_kind(a.type))]
    unknown = (set(host) | set(host_only)) - {name for _, name, _ in tensor_args}
    if unknown:
        raise TypeError(f"packcuda::{op} has no tensor arguments {sorted(unknown)}")
    dev = next((i for i, a in enumerate(args) if a.name == "device" and isinstance(_unwrap(a.type),
                                                                                     torch._C.DeviceObjType)), None)

    def value(call_args, call_kwargs, i, name):
        return call_args[i] if i < len(call_args) else call_kwargs.get(name)

    def register(fn):
        @functools.wraps(fn)
        def fake(*call_args, **call_kwargs):
            tensors = []
            for i, name, is_list in tensor_args:
                v = value(call_args, call_kwargs, i, name)
                tensors += ([(name, t) for t in v] if is_list and v is not None else [(name, v)])
            device = value(call_args, call_kwargs, dev, "device") if dev is not None else None
            check_devices(op, tensors, device, host, host_only)
            return fn(*call_args, **call_kwargs)

        torch.library.register_fake(f"packcuda::{op}")(fake)
        return fn

    return register


def output_device(op: str, meta: torch.Tensor, device) -> torch.device:
    """The device an op with a ``device`` argument writes to: `device` when given, else its metadata's."""
    return meta.device if device is None else resolve_device(op, "device", device)


def config_field(obj, name: str, default=None):
    """A field of a model config given as an object or as a dict (transformers' nested text/vision configs
    come either way)."""
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def is_device_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


def _who(op: Optional[str]) -> str:
    return f"packcuda.{op}" if op else "packcuda"


def plain_ints(values) -> Optional[torch.Tensor]:
    """The fast path of host metadata: a CPU int64 tensor of a non-empty list/tuple of plain Python ints
    within int64, or None (then :func:`host_tensor`'s general path decides). struct packs the list in C,
    several times faster than torch.tensor for a thousand entries; only plain ints take this path (struct
    would also take bools and other __index__ objects)."""
    if type(values) not in (list, tuple) or not values or {*map(type, values)} != {int} or (
            torch.compiler.is_compiling()):
        return None
    try:
        buf = bytearray(struct.pack(f"{len(values)}q", *values))
    except (struct.error, OverflowError):
        return None
    return torch.frombuffer(buf, dtype=torch.int64)


def host_tensor(values: IntsLike, name: str = "cu_seqlens", *, op: Optional[str] = None) -> torch.Tensor:
    """CPU int64 1-D tensor of host metadata (no device involved). Refuses what is not a 1-D sequence of
    integers (None, floats, bools, nested lists, 2-D tensors or arrays) and values outside int64."""
    fast = plain_ints(values)
    if fast is not None:
        return fast
    who = _who(op)
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{who}: {name} must be host metadata here, got a {values.device} tensor")
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{who}: {name} must be an int32/int64 tensor, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{who}: {name} must be 1-D, got shape {list(values.shape)}")
        return values.to(torch.int64)
    try:
        import numpy as np

        if isinstance(values, np.ndarray):
            if values.dtype.kind not in "iu":
                raise TypeError(f"{who}: {name} must hold integers, got numpy dtype {values.dtype}")
            if values.ndim != 1:
                raise ValueError(f"{who}: {name} must be 1-D, got shape {list(values.shape)}")
            if values.dtype.kind == "u" and values.size and int(values.max()) > INT64_MAX:
                raise ValueError(f"{who}: {name} holds {int(values.max())}, above int64")
            return torch.from_numpy(values.astype("int64"))
    except ImportError:  # pragma: no cover
        pass
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{who}: {name} must be a sequence of integers or an integer tensor, got "
                        f"{type(values).__name__}")
    vals = list(values)
    out = []
    for i, v in enumerate(vals):
        if isinstance(v, (bool, float)) or _is_bool_tensor(v) or not (
                isinstance(v, numbers.Integral) or hasattr(v, "__index__")):
            raise TypeError(f"{who}: {name}[{i}] must be an integer, got {v!r} ({type(v).__name__})")
        try:
            iv = int(v.__index__())
        except TypeError as e:
            raise TypeError(f"{who}: {name}[{i}] must be an integer, got {v!r}") from e
        if not INT64_MIN <= iv <= INT64_MAX:
            raise ValueError(f"{who}: {name}[{i}]={iv} is outside int64")
        out.append(iv)
    return torch.tensor(out, dtype=torch.int64)


def op_metadata(values: IntsLike, name: str = "cu_seqlens", *, op: Optional[str] = None) -> torch.Tensor:
    """The tensor to hand to an op: device tensors as they are (1-D int32/int64 checked), host metadata as a
    CPU int64 tensor."""
    if is_device_tensor(values):
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{_who(op)}: {name} must be an int32/int64 tensor, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"{_who(op)}: {name} must be 1-D, got shape {list(values.shape)}")
        return values
    return host_tensor(values, name, op=op)


def host_list(values: IntsLike, name: str = "cu_seqlens", *, op: Optional[str] = None) -> list[int]:
    """Python ints of metadata; a device tensor is read back (one device sync; a meta tensor has nothing to read:
    a ValueError naming the op)."""
    if type(values) in (list, tuple) and values and all(type(v) is int for v in values) and (
            INT64_MIN <= min(values) and max(values) <= INT64_MAX):
        return list(values)  # the common case, without a round trip through a tensor
    if is_device_tensor(values):
        _kernel_device(op, f"{name} on {values.device}", values.device)
        return op_metadata(values, name, op=op).tolist()
    return host_tensor(values, name, op=op).tolist()


def cu_from_lengths(lengths: IntsLike, name: str = "lengths", *, op: Optional[str] = None) -> list[int]:
    """Host cu_seqlens (Python ints, N+1 entries) from host lengths (a device tensor is read back: one sync)."""
    lens = host_list(lengths, name, op=op)
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{_who(op)}: {name}[{i}]={n} is negative")
    cu = list(itertools.accumulate(lens, initial=0))
    if cu[-1] > INT64_MAX:
        raise ValueError(f"{_who(op)}: the sum of {name} ({cu[-1]}) overflows int64")
    return cu


def to_device_async(t: torch.Tensor, device: torch.device, dtype=None) -> torch.Tensor:
    """Host tensor onto a device without making the host wait."""
    if dtype is not None:
        t = t.to(dtype)
    if torch.device(device).type == "cpu":
        return t
    # pinned staging: the copy is truly asynchronous (a pageable source is staged behind queued work)
    return t.pin_memory().to(device, non_blocking=True)
