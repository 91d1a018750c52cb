"""Bad-input cases: varlen causal conv1d and the conv-prefix exchange (conv.py and the conv raw ops; the row
exchange's own ops are in catalogue_exchange.py)."""
import torch

import packcuda
from catalogue import Case, call

ops = torch.ops.packcuda
I64 = torch.int64


def _x(T=10, C=4, dtype=torch.float32):
    return torch.randn(T, C, dtype=dtype)


def _w(C=4, K=3, dtype=torch.float32):
    return torch.randn(C, K, dtype=dtype)


def _plan(cp=2, rank=0, cu=(0, 10, 23)):
    return packcuda.shard_plan(list(cu), cp, rank)


def _sched():
    return packcuda.conv_prefix_schedule(_plan(), 3)


def _cu(*v):
    return torch.tensor(v, dtype=I64)


def _static_plan():
    return packcuda.static_shard_plan(torch.tensor([0, 3, 5, 9, 9]), 3, 2, 0, capacity=32, max_seqs=4)


def _static_tables(**change):
    p = _static_plan()
    args = dict(pieces=p.pieces, piece_offset=p.piece_offset, piece_seq=p.piece_seq,
                cu_seqlens_padded=p.cu_seqlens_padded, cp_size=2, cp_rank=0, layout="zigzag", capacity=32,
                kernel_size=4)
    args.update(change)
    return call(ops.conv_static_prefix_tables, *args.values())


CC = "packcuda.causal_conv1d"
FWD, BWD = "ops.causal_conv1d_fwd", "ops.causal_conv1d_bwd"
SCH, PSCH, ON = "ops.conv_prefix_schedule", "packcuda.conv_prefix_schedule", "ConvPrefixSchedule.on"
CP = "packcuda.conv_prefix"

CASES = [
    # ---------------------------------------------------------------------------------- causal_conv1d (facade)
    Case(CC, "x_none", lambda: call(packcuda.causal_conv1d, None, _w()), exc=TypeError, arg="x"),
    Case(CC, "weight_list", lambda: call(packcuda.causal_conv1d, _x(), [[1.0] * 3] * 4), exc=TypeError, arg="weight"),
    Case(CC, "bias_list", lambda: call(packcuda.causal_conv1d, _x(), _w(), [1.0] * 4), exc=TypeError, arg="bias"),
    Case(CC, "prefix_list", lambda: call(packcuda.causal_conv1d, _x(), _w(), prefix=[[1.0]]), exc=TypeError,
         arg="prefix"),
    Case(CC, "x_int_dtype", lambda: call(packcuda.causal_conv1d, _x().long(), _w().long()), arg="x"),
    Case(CC, "x_complex_dtype", lambda: call(packcuda.causal_conv1d, _x().cfloat(), _w().cfloat()), arg="x"),
    Case(CC, "weight_dtype_mismatch", lambda: call(packcuda.causal_conv1d, _x(), _w().double()), arg="weight"),
    Case(CC, "bias_dtype_mismatch", lambda: call(packcuda.causal_conv1d, _x(), _w(), torch.zeros(4, dtype=I64)),
         arg="bias"),
    Case(CC, "prefix_dtype_mismatch", lambda: call(packcuda.causal_conv1d, _x(), _w(),
                                                   prefix=torch.zeros(1, 2, 4, dtype=torch.float16)), arg="prefix"),
    Case(CC, "x_3d", lambda: call(packcuda.causal_conv1d, _x()[None], _w()), arg="x"),
    Case(CC, "weight_wrong_channels", lambda: call(packcuda.causal_conv1d, _x(), _w(C=5)), arg="weight"),
    Case(CC, "weight_1d", lambda: call(packcuda.causal_conv1d, _x(), torch.randn(4)), arg="weight"),
    Case(CC, "kernel_too_big", lambda: call(packcuda.causal_conv1d, _x(), _w(K=9)), arg="K"),
    Case(CC, "kernel_zero", lambda: call(packcuda.causal_conv1d, _x(), _w(K=0)), arg="K"),
    Case(CC, "bias_wrong_shape", lambda: call(packcuda.causal_conv1d, _x(), _w(), torch.randn(3)), arg="bias"),
    Case(CC, "prefix_wrong_rows", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 4, 10],
                                               prefix=torch.randn(2, 3, 4)), arg="prefix"),
    Case(CC, "prefix_wrong_segments", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 4, 10],
                                                   prefix=torch.randn(3, 2, 4)), arg="prefix"),
    Case(CC, "prefix_2d", lambda: call(packcuda.causal_conv1d, _x(), _w(), prefix=torch.randn(2, 4)), arg="prefix"),
    Case(CC, "cu_not_monotone", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 6, 4, 10]),
         arg="cu_seqlens"),
    Case(CC, "cu_total_mismatch", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 4, 9]),
         arg="cu_seqlens"),
    Case(CC, "cu_total_past_end", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 4, 11]),
         arg="cu_seqlens"),
    Case(CC, "cu_first_not_zero", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[1, 10]),
         arg="cu_seqlens"),
    Case(CC, "cu_negative", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, -3, 10]),
         arg="cu_seqlens"),
    Case(CC, "cu_empty", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[]), arg="cu_seqlens"),
    Case(CC, "cu_floats", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 4.0, 10]), exc=TypeError,
         arg="cu_seqlens"),
    Case(CC, "cu_bools", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[False, True]), exc=TypeError,
         arg="cu_seqlens"),
    Case(CC, "cu_float_tensor", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=torch.tensor([0., 10.])),
         arg="cu_seqlens"),
    Case(CC, "cu_2d", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=torch.tensor([[0, 4, 10]])),
         arg="cu_seqlens"),
    Case(CC, "cu_nested_list", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[[0, 10]]),
         exc=TypeError, arg="cu_seqlens"),
    Case(CC, "cu_beyond_int64", lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=[0, 2**64]),
         arg="cu_seqlens"),
    Case(CC, "activation_unknown", lambda: call(packcuda.causal_conv1d, _x(), _w(), activation="relu"),
         arg="activation"),
    Case(CC, "activation_int", lambda: call(packcuda.causal_conv1d, _x(), _w(), activation=1), exc=TypeError,
         arg="activation"),
    Case(CC, "activation_unhashable", lambda: call(packcuda.causal_conv1d, _x(), _w(), activation=["silu"]),
         exc=TypeError, arg="activation"),
    Case(CC, "weight_on_cpu_x_on_cuda", cuda=True, arg="weight",
         make=lambda: call(packcuda.causal_conv1d, _x().cuda(), _w())),
    Case(CC, "prefix_on_cpu_x_on_cuda", cuda=True, arg="prefix",
         make=lambda: call(packcuda.causal_conv1d, _x().cuda(), _w().cuda(), prefix=torch.zeros(1, 2, 4))),
    Case(CC, "cu_on_cuda_x_on_cpu", cuda=True, arg="cu_seqlens",
         make=lambda: call(packcuda.causal_conv1d, _x(), _w(), cu_seqlens=torch.tensor([0, 10], device="cuda"))),
    # ---------------------------------------------------------------------------------- raw conv ops
    Case(FWD, "activation_code", lambda: call(ops.causal_conv1d_fwd, _x(), _w(), None, None, None, "relu"),
         arg="activation", op="causal_conv1d"),
    Case(FWD, "x_none", lambda: call(ops.causal_conv1d_fwd, None, _w(), None, None, None), arg="x",
         op="causal_conv1d"),
    Case(FWD, "weight_none", lambda: call(ops.causal_conv1d_fwd, _x(), None, None, None, None), arg="weight",
         op="causal_conv1d"),
    Case(FWD, "cu_float", lambda: call(ops.causal_conv1d_fwd, _x(), _w(), None, torch.tensor([0., 10.]), None),
         arg="cu_seqlens", op="causal_conv1d"),
    Case(FWD, "cu_not_from_zero", lambda: call(ops.causal_conv1d_fwd, _x(), _w(), None, _cu(1, 10), None),
         arg="cu_seqlens", op="causal_conv1d"),
    Case(FWD, "cu_total", lambda: call(ops.causal_conv1d_fwd, _x(), _w(), None, _cu(0, 12), None),
         arg="cu_seqlens", op="causal_conv1d"),
    Case(FWD, "prefix_shape", lambda: call(ops.causal_conv1d_fwd, _x(), _w(), None, None, torch.zeros(1, 3, 4)),
         arg="prefix", op="causal_conv1d"),
    Case(BWD, "grad_y_shape", lambda: call(ops.causal_conv1d_bwd, _x(9), _x(), _w(), None, None, None),
         arg="grad_y"),
    Case(BWD, "grad_y_1d", lambda: call(ops.causal_conv1d_bwd, torch.randn(40), _x(), _w(), None, None, None),
         arg="grad_y"),
    Case(BWD, "grad_y_dtype", lambda: call(ops.causal_conv1d_bwd, _x().double(), _x(), _w(), None, None, None),
         arg="grad_y"),
    Case(BWD, "grad_y_none", lambda: call(ops.causal_conv1d_bwd, None, _x(), _w(), None, None, None),
         arg="grad_y"),
    Case(BWD, "prefix_shape", lambda: call(ops.causal_conv1d_bwd, _x(), _x(), _w(), None, _cu(0, 4, 10),
                                           torch.zeros(1, 2, 4), "silu"), arg="prefix"),
    Case(BWD, "cu_not_monotone", lambda: call(ops.causal_conv1d_bwd, _x(), _x(), _w(), None, _cu(0, 7, 3, 10),
                                              None), arg="cu_seqlens"),
    Case(BWD, "activation_code", lambda: call(ops.causal_conv1d_bwd, _x(), _x(), _w(), None, None, None, "gelu"),
         arg="activation"),
    # ---------------------------------------------------------------------------------- schedule (raw op)
    Case(SCH, "cp_size_huge", risky=True, arg="cp_size",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5, 9), 2**40, 0, "contiguous", 1, None, 4)),
    Case(SCH, "cp_size_zero",
         lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 0, 0, "contiguous", 1, None, 4), arg="cp_size"),
    Case(SCH, "cp_size_above_schedule_bound",
         lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 70000, 0, "contiguous", 1, None, 4),
         arg="cp_size must be <= 65536"),
    Case(SCH, "cp_size_zigzag_overflow", risky=True, arg="cp_size",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2**62, 0, "zigzag", 4, None, 4)),
    Case(SCH, "align_huge", risky=True, arg="align",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5, 9), 2, 0, "contiguous", 2**62, None, 4)),
    Case(SCH, "align_zero",
         lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "contiguous", 0, None, 4), arg="align"),
    Case(SCH, "zigzag_align",
         lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zigzag", 3, None, 4), arg="align"),
    Case(SCH, "bucket_huge", risky=True, arg="bucket",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5, 9), 2, 0, "contiguous", 1, 2**62, 4)),
    Case(SCH, "bucket_int32_lcm", risky=True, arg="padded",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 3, 0, "contiguous", 1, 2**30, 4)),
    Case(SCH, "bucket_zero",
         lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "contiguous", 1, 0, 4), arg="bucket"),
    Case(SCH, "zigzag_bucket_one", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zigzag", 4, 1, 4),
         arg="bucket"),
    Case(SCH, "zigzag_bucket_not_multiple", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zigzag", 4, 6, 4),
         arg="bucket"),
    Case(SCH, "cp_rank_out_of_range", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 2, "zigzag", 4, None, 4),
         arg="cp_rank"),
    Case(SCH, "cp_rank_negative", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, -1, "zigzag", 4, None, 4),
         arg="cp_rank"),
    Case(SCH, "layout_unknown", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zz", 4, None, 4),
         arg="layout"),
    # a layout is a name: torch's argument parser refuses any other type before the op runs (a RuntimeError naming
    # packcuda::<op> and the argument)
    Case(SCH, "layout_not_str", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, 0, 4, None, 4),
         exc=RuntimeError, arg=("'layout'", "'str'")),
    Case(SCH, "kernel_size_zero", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zigzag", 4, None, 0),
         arg="kernel_size"),
    Case(SCH, "kernel_size_nine", lambda: call(ops.conv_prefix_schedule, _cu(0, 5), 2, 0, "zigzag", 4, None, 9),
         arg="kernel_size"),
    Case(SCH, "cu_not_monotone", lambda: call(ops.conv_prefix_schedule, _cu(0, 5, 3), 2, 0, "contiguous", 1, None, 4),
         arg="cu_seqlens"),
    Case(SCH, "cu_negative", lambda: call(ops.conv_prefix_schedule, _cu(0, -5), 2, 0, "contiguous", 1, None, 4),
         arg="cu_seqlens"),
    Case(SCH, "cu_not_from_zero", lambda: call(ops.conv_prefix_schedule, _cu(2, 5), 2, 0, "contiguous", 1, None, 4),
         arg="cu_seqlens"),
    Case(SCH, "cu_2d", lambda: call(ops.conv_prefix_schedule, torch.tensor([[0, 5]]), 2, 0, "contiguous", 1, None, 4),
         arg="cu_seqlens"),
    Case(SCH, "cu_float",
         lambda: call(ops.conv_prefix_schedule, torch.tensor([0., 5.]), 2, 0, "contiguous", 1, None, 4),
         arg="cu_seqlens"),
    Case(SCH, "cu_empty",
         lambda: call(ops.conv_prefix_schedule, _cu(), 2, 0, "contiguous", 1, None, 4), arg="cu_seqlens"),
    Case(SCH, "cu_beyond_int32", risky=True, arg="padded",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 2**40), 2, 0, "contiguous", 1, None, 4)),
    Case(SCH, "cu_sum_overflow", risky=True, arg="padded",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 2**62, 2**63 - 1), 2, 0, "zigzag", 4, None, 4)),
    Case(SCH, "cu_on_cuda", cuda=True, arg="cu_seqlens",
         make=lambda: call(ops.conv_prefix_schedule, _cu(0, 5).cuda(), 2, 0, "contiguous", 1, None, 4)),
    # ---------------------------------------------------------------------------------- schedule (facade)
    Case(PSCH, "plan_object", lambda: call(packcuda.conv_prefix_schedule, object(), 4), exc=TypeError, arg="plan"),
    Case(PSCH, "plan_none", lambda: call(packcuda.conv_prefix_schedule, None, 4), exc=TypeError, arg="plan"),
    Case(PSCH, "kernel_size_float", lambda: call(packcuda.conv_prefix_schedule, _plan(), 2.5), exc=TypeError,
         arg="kernel_size"),
    Case(PSCH, "kernel_size_integral_float", lambda: call(packcuda.conv_prefix_schedule, _plan(), 4.0),
         exc=TypeError, arg="kernel_size"),
    Case(PSCH, "kernel_size_bool", lambda: call(packcuda.conv_prefix_schedule, _plan(), True), exc=TypeError,
         arg="kernel_size"),
    Case(PSCH, "kernel_size_none", lambda: call(packcuda.conv_prefix_schedule, _plan(), None), exc=TypeError,
         arg="kernel_size"),
    Case(PSCH, "kernel_size_nine", lambda: call(packcuda.conv_prefix_schedule, _plan(), 9), arg="kernel_size"),
    Case(PSCH, "kernel_size_zero", lambda: call(packcuda.conv_prefix_schedule, _plan(), 0), arg="kernel_size"),
    Case(PSCH, "kernel_size_float_tensor", lambda: call(packcuda.conv_prefix_schedule, _plan(), torch.tensor(4.0)),
         exc=TypeError, arg="kernel_size"),
    Case(ON, "device_meta", lambda: call(_sched().on, "meta"), arg="device", op="ConvPrefixSchedule.on"),
    Case(ON, "device_none", lambda: call(_sched().on, None), exc=TypeError, arg="device", op="ConvPrefixSchedule.on"),
    Case(ON, "device_object", lambda: call(_sched().on, object()), exc=TypeError, arg="device",
         op="ConvPrefixSchedule.on"),
    Case(ON, "device_garbage", lambda: call(_sched().on, "gpu0"), arg="device", op="ConvPrefixSchedule.on"),
    Case(ON, "device_missing_cuda_index", lambda: call(_sched().on, "cuda:4096"), arg="device",
         op="ConvPrefixSchedule.on"),
    # ---------------------------------------------------------------------------------- conv_prefix (facade)
    Case(CP, "plan_object", lambda: call(packcuda.conv_prefix, _x(), object(), 3), exc=TypeError, arg="plan"),
    Case(CP, "kernel_size_float", lambda: call(packcuda.conv_prefix, _x(_plan().total_local), _plan(), 3.0),
         exc=TypeError, arg="kernel_size"),
    Case(CP, "kernel_size_nine", lambda: call(packcuda.conv_prefix, _x(_plan().total_local), _plan(), 9),
         arg="kernel_size"),
    Case(CP, "x_local_none", lambda: call(packcuda.conv_prefix, None, _plan(), 3), exc=TypeError, arg="x_local"),
    Case(CP, "x_local_rows", lambda: call(packcuda.conv_prefix, _x(5), _plan(), 3), arg="x_local"),
    Case(CP, "x_local_1d", lambda: call(packcuda.conv_prefix, torch.randn(_plan().total_local), _plan(), 3),
         arg="x_local"),
    Case(CP, "x_local_int", lambda: call(packcuda.conv_prefix, _x(_plan().total_local).long(), _plan(), 3),
         arg="x_local"),
    Case(CP, "check_not_bool", lambda: call(packcuda.conv_prefix, _x(_plan().total_local), _plan(), 3, check="yes"),
         exc=TypeError, arg="check"),
    Case(CP, "backend_unknown", lambda: call(packcuda.conv_prefix, _x(_plan().total_local), _plan(), 3,
                                             backend="mpi"), arg="backend"),
    Case(CP, "no_process_group", risky=True, arg="group",
         make=lambda: call(packcuda.conv_prefix, _x(_plan().total_local), _plan(), 3)),
    # ---------------------------------------------------------------------------------- static plans' tables
    Case("ops.conv_static_prefix_tables", "kernel_size_one", lambda: _static_tables(kernel_size=1),
         arg="kernel_size"),
    Case("ops.conv_static_prefix_tables", "kernel_size_nine", lambda: _static_tables(kernel_size=9),
         arg="kernel_size"),
    Case("ops.conv_static_prefix_tables", "cp_rank_out_of_range", lambda: _static_tables(cp_rank=2),
         arg="cp_rank"),
    Case("ops.conv_static_prefix_tables", "cp_size_zero", lambda: _static_tables(cp_size=0), arg="cp_size"),
    Case("ops.conv_static_prefix_tables", "layout_unknown", lambda: _static_tables(layout="contig"), arg="layout"),
    Case("ops.conv_static_prefix_tables", "layout_not_str", lambda: _static_tables(layout=0), exc=RuntimeError,
         arg=("'layout'", "'str'")),
    Case("ops.conv_static_prefix_tables", "capacity_not_multiple", lambda: _static_tables(capacity=31),
         arg="capacity"),
    Case("ops.conv_static_prefix_tables", "capacity_huge", lambda: _static_tables(capacity=2**63 - 1),
         arg="capacity"),
    Case("ops.conv_static_prefix_tables", "pieces_wrong_length",
         lambda: _static_tables(pieces=torch.zeros(10, dtype=torch.int32)), arg="pieces"),
    Case("ops.conv_static_prefix_tables", "pieces_int64",
         lambda: _static_tables(pieces=torch.zeros(11, dtype=torch.int64)), arg="pieces"),
    Case("ops.conv_static_prefix_tables", "piece_offset_int32",
         lambda: _static_tables(piece_offset=torch.zeros(10, dtype=torch.int32)), arg="piece_offset"),
    Case("ops.conv_static_prefix_tables", "piece_offset_wrong_length",
         lambda: _static_tables(piece_offset=torch.zeros(9, dtype=torch.int64)), arg="piece_offset"),
    Case("ops.conv_static_prefix_tables", "piece_seq_wrong_length",
         lambda: _static_tables(piece_seq=torch.zeros(11, dtype=torch.int32)), arg="piece_seq"),
    Case("ops.conv_static_prefix_tables", "piece_seq_2d",
         lambda: _static_tables(piece_seq=torch.zeros(1, 10, dtype=torch.int32)), arg="piece_seq"),
    Case("ops.conv_static_prefix_tables", "padded_too_short",
         lambda: _static_tables(cu_seqlens_padded=torch.tensor([0, 32], dtype=torch.int32)), arg="cu_seqlens_padded"),
    Case("ops.conv_static_prefix_tables", "padded_int64",
         lambda: _static_tables(cu_seqlens_padded=_cu(0, 4, 8, 12, 32, 32)), arg="cu_seqlens_padded"),
    Case("ops.conv_static_prefix_tables", "layout_mismatch_piece_count", lambda: _static_tables(layout="contiguous"),
         arg="pieces"),
    Case("ops.conv_static_prefix_tables", "padded_other_device", cuda=True, arg="pieces",
         make=lambda: _static_tables(cu_seqlens_padded=torch.zeros(6, dtype=torch.int32, device="cuda"))),
]
