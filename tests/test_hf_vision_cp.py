"""The vision patch (patch_qwen_vl_vision) on transformers' own tiny Qwen2.5-VL and Qwen3-VL (random fp64 weights):
a whole forward+backward under context parallelism over gloo — each rank encodes its share of the images and video
frames, the text attention attends across ranks through a gather-based reference — equals the unsharded packed
run (transformers' own attention); cp = 1 equals the unpatched model; the handle."""
import contextlib
import copy

import pytest
import torch

import packcuda
from helpers import spawn_ranks
from hf_models import _batch, _model, _pc_positions, _vision_kwargs, hf
from qwen3_5_models import _torch_path

FAMS = ("qwen2_5_vl", "qwen3_vl")
TEXT_ATTENTION = {"qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLAttention"),
                  "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLTextAttention")}


def _fp64(fam, seed=0):
    model = _model(fam, seed).double()
    _, packed = _batch(fam, seed)
    for k in ("pixel_values", "pixel_values_videos"):
        if packed[k] is not None:
            packed[k] = packed[k].double()
    return model, packed


@contextlib.contextmanager
def gather_attention(fam, plan, group):
    """transformers' sdpa for every module but the text attention, which attends from this rank's query slots to
    the keys and values of the whole stream (all-gathered with plan.gather, differentiable), causally within each
    sequence: the reference of attention across CP ranks."""
    import importlib

    from transformers.modeling_utils import AttentionInterface

    text_cls = getattr(importlib.import_module(TEXT_ATTENTION[fam][0]), TEXT_ATTENTION[fam][1])
    sdpa = AttentionInterface._global_mapping["sdpa"]
    cu = torch.tensor(plan.cu_seqlens_host)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    row = plan.index.clamp(min=0)
    allowed = (seg[None, :] == seg[row][:, None]) & (torch.arange(plan.total)[None, :] <= row[:, None])
    pads = plan.index < 0
    allowed[pads] = False
    allowed[pads, 0] = True  # pad slots look at token 0 (their outputs are not used; no NaN)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not isinstance(module, text_cls):
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        rep = query.shape[1] // key.shape[1]
        k = plan.gather(key[0].transpose(0, 1), group).repeat_interleave(rep, dim=1)  # [T, H, D]
        v = plan.gather(value[0].transpose(0, 1), group).repeat_interleave(rep, dim=1)
        scaling = kwargs.get("scaling") or module.scaling
        scores = torch.einsum("shd,thd->hst", query[0].transpose(0, 1), k) * scaling
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hst,thd->shd", probs, v)[None], None

    AttentionInterface._global_mapping["sdpa"] = attention
    try:
        yield
    finally:
        AttentionInterface._global_mapping["sdpa"] = sdpa


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _unsharded(model, fam, packed, pos):
    """The packed row on one process, transformers' own attention: (logits, loss, parameter gradients)."""
    m = copy.deepcopy(model)
    logits = m(input_ids=packed["ids"][None], position_ids=pos, use_cache=False,
               **_vision_kwargs(fam, packed)).logits[0]
    loss = _loss(logits, packcuda.next_token_labels(packed["ids"], packed["cu"]))
    grads = torch.autograd.grad(loss, [p for p in m.parameters()], allow_unused=True)
    return logits.detach(), loss.detach(), [g if g is not None else torch.zeros_like(p)
                                            for g, p in zip(grads, m.parameters())]


def _cp_case(model, fam, packed, pos, want, cp, rank, layout, group):
    import torch.distributed as dist

    logits_ref, loss_ref, grads_ref = want
    m = copy.deepcopy(model)
    ids, cu = packed["ids"], packed["cu"]
    plan = packcuda.shard_plan(cu, cp, rank, layout=layout)
    vplan = hf.qwen_vl_vision_plan(m.config, ids, cu, plan, image_grid_thw=packed["image_grid_thw"],
                                   video_grid_thw=packed["video_grid_thw"])
    with hf.patch_qwen_vl_vision(m, vplan, group), gather_attention(fam, plan, group):
        logits = m(input_ids=plan.shard(ids)[None], position_ids=hf.shard_position_ids(pos, plan), use_cache=False,
                   **_vision_kwargs(fam, packed)).logits[0]
    what = f"{fam} cp={cp} {layout} rank={rank}"
    real = plan.index >= 0
    torch.testing.assert_close(logits[real].detach(), logits_ref[plan.index[real]], rtol=1e-9, atol=1e-10,
                               msg=lambda s: f"{what}: logits: {s}")
    loss = _loss(logits, plan.labels(ids))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total, loss_ref, rtol=1e-10, atol=1e-10)
    for (name, p), g in zip(m.named_parameters(), grads_ref):
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(got, group=group)
        torch.testing.assert_close(got, g, rtol=1e-8, atol=1e-10, msg=lambda s: f"{what}: grad of {name}: {s}")


def _worker(rank, world, init, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
        n = 0
        for fam in FAMS:
            model, packed = _fp64(fam)
            pos = _pc_positions(model, fam, packed)
            want = _unsharded(model, fam, packed, pos)
            for cp in (2, 4):
                for layout in ("zigzag", "contiguous"):
                    if rank < cp:
                        _cp_case(model, fam, packed, pos, want, cp, rank, layout, groups[cp])
                        n += 1
        results[rank] = n
    finally:
        dist.destroy_process_group()


@pytest.mark.spawns
def test_patched_model_under_cp_equals_unsharded_packed_run(tmp_path):
    """Qwen2.5-VL (windowed tower, whole videos) and Qwen3-VL (per-frame videos, deepstack), cp 2 and 4, zigzag and
    contiguous, videos split by frame: the logits of every real slot, the loss summed over ranks and every
    parameter gradient summed over ranks (tower, merger, text model) equal the unsharded packed run."""
    results = spawn_ranks(_worker, 4, tmp_path)
    assert results == {0: 8, 1: 8, 2: 4, 3: 4}


@pytest.fixture
def qwen3_5_torch_path():
    """Qwen3.5's gated delta rules and convs on transformers' PyTorch code: where flash-linear-attention is
    installed, the unpatched model would hand them (CPU tensors included) to its GPU kernels."""
    with _torch_path():
        yield


@pytest.mark.parametrize("fam", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_cp1_patch_equals_unpatched(fam, qwen3_5_torch_path):
    """cp = 1 (no process group): the patched model gives the unpatched logits and gradients; unpatch restores."""
    model, packed = _fp64(fam)
    pos = _pc_positions(model, fam, packed)
    logits_ref, loss_ref, grads_ref = _unsharded(model, fam, packed, pos)
    plan = packcuda.shard_plan(packed["cu"], 1, 0)
    vplan = hf.qwen_vl_vision_plan(model.config, packed["ids"], packed["cu"], plan,
                                   image_grid_thw=packed["image_grid_thw"], video_grid_thw=packed["video_grid_thw"])
    m = copy.deepcopy(model)
    inner_forward = m.model.forward
    kw = _vision_kwargs(fam, packed)
    with hf.patch_qwen_vl_vision(m, vplan) as handle:
        assert handle.active and "forward" in vars(m.model)
        logits = m(input_ids=packed["ids"][None], position_ids=pos, use_cache=False, **kw).logits[0]
        # outside the patched forward the model's feature methods give the tower's own rows (the transformers
        # releases whose forward calls them get them patched for the duration of a forward call)
        for modality, grid in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            if grid in kw:
                pv = kw["pixel_values" if modality == "image" else "pixel_values_videos"]
                got = getattr(m.model, f"get_{modality}_features")(pv, kw[grid]).pooler_output
                want = getattr(model.model, f"get_{modality}_features")(pv, kw[grid]).pooler_output
                torch.testing.assert_close(torch.cat(got), torch.cat(want), rtol=0, atol=0)
    patched = ("forward", "get_image_features", "get_video_features", "_packcuda_vision")
    assert not handle.active and not any(a in vars(m.model) for a in patched)
    assert m.model.forward == inner_forward
    torch.testing.assert_close(logits.detach(), logits_ref, rtol=1e-10, atol=1e-12)
    loss = _loss(logits, packcuda.next_token_labels(packed["ids"], packed["cu"]))
    grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
    for g, w in zip(grads, grads_ref):
        torch.testing.assert_close(g if g is not None else torch.zeros_like(w), w, rtol=1e-10, atol=1e-12)


def test_handle_set_plan_and_refusals():
    fam = "qwen2_5_vl"
    model, packed = _fp64(fam)
    plan = packcuda.shard_plan(packed["cu"], 1, 0)
    mk = lambda **kw: hf.qwen_vl_vision_plan(model.config, packed["ids"], packed["cu"], plan,  # noqa: E731
                                             image_grid_thw=packed["image_grid_thw"],
                                             video_grid_thw=packed["video_grid_thw"], **kw)
    vp1, vp2 = mk(), mk(unit="image")
    handle = hf.patch_qwen_vl_vision(model, vp1)
    try:
        assert handle.plan is vp1
        handle.set_plan(vp2)
        assert handle.plan is vp2
        with pytest.raises(ValueError, match="already patched"):
            hf.patch_qwen_vl_vision(model, vp1)
        # a call with another batch's grids is refused before the tower runs
        kw = _vision_kwargs(fam, packed)
        kw["image_grid_thw"] = kw["image_grid_thw"][:-1]
        with pytest.raises(ValueError, match="image_grid_thw"):
            model(input_ids=packed["ids"][None], use_cache=False, **kw)
    finally:
        handle.unpatch()
    handle.unpatch()  # idempotent
    with pytest.raises(ValueError, match="removed"):
        handle.set_plan(vp1)
