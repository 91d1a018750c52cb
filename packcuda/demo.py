"""End-to-end demo on a synthetic packed batch: every step is checked against a plain Python version."""
from __future__ import annotations

import random

import torch

import packcuda


class _Report:
    def __init__(self):
        self.rows = []

    def check(self, name: str, ok: bool, detail: str = ""):
        self.rows.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{(': ' + detail) if detail else ''}")

    @property
    def ok(self) -> bool:
        return all(r[1] for r in self.rows)


def _packing(rep: _Report, device: torch.device, rng: random.Random):
    print("packing")
    B, S, H = 6, 64, 32
    lens = [rng.randint(0, S) for _ in range(B)]
    x = torch.randn(B, S, H, device=device)
    mask = torch.arange(S, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    xp, idx, cu, mx = packcuda.unpad(x, lengths=lens)
    rep.check("unpad (host lengths)", torch.equal(xp, x[mask]), f"{B}x{S} -> {xp.shape[0]} tokens, max_seqlen {mx}")
    xp2, idx2, cu2, _ = packcuda.unpad(x, mask)
    rep.check("unpad (attention_mask) == unpad (lengths)", torch.equal(xp, xp2) and torch.equal(cu, cu2))
    rep.check("pad(unpad(x)) == x * mask", torch.equal(packcuda.pad(xp, idx, B, S), x * mask[..., None]))
    cu_host = [0]
    for n in lens:
        cu_host.append(cu_host[-1] + n)
    pos = packcuda.position_ids(cu_host, device=device)
    want = torch.cat([torch.arange(n) for n in lens])
    rep.check("position_ids restart per sequence", torch.equal(pos.cpu(), want))
    ids = torch.randint(0, 1000, (cu_host[-1],), device=device)
    lab = packcuda.next_token_labels(ids, cu_host)
    ok = all(
        (lab[t].item() == (ids[t + 1].item() if t + 1 < cu_host[i + 1] else -100))
        for i in range(B)
        for t in range(cu_host[i], cu_host[i + 1])
    )
    rep.check("next_token_labels never cross a sequence boundary", ok)


def _shard(rep: _Report, device: torch.device, rng: random.Random):
    print("shard plans (context parallelism)")
    cp = 4
    lens = [rng.randint(1, 40) for _ in range(5)] + [0]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T = cu[-1]
    plans = [packcuda.shard_plan(cu, cp, r, device=device, bucket=64) for r in range(cp)]
    print(f"  lengths {lens} -> padded {plans[0].cu_seqlens_padded_host} (bucket segment of {plans[0].pad_size})")
    for p in plans:
        runs = [f"s{q}[{o}:{o + b - a})" for a, b, o, q in
                zip(p.pieces_host[:-1], p.pieces_host[1:], p.piece_offset_host, p.piece_seq_host) if b > a]
        print(f"  rank {p.cp_rank}: {p.total_local} slots  " + " ".join(runs))
    x = torch.randn(T, 8, device=device)
    ids = torch.randint(0, 1000, (T,), device=device)
    shards = [p.shard(x) for p in plans]
    rep.check("every token on exactly one rank",
              sorted(i for p in plans for i in p.index.tolist() if i >= 0) == list(range(T)))
    rep.check("unshard(all ranks' shards) == x", all(torch.equal(p.unshard(torch.stack(shards)), x) for p in plans))
    ok = True
    for p in plans:
        lab = p.labels(ids).tolist()
        for s, (row, pos) in enumerate(zip(p.index.tolist(), p.position_ids.tolist())):
            if row < 0:
                ok &= lab[s] == -100
                continue
            i = max(j for j in range(len(lens)) if cu[j] <= row)  # plain: the sequence holding the row
            ok &= pos == row - cu[i]
            ok &= lab[s] == (ids[row + 1].item() if row + 1 < cu[i + 1] else -100)
    rep.check("positions and labels match the per-sequence definition on every rank", ok)


def _hf(rep: _Report, device: torch.device, rng: random.Random):
    print("transformers Qwen-VL drop-in (packed row, packcuda positions and rotary)")
    try:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from .integrations import transformers as hf
    except ImportError as e:
        print(f"  skipped: {e}")
        return
    V = 200
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
        vision_config=dict(depth=1, hidden_size=32, out_hidden_size=128, intermediate_size=64, num_heads=2),
        image_token_id=V - 4, video_token_id=V - 3, vision_start_token_id=V - 2, vision_end_token_id=V - 1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(device).eval()
    samples, grids = [], []
    for n_img in (0, 1, 2):  # three samples, with 0, 1 and 2 images (placeholders + grids; no pixels)
        ids = [rng.randrange(0, V - 8) for _ in range(rng.randint(2, 6))]
        for _ in range(n_img):
            h, w = 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)
            grids.append([1, h, w])
            ids += [V - 2] + [V - 4] * (h * w // 4) + [V - 1] + [rng.randrange(0, V - 8) for _ in range(3)]
        samples.append((torch.tensor(ids, device=device), grids[len(grids) - n_img:]))
    cu = [0]
    for ids, _ in samples:
        cu.append(cu[-1] + ids.numel())
    packed = torch.cat([ids for ids, _ in samples])
    want = hf.hf_packed_position_ids(model, packed, cu, image_grid_thw=grids)
    have_pos = hasattr(packcuda, "mrope_position_ids")
    if have_pos:
        pos = hf.packed_position_ids(packed, cu, cfg, image_grid_thw=grids)
        rep.check("packed [4,1,T] positions == transformers' get_rope_index per sample", torch.equal(pos.cpu(),
                                                                                                    want.cpu()))
    else:
        pos = want
        print("  packcuda.mrope_position_ids not in this build: transformers' positions used")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[None], use_cache=False, image_grid_thw=torch.tensor(g).reshape(-1, 3)
                                 if g else None, mm_token_type_ids=hf.mm_token_type_ids(ids[None], cfg)).logits[0]
                           for ids, g in samples])
        packed_logits = model(input_ids=packed[None], position_ids=pos, use_cache=False).logits[0]
        rep.check("one packed row == each sample alone (logits)", torch.allclose(packed_logits, alone, atol=1e-4),
                  f"{len(samples)} samples, {packed.numel()} tokens")
        if hasattr(packcuda, "apply_rope"):
            with hf.patch_qwen_vl_rope(model):
                patched = model(input_ids=packed[None], position_ids=pos, use_cache=False).logits[0]
            rep.check("rotary through packcuda.apply_rope == transformers' rotary (logits)",
                      torch.allclose(patched, packed_logits, atol=1e-4))
        else:
            print("  packcuda.apply_rope not in this build: rotary patch not shown")


def run(device: str | None = None, seed: int = 0) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu"))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packcuda demo on {dev} (torch {torch.__version__}, CUDA kernels: {packcuda.built_with_cuda()})")
    rep = _Report()
    _packing(rep, dev, rng)
    _shard(rep, dev, rng)
    _hf(rep, dev, rng)
    n_ok = sum(r[1] for r in rep.rows)
    print(f"demo: {n_ok}/{len(rep.rows)} checks passed")
    return 0 if rep.ok else 1
