"""A training step of a transformers Qwen2.5-VL model on one packed row: packcuda positions + rotary vs
transformers' own path (``get_rope_index`` per sample + eager rotary).

Model: transformers' Qwen2.5-VL modeling code, 4 text layers at the Qwen2.5-VL-7B shape (hidden 3584, 28 query
heads, 4 KV heads, head_dim 128, MLP 18944, vocab 152064, mrope_section [16, 24, 24]), random weights, bf16,
sdpa attention. The packed row: 16384 tokens of samples of 256-2048 tokens, some with images (their placeholder
tokens and grids drive the positions; the vision tower is not run, so pixels do not enter the timing).

Each step: positions for the packed row, forward, cross-entropy loss, backward. Reported: step time of both
paths, and the part of it spent in positions + rotary (measured separately: positions alone; rotary forward +
backward of q and k for all layers alone).

    python -m benchmarks.bench_hf_step [--quick] [--device cuda]

``--quick`` on CPU uses a tiny model (2 layers, hidden 256) and a 512-token row: a smoke test, not a result.
"""
from __future__ import annotations

import importlib
import random

import torch

import packcuda
from benchmarks.baselines import hf_packed_position_ids
from benchmarks.harness import Timer, cli


def _config(tiny: bool):
    from transformers import Qwen2_5_VLConfig

    if tiny:
        text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=1024)
    else:
        text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                    num_key_value_heads=4, vocab_size=152064)
    text.update(max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]))
    vocab = text["vocab_size"]
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=text[
        "hidden_size"], intermediate_size=64, num_heads=2, tokens_per_second=2),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def _packed_row(cfg, T: int, rng: random.Random, lo: int, hi: int):
    """input_ids [T], host cu_seqlens, host image grids: samples of lo..hi tokens, 0-3 images in some."""
    img, vs, ve = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id
    vocab = cfg.text_config.vocab_size
    ids, cu, grids = [], [0], []
    while len(ids) < T:
        n = min(rng.randint(lo, hi), T - len(ids))
        s = []
        for _ in range(rng.randint(0, 3)):
            h, w = 2 * rng.randint(2, max(2, min(20, n // 16))), 2 * rng.randint(2, max(2, min(20, n // 16)))
            blk = [vs] + [img] * (h * w // 4) + [ve]
            if len(s) + len(blk) + 8 > n:
                break
            s += [rng.randrange(0, vocab - 8) for _ in range(rng.randint(1, 6))] + blk
            grids.append([1, h, w])
        s += [rng.randrange(0, vocab - 8) for _ in range(n - len(s))]
        ids += s
        cu.append(len(ids))
    return torch.tensor(ids, dtype=torch.int64), cu, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)


def setup(quick, device, config, model_cls):
    """The step benchmarks' common setup: device, row length, dtype, timer, config, model (train mode) and one
    packed row (ids on the device, host cu_seqlens and grids, labels)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type == "cpu"
    T = 512 if cpu else (4096 if quick else 16384)
    lo, hi = (32, 128) if cpu else (256, 2048)
    dtype = torch.float32 if cpu else torch.bfloat16
    timer = Timer(dev, warmup=1 if cpu else 3, reps=3 if cpu else 10)
    cfg = config(cpu or quick)
    torch.manual_seed(0)
    model = model_cls(cfg).to(dev, dtype).train()
    ids_h, cu, grids = _packed_row(cfg, T, random.Random(0), lo, hi)
    ids = ids_h.to(dev)
    return dev, T, dtype, timer, cfg, model, ids, cu, grids, ids[None].clone()


def run(quick: bool = False, device=None) -> list[dict]:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from packcuda.integrations import transformers as hf

    dev, T, dtype, timer, cfg, model, ids, cu, grids, labels = setup(quick, device, _config,
                                                                     Qwen2_5_VLForConditionalGeneration)
    tc = cfg.text_config
    D, Hq, Hk, L = tc.hidden_size // tc.num_attention_heads, tc.num_attention_heads, tc.num_key_value_heads, \
        tc.num_hidden_layers
    shape = f"{L}L h{tc.hidden_size} T={T} N={len(cu) - 1} imgs={grids.shape[0]} {str(dtype).replace('torch.', '')}"
    have = hasattr(packcuda, "mrope_position_ids") and hasattr(packcuda, "apply_rope")

    # positions: transformers' get_rope_index per sample (device ids and grids, as a trainer holds them)
    grids_dev = grids.to(dev)
    hf_pos = lambda: hf_packed_position_ids(model, ids, cu, image_grid_thw=grids_dev)  # noqa: E731
    pc_pos = lambda: hf.packed_position_ids(ids, cu, cfg, image_grid_thw=grids, validate=False)  # noqa: E731
    want = hf_pos()
    if have:
        assert torch.equal(pc_pos().cpu(), want.cpu()), "packcuda positions differ from transformers'"

    def step(pos_fn):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids[None], position_ids=pos_fn(), labels=labels, use_cache=False)
        out.loss.backward()

    # rotary alone, forward + backward of q and k over all layers, through the model module's own functions
    mod = importlib.import_module(hf._common._FAMILIES["qwen2_5_vl"].module)
    rot = model.model.language_model.rotary_emb
    q = torch.randn(1, T, Hq, D, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, T, Hk, D, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    pos3 = want[1:].to(dev)

    def rope():
        cos, sin = rot(q, pos3)
        outs = [mod.apply_rotary_pos_emb(q, k, cos, sin) for _ in range(L)]
        torch.autograd.backward([t for o in outs for t in o], [g for _ in range(L) for g in (gq, gk)])
        q.grad = k.grad = None

    rows = []
    t_hf_pos = timer.median_ms(hf_pos)
    t_hf_rope = timer.median_ms(rope)
    t_hf_step = timer.median_ms(lambda: step(hf_pos))
    base = dict(t_pos=t_hf_pos, t_rope=t_hf_rope, t_step=t_hf_step)
    ours = None
    if have:
        with hf.patch_qwen_vl_rope(model):
            t_pc_pos = timer.median_ms(pc_pos)
            t_pc_rope = timer.median_ms(rope)
            t_pc_step = timer.median_ms(lambda: step(pc_pos))
        ours = dict(t_pos=t_pc_pos, t_rope=t_pc_rope, t_step=t_pc_step)
    nan = float("nan")
    g = (lambda key: ours[key]) if ours else (lambda key: nan)  # noqa: E731
    for op, key, bl in [("positions [4,1,T]", "t_pos", "get_rope_index per sample"),
                        (f"rotary fwd+bwd x{L} layers", "t_rope", "transformers cos/sin + eager apply"),
                        ("train step (positions + fwd + loss + bwd)", "t_step", "transformers path")]:
        rows.append(dict(op=op, shape=shape, packcuda_ms=g(key), baseline=bl, baseline_ms=base[key],
                         speedup=base[key] / g(key) if ours else nan))
    rows.append(dict(op="share of step in positions + rotary (%)", shape=shape,
                     packcuda_ms=100 * (g("t_pos") + g("t_rope")) / g("t_step") if ours else nan,
                     baseline="transformers path",
                     baseline_ms=100 * (base["t_pos"] + base["t_rope"]) / base["t_step"], speedup=nan))
    if not have:
        print("packcuda.mrope_position_ids / apply_rope not in this build: transformers path only")
    return rows


def main():
    cli(run, "transformers Qwen2.5-VL packed train step: packcuda positions + rotary vs transformers",
           notes="The share row is a percentage of the step (packcuda_ms / baseline_ms columns hold the two "
                 "percentages). Rotary is timed alone over all layers (forward + backward of q and k); the "
                 "vision tower is not run (image placeholders and grids only drive the positions).")


if __name__ == "__main__":
    main()
