"""Packing: remove/restore padding, per-sequence positions, next-token labels, row gathers."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._meta import IntsLike, cu_from_lengths, op_metadata, to_device_async

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
# fake (meta) kernels
# ---------------------------------------------------------------------------------------------------
def _resized(src, dim, n):
    d = dim % src.dim()
    return (*src.shape[:d], n, *src.shape[d + 1:])


@torch.library.register_fake("packcuda::gather_rows")
def _gather_rows_fake(src, index, fill=0.0, dim=0):
    return src.new_empty(_resized(src, dim, index.shape[0]))


@torch.library.register_fake("packcuda::scatter_rows")
def _scatter_rows_fake(src, index, num_rows, dim=0):
    return src.new_empty(_resized(src, dim, num_rows))


@torch.library.register_fake("packcuda::segment_positions")
def _segment_positions_fake(cu_seqlens, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=device if device is not None else cu_seqlens.device)


@torch.library.register_fake("packcuda::next_token_labels")
def _next_token_labels_fake(input_ids, cu_seqlens, ignore_index=-100):
    return torch.empty_like(input_ids)


@torch.library.register_fake("packcuda::right_pad_indices")
def _right_pad_indices_fake(cu_seqlens, seqlen, total, device=None):
    return torch.empty(total, dtype=torch.int64, device=device if device is not None else cu_seqlens.device)


@torch.library.register_fake("packcuda::mask_indices")
def _mask_indices_fake(attention_mask, cu_seqlens, total):
    return torch.empty(total, dtype=torch.int64, device=attention_mask.device)


# ---------------------------------------------------------------------------------------------------
# autograd: a row gather with unique indices and a row scatter are each other's transpose
# ---------------------------------------------------------------------------------------------------
def _gather_setup(ctx, inputs, output):
    src, index, _, dim = inputs
    ctx.save_for_backward(index)
    ctx.dim = dim
    ctx.n_src = src.shape[dim]


def _gather_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return ops.scatter_rows(grad, index, ctx.n_src, ctx.dim), None, None, None


def _scatter_setup(ctx, inputs, output):
    _, index, _, dim = inputs
    ctx.save_for_backward(index)
    ctx.dim = dim


def _scatter_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return ops.gather_rows(grad, index, 0.0, ctx.dim), None, None, None


torch.library.register_autograd("packcuda::gather_rows", _gather_backward, setup_context=_gather_setup)
torch.library.register_autograd("packcuda::scatter_rows", _scatter_backward, setup_context=_scatter_setup)


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
_is_compiling = torch.compiler.is_compiling
_below_autograd = torch._C._AutoDispatchBelowAutograd
_gather_op = ops.gather_rows.default
_scatter_op = ops.scatter_rows.default


def _gather(src: torch.Tensor, index: torch.Tensor, fill: float, dim: int = 0) -> torch.Tensor:
    """The row gather used by every facade. Without a gradient to track (and outside torch.compile) it calls
    the kernel below autograd: the Python autograd kernel that register_autograd installs costs more host time
    per call than the gather itself on small tensors. Same kernel, same result."""
    if (src.requires_grad and torch.is_grad_enabled()) or _is_compiling():
        return ops.gather_rows(src, index, fill, dim)
    with _below_autograd():
        return _gather_op(src, index, fill, dim)


def _scatter(src: torch.Tensor, index: torch.Tensor, num_rows: int, dim: int = 0) -> torch.Tensor:
    """Row scatter with the same fast path as :func:`_gather`."""
    if (src.requires_grad and torch.is_grad_enabled()) or _is_compiling():
        return ops.scatter_rows(src, index, num_rows, dim)
    with _below_autograd():
        return _scatter_op(src, index, num_rows, dim)


def gather_rows(src: torch.Tensor, index: torch.Tensor, fill: float = 0.0, dim: int = 0) -> torch.Tensor:
    """``out[i] = src[index[i]]`` for ``index[i] >= 0``, else a row of ``fill``. Rows are whole slices along
    ``dim`` (default 0) of any dtype and trailing shape, moved with 16-byte vector loads where alignment allows;
    for ``dim > 0`` every slice of the leading dims is gathered in the same launch (``src`` of shape
    ``[A, T, ...]`` gives ``[A, len(index), ...]``; leading dims that collapse to one stride need no copy).
    Differentiable in ``src`` when the non-negative indices are unique (the backward is a row scatter)."""
    return _gather(src, index, float(fill), int(dim))


def scatter_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int, dim: int = 0) -> torch.Tensor:
    """``out = zeros(num_rows, ...)``, ``out[index[i]] = src[i]`` for ``index[i] >= 0`` (rows along ``dim``,
    default 0). Indices must be unique (checked on CPU), which keeps the result deterministic. Differentiable
    in ``src``."""
    return _scatter(src, index, int(num_rows), int(dim))


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
    if x.dim() < 2:
        raise ValueError(f"packcuda.unpad: x must be [B, S, ...], got shape {tuple(x.shape)}")
    B, S = int(x.shape[0]), int(x.shape[1])
    if (attention_mask is None) == (lengths is None):
        raise ValueError("packcuda.unpad: give exactly one of attention_mask and lengths")
    if lengths is not None:
        cu = cu_from_lengths(lengths, "lengths")  # a device tensor is read back here (one sync)
        if len(cu) - 1 != B:
            raise ValueError(f"packcuda.unpad: lengths has {len(cu) - 1} entries but x has batch size {B}")
        total = cu[-1]
        cu_host = torch.tensor(cu, dtype=torch.int64)
        indices = ops.right_pad_indices(cu_host, S, total, x.device)
        max_seqlen = max(b - a for a, b in zip(cu[:-1], cu[1:])) if B > 0 else 0
    else:
        if tuple(attention_mask.shape) != (B, S):
            raise ValueError(
                f"packcuda.unpad: attention_mask must have shape {(B, S)}, got {tuple(attention_mask.shape)}"
            )
        if attention_mask.device != x.device:
            raise ValueError(f"packcuda.unpad: attention_mask is on {attention_mask.device}, x on {x.device}")
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        counts = mask.sum(1)
        cu_host = torch.zeros(B + 1, dtype=torch.int64)
        torch.cumsum(counts.cpu(), 0, out=cu_host[1:])  # the one sync of the mask path
        total = int(cu_host[-1])
        indices = ops.mask_indices(mask, cu_host, total)
        max_seqlen = int(cu_host.diff().max()) if B > 0 else 0
    x_packed = _gather(x.reshape(B * S, *x.shape[2:]), indices, 0.0)
    cu_seqlens = to_device_async(cu_host, x.device, torch.int32)
    return x_packed, indices, cu_seqlens, max_seqlen


def pad(x_packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: ``[B, S, ...]`` with ``x_packed`` rows at ``indices``, zeros elsewhere.
    Differentiable in ``x_packed``. No sync."""
    out = _scatter(x_packed, indices, int(batch_size) * int(seqlen))
    return out.view(int(batch_size), int(seqlen), *x_packed.shape[1:])


def position_ids(cu_seqlens: IntsLike, *, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
    """int64 ``[T]``: each token's offset in its segment (restarts at 0 in every segment).

    Host ``cu_seqlens`` with a CUDA ``device``: no sync. A device ``cu_seqlens`` costs one read of its last
    entry (the output size)."""
    meta = op_metadata(cu_seqlens)
    total = int(meta[-1]) if meta.numel() else 0  # device metadata: one sync for the size
    dev = torch.device(device) if device is not None else meta.device
    return ops.segment_positions(meta, total, dev)


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: IntsLike, ignore_index: int = -100) -> torch.Tensor:
    """``labels[t] = input_ids[t + 1]`` when t + 1 is in the same segment, else ``ignore_index``: a label
    never crosses into the next sequence. Host or device ``cu_seqlens``; no sync."""
    return ops.next_token_labels(input_ids, op_metadata(cu_seqlens), int(ignore_index))
