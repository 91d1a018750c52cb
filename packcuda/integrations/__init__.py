"""Integrations of packcuda with training frameworks.

- :mod:`packcuda.integrations.transformers`: packed training of Hugging Face transformers' Qwen-VL models
  (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) with packcuda mRoPE positions and rotary application.

Submodules import their framework lazily: importing this package never imports transformers.
"""
