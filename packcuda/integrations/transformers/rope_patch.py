"""The rotary patch: transformers' text attention rotates q and k with :func:`packcuda.apply_rope` (or, with
``fuse_qk_norm``, normalizes and rotates them with :func:`packcuda.apply_qk_norm_rope`), driven by the positions
themselves instead of cos/sin tables."""
from __future__ import annotations

import copy
import itertools
import sys
import types
from typing import List, Optional, Sequence, Tuple

import torch

import packcuda
from packcuda._families import Family

from ._common import (
    _ALIASES,
    _FAMILIES,
    _TEXT_FAMILIES,
    PATCHABLE_MODEL_TYPES,
    UnsupportedModelError,
    UnsupportedTransformersError,
    _check_source,
    _check_version,
    _family_of,
    _import_family,
    _require,
    _unwrap,
    transformers_version,
)
from ._patch import _Patch

# rope types whose inverse frequencies change during a forward (dynamic_rope_update): not supported
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


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
        packcuda.apply_rope(q, q.clone(), pos, inv_freq=module.inv_freq.detach().float().cpu(),
                            rotary_dim=d, mrope_section=lay["mrope_section"],
                            mrope_interleaved=lay["mrope_interleaved"],
                            attention_scaling=float(getattr(module, "attention_scaling", 1.0)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"packcuda.{fn}: the rotary layout of {type(module).__name__} ({lay}) is refused by "
                         f"packcuda.apply_rope: {e}") from e
    return lay


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


def _deferred_norm(self, x):
    """Replacement of an attention's q_norm / k_norm forward (fuse_qk_norm): x unchanged; the norm is applied,
    fused with the rotation, by the patched apply_rotary_pos_emb that follows in the same attention forward."""
    state, slot, _, _ = self._packcuda_norm_slot
    setattr(state, slot, self)
    return x


def _unfused_norm(mod, x):
    """The norm module's own (transformers') forward, for an apply_rotary_pos_emb called with cos/sin tables."""
    return x if mod is None else type(mod).forward(mod, x)


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
                       ["torch.rsqrt(variance + self.variance_epsilon)",
                        "self.weight * hidden_states.to(input_dtype)"]))
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
    """The module function ``apply_rotary_pos_emb`` of a patched modeling module, wrapping ``original``. It
    carries the handles that patched it (``__packcuda_handles__``, in patch order): the module is restored when
    the last of them is removed."""
    handles: List["RopePatch"] = []

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not isinstance(cos, _RopePositions):
            pending = [h._norm_state for h in handles if h._norm_state is not None
                       and (h._norm_state.q is not None or h._norm_state.k is not None)]
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
            qo, ko = packcuda.apply_qk_norm_rope(qt, kt, pos, q_weight=nq.weight, k_weight=nk.weight, eps=eps,
                                                 norm=kind, **kw)
        else:
            qo, ko = packcuda.apply_rope(qt, kt, pos, **kw)
        return qo.reshape(B, S, Hq, D).transpose(1, 2), ko.reshape(B, S, Hk, D).transpose(1, 2)

    apply_rotary_pos_emb.__packcuda_original__ = original
    apply_rotary_pos_emb.__packcuda_handles__ = handles
    apply_rotary_pos_emb.__doc__ = "packcuda.apply_rope for positions from the patched rotary module; otherwise " \
                                   "the original transformers function."
    return apply_rotary_pos_emb



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
    written = getattr(_unwrap(original), "__module__", None)
    if written != mod.__name__:
        raise UnsupportedTransformersError(
            f"packcuda rotary patch: {fam.model_type}: {fam.module}.apply_rotary_pos_emb was replaced by "
            f"{written or '?'} (another kernel library?); refusing to patch over it")


class RopePatch(_Patch):
    """Handle of an applied rotary patch: ``unpatch()`` (or leaving a ``with`` block) restores the originals."""

    def __init__(self, families: Sequence[Family], model=None):
        super().__init__(model)
        self.families = tuple(families)
        self.model_types = tuple(f.model_type for f in families)
        self._fns: List[Tuple[types.ModuleType, object]] = []  # (module, its patched apply_rotary_pos_emb)
        self._norm_state: Optional["_NormState"] = None  # fuse_qk_norm: the norms its attentions deferred
        self._order = next(RopePatch._count)

    _count = itertools.count()  # patch order, for unpatch_qwen_vl_rope() (the latest patch is undone first)

    def unpatch(self) -> None:
        """Restores what this handle patched (idempotent)."""
        if not isinstance(self, RopePatch):
            raise TypeError(f"packcuda.RopePatch.unpatch: self must be a RopePatch, got {type(self).__name__}")
        with self._lock:
            if not self.active:
                return
            self._restore()
            self._norm_state = None
            for mod, fn in self._fns:
                fn.__packcuda_handles__.remove(self)
                if not fn.__packcuda_handles__ and mod.apply_rotary_pos_emb is fn:
                    mod.apply_rotary_pos_emb = fn.__packcuda_original__
            self._fns.clear()
            self.active = False

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
    with handle._lock:
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
                handle._norm_state = state
            else:
                handle._set(rot_cls, "_packcuda_family", fam)
                handle._set(rot_cls, "forward", _rotary_forward)
            if not hasattr(mod.apply_rotary_pos_emb, "__packcuda_handles__"):
                mod.apply_rotary_pos_emb = _make_apply(mod.apply_rotary_pos_emb)
            patched = mod.apply_rotary_pos_emb
            patched.__packcuda_handles__.append(handle)
            handle._fns.append((mod, patched))
        handle.active = True
    return handle


def _active_patches() -> set:
    """The active handles: those that patched the apply_rotary_pos_emb of a loaded modeling module."""
    out = set()
    for fam in (*_FAMILIES.values(), *_TEXT_FAMILIES.values()):
        mod = sys.modules.get(fam.module)
        out.update(getattr(getattr(mod, "apply_rotary_pos_emb", None), "__packcuda_handles__", ()))
    return out


def unpatch_qwen_vl_rope(handle: Optional[RopePatch] = None) -> None:
    """Undo one patch (``handle``) or, without an argument, every active one."""
    if handle is not None and not isinstance(handle, RopePatch):
        raise TypeError(f"packcuda.unpatch_qwen_vl_rope: handle must be a RopePatch (what patch_qwen_vl_rope "
                        f"returns) or None, got {type(handle).__name__}")
    if handle is not None:
        handle.unpatch()
        return
    for h in sorted(_active_patches(), key=lambda h: h._order, reverse=True):
        h.unpatch()


def is_patched(model=None) -> bool:
    """Whether ``model`` (or, without an argument, any model) currently runs the packcuda rotary path."""
    if model is None:
        return bool(_active_patches())
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
