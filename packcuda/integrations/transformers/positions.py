"""The ``position_ids`` of a packed row (and of a CP shard) for transformers' Qwen-VL models."""
from __future__ import annotations

import functools
import inspect
import types
from typing import Optional

import torch

import packcuda
from packcuda._meta import config_field as _get

from ._common import _config_of, _family_of, _require, _vtuple, transformers_version


def video_seconds_default() -> str:
    """The rule by which the installed transformers turns Qwen2.5-VL's ``second_per_grid_ts`` into a temporal
    interval: "whole" (``tokens_per_second * int(second_per_grid_ts)``, older 5.x releases such as 5.17) or
    "float" (the float product; later releases, e.g. 5.24). Read from the installed modeling code itself
    (:func:`truncates_video_seconds`), so a backport or a patched release is seen as it behaves."""
    return "whole" if truncates_video_seconds() else "float"


def _text_after_vision_default() -> str:
    # transformers >= 5.3 resumes text after a vision block at s + max(H', W'); 4.x at max(position) + 1
    try:
        return "grid" if _vtuple(transformers_version()) >= (5, 3) else "max"
    except ImportError:  # pragma: no cover - positions do not need transformers itself
        return "grid"


def _check_ids(input_ids, fn: str) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"packcuda.{fn}: input_ids must be an integer tensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"packcuda.{fn}: input_ids must be an integer tensor, got {input_ids.dtype}")


def _flat_ids(input_ids: torch.Tensor, fn: str) -> torch.Tensor:
    _check_ids(input_ids, fn)
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"packcuda.{fn}: input_ids must be [T] or [1, T] (one packed "
                         f"row), got shape {tuple(input_ids.shape)}")
    return input_ids


def _checked_seconds(second_per_grid_ts, fn: str, whole: bool):
    """second_per_grid_ts as the host float32 tensor the op takes, checked as the op does (finite, >= 0; refused
    naming `fn`), truncated to whole seconds under the "whole" video_seconds rule."""
    if second_per_grid_ts is None:
        return None
    from packcuda.mrope import _seconds

    secs = _seconds(second_per_grid_ts, op=fn)
    bad = ~torch.isfinite(secs) | (secs < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"packcuda.{fn}: second_per_grid_ts[{i}] must be finite and >= 0, got {float(secs[i])}")
    return secs.trunc() if whole else secs


def packed_position_ids(input_ids: torch.Tensor, cu_seqlens, config, *, image_grid_thw=None, video_grid_thw=None,
                        second_per_grid_ts=None, text_after_vision: Optional[str] = None,
                        video_seconds: Optional[str] = None, validate: bool = True) -> torch.Tensor:
    """``position_ids`` int64 ``[4, 1, T]`` of one packed row for a Qwen-VL model.

    ``input_ids`` ``[T]`` (or ``[1, T]``) is the packed stream, ``cu_seqlens`` ``[N + 1]`` its samples (host
    list / CPU tensor, or device tensor), ``config`` the model's config (or the model). Grids are the rows of
    all samples in stream order, as the processor returns them; ``second_per_grid_ts`` (Qwen2.5-VL videos)
    likewise. Row 0 is the text position (0, 1, 2, ... in every sample: transformers' packed-sequence signal),
    rows 1-3 the t/h/w mRoPE positions, identical to transformers' ``get_rope_index`` on each sample alone.

    ``text_after_vision`` defaults to the rule of the installed transformers ("grid" for >= 5.3, "max" for
    4.x). ``video_seconds`` (Qwen2.5-VL videos) defaults to the rule of the installed transformers
    (:func:`video_seconds_default`): "float" uses ``tokens_per_second * second_per_grid_ts``, "whole" truncates
    ``second_per_grid_ts`` to whole seconds first, as transformers 5.17 does. Syncs: none on the GPU with host
    ``cu_seqlens`` and grids when ``validate=False``; with ``validate=True`` one read of the kernel's status word
    (see :func:`packcuda.mrope_position_ids`).
    """
    fn = "packed_position_ids"
    ids = _flat_ids(input_ids, fn)
    cfg = _config_of(config)
    fam = _family_of(cfg, fn, "config")
    if text_after_vision is not None and text_after_vision not in ("grid", "max"):
        raise ValueError(f"packcuda.{fn}: text_after_vision must be 'grid', 'max' or None, got {text_after_vision!r}")
    if video_seconds is not None and video_seconds not in ("float", "whole"):
        raise ValueError(f"packcuda.{fn}: video_seconds must be 'float', 'whole' or None, got {video_seconds!r}")
    whole = (video_seconds or video_seconds_default()) == "whole" and fam.video_seconds
    second_per_grid_ts = _checked_seconds(second_per_grid_ts, fn, whole)
    spec_cls = _require("MRopeSpec")
    spec = spec_cls.from_hf_config(cfg, text_after_vision=text_after_vision or _text_after_vision_default())
    pos, text_pos, _ = spec.position_ids(ids, cu_seqlens, image_grid_thw=image_grid_thw,
                                         video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts,
                                         validate=validate)
    return torch.cat([text_pos[None], pos], dim=0)[:, None, :]


def mm_token_type_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` (0 text, 1 image, 2 video) of ``input_ids``, int32, same shape."""
    fn = "mm_token_type_ids"
    _check_ids(input_ids, fn)
    cfg = _config_of(config)
    if cfg is None or isinstance(cfg, (str, bytes, int, float)):
        raise TypeError(f"packcuda.{fn}: config must be a transformers config, a model or a dict, got "
                        f"{type(config).__name__}")
    img, vid = _get(cfg, "image_token_id"), _get(cfg, "video_token_id")
    if img is None or vid is None:
        raise ValueError(f"packcuda.{fn}: config has no image_token_id / video_token_id")
    img = packcuda._meta.check_int(fn, "config.image_token_id", img)
    vid = packcuda._meta.check_int(fn, "config.video_token_id", vid)
    t = torch.zeros_like(input_ids, dtype=torch.int32)
    t = t.masked_fill(input_ids == img, 1)
    return t.masked_fill(input_ids == vid, 2)


def shard_position_ids(position_ids: torch.Tensor, plan) -> torch.Tensor:
    """This CP rank's positions from the global ones, with a :func:`packcuda.shard_plan` of the same packed
    stream, in the form given: mRoPE ``[R, 1, T]`` (R = 3 or 4, transformers' ``[R, B, T]`` with B = 1) gives
    ``[R, 1, T_local]``; ``[R, T]``, ``[1, R, T]``, ``[1, T]`` and ``[T]`` likewise, int32 or int64. Padding
    slots get the plan's ``position_ids`` on every row (a sequence's tail pads keep counting past its real
    positions, the bucket pad segment counts from 0), so positions restart at 0 only where a segment starts and
    transformers' packed-sequence detection sees each pad run as part of one segment (see
    :meth:`packcuda.ShardPlan.shard_positions`)."""
    op = "shard_position_ids"
    if not isinstance(plan, packcuda.ShardPlan):
        raise TypeError(f"packcuda.{op}: plan must be a packcuda.ShardPlan, got {type(plan).__name__}")
    return plan._shard_positions(op, "position_ids", position_ids)


@functools.lru_cache(maxsize=1)
def truncates_video_seconds() -> bool:
    """True when the installed transformers computes Qwen2.5-VL's video time interval as
    ``tokens_per_second * int(second_per_grid_ts)`` (older 5.x releases, e.g. 5.17), dropping fractional
    seconds. Later releases use the float product, which is the rule ``packcuda.mrope_position_ids``
    implements; with whole-second ``second_per_grid_ts`` the two agree. Found by behaviour: the installed
    ``get_rope_index`` runs once on a 0.5-second video of 3 frames (tokens_per_second 2: temporal positions
    1, 2, 3 with the float product, 1, 1, 1 with whole seconds); its source is read only if that call fails."""
    try:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    except Exception:
        return False
    cls = m.Qwen2_5_VLModel
    try:
        ns = types.SimpleNamespace(config=types.SimpleNamespace(
            vision_config=types.SimpleNamespace(spatial_merge_size=1, tokens_per_second=2), image_token_id=1,
            video_token_id=2, vision_start_token_id=3, vision_end_token_id=4))
        if hasattr(cls, "get_vision_position_ids"):
            ns.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, ns)
        ids = torch.tensor([[3, 2, 2, 2]])
        kw = dict(video_grid_thw=torch.tensor([[3, 1, 1]]), second_per_grid_ts=torch.tensor([0.5]))
        if "mm_token_type_ids" in inspect.signature(cls.get_rope_index).parameters:
            kw["mm_token_type_ids"] = torch.tensor([[0, 2, 2, 2]], dtype=torch.int32)
        t = cls.get_rope_index(ns, ids, **kw)[0][0, 0, 1:].tolist()
        if t in ([1, 1, 1], [1, 2, 3]):
            return t == [1, 1, 1]
    except Exception:
        pass
    try:
        return "int(next(second_per_grid_ts))" in inspect.getsource(cls.get_rope_index)
    except Exception:
        return False

