"""Bad-input cases: the layout bridge (relayout.py and the relayout raw ops)."""
import torch

import packcuda
from catalogue import Case, call, in_process_group

ops = torch.ops.packcuda
I64 = torch.int64
CU = [0, 5, 12, 12, 30]


def _pair(cp=2, rank=0, **kw):
    return packcuda.hybrid_plans(CU, cp, rank, **kw)


def _relayout(x=None, **kw):
    zz, ct = _pair()
    return call(packcuda.relayout, torch.zeros(zz.total_local, 3) if x is None else x, zz, ct, **kw)


def _schedule(**change):
    args = dict(cu_seqlens=torch.tensor(CU), cp_size=2, cp_rank=0, src_layout="zigzag", src_align=4,
                src_bucket=None, dst_layout="contiguous", dst_align=4, dst_bucket=None)
    args.update(change)
    return call(ops.relayout_schedule, *args.values())


def _static_plan(layout="zigzag", capacity=32):
    return packcuda.static_shard_plan(torch.tensor([0, 3, 5, 9, 9]), 3, 2, 0, capacity=capacity, max_seqs=4,
                                      layout=layout, align=4)


def _tables(**change):
    args = dict(cu_seqlens_padded=_static_plan().cu_seqlens_padded, cp_size=2, cp_rank=0,
                src_layout="zigzag", dst_layout="contiguous", capacity=32)
    args.update(change)
    return call(ops.relayout_static_tables, *args.values())


TL = packcuda.hybrid_plans(CU, 2, 0)[0].total_local  # rows of x_local for _pair()
RL, HP, SCH, TAB = "packcuda.relayout", "packcuda.hybrid_plans", "ops.relayout_schedule", "ops.relayout_static_tables"

CASES = [
    # ---------------------------------------------------------------------------------- packcuda.relayout
    Case(RL, "x_none", lambda: call(packcuda.relayout, None, *_pair()), exc=TypeError, arg="x_local"),
    Case(RL, "x_list", lambda: call(packcuda.relayout, [[0.0]] * TL, *_pair()), exc=TypeError, arg="x_local"),
    Case(RL, "x_wrong_rows", lambda: _relayout(torch.zeros(5, 3)), arg="x_local"),
    Case(RL, "x_0d", lambda: _relayout(torch.tensor(1.0)), arg="x_local"),
    Case(RL, "x_meta", lambda: _relayout(torch.zeros(TL, 3, device="meta")), arg="x_local"),
    Case(RL, "src_plan_object", lambda: call(packcuda.relayout, torch.zeros(TL, 3), object(), _pair()[1]),
         exc=TypeError, arg="src_plan"),
    Case(RL, "dst_plan_none", lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0], None), exc=TypeError,
         arg="dst_plan"),
    Case(RL, "other_batch", arg="different batches",
         make=lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0],
                           packcuda.hybrid_plans([0, 5, 12, 12, 31], 2, 0)[1])),
    Case(RL, "other_padded_stream", arg="one padded stream",
         make=lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0],
                           packcuda.shard_plan(CU, 2, 0, layout="contiguous"))),
    Case(RL, "other_rank", arg="rank",
         make=lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0], _pair(rank=1)[1])),
    Case(RL, "other_cp", arg="rank 0 of 4",
         make=lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0], _pair(cp=4)[1])),
    Case(RL, "host_and_static", arg="StaticShardPlan",
         make=lambda: call(packcuda.relayout, torch.zeros(TL, 3), _pair()[0], _static_plan("contiguous"))),
    Case(RL, "static_other_capacity", arg="capacity",
         make=lambda: call(packcuda.relayout, torch.zeros(16, 3), _static_plan(),
                           _static_plan("contiguous", capacity=40))),
    Case(RL, "backend_unknown", lambda: _relayout(backend="mpi"), arg="backend"),
    Case(RL, "check_not_bool", lambda: _relayout(check="yes"), exc=TypeError, arg="check"),
    Case(RL, "no_process_group", risky=True, arg="group", make=lambda: _relayout()),
    Case(RL, "group_object", risky=True, exc=TypeError, arg="group",
         make=lambda: in_process_group(lambda: packcuda.relayout(torch.zeros(TL, 3), *_pair(), "world"))),
    Case(RL, "group_size_mismatch", risky=True, arg="rank",
         make=lambda: in_process_group(lambda: packcuda.relayout(torch.zeros(TL, 3), *_pair()))),
    Case(RL, "static_no_process_group", arg="group",
         make=lambda: call(packcuda.relayout, torch.zeros(16, 3), _static_plan(), _static_plan("contiguous"))),
    Case(RL, "static_x_on_cuda", cuda=True, arg="x_local",
         make=lambda: call(packcuda.relayout, torch.zeros(16, 3, device="cuda"), _static_plan(),
                           _static_plan("contiguous"))),
    # ---------------------------------------------------------------------------------- packcuda.hybrid_plans
    Case(HP, "cu_floats", lambda: call(packcuda.hybrid_plans, [0, 2.5], 2, 0), exc=TypeError, arg="cu_seqlens"),
    Case(HP, "cu_decreasing", lambda: call(packcuda.hybrid_plans, [0, 5, 3], 2, 0), arg="cu_seqlens"),
    Case(HP, "cp_size_zero", lambda: call(packcuda.hybrid_plans, CU, 0, 0), arg="cp_size"),
    Case(HP, "cp_size_float", lambda: call(packcuda.hybrid_plans, CU, 2.0, 0), exc=TypeError, arg="cp_size"),
    Case(HP, "cp_rank_out_of_range", lambda: call(packcuda.hybrid_plans, CU, 2, 2), arg="cp_rank"),
    Case(HP, "bucket_not_multiple", lambda: call(packcuda.hybrid_plans, CU, 2, 0, bucket=6), arg="bucket"),
    Case(HP, "bucket_zero", lambda: call(packcuda.hybrid_plans, CU, 2, 0, bucket=0), arg="bucket"),
    Case(HP, "device_garbage", lambda: call(packcuda.hybrid_plans, CU, 2, 0, device="gpu0"), arg="device"),
    # ---------------------------------------------------------------------------------- raw ops
    Case(SCH, "cu_on_cuda", cuda=True, arg="cu_seqlens", make=lambda: _schedule(cu_seqlens=torch.tensor(CU).cuda())),
    Case(SCH, "cu_decreasing", lambda: _schedule(cu_seqlens=torch.tensor([0, 5, 3])), arg="cu_seqlens"),
    Case(SCH, "cp_size_zero", lambda: _schedule(cp_size=0), arg="cp_size"),
    Case(SCH, "cp_size_above_bound", lambda: _schedule(cp_size=70000, src_align=140000, dst_align=140000),
         arg="cp_size must be <= 65536"),
    Case(SCH, "cp_rank_out_of_range", lambda: _schedule(cp_rank=2), arg="cp_rank"),
    Case(SCH, "src_layout_unknown", lambda: _schedule(src_layout="zz"), arg="src_layout"),
    Case(SCH, "dst_layout_unknown", lambda: _schedule(dst_layout="ring"), arg="dst_layout"),
    # a layout is a name: torch's argument parser refuses any other type before the op runs (a RuntimeError naming
    # packcuda::<op> and the argument)
    Case(SCH, "src_layout_not_str", lambda: _schedule(src_layout=0), exc=RuntimeError, arg=("'src_layout'", "'str'")),
    Case(SCH, "dst_layout_not_str", lambda: _schedule(dst_layout=1), exc=RuntimeError, arg=("'dst_layout'", "'str'")),
    Case(SCH, "zigzag_src_align", lambda: _schedule(src_align=3), arg="align"),
    Case(SCH, "dst_bucket_zero", lambda: _schedule(dst_bucket=0), arg="bucket"),
    Case(SCH, "padded_streams_differ", lambda: _schedule(dst_align=1), arg="one padded stream"),
    Case(SCH, "padded_total_beyond_int32", risky=True, arg="padded",
         make=lambda: _schedule(cu_seqlens=torch.tensor([0, 2**40]))),
    Case(TAB, "padded_int64", lambda: _tables(cu_seqlens_padded=torch.tensor([0, 4, 8, 12, 32, 32])),
         arg="cu_seqlens_padded"),
    Case(TAB, "padded_too_short", lambda: _tables(cu_seqlens_padded=torch.tensor([0, 32], dtype=torch.int32)),
         arg="cu_seqlens_padded"),
    Case(TAB, "cp_size_zero", lambda: _tables(cp_size=0), arg="cp_size"),
    Case(TAB, "cp_rank_out_of_range", lambda: _tables(cp_rank=2), arg="cp_rank"),
    Case(TAB, "src_layout_unknown", lambda: _tables(src_layout="Contiguous"), arg="src_layout"),
    Case(TAB, "dst_layout_unknown", lambda: _tables(dst_layout="zigzag "), arg="dst_layout"),
    Case(TAB, "src_layout_not_str", lambda: _tables(src_layout=0), exc=RuntimeError, arg=("'src_layout'", "'str'")),
    Case(TAB, "dst_layout_not_str", lambda: _tables(dst_layout=None), exc=RuntimeError, arg=("'dst_layout'", "'str'")),
    Case(TAB, "capacity_not_multiple", lambda: _tables(capacity=31), arg="capacity"),
    Case(TAB, "capacity_not_multiple_of_2cp", lambda: _tables(capacity=34, cp_size=2), arg="2*cp_size"),
    Case(TAB, "capacity_huge", lambda: _tables(capacity=2**63 - 1), arg="capacity"),
]
