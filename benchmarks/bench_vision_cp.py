"""Vision towers under context parallelism: per-rank ViT work, memory and traffic of ``packcuda.vision_plan``.

A pack of 64 samples with images and videos at Qwen2.5-VL-7B vision shapes (patch 14, spatial merge 2,
temporal patch 2; tower width 1280, depth 32, output width 3584; images of 16..48 x 16..48 patches, videos of
2..8 temporal steps of 12..28 x 12..28 patches, 64..512 text tokens per sample). For cp = 2, 4, 8, zigzag and
contiguous shard plans, ``unit="image"`` and ``unit="frame"``, computed from the plan (every rank's plan is the
same computation; rank 0's is used):

- ViT work per rank: patches and attention pairs (sum over temporal steps of patches_per_step**2) when every rank
  encodes everything (replicated: today's default) and on the most loaded rank of the split, with the balance
  (largest rank cost / mean rank cost);
- memory: the block inputs the tower keeps under activation checkpointing (patches x 1280 x 32 layers, bf16);
- traffic: rows (and bytes of 3584-wide bf16 embeddings) the route sends between ranks, against an all-gather
  of every embedding to every rank (what DP-over-CP designs do);
- host time of ``vision_plan`` for one rank (one host thread, as in a data-loader worker).

With a GPU: the Qwen2.5-VL-7B tower (transformers, random bf16 weights, sdpa, activation checkpointing)
forward+backward timed on the whole pack (a replicated rank) and on the most loaded rank's share, with peak
memory. Rows of the multi-GPU wall clock (tower + route on cp GPUs) are listed as not run.

``python benchmarks/bench_vision_cp.py [--quick] [--device cuda|cpu] [--no-write]``
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import packcuda  # noqa: E402
from benchmarks.harness import Timer, cli  # noqa: E402

IMG, VID, TEXT = 151655, 151656, 100
PATCH, MERGE, TPATCH = 14, 2, 2
WIDTH, DEPTH, OUT_WIDTH = 1280, 32, 3584
PATCH_DIM = 3 * TPATCH * PATCH * PATCH
BF16 = 2


def make_pack(n_samples=64, seed=0, scale=1):
    """(ids, cu, image grids, video grids) of a random pack; `scale` divides the grid sides (quick runs)."""
    rng = random.Random(seed)
    ids, cu, images, videos = [], [0], [], []

    def side(lo, hi):
        return MERGE * max(1, rng.randint(lo, hi) // (2 * scale))

    for _ in range(n_samples):
        ids += [TEXT] * rng.randint(32, 256)
        if rng.random() < 0.6:
            for _ in range(rng.randint(1, 2)):
                h, w = side(16, 48), side(16, 48)
                images.append([1, h, w])
                ids += [IMG] * (h * w // MERGE ** 2) + [TEXT] * rng.randint(4, 32)
        else:
            t, h, w = rng.randint(2, 8), side(12, 28), side(12, 28)
            videos.append([t, h, w])
            ids += [VID] * (t * h * w // MERGE ** 2)
        ids += [TEXT] * rng.randint(32, 256)
        cu.append(len(ids))
    return torch.tensor(ids, dtype=torch.int64), cu, images, videos


def _plan(pack, cp, rank, layout, unit):
    ids, cu, images, videos = pack
    plan = packcuda.shard_plan(cu, cp, rank, layout=layout)
    return packcuda.vision_plan(ids, cu, plan, image_grid_thw=images or None, video_grid_thw=videos or None,
                                image_token_id=IMG, video_token_id=VID, spatial_merge_size=MERGE, unit=unit)


def plan_rows(pack, cps=(2, 4, 8)):
    _, _, images, videos = pack
    grids = images + videos
    patches = sum(t * h * w for t, h, w in grids)
    pairs = sum(t * (h * w) ** 2 for t, h, w in grids)
    V = sum(t * h * w for t, h, w in grids) // MERGE ** 2
    gb = lambda n: n * WIDTH * DEPTH * BF16 / 2**30  # noqa: E731  (block inputs kept under checkpointing)
    emb = lambda rows: rows * OUT_WIDTH * BF16 / 2**20  # noqa: E731
    rows = []
    for cp in cps:
        for layout in ("zigzag", "contiguous"):
            for unit in ("image", "frame"):
                threads = torch.get_num_threads()
                torch.set_num_threads(1)  # as in a data-loader worker
                try:
                    plan_ms = Timer(torch.device("cpu"), warmup=1, reps=5).median_ms(
                        lambda: _plan(pack, cp, 0, layout, unit))
                finally:
                    torch.set_num_threads(threads)
                vp = _plan(pack, cp, 0, layout, unit)
                tr = vp.traffic
                sent = int(tr.sum() - tr.diagonal().sum())
                recv = [int(tr[:, r].sum() - tr[r, r]) for r in range(cp)]
                ag = [V - n for n in vp.rank_rows]  # an all-gather brings every other rank's rows
                mean_cost = sum(vp.rank_cost) / cp
                rows.append(dict(
                    op="vision plan", shape=f"cp={cp} {layout} unit={unit}",
                    units=vp.n_units, patches_replicated=patches, patches_max_rank=max(vp.rank_patches),
                    patches_min_rank=min(vp.rank_patches), attn_pairs_replicated=pairs,
                    attn_pairs_max_rank=max(vp.rank_attention), cost_max_over_mean=max(vp.rank_cost) / mean_cost,
                    block_inputs_gb_replicated=gb(patches), block_inputs_gb_max_rank=gb(max(vp.rank_patches)),
                    route_rows_sent=sent, route_mb_max_rank_recv=emb(max(recv)),
                    allgather_rows_sent=(cp - 1) * V, allgather_mb_max_rank_recv=emb(max(ag)),
                    route_vs_allgather_bytes=sent / max(1, (cp - 1) * V), plan_host_ms=plan_ms))
    return rows


def _tower(device, quick):
    """The Qwen2.5-VL-7B vision tower (quick: a 2-layer narrow one), random weights, bf16 on CUDA."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    kw = dict(depth=DEPTH, hidden_size=WIDTH, intermediate_size=3420, num_heads=16, out_hidden_size=OUT_WIDTH,
              window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
    if quick:
        kw = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64, window_size=112,
                  fullatt_block_indexes=[1])
    cfg = transformers.Qwen2_5_VLConfig(vision_config=dict(patch_size=PATCH, spatial_merge_size=MERGE,
                                                           temporal_patch_size=TPATCH, in_channels=3, **kw))
    vc = cfg.vision_config
    vc._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vc, dtype=dtype)
    enable = getattr(tower, "activation_checkpointing_enable", None) or tower.gradient_checkpointing_enable
    enable()
    tower.train()
    return tower, dtype


def tower_rows(pack, device, quick, cps=(2, 4, 8)):
    """Forward+backward of the tower on the whole pack and on the most loaded rank's share."""
    _, _, images, videos = pack
    tower, dtype = _tower(device, quick)
    g = torch.Generator(device="cpu").manual_seed(0)
    n_img = sum(t * h * w for t, h, w in images)
    n_vid = sum(t * h * w for t, h, w in videos)
    pv_img = torch.randn(n_img, PATCH_DIM, generator=g).to(device, dtype)
    pv_vid = torch.randn(n_vid, PATCH_DIM, generator=g).to(device, dtype)
    # a step of the whole pack takes seconds at full size: one warm-up before the first (largest) measurement, the
    # median of two steps for each; progress goes to stderr as each row is measured
    timer = Timer(device, warmup=0, reps=2)

    def step(pv, grid):
        out = tower(pv, grid_thw=grid).pooler_output
        out.float().square().mean().backward()

    def measure(pv, grid, what, warmup=0):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        ms = timer.median_ms(lambda: step(pv, grid), warmup=warmup)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        print(f"bench_vision_cp: tower fwd+bwd, {what}: {pv.shape[0]} patches, {ms:.1f} ms", file=sys.stderr,
              flush=True)
        return ms, peak

    everything = torch.cat([pv_img, pv_vid])
    full_grid = torch.tensor(images + videos, dtype=torch.int64).to(device)
    base_ms, base_peak = measure(everything, full_grid, "replicated", warmup=1)
    rows = [dict(op="Qwen2.5-VL-7B tower fwd+bwd, one rank", shape="replicated (every rank encodes all)",
                 patches=n_img + n_vid, tower_ms=base_ms, peak_gb=base_peak, speedup=1.0)]
    todo = [(cp, unit) for cp in cps for unit in ("image", "frame")]
    tower_op = rows[0]["op"]
    try:
        for cp, unit in todo:
            vps = [_plan(pack, cp, r, "zigzag", unit) for r in range(cp)]
            vp = max(vps, key=lambda v: sum(t * h * w for t, h, w in v.local_grid_thw.tolist()))
            pv = vp.local_pixel_values(pv_img if n_img else None, pv_vid if n_vid else None)
            ms, peak = measure(pv, vp.local_grid_thw.to(device), f"cp={cp} unit={unit}")
            rows.append(dict(op=tower_op, shape=f"cp={cp} unit={unit}, most loaded rank", patches=pv.shape[0],
                             tower_ms=ms, peak_gb=peak, speedup=base_ms / ms))
    except KeyboardInterrupt:  # a run stopped with SIGINT keeps the rows it measured and names the rest
        rows += [dict(op=tower_op, shape=f"cp={cp} unit={unit}, most loaded rank",
                      status="not measured (the run was interrupted)") for cp, unit in todo[len(rows) - 1:]]
    return rows


def run(quick=False, device=None) -> list[dict]:
    device = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    pack = make_pack(n_samples=8 if quick else 64, scale=4 if quick else 1)
    rows = plan_rows(pack)
    if device.type == "cuda" or quick:
        rows += tower_rows(pack, device, quick)
    for cp in (2, 4, 8):
        rows.append(dict(op="tower + route wall clock", shape=f"cp={cp} on {cp} GPUs",
                         status=f"not run (needs {cp} GPUs)"))
    return rows


if __name__ == "__main__":
    cli(run, "vision towers under CP (Qwen2.5-VL-7B shapes, 64-sample pack)",
        notes="Computed from the plan (rank 0's; every rank computes the same): patches / attention pairs per "
              "rank replicated vs the most loaded rank of the split; block inputs = patches x 1280 x 32 layers "
              "x 2 bytes (what activation checkpointing keeps); route rows cross ranks only where the encoding "
              "rank is not the holder, an all-gather sends every row to every other rank (3584-wide bf16). "
              "Tower rows: transformers' Qwen2.5-VL-7B vision tower with random bf16 weights, sdpa, activation "
              "checkpointing, forward+backward, median of 2 steps after one warm-up; speedup = replicated time / the "
              "rank's time.")
