"""The transformers model families packcuda knows, in one table: per ``model_type``, what each module needs.

- :func:`packcuda.rope_kwargs_from_config`: the rotary layout (default ``mrope_section``, sectioned or
  interleaved, whether ``partial_rotary_factor`` is honoured);
- :meth:`packcuda.MRopeSpec.from_hf_config`: the mRoPE position rules (video blocks, video seconds);
- :mod:`packcuda.integrations.transformers`: the modeling code the rotary patch replaces.

Plain data: importing it imports nothing of transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Family:
    model_type: str
    # rotary layout: the rotary module's default mrope_section (None: plain RoPE, positions [B, S]), its
    # frequency layout (interleaved: Qwen3-VL, Qwen3.5; sectioned: Qwen2/2.5-VL) and whether it honours
    # partial_rotary_factor (Qwen2/2.5-VL and Qwen3-VL rotate the whole head whatever the factor says)
    mrope_section: Optional[Tuple[int, int, int]]
    interleaved: bool
    partial_rotary: bool
    # mRoPE positions: "whole" (one block per video) or "per_frame" (one block per temporal patch); whether
    # get_rope_index takes second_per_grid_ts (with vision_config.tokens_per_second: Qwen2.5-VL)
    video_frames: str
    video_seconds: bool
    # modeling code the transformers integration patches (module, text model, rotary and attention classes;
    # per-head q_norm / k_norm as (norm class, packcuda norm kind, eps attribute), () when none); "" when the
    # integration patches none of this family
    module: str = ""
    text_model: str = ""
    rotary: str = ""
    attention: str = ""
    qk_norm: Tuple[str, ...] = ()

    @property
    def mrope(self) -> bool:
        """Positions [3, B, S] (mRoPE); False: plain RoPE, positions [B, S]."""
        return self.mrope_section is not None


_M = "transformers.models."
_Q3VL_NORM = ("Qwen3VLTextRMSNorm", "rms", "variance_epsilon")
FAMILIES: Tuple[Family, ...] = (
    Family("qwen2_vl", (16, 24, 24), False, False, "whole", False, _M + "qwen2_vl.modeling_qwen2_vl",
           "Qwen2VLTextModel", "Qwen2VLRotaryEmbedding", "Qwen2VLAttention"),
    Family("qwen2_5_vl", (16, 24, 24), False, False, "whole", True, _M + "qwen2_5_vl.modeling_qwen2_5_vl",
           "Qwen2_5_VLTextModel", "Qwen2_5_VLRotaryEmbedding", "Qwen2_5_VLAttention"),
    Family("qwen3_vl", (24, 20, 20), True, False, "per_frame", False, _M + "qwen3_vl.modeling_qwen3_vl",
           "Qwen3VLTextModel", "Qwen3VLTextRotaryEmbedding", "Qwen3VLTextAttention", _Q3VL_NORM),
    Family("qwen3_vl_moe", (24, 20, 20), True, False, "per_frame", False),
    Family("qwen3_5", (11, 11, 10), True, True, "per_frame", False, _M + "qwen3_5.modeling_qwen3_5",
           "Qwen3_5TextModel", "Qwen3_5TextRotaryEmbedding", "Qwen3_5Attention",
           ("Qwen3_5RMSNorm", "rms_offset", "eps")),
    Family("qwen3_5_moe", (11, 11, 10), True, True, "per_frame", False),
    # text-only: plain RoPE driven by [B, S] position_ids (the rotary patch, not the positions)
    Family("qwen3", None, False, True, "whole", False, _M + "qwen3.modeling_qwen3", "Qwen3Model",
           "Qwen3RotaryEmbedding", "Qwen3Attention", ("Qwen3RMSNorm", "rms", "variance_epsilon")),
)

# the mRoPE families by model_type (the configs MRopeSpec.from_hf_config reads)
MROPE_FAMILIES: Dict[str, Family] = {f.model_type: f for f in FAMILIES if f.mrope}


def rotary_family(model_type: str) -> Optional[Family]:
    """The mRoPE family whose rotary layout a text config of `model_type` has: the family's own model_type or
    one of its sub-configs (``qwen3_vl_text``, ``qwen3_5_moe_text``, ...); None for any other model."""
    return next((f for f in MROPE_FAMILIES.values() if model_type == f.model_type
                 or model_type.startswith(f.model_type + "_")), None)
