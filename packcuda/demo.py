"""End-to-end demo on a synthetic packed batch. Every step is checked by what must hold of its result (round
trips, sharded == unsharded, invariants) and against other projects' own code (torch's ops, transformers'
``get_rope_index`` and rotary); the plain references that verify each op value by value live with the tests
(tests/reference.py)."""
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
    same = torch.cat([pos[1:] != 0, pos.new_zeros(1, dtype=torch.bool)])  # the next token is in the same sequence
    rep.check("next_token_labels never cross a sequence boundary",
              torch.equal(lab, torch.where(same, ids.roll(-1), -100)))


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
    pos_all, lab_all = packcuda.position_ids(cu, device=device), packcuda.next_token_labels(ids, cu)
    ok = True
    for p in plans:
        lab, keep = p.labels(ids), p.index >= 0
        rows = p.index[keep]
        ok &= torch.equal(p.position_ids[keep], pos_all[rows]) and torch.equal(lab[keep], lab_all[rows])
        ok &= bool((lab[~keep] == -100).all())
    rep.check("positions and labels on every rank == the unsharded ones of its tokens (pads: label -100)", ok)


def _balance(rep: _Report, device: torch.device, rng: random.Random):
    print("micro-batch planning (host)")
    lens = [int(2 ** rng.uniform(5, 13)) for _ in range(200)]
    cap = 16384
    parts = packcuda.plan_micro_batches(lens, cap, multiple_of=2, order="pipeline")
    flat = sorted(i for p in parts for i in p)
    toks = [sum(lens[i] for i in p) for p in parts]
    start = -(-max(-(-sum(lens) // cap), 1) // 2) * 2
    rep.check("every sequence in exactly one micro-batch", flat == list(range(len(lens))))
    rep.check("token cap holds", max(toks) <= cap, f"{len(parts)} micro-batches (start count {start}), "
              f"largest {max(toks)} <= {cap} tokens")
    w = [24576 * n + n * n for n in lens]
    loads = [sum(w[i] for i in p) for p in parts]
    top = loads.index(max(loads))
    rep.check("pipeline order: heaviest in the middle",
              all(loads[j] <= loads[j + 1] for j in range(top))
              and all(loads[j] >= loads[j + 1] for j in range(top, len(loads) - 1)),
              f"max/mean workload {max(loads) / (sum(loads) / len(loads)):.3f}")
    ranks = packcuda.balance_across_ranks(lens, 4, equal_count=True)
    rep.check("balance_across_ranks(equal_count) gives 50 sequences per rank", [len(r) for r in ranks] == [50] * 4)


def _rope(rep: _Report, device: torch.device, rng: random.Random):
    print("mRoPE application")
    # a packed batch of 3 samples: text, an image block (t fixed, h/w over a grid), text; positions restart
    rows = []
    for _ in range(3):
        n_text, gh, gw, n_tail = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 5), rng.randint(1, 15)
        t = list(range(n_text))
        pos = [[p, p, p] for p in t]
        st = n_text
        pos += [[st, st + i, st + j] for i in range(gh) for j in range(gw)]
        nxt = st + max(gh, gw)
        pos += [[nxt + i] * 3 for i in range(n_tail)]
        rows.append(pos)
    lens = [len(r) for r in rows]
    positions = torch.tensor([p for r in rows for p in r], dtype=torch.int64).T.contiguous().to(device)  # [3, T]
    T, Hq, Hk, D = sum(lens), 4, 2, 64
    section, theta = [8, 12, 12], 1e6
    q = torch.randn(T, Hq, D, device=device)
    k = torch.randn(T, Hk, D, device=device)
    qo, ko = packcuda.apply_rope(q, k, positions, rope_theta=theta, mrope_section=section)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)

    # a rotation: every head keeps its norm, and the first token of every sample (position (0, 0, 0)) stays
    err = max(float((o.norm(dim=-1) - i.norm(dim=-1)).abs().max()) for o, i in ((qo, q), (ko, k)))
    first = torch.tensor(cu[:-1], device=device)
    still = all(torch.allclose(o[first], i[first], atol=1e-6) for o, i in ((qo, q), (ko, k)))
    rep.check("apply_rope (sectioned mRoPE) rotates: head norms kept, position 0 unchanged", err < 1e-4 and still,
              f"max |norm diff| {err:.1e} (values: transformers' rotary in the last section)")

    # the same batch sharded over 2 CP ranks (zigzag): each rank rotates its own tokens with its positions
    plans = [packcuda.shard_plan(cu, 2, r, device=device) for r in range(2)]
    outs_q, outs_k = [], []
    for plan in plans:
        ql, kl = plan.shard(q), plan.shard(k)
        pl = plan.shard(positions, dim=1)
        packcuda.apply_rope_(ql, kl, pl, rope_theta=theta, mrope_section=section)  # in place on the shard
        outs_q.append(ql)
        outs_k.append(kl)
    sq = plans[0].unshard(torch.stack(outs_q))
    sk = plans[0].unshard(torch.stack(outs_k))
    rep.check("CP shards (2 ranks, zigzag) rotated locally == whole stream",
              torch.equal(sq, qo) and torch.equal(sk, ko), f"{T} tokens, {plans[0].total_local} per rank")


def _mrope(rep: _Report, device: torch.device, rng: random.Random):
    print("mRoPE position ids")
    IMG, VID, m, tps = 151655, 151656, 2, 2
    ids, cu, images, videos, secs = [], [0], [], [], []
    for _ in range(5):  # five samples: text, images, a video with fractional seconds per grid
        for _ in range(rng.randint(0, 3)):
            ids += [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
            if rng.random() < 0.6:
                g = [1, m * rng.randint(1, 4), m * rng.randint(1, 4)]
                images.append(g)
                ids += [IMG] * (g[1] * g[2] // m**2)
            else:
                g = [rng.randint(1, 4), m * rng.randint(1, 3), m * rng.randint(1, 3)]
                videos.append(g)
                secs.append(rng.choice([0.5, 1.0, 2.0 / 3.0]))
                ids += [VID] * (g[0] * g[1] * g[2] // m**2)
        ids += [rng.randrange(1000) for _ in range(rng.randint(1, 8))]
        cu.append(len(ids))
    x = torch.tensor(ids, device=device)
    pos, text_pos, deltas = packcuda.mrope_position_ids(
        x, cu, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=secs, image_token_id=IMG,
        video_token_id=VID, spatial_merge_size=m, tokens_per_second=tps)
    text = (x != IMG) & (x != VID)
    rep.check("text tokens take one position on all three axes",
              torch.equal(pos[0][text], pos[1][text]) and torch.equal(pos[0][text], pos[2][text]),
              f"{len(cu) - 1} samples, {len(ids)} tokens, {len(images)} images, {len(videos)} videos (values: "
              "transformers' get_rope_index in the last section)")
    rep.check("text_pos restarts per sample", torch.equal(text_pos.cpu(), packcuda.position_ids(cu)))
    want = pos.cpu()
    d = [int(want[:, a:b].max()) + 1 - (b - a) for a, b in zip(cu[:-1], cu[1:])]
    rep.check("deltas = max position + 1 - length", deltas.cpu().tolist() == d)
    if hasattr(packcuda, "shard_plan"):
        pos4 = torch.cat([text_pos[None], pos])
        parts = []
        for r in range(2):
            plan = packcuda.shard_plan(cu, 2, r, device=device)
            local = plan.shard(pos4, dim=1)
            keep = plan.index >= 0
            parts.append(torch.equal(local[:, keep], pos4[:, plan.index[keep]]))
        rep.check("cp=2 shards: plan.shard(pos, dim=1) gives each rank its tokens' positions", all(parts))


def _conv(rep: _Report, device: torch.device, rng: random.Random):
    print("conv-prefix exchange + varlen causal conv1d (cp=2 zigzag, K=4; the exchange is simulated in this one")
    print("  process by moving rows exactly as each rank's schedule says, instead of through a process group)")
    K, C, cp = 4, 16, 2
    lens = [rng.randint(1, 40) for _ in range(5)] + [1, 2]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], C, device=device)
    w, b = torch.randn(C, K, device=device), torch.randn(C, device=device)
    y = packcuda.causal_conv1d(x, w, b, cu_seqlens=cu, activation="silu")
    want = torch.cat([torch.nn.functional.silu(torch.nn.functional.conv1d(
        x[a:e].t()[None], w[:, None], b, padding=K - 1, groups=C)[0, :, :e - a].t()) for a, e in zip(cu[:-1], cu[1:])])
    rep.check("causal_conv1d == F.conv1d per sequence", torch.allclose(y, want, atol=1e-5),
              f"{len(lens)} sequences, {cu[-1]} tokens")
    plans = [packcuda.shard_plan(cu, cp, r, layout="zigzag", device=device) for r in range(cp)]
    scheds = [packcuda.conv_prefix_schedule(p, K) for p in plans]
    xs = [p.shard(x) for p in plans]  # every rank's slots (pad rows are zero and come after a sequence's tokens)
    ok = True
    for q in range(cp):
        recv = []
        for p in range(cp):  # what rank p's schedule sends to rank q
            off = sum(scheds[p].send_counts[:q])
            idx = scheds[p].send_index[off:off + scheds[p].send_counts[q]].to(device)
            recv.append(xs[p][idx])
        prefix = torch.ops.packcuda.exchange_gather_sum(xs[q], torch.cat(recv), scheds[q].on(device)[1])
        prefix = prefix.view(scheds[q].n_pieces, K - 1, C)
        yq = packcuda.causal_conv1d(xs[q], w, b, cu_seqlens=plans[q].pieces, prefix=prefix, activation="silu")
        keep = plans[q].index >= 0
        ok &= torch.allclose(yq[keep], y[plans[q].index[keep]], atol=1e-5)
        print(f"    rank {q}: {len(plans[q].pieces_host) - 1} pieces, receives {scheds[q].rows_moved} rows, "
              f"sends {sum(scheds[q].send_counts)}")
    rep.check("sharded conv (schedule exchange + prefix) == unsharded conv on every rank's tokens", ok)


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
    # transformers' own positions: get_rope_index on every sample alone, text positions restarting per sample
    per_sample = [model.model.get_rope_index(ids[None], image_grid_thw=torch.tensor(g, device=device) if g else None,
                                             mm_token_type_ids=hf.mm_token_type_ids(ids[None], cfg))[0][:, 0]
                  for ids, g in samples]
    want = torch.cat([packcuda.position_ids(cu, device=device)[None], torch.cat(per_sample, dim=1)])[:, None, :]
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
    """Runs every capability on a synthetic packed batch and checks each result (``python -m packcuda demo``).

    Args:
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when a GPU is present and the library has CUDA kernels.
        seed: the seed of the synthetic batch.

    Returns:
        The exit status: 0 when every check passed, else 1 (each check is printed as it runs).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and packcuda.built_with_cuda() else "cpu"))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    print(f"packcuda demo on {dev} (torch {torch.__version__}, CUDA kernels: {packcuda.built_with_cuda()})")
    rep = _Report()
    _packing(rep, dev, rng)
    _shard(rep, dev, rng)
    _balance(rep, dev, rng)
    _rope(rep, dev, rng)
    _mrope(rep, dev, rng)
    _conv(rep, dev, rng)
    _hf(rep, dev, rng)
    n_ok = sum(r[1] for r in rep.rows)
    print(f"demo: {n_ok}/{len(rep.rows)} checks passed")
    return 0 if rep.ok else 1
