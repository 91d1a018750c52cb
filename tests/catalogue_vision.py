"""Bad-input cases: vision work under context parallelism (vision.py: vision_plan and VisionPlan)."""
import torch

import packcuda
from catalogue import Case, call

IMG, VID = 900, 901
# one segment: 1 text, an image [1, 4, 4] (4 tokens), 1 text, a whole video [2, 4, 4] (8 tokens), 1 text
IDS = [1] + [IMG] * 4 + [2] + [VID] * 8 + [3]
CU = [0, len(IDS)]
GRIDS = dict(image_grid_thw=[[1, 4, 4]], video_grid_thw=[[2, 4, 4]])


def _plan(cp=2, rank=0, cu=CU, **kw):
    return packcuda.shard_plan(list(cu), cp, rank, **kw)


def _vp(**over):
    """vision_plan on IDS with overrides of any argument (ids=..., cu=..., plan=...)."""
    ids = over.pop("ids", torch.tensor(IDS))
    cu = over.pop("cu", CU)
    plan = over.pop("plan", None) or _plan()
    kw = dict(GRIDS, image_token_id=IMG, video_token_id=VID)
    kw.update(over)
    return call(packcuda.vision_plan, ids, cu, plan, **kw)


def _built(rank=0, **kw):
    fn, args, kwargs = _vp(**kw)
    kwargs.pop("plan", None)
    return packcuda.vision_plan(args[0], args[1], _plan(rank=rank), **{k: v for k, v in kwargs.items()})


def _pv(n=16, D=6, dtype=torch.float32):
    return torch.randn(n, D, dtype=dtype)


def _encoder(rank):
    vp = _built(rank)
    return vp, torch.randn(vp.n_encoded, 8, dtype=torch.float64)


VP, LPV, MRG = "packcuda.vision_plan", "VisionPlan.local_pixel_values", "VisionPlan.merge"


def _m(target, name, make, **kw):
    """A case of a VisionPlan method (its messages name VisionPlan.<method>)."""
    return Case(target, name, make, op=target, **kw)


CASES = [
    # the plan, and plans of another batch
    Case(VP, "plan_not_a_plan", lambda: _vp(plan=object()), exc=TypeError, arg="plan"),
    Case(VP, "static_plan", lambda: _vp(plan=packcuda.static_shard_plan(torch.tensor(CU), 1, 2, 0, capacity=16,
                                                                        max_seqs=1)), arg="StaticShardPlan"),
    Case(VP, "ids_of_another_batch", lambda: _vp(ids=torch.tensor(IDS + [4])), arg="input_ids"),
    Case(VP, "cu_of_another_batch", lambda: _vp(cu=[0, 5, len(IDS)]), arg="cu_seqlens"),
    Case(VP, "plan_of_another_batch", lambda: _vp(plan=_plan(cu=[0, 5, len(IDS)])), arg="cu_seqlens"),
    Case(VP, "ids_float", lambda: _vp(ids=torch.tensor(IDS, dtype=torch.float32)), arg="input_ids"),
    Case(VP, "ids_2d", lambda: _vp(ids=torch.tensor(IDS)[None]), arg="input_ids"),
    Case(VP, "ids_list", lambda: _vp(ids=IDS), exc=TypeError, arg="input_ids"),
    Case(VP, "cu_float", lambda: _vp(cu=[0.0, float(len(IDS))]), exc=TypeError, arg="cu_seqlens"),
    # grid rows that do not match the token runs (the block rules of mrope_position_ids)
    Case(VP, "image_run_too_short", lambda: _vp(image_grid_thw=[[1, 4, 6]]), arg="image block 0"),
    Case(VP, "video_run_too_long", lambda: _vp(video_grid_thw=[[1, 4, 4]]), arg="video block 0"),
    Case(VP, "more_grid_rows_than_runs", lambda: _vp(image_grid_thw=[[1, 4, 4], [1, 2, 2]]), arg="image_grid_thw"),
    Case(VP, "runs_without_grid_rows", lambda: _vp(video_grid_thw=None), arg="video"),
    Case(VP, "per_frame_of_whole_video", lambda: _vp(video_frames="per_frame"), arg="video"),
    Case(VP, "block_crosses_segment", lambda: _vp(cu=[0, 3, len(IDS)], plan=_plan(cu=[0, 3, len(IDS)])),
         arg="crosses"),
    Case(VP, "grid_not_divisible", lambda: _vp(image_grid_thw=[[1, 3, 4]]), arg="spatial_merge_size"),
    Case(VP, "grid_negative", lambda: _vp(image_grid_thw=[[1, -4, -4]]), arg="image_grid_thw"),
    Case(VP, "grid_not_rows", lambda: _vp(image_grid_thw=[1, 4, 4]), exc=TypeError, arg="image_grid_thw"),
    Case(VP, "grid_float_tensor", lambda: _vp(image_grid_thw=torch.tensor([[1.0, 4.0, 4.0]])), exc=TypeError,
         arg="image_grid_thw"),
    # the other arguments
    Case(VP, "unit_unknown", lambda: _vp(unit="video"), arg="unit"),
    Case(VP, "video_frames_unknown", lambda: _vp(video_frames="frames"), arg="video_frames"),
    Case(VP, "image_token_float", lambda: _vp(image_token_id=900.0), exc=TypeError, arg="image_token_id"),
    Case(VP, "same_token_ids", lambda: _vp(video_token_id=IMG), arg="video_token_id"),
    Case(VP, "merge_zero", lambda: _vp(spatial_merge_size=0), arg="spatial_merge_size"),
    Case(VP, "cost_string", lambda: _vp(cost="flops"), exc=TypeError, arg="cost"),
    Case(VP, "cost_triple", lambda: _vp(cost=(1.0, 2.0, 3.0)), arg="cost"),
    Case(VP, "cost_negative_weight", lambda: _vp(cost=(1.0, -1.0)), arg="cost[1]"),
    Case(VP, "cost_callable_nan", lambda: _vp(cost=lambda t, h, w: float("nan")), arg="cost"),
    Case(VP, "cost_callable_negative", lambda: _vp(cost=lambda t, h, w: -1), arg="cost"),
    Case(VP, "cost_callable_not_a_number", lambda: _vp(cost=lambda t, h, w: "big"), exc=TypeError, arg="cost"),
    # pixel rows that do not match the grids
    _m(LPV, "image_rows_mismatch", lambda: call(_built().local_pixel_values, _pv(15), _pv(32)), arg="pixel_values"),
    _m(LPV, "video_rows_mismatch", lambda: call(_built().local_pixel_values, _pv(16), _pv(31)),
         arg="pixel_values_videos"),
    _m(LPV, "videos_missing", lambda: call(_built().local_pixel_values, _pv(16), None), arg="pixel_values_videos"),
    _m(LPV, "images_missing", lambda: call(_built().local_pixel_values, None, _pv(32)), arg="pixel_values"),
    _m(LPV, "pixel_values_3d", lambda: call(_built().local_pixel_values, _pv(16)[None], _pv(32)),
         arg="pixel_values"),
    _m(LPV, "pixel_values_list", lambda: call(_built().local_pixel_values, [[0.0]] * 16, _pv(32)), exc=TypeError,
         arg="pixel_values"),
    _m(LPV, "columns_differ", lambda: call(_built().local_pixel_values, _pv(16), _pv(32, D=5)),
         arg="pixel_values_videos"),
    _m(LPV, "dtypes_differ", lambda: call(_built().local_pixel_values, _pv(16), _pv(32, dtype=torch.float64)),
         arg="pixel_values_videos"),
    # merge
    _m(MRG, "embeds_wrong_length", lambda: call(_built().merge, torch.zeros(3, 8), torch.zeros(_built().n_slots, 8)),
         arg="inputs_embeds_local"),
    _m(MRG, "embeds_batch_of_two", lambda: call(_built().merge, torch.zeros(2, _plan().total_local, 8),
                                                  torch.zeros(_built().n_slots, 8)), arg="inputs_embeds_local"),
    _m(MRG, "routed_wrong_rows", lambda: call(_built().merge, torch.zeros(_plan().total_local, 8),
                                                torch.zeros(_built().n_slots + 1, 8)), arg="routed"),
    _m(MRG, "routed_wrong_width", lambda: call(_built().merge, torch.zeros(_plan().total_local, 8),
                                                 torch.zeros(_built().n_slots, 7)), arg="routed"),
    _m(MRG, "routed_other_dtype", lambda: call(_built().merge, torch.zeros(_plan().total_local, 8),
                                                 torch.zeros(_built().n_slots, 8, dtype=torch.float64)), arg="routed"),
    _m(MRG, "routed_not_a_tensor", lambda: call(_built().merge, torch.zeros(_plan().total_local, 8), None),
         exc=TypeError, arg="routed"),
]


# ---------------------------------------------------------------------------------------------------
# VisionPlan.route and the transformers patch
# ---------------------------------------------------------------------------------------------------
RT = "VisionPlan.route"


def _route(feats, rank=0):
    vp = _built(rank)
    return call(vp.route, feats(vp))


CASES += [
    _m(RT, "embeds_wrong_rows", lambda: _route(lambda vp: torch.zeros(vp.n_encoded + 1, 8)), arg="embeds_local"),
    _m(RT, "embeds_3d", lambda: _route(lambda vp: torch.zeros(vp.n_encoded, 2, 4)), arg="embeds_local"),
    _m(RT, "embeds_not_a_tensor", lambda: _route(lambda vp: "rows"), exc=TypeError, arg="embeds_local"),
    _m(RT, "embeds_empty_list", lambda: _route(lambda vp: []), exc=TypeError, arg="embeds_local"),
    _m(RT, "level_not_a_tensor", lambda: _route(lambda vp: [torch.zeros(vp.n_encoded, 8), None]), exc=TypeError,
       arg="embeds_local[1]"),
    _m(RT, "level_wrong_rows", lambda: _route(lambda vp: [torch.zeros(vp.n_encoded, 8), torch.zeros(1, 8)]),
       arg="embeds_local[1]"),
    _m(RT, "levels_of_two_dtypes", lambda: _route(lambda vp: [torch.zeros(vp.n_encoded, 8),
                                                              torch.zeros(vp.n_encoded, 8, dtype=torch.float64)]),
       arg="embeds_local[1]"),
]

HF_IMG, HF_VID = 150, 151  # catalogue_integrations' tiny Qwen2-VL


def _hf():
    from packcuda.integrations import transformers as m

    return m


def _qwen2_vl():
    """A fresh tiny Qwen2-VL (cases may leave it patched)."""
    import copy

    from catalogue_integrations import _model

    return copy.deepcopy(_model())


def _hf_vplan(cp=1, image_token_id=HF_IMG, **kw):
    """A plan of one image of 4 tokens ([1, 4, 4], or [1, 2, 2] without a spatial merge)."""
    ids = torch.tensor([1] + [image_token_id] * 4 + [2])
    plan = packcuda.shard_plan([0, 6], cp, 0)
    grid = [[1, 2, 2]] if kw.get("spatial_merge_size") == 1 else [[1, 4, 4]]
    return packcuda.vision_plan(ids, [0, 6], plan, image_grid_thw=grid, image_token_id=image_token_id,
                                video_token_id=HF_VID if image_token_id != HF_VID else HF_IMG, **kw)


def _patch(model=None, plan=None, *args, **kw):
    return call(_hf().patch_qwen_vl_vision, _qwen2_vl() if model is None else model,
                _hf_vplan() if plan is None else plan, *args, **kw)


def _patched_twice():
    m = _qwen2_vl()
    _hf().patch_qwen_vl_vision(m, _hf_vplan())
    return _patch(m)


def _text_model():
    from catalogue_integrations import _qwen3_5

    return _qwen3_5()


def _removed_handle():
    h = _hf().patch_qwen_vl_vision(_qwen2_vl(), _hf_vplan())
    h.unpatch()
    return h


PV, QVP, SP, UP = ("transformers.patch_qwen_vl_vision", "transformers.qwen_vl_vision_plan", "VisionPatch.set_plan",
                   "VisionPatch.unpatch")
CASES += [
    Case(PV, "model_not_a_module", lambda: _patch(model="model"), exc=TypeError, arg="model"),
    Case(PV, "plan_not_a_vision_plan", lambda: _patch(plan=_plan(1)), exc=TypeError, arg="plan"),
    Case(PV, "group_not_a_group", lambda: _patch(None, None, "group"), exc=TypeError, arg="group"),
    Case(PV, "allow_unverified_not_bool", lambda: _patch(allow_unverified_version=1), exc=TypeError,
         arg="allow_unverified_version"),
    Case(PV, "text_only_model", lambda: _patch(model=_text_model()), arg="Qwen3_5VisionModel"),
    Case(PV, "plan_of_another_model", lambda: _patch(plan=_hf_vplan(image_token_id=IMG)), arg="image_token_id"),
    Case(PV, "plan_of_another_merge", lambda: _patch(plan=_hf_vplan(spatial_merge_size=1)),
         arg="spatial_merge_size"),
    Case(PV, "cp_plan_without_process_group", lambda: _patch(plan=_hf_vplan(cp=2)), arg="torch.distributed"),
    Case(PV, "already_patched", _patched_twice, arg="already patched"),
    Case(QVP, "config_none", lambda: call(_hf().qwen_vl_vision_plan, None, torch.tensor(IDS), CU, _plan(),
                                          **GRIDS), exc=TypeError, arg="config"),
    Case(QVP, "config_text_only", lambda: call(_hf().qwen_vl_vision_plan, {"model_type": "qwen3"},
                                               torch.tensor(IDS), CU, _plan(), **GRIDS), arg="model_type"),
    Case(QVP, "unit_unknown", op="vision_plan", arg="unit",
         make=lambda: call(_hf().qwen_vl_vision_plan, _qwen2_vl().config, torch.tensor([1, HF_IMG, HF_IMG, HF_IMG,
                                                                                       HF_IMG, 2]), [0, 6],
                           packcuda.shard_plan([0, 6], 1, 0), image_grid_thw=[[1, 4, 4]], unit="tubelet")),
    Case(SP, "not_a_handle", lambda: call(_hf().VisionPatch.set_plan, object(), _hf_vplan()), op=SP, exc=TypeError,
         arg="self"),
    Case(SP, "handle_removed", lambda: call(_removed_handle().set_plan, _hf_vplan()), op=SP, arg="removed"),
    Case(SP, "plan_not_a_vision_plan", op=SP, exc=TypeError, arg="plan",
         make=lambda: call(_hf().patch_qwen_vl_vision(_qwen2_vl(), _hf_vplan()).set_plan, _plan(1))),
    Case(SP, "plan_of_another_model", op=SP, arg="image_token_id",
         make=lambda: call(_hf().patch_qwen_vl_vision(_qwen2_vl(), _hf_vplan()).set_plan,
                           _hf_vplan(image_token_id=IMG))),
    Case(UP, "not_a_handle", lambda: call(_hf().VisionPatch.unpatch, "handle"), op=UP, exc=TypeError, arg="self"),
]
