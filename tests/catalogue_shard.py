"""Bad-input cases: shard plans (shard.py, transformers.shard_position_ids and the shard raw ops)."""
import numpy as np
import torch

import packcuda
from catalogue import Case, call
from packcuda.integrations import transformers as hf

ops = torch.ops.packcuda
I64_MAX = 2**63 - 1
BIG = 2**31  # one past the largest padded total of a plan
CU = [0, 3, 5, 9]


def _t(v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype)


def _plan(cp=2, rank=0, **kw):
    return packcuda.shard_plan(CU, cp, rank, **kw)


def _unshard_index(**change):
    plan = ops.shard_plan(_t(CU), 2, 0, "zigzag", 4, None, None)
    args = dict(cu_seqlens=_t(CU), cu_seqlens_padded=plan[3], cp_size=2, layout="zigzag", total_local=int(plan[9][2]),
                device=None)
    args.update(change)
    return call(ops.shard_unshard_index, *args.values())


def _gather_call(cp=1, extra_rows=0, device=None, **kw):
    plan = _plan(cp, device=device)
    return call(plan.gather, torch.zeros(plan.total_local + extra_rows, 2), **kw)


def _gather_with_group(make_args):
    """Runs plan.gather in a single-process gloo group (the case runs in a child process)."""
    import torch.distributed as dist

    def fn(*args, **kwargs):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            plan, x, kw = make_args()
            return plan.gather(x, **kw)
        finally:
            dist.destroy_process_group()

    return call(fn)


SP = "packcuda.shard_plan"
CASES = [
    # ---- packcuda.shard_plan: types --------------------------------------------------------------------
    Case(SP, "cu_none", lambda: call(packcuda.shard_plan, None, 2, 0), exc=TypeError, arg="cu_seqlens"),
    Case(SP, "cu_float_list", lambda: call(packcuda.shard_plan, [0, 2.0, 4], 2, 0), exc=TypeError, arg="cu_seqlens"),
    Case(SP, "cu_bool_list", lambda: call(packcuda.shard_plan, [0, True, 4], 2, 0), exc=TypeError, arg="cu_seqlens"),
    Case(SP, "cu_float_tensor", lambda: call(packcuda.shard_plan, torch.tensor([0.0, 4.0]), 2, 0), exc=TypeError,
         arg="cu_seqlens"),
    Case(SP, "cu_float_numpy", lambda: call(packcuda.shard_plan, np.array([0.0, 4.0]), 2, 0), exc=TypeError,
         arg="cu_seqlens"),
    Case(SP, "cu_2d_tensor", lambda: call(packcuda.shard_plan, _t([[0, 2], [3, 4]]), 1, 0), arg="cu_seqlens"),
    Case(SP, "cu_nested_list", lambda: call(packcuda.shard_plan, [[0, 2], [3, 4]], 1, 0), exc=TypeError,
         arg="cu_seqlens"),
    Case(SP, "cu_above_int64", lambda: call(packcuda.shard_plan, [0, 2**64], 1, 0), arg="cu_seqlens"),
    Case(SP, "cu_meta_tensor", lambda: call(packcuda.shard_plan, torch.tensor([0, 4], device="meta"), 2, 0),
         arg="cu_seqlens"),
    Case(SP, "cp_size_float", lambda: call(packcuda.shard_plan, CU, 2.5, 0), exc=TypeError, arg="cp_size"),
    Case(SP, "cp_size_integral_float", lambda: call(packcuda.shard_plan, CU, 2.0, 0), exc=TypeError, arg="cp_size"),
    Case(SP, "cp_size_bool", lambda: call(packcuda.shard_plan, CU, True, 0), exc=TypeError, arg="cp_size"),
    Case(SP, "cp_size_none", lambda: call(packcuda.shard_plan, CU, None, 0), exc=TypeError, arg="cp_size"),
    Case(SP, "cp_rank_float", lambda: call(packcuda.shard_plan, CU, 2, 1.0), exc=TypeError, arg="cp_rank"),
    Case(SP, "align_float", lambda: call(packcuda.shard_plan, CU, 1, 0, align=2.0), exc=TypeError, arg="align"),
    Case(SP, "bucket_float", lambda: call(packcuda.shard_plan, CU, 1, 0, layout="contiguous", bucket=3.5),
         exc=TypeError, arg="bucket"),
    Case(SP, "layout_not_str", lambda: call(packcuda.shard_plan, CU, 2, 0, layout=0), exc=TypeError, arg="layout"),
    Case(SP, "device_not_a_device", lambda: call(packcuda.shard_plan, CU, 2, 0, device=1.5), exc=TypeError,
         arg="device"),
    # ---- packcuda.shard_plan: values -------------------------------------------------------------------
    Case(SP, "cu_not_from_zero", lambda: call(packcuda.shard_plan, [1, 4], 2, 0), arg="cu_seqlens"),
    Case(SP, "cu_decreasing", lambda: call(packcuda.shard_plan, _t([0, 5, 3]), 2, 0), arg="cu_seqlens"),
    Case(SP, "cu_empty", lambda: call(packcuda.shard_plan, torch.zeros(0, dtype=torch.int64), 2, 0),
         arg="cu_seqlens"),
    Case(SP, "layout_unknown", lambda: call(packcuda.shard_plan, CU, 2, 0, layout="ring"), arg="layout"),
    Case(SP, "cp_size_zero", lambda: call(packcuda.shard_plan, CU, 0, 0), arg="cp_size"),
    Case(SP, "cp_size_int64_max", lambda: call(packcuda.shard_plan, CU, I64_MAX, 0, layout="contiguous"),
         arg="cp_size"),
    Case(SP, "cp_size_zigzag_default_align_overflow", lambda: call(packcuda.shard_plan, CU, 2**62, 0),
         arg="cp_size"),
    Case(SP, "cp_size_above_int64", lambda: call(packcuda.shard_plan, CU, 2**64, 0), arg="cp_size"),
    Case(SP, "cp_rank_too_big", lambda: call(packcuda.shard_plan, CU, 2, 2), arg="cp_rank"),
    Case(SP, "cp_rank_negative", lambda: call(packcuda.shard_plan, CU, 2, -1), arg="cp_rank"),
    Case(SP, "align_negative", lambda: call(packcuda.shard_plan, CU, 2, 0, layout="contiguous", align=-4),
         arg="align"),
    Case(SP, "align_2pow62_drops_tokens", lambda: call(packcuda.shard_plan, [0, 1, 2, 3, 4], 1, 0,
                                                        layout="contiguous", align=2**62), arg="align"),
    Case(SP, "align_not_multiple_of_2cp", lambda: call(packcuda.shard_plan, CU, 2, 0, align=6), arg="align"),
    Case(SP, "bucket_int64_max", lambda: call(packcuda.shard_plan, [0, 1, 2, 3, 4], 1, 0, layout="contiguous",
                                               bucket=I64_MAX), arg="bucket"),
    Case(SP, "bucket_zero", lambda: call(packcuda.shard_plan, CU, 2, 0, layout="contiguous", bucket=0),
         arg="bucket"),
    Case(SP, "bucket_not_multiple_of_align", lambda: call(packcuda.shard_plan, CU, 2, 0, align=8, bucket=12),
         arg="bucket"),
    Case(SP, "padded_total_above_int32", lambda: call(packcuda.shard_plan, [0, BIG - 1, BIG], 1, 0,
                                                       layout="contiguous", align=2), arg="padded stream"),
    Case(SP, "bucket_rounding_above_int32", lambda: call(packcuda.shard_plan, [0, 5], 3, 0, layout="contiguous",
                                                          bucket=BIG - 1), arg="padded stream"),
    Case(SP, "device_meta", lambda: call(packcuda.shard_plan, CU, 2, 0, device="meta"), arg="device"),
    Case(SP, "device_unknown", lambda: call(packcuda.shard_plan, CU, 2, 0, device="nodevice"), arg="device"),
    # ---- ShardPlan.shard ----------------------------------------------------------------------------------
    Case("ShardPlan.shard", "x_not_tensor", lambda: call(_plan().shard, [0.0] * 9), exc=TypeError, arg="x",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "x_none", lambda: call(_plan().shard, None), exc=TypeError, arg="x", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "x_wrong_rows", lambda: call(_plan().shard, torch.zeros(8, 2)), arg="x",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "x_0d", lambda: call(_plan().shard, torch.tensor(1.0)), arg="x", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "dim_out_of_range", lambda: call(_plan().shard, torch.zeros(9, 2), dim=2), arg="dim",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "dim_float", lambda: call(_plan().shard, torch.zeros(2, 9), dim=1.0), exc=TypeError,
         arg="dim", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_nan_int", lambda: call(_plan().shard, torch.arange(9), fill=float("nan")),
         arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_1e20_int64", lambda: call(_plan().shard, torch.arange(9), fill=1e20), arg="fill",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_inf_int32", lambda: call(_plan().shard, torch.arange(9, dtype=torch.int32),
                                                          fill=float("inf")), arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_fraction_int", lambda: call(_plan().shard, torch.arange(9), fill=2.5), arg="fill",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_above_int32", lambda: call(_plan().shard, torch.arange(9, dtype=torch.int32),
                                                            fill=2**31), arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_uint8_negative", lambda: call(_plan().shard, torch.zeros(9, dtype=torch.uint8),
                                                               fill=-1), arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_bool_2", lambda: call(_plan().shard, torch.zeros(9, dtype=torch.bool), fill=2),
         arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "fill_none", lambda: call(_plan().shard, torch.zeros(9), fill=None), exc=TypeError,
         arg="fill", op="ShardPlan.shard"),
    Case("ShardPlan.shard", "x_meta", lambda: call(_plan().shard, torch.zeros(9, device="meta")), arg="x",
         op="ShardPlan.shard"),
    Case("ShardPlan.shard", "x_cuda_plan_cpu", lambda: call(_plan().shard, torch.zeros(9, device="cuda")), arg="x",
         op="ShardPlan.shard", cuda=True),
    Case("ShardPlan.shard", "x_cpu_plan_indexless_cuda", lambda: call(_plan(device="cuda").shard, torch.zeros(9)),
         arg="x", op="ShardPlan.shard", cuda=True),
    # ---- ShardPlan.shard_positions ------------------------------------------------------------------------
    Case("ShardPlan.shard_positions", "float_positions",
         lambda: call(_plan().shard_positions, torch.zeros(3, 9)), exc=TypeError, arg="position_ids",
         op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "not_tensor", lambda: call(_plan().shard_positions, list(range(9))),
         exc=TypeError, arg="position_ids", op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "shape_3d_batch2",
         lambda: call(_plan().shard_positions, torch.zeros(3, 2, 9, dtype=torch.int64)), arg="position_ids",
         op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "wrong_tokens",
         lambda: call(_plan().shard_positions, torch.zeros(3, 8, dtype=torch.int64)), arg="position_ids",
         op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "shape_batch_first_rows_2",
         lambda: call(_plan().shard_positions, torch.zeros(1, 2, 9, dtype=torch.int32)), arg="position_ids",
         op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "shape_4d",
         lambda: call(_plan().shard_positions, torch.zeros(3, 1, 1, 9, dtype=torch.int64)), arg="position_ids",
         op="ShardPlan.shard_positions"),
    Case("ShardPlan.shard_positions", "tokens_on_dim_0",
         lambda: call(_plan().shard_positions, torch.zeros(9, 3, dtype=torch.int64)), arg="position_ids",
         op="ShardPlan.shard_positions"),
    # ---- ShardPlan.labels ---------------------------------------------------------------------------------
    Case("ShardPlan.labels", "ignore_index_float", lambda: call(_plan().labels, torch.arange(9), 1.5), exc=TypeError,
         arg="ignore_index", op="ShardPlan.labels"),
    Case("ShardPlan.labels", "ignore_index_nan", lambda: call(_plan().labels, torch.arange(9), float("nan")),
         exc=TypeError, arg="ignore_index", op="ShardPlan.labels"),
    Case("ShardPlan.labels", "ignore_index_above_int32",
         lambda: call(_plan().labels, torch.arange(9, dtype=torch.int32), 2**31), arg="ignore_index",
         op="ShardPlan.labels"),
    Case("ShardPlan.labels", "ignore_index_above_int64", lambda: call(_plan().labels, torch.arange(9), 2**64),
         arg="ignore_index", op="ShardPlan.labels"),
    Case("ShardPlan.labels", "input_ids_wrong_rows", lambda: call(_plan().labels, torch.arange(5)), arg="input_ids",
         op="ShardPlan.labels"),
    Case("ShardPlan.labels", "input_ids_not_tensor", lambda: call(_plan().labels, list(range(9))), exc=TypeError,
         arg="input_ids", op="ShardPlan.labels"),
    # ---- ShardPlan.unshard --------------------------------------------------------------------------------
    Case("ShardPlan.unshard", "gathered_none", lambda: call(_plan().unshard, None), exc=TypeError, arg="gathered",
         op="ShardPlan.unshard"),
    Case("ShardPlan.unshard", "gathered_list", lambda: call(_plan().unshard, [1.0, 2.0]), exc=TypeError,
         arg="gathered", op="ShardPlan.unshard"),
    Case("ShardPlan.unshard", "gathered_wrong_rows", lambda: call(_plan().unshard, torch.zeros(7, 3)),
         arg="gathered", op="ShardPlan.unshard"),
    Case("ShardPlan.unshard", "gathered_wrong_local_rows", lambda: call(_plan().unshard, torch.zeros(2, 7, 3)),
         arg="gathered", op="ShardPlan.unshard"),
    Case("ShardPlan.unshard", "gathered_0d", lambda: call(_plan().unshard, torch.tensor(1.0)), arg="gathered",
         op="ShardPlan.unshard"),
    Case("ShardPlan.unshard", "gathered_meta", lambda: call(_plan().unshard, torch.zeros(16, device="meta")),
         arg="gathered", op="ShardPlan.unshard"),
    # ---- ShardPlan.gather (argument checks before any collective) --------------------------------------------
    Case("ShardPlan.gather", "no_process_group", lambda: _gather_call(), arg="group",
         op="ShardPlan.gather"),
    Case("ShardPlan.gather", "x_local_not_tensor", lambda: call(_plan(1).gather, [0.0] * 12), exc=TypeError,
         arg="x_local", op="ShardPlan.gather"),
    Case("ShardPlan.gather", "x_local_wrong_rows", lambda: _gather_call(extra_rows=-1), arg="x_local",
         op="ShardPlan.gather"),
    Case("ShardPlan.gather", "group_wrong_type", risky=True, exc=TypeError, arg="group", op="ShardPlan.gather",
         make=lambda: _gather_with_group(
             lambda: (_plan(1), torch.zeros(_plan(1).total_local, 2), dict(group="world")))),
    Case("ShardPlan.gather", "plan_cp_size_mismatch", risky=True, arg="cp_size", op="ShardPlan.gather",
         make=lambda: _gather_with_group(lambda: (_plan(2), torch.zeros(_plan(2).total_local, 2), {}))),
    Case("ShardPlan.gather", "x_local_cpu_plan_cuda", cuda=True, arg="x_local", op="ShardPlan.gather",
         make=lambda: _gather_call(device="cuda")),
    # ---- transformers.shard_position_ids ------------------------------------------------------------------
    Case("transformers.shard_position_ids", "positions_batch_2",
         lambda: call(hf.shard_position_ids, torch.zeros(3, 2, 9, dtype=torch.int64), _plan()), arg="position_ids"),
    Case("transformers.shard_position_ids", "positions_two_rows",
         lambda: call(hf.shard_position_ids, torch.zeros(2, 9, dtype=torch.int32), _plan()), arg="position_ids"),
    Case("transformers.shard_position_ids", "positions_0d",
         lambda: call(hf.shard_position_ids, torch.zeros((), dtype=torch.int64), _plan()), arg="position_ids"),
    Case("transformers.shard_position_ids", "positions_float",
         lambda: call(hf.shard_position_ids, torch.zeros(3, 1, 9), _plan()), exc=TypeError, arg="position_ids"),
    Case("transformers.shard_position_ids", "positions_wrong_tokens",
         lambda: call(hf.shard_position_ids, torch.zeros(3, 1, 8, dtype=torch.int64), _plan()), arg="position_ids"),
    Case("transformers.shard_position_ids", "positions_not_tensor",
         lambda: call(hf.shard_position_ids, [[[0] * 9]] * 3, _plan()), exc=TypeError, arg="position_ids"),
    Case("transformers.shard_position_ids", "plan_not_a_plan",
         lambda: call(hf.shard_position_ids, torch.zeros(3, 1, 9, dtype=torch.int64), None), exc=TypeError,
         arg="plan"),
    # ---- ops.shard_plan: the layout arguments ------------------------------------------------------------------
    Case("ops.shard_plan", "cp_size_zero", lambda: call(ops.shard_plan, _t(CU), 0, 0, "contiguous", 1, None, None),
         arg="cp_size"),
    Case("ops.shard_plan", "cp_size_huge", lambda: call(ops.shard_plan, _t(CU), 2**62, 0, "contiguous", 1, None, None),
         arg="cp_size"),
    Case("ops.shard_plan", "cp_rank_out_of_range", lambda: call(ops.shard_plan, _t(CU), 2, 2, "zigzag", 4, None, None),
         arg="cp_rank"),
    Case("ops.shard_plan", "layout_unknown", lambda: call(ops.shard_plan, _t(CU), 2, 0, "zz", 4, None, None),
         arg="layout must be 'zigzag' or 'contiguous', got 'zz'"),
    # a layout is a name: torch's argument parser refuses any other type before the op runs (a RuntimeError naming
    # packcuda::<op> and the argument)
    Case("ops.shard_plan", "layout_not_str", lambda: call(ops.shard_plan, _t(CU), 2, 0, 0, 4, None, None),
         exc=RuntimeError, arg=("'layout'", "'str'")),
    Case("ops.shard_plan", "align_huge", lambda: call(ops.shard_plan, _t(CU), 1, 0, "contiguous", 2**62, None, None),
         arg="align"),
    Case("ops.shard_plan", "align_zero",
         lambda: call(ops.shard_plan, _t(CU), 1, 0, "contiguous", 0, None, None), arg="align"),
    Case("ops.shard_plan", "bucket_int64_max",
         lambda: call(ops.shard_plan, _t(CU), 1, 0, "contiguous", 1, I64_MAX, None),
         arg="bucket"),
    Case("ops.shard_plan", "bucket_negative",
         lambda: call(ops.shard_plan, _t(CU), 1, 0, "contiguous", 1, -3, None), arg="bucket"),
    Case("ops.shard_plan", "padded_total_above_int32_aligned",
         lambda: call(ops.shard_plan, _t([0, BIG - 1, BIG]), 1, 0, "contiguous", 2, None, None), arg="padded stream"),
    Case("ops.shard_plan", "padded_length_overflow",
         lambda: call(ops.shard_plan, _t([0, I64_MAX]), 1, 0, "contiguous", 2, None, None), arg="padded"),
    Case("ops.shard_plan", "cu_float",
         lambda: call(ops.shard_plan, torch.tensor([0.0, 4.0]), 1, 0, "contiguous", 1, None, None),
         arg="cu_seqlens"),
    Case("ops.shard_plan", "cu_2d", lambda: call(ops.shard_plan, _t([[0, 4]]), 1, 0, "contiguous", 1, None, None),
         arg="cu_seqlens"),
    Case("ops.shard_plan", "cu_decreasing",
         lambda: call(ops.shard_plan, _t([0, 5, 3]), 1, 0, "contiguous", 1, None, None),
         arg="cu_seqlens"),
    Case("ops.shard_plan", "cu_empty", lambda: call(ops.shard_plan, _t([]), 1, 0, "contiguous", 1, None, None),
         arg="cu_seqlens"),
    # ---- ops.shard_plan --------------------------------------------------------------------------------------
    Case("ops.shard_plan", "device_meta",
         lambda: call(ops.shard_plan, _t(CU), 2, 0, "zigzag", 4, None, torch.device("meta")), arg="device"),
    Case("ops.shard_plan", "align_overflow_contiguous",
         lambda: call(ops.shard_plan, _t([0, 1, 2, 3, 4]), 1, 0, "contiguous", 2**62, None, None), arg="align"),
    Case("ops.shard_plan", "cp_size_int64_max",
         lambda: call(ops.shard_plan, _t([0, 1, 2, 3, 4]), I64_MAX, 0, "contiguous", 1, None, None), arg="cp_size"),
    Case("ops.shard_plan", "padded_total_above_int32",
         lambda: call(ops.shard_plan, _t([0, 5]), 3, 0, "contiguous", 1, BIG - 1, None), arg="padded stream"),
    Case("ops.shard_plan", "cu_int16", lambda: call(ops.shard_plan, _t(CU, torch.int16), 2, 0, "zigzag", 4, None, None),
         arg="cu_seqlens"),
    Case("ops.shard_plan", "cu_not_from_zero", lambda: call(ops.shard_plan, _t([2, 5]), 2, 0, "zigzag", 4, None, None),
         arg="cu_seqlens"),
    Case("ops.shard_plan", "cu_device_tensor", cuda=True, arg="cu_seqlens",
         make=lambda: call(ops.shard_plan, torch.tensor(CU, device="cuda"), 2, 0, "zigzag", 4, None, None)),
    # ---- ops.shard_unshard_index -----------------------------------------------------------------------------
    Case("ops.shard_unshard_index", "concat_overflow", arg="total_local",
         make=lambda: _unshard_index(cu_seqlens=_t([0, 4]), cu_seqlens_padded=_t([0, 2**62]), cp_size=2**30,
                                     layout="contiguous", total_local=2**31 - 1)),
    Case("ops.shard_unshard_index", "cp_size_huge", arg="cp_size",
         make=lambda: _unshard_index(cu_seqlens=_t([0, 4]), cu_seqlens_padded=_t([0, 2**62]), cp_size=2**62,
                                     layout="contiguous", total_local=2)),
    Case("ops.shard_unshard_index", "cp_size_zero", lambda: _unshard_index(cp_size=0), arg="cp_size"),
    Case("ops.shard_unshard_index", "layout_unknown", lambda: _unshard_index(layout="Zigzag"), arg="layout"),
    Case("ops.shard_unshard_index", "layout_not_str", lambda: _unshard_index(layout=0), exc=RuntimeError,
         arg=("'layout'", "'str'")),
    Case("ops.shard_unshard_index", "total_local_negative", lambda: _unshard_index(total_local=-2), arg="total_local"),
    Case("ops.shard_unshard_index", "total_local_mismatch", lambda: _unshard_index(total_local=5),
         arg="cu_seqlens_padded"),
    Case("ops.shard_unshard_index", "padded_shorter_than_sequence", arg="padded segment",
         make=lambda: _unshard_index(cu_seqlens_padded=_t([0, 2, 6, 12]))),
    Case("ops.shard_unshard_index", "zigzag_not_multiple", arg="2*cp_size",
         make=lambda: _unshard_index(cu_seqlens_padded=_t([0, 6, 8, 12]))),
    Case("ops.shard_unshard_index", "padded_too_many_entries", arg="cu_seqlens_padded",
         make=lambda: _unshard_index(cu_seqlens_padded=_t([0, 4, 8, 12, 12, 12]))),
    Case("ops.shard_unshard_index", "padded_float", arg="cu_seqlens_padded",
         make=lambda: _unshard_index(cu_seqlens_padded=_t([0, 4, 8, 12]).double())),
    Case("ops.shard_unshard_index", "padded_decreasing", arg="cu_seqlens_padded",
         make=lambda: _unshard_index(cu_seqlens_padded=_t([0, 8, 4, 12]))),
    Case("ops.shard_unshard_index", "cu_2d", lambda: _unshard_index(cu_seqlens=_t([CU])), arg="cu_seqlens"),
    Case("ops.shard_unshard_index", "device_meta", lambda: _unshard_index(device=torch.device("meta")), arg="device"),
]


# ---- static plans ---------------------------------------------------------------------------------------------
SCU = [0, 3, 5, 9, 9]  # 3 sequences, max_seqs = 4


def _static(cu=None, n=3, cp=2, rank=0, **kw):
    kw.setdefault("capacity", 32)
    kw.setdefault("max_seqs", 4)
    return call(packcuda.static_shard_plan, _t(SCU) if cu is None else cu, n, cp, rank, **kw)


def _static_plan(**kw):
    return packcuda.static_shard_plan(_t(SCU), 3, 2, 0, capacity=32, max_seqs=4, **kw)


def _static_op(**change):
    args = dict(cu_seqlens=_t(SCU), num_seqs=None, num_seqs_host=3, cp_size=2, cp_rank=0, layout="zigzag", align=4,
                capacity=32, max_seqs=4)
    args.update(change)
    return call(ops.static_shard_plan, *args.values())


def _static_unshard(**change):
    p = _static_plan()
    args = dict(cu_seqlens=p.cu_seqlens, cu_seqlens_padded=p.cu_seqlens_padded, cp_size=2, layout="zigzag",
                capacity=32)
    args.update(change)
    return call(ops.shard_static_unshard_index, *args.values())


def _static_conv_prefix(make_args):
    """conv_prefix of a static plan in a single-process gloo group (the case runs in a child process)."""
    import torch.distributed as dist

    def fn(*args, **kwargs):
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        try:
            x, plan, group = make_args()
            return packcuda.conv_prefix(x, plan, 4, group)
        finally:
            dist.destroy_process_group()

    return call(fn)


def _overflowed_plan():
    return packcuda.static_shard_plan(_t([0, 30, 40, 40, 40]), 2, 2, 0, capacity=32, max_seqs=4)


SSP = "packcuda.static_shard_plan"
STATIC_CASES = [
    # ---- packcuda.static_shard_plan -----------------------------------------------------------------------------
    Case(SSP, "cu_list", lambda: _static(cu=SCU), exc=TypeError, arg="cu_seqlens"),
    Case(SSP, "cu_float", lambda: _static(cu=torch.zeros(5)), exc=TypeError, arg="cu_seqlens"),
    Case(SSP, "cu_2d", lambda: _static(cu=_t([SCU])), arg="cu_seqlens"),
    Case(SSP, "cu_wrong_length", lambda: _static(cu=_t(SCU[:-1])), arg="cu_seqlens"),
    Case(SSP, "cu_meta", lambda: _static(cu=torch.tensor(SCU, device="meta")), arg="cu_seqlens"),
    Case(SSP, "num_seqs_float", lambda: _static(n=2.0), exc=TypeError, arg="num_seqs"),
    Case(SSP, "num_seqs_bool", lambda: _static(n=True), exc=TypeError, arg="num_seqs"),
    Case(SSP, "num_seqs_above_max", lambda: _static(n=5), arg="num_seqs"),
    Case(SSP, "num_seqs_negative", lambda: _static(n=-1), arg="num_seqs"),
    Case(SSP, "num_seqs_float_tensor", lambda: _static(n=torch.tensor(3.0)), exc=TypeError, arg="num_seqs"),
    Case(SSP, "num_seqs_1d_tensor", lambda: _static(n=_t([3])), arg="num_seqs"),
    Case(SSP, "num_seqs_other_device", cuda=True, arg="num_seqs",
         make=lambda: _static(n=torch.tensor(3, device="cuda"))),
    Case(SSP, "cp_size_zero", lambda: _static(cp=0), arg="cp_size"),
    Case(SSP, "cp_size_float", lambda: _static(cp=2.0), exc=TypeError, arg="cp_size"),
    Case(SSP, "cp_rank_out_of_range", lambda: _static(rank=2), arg="cp_rank"),
    Case(SSP, "layout_unknown", lambda: _static(layout="ring"), arg="layout"),
    Case(SSP, "layout_not_str", lambda: _static(layout=0), exc=TypeError, arg="layout"),
    Case(SSP, "align_not_multiple", lambda: _static(align=6), arg="align"),
    Case(SSP, "align_zero", lambda: _static(layout="contiguous", align=0), arg="align"),
    Case(SSP, "capacity_zero", lambda: _static(capacity=0), arg="capacity"),
    Case(SSP, "capacity_above_int32", lambda: _static(capacity=BIG), arg="capacity"),
    Case(SSP, "capacity_not_multiple_of_align", lambda: _static(capacity=30), arg="capacity"),
    Case(SSP, "capacity_not_multiple_of_cp", lambda: _static(cp=3, layout="contiguous", capacity=31),
         arg="capacity"),
    Case(SSP, "capacity_float", lambda: _static(capacity=32.0), exc=TypeError, arg="capacity"),
    Case(SSP, "max_seqs_zero", lambda: _static(cu=_t([0]), n=0, max_seqs=0), arg="max_seqs"),
    Case(SSP, "max_seqs_huge", lambda: _static(max_seqs=2**40), arg="max_seqs"),
    # ---- StaticShardPlan -------------------------------------------------------------------------------------
    Case("StaticShardPlan.check", "over_capacity", lambda: call(_overflowed_plan().check), arg="capacity",
         op="StaticShardPlan.check"),
    Case("StaticShardPlan.check", "num_seqs_above_max", op="StaticShardPlan.check", arg="max_seqs",
         make=lambda: call(packcuda.static_shard_plan(_t(SCU), torch.tensor(7), 2, 0, capacity=32,
                                                      max_seqs=4).check)),
    Case("StaticShardPlan.check", "cu_decreasing", op="StaticShardPlan.check", arg="cu_seqlens",
         make=lambda: call(packcuda.static_shard_plan(_t([0, 5, 3, 9, 9]), 3, 2, 0, capacity=32,
                                                      max_seqs=4).check)),
    Case("StaticShardPlan.local_conv_prefix", "x_wrong_rows", op="StaticShardPlan.local_conv_prefix",
         arg="x_local", make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(15, 2), 4)),
    Case("StaticShardPlan.local_conv_prefix", "x_1d", op="StaticShardPlan.local_conv_prefix", arg="x_local",
         make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(16), 4)),
    Case("StaticShardPlan.local_conv_prefix", "x_int", op="StaticShardPlan.local_conv_prefix", arg="x_local",
         make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(16, 2, dtype=torch.int64), 4)),
    Case("StaticShardPlan.local_conv_prefix", "x_not_tensor", op="StaticShardPlan.local_conv_prefix",
         arg="x_local", exc=TypeError, make=lambda: call(_static_plan().local_conv_prefix, [[0.0]] * 16, 4)),
    Case("StaticShardPlan.local_conv_prefix", "kernel_size_zero", op="StaticShardPlan.local_conv_prefix",
         arg="kernel_size", make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(16, 2), 0)),
    Case("StaticShardPlan.local_conv_prefix", "kernel_size_nine", op="StaticShardPlan.local_conv_prefix",
         arg="kernel_size", make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(16, 2), 9)),
    Case("StaticShardPlan.local_conv_prefix", "x_on_cuda", op="StaticShardPlan.local_conv_prefix", cuda=True,
         arg="x_local", make=lambda: call(_static_plan().local_conv_prefix, torch.zeros(16, 2, device="cuda"), 4)),
    # ---- ops.static_shard_plan ----------------------------------------------------------------------------------
    Case("ops.static_shard_plan", "cu_float", lambda: _static_op(cu_seqlens=torch.zeros(5)), arg="cu_seqlens"),
    Case("ops.static_shard_plan", "cu_wrong_length", lambda: _static_op(cu_seqlens=_t(SCU[:3])), arg="cu_seqlens"),
    Case("ops.static_shard_plan", "num_seqs_host_above_max", lambda: _static_op(num_seqs_host=5), arg="num_seqs"),
    Case("ops.static_shard_plan", "num_seqs_tensor_1d", lambda: _static_op(num_seqs=_t([3])), arg="num_seqs"),
    Case("ops.static_shard_plan", "num_seqs_tensor_float", lambda: _static_op(num_seqs=torch.tensor(3.0)),
         arg="num_seqs"),
    Case("ops.static_shard_plan", "cp_size_zero", lambda: _static_op(cp_size=0), arg="cp_size"),
    Case("ops.static_shard_plan", "cp_size_huge", lambda: _static_op(cp_size=2**62), arg="cp_size"),
    Case("ops.static_shard_plan", "cp_rank_negative", lambda: _static_op(cp_rank=-1), arg="cp_rank"),
    Case("ops.static_shard_plan", "layout_unknown", lambda: _static_op(layout="ring"), arg="layout"),
    Case("ops.static_shard_plan", "layout_not_str", lambda: _static_op(layout=1), exc=RuntimeError,
         arg=("'layout'", "'str'")),
    Case("ops.static_shard_plan", "align_zero", lambda: _static_op(layout="contiguous", align=0), arg="align"),
    Case("ops.static_shard_plan", "align_huge", lambda: _static_op(layout="contiguous", align=2**62), arg="align"),
    Case("ops.static_shard_plan", "zigzag_align", lambda: _static_op(align=6), arg="align"),
    Case("ops.static_shard_plan", "capacity_negative", lambda: _static_op(capacity=-32), arg="capacity"),
    Case("ops.static_shard_plan", "capacity_int64_max", lambda: _static_op(capacity=I64_MAX), arg="capacity"),
    Case("ops.static_shard_plan", "capacity_zigzag_multiple", lambda: _static_op(capacity=36 + 2), arg="capacity"),
    Case("ops.static_shard_plan", "capacity_contiguous_multiple",
         lambda: _static_op(layout="contiguous", align=1, capacity=31),
         arg="capacity"),
    Case("ops.static_shard_plan", "max_seqs_negative", lambda: _static_op(max_seqs=-1), arg="max_seqs"),
    Case("ops.static_shard_plan", "max_seqs_int64_max", lambda: _static_op(max_seqs=I64_MAX), arg="max_seqs"),
    # ---- ops.shard_static_unshard_index ---------------------------------------------------------------------------
    Case("ops.shard_static_unshard_index", "cp_size_zero", lambda: _static_unshard(cp_size=0), arg="cp_size"),
    Case("ops.shard_static_unshard_index", "layout_unknown", lambda: _static_unshard(layout=""), arg="layout"),
    Case("ops.shard_static_unshard_index", "layout_not_str", lambda: _static_unshard(layout=None), exc=RuntimeError,
         arg=("'layout'", "'str'")),
    Case("ops.shard_static_unshard_index", "capacity_zero", lambda: _static_unshard(capacity=0), arg="capacity"),
    Case("ops.shard_static_unshard_index", "capacity_not_multiple", lambda: _static_unshard(capacity=33),
         arg="capacity"),
    Case("ops.shard_static_unshard_index", "cu_int64", lambda: _static_unshard(cu_seqlens=_t(SCU)),
         arg="cu_seqlens"),
    Case("ops.shard_static_unshard_index", "cu_one_entry", lambda: _static_unshard(cu_seqlens=_t([0], torch.int32)),
         arg="cu_seqlens"),
    Case("ops.shard_static_unshard_index", "cu_2d", lambda: _static_unshard(cu_seqlens=_t([SCU], torch.int32)),
         arg="cu_seqlens"),
    Case("ops.shard_static_unshard_index", "padded_wrong_length",
         lambda: _static_unshard(cu_seqlens_padded=_t([0, 4, 8, 12, 32], torch.int32)), arg="cu_seqlens_padded"),
    Case("ops.shard_static_unshard_index", "padded_float",
         lambda: _static_unshard(cu_seqlens_padded=torch.zeros(6)), arg="cu_seqlens_padded"),
    Case("ops.shard_static_unshard_index", "padded_other_device", cuda=True, arg="cu_seqlens_padded",
         make=lambda: _static_unshard(cu_seqlens_padded=torch.zeros(6, dtype=torch.int32, device="cuda"))),
    # ---- packcuda.conv_prefix with a static plan -------------------------------------------------------------------
    Case("packcuda.conv_prefix", "static_no_process_group", arg="group",
         make=lambda: call(packcuda.conv_prefix, torch.zeros(16, 2), _static_plan(), 4)),
    Case("packcuda.conv_prefix", "static_x_wrong_rows", arg="x_local",
         make=lambda: call(packcuda.conv_prefix, torch.zeros(8, 2),
                           packcuda.static_shard_plan(_t(SCU), 3, 1, 0, capacity=32, max_seqs=4), 4)),
    Case("packcuda.conv_prefix", "static_kernel_size_zero", arg="kernel_size",
         make=lambda: call(packcuda.conv_prefix, torch.zeros(32, 2),
                           packcuda.static_shard_plan(_t(SCU), 3, 1, 0, capacity=32, max_seqs=4), 0)),
    Case("packcuda.conv_prefix", "static_group_size_mismatch", risky=True, arg="rank",
         make=lambda: _static_conv_prefix(lambda: (torch.zeros(16, 2), _static_plan(), None))),
    Case("packcuda.conv_prefix", "static_group_wrong_type", risky=True, exc=TypeError, arg="group",
         make=lambda: _static_conv_prefix(lambda: (torch.zeros(16, 2), _static_plan(), "world"))),
    Case("packcuda.conv_prefix_schedule", "static_plan", arg="plan",
         make=lambda: call(packcuda.conv_prefix_schedule, _static_plan(), 4)),
]
CASES += STATIC_CASES
