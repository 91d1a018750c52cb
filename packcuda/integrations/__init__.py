"""Integrations of packcuda with training frameworks.

- :mod:`packcuda.integrations.transformers`: packed training of Hugging Face transformers' Qwen-VL models
  (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) with packcuda mRoPE positions and rotary application, and Qwen3.5's
  linear-attention (GatedDeltaNet) layers on packed samples and context-parallel shards.
- :mod:`packcuda.integrations.megatron`: Megatron-core THD context parallelism (``PackedSeqParams`` and the
  per-rank batch) from a packcuda shard plan.

Submodules import their framework lazily: importing this package never imports transformers or
megatron-core.
"""
