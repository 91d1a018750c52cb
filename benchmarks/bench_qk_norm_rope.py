"""Fused per-head QK-RMSNorm + (m)RoPE (packcuda.apply_qk_norm_rope) vs the copy floor, the unfused packcuda
path (transformers' norm modules + packcuda.apply_rope), transformers eager (norm modules + apply_rotary_pos_emb),
torch.compile of that, and Liger-Kernel's RMSNorm + rope (when importable), forward and forward+backward, bf16.

    python -m benchmarks.bench_qk_norm_rope [--quick] [--device cuda] [--no-write]

Shapes: Qwen3-VL-8B (32, 8, 128) interleaved mRoPE with norm "rms", Qwen3.5 (24, 4, 256) partial rotary (64 of
256) with norm "rms_offset", T = 32k and 128k. The floor is a copy_ of q and k (each read once and written once);
x_copy = ms / copy_ms (goals: fwd <= 1.15, fwd+bwd <= 2.4). fwd+bwd = torch.autograd.grad of (q_out, k_out) on
q, k and both norm weights. packcuda computes cos/sin from positions inside its pass; the baselines get
transformers' cos/sin precomputed. q and k are the transposed [1, H, T, D] views a transformers attention passes.
"""
from __future__ import annotations

import torch

import packcuda
from benchmarks.bench_rope_apply import _positions
from benchmarks.harness import Timer, cli, graph_ms
from benchmarks.host_time import HOST_NOTE, host_rows

# name, Hq, Hk, D, rotary_dim, mrope_section, interleaved, theta, norm
SHAPES = [
    ("Qwen3-VL-8B interleaved, rms", 32, 8, 128, 128, [24, 20, 20], True, 5e6, "rms"),
    ("Qwen3.5 partial 64/256, rms_offset", 24, 4, 256, 64, [11, 11, 10], True, 1e7, "rms_offset"),
]
EPS = 1e-6


def _hf(D, rd, section, theta, norm):
    """(rotary module, apply_rotary_pos_emb, norm class) of transformers for the layout, or None."""
    try:
        if norm == "rms_offset":
            from transformers.models.qwen3_5 import configuration_qwen3_5 as c, modeling_qwen3_5 as m

            cfg = c.Qwen3_5TextConfig(hidden_size=256, num_attention_heads=1, num_key_value_heads=1, head_dim=D,
                                      rope_parameters=dict(rope_type="default", rope_theta=theta,
                                                           mrope_section=section, mrope_interleaved=True,
                                                           partial_rotary_factor=rd / D))
            return m.Qwen3_5TextRotaryEmbedding(cfg), m.apply_rotary_pos_emb, m.Qwen3_5RMSNorm
        from transformers.models.qwen3_vl import configuration_qwen3_vl as c, modeling_qwen3_vl as m

        cfg = c.Qwen3VLTextConfig(hidden_size=256, num_attention_heads=1, num_key_value_heads=1, head_dim=D,
                                  rope_parameters=dict(rope_type="default", rope_theta=theta, mrope_section=section,
                                                       mrope_interleaved=True))
        return m.Qwen3VLTextRotaryEmbedding(cfg), m.apply_rotary_pos_emb, m.Qwen3VLTextRMSNorm
    except ImportError:
        return None


def _liger(D, norm):
    """(q_norm, k_norm, rope) of Liger-Kernel as its model patches configure them for the norm kind, or None."""
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    if norm == "rms_offset":  # zero-centred weight: (1 + w), computed in fp32 (Liger's gemma casting)
        kw = dict(offset=1.0, casting_mode="gemma", init_fn="zeros")
    else:  # w * x_normed.to(dtype) (Liger's llama casting)
        kw = dict(offset=0.0, casting_mode="llama", init_fn="ones")
    return (lambda: LigerRMSNorm(D, eps=EPS, **kw)), liger_rotary_pos_emb


def run(quick: bool = False, device=None) -> list[dict]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = dev.type == "cpu"
    timer = Timer(dev, warmup=2 if cpu else 5, reps=3 if cpu else 50)
    if cpu:
        Ts, shapes = [512], SHAPES[:1] if quick else SHAPES
    elif quick:
        Ts, shapes = [32768], SHAPES
    else:
        Ts, shapes = [32768, 131072], SHAPES
    rows = []

    def make(T, Hq, Hk, D, rd, section, inter, theta, norm):
        g = torch.Generator(device=dev).manual_seed(T * 1000 + Hq * 10 + Hk)
        # one [T, Hq + Hk, D] projection buffer: q and k are views of it (as a fused QKV projection output)
        q = torch.randn(T, Hq, D, device=dev, generator=g).bfloat16()
        k = torch.randn(T, Hk, D, device=dev, generator=g).bfloat16()
        w0 = 1.0 if norm == "rms" else 0.0
        wq = (w0 + 0.1 * torch.randn(D, device=dev, generator=g)).bfloat16()
        wk = (w0 + 0.1 * torch.randn(D, device=dev, generator=g)).bfloat16()
        kw = dict(inv_freq=packcuda.default_inv_freq(theta, rd).to(dev), rotary_dim=rd, mrope_section=section,
                  mrope_interleaved=inter)
        return q, k, wq, wk, _positions(T, dev, g), kw

    def grad_leaves(*xs):
        return [x.detach().clone().requires_grad_() for x in xs]

    # Pass 1: packcuda (fused and unfused) and the copy floor, before any torch.compile runs.
    ours = {}
    for T in Ts:
        for name, Hq, Hk, D, rd, section, inter, theta, norm in shapes:
            shape = f"{name} T={T} ({Hq},{Hk},{D})"
            q, k, wq, wk, pos, kw = make(T, Hq, Hk, D, rd, section, inter, theta, norm)
            nkw = dict(kw, q_weight=wq, k_weight=wk, eps=EPS, norm=norm)
            qd, kd = torch.empty_like(q), torch.empty_like(k)

            def copy():
                qd.copy_(q)
                kd.copy_(k)

            t_copy = timer.median_ms(copy)
            t_fwd = timer.median_ms(lambda: packcuda.apply_qk_norm_rope(q, k, pos, **nkw))
            qi, ki = q.clone(), k.clone()
            t_inp = timer.median_ms(lambda: packcuda.apply_qk_norm_rope_(qi, ki, pos, **nkw))
            ql, kl, wql, wkl = grad_leaves(q, k, wq, wk)
            gq, gk = torch.randn_like(q), torch.randn_like(k)

            def ours_fb():
                qo, ko = packcuda.apply_qk_norm_rope(ql, kl, pos, q_weight=wql, k_weight=wkl, eps=EPS, norm=norm,
                                                     **kw)
                torch.autograd.grad((qo, ko), (ql, kl, wql, wkl), (gq, gk))

            t_fb = timer.median_ms(ours_fb)
            timed = [("apply_qk_norm_rope fwd", t_fwd), ("apply_qk_norm_rope_ fwd (in place)", t_inp),
                     ("apply_qk_norm_rope fwd+bwd", t_fb)]
            if not cpu:  # kernel time alone: the same calls captured in a CUDA graph (no host work, no autograd engine)
                timed += [("apply_qk_norm_rope fwd (CUDA graph)",
                           graph_ms(timer, lambda: packcuda.apply_qk_norm_rope(q, k, pos, **nkw))),
                          ("apply_qk_norm_rope fwd+bwd (CUDA graph)", graph_ms(timer, ours_fb))]
            ours[shape] = (t_copy, t_fwd, t_fb)
            base = dict(shape=shape, copy_ms=t_copy)
            for op, t in timed:
                rows.append(dict(op=op, packcuda_ms=t, baseline="copy_ floor", baseline_ms=t_copy,
                                 speedup=t_copy / t, x_copy=t / t_copy, **base))

            # unfused packcuda: transformers' norm modules (torch ops), then packcuda.apply_rope
            hf = _hf(D, rd, section, theta, norm)
            if hf is not None:
                _, _, Norm = hf
                nq, nk = Norm(D, eps=EPS).to(dev).bfloat16(), Norm(D, eps=EPS).to(dev).bfloat16()
                with torch.no_grad():
                    nq.weight.copy_(wq)
                    nk.weight.copy_(wk)
                    t_un = timer.median_ms(lambda: packcuda.apply_rope(nq(q), nk(k), pos, **kw))
                qu, ku = grad_leaves(q, k)

                def unfused_fb():
                    qo, ko = packcuda.apply_rope(nq(qu), nk(ku), pos, **kw)
                    torch.autograd.grad((qo, ko), (qu, ku, nq.weight, nk.weight), (gq, gk))

                t_un_fb = timer.median_ms(unfused_fb)
                rows.append(dict(op="apply_qk_norm_rope fwd", packcuda_ms=t_fwd,
                                 baseline="unfused: transformers norm + packcuda.apply_rope", baseline_ms=t_un,
                                 speedup=t_un / t_fwd, **base))
                rows.append(dict(op="apply_qk_norm_rope fwd+bwd", packcuda_ms=t_fb,
                                 baseline="unfused: transformers norm + packcuda.apply_rope", baseline_ms=t_un_fb,
                                 speedup=t_un_fb / t_fb, **base))
            del q, k, qd, kd, qi, ki, ql, kl, gq, gk
            if not cpu:
                torch.cuda.empty_cache()

    # Pass 2: transformers eager, torch.compile, Liger; each against the packcuda times of its shape.
    for T in Ts:
        for name, Hq, Hk, D, rd, section, inter, theta, norm in shapes:
            shape = f"{name} T={T} ({Hq},{Hk},{D})"
            t_copy, t_fwd, t_fb = ours[shape]
            extra = dict(shape=shape, copy_ms=t_copy)
            hf = _hf(D, rd, section, theta, norm)
            if hf is None:
                rows.append(dict(op="transformers baselines", shape=shape, baseline="skipped: transformers missing"))
                continue
            rot, hf_apply, Norm = hf
            rot = rot.to(dev)
            q, k, wq, wk, pos, kw = make(T, Hq, Hk, D, rd, section, inter, theta, norm)
            nq, nk = Norm(D, eps=EPS).to(dev).bfloat16(), Norm(D, eps=EPS).to(dev).bfloat16()
            with torch.no_grad():
                nq.weight.copy_(wq)
                nk.weight.copy_(wk)
            qh, kh = q[None], k[None]  # [1, T, H, D]: the norm runs there, then the [1, H, T, D] transposed view
            gqh, gkh = torch.randn_like(qh).transpose(1, 2), torch.randn_like(kh).transpose(1, 2)
            with torch.no_grad():
                cos, sin = rot(qh, pos[:, None, :])
                # correctness in the same run: ours vs transformers, within bf16 rounding of each other
                oq = packcuda.apply_qk_norm_rope(q, k, pos, q_weight=wq, k_weight=wk, eps=EPS, norm=norm, **kw)[0]
                hq = hf_apply(nq(qh).transpose(1, 2), nk(kh).transpose(1, 2), cos, sin)[0].transpose(1, 2)[0]
                assert (oq.float() - hq.float()).abs().max() <= 0.1 * hq.float().abs().max(), "results disagree"

            def hf_fn(qx, kx, cos_, sin_):
                return hf_apply(nq(qx).transpose(1, 2), nk(kx).transpose(1, 2), cos_, sin_)

            compiled = torch.compile(hf_fn)
            with torch.no_grad():
                t_eager = timer.median_ms(lambda: hf_fn(qh, kh, cos, sin))
                t_comp = timer.median_ms(lambda: compiled(qh, kh, cos, sin))
            qhl, khl = grad_leaves(qh, kh)

            def fb(fn):
                def f():
                    a, b = fn(qhl, khl, cos, sin)
                    torch.autograd.grad((a, b), (qhl, khl, nq.weight, nk.weight), (gqh, gkh))
                return f

            t_eager_fb = timer.median_ms(fb(hf_fn))
            t_comp_fb = timer.median_ms(fb(compiled))
            for base_name, tf, tfb in (("transformers eager (norm modules + apply)", t_eager, t_eager_fb),
                                       ("torch.compile(transformers norm + apply)", t_comp, t_comp_fb)):
                rows.append(dict(op="apply_qk_norm_rope fwd", packcuda_ms=t_fwd, baseline=base_name,
                                 baseline_ms=tf, speedup=tf / t_fwd, **extra))
                rows.append(dict(op="apply_qk_norm_rope fwd+bwd", packcuda_ms=t_fb, baseline=base_name,
                                 baseline_ms=tfb, speedup=tfb / t_fb, **extra))
            liger = None if cpu else _liger(D, norm)
            if liger is None:
                rows.append(dict(op="Liger RMSNorm + rope", shape=shape,
                                 baseline="skipped: liger-kernel missing" if not cpu else "skipped: CPU"))
            elif rd < D:
                rows.append(dict(op="Liger RMSNorm + rope", shape=shape,
                                 baseline="skipped: Liger's rope rotates the whole head (no partial rotary)"))
            else:
                make_norm, lrope = liger
                lq, lk = make_norm().to(dev).bfloat16(), make_norm().to(dev).bfloat16()
                with torch.no_grad():
                    lq.weight.copy_(wq)
                    lk.weight.copy_(wk)

                # as a model calls them: norm on the [1, T, H, D] projection views, rope on the transposed views
                # with transformers' (interleaved) cos/sin, no extra copies
                def lig(qx, kx):
                    return lrope(lq(qx).transpose(1, 2), lk(kx).transpose(1, 2), cos, sin)

                with torch.no_grad():
                    t_lig = timer.median_ms(lambda: lig(qh, kh))
                qlg, klg = grad_leaves(qh, kh)

                def lig_fb():
                    a, b = lig(qlg, klg)
                    torch.autograd.grad((a, b), (qlg, klg, lq.weight, lk.weight), (gqh, gkh))

                t_lig_fb = timer.median_ms(lig_fb)
                rows.append(dict(op="apply_qk_norm_rope fwd", packcuda_ms=t_fwd, baseline="Liger RMSNorm + rope",
                                 baseline_ms=t_lig, speedup=t_lig / t_fwd, **extra))
                rows.append(dict(op="apply_qk_norm_rope fwd+bwd", packcuda_ms=t_fb, baseline="Liger RMSNorm + rope",
                                 baseline_ms=t_lig_fb, speedup=t_lig_fb / t_fb, **extra))
            del q, k, qh, kh, qhl, khl, cos, sin, gqh, gkh
            if not cpu:
                torch.cuda.empty_cache()
    rows += host_rows(["apply_qk_norm_rope"], dev)
    return rows


NOTES = ("copy_ floor: a copy_ of q and k (read once, written once); x_copy = packcuda_ms / copy_ms (goals: fwd <= "
         "1.15, fwd+bwd <= 2.4, and >= 1.8x faster than the best other row in fwd+bwd). fwd+bwd differentiates q, k "
         "and both norm weights. packcuda computes cos/sin inside its pass; the other rows get transformers' cos/sin "
         "precomputed. The unfused row runs transformers' norm modules then packcuda.apply_rope. Liger runs as "
         "models call it (its RMSNorm, then its rope on the transposed views, no extra copies). The CUDA-graph rows "
         "capture 20 calls (fwd+bwd: the forward and torch.autograd.grad) and time the replays, divided by the same "
         "eager copy_: kernel time without the host's validation, dispatch and autograd work. The floor of fwd+bwd "
         "is 2.5x copy_ (forward: read and write q, k; backward: read dq_out, q, k and write dq, dk). " + HOST_NOTE)


def main():
    cli(run, "QK-RMSNorm + (m)RoPE, bf16", notes=NOTES)


if __name__ == "__main__":
    main()
