"""The conv-prefix exchange of context parallelism (packcuda.conv_prefix): the prefix rows of every rank's pieces
from the ranks that hold them, over gloo and NCCL, against the unsharded causal_conv1d; the schedules built
from a shard plan, and the prepared (NCCL) exchange's ops."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, cumulative, nccl_rank, no_sync, requires_cuda, requires_two_gpus_nccl, spawn_ranks


def _unsharded_case(plan, seed, C, K, act):
    """Random fp64 (X [Tp, C], w, b, output gradient G) on the global padded stream of ``plan`` and the
    unsharded reference over it, split at cu_seqlens_padded: (X, w, b, G, y, dX, dw, db)."""
    g = torch.Generator().manual_seed(seed)
    Tp = plan.total_padded
    X = torch.randn(Tp, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    b = torch.randn(C, generator=g, dtype=torch.float64)
    G = torch.randn(Tp, C, generator=g, dtype=torch.float64)
    Xr, wr, br = (t.clone().requires_grad_() for t in (X, w, b))
    yr = ref.causal_conv1d(Xr, wr, br, plan.cu_seqlens_padded_host, None, act)
    return (X, w, b, G, yr, *torch.autograd.grad(yr, (Xr, wr, br), G))


def _exchange_cases(cps=(2, 3, 4), Ks=(2, 3, 4)):
    import random

    rng = random.Random(1234)
    packs = {
        "random": [rng.randint(0, 30) for _ in range(6)],
        "short": [1, 2, 0, 3, 1, 5, 2, 1],  # shorter than 2*cp*(K-1): prefixes span several pieces / ranks
        "long": [157],
        "many_short": [rng.randint(1, 6) for _ in range(20)],
    }
    cases = []
    for cp in cps:
        for layout in ("zigzag", "contiguous"):
            for K in Ks:
                for name, lens in packs.items():
                    bucket = None
                    if name == "random":  # bucket segment at the tail
                        bucket = 8 * cp * (3 if layout == "zigzag" else 1)
                    act = "silu" if (K + len(name)) % 2 else None
                    cases.append((cp, layout, K, name, lens, bucket, act))
    return cases


def _check_exchange_cases(rank, cases, groups):
    """Runs the sharded conv of every case this rank takes part in against the unsharded reference (outputs and
    every gradient; the "short" packs also twice, bitwise); returns how many it ran."""
    import torch.distributed as dist

    n = 0
    for ci, (cp, layout, K, name, lens, bucket, act) in enumerate(cases):
        if rank >= cp:
            continue
        group = groups[cp]
        cu = cumulative(lens)
        plan = packcuda.shard_plan(cu, cp, rank, layout=layout, bucket=bucket)
        C = 3
        X, w, b, G, yr, dXr, dwr, dbr = _unsharded_case(plan, ci, C, K, act)
        rows = ref.local_padded_rows(plan)
        xl = X[rows].clone().requires_grad_()
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        prefix = packcuda.conv_prefix(xl, plan, K, group)
        assert prefix.shape == (len(plan.pieces_host) - 1, K - 1, C)
        y = packcuda.causal_conv1d(xl, wl, bl, cu_seqlens=plan.pieces, prefix=prefix, activation=act)
        what = f"cp={cp} {layout} K={K} {name} rank={rank}"
        assert torch.allclose(y, yr.detach()[rows], atol=1e-12, rtol=1e-10), f"outputs differ: {what}"
        dx, dw, db = torch.autograd.grad(y, (xl, wl, bl), G[rows])
        assert torch.allclose(dx, dXr[rows], atol=1e-12, rtol=1e-10), f"grad x differs: {what}"
        dist.all_reduce(dw, group=group)
        dist.all_reduce(db, group=group)
        assert torch.allclose(dw, dwr, atol=1e-10, rtol=1e-10), f"grad weight differs: {what}"
        assert torch.allclose(db, dbr, atol=1e-10, rtol=1e-10), f"grad bias differs: {what}"
        if name != "short":
            n += 1
            continue
        # the same call twice gives bit-identical results (deterministic)
        dx2 = torch.autograd.grad(packcuda.causal_conv1d(
            xl, wl, bl, cu_seqlens=plan.pieces, prefix=packcuda.conv_prefix(xl, plan, K, group),
            activation=act), xl, G[rows])[0]
        assert torch.equal(dx, dx2), what
        n += 1
    return n


def _dist_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in (2, 3, 4)}
        n = _check_exchange_cases(rank, _exchange_cases(), groups)
        # debug-check mode: ranks holding different plans fail loudly instead of hanging
        group = groups[2]
        if rank < 2:
            plan = packcuda.shard_plan([0, 10, 16 + 4 * rank], 2, rank)
            x = torch.randn(plan.total_local, 4, dtype=torch.float64)
            try:
                packcuda.conv_prefix(x, plan, 4, group, check=True)
                raise AssertionError("mismatched plans were not detected")
            except ValueError as e:
                assert "disagree on the plan" in str(e)
            good = packcuda.shard_plan([0, 10, 20], 2, rank)
            packcuda.conv_prefix(torch.randn(good.total_local, 4), good, 4, group, check=True)
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_conv_prefix_gloo_equivalence(tmp_path):
    """cp in {2, 3, 4} (subgroups of one 4-process gloo job), zigzag and contiguous, K in {2, 3, 4}, random
    packs with a bucket segment, sequences shorter than 2*cp*(K-1), one long sequence, many short ones: the
    sharded conv equals the unsharded one on this rank's slots, outputs and all gradients."""
    world = 4
    results = spawn_ranks(_dist_worker, world, tmp_path)
    n_cases = len(_exchange_cases())
    per_rank = {r: sum(1 for c in _exchange_cases() if r < c[0]) for r in range(world)}
    assert results == per_rank and n_cases == 72


def _dist_worker_cp8(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        n = _check_exchange_cases(rank, _exchange_cases(cps=(8,), Ks=(2, 4)), {8: dist.group.WORLD})
        # one rank holding another plan: every rank gets the error (none waits for the others)
        plan = packcuda.shard_plan([0, 40, 80 + (16 if rank == 5 else 0)], 8, rank)
        try:
            packcuda.conv_prefix(torch.randn(plan.total_local, 4, dtype=torch.float64), plan, 4, check=True,
                                 group=dist.group.WORLD)
            results[(rank, "mismatch")] = "accepted"
        except ValueError as e:
            results[(rank, "mismatch")] = str(e)
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_conv_prefix_gloo_cp8(tmp_path):
    """cp = 8 (an 8-process gloo job): zigzag and contiguous, K in {2, 4}, a random pack with a bucket segment,
    sequences shorter than 2*cp*(K-1) (a prefix gathered from several pieces and ranks; most pieces empty), one
    long sequence, many short ones: the sharded conv equals the unsharded one (outputs and all gradients); with
    check=True, a rank holding another plan makes every rank raise."""
    world = 8
    results = spawn_ranks(_dist_worker_cp8, world, tmp_path)
    n_cases = len(_exchange_cases(cps=(8,), Ks=(2, 4)))
    assert n_cases == 16
    for r in range(world):
        assert results[r] == n_cases, r
        assert "disagree on the plan" in results[(r, "mismatch")], (r, results[(r, "mismatch")])


def _mismatch_worker(rank, world, init, results):
    """Ranks that disagree (plan, kernel size, channel count) all raise the same ValueError before any row moves,
    and the group stays usable; a rank that never calls makes the others fail after the group's timeout."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: dist.new_group(list(range(cp))) for cp in (2, 3)}
        short = {cp: dist.new_group(list(range(cp)), timeout=datetime.timedelta(seconds=3)) for cp in (2, 3)}
        for cp in (2, 3):
            if rank >= cp:
                continue
            group = groups[cp]
            same = packcuda.shard_plan([0, 10, 23], cp, rank)
            scenarios = {
                "plan": (packcuda.shard_plan([0, 10, 16 + 4 * rank], cp, rank), 4, 4),
                "kernel_size": (same, 2 + rank, 4),
                "C": (same, 3, 5 if rank == cp - 1 else 4),
            }
            for what, (plan, K, C) in scenarios.items():
                x = torch.randn(plan.total_local, C, dtype=torch.float64)
                try:
                    packcuda.conv_prefix(x, plan, K, group)
                    results[(cp, what, rank)] = "accepted"
                except ValueError as e:
                    results[(cp, what, rank)] = str(e)
            # the group is still usable, and a good call gives the right rows
            x = torch.randn(same.total_local, 4, dtype=torch.float64)
            p = packcuda.conv_prefix(x, same, 3, group)
            results[(cp, "good", rank)] = tuple(p.shape)
            # a rank that never calls: the others raise once the group's timeout has passed
            lonely = packcuda.shard_plan([0, 12], cp, rank)
            if rank != cp - 1:
                import time

                t0 = time.monotonic()
                try:
                    packcuda.conv_prefix(torch.randn(lonely.total_local, 2), lonely, 3, short[cp])
                    results[(cp, "absent", rank)] = "accepted"
                except RuntimeError as e:
                    results[(cp, "absent", rank)] = (str(e), time.monotonic() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_conv_prefix_mismatch_gloo(tmp_path):
    """cp = 2 and 3 over gloo: different plans, different kernel sizes, one rank with another channel count:
    every rank raises the same ValueError naming conv_prefix and what differs (no hang, no abort); a rank that
    does not call makes the others raise after the process group's timeout."""
    world = 3
    results = spawn_ranks(_mismatch_worker, world, tmp_path)
    res = dict(results)
    words = {"plan": "the plan (cu_seqlens", "kernel_size": "kernel_size per rank is", "C": "channel count"}
    for cp in (2, 3):
        for what, word in words.items():
            msgs = {res[(cp, what, r)] for r in range(cp)}
            assert len(msgs) == 1, (cp, what, msgs)  # the same error on every rank
            msg = msgs.pop()
            assert msg.startswith("packcuda.conv_prefix: the ranks of the group disagree") and word in msg, msg
        assert all(res[(cp, "good", r)] == res[(cp, "good", 0)] for r in range(cp))
        for r in range(cp - 1):
            msg, waited = res[(cp, "absent", r)]
            assert "packcuda.conv_prefix: group: not every rank" in msg and waited < 60, (msg, waited)
    assert res[(3, "kernel_size", 0)].count("[2, 3, 4]") == 1


def _simulate_schedules(cp, layout, K, lens, bucket=None, C=2, seed=0):
    """Builds every rank's schedule, runs the exchange (forward and backward) by hand and compares it with the
    plain definition: prefix row j of piece k is the row at padded offset o-(K-1)+j of the piece's sequence
    (zero before its start); the gradient of a row is the sum of every prefix slot that copied it."""
    g = torch.Generator().manual_seed(seed)
    cu = cumulative(lens)
    plans = [packcuda.shard_plan(cu, cp, r, layout=layout, bucket=bucket) for r in range(cp)]
    scheds = [packcuda.conv_prefix_schedule(p, K) for p in plans]
    assert packcuda.conv_prefix_schedule(plans[0], K) is scheds[0]  # cached on the plan
    W = K - 1
    X = torch.randn(plans[0].total_padded, C, generator=g, dtype=torch.float64)
    rows = [ref.local_padded_rows(p) for p in plans]
    xs = [X[r] for r in rows]
    # plain definition: global padded row of every prefix slot (-1: zero row)
    src_rows = []
    for pl in plans:
        sr = []
        for k in range(len(pl.pieces_host) - 1):
            start = pl.cu_seqlens_padded_host[pl.piece_seq_host[k]]
            for j in range(W):
                o = pl.piece_offset_host[k] - W + j
                empty = pl.pieces_host[k + 1] == pl.pieces_host[k]
                sr.append(start + o if o >= 0 and not empty else -1)
        src_rows.append(sr)
    Gs = [torch.randn(len(sr), C, generator=g, dtype=torch.float64) for sr in src_rows]
    dX = torch.zeros_like(X)
    for sr, G in zip(src_rows, Gs):
        for i, r in enumerate(sr):
            if r >= 0:
                dX[r] += G[i]
    for q in range(cp):
        recv, brecv = [], []
        for p in range(cp):
            assert scheds[p].send_counts[q] == scheds[q].recv_counts[p]
            off = sum(scheds[p].send_counts[:q])
            recv.append(xs[p][scheds[p].send_index[off:off + scheds[p].send_counts[q]]])
            boff = sum(scheds[p].recv_counts[:q])
            brecv.append(Gs[p][scheds[p].bwd_send_index[boff:boff + scheds[p].recv_counts[q]]])
        got = torch.ops.packcuda.exchange_gather_sum(xs[q], torch.cat(recv), scheds[q].unpack[:, None])
        want = torch.stack([X[r] if r >= 0 else torch.zeros(C, dtype=X.dtype) for r in src_rows[q]]) \
            if src_rows[q] else got[:0]
        assert torch.equal(got, want), ("forward", cp, layout, K, lens, bucket, q)
        dx = torch.ops.packcuda.exchange_gather_sum(Gs[q], torch.cat(brecv), scheds[q].bwd_unpack)
        assert torch.allclose(dx, dX[rows[q]], atol=1e-12), ("backward", cp, layout, K, lens, bucket, q)


def test_conv_prefix_schedule_single_process():
    """The schedules of all ranks are consistent: what rank p sends to q is what q expects from p, and the
    exchange simulated by hand reproduces the unsharded prefix rows and their gradients."""
    for cp, layout, K, lens in [(2, "zigzag", 4, [3, 1, 40, 0, 7]), (4, "zigzag", 3, [1, 2, 3]),
                                (3, "contiguous", 4, [2, 30, 1, 1, 9])]:
        _simulate_schedules(cp, layout, K, lens)


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(0, 25), min_size=0, max_size=7),
    cp=st.integers(1, 4),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    K=st.integers(1, 8),
    bucket_units=st.one_of(st.none(), st.integers(1, 3)),
    seed=st.integers(0, 2**16),
)
def test_conv_prefix_schedule_hypothesis(lens, cp, layout, K, bucket_units, seed):
    """conv_prefix_schedule against the plain definition of the prefix rows (forward) and of their gradient
    sums (backward), every rank's schedule exchanged by hand."""
    bucket = None if bucket_units is None else bucket_units * (2 * cp if layout == "zigzag" else 8)
    _simulate_schedules(cp, layout, K, lens, bucket, seed=seed)


def _first_rows(index, counts):
    """Per peer: the first row when the peer's rows of index (grouped by peer) are consecutive, else -1."""
    out, o = [], 0
    for c in counts:
        seg = index[o:o + c].tolist()
        o += c
        out.append(seg[0] if c > 0 and seg == list(range(seg[0], seg[0] + c)) else -1)
    return out


@pytest.mark.parametrize("cp,layout,K,lens", [(2, "zigzag", 4, [10, 23]), (3, "contiguous", 3, [5, 40, 2, 17]),
                                              (4, "zigzag", 8, [64, 3, 30]), (2, "contiguous", 2, [1, 1, 9])])
def test_schedule_send_first(cp, layout, K, lens):
    """The schedule's send_first / bwd_send_first: per peer, the first row of a consecutive run of sent rows."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for rank in range(cp):
        s = packcuda.conv_prefix_schedule(packcuda.shard_plan(cu, cp, rank, layout=layout), K)
        assert s.send_first == _first_rows(s.send_index, s.send_counts)
        assert s.bwd_send_first == _first_rows(s.bwd_send_index, s.recv_counts)


def test_schedule_on_device_spellings():
    """ConvPrefixSchedule.on takes a device or its spelling; an index-less "cuda" is the current device, so
    every spelling of one device shares one upload."""
    sched = packcuda.conv_prefix_schedule(packcuda.shard_plan([0, 10, 23], 2, 1), 3)
    a = sched.on("cpu")
    assert sched.on(torch.device("cpu")) is a and torch.equal(a[0], sched.send_index)
    if HAS_CUDA:
        b = sched.on("cuda")
        assert sched.on(torch.device("cuda", torch.cuda.current_device())) is b
        assert b[0].device == torch.device("cuda", torch.cuda.current_device())


def test_bad_conv_prefix_arguments(tmp_path):
    import torch.distributed as dist

    plan = packcuda.shard_plan([0, 10], 2, 0)
    with pytest.raises(ValueError, match=r"packcuda.conv_prefix: kernel_size=0 is out of range \[1, 8\]"):
        packcuda.conv_prefix(torch.randn(plan.total_local, 2), plan, 0)
    with pytest.raises(ValueError, match=r"x_local must be \[T_local, C\] with T_local = 6"):
        packcuda.conv_prefix(torch.randn(5, 2), plan, 4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="plan is for rank 0 of 2 but this process is rank 0 of 1"):
            packcuda.conv_prefix(torch.randn(plan.total_local, 2), plan, 4)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="zigzag align must be a multiple of 2\\*cp_size=4, got 3"):
        torch.ops.packcuda.conv_prefix_schedule(torch.tensor([0, 5]), 2, 0, "zigzag", 3, None, 4)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp_size=2\), got 2"):
        torch.ops.packcuda.conv_prefix_schedule(torch.tensor([0, 5]), 2, 2, "zigzag", 4, None, 4)


def test_bad_prepared_exchange():
    """The prepared exchange (the NCCL path's per-call op) checks its arguments when it is prepared."""
    ops = torch.ops.packcuda
    idx, unpack = torch.zeros(0, dtype=torch.int64), torch.zeros(4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="send_index must be a CUDA tensor"):
        ops.exchange_prepare(idx, [0, 0], [0, 0], [-1, -1], unpack, 1, 0, 8, [2, 2])
    with pytest.raises(ValueError, match="exchange_release: unknown handle 123456"):
        ops.exchange_release(123456)  # a handle never issued
    if HAS_CUDA:
        idx, unpack = idx.cuda(), unpack.cuda()
        with pytest.raises(ValueError, match="send_counts, recv_counts and send_first must have cp entries"):
            ops.exchange_prepare(idx, [0, 0], [0, 0], [-1], unpack, 1, 0, 8, [2, 2])
        with pytest.raises(ValueError, match="out_lead 2 dims hold 6 rows but unpack_index has 4"):
            ops.exchange_prepare(idx, [0, 0], [0, 0], [-1, -1], unpack, 1, 0, 8, [2, 3])
        with pytest.raises(ValueError, match="runs past the 8 source rows"):
            ops.exchange_prepare(torch.zeros(3, dtype=torch.int64, device="cuda"), [0, 3], [0, 0], [0, 6],
                                      unpack, 1, 0, 8, [2, 2])
        with pytest.raises(ValueError, match="unknown or released handle"):
            ops.exchange_run(torch.zeros(8, 2, device="cuda"), 987654, [8])


def test_prepared_exchange_fake_kernel():
    """The fake kernel of exchange_run (what torch.compile traces): [*out_lead, C] from the arguments."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10, 16, device="cuda", dtype=torch.bfloat16)
        out = torch.ops.packcuda.exchange_run(x, -7, [3, 2])  # -7: never a real handle
        assert out.shape == (3, 2, 16) and out.dtype == x.dtype and out.device == x.device


@requires_cuda
@pytest.mark.skipif(not (HAS_CUDA and bool(torch.ops.packcuda.exchange_nccl_available())), reason="built without NCCL")
def test_prepared_exchange_one_rank():
    """One GPU, a one-rank communicator: the prepared exchange's unpack of local rows and zero rows, the output
    shape, the row-count check and release."""
    ops = torch.ops.packcuda
    comm = ops.exchange_nccl_comm_init(ops.exchange_nccl_unique_id(), 1, 0, torch.cuda.current_device())
    x = torch.randn(8, 5, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor([3, -1, 0, 7, 7, -1], device="cuda")
    from packcuda.exchange import _release as _release_exchanges

    h = ops.exchange_prepare(torch.zeros(0, dtype=torch.int64, device="cuda"), [0], [0], [-1], rows[:, None],
                                  comm, 0, 8, [2, 3])
    try:
        out = ops.exchange_run(x, h, [2, 3])
        want = torch.where(rows[:, None] >= 0, x[rows.clamp(min=0)], torch.zeros_like(x[:1]))
        assert out.shape == (2, 3, 5) and torch.equal(out.view(6, 5), want)
        assert torch.equal(ops.exchange_run(x.view(2, 4, 5), h, [2, 3]), out)  # any [..., C] holding 8 rows
        with pytest.raises(ValueError, match="src has 7 rows but the exchange was prepared for 8"):
            ops.exchange_run(x[:7], h, [2, 3])
        with pytest.raises(ValueError, match=r"out_lead \[3, 2\] is not the prepared exchange's \[2, 3\]"):
            ops.exchange_run(x, h, [3, 2])
        # schema, fake kernel (the output shape from out_lead) and the compiled-graph path
        torch.library.opcheck(ops.exchange_run.default, (x, h, [2, 3]))
        torch.library.opcheck(ops.exchange_run.default, (x.float().view(4, 2, 5), h, [2, 3]))
    finally:
        _release_exchanges(h)
    with pytest.raises(ValueError, match="unknown or released handle"):
        ops.exchange_run(x, h, [2, 3])


# ------------------------------------------------------------------------------------ two GPUs, NCCL
def _nccl_worker(rank, world, init, results):
    import torch.distributed as dist

    with nccl_rank(rank, world, init) as dev:
        n = 0
        for ci, (cp, layout, K, name, lens, bucket, act) in enumerate(_exchange_cases()):
            if cp != world:
                continue
            plan = packcuda.shard_plan(cumulative(lens), cp, rank, layout=layout, bucket=bucket, device=dev)
            X, w, b, G, yr, dXr, dwr, dbr = _unsharded_case(plan, ci, 5, K, act)
            rows = ref.local_padded_rows(plan)
            for backend in ("nccl", "torch"):
                xl = X[rows].to(dev).requires_grad_()
                wl, bl = w.to(dev).requires_grad_(), b.to(dev).requires_grad_()
                y = packcuda.causal_conv1d(xl, wl, bl, cu_seqlens=plan.pieces,
                                           prefix=packcuda.conv_prefix(xl, plan, K, backend=backend), activation=act)
                what = f"{backend} {layout} K={K} {name} rank={rank}"
                assert torch.allclose(y.cpu(), yr.detach()[rows], atol=1e-12, rtol=1e-10), what
                dx, dw, db = torch.autograd.grad(y, (xl, wl, bl), G[rows].to(dev))
                assert torch.allclose(dx.cpu(), dXr[rows], atol=1e-12, rtol=1e-10), what
                dist.all_reduce(dw)
                dist.all_reduce(db)
                assert torch.allclose(dw.cpu(), dwr, atol=1e-10) and torch.allclose(db.cpu(), dbr, atol=1e-10), what
                n += 1
        # no host sync on the NCCL path (host metadata, cached schedule), forward and backward
        plan = packcuda.shard_plan(cumulative([300, 7, 1, 2, 900]), world, rank, device=dev)
        x = torch.randn(plan.total_local, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(256, 4, device=dev, dtype=torch.bfloat16, requires_grad=True)

        def step():
            p = packcuda.conv_prefix(x, plan, 4)
            y = packcuda.causal_conv1d(x, w, cu_seqlens=plan.pieces, prefix=p, activation="silu")
            y.backward(torch.ones_like(y))

        step()
        with no_sync():
            step()
        # CUDA graph: capture exchange + conv once, replay with new inputs
        xs = torch.randn(plan.total_local, 256, device=dev)
        ws = torch.randn(256, 4, device=dev)
        eager = lambda: packcuda.causal_conv1d(  # noqa: E731
            xs, ws, cu_seqlens=plan.pieces, prefix=packcuda.conv_prefix(xs, plan, 4, backend="nccl"))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()  # warm-up: communicator, peer connections, cached schedule tensors
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = eager()
        for _ in range(3):
            xs.copy_(torch.randn_like(xs))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y_static, eager()), "graph replay differs from eager"
        results[rank] = n


@requires_two_gpus_nccl
@pytest.mark.spawns
def test_conv_prefix_nccl_two_gpus(tmp_path):
    """cp=2 over NCCL: both the raw-NCCL path and the torch.distributed path equal the unsharded conv (outputs
    and gradients); the NCCL path does not sync; exchange + conv capture into a CUDA graph and replay."""
    results = spawn_ranks(_nccl_worker, 2, tmp_path)
    assert results == {0: 48, 1: 48}
