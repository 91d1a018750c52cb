"""Qwen3.5's GatedDeltaNet (linear-attention) layers on packed rows (the conv and the gated delta rule stop at
every sample boundary) and on context-parallel shards (conv halo rows through :func:`packcuda.conv_prefix`, the
recurrence through flash-linear-attention's CP context). Under a zigzag plan (the layout the attention layers
want) each GatedDeltaNet layer moves its hidden states to the contiguous layout of the same batch with
:func:`packcuda.relayout` and back, or runs on the zigzag slots where flash-linear-attention's CP context has
the same zigzag."""
from __future__ import annotations

import functools
import inspect
import types

import torch

import packcuda
from packcuda._meta import config_field as _get, host_list

from ._common import (
    _ALIASES,
    _FAMILIES,
    UnsupportedModelError,
    UnsupportedTransformersError,
    _check_source,
    _check_version,
    _config_of,
    _import_family,
    _src,
    _unwrap,
    transformers_version,
)
from ._patch import _Patch

_QWEN3_5 = _FAMILIES["qwen3_5"]
_GDN_CLASS = "Qwen3_5GatedDeltaNet"
_GDN_LAYER = "Qwen3_5DecoderLayer"
# the kwarg by which a patched decoder layer hands its sample boundaries to its GatedDeltaNet
_CU_KWARG = "packcuda_cu_seqlens"
# how the GatedDeltaNet's forward hands its conv the layer's weight: itself (to 5.24), or the conv module to
# causal_conv1d_forward, which reads the weight (5.25)
_GDN_CONV_CALLS = ("self.conv1d.weight.squeeze(1)", "causal_conv1d_forward(\n            self.conv1d,")
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


def _fla_native_zigzag() -> bool:
    """Whether the installed flash-linear-attention's CP context takes ``layout='zigzag'``. Its zigzag is one of
    the whole stream (rank r holds parts r and 2*cp-1-r of the stream); a packcuda zigzag plan splits every
    padded sequence so, which is the same layout only where the padded stream is one sequence."""
    cp = _fla_cp()
    if cp is None:
        return False
    try:
        return "layout" in inspect.signature(cp[1]).parameters
    except (TypeError, ValueError):
        return False


def _fla_cp_recurrence(q, k, v, g, beta, *, plan, group, state):
    """The gated delta rule of this rank's shard through flash-linear-attention's CP context (its state is
    handed from rank to rank): a contiguous plan, or a zigzag plan of one padded sequence (FLA's own zigzag).
    ``state`` caches the context per plan (one build per batch)."""
    rule, build = _fla_cp()
    ctx = state.get("fla_ctx")
    if ctx is None or ctx[0] is not plan:
        cu_cpu = torch.tensor(plan.cu_seqlens_padded_host, dtype=torch.int64)
        cu_dev = packcuda._meta.to_device_async(cu_cpu, q.device)
        layout = {"layout": "zigzag"} if plan.layout == "zigzag" else {}
        ctx = (plan, build(cu_dev, group=group, cu_seqlens_cpu=cu_cpu, **layout))
        state["fla_ctx"] = ctx
    out, _ = rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=ctx[1].cu_seqlens, cp_context=ctx[1])
    return out


def _cp_recurrence(plan):
    """The recurrence of a CP shard: a callable ``(q, k, v, g, beta, *, plan, group, state) -> out`` ``[1, T, Hv,
    Dv]`` for the plan it is handed (contiguous, or zigzag on the native path), or a reason why none is
    available (a str)."""
    if _fla_cp() is None:
        return ("no context-parallel backend for the gated delta rule is installed (flash-linear-attention with "
                "fla.ops.cp and chunk_gated_delta_rule(cp_context=...))")
    return _fla_cp_recurrence


_ZIGZAG_PATHS = ("auto", "relayout")


def _layout_path(plan, zigzag_path: str):
    """How the GatedDeltaNet layers run under ``plan``: None (no plan, or a contiguous one: on its slots),
    ``"native"`` (a zigzag plan whose padded stream is one sequence, with a flash-linear-attention whose CP
    context has the same zigzag: on the zigzag slots, no move) or ``"relayout"`` (any other zigzag plan: moved
    to the contiguous plan of the same batch and back)."""
    if plan is None or plan.layout != "zigzag":
        return None
    if zigzag_path == "auto" and len(plan.cu_seqlens_padded_host) == 2 and _fla_native_zigzag():
        return "native"
    return "relayout"


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
            _GDN_CONV_CALLS, "activation=self.activation",
            "self.key_dim,\n                self.key_dim,\n                self.value_dim,",
            "beta = b.sigmoid()", "g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)",
            "torch_chunk_gated_delta_rule(", "use_qk_l2norm_in_kernel=True", "self.norm(core_attn_out, z)",
            "self.out_proj(core_attn_out)"]),
        (gdn, _GDN_CLASS, [  # the class: from 5.25 its __init__ is the kernels package's wrapper
            "self.conv_dim = self.key_dim * 2 + self.value_dim", "groups=self.conv_dim",
            "self.activation = config.hidden_act"]),
        (layer.forward, f"{_GDN_LAYER}.forward", ["self.linear_attn(", 'self.block_type == "linear_attention"']),
        (getattr(mod, "causal_conv1d_fn", None), "causal_conv1d_fn", [
            "padding = weight.shape[-1] - 1", "groups=hidden_size", "[:, :, :seq_len]", "ACT2FN[activation](out)"]),
    ]
    if _GDN_CONV_CALLS[1] in _src(gdn.forward):  # 5.25: the conv (and its cache) behind one function
        expect.append((getattr(mod, "causal_conv1d_forward", None), "causal_conv1d_forward", [
            "weight = conv1d.weight.squeeze(1)", "causal_conv1d_fn(hidden_states, weight, conv1d.bias, "
            "activation=activation"]))
    for obj, name, needles in expect:
        _check_source(obj, name, needles, f"packcuda linear-attention patch: qwen3_5 in transformers {v}")


class _GdnState:
    """What the patched layers of one model share: the plan and group (CP), the recurrence, and the sample
    boundaries derived from the position ids of the current forward (computed once, reused by every layer)."""

    def __init__(self, mod, plan, group, cp_recurrence, zigzag_path):
        self.mod = mod
        self.group = group
        self.cp_recurrence = cp_recurrence
        self.zigzag_path = zigzag_path
        self.cache: dict = {}
        self.set_plan(plan)
        self.repeat_heads = "query.repeat_interleave(" in _src(getattr(mod, _GDN_CLASS).forward)
        # transformers' PyTorch rule itself: the name in the module routes to flash-linear-attention's kernels
        # where it is installed, also for CPU tensors
        self.torch_rule = _unwrap(mod.torch_chunk_gated_delta_rule)
        self._pos = None  # (weakref of the position ids, their version, number of rows, cu_seqlens)

    def set_plan(self, plan) -> None:
        self.plan = plan
        self.layout_path = _layout_path(plan, self.zigzag_path)
        self.cache.clear()

    def contiguous(self):
        """The contiguous plan of the current zigzag plan's batch (same cu_seqlens, align and bucket, so both
        index one padded stream): built once per plan, cached."""
        c = self.cache.get("contiguous")
        if c is None or c[0] is not self.plan:
            p = self.plan
            c = (p, packcuda.shard_plan(p.cu_seqlens_host, p.cp_size, p.cp_rank, layout="contiguous",
                                        align=p.align, bucket=p.bucket, device=p.device))
            self.cache["contiguous"] = c
        return c[1]

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
    """``fn`` (transformers' PyTorch gated delta rule, unwrapped) on every sample alone, concatenated: correct,
    slow."""
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
    delta rule stop at the sample boundaries. With a cache (generation) the original forward runs. Under a
    zigzag plan on the relayout path the layer's input (``hidden_size`` columns, before the projections) moves
    to the contiguous plan's slots and its output (after ``out_proj``) back."""
    state: _GdnState = self._packcuda_gdn
    cu = kwargs.pop(_CU_KWARG, None)
    cache = cache if cache is not None else kwargs.pop("cache_params", kwargs.pop("past_key_values", None))
    if cache is not None:
        if state.plan is not None:
            raise ValueError("packcuda.patch_qwen3_5_linear_attention: a model patched for context parallelism "
                             "does not run with a cache (generation); unpatch it first")
        return self._packcuda_original_forward(hidden_states, cache, attention_mask=attention_mask, **kwargs)
    hidden_states = state.mod.apply_mask_to_padding_states(hidden_states, attention_mask)
    B, S, _ = hidden_states.shape
    plan = state.plan
    if plan is None:
        given = kwargs.get("cu_seq_lens_q")
        if given is not None:
            cu = given
        elif cu is None:
            cu = list(range(0, B * S + 1, S)) if S else [0]
        return _gdn_layer(self, state, hidden_states, cu, None)
    if B != 1 or S != plan.total_local:
        raise ValueError(f"packcuda.patch_qwen3_5_linear_attention: hidden_states must be this rank's [1, "
                         f"{plan.total_local}] slots of the plan, got [{B}, {S}]")
    if state.layout_path != "relayout":
        return _gdn_layer(self, state, hidden_states, None, plan)
    contiguous = state.contiguous()
    x = packcuda.relayout(hidden_states[0], plan, contiguous, state.group)
    out = _gdn_layer(self, state, x[None], None, contiguous)
    return packcuda.relayout(out[0], contiguous, plan, state.group)[None]


def _gdn_layer(self, state: _GdnState, hidden_states, cu, plan) -> torch.Tensor:
    """The GatedDeltaNet layer from its input projections to its output projection, on the samples ``cu`` of
    ``hidden_states`` ``[B, S, hidden]`` (``plan`` None) or on ``plan``'s slots ``[1, plan.total_local,
    hidden]``."""
    B, S, _ = hidden_states.shape
    T = B * S
    mixed = self.in_proj_qkv(hidden_states).reshape(T, -1)
    z = self.in_proj_z(hidden_states).reshape(T, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states).reshape(1, T, -1)
    a = self.in_proj_a(hidden_states).reshape(1, T, -1)
    mixed = _gdn_conv(self, mixed, cu, plan=plan, group=state.group)
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
    if plan is not None:
        core = state.cp_recurrence(q, k, v, g, beta, plan=plan, group=state.group, state=state.cache)
    else:
        fla = _fla_chunk_rule() if q.is_cuda else None  # FLA's kernels are GPU kernels
        if fla is not None:
            cu_dev = cu if isinstance(cu, torch.Tensor) and cu.device == q.device else None
            if cu_dev is None:
                cu_dev = packcuda._meta.to_device_async(_cu_tensor(cu), q.device)
            core, _ = fla(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev.to(torch.int64))
        else:
            core = _per_sample_rule(state.torch_rule, q, k, v, g, beta, cu)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(B, S, -1))


def _cu_tensor(cu) -> torch.Tensor:
    return cu.to(torch.int64) if isinstance(cu, torch.Tensor) else packcuda._meta.host_tensor(
        cu, "cu_seqlens", op="patch_qwen3_5_linear_attention")


class LinearAttentionPatch(_Patch):
    """Handle of :func:`patch_qwen3_5_linear_attention`: ``unpatch()`` (or leaving a ``with`` block) restores
    the model's GatedDeltaNet layers; ``set_plan(plan)`` switches a CP patch to the next batch's plan;
    ``layout_path`` says how the GatedDeltaNet layers run under the current plan (None: packed rows or a
    contiguous plan; ``"relayout"``: a zigzag plan, moved to the contiguous layout and back; ``"native"``: a zigzag
    plan of one padded sequence on flash-linear-attention's own zigzag)."""

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

    @property
    def layout_path(self):
        return self._state.layout_path

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
        self._state.set_plan(plan)

    def unpatch(self) -> None:
        """Restores the original GatedDeltaNet forwards and removes the boundary hooks (idempotent)."""
        if not isinstance(self, LinearAttentionPatch):
            raise TypeError(f"packcuda.LinearAttentionPatch.unpatch: self must be a LinearAttentionPatch, got "
                            f"{type(self).__name__}")
        with self._lock:
            if not self.active:
                return
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            self._restore()
            self.active = False

    def __repr__(self):
        p = self._state.plan
        cp = "packed rows" if p is None else f"CP {p.layout} cp={p.cp_size}"
        if self._state.layout_path is not None:
            cp += f" ({self._state.layout_path})"
        return (f"LinearAttentionPatch({type(self.model).__name__}; {cp}; recurrence: {self.recurrence}; "
                f"{'active' if self.active else 'removed'})")


def _check_plan_kind(fn: str, plan) -> None:
    if not isinstance(plan, packcuda.ShardPlan):
        raise TypeError(f"packcuda.{fn}: plan must be a packcuda.ShardPlan, got {type(plan).__name__}")
    if plan.layout == "zigzag" and isinstance(plan, packcuda.StaticShardPlan):
        raise ValueError(f"packcuda.{fn}: plan is a StaticShardPlan with layout 'zigzag'; the GatedDeltaNet "
                         "layers of a zigzag plan need its host boundaries (for the contiguous plan of the same "
                         "batch and the recurrence's CP context): pass packcuda.shard_plan(..., layout='zigzag')")


def _check_cp_plan(fn: str, plan, group) -> None:
    _check_plan_kind(fn, plan)
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.cp_size != size or plan.cp_rank != rank:
        raise ValueError(f"packcuda.{fn}: plan is for cp_size {plan.cp_size}, cp_rank {plan.cp_rank}, but this "
                         f"process is rank {rank} of a group of {size}")


def patch_qwen3_5_linear_attention(model, *, plan=None, group=None, zigzag_path: str = "auto",
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
      delta rule runs through flash-linear-attention's CP context (``fla.ops.cp.build_cp_context``), which
      splits the stream contiguously. Without a CP-capable recurrence backend the patch refuses, before
      patching anything. ``set_plan`` switches the handle to the next batch's plan.
    - **Hybrid models under a zigzag plan** (the layout the attention layers want: balanced causal work; feed
      the model ``plan.shard(input_ids)`` and ``plan.position_ids``; the attention layers need a
      context-parallel attention over the zigzag slots, registered with transformers' ``AttentionInterface``):
      each GatedDeltaNet layer moves its input hidden states to the contiguous plan of the same batch with
      :func:`packcuda.relayout` before its input projections, and its output back after its output projection
      (``hidden_size`` columns move, not the wider projected q/k/v/z/b/a), and runs the conv and the
      recurrence on the contiguous plan (``handle.layout_path == "relayout"``). The contiguous plan (same
      ``cu_seqlens``, ``align`` and ``bucket``, so the two index one padded stream) is built once per plan and
      cached. Where the padded stream is one sequence and the installed flash-linear-attention's CP context
      takes ``layout='zigzag'`` (its zigzag splits the whole stream, which is packcuda's zigzag for one
      sequence only), the layers run on the zigzag slots with no move (``layout_path == "native"``);
      ``zigzag_path="relayout"`` always moves. A :class:`packcuda.StaticShardPlan` with layout 'zigzag' is
      refused (the move and the recurrence's CP context need host boundaries).

    Checks first, patches nothing on failure: the transformers version is in :data:`SUPPORTED_TRANSFORMERS`,
    the model is a Qwen3.5 model (``model_type`` ``qwen3_5`` / ``qwen3_5_text``: ``Qwen3_5ForCausalLM``,
    ``Qwen3_5ForConditionalGeneration``, their base models) with GatedDeltaNet layers, and the GatedDeltaNet /
    decoder-layer code is the code this patch reproduces (checked in its source; verified on transformers
    5.17.0, 5.24.0 and 5.25.0). Runs with a cache (generation) take the original forward. The rotary patch
    (:func:`patch_qwen_vl_rope`) is independent: both can be active together.
    """
    fn = "patch_qwen3_5_linear_attention"
    if not isinstance(allow_unverified_version, bool):
        raise TypeError(f"packcuda.{fn}: allow_unverified_version must be a bool, got "
                        f"{type(allow_unverified_version).__name__}")
    if not isinstance(zigzag_path, str):
        raise TypeError(f"packcuda.{fn}: zigzag_path must be a str, got {type(zigzag_path).__name__}")
    if zigzag_path not in _ZIGZAG_PATHS:
        raise ValueError(f"packcuda.{fn}: zigzag_path must be one of {', '.join(map(repr, _ZIGZAG_PATHS))}, got "
                         f"{zigzag_path!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"packcuda.{fn}: model must be a torch.nn.Module (a transformers Qwen3.5 model), got "
                        f"{type(model).__name__}")
    if (plan is None) != (group is None):
        name = "group" if group is None else "plan"
        raise ValueError(f"packcuda.{fn}: plan and group go together (context parallelism); {name} is missing")
    if plan is not None:
        import torch.distributed as dist

        _check_plan_kind(fn, plan)
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
    state = _GdnState(mod, plan, group, cp_rule, zigzag_path)
    handle = LinearAttentionPatch(model, state, recurrence)
    with handle._lock:
        for m in gdns:
            handle._set(m, "_packcuda_original_forward", m.forward)
            handle._set(m, "_packcuda_gdn", state)
            handle._set(m, "forward", types.MethodType(_gdn_forward, m))
        hook = _gdn_layer_pre_hook(state)
        for layer in layers:
            handle._hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        handle.active = True
    return handle
