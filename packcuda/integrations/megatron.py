"""THD context parallelism for Megatron-core trainers from a packcuda shard plan, without TransformerEngine glue.

Megatron-core's packed (THD) path expects each CP rank to hold, for every sequence padded to a multiple of
``2*cp``, the chunks ``r`` and ``2*cp-1-r`` (TransformerEngine's ``thd_get_partitioned_indices``), and a
``PackedSeqParams`` describing the global stream for TE's attention. A zigzag :func:`packcuda.shard_plan`
of the packed stream describes exactly that split, so:

- :func:`packed_seq_params` — ``megatron.core.packed_seq_params.PackedSeqParams`` of the plan (``qkv_format
  "thd"``, global ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` int32 on the plan's device, the padded
  ``max_seqlen_q/kv``; ``total_tokens`` and ``seq_idx`` where the installed megatron-core has those fields);
- :func:`thd_batch_on_this_cp_rank` — this rank's ``tokens``, ``labels``, ``loss_mask`` and ``position_ids``
  from the *unpadded* packed batch, with labels built per sequence before the split when the batch has
  none. It takes the batch dicts megatron-core's ``get_batch_on_this_tp_rank`` makes (0.19 adds
  ``local_cp_size`` and ``hybrid_cp_group``, None without hybrid CP; pipeline stages carry None for the
  tensors they do not need) and mRoPE position ids in the trainer's form (``[3, 1, T]``, ``[4, 1, T]``).
  No host sync: every tensor is one gather with the plan's device index.

Equal, on every slot, to megatron-core's own THD split (``get_thd_batch_on_this_cp_rank`` in 0.16.1, the
per-document ``get_batch_on_this_cp_rank`` in 0.19) run on the stream padded the Megatron way (pads at each
sequence's tail, positions counting on through them, loss mask 0, labels ``ignore_index``). Verified against
megatron-core 0.16.1 and 0.19.2 (``tests/test_megatron_integration.py``). megatron-core is imported lazily,
only by :func:`packed_seq_params`; ``pip install packcuda[megatron]``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

import packcuda
from packcuda._meta import check_int

__all__ = ["VERIFIED_MEGATRON_CORE", "packed_seq_params", "thd_batch_on_this_cp_rank"]

# megatron-core releases whose PackedSeqParams / THD batch split these helpers were tested against
VERIFIED_MEGATRON_CORE = ("0.16.1", "0.19.2")

# keys megatron-core's THD split passes through unchanged
_PASS_THROUGH = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
# hybrid context parallelism (megatron-core >= 0.19): None unless the trainer runs it
_HYBRID_CP = ("local_cp_size", "hybrid_cp_group")
_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask") + _PASS_THROUGH + _HYBRID_CP


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
        host int, the longest padded sequence (no ``.item()``); ``total_tokens`` (the padded total) and ``seq_idx``
        (int32 ``[1, total_padded]``, the segment of every padded slot, as megatron-core derives it) when the
        installed ``PackedSeqParams`` has those fields. No sync (the host copies are uploaded without waiting).
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
    p = PackedSeqParams(**kw)
    fields = {f.name for f in dataclasses.fields(PackedSeqParams)}
    if "total_tokens" in fields:
        # Set after construction: given to the constructor, megatron-core >= 0.19 derives seq_idx from the
        # device boundaries with a repeat_interleave that waits on the device. The same seq_idx (int32
        # [1, total_padded], the segment of every padded slot) comes from the plan's host boundaries here.
        p.total_tokens = int(plan.total_padded)
        if "seq_idx" in fields:
            cup = torch.tensor(plan.cu_seqlens_padded_host, dtype=torch.int64)
            seq_idx = torch.repeat_interleave(torch.arange(len(cup) - 1, dtype=torch.int32), cup.diff())
            p.seq_idx = packcuda._meta.to_device_async(seq_idx[None], dev)
    return p


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
            ``[3, 1, T]`` / ``[4, 1, T]`` (Megatron VLM trainers' ``[3, B, S]`` with B = 1), ``[3, T]`` / ``[4, T]``
            or ``[1, R, T]``, int32 or int64, ``attention_mask`` None (THD has no mask), and the pass-through keys
            ``cu_seqlens`` / ``cu_seqlens_padded`` / ``max_seqlen`` (returned unchanged); tensors on the plan's
            device. ``local_cp_size`` and ``hybrid_cp_group`` (megatron-core >= 0.19) must be None and are
            returned as None: hybrid context parallelism splits each sample over a group of ``local_cp_size``
            ranks picked per micro-batch, not the plan's ranks, and is refused. Pipeline stages' batches work
            too: a tensor may be None (the later stages carry no ``tokens`` and ``position_ids``).
        plan: a zigzag ``packcuda.ShardPlan`` of the stream.
        pad_token_id: the token of pad slots.
        ignore_index: the label of pad slots and of each sequence's last token.

    Returns:
        A new dict, every tensor on the plan's device (no sync): ``tokens`` ``[1, T_local]``, the local tokens
            (``pad_token_id`` on pad slots); ``labels`` ``[1, T_local]``, the given labels sharded
            (``ignore_index`` on pads) or, when the batch has none, the next token of the same sequence built on
            the whole stream before the split (``ignore_index`` at each sequence's last token and on pads),
            correct at every chunk boundary; ``loss_mask`` ``[1, T_local]``, the given mask sharded (0 on pads)
            or ``labels != ignore_index`` as float; ``position_ids`` with ``T_local`` tokens in the form given,
            sharded with ``ShardPlan.shard_positions`` (pads continue counting through each sequence's tail, as
            Megatron's padded stream does), built per sequence from 0 when absent and the batch has tokens;
            ``attention_mask`` None. A tensor that cannot be built (no tokens, no labels) is None.
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
    for k in _HYBRID_CP:
        if batch.get(k) is not None:
            raise ValueError(f"packcuda.{op}: batch[{k!r}] is set: hybrid context parallelism (megatron-core's "
                             "is_hybrid_cp) splits each sample over its own group of local_cp_size ranks, which "
                             "this split over the plan's cp_size ranks does not do; it takes batches made "
                             "without hybrid CP (local_cp_size and hybrid_cp_group None)")
    tokens, labels, loss_mask, pos = (batch.get(k) for k in ("tokens", "labels", "loss_mask", "position_ids"))
    if tokens is not None:
        tokens = _rows(op, "tokens", tokens, plan)
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"packcuda.{op}: batch['tokens'] must be an integer tensor, got {tokens.dtype}")
    if labels is not None:
        labels = _rows(op, "labels", labels, plan)
    if loss_mask is not None:
        loss_mask = _rows(op, "loss_mask", loss_mask, plan)
    if pos is not None:
        local_pos = plan._shard_positions(op, "batch['position_ids']", pos)
    elif tokens is not None:
        local_pos = plan.position_ids[None]
    else:
        local_pos = None
    # the pass-through keys as given (the hybrid CP ones are None here)
    out: Dict[str, Optional[torch.Tensor]] = {k: batch[k] for k in _PASS_THROUGH + _HYBRID_CP if k in batch}
    out["attention_mask"] = None
    out["tokens"] = None if tokens is None else plan.shard(tokens, fill=pad_token_id)[None]
    if labels is not None:
        local_labels = plan.shard(labels, fill=ignore_index)
    elif tokens is not None:
        local_labels = plan.labels(tokens, ignore_index=ignore_index)
    else:
        local_labels = None
    out["labels"] = None if local_labels is None else local_labels[None]
    if loss_mask is not None:
        out["loss_mask"] = plan.shard(loss_mask, fill=0)[None]
    elif local_labels is not None:
        out["loss_mask"] = (local_labels != ignore_index).to(torch.float32)[None]
    else:
        out["loss_mask"] = None
    out["position_ids"] = local_pos
    return out
