"""A training step of a transformers Qwen3-VL model on one packed row, with and without the fused QK norm:
transformers' own path, the packcuda rotary patch (q_norm / k_norm still transformers' modules), and the patch with
``fuse_qk_norm=True`` (norms and rotary in one packcuda.apply_qk_norm_rope pass per layer).

Model: transformers' Qwen3-VL modeling code, 4 text layers at the Qwen3-VL-8B shape (hidden 4096, 32 query heads,
8 KV heads, head_dim 128, MLP 12288, vocab 151936, interleaved mrope_section [24, 20, 20]), random weights, bf16,
sdpa attention; the packed row of bench_hf_step (16384 tokens, samples of 256-2048 tokens, image placeholders
driving the positions; the vision tower is not run).

    python -m benchmarks.bench_hf_step_qknorm [--quick] [--device cuda]

``--quick`` on CPU uses a tiny model (2 layers, hidden 256) and a 512-token row: a smoke test, not a result.
"""
from __future__ import annotations

import torch

import packcuda
from benchmarks.baselines import hf_packed_position_ids
from benchmarks.bench_hf_step import setup
from benchmarks.harness import cli


def _config(tiny: bool):
    from transformers import Qwen3VLConfig

    if tiny:
        text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=128, vocab_size=1024)
    else:
        text = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936)
    text.update(max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                     mrope_interleaved=True))
    vocab = text["vocab_size"]
    cfg = Qwen3VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=text[
        "hidden_size"], intermediate_size=64, num_heads=2, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def run(quick: bool = False, device=None) -> list[dict]:
    from transformers import Qwen3VLForConditionalGeneration

    from packcuda.integrations import transformers as hf

    dev, T, dtype, timer, cfg, model, ids, cu, grids, labels = setup(quick, device, _config,
                                                                     Qwen3VLForConditionalGeneration)
    tc = cfg.text_config
    shape = (f"{tc.num_hidden_layers}L h{tc.hidden_size} ({tc.num_attention_heads},{tc.num_key_value_heads},"
             f"{tc.head_dim}) T={T} N={len(cu) - 1} {str(dtype).replace('torch.', '')}")
    grids_dev = grids.to(dev)
    hf_pos = lambda: hf_packed_position_ids(model, ids, cu, image_grid_thw=grids_dev)  # noqa: E731
    pc_pos = lambda: hf.packed_position_ids(ids, cu, cfg, image_grid_thw=grids, validate=False)  # noqa: E731

    def step(pos_fn):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids[None], position_ids=pos_fn(), labels=labels, use_cache=False)
        out.loss.backward()
        return out.loss.detach()

    rows = []
    loss_hf = step(hf_pos)
    t_hf = timer.median_ms(lambda: step(hf_pos))
    if not hasattr(packcuda, "apply_qk_norm_rope"):
        print("packcuda.apply_qk_norm_rope not in this build: transformers path only")
        return [dict(op="train step", shape=shape, baseline="transformers path", baseline_ms=t_hf)]
    with hf.patch_qwen_vl_rope(model):
        t_rope = timer.median_ms(lambda: step(pc_pos))
    with hf.patch_qwen_vl_rope(model, fuse_qk_norm=True):
        loss_fused = step(pc_pos)
        t_fused = timer.median_ms(lambda: step(pc_pos))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert abs(float(loss_fused) - float(loss_hf)) <= tol * abs(float(loss_hf)), "fused step loss differs"
    rows.append(dict(op="train step, packcuda rotary + fused QK norm", shape=shape, packcuda_ms=t_fused,
                     baseline="transformers path", baseline_ms=t_hf, speedup=t_hf / t_fused))
    rows.append(dict(op="train step, packcuda rotary + fused QK norm", shape=shape, packcuda_ms=t_fused,
                     baseline="packcuda rotary, transformers q_norm / k_norm", baseline_ms=t_rope,
                     speedup=t_rope / t_fused))
    return rows


def main():
    cli(run, "transformers Qwen3-VL packed train step: fused QK norm + rotary vs unfused")


if __name__ == "__main__":
    main()
