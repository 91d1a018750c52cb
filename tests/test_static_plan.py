"""Static-shape shard plans built on the device (packcuda.static_shard_plan): equal to the host plan with
bucket=capacity on every slot the host plan has, all-pad with a status on overflow, capturable in one CUDA
graph (plan -> shard ids/positions/labels -> apply_rope -> conv prefix -> causal_conv1d -> unshard) and
compiled once by torch.compile(dynamic=False) for every batch of one capacity."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
from helpers import HAS_CUDA, nccl_rank, no_sync, requires_two_gpus_nccl, spawn_ranks
from packcuda._meta import cu_from_lengths as _cu

ops = torch.ops.packcuda


def _unit(layout, cp, align):
    """What capacity must be a multiple of."""
    return align if layout == "zigzag" else cp


def _needed(lens, layout, cp, align):
    """Padded total the batch needs (rounded up to the capacity unit, at least one unit)."""
    seq_total = sum(-(-n // align) * align for n in lens)
    u = _unit(layout, cp, align)
    return max(u, -(-seq_total // u) * u)


def _static_cu(lens, max_seqs, dtype=torch.int64, junk=False, device="cpu", g=None):
    """cu_seqlens of max_seqs + 1 entries: the batch, then repeats of the total (or junk, which is never read)."""
    cu = _cu(lens)
    tail = max_seqs + 1 - len(cu)
    if junk:
        extra = torch.randint(-5, 10**6, (tail,), generator=g).tolist()
    else:
        extra = [cu[-1]] * tail
    return torch.tensor(cu + extra, dtype=dtype, device=device)


def _build(lens, max_seqs, cp, rank, layout, align, capacity, device="cpu", dtype=torch.int64,
           num_seqs_tensor=False, junk=False, g=None):
    cu = _static_cu(lens, max_seqs, dtype, junk, device, g)
    n = torch.tensor(len(lens), dtype=dtype, device=device) if num_seqs_tensor else len(lens)
    return packcuda.static_shard_plan(cu, n, cp, rank, capacity=capacity, max_seqs=max_seqs, layout=layout,
                                      align=align)


def _assert_matches_host(s, lens, cp, rank, layout, align, capacity):
    """The static plan equals the host plan with bucket=capacity on what the host plan has; the rest is
    padding (empty pieces, trailing repeats)."""
    cu = _cu(lens)
    h = packcuda.shard_plan(cu, cp, rank, layout=layout, align=align, bucket=capacity, device=s.device)
    tl = h.total_local
    S = s.piece_offset.shape[0]
    M = s.max_seqs
    assert s.total_local == capacity // cp and s.index.shape == (capacity // cp,)
    assert s.cu_seqlens_padded.shape == (M + 2,) and s.cu_seqlens_local.shape == (M + 2,)
    assert S == (2 * (M + 1) if layout == "zigzag" else M + 1) and s.pieces.shape == (S + 1,)
    for name in ("index", "position_ids", "label_index"):
        assert torch.equal(getattr(s, name)[:tl], getattr(h, name)), name
    assert bool((s.index[tl:] == -1).all()) and bool((s.label_index[tl:] == -1).all())
    for name in ("cu_seqlens_padded", "cu_seqlens_local", "pieces", "piece_offset", "piece_seq"):
        hv = getattr(h, name)
        sv = getattr(s, name)
        assert sv.dtype == hv.dtype, name
        assert torch.equal(sv[:hv.shape[0]], hv), (name, sv, hv)
    n_seg = len(h.cu_seqlens_padded_host)
    assert bool((s.cu_seqlens_padded[n_seg:] == capacity).all())
    assert bool((s.cu_seqlens_local[n_seg:] == capacity // cp).all())
    if h.total_padded == capacity:  # (an empty batch has no host slots; the static plan is one pad segment)
        n_p = len(h.piece_offset_host)
        assert bool((s.pieces[n_p:] == capacity // cp).all())  # extra pieces are empty, at the end
    assert s.cu_seqlens.tolist() == cu + [cu[-1]] * (M + 1 - len(cu))
    assert s.status.tolist() == [0, len(lens), h.total_padded - h.pad_size, -1]
    # the unshard index: the host plan's on the real tokens, -1 past them
    T = cu[-1]
    ui = s.unshard_index
    assert ui.shape == (capacity,)
    if T:
        assert torch.equal(ui[:T], h.unshard_index)
    assert bool((ui[T:] == -1).all())
    s.check()
    return h


def _assert_all_pad(s, cp, rank, layout, align, capacity):
    """A refused batch: every slot padding, one pad segment covering the stream."""
    assert bool((s.index == -1).all()) and bool((s.label_index == -1).all())
    M = s.max_seqs
    assert s.cu_seqlens_padded.tolist() == [0] + [capacity] * (M + 1)
    assert s.cu_seqlens.tolist() == [0] * (M + 1)
    full = packcuda.shard_plan([0, capacity], cp, rank, layout=layout, device=s.device)  # one segment, unpadded
    assert torch.equal(s.position_ids, full.position_ids)
    assert bool((s.unshard_index == -1).all())
    with pytest.raises(ValueError, match="StaticShardPlan.check"):
        s.check()


_lens = st.lists(st.one_of(st.just(0), st.integers(1, 40)), min_size=0, max_size=8)


@settings(max_examples=250, deadline=None)
@given(
    lens=_lens,
    slack=st.integers(0, 3),
    cp=st.integers(1, 16),
    rank_frac=st.floats(0, 0.999),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    align_mult=st.sampled_from([None, 1, 2, 3]),
    edge=st.sampled_from(["full", "slack", "short"]),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    num_seqs_tensor=st.booleans(),
    junk=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_static_plan_matches_host_plan(lens, slack, cp, rank_frac, layout, align_mult, edge, dtype, num_seqs_tensor,
                                       junk, seed):
    g = torch.Generator().manual_seed(seed)
    rank = int(rank_frac * cp)
    base = 2 * cp if layout == "zigzag" else 1
    align = None if align_mult is None else base * align_mult
    a = base if align is None else align
    u = _unit(layout, cp, a)
    need = _needed(lens, layout, cp, a)
    capacity = {"full": need, "slack": need + u * (1 + seed % 3), "short": need - u}[edge]
    max_seqs = max(1, len(lens) + slack)
    if capacity < 1:
        return
    s = _build(lens, max_seqs, cp, rank, layout, align, capacity, dtype=dtype, num_seqs_tensor=num_seqs_tensor,
               junk=junk, g=g)
    seq_total = sum(-(-n // a) * a for n in lens)
    if seq_total > capacity:
        assert s.status.tolist()[0] == 1 and s.status.tolist()[2] == seq_total
        _assert_all_pad(s, cp, rank, layout, a, capacity)
    else:
        _assert_matches_host(s, lens, cp, rank, layout, a, capacity)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_edges(device, layout):
    cp = 4
    a = 2 * cp if layout == "zigzag" else 1
    # exactly full, num_seqs == max_seqs, empty sequences in the middle and at the ends
    lens = [0, 5, 0, 8, 3, 0]
    cap = _needed(lens, layout, cp, a)
    for rank in range(cp):
        _assert_matches_host(_build(lens, len(lens), cp, rank, layout, None, cap, device), lens, cp, rank, layout,
                             a, cap)
    # no sequence at all / only empty sequences: every slot is padding, status clear
    for lens0 in ([], [0, 0]):
        s = _build(lens0, 3, cp, 1, layout, None, 16, device)
        assert s.status.tolist() == [0, len(lens0), 0, -1] and bool((s.index == -1).all())
        assert s.cu_seqlens_padded.tolist() == [0] * (len(lens0) + 1) + [16] * (4 - len(lens0))
        s.check()
    # one row over capacity
    s = _build([cap + 1], 2, cp, 0, layout, None, cap, device)
    assert s.status.tolist()[0] == 1
    _assert_all_pad(s, cp, 0, layout, a, cap)


def test_status_flags(device):
    cap, M = 32, 4
    mk = lambda cu, n: packcuda.static_shard_plan(torch.tensor(cu, device=device), n, 2, 0,  # noqa: E731
                                                  capacity=cap, max_seqs=M)
    s = mk([0, 5, 3, 9, 9], 3)
    assert s.status.tolist() == [4, 3, s.status.tolist()[2], 2]
    with pytest.raises(ValueError, match=r"decreases at entry 2"):
        s.check()
    s = mk([1, 5, 9, 9, 9], 2)
    assert s.status.tolist()[0] == 4 and s.status.tolist()[3] == 0
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] is not 0"):
        s.check()
    s = mk([0, 5, 9, 9, 9], torch.tensor(5, device=device))
    assert s.status.tolist()[:2] == [2, 5]
    with pytest.raises(ValueError, match=r"num_seqs=5 is outside \[0, max_seqs=4\]"):
        s.check()
    s = mk([0, 5, 9, 9, 9], torch.tensor(-1, device=device))
    assert s.status.tolist()[:2] == [2, -1]
    _assert_all_pad(s, 2, 0, "zigzag", 4, cap)
    s = mk([0, 2**40, 2**41, 2**62, 2**62], 4)  # huge lengths: saturated, no overflow
    assert s.status.tolist()[0] == 1 and s.status.tolist()[2] >= 2**31
    with pytest.raises(ValueError, match=r"exceeds capacity=32"):
        s.check()
    s = mk([0, 2**40, 2**41, 2**62, 2**62], 3)
    _assert_all_pad(s, 2, 0, "zigzag", 4, cap)


def test_data_path_matches_host_plan(device):
    """shard / labels / shard_positions / unshard of capacity-sized inputs agree with the host plan on the
    batch's real tokens."""
    g = torch.Generator().manual_seed(3)
    lens = [7, 0, 13, 1, 20]
    cu = _cu(lens)
    T, cp, M = cu[-1], 3, 8
    cap = _needed(lens, "zigzag", cp, 6) + 12
    ids = torch.randint(0, 1000, (cap,), generator=g).to(device)
    pos = torch.randint(0, 50, (3, cap), generator=g).to(device)
    x = torch.randn(cap, 4, generator=g).to(device)
    statics, hosts = [], []
    for r in range(cp):
        s = _build(lens, M, cp, r, "zigzag", None, cap, device)
        h = packcuda.shard_plan(cu, cp, r, bucket=cap, device=device)
        assert torch.equal(s.shard(x, fill=2.0), h.shard(x[:T], fill=2.0))
        assert torch.equal(s.labels(ids), h.labels(ids[:T]))
        assert torch.equal(s.shard_positions(pos), h.shard_positions(pos[:, :T]))
        statics.append(s.shard(x))
        hosts.append(s)
    out = hosts[0].unshard(torch.stack(statics))
    assert out.shape == (cap, 4) and torch.equal(out[:T], x[:T]) and bool((out[T:] == 0).all())
    # differentiable: the gradient of shard reaches the real rows only
    xg = x.clone().requires_grad_()
    hosts[1].shard(xg).sum().backward()
    want = torch.zeros(cap, 4, device=device)
    idx = hosts[1].index[hosts[1].index >= 0]
    want[idx] = 1
    assert torch.equal(xg.grad, want)


def test_host_accessors_refused():
    s = _build([3, 4], 3, 2, 0, "zigzag", None, 16)
    for name in ("pad_size", "cu_seqlens_host", "cu_seqlens_padded_host", "cu_seqlens_local_host", "pieces_host",
                 "piece_offset_host", "piece_seq_host"):
        with pytest.raises(ValueError, match=f"StaticShardPlan.{name}"):
            getattr(s, name)
    assert s.max_seqlen_local == 8 and s.max_seqlen_padded == 16 and s.total == 16
    assert "StaticShardPlan(" in repr(s)
    with pytest.raises(ValueError, match="conv_prefix_schedule"):
        packcuda.conv_prefix_schedule(s, 4)


# ---------------------------------------------------------------------------------------------------
# conv prefix
# ---------------------------------------------------------------------------------------------------
def _owner(layout, cu_padded, cp, total_local, seg, o):
    begin = cu_padded[seg]
    if layout == "contiguous":
        gl = begin + o
        return gl // total_local, gl % total_local
    h = (cu_padded[seg + 1] - begin) // (2 * cp)
    c = o // h
    r = c if c < cp else 2 * cp - 1 - c
    return r, begin // cp + (0 if c < cp else h) + (o - c * h)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_local_conv_prefix(device, layout, cp):
    g = torch.Generator().manual_seed(11 + cp)
    lens = [1, 9, 0, 17, 4, 30, 2, 1]
    M, K, C = 10, 4, 3
    a = 2 * cp if layout == "zigzag" else 1
    cap = _needed(lens, layout, cp, a) + _unit(layout, cp, a)
    x = torch.randn(cap, C, generator=g, dtype=torch.float64).to(device)
    plans = [_build(lens, M, cp, r, layout, None, cap, device) for r in range(cp)]
    xl = [p.shard(x) for p in plans]
    for r, p in enumerate(plans):
        got = p.local_conv_prefix(xl[r], K)
        S = p.piece_offset.shape[0]
        assert got.shape == (S, K - 1, C)
        cp_host, off, seq = p.cu_seqlens_padded.tolist(), p.piece_offset.tolist(), p.piece_seq.tolist()
        src = torch.full((S, K - 1), -1, dtype=torch.int64)
        for k in range(S):
            for j in range(K - 1):
                o = off[k] - (K - 1) + j
                if o < 0 or o >= cp_host[seq[k] + 1] - cp_host[seq[k]]:
                    continue
                owner, slot = _owner(layout, cp_host, cp, p.total_local, seq[k], o)
                if owner == r:
                    src[k, j] = slot
        src = src.to(device)
        want = torch.where((src >= 0)[..., None], xl[r][src.clamp(min=0)], 0.0)
        assert torch.equal(got, want)
        # backward: rows read by several prefix slots (pieces shorter than K-1) sum their gradients
        xg = xl[r].clone().requires_grad_()
        G = torch.randn(got.shape, generator=g, dtype=torch.float64).to(device)
        gx = torch.autograd.grad(p.local_conv_prefix(xg, K), xg, G)[0]
        gw = torch.autograd.grad(torch.where((src >= 0)[..., None], xg[src.clamp(min=0)], 0.0), xg, G)[0]
        assert torch.allclose(gx, gw, atol=1e-12, rtol=0)
    if cp == 1:
        # the whole prefix: the sharded conv equals the unsharded one on the real tokens, values and gradients
        p = plans[0]
        w = torch.randn(C, K, generator=g, dtype=torch.float64).to(device).requires_grad_()
        xr = x.clone().requires_grad_()
        xs = p.shard(xr)
        y = packcuda.causal_conv1d(xs, w, cu_seqlens=p.pieces, prefix=packcuda.conv_prefix(xs, p, K))
        out = p.unshard(y[None])
        T = _cu(lens)[-1]
        xr2 = x[:T].clone().requires_grad_()
        ref = packcuda.causal_conv1d(xr2, w, cu_seqlens=_cu(lens))
        assert torch.allclose(out[:T], ref, atol=1e-12)
        gy = torch.randn(cap, C, generator=g, dtype=torch.float64).to(device)
        gy[T:] = 0
        gx, gw = torch.autograd.grad(out, (xr, w), gy)
        gx2, gw2 = torch.autograd.grad(ref, (xr2, w), gy[:T])
        assert torch.allclose(gx[:T], gx2, atol=1e-12) and torch.allclose(gw, gw2, atol=1e-12)
    else:
        with pytest.raises(ValueError, match="conv_prefix: group: torch.distributed is not initialized"):
            packcuda.conv_prefix(xl[0], plans[0], K)  # the exchange needs the group (tests below)


# ---------------------------------------------------------------------------------------------------
# the whole step: plan -> shard ids/positions/labels -> apply_rope -> conv prefix -> causal_conv1d -> unshard
# ---------------------------------------------------------------------------------------------------
H, D, K = 2, 8, 4
VOCAB = 97


def _params(device):
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(VOCAB, H * D, generator=g).to(device)
    w = torch.randn(H * D, K, generator=g).to(device)
    return emb, w


def _tail(plan, ids, pos, emb, w, conv_cu, prefix_fn):
    """The data path after the plan: embedding of the local ids, 1D RoPE at the local positions, the
    varlen causal conv, unshard of the (single rank's) output, and the local labels."""
    local = plan.shard(ids)
    h = emb[local].view(-1, H, D)
    q, k = packcuda.apply_rope(h, h * 0.5, plan.shard_positions(pos), rope_theta=10000.0)
    xc = (q + k).reshape(-1, H * D).contiguous()
    y = packcuda.causal_conv1d(xc, w, cu_seqlens=conv_cu, prefix=prefix_fn(xc), activation="silu")
    return plan.unshard(y[None]), plan.labels(ids)


def _static_step(cu, n, ids, pos, emb, w, capacity, max_seqs):
    plan = packcuda.static_shard_plan(cu, n, 1, 0, capacity=capacity, max_seqs=max_seqs)
    out, labels = _tail(plan, ids, pos, emb, w, plan.pieces, lambda xc: packcuda.conv_prefix(xc, plan, K))
    return out, labels, plan.status


def _host_step(lens, ids, pos, emb, w, capacity, device):
    """The eager host-plan path: a plan per batch from host lengths (cp = 1: each local segment is the whole
    padded sequence, so the conv runs over cu_seqlens_local without a prefix)."""
    cu = _cu(lens)
    plan = packcuda.shard_plan(cu, 1, 0, bucket=capacity, device=device)
    T = cu[-1]
    return _tail(plan, ids[:T], pos[:T], emb, w, plan.cu_seqlens_local, lambda xc: None)


def _batches(capacity, max_seqs, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < count:
        n = int(torch.randint(1, max_seqs + 1, (1,), generator=g))
        lens = torch.randint(0, capacity // 4, (n,), generator=g).tolist()
        if sum(lens) > 0 and _needed(lens, "zigzag", 1, 2) <= capacity:
            out.append(lens)
    return out


def _check_step(got, lens, ids, pos, emb, w, capacity, device):
    out, labels, status = got
    want_out, want_labels = _host_step(lens, ids, pos, emb, w, capacity, device)
    T = sum(lens)
    assert status.tolist()[0] == 0
    assert torch.allclose(out[:T], want_out, atol=1e-5, rtol=1e-5)
    assert bool((out[T:] == 0).all())
    assert torch.equal(labels[:want_labels.shape[0]], want_labels)


def _inputs(lens, capacity, max_seqs, device, g):
    """Device inputs of one batch: cu_seqlens [max_seqs+1], num_seqs (0-dim), input_ids and position ids
    [capacity] (each sequence's positions from 0; rows past the real tokens are junk the plan never reads)."""
    cu = _static_cu(lens, max_seqs, device=device)
    ids = torch.randint(0, VOCAB, (capacity,), generator=g).to(device)
    pos = torch.randint(0, 5, (capacity,), generator=g)
    pos[:sum(lens)] = packcuda.position_ids(_cu(lens))
    return cu, torch.tensor(len(lens), device=device), ids, pos.to(device)


def test_step_matches_host_path(device):
    emb, w = _params(device)
    cap, M = 256, 12
    g = torch.Generator().manual_seed(1)
    for lens in _batches(cap, M, 5):
        cu, n, ids, pos = _inputs(lens, cap, M, device, g)
        _check_step(_static_step(cu, n, ids, pos, emb, w, cap, M), lens, ids, pos, emb, w, cap, device)


def test_compile_once(device):
    """torch.compile(fullgraph=True, dynamic=False) of the whole step compiles once for every batch."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    emb, w = _params(device)
    cap, M = 128, 6
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")
    step = torch.compile(lambda cu, n, ids, pos: _static_step(cu, n, ids, pos, emb, w, cap, M), fullgraph=True,
                         dynamic=False, backend=cnt)
    g = torch.Generator().manual_seed(2)
    for lens in _batches(cap, M, 5, seed=4):
        cu, n, ids, pos = _inputs(lens, cap, M, device, g)
        _check_step(step(cu, n, ids, pos), lens, ids, pos, emb, w, cap, device)
    assert cnt.frame_count == 1


# ---------------------------------------------------------------------------------------------------
# CUDA: no sync, one graph for every batch
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
def test_cuda_matches_host_plan_and_cpu():
    g = torch.Generator().manual_seed(9)
    for trial in range(60):
        layout = ("zigzag", "contiguous")[trial % 2]
        cp = 1 + trial % 16
        a = 2 * cp if layout == "zigzag" else 1
        n = int(torch.randint(0, 40, (1,), generator=g))
        lens = torch.randint(0, 300, (n,), generator=g).tolist()
        lens = [0 if i % 7 == 3 else v for i, v in enumerate(lens)]
        u = _unit(layout, cp, a)
        cap = _needed(lens, layout, cp, a) + u * (trial % 3) - (u if trial % 5 == 0 else 0)
        if cap < 1:
            continue
        M = n + trial % 3 or 1
        rank = trial % cp
        dev = _build(lens, M, cp, rank, layout, None, cap, "cuda", num_seqs_tensor=trial % 2 == 0)
        cpu = _build(lens, M, cp, rank, layout, None, cap, "cpu")
        for name in ("index", "position_ids", "label_index", "cu_seqlens_padded", "cu_seqlens_local", "pieces",
                     "piece_offset", "piece_seq", "cu_seqlens", "status", "unshard_index"):
            assert torch.equal(getattr(dev, name).cpu(), getattr(cpu, name)), name
        if sum(-(-v // a) * a for v in lens) <= cap:
            _assert_matches_host(dev, lens, cp, rank, layout, a, cap)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
def test_cuda_no_sync():
    emb, w = _params("cuda")
    cap, M = 512, 16
    g = torch.Generator().manual_seed(3)
    lens = _batches(cap, M, 1)[0]
    cu, n, ids, pos = _inputs(lens, cap, M, "cuda", g)
    _static_step(cu, n, ids, pos, emb, w, cap, M)  # warm-up (lazy inits outside the checked region)
    with no_sync():
        for layout in ("zigzag", "contiguous"):
            plan = packcuda.static_shard_plan(cu, n, 8, 3, capacity=cap, max_seqs=M, layout=layout)
            plan.shard(ids), plan.labels(ids), plan.shard_positions(ids), plan.unshard_index
            plan.local_conv_prefix(torch.randn(plan.total_local, 4, device="cuda"), 4)
        out = _static_step(cu, n, ids, pos, emb, w, cap, M)
    _check_step(out, lens, ids, pos, emb, w, cap, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
def test_cuda_graph_whole_step():
    """One capture of plan build -> shard ids/positions/labels -> apply_rope -> conv prefix -> causal_conv1d
    -> unshard, replayed for several batches of one capacity (different lengths and counts), each equal to the
    eager host-plan path."""
    emb, w = _params("cuda")
    cap, M = 1024, 24
    g = torch.Generator().manual_seed(8)
    batches = _batches(cap, M, 7, seed=8)
    cu_buf, n_buf, ids_buf, pos_buf = _inputs(batches[0], cap, M, "cuda", g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _static_step(cu_buf, n_buf, ids_buf, pos_buf, emb, w, cap, M)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _static_step(cu_buf, n_buf, ids_buf, pos_buf, emb, w, cap, M)
    for lens in batches:
        cu, n, ids, pos = _inputs(lens, cap, M, "cuda", g)
        with no_sync():
            cu_buf.copy_(cu)
            n_buf.copy_(n)
            ids_buf.copy_(ids)
            pos_buf.copy_(pos)
            graph.replay()
        torch.cuda.synchronize()
        _check_step(got, lens, ids_buf, pos_buf, emb, w, cap, "cuda")
    # a batch over capacity: the replay gives all-pad outputs and a set status
    big = [cap + 1]
    cu_buf.copy_(_static_cu(big, M, device="cuda"))
    n_buf.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    out, labels, status = got
    assert status.tolist()[0] == 1 and bool((out == 0).all()) and bool((labels == -100).all())


# ---------------------------------------------------------------------------------------------------
# conv prefix exchange between ranks (gloo, CPU): equal to the host plan's exchange
# ---------------------------------------------------------------------------------------------------
def _exchange_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in (2, 3, 4)}
        n = 0
        batches = {"mixed": [13, 1, 0, 40, 7, 22], "short": [1, 2, 3, 1, 2], "one": [61]}
        for cp in (2, 3, 4):
            for layout in ("zigzag", "contiguous"):
                for K in (2, 4):
                    for name, lens in batches.items():
                        if rank >= cp:
                            continue
                        group = groups[cp]
                        a = 2 * cp if layout == "zigzag" else 1
                        cap = _needed(lens, layout, cp, a) + _unit(layout, cp, a)
                        M = len(lens) + 2
                        g = torch.Generator().manual_seed(cp * 100 + K * 10 + len(name))
                        X = torch.randn(cap, 3, generator=g, dtype=torch.float64)
                        s = _build(lens, M, cp, rank, layout, None, cap)
                        h = packcuda.shard_plan(_cu(lens), cp, rank, layout=layout, bucket=cap)
                        xs = s.shard(X).requires_grad_()
                        xh = h.shard(X[:sum(lens)]).requires_grad_()
                        ps = packcuda.conv_prefix(xs, s, K, group)
                        ph = packcuda.conv_prefix(xh, h, K, group, backend="torch")
                        nh = ph.shape[0]
                        what = f"cp={cp} {layout} K={K} {name} rank={rank}"
                        assert torch.equal(ps[:nh], ph), what
                        assert bool((ps[nh:] == 0).all()), what
                        # the local part: this rank's own rows, zero elsewhere
                        loc = s.local_conv_prefix(xs, K)
                        assert bool(((loc == ps) | (loc == 0)).all()), what
                        G = torch.randn(ps.shape, generator=g, dtype=torch.float64)
                        G[nh:] = 0
                        gs = torch.autograd.grad(ps, xs, G)[0]
                        gh = torch.autograd.grad(ph, xh, G[:nh])[0]
                        assert torch.allclose(gs, gh, atol=1e-12, rtol=0), what
                        gs2 = torch.autograd.grad(packcuda.conv_prefix(xs, s, K, group), xs, G)[0]
                        assert torch.equal(gs, gs2), what  # deterministic
                        n += 1
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_conv_prefix_exchange_gloo(tmp_path):
    """cp in {2, 3, 4} (subgroups of one 4-process gloo job), both layouts, K in {2, 4}, sequences shorter than
    2*cp*(K-1): the static plan's fixed-size exchange gives the host plan's prefix (values and gradients)."""
    world = 4
    results = spawn_ranks(_exchange_worker, world, tmp_path)
    assert results == {r: sum(12 for cp in (2, 3, 4) if r < cp) for r in range(world)}


def _nccl_exchange_worker(rank, world, init, results):
    with nccl_rank(rank, world, init) as dev:
        n = 0
        for layout in ("zigzag", "contiguous"):
            for lens in ([13, 1, 0, 40, 7, 22], [1, 2, 3, 1, 2], [61]):
                a = 2 * world if layout == "zigzag" else 1
                cap = _needed(lens, layout, world, a) + _unit(layout, world, a)
                M = len(lens) + 2
                X = torch.randn(cap, 8, generator=torch.Generator().manual_seed(len(lens)), dtype=torch.float64)
                X = X.to(dev)
                s = _build(lens, M, world, rank, layout, None, cap, dev)
                h = packcuda.shard_plan(_cu(lens), world, rank, layout=layout, bucket=cap, device=dev)
                xs = s.shard(X).requires_grad_()
                xh = h.shard(X[:sum(lens)]).requires_grad_()
                ps, ph = packcuda.conv_prefix(xs, s, 4), packcuda.conv_prefix(xh, h, 4, backend="torch")
                nh = ph.shape[0]
                assert torch.equal(ps[:nh], ph) and bool((ps[nh:] == 0).all()), (layout, lens, rank)
                G = torch.randn(ps.shape, device=dev, dtype=torch.float64)
                G[nh:] = 0
                gs = torch.autograd.grad(ps, xs, G)[0]
                gh = torch.autograd.grad(ph, xh, G[:nh])[0]
                assert torch.allclose(gs, gh, atol=1e-12, rtol=0), (layout, lens, rank)
                n += 1
        # one CUDA graph: plan build -> shard -> exchange -> conv, replayed for new batches, no sync
        cap, M = 4096, 16
        cu_buf = _static_cu([100, 3, 700], M, device=dev)
        n_buf = torch.tensor(3, device=dev)
        x_buf = torch.randn(cap, 64, device=dev)
        w = torch.randn(64, 4, device=dev)

        def step():
            p = packcuda.static_shard_plan(cu_buf, n_buf, world, rank, capacity=cap, max_seqs=M)
            xl = p.shard(x_buf)
            y = packcuda.causal_conv1d(xl, w, cu_seqlens=p.pieces, prefix=packcuda.conv_prefix(xl, p, 4))
            return y, p

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        with no_sync():
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static, _ = step()
        for lens in ([5, 900, 33], [1] * 16, [2000, 1500]):
            cu_buf.copy_(_static_cu(lens, M, device=dev))
            n_buf.fill_(len(lens))
            x_buf.copy_(torch.randn_like(x_buf))
            graph.replay()
            torch.cuda.synchronize()
            y_eager, p = step()
            p.check()
            assert torch.equal(y_static, y_eager), lens
        results[rank] = n


@requires_two_gpus_nccl
@pytest.mark.spawns
def test_conv_prefix_exchange_nccl_two_gpus(tmp_path):
    """cp=2 over NCCL: the static exchange equals the host plan's (values, gradients); plan build, shard, the
    exchange and the conv capture into one CUDA graph and replay for new batches without a sync."""
    results = spawn_ranks(_nccl_exchange_worker, 2, tmp_path)
    assert results == {0: 6, 1: 6}


def test_opcheck(device):
    """Schemas, fake kernels (static shapes) and the autograd registration of the static raw ops."""
    from torch.library import opcheck

    cu = _static_cu([3, 0, 9], 5, torch.int32, device=device)
    for layout, align in (("zigzag", 4), ("contiguous", 1)):
        for n in (None, torch.tensor(3, device=device)):
            opcheck(ops.static_shard_plan.default, (cu, n, 3, 2, 1, layout, align, 32, 5))
        s = _build([3, 0, 9], 5, 2, 1, layout, align, 32, device)
        opcheck(ops.shard_static_unshard_index.default, (s.cu_seqlens, s.cu_seqlens_padded, 2, layout, 32))
        opcheck(ops.conv_static_prefix_tables.default,
                (s.pieces, s.piece_offset, s.piece_seq, s.cu_seqlens_padded, 2, 1, layout, 32, 3))
