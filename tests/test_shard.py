import os
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, no_sync, requires_cuda, spawn

ops = torch.ops.packcuda
DEVS = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _check_plan(plan, want):
    assert plan.cu_seqlens_padded_host == want["cu_padded"]
    assert plan.cu_seqlens_local_host == want["cu_local"]
    assert plan.total_local == want["total_local"] and plan.pad_size == want["pad_size"]
    assert plan.index.cpu().tolist() == want["index"]
    assert plan.position_ids.cpu().tolist() == want["position"]
    assert plan.label_index.cpu().tolist() == want["label_index"]
    assert plan.cu_seqlens_padded.dtype == torch.int32 and plan.cu_seqlens_local.dtype == torch.int32
    assert plan.cu_seqlens_padded.cpu().tolist() == want["cu_padded"]
    assert plan.cu_seqlens_local.cpu().tolist() == want["cu_local"]
    # pieces tile the local buffer; each is a run of consecutive padded offsets of one segment
    p, off, seq = plan.pieces_host, plan.piece_offset_host, plan.piece_seq_host
    assert p[0] == 0 and p[-1] == plan.total_local and len(p) == len(off) + 1 == len(seq) + 1
    for k in range(len(off)):
        assert want["position"][p[k]:p[k + 1]] == list(range(off[k], off[k] + p[k + 1] - p[k]))
    assert plan.pieces.cpu().tolist() == p and plan.piece_offset.cpu().tolist() == off
    assert plan.piece_seq.cpu().tolist() == seq


def _all_ranks(cu, cp, device, **kw):
    return [packcuda.shard_plan(cu, cp, r, device=device, **kw) for r in range(cp)]


def _roundtrip(plans, cu, device, g):
    T = cu[-1]
    x = torch.randn(T, 3, generator=g).to(device)
    shards = [p.shard(x, fill=7.0) for p in plans]
    for p, s in zip(plans, shards):
        valid = p.index >= 0
        assert torch.equal(s[valid], x[p.index[valid]]) and bool((s[~valid] == 7.0).all())
    for p in plans:
        assert torch.equal(p.unshard(torch.stack(shards)), x)
    ids = torch.randint(0, 1000, (T,), generator=g).to(device)
    want_labels = packcuda.next_token_labels(ids, cu, -100)
    for p in plans:
        assert torch.equal(p.labels(ids, -100), p.shard(want_labels, fill=-100))


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.one_of(st.just(0), st.integers(1, 40)), min_size=0, max_size=8),
    cp=st.integers(1, 8),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    align_mult=st.sampled_from([None, 1, 2, 3]),
    bucket_mult=st.sampled_from([None, 1, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_plan_matches_reference(lens, cp, layout, align_mult, bucket_mult, seed):
    cu = _cu(lens)
    base = 2 * cp if layout == "zigzag" else 1
    align = None if align_mult is None else base * align_mult
    a = align if align is not None else base
    bucket = None if bucket_mult is None else (a * bucket_mult if layout == "zigzag" else 3 * bucket_mult)
    g = torch.Generator().manual_seed(seed)
    for device in DEVS:
        plans = _all_ranks(cu, cp, device, layout=layout, align=align, bucket=bucket)
        rows = []
        for r, plan in enumerate(plans):
            _check_plan(plan, ref.shard_layout(cu, cp, r, layout, align, bucket))
            rows += [i for i in plan.index.cpu().tolist() if i >= 0]
            assert plan.total == cu[-1] and plan.cu_seqlens_host == cu
        assert sorted(rows) == list(range(cu[-1]))  # every original row exactly once across ranks
        assert plans[0].total_padded % cp == 0 and (bucket is None or plans[0].total_padded % bucket == 0)
        _roundtrip(plans, cu, device, g)


def test_verl_example(device):
    # L=4803, cp=2: rank 0 holds positions [0,1201) and [3603,4803), rank 1 [1201,3603)
    p0, p1 = _all_ranks([0, 4803], 2, device)
    real0 = p0.position_ids[p0.index >= 0].cpu().tolist()
    real1 = p1.position_ids[p1.index >= 0].cpu().tolist()
    assert real0 == list(range(0, 1201)) + list(range(3603, 4803))
    assert real1 == list(range(1201, 3603))
    assert p0.total_local == p1.total_local == 2402 and p0.cu_seqlens_padded_host == [0, 4804]
    # the last real token has no label; the token before the chunk boundary labels across it
    assert p1.label_index[-1].item() == 3603 and p0.label_index[1200].item() == 1201


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_te_thd_partitioned_indices(device, cp):
    lens = [0, 1, 17, 64, 100, 5, 2 * cp, 333]
    cu = _cu(lens)
    for r in range(cp):
        plan = packcuda.shard_plan(cu, cp, r, device=device)
        te = ref.thd_partitioned_indices(plan.cu_seqlens_padded_host, plan.total_padded, cp, r)
        # padded stream index -> original row (or -1)
        row_of = []
        for i in range(len(lens)):
            P = plan.cu_seqlens_padded_host[i + 1] - plan.cu_seqlens_padded_host[i]
            row_of += [cu[i] + o if o < lens[i] else -1 for o in range(P)]
        assert plan.index.cpu().tolist() == [row_of[j] for j in te]


def test_bucket_segment(device):
    cu = _cu([5, 0, 9])
    plan = packcuda.shard_plan(cu, 2, 1, align=4, bucket=40, device=device)
    assert plan.cu_seqlens_padded_host == [0, 8, 8, 20, 40] and plan.pad_size == 20
    assert plan.total_padded == 40 and plan.max_seqlen_padded == 20
    # bucket segment positions restart at 0 on every rank's share of it
    pos = plan.position_ids.cpu().tolist()
    assert pos[plan.cu_seqlens_local_host[3]:] == list(range(5, 10)) + list(range(10, 15))
    plan = packcuda.shard_plan(cu, 2, 0, layout="contiguous", bucket=7, device=device)
    assert plan.total_padded == 14 and plan.pad_size == 0 and len(plan.cu_seqlens_padded_host) == 4
    plan = packcuda.shard_plan(cu, 3, 0, layout="contiguous", bucket=4, device=device)
    assert plan.total_padded == 24 and plan.cu_seqlens_padded_host[-1] == 24 and plan.pad_size == 10


def test_cp1_plain_padding(device):
    cu = _cu([3, 0, 6])
    plan = packcuda.shard_plan(cu, 1, 0, device=device)
    assert plan.index.cpu().tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, 8]
    assert plan.position_ids.cpu().tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    plan = packcuda.shard_plan(cu, 1, 0, layout="contiguous", device=device)
    assert plan.index.cpu().tolist() == list(range(9)) and plan.pad_size == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_dims_and_dtypes(device, dtype, layout):
    cu = _cu([7, 30, 0, 12])
    T = cu[-1]
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(T, 4, 5, generator=g) * 10).to(dtype)
    pos = torch.randint(0, 99, (3, T), generator=g).to(dtype)
    for r in range(4):
        plan = packcuda.shard_plan(cu, 4, r, layout=layout, device=device)
        want = ref.shard_layout(cu, 4, r, layout)
        assert torch.equal(plan.shard(x.to(device)).cpu(), ref.shard_rows(x, want["index"]))
        got = plan.shard(pos.to(device), dim=1, fill=1)
        assert got.shape == (3, plan.total_local)
        assert torch.equal(got.cpu(), ref.shard_rows(pos.t(), want["index"], 1).t())
        assert torch.equal(plan.shard(pos.to(device), dim=-1, fill=1), got)


def test_device_cu_seqlens_matches_host(device):
    cu = _cu([4, 11, 0, 9])
    a = packcuda.shard_plan(cu, 2, 1, device=device)
    b = packcuda.shard_plan(torch.tensor(cu, dtype=torch.int32, device=device), 2, 1)
    assert b.device == a.device
    for name in ["index", "position_ids", "label_index", "cu_seqlens_padded", "cu_seqlens_local", "pieces"]:
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_gradients(device):
    cu = _cu([5, 0, 8, 3])
    x = torch.randn(cu[-1], 2, dtype=torch.float64, device=device, requires_grad=True)
    plans = _all_ranks(cu, 2, device, bucket=8)
    assert torch.autograd.gradcheck(lambda t: plans[1].shard(t, fill=3.0), (x,))
    g = torch.randn(2, plans[0].total_local, 2, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: plans[0].unshard(t), (g,))
    p3 = torch.randn(3, cu[-1], dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: plans[0].shard(t, dim=1), (p3,))
    # shard is the transpose of gathering: the sum over ranks of the shard backward is all ones
    grads = torch.zeros_like(x)
    for p in plans:
        (gx,) = torch.autograd.grad(p.shard(x).sum(), x)
        grads += gx
    assert torch.equal(grads, torch.ones_like(x))


def test_plan_fields_are_named_by_the_op():
    """ShardPlan and StaticShardPlan read their host fields by the names the op library gives (one list, in C++)."""
    from packcuda import shard
    assert shard._INFO_NAMES == ("total", "total_padded", "total_local", "pad_size", "max_seqlen_padded",
                                 "max_seqlen_local")
    assert list(shard._SECTIONS) == ["cu_seqlens_padded", "cu_seqlens_local", "pieces", "piece_seq", "piece_offset",
                                     "cu_seqlens"]
    assert shard._STATUS_NAMES == ("flags", "num_seqs", "padded_total", "first_bad_cu")
    assert shard._STATUS_FLAGS == {"over_capacity": 1, "too_many_seqs": 2, "bad_cu": 4}
    cu = [0, 5, 5, 13, 16]
    plan = packcuda.shard_plan(cu, 2, 1, bucket=32)
    info = ops.shard_plan(torch.tensor(cu), 2, 1, "zigzag", 4, 32, None)[9].tolist()
    assert len(info) == shard._N_INFO
    assert [getattr(plan, n) for n in shard._INFO_NAMES] == info[:len(shard._INFO_NAMES)]
    for name in shard._SECTIONS:
        want = plan.cu_seqlens_host if name == "cu_seqlens" else getattr(plan, name).tolist()
        assert getattr(plan, name + "_host") == want


def test_opcheck(device):
    cu = torch.tensor(_cu([5, 0, 8, 3]))
    plan = ops.shard_plan(cu, 2, 1, "zigzag", 4, 16, None)
    dev = torch.device(device)
    total_local = int(plan[9][2])
    torch.library.opcheck(ops.shard_unshard_index, (cu, plan[3], 2, "zigzag", total_local, dev),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile(device):
    cu = _cu([5, 9, 0, 13])
    plans = _all_ranks(cu, 2, device)
    for p in plans:
        p.unshard_index  # noqa: B018 (built outside the compiled region)
    x = torch.randn(cu[-1], 4, device=device)
    ids = torch.randint(0, 100, (cu[-1],), device=device)

    pos = torch.randint(0, 100, (3, cu[-1]), device=device)

    def f(x, ids, pos):
        shards = [p.shard(x) * 2 for p in plans]
        return plans[0].unshard(torch.stack(shards)), plans[1].labels(ids), plans[1].shard(pos, dim=1) + 1

    backend = "aot_eager" if device == "cpu" else "inductor"
    got = torch.compile(f, fullgraph=True, backend=backend)(x, ids, pos)
    want = f(x, ids, pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_deterministic(device):
    cu = _cu([100, 3, 250, 0, 77])
    a = packcuda.shard_plan(cu, 4, 2, device=device)
    b = packcuda.shard_plan(cu, 4, 2, device=device)
    x = torch.randn(cu[-1], 8, device=device)
    assert torch.equal(a.index, b.index) and torch.equal(a.shard(x), b.shard(x))
    assert torch.equal(a.unshard_index, b.unshard_index)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cu=[0, 5, 3], cp=2, rank=0), "non-decreasing"),
        (dict(cu=[1, 5], cp=2, rank=0), r"cu_seqlens\[0\] must be 0"),
        (dict(cu=[0, 5], cp=2, rank=2), "cp_rank must be in"),
        (dict(cu=[0, 5], cp=2, rank=-1), "cp_rank must be in"),
        (dict(cu=[0, 5], cp=0, rank=0), r"cp_size=0 is out of range \[1, "),
        (dict(cu=[0, 5], cp=2, rank=0, align=6), "multiple of 2\\*cp_size=4"),
        (dict(cu=[0, 5], cp=2, rank=0, align=0, layout="contiguous"), "align must be >= 1"),
        (dict(cu=[0, 5], cp=2, rank=0, align=8, bucket=12), "bucket must be a multiple of align=8"),
        (dict(cu=[0, 5], cp=2, rank=0, bucket=0, layout="contiguous"), "bucket must be >= 1"),
        (dict(cu=[0, 5], cp=2, rank=0, layout="ring"), "layout must be"),
    ],
)
def test_bad_plan_args(kw, match):
    cu = kw.pop("cu")
    with pytest.raises(ValueError, match=match):
        packcuda.shard_plan(cu, kw.pop("cp"), kw.pop("rank"), **kw)


def test_bad_tensors(device):
    cu = _cu([5, 0, 8])
    plan = packcuda.shard_plan(cu, 2, 0, device=device)
    with pytest.raises(ValueError, match="x has 12 rows along dim 0, expected 13"):
        plan.shard(torch.zeros(12, 2, device=device))
    with pytest.raises(ValueError, match="x has 3 rows along dim 0, expected 13"):
        plan.shard(torch.zeros(3, 13, device=device), dim=0)
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        plan.shard(torch.zeros(3, 13, device=device), dim=2)
    with pytest.raises(ValueError, match="input_ids has 5 rows"):
        plan.labels(torch.zeros(5, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="gathered has 7 rows along dim 0, expected 16"):
        plan.unshard(torch.zeros(7, 3, device=device))
    with pytest.raises(ValueError, match="gathered has 2 rows along dim 0, expected 16"):
        plan.unshard(torch.zeros(2, 7, device=device))
    with pytest.raises(TypeError, match="int32/int64"):
        packcuda.shard_plan(torch.tensor([0.0, 5.0]), 2, 0)
    with pytest.raises(TypeError, match="integer"):
        packcuda.shard_plan([0, 5.5], 2, 0)
    assert packcuda.shard_plan((0, 5), 2, 0).index.tolist() == [0, 1, -1, -1]
    other = "cpu" if device == "cuda" else ("cuda" if HAS_CUDA else None)
    if other is not None:
        with pytest.raises(ValueError, match="is on"):
            plan.shard(torch.zeros(13, device=other))


@requires_cuda
@pytest.mark.gpu
def test_op_rejects_device_metadata():
    with pytest.raises(ValueError, match="must be host metadata"):
        ops.shard_plan(torch.tensor([0, 5], device="cuda"), 2, 0, "zigzag", 4, None, None)


def test_bad_op_metadata():
    cu = torch.tensor([0, 5, 13])
    cu_padded = ops.shard_plan(cu, 2, 0, "zigzag", 4, None, None)[3]
    with pytest.raises(ValueError, match="does not match the number of tokens"):
        ops.shard_unshard_index(cu, cu_padded, 2, "zigzag", 5, None)
    with pytest.raises(ValueError, match="padded segment 0 has 4 rows, fewer than its 5 tokens"):
        ops.shard_unshard_index(cu, torch.tensor([0, 4, 16]), 2, "zigzag", 8, None)
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp_size=4"):
        ops.shard_unshard_index(cu, torch.tensor([0, 6, 16]), 2, "zigzag", 8, None)


# ---------------------------------------------------------------------------------------------------
# plan.gather across processes (gloo)
# ---------------------------------------------------------------------------------------------------
def _gather_worker(rank, world, init, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cu = _cu([13, 0, 40, 7, 21])
        g = torch.Generator().manual_seed(5)
        x = torch.randn(cu[-1], 3, dtype=torch.float64, generator=g)
        w = torch.randn(cu[-1], 3, dtype=torch.float64, generator=g)
        res = {}
        for layout in ["zigzag", "contiguous"]:
            plan = packcuda.shard_plan(cu, world, rank, layout=layout, bucket=12 * world)
            x_local = plan.shard(x).requires_grad_()
            y = plan.gather(x_local)
            (y * w).sum().backward()
            res[layout] = dict(y=y.detach(), grad=x_local.grad, want_grad=world * plan.shard(w))
        torch.save(res, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 8])
def test_gather_gloo(world):
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        spawn(_gather_worker, (world, init, d), world)
        x = torch.randn(81, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        for r in range(world):
            for layout, res in torch.load(os.path.join(d, f"r{r}.pt")).items():
                assert torch.equal(res["y"], x), layout
                # every rank used the same loss: the gradient is the sum over ranks (world x), pads get zero
                assert torch.allclose(res["grad"], res["want_grad"]), layout


# ---------------------------------------------------------------------------------------------------
# GPU: host metadata never syncs
# ---------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_no_sync(layout):
    cu = _cu([100, 0, 37, 512, 9])
    x = torch.randn(cu[-1], 16, device="cuda")
    ids = torch.randint(0, 1000, (cu[-1],), device="cuda")
    pos = torch.randint(0, 1000, (3, cu[-1]), device="cuda")
    with no_sync():
        plans = [packcuda.shard_plan(cu, 4, r, layout=layout, bucket=64 if layout == "zigzag" else 10,
                                     device="cuda") for r in range(4)]
        shards = [p.shard(x) for p in plans]
        [p.labels(ids) for p in plans]
        [p.shard(pos, dim=1) for p in plans]
        back = plans[2].unshard(torch.stack(shards))
    assert torch.equal(back, x)


# ---------------------------------------------------------------------------------------------------
# the one-call plan op, strided dim>0 shards, CUDA graphs
# ---------------------------------------------------------------------------------------------------
def test_shard_plan_op(device):
    cu = torch.tensor(_cu([5, 0, 8, 3]))
    dev = torch.device(device)
    for args in [(cu, 2, 1, "zigzag", 4, 16, dev), (cu, 3, 2, "contiguous", 1, 5, dev),
                 (cu.to(torch.int32), 1, 0, "zigzag", 2, None, dev)]:
        torch.library.opcheck(ops.shard_plan, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out = ops.shard_plan(cu, 2, 1, "zigzag", 4, 16, dev)
    assert [t.device.type for t in out] == [device] * 8 + ["cpu", "cpu"]
    assert [t.dtype for t in out[:8]] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64, torch.int32]
    # every output owns its memory (no output is a view of another)
    ptrs = [t.untyped_storage().data_ptr() for t in out if t.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_plan_host_values(device):
    cu = _cu([7, 0, 30, 1, 12])
    for layout, bucket in [("zigzag", None), ("zigzag", 60), ("contiguous", 10)]:
        for r in range(3):
            plan = packcuda.shard_plan(cu, 3, r, layout=layout, bucket=bucket, device=device)
            want = ref.shard_layout(cu, 3, r, layout, None, bucket)
            local = want["cu_local"]
            assert plan.max_seqlen_local == max(b - a for a, b in zip(local[:-1], local[1:]))
            assert plan.cu_seqlens_host == cu and plan.cu_seqlens_local_host == local
            assert plan.cu_seqlens_padded.device.type == device and plan.piece_offset.dtype == torch.int64
            assert repr(plan).startswith("ShardPlan(") and "sequences=5" in repr(plan)


def test_shard_strided_and_leading_dims(device):
    cu = _cu([9, 0, 21, 4])
    T = cu[-1]
    g = torch.Generator().manual_seed(8)
    pos4 = torch.randint(0, 99, (4, 1, T), generator=g)
    x = torch.randn(T, 4, generator=g)
    wide = torch.randn(2, 3, T, 5, generator=g)
    for r in range(2):
        plan = packcuda.shard_plan(cu, 2, r, device=device)
        idx = torch.tensor(ref.shard_layout(cu, 2, r)["index"])
        for src, dim in [(pos4[:, 0, :], 1), (x.t(), 1), (wide, 2), (wide, -2), (pos4, 2), (x[:, 1], 0)]:
            got = plan.shard(src.to(device), dim=dim, fill=-1)
            assert torch.equal(got.cpu(), ref.gather_rows_dim(src, idx, -1, dim))
    with pytest.raises(TypeError, match="x must be a tensor"):
        plan.shard([0] * T)
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        plan.shard(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="input_ids has 3 rows along dim 0"):
        plan.labels(torch.zeros(3, T, device=device))


def test_shard_dim1_backward_deterministic(device):
    cu = _cu([13, 0, 6, 29])
    T = cu[-1]
    plans = _all_ranks(cu, 3, device, layout="contiguous", bucket=7)
    pos = torch.randn(3, T, 2, dtype=torch.float64, device=device, requires_grad=True)
    w = [torch.randn(3, p.total_local, 2, dtype=torch.float64, device=device) for p in plans]
    total = torch.zeros_like(pos)
    for p, wp in zip(plans, w):
        g1 = torch.autograd.grad((p.shard(pos, dim=1) * wp).sum(), pos)[0]
        g2 = torch.autograd.grad((p.shard(pos, dim=1) * wp).sum(), pos)[0]
        assert torch.equal(g1, g2)
        assert torch.equal(g1.cpu(), ref.scatter_rows_dim(wp.cpu(), p.index.cpu(), T, 1))
        total += torch.autograd.grad(p.shard(pos, dim=1).sum(), pos)[0]
    # every original row lands on exactly one rank: the ranks' gradients of the sums add up to all ones
    assert torch.equal(total, torch.ones_like(pos))


@requires_cuda
@pytest.mark.gpu
def test_op_rejects_device_metadata_in_one_call():
    with pytest.raises(ValueError, match="must be host metadata"):
        ops.shard_plan(torch.tensor([0, 5], device="cuda"), 2, 0, "zigzag", 4, None, torch.device("cuda"))


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_capture():
    # a plan built before capture: shard / labels / shard along dim 1 replay from a CUDA graph
    cu = _cu([100, 0, 37, 512, 9])
    T = cu[-1]
    plan = packcuda.shard_plan(cu, 4, 1, device="cuda")
    ids = torch.randint(0, 1000, (T,), device="cuda")
    pos = torch.randint(0, 1000, (3, T), device="cuda")
    x = torch.randn(T, 64, device="cuda")
    fns = [lambda: plan.shard(ids), lambda: plan.labels(ids), lambda: plan.shard(pos, dim=1), lambda: plan.shard(x)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            [f() for f in fns]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [f() for f in fns]
    ids.copy_(torch.randint(0, 1000, (T,), device="cuda"))
    pos.copy_(torch.randint(0, 1000, (3, T), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for o, f in zip(outs, fns):
        assert torch.equal(o, f())


# ---------------------------------------------------------------------------------------------------
# positions: pad slots continue their pad segment (one segment per pad run under position-based detection)
# ---------------------------------------------------------------------------------------------------
def _want_positions(pos, want):
    """pos [..., T] sharded by the reference layout, pad slots taking the reference plan positions."""
    idx = torch.tensor(want["index"], dtype=torch.int64)
    plan_pos = torch.tensor(want["position"], dtype=pos.dtype)
    got = pos[..., idx.clamp(min=0)]
    return torch.where(idx < 0, plan_pos, got)


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.one_of(st.just(0), st.integers(1, 30)), min_size=0, max_size=6),
    cp=st.integers(1, 4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    align_mult=st.sampled_from([None, 1, 2, 3]),
    bucket_mult=st.sampled_from([None, 1, 3, 7]),
    rows=st.sampled_from([None, 3, 4]),
    seed=st.integers(0, 2**16),
)
def test_shard_positions_matches_reference(lens, cp, layout, align_mult, bucket_mult, rows, seed):
    cu = _cu(lens)
    base = 2 * cp if layout == "zigzag" else 1
    align = None if align_mult is None else base * align_mult
    a = align if align is not None else base
    bucket = None if bucket_mult is None else (a * bucket_mult if layout == "zigzag" else 5 * bucket_mult)
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    shape = (T,) if rows is None else (rows, T)
    pos = torch.randint(0, 1000, shape, generator=g)
    for r in range(cp):
        plan = packcuda.shard_plan(cu, cp, r, layout=layout, align=align, bucket=bucket)
        want = ref.shard_layout(cu, cp, r, layout, align, bucket)
        assert torch.equal(plan.shard_positions(pos), _want_positions(pos, want))
        if rows is not None:
            got3 = plan.shard_positions(pos[:, None, :].to(torch.int32))
            assert got3.shape == (rows, 1, plan.total_local) and got3.dtype == torch.int32
            assert torch.equal(got3[:, 0, :].long(), _want_positions(pos, want))
            assert torch.equal(hf_shard_position_ids(pos[:, None, :], plan)[:, 0, :], _want_positions(pos, want))


def hf_shard_position_ids(pos, plan):
    from packcuda.integrations.transformers import shard_position_ids

    return shard_position_ids(pos, plan)


def _mrope_like(lens, rows, g):
    """[rows, T] positions: each sequence starts at 0 on every row and grows by 0 or 1 per token (as mRoPE
    positions do: vision tokens share or compress positions, text tokens count by 1)."""
    out = []
    for n in lens:
        steps = torch.randint(0, 2, (rows, n), generator=g)
        if n:
            steps[:, 0] = 0
        out.append(steps.cumsum(1))
    return torch.cat(out, 1) if out else torch.zeros(rows, 0, dtype=torch.int64)


@pytest.mark.parametrize("layout,bucket", [("zigzag", None), ("zigzag", 48), ("contiguous", 10), ("contiguous", None)])
def test_pad_runs_are_one_segment_for_transformers(layout, bucket):
    """Position-based packed-sequence detection (transformers' own functions) finds exactly the plan's
    non-empty padded segments, bucket pad segment included: pads no longer form one-token sequences."""
    from transformers.masking_utils import find_packed_sequence_indices
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from packcuda.integrations.transformers import shard_position_ids

    lens = [5, 0, 9, 1, 14]
    cu = _cu(lens)
    cp = 2
    text = ref.position_ids(cu)
    pos = torch.stack([text] * 3)[:, None, :]
    plans = _all_ranks(cu, cp, "cpu", layout=layout, bucket=bucket)

    def segments(plan):
        c = plan.cu_seqlens_padded_host
        return [0] + [b for a, b in zip(c[:-1], c[1:]) if b > a]

    # cp = 1 sees the whole padded stream; contiguous ranks concatenated are the padded stream too
    one = packcuda.shard_plan(cu, 1, 0, layout=layout, bucket=bucket)
    streams = [(shard_position_ids(pos, one)[0], segments(one))]
    if layout == "contiguous":
        streams.append((torch.cat([shard_position_ids(pos, p)[0] for p in plans], dim=1), segments(plans[0])))
    for s, want in streams:
        (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(s)
        assert cu_q.tolist() == want
        seg_ids = find_packed_sequence_indices(s)
        assert int(seg_ids[0, -1]) + 1 == len(want) - 1
    # every rank: a pad slot is a restart (position 0) only where the bucket pad segment starts
    for p in plans:
        got = shard_position_ids(pos, p)[:, 0, :]
        pads = p.index < 0
        zero_pads = (got[0] == 0) & pads
        assert torch.equal(zero_pads, pads & (p.position_ids == 0))
        assert int(zero_pads.sum()) <= (1 if p.pad_size else 0)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_mrope_pads_continue_their_segment(layout):
    """3-row mRoPE-like positions: each sequence's tail pads lie above every real position of the sequence
    on every row and count up by one, so no row restarts inside a pad run."""
    g = torch.Generator().manual_seed(11)
    lens = [7, 3, 0, 12, 5]
    cu = _cu(lens)
    pos = _mrope_like(lens, 3, g)
    plan = packcuda.shard_plan(cu, 1, 0, layout=layout, align=4, bucket=40 if layout == "zigzag" else 9)
    got = plan.shard_positions(pos)
    cup = plan.cu_seqlens_padded_host
    for i in range(len(cup) - 1):
        seg = got[:, cup[i]:cup[i + 1]]
        n = lens[i] if i < len(lens) else 0
        if seg.shape[1] == 0:
            continue
        real, pad = seg[:, :n], seg[:, n:]
        assert bool((seg[:, 1:] >= seg[:, :-1]).all())  # monotone on every row
        if pad.shape[1]:
            assert bool((pad[:, 1:] - pad[:, :-1] == 1).all())
            if n:
                assert bool((pad[:, :1] > real[:, -1:]).all())
            else:
                assert bool((pad[:, 0] == 0).all())  # the bucket pad segment starts at 0


def test_edge_arguments_that_work():
    import numpy as np

    from packcuda.shard import MAX_PADDED_TOTAL

    # numpy / 0-d integer tensors are integers; the largest cp_size / bucket with an empty stream
    a = packcuda.shard_plan(np.array([0, 5, 9]), np.int64(2), torch.tensor(1), align=np.int32(4))
    b = packcuda.shard_plan([0, 5, 9], 2, 1, align=4)
    assert torch.equal(a.index, b.index) and a.cu_seqlens_padded_host == b.cu_seqlens_padded_host
    p = packcuda.shard_plan([0], MAX_PADDED_TOTAL, 5, layout="contiguous", bucket=MAX_PADDED_TOTAL)
    assert p.total_local == 0 and p.total_padded == 0 and p.index.numel() == 0
    p = packcuda.shard_plan([0, 3], 4, 3, layout="contiguous", bucket=2**12 + 1)
    assert p.total_padded == 4 * (2**12 + 1) and p.pad_size == p.total_padded - 3
    # fills a dtype holds exactly; floats take NaN
    plan = packcuda.shard_plan([0, 3, 5], 2, 0)
    x = torch.arange(5)
    assert plan.shard(x, fill=-(2**53)).tolist() == [0, -(2**53), 3, -(2**53)]
    assert plan.shard(x, fill=2**62 + 1).tolist() == [0, 2**62 + 1, 3, 2**62 + 1]  # integers stay integers
    assert plan.labels(x, ignore_index=2**53 + 1).tolist() == [1, 2**53 + 1, 4, 2**53 + 1]
    assert plan.shard(x, fill=7.0).tolist() == [0, 7, 3, 7]
    assert plan.shard(x.to(torch.uint8), fill=255).tolist() == [0, 255, 3, 255]
    assert plan.shard(x > 2, fill=True).tolist() == [False, True, True, True]
    f = plan.shard(x.float(), fill=float("nan"))
    assert f[0] == 0 and bool(f[1].isnan()) and f[2] == 3
    assert plan.labels(x, ignore_index=np.int64(-1)).tolist() == [1, -1, 4, -1]
    assert plan.shard(torch.stack([x, x]), dim=np.int64(1)).shape == (2, 4)


@requires_cuda
@pytest.mark.gpu
def test_indexless_cuda_means_current_device():
    plan = packcuda.shard_plan([0, 3, 5], 2, 0, device="cuda")
    assert plan.device == torch.device("cuda", torch.cuda.current_device())
    assert plan.index.device == plan.device
    assert torch.equal(plan.shard(torch.arange(5, device="cuda")).cpu(), packcuda.shard_plan([0, 3, 5], 2, 0).shard(
        torch.arange(5)))


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.one_of(st.just(0), st.integers(1, 50)), min_size=0, max_size=6),
    cp=st.integers(1, 6),
    layout=st.sampled_from([0, 1]),
    align_mult=st.integers(1, 4),
    bucket_mult=st.sampled_from([None, 1, 2, 9]),
    rank_seed=st.integers(0, 100),
)
def test_raw_ops_match_reference(lens, cp, layout, align_mult, bucket_mult, rank_seed):
    """shard_plan + shard_unshard_index (the raw ops) against the plain reference."""
    cu = _cu(lens)
    rank = rank_seed % cp
    align = (2 * cp if layout == 0 else 1) * align_mult
    bucket = None if bucket_mult is None else (align * bucket_mult if layout == 0 else 4 * bucket_mult)
    name = "zigzag" if layout == 0 else "contiguous"
    want = ref.shard_layout(cu, cp, rank, name, align, bucket)
    cu_t = torch.tensor(cu)
    index, position, label, cu_padded, cu_local, *_, info = ops.shard_plan(cu_t, cp, rank, name, align, bucket,
                                                                            None)
    assert cu_padded.tolist() == want["cu_padded"] and cu_local.tolist() == want["cu_local"]
    tl = int(info[2])
    assert tl == want["total_local"] and int(info[3]) == want["pad_size"]
    assert index.tolist() == want["index"] and position.tolist() == want["position"]
    assert label.tolist() == want["label_index"]
    un = ops.shard_unshard_index(cu_t, cu_padded, cp, name, tl, None)
    # row of token t in the rank-major concatenation: slot of t in its rank's reference index
    where = {}
    for r in range(cp):
        for s, row in enumerate(ref.shard_layout(cu, cp, r, name, align, bucket)["index"]):
            if row >= 0:
                where[row] = r * tl + s
    assert un.tolist() == [where[t] for t in range(cu[-1])]
