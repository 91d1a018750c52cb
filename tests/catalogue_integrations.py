"""Bad-input cases: packcuda.integrations.transformers (positions, the rotary patch and its handle)."""
import functools

import torch

import packcuda
from catalogue import Case, call

IMG, VID, VS, VE = 150, 151, 152, 153


def hf():
    from packcuda.integrations import transformers as m

    return m


def _cfg(model_type="qwen2_5_vl", **over):
    d = {"model_type": model_type, "image_token_id": IMG, "video_token_id": VID,
         "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}}
    d.update(over)
    return d


def _ids(n_img=4, n_vid=0):
    return torch.tensor([1, VS] + [IMG] * n_img + [VE, 2] + ([VS] + [VID] * n_vid + [VE] if n_vid else []) + [3])


@functools.lru_cache(maxsize=None)
def _model():
    """A tiny Qwen2-VL (1 layer): built once per process."""
    import transformers as T

    text = dict(vocab_size=160, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                            mrope_section=[4, 6, 6]))
    vision = dict(depth=1, num_heads=1, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  embed_dim=16, hidden_size=32, mlp_ratio=2)
    c = T.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID,
                        vision_start_token_id=VS, vision_end_token_id=VE)
    torch.manual_seed(0)
    return T.Qwen2VLForConditionalGeneration(c).eval()


def _pp(ids=None, cu=None, cfg=None, **kw):
    ids = _ids() if ids is None else ids
    kw.setdefault("image_grid_thw", [[1, 4, 4]])
    return call(hf().packed_position_ids, ids, [0, ids.numel()] if cu is None else cu,
                _cfg() if cfg is None else cfg, **kw)


def _hfp(ids=None, cu=None, **kw):
    ids = _ids() if ids is None else ids
    kw.setdefault("image_grid_thw", [[1, 4, 4]])
    return call(hf().hf_packed_position_ids, _model(), ids, [0, ids.numel()] if cu is None else cu, **kw)


def _plan():
    return packcuda.shard_plan([0, 8], 1, 0)


PP = "transformers.packed_position_ids"
HP = "transformers.hf_packed_position_ids"
MM = "transformers.mm_token_type_ids"
PATCH = "transformers.patch_qwen_vl_rope"
CASES = [
    # packed_position_ids
    Case(PP, "grid_overflow", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: _pp(image_grid_thw=[[1, 2**62 + 1, 4]])),
    Case(PP, "grid_float", op="mrope_position_ids", arg="image_grid_thw", exc=TypeError,
         make=lambda: _pp(image_grid_thw=[[1.5, 4, 4]])),
    Case(PP, "seconds_nan", arg="second_per_grid_ts",
         make=lambda: _pp(_ids(0, 8), image_grid_thw=None, video_grid_thw=[[2, 4, 4]],
                          second_per_grid_ts=[float("nan")])),
    Case(PP, "seconds_nan_whole_rule", arg="second_per_grid_ts",
         make=lambda: _pp(_ids(0, 8), image_grid_thw=None, video_grid_thw=[[2, 4, 4]],
                          second_per_grid_ts=[float("nan")], video_seconds="whole")),
    Case(PP, "seconds_str_whole_rule", arg="second_per_grid_ts", exc=TypeError,
         make=lambda: _pp(_ids(0, 8), image_grid_thw=None, video_grid_thw=[[2, 4, 4]],
                          second_per_grid_ts=["1"], video_seconds="whole")),
    Case(PP, "video_seconds_rule", arg="video_seconds", make=lambda: _pp(video_seconds="floor")),
    Case(PP, "text_after_vision_rule", arg="text_after_vision", make=lambda: _pp(text_after_vision="last")),
    Case(PP, "ids_2d_batch", arg="input_ids", make=lambda: _pp(_ids().expand(2, -1))),
    Case(PP, "ids_float", arg="input_ids", exc=TypeError, make=lambda: _pp(_ids().float())),
    Case(PP, "ids_list", arg="input_ids", exc=TypeError, make=lambda: _pp([1, 2, 3], cu=[0, 3])),
    Case(PP, "config_unsupported", arg="config", make=lambda: _pp(cfg={"model_type": "llama"})),
    Case(PP, "config_none", arg="config", make=lambda: call(hf().packed_position_ids, _ids(), [0, 9], None)),
    Case(PP, "config_float_token", op="MRopeSpec.from_hf_config", arg="image_token_id", exc=TypeError,
         make=lambda: _pp(cfg=_cfg(image_token_id=150.0))),
    Case(PP, "cu_2d", op="mrope_position_ids", arg="cu_seqlens", make=lambda: _pp(cu=torch.tensor([[0, 9]]))),
    Case(PP, "cu_float", op="mrope_position_ids", arg="cu_seqlens", exc=TypeError, make=lambda: _pp(cu=[0.0, 9.0])),
    Case(PP, "tokens_mismatch", op="mrope_position_ids", arg="image block 0",
         make=lambda: _pp(image_grid_thw=[[1, 4, 6]])),

    # hf_packed_position_ids (the per-sample transformers path)
    Case(HP, "model_unsupported", arg="model",
         make=lambda: call(hf().hf_packed_position_ids, torch.nn.Linear(2, 2), _ids(), [0, 9])),
    Case(HP, "cu_float", arg="cu_seqlens", exc=TypeError, make=lambda: _hfp(cu=[0.0, 9.0])),
    Case(HP, "cu_wrong_total", arg="cu_seqlens", make=lambda: _hfp(cu=[0, 5])),
    Case(HP, "cu_decreasing", arg="cu_seqlens", make=lambda: _hfp(cu=[0, 6, 3, 9])),
    Case(HP, "grid_float", arg="image_grid_thw", exc=TypeError, make=lambda: _hfp(image_grid_thw=[[1, 4.0, 4]])),
    Case(HP, "grid_flat", arg="image_grid_thw", make=lambda: _hfp(image_grid_thw=torch.tensor([1, 4, 4]))),
    Case(HP, "too_few_grid_rows", arg="image_grid_thw", make=lambda: _hfp(image_grid_thw=None)),
    Case(HP, "ids_float", arg="input_ids", exc=TypeError, make=lambda: _hfp(_ids().double())),
    Case(HP, "seconds_str", arg="second_per_grid_ts", exc=TypeError,
         make=lambda: _hfp(second_per_grid_ts=["x"])),

    # mm_token_type_ids
    Case(MM, "ids_list", arg="input_ids", exc=TypeError, make=lambda: call(hf().mm_token_type_ids, [1, 2], _cfg())),
    Case(MM, "ids_float", arg="input_ids", exc=TypeError,
         make=lambda: call(hf().mm_token_type_ids, torch.zeros(3), _cfg())),
    Case(MM, "config_without_ids", arg="image_token_id",
         make=lambda: call(hf().mm_token_type_ids, _ids(), {"model_type": "qwen2_vl"})),
    Case(MM, "config_float_id", arg="image_token_id", exc=TypeError,
         make=lambda: call(hf().mm_token_type_ids, _ids(), _cfg(image_token_id=150.5))),
    Case(MM, "config_none", arg="config", exc=TypeError, make=lambda: call(hf().mm_token_type_ids, _ids(), None)),

    # shard_position_ids (argument checks at its start)
    Case("transformers.shard_position_ids", "position_ids_list", arg="position_ids", exc=TypeError,
         make=lambda: call(hf().shard_position_ids, [[0, 1]], _plan())),
    Case("transformers.shard_position_ids", "plan_none", arg="plan", exc=TypeError,
         make=lambda: call(hf().shard_position_ids, torch.zeros(4, 1, 8, dtype=torch.int64), None)),
    Case("transformers.shard_position_ids", "plan_list", arg="plan", exc=TypeError,
         make=lambda: call(hf().shard_position_ids, torch.zeros(4, 1, 8, dtype=torch.int64), [0, 8])),

    # patch_qwen_vl_rope (refused before anything is patched)
    Case(PATCH, "model_not_a_module", arg="model", exc=TypeError,
         make=lambda: call(hf().patch_qwen_vl_rope, "qwen2_vl")),
    Case(PATCH, "model_types_str", arg="model_types", exc=TypeError,
         make=lambda: call(hf().patch_qwen_vl_rope, model_types="qwen2_vl")),
    Case(PATCH, "model_types_unknown", arg="model_types",
         make=lambda: call(hf().patch_qwen_vl_rope, model_types=["qwen2_vl", "llama"])),
    Case(PATCH, "model_types_int", arg="model_types", make=lambda: call(hf().patch_qwen_vl_rope, model_types=[3])),
    Case(PATCH, "model_and_model_types", arg="model_types",
         make=lambda: call(hf().patch_qwen_vl_rope, _model(), model_types=["qwen2_vl"])),
    Case(PATCH, "model_unsupported", arg="model", make=lambda: call(hf().patch_qwen_vl_rope, torch.nn.Linear(2, 2))),
    Case(PATCH, "allow_unverified_str", arg="allow_unverified_version", exc=TypeError,
         make=lambda: call(hf().patch_qwen_vl_rope, _model(), allow_unverified_version="yes")),
    Case(PATCH, "fuse_qk_norm_str", arg="fuse_qk_norm", exc=TypeError,
         make=lambda: call(hf().patch_qwen_vl_rope, _model(), fuse_qk_norm="yes")),
    Case(PATCH, "fuse_qk_norm_without_model", arg="fuse_qk_norm",
         make=lambda: call(hf().patch_qwen_vl_rope, fuse_qk_norm=True)),
    Case(PATCH, "fuse_qk_norm_no_qk_norms", arg="fuse_qk_norm",  # Qwen2-VL attention has no q_norm / k_norm
         make=lambda: call(hf().patch_qwen_vl_rope, _model(), fuse_qk_norm=True)),

    # unpatch / is_patched / the handle
    Case("transformers.unpatch_qwen_vl_rope", "handle_str", arg="handle", exc=TypeError,
         make=lambda: call(hf().unpatch_qwen_vl_rope, "all")),
    Case("transformers.unpatch_qwen_vl_rope", "handle_model", arg="handle", exc=TypeError,
         make=lambda: call(hf().unpatch_qwen_vl_rope, _model())),
    Case("transformers.is_patched", "model_str", arg="model", exc=TypeError,
         make=lambda: call(hf().is_patched, "qwen2_vl")),
    Case("transformers.is_patched", "config", arg="model", exc=TypeError,
         make=lambda: call(hf().is_patched, _cfg())),
    Case("RopePatch.unpatch", "not_a_handle", op="RopePatch.unpatch", arg="self", exc=TypeError,
         make=lambda: call(hf().RopePatch.unpatch, object())),
]
