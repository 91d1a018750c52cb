"""One Qwen3.5 GatedDeltaNet (linear-attention) layer on a packed row, forward + backward.

A 32k-token pack of 64 samples, bf16, the layer dimensions of transformers' default ``Qwen3_5TextConfig``
(hidden 4096, 16 key / 32 value heads of 128, conv kernel 4: 8192 conv channels). Rows:

- the layer patched with ``patch_qwen3_5_linear_attention`` (packcuda conv on the sample boundaries, FLA's
  varlen gated delta rule) vs the unpatched layer with transformers' default kernels (``causal_conv1d_fn``:
  Dao's causal-conv1d when installed, else ``F.conv1d``; FLA's ``chunk_gated_delta_rule`` with
  ``cu_seq_lens_q``). The unpatched conv does not stop at the sample boundaries, so the baseline computes a
  slightly different (leaking) result: it is the speed of what transformers runs by default.
- the conv alone: ``packcuda.causal_conv1d`` ``[T, C]`` vs transformers' ``causal_conv1d_fn`` on the layer's
  ``[1, C, T]`` layout, both with silu, forward + backward.

Needs a GPU for the layer rows (FLA's kernels are GPU-only); ``python -m benchmarks.bench_qwen3_5 [--quick]``.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import packcuda  # noqa: E402
from benchmarks.harness import Timer, record  # noqa: E402
from packcuda._meta import cu_from_lengths  # noqa: E402


def _lengths(n, total, rng):
    cuts = sorted(rng.sample(range(1, total), n - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def _model(quick: bool, device, dtype):
    import transformers as T

    kw = dict(vocab_size=256, num_hidden_layers=1, layer_types=["linear_attention"])
    if quick:
        kw.update(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  intermediate_size=256)
    torch.manual_seed(0)
    return T.Qwen3_5TextModel(T.Qwen3_5TextConfig(**kw)).to(device=device, dtype=dtype)


def _fwd_bwd(layer, h, g, **kw):
    def step():
        out = layer(h, **kw)
        out.backward(g)
    return step


def rows_and_notes(quick=False, device=None):
    from packcuda.integrations.transformers import patch_qwen3_5_linear_attention
    from packcuda.integrations.transformers.linear_attention import _fla_chunk_rule

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    T, nseq = (2048, 16) if quick or dev.type == "cpu" else (32768, 64)
    cu = cu_from_lengths(_lengths(nseq, T, random.Random(0)))
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=dev)
    model = _model(quick or dev.type == "cpu", dev, dtype)
    layer = model.layers[0].linear_attn
    H, C, K = model.config.hidden_size, layer.conv_dim, layer.conv_kernel_size
    t = Timer(dev, warmup=2 if quick else 5, reps=5 if quick else 20)
    shape = f"T={T} ({nseq} samples), hidden {H}, conv {C}x{K}, {str(dtype).replace('torch.', '')}"
    rows, notes = [], []

    # the conv alone
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    w = layer.conv1d.weight.detach().squeeze(1).clone().requires_grad_()
    x = torch.randn(T, C, device=dev, dtype=dtype, requires_grad=True)
    xt = x.detach().t()[None].contiguous().requires_grad_()  # the layer's [1, C, T] layout
    gy = torch.randn(T, C, device=dev, dtype=dtype)
    gyt = gy.t()[None].contiguous()

    def ours_conv():
        packcuda.causal_conv1d(x, w, None, cu_seqlens=cu, activation="silu").backward(gy)

    def hf_conv():
        mod.causal_conv1d_fn(xt, w, None, activation="silu").backward(gyt)

    ms_o, ms_b = t.median_ms(ours_conv), t.median_ms(hf_conv)
    rows.append(dict(op="GatedDeltaNet conv fwd+bwd", shape=shape, packcuda_ms=ms_o,
                     baseline="transformers causal_conv1d_fn (default kernel, no sample boundaries)",
                     baseline_ms=ms_b, speedup=ms_b / ms_o))

    # the whole layer
    if _fla_chunk_rule() is None or dev.type != "cuda":
        notes.append("layer rows skipped: they need a GPU and flash-linear-attention (pip install "
                     "flash-linear-attention)")
        return rows, notes
    h = torch.randn(1, T, H, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(1, T, H, device=dev, dtype=dtype)
    what, step = "fwd+bwd", _fwd_bwd
    try:
        _fwd_bwd(layer, h, g, cu_seq_lens_q=cu_dev)()
    except RuntimeError as e:  # FLA refuses its gated-delta backward with some Triton releases on Hopper
        if "Triton" not in str(e):
            raise
        notes.append(f"layer rows are forward only: flash-linear-attention refuses its backward here ({e}).")
        what = "fwd"

        def step(layer, h, g, **kw):
            def go():
                with torch.no_grad():
                    layer(h, **kw)
            return go
    ms_b = t.median_ms(step(layer, h, g, cu_seq_lens_q=cu_dev))
    with patch_qwen3_5_linear_attention(model):
        ms_dev = t.median_ms(step(layer, h, g, cu_seq_lens_q=cu_dev))
        ms_host = t.median_ms(step(layer, h, g, cu_seq_lens_q=cu))
    for how, ms in (("device cu_seqlens", ms_dev), ("host cu_seqlens", ms_host)):
        rows.append(dict(op=f"GatedDeltaNet layer {what}, patched ({how})", shape=shape, packcuda_ms=ms,
                         baseline="unpatched layer, transformers default kernels (FLA recurrence)",
                         baseline_ms=ms_b, speedup=ms_b / ms))
    return rows, notes


def run(quick=False, device=None) -> list[dict]:
    return rows_and_notes(quick, device)[0]


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    rows, notes = rows_and_notes(quick=quick)
    record("Qwen3.5 GatedDeltaNet layer, packed 32k", rows, notes=" ".join(notes), write=not quick)
