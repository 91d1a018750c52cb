"""patch_qwen3_5_linear_attention under context parallelism, over gloo on the CPU: packcuda's zigzag against
flash-linear-attention's zigzag CP parts, the layout path a plan takes, the conv and the GatedDeltaNet layer on
contiguous shards against transformers' layer run on every sequence alone, and the whole hybrid model under a
zigzag plan against the unsharded packed run (attention across ranks through a gather-based reference; the
recurrence through FLA's CP context where installed, else through a gather-based reference: the test id says
which ran)."""
import inspect
from itertools import accumulate

import pytest
import torch

import packcuda
import reference as ref
from helpers import spawn_ranks
from qwen3_5_models import (
    TOL_GRADS,
    VERSION_OK,
    _close,
    _ids,
    _loss,
    _model,
    _ref_cp_recurrence,
    _torch_path,
    hf,
    transformers,
)

pytestmark = pytest.mark.skipif(not VERSION_OK, reason="transformers outside the versions the patch supports")


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


@pytest.mark.spawns
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
@pytest.mark.spawns
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
@pytest.mark.spawns
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
