"""Host time per call of the packcuda facades against a bare ``torch.autograd.Function`` of the same shape (the
op's tensors in and out, one torch kernel per output forward and one per input backward), measured in the same
process, and the ratios against the goal (forward+backward <= 1.5x the bare Function's, forward alone <= 1.2x);
then the quick report's unpad row (host lengths against nonzero + index_select).

    python -m benchmarks.host_time [--device cuda|cpu] [--tokens T] [--rounds N] [--clock wall|thread]

Host time (``harness.host_us``): the wall time of back-to-back calls divided by their number, with the GPU running
ahead (synchronized between runs, outside the timing), the median over runs; the cases are measured in turns
(``harness.host_us_in_turns``) so that drifts of the machine hit every row alike. The shapes default to the per-rank
sizes context parallelism gives (T = 4096 tokens) on CUDA and to tiny ones on the CPU, where the kernels take a few
microseconds and the rows measure the same Python and dispatcher code. The one-tensor bare Function is printed
beside each ratio: an op on q and k pays autograd for two inputs and two outputs (a QK-norm op for four inputs),
which no op can avoid; the bare Function of the op's shape is that floor. The benchmark modules add the per-op rows
to their tables through :func:`host_rows`."""
from __future__ import annotations

import argparse
import random
from typing import Callable, Dict, List, Optional, Tuple

import torch

import packcuda
from benchmarks.harness import HOST_CLOCKS, Timer, host_us_in_turns, record

GOAL_FWD_BWD, GOAL_FWD = 1.5, 1.2
BARE = "bare autograd.Function"


def bare_name(n_in: int, n_out: int) -> str:
    return BARE if (n_in, n_out) == (1, 1) else f"bare Function, {n_in} in / {n_out} out"


class BareFunction(torch.autograd.Function):
    """The leanest custom autograd op of a given shape: ``n_out`` outputs, one torch kernel each (``x * 2`` of the
    first inputs), and in the backward one torch kernel per input (``g * 2`` for the inputs with an output, a
    zero-filled gradient for the others, as a norm weight gets)."""

    @staticmethod
    def forward(ctx, n_out, *xs):
        ctx.n_out = n_out
        ctx.save_for_backward(*xs[n_out:])
        outs = tuple(x * 2 for x in xs[:n_out])
        return outs[0] if n_out == 1 else outs

    @staticmethod
    def backward(ctx, *gs):
        return (None, *(g * 2 for g in gs), *(torch.zeros_like(w) for w in ctx.saved_tensors))


def _grad(outs, ins, grads):
    return torch.autograd.grad(outs, ins, grads)


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def _bare(ins, grads):
    n_out = len(grads)
    return (_no_grad(lambda: BareFunction.apply(n_out, *ins)),
            lambda: _grad(BareFunction.apply(n_out, *ins), ins, grads))


def cases(device, tokens: Optional[int] = None) -> Tuple[Dict[str, Tuple[Callable, Callable]], Dict[str, str], str]:
    """{name: (forward, forward+backward)} for each op on ``device`` and for the bare Functions of the same shape
    (tensors in / out; x * 2 per output on the op's own tensors), {op: its bare Function's name} and {op: its
    shapes}."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    T = tokens or (4096 if cuda else 4)
    dt = torch.bfloat16
    Hq, Hk, D, section = (32, 8, 128, [24, 20, 20]) if cuda else (2, 1, 16, [4, 2, 2])
    C, K = (4096, 4) if cuda else (8, 4)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x = rand(T, Hq * D).requires_grad_()
    gx = rand(T, Hq * D)
    q, k = rand(T, Hq, D).requires_grad_(), rand(T, Hk, D).requires_grad_()
    gq, gk = rand(T, Hq, D), rand(T, Hk, D)
    wq, wk = rand(D, dtype=torch.float32).requires_grad_(), rand(D, dtype=torch.float32).requires_grad_()
    xc = rand(T, C).requires_grad_()
    w, b = rand(C, K).requires_grad_(), rand(C).requires_grad_()
    gy = rand(T, C)
    out = {bare_name(1, 1): _bare((x,), (gx,)), bare_name(2, 2): _bare((q, k), (gq, gk)),
           bare_name(4, 2): _bare((q, k, wq, wk), (gq, gk)), bare_name(3, 1): _bare((xc, w, b), (gy,))}
    twin = {}

    pos = torch.arange(T, device=device).remainder(max(1, T // 2)).repeat(3, 1)
    kw = dict(inv_freq=packcuda.default_inv_freq(5e6, D).to(device), mrope_section=section, mrope_interleaved=True)
    out["apply_rope"] = (_no_grad(lambda: packcuda.apply_rope(q, k, pos, **kw)),
                         lambda: _grad(packcuda.apply_rope(q, k, pos, **kw), (q, k), (gq, gk)))
    twin["apply_rope"] = bare_name(2, 2)
    for wdt in (torch.float32, torch.bfloat16):
        wq, wk = rand(D, dtype=wdt).requires_grad_(), rand(D, dtype=wdt).requires_grad_()

        def fwd(wq=wq, wk=wk):
            return packcuda.apply_qk_norm_rope(q, k, pos, q_weight=wq, k_weight=wk, **kw)

        name = f"apply_qk_norm_rope (w {str(wdt)[6:]})"
        out[name] = (_no_grad(fwd), lambda fwd=fwd, wq=wq, wk=wk: _grad(fwd(), (q, k, wq, wk), (gq, gk)))
        twin[name] = bare_name(4, 2)

    cu = [0] + [T * i // 8 for i in range(1, 8)] + [T]
    out["causal_conv1d"] = (
        _no_grad(lambda: packcuda.causal_conv1d(xc, w, b, cu_seqlens=cu, activation="silu")),
        lambda: _grad(packcuda.causal_conv1d(xc, w, b, cu_seqlens=cu, activation="silu"), (xc, w, b), gy))
    twin["causal_conv1d"] = bare_name(3, 1)
    qk = f"T={T} bf16, q/k [{T}, {Hq}/{Hk}, {D}], mRoPE {section} interleaved"
    shape = {"apply_rope": qk, "apply_qk_norm_rope (w float32)": qk + ", weights [D] fp32",
             "apply_qk_norm_rope (w bfloat16)": qk + ", weights [D] bf16",
             "causal_conv1d": f"T={T} bf16, x [{T}, {C}], K={K}, bias, silu, 8 host segments"}
    return out, twin, shape


HOST_NOTE = ("host µs per call rows: host wall time per call with the GPU running ahead (benchmarks/host_time.py), "
             "the baseline a bare autograd.Function of the op's shape (its tensors in and out: one torch kernel per "
             "output forward, one per input backward) measured in the same turns; goal ratio: "
             f"fwd <= {GOAL_FWD}x, fwd+bwd <= {GOAL_FWD_BWD}x. 'vs single' divides by the one-tensor {BARE}.")


def host_rows(names=None, device=None, tokens: Optional[int] = None, rounds: int = 3) -> List[dict]:
    """Benchmark-table rows "host µs per call" of the ops whose names start with one of ``names`` (all when None),
    forward and forward+backward, each with the bare Function of its shape measured in the same turns as its
    baseline (packcuda_ms / baseline_ms in ms, as every row; ratio, goal and the ratio to the one-tensor bare
    Function beside them)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_cases, twin, shape = cases(device, tokens)
    ops = [n for n in twin if names is None or any(n.startswith(m) for m in names)]
    keep = set(ops) | {twin[n] for n in ops} | {BARE}
    timed = {(n, m): fn for n, c in all_cases.items() if n in keep for m, fn in zip(("fwd", "fwd+bwd"), c)}
    got = host_us_in_turns(timed, device, rounds=rounds)
    return _rows(got, twin, ops, shape)


def _rows(got: Dict, twin: Dict[str, str], ops, shape: Dict[str, str]) -> List[dict]:
    rows = []
    for n in ops:
        for mode in ("fwd", "fwd+bwd"):
            us, base = got[(n, mode)], got[(twin[n], mode)]
            rows.append(dict(op=f"{n} {mode}, host µs per call", shape=shape[n], packcuda_ms=us / 1e3,
                             baseline=f"{twin[n]} {mode}, host", baseline_ms=base / 1e3, host_us=us, ratio=us / base,
                             goal=f"<= {GOAL_FWD if mode == 'fwd' else GOAL_FWD_BWD}x",
                             vs_single=us / got[(BARE, mode)]))
    return rows


def _nonzero_unpad(x, mask):
    """flash-attn's unpad_input: seqlens, nonzero indices, cumsum, max via .item(), index_select."""
    seqlens = mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices), indices, cu, max_seqlen


def unpad_rows(device, clock: str = "wall") -> List[dict]:
    """The quick report's unpad row (host lengths against nonzero + index_select, B=16 S=4096 H=1024 bf16 on
    CUDA; a small shape on the CPU): device time per call as the report times it, and host time per call."""
    device = torch.device(device)
    B, S, H = (16, 4096, 1024) if device.type == "cuda" else (16, 64, 8)
    rng = random.Random(0)
    lens = [rng.randint(S // 4, S) for _ in range(B)]
    x = torch.randn(B, S, H, device=device).to(torch.bfloat16)
    mask = torch.arange(S, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    ours, base = (lambda: packcuda.unpad(x, lengths=lens)), (lambda: _nonzero_unpad(x, mask))
    timer = Timer(device, warmup=5, reps=50)
    t_ours, t_base = timer.median_ms(ours), timer.median_ms(base)
    h = host_us_in_turns({"ours": ours, "base": base}, device, rounds=3, clock=clock)
    return [dict(op="unpad (host lengths)", shape=f"B={B} S={S} H={H} bf16 T={sum(lens)}", packcuda_ms=t_ours,
                 baseline="nonzero+index_select", baseline_ms=t_base, speedup=t_base / t_ours,
                 host_us=h["ours"], baseline_host_us=h["base"])]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_time")
    p.add_argument("--device", default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clock", choices=sorted(HOST_CLOCKS), default="wall",
                   help="thread: this thread's CPU time (a shared CPU-only machine); wall: wall time (default)")
    p.add_argument("--no-unpad", action="store_true", help="leave out the unpad row")
    p.add_argument("--write", action="store_true", help="also write the rows to a run file (benchmarks/results)")
    a = p.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    all_cases, twin, shape = cases(device, a.tokens)
    flat = {(n, m): fn for n, c in all_cases.items() for m, fn in zip(("fwd", "fwd+bwd"), c)}
    got = host_us_in_turns(flat, device, rounds=a.rounds, clock=a.clock)
    print(f"host time per call ({a.clock} clock), {device}: " + "; ".join(f"{n}: {v}" for n, v in shape.items()))
    print(f"goal: fwd <= {GOAL_FWD}x and fwd+bwd <= {GOAL_FWD_BWD}x the bare Function of the op's shape; "
          f"'single': against the one-tensor {BARE}")
    print(f"{'op':34s} {'fwd µs':>8s} {'ratio':>6s} {'single':>6s} {'fwd+bwd µs':>11s} {'ratio':>6s} {'single':>6s}")
    ok = True
    for n in all_cases:
        f, fb = got[(n, "fwd")], got[(n, "fwd+bwd")]
        base = twin.get(n, n)
        rf, rfb = f / got[(base, "fwd")], fb / got[(base, "fwd+bwd")]
        met = n not in twin or (rf <= GOAL_FWD and rfb <= GOAL_FWD_BWD)
        ok &= met
        print(f"{n:34s} {f:8.1f} {rf:6.2f} {f / got[(BARE, 'fwd')]:6.2f} {fb:11.1f} {rfb:6.2f} "
              f"{fb / got[(BARE, 'fwd+bwd')]:6.2f}{'' if met else '  over the goal'}")
    print("goal met" if ok else "goal not met")
    unpad = [] if a.no_unpad else unpad_rows(device, a.clock)
    if a.write:
        record("host time per call", _rows(got, twin, list(twin), shape) + unpad, device=device,
               notes=HOST_NOTE + f" Clock: {a.clock}; {a.rounds} rounds in turns." + (
                   " unpad row: device time per call (the report's timing) and host time per call beside it."
                   if unpad else ""), bench="host_time")
    if unpad:
        for r in unpad:
            print(f"\n{r['op']} {r['shape']}: {r['packcuda_ms'] * 1e3:.1f} µs per call vs {r['baseline']} "
                  f"{r['baseline_ms'] * 1e3:.1f} µs ({r['speedup']:.2f}x); host {r['host_us']:.1f} µs vs "
                  f"{r['baseline_host_us']:.1f} µs")


if __name__ == "__main__":
    main()
