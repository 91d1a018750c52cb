"""What the transformers integration's features share: the supported transformers versions and model families,
the errors it raises, and the checks on the installed modeling code."""
from __future__ import annotations

import inspect
from typing import Dict, Tuple

import packcuda
from packcuda._families import FAMILIES, Family
from packcuda._meta import config_field as _get

# transformers versions whose Qwen-VL modeling code was read and tested with this patch: [low, high)
SUPPORTED_TRANSFORMERS = ("5.17.0", "5.26.0")


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


def _require(name: str):
    fn = getattr(packcuda, name, None)
    if fn is None:
        raise RuntimeError(f"packcuda.integrations.transformers: packcuda.{name} is not available in this build")
    return fn


def _unwrap(obj):
    """The function transformers wrote, under the wrappers transformers (>= 5.25) puts around some of them:
    ``functools.wraps`` chains, and the ``kernels`` package's function modules (``use_kernel_forward_from_hub``
    on a function makes it an instance of an ``nn.Module`` class whose ``forward`` calls the function, held in
    that forward's closure as ``func``). Anything else is returned as it is."""
    for _ in range(8):
        obj = inspect.unwrap(obj)
        cls = type(obj)
        fwd = getattr(cls, "forward", None)
        code = getattr(fwd, "__code__", None)
        if getattr(cls, "kernel_layer_name", None) is None or code is None or "func" not in code.co_freevars:
            return obj
        inner = fwd.__closure__[code.co_freevars.index("func")].cell_contents
        if not callable(inner):
            return obj
        obj = inner
    return obj


def _src(obj) -> str:
    try:
        return inspect.getsource(_unwrap(obj))
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
            f"packcuda.integrations.transformers: transformers {transformers_version()} has no {fam.module} ({e})"
        ) from e

