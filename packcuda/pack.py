"""Packing: remove/restore padding, per-sequence positions, next-token labels, row gathers."""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional, Tuple, Union

import torch

from . import _lib
from ._meta import (
    INT64_MAX,
    IntsLike,
    check_int,
    cu_from_lengths,
    fake_kernel,
    op_metadata,
    output_device,
    plain_ints,
    resolve_device,
    to_device_async,
)

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
# fake (meta) kernels: the same shape and device rules as the kernels (devices: _meta.fake_kernel)
# ---------------------------------------------------------------------------------------------------
def _resized(src, dim, n):
    d = dim % src.dim()
    return (*src.shape[:d], n, *src.shape[d + 1:])


def _fake_rows(op, src, index, dim):
    d = _check_dim(op, "src", src, dim)
    _index_rules(op, index, src)
    return d


@fake_kernel("gather_rows")
def _gather_rows_fake(src, index, fill=0.0, dim=0, fill_int=None):
    d = _fake_rows("gather_rows", src, index, dim)
    return src.new_empty(_resized(src, d, index.shape[0]))


@fake_kernel("scatter_rows")
def _scatter_rows_fake(src, index, num_rows, dim=0):
    d = _fake_rows("scatter_rows", src, index, dim)
    if num_rows < 0:
        raise ValueError(f"packcuda.scatter_rows: num_rows must be >= 0, got {num_rows}")
    return src.new_empty(_resized(src, d, num_rows))


@fake_kernel("segment_positions", host=["cu_seqlens"])
def _segment_positions_fake(cu_seqlens, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=output_device("segment_positions", cu_seqlens, device))


@fake_kernel("next_token_labels", host=["cu_seqlens"])
def _next_token_labels_fake(input_ids, cu_seqlens, ignore_index=-100):
    return torch.empty_like(input_ids, memory_format=torch.contiguous_format)


@fake_kernel("right_pad_indices", host=["cu_seqlens"])
def _right_pad_indices_fake(cu_seqlens, seqlen, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=output_device("right_pad_indices", cu_seqlens, device))


@fake_kernel("mask_indices", host=["cu_seqlens"])
def _mask_indices_fake(attention_mask, cu_seqlens, total):
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
    """Gather whole rows along ``dim``: ``out[i] = src[index[i]]``, a row of ``fill`` where ``index[i] == -1``.

    Rows are whole slices along ``dim`` of any dtype and trailing shape, moved with 16-byte vector loads where
    alignment allows; for ``dim > 0`` every slice of the leading dims is gathered in the same launch (``src``
    ``[A, T, ...]`` gives ``[A, len(index), ...]``; leading dims that collapse to one stride need no copy).
    Differentiable in ``src`` when the non-negative indices are unique (the backward is a row scatter).

    Args:
        src: ``[..., T, ...]`` (``T`` along ``dim``), any dtype, CPU or CUDA.
        index: int64 ``[N]`` on ``src``'s device, values in ``[-1, T)`` (checked on CPU, trusted on CUDA:
            no sync).
        fill: the value of the rows where ``index`` is -1; one ``src``'s dtype holds: 0/1 for bool, an
            integral value in range for integer dtypes (exact, also beyond 2**53 for int64), any float
            (NaN, inf too) for floating dtypes.
        dim: the dimension the rows run along.

    Returns:
        ``src``'s shape with ``N`` rows along ``dim``, ``src``'s dtype and device. No sync.
    """
    op = "gather_rows"
    src = _check_tensor(op, "src", src)
    d = _check_dim(op, "src", src, dim)
    index = _check_index(op, index, src)
    return _gather(src, index, _fill_arg(op, fill), d)


def scatter_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int, dim: int = 0) -> torch.Tensor:
    """Scatter whole rows along ``dim``: ``out[index[i]] = src[i]`` where ``index[i] >= 0``, zeros elsewhere.

    Indices must be unique, which keeps the result deterministic. Differentiable in ``src``.

    Args:
        src: ``[..., N, ...]`` (``N`` along ``dim``), any dtype, CPU or CUDA.
        index: int64 ``[N]`` on ``src``'s device, unique values in ``[-1, num_rows)`` (-1 drops the row;
            checked on CPU, trusted on CUDA: no sync).
        num_rows: the number of rows of the output along ``dim``.
        dim: the dimension the rows run along.

    Returns:
        ``src``'s shape with ``num_rows`` rows along ``dim``, ``src``'s dtype and device. No sync.
    """
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
    """Remove the padding of ``x``: its rows where the mask is set, packed in row-major order.

    Give either ``attention_mask`` (any pattern: left or right padding, holes) or host ``lengths`` (right
    padding). The same contract as flash-attn's ``unpad_input``. Differentiable in ``x``.

    Args:
        x: ``[B, S, ...]``, any dtype, CPU or CUDA.
        attention_mask: ``[B, S]`` 0/1 (bool or integer) on ``x``'s device. Syncs once: the output size
            depends on the row counts, which are read back.
        lengths: host ``[B]`` (list, numpy array or CPU tensor) of lengths in ``[0, S]``, right padding. No
            sync.

    Returns:
        x_packed: ``[T, ...]``, ``x``'s dtype and device.
        indices: int64 ``[T]`` on ``x``'s device, each row's flat position in ``B*S``.
        cu_seqlens: int32 ``[B + 1]`` on ``x``'s device, the segment boundaries.
        max_seqlen: Python int, the longest segment.
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
    """Inverse of ``unpad``: ``x_packed``'s rows placed at ``indices`` of a padded batch, zeros elsewhere.

    Differentiable in ``x_packed``.

    Args:
        x_packed: ``[T, ...]``, any dtype, CPU or CUDA.
        indices: int64 ``[T]`` on ``x_packed``'s device, unique values in ``[-1, batch_size * seqlen)`` (-1
            drops a row; checked on CPU, trusted on CUDA: no sync).
        batch_size: ``B`` of the output.
        seqlen: ``S`` of the output.

    Returns:
        ``[B, S, ...]``, ``x_packed``'s dtype and device. No sync.
    """
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
    """Each token's offset in its segment, restarting at 0 in every segment.

    Args:
        cu_seqlens: ``[N + 1]`` integer segment boundaries, non-decreasing from 0: host (list, tuple, numpy
            array, CPU tensor; checked on the host, no sync) or a device tensor (read back once: one sync, as
            the output size depends on it; its values are then checked too).
        device: where the positions go (an index-less ``"cuda"`` is the current device); default:
            ``cu_seqlens``'s device.

    Returns:
        int64 ``[T]`` (``T = cu_seqlens[-1]``) on ``device``. No sync with host ``cu_seqlens``.
    """
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
    """Next-token labels that never cross a sequence boundary.

    ``labels[t] = input_ids[t + 1]`` when ``t + 1`` is in the same segment, else ``ignore_index``.

    Args:
        input_ids: int32 or int64 ``[T]``, CPU or CUDA.
        cu_seqlens: ``[N + 1]`` segment boundaries (host or device, ending at ``T``).
        ignore_index: the label of each segment's last token; an integer ``input_ids``' dtype holds.

    Returns:
        ``[T]``, ``input_ids``' dtype and device. No sync (host or device ``cu_seqlens``).
    """
    op = "next_token_labels"
    input_ids = _check_tensor(op, "input_ids", input_ids)
    if isinstance(cu_seqlens, torch.Tensor):
        _check_tensor(op, "cu_seqlens", cu_seqlens)
    ignore_index = check_int(op, "ignore_index", ignore_index)
    return ops.next_token_labels(input_ids, op_metadata(cu_seqlens, op=op), ignore_index)
