"""Packed training of transformers' Qwen-VL models with packcuda mRoPE positions and rotary application.

Two pieces, usable separately:

1. :func:`packed_position_ids` — the ``position_ids`` input of a **packed row** (many samples in one row of
   batch size 1) for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: the 4-row form ``[4, 1, T]`` (text positions
   restarting at 0 in every sample, then the t/h/w mRoPE rows) with which transformers detects packed
   sequences (sdpa / eager build a block-causal mask, flash-attention finds ``cu_seqlens``). Computed by
   :func:`packcuda.mrope_position_ids` for the whole pack in one pass, equal to transformers' own
   ``get_rope_index`` run on every sample alone.

2. :func:`patch_qwen_vl_rope` — an opt-in patch that routes the text attention's rotary application through
   :func:`packcuda.apply_rope`, driven by the positions themselves: the rotary module no longer builds the
   ``[3, B, S, D]`` cos/sin tables, and each attention layer rotates q and k in one fused kernel (forward and
   backward). It checks the transformers version and the structure of the code it replaces and refuses
   (:class:`UnsupportedTransformersError`, :class:`UnsupportedModelError`) instead of silently patching nothing.

3. :func:`patch_qwen3_5_linear_attention` — Qwen3.5's GatedDeltaNet layers on packed rows (the conv and the
   gated delta rule stop at every sample boundary) and on context-parallel shards (conv halo rows through
   :func:`packcuda.conv_prefix`, the recurrence through flash-linear-attention's CP context).

The two lines a trainer changes::

    from packcuda.integrations.transformers import packed_position_ids, patch_qwen_vl_rope
    patch_qwen_vl_rope(model)                                   # once, after building the model
    ...
    position_ids = packed_position_ids(input_ids, cu_seqlens, model.config,
                                       image_grid_thw=..., video_grid_thw=...)   # per packed batch
    out = model(input_ids=input_ids[None], position_ids=position_ids, pixel_values=..., ...)

Under context parallelism compute the positions on the global stream, then shard them with the plan
(:func:`shard_position_ids`); the patched rotary consumes whatever per-token positions it is given.
"""
from __future__ import annotations

import copy
import functools
import inspect
import threading
import types
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import packcuda
from packcuda._families import FAMILIES, Family
from packcuda._meta import config_field as _get
from packcuda._meta import host_list

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedTransformersError",
    "UnsupportedModelError",
    "RopePatch",
    "packed_position_ids",
    "shard_position_ids",
    "mm_token_type_ids",
    "PATCHABLE_MODEL_TYPES",
    "patch_qwen_vl_rope",
    "unpatch_qwen_vl_rope",
    "is_patched",
    "LinearAttentionPatch",
    "patch_qwen3_5_linear_attention",
]

# transformers versions whose Qwen-VL modeling code was read and tested with this patch: [low, high)
SUPPORTED_TRANSFORMERS = ("5.17.0", "5.25.0")


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is not a version (or not the code) this integration knows how to patch."""


class UnsupportedModelError(ValueError):
    """The model is not one of the families this integration supports."""


# the families of packcuda's one table (packcuda._families) with modeling code this integration patches: the
# Qwen-VL families (positions and rotary patch) and the text-only ones (rotary patch only: plain RoPE driven by
# [B, S] position_ids)
_FAMILIES: Dict[str, Family] = {f.model_type: f for f in FAMILIES if f.module and f.mrope}
_TEXT_FAMILIES: Dict[str, Family] = {f.model_type: f for f in FAMILIES if f.module and not f.mrope}
# text-only configs of the same families (their models use the same text modules)
_ALIASES = {f"{mt}_text": mt for mt in _FAMILIES}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
# model types patch_qwen_vl_rope accepts: the Qwen-VL families and the text-only ones
PATCHABLE_MODEL_TYPES = tuple(_FAMILIES) + tuple(_TEXT_FAMILIES)

# rope types whose inverse frequencies change during a forward (dynamic_rope_update): not supported
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


# ---------------------------------------------------------------------------------------------------
# version / model checks
# ---------------------------------------------------------------------------------------------------
def _vtuple(v: str) -> Tuple[int, ...]:
    from packaging.version import Version

    return Version(v).release


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_version(allow_unverified_version: bool) -> str:
    from packaging.version import Version

    v = transformers_version()
    lo, hi = SUPPORTED_TRANSFORMERS
    ok = Version(lo) <= Version(v) < Version(hi)
    if not ok and not allow_unverified_version:
        raise UnsupportedTransformersError(
            f"packcuda.integrations.transformers: transformers {v} is not a supported version "
            f"(supported: >= {lo}, < {hi}); pass allow_unverified_version=True to try anyway (the code it "
            "patches is still checked)")
    return v


def _config_of(model_or_config):
    cfg = getattr(model_or_config, "config", None)
    return cfg if cfg is not None else model_or_config


def _family_of(model_or_config, fn: str = "integrations.transformers", name: str = "model",
               text_ok: bool = False) -> Family:
    """The family of a model / config; text_ok: also the text-only families of the rotary patch."""
    cfg = _config_of(model_or_config)
    mt = _get(cfg, "model_type", None)
    mt = _ALIASES.get(mt, mt)
    fams = {**_FAMILIES, **_TEXT_FAMILIES} if text_ok else _FAMILIES
    if not isinstance(mt, str) or mt not in fams:
        what = type(model_or_config).__name__
        raise UnsupportedModelError(
            f"packcuda.{fn}: {name} has model_type {mt!r} ({what}), which is not supported; "
            f"supported: {', '.join(PATCHABLE_MODEL_TYPES if text_ok else SUPPORTED_MODEL_TYPES)}")
    return fams[mt]


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


def _require(name: str):
    fn = getattr(packcuda, name, None)
    if fn is None:
        raise RuntimeError(f"packcuda.integrations.transformers: packcuda.{name} is not available in this build")
    return fn


# ---------------------------------------------------------------------------------------------------
# positions
# ---------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------
# rotary patch
# ---------------------------------------------------------------------------------------------------
class _RopePositions:
    """What the patched rotary module returns in place of (cos, sin): the positions and the rotary constants.
    The patched ``apply_rotary_pos_emb`` recognizes it and calls packcuda.apply_rope."""

    __slots__ = ("positions", "inv_freq", "rotary_dim", "mrope_section", "interleaved", "attention_scaling", "norms")

    def __init__(self, positions, inv_freq, rotary_dim, mrope_section, interleaved, attention_scaling, norms=None):
        # [R, Bp, Sp] (R = 3 for mRoPE, 1 for plain RoPE): broadcast to q's [B, S] as transformers broadcasts cos/sin
        self.positions = positions
        self.norms = norms  # _NormState of a model patched with fuse_qk_norm, else None
        self.inv_freq = inv_freq  # fp32 [rotary_dim / 2]
        self.rotary_dim = rotary_dim
        self.mrope_section = mrope_section
        self.interleaved = interleaved
        self.attention_scaling = attention_scaling


def _rope_layout(module, fn: str, mrope: bool = True) -> dict:
    """``rotary_dim``, ``mrope_section`` and ``mrope_interleaved`` of a text rotary module, from
    :func:`packcuda.rope_kwargs_from_config` on its config (the one reading of a config's rotary layout);
    the frequencies themselves come from the module. Refuses a layout the module's frequencies do not have."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise UnsupportedModelError(f"packcuda.{fn}: {type(module).__name__} has no config")
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    if rp.get("rope_type", "default") != "default":
        # static frequencies of another rope type are the module's (inv_freq, attention_scaling); the config
        # still gives the layout
        cfg = copy.copy(cfg)
        object.__setattr__(cfg, "rope_parameters", {**rp, "rope_type": "default"})
    try:
        kw = _require("rope_kwargs_from_config")(cfg)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"packcuda.{fn}: the rotary layout of {type(module).__name__} is not supported: {e}") from e
    n = int(module.inv_freq.numel())
    if (kw.get("mrope_section") is None) == mrope or kw.get("rotary_dim") != 2 * n:
        raise ValueError(f"packcuda.{fn}: {type(module).__name__} has {n} frequencies but its config gives "
                         f"rotary_dim {kw.get('rotary_dim')} and mrope_section {kw.get('mrope_section')}")
    if not mrope:
        return dict(rotary_dim=int(kw["rotary_dim"]), mrope_section=None, mrope_interleaved=False)
    return dict(rotary_dim=int(kw["rotary_dim"]), mrope_section=[int(v) for v in kw["mrope_section"]],
                mrope_interleaved=bool(kw["mrope_interleaved"]))


def _check_rope_layout(module, fn: str, mrope: bool = True) -> dict:
    """:func:`_rope_layout`, then the rotary kernel once on one token with these constants, so that whatever
    it would refuse during a forward is refused now, before anything is patched."""
    lay = _rope_layout(module, fn, mrope)
    d = lay["rotary_dim"]
    if module.inv_freq.is_meta:  # a model not materialized yet: the constants are checked, the kernel runs later
        return lay
    q = torch.zeros(1, 1, d)
    try:
        pos = torch.ones(3, 1, dtype=torch.int64) if mrope else torch.ones(1, dtype=torch.int64)
        _rope_impl(q, q.clone(), pos, inv_freq=module.inv_freq.detach().float().cpu(),
                   rotary_dim=d, mrope_section=lay["mrope_section"], mrope_interleaved=lay["mrope_interleaved"],
                   attention_scaling=float(getattr(module, "attention_scaling", 1.0)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"packcuda.{fn}: the rotary layout of {type(module).__name__} ({lay}) is refused by "
                         f"packcuda.apply_rope: {e}") from e
    return lay


def _default_rope(q, k, positions, **kw):
    return packcuda.apply_rope(q, k, positions, **kw)


# the rotary kernel the patched attention calls (tests can point it to a plain reference)
_rope_impl = _default_rope


def _rotary_forward(self, x, position_ids):
    """Replacement of the text rotary module's forward: no cos/sin tables, just the positions."""
    rope_type = getattr(self, "rope_type", "default")
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise UnsupportedModelError(f"packcuda.patch_qwen_vl_rope: rope_type {rope_type!r} (dynamic frequencies) is "
                                    "not supported; unpatch the model")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (2, 3):
        raise ValueError("packcuda.patch_qwen_vl_rope: the rotary module takes position_ids [B, S] or [3, B, S], "
                         f"got {getattr(position_ids, 'shape', type(position_ids).__name__)}")
    fam = getattr(self, "_packcuda_family", None)
    mrope = fam is None or fam.mrope
    if position_ids.dim() == 2:
        position_ids = position_ids[None]
    # [3, Bp, Sp] (mRoPE) or [1, Bp, Sp] (plain RoPE: the first row), broadcast against q in apply_rotary_pos_emb
    pos = position_ids.expand(3, -1, -1) if mrope else position_ids[:1]
    lay = vars(self).get("_packcuda_rope") or _rope_layout(self, "patch_qwen_vl_rope", mrope)  # class patches: here
    carrier = _RopePositions(pos, self.inv_freq.float(), lay["rotary_dim"], lay["mrope_section"],
                             lay["mrope_interleaved"], float(self.attention_scaling),
                             vars(self).get("_packcuda_norms"))
    return carrier, carrier


class _NormState:
    """The q_norm / k_norm modules an attention layer called (deferred) and that its apply_rotary_pos_emb has
    not applied yet: one per model patched with fuse_qk_norm."""

    __slots__ = ("q", "k")

    def __init__(self):
        self.q = self.k = None

    def take(self):
        nq, nk = self.q, self.k
        self.q = self.k = None
        return nq, nk


_NORM_STATES: List[_NormState] = []  # of the active patches with fuse_qk_norm


def _deferred_norm(self, x):
    """Replacement of an attention's q_norm / k_norm forward (fuse_qk_norm): x unchanged; the norm is applied,
    fused with the rotation, by the patched apply_rotary_pos_emb that follows in the same attention forward."""
    state, slot, _, _ = self._packcuda_norm_slot
    setattr(state, slot, self)
    return x


def _unfused_norm(mod, x):
    """The norm module's own (transformers') forward, for an apply_rotary_pos_emb called with cos/sin tables."""
    return x if mod is None else type(mod).forward(mod, x)


def _default_qk_norm_rope(q, k, positions, **kw):
    return packcuda.apply_qk_norm_rope(q, k, positions, **kw)


# the fused norm + rotary kernel the patched attention calls with fuse_qk_norm (tests can point it elsewhere)
_qk_norm_rope_impl = _default_qk_norm_rope


def _check_qk_norms(fam: Family, mod, model, fn: str) -> list:
    """The (q_norm, k_norm, kind, eps) of every attention of `model` for fuse_qk_norm; refuses (before anything
    is patched) a family without per-head norms, a norm of a class it does not recognize, or norm code that is
    not the one the fused kernel reproduces."""
    if not fam.qk_norm:
        raise UnsupportedModelError(f"packcuda.{fn}: {fam.model_type} attention has no per-head q_norm / k_norm; "
                                    "fuse_qk_norm does not apply")
    cls_name, kind, eps_attr = fam.qk_norm
    norm_cls = getattr(mod, cls_name, None)
    is_cls = isinstance(norm_cls, type)
    attn_cls = getattr(mod, fam.attention)
    checks = [(attn_cls.forward, f"{fam.attention}.forward", ["self.q_norm(", "self.k_norm("])]
    if kind == "rms":
        checks.append((norm_cls.forward if is_cls else None, f"{cls_name}.forward",
                       ["torch.rsqrt(variance + self.variance_epsilon)", "self.weight * hidden_states.to(input_dtype)"]))
    else:
        checks += [(norm_cls.forward if is_cls else None, f"{cls_name}.forward",
                    ["self._norm(x.float())", "output * (1.0 + self.weight.float())", "output.type_as(x)"]),
                   (getattr(norm_cls, "_norm", None) if is_cls else None, f"{cls_name}._norm",
                    ["torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"])]
    for obj, name, need in checks:
        _check_source(obj, name, need, f"packcuda.{fn} (fuse_qk_norm): {fam.model_type} in transformers "
                                        f"{transformers_version()}")
    out = []
    attns = [m for m in model.modules() if type(m) is attn_cls]
    if not attns:
        raise UnsupportedModelError(f"packcuda.{fn}: model ({type(model).__name__}) has no {fam.attention} module")
    for a in attns:
        pair = []
        for which in ("q_norm", "k_norm"):
            nm = getattr(a, which, None)
            if type(nm) is not norm_cls:
                raise UnsupportedModelError(
                    f"packcuda.{fn}: {fam.attention}.{which} is a {type(nm).__name__}, not the {cls_name} that "
                    "fuse_qk_norm reproduces; refusing to patch")
            w = getattr(nm, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.shape[0] != getattr(a, "head_dim", w.shape[0]):
                raise UnsupportedModelError(f"packcuda.{fn}: {fam.attention}.{which}.weight must be [head_dim], got "
                                            f"{getattr(w, 'shape', None)}")
            pair.append(nm)
        eq, ek = (packcuda._meta.check_float(fn, f"{which}.{eps_attr}", getattr(nm, eps_attr, None), lo=0.0)
                  for which, nm in zip(("q_norm", "k_norm"), pair))
        if eq != ek:
            raise UnsupportedModelError(f"packcuda.{fn}: q_norm eps {eq} and k_norm eps {ek} differ; the fused kernel "
                                        "takes one eps")
        out.append((pair[0], pair[1], kind, eq))
    return out


def _make_apply(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not isinstance(cos, _RopePositions):
            pending = [st for st in _NORM_STATES if st.q is not None or st.k is not None]
            if pending:  # cos/sin tables of the caller's own: the deferred norms run here, as modules
                nq, nk = pending[0].take()
                q, k = _unfused_norm(nq, q), _unfused_norm(nk, k)
            return original(q, k, cos, sin, unsqueeze_dim)
        if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4:
            raise ValueError("packcuda.patch_qwen_vl_rope: expected q, k of shape [B, H, S, D] (unsqueeze_dim=1)")
        B, Hq, S, D = q.shape
        Hk = k.shape[1]
        pos = cos.positions
        _, Bp, Sp = pos.shape
        if Bp not in (1, B) or Sp not in (1, S):  # transformers broadcasts cos/sin [Bp, 1, Sp, D] against q
            raise ValueError(f"packcuda.patch_qwen_vl_rope: position_ids with batch {Bp} and length {Sp} do not "
                             f"broadcast to the batch of the hidden states ([{B}, {S}])")
        R = pos.shape[0]
        pos = pos.expand(R, B, S).reshape(R, B * S)
        if cos.mrope_section is None:
            pos = pos[0]
        qt = q.transpose(1, 2).reshape(B * S, Hq, D)  # views for the [B, S, H, D] projections
        kt = k.transpose(1, 2).reshape(B * S, Hk, D)
        kw = dict(inv_freq=cos.inv_freq, rotary_dim=cos.rotary_dim, mrope_section=cos.mrope_section,
                  mrope_interleaved=cos.interleaved, attention_scaling=cos.attention_scaling)
        norms = cos.norms
        if norms is not None and (norms.q is not None or norms.k is not None):
            nq, nk = norms.take()
            if nq is None or nk is None:
                raise RuntimeError("packcuda.patch_qwen_vl_rope: the attention called only one of q_norm / k_norm "
                                   "before apply_rotary_pos_emb; unpatch the model (fuse_qk_norm=False)")
            _, _, kind, eps = nq._packcuda_norm_slot
            qo, ko = _qk_norm_rope_impl(qt, kt, pos, q_weight=nq.weight, k_weight=nk.weight, eps=eps, norm=kind,
                                        **kw)
        else:
            qo, ko = _rope_impl(qt, kt, pos, **kw)
        return qo.reshape(B, S, Hq, D).transpose(1, 2), ko.reshape(B, S, Hk, D).transpose(1, 2)

    apply_rotary_pos_emb.__packcuda_original__ = original
    apply_rotary_pos_emb.__doc__ = "packcuda.apply_rope for positions from the patched rotary module; otherwise " \
                                   "the original transformers function."
    return apply_rotary_pos_emb


def _src(obj) -> str:
    try:
        return inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return ""


def _check_source(obj, name: str, needles, where: str) -> None:
    """Refuses (UnsupportedTransformersError) when the source of obj lacks any of the needles (a tuple of
    strings is one needle written in alternative ways: one of them must be there)."""
    src = _src(obj) if obj is not None else ""
    missing = [n for n in needles if not any(alt in src for alt in ((n,) if isinstance(n, str) else n))]
    if missing:
        raise UnsupportedTransformersError(f"{where}: {name} is not the code this patch was written for (missing "
                                           f"{missing}); refusing to patch")


def _import_family(fam: Family):
    import importlib

    try:
        return importlib.import_module(fam.module)
    except ImportError as e:
        raise UnsupportedTransformersError(
            f"packcuda.integrations.transformers: transformers {transformers_version()} has no {fam.module} ({e})")


# The text models' rotary frequencies, as transformers writes them: position * inv_freq in fp32, elementwise
# (5.24) or as the [n, 1] x [1, T] fp32 product of the earlier releases (one product per element: the same values).
_TEXT_FREQS = ("position_ids[..., None].float()", "inv_freq_expanded.float() @ position_ids_expanded.float()")


def _check_code(fam: Family, mod) -> None:
    """The patch relies on these facts about the modeling code; refuse if any is not true."""
    v = transformers_version()
    problems = []
    for name in (fam.text_model, fam.rotary, fam.attention):
        if not isinstance(getattr(mod, name, None), type):
            problems.append(f"class {name} is missing")
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        problems.append("apply_rotary_pos_emb is missing")
    if problems:
        raise UnsupportedTransformersError(f"packcuda rotary patch: {fam.model_type} in transformers {v}: "
                                           + "; ".join(problems))
    original = getattr(fn, "__packcuda_original__", fn)
    expect = [
        (original, "apply_rotary_pos_emb", ["rotate_half(", "cos.unsqueeze(unsqueeze_dim)"]),
        (getattr(mod, fam.attention).forward, f"{fam.attention}.forward",
         ["cos, sin = position_embeddings", "apply_rotary_pos_emb(query_states, key_states, cos, sin)"]),
        (getattr(mod, fam.text_model).forward, f"{fam.text_model}.forward",
         (["text_position_ids = position_ids[0]"] if fam.mrope else [])
         + ["position_embeddings = self.rotary_emb(hidden_states, position_ids)"]),
        (getattr(mod, fam.rotary).forward, f"{fam.rotary}.forward",
         ["self.inv_freq", "self.attention_scaling"] + (["recomposition_frequencies"] if fam.mrope else
                                                         [_TEXT_FREQS])),
    ]
    if fam.mrope:
        expect.append((getattr(getattr(mod, fam.rotary), "recomposition_frequencies", None),
                       f"{fam.rotary}.recomposition_frequencies",
                       ["slice(offset, length, 3)"] if fam.interleaved else ["split(self.mrope_section"]))
    for obj, name, needles in expect:
        if getattr(obj, "__name__", "") == "_rotary_forward":
            continue  # already patched by us
        _check_source(obj, name, needles, f"packcuda rotary patch: {fam.model_type} in transformers {v}")
    if getattr(original, "__module__", None) != mod.__name__:
        raise UnsupportedTransformersError(
            f"packcuda rotary patch: {fam.model_type}: {fam.module}.apply_rotary_pos_emb was replaced by "
            f"{getattr(original, '__module__', '?')} (another kernel library?); refusing to patch over it")


_LOCK = threading.Lock()
_FN_REFS: Dict[str, int] = {}  # module name -> handles that patched its apply_rotary_pos_emb
_ACTIVE: List["RopePatch"] = []


class _Patch:
    """What a patch handle shares: the attributes it set (restored in reverse order) and ``with`` semantics."""

    def __init__(self, model=None):
        self.model = model
        self._saved: List[Tuple[object, str, object, bool]] = []  # (owner, attr, previous, had_own_attr)
        self.active = False

    def _set(self, owner, attr, value):
        had = attr in vars(owner)
        self._saved.append((owner, attr, vars(owner).get(attr), had))
        setattr(owner, attr, value)

    def _restore(self) -> None:
        for owner, attr, prev, had in reversed(self._saved):
            if had:
                setattr(owner, attr, prev)
            else:
                delattr(owner, attr)
        self._saved.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False


class RopePatch(_Patch):
    """Handle of an applied rotary patch: ``unpatch()`` (or leaving a ``with`` block) restores the originals."""

    def __init__(self, families: Sequence[Family], model=None):
        super().__init__(model)
        self.families = tuple(families)
        self.model_types = tuple(f.model_type for f in families)
        self._modules: List[str] = []
        self._norm_state: Optional["_NormState"] = None  # fuse_qk_norm

    def unpatch(self) -> None:
        """Restores what this handle patched (idempotent)."""
        if not isinstance(self, RopePatch):
            raise TypeError(f"packcuda.RopePatch.unpatch: self must be a RopePatch, got {type(self).__name__}")
        with _LOCK:
            if not self.active:
                return
            self._restore()
            if self._norm_state is not None:
                if self._norm_state in _NORM_STATES:
                    _NORM_STATES.remove(self._norm_state)
                self._norm_state = None
            import importlib

            for name in self._modules:
                _FN_REFS[name] -= 1
                if _FN_REFS[name] == 0:
                    del _FN_REFS[name]
                    mod = importlib.import_module(name)
                    mod.apply_rotary_pos_emb = mod.apply_rotary_pos_emb.__packcuda_original__
            self._modules.clear()
            self.active = False
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def __repr__(self):
        scope = type(self.model).__name__ if self.model is not None else "all models"
        return f"RopePatch({', '.join(self.model_types)}; {scope}; {'active' if self.active else 'removed'})"


def patch_qwen_vl_rope(model=None, *, model_types: Optional[Sequence[str]] = None,
                       allow_unverified_version: bool = False, fuse_qk_norm: bool = False) -> RopePatch:
    """Route the text attention's rotary application of Qwen-VL models through :func:`packcuda.apply_rope`.

    - ``patch_qwen_vl_rope(model)``: patches this model only (its text rotary module(s)); the model's
      ``config.model_type`` must be one of :data:`SUPPORTED_MODEL_TYPES`.
    - ``patch_qwen_vl_rope()`` (or ``model_types=[...]``): patches the classes, so every model of those
      families built afterwards (or before) uses packcuda.

    Checks first, patches nothing on failure: the transformers version is in :data:`SUPPORTED_TRANSFORMERS`
    (``allow_unverified_version=True`` skips only this one), the modeling code has the structure the patch
    replaces, ``apply_rotary_pos_emb`` was not replaced by another library, the rope type has static
    frequencies. Returns a :class:`RopePatch`; ``unpatch()`` (or :func:`unpatch_qwen_vl_rope`) restores.

    The rotary layout (``rotary_dim``, ``mrope_section``, interleaving) is read with
    :func:`packcuda.rope_kwargs_from_config` from each rotary module's config; with a model, it is checked
    when patching (the kernel runs once on one token with these constants), so a layout packcuda cannot
    reproduce is a ``ValueError`` here, never during a forward (class patches read it at the module's first
    forward). ``position_ids`` of batch 1 ([1, S] or [3, 1, S]) broadcast over the batch as transformers
    broadcasts its cos/sin.

    What changes: the text rotary module returns the positions instead of cos/sin tables and the module's
    ``apply_rotary_pos_emb`` calls ``packcuda.apply_rope`` on q/k viewed as ``[B*S, H, D]`` (no copy). The
    vision towers and everything else run unchanged. Numerics: angles and rotation in fp32, rounded once to
    the activation dtype (transformers rounds cos/sin to it first), so bf16 results differ by rounding.

    Qwen3 text models (``model_type`` "qwen3", plain RoPE from ``[B, S]`` position_ids) are patched the same way
    (``PATCHABLE_MODEL_TYPES``); ``patch_qwen_vl_rope()`` without arguments patches the Qwen-VL families only.

    ``fuse_qk_norm=True`` (with a model of Qwen3, Qwen3-VL or Qwen3.5): the attention's ``q_norm`` / ``k_norm``
    are deferred and applied, fused with the rotation, by :func:`packcuda.apply_qk_norm_rope` (norm "rms" for
    Qwen3 / Qwen3-VL, "rms_offset" for Qwen3.5), forward and backward, reading the projections' views once. Each
    norm must be exactly the family's norm class (a replaced or subclassed norm is refused before anything is
    patched). An attention called with cos/sin tables of its own still gets its norms, unfused.
    """
    fn = "patch_qwen_vl_rope"
    if not isinstance(allow_unverified_version, bool):
        raise TypeError(f"packcuda.{fn}: allow_unverified_version must be a bool, got "
                        f"{type(allow_unverified_version).__name__}")
    if not isinstance(fuse_qk_norm, bool):
        raise TypeError(f"packcuda.{fn}: fuse_qk_norm must be a bool, got {type(fuse_qk_norm).__name__}")
    if fuse_qk_norm and model is None:
        raise ValueError(f"packcuda.{fn}: fuse_qk_norm needs a model (it patches the model's own norm modules)")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"packcuda.{fn}: model must be a torch.nn.Module (a transformers model), got "
                        f"{type(model).__name__}")
    if model_types is not None and (isinstance(model_types, (str, bytes)) or not hasattr(model_types, "__iter__")):
        raise TypeError(f"packcuda.{fn}: model_types must be a sequence of model_type names, got {model_types!r}")
    _check_version(allow_unverified_version)
    if model is not None:
        if model_types is not None:
            raise ValueError(f"packcuda.{fn}: give a model or model_types, not both")
        fams = [_family_of(model, fn, text_ok=True)]
    else:
        names = list(model_types) if model_types is not None else list(_FAMILIES)
        fams = []
        known = {**_FAMILIES, **_TEXT_FAMILIES}
        for n in names:
            n2 = _ALIASES.get(n, n) if isinstance(n, str) else n
            if not isinstance(n2, str) or n2 not in known:
                raise UnsupportedModelError(f"packcuda.{fn}: model_types has model_type {n!r}, which is not "
                                            f"supported; supported: {', '.join(PATCHABLE_MODEL_TYPES)}")
            fams.append(known[n2])
    _require("apply_rope")
    mods = {}
    for fam in fams:
        mod = _import_family(fam)
        _check_code(fam, mod)
        mods[fam.model_type] = mod
    targets = []
    if model is not None:
        fam = fams[0]
        rot_cls = getattr(mods[fam.model_type], fam.rotary)
        targets = [m for m in model.modules() if type(m) is rot_cls]
        if not targets:
            raise UnsupportedModelError(f"packcuda.{fn}: model ({type(model).__name__}) has no {fam.rotary} module")
        for m in targets:
            rt = getattr(m, "rope_type", "default")
            if rt in _DYNAMIC_ROPE_TYPES:
                raise UnsupportedModelError(f"packcuda.{fn}: model has rope_type {rt!r} (dynamic frequencies), "
                                            "which is not supported")
        layouts = [_check_rope_layout(m, fn, fam.mrope) for m in targets]  # refused here, not during a forward
    norms = []
    if fuse_qk_norm:
        _require("apply_qk_norm_rope")
        norms = _check_qk_norms(fams[0], mods[fams[0].model_type], model, fn)
    handle = RopePatch(fams, model)
    with _LOCK:
        for fam in fams:
            mod = mods[fam.model_type]
            rot_cls = getattr(mod, fam.rotary)
            if model is not None:
                state = _NormState() if norms else None
                for m, lay in zip(targets, layouts):
                    handle._set(m, "_packcuda_rope", lay)
                    handle._set(m, "_packcuda_family", fam)
                    handle._set(m, "forward", types.MethodType(_rotary_forward, m))
                    if state is not None:
                        handle._set(m, "_packcuda_norms", state)
                for nq, nk, kind, eps in norms:
                    for nm, slot in ((nq, "q"), (nk, "k")):
                        handle._set(nm, "_packcuda_norm_slot", (state, slot, kind, eps))
                        handle._set(nm, "forward", types.MethodType(_deferred_norm, nm))
                if state is not None:
                    handle._norm_state = state
                    _NORM_STATES.append(state)
            else:
                handle._set(rot_cls, "_packcuda_family", fam)
                handle._set(rot_cls, "forward", _rotary_forward)
            if mod.__name__ not in _FN_REFS:
                mod.apply_rotary_pos_emb = _make_apply(mod.apply_rotary_pos_emb)
                _FN_REFS[mod.__name__] = 0
            _FN_REFS[mod.__name__] += 1
            handle._modules.append(mod.__name__)
        handle.active = True
        _ACTIVE.append(handle)
    return handle


def unpatch_qwen_vl_rope(handle: Optional[RopePatch] = None) -> None:
    """Undo one patch (``handle``) or, without an argument, every active one."""
    if handle is not None and not isinstance(handle, RopePatch):
        raise TypeError(f"packcuda.unpatch_qwen_vl_rope: handle must be a RopePatch (what patch_qwen_vl_rope "
                        f"returns) or None, got {type(handle).__name__}")
    if handle is not None:
        handle.unpatch()
        return
    for h in list(reversed(_ACTIVE)):
        h.unpatch()


def is_patched(model=None) -> bool:
    """Whether ``model`` (or, without an argument, any model) currently runs the packcuda rotary path."""
    if model is None:
        return bool(_ACTIVE)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"packcuda.is_patched: model must be a torch.nn.Module or None, got {type(model).__name__}")
    try:
        fam = _family_of(model, text_ok=True)
    except UnsupportedModelError:
        return False
    mod = _import_family(fam)
    rot_cls = getattr(mod, fam.rotary)
    mods = [m for m in model.modules() if type(m) is rot_cls]
    return bool(mods) and all(getattr(m.forward, "__func__", m.forward) is _rotary_forward for m in mods)


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


# ---------------------------------------------------------------------------------------------------
# Qwen3.5 linear attention (GatedDeltaNet): packed rows and context parallelism
# ---------------------------------------------------------------------------------------------------
_QWEN3_5 = _FAMILIES["qwen3_5"]
_GDN_CLASS = "Qwen3_5GatedDeltaNet"
_GDN_LAYER = "Qwen3_5DecoderLayer"
# the kwarg by which a patched decoder layer hands its sample boundaries to its GatedDeltaNet
_CU_KWARG = "packcuda_cu_seqlens"
_GDN_ACTIVATIONS = ("silu", "swish")  # the same function; packcuda.causal_conv1d calls it "silu"


@functools.lru_cache(maxsize=1)
def _fla_chunk_rule():
    """flash-linear-attention's varlen ``chunk_gated_delta_rule``, or None when it is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def _fla_cp():
    """(chunk_gated_delta_rule, build_cp_context) of a flash-linear-attention with context parallelism for the
    gated delta rule, or None."""
    rule = _fla_chunk_rule()
    if rule is None:
        return None
    try:
        from fla.ops.cp import build_cp_context
    except Exception:
        return None
    try:
        if "cp_context" not in inspect.signature(rule).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return rule, build_cp_context


def _fla_cp_recurrence(q, k, v, g, beta, *, plan, group, state):
    """The gated delta rule of this rank's contiguous shard through flash-linear-attention's CP context (its
    state is handed from rank to rank). ``state`` caches the context per plan (one build per batch)."""
    rule, build = _fla_cp()
    ctx = state.get("fla_ctx")
    if ctx is None or ctx[0] is not plan:
        cu_cpu = torch.tensor(plan.cu_seqlens_padded_host, dtype=torch.int64)
        cu_dev = packcuda._meta.to_device_async(cu_cpu, q.device)
        ctx = (plan, build(cu_dev, group=group, cu_seqlens_cpu=cu_cpu))
        state["fla_ctx"] = ctx
    out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=ctx[1].cu_seqlens, cp_context=ctx[1])
    return out


def _cp_recurrence(plan):
    """The recurrence of a CP shard: a callable ``(q, k, v, g, beta, *, plan, group, state) -> out`` ``[1, T, Hv,
    Dv]``, or a reason why none is available (a str)."""
    if _fla_cp() is None:
        return ("no context-parallel backend for the gated delta rule is installed (flash-linear-attention with "
                "fla.ops.cp and chunk_gated_delta_rule(cp_context=...))")
    if plan.layout != "contiguous":
        return (f"flash-linear-attention's CP context splits the stream contiguously; a {plan.layout!r} plan is "
                "not supported (build the plan with layout='contiguous')")
    return _fla_cp_recurrence


def _gdn_checks(mod) -> None:
    """The linear-attention patch relies on these facts about transformers' Qwen3.5 modeling code."""
    v = transformers_version()
    problems = [f"{n} is missing" for n in (_GDN_CLASS, _GDN_LAYER, "torch_chunk_gated_delta_rule",
                                            "apply_mask_to_padding_states") if getattr(mod, n, None) is None]
    if problems:
        raise UnsupportedTransformersError(f"packcuda linear-attention patch: qwen3_5 in transformers {v}: "
                                           + "; ".join(problems))
    gdn, layer = getattr(mod, _GDN_CLASS), getattr(mod, _GDN_LAYER)
    expect = [
        (gdn.forward, f"{_GDN_CLASS}.forward", [
            "apply_mask_to_padding_states(hidden_states, attention_mask)", "self.in_proj_qkv(hidden_states)",
            "self.in_proj_z(hidden_states)", "self.in_proj_b(hidden_states)", "self.in_proj_a(hidden_states)",
            "self.conv1d.weight.squeeze(1)", "activation=self.activation",
            "self.key_dim,\n                self.key_dim,\n                self.value_dim,",
            "beta = b.sigmoid()", "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)",
            "torch_chunk_gated_delta_rule(", "use_qk_l2norm_in_kernel=True", "self.norm(core_attn_out, z)",
            "self.out_proj(core_attn_out)"]),
        (gdn.__init__, f"{_GDN_CLASS}.__init__", [
            "self.conv_dim = self.key_dim * 2 + self.value_dim", "groups=self.conv_dim",
            "self.activation = config.hidden_act"]),
        (layer.forward, f"{_GDN_LAYER}.forward", ["self.linear_attn(", 'self.block_type == "linear_attention"']),
    ]
    for obj, name, needles in expect:
        _check_source(obj, name, needles, f"packcuda linear-attention patch: qwen3_5 in transformers {v}")


class _GdnState:
    """What the patched layers of one model share: the plan and group (CP), the recurrence, and the sample
    boundaries derived from the position ids of the current forward (computed once, reused by every layer)."""

    def __init__(self, mod, plan, group, cp_recurrence):
        self.mod = mod
        self.plan = plan
        self.group = group
        self.cp_recurrence = cp_recurrence
        self.cache: dict = {}
        self.repeat_heads = "query.repeat_interleave(" in _src(getattr(mod, _GDN_CLASS).forward)
        self._pos = None  # (weakref of the position ids, their version, number of rows, cu_seqlens)

    def boundaries(self, position_ids, B: int, S: int):
        """cu_seqlens of the flattened ``[B * S]`` rows: every row starts a sample, and so does every position
        0 of the text position ids ``[B, S]`` (one device read per new position tensor)."""
        import weakref

        if position_ids is None or not isinstance(position_ids, torch.Tensor):
            return list(range(0, B * S + 1, S)) if S else [0]
        last = self._pos
        if last is not None and last[0]() is position_ids and last[1] == position_ids._version and last[2] == B * S:
            return last[3]
        pos = position_ids
        if pos.dim() == 3:  # [R, B, S]: the text row first
            pos = pos[0]
        if pos.dim() != 2 or pos.shape[-1] != S or pos.shape[0] not in (1, B):
            raise ValueError(f"packcuda.patch_qwen3_5_linear_attention: position_ids of shape "
                             f"{tuple(position_ids.shape)} do not describe the [{B}, {S}] rows of the layer")
        start = pos.expand(B, S) == 0
        start[:, 0] = True
        idx = start.reshape(-1).nonzero().reshape(-1)
        cu = torch.cat([idx, idx.new_tensor([B * S])]).to(torch.int32)
        self._pos = (weakref.ref(position_ids), position_ids._version, B * S, cu)
        return cu


def _gdn_layer_pre_hook(state: _GdnState):
    def hook(module, args, kwargs):
        if getattr(module, "block_type", None) != "linear_attention" or kwargs.get("cu_seq_lens_q") is not None:
            return None
        if state.plan is not None:
            return None
        h = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(h, torch.Tensor) or h.dim() != 3:
            return None
        B, S = h.shape[0], h.shape[1]
        kwargs = dict(kwargs)
        kwargs[_CU_KWARG] = state.boundaries(kwargs.get("position_ids"), B, S)
        return args, kwargs

    return hook


def _gdn_conv(layer, x: torch.Tensor, cu_seqlens, *, plan=None, group=None) -> torch.Tensor:
    """The GatedDeltaNet's causal conv1d (+ activation) of ``x`` ``[T, C]`` (the ``in_proj_qkv`` output) with
    packcuda: without ``plan`` on the samples ``cu_seqlens``, with ``plan`` on the plan's local pieces, each
    reading its K-1 preceding rows from whichever rank holds them (:func:`packcuda.conv_prefix`)."""
    w = layer.conv1d.weight.squeeze(1)
    bias = layer.conv1d.bias
    xw = x.to(w.dtype)
    act = "silu" if layer.activation in _GDN_ACTIVATIONS else layer.activation
    if plan is None:
        y = packcuda.causal_conv1d(xw, w, bias, cu_seqlens=cu_seqlens, activation=act)
    else:
        K = int(w.shape[1])
        prefix = packcuda.conv_prefix(xw, plan, K, group) if K > 1 else None
        y = packcuda.causal_conv1d(xw, w, bias, cu_seqlens=plan.pieces, prefix=prefix, activation=act)
    return y.to(x.dtype)


def _per_sample_rule(fn, q, k, v, g, beta, cu) -> torch.Tensor:
    """``fn`` (transformers' PyTorch gated delta rule) on every sample alone, concatenated: correct, slow."""
    cu = host_list(cu, "cu_seqlens", op="patch_qwen3_5_linear_attention")
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            o, _ = fn(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=None,
                      output_final_state=False, use_qk_l2norm_in_kernel=True)
            outs.append(o)
    if not outs:
        return v.new_zeros(v.shape)
    return torch.cat(outs, dim=1)


def _gdn_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Replacement of ``Qwen3_5GatedDeltaNet.forward`` for packed rows (and CP shards): the conv and the gated
    delta rule stop at the sample boundaries. With a cache (generation) the original forward runs."""
    state: _GdnState = self._packcuda_gdn
    cu = kwargs.pop(_CU_KWARG, None)
    cache = cache if cache is not None else kwargs.pop("cache_params", kwargs.pop("past_key_values", None))
    if cache is not None:
        if state.plan is not None:
            raise ValueError("packcuda.patch_qwen3_5_linear_attention: a model patched for context parallelism "
                             "does not run with a cache (generation); unpatch it first")
        return self._packcuda_original_forward(hidden_states, cache, attention_mask=attention_mask, **kwargs)
    mod = state.mod
    hidden_states = mod.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, S, _ = hidden_states.shape
    T = B * S
    if state.plan is not None:
        if B != 1 or S != state.plan.total_local:
            raise ValueError(f"packcuda.patch_qwen3_5_linear_attention: hidden_states must be this rank's [1, "
                             f"{state.plan.total_local}] slots of the plan, got [{B}, {S}]")
    else:
        given = kwargs.get("cu_seq_lens_q")
        if given is not None:
            cu = given
        elif cu is None:
            cu = list(range(0, T + 1, S)) if S else [0]
    mixed = self.in_proj_qkv(hidden_states).reshape(T, -1)
    z = self.in_proj_z(hidden_states).reshape(T, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states).reshape(1, T, -1)
    a = self.in_proj_a(hidden_states).reshape(1, T, -1)
    mixed = _gdn_conv(self, mixed, cu, plan=state.plan, group=state.group)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(1, T, -1, self.head_k_dim)
    k = k.reshape(1, T, -1, self.head_k_dim)
    v = v.reshape(1, T, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias)
    if state.repeat_heads and self.num_v_heads != self.num_k_heads:
        # grouped values (every q/k head serves consecutive value heads), expanded here where the installed
        # transformers expands them before its rule (5.17); later releases hand the rule the q/k heads as they are
        rep = self.num_v_heads // self.num_k_heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if state.plan is not None:
        core = state.cp_recurrence(q, k, v, g, beta, plan=state.plan, group=state.group, state=state.cache)
    else:
        fla = _fla_chunk_rule() if q.is_cuda else None  # FLA's kernels are GPU kernels
        if fla is not None:
            cu_dev = cu if isinstance(cu, torch.Tensor) and cu.device == q.device else None
            if cu_dev is None:
                cu_dev = packcuda._meta.to_device_async(_cu_tensor(cu), q.device)
            core, _ = fla(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev.to(torch.int64))
        else:
            core = _per_sample_rule(mod.torch_chunk_gated_delta_rule, q, k, v, g, beta, cu)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(B, S, -1))


def _cu_tensor(cu) -> torch.Tensor:
    return cu.to(torch.int64) if isinstance(cu, torch.Tensor) else packcuda._meta.host_tensor(
        cu, "cu_seqlens", op="patch_qwen3_5_linear_attention")


class LinearAttentionPatch(_Patch):
    """Handle of :func:`patch_qwen3_5_linear_attention`: ``unpatch()`` (or leaving a ``with`` block) restores
    the model's GatedDeltaNet layers; ``set_plan(plan)`` switches a CP patch to the next batch's plan."""

    def __init__(self, model, state: _GdnState, recurrence: str):
        super().__init__(model)
        self._state = state
        self._hooks: list = []
        self.recurrence = recurrence  # "fla varlen", "transformers per sample" or "fla cp"

    @property
    def plan(self):
        return self._state.plan

    @property
    def group(self):
        return self._state.group

    def set_plan(self, plan) -> None:
        """Use ``plan`` (a :func:`packcuda.shard_plan` of the next batch, same CP size and rank) from now on."""
        fn = "LinearAttentionPatch.set_plan"
        if not isinstance(self, LinearAttentionPatch):
            raise TypeError(f"packcuda.{fn}: self must be a LinearAttentionPatch, got {type(self).__name__}")
        if not self.active:
            raise ValueError(f"packcuda.{fn}: plan cannot be set: the patch was removed")
        if self._state.plan is None:
            raise ValueError(f"packcuda.{fn}: plan cannot be set on a patch made without one (packed rows, no CP); "
                             "patch with plan= and group=")
        _check_cp_plan(fn, plan, self._state.group)
        self._state.plan = plan
        self._state.cache.clear()

    def unpatch(self) -> None:
        """Restores the original GatedDeltaNet forwards and removes the boundary hooks (idempotent)."""
        if not isinstance(self, LinearAttentionPatch):
            raise TypeError(f"packcuda.LinearAttentionPatch.unpatch: self must be a LinearAttentionPatch, got "
                            f"{type(self).__name__}")
        with _LOCK:
            if not self.active:
                return
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._restore()
            self.active = False

    def __repr__(self):
        cp = "packed rows" if self._state.plan is None else f"CP {self._state.plan.layout} cp={self._state.plan.cp_size}"
        return (f"LinearAttentionPatch({type(self.model).__name__}; {cp}; recurrence: {self.recurrence}; "
                f"{'active' if self.active else 'removed'})")


def _check_cp_plan(fn: str, plan, group) -> None:
    if not isinstance(plan, packcuda.ShardPlan):
        raise TypeError(f"packcuda.{fn}: plan must be a packcuda.ShardPlan, got {type(plan).__name__}")
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.cp_size != size or plan.cp_rank != rank:
        raise ValueError(f"packcuda.{fn}: plan is for cp_size {plan.cp_size}, cp_rank {plan.cp_rank}, but this "
                         f"process is rank {rank} of a group of {size}")


def patch_qwen3_5_linear_attention(model, *, plan=None, group=None,
                                   allow_unverified_version: bool = False) -> LinearAttentionPatch:
    """Make the GatedDeltaNet (linear-attention) layers of a transformers Qwen3.5 model respect packed samples,
    and optionally run them on a context-parallel shard.

    - **Packed rows** (no ``plan``): each layer's causal conv1d runs as :func:`packcuda.causal_conv1d` on the
      sample boundaries, and the gated delta rule restarts its state at every sample. The boundaries are the
      ``cu_seq_lens_q`` the model is given (transformers' flash-attention packing kwargs; a host list or CPU
      tensor is used without a device sync), otherwise they are derived from the text position ids (a new
      sample wherever the position is 0, e.g. :func:`packed_position_ids` row 0), once per forward (one read of
      the start indices), shared by every layer. The recurrence is flash-linear-attention's varlen
      ``chunk_gated_delta_rule`` when it is importable, otherwise **transformers' own PyTorch implementation
      run on every sample alone** — correct, but a Python loop over samples with a host read of the
      boundaries, and slow; install flash-linear-attention for training.
    - **Context parallelism** (``plan`` from :func:`packcuda.shard_plan` of the global packed stream, ``group``
      its CP process group): each rank feeds its own ``[1, plan.total_local]`` slots; the conv reads the K−1
      rows before each local piece with :func:`packcuda.conv_prefix` and runs on ``plan.pieces``; the gated
      delta rule runs through flash-linear-attention's CP context (``fla.ops.cp.build_cp_context``,
      contiguous layout). Without a CP-capable recurrence backend (or with a layout it cannot run) the patch
      refuses, before patching anything. ``set_plan`` switches the handle to the next batch's plan.

    Checks first, patches nothing on failure: the transformers version is in :data:`SUPPORTED_TRANSFORMERS`,
    the model is a Qwen3.5 model (``model_type`` ``qwen3_5`` / ``qwen3_5_text``: ``Qwen3_5ForCausalLM``,
    ``Qwen3_5ForConditionalGeneration``, their base models) with GatedDeltaNet layers, and the GatedDeltaNet /
    decoder-layer code is the code this patch reproduces (checked in its source; verified on transformers
    5.17.0 and 5.24.0). Runs with a cache (generation) take the original forward. The rotary patch
    (:func:`patch_qwen_vl_rope`) is independent: both can be active together.
    """
    fn = "patch_qwen3_5_linear_attention"
    if not isinstance(allow_unverified_version, bool):
        raise TypeError(f"packcuda.{fn}: allow_unverified_version must be a bool, got "
                        f"{type(allow_unverified_version).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"packcuda.{fn}: model must be a torch.nn.Module (a transformers Qwen3.5 model), got "
                        f"{type(model).__name__}")
    if (plan is None) != (group is None):
        name = "group" if group is None else "plan"
        raise ValueError(f"packcuda.{fn}: plan and group go together (context parallelism); {name} is missing")
    if plan is not None:
        import torch.distributed as dist

        if not isinstance(plan, packcuda.ShardPlan):
            raise TypeError(f"packcuda.{fn}: plan must be a packcuda.ShardPlan, got {type(plan).__name__}")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"packcuda.{fn}: group must be a torch.distributed.ProcessGroup, got "
                            f"{type(group).__name__}")
        _check_cp_plan(fn, plan, group)
    mt = _get(_config_of(model), "model_type", None)
    if _ALIASES.get(mt, mt) != "qwen3_5":
        raise UnsupportedModelError(f"packcuda.{fn}: model has model_type {mt!r} ({type(model).__name__}); the "
                                    "linear-attention patch supports Qwen3.5 models (qwen3_5, qwen3_5_text) only")
    fam = _QWEN3_5
    _check_version(allow_unverified_version)
    mod = _import_family(fam)
    _gdn_checks(mod)
    gdn_cls, layer_cls = getattr(mod, _GDN_CLASS), getattr(mod, _GDN_LAYER)
    gdns = [m for m in model.modules() if type(m) is gdn_cls]
    layers = [m for m in model.modules() if type(m) is layer_cls and type(getattr(m, "linear_attn", None)) is gdn_cls]
    if not gdns:
        raise UnsupportedModelError(f"packcuda.{fn}: model ({type(model).__name__}) has no {_GDN_CLASS} layer")
    for m in gdns:
        if "_packcuda_gdn" in vars(m):
            raise ValueError(f"packcuda.{fn}: model is already patched (unpatch its LinearAttentionPatch first)")
        if m.activation not in _GDN_ACTIVATIONS:
            raise UnsupportedModelError(f"packcuda.{fn}: model has hidden_act {m.activation!r}; the conv supports "
                                        f"{', '.join(_GDN_ACTIVATIONS)}")
        if not 1 <= m.conv_kernel_size <= 8:
            raise UnsupportedModelError(f"packcuda.{fn}: model has linear_conv_kernel_dim {m.conv_kernel_size}; "
                                        "packcuda.causal_conv1d supports 1 to 8")
    cp_rule = None
    if plan is not None:
        cp_rule = _cp_recurrence(plan)
        if isinstance(cp_rule, str):
            raise ValueError(f"packcuda.{fn}: plan (context parallelism) cannot be served: {cp_rule}")
        recurrence = "fla cp"
    else:  # FLA on CUDA tensors; CPU tensors always take the per-sample PyTorch rule
        recurrence = "fla varlen" if _fla_chunk_rule() is not None else "transformers per sample"
    state = _GdnState(mod, plan, group, cp_rule)
    handle = LinearAttentionPatch(model, state, recurrence)
    with _LOCK:
        for m in gdns:
            handle._set(m, "_packcuda_original_forward", m.forward)
            handle._set(m, "_packcuda_gdn", state)
            handle._set(m, "forward", types.MethodType(_gdn_forward, m))
        hook = _gdn_layer_pre_hook(state)
        for layer in layers:
            handle._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        handle.active = True
    return handle
