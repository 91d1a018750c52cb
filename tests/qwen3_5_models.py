"""transformers' tiny Qwen3.5 text model with both layer kinds, built from its config with random weights, and
the helpers the Qwen3.5 linear-attention tests share: transformers' own layers pinned to their PyTorch code
(:func:`_torch_path`: where flash-linear-attention is installed, transformers routes them to its GPU kernels, also
for CPU tensors), losses with parameter gradients, tolerances."""
import contextlib
import importlib.util
import inspect

import torch

from hf_models import VERSION_OK, hf, transformers  # noqa: F401  (the tests import them from here)

HAS_FLA = importlib.util.find_spec("fla") is not None


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


# some Triton releases on Hopper: flash-linear-attention raises rather than compute wrong gradients
FLA_NO_BACKWARD = "flash-linear-attention refuses its gated-delta backward with the Triton installed here"


def _fla_refused_backward(e: RuntimeError) -> bool:
    return "Triton" in str(e)


def _fla_loss_grads(model, pieces):
    """_loss_grads, or (logits, None) where flash-linear-attention refuses its backward on this machine."""
    try:
        return _loss_grads(model, pieces)
    except RuntimeError as e:
        if not _fla_refused_backward(e):
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


def _ref_cp_recurrence(q, k, v, g, beta, *, plan, group, state):
    """A CP recurrence for tests (any layout): all-gather the inputs, run transformers' PyTorch rule on every
    sequence of the whole stream, keep this rank's slots (pads get zeros)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    full = [plan.gather(t[0], group)[None] for t in (q, k, v, g, beta)]
    rule = inspect.unwrap(mod.torch_chunk_gated_delta_rule)
    out = hf.linear_attention._per_sample_rule(rule, *full, plan.cu_seqlens_host)
    return plan.shard(out[0])[None]


def _loss(logits, labels, n):
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n
