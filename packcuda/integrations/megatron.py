"""THD context parallelism for Megatron-core trainers from a packcuda shard plan, without TransformerEngine glue.

Megatron-core's packed (THD) path expects each CP rank to hold, for every sequence padded to a multiple of
``2*cp``, the chunks ``r`` and ``2*cp-1-r`` (TransformerEngine's ``thd_get_partitioned_indices``), and a
``PackedSeqParams`` describing the global stream for TE's attention. A zigzag :func:`packcuda.shard_plan`
of the packed stream describes exactly that split, so:

- :func:`packed_seq_params` — ``megatron.core.packed_seq_params.PackedSeqParams`` of the plan (``qkv_format
  "thd"``, global ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` int32 on the plan's device, the padded
  ``max_seqlen_q/kv``; ``total_tokens`` where the installed megatron-core has that field);
- :func:`thd_batch_on_this_cp_rank` — this rank's ``tokens``, ``labels``, ``loss_mask`` and ``position_ids``
  from the *unpadded* packed batch, with labels built per sequence before the split when the batch has
  none. No host sync: every tensor is one gather with the plan's device index.

Equal, on every slot, to megatron-core's own ``get_thd_batch_on_this_cp_rank`` (megatron-core 0.16.1; its
per-document ``get_batch_on_this_cp_rank`` in later releases) run on the stream padded the Megatron way
(pads at each sequence's tail, positions counting on through them, loss mask 0, labels ``ignore_index``).
Verified against megatron-core 0.16.1 (``tests/test_megatron_integration.py``). megatron-core is imported
lazily, only by :func:`packed_seq_params`; ``pip install packcuda[megatron]``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

import packcuda
from packcuda._meta import check_int

__all__ = ["VERIFIED_MEGATRON_CORE", "packed_seq_params", "thd_batch_on_this_cp_rank"]

# megatron-core releases whose PackedSeqParams / THD batch split these helpers were tested against
VERIFIED_MEGATRON_CORE = ("0.16.1",)

# keys megatron-core's THD split passes through unchanged
_PASS_THROUGH = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask") + _PASS_THROUGH


def _check_plan(op: str, plan) -> None:
    if not isinstance(plan, packcuda.ShardPlan):
        raise TypeError(f"packcuda.{op}: plan must be a packcuda.ShardPlan, got {type(plan).__name__}")
    if plan.layout != "zigzag":
        raise ValueError(f"packcuda.{op}: plan has layout {plan.layout!r}; Megatron-core's THD context parallelism "
                         "(TransformerEngine's partition) is the 'zigzag' layout")


def _cu_seqlens_q(plan) -> list:
    """The real sequence boundaries with one entry per padded segment: the bucket segment (when the plan has
    one) is an empty sequence whose padded length is the bucket pad."""
    cu = list(plan.cu_seqlens_host)
    extra = len(plan.cu_seqlens_padded_host) - len(cu)
    return cu + [cu[-1]] * extra


def packed_seq_params(plan):
    """Megatron-core's ``PackedSeqParams`` of a zigzag shard plan, for TransformerEngine's THD attention.

    Boundaries are global, as TransformerEngine's CP attention takes them. megatron-core is imported here, lazily
    (``pip install packcuda[megatron]``).

    Args:
        plan: a zigzag ``packcuda.ShardPlan`` of the packed stream.

    Returns:
        ``megatron.core.packed_seq_params.PackedSeqParams`` with ``qkv_format="thd"``; ``cu_seqlens_q`` =
        ``cu_seqlens_kv``: int32 ``[N' + 1]`` on the plan's device, the real boundaries of the global stream (a
        bucket segment appears as an empty sequence); ``cu_seqlens_q_padded`` = ``cu_seqlens_kv_padded``: int32
        ``[N' + 1]`` on the plan's device, ``plan.cu_seqlens_padded``; ``max_seqlen_q`` = ``max_seqlen_kv``: a
        host int, the longest padded sequence (no ``.item()``); ``total_tokens`` (the padded total) when the
        installed ``PackedSeqParams`` has that field. No sync (the host copies are uploaded without waiting).
    """
    op = "megatron.packed_seq_params"
    _check_plan(op, plan)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError as e:
        raise ImportError(f"packcuda.{op}: needs megatron-core (pip install packcuda[megatron]): {e}") from e
    import dataclasses

    dev = plan.device
    cu_q = packcuda._meta.to_device_async(torch.tensor(_cu_seqlens_q(plan), dtype=torch.int32), dev)
    cu_p = plan.cu_seqlens_padded.to(torch.int32)
    kw = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q, cu_seqlens_q_padded=cu_p,
              cu_seqlens_kv_padded=cu_p, max_seqlen_q=int(plan.max_seqlen_padded),
              max_seqlen_kv=int(plan.max_seqlen_padded))
    fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    if "total_tokens" in fields:
        kw["total_tokens"] = int(plan.total_padded)
    return PackedSeqParams(**kw)


def _rows(op: str, name: str, v, plan) -> torch.Tensor:
    """``v`` as ``[1, T]`` or ``[T]`` (returned as ``[T]``), checked."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"packcuda.{op}: batch[{name!r}] must be a tensor, got {type(v).__name__}")
    if v.dim() == 2 and v.shape[0] == 1:
        v = v[0]
    if v.dim() != 1 or v.shape[0] != plan.total:
        raise ValueError(f"packcuda.{op}: batch[{name!r}] must be [1, T] or [T] with T = {plan.total} tokens of the "
                         f"plan, got shape {tuple(v.shape)}")
    if v.device != plan.device:
        raise ValueError(f"packcuda.{op}: batch[{name!r}] is on {v.device}, but the plan is on {plan.device}")
    return v


def thd_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]], plan, *, pad_token_id: int = 0,
                              ignore_index: int = -100) -> Dict[str, Optional[torch.Tensor]]:
    """This CP rank's part of a packed Megatron batch, from a zigzag shard plan of it.

    Equal to megatron-core's ``get_thd_batch_on_this_cp_rank`` on the Megatron-padded stream.

    Args:
        batch: the **unpadded** packed stream of the plan's ``T`` tokens: ``tokens`` ``[1, T]`` (or ``[T]``),
            optionally ``labels`` and ``loss_mask`` (same shape), ``position_ids`` ``[1, T]`` / ``[T]`` or mRoPE
            ``[3, T]`` / ``[4, T]``, ``attention_mask`` None (THD has no mask), and the pass-through keys
            ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen`` (returned unchanged); tensors on the plan's
            device.
        plan: a zigzag ``packcuda.ShardPlan`` of the stream.
        pad_token_id: the token of pad slots.
        ignore_index: the label of pad slots and of each sequence's last token.

    Returns:
        A new dict, every tensor on the plan's device (no sync): ``tokens`` ``[1, T_local]``, the local tokens
            (``pad_token_id`` on pad slots); ``labels`` ``[1, T_local]``, the given labels sharded
            (``ignore_index`` on pads) or, when the batch has none, the next token of the same sequence built on
            the whole stream before the split (``ignore_index`` at each sequence's last token and on pads),
            correct at every chunk boundary; ``loss_mask`` ``[1, T_local]``, the given mask sharded (0 on pads)
            or ``labels != ignore_index`` as float; ``position_ids`` ``[R, T_local]`` as given (R = 1, 3 or 4),
            sharded with ``ShardPlan.shard_positions`` (pads continue counting through each sequence's tail, as
            Megatron's padded stream does), built per sequence from 0 when absent; ``attention_mask`` None.
    """
    op = "megatron.thd_batch_on_this_cp_rank"
    _check_plan(op, plan)
    if not isinstance(batch, dict):
        raise TypeError(f"packcuda.{op}: batch must be a dict of tensors, got {type(batch).__name__}")
    unknown = [k for k in batch if k not in _KEYS]
    if unknown:
        raise ValueError(f"packcuda.{op}: batch has keys {unknown} this split does not know; known: {list(_KEYS)}")
    pad_token_id = check_int(op, "pad_token_id", pad_token_id)
    ignore_index = check_int(op, "ignore_index", ignore_index)
    if batch.get("attention_mask") is not None:
        raise ValueError(f"packcuda.{op}: batch['attention_mask'] must be None for packed (THD) batches")
    if batch.get("tokens") is None:
        raise ValueError(f"packcuda.{op}: batch['tokens'] is missing")
    tokens = _rows(op, "tokens", batch["tokens"], plan)
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"packcuda.{op}: batch['tokens'] must be an integer tensor, got {tokens.dtype}")
    labels = batch.get("labels")
    loss_mask = batch.get("loss_mask")
    pos = batch.get("position_ids")
    if labels is not None:
        labels = _rows(op, "labels", labels, plan)
    if loss_mask is not None:
        loss_mask = _rows(op, "loss_mask", loss_mask, plan)
    if pos is not None:
        if not isinstance(pos, torch.Tensor):
            raise TypeError(f"packcuda.{op}: batch['position_ids'] must be a tensor, got {type(pos).__name__}")
        if pos.dim() != 2 or pos.shape[0] not in (1, 3, 4):
            raise ValueError(f"packcuda.{op}: batch['position_ids'] must be [1, T], [3, T] or [4, T], got shape "
                             f"{tuple(pos.shape)}")
        if pos.device != plan.device:
            raise ValueError(f"packcuda.{op}: batch['position_ids'] is on {pos.device}, but the plan is on "
                             f"{plan.device}")
    out: Dict[str, Optional[torch.Tensor]] = {k: batch[k] for k in _PASS_THROUGH if k in batch}
    out["attention_mask"] = None
    out["tokens"] = plan.shard(tokens, fill=pad_token_id)[None]
    if labels is None:
        local_labels = plan.labels(tokens, ignore_index=ignore_index)
    else:
        local_labels = plan.shard(labels, fill=ignore_index)
    out["labels"] = local_labels[None]
    if loss_mask is None:
        out["loss_mask"] = (local_labels != ignore_index).to(torch.float32)[None]
    else:
        out["loss_mask"] = plan.shard(loss_mask, fill=0)[None]
    if pos is None:
        out["position_ids"] = plan.position_ids[None]
    else:
        out["position_ids"] = plan.shard_positions(pos)
    return out
