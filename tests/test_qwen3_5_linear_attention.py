"""patch_qwen3_5_linear_attention: transformers' Qwen3.5 GatedDeltaNet layers on packed rows and CP shards.

The oracle is transformers itself: the unpatched model run on every sample alone (where its layers are right),
and the unpatched GatedDeltaNet run on every sequence alone for the CP checks."""
import importlib.util

import pytest
import torch

import packcuda
import reference as ref
from conftest import HAS_CUDA

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("packcuda.integrations.transformers")
from packaging.version import Version  # noqa: E402

VERSION_OK = Version(hf.SUPPORTED_TRANSFORMERS[0]) <= Version(transformers.__version__) < Version(
    hf.SUPPORTED_TRANSFORMERS[1])
HAS_FLA = importlib.util.find_spec("fla") is not None
pytestmark = pytest.mark.skipif(not VERSION_OK, reason="transformers outside the versions the patch supports")
cpu_only = pytest.mark.skipif(HAS_FLA, reason="flash-linear-attention is installed: transformers' unpatched layers "
                                              "and the patch route the recurrence to its GPU kernels")

LENS = [5, 9, 1, 7, 2]  # a 1-token sample, samples shorter than K-1
# transformers' PyTorch gated delta rule computes in fp32 even in an fp64 model, so packed and per-sample runs
# agree to fp32 rounding there (the leak they are checked against is above 1e-3)
TOL_LOGITS, TOL_GRADS = 1e-6, 1e-5


def _config(K=2, layer_types=("full_attention", "linear_attention")):
    """transformers' own tiny Qwen3.5 text config (tests/models/qwen3_5: Qwen3_5TextModelTester), both layer
    kinds; K = linear_conv_kernel_dim (2 there, 4 in the released models)."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu", max_position_embeddings=512,
        layer_types=list(layer_types), tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True},
        linear_conv_kernel_dim=K, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
        linear_num_value_heads=8)


def _model(K=2, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    m = transformers.Qwen3_5ForCausalLM(_config(K, **kw)).to(dtype)
    m.config._attn_implementation = "sdpa"
    return m.train()


def _ids(lens, seed=1):
    return torch.randint(0, 99, (sum(lens),), generator=torch.Generator().manual_seed(seed))


def _loss_grads(model, pieces):
    """Logits of every (input_ids, kwargs) call, concatenated, and the parameter gradients of sum(logits * W)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(input_ids=i[None], use_cache=False, **kw).logits[0] for i, kw in pieces])
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w = w.to(device=logits.device, dtype=logits.dtype)
    (logits * w).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fla_loss_grads(model, pieces):
    """_loss_grads, or (logits, None) where flash-linear-attention refuses its backward on this machine (some
    Triton releases on Hopper: FLA raises rather than compute wrong gradients)."""
    try:
        return _loss_grads(model, pieces)
    except RuntimeError as e:
        if "Triton" not in str(e):
            raise
    with torch.no_grad():
        logits = torch.cat([model(input_ids=i[None], use_cache=False, **kw).logits[0] for i, kw in pieces])
    return logits, None


def _per_sample(model, ids, lens):
    return _loss_grads(model, [(s, {}) for s in ids.split(lens)])


def _close(got, want, tol, what):
    for n in want:
        scale = max(1.0, want[n].abs().max().item())
        err = (got[n] - want[n]).abs().max().item() / scale
        assert err <= tol, f"{what} {n}: error {err:.3g} > {tol}"


def _boundary_kwargs(source, lens):
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if source == "position_ids":
        return {"position_ids": pos[None]}
    if source == "position_ids_4rows":  # [4, 1, T]: the text row, then t/h/w (packed_position_ids' layout)
        return {"position_ids": pos.expand(4, -1)[:, None].clone()}
    if source == "cu_seq_lens_q_host":
        return {"position_ids": pos[None], "cu_seq_lens_q": cu}
    return {"position_ids": pos[None], "cu_seq_lens_q": torch.tensor(cu, dtype=torch.int32)}


@cpu_only
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
    leak_logits, _ = _loss_grads(model, [(ids, plain)])  # unpatched: the conv and the recurrence cross samples
    assert (leak_logits - want_logits).abs().max() > 1e-3
    rope = hf.patch_qwen_vl_rope(model) if rotary == "packcuda" else None
    try:
        with hf.patch_qwen3_5_linear_attention(model) as h:
            assert h.active and h.recurrence == "transformers per sample"
            got_logits, got_grads = _loss_grads(model, [(ids, kw)])
        assert not h.active
    finally:
        if rope is not None:
            rope.unpatch()
    _close({"logits": got_logits}, {"logits": want_logits}, TOL_LOGITS, "packed")
    assert got_grads.keys() == want_grads.keys()
    _close(got_grads, want_grads, TOL_GRADS, "grad")
    # unpatched again: transformers' own layers, bit for bit
    again, _ = _loss_grads(model, [(ids, plain)])
    assert torch.equal(again, leak_logits)


@cpu_only
def test_batch_rows_are_samples_and_padding_mask():
    """Without boundaries every row of a [B, S] batch is one sample; a 2-D attention mask zeroes pad rows as
    transformers does: equal to the unpatched model on right-padded rows."""
    model = _model(4)
    ids = _ids([16]).reshape(2, 8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    with hf.patch_qwen3_5_linear_attention(model):
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-10, atol=1e-10)


@cpu_only
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
        with torch.no_grad():
            a = model(input_ids=ids[None, :6], use_cache=True).logits
    _close({"logits": got_logits}, {"logits": want_logits}, TOL_LOGITS, "checkpointed")
    _close(got_grads, want_grads, TOL_GRADS, "checkpointed grad")
    with torch.no_grad():
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


def test_cp_refused_without_a_cp_recurrence(tmp_path, monkeypatch):
    """Without flash-linear-attention's CP context the CP patch is refused before anything is patched."""
    import torch.distributed as dist

    monkeypatch.setattr(hf.linear_attention, "_fla_cp", lambda: None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = _model(2)
        plan = packcuda.shard_plan([0, 6], 1, 0, layout="contiguous")
        with pytest.raises(ValueError, match="no context-parallel backend"):
            hf.patch_qwen3_5_linear_attention(model, plan=plan, group=dist.group.WORLD)
        assert all("forward" not in vars(m) for m in model.modules())
        with pytest.raises(ValueError, match="plan is for cp_size 2"):
            hf.patch_qwen3_5_linear_attention(model, plan=packcuda.shard_plan([0, 6], 2, 0),
                                              group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------- CP
def _ref_cp_recurrence(q, k, v, g, beta, *, plan, group, state):
    """A CP recurrence for tests: all-gather the inputs, run transformers' PyTorch rule on every sequence of the
    whole stream, keep this rank's slots (pads get zeros)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    full = [plan.gather(t[0], group)[None] for t in (q, k, v, g, beta)]
    out = hf.linear_attention._per_sample_rule(mod.torch_chunk_gated_delta_rule, *full, plan.cu_seqlens_host)
    return plan.shard(out[0])[None]


def _cp_cases():
    """(cp, layout, K, lengths, bucket): samples shorter than K-1, one over several ranks, a bucket segment."""
    return [(cp, layout, K, lens, bucket)
            for cp in (2, 3, 4)
            for layout in ("contiguous", "zigzag")
            for K, lens, bucket in ((2, [7, 12, 1, 9], None), (4, [3, 1, 2, 17, 5], None),
                                    (4, [11, 6, 1], 8 * cp * (2 if layout == "zigzag" else 1)))]


def _cp_worker(rank, world, init, results):
    import torch.distributed as dist

    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    torch.set_num_threads(1)  # four processes share the machine's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in (2, 3, 4)}
        hf.linear_attention._cp_recurrence = lambda plan: _ref_cp_recurrence
        models = {}
        n = 0
        for ci, (cp, layout, K, lens, bucket) in enumerate(_cp_cases()):
            if rank >= cp:
                continue
            group = groups[cp]
            what = f"cp={cp} {layout} K={K} lens={lens} bucket={bucket} rank={rank}"
            cu = [0]
            for L in lens:
                cu.append(cu[-1] + L)
            plan = packcuda.shard_plan(cu, cp, rank, layout=layout, bucket=bucket)
            model = models.setdefault(K, _model(K, layer_types=("linear_attention",)))
            layer = model.model.layers[0].linear_attn
            g = torch.Generator().manual_seed(100 + ci)
            X = torch.randn(cu[-1], 32, generator=g, dtype=torch.float64)
            G = torch.randn(cu[-1], 32, generator=g, dtype=torch.float64)
            params = [p for p in layer.parameters()]
            # the unsharded layer's conv (transformers' causal_conv1d_fn) on every padded sequence alone
            Xp = torch.zeros(plan.total_padded, 32, dtype=torch.float64)
            cup = plan.cu_seqlens_padded_host
            for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # every token at its padded row
                Xp[cup[i]:cup[i] + b - a] = X[a:b]
            real = plan.index >= 0
            rows = ref.local_padded_rows(plan)
            Xr = Xp.clone().requires_grad_()
            mixed = layer.in_proj_qkv(Xr)
            w = layer.conv1d.weight.squeeze(1)
            yr = torch.cat([mod.causal_conv1d_fn(mixed[a:b].T[None], w, None, activation=layer.activation)[0].T
                            for a, b in zip(plan.cu_seqlens_padded_host[:-1], plan.cu_seqlens_padded_host[1:])])
            Gc = torch.randn(yr.shape, generator=g, dtype=torch.float64)
            dXr, dwr = torch.autograd.grad(yr, (Xr, layer.conv1d.weight), Gc)
            # the patched conv on this rank's slots
            xl = Xp[rows].clone().requires_grad_()
            yl = hf.linear_attention._gdn_conv(layer, layer.in_proj_qkv(xl), None, plan=plan, group=group)
            assert torch.allclose(yl, yr.detach()[rows], atol=1e-12, rtol=1e-10), f"conv differs: {what}"
            dxl, dwl = torch.autograd.grad(yl, (xl, layer.conv1d.weight), Gc[rows])
            dist.all_reduce(dwl, group=group)
            assert torch.allclose(dxl, dXr[rows], atol=1e-12, rtol=1e-10), f"conv grad x differs: {what}"
            assert torch.allclose(dwl, dwr, atol=1e-10, rtol=1e-10), f"conv grad weight differs: {what}"
            # the whole patched layer on this rank's slots vs the unpatched layer on every sequence alone
            Xg = X.clone().requires_grad_()
            want = torch.cat([layer(Xg[a:b][None])[0] for a, b in zip(cu[:-1], cu[1:]) if b > a])
            want_dx, *want_grads = torch.autograd.grad(want, [Xg, *params], G)
            with hf.patch_qwen3_5_linear_attention(model, plan=plan, group=group) as h:
                assert "CP" in repr(h) and h.plan is plan and h.group is group
                h.set_plan(packcuda.shard_plan(cu, cp, rank, layout=layout, bucket=bucket))  # the next batch's
                assert h.plan is not plan
                x_local = plan.shard(X).requires_grad_()
                got = layer(x_local[None])[0]
                assert torch.allclose(got[real], want[plan.index[real]], atol=1e-6, rtol=1e-6), f"layer: {what}"
                Gl = plan.shard(G)
                got_grads = torch.autograd.grad(got, [x_local, *params], Gl)
            assert torch.allclose(got_grads[0][real], want_dx[plan.index[real]], atol=1e-6, rtol=1e-6), \
                f"layer grad x: {what}"
            for gr in got_grads[1:]:
                dist.all_reduce(gr, group=group)
            for name, a, b in zip([n for n, _ in layer.named_parameters()], got_grads[1:], want_grads):
                assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"layer grad {name}: {what}"
            n += 1
        results[rank] = n
    finally:
        dist.destroy_process_group()


@cpu_only
def test_cp_conv_and_layer_gloo(tmp_path):
    """cp 2-4 over gloo, contiguous and zigzag, K 2 and 4, samples shorter than K-1, a bucket segment: the
    patched layer's conv (conv_prefix + causal_conv1d on plan.pieces) equals the unsharded layer's conv on this
    rank's slots (values, input and weight gradients); the whole patched layer, with a gather-based reference
    recurrence in place of flash-linear-attention's CP context, equals the unpatched layer run on every
    sequence alone (outputs and parameter gradients)."""
    import torch.multiprocessing as mp

    world = 4
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_cp_worker, args=(world, f"file://{tmp_path}/init", results), nprocs=world, join=True)
    per_rank = {r: sum(1 for c in _cp_cases() if r < c[0]) for r in range(world)}
    assert dict(results) == per_rank


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
    import inspect

    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    # the oracle: transformers' PyTorch functions, not the kernels transformers routes them to when installed
    saved = mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn
    mod.torch_chunk_gated_delta_rule = inspect.unwrap(mod.torch_chunk_gated_delta_rule)
    mod.causal_conv1d_fn = inspect.unwrap(mod.causal_conv1d_fn)
    try:
        want_logits, want_grads = _per_sample(oracle, ids, lens)
    finally:
        mod.torch_chunk_gated_delta_rule, mod.causal_conv1d_fn = saved
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
        pytest.skip("logits checked; gradients not: flash-linear-attention refuses its gated-delta backward "
                    "with the Triton installed here")
    for n in want_grads:
        tol = 4 * err(base_grads[n], want_grads[n]) + 1e-2
        assert err(got_grads[n], want_grads[n]) <= tol, (n, err(got_grads[n], want_grads[n]), tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of packcuda")
def test_gpu_conv_with_host_boundaries_does_not_sync():
    """The patched layer's conv on host sample boundaries (a list, e.g. cu_seq_lens_q given on the host) makes
    the host wait for nothing, forward and backward."""
    from conftest import no_sync

    model = _model(4, dtype=torch.bfloat16).cuda()
    layer = model.model.layers[1].linear_attn
    cu = [0, 300, 301, 1000, 4096]
    x = torch.randn(4096, layer.conv_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hf.linear_attention._gdn_conv(layer, x, cu).sum().backward()  # warm-up
    with no_sync():
        y = hf.linear_attention._gdn_conv(layer, x, cu)
        y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
