"""Tiny random-weight Qwen-VL models built from configs with transformers' own modeling code (no downloads):
2 layers, small hidden size, the real rope settings of each family, real vision towers fed random pixels of images
and videos of varied grids; packed batches of them, and their position ids through transformers and packcuda.
Shared by the tests of packcuda.integrations.transformers (the module skips where transformers is missing)."""
import random

import pytest
import torch
from packaging.version import Version

import packcuda
import reference as ref
from helpers import HF_INT_SECONDS

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("packcuda.integrations.transformers")

HAS_MROPE = hasattr(packcuda, "mrope_position_ids")
HAS_ROPE = hasattr(packcuda, "apply_rope")
HAS_SHARD = hasattr(packcuda, "shard_plan")
needs_mrope = pytest.mark.skipif(not HAS_MROPE, reason="packcuda.mrope_position_ids not in this build")
needs_rope = pytest.mark.skipif(not HAS_ROPE, reason="packcuda.apply_rope not in this build")
needs_shard = pytest.mark.skipif(not HAS_SHARD, reason="packcuda.shard_plan not in this build")
VERSION_OK = Version(hf.SUPPORTED_TRANSFORMERS[0]) <= Version(transformers.__version__) < Version(
    hf.SUPPORTED_TRANSFORMERS[1])

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"]

# token ids of the tiny vocabulary
V, IMG, VID, VS, VE = 160, 150, 151, 152, 153
PATCH, TPATCH, MERGE = 4, 2, 2
PATCH_DIM = 3 * TPATCH * PATCH * PATCH


def _text(**kw):
    d = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6)
    d.update(kw)
    return d


def _vision(**kw):
    d = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TPATCH,
             in_channels=3)
    d.update(kw)
    return d


def _config(fam, full_attention_only=False):
    """Tiny config with the family's real rope settings (mrope_section, rope_theta, head_dim, partial rotary)."""
    T = transformers
    ids = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    if fam == "qwen2_vl":  # head_dim 128 = hidden / heads, sectioned [16, 24, 24], theta 1e6
        c = T.Qwen2VLConfig(
            text_config=_text(hidden_size=128, num_attention_heads=1,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
            vision_config=_vision(embed_dim=32, hidden_size=128, mlp_ratio=2), **ids)
        cls = T.Qwen2VLForConditionalGeneration
    elif fam == "qwen2_5_vl":  # as Qwen2-VL, plus windowed vision attention and tokens_per_second 2
        c = T.Qwen2_5_VLConfig(
            text_config=_text(hidden_size=128, num_attention_heads=1,
                              rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
            vision_config=_vision(hidden_size=32, out_hidden_size=128, intermediate_size=64, window_size=16,
                                  fullatt_block_indexes=[1], tokens_per_second=2), **ids)
        cls = T.Qwen2_5_VLForConditionalGeneration
    elif fam == "qwen3_vl":  # head_dim 128, interleaved [24, 20, 20], theta 5e6
        c = T.Qwen3VLConfig(
            text_config=_text(head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=5e6,
                                                                 mrope_section=[24, 20, 20], mrope_interleaved=True)),
            vision_config=_vision(hidden_size=32, out_hidden_size=64, intermediate_size=64,
                                  num_position_embeddings=64, deepstack_visual_indexes=[0]), **ids)
        cls = T.Qwen3VLForConditionalGeneration
    else:  # Qwen3.5: head_dim 256, partial rotary 0.25 (64 dims), interleaved [11, 11, 10], theta 1e7
        layers = ["full_attention"] * 2 if full_attention_only else ["linear_attention", "full_attention"]
        c = T.Qwen3_5Config(
            text_config=_text(head_dim=256, layer_types=layers, full_attention_interval=2, linear_num_key_heads=2,
                              linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                              linear_conv_kernel_dim=4,
                              rope_parameters=dict(rope_type="default", rope_theta=1e7, mrope_section=[11, 11, 10],
                                                   mrope_interleaved=True, partial_rotary_factor=0.25)),
            vision_config=_vision(hidden_size=32, out_hidden_size=64, intermediate_size=64,
                                  num_position_embeddings=64), **ids)
        cls = T.Qwen3_5ForConditionalGeneration
    c._attn_implementation = "sdpa"
    return c, cls


def _model(fam, seed=0, full_attention_only=False):
    c, cls = _config(fam, full_attention_only)
    torch.manual_seed(seed)
    return cls(c).eval()


def _sample(fam, rng, kinds, lead=None):
    """One sample: text with vision blocks of the given kinds ('img' / 'vid'), in order."""
    per_frame = fam in ("qwen3_vl", "qwen3_5")
    ids, imgs, vids, secs = [], [], [], []

    def text(n):
        ids.extend(rng.randrange(0, 140) for _ in range(n))

    text(rng.randint(0, 2) if lead is None else lead)
    if not kinds:
        text(rng.randint(3, 8))
    for k in kinds:
        h, w = rng.choice([2, 4, 6]), rng.choice([2, 4])
        if k == "img":
            imgs.append([1, h, w])
            ids.extend([VS] + [IMG] * (h * w // MERGE ** 2) + [VE])
        else:
            t = rng.choice([2, 3])
            vids.append([t, h, w])
            secs.append(rng.choice([1.0, 2.0] if HF_INT_SECONDS else [0.5, 1.0, 1.5, 2.0]))
            if per_frame:  # <timestamp> <vision_start> frame <vision_end>, per temporal patch
                for _ in range(t):
                    text(1)
                    ids.extend([VS] + [VID] * (h * w // MERGE ** 2) + [VE])
            else:
                ids.extend([VS] + [VID] * (t * h * w // MERGE ** 2) + [VE])
        text(rng.randint(1, 4))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pix = lambda grids: (torch.randn(sum(a * b * c for a, b, c in grids), PATCH_DIM, generator=g)  # noqa: E731
                         if grids else None)
    return dict(ids=torch.tensor(ids, dtype=torch.int64), image_grid_thw=imgs, video_grid_thw=vids,
                second_per_grid_ts=secs, pixel_values=pix(imgs), pixel_values_videos=pix(vids))


# samples with blocks at the start and the end of a sample, text-only samples, images and videos together
LAYOUTS = [[], ["img"], ["img", "vid"], ["vid"], ["vid", "img", "img"]]


def _batch(fam, seed=0, layouts=LAYOUTS):
    rng = random.Random(seed)
    # the second sample starts with its vision block, the others start with 0-2 text tokens
    samples = [_sample(fam, rng, k, lead=0 if i == 1 else None) for i, k in enumerate(layouts)]
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + s["ids"].numel())
    cat = lambda key: (torch.cat([s[key] for s in samples if s[key] is not None])  # noqa: E731
                       if any(s[key] is not None for s in samples) else None)
    grids = lambda key: torch.tensor([r for s in samples for r in s[key]], dtype=torch.int64).reshape(-1, 3)  # noqa
    packed = dict(ids=torch.cat([s["ids"] for s in samples]), cu=cu, pixel_values=cat("pixel_values"),
                  pixel_values_videos=cat("pixel_values_videos"), image_grid_thw=grids("image_grid_thw"),
                  video_grid_thw=grids("video_grid_thw"),
                  second_per_grid_ts=torch.tensor([x for s in samples for x in s["second_per_grid_ts"]]))
    return samples, packed


def _vision_kwargs(fam, d):
    kw = {}
    ig, vg = torch.as_tensor(d["image_grid_thw"], dtype=torch.int64).reshape(-1, 3), \
        torch.as_tensor(d["video_grid_thw"], dtype=torch.int64).reshape(-1, 3)
    if ig.shape[0]:
        kw.update(pixel_values=d["pixel_values"], image_grid_thw=ig)
    if vg.shape[0]:
        kw.update(pixel_values_videos=d["pixel_values_videos"], video_grid_thw=vg)
        if fam == "qwen2_5_vl":
            kw["second_per_grid_ts"] = torch.as_tensor(d["second_per_grid_ts"], dtype=torch.float32)
    return kw


def _separate_logits(model, fam, samples):
    """Each sample alone, transformers computing its positions itself (get_rope_index)."""
    out = []
    for s in samples:
        ids = s["ids"][None]
        out.append(model(input_ids=ids, mm_token_type_ids=hf.mm_token_type_ids(ids, model.config),
                         **_vision_kwargs(fam, s)).logits[0])
    return torch.cat(out)


def _packed_logits(model, fam, packed, position_ids):
    # use_cache=False as in training: with a cache transformers does not look for packed sequences
    return model(input_ids=packed["ids"][None], position_ids=position_ids, use_cache=False,
                 **_vision_kwargs(fam, packed)).logits[0]


def _hf_positions(model, fam, packed):
    return ref.hf_packed_position_ids(model, packed["ids"], packed["cu"], image_grid_thw=packed["image_grid_thw"],
                                      video_grid_thw=packed["video_grid_thw"],
                                      second_per_grid_ts=packed["second_per_grid_ts"])


def _pc_positions(model, fam, packed, device="cpu", **kw):
    return hf.packed_position_ids(packed["ids"].to(device), packed["cu"], model.config,
                                  image_grid_thw=packed["image_grid_thw"], video_grid_thw=packed["video_grid_thw"],
                                  second_per_grid_ts=packed["second_per_grid_ts"] if fam == "qwen2_5_vl" else None,
                                  **kw)
