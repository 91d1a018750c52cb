"""Bad-input cases: the row exchange between CP ranks (exchange.py and the exchange_* raw ops)."""
import torch

from catalogue import Case, call, in_process_group
from packcuda import exchange as ex

ops = torch.ops.packcuda
I64 = torch.int64


def _x(T=10, C=4, dtype=torch.float32):
    return torch.randn(T, C, dtype=dtype)


def _prep(send_index=None, send_counts=(0, 0), recv_counts=(0, 0), send_first=(-1, -1), unpack=None, comm=1, rank=0,
          n_src=8, out_lead=(2, 2)):
    si = torch.zeros(0, dtype=I64) if send_index is None else send_index
    up = torch.zeros(4, 1, dtype=I64) if unpack is None else unpack
    return call(ops.exchange_prepare, si, list(send_counts), list(recv_counts), list(send_first), up, comm, rank,
                n_src, list(out_lead))


def _prep_cuda(**kw):
    kw.setdefault("send_index", torch.zeros(0, dtype=I64, device="cuda"))
    kw.setdefault("unpack", torch.zeros(4, 1, dtype=I64, device="cuda"))
    return _prep(**kw)


# moves of a 2-rank exchange: rank 0's rows 0, 1 fill rank 1's slots 1, 0; rank 1's row 2 fills rank 0's slot 0
MOVES = dict(src_rank=[0, 0, 1], src_row=[0, 1, 2], dst_rank=[1, 1, 0], dst_slot=[1, 0, 0])


def _moves(**change):
    m = {k: list(v) for k, v in MOVES.items()}
    m.update(change)
    return m


def _from_moves(cp=2, rank=0, n_src=3, n_out=2, **change):
    return call(ex.RowSchedule.from_moves, cp, rank, n_src, n_out, *_moves(**change).values())


def _schedule_op(cp=2, rank=0, n_src=3, n_out=2, **change):
    cols = [torch.tensor(v, dtype=I64) if isinstance(v, list) else v for v in _moves(**change).values()]
    return call(ops.exchange_schedule, cp, rank, n_src, n_out, *cols)


def _local_schedule():
    """A one-rank schedule (no group needed): slot j of 3 takes row (2, 0, -) of 4."""
    return ex.RowSchedule.from_moves(1, 0, 4, 3, [0, 0], [2, 0], [0, 0], [0, 1])


def _static_schedule():
    send = torch.tensor([0, 1, -1, 2], dtype=I64)
    return ex.StaticRowSchedule(2, 0, 3, 2, send, torch.tensor([0, 2]), torch.tensor([[0], [1], [-1]]))


GS = "ops.exchange_gather_sum"
SCH, FM = "ops.exchange_schedule", "RowSchedule.from_moves"
ON = "RowSchedule.on"
XR, XS, AG = "exchange.exchange_rows", "exchange.exchange_rows_static", "exchange.check_agreement"
INIT, PREP, RUN, REL = ("ops.exchange_nccl_comm_init", "ops.exchange_prepare", "ops.exchange_run",
                        "ops.exchange_release")

CASES = [
    # ---------------------------------------------------------------------------------- the unpack step
    Case(GS, "index_out_of_range", lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.tensor([[25]])),
         arg="index"),
    Case(GS, "index_below_minus_one", lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.tensor([[-2]])),
         arg="index"),
    Case(GS, "index_int32", lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.tensor([[1]], dtype=torch.int32)),
         arg="index"),
    Case(GS, "index_1d", lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.tensor([1])), arg="index"),
    Case(GS, "index_none", lambda: call(ops.exchange_gather_sum, _x(), _x(), None), arg="index"),
    Case(GS, "b_dtype", lambda: call(ops.exchange_gather_sum, _x(), _x().double(), torch.tensor([[1]])), arg="b"),
    Case(GS, "b_columns", lambda: call(ops.exchange_gather_sum, _x(), _x(C=5), torch.tensor([[1]])), arg="columns"),
    Case(GS, "a_int_summed", lambda: call(ops.exchange_gather_sum, _x().long(), _x().long(), torch.tensor([[1, 2]])),
         arg="a"),
    Case(GS, "a_complex", lambda: call(ops.exchange_gather_sum, _x().cfloat(), _x().cfloat(), torch.tensor([[1]])),
         arg="a"),
    Case(GS, "a_1d", lambda: call(ops.exchange_gather_sum, _x()[0], _x(), torch.tensor([[1]])), arg="a"),
    Case(GS, "too_many_sources_per_row", risky=True, arg="index",
         make=lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.zeros(1, 1, dtype=I64).expand(1, 2**31))),
    Case(GS, "index_on_cuda_a_on_cpu", cuda=True, arg="index",
         make=lambda: call(ops.exchange_gather_sum, _x(), _x(), torch.tensor([[1]], device="cuda"))),
    # ---------------------------------------------------------------------------------- schedules from moves
    Case(SCH, "cp_size_zero", lambda: _schedule_op(cp=0), arg="cp_size"),
    Case(SCH, "cp_size_above_bound", lambda: _schedule_op(cp=70000), arg="cp_size must be <= 65536"),
    Case(SCH, "cp_rank_out_of_range", lambda: _schedule_op(rank=2), arg="cp_rank"),
    Case(SCH, "n_src_negative", lambda: _schedule_op(n_src=-1), arg="n_src"),
    Case(SCH, "n_out_negative", lambda: _schedule_op(n_out=-1), arg="n_out"),
    Case(SCH, "lengths_differ", lambda: _schedule_op(dst_slot=[1, 0]), arg="dst_slot"),
    Case(SCH, "src_row_float", lambda: _schedule_op(src_row=torch.tensor([0.0, 1.0, 2.0])), arg="src_row"),
    Case(SCH, "dst_rank_2d", lambda: _schedule_op(dst_rank=torch.tensor([[1, 1, 0]])), arg="dst_rank"),
    Case(SCH, "src_rank_none", lambda: _schedule_op(src_rank=None), arg="src_rank"),
    Case(SCH, "rank_outside_cp", lambda: _schedule_op(dst_rank=[1, 2, 0]), arg="ranks must be in"),
    Case(SCH, "negative_slot", lambda: _schedule_op(dst_slot=[1, -1, 0]), arg="dst_slot"),
    Case(SCH, "src_row_past_source", lambda: _schedule_op(src_row=[0, 3, 2]), arg="n_src"),
    Case(SCH, "dst_slot_past_output", lambda: _schedule_op(rank=1, dst_slot=[1, 2, 0]), arg="n_out"),
    Case(SCH, "slot_filled_twice", lambda: _schedule_op(dst_slot=[0, 0, 0]), arg="filled by two moves"),
    Case(SCH, "moves_on_cuda", cuda=True, arg="src_rank",
         make=lambda: _schedule_op(src_rank=torch.tensor([0, 0, 1], device="cuda"))),
    Case(FM, "cp_float", lambda: _from_moves(cp=2.0), exc=TypeError, arg="cp", op="exchange_schedule"),
    Case(FM, "rank_out_of_range", lambda: _from_moves(rank=5), arg="rank", op="exchange_schedule"),
    Case(FM, "src_row_floats", lambda: _from_moves(src_row=[0.0, 1.0, 2.0]), exc=TypeError, arg="src_row",
         op="exchange_schedule"),
    Case(FM, "slot_filled_twice", lambda: _from_moves(dst_slot=[1, 1, 0]), arg="slot", op="exchange_schedule"),
    Case(FM, "src_row_past_source", lambda: _from_moves(n_src=1), arg="n_src", op="exchange_schedule"),
    Case(FM, "moves_on_meta", lambda: _from_moves(dst_slot=torch.tensor([1, 0, 0], device="meta")), arg="dst_slot",
         op="exchange_schedule"),
    Case(ON, "device_none", lambda: call(_local_schedule().on, None), exc=TypeError, arg="device", op=ON),
    Case(ON, "device_meta", lambda: call(_local_schedule().on, "meta"), arg="device", op=ON),
    # ---------------------------------------------------------------------------------- exchange_rows
    Case(XR, "x_list", lambda: call(ex.exchange_rows, [[1.0]] * 4, _local_schedule()), exc=TypeError, arg="x"),
    Case(XR, "x_wrong_rows", lambda: call(ex.exchange_rows, _x(5), _local_schedule()), arg="x"),
    Case(XR, "x_0d", lambda: call(ex.exchange_rows, torch.tensor(1.0), _local_schedule()), arg="x"),
    Case(XR, "x_meta", lambda: call(ex.exchange_rows, _x(4).to("meta"), _local_schedule()), arg="x"),
    Case(XR, "schedule_object", lambda: call(ex.exchange_rows, _x(4), object()), exc=TypeError, arg="schedule"),
    Case(XR, "backend_unknown", lambda: call(ex.exchange_rows, _x(4), _local_schedule(), backend="mpi"),
         arg="backend"),
    Case(XR, "check_not_bool", lambda: call(ex.exchange_rows, _x(4), _local_schedule(), check=1), exc=TypeError,
         arg="check"),
    Case(XR, "fingerprint_str", lambda: call(ex.exchange_rows, _x(4), _local_schedule(), fingerprint="plan"),
         exc=TypeError, arg="fingerprint"),
    Case(XR, "fingerprint_unhashable", lambda: call(ex.exchange_rows, _x(4), _local_schedule(),
                                                    fingerprint=[ex.Field("plan", [1, 2])]),
         exc=TypeError, arg="fingerprint"),
    Case(XR, "op_not_str", lambda: call(ex.exchange_rows, _x(4), _local_schedule(), op=3), exc=TypeError, arg="op"),
    Case(XR, "caller_op_named", lambda: call(ex.exchange_rows, _x(5), _local_schedule(), op="vision_route"),
         arg="x", op="vision_route"),
    Case(XR, "group_object", lambda: call(ex.exchange_rows, _x(4), _local_schedule(), "world"), exc=TypeError,
         arg="group"),
    Case(XR, "no_process_group", risky=True, arg="group",
         make=lambda: call(ex.exchange_rows, _x(3), ex.RowSchedule.from_moves(2, 0, 3, 2, *MOVES.values()))),
    Case(XR, "group_size_mismatch", risky=True, arg="rank",
         make=lambda: in_process_group(lambda: ex.exchange_rows(_x(3), ex.RowSchedule.from_moves(2, 0, 3, 2,
                                                                                           *MOVES.values())))),
    Case(XS, "x_list", lambda: call(ex.exchange_rows_static, [[1.0]] * 3, _static_schedule()), exc=TypeError,
         arg="x"),
    Case(XS, "x_wrong_rows", lambda: call(ex.exchange_rows_static, _x(4), _static_schedule(), local=True), arg="x"),
    Case(XS, "schedule_row_schedule", lambda: call(ex.exchange_rows_static, _x(4), _local_schedule(), local=True),
         exc=TypeError, arg="schedule"),
    Case(XS, "local_not_bool", lambda: call(ex.exchange_rows_static, _x(3), _static_schedule(), local="yes"),
         exc=TypeError, arg="local"),
    Case(XS, "no_group", lambda: call(ex.exchange_rows_static, _x(3), _static_schedule()), arg="group"),
    Case(XS, "x_on_cuda", cuda=True, arg="x",
         make=lambda: call(ex.exchange_rows_static, _x(3).cuda(), _static_schedule(), local=True)),
    Case(AG, "fields_not_fields", lambda: call(ex.check_agreement, "plan.gather", None, [("plan", 1)]),
         exc=TypeError, arg="fields", op="plan.gather"),
    Case(AG, "op_not_str", lambda: call(ex.check_agreement, None, None, []), exc=TypeError, arg="op",
         op="check_agreement"),
    Case(AG, "no_process_group", risky=True, arg="group", op="plan.gather",
         make=lambda: call(ex.check_agreement, "plan.gather", None, [ex.Field("plan", 1)])),
    Case("StaticRowSchedule", "tables_on_other_devices", cuda=True, arg="unpack",
         op="StaticRowSchedule",
         make=lambda: call(ex.StaticRowSchedule, 2, 0, 3, 2, torch.tensor([0, 1, -1, 2], device="cuda"),
                           torch.tensor([0, 2]), torch.tensor([[0], [1], [-1]]))),
    Case("StaticRowSchedule", "send_not_a_multiple_of_cp", arg="send", op="StaticRowSchedule",
         make=lambda: call(ex.StaticRowSchedule, 2, 0, 3, 2, torch.tensor([0, 1, -1]), torch.tensor([0, 2]),
                           torch.tensor([[0], [1], [-1]]))),
    Case("StaticRowSchedule", "bwd_wrong_rows", arg="bwd", op="StaticRowSchedule",
         make=lambda: call(ex.StaticRowSchedule, 2, 0, 3, 2, torch.tensor([0, 1, -1, 2]), torch.tensor([0, 2]),
                           torch.tensor([[0], [1]]))),
    # ---------------------------------------------------------------------------------- raw NCCL entry points
    Case(INIT, "unique_id_size", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(5, dtype=torch.uint8), 2, 0, 0),
         arg="unique_id"),
    Case(INIT, "unique_id_dtype", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128), 2, 0, 0),
         arg="unique_id"),
    Case(INIT, "unique_id_none", lambda: call(ops.exchange_nccl_comm_init, None, 2, 0, 0), arg="unique_id"),
    Case(INIT, "rank_out_of_range", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8), 2, 5,
                                                 0), arg="rank"),
    Case(INIT, "rank_negative",
         lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8), 2, -1, 0), arg="rank"),
    Case(INIT, "nranks_zero", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8), 0, 0, 0),
         arg="nranks"),
    Case(INIT, "nranks_beyond_int", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8),
                                                 2**40, 0, 0), arg="nranks"),
    Case(INIT, "device_index_negative", lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8),
                                                     2, 0, -3), arg="device_index"),
    Case(INIT, "unique_id_on_cuda", cuda=True, arg="unique_id",
         make=lambda: call(ops.exchange_nccl_comm_init, torch.zeros(128, dtype=torch.uint8, device="cuda"), 2, 0, 0)),
    Case(PREP, "list_lengths", lambda: _prep(send_first=(-1,)), arg="send_first"),
    Case(PREP, "no_ranks", lambda: _prep(send_counts=(), recv_counts=(), send_first=()), arg="send_counts"),
    Case(PREP, "send_count_negative", lambda: _prep(send_counts=(0, -1)), arg="send_counts"),
    Case(PREP, "recv_count_negative", lambda: _prep(recv_counts=(-4, 0)), arg="recv_counts"),
    Case(PREP, "count_sum_overflow", lambda: _prep(recv_counts=(2**62, 2**62)), arg="recv_counts"),
    Case(PREP, "rank_out_of_range", lambda: _prep(rank=2), arg="rank"),
    Case(PREP, "n_src_negative", lambda: _prep(n_src=-1), arg="n_src"),
    Case(PREP, "send_first_past_end", lambda: _prep(send_index=torch.zeros(3, dtype=I64), send_counts=(0, 3),
                                                    send_first=(0, 6)), arg="send_first"),
    Case(PREP, "send_first_overflow", lambda: _prep(send_index=torch.zeros(3, dtype=I64), send_counts=(0, 3),
                                                    send_first=(0, 2**63 - 2)), arg="send_first"),
    Case(PREP, "out_lead_negative", lambda: _prep(out_lead=(-2, -2)), arg="out_lead"),
    Case(PREP, "out_lead_overflow", lambda: _prep(out_lead=(2**40, 2**40)), arg="out_lead"),
    Case(PREP, "out_lead_rows", lambda: _prep(out_lead=(2, 3)), arg="out_lead"),
    Case(PREP, "send_index_count", lambda: _prep(send_index=torch.zeros(2, dtype=I64)), arg="send_index"),
    Case(PREP, "send_index_int32", lambda: _prep(send_index=torch.zeros(0, dtype=torch.int32)), arg="send_index"),
    Case(PREP, "send_index_2d", lambda: _prep(send_index=torch.zeros(0, 1, dtype=I64)), arg="send_index"),
    Case(PREP, "unpack_index_1d", lambda: _prep(unpack=torch.zeros(4, dtype=I64)), arg="unpack_index"),
    Case(PREP, "unpack_index_float", lambda: _prep(unpack=torch.zeros(4, 1)), arg="unpack_index"),
    Case(PREP, "send_index_none", lambda: call(ops.exchange_prepare, None, [0, 0], [0, 0], [-1, -1],
                                               torch.zeros(4, 1, dtype=I64), 1, 0, 8, [2, 2]), arg="send_index"),
    Case(PREP, "send_index_on_cpu", lambda: _prep(), arg="send_index"),
    Case(PREP, "comm_not_a_communicator", cuda=True, arg="comm", make=lambda: _prep_cuda(comm=12345)),
    Case(PREP, "unpack_index_on_cpu", cuda=True, arg="unpack_index",
         make=lambda: _prep_cuda(unpack=torch.zeros(4, 1, dtype=I64))),
    Case(RUN, "unknown_handle", lambda: call(ops.exchange_run, _x(), 987654, [8]), arg="handle"),
    Case(RUN, "negative_handle", lambda: call(ops.exchange_run, _x(), -1, [8]), arg="handle"),
    Case(RUN, "unknown_handle_cuda", cuda=True, arg="handle",
         make=lambda: call(ops.exchange_run, _x().cuda(), 987654, [8])),
    Case(REL, "unknown_handle", lambda: call(ops.exchange_release, 123456), arg="handle"),
    Case(REL, "zero_handle", lambda: call(ops.exchange_release, 0), arg="handle"),
    Case(REL, "negative_handle", lambda: call(ops.exchange_release, -5), arg="handle"),
]
