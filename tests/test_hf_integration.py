"""packcuda.integrations.transformers' rotary patch on transformers' own Qwen-VL and Qwen3 modeling code (tiny
random-weight models, hf_models.py): the same logits and gradients as transformers' own rotary, context-parallel
sharding of the positions, refusals, the GPU path without syncs, broadcast batches and fuse_qk_norm."""
import importlib.util
import sys

import pytest
import torch

import packcuda
import reference as ref
from helpers import no_sync, requires_cuda
from hf_models import (
    FAMILIES,
    HAS_MROPE,
    HAS_ROPE,
    IMG,
    VE,
    VERSION_OK,
    VID,
    VS,
    V,
    _batch,
    _hf_positions,
    _model,
    _packed_logits,
    _pc_positions,
    _text,
    _vision,
    hf,
    needs_mrope,
    needs_rope,
    needs_shard,
    transformers,
)


# ---------------------------------------------------------------------------------------------------
# rotary patch: same logits and gradients as transformers' own rotary
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def rope_impl(request, monkeypatch):
    """'reference': the patch plumbing with a plain rotation (runs without the kernel); 'packcuda': the kernel."""
    if request.param == "reference":
        monkeypatch.setattr(packcuda, "apply_rope", ref.hf_rope_apply, raising=False)
    elif not HAS_ROPE:
        pytest.skip("packcuda.apply_rope not in this build")
    yield request.param
    hf.unpatch_qwen_vl_rope()


def _loss_and_grads(model, fam, packed, pos):
    model.zero_grad(set_to_none=True)
    logits = _packed_logits(model, fam, packed, pos)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference", "packcuda"], indirect=True)
@pytest.mark.parametrize("fam", FAMILIES)
def test_patch_matches_unpatched_logits_and_grads(fam, rope_impl, monkeypatch):
    if fam == "qwen3_5" and importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: transformers routes Qwen3.5's linear-attention layers "
                    "to its GPU kernels, which this CPU comparison does not exercise")
    model = _model(fam)  # Qwen3.5 with its real hybrid layer pattern (linear + full attention)
    _, packed = _batch(fam, seed=2)
    pos = _hf_positions(model, fam, packed)
    want_logits, want_grads = _loss_and_grads(model, fam, packed, pos)
    calls = []
    inner = packcuda.apply_rope
    monkeypatch.setattr(packcuda, "apply_rope", lambda *a, **k: calls.append(a[2].shape) or inner(*a, **k))
    with hf.patch_qwen_vl_rope(model) as h:
        assert hf.is_patched(model) and h.active
        got_logits, got_grads = _loss_and_grads(model, fam, packed, pos)
    tc = model.config.text_config
    n_attn = sum(t == "full_attention" for t in (getattr(tc, "layer_types", None) or
                                                  ["full_attention"] * tc.num_hidden_layers))
    assert calls[0] == (3, 1)  # patch time: the kernel once on one token with the model's rotary layout
    calls = calls[1:]
    assert len(calls) == n_attn and all(c == (3, packed["ids"].numel()) for c in calls)
    assert not hf.is_patched(model)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-5)
    assert want_grads.keys() == got_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference"], indirect=True)
def test_class_patch_applies_to_new_models_and_unpatches(rope_impl):
    import transformers.models.qwen3_vl.modeling_qwen3_vl as m

    orig_fn, orig_fwd = m.apply_rotary_pos_emb, m.Qwen3VLTextRotaryEmbedding.forward
    h = hf.patch_qwen_vl_rope(model_types=["qwen3_vl", "qwen2_vl"])
    model = _model("qwen3_vl")
    assert hf.is_patched(model) and hf.is_patched()
    # text-only input: the model builds the positions itself
    ids = torch.randint(0, 140, (2, 9))
    patched = model(input_ids=ids).logits
    h.unpatch()
    assert m.apply_rotary_pos_emb is orig_fn and m.Qwen3VLTextRotaryEmbedding.forward is orig_fwd
    assert not hf.is_patched(model) and not hf.is_patched()
    torch.testing.assert_close(patched, model(input_ids=ids).logits, rtol=1e-4, atol=2e-5)
    h.unpatch()  # idempotent


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference"], indirect=True)
def test_vision_rotary_untouched(rope_impl):
    """The vision tower's rotary (and the original function with real cos/sin) still take the original path."""
    import transformers.models.qwen2_vl.modeling_qwen2_vl as m

    model = _model("qwen2_vl")
    _, packed = _batch("qwen2_vl", layouts=[["img"]])
    with torch.no_grad():
        want = model.model.get_image_features(packed["pixel_values"], packed["image_grid_thw"]).pooler_output
        q, k = torch.randn(1, 1, 5, 128), torch.randn(1, 1, 5, 128)
        cos, sin = torch.randn(1, 5, 128), torch.randn(1, 5, 128)
        want_qk = m.apply_rotary_pos_emb(q, k, cos, sin)
        with hf.patch_qwen_vl_rope(model):
            got = model.model.get_image_features(packed["pixel_values"], packed["image_grid_thw"]).pooler_output
            got_qk = m.apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_qk, want_qk):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# context parallelism: shard the global positions, rotate locally
# ---------------------------------------------------------------------------------------------------
@needs_shard
@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference", "packcuda"], indirect=True)
@pytest.mark.parametrize("fam", FAMILIES)
def test_cp_sharded_positions_and_rotated_qk(fam, rope_impl):
    import importlib

    model = _model(fam)
    mod = importlib.import_module(hf._common._FAMILIES[fam].module)
    rot = model.model.language_model.rotary_emb
    _, packed = _batch(fam, seed=3)
    T = packed["ids"].numel()
    pos = _pc_positions(model, fam, packed) if HAS_MROPE else _hf_positions(model, fam, packed)
    tc = model.config.text_config
    D = tc.head_dim if getattr(tc, "head_dim", None) else tc.hidden_size // tc.num_attention_heads
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(T, 2, D, generator=g), torch.randn(T, 1, D, generator=g)
    x = torch.zeros(1, T, 4)

    def rotate(q, k, pos4):  # [T, H, D] through the model's rotary module and its module's apply function
        cos, sin = rot(x[:, :q.shape[0]], pos4[1:])
        qo, ko = mod.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return qo[0].transpose(0, 1), ko[0].transpose(0, 1)

    want_q, want_k = rotate(q, k, pos)  # transformers' own cos/sin path, unsharded
    with hf.patch_qwen_vl_rope(model):
        full_q, full_k = rotate(q, k, pos)
        torch.testing.assert_close(full_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full_k, want_k, rtol=1e-5, atol=1e-5)
        seen = torch.zeros(T, dtype=torch.int64)
        for r in range(2):
            plan = packcuda.shard_plan(packed["cu"], 2, r, layout="zigzag")
            lpos = hf.shard_position_ids(pos, plan)
            idx = plan.index
            valid = idx >= 0
            assert lpos.shape == (4, 1, idx.numel())
            assert torch.equal(lpos[:, 0, valid], pos[:, 0, idx[valid]])
            # pad slots carry the plan's pad-segment positions (one segment per pad run), on every row
            assert torch.equal(lpos[:, 0, ~valid], plan.position_ids[~valid].expand(4, -1))
            lq, lk = rotate(plan.shard(q), plan.shard(k), lpos)
            assert torch.equal(lq[valid], full_q[idx[valid]]) and torch.equal(lk[valid], full_k[idx[valid]])
            seen[idx[valid]] += 1
        assert (seen == 1).all()


# ---------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["4.57.3", "5.16.0", "5.99.0", "6.0.0"])
def test_patch_refuses_unknown_transformers_version(monkeypatch, version):
    model = _model("qwen2_vl")
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # the module the integration reads
    assert hf.transformers_version() == version
    with pytest.raises(hf.UnsupportedTransformersError, match=version.replace(".", r"\.")):
        hf.patch_qwen_vl_rope(model)
    assert not hf.is_patched()


def test_patch_refuses_unknown_model():
    T = transformers
    cfg = T.Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(hf.UnsupportedModelError, match="'qwen2'"):
        hf.patch_qwen_vl_rope(T.Qwen2ForCausalLM(cfg), allow_unverified_version=True)
    with pytest.raises(hf.UnsupportedModelError, match="'llama'"):
        hf.patch_qwen_vl_rope(model_types=["qwen2_vl", "llama"], allow_unverified_version=True)
    with pytest.raises(hf.UnsupportedModelError, match="'qwen2'"):
        hf.packed_position_ids(torch.zeros(3, dtype=torch.int64), [0, 3], cfg)
    with pytest.raises(ValueError, match="model or model_types"):
        hf.patch_qwen_vl_rope(_model("qwen2_vl"), model_types=["qwen2_vl"], allow_unverified_version=True)
    assert not hf.is_patched()


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference"], indirect=True)
def test_patch_refuses_changed_code(monkeypatch, rope_impl):
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as m

    model = _model("qwen2_5_vl")

    def foreign_apply(q, k, cos, sin, unsqueeze_dim=1):  # what another kernel library would install
        return q, k

    with monkeypatch.context() as mp:
        mp.setattr(m, "apply_rotary_pos_emb", foreign_apply)
        with pytest.raises(hf.UnsupportedTransformersError, match="apply_rotary_pos_emb"):
            hf.patch_qwen_vl_rope(model)
    try:  # from 5.25 transformers wraps the function in a `kernels` function module: a wrapped foreign function
        from kernels import use_kernel_forward_from_hub  # is refused by the module that wrote it
    except ImportError:
        use_kernel_forward_from_hub = None
    if use_kernel_forward_from_hub is not None:
        wrapped = use_kernel_forward_from_hub("rotary_pos_emb")(foreign_apply)
        assert isinstance(wrapped, torch.nn.Module) and hf._common._unwrap(wrapped) is foreign_apply
        with monkeypatch.context() as mp:
            mp.setattr(m, "apply_rotary_pos_emb", wrapped)
            with pytest.raises(hf.UnsupportedTransformersError, match="apply_rotary_pos_emb"):
                hf.patch_qwen_vl_rope(model)
    with monkeypatch.context() as mp:
        def forward(self, hidden_states, position_embeddings=None, **kw):  # a rewritten attention
            return hidden_states, None

        mp.setattr(m.Qwen2_5_VLAttention, "forward", forward)
        with pytest.raises(hf.UnsupportedTransformersError,
                           match=r"transformers 5\.\d+.*Qwen2_5_VLAttention\.forward"):
            hf.patch_qwen_vl_rope(model)
    assert not hf.is_patched(model) and not hf.is_patched()
    with monkeypatch.context() as mp:
        mp.setattr(model.model.language_model.rotary_emb, "rope_type", "dynamic")
        with pytest.raises(hf.UnsupportedModelError, match="dynamic"):
            hf.patch_qwen_vl_rope(model)
    assert not hf.is_patched()


# ---------------------------------------------------------------------------------------------------
# GPU: the training-loop path (host metadata, validate=False, patched rotary) never syncs
# ---------------------------------------------------------------------------------------------------
@requires_cuda
@needs_mrope
@needs_rope
@pytest.mark.gpu
@pytest.mark.parametrize("fam", ["qwen2_5_vl", "qwen3_5"])
def test_gpu_positions_and_patched_rope_no_sync(fam):
    import importlib

    model = _model(fam, full_attention_only=True).cuda()
    mod = importlib.import_module(hf._common._FAMILIES[fam].module)
    _, packed = _batch(fam, seed=4)
    T = packed["ids"].numel()
    ids = packed["ids"].cuda()
    tc = model.config.text_config
    D = tc.head_dim if getattr(tc, "head_dim", None) else tc.hidden_size // tc.num_attention_heads
    q, k = torch.randn(1, 2, T, D, device="cuda"), torch.randn(1, 1, T, D, device="cuda")
    rot = model.model.language_model.rotary_emb
    want_pos = _hf_positions(model.cpu(), fam, packed)
    model.cuda()
    cos, sin = rot(q, want_pos[1:].cuda())
    want = mod.apply_rotary_pos_emb(q, k, cos, sin)
    with hf.patch_qwen_vl_rope(model):
        with no_sync():
            pos = hf.packed_position_ids(ids, packed["cu"], model.config, image_grid_thw=packed["image_grid_thw"],
                                         video_grid_thw=packed["video_grid_thw"],
                                         second_per_grid_ts=packed["second_per_grid_ts"] if fam == "qwen2_5_vl"
                                         else None, validate=False)
            c2, s2 = rot(q, pos[1:])
            got = mod.apply_rotary_pos_emb(q, k, c2, s2)
        torch.cuda.synchronize()
    assert torch.equal(pos.cpu(), want_pos)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# the patch on batches transformers broadcasts, and on rotary layouts the kernel might refuse
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference", "packcuda"], indirect=True)
@pytest.mark.parametrize("fam", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("form", ["[1, S]", "[3, 1, S]", "[B, S]", "[3, B, S]"])
def test_patch_broadcasts_position_ids_over_the_batch(fam, rope_impl, form):
    """A batch of 2 with position_ids of batch 1: transformers broadcasts cos/sin over the batch; so does the
    patched path (same logits as unpatched)."""
    model = _model(fam)
    S = 9
    ids = torch.randint(0, 140, (2, S), generator=torch.Generator().manual_seed(3))
    p = torch.arange(S)[None] + 2
    B = 1 if "1" in form else 2
    pos = p.expand(B, S) if form.count(",") == 1 else torch.stack([p, p + 1, p * 2])[:, :1].expand(3, B, S)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with hf.patch_qwen_vl_rope(model):
            got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("rope_impl", ["reference", "packcuda"], indirect=True)
def test_patch_over_covering_mrope_section_refused_at_patch_time_or_equal(rope_impl):
    """transformers' own Qwen3-VL test config: head_dim 8 (4 frequencies) with mrope_section [16, 8, 8], which
    transformers' interleaving clips. The patch either reproduces transformers' logits or refuses when patching,
    never during a forward."""
    T = transformers
    c = T.Qwen3VLConfig(
        text_config=_text(head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=10000,
                                                           mrope_section=[16, 8, 8], mrope_interleaved=True)),
        vision_config=_vision(hidden_size=32, out_hidden_size=64, intermediate_size=64, num_position_embeddings=64,
                              deepstack_visual_indexes=[0]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.Qwen3VLForConditionalGeneration(c).eval()
    ids = torch.randint(0, 140, (1, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.stack([torch.arange(11), torch.arange(11) + 3, torch.arange(11) * 2])[:, None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    try:
        h = hf.patch_qwen_vl_rope(model)
    except ValueError as e:
        assert "packcuda.patch_qwen_vl_rope" in str(e) and "mrope_section" in str(e)
        assert not hf.is_patched(model) and not hf.is_patched()
        return
    with h, torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------------
# fuse_qk_norm: q_norm / k_norm + rotary through packcuda.apply_qk_norm_rope
# ---------------------------------------------------------------------------------------------------
def _qwen3_text_model(seed=0):
    c = transformers.Qwen3Config(**_text(head_dim=64, rope_parameters=dict(rope_type="default", rope_theta=1e6)))
    c._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(c).eval()


def _randomize_norms(model, offset):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(offset + 0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
@pytest.mark.parametrize("fam", ["qwen3_vl", "qwen3_5", "qwen3"])
def test_fuse_qk_norm_matches_unpatched_logits_and_grads(fam, monkeypatch):
    if fam == "qwen3_5" and importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed (GPU kernels for the linear-attention layers)")
    if fam == "qwen3":
        model = _qwen3_text_model()
        ids = torch.randint(0, 140, (1, 37), generator=torch.Generator().manual_seed(1))
        pos = torch.cat([torch.arange(20), torch.arange(17)])[None]  # a packed row of two samples
        run = lambda: model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # noqa: E731
    else:
        model = _model(fam)
        _, packed = _batch(fam, seed=2)
        pos = _hf_positions(model, fam, packed)
        run = lambda: _packed_logits(model, fam, packed, pos)  # noqa: E731
    _randomize_norms(model, 1.0 if fam != "qwen3_5" else 0.0)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        logits = run()
        w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
        (logits * w).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want_grads = loss_and_grads()
    calls = []
    inner = packcuda.apply_qk_norm_rope
    monkeypatch.setattr(packcuda, "apply_qk_norm_rope", lambda *a, **k: calls.append(k["norm"]) or inner(*a, **k))
    with hf.patch_qwen_vl_rope(model, fuse_qk_norm=True):
        assert hf.is_patched(model)
        got_logits, got_grads = loss_and_grads()
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "q_norm")]
    assert len(calls) == len(attn) and set(calls) == {"rms_offset" if fam == "qwen3_5" else "rms"}
    assert not hf.is_patched(model) and not hf.is_patched()
    assert all("forward" not in vars(m.q_norm) and "forward" not in vars(m.k_norm) for m in attn)  # restored
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=2e-5)
    assert want_grads.keys() == got_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
def test_fuse_qk_norm_refuses_unknown_norm_before_patching():
    model = _model("qwen3_vl")
    attn = next(m for m in model.modules() if type(m).__name__ == "Qwen3VLTextAttention")
    orig = attn.k_norm
    attn.k_norm = torch.nn.LayerNorm(orig.weight.shape[0])
    with pytest.raises(hf.UnsupportedModelError, match="k_norm is a LayerNorm"):
        hf.patch_qwen_vl_rope(model, fuse_qk_norm=True)
    assert not hf.is_patched(model) and not hf.is_patched()
    attn.k_norm = orig
    with pytest.raises(hf.UnsupportedModelError, match="no per-head q_norm"):
        hf.patch_qwen_vl_rope(_model("qwen2_vl"), fuse_qk_norm=True)
    with pytest.raises(ValueError, match="needs a model"):
        hf.patch_qwen_vl_rope(fuse_qk_norm=True)
    assert not hf.is_patched()


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
def test_fuse_qk_norm_with_callers_cos_sin_still_normalizes():
    """An attention called with cos/sin tables of the caller's own runs its deferred norms unfused."""
    model = _qwen3_text_model()
    _randomize_norms(model, 1.0)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    want = attn(x, (cos, sin), None)[0]
    with hf.patch_qwen_vl_rope(model, fuse_qk_norm=True):
        got = attn(x, (cos, sin), None)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not VERSION_OK, reason="transformers older than the patch supports")
def test_qwen3_text_rotary_patch_matches_unpatched():
    """The plain-RoPE path of the patch (Qwen3 text models, [B, S] position_ids, broadcast over the batch)."""
    model = _qwen3_text_model()
    ids = torch.randint(0, 140, (2, 19), generator=torch.Generator().manual_seed(4))
    for pos in (torch.arange(19)[None], torch.cat([torch.arange(7), torch.arange(12)])[None].expand(2, -1)):
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with hf.patch_qwen_vl_rope(model) as h:
            assert h.model_types == ("qwen3",) and hf.is_patched(model)
            got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    assert not hf.is_patched(model)
