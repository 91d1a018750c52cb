"""Device cases, generated: every tensor argument of every raw op on a device other than the data's.

The rule the ops are held to (stated here on its own; ``packcuda/_meta.py: check_devices`` implements it for the
fake kernels, each C++ op for real tensors): every tensor argument is on the data's device — the op's ``device``
argument when given, else the device of its first tensor argument that is not metadata. Metadata arguments
(``Baseline.host``) may also be on the CPU; host-only ones (``Baseline.host_only``) must be. A meta tensor is
the data's device only when the data is meta too (as under FakeTensor, where every tensor carries its real
device): mixed with real tensors it goes to the fake kernel, which must refuse it rather than return
uninitialized memory.

From one valid CPU call per raw op (``BASELINES``), each tensor argument A gives two calls: A alone on the other
device, and every tensor but A on it. A call the rule refuses becomes a Case: a ValueError naming the op, the
device and a tensor out of place (A, or one on another device than A when A sets the data's device). The other
device is ``meta`` (runs everywhere: the fake kernels) and ``cuda`` (GPU only: the C++ ops). An op with an output
``device`` argument is also asked for a CUDA device it cannot use (any device on a machine without a usable GPU).
``test_bad_inputs.py`` fails for a raw op with a tensor argument and no baseline here.
"""
import dataclasses
from typing import Callable, Optional, Sequence

import torch

import packcuda  # noqa: F401  (loads the op library)
from catalogue import Case, call

ops = torch.ops.packcuda

I32, I64 = torch.int32, torch.int64


def _t(*v, dtype=I64):
    return torch.tensor(v, dtype=dtype)


def _x(*shape, dtype=torch.float32):
    return torch.arange(1, 1 + torch.Size(shape).numel()).to(dtype).reshape(shape)


@dataclasses.dataclass
class Baseline:
    """A valid CPU call of a raw op: ``make()`` returns its arguments by name, in schema order (so that the
    first data tensor is the data's device). host / host_only: the metadata arguments, as the op documents
    them. runs: the call succeeds on the CPU (ops that only run on CUDA refuse the CPU baseline itself, after
    their device checks). op: the name its messages carry where it is not the op's own (causal_conv1d_fwd
    speaks as packcuda.causal_conv1d, the function it serves, as in catalogue_conv)."""

    make: Callable[[], dict]
    host: Sequence[str] = ()
    host_only: Sequence[str] = ()
    runs: bool = True
    op: Optional[str] = None


def _rope(**extra):
    return dict(q=_x(5, 2, 8), k=_x(5, 1, 8), positions=torch.arange(5), inv_freq=torch.rand(4), **extra)


def _qk(**extra):
    return dict(q=_x(5, 2, 8), k=_x(5, 1, 8), positions=torch.arange(5), inv_freq=torch.rand(4),
                q_weight=torch.ones(8), k_weight=torch.ones(8), eps=1e-6, norm="rms", **extra)


def _qk_backward():
    return dict(grad_q=_x(5, 2, 8), grad_k=_x(5, 1, 8), **_qk(rotary_dim=8, mrope_section=[]))


def _conv(**extra):
    return dict(x=_x(5, 4), weight=_x(4, 3), bias=_x(4), cu_seqlens=_t(0, 2, 5), prefix=_x(2, 2, 4), **extra)


def _static_plan():
    return dict(cu_seqlens=_t(0, 3, 5, dtype=I32), num_seqs=_t(2).reshape(()), num_seqs_host=0, cp_size=2,
                cp_rank=0, layout="contiguous", align=1, capacity=8, max_seqs=2)


def _static_exchange():
    plan = ops.static_shard_plan(**_static_plan())
    pieces, piece_offset, piece_seq, cu_padded = plan[5], plan[6], plan[7], plan[3]
    return dict(pieces=pieces, piece_offset=piece_offset, piece_seq=piece_seq, cu_seqlens_padded=cu_padded,
                cp_size=2, cp_rank=0, layout="contiguous", capacity=8, kernel_size=4)


BASELINES = {
    "gather_rows": Baseline(lambda: dict(src=_x(4, 3), index=_t(0, 2), fill=0.0, dim=0)),
    "scatter_rows": Baseline(lambda: dict(src=_x(2, 3), index=_t(1, 3), num_rows=4, dim=0)),
    "segment_positions": Baseline(lambda: dict(cu_seqlens=_t(0, 2, 5), total=5, device=torch.device("cpu")),
                                  host=["cu_seqlens"]),
    "next_token_labels": Baseline(lambda: dict(input_ids=_t(1, 2, 3, 4, 5), cu_seqlens=_t(0, 2, 5)),
                                  host=["cu_seqlens"]),
    "right_pad_indices": Baseline(lambda: dict(cu_seqlens=_t(0, 2, 5), seqlen=3, total=5,
                                               device=torch.device("cpu")), host=["cu_seqlens"]),
    "mask_indices": Baseline(lambda: dict(attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
                                          cu_seqlens=_t(0, 2, 5), total=5), host=["cu_seqlens"]),
    "plan_micro_batches": Baseline(lambda: dict(seqlens=_t(3, 4, 5), max_tokens=10), host_only=["seqlens"]),
    "balance_across_ranks": Baseline(lambda: dict(seqlens=_t(3, 4, 5, 6), world_size=2), host_only=["seqlens"]),
    "causal_conv1d_fwd": Baseline(lambda: _conv(activation="silu"), host=["cu_seqlens"], op="causal_conv1d"),
    "causal_conv1d_bwd": Baseline(lambda: dict(grad_y=_x(5, 4), **_conv(activation="silu")), host=["cu_seqlens"]),
    "exchange_gather_sum": Baseline(lambda: dict(a=_x(3, 4), b=_x(2, 4), index=_t(0, 1, 4, -1).view(2, 2))),
    "exchange_schedule": Baseline(lambda: dict(cp_size=2, cp_rank=0, n_src=2, n_out=2, src_rank=_t(0, 1),
                                               src_row=_t(1, 0), dst_rank=_t(0, 0), dst_slot=_t(0, 1)),
                                  host_only=["src_rank", "src_row", "dst_rank", "dst_slot"]),
    "conv_prefix_schedule": Baseline(lambda: dict(cu_seqlens=_t(0, 5), cp_size=2, cp_rank=0, layout="contiguous",
                                                  align=1, bucket=None, kernel_size=4), host_only=["cu_seqlens"]),
    "exchange_nccl_comm_init": Baseline(lambda: dict(unique_id=torch.zeros(128, dtype=torch.uint8), nranks=1, rank=0,
                                                     device_index=0), host_only=["unique_id"], runs=False),
    "exchange_prepare": Baseline(lambda: dict(send_index=_t(0), send_counts=[1], recv_counts=[1],
                                              send_first=[-1], unpack_index=_t(0, 1).view(1, 2), comm=0,
                                              rank=0, n_src=1, out_lead=[1]), runs=False),
    "exchange_run": Baseline(lambda: dict(src=_x(1, 4), handle=1, out_lead=[1]), runs=False),
    "shard_plan": Baseline(lambda: dict(cu_seqlens=_t(0, 5), cp_size=2, cp_rank=0, layout="contiguous", align=1,
                                        bucket=None, device=torch.device("cpu")), host_only=["cu_seqlens"]),
    "shard_unshard_index": Baseline(lambda: dict(cu_seqlens=_t(0, 5), cu_seqlens_padded=_t(0, 6), cp_size=2,
                                                 layout="contiguous", total_local=3, device=torch.device("cpu")),
                                    host_only=["cu_seqlens", "cu_seqlens_padded"]),
    "static_shard_plan": Baseline(_static_plan),
    "shard_static_unshard_index": Baseline(lambda: dict(cu_seqlens=_t(0, 3, 5, dtype=I32),
                                                        cu_seqlens_padded=_t(0, 3, 5, 8, dtype=I32), cp_size=2,
                                                        layout="contiguous", capacity=8)),
    "conv_static_prefix_tables": Baseline(_static_exchange),
    "relayout_schedule": Baseline(lambda: dict(cu_seqlens=_t(0, 5, 9), cp_size=2, cp_rank=0, src_layout="zigzag",
                                               src_align=4, src_bucket=None, dst_layout="contiguous", dst_align=4,
                                               dst_bucket=None),
                                  host_only=["cu_seqlens"]),
    "relayout_static_tables": Baseline(lambda: dict(cu_seqlens_padded=_t(0, 4, 8, 8, dtype=I32), cp_size=2, cp_rank=0,
                                                    src_layout="zigzag", dst_layout="contiguous", capacity=8)),
    "apply_rope": Baseline(lambda: _rope(rotary_dim=8, mrope_section=[]), host=["positions", "inv_freq"]),
    "apply_rope_": Baseline(lambda: _rope(rotary_dim=8, mrope_section=[]), host=["positions", "inv_freq"]),
    "apply_qk_norm_rope": Baseline(lambda: _qk(rotary_dim=8, mrope_section=[]), host=["positions", "inv_freq"]),
    "apply_qk_norm_rope_": Baseline(lambda: _qk(rotary_dim=8, mrope_section=[]), host=["positions", "inv_freq"]),
    "apply_qk_norm_rope_backward": Baseline(_qk_backward, host=["positions", "inv_freq"]),
    "mrope_position_ids": Baseline(
        lambda: dict(input_ids=_t(1, 2, 3, 4, 5), cu_seqlens=_t(0, 5), image_grid_thw=torch.empty(0, 3, dtype=I64),
                     video_grid_thw=torch.empty(0, 3, dtype=I64), second_per_grid_ts=torch.empty(0),
                     image_token_id=7, video_token_id=8),
        host=["cu_seqlens"], host_only=["image_grid_thw", "video_grid_thw", "second_per_grid_ts"]),
}


def tensor_args(kw: dict) -> list:
    return [n for n, v in kw.items() if isinstance(v, torch.Tensor)]


def refused(b: Baseline, kw: dict) -> bool:
    """Whether the rule refuses the call `kw` (its tensors' and device argument's devices)."""
    cpu = torch.device("cpu")
    names = tensor_args(kw)
    data = [n for n in names if n not in b.host and n not in b.host_only]
    ref = kw.get("device")
    if ref is None:
        ref = kw[(data or names)[0]].device
    return not (all(kw[n].device == ref for n in data)
                and all(kw[n].device in (cpu, ref) for n in b.host)
                and all(kw[n].device == cpu for n in b.host_only if n in names))


def _moving(b: Baseline, kw: dict, arg: str, others: bool) -> list:
    """The tensors a variant moves: `arg` alone, or (others) every tensor but `arg` that may follow the data
    (host-only metadata stays on the host, so that `arg` is the one tensor out of place)."""
    if not others:
        return [arg]
    return [n for n in tensor_args(kw) if n != arg and n not in b.host_only]


def _moved(b: Baseline, op: str, arg: str, device: str, others: bool):
    def make():
        kw = b.make()
        for n in _moving(b, kw, arg, others):
            kw[n] = kw[n].to(device)
        return call(getattr(ops, op), **kw)
    return make


def _variants(op: str, b: Baseline, device: str) -> list:
    out = []
    kw = b.make()
    for arg in tensor_args(kw):
        for others in (False, True):
            # the verdict is the same for meta and cuda (a device that is neither cpu nor the other tensors')
            moving = _moving(b, kw, arg, others)
            probe = {n: v.to("meta") if n in moving else v for n, v in kw.items()}
            if not moving or not refused(b, probe):
                continue
            # the message names the device and a tensor out of place: `arg`, or (when `arg` sets the data's
            # device) one whose device differs from it
            data = [n for n in tensor_args(kw) if n not in b.host and n not in b.host_only]
            sets_device = "device" not in kw and data[:1] == [arg]
            involved = (arg, *(n for n in tensor_args(kw) if sets_device and probe[n].device != probe[arg].device))
            name = f"{arg}_{device}" if not others else f"{arg}_cpu_others_{device}"
            out.append(Case(f"ops.{op}", name, _moved(b, op, arg, device, others), arg=(involved, device),
                            cuda=device == "cuda", op=b.op))
    return out


def unusable_cuda() -> torch.device:
    """A CUDA device this process cannot use: plain "cuda" without a usable GPU (or with a CPU-only build of
    packcuda), else the index past the last device."""
    if torch.cuda.is_available() and packcuda.built_with_cuda():
        return torch.device("cuda", torch.cuda.device_count())
    return torch.device("cuda")


def _on_unusable_cuda(op: str, b: Baseline):
    def make():
        return call(getattr(ops, op), **{**b.make(), "device": unusable_cuda()})
    return make


CASES = [c for op, b in BASELINES.items() for device in ("meta", "cuda") for c in _variants(op, b, device)]
# ops with an output device argument, asked for a CUDA device that cannot be used: refused by name before any CUDA
# call (not a driver error from deep inside)
CASES += [Case(f"ops.{op}", "device_unusable_cuda", _on_unusable_cuda(op, b), arg="device")
          for op, b in BASELINES.items() if "device" in b.make()]


# ---------------------------------------------------------------------------------------------------
# public functions: each tensor argument alone on the meta device, everything else on the CPU. The rule above
# leaves two outcomes: a ValueError/TypeError naming packcuda and meta, or (the argument is the data and the rest
# host metadata) a result wholly on meta - never a CPU result computed from a meta input (uninitialized memory).
# ---------------------------------------------------------------------------------------------------
IMG, VID = 150, 151
_VL = {"model_type": "qwen2_5_vl", "image_token_id": IMG, "video_token_id": VID,
       "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}}


def _vl_ids():
    return torch.tensor([1, 2] + [IMG] * 4 + [3, 4])


def _plan(cp=1):
    return packcuda.shard_plan([0, 3, 8], cp, 0, layout="contiguous")


def _static(cp=1):
    return packcuda.static_shard_plan(_t(0, 3, 8), 2, cp, 0, capacity=8, max_seqs=2, layout="contiguous")


def _hf():
    from packcuda.integrations import transformers as m
    return m


def _mg():
    from packcuda.integrations import megatron as m
    return m


def _gloo(fn):
    """fn run in a one-rank gloo group (the functions that exchange rows need one)."""
    import torch.distributed as dist

    def run(*args, **kwargs):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            return fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
    return run


def _rope_kw():
    return dict(q=_x(5, 2, 8), k=_x(5, 1, 8), positions=torch.arange(5))


def _qk_kw():
    return dict(**_rope_kw(), q_weight=torch.ones(8), k_weight=torch.ones(8))


def _swap_schedule():
    """cp = 1: output row 0 <- source row 1, output row 1 <- source row 0."""
    return packcuda.exchange.RowSchedule.from_moves(1, 0, 2, 2, [0, 0], [1, 0], [0, 0], [0, 1])


def _static_conv_schedule():
    from packcuda.conv import _static_schedule

    return _static_schedule(_static(), 3)


def _vision_args():
    ids = torch.tensor([1] + [IMG] * 4 + [2])
    return ids, [0, 6], packcuda.shard_plan([0, 6], 1, 0), dict(image_grid_thw=[[1, 4, 4]], image_token_id=IMG,
                                                                video_token_id=VID)


def _vision_plan():
    ids, cu, plan, kw = _vision_args()
    return packcuda.vision_plan(ids, cu, plan, **kw)


# target -> make() returning (fn, args, kwargs) of a valid CPU call
PUBLIC = {
    "packcuda.gather_rows": lambda: call(packcuda.gather_rows, _x(4, 3), _t(0, 2)),
    "packcuda.scatter_rows": lambda: call(packcuda.scatter_rows, _x(2, 3), _t(1, 3), 4),
    "packcuda.unpad": lambda: call(packcuda.unpad, _x(2, 3, 4), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()),
    "packcuda.pad": lambda: call(packcuda.pad, _x(5, 4), _t(0, 1, 3, 4, 5), 2, 3),
    "packcuda.position_ids": lambda: call(packcuda.position_ids, _t(0, 2, 5)),
    "packcuda.next_token_labels": lambda: call(packcuda.next_token_labels, _t(1, 2, 3, 4, 5), _t(0, 2, 5)),
    "packcuda.plan_micro_batches": lambda: call(packcuda.plan_micro_batches, _t(3, 4, 5), 10),
    "packcuda.balance_across_ranks": lambda: call(packcuda.balance_across_ranks, _t(3, 4, 5, 6), 2),
    "packcuda.sequence_workloads": lambda: call(packcuda.sequence_workloads, _t(3, 4)),
    "packcuda.causal_conv1d": lambda: call(packcuda.causal_conv1d, _x(5, 4), _x(4, 3), _x(4), cu_seqlens=_t(0, 2, 5),
                                           prefix=_x(2, 2, 4)),
    "packcuda.conv_prefix": lambda: call(_gloo(packcuda.conv_prefix), _x(8, 4), _plan(), 3),
    "packcuda.apply_rope": lambda: call(packcuda.apply_rope, **_rope_kw(), inv_freq=torch.rand(4)),
    "packcuda.apply_rope_": lambda: call(packcuda.apply_rope_, **_rope_kw(), inv_freq=torch.rand(4)),
    "packcuda.apply_qk_norm_rope": lambda: call(packcuda.apply_qk_norm_rope, **_qk_kw(), inv_freq=torch.rand(4)),
    "packcuda.apply_qk_norm_rope_": lambda: call(packcuda.apply_qk_norm_rope_, **_qk_kw(), inv_freq=torch.rand(4)),
    "packcuda.mrope_position_ids": lambda: call(packcuda.mrope_position_ids, _vl_ids(), _t(0, 8),
                                                image_grid_thw=_t(1, 4, 4).view(1, 3), image_token_id=IMG,
                                                video_token_id=VID),
    "MRopeSpec.position_ids": lambda: call(packcuda.MRopeSpec.from_hf_config(_VL).position_ids, _vl_ids(), _t(0, 8),
                                           image_grid_thw=_t(1, 4, 4).view(1, 3)),
    "packcuda.shard_plan": lambda: call(packcuda.shard_plan, _t(0, 3, 8), 2, 0),
    "packcuda.static_shard_plan": lambda: call(packcuda.static_shard_plan, _t(0, 3, 8), _t(2).reshape(()), 2, 0,
                                               capacity=8, max_seqs=2),
    "ShardPlan.shard": lambda: call(_plan(2).shard, _x(8, 3)),
    "ShardPlan.labels": lambda: call(_plan(2).labels, _t(*range(8))),
    "ShardPlan.shard_positions": lambda: call(_plan(2).shard_positions, _t(*range(8))),
    "ShardPlan.unshard": lambda: call(_plan(2).unshard, _x(8, 3)),
    "ShardPlan.gather": lambda: call(_gloo(_plan().gather), _x(8, 3)),
    "StaticShardPlan.local_conv_prefix": lambda: call(_static().local_conv_prefix, _x(8, 4), 3),
    "transformers.mm_token_type_ids": lambda: call(_hf().mm_token_type_ids, _vl_ids(), _VL),
    "transformers.packed_position_ids": lambda: call(_hf().packed_position_ids, _vl_ids(), _t(0, 8), _VL,
                                                     image_grid_thw=_t(1, 4, 4).view(1, 3)),
    "transformers.shard_position_ids": lambda: call(_hf().shard_position_ids, torch.arange(8).expand(4, 1, 8),
                                                    _plan(2)),
    "RowSchedule.from_moves": lambda: call(packcuda.exchange.RowSchedule.from_moves, 1, 0, 2, 2, _t(0, 0), _t(1, 0),
                                           _t(0, 0), _t(0, 1)),
    "exchange.exchange_rows": lambda: call(packcuda.exchange.exchange_rows, _x(2, 3), _swap_schedule()),
    "exchange.exchange_rows_static": lambda: call(packcuda.exchange.exchange_rows_static, _x(8, 4),
                                                  _static_conv_schedule(), local=True),
    "packcuda.vision_plan": lambda: call(packcuda.vision_plan, *_vision_args()[:3], **_vision_args()[3]),
    "VisionPlan.local_pixel_values": lambda: call(_vision_plan().local_pixel_values, _x(16, 6)),
    "VisionPlan.route": lambda: call(_vision_plan().route, _x(_vision_plan().n_encoded, 8)),
    "VisionPlan.merge": lambda: call(_vision_plan().merge, _x(_vision_plan().total_local, 8),
                                     _x(_vision_plan().n_slots, 8)),
    "transformers.qwen_vl_vision_plan": lambda: call(_hf().qwen_vl_vision_plan, _VL, _vl_ids(), _t(0, 8),
                                                     packcuda.shard_plan([0, 8], 1, 0),
                                                     image_grid_thw=_t(1, 4, 4).view(1, 3)),
    "packcuda.relayout": lambda: call(packcuda.relayout, _x(packcuda.hybrid_plans([0, 3, 8], 1, 0)[0].total_local, 3),
                                      *packcuda.hybrid_plans([0, 3, 8], 1, 0)),
    "megatron.thd_batch_on_this_cp_rank": lambda: call(
        _mg().thd_batch_on_this_cp_rank, {"tokens": _t(*range(8)).view(1, 8), "labels": _t(*range(8)).view(1, 8),
                                          "position_ids": torch.arange(8).view(1, 8)},
        packcuda.shard_plan([0, 3, 8], 2, 0, layout="zigzag", align=4)),
}

# public callables without a tensor argument (nothing to put on another device)
NO_TENSOR_ARGUMENT = {
    "ConvPrefixSchedule.on", "RowSchedule.on", "VisionPatch.set_plan", "VisionPatch.unpatch",
    "exchange.check_agreement", "transformers.patch_qwen_vl_vision", "LinearAttentionPatch.set_plan",
    "LinearAttentionPatch.unpatch", "MRopeSpec.from_hf_config", "RopePatch.unpatch", "StaticShardPlan.check",
    "megatron.packed_seq_params", "packcuda.conv_prefix_schedule", "packcuda.default_inv_freq", "packcuda.hybrid_plans",
    "packcuda.rope_kwargs_from_config",
    "transformers.is_patched", "transformers.patch_qwen3_5_linear_attention", "transformers.patch_qwen_vl_rope",
    "transformers.unpatch_qwen_vl_rope",
}


def _paths(args, kwargs) -> list:
    """Where the tensors of a call are: ("args", i) / ("kwargs", name), and (..., key) inside a dict argument."""
    out = []
    for where, items in (("args", enumerate(args)), ("kwargs", kwargs.items())):
        for k, v in items:
            if isinstance(v, torch.Tensor):
                out.append((where, k))
            elif isinstance(v, dict):
                out += [(where, k, key) for key, t in v.items() if isinstance(t, torch.Tensor)]
    return out


def public_variants() -> list:
    """(target, path) of every tensor of every public baseline."""
    out = []
    for target, make in PUBLIC.items():
        _, args, kwargs = make()
        out += [(target, p) for p in _paths(args, kwargs)]
    return out


def public_variant(target: str, path: tuple):
    """The public baseline with the tensor at `path` moved to the meta device."""
    fn, args, kwargs = PUBLIC[target]()
    args = list(args)
    box = args if path[0] == "args" else kwargs
    if len(path) == 2:
        box[path[1]] = box[path[1]].to("meta")
    else:
        box[path[1]] = {**box[path[1]], path[2]: box[path[1]][path[2]].to("meta")}
    return fn, args, kwargs
