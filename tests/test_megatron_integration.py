"""packcuda.integrations.megatron against megatron-core's own THD context-parallel split.

megatron-core index-selects the Megatron-padded stream with TransformerEngine's ``thd_get_partitioned_indices``:
``get_thd_batch_on_this_cp_rank`` in 0.16.1, the per-document ``get_batch_on_this_cp_rank`` (dicts with
``cu_seqlens`` ``[1, n]``, ``local_cp_size`` and ``hybrid_cp_group``) in 0.19. TransformerEngine needs a GPU, so
on the CPU its partition is the plain reference of that function (``reference.thd_partitioned_indices``), which
the shard-plan tests check against TransformerEngine's semantics; 0.19 reads the CP size and rank from its
process group, answered here for a stand-in group. The rotary test runs megatron-core's own THD rotary
(``rope_utils._apply_rotary_pos_emb_thd``, pure PyTorch) on the split. The tests run against whichever
megatron-core is importable (CI runs them with 0.16.1 and again with 0.19.2 first on PYTHONPATH); skipped, with
the reason, without one."""
import random
import types

import pytest
import torch

import packcuda
import reference as ref
from helpers import no_sync, requires_cuda
from packcuda.integrations import megatron as pm

IGNORE, PAD = -100, 0
NEEDS_MCORE = "megatron-core is not installed (pip install packcuda[megatron])"


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
    pads (token PAD, label IGNORE, loss mask 0, positions counting on); the bucket segment is all pads.
    ``pos`` is ``[R, T]``; the padded positions are ``[R, T_padded]``."""
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


@pytest.fixture
def mcore(monkeypatch):
    """megatron.core.utils with TransformerEngine's partition answered by the reference and, for 0.19's
    process-group based split, the CP size and rank of a stand-in group answered as set by ``split``."""
    mcu = pytest.importorskip("megatron.core.utils", reason=NEEDS_MCORE)
    monkeypatch.setattr(mcu, "tex", types.SimpleNamespace(
        thd_get_partitioned_indices=lambda cup, n, cp, r: torch.tensor(
            ref.thd_partitioned_indices(cup.tolist(), n, cp, r), dtype=torch.int64)))
    if hasattr(mcu, "is_te_min_version"):
        monkeypatch.setattr(mcu, "is_te_min_version", lambda *a, **k: True)
    group = types.SimpleNamespace(cp=None)
    dist = torch.distributed
    size, rank = dist.get_world_size, dist.get_rank
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: g.cp[0] if g is group else size(g))
    monkeypatch.setattr(dist, "get_rank", lambda g=None: g.cp[1] if g is group else rank(g))
    monkeypatch.setattr(mcu, "cp_group", group, raising=False)
    return mcu


def _version():
    """The release number alone: from a git checkout (a venv inside one) megatron-core appends ``+<sha>``."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def _split(mcu, plan, P):
    """megatron-core's own THD split of the Megatron-padded batch ``P`` for the plan's rank (a new dict), in
    the release's own dict form: 0.16.1's ``get_thd_batch_on_this_cp_rank``, or 0.19's ``get_batch_on_this_cp_rank``
    on the dict ``get_batch_on_this_tp_rank`` makes (``cu_seqlens`` / ``cu_seqlens_padded`` ``[1, n]`` int32,
    ``max_seqlen`` ``[1]``, ``local_cp_size`` and ``hybrid_cp_group`` None)."""
    cp, rank = plan.cp_size, plan.cp_rank
    cu_q = torch.tensor(pm._cu_seqlens_q(plan), dtype=torch.int32)
    max_seqlen = torch.tensor([plan.max_seqlen_padded], dtype=torch.int32)
    if hasattr(mcu, "get_thd_batch_on_this_cp_rank"):  # 0.16
        want, _ = mcu.get_thd_batch_on_this_cp_rank(dict(P), cu_q, plan.cu_seqlens_padded, max_seqlen,
                                                     cp_size=cp, cp_rank=rank)
        return want
    mcu.cp_group.cp = (cp, rank)
    batch = dict(P, cu_seqlens=cu_q[None], cu_seqlens_padded=plan.cu_seqlens_padded.to(torch.int32)[None],
                 max_seqlen=max_seqlen, local_cp_size=None, hybrid_cp_group=None)
    return mcu.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mcu.cp_group)


def _forms(pos):
    """Every B = 1 form a trainer carries ``[R, T]`` positions in (R = 1: [1, T] and [T]; R = 3/4: [R, T],
    Megatron's / transformers' [R, 1, T] and verl's [1, R, T]), each with its way back to [R, T]."""
    if pos.shape[0] == 1:
        return [("1T", pos, lambda x: x), ("T", pos[0], lambda x: x[None])]
    return [("RT", pos, lambda x: x), ("R1T", pos[:, None], lambda x: x[:, 0]), ("1RT", pos[None], lambda x: x[0])]


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"cp{c[0]}-{c[1]}-b{c[2]}")
def test_thd_batch_equals_megatron_core(case, rows, mcore):
    cp, lens, bucket = case
    cu, tokens, pos = _inputs(lens, sum(lens) + cp, rows)
    labels_ref = ref.next_token_labels(tokens, cu, IGNORE)  # built per sequence, before the split
    v = _version()
    for rank in range(cp):
        plan = packcuda.shard_plan(cu, cp, rank, bucket=bucket)
        P = _megatron_padded_batch(plan, tokens, labels_ref, (labels_ref != IGNORE).float(), pos)
        want = _split(mcore, plan, P)  # megatron-core selects along dim 1: positions go in as [R, T_padded]
        for given in (False, True):  # labels and loss mask built here (the batch carries none) and given
            for form, p, back in _forms(pos):
                for dt in (torch.int64, torch.int32):
                    batch = {"tokens": tokens[None], "position_ids": p.to(dt), "attention_mask": None}
                    if given:
                        batch.update(labels=labels_ref[None], loss_mask=(labels_ref != IGNORE).float()[None])
                    got = pm.thd_batch_on_this_cp_rank(batch, plan, pad_token_id=PAD, ignore_index=IGNORE)
                    where = f"megatron-core {v}: cp={cp} rank={rank} {lens} given={given} {form} {dt}"
                    for k in ("tokens", "labels", "loss_mask"):
                        assert torch.equal(got[k], want[k].to(got[k].dtype)), f"{k}: {where}"
                    gp = got["position_ids"]
                    assert gp.dtype == dt and gp.shape == p.shape[:-1] + (plan.total_local,), where
                    assert torch.equal(back(gp).long(), want["position_ids"]), f"position_ids: {where}"
                    assert got["attention_mask"] is None


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_batch_takes_megatron_core_batch_dicts(cp, mcore):
    """The dict megatron-core's get_batch_on_this_tp_rank makes (0.19: with local_cp_size and
    hybrid_cp_group None; pipeline stages with None for the tensors they do not carry) goes in as it is: the
    pass-through keys come back unchanged (the same objects), and every stage's tensors equal megatron-core's
    own split of the whole batch."""
    lens = [7, 1, 20, 6]
    cu, tokens, pos = _inputs(lens, cp, 3)
    labels = ref.next_token_labels(tokens, cu, IGNORE)
    mask = (labels != IGNORE).float()
    for rank in range(cp):
        plan = packcuda.shard_plan(cu, cp, rank)
        want = _split(mcore, plan, _megatron_padded_batch(plan, tokens, labels, mask, pos))
        meta = dict(cu_seqlens=torch.tensor([cu], dtype=torch.int32),
                    cu_seqlens_padded=plan.cu_seqlens_padded.to(torch.int32)[None],
                    max_seqlen=torch.tensor([plan.max_seqlen_padded], dtype=torch.int32),
                    local_cp_size=None, hybrid_cp_group=None, attention_mask=None)
        full = dict(tokens=tokens[None], labels=labels[None], loss_mask=mask[None], position_ids=pos[:, None])
        stages = {  # get_batch_on_this_tp_rank: first stage, last stage, a middle one, no pipeline
            "first": dict(full, labels=None, loss_mask=None),
            "last": dict(full, tokens=None, position_ids=None),
            "middle": dict(full, tokens=None, labels=None, loss_mask=None, position_ids=None),
            "all": full,
        }
        for stage, tensors in stages.items():
            batch = dict(meta, **tensors)
            got = pm.thd_batch_on_this_cp_rank(batch, plan, pad_token_id=PAD, ignore_index=IGNORE)
            assert set(got) == set(batch), stage
            for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
                assert got[k] is batch[k], (stage, k)
            assert got["local_cp_size"] is None and got["hybrid_cp_group"] is None and got["attention_mask"] is None
            # tokens and positions wherever the stage has tokens; labels and loss mask wherever it has labels
            # (the first stage builds them from the tokens, as the split does for a batch without labels)
            has = {"tokens": stage in ("first", "all"), "position_ids": stage in ("first", "all"),
                   "labels": stage != "middle", "loss_mask": stage != "middle"}
            for k, present in has.items():
                if not present:
                    assert got[k] is None, (stage, k)
                elif k == "position_ids":
                    assert torch.equal(got[k][:, 0], want[k]), (stage, k)
                else:
                    assert torch.equal(got[k], want[k].to(got[k].dtype)), (stage, k)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_thd_positions_give_megatron_core_rotary(cp, monkeypatch):
    """megatron-core's own THD rotary (RotaryEmbedding's table over the longest padded sequence, applied per
    padded sequence to this rank's zigzag chunks by rope_utils._apply_rotary_pos_emb_thd) equals
    packcuda.apply_rope with the split's position_ids, on every local slot, pads included. (RotaryEmbedding
    moves its table to the current CUDA device; here the current device is the CPU.)"""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    rope_mod = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils", reason=NEEDS_MCORE)
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    D, H = 32, 2
    rope = RotaryEmbedding(kv_channels=D, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    lens = [5, 17, 1, 30]
    cu, tokens, _ = _inputs(lens, cp)
    g = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        plan = packcuda.shard_plan(cu, cp, rank, bucket=16 * cp)
        q = torch.randn(plan.total_local, H, D, generator=g)
        group = types.SimpleNamespace(size=lambda: cp, rank=lambda: rank)
        freqs = rope(plan.max_seqlen_padded)  # [max_seqlen, 1, 1, D]
        want = rope_mod._apply_rotary_pos_emb_thd(q, plan.cu_seqlens_padded.to(torch.int32), freqs, cp_group=group)
        pos = pm.thd_batch_on_this_cp_rank({"tokens": tokens[None]}, plan)["position_ids"][0]
        got, _ = packcuda.apply_rope(q, q, pos, inv_freq=rope.inv_freq.float())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=f"megatron-core {_version()}: cp={cp} rank={rank}")


def test_thd_batch_refuses_hybrid_context_parallelism():
    """megatron-core 0.19's hybrid CP (local_cp_size set, a group per sample) is not this split: refused by
    name, before anything is computed; None values (no hybrid CP) pass."""
    plan = packcuda.shard_plan([0, 6, 11], 2, 0)
    base = {"tokens": torch.arange(11)[None], "local_cp_size": None, "hybrid_cp_group": None}
    assert pm.thd_batch_on_this_cp_rank(base, plan)["local_cp_size"] is None
    with pytest.raises(ValueError, match=r"thd_batch_on_this_cp_rank: batch\['local_cp_size'\] is set: hybrid"):
        pm.thd_batch_on_this_cp_rank(dict(base, local_cp_size=torch.tensor([2], dtype=torch.int32)), plan)
    with pytest.raises(ValueError, match=r"batch\['hybrid_cp_group'\] is set"):
        pm.thd_batch_on_this_cp_rank(dict(base, hybrid_cp_group=object()), plan)


def test_packed_seq_params_equals_megatron_core():
    """Every field megatron-core's PackedSeqParams has, equal to what megatron-core builds from the same
    boundaries (0.19: total_tokens, and seq_idx as its constructor derives it)."""
    psp_mod = pytest.importorskip("megatron.core.packed_seq_params", reason=NEEDS_MCORE)
    import dataclasses

    fields = {f.name for f in dataclasses.fields(psp_mod.PackedSeqParams)}
    for cu, cp, bucket in (([0, 4, 26], 4, 64), ([0, 5, 6, 18, 25], 2, None), ([0, 3], 1, 8), ([0, 0, 9], 3, None)):
        for rank in range(cp):
            plan = packcuda.shard_plan(cu, cp, rank, bucket=bucket)
            got = pm.packed_seq_params(plan)
            cu_q = torch.tensor(pm._cu_seqlens_q(plan), dtype=torch.int32)
            cu_p = torch.tensor(plan.cu_seqlens_padded_host, dtype=torch.int32)
            kw = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_q, cu_seqlens_q_padded=cu_p,
                      cu_seqlens_kv_padded=cu_p, max_seqlen_q=plan.max_seqlen_padded,
                      max_seqlen_kv=plan.max_seqlen_padded)
            if "total_tokens" in fields:
                kw["total_tokens"] = plan.total_padded
            want = psp_mod.PackedSeqParams(**kw)
            assert type(got) is type(want)
            for f in fields:
                g, w = getattr(got, f), getattr(want, f)
                if isinstance(w, torch.Tensor):
                    assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and torch.equal(g, w), f
                else:
                    assert g == w, f


def test_packed_seq_params_fields():
    pytest.importorskip("megatron.core.packed_seq_params", reason=NEEDS_MCORE)
    plan = packcuda.shard_plan([0, 4, 26], 4, 3, bucket=64)
    p = pm.packed_seq_params(plan)
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q.tolist() == [0, 4, 26, 26]  # the bucket segment: an empty sequence
    assert p.cu_seqlens_q_padded.tolist() == [0, 8, 32, 64]
    assert p.max_seqlen_q == p.max_seqlen_kv == 32
    if hasattr(p, "total_tokens"):
        assert p.total_tokens == 64
    if hasattr(p, "seq_idx"):
        assert p.seq_idx.tolist() == [[0] * 8 + [1] * 24 + [2] * 32]


def test_verified_releases_name_the_installed_one():
    """The release under test is one this module says it was verified against (CI runs 0.16.1 and 0.19.2)."""
    pytest.importorskip("megatron.core", reason=NEEDS_MCORE)
    assert _version() in pm.VERIFIED_MEGATRON_CORE, (_version(), pm.VERIFIED_MEGATRON_CORE)


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


@pytest.mark.parametrize("shape", [(3, 1), (4, 1), (1, 3), (1, 4), (1,), (1, 1), (3,), (4,), ()])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_every_positions_function_takes_every_b1_form(shape, dtype):
    """plan.shard(dim=-1), plan.shard_positions, transformers.shard_position_ids and the Megatron split take
    every B = 1 form of position ids and give it back in the same form and dtype, the same values."""
    from packcuda.integrations.transformers import shard_position_ids

    cu, tokens, pos1 = _inputs([5, 12, 3], 1)
    R = next((n for n in shape if n != 1), 1)
    pos = (pos1.expand(R, -1) + torch.arange(R)[:, None]).reshape(*shape, -1).to(dtype)
    for rank in range(2):
        plan = packcuda.shard_plan(cu, 2, rank)
        want = plan.shard_positions(pos.reshape(-1, pos.shape[-1]).long())  # [R, T_local]
        out = {
            "shard_positions": plan.shard_positions(pos),
            "shard_position_ids": shard_position_ids(pos, plan),
            "thd_batch_on_this_cp_rank": pm.thd_batch_on_this_cp_rank(
                {"tokens": tokens[None], "position_ids": pos}, plan)["position_ids"],
        }
        for name, got in out.items():
            assert got.shape == pos.shape[:-1] + (plan.total_local,) and got.dtype == dtype, name
            assert torch.equal(got.reshape(-1, plan.total_local).long(), want), name
        # plan.shard along the token dim: the same real slots (pads are filled, not counted on)
        real = plan.index >= 0
        got = plan.shard(pos, dim=-1)
        assert got.shape == pos.shape[:-1] + (plan.total_local,) and got.dtype == dtype
        assert torch.equal(got.reshape(-1, plan.total_local)[:, real].long(), want[:, real])


@requires_cuda
def test_no_sync_on_cuda():
    """On CUDA, the split (mRoPE positions [3, 1, T] included) and PackedSeqParams (with megatron-core 0.19's
    total_tokens / seq_idx) never wait on the device; the same values as on the CPU."""
    lens = [100, 0, 37, 512, 9]
    cu, tokens, pos = _inputs(lens, 5, 3)
    batch = {"tokens": tokens[None].cuda(), "position_ids": pos[:, None].cuda().to(torch.int32),
             "attention_mask": None}
    cpu = [pm.thd_batch_on_this_cp_rank({"tokens": tokens[None], "position_ids": pos[:, None].to(torch.int32)},
                                        packcuda.shard_plan(cu, 4, r, bucket=64)) for r in range(4)]
    with no_sync():
        plans = [packcuda.shard_plan(cu, 4, r, bucket=64, device="cuda") for r in range(4)]
        got = [pm.thd_batch_on_this_cp_rank(batch, p) for p in plans]
        psp = [pm.packed_seq_params(p) for p in plans] if _has_mcore() else []
    for g, c in zip(got, cpu):
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(g[k].cpu(), c[k]), k
    for p, plan in zip(psp, plans):
        want = pm.packed_seq_params(packcuda.shard_plan(cu, 4, plan.cp_rank, bucket=64))
        for f in ("cu_seqlens_q", "cu_seqlens_q_padded", "seq_idx"):
            if getattr(want, f, None) is not None:
                assert torch.equal(getattr(p, f).cpu(), getattr(want, f)), f


def _has_mcore():
    try:
        import megatron.core.packed_seq_params  # noqa: F401
    except ImportError:
        return False
    return True


def test_refusals():
    plan = packcuda.shard_plan([0, 6], 2, 0, layout="contiguous")
    with pytest.raises(ValueError, match="zigzag"):
        pm.thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6, dtype=torch.long)}, plan)
    plan = packcuda.shard_plan([0, 6], 2, 0)
    with pytest.raises(ValueError, match="attention_mask"):
        pm.thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6, dtype=torch.long),
                                      "attention_mask": torch.ones(1, 6)}, plan)
    # ambiguous leading sizes: [2, T] could be two rows or a batch of two; B must be 1
    for shape in ((2, 6), (3, 2, 6), (2, 3, 6), (3, 1, 1, 6)):
        with pytest.raises(ValueError, match=r"thd_batch_on_this_cp_rank: batch\['position_ids'\] must be"):
            pm.thd_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6, dtype=torch.long),
                                          "position_ids": torch.zeros(shape, dtype=torch.long)}, plan)
