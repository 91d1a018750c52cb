"""packcuda: packed-sequence data ops for context-parallel training, on CPU and CUDA.

Ops live in ``torch.ops.packcuda``; this package loads them and adds typed Python functions with fake
(meta) kernels and autograd formulas, so everything also works under ``torch.compile(fullgraph=True)``.
Modules mirror the capabilities: ``pack`` (packing), ``shard`` (CP shard plans), ``exchange`` (the row exchange
between CP ranks that the plan-driven moves run on), ``mrope`` / ``rope`` (mRoPE positions, rotary application),
``conv`` (conv-prefix exchange, varlen causal conv1d), ``balance`` (micro-batch planning), ``vision`` (vision
towers under CP), ``integrations`` (transformers drop-in).
"""
from ._lib import built_with_cuda, cmake_prefix_path, library_path
from ._lib import load as _load

_load()

from .pack import gather_rows, next_token_labels, pad, position_ids, scatter_rows, unpad  # noqa: E402
from . import exchange  # noqa: E402  (the row exchange: packcuda.exchange.exchange_rows, RowSchedule, ...)
from .shard import ShardPlan, StaticShardPlan, shard_plan, static_shard_plan  # noqa: E402
from .mrope import MRopeSpec, mrope_position_ids  # noqa: E402
from .rope import (apply_qk_norm_rope, apply_qk_norm_rope_, apply_rope, apply_rope_, default_inv_freq,  # noqa: E402
                   rope_kwargs_from_config)
from .conv import ConvPrefixSchedule, causal_conv1d, conv_prefix, conv_prefix_schedule  # noqa: E402
from .balance import balance_across_ranks, plan_micro_batches, sequence_workloads  # noqa: E402
from .vision import VisionPlan, vision_plan  # noqa: E402
from . import integrations  # noqa: E402  (importing it never imports transformers)

__version__ = "0.1.0"

__all__ = [
    "built_with_cuda", "cmake_prefix_path", "library_path",
    # packing
    "gather_rows", "scatter_rows", "unpad", "pad", "position_ids", "next_token_labels",
    # shard plans
    "ShardPlan", "shard_plan", "StaticShardPlan", "static_shard_plan",
    # mRoPE positions and rotary application
    "MRopeSpec", "mrope_position_ids", "apply_rope", "apply_rope_", "apply_qk_norm_rope", "apply_qk_norm_rope_",
    "default_inv_freq", "rope_kwargs_from_config",
    # conv-prefix exchange
    "causal_conv1d", "conv_prefix", "conv_prefix_schedule", "ConvPrefixSchedule",
    # micro-batch planning
    "plan_micro_batches", "balance_across_ranks", "sequence_workloads",
    # vision work under context parallelism
    "VisionPlan", "vision_plan",
    "integrations", "exchange",
]
