"""Linear-attention ops benchmark: chunked vs fused-recurrent vs naive, forward and forward+backward.

    python benchmarks/ops.py                                  # B=2, T=1024, H=4, D=64, fp32, 1 thread
    python benchmarks/ops.py --length 2048 --batch 1 --fla    # the issue's target size, with fla's refs
    python benchmarks/ops.py --quick                          # smoke test

For every op in `recurrent_depth.ops` and every form (`chunk_*`, `fused_recurrent_*`,
`naive_recurrent_*`): wall time of the forward pass (under no_grad, as in prefill) and of forward
plus backward (gradients for q, k, v, gates and beta), best of --repeats for the chunked forms
(timed in interleaved rounds with fla's chunked references, so that load drifts on a shared
machine hit both alike) and of --slow-repeats for the recurrent ones. Speedups are against the
naive form. The error column is the worst norm-relative error ‖x − naive‖/‖naive‖ over the
output and every gradient. With --fla, the matching pure-PyTorch reference of
flash-linear-attention (fla-core, loaded by path) is timed too where one exists:
naive_chunk_linear_attn, delta_rule_chunkwise, naive_chunk_gated_delta_rule (best of --repeats,
like ours), naive_recurrent_gla (fla has no chunked GLA reference) and naive_log_linear_attn
(O(T²); both best of --slow-repeats).
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from recurrent_depth import ops
from recurrent_depth.ops.log_linear_attn.utils import levels_needed

OPS = ["linear_attn", "delta_rule", "gla", "gated_delta_rule", "log_linear_attn"]
FORMS = ["chunk", "fused_recurrent", "naive_recurrent"]
EXTRAS = {
    "linear_attn": (),
    "delta_rule": ("beta",),
    "gla": ("gk",),
    "gated_delta_rule": ("g", "beta"),
    "log_linear_attn": ("g", "lam"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2, help="B (default: %(default)s)")
    p.add_argument("--length", type=int, default=1024, help="T (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="H (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="K = V head dim (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=64, help="chunk size of the chunked forms (default: %(default)s)")
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS, help="ops to time (default: all)")
    p.add_argument("--forms", nargs="+", default=FORMS, choices=FORMS, help="forms to time (default: all)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of the chunked forms, best kept (default: %(default)s)"
    )
    p.add_argument(
        "--slow-repeats",
        type=int,
        default=1,
        help="timed runs of the recurrent forms and fla's references (default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default: %(default)s: steadiest on a shared machine; the recurrent "
        "forms are overhead-bound and gain nothing from threads)",
    )
    p.add_argument("--fla", action="store_true", help="also time fla-core's pure-PyTorch references (default: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (B=1, T=128, H=2, D=32)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.length, args.heads, args.dim = 1, 128, 2, 32
    for name in ("batch", "length", "heads", "dim", "repeats", "slow_repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def make_inputs(op: str, B: int, T: int, H: int, D: int, seed: int) -> list[torch.Tensor]:
    """q, k, v and the op's extras, shaped like a layer would produce them (unit keys, decays)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    extra = {
        "beta": torch.sigmoid(randn(B, T, H)),
        "g": F.logsigmoid(randn(B, T, H) + 3.0),
        "gk": F.logsigmoid(randn(B, T, H, D)) / 16,  # fla's GLA gate normaliser
        "lam": F.softplus(randn(B, T, H, levels_needed(T))),
    }
    q, k, v = randn(B, T, H, D), F.normalize(randn(B, T, H, D), dim=-1), randn(B, T, H, D)
    return [q, k, v, *(extra[e] for e in EXTRAS[op])]


def load_fla_naive(op: str):
    """fla-core's `ops/<op>/naive.py`, loaded by path (importing `fla.ops` needs triton)."""
    import fla

    path = os.path.join(os.path.dirname(fla.__file__), "ops", op, "naive.py")
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fla_reference(op: str, chunk_size: int) -> tuple[str, Callable[..., torch.Tensor]] | None:
    """(name, fn(q, k, v, *extras) -> o) for fla's reference of `op`, or None when fla has none."""
    m = load_fla_naive(op)
    if op == "linear_attn":
        return "naive_chunk_linear_attn", lambda q, k, v: m.naive_chunk_linear_attn(q, k, v)
    if op == "delta_rule":

        def delta(q, k, v, beta):
            o, _ = m.delta_rule_chunkwise(*(x.transpose(1, 2) for x in (q, k, v, beta)), chunk_size=chunk_size)
            return o.transpose(1, 2)

        return "delta_rule_chunkwise", delta
    if op == "gated_delta_rule":
        return "naive_chunk_gated_delta_rule", lambda q, k, v, g, beta: m.naive_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=chunk_size
        )[0]
    if op == "gla":
        return "naive_recurrent_gla", lambda q, k, v, gk: m.naive_recurrent_gla(q, k, v, gk)[0]
    if op == "log_linear_attn":
        # fla's default scale here is 1.0 (Mamba-2 style); pass ours, K^-0.5.
        return "naive_log_linear_attn", lambda q, k, v, g, lam: m.naive_log_linear_attn(
            q, k, v, g, lam, scale=q.shape[-1] ** -0.5
        )
    return None


def time_once(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> tuple[float, float, dict]:
    """One forward (no_grad) and one forward+backward: (fwd s, fwd+bwd s, output and gradients)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(*inputs)
        fwd = time.perf_counter() - t0
    leaves = [x.clone().requires_grad_() for x in inputs]
    t0 = time.perf_counter()
    o = fn(*leaves)
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    (o * cot).sum().backward()
    fwd_bwd = time.perf_counter() - t0
    return fwd, fwd_bwd, {"o": o.detach(), **{f"d{i}": x.grad for i, x in enumerate(leaves)}}


def time_forms(fns: dict[str, Callable[..., torch.Tensor]], inputs: list[torch.Tensor], repeats: int) -> dict:
    """Best-of-`repeats` times per form, in interleaved rounds so load drifts hit every form alike."""
    best: dict[str, dict] = {name: {"fwd_s": float("inf"), "fwd_bwd_s": float("inf")} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fwd, fwd_bwd, tensors = time_once(fn, inputs)
            b = best[name]
            b["fwd_s"], b["fwd_bwd_s"], b["tensors"] = min(b["fwd_s"], fwd), min(b["fwd_bwd_s"], fwd_bwd), tensors
    return best


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    B, T, H, D = args.batch, args.length, args.heads, args.dim
    rows = []
    for op in args.ops:
        inputs = make_inputs(op, B, T, H, D, args.seed)
        fast: dict[str, Callable[..., torch.Tensor]] = {}  # timed --repeats times, interleaved
        slow: dict[str, Callable[..., torch.Tensor]] = {}  # timed --slow-repeats times
        for form in args.forms:
            fn = getattr(ops, f"{form}_{op}")
            kw = {"chunk_size": args.chunk_size} if form == "chunk" else {}
            (fast if form == "chunk" else slow)[form] = lambda *xs, fn=fn, kw=kw: fn(*xs, **kw)[0]
        if args.fla:
            ref = fla_reference(op, args.chunk_size)
            # fla's chunked linear attention has a fixed chunk of 64, its delta rule no padding.
            fits = {"linear_attn": T % 64 == 0, "delta_rule": T % args.chunk_size == 0}.get(op, True)
            if ref is not None and fits:
                name, fn = ref
                (fast if "chunk" in name else slow)[f"fla:{name}"] = fn
        for fn in fast.values():
            time_once(fn, inputs)  # warm-up (allocator, first-call dispatch)
        timed = {**time_forms(fast, inputs, args.repeats), **time_forms(slow, inputs, args.slow_repeats)}
        for form, t in timed.items():
            print(f"  {op:17s} {form:34s} fwd {t['fwd_s']:.3f}s  fwd+bwd {t['fwd_bwd_s']:.3f}s", file=sys.stderr)
        naive = timed.get("naive_recurrent")
        fused = timed.get("fused_recurrent")
        fla_chunk = next((t for name, t in timed.items() if name.startswith("fla:") and "chunk" in name), None)
        for form, t in timed.items():
            row = {"op": op, "form": form, "fwd_s": round(t["fwd_s"], 4), "fwd_bwd_s": round(t["fwd_bwd_s"], 4)}
            if naive is not None:
                row["speedup_fwd"] = round(naive["fwd_s"] / t["fwd_s"], 2)
                row["speedup_fwd_bwd"] = round(naive["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
                if form != "naive_recurrent":
                    row["max_rel_err"] = max(rel_err(t["tensors"][k], naive["tensors"][k]) for k in naive["tensors"])
            if fused is not None and form == "chunk":
                row["speedup_fwd_bwd_vs_fused"] = round(fused["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
            if fla_chunk is not None and form == "chunk":
                row["fla_chunk_over_ours_fwd_bwd"] = round(fla_chunk["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
            rows.append(row)
    return {
        "benchmark": "ops",
        "config": {
            "B": B,
            "T": T,
            "H": H,
            "K": D,
            "V": D,
            "chunk_size": args.chunk_size,
            "dtype": "float32",
            "threads": args.threads,
            "repeats": args.repeats,
            "slow_repeats": args.slow_repeats,
        },
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "results": rows,
    }


def print_table(report: dict) -> None:
    cols = ("fwd s", 8), ("fwd+bwd s", 10), ("x fwd", 7), ("x fwd+bwd", 10), ("max rel err", 12)
    head = f"{'op':17s} {'form':34s} " + " ".join(f"{name:>{width}s}" for name, width in cols)
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        x_f = f"{r['speedup_fwd']:.1f}" if "speedup_fwd" in r else "-"
        x_fb = f"{r['speedup_fwd_bwd']:.1f}" if "speedup_fwd_bwd" in r else "-"
        times = f"{r['fwd_s']:8.3f} {r['fwd_bwd_s']:10.3f}"
        print(f"{r['op']:17s} {r['form']:34s} {times} {x_f:>7s} {x_fb:>10s} {err:>12s}")
    c = report["config"]
    print(
        f"\nB={c['B']} T={c['T']} H={c['H']} K=V={c['K']} chunk={c['chunk_size']} float32, {c['threads']} thread(s); "
        "x = speedup over naive_recurrent; error = worst of output and gradients vs naive_recurrent"
    )
    chunk_rows = [r for r in report["results"] if r["form"] == "chunk"]
    if not chunk_rows:
        return
    # The targets for the chunked forms, forward+backward, side by side in this run.
    print("\nchunked fwd+bwd vs the targets (>= 20x the step-by-step forms, faster than fla's chunk ref, err <= 1e-5):")
    head = ("op", 17), ("x naive_recurrent", 18), ("x fused_recurrent", 18), ("fla chunk / ours", 18), ("rel err", 12)
    print(" ".join(f"{name:>{width}s}" if i else f"{name:{width}s}" for i, (name, width) in enumerate(head)))
    for r in chunk_rows:
        x_naive = f"{r['speedup_fwd_bwd']:.1f}" if "speedup_fwd_bwd" in r else "-"
        x_fused = f"{r['speedup_fwd_bwd_vs_fused']:.1f}" if "speedup_fwd_bwd_vs_fused" in r else "-"
        fla = f"{r['fla_chunk_over_ours_fwd_bwd']:.2f}" if "fla_chunk_over_ours_fwd_bwd" in r else "(no fla chunk ref)"
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        print(f"{r['op']:17s} {x_naive:>18s} {x_fused:>18s} {fla:>18s} {err:>12s}")


def main(argv: list[str] | None = None) -> int:
    report = run(parse_args(argv))
    print(json.dumps(report))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
