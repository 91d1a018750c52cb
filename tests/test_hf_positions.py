"""packcuda.integrations.transformers' packed position ids on transformers' own Qwen-VL modeling code (tiny
random-weight models, hf_models.py): a packed row equals its samples run alone, with transformers' positions
and with packcuda's; bad input; Qwen2.5-VL's video-seconds rules."""
import functools

import pytest
import torch

import packcuda
import reference as ref
from helpers import HF_INT_SECONDS
from hf_models import (
    FAMILIES,
    HAS_SHARD,
    IMG,
    MERGE,
    VE,
    VID,
    VS,
    _batch,
    _config,
    _hf_positions,
    _model,
    _packed_logits,
    _pc_positions,
    _separate_logits,
    hf,
    needs_mrope,
)


# ---------------------------------------------------------------------------------------------------
# packed row == samples alone
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILIES)
def test_hf_packed_positions_restart_per_sample(fam):
    model = _model(fam, full_attention_only=True)
    samples, packed = _batch(fam)
    pos = _hf_positions(model, fam, packed)
    T = packed["ids"].numel()
    assert pos.shape == (4, 1, T) and pos.dtype == torch.int64
    cu = packed["cu"]
    for i, s in enumerate(samples):
        seg = pos[:, 0, cu[i]:cu[i + 1]]
        assert torch.equal(seg[0], torch.arange(s["ids"].numel()))  # text row: 0, 1, 2, ... in every sample
        assert seg.numel() == 0 or seg[1:].min() == 0
    # the rows HF builds for a sample with vision differ from the plain text row somewhere
    assert not torch.equal(pos[0], pos[1])


@pytest.mark.parametrize("fam", FAMILIES)
def test_packed_row_matches_samples_alone_hf_positions(fam):
    # Qwen3.5's gated-delta-net layers need flash-linear-attention's varlen kernels to respect sample
    # boundaries; transformers' PyTorch fallback ignores them, so this equivalence uses attention layers only
    model = _model(fam, full_attention_only=True)
    samples, packed = _batch(fam)
    with torch.no_grad():
        want = _separate_logits(model, fam, samples)
        got = _packed_logits(model, fam, packed, _hf_positions(model, fam, packed))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_mrope
@pytest.mark.parametrize("fam", FAMILIES)
def test_packed_position_ids_equal_transformers(fam, device):
    model = _model(fam, full_attention_only=True)
    for seed in range(3):
        _, packed = _batch(fam, seed)
        want = _hf_positions(model, fam, packed)
        got = _pc_positions(model, fam, packed, device)
        assert got.device.type == device
        assert torch.equal(got.cpu(), want), f"seed {seed}"


@needs_mrope
@pytest.mark.parametrize("fam", FAMILIES)
def test_packed_row_matches_samples_alone_packcuda_positions(fam):
    model = _model(fam, full_attention_only=True)
    samples, packed = _batch(fam, seed=1)
    with torch.no_grad():
        want = _separate_logits(model, fam, samples)
        got = _packed_logits(model, fam, packed, _pc_positions(model, fam, packed))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------
def test_positions_bad_input():
    cfg, _ = _config("qwen2_vl")
    with pytest.raises(ValueError, match=r"\[T\] or \[1, T\]"):
        hf.packed_position_ids(torch.zeros(2, 3, dtype=torch.int64), [0, 3], cfg)
    if HAS_SHARD:
        with pytest.raises(ValueError, match=r"\[R, 1, T\]"):
            hf.shard_position_ids(torch.zeros(4, 2, 5, dtype=torch.int64), packcuda.shard_plan([0, 5], 1, 0))


@needs_mrope
def test_positions_bad_grid_is_named():
    cfg, _ = _config("qwen2_vl")
    ids = torch.tensor([1, VS] + [IMG] * 4 + [VE, 2])
    with pytest.raises(ValueError, match="packcuda"):
        hf.packed_position_ids(ids, [0, 8], cfg, image_grid_thw=[[1, 4, 6]])  # 6 tokens expected, 4 given


# ---------------------------------------------------------------------------------------------------
# Qwen2.5-VL video seconds: the installed release's rule by default, the other one by argument
# ---------------------------------------------------------------------------------------------------
def _installed_truncates_seconds():
    """By behaviour: the installed get_rope_index on one 0.5-second video of 3 temporal patches."""
    model = _model("qwen2_5_vl", full_attention_only=True)
    ids = torch.tensor([1, VS] + [VID] * 3 + [VE])
    pos, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=hf.mm_token_type_ids(ids[None], model.config),
                                        video_grid_thw=torch.tensor([[3, 2, 2]]),
                                        second_per_grid_ts=torch.tensor([0.5]))
    t = pos[0, 0, 2:5].tolist()  # tokens_per_second 2: float rule 2 + [0, 1, 2], whole rule 2 + [0, 0, 0]
    assert t in ([2, 3, 4], [2, 2, 2]), t
    return t == [2, 2, 2]


@needs_mrope
def test_video_seconds_default_is_the_installed_rule():
    assert hf.video_seconds_default() == ("whole" if _installed_truncates_seconds() else "float")
    assert hf.truncates_video_seconds() == (hf.video_seconds_default() == "whole")


@needs_mrope
@pytest.mark.parametrize("rule", [None, "float", "whole"])
def test_video_seconds_rules_match_reference(rule):
    cfg, _ = _config("qwen2_5_vl")
    secs = [0.5, 1.5, 0.25, 2.0, 1.0 / 3.0]
    ids, cu, vids = [], [0], []
    for i, _sec in enumerate(secs):
        ids += [5, VS] + [VID] * (3 + i) * 2 + [VE, 6]
        cu.append(len(ids))
        vids.append([3 + i, 2, 4])
    got = hf.packed_position_ids(torch.tensor(ids), cu, cfg, video_grid_thw=vids, second_per_grid_ts=secs,
                                 video_seconds=rule)
    eff = rule or hf.video_seconds_default()
    use = [float(int(s)) for s in secs] if eff == "whole" else secs
    want, text_pos, _ = ref.mrope_position_ids(ids, cu, [], vids, use, image_token_id=IMG, video_token_id=VID,
                                               spatial_merge_size=MERGE, tokens_per_second=2)
    assert torch.equal(got[1:, 0], want) and torch.equal(got[0, 0], text_pos)
    if eff == "float":  # the rules differ on these seconds
        other = hf.packed_position_ids(torch.tensor(ids), cu, cfg, video_grid_thw=vids, second_per_grid_ts=secs,
                                       video_seconds="whole")
        assert not torch.equal(other, got)
    with pytest.raises(ValueError, match="packcuda.packed_position_ids: video_seconds"):
        hf.packed_position_ids(torch.tensor(ids), cu, cfg, video_grid_thw=vids, second_per_grid_ts=secs,
                               video_seconds="floor")


@needs_mrope
def test_release_that_truncates_seconds_is_detected_and_matched(monkeypatch):
    """A release computing tokens_per_second * int(second_per_grid_ts) (5.17), simulated by wrapping the
    installed get_rope_index: detected by behaviour, and the default positions equal the model's per sample."""
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as m

    orig = m.Qwen2_5_VLModel.get_rope_index

    @functools.wraps(orig)
    def truncating(self, *a, second_per_grid_ts=None, **kw):
        if second_per_grid_ts is not None:
            second_per_grid_ts = second_per_grid_ts.trunc()
        return orig(self, *a, second_per_grid_ts=second_per_grid_ts, **kw)

    hf.truncates_video_seconds.cache_clear()
    try:
        monkeypatch.setattr(m.Qwen2_5_VLModel, "get_rope_index", truncating)
        assert hf.truncates_video_seconds() and hf.video_seconds_default() == "whole"
        model = _model("qwen2_5_vl", full_attention_only=True)
        _, packed = _batch("qwen2_5_vl", seed=1)
        packed["second_per_grid_ts"] = packed["second_per_grid_ts"] * 0 + torch.tensor([0.5, 1.5, 2.25])[
            torch.arange(packed["second_per_grid_ts"].numel()) % 3]
        want = _hf_positions(model, "qwen2_5_vl", packed)
        assert torch.equal(_pc_positions(model, "qwen2_5_vl", packed), want)
        assert not torch.equal(_pc_positions(model, "qwen2_5_vl", packed, video_seconds="float"), want)
    finally:
        monkeypatch.undo()
        hf.truncates_video_seconds.cache_clear()
    assert not hf.truncates_video_seconds() or HF_INT_SECONDS
