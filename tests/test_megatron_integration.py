"""packcuda.integrations.megatron against megatron-core's own THD context-parallel split.

megatron-core's ``get_thd_batch_on_this_cp_rank`` (0.16.1) index-selects the Megatron-padded stream with
TransformerEngine's ``thd_get_partitioned_indices``; TransformerEngine needs a GPU, so on the CPU its partition
is the plain reference of that function (``reference.thd_partitioned_indices``), which the shard-plan tests
check against TransformerEngine's semantics. Skipped, with the reason, when megatron-core is not installed."""
import random
import types

import pytest
import torch

import packcuda
import reference as ref
from packcuda.integrations import megatron as pm

IGNORE, PAD = -100, 0


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _cases():
    rng = random.Random(7)
    out = []
    for cp in (1, 2, 3, 4):
        for lens, bucket in (([5, 1, 12, 7], None), ([rng.randint(1, 40) for _ in range(6)], None),
                             ([4, 22], 64), ([3, 9, 2], 16 * cp)):
            if bucket is not None and bucket % (2 * cp):
                continue
            out.append((cp, lens, bucket))
    return out


def _megatron_padded_batch(plan, tokens, labels, loss_mask, pos):
    """The padded stream the Megatron way: each segment of cu_seqlens_padded holds its sequence's tokens, then
    pads (token PAD, label IGNORE, loss mask 0, positions counting on); the bucket segment is all pads."""
    cu, cup = plan.cu_seqlens_host, plan.cu_seqlens_padded_host
    Tp = plan.total_padded
    R = pos.shape[0]
    P = dict(tokens=torch.full((1, Tp), PAD, dtype=tokens.dtype), labels=torch.full((1, Tp), IGNORE),
             loss_mask=torch.zeros(1, Tp), position_ids=torch.zeros(R, Tp, dtype=torch.int64))
    for i in range(len(cup) - 1):
        a, b = (cu[i], cu[i + 1]) if i < len(cu) - 1 else (cu[-1], cu[-1])
        p0, p1 = cup[i], cup[i + 1]
        L = b - a
        P["tokens"][0, p0:p0 + L] = tokens[a:b]
        P["labels"][0, p0:p0 + L] = labels[a:b]
        P["loss_mask"][0, p0:p0 + L] = loss_mask[a:b]
        P["position_ids"][:, p0:p0 + L] = pos[:, a:b]
        P["position_ids"][:, p0 + L:p1] = torch.arange(L, p1 - p0)
    P["attention_mask"] = None
    return P


def _inputs(lens, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    cu = _cu(lens)
    T = cu[-1]
    tokens = torch.randint(1, 1000, (T,), generator=g)
    pos = ref.position_ids(cu).expand(rows, T).clone()
    if rows > 1:  # mRoPE-like rows: anything per token
        pos[1:] += torch.randint(0, 5, (rows - 1, T), generator=g)
    return cu, tokens, pos


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"cp{c[0]}-{c[1]}-b{c[2]}")
def test_thd_batch_equals_megatron_core(case, rows, monkeypatch):
    mcu = pytest.importorskip("megatron.core.utils", reason="megatron-core is not installed (pip install "
                                                            "packcuda[megatron])")
    monkeypatch.setattr(mcu, "tex", types.SimpleNamespace(thd_get_partitioned_indices=lambda cup, n, cp, r: torch.tensor(
        ref.thd_partitioned_indices(cup.tolist(), n, cp, r), dtype=torch.int64)))
    monkeypatch.setattr(mcu, "is_te_min_version", lambda *a, **k: True)
    cp, lens, bucket = case
    cu, tokens, pos = _inputs(lens, sum(lens) + cp, rows)
    labels_ref = ref.next_token_labels(tokens, cu, IGNORE)  # built per sequence, before the split
    for rank in range(cp):
        plan = packcuda.shard_plan(cu, cp, rank, bucket=bucket)
        P = _megatron_padded_batch(plan, tokens, labels_ref, (labels_ref != IGNORE).float(), pos)
        want, want_psp = mcu.get_thd_batch_on_this_cp_rank(
            P, torch.tensor(pm._cu_seqlens_q(plan), dtype=torch.int32),
            plan.cu_seqlens_padded, torch.tensor([plan.max_seqlen_padded]), cp_size=cp, cp_rank=rank)
        # labels and loss mask built here (the batch carries none) and given (sharded)
        for given in (False, True):
            batch = {"tokens": tokens[None], "position_ids": pos, "attention_mask": None}
            if given:
                batch.update(labels=labels_ref[None], loss_mask=(labels_ref != IGNORE).float()[None])
            got = pm.thd_batch_on_this_cp_rank(batch, plan, pad_token_id=PAD, ignore_index=IGNORE)
            for k in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(got[k], want[k].to(got[k].dtype)), f"{k}: cp={cp} rank={rank} {lens} given={given}"
            assert got["attention_mask"] is None
        psp = pm.packed_seq_params(plan)
        for f in ("qkv_format", "max_seqlen_q", "max_seqlen_kv"):
            assert getattr(psp, f) == getattr(want_psp, f), f
        for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert getattr(psp, f).dtype == torch.int32 and torch.equal(getattr(psp, f), getattr(want_psp, f)), f
        assert type(psp) is type(want_psp)


def test_packed_seq_params_fields():
    pytest.importorskip("megatron.core.packed_seq_params", reason="megatron-core is not installed")
    plan = packcuda.shard_plan([0, 4, 26], 4, 3, bucket=64)
    p = pm.packed_seq_params(plan)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 4, 26, 26]  # the bucket segment: an empty sequence
    assert p.cu_seqlens_q_padded.tolist() == [0, 8, 32, 64]
    assert p.max_seqlen_q == p.max_seqlen_kv == 32
    if hasattr(p, "total_tokens"):
        assert p.total_tokens == 64


def test_thd_batch_labels_cross_chunk_boundaries_without_megatron():
    """Needs no megatron-core: the split is TransformerEngine's zigzag (reference) of the padded stream, and the
    labels at every chunk boundary are the next token of the same sequence."""
    cu, tokens, pos = _inputs([4, 22, 9], 3)
    labels = ref.next_token_labels(tokens, cu, IGNORE)
    for rank in range(2):
        plan = packcuda.shard_plan(cu, 2, rank)
        P = _megatron_padded_batch(plan, tokens, labels, (labels != IGNORE).float(), pos)
        idx = torch.tensor(ref.thd_partitioned_indices(plan.cu_seqlens_padded_host, plan.total_padded, 2, rank))
        got = pm.thd_batch_on_this_cp_rank({"tokens": tokens[None]}, plan)
        assert torch.equal(got["tokens"], P["tokens"][:, idx])
        assert torch.equal(got["labels"], P["labels"][:, idx])
        assert torch.equal(got["loss_mask"], P["loss_mask"][:, idx])
        assert torch.equal(got["position_ids"], P["position_ids"][:, idx])


def test_refusals():
    plan = packcuda.shard_plan([0, 6], 2, 0, layout="contiguous")
    with pytest.raises(ValueError, match="zigzag"):
        pm.thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6, dtype=torch.long)}, plan)
    plan = packcuda.shard_plan([0, 6], 2, 0)
    with pytest.raises(ValueError, match="attention_mask"):
        pm.thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6, dtype=torch.long),
                                      "attention_mask": torch.ones(1, 6)}, plan)
