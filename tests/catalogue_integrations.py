"""Bad-input cases: packcuda.integrations.transformers (positions, the rotary and linear-attention patches and
their handles) and packcuda.integrations.megatron."""
import functools

import torch

import packcuda
import reference
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


def _qwen3_5(layer_types=("full_attention", "linear_attention")):
    """A tiny Qwen3.5 text model (a fresh one: cases may leave it patched)."""
    import transformers as T

    c = T.Qwen3_5TextConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=len(layer_types),
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, layer_types=list(layer_types),
                            linear_conv_kernel_dim=2, linear_key_head_dim=4, linear_value_head_dim=4,
                            linear_num_key_heads=2, linear_num_value_heads=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 0],
                                             "mrope_interleaved": True})
    return T.Qwen3_5ForCausalLM(c)


def _la(model=None, **kw):
    return call(hf().patch_qwen3_5_linear_attention, _qwen3_5() if model is None else model, **kw)


def _set_plan_on_removed():
    h = hf().patch_qwen3_5_linear_attention(_qwen3_5())
    h.unpatch()
    return call(h.set_plan, _plan())


def _zz():
    return packcuda.shard_plan([0, 5, 11], 2, 1)


def _thd(batch=None, plan=None, **kw):
    from packcuda.integrations import megatron as m

    batch = {"tokens": torch.arange(11)[None]} if batch is None else batch
    return call(m.thd_batch_on_this_cp_rank, batch, _zz() if plan is None else plan, **kw)


def _psp(plan):
    from packcuda.integrations import megatron as m

    return call(m.packed_seq_params, plan)


def _pp(ids=None, cu=None, cfg=None, **kw):
    ids = _ids() if ids is None else ids
    kw.setdefault("image_grid_thw", [[1, 4, 4]])
    return call(hf().packed_position_ids, ids, [0, ids.numel()] if cu is None else cu,
                _cfg() if cfg is None else cfg, **kw)


def _hfp(ids=None, cu=None, **kw):
    ids = _ids() if ids is None else ids
    kw.setdefault("image_grid_thw", [[1, 4, 4]])
    return call(reference.hf_packed_position_ids, _model(), ids, [0, ids.numel()] if cu is None else cu, **kw)


def _plan():
    return packcuda.shard_plan([0, 8], 1, 0)


PP = "transformers.packed_position_ids"
HP = "reference.hf_packed_position_ids"
MM = "transformers.mm_token_type_ids"
PATCH = "transformers.patch_qwen_vl_rope"
LA = "transformers.patch_qwen3_5_linear_attention"
THD = "megatron.thd_batch_on_this_cp_rank"
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

    # hf_packed_position_ids (tests/reference.py: the per-sample transformers path the tests compare with)
    Case(HP, "model_unsupported", arg="model",
         make=lambda: call(reference.hf_packed_position_ids, torch.nn.Linear(2, 2), _ids(), [0, 9])),
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

    # patch_qwen3_5_linear_attention (refused before anything is patched) and its handle
    Case(LA, "model_not_a_module", arg="model", exc=TypeError, make=lambda: call(hf().patch_qwen3_5_linear_attention,
                                                                                 "qwen3_5")),
    Case(LA, "model_other_family", arg="model", make=lambda: _la(_model())),
    Case(LA, "model_without_linear_attention", arg="model",
         make=lambda: _la(_qwen3_5(("full_attention", "full_attention")))),
    Case(LA, "allow_unverified_str", arg="allow_unverified_version", exc=TypeError,
         make=lambda: _la(allow_unverified_version=1)),
    Case(LA, "plan_without_group", arg="group", make=lambda: _la(plan=_plan())),
    Case(LA, "group_without_plan", arg="plan", make=lambda: _la(group=object())),
    Case(LA, "plan_list", arg="plan", exc=TypeError, make=lambda: _la(plan=[0, 8], group=object())),
    Case(LA, "group_str", arg="group", exc=TypeError, make=lambda: _la(plan=_plan(), group="world")),
    Case(LA, "plan_static_zigzag", arg="plan",  # the move and FLA's CP context need the plan's host boundaries
         make=lambda: _la(plan=packcuda.static_shard_plan(torch.tensor([0, 6]), 1, 1, 0, capacity=8, max_seqs=1),
                          group=object())),
    Case(LA, "zigzag_path_native", arg="zigzag_path", make=lambda: _la(zigzag_path="native")),
    Case(LA, "zigzag_path_none", arg="zigzag_path", exc=TypeError, make=lambda: _la(zigzag_path=None)),
    Case("LinearAttentionPatch.set_plan", "not_a_handle", op="LinearAttentionPatch.set_plan", arg="self", exc=TypeError,
         make=lambda: call(hf().LinearAttentionPatch.set_plan, object(), _plan())),
    Case("LinearAttentionPatch.set_plan", "handle_removed", op="LinearAttentionPatch.set_plan", arg="plan",
         make=_set_plan_on_removed),
    Case("LinearAttentionPatch.set_plan", "handle_without_cp", op="LinearAttentionPatch.set_plan", arg="plan",
         make=lambda: call(hf().patch_qwen3_5_linear_attention(_qwen3_5()).set_plan, _plan())),
    Case("LinearAttentionPatch.unpatch", "not_a_handle", op="LinearAttentionPatch.unpatch", arg="self", exc=TypeError,
         make=lambda: call(hf().LinearAttentionPatch.unpatch, "handle")),

    # packcuda.integrations.megatron (refused before megatron-core is imported)
    Case("megatron.packed_seq_params", "plan_list", op="megatron.packed_seq_params", arg="plan", exc=TypeError,
         make=lambda: _psp([0, 5, 11])),
    Case("megatron.packed_seq_params", "plan_contiguous", op="megatron.packed_seq_params", arg="plan",
         make=lambda: _psp(packcuda.shard_plan([0, 6], 2, 0, layout="contiguous"))),
    Case(THD, "plan_none", op=THD, arg="plan", exc=TypeError, make=lambda: call(_thd()[0], _thd()[1][0], None)),
    Case(THD, "plan_contiguous", op=THD, arg="plan",
         make=lambda: _thd(plan=packcuda.shard_plan([0, 5, 11], 2, 1, layout="contiguous"))),
    Case(THD, "batch_list", op=THD, arg="batch", exc=TypeError, make=lambda: _thd([torch.arange(11)[None]])),
    Case(THD, "batch_unknown_key", op=THD, arg="batch", make=lambda: _thd({"tokens": torch.arange(11)[None],
                                                                           "images": torch.zeros(1, 11)})),
    Case(THD, "local_cp_size_set", op=THD, arg="local_cp_size",
         make=lambda: _thd({"tokens": torch.arange(11)[None], "local_cp_size": torch.tensor([2], dtype=torch.int32),
                            "hybrid_cp_group": None})),
    Case(THD, "hybrid_cp_group_set", op=THD, arg="hybrid_cp_group",
         make=lambda: _thd({"tokens": torch.arange(11)[None], "local_cp_size": None, "hybrid_cp_group": object()})),
    Case(THD, "labels_without_tokens_short", op=THD, arg="labels",
         make=lambda: _thd({"tokens": None, "labels": torch.arange(10)[None]})),
    Case(THD, "tokens_float", op=THD, arg="tokens", exc=TypeError, make=lambda: _thd({"tokens": torch.zeros(1, 11)})),
    Case(THD, "tokens_short", op=THD, arg="tokens", make=lambda: _thd({"tokens": torch.arange(10)[None]})),
    Case(THD, "tokens_batch_2", op=THD, arg="tokens", make=lambda: _thd({"tokens": torch.arange(22).view(2, 11)})),
    Case(THD, "tokens_list", op=THD, arg="tokens", exc=TypeError, make=lambda: _thd({"tokens": list(range(11))})),
    Case(THD, "labels_short", op=THD, arg="labels", make=lambda: _thd({"tokens": torch.arange(11)[None],
                                                                       "labels": torch.arange(9)[None]})),
    Case(THD, "loss_mask_2d", op=THD, arg="loss_mask", make=lambda: _thd({"tokens": torch.arange(11)[None],
                                                                          "loss_mask": torch.ones(11, 1)})),
    Case(THD, "position_ids_two_rows", op=THD, arg="position_ids",
         make=lambda: _thd({"tokens": torch.arange(11)[None], "position_ids": torch.zeros(2, 11, dtype=torch.long)})),
    Case(THD, "position_ids_list", op=THD, arg="position_ids", exc=TypeError,
         make=lambda: _thd({"tokens": torch.arange(11)[None], "position_ids": [list(range(11))]})),
    Case(THD, "position_ids_float", op=THD, arg="position_ids", exc=TypeError,
         make=lambda: _thd({"tokens": torch.arange(11)[None], "position_ids": torch.zeros(1, 11)})),
    Case(THD, "position_ids_mrope_batch_2", op=THD, arg="position_ids",
         make=lambda: _thd({"tokens": torch.arange(11)[None],
                            "position_ids": torch.zeros(3, 2, 11, dtype=torch.int32)})),
    Case(THD, "position_ids_short", op=THD, arg="position_ids",
         make=lambda: _thd({"tokens": torch.arange(11)[None],
                            "position_ids": torch.zeros(3, 1, 10, dtype=torch.long)})),
    Case(THD, "attention_mask_given", op=THD, arg="attention_mask",
         make=lambda: _thd({"tokens": torch.arange(11)[None], "attention_mask": torch.ones(1, 11)})),
    Case(THD, "pad_token_id_float", op=THD, arg="pad_token_id", exc=TypeError, make=lambda: _thd(pad_token_id=0.0)),
    Case(THD, "ignore_index_bool", op=THD, arg="ignore_index", exc=TypeError, make=lambda: _thd(ignore_index=True)),
    Case(THD, "pad_token_id_not_int64", op="ShardPlan.shard", arg="fill",
         make=lambda: _thd({"tokens": torch.arange(11, dtype=torch.int32)[None]}, pad_token_id=2**40)),

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
