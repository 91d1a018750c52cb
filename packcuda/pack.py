"""Packing: remove/restore padding, per-sequence positions, next-token labels, row gathers."""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._meta import (INT64_MAX, IntsLike, check_int, cu_from_lengths, op_metadata, plain_ints, resolve_device,
                    to_device_async)

_lib.load()
ops = torch.ops.packcuda

__all__ = [
    "gather_rows",
    "scatter_rows",
    "unpad",
    "pad",
    "position_ids",
    "next_token_labels",
]


# ---------------------------------------------------------------------------------------------------
# argument checks shared by the fake kernels and the facade
# ---------------------------------------------------------------------------------------------------
def _check_tensor(op: str, name: str, t) -> torch.Tensor:
    """`t` must be a tensor on cpu or cuda (a meta tensor has no data for packcuda's host checks)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"packcuda.{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"packcuda.{op}: {name} is on {t.device}; packcuda runs on cpu and cuda")
    return t


def _same_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"packcuda.{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def _host_or_same_device(op: str, name: str, meta: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Metadata is either on the host or on the data's device."""
    if meta.device.type != "cpu" and meta.device != ref.device:
        raise ValueError(f"packcuda.{op}: {name} is on {meta.device} but {ref_name} is on {ref.device}")


def _check_dim(op: str, name: str, t: torch.Tensor, dim) -> int:
    """`dim` as an int in [0, t.dim()) (negative counts from the end)."""
    dim = check_int(op, "dim", dim)
    nd = t.dim()
    if nd < 1:
        raise ValueError(f"packcuda.{op}: {name} must have at least 1 dimension, got shape {list(t.shape)}")
    if not -nd <= dim < nd:
        raise ValueError(f"packcuda.{op}: dim={dim} is out of range for {name} of shape {list(t.shape)}")
    return dim % nd


def _index_rules(op: str, index: torch.Tensor, src: torch.Tensor, name: str = "index", src_name: str = "src"):
    """A row index is int64, 1-D and on its data's device (the facade and the fake kernels share this)."""
    if index.dtype != torch.int64:
        raise ValueError(f"packcuda.{op}: {name} must have dtype int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"packcuda.{op}: {name} must be 1-D, got shape {list(index.shape)}")
    _same_device(op, name, index, src_name, src)


def _check_index(op: str, index, src: torch.Tensor, name: str = "index", src_name: str = "src") -> torch.Tensor:
    index = _check_tensor(op, name, index)
    _index_rules(op, index, src, name, src_name)
    return index


def _fill_arg(op: str, fill, name: str = "fill", dtype: Optional[torch.dtype] = None) -> Union[int, float]:
    """A fill value as a Python int (integers travel as integers: exact for int64) or float. With `dtype`, the
    value must also be one that dtype holds (bool: 0/1; integer dtypes: an integral value in range; floating
    dtypes: any real), refused here naming `op`; without it the op itself refuses what src's dtype cannot hold."""
    if isinstance(fill, bool):
        fill = int(fill)
    elif isinstance(fill, numbers.Integral):
        fill = check_int(op, name, fill)
    elif isinstance(fill, numbers.Real):
        fill = float(fill)
    else:
        raise TypeError(f"packcuda.{op}: {name} must be a real number, got {fill!r} ({type(fill).__name__})")
    if dtype is None or dtype.is_floating_point or dtype.is_complex:
        return float(fill) if dtype is not None else fill
    if isinstance(fill, float):
        if not math.isfinite(fill) or not fill.is_integer():
            raise ValueError(f"packcuda.{op}: {name}={fill!r} is not an integer value, but the tensor is {dtype}")
        fill = int(fill)
    lo, hi = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not lo <= fill <= hi:
        raise ValueError(f"packcuda.{op}: {name}={fill!r} does not fit the tensor's dtype {dtype} (range [{lo}, {hi}])")
    return fill


def _split_fill(fill: Union[int, float]) -> Tuple[float, Optional[int]]:
    """(fill, fill_int) arguments of the gather_rows op."""
    return (0.0, fill) if isinstance(fill, int) else (fill, None)


# ---------------------------------------------------------------------------------------------------
# fake (meta) kernels: the same shape and device rules as the kernels (a meta tensor mixed with real ones is
# refused instead of producing an uninitialized result)
# ---------------------------------------------------------------------------------------------------
def _resized(src, dim, n):
    d = dim % src.dim()
    return (*src.shape[:d], n, *src.shape[d + 1:])


def _fake_rows(op, src, index, dim):
    d = _check_dim(op, "src", src, dim)
    _index_rules(op, index, src)
    return d


def _fake_target(op, cu_seqlens, device):
    if device is None:
        return cu_seqlens.device
    d = resolve_device(op, "device", device)
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != d:
        raise ValueError(f"packcuda.{op}: cu_seqlens is on {cu_seqlens.device} but the output device is {d}")
    return d


@torch.library.register_fake("packcuda::gather_rows")
def _gather_rows_fake(src, index, fill=0.0, dim=0, fill_int=None):
    d = _fake_rows("gather_rows", src, index, dim)
    return src.new_empty(_resized(src, d, index.shape[0]))


@torch.library.register_fake("packcuda::scatter_rows")
def _scatter_rows_fake(src, index, num_rows, dim=0):
    d = _fake_rows("scatter_rows", src, index, dim)
    if num_rows < 0:
        raise ValueError(f"packcuda.scatter_rows: num_rows must be >= 0, got {num_rows}")
    return src.new_empty(_resized(src, d, num_rows))


@torch.library.register_fake("packcuda::segment_positions")
def _segment_positions_fake(cu_seqlens, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=_fake_target("segment_positions", cu_seqlens, device))


@torch.library.register_fake("packcuda::next_token_labels")
def _next_token_labels_fake(input_ids, cu_seqlens, ignore_index=-100):
    _host_or_same_device("next_token_labels", "cu_seqlens", cu_seqlens, "input_ids", input_ids)
    return torch.empty_like(input_ids, memory_format=torch.contiguous_format)


@torch.library.register_fake("packcuda::right_pad_indices")
def _right_pad_indices_fake(cu_seqlens, seqlen, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=_fake_target("right_pad_indices", cu_seqlens, device))


@torch.library.register_fake("packcuda::mask_indices")
def _mask_indices_fake(attention_mask, cu_seqlens, total):
    _host_or_same_device("mask_indices", "cu_seqlens", cu_seqlens, "attention_mask", attention_mask)
    return torch.empty(total, dtype=torch.int64, device=attention_mask.device)


# ---------------------------------------------------------------------------------------------------
# autograd: a row gather with unique indices and a row scatter are each other's transpose
# ---------------------------------------------------------------------------------------------------
def _gather_setup(ctx, inputs, output):
    src, index, dim = inputs[0], inputs[1], inputs[3]
    ctx.save_for_backward(index)
    ctx.dim = dim
    ctx.n_src = src.shape[dim]


def _gather_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _scatter(grad, index, ctx.n_src, ctx.dim), None, None, None, None


def _scatter_setup(ctx, inputs, output):
    _, index, _, dim = inputs
    ctx.save_for_backward(index)
    ctx.dim = dim


def _scatter_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _GATHER(grad.requires_grad, grad, index, 0.0, ctx.dim, None), None, None, None


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
_GATHER = _lib.EagerOp(ops.gather_rows, _gather_setup, _gather_backward, differentiable=(0,))
_SCATTER = _lib.EagerOp(ops.scatter_rows, _scatter_setup, _scatter_backward, differentiable=(0,))


def _gather(src: torch.Tensor, index: torch.Tensor, fill: Union[int, float], dim: int = 0) -> torch.Tensor:
    """The row gather used by every facade; without a gradient to track it calls the kernel below autograd
    (:class:`packcuda._lib.EagerOp`). An int `fill` is carried as an integer (exact for int64 data); a float as
    a double. The op refuses a fill that src's dtype cannot hold."""
    f, fi = _split_fill(fill)
    return _GATHER(src.requires_grad, src, index, f, dim, fi)


def _scatter(src: torch.Tensor, index: torch.Tensor, num_rows: int, dim: int = 0) -> torch.Tensor:
    """Row scatter with the same fast path as :func:`_gather`."""
    return _SCATTER(src.requires_grad, src, index, num_rows, dim)


def gather_rows(src: torch.Tensor, index: torch.Tensor, fill: Union[int, float] = 0.0, dim: int = 0) -> torch.Tensor:
    """``out[i] = src[index[i]]`` for ``index[i] >= 0``, else a row of ``fill``. Rows are whole slices along
    ``dim`` (default 0) of any dtype and trailing shape, moved with 16-byte vector loads where alignment allows;
    for ``dim > 0`` every slice of the leading dims is gathered in the same launch (``src`` of shape
    ``[A, T, ...]`` gives ``[A, len(index), ...]``; leading dims that collapse to one stride need no copy).
    Differentiable in ``src`` when the non-negative indices are unique (the backward is a row scatter).

    ``fill`` must be a value src's dtype holds: 0/1 for bool, an integral value in range for integer dtypes
    (ints are exact, also beyond 2**53 for int64), any float (NaN, inf too) that stays finite-or-not as given
    for floating dtypes. ``index`` is int64, 1-D, on src's device; on CPU its values are checked
    (``-1 <= index[i] < src.shape[dim]``)."""
    op = "gather_rows"
    src = _check_tensor(op, "src", src)
    d = _check_dim(op, "src", src, dim)
    index = _check_index(op, index, src)
    return _gather(src, index, _fill_arg(op, fill), d)


def scatter_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int, dim: int = 0) -> torch.Tensor:
    """``out = zeros(num_rows, ...)``, ``out[index[i]] = src[i]`` for ``index[i] >= 0`` (rows along ``dim``,
    default 0). Indices must be unique (checked on CPU), which keeps the result deterministic. Differentiable
    in ``src``."""
    op = "scatter_rows"
    src = _check_tensor(op, "src", src)
    d = _check_dim(op, "src", src, dim)
    index = _check_index(op, index, src)
    num_rows = check_int(op, "num_rows", num_rows, lo=0)
    return _scatter(src, index, num_rows, d)


def _flat_size(op: str, B: int, S: int) -> int:
    if B * S > INT64_MAX:
        raise ValueError(f"packcuda.{op}: batch size * seqlen ({B} * {S}) overflows int64")
    return B * S


def unpad(
    x: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    lengths: Optional[IntsLike] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Remove padding from ``x`` ``[B, S, ...]``.

    Give either ``attention_mask`` ``[B, S]`` (0/1, any pattern: left or right padding, holes) or host
    ``lengths`` ``[B]`` (right padding). Returns ``(x_packed [T, ...], indices int64 [T], cu_seqlens int32
    [B+1], max_seqlen)``: the rows where the mask is set, in row-major order, their flat positions in
    ``B*S``, the segment boundaries on ``x``'s device, and the longest segment as a Python int — the same
    contract as flash-attn's ``unpad_input``. Differentiable in ``x``.

    Syncs: with host ``lengths``, none. With ``attention_mask`` (device data) one device-to-host read of the
    row counts, because the output size depends on them.
    """
    op = "unpad"
    x = _check_tensor(op, "x", x)
    if x.dim() < 2:
        raise ValueError(f"packcuda.unpad: x must be [B, S, ...], got shape {tuple(x.shape)}")
    B, S = int(x.shape[0]), int(x.shape[1])
    flat = _flat_size(op, B, S)
    if (attention_mask is None) == (lengths is None):
        raise ValueError("packcuda.unpad: give exactly one of attention_mask and lengths")
    if lengths is not None:
        if isinstance(lengths, torch.Tensor):
            _check_tensor(op, "lengths", lengths)
        cu = cu_from_lengths(lengths, "lengths", op=op)  # a device tensor is read back here (one sync)
        if len(cu) - 1 != B:
            raise ValueError(f"packcuda.unpad: lengths has {len(cu) - 1} entries but x has batch size {B}")
        max_seqlen = max(map(operator.sub, cu[1:], cu[:-1]), default=0)
        if max_seqlen > S:
            i = next(i for i in range(B) if cu[i + 1] - cu[i] > S)
            raise ValueError(f"packcuda.unpad: lengths[{i}]={cu[i + 1] - cu[i]} exceeds seqlen {S} (x.shape[1])")
        total = cu[-1]
        cu_host = plain_ints(cu)
        if cu_host is None:
            cu_host = torch.tensor(cu, dtype=torch.int64)
        indices = ops.right_pad_indices(cu_host, S, total, x.device)
    else:
        attention_mask = _check_tensor(op, "attention_mask", attention_mask)
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"packcuda.unpad: attention_mask must have shape {(B, S)}, got {tuple(attention_mask.shape)}"
            )
        if attention_mask.dtype.is_complex:
            raise ValueError(f"packcuda.unpad: attention_mask must be bool, integer or float, got "
                             f"{attention_mask.dtype}")
        _same_device(op, "attention_mask", attention_mask, "x", x)
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        counts = mask.sum(1)
        cu_host = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(counts.cpu(), 0, out=cu_host[1:])  # the one sync of the mask path
        total = int(cu_host[-1])
        indices = ops.mask_indices(mask, cu_host, total)
        max_seqlen = int(cu_host.diff().max()) if B > 0 else 0
    x_packed = _gather(x.reshape(flat, *x.shape[2:]), indices, 0.0)
    cu_seqlens = to_device_async(cu_host, x.device, torch.int32)
    return x_packed, indices, cu_seqlens, max_seqlen


def pad(x_packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: ``[B, S, ...]`` with ``x_packed`` rows at ``indices``, zeros elsewhere.
    Differentiable in ``x_packed``. No sync. ``indices`` (int64, 1-D, one per row of ``x_packed``, on its
    device) must be unique and in ``[-1, B*S)`` (checked on CPU; -1 drops a row)."""
    op = "pad"
    x_packed = _check_tensor(op, "x_packed", x_packed)
    if x_packed.dim() < 1:
        raise ValueError(f"packcuda.pad: x_packed must be [T, ...], got shape {list(x_packed.shape)}")
    indices = _check_index(op, indices, x_packed, "indices", "x_packed")
    if indices.shape[0] != x_packed.shape[0]:
        raise ValueError(f"packcuda.pad: indices has {indices.shape[0]} entries but x_packed has "
                         f"{x_packed.shape[0]} rows")
    B = check_int(op, "batch_size", batch_size, lo=0)
    S = check_int(op, "seqlen", seqlen, lo=0)
    out = _scatter(x_packed, indices, _flat_size(op, B, S))
    return out.view(B, S, *x_packed.shape[1:])


def position_ids(cu_seqlens: IntsLike, *, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """int64 ``[T]``: each token's offset in its segment (restarts at 0 in every segment).

    Host ``cu_seqlens`` with a CUDA ``device``: no sync. A device ``cu_seqlens`` is read back once (one sync:
    the output size depends on it), which also lets its values be checked; the positions go to ``device``
    (an index-less ``"cuda"`` is the current device), else to ``cu_seqlens``'s device."""
    op = "position_ids"
    if isinstance(cu_seqlens, torch.Tensor):
        _check_tensor(op, "cu_seqlens", cu_seqlens)
    dev = resolve_device(op, "device", device)
    meta = op_metadata(cu_seqlens, op=op)
    if meta.device.type != "cpu":
        if dev is None:
            dev = meta.device
        meta = meta.cpu()  # device metadata: the one sync (values and size)
    total = int(meta[-1]) if meta.numel() else 0
    return ops.segment_positions(meta, total, dev)


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: IntsLike, ignore_index: int = -100) -> torch.Tensor:
    """``labels[t] = input_ids[t + 1]`` when t + 1 is in the same segment, else ``ignore_index``: a label
    never crosses into the next sequence. Host or device ``cu_seqlens``; no sync. ``ignore_index`` must be an
    integer that input_ids' dtype (int32 or int64) holds."""
    op = "next_token_labels"
    input_ids = _check_tensor(op, "input_ids", input_ids)
    if isinstance(cu_seqlens, torch.Tensor):
        _check_tensor(op, "cu_seqlens", cu_seqlens)
    ignore_index = check_int(op, "ignore_index", ignore_index)
    return ops.next_token_labels(input_ids, op_metadata(cu_seqlens, op=op), ignore_index)
