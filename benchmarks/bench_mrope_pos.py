"""mRoPE position ids for a packed multimodal batch (Qwen2.5-VL rules: fractional video intervals) vs
transformers' ``get_rope_index`` run on every sample, the way trainers compute them today.

64 samples of 2k-16k tokens with 0-6 images and 0-2 videos each (quick / CPU: fewer, shorter samples).
The baseline gets its per-sample tensors ready on the device beforehand; only the get_rope_index loop is timed.

    python -m benchmarks.bench_mrope_pos [--quick] [--device cuda]
"""
from __future__ import annotations

import functools
import inspect
import random
from types import SimpleNamespace

import torch

import packcuda
from benchmarks.harness import Timer, cli

IMG, VID, VSTART, VEND = 151655, 151656, 151652, 151653
MERGE, TPS = 2, 2


def make_batch(rng: random.Random, n: int, lo: int, hi: int):
    """Per sample: (ids, image grids, video grids, second_per_grid_ts), vision blocks wrapped in start/end."""
    from packcuda.integrations.transformers import truncates_video_seconds

    int_seconds = truncates_video_seconds()  # older transformers releases drop fractional seconds
    samples = []
    for _ in range(n):
        L = rng.randint(lo, hi)
        items = []
        budget = L - 8
        for kind in ["image"] * rng.randint(0, 6) + ["video"] * rng.randint(0, 2):
            if kind == "image":
                g = [1, MERGE * rng.randint(4, 24), MERGE * rng.randint(4, 24)]
            else:
                g = [rng.randint(1, 8), MERGE * rng.randint(4, 16), MERGE * rng.randint(4, 16)]
            n_tok = g[0] * g[1] * g[2] // MERGE**2
            if n_tok + 2 > budget // 2:
                continue
            budget -= n_tok + 2
            items.append((kind, g, n_tok))
        rng.shuffle(items)
        text_left = L - sum(n_tok + 2 for _, _, n_tok in items)
        cuts = sorted(rng.randint(0, text_left) for _ in range(len(items)))
        ids, imgs, vids, secs, prev = [], [], [], [], 0
        for (kind, g, n_tok), c in zip(items, cuts):
            ids += [rng.randrange(150000) for _ in range(c - prev)]
            prev = c
            ids += [VSTART] + [IMG if kind == "image" else VID] * n_tok + [VEND]
            if kind == "image":
                imgs.append(g)
            else:
                vids.append(g)
                secs.append(rng.choice([1.0, 2.0] if int_seconds else [0.5, 1.0 / 3.0, 2.0 / 3.0, 1.0]))
        ids += [rng.randrange(150000) for _ in range(text_left - prev)]
        samples.append((ids, imgs, vids, secs))
    return samples


def hf_get_rope_index():
    """transformers' Qwen2.5-VL get_rope_index, bound to a namespace holding a tiny config."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as M

    ns = SimpleNamespace(config=SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=TPS),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART))
    if hasattr(M, "get_vision_position_ids"):
        ns.get_vision_position_ids = functools.partial(M.get_vision_position_ids, ns)
    takes_types = "mm_token_type_ids" in inspect.signature(M.get_rope_index).parameters
    return functools.partial(M.get_rope_index, ns), takes_types


def run(quick: bool = False, device=None) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type == "cpu"
    n, lo, hi = (4, 512, 2048) if (cpu or quick) else (64, 2048, 16384)
    rng = random.Random(0)
    samples = make_batch(rng, n, lo, hi)
    ids_host = [t for s in samples for t in s[0]]
    cu = [0]
    for s in samples:
        cu.append(cu[-1] + len(s[0]))
    images = [g for s in samples for g in s[1]]
    videos = [g for s in samples for g in s[2]]
    secs = [x for s in samples for x in s[3]]
    ids = torch.tensor(ids_host, dtype=torch.int64, device=dev)
    T = len(ids_host)
    kw = dict(image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=secs, image_token_id=IMG,
              video_token_id=VID, spatial_merge_size=MERGE, tokens_per_second=TPS)

    pos, text_pos, deltas = packcuda.mrope_position_ids(ids, cu, **kw)

    rows = []
    timer = Timer(dev, warmup=3 if cpu else 10, reps=5 if cpu else 100)
    shape = f"{n} samples, T={T}, {len(images)} images, {len(videos)} videos"
    t_fast = timer.median_ms(lambda: packcuda.mrope_position_ids(ids, cu, validate=False, **kw))
    t_val = timer.median_ms(lambda: packcuda.mrope_position_ids(ids, cu, validate=True, **kw))
    # the same host metadata as CPU tensors (what HF processors return for the grids): no list conversion
    kw_t = dict(kw, image_grid_thw=torch.tensor(images, dtype=torch.int64).reshape(-1, 3),
                video_grid_thw=torch.tensor(videos, dtype=torch.int64).reshape(-1, 3),
                second_per_grid_ts=torch.tensor(secs, dtype=torch.float32))
    cu_t = torch.tensor(cu, dtype=torch.int64)
    p_t = packcuda.mrope_position_ids(ids, cu_t, validate=False, **kw_t)
    assert all(torch.equal(a, b) for a, b in zip(p_t, (pos, text_pos, deltas)))
    t_tensors = timer.median_ms(lambda: packcuda.mrope_position_ids(ids, cu_t, validate=False, **kw_t))

    baseline, hf_ms = "n/a (transformers not installed)", float("nan")
    try:
        get_rope_index, takes_types = hf_get_rope_index()
    except ImportError:
        get_rope_index = None
    if get_rope_index is not None:
        per = []
        for s in samples:
            x = torch.tensor(s[0], dtype=torch.int64, device=dev)[None]
            a = dict(image_grid_thw=torch.tensor(s[1], device=dev) if s[1] else None,
                     video_grid_thw=torch.tensor(s[2], device=dev) if s[2] else None,
                     second_per_grid_ts=torch.tensor(s[3], dtype=torch.float32, device=dev) if s[2] else None)
            if takes_types:
                a["mm_token_type_ids"] = ((x == IMG).int() + 2 * (x == VID).int())
            per.append((x, a))

        def hf_all():
            return [get_rope_index(x, **a) for x, a in per]

        out = hf_all()  # correctness in the same run
        for i, (p, d) in enumerate(out):
            assert torch.equal(p[:, 0], pos[:, cu[i]:cu[i + 1]]), f"sample {i} differs from transformers"
            assert int(d.reshape(-1)[0]) == int(deltas[i])
        hf_ms = Timer(dev, warmup=1, reps=3).median_ms(hf_all)
        baseline = "transformers get_rope_index per sample"
    for op, t in [("mrope_position_ids (validate=False, no sync)", t_fast),
                  ("mrope_position_ids (validate=True, one sync)", t_val),
                  ("mrope_position_ids (validate=False, grids/cu_seqlens as CPU tensors)", t_tensors)]:
        rows.append(dict(op=op, shape=shape, packcuda_ms=t, baseline=baseline, baseline_ms=hf_ms,
                         speedup=hf_ms / t, us_per_batch=1e3 * t))
    if not cpu:
        ids_cpu = ids.cpu()
        t_cpu = Timer("cpu", warmup=1, reps=5).median_ms(lambda: packcuda.mrope_position_ids(ids_cpu, cu, **kw))
        rows.append(dict(op="mrope_position_ids on CPU (same batch)", shape=shape, packcuda_ms=t_cpu,
                         baseline=baseline, baseline_ms=hf_ms, speedup=hf_ms / t_cpu, us_per_batch=1e3 * t_cpu))
    return rows


def main():
    cli(run, "mRoPE position ids: packed multimodal batch vs transformers get_rope_index",
           notes="Qwen2.5-VL rules (tokens_per_second=2, fractional second_per_grid_ts), host grids and cu_seqlens; "
                 "outputs checked equal to transformers in the same run. Times include the Python facade and the "
                 "host-side block table.")


if __name__ == "__main__":
    main()
