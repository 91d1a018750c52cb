"""mRoPE (Qwen-VL 3D rotary) position ids over a packed multimodal stream, equal to transformers'
``get_rope_index`` run on every sample alone, computed for the whole pack in one pass on CPU or GPU."""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _lib
from ._families import MROPE_FAMILIES
from ._meta import (
    IntsLike,
    check_float,
    check_int,
    config_field as _get,
    fake_kernel,
    is_device_tensor,
    op_metadata,
    plain_ints,
    tensor_device,
)

_lib.load()
ops = torch.ops.packcuda

__all__ = ["MRopeSpec", "mrope_position_ids"]

GridLike = Union[torch.Tensor, Sequence[Sequence[int]], None]

# ---------------------------------------------------------------------------------------------------
# fake (meta) kernel
# ---------------------------------------------------------------------------------------------------
@fake_kernel("mrope_position_ids", host=["cu_seqlens"],
             host_only=["image_grid_thw", "video_grid_thw", "second_per_grid_ts"])
def _mrope_position_ids_fake(input_ids, cu_seqlens, image_grid_thw, video_grid_thw, second_per_grid_ts,
                             image_token_id, video_token_id, spatial_merge_size=2, tokens_per_second=None,
                             per_frame=False, text_after_max=False):
    T = input_ids.shape[0]
    N = cu_seqlens.shape[0] - 1
    e = lambda *s: input_ids.new_empty(s, dtype=torch.int64)  # noqa: E731
    return e(3, T), e(T), e(N), e(1)


# ---------------------------------------------------------------------------------------------------
# facade
# ---------------------------------------------------------------------------------------------------
# Host metadata arrives as Python lists in most trainers; torch.tensor on a nested list is slow per element, so
# lists take a fast path (one C-level pass into an array buffer, wrapped without a copy) and fall back to the
# general conversion, with its messages, on anything unusual.
_OP = ops.mrope_position_ids.default
_EMPTY_GRID = torch.empty(0, 3, dtype=torch.int64)
_EMPTY_SECS = torch.empty(0, dtype=torch.float32)


_FN = "mrope_position_ids"


def _cu(cu_seqlens) -> torch.Tensor:
    if isinstance(cu_seqlens, torch.Tensor):
        if not cu_seqlens.is_cpu or (cu_seqlens.dim() == 1 and cu_seqlens.dtype in (torch.int32, torch.int64)):
            return cu_seqlens  # the op checks it (device tensors: dtype/shape/device; host: every value)
    return op_metadata(cu_seqlens, "cu_seqlens", op=_FN)  # lists of plain ints take host_tensor's fast path


def _grid(g: GridLike, name: str, op: str = _FN) -> torch.Tensor:
    """Host int32/int64 tensor of a grid argument (rows [t, h, w] of integers); a device tensor is read back (one
    sync). The op checks the shape ([n, 3]) and the values."""
    if g is None:
        return _EMPTY_GRID
    if isinstance(g, torch.Tensor):
        if g.dtype not in (torch.int32, torch.int64):  # (before a device tensor's read-back converts it)
            raise TypeError(f"packcuda.{op}: {name} must be an int32/int64 tensor, got {g.dtype}")
        if not g.is_cpu:  # read back below: a meta tensor has nothing to read (refused empty or not, as by the op)
            tensor_device(op, name, g)
        if not g.numel():
            return _EMPTY_GRID  # (a device tensor: no read-back, no sync)
        return g if g.is_cpu else g.detach().to("cpu", torch.int64)
    if type(g) in (list, tuple) and g and not torch.compiler.is_compiling():
        # Columns at C level: zip(strict=True) insists on rows of one length (unpacking: three of them), then
        # host metadata's fast path packs the columns (plain ints only: bools and other integer-likes take the
        # strict path below); the [n, 3] view reads the column-major buffer through its strides.
        try:
            t, h, w = zip(*g, strict=True)
        except (TypeError, ValueError):
            t = h = w = ()  # rows that are not triples: the general path below
        cols = plain_ints(t + h + w)
        if cols is not None:
            n = len(t)
            return cols.as_strided((n, 3), (1, n))
    if isinstance(g, (str, bytes)) or not hasattr(g, "__iter__"):
        raise TypeError(f"packcuda.{op}: {name} must be rows [t, h, w] (a list or an integer tensor [n, 3]), "
                        f"got {type(g).__name__}")
    try:
        import numpy as np

        if isinstance(g, np.ndarray) and g.ndim != 2 and g.size:
            raise ValueError(f"packcuda.{op}: {name} must have shape [n, 3] (rows [t, h, w]), got {list(g.shape)}")
    except ImportError:  # pragma: no cover
        pass
    rows = []
    for i, r in enumerate(g):
        if isinstance(r, torch.Tensor):
            r = r.tolist() if r.dim() == 1 else r
        if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
            raise TypeError(f"packcuda.{op}: {name}[{i}] must be a row [t, h, w], got {r!r}")
        r = list(r)
        if len(r) != 3:
            raise ValueError(f"packcuda.{op}: {name}[{i}] must be [t, h, w], got {r}")
        rows.append([check_int(op, f"{name}[{i}][{j}]", v) for j, v in enumerate(r)])
    if not rows:
        return _EMPTY_GRID
    return torch.tensor(rows, dtype=torch.int64)


def _seconds(s, op: str = _FN) -> torch.Tensor:
    """Host float32 [n] (the dtype the Qwen2.5-VL processor returns); a device tensor is read back. The op checks
    the values (finite, >= 0)."""
    if s is None:
        return _EMPTY_SECS
    if isinstance(s, torch.Tensor):
        if not (s.dtype.is_floating_point or s.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"packcuda.{op}: second_per_grid_ts must be a floating (or integer) tensor, got "
                            f"{s.dtype}")
        if s.dim() != 1:
            raise ValueError(f"packcuda.{op}: second_per_grid_ts must be 1-D, got shape {list(s.shape)}")
        if s.is_cpu and s.dtype == torch.float32:
            return s
        tensor_device(op, "second_per_grid_ts", s)  # read back below: a meta tensor has nothing to read
        return s.detach().to("cpu", torch.float32)
    if type(s) in (list, tuple) and s and set(map(type, s)) <= {int, float} and not torch.compiler.is_compiling():
        try:  # array("f") rounds each double to float32 exactly as torch.tensor(..., dtype=float32) does
            return torch.frombuffer(array("f", s), dtype=torch.float32)
        except OverflowError:
            pass
    if isinstance(s, (str, bytes)) or not hasattr(s, "__iter__"):
        raise TypeError(f"packcuda.{op}: second_per_grid_ts must be a sequence of numbers or a tensor, got "
                        f"{type(s).__name__}")
    vals = []
    for i, v in enumerate(s):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype.is_floating_point:
            v = v.item()
        vals.append(check_float(op, f"second_per_grid_ts[{i}]", v, lo=0.0))
    return torch.tensor(vals, dtype=torch.float32)


def mrope_position_ids(
    input_ids: torch.Tensor,
    cu_seqlens: IntsLike,
    *,
    image_grid_thw: GridLike = None,
    video_grid_thw: GridLike = None,
    second_per_grid_ts=None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int = 2,
    tokens_per_second: Optional[float] = None,
    video_frames: str = "whole",
    text_after_vision: str = "grid",
    validate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen-VL mRoPE positions of a packed stream: transformers' ``get_rope_index`` on every sample alone.

    Every segment of ``cu_seqlens`` is its own sample; its positions start at 0. A *vision block* is a maximal
    run of ``image_token_id`` (or ``video_token_id``) tokens inside a segment. Blocks take the rows
    ``[t, h, w]`` of ``image_grid_thw`` / ``video_grid_thw`` in stream order across all segments; with
    ``video_frames="per_frame"`` (Qwen3-VL, Qwen3.5) a video row stands for t blocks of grid ``[1, h, w]`` (one
    per frame, separated by timestamp text). A block has ``t*h*w / spatial_merge_size**2`` tokens.

    - text token: ``(cur, cur, cur)``, then ``cur += 1``;
    - block starting at ``cur = s`` with merged grid ``(T', H', W') = (t, h/m, w/m)``, tokens in t-major, h, w
      order: ``(s + floor(ti * interval), s + hi, s + wi)``. ``interval`` is 1, except for whole videos when
      ``tokens_per_second`` is given (Qwen2.5-VL): ``float32(tokens_per_second) * float32(second_per_grid_ts[v])``
      (1.0 when ``second_per_grid_ts`` is None), multiplied by ``ti`` in float32 and truncated, as transformers
      does with the float32 ``second_per_grid_ts`` its processor returns;
    - text after a block resumes at ``s + max(H', W')`` with ``text_after_vision="grid"`` (transformers >= 5.3)
      or at ``max(all positions so far) + 1`` with ``"max"`` (transformers <= 4.57, verl, ROLL).

    Bad input (a run whose length does not match its grid, more or fewer runs than blocks, a block crossing a
    segment boundary, h or w not divisible by ``spatial_merge_size``, grids describing more vision tokens than
    ``input_ids`` has) raises ``ValueError`` naming the block or the argument; so do non-finite or negative
    ``second_per_grid_ts`` / ``tokens_per_second`` and grids whose sizes or positions overflow int64 (every
    size is combined in checked int64 arithmetic). Floats, bools or other non-integers where integers are meant
    raise ``TypeError``.

    Args:
        input_ids: integer ``[T]``, the packed stream, CPU or CUDA.
        cu_seqlens: ``[N + 1]`` segment boundaries: host (list or CPU tensor; checked on the host, uploaded
            without a sync) or on ``input_ids``' device.
        image_grid_thw: ``[n_images, 3]`` rows ``[t, h, w]`` in patches (a list of rows or an integer tensor;
            host: no sync; a device tensor is read back: one sync), or None.
        video_grid_thw: ``[n_videos, 3]``, as ``image_grid_thw``.
        second_per_grid_ts: host ``[n_videos]`` seconds per temporal grid step, finite and >= 0 (Qwen2.5-VL), or
            None.
        image_token_id: the token id of image tokens.
        video_token_id: the token id of video tokens.
        spatial_merge_size: ``m``, the vision merger's spatial factor (h and w must be multiples of it).
        tokens_per_second: Qwen2.5-VL's temporal scale of whole videos, finite and >= 0, or None.
        video_frames: ``"whole"`` (Qwen2-VL, Qwen2.5-VL: one block per video) or ``"per_frame"``.
        text_after_vision: ``"grid"`` or ``"max"`` (see above).
        validate: on CUDA, read the kernel's status word back once (one sync) and raise on bad input; with
            False nothing syncs and bad input yields unspecified positions (for ``torch.compile`` regions and
            training loops on trusted data). On CPU every check runs before anything is written either way.

    Returns:
        pos: int64 ``[3, T]`` on ``input_ids``' device, the t, h, w positions.
        text_pos: int64 ``[T]`` on ``input_ids``' device, each token's offset in its segment (the 4th "text
            position" row transformers uses to find packed sequence boundaries).
        deltas: int64 ``[N]`` on ``input_ids``' device, ``max position of segment i + 1 - its length`` (0 for
            an empty segment).
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"packcuda.mrope_position_ids: input_ids must be a 1-D integer tensor (the packed stream), "
                        f"got {type(input_ids).__name__}")
    if input_ids.dim() != 1:
        raise ValueError("packcuda.mrope_position_ids: input_ids must be a 1-D integer tensor (the packed stream), "
                         f"got shape {list(input_ids.shape)}")
    if input_ids.device.type not in ("cpu", "cuda"):
        raise ValueError(f"packcuda.mrope_position_ids: input_ids on {input_ids.device} is not supported (packcuda "
                         "runs on cpu and cuda)")
    if video_frames not in ("whole", "per_frame"):
        raise ValueError(
            f"packcuda.mrope_position_ids: video_frames must be 'whole' or 'per_frame', got {video_frames!r}")
    if text_after_vision not in ("grid", "max"):
        raise ValueError(
            f"packcuda.mrope_position_ids: text_after_vision must be 'grid' or 'max', got {text_after_vision!r}")
    if not isinstance(validate, bool):
        raise TypeError(f"packcuda.mrope_position_ids: validate must be a bool, got {type(validate).__name__}")
    image_token_id = check_int(_FN, "image_token_id", image_token_id)
    video_token_id = check_int(_FN, "video_token_id", video_token_id)
    spatial_merge_size = check_int(_FN, "spatial_merge_size", spatial_merge_size)  # the op: >= 1
    tps = None if tokens_per_second is None else check_float(_FN, "tokens_per_second", tokens_per_second, lo=0.0)
    meta = _cu(cu_seqlens)
    igrid = _grid(image_grid_thw, "image_grid_thw")
    vgrid = _grid(video_grid_thw, "video_grid_thw")
    secs = _seconds(second_per_grid_ts)
    args = (igrid, vgrid, secs, image_token_id, video_token_id, spatial_merge_size, tps,
            video_frames == "per_frame", text_after_vision == "max")
    pos, text_pos, deltas, status = _OP(input_ids, meta, *args)
    if validate and not input_ids.is_cpu:
        token = ops.mrope_status_token(int(status.item()))  # the one documented sync
        if token >= 0:
            cu_host = meta.cpu() if is_device_tensor(meta) else meta
            ops.mrope_position_ids(input_ids.cpu(), cu_host, *args)  # raises the message naming the block
            raise ValueError(f"packcuda.mrope_position_ids: invalid run structure near token {token}")
    return pos, text_pos, deltas


_SPEC = "MRopeSpec"


@dataclass(frozen=True)
class MRopeSpec:
    """The constants of a model family that mRoPE positions need, usually read from a transformers config.

    Checked on construction (integers, a finite ``tokens_per_second`` >= 0, known rules).

    Attributes:
        image_token_id: the token id of image tokens.
        video_token_id: the token id of video tokens (differs from ``image_token_id``).
        spatial_merge_size: the vision merger's spatial factor, >= 1.
        tokens_per_second: Qwen2.5-VL's temporal scale of whole videos, or None.
        video_frames: ``"whole"`` or ``"per_frame"`` (Qwen3-VL, Qwen3.5).
        text_after_vision: ``"grid"`` (transformers >= 5.3) or ``"max"`` (4.x).
        model_type: the config's ``model_type`` (informational).
    """

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    tokens_per_second: Optional[float] = None
    video_frames: str = "whole"
    text_after_vision: str = "grid"
    model_type: str = ""

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen)
        put("image_token_id", check_int(_SPEC, "image_token_id", self.image_token_id))
        put("video_token_id", check_int(_SPEC, "video_token_id", self.video_token_id))
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"packcuda.{_SPEC}: image_token_id and video_token_id must differ, both are "
                             f"{self.image_token_id}")
        put("spatial_merge_size", check_int(_SPEC, "spatial_merge_size", self.spatial_merge_size, lo=1))
        if self.tokens_per_second is not None:
            put("tokens_per_second", check_float(_SPEC, "tokens_per_second", self.tokens_per_second, lo=0.0))
        if self.video_frames not in ("whole", "per_frame"):
            raise ValueError(f"packcuda.{_SPEC}: video_frames must be 'whole' or 'per_frame', got "
                             f"{self.video_frames!r}")
        if self.text_after_vision not in ("grid", "max"):
            raise ValueError(f"packcuda.{_SPEC}: text_after_vision must be 'grid' or 'max', got "
                             f"{self.text_after_vision!r}")
        if not isinstance(self.model_type, str):
            raise TypeError(f"packcuda.{_SPEC}: model_type must be a str, got {type(self.model_type).__name__}")

    @classmethod
    def from_hf_config(cls, config, *, text_after_vision: str = "grid") -> "MRopeSpec":
        """The spec of a transformers Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE) or Qwen3.5(-MoE) config.

        Reads ``image_token_id``, ``video_token_id``, ``vision_config.spatial_merge_size`` and (Qwen2.5-VL)
        ``vision_config.tokens_per_second``; the family sets ``video_frames``. Missing or mistyped fields (a float
        token id, a NaN ``tokens_per_second``) are refused naming the field.

        Args:
            config: a transformers config object or its dict.
            text_after_vision: the rule of the transformers version the model trains with (``"grid"`` for >= 5.3,
                ``"max"`` for 4.x).

        Returns:
            The ``MRopeSpec``.
        """
        op = f"{_SPEC}.from_hf_config"
        if config is None or isinstance(config, (str, bytes, int, float)):
            raise TypeError(f"packcuda.{op}: config must be a transformers config or a dict, got "
                            f"{type(config).__name__}")
        model_type = _get(config, "model_type", "")
        if model_type not in MROPE_FAMILIES:
            raise ValueError(f"packcuda.{op}: unsupported model_type {model_type!r}; known: {sorted(MROPE_FAMILIES)}")
        if text_after_vision not in ("grid", "max"):
            raise ValueError(f"packcuda.{op}: text_after_vision must be 'grid' or 'max', got {text_after_vision!r}")
        family = MROPE_FAMILIES[model_type]
        vision = _get(config, "vision_config")
        if vision is None:
            raise ValueError(f"packcuda.{op}: the config has no vision_config")
        image_id, video_id = _get(config, "image_token_id"), _get(config, "video_token_id")
        if image_id is None or video_id is None:
            raise ValueError(f"packcuda.{op}: the config has no image_token_id / video_token_id")
        tps = _get(vision, "tokens_per_second") if family.video_seconds else None
        return cls(image_token_id=check_int(op, "image_token_id", image_id),
                   video_token_id=check_int(op, "video_token_id", video_id),
                   spatial_merge_size=check_int(op, "vision_config.spatial_merge_size",
                                                _get(vision, "spatial_merge_size", 2), lo=1),
                   tokens_per_second=None if tps is None else check_float(op, "vision_config.tokens_per_second",
                                                                          tps, lo=0.0),
                   video_frames=family.video_frames, text_after_vision=text_after_vision, model_type=model_type)

    def position_ids(self, input_ids: torch.Tensor, cu_seqlens: IntsLike, *, image_grid_thw: GridLike = None,
                     video_grid_thw: GridLike = None, second_per_grid_ts=None, validate: bool = True):
        """``mrope_position_ids`` with this spec's constants; the other arguments are checked there.

        Args:
            input_ids: integer ``[T]``, CPU or CUDA.
            cu_seqlens: ``[N + 1]`` segment boundaries, host (no sync) or on ``input_ids``' device.
            image_grid_thw: ``[n_images, 3]`` or None.
            video_grid_thw: ``[n_videos, 3]`` or None.
            second_per_grid_ts: host ``[n_videos]`` or None.
            validate: on CUDA, one sync to check the input (see ``mrope_position_ids``).

        Returns:
            ``(pos int64 [3, T], text_pos int64 [T], deltas int64 [N])`` on ``input_ids``' device.
        """
        return mrope_position_ids(
            input_ids, cu_seqlens, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts, image_token_id=self.image_token_id,
            video_token_id=self.video_token_id, spatial_merge_size=self.spatial_merge_size,
            tokens_per_second=self.tokens_per_second, video_frames=self.video_frames,
            text_after_vision=self.text_after_vision, validate=validate)
