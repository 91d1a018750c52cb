"""mRoPE position ids over a packed stream: bit-equal to transformers' get_rope_index run per segment (the
installed version, text_after_vision="grid"), to the plain reference (both rules), golden cases of the 4.x
"max" rule, CPU == CUDA, bad input, opcheck, torch.compile and zero syncs."""
import functools
import importlib
import inspect
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import packcuda
import reference as ref
from helpers import HAS_CUDA, HF_INT_SECONDS, no_sync, requires_cuda

IMG, VID, VSTART, VEND = 900, 901, 902, 903  # text tokens are drawn from [0, 800)

# family -> (module, model class, video_frames, uses tokens_per_second)
FAMILIES = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLModel", "whole", False),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel", "whole", True),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel", "per_frame", False),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Model", "per_frame", False),
}


# ---------------------------------------------------------------------------------------------- data
@dataclass
class Pack:
    ids: list = field(default_factory=list)
    cu: list = field(default_factory=lambda: [0])
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)
    secs: list = field(default_factory=list)
    segs: list = field(default_factory=list)  # per segment: (images, videos, secs)


def make_pack(rng, *, merge=2, per_frame=False, nseg=None, max_items=5, max_t=5, bare_start=True):
    """Random packed multimodal batch: text-only, empty and mixed segments, images and videos of varied grids,
    blocks at segment start and end. Same-type blocks are always separated by text (else they would merge)."""
    p = Pack()
    for _ in range(nseg if nseg is not None else rng.randint(1, 5)):
        kind = rng.random()
        seg_ids, imgs, vids, secs = [], [], [], []
        n_items = 0 if kind < 0.08 else rng.randint(1, max_items)
        items = ["text" if kind < 0.25 else rng.choice(["text", "image", "video", "image", "video"])
                 for _ in range(n_items)]
        for j, it in enumerate(items):
            first, last = j == 0, j == len(items) - 1
            if it == "text":
                seg_ids += [rng.randrange(800) for _ in range(rng.randint(1, 6))]
                continue
            h, w = merge * rng.randint(1, 3), merge * rng.randint(1, 3)
            hw = h * w // (merge * merge)
            if it == "image":
                imgs.append([1, h, w])
                frames = [(IMG, hw)]
            else:
                t = rng.randint(1, max_t)
                vids.append([t, h, w])
                secs.append(rng.choice([1.0, 2.0] if HF_INT_SECONDS else [0.5, 1.0 / 3.0, 0.7, 1.0, 2.0 / 3.0, 1.25]))
                frames = [(VID, hw)] if per_frame else [(VID, t * hw)]
                if per_frame:
                    frames = frames * t
            for f, (tok, n) in enumerate(frames):
                if per_frame and it == "video":
                    seg_ids += [rng.randrange(800) for _ in range(2)]  # timestamp text "<t x.x seconds>"
                if not (first and f == 0 and not (per_frame and it == "video") and bare_start and rng.random() < 0.5):
                    seg_ids.append(VSTART)
                seg_ids += [tok] * n
                if not (last and f == len(frames) - 1 and rng.random() < 0.5):
                    seg_ids.append(VEND)
        p.ids += seg_ids
        p.cu.append(len(p.ids))
        p.images += imgs
        p.videos += vids
        p.secs += secs
        p.segs.append((imgs, vids, secs))
    return p


def _hf_takes_types(family):
    mod, cls, *_ = FAMILIES[family]
    return "mm_token_type_ids" in inspect.signature(
        getattr(importlib.import_module(mod), cls).get_rope_index).parameters


def hf_segment(family, ids, imgs, vids, secs, merge, tps):
    """transformers' own get_rope_index on one segment (called unbound with a namespace as `self`)."""
    mod, cls_name, _, uses_tps = FAMILIES[family]
    Cls = getattr(importlib.import_module(mod), cls_name)
    ns = SimpleNamespace()
    ns.config = SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tps),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    if hasattr(Cls, "get_vision_position_ids"):
        ns.get_vision_position_ids = functools.partial(Cls.get_vision_position_ids, ns)
    x = torch.tensor(ids, dtype=torch.int64)[None]
    kw = dict(image_grid_thw=torch.tensor(imgs, dtype=torch.int64) if imgs else None,
              video_grid_thw=torch.tensor(vids, dtype=torch.int64) if vids else None)
    params = inspect.signature(Cls.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        kw["mm_token_type_ids"] = ((x == IMG).int() + 2 * (x == VID).int())
    if uses_tps and "second_per_grid_ts" in params:
        kw["second_per_grid_ts"] = torch.tensor(secs, dtype=torch.float32) if vids else None
    pos, delta = Cls.get_rope_index(ns, x, **kw)
    return pos[:, 0], int(delta.reshape(-1)[0])


def ours(p, device, *, per_frame=False, tps=None, rule="grid", merge=2, validate=True, use_secs=True):
    return packcuda.mrope_position_ids(
        torch.tensor(p.ids, dtype=torch.int64, device=device), p.cu, image_grid_thw=p.images or None,
        video_grid_thw=p.videos or None,
        second_per_grid_ts=p.secs if (use_secs and p.videos and tps is not None) else None,
        image_token_id=IMG, video_token_id=VID, spatial_merge_size=merge, tokens_per_second=tps,
        video_frames="per_frame" if per_frame else "whole", text_after_vision=rule, validate=validate)


def reference(p, *, per_frame=False, tps=None, rule="grid", merge=2, use_secs=True):
    return ref.mrope_position_ids(
        p.ids, p.cu, p.images, p.videos, p.secs if use_secs else None, image_token_id=IMG, video_token_id=VID,
        spatial_merge_size=merge, tokens_per_second=tps, video_frames="per_frame" if per_frame else "whole",
        text_after_vision=rule)


# ---------------------------------------------------------------------------------------------- oracle
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seed", range(4))
def test_matches_transformers_per_segment(device, family, seed):
    pytest.importorskip("transformers")
    _, _, frames, uses_tps = FAMILIES[family]
    rng = random.Random(seed * 31 + len(family))
    merge = 2 if seed % 2 == 0 else 1
    tps = rng.choice([2, 4, 25]) if uses_tps else None
    per_frame = frames == "per_frame"
    p = make_pack(rng, merge=merge, per_frame=per_frame, nseg=6, bare_start=_hf_takes_types(family))
    pos, text_pos, deltas = ours(p, device, per_frame=per_frame, tps=tps, merge=merge)
    pos, text_pos, deltas = pos.cpu(), text_pos.cpu(), deltas.cpu()
    assert pos.shape == (3, len(p.ids)) and pos.dtype == torch.int64
    for i, (imgs, vids, secs) in enumerate(p.segs):
        a, b = p.cu[i], p.cu[i + 1]
        if a == b:
            assert deltas[i] == 0
            continue
        want, want_delta = hf_segment(family, p.ids[a:b], imgs, vids, secs, merge, tps)
        assert torch.equal(pos[:, a:b], want), (i, pos[:, a:b], want)
        assert int(deltas[i]) == want_delta
        assert torch.equal(text_pos[a:b], torch.arange(b - a))


@pytest.mark.skipif(HF_INT_SECONDS, reason="this transformers release truncates second_per_grid_ts to whole seconds")
def test_qwen25_fractional_intervals_match_transformers(device):
    """Long videos with fractional second_per_grid_ts: the float32 truncations must match bit for bit."""
    pytest.importorskip("transformers")
    tps = 25
    p = Pack()
    for sec in [1.0 / 3.0, 0.7, 0.45, 2.0 / 3.0, 0.3]:
        ids = [1, 2, VSTART] + [VID] * 12 * 4 + [VEND, 3]
        p.ids += ids
        p.cu.append(len(p.ids))
        p.videos.append([12, 4, 4])
        p.secs.append(sec)
        p.segs.append(([], [[12, 4, 4]], [sec]))
    pos, _, deltas = ours(p, device, tps=tps)
    for i, (imgs, vids, secs) in enumerate(p.segs):
        a, b = p.cu[i], p.cu[i + 1]
        want, want_delta = hf_segment("qwen2_5_vl", p.ids[a:b], imgs, vids, secs, 2, tps)
        assert torch.equal(pos.cpu()[:, a:b], want)
        assert int(deltas[i]) == want_delta


# ---------------------------------------------------------------------------------------------- reference
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), per_frame=st.booleans(), rule=st.sampled_from(["grid", "max"]),
       merge=st.sampled_from([1, 2, 3]), tps=st.sampled_from([None, 2, 4.5, 41]), wide=st.booleans())
def test_matches_reference_hypothesis(seed, per_frame, rule, merge, tps, wide):
    rng = random.Random(seed)
    p = make_pack(rng, merge=merge, per_frame=per_frame)
    want = reference(p, per_frame=per_frame, tps=tps, rule=rule, merge=merge)
    ids = torch.tensor(p.ids, dtype=torch.int64 if wide else torch.int32)
    for dev in ["cpu"] + (["cuda"] if HAS_CUDA else []):
        got = packcuda.mrope_position_ids(
            ids.to(dev), p.cu, image_grid_thw=p.images, video_grid_thw=p.videos,
            second_per_grid_ts=p.secs if p.videos and tps else None, image_token_id=IMG, video_token_id=VID,
            spatial_merge_size=merge, tokens_per_second=tps, video_frames="per_frame" if per_frame else "whole",
            text_after_vision=rule)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("rule", ["grid", "max"])
def test_large_pack_cpu_equals_cuda_equals_reference(device, rule):
    rng = random.Random(7)
    p = make_pack(rng, nseg=40, max_items=8, max_t=8)
    want = reference(p, tps=2, rule=rule)
    got = ours(p, device, tps=2, rule=rule)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    again = ours(p, device, tps=2, rule=rule)  # deterministic
    for g, w in zip(got, again):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------------------------- "max" rule
def _golden_video_pack():
    # segment 0: 2 text, a video [3, 4, 4] (merged 3x2x2 = 12 tokens) with interval 2 * 1.0 = 2, 2 text
    # segment 1: 1 text, an image [1, 4, 6] (merged 1x2x3 = 6 tokens), 1 text
    p = Pack()
    p.ids = [7, 8] + [VID] * 12 + [9, 10] + [11] + [IMG] * 6 + [12]
    p.cu = [0, 16, 24]
    p.videos, p.secs, p.images = [[3, 4, 4]], [1.0], [[1, 4, 6]]
    return p


GOLDEN = {
    # video block at s = 2: t = 2 + floor(ti * 2) = 2, 4, 6; h = 2 + hi; w = 2 + wi (ti-major, then hi, wi)
    # grid rule: text resumes at s + max(H', W') = 2 + 2 = 4; max rule: at max(6, 3, 3) + 1 = 7
    # segment 1 (image at s = 1, 1x2x3): grid resumes at 1 + 3 = 4, max rule at max(1, 2, 3) + 1 = 4 (same)
    "grid": (
        [[0, 1] + [2] * 4 + [4] * 4 + [6] * 4 + [4, 5], [0, 1] + [2, 2, 3, 3] * 3 + [4, 5],
         [0, 1] + [2, 3, 2, 3] * 3 + [4, 5]],
        [-9, -3],  # max 6 + 1 - 16; max 4 + 1 - 8
    ),
    "max": (
        [[0, 1] + [2] * 4 + [4] * 4 + [6] * 4 + [7, 8], [0, 1] + [2, 2, 3, 3] * 3 + [7, 8],
         [0, 1] + [2, 3, 2, 3] * 3 + [7, 8]],
        [-7, -3],  # max 8 + 1 - 16
    ),
}
GOLDEN_SEG1 = [[0, 1, 1, 1, 1, 1, 1, 4], [0, 1, 1, 1, 2, 2, 2, 4], [0, 1, 2, 3, 1, 2, 3, 4]]


@pytest.mark.parametrize("rule", ["grid", "max"])
def test_golden_max_vs_grid(device, rule):
    p = _golden_video_pack()
    pos, text_pos, deltas = ours(p, device, tps=2, rule=rule)
    rows, d = GOLDEN[rule]
    want = torch.tensor(rows)
    assert torch.equal(pos.cpu()[:, :16], want)
    assert torch.equal(pos.cpu()[:, 16:], torch.tensor(GOLDEN_SEG1))
    assert deltas.cpu().tolist() == d
    assert text_pos.cpu().tolist() == list(range(16)) + list(range(8))
    # the reference's documented formula gives the same numbers
    for g, w in zip((pos, text_pos, deltas), reference(p, tps=2, rule=rule)):
        assert torch.equal(g.cpu(), w)


def test_golden_fractional_interval_max_rule():
    # video [4, 2, 2] merged 4x1x1, tps 4, second 0.35 -> interval float32(4) * float32(0.35) = 1.4000000953...
    # t = floor(ti * 1.4) = 0, 1, 2, 4; grid: text at s + 1; max: text at s + 4 + 1
    p = Pack(ids=[VID] * 4 + [5, 6], cu=[0, 6], videos=[[4, 2, 2]], secs=[0.35])
    for rule, text in [("grid", [1, 2]), ("max", [5, 6])]:
        pos, _, deltas = ours(p, "cpu", tps=4, rule=rule)
        assert pos[0].tolist() == [0, 1, 2, 4] + text
        assert pos[1].tolist() == [0, 0, 0, 0] + text
        assert deltas.tolist() == [max(4, text[-1]) + 1 - 6]


def test_empty_and_text_only():
    pos, text_pos, deltas = packcuda.mrope_position_ids(torch.tensor([3, 4, 5, 6]), [0, 0, 3, 3, 4],
                                                        image_token_id=IMG, video_token_id=VID)
    assert pos.tolist() == [[0, 1, 2, 0]] * 3 and text_pos.tolist() == [0, 1, 2, 0]
    assert deltas.tolist() == [0, 0, 0, 0]
    pos, _, deltas = packcuda.mrope_position_ids(torch.empty(0, dtype=torch.int64), [0],
                                                 image_token_id=IMG, video_token_id=VID)
    assert pos.shape == (3, 0) and deltas.shape == (0,)


# ---------------------------------------------------------------------------------------------- spec
def test_spec_from_hf_config():
    transformers = pytest.importorskip("transformers")
    cases = [("Qwen2VLConfig", "whole", False), ("Qwen2_5_VLConfig", "whole", True),
             ("Qwen3VLConfig", "per_frame", False), ("Qwen3_5Config", "per_frame", False)]
    for name, frames, has_tps in cases:
        cfg = getattr(transformers, name)()
        spec = packcuda.MRopeSpec.from_hf_config(cfg)
        assert spec.image_token_id == cfg.image_token_id and spec.video_token_id == cfg.video_token_id
        assert spec.spatial_merge_size == cfg.vision_config.spatial_merge_size
        assert spec.video_frames == frames and spec.text_after_vision == "grid"
        assert (spec.tokens_per_second == cfg.vision_config.tokens_per_second) if has_tps else \
            spec.tokens_per_second is None
    spec = packcuda.MRopeSpec.from_hf_config(
        {"model_type": "qwen2_5_vl", "image_token_id": IMG, "video_token_id": VID,
         "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2}}, text_after_vision="max")
    p = _golden_video_pack()
    pos, _, _ = spec.position_ids(torch.tensor(p.ids), p.cu, image_grid_thw=p.images, video_grid_thw=p.videos,
                                  second_per_grid_ts=p.secs)
    assert torch.equal(pos[:, :16], torch.tensor(GOLDEN["max"][0]))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        packcuda.MRopeSpec.from_hf_config({"model_type": "llama"})


# ---------------------------------------------------------------------------------------------- bad input
def _call(ids, cu, device="cpu", validate=True, **kw):
    args = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2)
    args.update(kw)
    return packcuda.mrope_position_ids(torch.tensor(ids, dtype=torch.int64, device=device), cu, validate=validate,
                                       **args)


BAD_RUNS = [
    # (ids, cu, kwargs, message)
    ([1] + [IMG] * 3 + [2] + [IMG] * 4, [0, 9], dict(image_grid_thw=[[1, 4, 4], [1, 4, 4]]),
     r"image block 0 \(image_grid_thw\[0\] = \[1, 4, 4\]\) needs 4 image tokens .* starting at token 1 "
     r"\(segment 0\) has 3"),
    ([1] + [IMG] * 4 + [2] + [IMG] * 5, [0, 11], dict(image_grid_thw=[[1, 4, 4], [1, 4, 4]]),
     r"image block 1 .* needs 4 image tokens .* starting at token 6 \(segment 0\) has 5"),
    ([1] + [IMG] * 4 + [2] + [IMG] * 4, [0, 10], dict(image_grid_thw=[[1, 4, 4]]),
     r"more image blocks than image_grid_thw describes \(1\): a run of image tokens starts at token 6"),
    ([1] + [VID] * 8 + [2] * 4, [0, 13], dict(video_grid_thw=[[2, 4, 4], [1, 4, 4]]),
     r"video_grid_thw describes 2 video blocks but input_ids has only 1 runs of video tokens"),
    ([1, 2] + [IMG] * 4 + [3], [0, 4, 7], dict(image_grid_thw=[[1, 4, 4]]),
     r"image block 0 .* starting at token 2 crosses the end of segment 0 \(token 4\)"),
    ([1] + [VID] * 4 + [2] + [VID] * 4 + [3] * 2, [0, 12], dict(video_grid_thw=[[3, 4, 4]], video_frames="per_frame"),
     r"video_grid_thw describes 3 video blocks \(one per video frame\) but input_ids has only 2 runs"),
    ([1] + [VID] * 4 + [2] + [VID] * 2, [0, 8], dict(video_grid_thw=[[2, 4, 4]], video_frames="per_frame"),
     r"video block 1 \(video_grid_thw\[0\] = \[2, 4, 4\], frame 1\) needs 4 video tokens"),
]


@pytest.mark.parametrize("case", range(len(BAD_RUNS)))
def test_bad_runs_raise_naming_the_block(device, case):
    ids, cu, kw, msg = BAD_RUNS[case]
    with pytest.raises(ValueError, match="packcuda.mrope_position_ids: " + msg):
        _call(ids, cu, device, **kw)


@requires_cuda
@pytest.mark.parametrize("case", range(len(BAD_RUNS)))
def test_bad_runs_unvalidated_cuda_does_not_raise_or_sync(case):
    ids, cu, kw, _ = BAD_RUNS[case]
    ids_dev = torch.tensor(ids, dtype=torch.int64, device="cuda")  # the upload itself is outside the check
    args = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2, **kw)
    with no_sync():
        pos, text_pos, deltas = packcuda.mrope_position_ids(ids_dev, cu, validate=False, **args)
    assert pos.shape == (3, len(ids))


def test_host_metadata_forms_agree(device):
    """Lists (fast path), tuples, numpy, int32 / strided CPU tensors and odd element types give the same result."""
    np = pytest.importorskip("numpy")
    p = None
    for seed in range(100):  # a pack with images and videos
        p = make_pack(random.Random(seed), nseg=5)
        if p.images and p.videos:
            break
    want = reference(p, tps=2)
    ig, vg = torch.tensor(p.images), torch.tensor(p.videos)
    forms = [
        (p.cu, p.images, p.videos, p.secs),
        (tuple(p.cu), tuple(map(tuple, p.images)), [tuple(r) for r in p.videos], tuple(p.secs)),
        (torch.tensor(p.cu, dtype=torch.int32), ig.int(), vg.int(), torch.tensor(p.secs, dtype=torch.float32)),
        (torch.tensor(p.cu)[::1], ig.t().contiguous().t(), vg, torch.tensor(p.secs, dtype=torch.float64)),
        (np.array(p.cu), [np.array(r) for r in p.images], [[np.int64(v) for v in r] for r in p.videos],
         [np.float32(x) for x in p.secs]),
        ([np.int32(v) for v in p.cu], np.array(p.images), [list(r) for r in vg],
         [int(x) if x == int(x) else x for x in p.secs]),
    ]
    for cu, images, videos, secs in forms:
        got = packcuda.mrope_position_ids(
            torch.tensor(p.ids, device=device), cu, image_grid_thw=images, video_grid_thw=videos,
            second_per_grid_ts=secs, image_token_id=IMG, video_token_id=VID, tokens_per_second=2)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)
    for bad, err in [([0, True], TypeError), ([0.0, 6.0], TypeError), ([0, 2**70], ValueError),
                     (torch.tensor([0, 6])[None], ValueError)]:  # a 2-D cu_seqlens is refused, not flattened
        with pytest.raises(err, match="packcuda.mrope_position_ids: cu_seqlens"):
            _call([1] * 6, bad)
    # float grid entries are refused, not truncated; a flat [3n] grid is not [n, 3]
    for images, err in [([[1.0, 4, 4]], TypeError), ([[1, 4.5, 4]], TypeError), ([[True, 4, 4]], TypeError),
                        (torch.tensor([1, 4, 4]), ValueError), (torch.tensor([[1.0, 4, 4]]), TypeError)]:
        with pytest.raises(err, match="packcuda.mrope_position_ids: image_grid_thw"):
            _call([1] + [IMG] * 4 + [2], [0, 6], image_grid_thw=images)


def test_bad_host_arguments():
    ids = [1] + [IMG] * 4 + [2]
    cases = [
        (dict(image_grid_thw=[[1, 3, 4]]), r"image_grid_thw\[0\] = \[1, 3, 4\]: h and w must be divisible by "
                                           r"spatial_merge_size 2"),
        (dict(image_grid_thw=[[0, 4, 4]]), r"image_grid_thw\[0\] = \[0, 4, 4\] must be positive"),
        (dict(image_grid_thw=[[1, 4]]), r"image_grid_thw\[0\] must be \[t, h, w\]"),
        (dict(image_grid_thw=[[1, 4, 4]], video_grid_thw=[[1, 2, 2]], second_per_grid_ts=[1.0, 2.0],
              tokens_per_second=2), r"second_per_grid_ts has 2 entries but video_grid_thw has 1 rows"),
        (dict(image_grid_thw=[[1, 4, 4]], video_grid_thw=[[1, 2, 2]], second_per_grid_ts=[1.0]),
         r"second_per_grid_ts needs tokens_per_second"),
        (dict(image_grid_thw=[[1, 4, 4]], spatial_merge_size=0), r"spatial_merge_size must be >= 1, got 0"),
        (dict(image_grid_thw=[[1, 4, 4]], video_token_id=IMG), r"image_token_id and video_token_id must differ"),
        (dict(image_grid_thw=[[1, 4, 4]], video_frames="frames"), r"video_frames must be 'whole' or 'per_frame'"),
        (dict(image_grid_thw=[[1, 4, 4]], text_after_vision="last"), r"text_after_vision must be 'grid' or 'max'"),
    ]
    for kw, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            _call(ids, [0, 6], **kw)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=5 does not match the number of tokens \(6\)"):
        _call(ids, [0, 5], image_grid_thw=[[1, 4, 4]])
    with pytest.raises(ValueError, match=r"image_grid_thw describes 1 image blocks but input_ids is empty"):
        _call([], [0], image_grid_thw=[[1, 4, 4]])
    with pytest.raises(ValueError, match="input_ids must be a 1-D"):
        packcuda.mrope_position_ids(torch.zeros(2, 3, dtype=torch.int64), [0, 6], image_token_id=IMG,
                                    video_token_id=VID)
    with pytest.raises(ValueError, match=r"input_ids must have dtype in \{int32, int64\}, got float32"):
        packcuda.mrope_position_ids(torch.zeros(6), [0, 6], image_token_id=IMG, video_token_id=VID)


# ---------------------------------------------------------------------------------------------- torch
def _op_args(p, device):
    return (torch.tensor(p.ids, device=device), torch.tensor(p.cu), torch.tensor(p.images).reshape(-1, 3),
            torch.tensor(p.videos).reshape(-1, 3), torch.tensor(p.secs, dtype=torch.float32), IMG, VID, 2, 2.0,
            False, False)


def test_opcheck(device):
    p = make_pack(random.Random(3), nseg=4)
    torch.library.opcheck(torch.ops.packcuda.mrope_position_ids, _op_args(p, device))


def test_compile_fullgraph(device):
    p = make_pack(random.Random(5), nseg=4)
    ids = torch.tensor(p.ids, device=device)
    cu = torch.tensor(p.cu)
    ig, vg = torch.tensor(p.images).reshape(-1, 3), torch.tensor(p.videos).reshape(-1, 3)
    secs = torch.tensor(p.secs, dtype=torch.float32)

    def f(x):
        pos, text_pos, deltas = packcuda.mrope_position_ids(
            x, cu, image_grid_thw=ig, video_grid_thw=vg, second_per_grid_ts=secs, image_token_id=IMG,
            video_token_id=VID, tokens_per_second=2, validate=False)
        return torch.cat([text_pos[None], pos]), deltas

    backend = "aot_eager" if device == "cpu" else "inductor"
    got = torch.compile(f, fullgraph=True, backend=backend)(ids)
    want = f(ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@requires_cuda
def test_host_metadata_path_does_not_sync():
    p = make_pack(random.Random(11), nseg=8)
    ids = torch.tensor(p.ids, device="cuda")
    want = reference(p, tps=2)
    with no_sync():
        got = packcuda.mrope_position_ids(ids, p.cu, image_grid_thw=p.images, video_grid_thw=p.videos,
                                          second_per_grid_ts=p.secs or None, image_token_id=IMG,
                                          video_token_id=VID, tokens_per_second=2, validate=False)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@requires_cuda
def test_device_cu_seqlens():
    p = make_pack(random.Random(12), nseg=5)
    got = packcuda.mrope_position_ids(torch.tensor(p.ids, device="cuda"), torch.tensor(p.cu, device="cuda"),
                                      image_grid_thw=p.images, video_grid_thw=p.videos, image_token_id=IMG,
                                      video_token_id=VID)
    for g, w in zip(got, reference(p, use_secs=False)):
        assert torch.equal(g.cpu(), w)


# ---------------------------------------------------------------------------------------------- CP
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_positions_for_context_parallel(device, layout):
    """Recipe: positions on the global stream, then every rank takes its slots with plan.shard(pos, dim=1)."""
    p = make_pack(random.Random(21), nseg=7)
    pos, text_pos, _ = ours(p, device, tps=2)
    pos4 = torch.cat([text_pos[None], pos])  # [4, T]: the layout transformers takes for packed sequences
    seen = torch.zeros(len(p.ids), dtype=torch.int64)
    cp = 2
    for rank in range(cp):
        plan = packcuda.shard_plan(p.cu, cp, rank, layout=layout, device=device)
        local = plan.shard(pos4, dim=1)
        assert local.shape == (4, plan.total_local)
        index = plan.index.cpu()
        want = torch.zeros(4, plan.total_local, dtype=torch.int64)
        want[:, index >= 0] = pos4.cpu()[:, index[index >= 0]]
        assert torch.equal(local.cpu(), want)
        seen[index[index >= 0]] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every token on exactly one rank


# ---------------------------------------------------------------------------------------------- tiles
def _tile_pack(rng, *, per_frame=False, merge=2):
    """Segments of very different lengths around the 256-token tiles and 32-token steps the CUDA kernels scan:
    empty and one-token segments, long text runs, blocks longer than a tile, blocks at segment starts and ends
    (also a block ending one segment and a block of the same type starting the next: two runs)."""
    p = Pack()
    for _ in range(rng.randint(50, 80)):
        kind = rng.random()
        seg_ids, imgs, vids, secs = [], [], [], []
        if kind < 0.1:
            pass  # empty segment
        elif kind < 0.25:
            seg_ids = [rng.randrange(800) for _ in range(rng.choice([1, 2, 31, 32, 33, rng.randint(1, 300)]))]
        else:
            for j in range(rng.randint(1, 5)):
                if j > 0 or rng.random() < 0.6:  # same-type blocks need text between them
                    seg_ids += [rng.randrange(800) for _ in range(rng.randint(1, 90))]
                if rng.random() < 0.5:
                    g = [1, merge * rng.randint(1, 20), merge * rng.randint(1, 20)]
                    imgs.append(g)
                    seg_ids += [IMG] * (g[1] * g[2] // merge**2)
                    continue
                g = [rng.randint(1, 6), merge * rng.randint(1, 12), merge * rng.randint(1, 12)]
                vids.append(g)
                secs.append(rng.choice([0.5, 1.0 / 3.0, 1.0, 2.0]))
                frame = g[1] * g[2] // merge**2
                if per_frame:
                    for f in range(g[0]):
                        seg_ids += ([rng.randrange(800)] if f else []) + [VID] * frame
                else:
                    seg_ids += [VID] * (g[0] * frame)
            if rng.random() < 0.5:
                seg_ids += [rng.randrange(800) for _ in range(rng.randint(1, 40))]
        p.ids += seg_ids
        p.cu.append(len(p.ids))
        p.images += imgs
        p.videos += vids
        p.secs += secs
    return p


@pytest.mark.parametrize("per_frame", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tile_boundaries_match_reference(device, per_frame, dtype):
    for seed, rule in [(0, "grid"), (1, "max")]:
        p = _tile_pack(random.Random(seed + 10 * per_frame), per_frame=per_frame)
        want = reference(p, per_frame=per_frame, tps=2, rule=rule)
        got = packcuda.mrope_position_ids(
            torch.tensor(p.ids, dtype=dtype, device=device), p.cu, image_grid_thw=p.images,
            video_grid_thw=p.videos, second_per_grid_ts=None if per_frame else p.secs, image_token_id=IMG,
            video_token_id=VID, tokens_per_second=2, video_frames="per_frame" if per_frame else "whole",
            text_after_vision=rule)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w)


def test_many_extra_runs_raise(device):
    ids = [IMG, 1] * 1500  # 1500 one-token runs, one grid row
    with pytest.raises(ValueError, match=r"more image blocks than image_grid_thw describes \(1\): a run of image "
                                         r"tokens starts at token 2 \(segment 0\)"):
        _call(ids, [0, len(ids)], device, image_grid_thw=[[1, 2, 2]])


def _error_token(msg, total):
    import re

    m = re.search(r"start(?:ing|s) at token (\d+)", msg)
    return int(m.group(1)) if m else total  # fewer runs than blocks: reported at the end of the stream


@requires_cuda
def test_cuda_status_is_the_earliest_error():
    """The CUDA kernels report the same error (by its first token) as the CPU check, without a sync."""
    rng = random.Random(5)
    cases = [(ids, cu, kw) for ids, cu, kw, _ in BAD_RUNS]
    for _ in range(30):
        p = _tile_pack(rng)
        ids, cu, images = list(p.ids), list(p.cu), list(p.images)
        kind = rng.randrange(3)
        if kind == 0:  # drop a token
            i = rng.randrange(len(ids))
            del ids[i]
            cu = [c - (c > i) for c in cu]
        elif kind == 1:  # a stray vision token
            ids[rng.randrange(len(ids))] = rng.choice([IMG, VID])
        elif images:  # one grid row short
            images.pop(rng.randrange(len(images)))
        cases.append((ids, cu, dict(image_grid_thw=images, video_grid_thw=p.videos, second_per_grid_ts=p.secs,
                                    tokens_per_second=2)))
    n_bad = 0
    for ids, cu, kw in cases:
        args = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2)
        args.update(kw)
        try:
            _call(ids, cu, "cpu", **kw)
            cpu_token = None
        except ValueError as e:
            cpu_token = _error_token(str(e), len(ids))
        frames = args.pop("video_frames", "whole") == "per_frame"
        tps = args.pop("tokens_per_second", None)
        secs = args.pop("second_per_grid_ts", None)
        op_args = (torch.tensor(ids, dtype=torch.int64, device="cuda"), torch.tensor(cu),
                   torch.tensor(args.pop("image_grid_thw", []), dtype=torch.int64).reshape(-1, 3),
                   torch.tensor(args.pop("video_grid_thw", []), dtype=torch.int64).reshape(-1, 3),
                   torch.tensor(secs or [], dtype=torch.float32), IMG, VID, 2, tps, frames, False)
        with no_sync():
            status = torch.ops.packcuda.mrope_position_ids(*op_args)[3]
        key = int(status.item())
        if cpu_token is None:
            assert key == (1 << 63) - 1
            assert torch.ops.packcuda.mrope_status_token(key) == -1
        else:
            n_bad += 1
            assert key != (1 << 63) - 1 and key >> 24 == cpu_token
            assert torch.ops.packcuda.mrope_status_token(key) == cpu_token
    assert n_bad >= len(BAD_RUNS) + 10


# ---------------------------------------------------------------------------------------- hypothesis: forms, sizes
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), per_frame=st.booleans(), rule=st.sampled_from(["grid", "max"]),
       merge=st.sampled_from([1, 2, 4]), form=st.sampled_from(["list", "tuple", "int32", "int64", "numpy"]),
       tps=st.sampled_from([None, 0.0, 1, 2.5, 25.0]))
def test_host_forms_match_reference_hypothesis(seed, per_frame, rule, merge, form, tps):
    """Every accepted host form of the grids, cu_seqlens and seconds gives the reference's positions."""
    np = pytest.importorskip("numpy")
    p = make_pack(random.Random(seed), merge=merge, per_frame=per_frame, max_t=4)
    want = reference(p, per_frame=per_frame, tps=tps, rule=rule, merge=merge, use_secs=tps is not None)

    def conv(rows, dtype):
        if form in ("list", "tuple"):
            return (tuple if form == "tuple" else list)(tuple(r) if form == "tuple" else list(r) for r in rows)
        if form == "numpy":
            return np.array(rows, dtype=np.int64).reshape(-1, 3)
        return torch.tensor(rows, dtype=torch.int32 if form == "int32" else torch.int64).reshape(-1, 3)

    cu = (p.cu if form in ("list", "tuple")
          else torch.tensor(p.cu, dtype=torch.int32 if form == "int32" else torch.int64))
    secs = (p.secs if form != "numpy" else [np.float32(s) for s in p.secs]) if (tps is not None and p.videos) else None
    got = packcuda.mrope_position_ids(
        torch.tensor(p.ids, dtype=torch.int64), cu, image_grid_thw=conv(p.images, form),
        video_grid_thw=conv(p.videos, form),
        second_per_grid_ts=secs, image_token_id=IMG, video_token_id=VID, spatial_merge_size=merge,
        tokens_per_second=tps, video_frames="per_frame" if per_frame else "whole", text_after_vision=rule)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@settings(max_examples=150, deadline=None)
@given(t=st.one_of(st.integers(1, 4), st.integers(1, 2**63 - 1)), h=st.one_of(st.integers(1, 3), st.integers(1, 2**62)),
       w=st.one_of(st.integers(1, 3), st.integers(1, 2**62)), merge=st.sampled_from([1, 2]),
       per_frame=st.booleans(), rule=st.sampled_from(["grid", "max"]),
       sec=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e30]),
                     st.floats(0, 100)),
       tps=st.one_of(st.none(), st.floats(0, 1e38), st.floats(0, 50),
                     st.sampled_from([2.0, float("nan"), float("inf"), -1.0])))
def test_any_grid_or_seconds_is_refused_or_matches_reference(t, h, w, merge, per_frame, rule, sec, tps):
    """Arbitrary (also huge, non-finite) grid rows and seconds on a short stream: either refused with a
    ValueError naming the op, or the reference's positions, which all lie in [0, 2**62)."""
    h, w = h * merge if h * merge < 2**63 else merge, w * merge if w * merge < 2**63 else merge
    n = t * (h // merge) * (w // merge)
    k = n if n <= 64 else 3
    ids = [1] + [VID] * k + [2]
    kw = dict(image_token_id=IMG, video_token_id=VID, spatial_merge_size=merge, tokens_per_second=tps,
              video_frames="per_frame" if per_frame else "whole", text_after_vision=rule)
    secs = [sec] if tps is not None else None
    try:
        got = packcuda.mrope_position_ids(torch.tensor(ids), [0, len(ids)], video_grid_thw=[[t, h, w]],
                                          second_per_grid_ts=secs, **kw)
    except ValueError as e:
        assert "packcuda.mrope_position_ids" in str(e)
        return
    assert n == k  # only a grid matching the stream is accepted
    assert got[0].min() >= 0 and got[0].max() < 2**62
    if not per_frame or t == 1:
        want = ref.mrope_position_ids(ids, [0, len(ids)], [], [[t, h, w]], secs, **kw)
        for g, wv in zip(got, want):
            assert torch.equal(g, wv)


def test_valid_edges_work():
    """Edges that are valid input: zero seconds (all frames at one time), an integer tokens_per_second, numpy
    [n, 3] grids, a spec built from a dict with integer-valued numpy fields, grids that exactly fill the stream."""
    np = pytest.importorskip("numpy")
    ids = [VID] * 12
    p = Pack(ids=ids, cu=[0, 12], videos=[[3, 4, 4]], secs=[0.0])
    pos, _, deltas = ours(p, "cpu", tps=2)
    assert pos[0].tolist() == [0] * 12 and deltas.tolist() == [max(pos.max().item(), 0) + 1 - 12]
    for g, w in zip(ours(p, "cpu", tps=2), reference(p, tps=2)):
        assert torch.equal(g, w)
    got = packcuda.mrope_position_ids(torch.tensor(ids), np.array([0, 12]), video_grid_thw=np.array([[3, 4, 4]]),
                                      second_per_grid_ts=np.array([0.5], dtype=np.float32), image_token_id=IMG,
                                      video_token_id=VID, tokens_per_second=np.int64(2))
    want = reference(Pack(ids=ids, cu=[0, 12], videos=[[3, 4, 4]], secs=[0.5]), tps=2)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    spec = packcuda.MRopeSpec.from_hf_config({"model_type": "qwen2_vl", "image_token_id": np.int64(IMG),
                                              "video_token_id": VID, "vision_config": {"spatial_merge_size": 2}})
    assert spec.image_token_id == IMG and type(spec.image_token_id) is int


def test_mrope_status_token():
    """The status word's token, read by the op that owns the layout: -1 for a good status."""
    ops = torch.ops.packcuda
    assert ops.mrope_status_token((1 << 63) - 1) == -1
    assert ops.mrope_status_token(0) == 0
    assert ops.mrope_status_token((37 << 24) | (1 << 21) | 5) == 37
    with pytest.raises(ValueError, match=r"mrope_status_token: status must be a status word .* got -1"):
        ops.mrope_status_token(-1)
