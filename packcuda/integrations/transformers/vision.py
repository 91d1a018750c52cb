"""The vision patch: under context parallelism each rank of a transformers Qwen-VL model encodes only its share of
the batch's images / video frames and receives, for the vision tokens it holds, the embeddings (and Qwen3-VL's
deepstack features) from the ranks that encoded them (:class:`packcuda.VisionPlan`)."""
from __future__ import annotations

import inspect
import types

import torch

import packcuda

from ._common import (
    UnsupportedModelError,
    UnsupportedTransformersError,
    _check_source,
    _check_version,
    _config_of,
    _family_of,
    _import_family,
)
from ._patch import _Patch

# per family: the multimodal model class whose forward is wrapped, its vision tower class, whether the tower
# returns deepstack features (Qwen3-VL)
_MODELS = {
    "qwen2_vl": ("Qwen2VLModel", "Qwen2VisionTransformerPretrainedModel", False),
    "qwen2_5_vl": ("Qwen2_5_VLModel", "Qwen2_5_VisionTransformerPretrainedModel", False),
    "qwen3_vl": ("Qwen3VLModel", "Qwen3VLVisionModel", True),
    "qwen3_5": ("Qwen3_5Model", "Qwen3_5VisionModel", False),
}
# what the wrapped code must do for the patch to be right, in either of the two forms transformers has had: the
# model forward scatters the pooled rows of each modality, concatenated, into its placeholder tokens in stream
# order, taking them either from precomputed encoder outputs per modality ("encoder_outputs": newer releases) or
# from its own get_image_features / get_video_features calls ("feature_calls": 5.17 and the releases near it);
# the tower's output rows are its grid rows' merged tokens in grid order
_SCATTER_NEEDLES = ("get_placeholder_mask", "inputs_embeds.masked_scatter(image_mask, image_embeds)",
                    "inputs_embeds.masked_scatter(video_mask, video_embeds)")
_FORWARD_NEEDLES = {
    "encoder_outputs": (
        ('mm_encoder_outputs.get("image") is None and pixel_values is not None',
         'mm_encoder_outputs.get("video") is None and pixel_values_videos is not None',
         ('torch.cat(mm_encoder_outputs["image"].pooler_output, dim=0)',
          'image_embeds = mm_encoder_outputs["image"].pooler_output'),
         ('torch.cat(mm_encoder_outputs["video"].pooler_output, dim=0)',
          'video_embeds = mm_encoder_outputs["video"].pooler_output')) + _SCATTER_NEEDLES,
        ('mm_encoder_outputs["image"].deepstack_features', 'mm_encoder_outputs["video"].deepstack_features',
         "torch.cat(img_embed, dim=0)")),
    "feature_calls": (
        ("= self.get_image_features(", "= self.get_video_features(",
         "image_embeds = torch.cat(image_embeds, dim=0)", "video_embeds = torch.cat(video_embeds, dim=0)")
        + _SCATTER_NEEDLES,
        ("deepstack_image_embeds = image_outputs.deepstack_features",
         "deepstack_video_embeds = video_outputs.deepstack_features",
         "embed_joint[image_mask_joint, :] = img_embed", "embed_joint[video_mask_joint, :] = vid_embed")),
}
_FEATURES_NEEDLES = ("self.visual(", "prod(-1) // self.visual.spatial_merge_size**2", "torch.split(")
_FN = "patch_qwen_vl_vision"


def qwen_vl_vision_plan(config, input_ids: torch.Tensor, cu_seqlens, plan, *, image_grid_thw=None,
                        video_grid_thw=None, unit: str = "frame", cost=None) -> "packcuda.VisionPlan":
    """:func:`packcuda.vision_plan` with the constants of a transformers Qwen-VL config (token ids, spatial merge
    size and the family's video blocks, through :meth:`packcuda.MRopeSpec.from_hf_config`); ``unit`` defaults
    to ``"frame"`` (videos split by temporal step). The arguments and syncs are :func:`packcuda.vision_plan`'s."""
    try:
        spec = packcuda.MRopeSpec.from_hf_config(_config_of(config))
    except (TypeError, ValueError) as e:
        raise type(e)(f"packcuda.qwen_vl_vision_plan: config: {e}") from e
    return packcuda.vision_plan(input_ids, cu_seqlens, plan, image_grid_thw=image_grid_thw,
                                video_grid_thw=video_grid_thw, image_token_id=spec.image_token_id,
                                video_token_id=spec.video_token_id, spatial_merge_size=spec.spatial_merge_size,
                                video_frames=spec.video_frames, unit=unit, cost=cost)


class VisionPatch(_Patch):
    """Handle of :func:`patch_qwen_vl_vision`: ``set_plan(vplan)`` switches to the next batch's vision plan;
    ``unpatch()`` (or leaving a ``with`` block) restores the model's forward (and feature methods, where patched)."""

    def __init__(self, model, inner, family: str, plan, group, deepstack: bool, out_cls, form: str):
        super().__init__(model)
        self.inner, self.family, self.group = inner, family, group
        self._plan, self._deepstack, self._out_cls = plan, deepstack, out_cls
        self._form = form  # which of _FORWARD_NEEDLES' forms the model's forward has
        self._pending = None  # "feature_calls": the routed rows of the forward call under way, per modality

    @property
    def plan(self):
        return self._plan

    def set_plan(self, plan) -> None:
        """Use ``plan`` (the :class:`packcuda.VisionPlan` of the next batch, same CP size and rank) from now on."""
        fn = "VisionPatch.set_plan"
        if not isinstance(self, VisionPatch):
            raise TypeError(f"packcuda.{fn}: self must be a VisionPatch, got {type(self).__name__}")
        if not self.active:
            raise ValueError(f"packcuda.{fn}: plan cannot be set: the patch was removed")
        _check_plan(fn, plan, self.group, self.inner, self.family)
        self._plan = plan

    def unpatch(self) -> None:
        """Restores the model's forward (idempotent)."""
        if not isinstance(self, VisionPatch):
            raise TypeError(f"packcuda.VisionPatch.unpatch: self must be a VisionPatch, got {type(self).__name__}")
        with self._lock:
            if not self.active:
                return
            self._restore()
            self.active = False

    def __repr__(self):
        p = self._plan
        return (f"VisionPatch({type(self.model).__name__}; cp={p.cp_size} rank={p.cp_rank} unit={p.unit!r}; "
                f"{'active' if self.active else 'removed'})")

    # ---- the patched forward ---------------------------------------------------------------------
    def _encode(self, inner, pixel_values, pixel_values_videos):
        """This rank's tower output (pooled rows, then the deepstack levels), routed: a list of [n_slots, H]."""
        vp = self._plan
        visual = inner.visual
        x = vp.local_pixel_values(pixel_values, pixel_values_videos)
        width = _get_width(inner)
        if vp.local_units:
            out = visual(x.type(visual.dtype), grid_thw=vp._on(x.device, "grid"), return_dict=True)
            feats = [out.pooler_output] + (list(out.deepstack_features) if self._deepstack else [])
        else:
            # nothing to encode: empty rows whose backward gives every trainable tower parameter a zero gradient
            # (data-parallel wrappers then see every parameter used on every rank)
            anchor = sum((p.reshape(-1)[:0].sum() for p in visual.parameters() if p.requires_grad),
                         torch.zeros((), dtype=visual.dtype, device=visual.device))
            n = 1 + (len(visual.deepstack_visual_indexes) if self._deepstack else 0)
            feats = [torch.zeros(0, width, dtype=visual.dtype, device=visual.device) + anchor for _ in range(n)]
        return vp.route(feats, self.group)

    def _mm_outputs(self, inner, pixel_values, pixel_values_videos):
        vp = self._plan
        routed = self._encode(inner, pixel_values, pixel_values_videos)
        dev = routed[0].device
        out = {}
        for m, (key, given) in enumerate((("image", pixel_values), ("video", pixel_values_videos))):
            if given is None:
                continue
            rows = vp._on(dev, ("image_rows", "video_rows")[m])
            parts = [r.index_select(0, rows) for r in routed]
            kw = dict(pooler_output=(parts[0],))
            if self._deepstack:
                # encoder outputs hold each level as a tuple of rows the forward concatenates; the older forward
                # takes each level's rows whole
                kw["deepstack_features"] = [(p,) if self._form == "encoder_outputs" else p for p in parts[1:]]
            out[key] = self._out_cls(**kw)
        return out


def _get_width(inner) -> int:
    """Width of the embeddings the tower hands the text model (the text hidden size)."""
    cfg = inner.config
    text = getattr(cfg, "text_config", None) or cfg
    return int(text.hidden_size)


def _vision_forward(self, *args, **kwargs):
    handle: VisionPatch = self._packcuda_vision
    original = self._packcuda_vision_original
    bound = inspect.signature(original).bind(*args, **kwargs)
    a = bound.arguments
    pv, pvv = a.get("pixel_values"), a.get("pixel_values_videos")
    if pv is None and pvv is None:
        return original(*args, **kwargs)
    vp = handle._plan
    for m, (name, grid) in enumerate((("image_grid_thw", a.get("image_grid_thw")),
                                      ("video_grid_thw", a.get("video_grid_thw")))):
        n = 0 if grid is None else int(grid.shape[0]) if isinstance(grid, torch.Tensor) else len(grid)
        given = (pv, pvv)[m] is not None
        if given and n != vp.n_grid_rows[m]:
            raise ValueError(f"packcuda.{_FN}: {name} has {n} rows but the vision plan has {vp.n_grid_rows[m]} "
                             "(the plan of another batch: call set_plan with this batch's plan)")
    if handle._form == "encoder_outputs":
        if a.get("mm_encoder_outputs") is not None:
            raise ValueError(f"packcuda.{_FN}: pixel values and mm_encoder_outputs were both given")
        a["mm_encoder_outputs"] = handle._mm_outputs(self, pv, pvv)
        a["pixel_values"] = a["pixel_values_videos"] = None
        return original(*bound.args, **bound.kwargs)
    # "feature_calls": the original forward asks get_image_features / get_video_features for the rows of each
    # modality it was given; the patched methods hand it this call's routed rows
    handle._pending = handle._mm_outputs(self, pv, pvv)
    try:
        return original(*bound.args, **bound.kwargs)
    finally:
        handle._pending = None


def _feature_method(modality: str, original):
    """get_image_features / get_video_features of a patched model of the "feature_calls" form: the routed rows of
    the forward call under way, or (called on their own, outside the patched forward) the original method."""

    def get_features(self, *args, **kwargs):
        pending = self._packcuda_vision._pending
        if pending is None or modality not in pending:
            return original(*args, **kwargs)
        return pending.pop(modality)

    return get_features


def _forward_form(model_cls, model_name: str, deepstack: bool, where: str) -> str:
    """Which of _FORWARD_NEEDLES' forms the multimodal model's forward has; refused when it has neither."""
    refusals = []
    for form, (needles, deepstack_needles) in _FORWARD_NEEDLES.items():
        try:
            _check_source(model_cls.forward, f"{model_name}.forward",
                          needles + (deepstack_needles if deepstack else ()), where)
        except UnsupportedTransformersError as e:
            refusals.append(str(e))
        else:
            return form
    raise UnsupportedTransformersError(" and ".join(refusals))


def _check_plan(fn: str, plan, group, inner, family: str) -> None:
    if not isinstance(plan, packcuda.VisionPlan):
        raise TypeError(f"packcuda.{fn}: plan must be a packcuda.VisionPlan (packcuda.vision_plan or "
                        f"qwen_vl_vision_plan), got {type(plan).__name__}")
    if plan.cp_size > 1 or group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"packcuda.{fn}: plan is for cp_size {plan.cp_size} but torch.distributed is not "
                             "initialized (the route runs over the CP process group)")
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if plan.cp_size != size or plan.cp_rank != rank:
            raise ValueError(f"packcuda.{fn}: plan is for cp_size {plan.cp_size}, cp_rank {plan.cp_rank}, but this "
                             f"process is rank {rank} of a group of {size}")
    cfg = inner.config
    want = dict(image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                spatial_merge_size=inner.visual.spatial_merge_size,
                video_frames=packcuda.MRopeSpec.from_hf_config(cfg).video_frames)
    for k, v in want.items():
        if getattr(plan, k) != v:
            raise ValueError(f"packcuda.{fn}: plan has {k}={getattr(plan, k)!r} but the model has {v!r} (a plan "
                             "built for another model)")


def patch_qwen_vl_vision(model, plan, group=None, *, allow_unverified_version: bool = False) -> VisionPatch:
    """Vision towers under context parallelism in a transformers Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 model:
    the model's image / video feature path encodes only this rank's units of ``plan`` (a
    :class:`packcuda.VisionPlan` of the batch, e.g. from :func:`qwen_vl_vision_plan`) and routes the embeddings
    (and Qwen3-VL's deepstack features) into this rank's ``inputs_embeds`` with :meth:`packcuda.VisionPlan.route`
    over ``group`` (the CP process group; ``None``: the default group, or nothing at ``cp_size == 1``).

    The rank calls the model with its own ``[1, T_local]`` slots (``plan.shard(input_ids)[None]``), positions
    from :func:`shard_position_ids`, and the batch's **whole** ``pixel_values`` / ``pixel_values_videos`` /
    ``image_grid_thw`` / ``video_grid_thw`` (every rank the same); the tower sees only the rows of its units.
    The multimodal model's forward is wrapped: given pixel values, it runs the tower once on this rank's units
    (images and video frames together), routes the rows, and hands them to the original forward
    (image rows and video rows of this rank's slots, in slot order, which is the order the model scatters them
    into its placeholder tokens): as ``mm_encoder_outputs`` where the forward takes precomputed encoder outputs,
    else as what its ``get_image_features`` / ``get_video_features`` return within that call (transformers 5.17
    and the releases near it). Every rank must call the model (the route is collective);
    a rank that encodes nothing gives its tower parameters zero gradients. ``set_plan`` switches the handle to the
    next batch's plan; calls whose grids have another row count than the plan are refused.

    Checks first, patches nothing on failure: the transformers version (:data:`SUPPORTED_TRANSFORMERS`), the
    family, one multimodal model with the family's tower inside ``model``, the source of its forward and
    ``get_image_features`` (one of the two forms above, placeholder scatter, the tower's grid-order output),
    and the plan (CP size and rank of ``group``, token ids, spatial merge size and video blocks of the model)."""
    if not isinstance(allow_unverified_version, bool):
        raise TypeError(f"packcuda.{_FN}: allow_unverified_version must be a bool, got "
                        f"{type(allow_unverified_version).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"packcuda.{_FN}: model must be a torch.nn.Module (a transformers Qwen-VL model), got "
                        f"{type(model).__name__}")
    if not isinstance(plan, packcuda.VisionPlan):
        raise TypeError(f"packcuda.{_FN}: plan must be a packcuda.VisionPlan (packcuda.vision_plan or "
                        f"qwen_vl_vision_plan), got {type(plan).__name__}")
    if group is not None:
        import torch.distributed as dist

        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"packcuda.{_FN}: group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(group).__name__}")
    fam = _family_of(model, _FN)
    if fam.model_type not in _MODELS:
        raise UnsupportedModelError(f"packcuda.{_FN}: model_type {fam.model_type!r} has no vision patch; supported: "
                                    f"{', '.join(_MODELS)}")
    _check_version(allow_unverified_version)
    mod = _import_family(fam)
    model_name, tower_name, deepstack = _MODELS[fam.model_type]
    model_cls, tower_cls = getattr(mod, model_name, None), getattr(mod, tower_name, None)
    if model_cls is None or tower_cls is None:
        raise UnsupportedTransformersError(f"packcuda.{_FN}: {fam.module} has no {model_name} / {tower_name}")
    where = f"packcuda.{_FN}"
    form = _forward_form(model_cls, model_name, deepstack, where)
    _check_source(model_cls.get_image_features, f"{model_name}.get_image_features", _FEATURES_NEEDLES, where)
    if "grid_thw" not in inspect.signature(tower_cls.forward).parameters:
        raise UnsupportedTransformersError(f"{where}: {tower_name}.forward takes no grid_thw; refusing to patch")
    out_cls = getattr(mod, "BaseModelOutputWithDeepstackFeatures", None) if deepstack else None
    if out_cls is None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling as out_cls
    inners = [m for m in model.modules() if type(m) is model_cls]
    if len(inners) != 1 or type(getattr(inners[0], "visual", None)) is not tower_cls:
        raise UnsupportedModelError(f"packcuda.{_FN}: model ({type(model).__name__}) must hold one {model_name} "
                                    f"with a {tower_name} as .visual, found {len(inners)} {model_name}")
    inner = inners[0]
    if "_packcuda_vision" in vars(inner):
        raise ValueError(f"packcuda.{_FN}: model is already patched (unpatch its VisionPatch first)")
    _check_plan(_FN, plan, group, inner, fam.model_type)
    handle = VisionPatch(model, inner, fam.model_type, plan, group, deepstack, out_cls, form)
    with handle._lock:
        handle._set(inner, "_packcuda_vision_original", inner.forward)
        handle._set(inner, "_packcuda_vision", handle)
        handle._set(inner, "forward", types.MethodType(_vision_forward, inner))
        if form == "feature_calls":
            for modality in ("image", "video"):
                name = f"get_{modality}_features"
                handle._set(inner, name, types.MethodType(_feature_method(modality, getattr(inner, name)), inner))
        handle.active = True
    return handle


__all__ = ["VisionPatch", "patch_qwen_vl_vision", "qwen_vl_vision_plan"]
