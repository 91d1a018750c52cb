"""patch_qwen3_5_linear_attention: transformers' Qwen3.5 GatedDeltaNet layers on packed rows and CP shards.

The oracle is transformers itself: the unpatched model run on every sample alone (where its layers are right),
the unpatched GatedDeltaNet run on every sequence alone for the CP checks, and the unsharded packed run for the
whole model under a zigzag plan. Every run of transformers' own layers pins their PyTorch functions
(:func:`_torch_path`): where flash-linear-attention is installed, transformers routes them to its GPU kernels,
also for CPU tensors."""
from itertools import accumulate

import pytest
import torch

import packcuda
import reference as ref
from helpers import HAS_CUDA
from qwen3_5_models import (
    FLA_NO_BACKWARD,
    HAS_FLA,
    LENS,
    TOL_GRADS,
    TOL_LOGITS,
    VERSION_OK,
    _boundary_kwargs,
    _close,
    _fla_loss_grads,
    _fla_refused_backward,
    _ids,
    _loss,
    _loss_grads,
    _model,
    _per_sample,
    _ref_cp_recurrence,
    _torch_path,
    hf,
    transformers,
)

pytestmark = pytest.mark.skipif(not VERSION_OK, reason="transformers outside the versions the patch supports")


@pytest.mark.parametrize("rotary", ["transformers", "packcuda"])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("source", ["position_ids", "position_ids_4rows", "cu_seq_lens_q_host", "cu_seq_lens_q"])
def test_packed_row_equals_samples_alone(K, source, rotary):
    """fp64: one packed row of N samples (patched) gives the logits and parameter gradients of every sample run
    alone through the unpatched model, with transformers' rotary or the packcuda rotary patch."""
    model = _model(K)
    ids = _ids(LENS)
    want_logits, want_grads = _per_sample(model, ids, LENS)
    kw = _boundary_kwargs(source, LENS)
    plain = {"position_ids": kw["position_ids"]}
    with _torch_path():  # unpatched: the conv and the recurrence cross samples
        leak_logits, _ = _loss_grads(model, [(ids, plain)])
    assert (leak_logits - want_logits).abs().max() > 1e-3
    rope = hf.patch_qwen_vl_rope(model) if rotary == "packcuda" else None
    try:
        with hf.patch_qwen3_5_linear_attention(model) as h:
            # CPU tensors take transformers' PyTorch rule per sample, also where FLA (GPU kernels) is installed
            assert h.active and h.recurrence == ("fla varlen" if HAS_FLA else "transformers per sample")
            got_logits, got_grads = _loss_grads(model, [(ids, kw)])
        assert not h.active
    finally:
        if rope is not None:
            rope.unpatch()
    _close({"logits": got_logits}, {"logits": want_logits}, TOL_LOGITS, "packed")
    assert got_grads.keys() == want_grads.keys()
    _close(got_grads, want_grads, TOL_GRADS, "grad")
    # unpatched again: transformers' own layers, bit for bit
    with _torch_path():
        again, _ = _loss_grads(model, [(ids, plain)])
    assert torch.equal(again, leak_logits)


def test_batch_rows_are_samples_and_padding_mask():
    """Without boundaries every row of a [B, S] batch is one sample; a 2-D attention mask zeroes pad rows as
    transformers does: equal to the unpatched model on right-padded rows."""
    model = _model(4)
    ids = _ids([16]).reshape(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    with _torch_path():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    with hf.patch_qwen3_5_linear_attention(model):
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-10, atol=1e-10)


def test_gradient_checkpointing_and_cache_path():
    """Under gradient checkpointing the recomputed layers find the same boundaries; with a cache (generation)
    the original forward runs."""
    model = _model(4)
    ids = _ids(LENS)
    want_logits, want_grads = _per_sample(model, ids, LENS)
    on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    off = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    on()
    with hf.patch_qwen3_5_linear_attention(model):
        got_logits, got_grads = _loss_grads(model, [(ids, _boundary_kwargs("position_ids", LENS))])
        off()
        model.eval()
        with torch.no_grad(), _torch_path():
            a = model(input_ids=ids[None, :6], use_cache=True).logits
    _close({"logits": got_logits}, {"logits": want_logits}, TOL_LOGITS, "checkpointed")
    _close(got_grads, want_grads, TOL_GRADS, "checkpointed grad")
    with torch.no_grad(), _torch_path():
        b = model(input_ids=ids[None, :6], use_cache=True).logits
    assert torch.equal(a, b)


def test_unpatch_restores_and_patches_compose():
    model = _model(2)
    gdn = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
    layer_hooks = [len(m._forward_pre_hooks) for m in model.modules() if type(m).__name__ == "Qwen3_5DecoderLayer"]
    rope = hf.patch_qwen_vl_rope(model)
    h = hf.patch_qwen3_5_linear_attention(model)
    assert all("forward" in vars(m) for m in gdn)
    assert "LinearAttentionPatch(Qwen3_5ForCausalLM; packed rows" in repr(h)
    with pytest.raises(ValueError, match="already patched"):
        hf.patch_qwen3_5_linear_attention(model)
    rope.unpatch()  # in either order
    assert hf.is_patched(model) is False and all("forward" in vars(m) for m in gdn)
    h.unpatch()
    h.unpatch()  # idempotent
    assert all("forward" not in vars(m) and "_packcuda_gdn" not in vars(m) for m in gdn)
    assert [len(m._forward_pre_hooks) for m in model.modules()
            if type(m).__name__ == "Qwen3_5DecoderLayer"] == layer_hooks
    with pytest.raises(ValueError, match="removed"):
        h.set_plan(packcuda.shard_plan([0, 4], 1, 0))


def test_refusals_before_patching(monkeypatch):
    model = _model(2)
    gdn = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]

    def untouched():
        assert all("forward" not in vars(m) for m in gdn)

    monkeypatch.setattr(hf._common, "transformers_version", lambda: "5.99.0")
    with pytest.raises(hf.UnsupportedTransformersError, match="not a supported version"):
        hf.patch_qwen3_5_linear_attention(model)
    untouched()
    monkeypatch.undo()
    real_src = hf._common._src
    monkeypatch.setattr(hf._common, "_src", lambda obj: real_src(obj).replace("beta = b.sigmoid()", "beta = b"))
    with pytest.raises(hf.UnsupportedTransformersError, match="not the code this patch was written for"):
        hf.patch_qwen3_5_linear_attention(model)
    untouched()
    monkeypatch.undo()
    full = _model(2, layer_types=("full_attention", "full_attention"))
    with pytest.raises(hf.UnsupportedModelError, match="no Qwen3_5GatedDeltaNet"):
        hf.patch_qwen3_5_linear_attention(full)
    cfg = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(hf.UnsupportedModelError, match="model_type"):
        hf.patch_qwen3_5_linear_attention(transformers.Qwen3ForCausalLM(cfg))
    untouched()


def test_cp_plans_accepted_and_refused(tmp_path, monkeypatch):
    """Without flash-linear-attention's CP context the CP patch is refused before anything is patched. With a CP
    recurrence a zigzag plan is accepted: its GatedDeltaNet layers take the relayout path, or the native one for
    a plan of one padded sequence where FLA's CP context has the same zigzag (or always relayout, when asked);
    set_plan switches the path with the plan; a static zigzag plan is refused."""
    import torch.distributed as dist

    la = hf.linear_attention
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = _model(2)
        world = dist.group.WORLD
        zz = packcuda.shard_plan([0, 5, 6], 1, 0)
        one = packcuda.shard_plan([0, 6], 1, 0)
        with monkeypatch.context() as m:
            m.setattr(la, "_fla_cp", lambda: None)
            for plan in (packcuda.shard_plan([0, 6], 1, 0, layout="contiguous"), zz):
                with pytest.raises(ValueError, match="no context-parallel backend"):
                    hf.patch_qwen3_5_linear_attention(model, plan=plan, group=world)
                assert all("forward" not in vars(m) for m in model.modules())
        with pytest.raises(ValueError, match="plan is for cp_size 2"):
            hf.patch_qwen3_5_linear_attention(model, plan=packcuda.shard_plan([0, 6], 2, 0), group=world)
        static = packcuda.static_shard_plan(torch.tensor([0, 6]), 1, 1, 0, capacity=8, max_seqs=1)
        with pytest.raises(ValueError, match="StaticShardPlan with layout 'zigzag'"):
            hf.patch_qwen3_5_linear_attention(model, plan=static, group=world)
        assert all("forward" not in vars(m) for m in model.modules())
        monkeypatch.setattr(la, "_cp_recurrence", lambda plan: _ref_cp_recurrence)
        monkeypatch.setattr(la, "_fla_native_zigzag", lambda: True)
        with hf.patch_qwen3_5_linear_attention(model, plan=zz, group=world) as h:
            assert h.layout_path == "relayout" and "(relayout)" in repr(h)
            h.set_plan(one)
            assert h.layout_path == "native"
            h.set_plan(packcuda.shard_plan([0, 6], 1, 0, layout="contiguous"))
            assert h.layout_path is None
            with pytest.raises(ValueError, match="StaticShardPlan"):
                h.set_plan(static)
        with hf.patch_qwen3_5_linear_attention(model, plan=one, group=world, zigzag_path="relayout") as h:
            assert h.layout_path == "relayout"
        monkeypatch.setattr(la, "_fla_native_zigzag", lambda: False)
        with hf.patch_qwen3_5_linear_attention(model, plan=one, group=world) as h:
            assert h.layout_path == "relayout"
        with hf.patch_qwen3_5_linear_attention(model) as h:
            assert h.layout_path is None
    finally:
        dist.destroy_process_group()



# --------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
@pytest.mark.skipif(not HAS_FLA, reason="needs flash-linear-attention")
@pytest.mark.parametrize("rotary", ["transformers", "packcuda"])
def test_gpu_bf16_packed_equals_samples_alone_fla(rotary):
    """bf16 on the GPU with flash-linear-attention: the patched packed row against the fp64 per-sample oracle
    (transformers' PyTorch layers on the CPU, every sample alone). Tolerance: the bf16 error of the unpatched
    model run per sample on the GPU against the same oracle, times 2 (logits) and 4 (gradients), plus 1e-2."""
    lens = [300, 17, 1, 3, 700, 64]
    oracle = _model(4)
    ids = _ids(lens)
    # the oracle: transformers' PyTorch functions (_per_sample pins them), not the kernels it routes them to
    want_logits, want_grads = _per_sample(oracle, ids, lens)
    model = _model(4, dtype=torch.bfloat16).cuda()
    dids = ids.cuda()
    base_logits, base_grads = _fla_loss_grads(model, [(s, {}) for s in dids.split(lens)])
    kw = {"position_ids": torch.cat([torch.arange(n) for n in lens]).cuda()[None]}
    rope = hf.patch_qwen_vl_rope(model) if rotary == "packcuda" else None
    try:
        with hf.patch_qwen3_5_linear_attention(model) as h:
            assert h.recurrence == "fla varlen"
            got_logits, got_grads = _fla_loss_grads(model, [(dids, kw)])
    finally:
        if rope is not None:
            rope.unpatch()

    def err(a, b):
        return (a.double().cpu() - b).abs().max().item() / max(1.0, b.abs().max().item())

    tol = 2 * err(base_logits, want_logits) + 1e-2
    assert err(got_logits, want_logits) <= tol, (err(got_logits, want_logits), tol)
    if got_grads is None or base_grads is None:
        pytest.skip(f"logits checked; gradients not: {FLA_NO_BACKWARD}")
    for n in want_grads:
        tol = 4 * err(base_grads[n], want_grads[n]) + 1e-2
        assert err(got_grads[n], want_grads[n]) <= tol, (n, err(got_grads[n], want_grads[n]), tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
def test_gpu_conv_with_host_boundaries_does_not_sync():
    """The patched layer's conv on host sample boundaries (a list, e.g. cu_seq_lens_q given on the host) makes
    the host wait for nothing, forward and backward."""
    from helpers import no_sync

    model = _model(4, dtype=torch.bfloat16).cuda()
    layer = model.model.layers[1].linear_attn
    cu = [0, 300, 301, 1000, 4096]
    x = torch.randn(4096, layer.conv_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hf.linear_attention._gdn_conv(layer, x, cu).sum().backward()  # warm-up
    with no_sync():
        y = hf.linear_attention._gdn_conv(layer, x, cu)
        y.backward(torch.ones_like(y))
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
@pytest.mark.skipif(not HAS_FLA, reason="needs flash-linear-attention")
@pytest.mark.parametrize("lens, path", [([300, 17, 1, 3, 700, 64], "auto"), ([1000], "auto"), ([1000], "relayout")])
def test_gpu_zigzag_cp1_equals_packed_run(tmp_path, monkeypatch, lens, path):
    """The zigzag path on CUDA at cp = 1 (an NCCL group of one): the patched fp32 model fed a zigzag plan's slots
    (each GatedDeltaNet layer moved to the contiguous plan and back, or on FLA's own zigzag for one sequence)
    gives the loss and parameter gradients of the unsharded packed run (flash-linear-attention's varlen rule).
    At cp = 1 a zigzag plan's slots are the padded stream and attention is plain sdpa on the plan's positions."""
    import torch.distributed as dist

    if hf.linear_attention._fla_cp() is None:
        pytest.skip("needs flash-linear-attention with fla.ops.cp")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = _model(4, dtype=torch.float32).cuda()
    cu = [0, *accumulate(lens)]
    ids = _ids(lens)
    labels = ref.next_token_labels(ids, cu).cuda()
    count = int((labels != -100).sum())
    pos = ref.position_ids(cu).cuda()[None]
    ids = ids.cuda()
    with hf.patch_qwen3_5_linear_attention(model):
        want_loss = _loss(model(input_ids=ids[None], position_ids=pos, use_cache=False).logits[0], labels, count)
        try:
            want_loss.backward()
            want = {k: p.grad.clone() for k, p in model.named_parameters()}
        except RuntimeError as e:  # the loss is still checked, the gradients not
            if not _fla_refused_backward(e):
                raise
            want = None
    model.zero_grad(set_to_none=True)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        plan = packcuda.shard_plan(cu, 1, 0, device="cuda")
        with hf.patch_qwen3_5_linear_attention(model, plan=plan, group=dist.group.WORLD, zigzag_path=path) as h:
            native = hf.linear_attention._fla_native_zigzag() and len(lens) == 1 and path == "auto"
            assert h.layout_path == ("native" if native else "relayout")
            logits = model(input_ids=plan.shard(ids)[None], position_ids=plan.position_ids[None],
                           use_cache=False).logits[0]
            got_loss = _loss(logits, plan.labels(ids), count)
            if want is not None:
                got_loss.backward()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    if want is None:
        pytest.skip(f"loss checked; gradients not: {FLA_NO_BACKWARD}")
    _close({k: p.grad for k, p in model.named_parameters()}, want, 1e-3, "grad")
