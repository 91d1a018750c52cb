"""Packed training of transformers' Qwen-VL models with packcuda mRoPE positions and rotary application.

Four pieces, usable separately, one module each (``positions``, ``rope_patch``, ``linear_attention``,
``vision``):

1. :func:`packed_position_ids` — the ``position_ids`` input of a **packed row** (many samples in one row of
   batch size 1) for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: the 4-row form ``[4, 1, T]`` (text positions
   restarting at 0 in every sample, then the t/h/w mRoPE rows) with which transformers detects packed
   sequences (sdpa / eager build a block-causal mask, flash-attention finds ``cu_seqlens``). Computed by
   :func:`packcuda.mrope_position_ids` for the whole pack in one pass, equal to transformers' own
   ``get_rope_index`` run on every sample alone.

2. :func:`patch_qwen_vl_rope` — an opt-in patch that routes the text attention's rotary application through
   :func:`packcuda.apply_rope`, driven by the positions themselves: the rotary module no longer builds the
   ``[3, B, S, D]`` cos/sin tables, and each attention layer rotates q and k in one fused kernel (forward and
   backward). It checks the transformers version and the structure of the code it replaces and refuses
   (:class:`UnsupportedTransformersError`, :class:`UnsupportedModelError`) instead of silently patching nothing.

3. :func:`patch_qwen3_5_linear_attention` — Qwen3.5's GatedDeltaNet layers on packed rows (the conv and the
   gated delta rule stop at every sample boundary) and on context-parallel shards (conv halo rows through
   :func:`packcuda.conv_prefix`, the recurrence through flash-linear-attention's CP context).

4. :func:`patch_qwen_vl_vision` — vision towers under context parallelism: each rank encodes only its share of
   the batch's images and video frames (:func:`packcuda.vision_plan`) and receives the embeddings of the vision
   tokens it holds from the ranks that encoded them.

The two lines a trainer changes::

    from packcuda.integrations.transformers import packed_position_ids, patch_qwen_vl_rope
    patch_qwen_vl_rope(model)                                   # once, after building the model
    ...
    position_ids = packed_position_ids(input_ids, cu_seqlens, model.config,
                                       image_grid_thw=..., video_grid_thw=...)   # per packed batch
    out = model(input_ids=input_ids[None], position_ids=position_ids, pixel_values=..., ...)

Under context parallelism compute the positions on the global stream, then shard them with the plan
(:func:`shard_position_ids`); the patched rotary consumes whatever per-token positions it is given.
"""
from __future__ import annotations

from ._common import (  # noqa: F401
                      PATCHABLE_MODEL_TYPES,
                      SUPPORTED_MODEL_TYPES,
                      SUPPORTED_TRANSFORMERS,
                      UnsupportedModelError,
                      UnsupportedTransformersError,
                      transformers_version,
)
from .linear_attention import LinearAttentionPatch, patch_qwen3_5_linear_attention
from .positions import (  # noqa: F401
                      mm_token_type_ids,
                      packed_position_ids,
                      shard_position_ids,
                      truncates_video_seconds,
                      video_seconds_default,
)
from .rope_patch import RopePatch, is_patched, patch_qwen_vl_rope, unpatch_qwen_vl_rope
from .vision import VisionPatch, patch_qwen_vl_vision, qwen_vl_vision_plan

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedTransformersError",
    "UnsupportedModelError",
    "RopePatch",
    "packed_position_ids",
    "shard_position_ids",
    "mm_token_type_ids",
    "PATCHABLE_MODEL_TYPES",
    "patch_qwen_vl_rope",
    "unpatch_qwen_vl_rope",
    "is_patched",
    "LinearAttentionPatch",
    "patch_qwen3_5_linear_attention",
    "VisionPatch",
    "patch_qwen_vl_vision",
    "qwen_vl_vision_plan",
]
