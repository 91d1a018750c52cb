"""Bad-input cases: mRoPE position ids (mrope.py, MRopeSpec and the mrope_position_ids raw op)."""
import torch

import packcuda
from catalogue import Case, call

ops = torch.ops.packcuda
IMG, VID = 900, 901
F = packcuda.mrope_position_ids
P = "packcuda.mrope_position_ids"


def _ids(n_img=4, n_vid=0, dtype=torch.int64, device="cpu"):
    return torch.tensor([1] + [IMG] * n_img + [2] + [VID] * n_vid + [3], dtype=dtype, device=device)


def _f(ids=None, cu=None, **kw):
    """mrope_position_ids on 1 text, 4 image, 1 text, 1 text token (image [1, 4, 4]) with overrides."""
    ids = _ids() if ids is None else ids
    args = dict(image_token_id=IMG, video_token_id=VID, image_grid_thw=[[1, 4, 4]])
    args.update(kw)
    return call(F, ids, [0, ids.numel()] if cu is None else cu, **args)


def _v(secs, tps=2.0, t=2, **kw):
    """A whole video [t, 4, 4] (t*4 tokens) with seconds and tokens_per_second."""
    ids = _ids(n_img=0, n_vid=4 * t)
    args = dict(image_grid_thw=None, video_grid_thw=[[t, 4, 4]], second_per_grid_ts=secs, tokens_per_second=tps)
    args.update(kw)
    return _f(ids, **args)


def _op(ids=None, cu=None, image=None, video=None, secs=None, image_id=IMG, video_id=VID, merge=2, tps=None,
        per_frame=False, text_after_max=False):
    ids = _ids() if ids is None else ids
    cu = torch.tensor([0, ids.numel()]) if cu is None else cu
    image = torch.tensor([[1, 4, 4]]) if image is None else image
    video = torch.empty(0, 3, dtype=torch.int64) if video is None else video
    secs = torch.empty(0, dtype=torch.float32) if secs is None else secs
    return call(ops.mrope_position_ids, ids, cu, image, video, secs, image_id, video_id, merge, tps, per_frame,
                text_after_max)


SPEC = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2, tokens_per_second=2.0)
HF25 = {"model_type": "qwen2_5_vl", "image_token_id": IMG, "video_token_id": VID,
        "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}}


def _hf(**over):
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in HF25.items()}
    for k, v in over.items():
        if k.startswith("vision_"):
            d["vision_config"][k[len("vision_"):]] = v
        else:
            d[k] = v
    return d


def _spec():
    return packcuda.MRopeSpec(**SPEC)


T = "packcuda.mrope_position_ids"
CASES = [
    # overflow of grid products, token counts and positions (finding: 2**62+1 rows wrapped to 4 tokens)
    Case(T, "grid_product_overflow", lambda: _f(image_grid_thw=[[1, 2**62 + 1, 4]], spatial_merge_size=1),
         arg="image_grid_thw"),
    Case(T, "grid_more_tokens_than_ids", lambda: _f(image_grid_thw=[[1, 2**40, 4]], spatial_merge_size=1),
         arg="image_grid_thw"),
    Case(T, "per_frame_video_t_huge", risky=True, arg="video_grid_thw",
         make=lambda: _f(_ids(0, 4), image_grid_thw=None, video_grid_thw=[[2**40, 4, 4]], video_frames="per_frame")),
    Case(T, "per_frame_video_t_overflow_empty_ids", risky=True, arg="video_grid_thw",
         make=lambda: _f(torch.empty(0, dtype=torch.int64), [0], image_grid_thw=None,
                         video_grid_thw=[[2**62, 4, 4]], video_frames="per_frame")),
    Case(T, "grid_rows_sum_overflow", arg="image_grid_thw",
         make=lambda: _f(image_grid_thw=[[2**31, 2**15, 2**15]] * 4, spatial_merge_size=1)),
    Case(T, "grid_tokens_mismatch", lambda: _f(image_grid_thw=[[1, 4, 6]]), arg="image block 0"),
    Case(T, "grid_negative", lambda: _f(image_grid_thw=[[1, -4, 4]]), arg="image_grid_thw"),
    Case(T, "grid_not_divisible", lambda: _f(image_grid_thw=[[1, 3, 4]]), arg="spatial_merge_size"),
    # non-finite / huge seconds and tokens_per_second (finding: temporal positions of -2**63)
    Case(T, "seconds_nan", lambda: _v([float("nan")]), arg="second_per_grid_ts"),
    Case(T, "seconds_inf", lambda: _v([float("inf")]), arg="second_per_grid_ts"),
    Case(T, "seconds_1e30", lambda: _v([1e30]), arg="second_per_grid_ts"),
    Case(T, "seconds_negative", lambda: _v([-1.0]), arg="second_per_grid_ts"),
    Case(T, "seconds_tensor_nan", lambda: _v(torch.tensor([float("nan")])), arg="second_per_grid_ts"),
    Case(T, "seconds_float64_overflows_float32", lambda: _v(torch.tensor([1e300], dtype=torch.float64)),
         arg="second_per_grid_ts"),
    Case(T, "seconds_2d", lambda: _v(torch.tensor([[1.0]])), arg="second_per_grid_ts"),
    Case(T, "seconds_bool_tensor", lambda: _v(torch.tensor([True])), exc=TypeError, arg="second_per_grid_ts"),
    Case(T, "seconds_str", lambda: _v(["1.0"]), exc=TypeError, arg="second_per_grid_ts"),
    Case(T, "seconds_none_entry", lambda: _v([None]), exc=TypeError, arg="second_per_grid_ts"),
    Case(T, "seconds_count", lambda: _v([1.0, 2.0]), arg="second_per_grid_ts"),
    Case(T, "seconds_without_tps", lambda: _v([1.0], tps=None), arg="tokens_per_second"),
    Case(T, "tps_nan", lambda: _v([1.0], tps=float("nan")), arg="tokens_per_second"),
    Case(T, "tps_inf", lambda: _v([1.0], tps=float("inf")), arg="tokens_per_second"),
    Case(T, "tps_negative", lambda: _v([1.0], tps=-2.0), arg="tokens_per_second"),
    Case(T, "tps_str", lambda: _v([1.0], tps="2"), exc=TypeError, arg="tokens_per_second"),
    Case(T, "interval_overflows_float32", lambda: _v([1e30], tps=1e30), arg="second_per_grid_ts"),
    # floats (and bools) where integers are meant
    Case(T, "grid_float_entry", lambda: _f(image_grid_thw=[[1.5, 4, 4]]), exc=TypeError, arg="image_grid_thw"),
    Case(T, "grid_integral_float_entry", lambda: _f(image_grid_thw=[[1.0, 4, 4]]), exc=TypeError,
         arg="image_grid_thw"),
    Case(T, "grid_bool_entry", lambda: _f(image_grid_thw=[[True, 4, 4]]), exc=TypeError, arg="image_grid_thw"),
    Case(T, "grid_float_tensor", lambda: _f(image_grid_thw=torch.tensor([[1.0, 4, 4]])), exc=TypeError,
         arg="image_grid_thw"),
    Case(T, "grid_flat_tensor", lambda: _f(image_grid_thw=torch.tensor([1, 4, 4])), arg="image_grid_thw"),
    Case(T, "grid_row_of_two", lambda: _f(image_grid_thw=[[1, 4]]), arg="image_grid_thw"),
    Case(T, "grid_scalar", lambda: _f(image_grid_thw=5), exc=TypeError, arg="image_grid_thw"),
    Case(T, "grid_none_row", lambda: _f(image_grid_thw=[None]), exc=TypeError, arg="image_grid_thw"),
    Case(T, "video_grid_float", lambda: _v([1.0], video_grid_thw=[[2, 4.0, 4]]), exc=TypeError,
         arg="video_grid_thw"),
    Case(T, "merge_float", lambda: _f(spatial_merge_size=2.0), exc=TypeError, arg="spatial_merge_size"),
    Case(T, "merge_zero", lambda: _f(spatial_merge_size=0), arg="spatial_merge_size"),
    Case(T, "merge_bool", lambda: _f(spatial_merge_size=True), exc=TypeError, arg="spatial_merge_size"),
    Case(T, "image_token_float", lambda: _f(image_token_id=151655.0), exc=TypeError, arg="image_token_id"),
    Case(T, "video_token_none", lambda: _f(video_token_id=None), exc=TypeError, arg="video_token_id"),
    Case(T, "same_token_ids", lambda: _f(video_token_id=IMG), arg="video_token_id"),
    # cu_seqlens
    Case(T, "cu_2d", lambda: _f(cu=torch.tensor([[0, 7]])), arg="cu_seqlens"),
    Case(T, "cu_float_list", lambda: _f(cu=[0.0, 7.0]), exc=TypeError, arg="cu_seqlens"),
    Case(T, "cu_bool_entry", lambda: _f(cu=[0, True]), exc=TypeError, arg="cu_seqlens"),
    Case(T, "cu_none", lambda: call(F, _ids(), None, image_token_id=IMG, video_token_id=VID), exc=TypeError,
         arg="cu_seqlens"),
    Case(T, "cu_decreasing", lambda: _f(cu=[0, 5, 3, 7]), arg="cu_seqlens"),
    Case(T, "cu_wrong_total", lambda: _f(cu=[0, 5]), arg="cu_seqlens"),
    Case(T, "cu_int64_overflow", lambda: _f(cu=[0, 2**70]), arg="cu_seqlens"),
    Case(T, "block_crosses_segment", lambda: _f(cu=[0, 3, 7]), arg="crosses"),
    # input_ids
    Case(T, "ids_float", lambda: _f(_ids(dtype=torch.float32)), arg="input_ids"),
    Case(T, "ids_2d", lambda: _f(_ids()[None]), arg="input_ids"),
    Case(T, "ids_list", lambda: _f([1, 2, 3], cu=[0, 3]), exc=TypeError, arg="input_ids"),
    Case(T, "ids_meta", lambda: _f(_ids(device="meta")), arg="input_ids"),
    # a meta grid is refused empty or not, as the raw op refuses it (a meta tensor has nothing to read)
    Case(T, "grid_empty_meta", arg=("image_grid_thw", "meta"),
         make=lambda: _f(_ids(0), [0, 3], image_grid_thw=torch.empty(0, 3, dtype=torch.int64, device="meta"))),
    Case(T, "video_grid_empty_meta", arg=("video_grid_thw", "meta"),
         make=lambda: _f(video_grid_thw=torch.empty(0, 3, dtype=torch.int64, device="meta"))),
    # string options
    Case(T, "video_frames", lambda: _f(video_frames="frames"), arg="video_frames"),
    Case(T, "text_after_vision", lambda: _f(text_after_vision="last"), arg="text_after_vision"),
    Case(T, "validate_str", lambda: _f(validate="no"), exc=TypeError, arg="validate"),
    # device-specific (run on a GPU machine)
    Case(T, "cu_on_other_device", cuda=True, arg="cu_seqlens",
         make=lambda: _f(_ids(), cu=torch.tensor([0, 7], device="cuda"))),
    Case(T, "grid_device_tensor_bad_row", cuda=True, arg="image_grid_thw",
         make=lambda: _f(_ids(device="cuda"), image_grid_thw=torch.tensor([[1, 2**62 + 1, 4]], device="cuda"),
                         spatial_merge_size=1)),
    Case(T, "cuda_seconds_nan", cuda=True, arg="second_per_grid_ts",
         make=lambda: _f(_ids(0, 8, device="cuda"), image_grid_thw=None, video_grid_thw=[[2, 4, 4]],
                         second_per_grid_ts=[float("nan")], tokens_per_second=2.0)),

    Case("ops.mrope_status_token", "negative_status", op="mrope_status_token", arg="status",
         make=lambda: call(ops.mrope_status_token, -5)),

    # raw op: the same host checks
    Case("ops.mrope_position_ids", "grid_product_overflow", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: _op(image=torch.tensor([[1, 2**62 + 1, 4]]), merge=1)),
    Case("ops.mrope_position_ids", "grid_more_tokens_than_ids", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: _op(image=torch.tensor([[1, 64, 64]]))),
    Case("ops.mrope_position_ids", "seconds_nan", op="mrope_position_ids", arg="second_per_grid_ts",
         make=lambda: _op(_ids(0, 8), image=torch.empty(0, 3, dtype=torch.int64), video=torch.tensor([[2, 4, 4]]),
                          secs=torch.tensor([float("nan")]), tps=2.0)),
    Case("ops.mrope_position_ids", "seconds_float64", op="mrope_position_ids", arg="second_per_grid_ts",
         make=lambda: _op(_ids(0, 8), image=torch.empty(0, 3, dtype=torch.int64), video=torch.tensor([[2, 4, 4]]),
                          secs=torch.tensor([1.0], dtype=torch.float64), tps=2.0)),
    Case("ops.mrope_position_ids", "seconds_huge", op="mrope_position_ids", arg="video_grid_thw",
         make=lambda: _op(_ids(0, 8), image=torch.empty(0, 3, dtype=torch.int64), video=torch.tensor([[2, 4, 4]]),
                          secs=torch.tensor([1e30]), tps=2.0)),
    Case("ops.mrope_position_ids", "tps_inf", op="mrope_position_ids", arg="tokens_per_second",
         make=lambda: _op(tps=float("inf"))),
    Case("ops.mrope_position_ids", "tps_above_float32", op="mrope_position_ids", arg="tokens_per_second",
         make=lambda: _op(tps=1e300)),
    Case("ops.mrope_position_ids", "grid_float", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: _op(image=torch.tensor([[1.0, 4, 4]]))),
    Case("ops.mrope_position_ids", "grid_shape", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: _op(image=torch.tensor([[1, 4, 4, 1]]))),
    Case("ops.mrope_position_ids", "grid_empty_meta", op="mrope_position_ids", arg=("image_grid_thw", "meta"),
         make=lambda: _op(_ids(0), image=torch.empty(0, 3, dtype=torch.int64, device="meta"))),
    Case("ops.mrope_position_ids", "merge_zero", op="mrope_position_ids", arg="spatial_merge_size",
         make=lambda: _op(merge=0)),
    Case("ops.mrope_position_ids", "cu_2d", op="mrope_position_ids", arg="cu_seqlens",
         make=lambda: _op(cu=torch.tensor([[0, 7]]))),
    Case("ops.mrope_position_ids", "ids_float", op="mrope_position_ids", arg="input_ids",
         make=lambda: _op(_ids(dtype=torch.float32))),
    Case("ops.mrope_position_ids", "per_frame_t_huge", op="mrope_position_ids", arg="video_grid_thw", risky=True,
         make=lambda: _op(_ids(0, 4), image=torch.empty(0, 3, dtype=torch.int64),
                          video=torch.tensor([[2**40, 4, 4]]), per_frame=True)),

    # MRopeSpec
    Case("MRopeSpec.from_hf_config", "unknown_model_type", op="MRopeSpec.from_hf_config", arg="model_type",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, {"model_type": "llama"})),
    Case("MRopeSpec.from_hf_config", "config_none", op="MRopeSpec.from_hf_config", arg="config", exc=TypeError,
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, None)),
    Case("MRopeSpec.from_hf_config", "no_vision_config", op="MRopeSpec.from_hf_config", arg="vision_config",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, {k: v for k, v in HF25.items() if k != "vision_config"})),
    Case("MRopeSpec.from_hf_config", "no_token_ids", op="MRopeSpec.from_hf_config", arg="image_token_id",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(image_token_id=None))),
    Case("MRopeSpec.from_hf_config", "float_token_id", op="MRopeSpec.from_hf_config", arg="image_token_id",
         exc=TypeError, make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(image_token_id=151655.0))),
    Case("MRopeSpec.from_hf_config", "float_merge", op="MRopeSpec.from_hf_config", arg="spatial_merge_size",
         exc=TypeError, make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(vision_spatial_merge_size=2.0))),
    Case("MRopeSpec.from_hf_config", "zero_merge", op="MRopeSpec.from_hf_config", arg="spatial_merge_size",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(vision_spatial_merge_size=0))),
    Case("MRopeSpec.from_hf_config", "nan_tps", op="MRopeSpec.from_hf_config", arg="tokens_per_second",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(vision_tokens_per_second=float("nan")))),
    Case("MRopeSpec.from_hf_config", "str_tps", op="MRopeSpec.from_hf_config", arg="tokens_per_second",
         exc=TypeError, make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(vision_tokens_per_second="2"))),
    Case("MRopeSpec.from_hf_config", "bad_rule", op="MRopeSpec.from_hf_config", arg="text_after_vision",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(), text_after_vision="last")),
    Case("MRopeSpec.from_hf_config", "same_token_ids", op="MRopeSpec", arg="video_token_id",
         make=lambda: call(packcuda.MRopeSpec.from_hf_config, _hf(video_token_id=IMG))),
    Case("MRopeSpec.position_ids", "grid_overflow", op="mrope_position_ids", arg="image_grid_thw",
         make=lambda: call(_spec().position_ids, _ids(), [0, 7], image_grid_thw=[[1, 2**62 + 2, 4]])),
    Case("MRopeSpec.position_ids", "seconds_nan", op="mrope_position_ids", arg="second_per_grid_ts",
         make=lambda: call(_spec().position_ids, _ids(0, 8), [0, 11], video_grid_thw=[[2, 4, 4]],
                           second_per_grid_ts=[float("nan")])),
    Case("MRopeSpec.position_ids", "grid_float", op="mrope_position_ids", arg="image_grid_thw", exc=TypeError,
         make=lambda: call(_spec().position_ids, _ids(), [0, 7], image_grid_thw=[[1, 4.0, 4]])),
    Case("MRopeSpec.position_ids", "cu_2d", op="mrope_position_ids", arg="cu_seqlens",
         make=lambda: call(_spec().position_ids, _ids(), torch.tensor([[0, 7]]), image_grid_thw=[[1, 4, 4]])),
    Case("MRopeSpec.position_ids", "ids_float", op="mrope_position_ids", arg="input_ids",
         make=lambda: call(_spec().position_ids, _ids(dtype=torch.float64), [0, 7], image_grid_thw=[[1, 4, 4]])),
    Case("MRopeSpec.position_ids", "validate_str", op="mrope_position_ids", arg="validate", exc=TypeError,
         make=lambda: call(_spec().position_ids, _ids(), [0, 7], image_grid_thw=[[1, 4, 4]], validate="yes")),
    # the constructor (dataclass __init__) checks its fields too
    Case("MRopeSpec.position_ids", "spec_float_token", op="MRopeSpec", arg="image_token_id", exc=TypeError,
         make=lambda: call(packcuda.MRopeSpec, image_token_id=1.5, video_token_id=VID)),
    Case("MRopeSpec.position_ids", "spec_nan_tps", op="MRopeSpec", arg="tokens_per_second",
         make=lambda: call(packcuda.MRopeSpec, image_token_id=IMG, video_token_id=VID, tokens_per_second=float("nan"))),
    Case("MRopeSpec.position_ids", "spec_bad_frames", op="MRopeSpec", arg="video_frames",
         make=lambda: call(packcuda.MRopeSpec, image_token_id=IMG, video_token_id=VID, video_frames="x")),
]
