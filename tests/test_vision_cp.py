"""Vision work under context parallelism (packcuda.vision): the plan (units, balance, local pixel rows and grids,
vision slots), the route's moves against the replicated path (every rank encodes everything and keeps its
slots), and the cost balance against the exact optimum."""
import random

import pytest
import torch

import packcuda
import reference as ref
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
        slots, want = ref.vision_replicated(torch.tensor(p.ids), plan.index, E_img, E_vid, IMG, VID)
        assert vp.vision_slots.tolist() == slots
        assert torch.equal(got, want), f"cp={cp} {layout} {unit} rank={vp.cp_rank}"
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
