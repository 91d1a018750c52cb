"""The row exchange (packcuda/exchange.py, csrc/exchange): schedules from moves against the plain definition of a
move, the local / gloo paths of exchange_rows and the static move (values, gradients, dtypes, trailing shapes),
the agreement check of exchange_rows and of plan.gather (every rank raises the same error), and on one GPU the
NCCL path with its CUDA-graph capture."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, capture_cuda_graph, no_sync, requires_cuda, spawn_ranks
from packcuda import exchange as ex

ops = torch.ops.packcuda


# ---------------------------------------------------------------------------------------------------
# the plain definition of a move
# ---------------------------------------------------------------------------------------------------
def _random_moves(cp, n_src, n_out, density, rng):
    """Every slot of every rank gets a source with probability `density` (a random row of a random rank); a row
    may feed several slots. Returns the global move list (src_rank, src_row, dst_rank, dst_slot), shuffled."""
    moves = []
    for q in range(cp):
        for j in range(n_out[q]):
            if rng.random() < density:
                p = rng.randrange(cp)
                if n_src[p]:
                    moves.append((p, rng.randrange(n_src[p]), q, j))
    rng.shuffle(moves)
    return moves


def _reference(moves, xs, gs, n_out):
    """Outputs (rank q's slot j = the source row, zero without one) and source gradients (the sum of the slots
    each row fed) by the definition, in float64."""
    outs = [torch.zeros(n_out[q], *xs[0].shape[1:], dtype=torch.float64) for q in range(len(xs))]
    dxs = [torch.zeros(x.shape, dtype=torch.float64) for x in xs]
    for p, r, q, j in moves:
        outs[q][j] = xs[p][r].double()
        dxs[p][r] += gs[q][j].double()
    return outs, dxs


def _columns(moves):
    return [[m[k] for m in moves] for k in range(4)]


def _simulate(cp, moves, xs, gs, n_src, n_out):
    """Every rank's schedule and the move run by hand (reference.exchange_by_hand)."""
    cols = _columns(moves)
    return ref.exchange_by_hand([ex.RowSchedule.from_moves(cp, r, n_src[r], n_out[r], *cols) for r in range(cp)],
                                xs, gs)


@settings(max_examples=120, deadline=None)
@given(cp=st.integers(1, 6), seed=st.integers(0, 2**16), density=st.sampled_from([0.0, 0.3, 1.0]))
def test_schedule_from_moves_matches_definition(cp, seed, density):
    """Random moves (several slots per source row, slots without a source, ranks with empty buffers), given in a
    random order: every rank's schedule, run by hand, gives the definition's outputs and gradients; the rows each
    rank sends to itself are never in its send list."""
    rng = random.Random(seed)
    n_src = [rng.randint(0, 7) for _ in range(cp)]
    n_out = [rng.randint(0, 7) for _ in range(cp)]
    moves = _random_moves(cp, n_src, n_out, density, rng)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in n_src]
    gs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in n_out]
    outs, dxs = _simulate(cp, moves, xs, gs, n_src, n_out)
    want_out, want_dx = _reference(moves, xs, gs, n_out)
    for q in range(cp):
        assert torch.equal(outs[q], want_out[q]), q
        assert torch.allclose(dxs[q], want_dx[q], atol=1e-12), q
        s = ex.RowSchedule.from_moves(cp, q, n_src[q], n_out[q], *_columns(moves))
        assert s.send_counts[q] == 0 and s.recv_counts[q] == 0  # own rows are copied, never sent


def test_schedule_is_canonical_and_send_first():
    """The same moves in any order give the same schedule; send_first names a consecutive run of sent rows."""
    rng = random.Random(3)
    cp, n = 3, [6, 5, 7]
    moves = _random_moves(cp, n, n, 1.0, rng)
    for r in range(cp):
        a = ex.RowSchedule.from_moves(cp, r, n[r], n[r], *_columns(moves))
        b = ex.RowSchedule.from_moves(cp, r, n[r], n[r], *_columns(sorted(moves)))
        for name in ("send_index", "unpack", "bwd_send_index", "bwd_unpack"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.send_counts == b.send_counts and a.send_first == b.send_first
    # rank 0 sends rows 2, 3, 4 to rank 1 (slots 0..2): one consecutive run
    s = ex.RowSchedule.from_moves(2, 0, 5, 0, [0, 0, 0], [2, 3, 4], [1, 1, 1], [0, 1, 2])
    assert s.send_first == [-1, 2] and s.send_index.tolist() == [2, 3, 4]
    s = ex.RowSchedule.from_moves(2, 0, 5, 0, [0, 0], [4, 2], [1, 1], [0, 1])
    assert s.send_first == [-1, -1]


def test_bad_moves_refused():
    with pytest.raises(ValueError, match="slot 1 of rank 0 is filled by two moves"):
        ex.RowSchedule.from_moves(2, 0, 3, 2, [0, 1], [0, 0], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="reads src_row 3 of this rank's source, which has n_src=3 rows"):
        ex.RowSchedule.from_moves(2, 0, 3, 2, [0], [3], [1], [0])
    with pytest.raises(ValueError, match=r"ranks must be in \[0, cp=2\)"):
        ex.RowSchedule.from_moves(2, 0, 3, 2, [0], [0], [2], [0])
    # moves between other ranks are not this rank's business
    s = ex.RowSchedule.from_moves(3, 0, 1, 1, [1, 2], [5, 9], [2, 1], [7, 3])
    assert s.send_counts == [0, 0, 0] and s.unpack.tolist() == [-1]


# ---------------------------------------------------------------------------------------------------
# one rank: the local path (no group)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int32, torch.bool, torch.uint8, torch.complex64])
@pytest.mark.parametrize("trail", [(), (3,), (2, 5)])
def test_local_any_dtype_and_shape(device, dtype, trail):
    """cp = 1: a gather of the rank's own rows for any dtype and trailing shape (bitwise), zero rows for slots
    without a source."""
    n_src, n_out = 6, 9
    rng = random.Random(len(trail))
    moves = _random_moves(1, [n_src], [n_out], 0.7, rng)
    s = ex.RowSchedule.from_moves(1, 0, n_src, n_out, *_columns(moves))
    x = (torch.randn(n_src, *trail, dtype=torch.float64) * 50).to(dtype).to(device)
    out = ex.exchange_rows(x, s)
    want = torch.zeros(n_out, *trail, dtype=dtype)
    for _, r, _, j in moves:
        want[j] = x[r].cpu()
    assert out.dtype == dtype and out.shape == (n_out, *trail) and torch.equal(out.cpu(), want)


def test_local_gradient_is_reverse_move(device):
    """The backward sums, per source row, the gradients of the slots it fed, in a fixed order (bitwise
    repeatable), and equals the definition."""
    rng = random.Random(11)
    n_src, n_out = 5, 12
    moves = _random_moves(1, [n_src], [n_out], 1.0, rng)
    s = ex.RowSchedule.from_moves(1, 0, n_src, n_out, *_columns(moves))
    x = torch.randn(n_src, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    g = torch.randn(n_out, 2, 3, dtype=torch.float64, device=device)
    dx = torch.autograd.grad(ex.exchange_rows(x, s), x, g)[0]
    _, want = _reference(moves, [x.detach().cpu()], [g.cpu()], [n_out])
    assert torch.allclose(dx.cpu(), want[0], atol=1e-12)
    assert torch.equal(torch.autograd.grad(ex.exchange_rows(x, s), x, g)[0], dx)
    torch.autograd.gradcheck(lambda t: ex.exchange_rows(t, s), (x,))


def test_gather_sum_copies_one_source_bitwise(device):
    """exchange_gather_sum with one source per row is a copy of the bits (-0.0 and NaN payloads kept, any row
    dtype); with several it sums in fp32 in the given order."""
    a = torch.tensor([[-0.0, float("nan")], [1.5, -2.0]], device=device)
    b = torch.tensor([[7.0, 8.0]], device=device)
    out = ops.exchange_gather_sum(a, b, torch.tensor([[0], [2], [-1]], device=device))
    assert torch.equal(out.view(torch.int32).cpu(), torch.stack([a[0], b[0], torch.zeros(2, device=device)])
                       .view(torch.int32).cpu())
    ints = torch.arange(12, dtype=torch.int64, device=device).view(6, 2)
    got = ops.exchange_gather_sum(ints, ints[:1], torch.tensor([[5], [6], [-1]], device=device))
    assert got.tolist() == [[10, 11], [0, 1], [0, 0]]
    s = ops.exchange_gather_sum(a[1:], b, torch.tensor([[0, 1, -1]], device=device))
    assert s.tolist() == [[8.5, 6.0]]


# ---------------------------------------------------------------------------------------------------
# several ranks over gloo
# ---------------------------------------------------------------------------------------------------
def _case(cp, seed):
    rng = random.Random(seed)
    n_src = [rng.randint(0, 9) for _ in range(cp)]
    n_out = [rng.randint(0, 9) for _ in range(cp)]
    moves = _random_moves(cp, n_src, n_out, 0.8, rng)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 2, 3, generator=g, dtype=torch.float64) for n in n_src]
    gs = [torch.randn(n, 2, 3, generator=g, dtype=torch.float64) for n in n_out]
    return n_src, n_out, moves, xs, gs


def _gloo_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in (2, 3)}
        n = 0
        for cp in (2, 3):
            if rank >= cp:
                continue
            for seed in range(4):
                n_src, n_out, moves, xs, gs = _case(cp, seed)
                s = ex.RowSchedule.from_moves(cp, rank, n_src[rank], n_out[rank], *_columns(moves))
                want_out, want_dx = _reference(moves, xs, gs, n_out)
                x = xs[rank].clone().requires_grad_()
                out = ex.exchange_rows(x, s, groups[cp], op="test_move", fingerprint=seed)
                assert torch.equal(out, want_out[rank]), (cp, seed, rank)
                dx = torch.autograd.grad(out, x, gs[rank])[0]
                assert torch.allclose(dx, want_dx[rank], atol=1e-12), (cp, seed, rank)
                # another dtype and shape through the same schedule (rows travel as bytes)
                xi = (xs[rank][:, 0, 0] * 100).to(torch.int64)
                oi = ex.exchange_rows(xi, s, groups[cp], op="test_move", fingerprint=seed)
                assert torch.equal(oi, (want_out[rank][:, 0, 0] * 100).to(torch.int64)), (cp, seed, rank)
                n += 1
        # disagreement: the same error on every rank of the group, before any row moves
        group = groups[2]
        if rank < 2:
            n_src, n_out, moves, xs, gs = _case(2, 0)
            s = ex.RowSchedule.from_moves(2, rank, n_src[rank], n_out[rank], *_columns(moves))
            for what, kw, x in (("fingerprint", dict(fingerprint=rank), xs[rank]),
                                ("dtype", dict(fingerprint=7), xs[rank].to(torch.float32 if rank else torch.float64)),
                                ("fields", dict(fingerprint=[ex.Field("kernel_size", 3 + rank)]), xs[rank])):
                try:
                    ex.exchange_rows(x, s, group, op="test_move", **kw)
                    results[(what, rank)] = "accepted"
                except ValueError as e:
                    results[(what, rank)] = str(e)
            # schedules that do not fit together: rank 0 sends rank 1 one row, rank 1 expects two
            mv = [(0, 0, 1, 0)] if rank == 0 else [(0, 0, 1, 0), (0, 1, 1, 1)]
            s2 = ex.RowSchedule.from_moves(2, rank, 2, 2, *_columns(mv))
            try:
                ex.exchange_rows(torch.zeros(2, 1), s2, group, op="test_move")
                results[("fit", rank)] = "accepted"
            except ValueError as e:
                results[("fit", rank)] = str(e)
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_exchange_rows_gloo(tmp_path):
    """cp 2 and 3 over gloo (subgroups of one 3-process job): random moves, values and gradients equal the
    definition (float64 [n, 2, 3] and int64 [n] through one schedule); ranks that disagree on the caller's
    fingerprint, the dtype or a field, and schedules that do not fit together, raise the same ValueError on every
    rank."""
    results = spawn_ranks(_gloo_worker, 3, tmp_path)
    assert [results[r] for r in range(3)] == [8, 8, 4]
    words = {"fingerprint": "the purpose of the exchange (test_move) differs between ranks",
             "dtype": "x.dtype per rank is ['float64', 'float32']", "fields": "kernel_size per rank is [3, 4]",
             "fit": "the schedules do not fit together"}
    for what, word in words.items():
        msgs = {results[(what, r)] for r in range(2)}
        assert len(msgs) == 1, (what, msgs)
        msg = msgs.pop()
        assert msg.startswith("packcuda.test_move: the ranks of the group disagree") and word in msg, msg


# ---------------------------------------------------------------------------------------------------
# plan.gather: the agreement check (plans of one batch, rows of one shape)
# ---------------------------------------------------------------------------------------------------
def _gather_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cases = {
            # equal local sizes, different batches: silently wrong rows without the check
            "same_sizes": [0, 10, 20] if rank == 0 else [0, 12, 20],
            # different local sizes: gloo aborted the process without the check
            "other_sizes": [0, 10, 20 + 4 * rank],
        }
        for what, cu in cases.items():
            plan = packcuda.shard_plan(cu, world, rank)
            try:
                plan.gather(torch.randn(plan.total_local, 2))
                results[(what, rank)] = "accepted"
            except ValueError as e:
                results[(what, rank)] = str(e)
        plan = packcuda.shard_plan([0, 10, 20], world, rank)
        try:  # rows of another shape on one rank
            plan.gather(torch.randn(plan.total_local, 2 + (rank == 1)))
            results[("row_shape", rank)] = "accepted"
        except ValueError as e:
            results[("row_shape", rank)] = str(e)
        x = torch.arange(20.0)[:, None]
        results[("good", rank)] = torch.equal(plan.gather(plan.shard(x)), x)
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_gather_refuses_mismatched_plans_gloo(tmp_path):
    """plan.gather with plans of different batches (equal or different local sizes) or rows of different shapes:
    every rank raises the same ValueError naming ShardPlan.gather (no wrong rows, no abort); matching plans
    gather."""
    world = 3
    results = spawn_ranks(_gather_worker, world, tmp_path)
    words = {"same_sizes": "the plan (cu_seqlens / cp_size / layout / align / bucket) differs between ranks",
             "other_sizes": "the plan (cu_seqlens", "row_shape": "x_local.shape[1:] per rank is [2, 3, 2]"}
    for what, word in words.items():
        msgs = {results[(what, r)] for r in range(world)}
        assert len(msgs) == 1, (what, msgs)
        msg = msgs.pop()
        assert msg.startswith("packcuda.ShardPlan.gather: the ranks of the group disagree") and word in msg, msg
    assert all(results[("good", r)] for r in range(world))


# ---------------------------------------------------------------------------------------------------
# the static move
# ---------------------------------------------------------------------------------------------------
def _static_tables(cp, seed):
    """Random static tables of every rank for a move with block B: each rank's output slots take rows from random
    peers (a random row of the peer's source), the send / unpack / bwd tables as exchange_static.h defines them."""
    rng = random.Random(seed)
    n_src, n_out, B = 5, 4, 4
    send = [[-1] * (cp * B) for _ in range(cp)]
    unpack = [[-1] * n_out for _ in range(cp)]
    feeds = [[[] for _ in range(n_src)] for _ in range(cp)]  # per source row: returned-buffer rows
    moves = []
    for q in range(cp):
        for j in range(n_out):
            if rng.random() < 0.8:
                p, r = rng.randrange(cp), rng.randrange(n_src)
                send[p][q * B + j] = r
                unpack[q][j] = p * B + j
                feeds[p][r].append(q * B + j)
                moves.append((p, r, q, j))
    M = max(1, max(len(f) for fs in feeds for f in fs))
    bwd = [[f + [-1] * (M - len(f)) for f in fs] for fs in feeds]
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return [ex.StaticRowSchedule(cp, r, n_src, n_out, t(send[r]), t(unpack[r]), t(bwd[r])) for r in range(cp)], moves


def test_static_local_matches_definition():
    """The local part of a static move: the rows a rank holds itself, zero elsewhere; its gradient the sum of the
    own slots each row fed."""
    for seed in range(6):
        scheds, moves = _static_tables(3, seed)
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(5, 2, generator=g, dtype=torch.float64) for _ in range(3)]
        gs = [torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(3)]
        for r in range(3):
            own = [m for m in moves if m[0] == r and m[2] == r]
            x = xs[r].clone().requires_grad_()
            out = ex.exchange_rows_static(x, scheds[r], local=True)
            want_out, want_dx = _reference([(0, mr, 0, mj) for _, mr, _, mj in own], [xs[r]], [gs[r]], [4])
            assert torch.equal(out, want_out[0]), (seed, r)
            dx = torch.autograd.grad(out, x, gs[r])[0]
            assert torch.allclose(dx, want_dx[0], atol=1e-12), (seed, r)


def _static_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for seed in range(3):
            scheds, moves = _static_tables(world, seed)
            g = torch.Generator().manual_seed(seed)
            xs = [torch.randn(5, 2, generator=g, dtype=torch.float64) for _ in range(world)]
            gs = [torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(world)]
            want_out, want_dx = _reference(moves, xs, gs, [4] * world)
            x = xs[rank].clone().requires_grad_()
            out = ex.exchange_rows_static(x, scheds[rank], dist.group.WORLD)
            assert torch.equal(out, want_out[rank]), (seed, rank)
            dx = torch.autograd.grad(out, x, gs[rank])[0]
            assert torch.allclose(dx, want_dx[rank], atol=1e-12), (seed, rank)
        results[rank] = True
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_static_move_gloo(tmp_path):
    """The fixed-size move over gloo (cp = 3): values and gradients equal the definition."""
    assert spawn_ranks(_static_worker, 3, tmp_path) == {0: True, 1: True, 2: True}


def test_opcheck(device):
    from torch.library import opcheck

    a = torch.randn(5, 3, device=device)
    b = torch.randn(2, 3, device=device)
    opcheck(ops.exchange_gather_sum.default, (a, b, torch.tensor([[0, 6], [-1, 2]], device=device)))
    opcheck(ops.exchange_gather_sum.default, (a.long(), b.long(), torch.tensor([[6], [-1]], device=device)))


# ---------------------------------------------------------------------------------------------------
# one GPU: the NCCL path
# ---------------------------------------------------------------------------------------------------
def _nccl_world_one(tmp_path):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)


@requires_cuda
@pytest.mark.skipif(not (HAS_CUDA and bool(torch.ops.packcuda.exchange_nccl_available())), reason="built without NCCL")
def test_nccl_path_one_rank_graph(tmp_path):
    """cp = 1 with backend='nccl' (a one-rank NCCL group): the prepared move (pack-free, unpack of local rows and
    zero rows) equals the local path, values and gradients, for bf16 and int64; no host sync after the first
    call; the move captures into a CUDA graph and replays for new inputs."""
    import torch.distributed as dist

    _nccl_world_one(tmp_path)
    try:
        rng = random.Random(5)
        moves = _random_moves(1, [300], [500], 0.9, rng)
        s = ex.RowSchedule.from_moves(1, 0, 300, 500, *_columns(moves))
        x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(500, 64, device="cuda", dtype=torch.bfloat16)
        want = ex.exchange_rows(x, s)
        got = ex.exchange_rows(x, s, backend="nccl")
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
        xi = torch.randint(0, 100, (300, 3), device="cuda")
        assert torch.equal(ex.exchange_rows(xi, s, backend="nccl"), ex.exchange_rows(xi, s))
        with no_sync():
            y = ex.exchange_rows(x, s, backend="nccl")
            y.backward(g)
        xs = torch.randn(300, 64, device="cuda")
        graph, out = capture_cuda_graph(lambda: ex.exchange_rows(xs, s, backend="nccl"))
        for _ in range(3):
            xs.copy_(torch.randn_like(xs))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ex.exchange_rows(xs, s))
    finally:
        dist.destroy_process_group()


@requires_cuda
def test_static_move_in_graph(tmp_path):
    """The static move on one GPU: the local part and (over a one-rank NCCL group) the all-to-all path capture
    into a CUDA graph and replay for new inputs without a sync, equal to eager."""
    import torch.distributed as dist

    scheds, _ = _static_tables(1, 4)
    s = scheds[0]
    s = ex.StaticRowSchedule(1, 0, s.n_src, s.n_out, s.send.cuda(), s.unpack.cuda(), s.bwd.cuda())
    xs = torch.randn(5, 16, device="cuda")
    graph, out = capture_cuda_graph(lambda: ex.exchange_rows_static(xs, s, local=True))
    xs.copy_(torch.randn_like(xs))
    with no_sync():
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ex.exchange_rows_static(xs, s, local=True))
    _nccl_world_one(tmp_path)
    try:
        graph, out = capture_cuda_graph(lambda: ex.exchange_rows_static(xs, s, dist.group.WORLD))
        xs.copy_(torch.randn_like(xs))
        with no_sync():
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ex.exchange_rows_static(xs, s, local=True))
    finally:
        dist.destroy_process_group()
