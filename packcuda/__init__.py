"""packcuda: packed-sequence data ops for context-parallel training, on CPU and CUDA.

Ops live in ``torch.ops.packcuda``; this package loads them and adds typed Python functions with fake
(meta) kernels and autograd formulas, so everything also works under ``torch.compile(fullgraph=True)``.
"""
from ._lib import built_with_cuda, cmake_prefix_path, library_path
from ._lib import load as _load

_load()

from .pack import gather_rows, next_token_labels, pad, position_ids, scatter_rows, unpad  # noqa: E402
from .shard import ShardPlan, shard_plan  # noqa: E402
from .balance import balance_across_ranks, plan_micro_batches, sequence_workloads  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "built_with_cuda",
    "cmake_prefix_path",
    "library_path",
    "gather_rows",
    "scatter_rows",
    "unpad",
    "pad",
    "position_ids",
    "next_token_labels",
    "ShardPlan",
    "shard_plan",
    "plan_micro_batches",
    "balance_across_ranks",
    "sequence_workloads",
]

from .rope import apply_rope, apply_rope_, default_inv_freq, rope_kwargs_from_config  # noqa: E402

__all__ += ["apply_rope", "apply_rope_", "default_inv_freq", "rope_kwargs_from_config"]
from .mrope import MRopeSpec, mrope_position_ids  # noqa: E402

__all__ += ["MRopeSpec", "mrope_position_ids"]
from .conv import causal_conv1d, conv_prefix, conv_prefix_schedule, ConvPrefixSchedule  # noqa: E402

__all__ += ["causal_conv1d", "conv_prefix", "conv_prefix_schedule", "ConvPrefixSchedule"]
from . import integrations  # noqa: E402  (framework integrations; importing it never imports transformers)

__all__ += ["integrations"]
