"""Vision work under context parallelism (packcuda.vision): the plan (units, balance, local pixel rows and grids,
vision slots), the route's moves against the replicated path (every rank encodes everything and keeps its
slots), and the cost balance against the exact optimum."""
import random

import pytest
import torch

import packcuda
import reference as ref
from helpers import capture_cuda_graph, nccl_rank, no_sync, requires_cuda, spawn_ranks
from test_mrope_pos import IMG, VID, make_pack

MERGE = 2


# ---------------------------------------------------------------------------------------------- helpers
def fake_tower(pv, grid, merge=MERGE):
    """A stand-in for a Qwen-VL tower with its shape rules: merged token j of a temporal step of an h x w patch
    grid is the sum of its merge*merge consecutive patch rows plus a term of its block position; temporal steps
    are independent (so a video split by frame encodes as the whole one, bit for bit)."""
    out, r, m2 = [], 0, merge * merge
    for t, h, w in grid.tolist():
        hb, wb = h // merge, w // merge
        for _ in range(t):
            x = pv[r:r + h * w].reshape(hb, wb, m2, -1).sum(2)
            pos = 1000 * torch.arange(hb, dtype=pv.dtype)[:, None, None] + torch.arange(wb, dtype=pv.dtype)[:, None]
            out.append((x + pos).reshape(hb * wb, -1))
            r += h * w
    assert r == pv.shape[0], "the tower's pixel rows do not match its grid rows"
    return torch.cat(out) if out else pv.new_zeros(0, pv.shape[1])


def pixels(grids, g, D=3):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, D, generator=g, dtype=torch.float64) if n else None


def plans(p, cp, layout, unit, per_frame, bucket=None, cost=None):
    out = []
    for r in range(cp):
        plan = packcuda.shard_plan(p.cu, cp, r, layout=layout, bucket=bucket)
        vp = packcuda.vision_plan(torch.tensor(p.ids, dtype=torch.int64), p.cu, plan, image_grid_thw=p.images or None,
                                  video_grid_thw=p.videos or None, image_token_id=IMG, video_token_id=VID,
                                  spatial_merge_size=MERGE, video_frames="per_frame" if per_frame else "whole",
                                  unit=unit, cost=cost)
        out.append((plan, vp))
    return out


def simulate_route(vps, encoded):
    """Every rank's route output, assembled from its own moves and the encoding ranks' tower outputs; checks that
    the two ends of every move agree and that every output row is written exactly once."""
    cp = len(vps)
    seen = {}
    for r, vp in enumerate(vps):
        for s, sr, d, ds in zip(*(t.tolist() for t in vp.moves)):
            assert s == r or d == r
            key = (s, sr)
            assert seen.setdefault(key, (d, ds)) == (d, ds), "the ranks disagree on a move"
    out = []
    for d, vp in enumerate(vps):
        D = encoded[0].shape[1]
        routed = torch.full((vp.n_slots, D), float("nan"), dtype=torch.float64)
        hit = torch.zeros(vp.n_slots, dtype=torch.int64)
        for s, sr, dd, ds in zip(*(t.tolist() for t in vp.moves)):
            if dd == d:
                routed[ds] = encoded[s][sr]
                hit[ds] += 1
        assert bool((hit == 1).all()), "a route output row is written never or twice"
        out.append(routed)
    assert len(out) == cp
    return out


def check_pack(p, cp, layout, unit, per_frame, seed, bucket=None):
    """Route of the fake tower's outputs == the replicated path on every rank, bit for bit; returns the plans."""
    g = torch.Generator().manual_seed(seed)
    pv_img, pv_vid = pixels(p.images, g), pixels(p.videos, g)
    none = torch.zeros(0, 3, dtype=torch.float64)
    E_img = fake_tower(pv_img, torch.tensor(p.images).view(-1, 3)) if p.images else none
    E_vid = fake_tower(pv_vid, torch.tensor(p.videos).view(-1, 3)) if p.videos else none
    pl = plans(p, cp, layout, unit, per_frame, bucket)
    vps = [vp for _, vp in pl]
    encoded = []
    for vp in vps:
        if vp.n_units == 0:
            encoded.append(torch.zeros(0, 3, dtype=torch.float64))
            continue
        x = vp.local_pixel_values(pv_img, pv_vid)
        assert x.shape[0] == sum(t * h * w for t, h, w in vp.local_grid_thw.tolist())
        e = fake_tower(x, vp.local_grid_thw) if x.shape[0] else torch.zeros(0, 3, dtype=torch.float64)
        assert e.shape[0] == vp.n_encoded
        encoded.append(e)
    routed = simulate_route(vps, encoded)
    for (plan, vp), got in zip(pl, routed):
        slots, rows = ref.vision_replicated(torch.tensor(p.ids), plan.index, IMG, VID)
        assert vp.vision_slots.tolist() == slots
        assert torch.equal(got, torch.cat([E_img, E_vid])[rows]), f"cp={cp} {layout} {unit} rank={vp.cp_rank}"
    # every rank computed the same assignment and statistics
    assert len({(tuple(vp.assignment), vp.fingerprint) for vp in vps}) == 1
    v0 = vps[0]
    assert sum(v0.rank_rows) == E_img.shape[0] + E_vid.shape[0] == sum(v0.rank_slots) == int(v0.traffic.sum())
    assert v0.rank_slots == [vp.n_slots for vp in vps] and v0.rank_rows == [vp.n_encoded for vp in vps]
    assert sum(v0.rank_patches) == sum(t * h * w for t, h, w in p.images + p.videos)
    return vps


# ---------------------------------------------------------------------------------------------- the route's moves
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("unit", ["image", "frame"])
@pytest.mark.parametrize("per_frame", [False, True])
def test_moves_give_the_replicated_path(cp, layout, unit, per_frame):
    rng = random.Random(cp * 1000 + len(layout) * 10 + len(unit) + per_frame)
    split = 0
    for seed in range(12):
        p = make_pack(rng, merge=MERGE, per_frame=per_frame, max_items=6)
        bucket = None if seed % 3 else 8 * cp * (2 if layout == "zigzag" else 1)
        vps = check_pack(p, cp, layout, unit, per_frame, seed, bucket)
        # some unit's tokens lie on several ranks (an image cut by a chunk boundary)
        tr = vps[0].traffic
        split += int(tr.sum() - tr.diagonal().sum()) > 0
    assert cp == 1 or split > 0


def _pack(segments):
    """A Pack from segments given as lists of items: int n (n text tokens), ("i", h, w) an image, ("v", t, h, w) a
    whole video."""
    from test_mrope_pos import Pack

    p = Pack()
    for seg in segments:
        for it in seg:
            if isinstance(it, int):
                p.ids += [5] * it
            elif it[0] == "i":
                p.images.append([1, it[1], it[2]])
                p.ids += [IMG] * (it[1] * it[2] // 4)
            else:
                p.videos.append(list(it[1:]))
                p.ids += [VID] * (it[1] * it[2] * it[3] // 4)
        p.cu.append(len(p.ids))
    return p


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_edges(layout):
    # no images at all
    p = _pack([[7], [12]])
    vps = check_pack(p, 4, layout, "image", False, 0)
    assert all(vp.n_units == 0 and vp.n_slots == 0 and vp.local_grid_thw.shape == (0, 3) for vp in vps)
    # fewer units than ranks: three ranks encode nothing (no dummy images), some hold no vision token
    p = _pack([[30], [3, ("i", 4, 4), 3]])
    vps = check_pack(p, 4, layout, "image", False, 1)
    assert sorted(vp.n_encoded for vp in vps) == [0, 0, 0, 4]
    assert sum(vp.n_slots == 0 for vp in vps) >= 1
    idle = next(vp for vp in vps if vp.n_encoded == 0)
    assert idle.local_pixel_values(torch.zeros(16, 3), None).shape == (0, 3)
    # one long video split by frame over every rank
    p = _pack([[5, ("v", 8, 4, 6), 5]])
    vps = check_pack(p, 4, layout, "frame", False, 2)
    assert [vp.rank_units for vp in vps][0] == [2, 2, 2, 2]
    assert all(vp.local_grid_thw.tolist() == [[1, 4, 6]] * 2 for vp in vps)
    # whole-video units: one rank encodes it
    vps = check_pack(p, 4, layout, "image", False, 3)
    assert sorted(vp.n_encoded for vp in vps) == [0, 0, 0, 48]


def test_frame_units_of_a_video_take_its_temporal_steps():
    """A frame unit's pixel rows are the video's rows [s*h*w, (s+1)*h*w) (the processor's layout with
    temporal_patch_size: a grid row's temporal steps are consecutive blocks of h*w rows)."""
    p = _pack([[2, ("i", 2, 2), 1, ("v", 3, 2, 4), 2]])
    vps = [vp for _, vp in plans(p, 3, "contiguous", "frame", False)]
    pv_img = torch.arange(4.)[:, None]
    pv_vid = 100 + torch.arange(24.)[:, None]
    for vp in vps:
        rows = vp.local_pixel_values(pv_img, pv_vid).flatten().tolist()
        want = []
        for u in vp.local_units:
            m, s = vp.unit_modality[u], vp.unit_step[u]
            want += list(range(4)) if m == 0 else [100 + s * 8 + i for i in range(8)]
        assert rows == [float(v) for v in want]
    assert sorted(u for vp in vps for u in vp.local_units) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- the balance
@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("cost", [None, (1.0, 0.0), (0.0, 1.0), "callable"])
def test_balance_within_the_lpt_bound(cp, cost):
    """The largest per-rank cost is within (4/3 - 1/(3 cp)) of the exact optimum (brute force over every
    assignment) on random packs of up to 7 units; the assignment is the same on every rank and deterministic."""
    rng = random.Random(cp * 17 + len(str(cost)))
    fn = (lambda t, h, w: float(t * h * w + (h * w) ** 1.5)) if cost == "callable" else cost
    worst = 0.0
    for _ in range(25):
        items = []
        for _ in range(rng.randint(1, 7)):
            if rng.random() < 0.7:
                items += [rng.randint(1, 3), ("i", 2 * rng.randint(1, 6), 2 * rng.randint(1, 6))]
            else:
                items += [2, ("v", rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3))]
        p = _pack([items[:len(items) // 2] + [1], items[len(items) // 2:] + [1]])
        vps = [vp for _, vp in plans(p, cp, "zigzag", "image", False, cost=fn)]
        v0 = vps[0]
        assert all(vp.assignment == v0.assignment for vp in vps)
        assert [vp for _, vp in plans(p, cp, "zigzag", "image", False, cost=fn)][0].assignment == v0.assignment
        opt = ref.vision_balance_optimum(v0.unit_cost, cp)
        got = max(v0.rank_cost)
        assert got <= (4 / 3 - 1 / (3 * cp)) * opt * (1 + 1e-12) + 1e-9, (v0.unit_cost, v0.assignment)
        worst = max(worst, got / opt if opt else 1.0)
        # the costs are what the model says
        for (t, h, w), c in zip(v0.unit_grid, v0.unit_cost):
            if cost is None:
                want = t * h * w + t * (h * w) ** 2 / (6 * packcuda.vision.VISION_COST_WIDTH)
            elif cost == "callable":
                want = fn(t, h, w)
            else:
                want = cost[0] * t * h * w + cost[1] * t * (h * w) ** 2
            assert c == pytest.approx(want, rel=1e-12)
    assert worst >= 1.0


def test_balance_prefers_the_rank_holding_the_tokens():
    """Equal loads: a unit goes to the rank that holds most of its tokens (no traffic for it)."""
    p = _pack([[2, ("i", 4, 4), 10, ("i", 4, 4), 8]])
    for layout in ("zigzag", "contiguous"):
        vps = check_pack(p, 2, layout, "image", False, 0)
        tr = vps[0].traffic
        assert sum(vp.n_encoded for vp in vps) == 8
        assert int(tr.diagonal().sum()) >= 4


# ---------------------------------------------------------------------------------------------- the route over gloo
PATCH, TPATCH = 4, 2
PIX = 3 * TPATCH * PATCH * PATCH


def tower(fam, seed=0):
    """transformers' own vision tower of a tiny fp64 config with random weights: Qwen2.5-VL (window attention and a
    full-attention block) or Qwen3-VL (interpolated position embeddings, two deepstack levels)."""
    import transformers as T

    vision = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TPATCH,
                  in_channels=3, hidden_size=32, intermediate_size=64, out_hidden_size=24)
    if fam == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as cls
        cfg = T.Qwen2_5_VLConfig(vision_config=dict(vision, window_size=16, fullatt_block_indexes=[1])).vision_config
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as cls
        cfg = T.Qwen3VLConfig(vision_config=dict(vision, num_position_embeddings=64,
                                                 deepstack_visual_indexes=[0, 1])).vision_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls._from_config(cfg, dtype=torch.float64)


def features(tw, pv, grid):
    """The tower's pooled rows and deepstack levels (a list)."""
    out = tw(pv, grid_thw=grid)
    return [out.pooler_output] + list(getattr(out, "deepstack_features", None) or [])


def _unit_rows(vp, p):
    """The rows of the replicated tower output [image rows; video rows] that this rank's units encode, in its
    tower's output order."""
    starts, n = [], 0
    for t, h, w in p.images + p.videos:
        starts.append(n)
        n += t * h * w // MERGE ** 2
    out = []
    for u in vp.local_units:
        t, h, w = vp.unit_grid[u]
        first = starts[vp.unit_row[u] + (len(p.images) if vp.unit_modality[u] else 0)] + vp.unit_step[u] * h * w // 4
        out += range(first, first + t * h * w // MERGE ** 2)
    return torch.tensor(out, dtype=torch.int64)


def _replicated(tw, p, seed):
    """The replicated path (the whole tower on all images, then on all videos: transformers' two calls) and a loss
    weighing every vision token's features: (pixel values, features E per level, weights G, parameter gradients)."""
    g = torch.Generator().manual_seed(seed)
    n_img, n_vid = (sum(t * h * w for t, h, w in grids) for grids in (p.images, p.videos))
    pv = (torch.randn(n_img, PIX, generator=g, dtype=torch.float64) if n_img else None,
          torch.randn(n_vid, PIX, generator=g, dtype=torch.float64) if n_vid else None)
    parts = [features(tw, x, torch.tensor(grids)) for x, grids in zip(pv, (p.images, p.videos)) if grids]
    E = [torch.cat(level) for level in zip(*parts)]
    G = [torch.randn(e.shape, generator=g, dtype=torch.float64) for e in E]
    grads = torch.autograd.grad(sum((e * w).sum() for e, w in zip(E, G)), list(tw.parameters()))
    return pv, [e.detach() for e in E], G, grads


def _route_case(tw, p, replicated, cp, rank, layout, unit, per_frame, group, bucket=None):
    """On this rank (a plan with `bucket`: padded to a multiple of it): the route of the replicated path's rows of
    this rank's units gives the replicated path's slot rows bit for bit; the tower run on this rank's units and
    routed gives them within fp64 rounding (a BLAS sums in another order for another number of rows), and the
    tower gradients summed over the group equal the single-process ones; a repeated backward is bit-identical.
    Returns the plan's bucket pad rows."""
    import torch.distributed as dist

    (pv_img, pv_vid), E, G, grads_ref = replicated
    params = list(tw.parameters())
    plan = packcuda.shard_plan(p.cu, cp, rank, layout=layout, bucket=bucket)
    assert bucket is None or plan.total_padded % bucket == 0
    vp = packcuda.vision_plan(torch.tensor(p.ids), p.cu, plan, image_grid_thw=p.images or None,
                              video_grid_thw=p.videos or None, image_token_id=IMG, video_token_id=VID,
                              video_frames="per_frame" if per_frame else "whole", unit=unit)
    slots, rows = ref.vision_replicated(torch.tensor(p.ids), plan.index, IMG, VID)
    assert vp.vision_slots.tolist() == slots
    what = f"cp={cp} {layout} unit={unit} bucket={bucket} rank={rank}"
    mine = _unit_rows(vp, p)
    for r, e in zip(vp.route([e[mine] for e in E], group), E):
        assert torch.equal(r, e[rows]), f"routed rows differ: {what}"
    runs = []
    for _ in range(2 if cp == 2 else 1):
        for q in params:
            q.grad = None
        if vp.local_units:
            feats = features(tw, vp.local_pixel_values(pv_img, pv_vid), vp.local_grid_thw)
        else:  # nothing to encode: rows that still take part in the backward exchange
            feats = [torch.zeros(0, e.shape[1], dtype=torch.float64, requires_grad=True) for e in E]
        routed = vp.route(feats, group)
        for r, e in zip(routed, E):
            torch.testing.assert_close(r.detach(), e[rows], rtol=1e-12, atol=1e-14, msg=lambda m: f"{what}: {m}")
        sum((r * w[rows]).sum() for r, w in zip(routed, G)).backward()
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
        for gr in grads:
            dist.all_reduce(gr, group=group)
        for gr, gw in zip(grads, grads_ref):
            torch.testing.assert_close(gr, gw, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")
        runs.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[-1])), f"a repeated backward differs: {what}"
    return plan.pad_size


def _gloo_worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in (2, 3, 4)}
        n = 0
        for fam, per_frame in (("qwen2_5_vl", False), ("qwen3_vl", True)):
            tw = tower(fam)
            for cp in (2, 3, 4):
                seed = cp + 10 * per_frame
                rng = random.Random(seed)
                p = make_pack(rng, merge=MERGE, per_frame=per_frame, max_items=4, max_t=3)
                while not (p.images and p.videos):
                    p = make_pack(rng, merge=MERGE, per_frame=per_frame, max_items=4, max_t=3)
                if rank >= cp:
                    continue
                replicated = _replicated(tw, p, seed)
                for layout in ("zigzag", "contiguous"):
                    # bucket plans (cp 2-3): a pad segment after the last sequence, the route's exchange the same
                    for bucket in (None,) + ((8 * cp * (2 if layout == "zigzag" else 1),) if cp < 4 else ()):
                        for unit in ("image", "frame"):
                            pad = _route_case(tw, p, replicated, cp, rank, layout, unit, per_frame, groups[cp],
                                              bucket)
                            n += 1
                            results[(rank, "bucket_pad")] = results.get((rank, "bucket_pad"), 0) + (pad > 0)
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_route_gloo_equals_replicated(tmp_path):
    """cp 2, 3, 4 (subgroups of one 4-process gloo job), zigzag and contiguous, image and frame units, fp64
    towers of transformers (Qwen2.5-VL, whole videos; Qwen3-VL, per-frame videos and deepstack levels in the same
    route call), plans without and (cp 2, 3) with a bucket (some with a pad segment): the route gives the
    replicated path's rows bit for bit on every rank, the towers run on each rank's units give them within fp64
    rounding, tower gradients summed over the ranks == single-process gradients, and a repeated backward is
    bit-identical."""
    results = spawn_ranks(_gloo_worker, 4, tmp_path)
    assert {r: results[r] for r in range(4)} == {0: 40, 1: 40, 2: 24, 3: 8}
    assert results[(0, "bucket_pad")] > 0  # some bucket plans do have a pad segment


def _mismatch_worker(rank, world, init, results):
    """Ranks whose vision plans differ (another unit, another grid, another feature count) all raise the same
    ValueError before a row moves."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        p = _pack([[3, ("i", 4, 4), 2, ("v", 3, 4, 6), 2], [5, ("i", 2, 6), 1]])

        def vplan(layout="zigzag", **kw):
            args = dict(image_grid_thw=p.images, video_grid_thw=p.videos, image_token_id=IMG, video_token_id=VID)
            args.update(kw)
            return packcuda.vision_plan(torch.tensor(p.ids), p.cu, packcuda.shard_plan(p.cu, world, rank,
                                                                                      layout=layout), **args)

        seen = []
        for case in ("unit", "layout", "levels"):
            vp = vplan(unit="frame" if rank == 1 and case == "unit" else "image",
                       layout="contiguous" if rank == 0 and case == "layout" else "zigzag")
            n = 2 if rank == 1 and case == "levels" else 1
            try:
                vp.route([torch.zeros(vp.n_encoded, 4, dtype=torch.float64) for _ in range(n)], check=True)
            except ValueError as e:
                seen.append(str(e))
            else:
                seen.append("accepted")
        good = vplan()
        out = good.route(torch.ones(good.n_encoded, 4, dtype=torch.float64), check=True)
        assert out.shape == (good.n_slots, 4) and bool((out == 1).all())
        # a pack without images, and one image whose rows one rank encodes and the other holds in part
        for p in (_pack([[7], [12]]), _pack([[9, ("i", 4, 6), 1]])):
            vp = packcuda.vision_plan(torch.tensor(p.ids), p.cu, packcuda.shard_plan(p.cu, world, rank),
                                      image_grid_thw=p.images or None, image_token_id=IMG, video_token_id=VID)
            x = (torch.arange(vp.n_encoded * 3, dtype=torch.float64).view(-1, 3) + 1).requires_grad_()
            routed = vp.route(x)
            slots, rows = ref.vision_replicated(torch.tensor(p.ids), packcuda.shard_plan(p.cu, world, rank).index,
                                                IMG, VID)
            assert routed.shape == (len(slots), 3)
            assert torch.equal(routed, (torch.arange(6 * 3, dtype=torch.float64).view(-1, 3) + 1)[rows])
            (routed * (rows[:, None] + 1)).sum().backward()
            grads = torch.zeros(6, 3, dtype=torch.float64)
            if vp.n_encoded:
                grads += x.grad
            dist.all_reduce(grads)
            assert torch.equal(grads, torch.arange(1, 7, dtype=torch.float64)[:, None].expand(6, 3)) or not p.images
        results[rank] = seen
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_route_refuses_ranks_that_disagree(tmp_path):
    """cp = 2 over gloo: plans of another unit or shard layout, another number of feature tensors: every rank
    raises the same ValueError naming VisionPlan.route; agreeing plans then route; a pack without images; one
    image that one rank encodes (the other encodes nothing) and both hold in part, values and gradients."""
    results = spawn_ranks(_mismatch_worker, 2, tmp_path)
    assert results[0] == results[1]
    for msg in results[0]:
        assert "packcuda.VisionPlan.route" in msg and "disagree" in msg, msg


# ---------------------------------------------------------------------------------------------- CUDA
@requires_cuda
def test_cuda_plan_pixels_and_merge():
    """A plan on CUDA (device input_ids: one read) equals the host plan; local_pixel_values and merge on CUDA
    equal CPU and do not sync."""
    p = _pack([[3, ("i", 4, 4), 2, ("v", 3, 4, 6), 2], [5, ("i", 2, 6), 1]])
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    pv_img, pv_vid = pixels(p.images, g), pixels(p.videos, g)
    for layout in ("zigzag", "contiguous"):
        for r in range(2):
            kw = dict(image_grid_thw=p.images, video_grid_thw=p.videos, image_token_id=IMG, video_token_id=VID,
                      unit="frame")
            host = packcuda.vision_plan(torch.tensor(p.ids), p.cu, packcuda.shard_plan(p.cu, 2, r, layout=layout),
                                        **kw)
            plan = packcuda.shard_plan(p.cu, 2, r, layout=layout, device=dev)
            vp = packcuda.vision_plan(torch.tensor(p.ids, device=dev), p.cu, plan, **kw)
            assert vp.fingerprint == host.fingerprint and vp.assignment == host.assignment
            assert vp.vision_slots.device == plan.device
            assert vp.vision_slots.cpu().tolist() == host.vision_slots.tolist()
            want = host.local_pixel_values(pv_img, pv_vid)
            emb = torch.randn(plan.total_local, 6, dtype=torch.float64, device=dev)
            routed = torch.randn(vp.n_slots, 6, dtype=torch.float64, device=dev)
            pv_img_d, pv_vid_d = pv_img.to(dev), pv_vid.to(dev)
            vp.local_pixel_values(pv_img_d, pv_vid_d)  # uploads the index once
            vp.merge(emb, routed)
            with no_sync():
                got = vp.local_pixel_values(pv_img_d, pv_vid_d)
                merged = vp.merge(emb, routed)
            assert torch.equal(got.cpu(), want)
            assert torch.equal(merged.cpu(), host.merge(emb.cpu(), routed.cpu()))


def _nccl_one_worker(rank, world, init, results):
    """cp = 1 on an NCCL group of one GPU: the NCCL route equals the torch one (values and gradients, bit for bit)
    and the replicated path (within rounding), does not sync after a warm-up, and captures into a CUDA graph."""
    import torch.distributed as dist

    with nccl_rank(rank, world, init) as dev:
        group = dist.group.WORLD
        tw = tower("qwen3_vl").to(dev)
        p = _pack([[3, ("i", 4, 4), 2, ("v", 3, 4, 6), 2], [5, ("i", 2, 6), 1]])
        replicated = _replicated(tw.cpu(), p, 0)
        tw.to(dev)
        (pv_img, pv_vid), E, _, _ = replicated
        plan = packcuda.shard_plan(p.cu, 1, 0, device=dev)
        vp = packcuda.vision_plan(torch.tensor(p.ids), p.cu, plan, image_grid_thw=p.images, video_grid_thw=p.videos,
                                  image_token_id=IMG, video_token_id=VID, unit="frame")
        slots, rows = ref.vision_replicated(torch.tensor(p.ids), plan.index.cpu(), IMG, VID)
        outs = {}
        for backend in ("nccl", "torch"):
            feats = features(tw, vp.local_pixel_values(pv_img.to(dev), pv_vid.to(dev)), vp.local_grid_thw.to(dev))
            routed = vp.route(feats, group, backend=backend)
            grads = torch.autograd.grad(sum(r.square().sum() for r in routed), list(tw.parameters()))
            outs[backend] = ([r.detach() for r in routed], grads)
        for a, b in zip(outs["nccl"][0] + list(outs["nccl"][1]), outs["torch"][0] + list(outs["torch"][1])):
            assert torch.equal(a, b)
        for r, e in zip(outs["nccl"][0], E):
            torch.testing.assert_close(r.cpu(), e[rows], rtol=1e-10, atol=1e-12)
        # no sync once warm, forward and backward
        x = torch.randn(plan.total_local, E[0].shape[1], dtype=torch.float64, device=dev, requires_grad=True)
        fs = [f.detach().requires_grad_() for f in feats]

        def step():
            out = vp.merge(x, vp.route(fs[0], group, backend="nccl"))
            out.backward(torch.ones_like(out))

        step()
        with no_sync():
            step()
        # CUDA graph: route + merge captured once, replayed with new features
        es = fs[0].detach().clone()
        xs = x.detach().clone()
        graph, y = capture_cuda_graph(lambda: vp.merge(xs, vp.route(es, group, backend="nccl")))
        for _ in range(3):
            es.copy_(torch.randn_like(es))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, vp.merge(xs, vp.route(es, group, backend="torch")))
        results[rank] = len(slots)


@requires_cuda
@pytest.mark.spawns
def test_route_nccl_cp1_no_sync_and_graph_capture(tmp_path):
    results = spawn_ranks(_nccl_one_worker, 1, tmp_path)
    assert results[0] > 0
