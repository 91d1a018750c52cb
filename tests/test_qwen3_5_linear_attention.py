"""patch_qwen3_5_linear_attention: transformers' Qwen3.5 GatedDeltaNet layers on packed rows and CP shards.

The oracle is transformers itself: the unpatched model run on every sample alone (where its layers are right),
the unpatched GatedDeltaNet run on every sequence alone for the CP checks, and the unsharded packed run for the
whole model under a zigzag plan. Every run of transformers' own layers pins their PyTorch functions
(:func:`_torch_path`): where flash-linear-attention is installed, transformers routes them to its GPU kernels,
also for CPU tensors."""
import contextlib
import importlib.util
import inspect
from itertools import accumulate

import pytest
import torch

import packcuda
import reference as ref
from helpers import HAS_CUDA, spawn_ranks

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("packcuda.integrations.transformers")
from packaging.version import Version  # noqa: E402

VERSION_OK = Version(hf.SUPPORTED_TRANSFORMERS[0]) <= Version(transformers.__version__) < Version(
    hf.SUPPORTED_TRANSFORMERS[1])
HAS_FLA = importlib.util.find_spec("fla") is not None
pytestmark = pytest.mark.skipif(not VERSION_OK, reason="transformers outside the versions the patch supports")

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


@contextlib.contextmanager
def _torch_path():
    """transformers' Qwen3.5 modeling module with its gated delta rules and convs pinned to their PyTorch code
    (the module's names route to flash-linear-attention's / causal-conv1d's kernels where installed)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
             "causal_conv1d_update")
    saved = {n: getattr(mod, n) for n in names}
    try:
        for n, f in saved.items():
            setattr(mod, n, inspect.unwrap(f))
        yield mod
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)


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
    with _torch_path():
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


# ------------------------------------------------------------------------ zigzag: packcuda's and FLA's CP parts
def _fla_zigzag_rows(cu_padded, cp, rank):
    """The padded-stream rows flash-linear-attention's zigzag CP context gives rank `rank` of `cp`
    (fla.ops.cp.context.get_cp_cu_seqlens, pure Python, no group): its front and back parts in local-buffer order,
    each part_len rows, at the chain slots the context reports. None where FLA's CP context has no zigzag."""
    ctxmod = pytest.importorskip("fla.ops.cp.context")
    if "layout" not in inspect.signature(ctxmod.get_cp_cu_seqlens).parameters:
        return None
    cu = torch.tensor(cu_padded, dtype=torch.int64)
    ctx = ctxmod.get_cp_cu_seqlens(cu, cu_seqlens_cpu=cu, world_size=cp, rank=rank, layout="zigzag")
    pl = ctx.part_len
    # chain slot of each part: the number of earlier parts of the stream's first sequence (which starts at row 0)
    slots = ctx.pre_num_ranks_by_part if len(cu_padded) == 2 else (rank, 2 * cp - 1 - rank)
    return ctx, [i for s in slots for i in range(s * pl, (s + 1) * pl)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_of_one_sequence_is_fla_zigzag(cp):
    """The native path's premise, against flash-linear-attention's own CP partition (get_cp_cu_seqlens with
    layout='zigzag'): for one padded sequence (lengths that need pads and lengths that do not), every rank's
    packcuda zigzag rows (hybrid_plans' zigzag plan, from its pieces) are the rows FLA's context gives it: parts r
    and 2*cp-1-r of the sequence, front then back, part_len = total_local / 2, local cu_seqlens [0, part_len,
    2*part_len]. With several sequences the layouts differ (FLA zigzags the whole stream, packcuda every
    sequence), which is why that case takes the relayout path."""
    if _fla_zigzag_rows([0, 2 * cp], cp, 0) is None:
        pytest.skip("the installed flash-linear-attention's CP context has no zigzag layout")
    assert hf.linear_attention._fla_native_zigzag()
    for L in (2 * cp, 2 * cp * 5, 2 * cp * 7 - 3, 1):
        for r in range(cp):
            zz = packcuda.hybrid_plans([0, L], cp, r)[0]
            ctx, fla_rows = _fla_zigzag_rows(zz.cu_seqlens_padded_host, cp, r)
            assert ctx.pre_num_ranks_by_part == (r, 2 * cp - 1 - r), (cp, L, r)
            assert 2 * ctx.part_len == zz.total_local, (cp, L, r)
            assert ctx.cu_seqlens_cpu.tolist() == [0, ctx.part_len, 2 * ctx.part_len], (cp, L, r)
            assert ref.local_padded_rows(zz).tolist() == fla_rows, (cp, L, r)
    lens = [2 * cp * 3, 2 * cp * 2]
    zz = [packcuda.hybrid_plans(list(accumulate([0] + lens)), cp, r)[0] for r in range(cp)]
    assert any(ref.local_padded_rows(p).tolist() != _fla_zigzag_rows(p.cu_seqlens_padded_host, cp, r)[1]
               for r, p in enumerate(zz))


def _layout_path_worker(rank, world, init, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = _cp_groups(dist, world)
        hf.linear_attention._cp_recurrence = lambda plan: _ref_cp_recurrence
        model = _model(2)
        for cp in (2, 3, 4):
            if rank >= cp:
                continue
            cases = {"one": ([0, 11], None, "auto"), "one_bucket": ([0, 11], 2 * cp * 4, "auto"),
                     "several": ([0, 5, 11], None, "auto"), "one_asked_relayout": ([0, 11], None, "relayout")}
            for name, (cu, bucket, path) in cases.items():
                plan = packcuda.hybrid_plans(cu, cp, rank, bucket=bucket)[0]
                with hf.patch_qwen3_5_linear_attention(model, plan=plan, group=groups[cp], zigzag_path=path) as h:
                    results[(cp, name, rank)] = h.layout_path
    finally:
        dist.destroy_process_group()


def test_zigzag_layout_path_bucket_or_several_sequences(tmp_path):
    """cp 2-4 over gloo (the installed recurrence, or none: the patch's layout path does not depend on it): a zigzag
    plan with a bucket pad segment, or of several sequences, or with zigzag_path='relayout', takes the relayout path
    on every rank (handle.layout_path == 'relayout'); one padded sequence takes the native path exactly where the
    installed flash-linear-attention's CP context has the zigzag layout."""
    results = spawn_ranks(_layout_path_worker, 4, tmp_path)
    native = "native" if hf.linear_attention._fla_native_zigzag() else "relayout"
    for cp in (2, 3, 4):
        for name, want in (("one", native), ("one_bucket", "relayout"), ("several", "relayout"),
                           ("one_asked_relayout", "relayout")):
            assert [results[(cp, name, r)] for r in range(cp)] == [want] * cp, (cp, name)


# ---------------------------------------------------------------------------------------------------------- CP
def _ref_cp_recurrence(q, k, v, g, beta, *, plan, group, state):
    """A CP recurrence for tests (any layout): all-gather the inputs, run transformers' PyTorch rule on every
    sequence of the whole stream, keep this rank's slots (pads get zeros)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    full = [plan.gather(t[0], group)[None] for t in (q, k, v, g, beta)]
    rule = inspect.unwrap(mod.torch_chunk_gated_delta_rule)
    out = hf.linear_attention._per_sample_rule(rule, *full, plan.cu_seqlens_host)
    return plan.shard(out[0])[None]


def _which_recurrence() -> str:
    """Which recurrence the CPU CP tests run, as their parameter id (flash-linear-attention's CP kernels are GPU
    kernels: on the CPU the gather-based reference runs either way)."""
    return "gather-reference-recurrence-" + ("fla-cp-needs-cuda" if hf.linear_attention._fla_cp() else "no-fla-cp")


def _cp_groups(dist, world):
    return {cp: (dist.new_group(list(range(cp))) if cp < world else dist.group.WORLD) for cp in range(2, world + 1)}


def _cp_cases():
    """(cp, layout, K, lengths, bucket): samples shorter than K-1, one over several ranks, a bucket segment."""
    return [(cp, layout, K, lens, bucket)
            for cp in (2, 3, 4)
            for layout in ("contiguous", "zigzag")
            for K, lens, bucket in ((2, [7, 12, 1, 9], None), (4, [3, 1, 2, 17, 5], None),
                                    (4, [11, 6, 1], 8 * cp * (2 if layout == "zigzag" else 1)))]


def _cp_worker(rank, world, init, results):
    import torch.distributed as dist

    torch.set_num_threads(1)  # four processes share the machine's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = _cp_groups(dist, world)
        hf.linear_attention._cp_recurrence = lambda plan: _ref_cp_recurrence
        models = {}
        n = 0
        for ci, (cp, layout, K, lens, bucket) in enumerate(_cp_cases()):
            if rank >= cp:
                continue
            group = groups[cp]
            what = f"cp={cp} {layout} K={K} lens={lens} bucket={bucket} rank={rank}"
            cu = [0, *accumulate(lens)]
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
            with _torch_path() as mod:
                yr = torch.cat([mod.causal_conv1d_fn(mixed[a:b].T[None], w, None, activation=layer.activation)[0].T
                                for a, b in zip(cup[:-1], cup[1:])])
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
            with _torch_path():
                want = torch.cat([layer(Xg[a:b][None])[0] for a, b in zip(cu[:-1], cu[1:]) if b > a])
            want_dx, *want_grads = torch.autograd.grad(want, [Xg, *params], G)
            with hf.patch_qwen3_5_linear_attention(model, plan=plan, group=group) as h:
                assert "CP" in repr(h) and h.plan is plan and h.group is group
                h.set_plan(packcuda.shard_plan(cu, cp, rank, layout=layout, bucket=bucket))  # the next batch's
                assert h.plan is not plan
                assert h.layout_path == (None if layout == "contiguous" else "relayout")
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


@pytest.mark.parametrize("recurrence", [_which_recurrence()])
def test_cp_conv_and_layer_gloo(tmp_path, recurrence):
    """cp 2-4 over gloo, contiguous and zigzag, K 2 and 4, samples shorter than K-1, a bucket segment: the
    patched layer's conv (conv_prefix + causal_conv1d on plan.pieces) equals the unsharded layer's conv on this
    rank's slots (values, input and weight gradients); the whole patched layer (zigzag: moved to the contiguous
    plan and back), with a gather-based reference recurrence in place of flash-linear-attention's CP context,
    equals the unpatched layer run on every sequence alone (outputs and parameter gradients)."""
    world = 4
    results = spawn_ranks(_cp_worker, world, tmp_path)
    per_rank = {r: sum(1 for c in _cp_cases() if r < c[0]) for r in range(world)}
    assert results == per_rank


# ------------------------------------------------------------------------------- hybrid model, zigzag plan
_CP_ATTENTION = "packcuda_test_cp_reference"


def _cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Softmax attention of a CP rank's zigzag slots for tests (an AttentionInterface function): all-gather q,
    k, v to the whole stream, causal attention on every sequence alone, keep this rank's slots (pads get
    zeros). The plan and group come from the module's ``packcuda_cp`` attribute."""
    plan, group = module.packcuda_cp
    q, k, v = (plan.gather(t[0].transpose(0, 1), group) for t in (query, key, value))  # [T, H, D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = plan.cu_seqlens_host
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True,
        scale=scaling).transpose(0, 1) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    return plan.shard(torch.cat(outs))[None], None


def _model_cases():
    """(cp, K, lengths, bucket, zigzag_path, native): several sequences (one over several ranks, one shorter
    than K-1), a bucket segment, one sequence (native path where FLA's zigzag is offered, or relayout)."""
    return [(cp, K, lens, bucket, path, native)
            for cp in (2, 3, 4)
            for K, lens, bucket, path, native in (
                (4, [3, 1, 2, 17, 5], None, "auto", True),
                (2, [11, 6, 1], 16 * cp, "auto", False),
                (4, [23], None, "auto", True),
                (4, [23], None, "relayout", True))]


def _loss(logits, labels, n):
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n


def _model_worker(rank, world, init, results):
    import torch.distributed as dist

    la = hf.linear_attention
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = _cp_groups(dist, world)
        transformers.AttentionInterface.register(_CP_ATTENTION, _cp_attention)
        la._cp_recurrence = lambda plan: _ref_cp_recurrence
        moved = []
        relayout = packcuda.relayout

        def recording_relayout(x, src, dst, group, **kw):
            moved.append(tuple(x.shape))
            return relayout(x, src, dst, group, **kw)

        packcuda.relayout = recording_relayout
        n = 0
        for ci, (cp, K, lens, bucket, path, native) in enumerate(_model_cases()):
            if rank >= cp:
                continue
            group = groups[cp]
            what = f"cp={cp} K={K} lens={lens} bucket={bucket} path={path} native={native} rank={rank}"
            la._fla_native_zigzag = lambda: native
            model = _model(K, seed=ci, layer_types=("linear_attention", "full_attention", "linear_attention"))
            cu = [0, *accumulate(lens)]
            ids = _ids(lens, seed=ci)
            labels = ref.next_token_labels(ids, cu)
            count = int((labels != -100).sum())
            # the unsharded packed run (sdpa on the packed row, the patch without a plan)
            pos = ref.position_ids(cu)[None]
            model.zero_grad(set_to_none=True)
            with hf.patch_qwen3_5_linear_attention(model):
                want_loss = _loss(model(input_ids=ids[None], position_ids=pos, use_cache=False).logits[0], labels,
                                  count)
                want_loss.backward()
            want = {k: p.grad.clone() for k, p in model.named_parameters()}
            # this rank's zigzag slots: attention across ranks through the gather-based reference
            plan = packcuda.shard_plan(cu, cp, rank, bucket=bucket)
            model.zero_grad(set_to_none=True)
            model.config._attn_implementation = _CP_ATTENTION
            for m in model.modules():
                if type(m).__name__ == "Qwen3_5Attention":
                    m.packcuda_cp = (plan, group)
            del moved[:]
            with hf.patch_qwen3_5_linear_attention(model, plan=plan, group=group, zigzag_path=path) as h:
                expect = "native" if native and path == "auto" and len(lens) == 1 and bucket is None else "relayout"
                assert h.layout_path == expect, (h.layout_path, what)
                logits = model(input_ids=plan.shard(ids)[None], position_ids=plan.position_ids[None],
                               use_cache=False).logits[0]
                local = _loss(logits, plan.labels(ids), count)
                local.backward()
            # relayout path: each GatedDeltaNet layer moves [total_local, hidden_size] in and out, nothing else
            hidden = model.config.hidden_size
            assert moved == ([] if expect == "native" else
                             [(plan.total_local, hidden)] * 4), (moved, what)
            got_loss = local.detach().clone()
            dist.all_reduce(got_loss, group=group)
            assert torch.allclose(got_loss, want_loss.detach(), atol=1e-9, rtol=1e-9), \
                f"loss {got_loss.item()} != {want_loss.item()}: {what}"
            got = {k: p.grad.clone() for k, p in model.named_parameters()}
            for gr in got.values():
                dist.all_reduce(gr, group=group)
            _close(got, want, TOL_GRADS, f"({what}) grad")
            n += 1
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recurrence", [_which_recurrence()])
def test_cp_zigzag_hybrid_model_gloo(tmp_path, recurrence):
    """transformers' tiny Qwen3.5 with both layer kinds, fp64, cp 2-4 over gloo with zigzag plans: the loss
    and every parameter gradient equal the unsharded packed run. Attention runs on the zigzag slots (positions
    from the plan) through a gather-based reference across ranks; each GatedDeltaNet layer moves its
    hidden_size-wide input to the contiguous plan and its output back (relayout path), or stays on the zigzag
    slots (native path: one padded sequence, FLA's zigzag offered); the recurrence is a gather-based
    reference (flash-linear-attention's CP kernels need CUDA; the parameter id says whether FLA's CP context
    is installed)."""
    world = 4
    results = spawn_ranks(_model_worker, world, tmp_path)
    assert results == {r: sum(1 for c in _model_cases() if r < c[0]) for r in range(world)}


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
        except RuntimeError as e:  # see _fla_loss_grads
            if "Triton" not in str(e):
                raise
            pytest.skip("flash-linear-attention refuses its gated-delta backward with the Triton installed here")
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
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
            got_loss.backward()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    _close({k: p.grad for k, p in model.named_parameters()}, want, 1e-3, "grad")
