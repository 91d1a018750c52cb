"""The layout bridge (packcuda/relayout.py): zigzag <-> contiguous moves of one batch's rows between CP ranks.

References: each rank's rows of a plan are the plan's rows of the global padded stream (reference.local_padded_rows,
built from the plan's pieces): relayout must give exactly dst_plan's rows of that stream, bitwise, and its
gradient the reverse move. Every rank's schedule is also run by hand in one process for cp 1-8; over gloo the
real move runs for cp 2-8 (subgroups of one 8-process job)."""
import importlib
import random

import pytest
import torch

import packcuda
import reference as ref
from helpers import HAS_CUDA, capture_cuda_graph, no_sync, requires_cuda, spawn_ranks

rl = importlib.import_module("packcuda.relayout")  # the module (packcuda.relayout is the function)

ops = torch.ops.packcuda


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _batches(cp):
    """name -> (lens, bucket): random lengths, a bucket pad segment, empty sequences, sequences shorter than
    2*cp, one long sequence, an empty batch."""
    rng = random.Random(cp)
    return {
        "random": ([rng.randint(0, 40) for _ in range(6)], None),
        "bucket": ([rng.randint(1, 30) for _ in range(4)], 2 * cp * 9),
        "empty_seqs": ([0, 5, 0, 0, 9, 0], None),
        "short": ([1, 2, 1, 3, 1, 1][:max(2, cp - 1)], None),
        "long": ([157], None),
        "nothing": ([0, 0], None),
    }


def _simulate(plans_src, plans_dst, X):
    """Every rank's relayout schedule run by hand (reference.exchange_by_hand): rank q's rows of the dst layout."""
    xs = [X[ref.local_padded_rows(p)] for p in plans_src]
    return ref.exchange_by_hand([rl._schedule(s, d) for s, d in zip(plans_src, plans_dst)], xs)[0]


@pytest.mark.parametrize("cp", range(1, 9))
def test_schedules_by_hand(cp):
    """cp 1-8, every batch shape, both directions: each rank receives exactly dst_plan's rows of the global padded
    stream; every row is sent at most once and only to another rank; the reverse move is a copy (bwd_m = 1)."""
    for name, (lens, bucket) in _batches(cp).items():
        pairs = [packcuda.hybrid_plans(_cu(lens), cp, r, bucket=bucket) for r in range(cp)]
        zz, ct = [p[0] for p in pairs], [p[1] for p in pairs]
        X = torch.randn(zz[0].total_padded, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(cp))
        for src, dst in ((zz, ct), (ct, zz)):
            outs = _simulate(src, dst, X)
            for q in range(cp):
                assert torch.equal(outs[q], X[ref.local_padded_rows(dst[q])]), (cp, name, q, src[0].layout)
                s = rl._schedule(src[q], dst[q])
                assert s.send_counts[q] == 0 and s.bwd_unpack.shape[1] == 1, (cp, name, q)
                assert sorted(s.send_index.tolist()) == sorted(set(s.send_index.tolist()))


def test_hybrid_plans():
    zz, ct = packcuda.hybrid_plans([0, 5, 12, 12, 30], 3, 1, bucket=36)
    assert (zz.layout, ct.layout) == ("zigzag", "contiguous") and zz.align == ct.align == 6
    assert zz.cu_seqlens_padded_host == ct.cu_seqlens_padded_host and zz.total_local == ct.total_local == 12
    with pytest.raises(ValueError, match="packcuda.hybrid_plans: zigzag bucket must be a multiple of align=6"):
        packcuda.hybrid_plans([0, 5], 3, 1, bucket=8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("trail", [(), (3,), (2, 4)])
def test_one_rank_without_group(device, dtype, trail):
    """cp = 1 (no group): the move is local; any dtype and trailing shape; the round trip is the identity."""
    zz, ct = packcuda.hybrid_plans([0, 5, 12, 12, 30], 1, 0, bucket=34, device=device)
    X = (torch.randn(zz.total_padded, *trail, dtype=torch.float64) * 9).to(dtype).to(device)
    xz = X[ref.local_padded_rows(zz).to(device)]
    y = packcuda.relayout(xz, zz, ct)
    assert y.dtype == dtype and torch.equal(y, X[ref.local_padded_rows(ct).to(device)])
    assert torch.equal(packcuda.relayout(y, ct, zz), xz)


def test_bad_pairs_refused():
    """Pairs that do not index one padded stream, or not for one rank, are refused naming relayout and the plans,
    before anything moves (no process group is needed to refuse)."""
    zz, ct = packcuda.hybrid_plans([0, 5, 12], 2, 0)
    x = torch.zeros(zz.total_local, 2)
    bad = {
        "other batch": (ct, packcuda.hybrid_plans([0, 5, 13], 2, 0)[1], "different batches"),
        "other align": (zz, packcuda.shard_plan([0, 5, 12], 2, 0, layout="contiguous"), "one padded stream"),
        "other rank": (zz, packcuda.hybrid_plans([0, 5, 12], 2, 1)[1], "for rank 0 of 2 but dst_plan for rank 1"),
        "other cp": (zz, packcuda.hybrid_plans([0, 5, 12], 4, 0)[1], "rank 0 of 2 but dst_plan for rank 0 of 4"),
    }
    for what, (src, dst, word) in bad.items():
        with pytest.raises(ValueError, match="packcuda.relayout: src_plan and dst_plan are no pair") as e:
            packcuda.relayout(torch.zeros(src.total_local, 2), src, dst)
        assert word in str(e.value), (what, str(e.value))
    s = packcuda.static_shard_plan(torch.tensor([0, 5, 12]), 2, 2, 0, capacity=16, max_seqs=2)
    with pytest.raises(ValueError, match="src_plan is a ShardPlan but dst_plan is a StaticShardPlan"):
        packcuda.relayout(x, zz, s)
    with pytest.raises(ValueError, match=r"x_local must be \[src_plan.total_local, ...\]"):
        packcuda.relayout(x[1:], zz, ct)
    with pytest.raises(ValueError, match="do not index one padded stream"):
        ops.relayout_schedule(torch.tensor([0, 5, 12]), 2, 0, "zigzag", 4, None, "contiguous", 1, None)


# ---------------------------------------------------------------------------------------------------
# several ranks over gloo
# ---------------------------------------------------------------------------------------------------
CPS = (2, 3, 4, 5, 6, 7, 8)
DTYPES = ((torch.bfloat16, (2, 4)), (torch.int64, ()), (torch.bool, (3,)), (torch.float32, (1,)))


def _static_pair(lens, cp, rank, cap, layout_first="zigzag"):
    cu = torch.tensor(_cu(lens) + [sum(lens)] * 2)
    M = len(lens) + 2
    mk = lambda layout: packcuda.static_shard_plan(cu, len(lens), cp, rank, capacity=cap, max_seqs=M,  # noqa: E731
                                                   layout=layout, align=2 * cp)
    return mk("zigzag"), mk("contiguous")


def _gloo_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in CPS}
        n = 0
        for cp in CPS:
            if rank >= cp:
                continue
            group = groups[cp]
            for bi, (name, (lens, bucket)) in enumerate(_batches(cp).items()):
                zz, ct = packcuda.hybrid_plans(_cu(lens), cp, rank, bucket=bucket)
                g = torch.Generator().manual_seed(cp * 100 + bi)
                X = torch.randn(zz.total_padded, 3, dtype=torch.float64, generator=g)
                G = torch.randn(zz.total_padded, 3, dtype=torch.float64, generator=g)
                for src, dst in ((zz, ct), (ct, zz)):
                    what = f"cp={cp} {name} {src.layout}->{dst.layout} rank={rank}"
                    rs, rd = ref.local_padded_rows(src), ref.local_padded_rows(dst)
                    x = X[rs].clone().requires_grad_()
                    y = packcuda.relayout(x, src, dst, group)
                    assert torch.equal(y, X[rd]), what
                    # gradient: the reverse move (bitwise: every row has one source)
                    assert torch.equal(torch.autograd.grad(y, x, G[rd])[0], G[rs]), what
                    # the round trip is the identity
                    assert torch.equal(packcuda.relayout(y.detach(), dst, src, group), X[rs]), what
                    n += 1
            # several dtypes and trailing shapes through one plan pair
            zz, ct = packcuda.hybrid_plans(_cu(_batches(cp)["random"][0]), cp, rank)
            for dtype, trail in DTYPES:
                X = (torch.randn(zz.total_padded, *trail, generator=torch.Generator().manual_seed(cp)) * 9).to(dtype)
                y = packcuda.relayout(X[ref.local_padded_rows(zz)], zz, ct, group)
                assert y.dtype == dtype and torch.equal(y, X[ref.local_padded_rows(ct)]), (cp, dtype)
            # static plans of one capacity: the fixed-size move equals the host plans' rows
            lens = _batches(cp)["random"][0]
            cap = zz.total_padded + 2 * cp * 3
            sz, sc = _static_pair(lens, cp, rank, cap)
            hz, hc = packcuda.hybrid_plans(_cu(lens), cp, rank, bucket=cap)
            X = torch.randn(cap, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
            for src, dst, hs, hd in ((sz, sc, hz, hc), (sc, sz, hc, hz)):
                x = X[ref.local_padded_rows(hs)].clone().requires_grad_()
                y = packcuda.relayout(x, src, dst, group)
                assert torch.equal(y, X[ref.local_padded_rows(hd)]), (cp, "static", src.layout)
                Gd = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(cp))
                Gs = torch.zeros(cap, 5, dtype=torch.float64)
                Gs[ref.local_padded_rows(hd)] = Gd
                dist.all_reduce(Gs, group=group)  # the global gradient of the padded stream
                assert torch.equal(torch.autograd.grad(y, x, Gd)[0], Gs[ref.local_padded_rows(hs)]), (cp, "static")
            # a pair that is no pair: refused on every rank, before anything moves
            other = packcuda.hybrid_plans(_cu(lens[:-1] + [lens[-1] + 1]), cp, rank)[1]
            try:
                packcuda.relayout(torch.zeros(zz.total_local, 2), zz, other, group)
                results[(cp, "bad_pair", rank)] = "accepted"
            except ValueError as e:
                results[(cp, "bad_pair", rank)] = str(e)
            # ranks holding plans of different batches with equal local sizes: the agreement check refuses
            az, ac = packcuda.hybrid_plans(_cu([2 * cp - rank % 2, 2 * cp]), cp, rank)
            try:
                packcuda.relayout(torch.zeros(az.total_local, 2), az, ac, group)
                results[(cp, "disagree", rank)] = "accepted"
            except ValueError as e:
                results[(cp, "disagree", rank)] = str(e)
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_relayout_gloo(tmp_path):
    """cp 2-8 over gloo (subgroups of one 8-process job), every batch shape (random lengths, a bucket segment,
    empty sequences, sequences shorter than 2*cp, one long sequence, an empty batch), both directions: each rank
    gets dst_plan's rows of the global padded stream, the gradient is the reverse move (bitwise), the round trip
    the identity; bf16 / int64 / bool / fp32 with several trailing shapes; static plans of one capacity; a bad pair
    refused with the same error on every rank, plans of different batches refused by the agreement check."""
    world = 8
    results = spawn_ranks(_gloo_worker, world, tmp_path)
    for r in range(world):
        assert results[r] == sum(2 * len(_batches(cp)) for cp in CPS if r < cp), r
    for cp in CPS:
        msgs = {results[(cp, "bad_pair", r)] for r in range(cp)}
        assert len(msgs) == 1, (cp, msgs)
        assert "packcuda.relayout: src_plan and dst_plan are no pair" in msgs.pop()
        got = {results[(cp, "disagree", r)] for r in range(cp)}
        assert len(got) == 1, (cp, got)
        msg = got.pop()
        assert msg.startswith("packcuda.relayout: the ranks of the group disagree") and "plan pair" in msg, msg


def _one_bad_pair_worker(rank, world, init, results):
    """Every rank calls relayout on the first use of its plan pair; only the last rank's pair is no pair (one
    kind per round). Records each rank's error and how long it took; then the good pair's calls, counting the
    agreement gathers."""
    import datetime
    import time

    import torch.distributed as dist

    ex = importlib.import_module("packcuda.exchange")
    # a short timeout: a rank left waiting in a collective fails the test instead of hanging it
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        cu, cp = _cu([5, 12, 3]), world
        bad_rank = world - 1
        for kind in ("other batch", "other padded stream", "other rank", "other cp", "static dst"):
            zz, ct = packcuda.hybrid_plans(cu, cp, rank)
            dst = ct
            if rank == bad_rank:
                dst = {
                    "other batch": lambda: packcuda.hybrid_plans(_cu([5, 12, 4]), cp, rank)[1],
                    "other padded stream": lambda: packcuda.shard_plan(cu, cp, rank, layout="contiguous",
                                                                       align=2 * cp, bucket=2 * cp * 9),
                    "other rank": lambda: packcuda.hybrid_plans(cu, cp, (rank + 1) % cp)[1],
                    "other cp": lambda: packcuda.hybrid_plans(cu, cp + 1, rank)[1],
                    "static dst": lambda: packcuda.static_shard_plan(torch.tensor(cu + [cu[-1]]), 3, cp, rank,
                                                                     capacity=48, max_seqs=4, layout="contiguous",
                                                                     align=2 * cp),
                }[kind]()
            t0 = time.monotonic()
            try:
                packcuda.relayout(torch.randn(zz.total_local, 3), zz, dst, dist.group.WORLD)
                results[(kind, rank)] = ("accepted", time.monotonic() - t0)
            except ValueError as e:
                results[(kind, rank)] = (str(e), time.monotonic() - t0)
        # the same (fresh) good pair on every rank afterwards: one agreement gather on the first call, none later
        zz, ct = packcuda.hybrid_plans(cu, cp, rank)
        gathers = []
        real = ex._gather_objects
        ex._gather_objects = lambda *a, **k: gathers.append(1) or real(*a, **k)
        try:
            X = torch.arange(zz.total_padded * 3, dtype=torch.float64).view(-1, 3)
            for _ in range(3):
                y = packcuda.relayout(X[ref.local_padded_rows(zz)], zz, ct)
                assert torch.equal(y, X[ref.local_padded_rows(ct)])
        finally:
            ex._gather_objects = real
        results[("gathers", rank)] = len(gathers)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.spawns
def test_one_rank_bad_pair_gloo(tmp_path, world):
    """Only the last rank of 2 / 3 (gloo) passes a pair that is no pair (plans of another batch, of another padded
    stream, for another rank, for another cp, a host src_plan with a static dst_plan) on the first call of the
    pair: every rank raises the same ValueError at once (well within the group's 20 s timeout: nobody waits in a
    collective), naming relayout, src_plan / dst_plan and the bad rank, with that rank's problem. A good pair
    afterwards moves the right rows with one agreement gather on its first call and none on later calls."""
    results = spawn_ranks(_one_bad_pair_worker, world, tmp_path)
    words = {"other batch": "different batches", "other padded stream": "do not index one padded stream",
             "other rank": f"src_plan is for rank {world - 1} of {world} but dst_plan for rank 0 of {world}",
             "other cp": f"rank {world - 1} of {world} but dst_plan for rank {world - 1} of {world + 1}",
             "static dst": "src_plan is a ShardPlan but dst_plan is a StaticShardPlan"}
    for kind, word in words.items():
        got = [results[(kind, r)] for r in range(world)]
        msgs = {m for m, _ in got}
        assert len(msgs) == 1, (kind, msgs)
        msg = msgs.pop()
        assert msg.startswith(f"packcuda.relayout: src_plan and dst_plan are no pair on rank {world - 1} of the "
                              f"group's {world}: "), (kind, msg)
        assert word in msg and "before any data moved" in msg, (kind, msg)
        assert max(t for _, t in got) < 10, (kind, got)
    assert [results[("gathers", r)] for r in range(world)] == [1] * world


# ---------------------------------------------------------------------------------------------------
# one GPU: the NCCL path and the static move in a CUDA graph
# ---------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.skipif(not (HAS_CUDA and bool(torch.ops.packcuda.exchange_nccl_available())), reason="built without NCCL")
def test_nccl_one_rank_graph(tmp_path):
    """cp = 1 over a one-rank NCCL group with backend='nccl': equal to the local move (values, gradients, bf16
    [T, 2, 64]); no sync after the first call; captured into a CUDA graph and replayed for new inputs."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        zz, ct = packcuda.hybrid_plans(_cu([700, 3, 0, 1300, 40]), 1, 0, bucket=2100, device="cuda")
        x = torch.randn(zz.total_local, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(ct.total_local, 2, 64, device="cuda", dtype=torch.bfloat16)
        want = packcuda.relayout(x, zz, ct)
        got = packcuda.relayout(x, zz, ct, backend="nccl")
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
        with no_sync():
            packcuda.relayout(x, zz, ct, backend="nccl").backward(g)
        xs = torch.randn(zz.total_local, 128, device="cuda")
        graph, out = capture_cuda_graph(lambda: packcuda.relayout(xs, zz, ct, backend="nccl"))
        for _ in range(3):
            xs.copy_(torch.randn_like(xs))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, packcuda.relayout(xs, zz, ct))
    finally:
        dist.destroy_process_group()


@requires_cuda
def test_static_relayout_in_graph():
    """Static plans on one GPU: plan build, relayout zigzag -> contiguous -> zigzag in one CUDA graph, replayed for
    new batches of one capacity without a sync, equal to the host plans' rows."""
    cap, M = 4096, 8
    cu_buf = torch.zeros(M + 1, dtype=torch.int64, device="cuda")
    n_buf = torch.tensor(0, device="cuda")
    x_buf = torch.randn(cap, 64, device="cuda")

    def step():
        z = packcuda.static_shard_plan(cu_buf, n_buf, 1, 0, capacity=cap, max_seqs=M, align=2)
        c = packcuda.static_shard_plan(cu_buf, n_buf, 1, 0, capacity=cap, max_seqs=M, align=2, layout="contiguous")
        xz = z.shard(x_buf)
        y = packcuda.relayout(xz, z, c)
        return y, packcuda.relayout(y, c, z), xz

    graph, (y, back, xz) = capture_cuda_graph(step)
    for lens in ([5, 900, 33], [1] * 8, [2000, 1500]):
        cu = _cu(lens)
        cu_buf.copy_(torch.tensor(cu + [cu[-1]] * (M + 1 - len(cu))))
        n_buf.fill_(len(lens))
        x_buf.copy_(torch.randn_like(x_buf))
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        hz, hc = packcuda.hybrid_plans(cu, 1, 0, bucket=cap, device="cuda")
        assert torch.equal(y, packcuda.relayout(hz.shard(x_buf[:cu[-1]]), hz, hc)), lens
        assert torch.equal(back, xz), lens
