"""The verl recipe of docs/integrations/verl.md: shard plans with a bucket reproduce verl's FSDP-engine padding and
Ulysses slicing (contiguous) and its Megatron-engine THD preprocessing (zigzag).

verl is not a dependency; the verl steps are written out here from their documented behaviour (packed row
``[1, T]`` with per-sample positions, ``pad_packed_inputs``: the bucket pad appended as its own segment with
positions ``arange(pad)`` on every rope row, then Ulysses' pad to a multiple of ``sp`` and contiguous slice;
the THD path: every sequence padded to ``2*cp`` at its tail, chunks ``r`` and ``2*cp-1-r`` per sequence)."""
import random

import pytest
import torch

import packcuda
import reference as ref

IGNORE = -100


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _pack(lens, rows, seed):
    g = torch.Generator().manual_seed(seed)
    cu = _cu(lens)
    ids = torch.randint(1, 1000, (cu[-1],), generator=g)
    pos = ref.position_ids(cu).expand(rows, -1).clone()
    if rows == 4:  # text row, then t/h/w rows (anything per token here)
        pos[1:] += torch.randint(0, 3, (3, cu[-1]), generator=g)
    return cu, ids, pos


def _verl_fsdp(ids, pos, cu, bucket, sp, rank):
    """verl FSDP engine: labels rolled over the whole pack (the last label of each sample masked),
    pad_packed_inputs to a multiple of ``bucket`` (positions arange(pad) on every row), ulysses_pad to a multiple
    of ``sp`` (positions arange(pad)), contiguous slice of rank ``rank``."""
    T = ids.numel()
    labels = torch.roll(ids, -1)
    mask = torch.ones(T)
    mask[torch.tensor(cu[1:]) - 1] = 0
    pad = -(-T // bucket) * bucket - T
    ids, labels, mask = (torch.cat([t, t.new_full((pad,), v)]) for t, v in ((ids, 0), (labels, 0), (mask, 0)))
    pos = torch.cat([pos, torch.arange(pad).expand(pos.shape[0], -1)], dim=1)
    pad2 = (sp - ids.numel() % sp) % sp
    ids, labels, mask = (torch.cat([t, t.new_full((pad2,), v)]) for t, v in ((ids, 0), (labels, 0), (mask, 0)))
    pos = torch.cat([pos, torch.arange(pad2).expand(pos.shape[0], -1)], dim=1)
    n = ids.numel() // sp
    sl = slice(rank * n, (rank + 1) * n)
    return ids[sl], pos[:, sl], labels[sl], mask[sl]


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("bucket", [8, 64])
def test_contiguous_bucket_is_verl_pad_packed_inputs_then_ulysses(sp, rows, bucket):
    rng = random.Random(sp * 100 + bucket + rows)
    for trial in range(4):
        lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
        cu, ids, pos = _pack(lens, rows, trial)
        for rank in range(sp):
            v_ids, v_pos, v_labels, v_mask = _verl_fsdp(ids, pos, cu, bucket, sp, rank)
            # the recipe
            plan = packcuda.shard_plan(cu, sp, rank, layout="contiguous", bucket=bucket)
            l_ids = plan.shard(ids)
            l_pos = plan.shard_positions(pos)
            l_labels = plan.labels(ids)
            l_mask = (l_labels != IGNORE).float()
            assert torch.equal(l_ids, v_ids) and torch.equal(l_pos, v_pos), (lens, sp, rank)
            assert torch.equal(l_mask, v_mask)
            keep = v_mask.bool()  # verl's rolled labels are right where its loss mask is 1
            assert torch.equal(l_labels[keep], v_labels[keep])


def _verl_thd_zigzag(ids, cu, cp, rank):
    """verl's THD preprocessing without a bucket: every sequence padded to a multiple of 2*cp at its tail,
    this rank's chunks r and 2*cp-1-r of each; labels the next token of the same sequence (-100 at the last);
    positions the offset in the sequence, 0 at pads."""
    align = 2 * cp
    labels = ref.next_token_labels(ids, cu, IGNORE)
    out_ids, out_labels, out_pos = [], [], []
    for a, b in zip(cu[:-1], cu[1:]):
        L = b - a
        P = -(-L // align) * align
        h = P // align
        for c in (rank, 2 * cp - 1 - rank):
            for o in range(c * h, (c + 1) * h):
                out_ids.append(int(ids[a + o]) if o < L else 0)
                out_labels.append(int(labels[a + o]) if o < L else IGNORE)
                out_pos.append(o if o < L else 0)  # verl writes 0 at pads
    return torch.tensor(out_ids), torch.tensor(out_labels), torch.tensor(out_pos)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_bucket_is_verl_thd_preprocessing(cp):
    """Where verl adds no bucket pad (the padded total already a multiple of the bucket), the zigzag plan with
    that bucket is verl's THD split: tokens, labels (correct at every chunk boundary), positions of the real
    tokens."""
    rng = random.Random(cp)
    align = 2 * cp
    n = 0
    while n < 6:
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 5))]
        total = sum(-(-L // align) * align for L in lens)
        bucket = next(b for b in (4 * align, 2 * align, align) if total % b == 0)
        cu, ids, _ = _pack(lens, 1, n)
        for rank in range(cp):
            v_ids, v_labels, v_pos = _verl_thd_zigzag(ids, cu, cp, rank)
            plan = packcuda.shard_plan(cu, cp, rank, layout="zigzag", bucket=bucket)
            assert plan.pad_size == 0
            assert torch.equal(plan.shard(ids), v_ids)
            assert torch.equal(plan.labels(ids), v_labels)
            real = plan.index >= 0  # pads: verl writes 0, the plan counts on through the tail (Megatron's way)
            assert torch.equal(plan.position_ids[real], v_pos[real])
        n += 1


def test_zigzag_bucket_lengths_4_22_cp4_rank3():
    """The docs example: lengths [4, 22], cp=4, bucket 64. The real sequences keep their 2*cp padding (8 and
    24 rows) and the 32 bucket rows are a segment of their own, zigzag-split like any other; every real token
    is on exactly one rank, once, and every label is the next token of its own sequence."""
    cu, ids, _ = _pack([4, 22], 1, 0)
    seen = []
    for rank in range(4):
        plan = packcuda.shard_plan(cu, 4, rank, layout="zigzag", bucket=64)
        assert plan.cu_seqlens_padded_host == [0, 8, 32, 64] and plan.total_local == 16
        idx = plan.index.tolist()
        seen += [i for i in idx if i >= 0]
        want = [int(ids[i + 1]) if i >= 0 and i + 1 not in (4, 26) else IGNORE for i in idx]
        assert plan.labels(ids).tolist() == want
        if rank == 3:
            # chunks 3 and 4 of each segment: A (h=1) -> a3 | pad; B (h=3) -> b9 b10 b11 | b12 b13 b14;
            # bucket segment (h=4) -> 8 pads with positions 12..19 of that segment
            assert idx == [3, -1, 13, 14, 15, 16, 17, 18] + [-1] * 8
            assert plan.position_ids.tolist() == [3, 4, 9, 10, 11, 12, 13, 14] + list(range(12, 20))
    assert sorted(seen) == list(range(26))
