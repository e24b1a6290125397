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
output and every gradient. Rows keep the best time; `fwd_bwd_median_s` is the median over the
rounds (on a shared machine the best is the steadier figure, the median shows the spread).

With --fla, flash-linear-attention's pure-PyTorch references (fla-core, loaded by path) are timed
side by side where they exist:
- chunked: naive_chunk_linear_attn, delta_rule_chunkwise, naive_chunk_gated_delta_rule (best of
  --repeats, interleaved with ours; fla has no chunked GLA reference);
- step-by-step: naive_recurrent_linear_attn, delta_rule_recurrence, naive_recurrent_gla,
  naive_recurrent_gated_delta_rule (best of --slow-repeats); the "x fla recurrent" column is
  their fwd+bwd time over our chunked one, the comparison the issue quotes for fla itself
  (naive chunk vs recurrent Gated DeltaNet). Next to our naive_recurrent rows they also show that
  our step-by-step baseline is a plain loop, not a slowed-down one;
- naive_log_linear_attn (O(T²) parallel form; best of --slow-repeats).
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
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


def fla_references(op: str, chunk_size: int) -> dict[str, tuple[str, Callable[..., torch.Tensor]]]:
    """fla's references of `op` by kind ("chunk", "recurrent", "parallel"): (name, fn(q, k, v, *extras) -> o).

    Every fn takes our inputs ([B, T, H, D], gates in our order) and returns o [B, T, H, V]; all
    use our default scale K^-0.5 (fla's delta rule and GLA fix it to that).
    """
    m = load_fla_naive(op)
    refs: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {}
    if op == "linear_attn":
        refs["chunk"] = "naive_chunk_linear_attn", lambda q, k, v: m.naive_chunk_linear_attn(q, k, v)
        refs["recurrent"] = "naive_recurrent_linear_attn", lambda q, k, v: m.naive_recurrent_linear_attn(q, k, v)[0]
    elif op == "delta_rule":
        # fla's delta rule references are [B, H, T, D].
        def delta_chunk(q, k, v, beta):
            o, _ = m.delta_rule_chunkwise(*(x.transpose(1, 2) for x in (q, k, v, beta)), chunk_size=chunk_size)
            return o.transpose(1, 2)

        def delta_recurrent(q, k, v, beta):
            return m.delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)))[0].transpose(1, 2)

        refs["chunk"] = "delta_rule_chunkwise", delta_chunk
        refs["recurrent"] = "delta_rule_recurrence", delta_recurrent
    elif op == "gated_delta_rule":
        refs["chunk"] = (
            "naive_chunk_gated_delta_rule",
            lambda q, k, v, g, beta: m.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[0],
        )
        # Note fla's recurrent form takes beta before g.
        refs["recurrent"] = (
            "naive_recurrent_gated_delta_rule",
            lambda q, k, v, g, beta: m.naive_recurrent_gated_delta_rule(q, k, v, beta, g)[0],
        )
    elif op == "gla":
        refs["recurrent"] = "naive_recurrent_gla", lambda q, k, v, gk: m.naive_recurrent_gla(q, k, v, gk)[0]
    elif op == "log_linear_attn":
        # fla's default scale here is 1.0 (Mamba-2 style); pass ours, K^-0.5.
        refs["parallel"] = (
            "naive_log_linear_attn",
            lambda q, k, v, g, lam: m.naive_log_linear_attn(q, k, v, g, lam, scale=q.shape[-1] ** -0.5),
        )
    return refs


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
    """Best-of-`repeats` times (and the fwd+bwd median) per form, in interleaved rounds so load
    drifts hit every form alike."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    out: dict[str, dict] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            fwd, fwd_bwd, tensors = time_once(fn, inputs)
            runs[name].append((fwd, fwd_bwd))
            out[name] = {"tensors": tensors}
    for name, times in runs.items():
        out[name]["fwd_s"] = min(t[0] for t in times)
        out[name]["fwd_bwd_s"] = min(t[1] for t in times)
        out[name]["fwd_bwd_median_s"] = statistics.median(t[1] for t in times)
    return out


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
        fla_names: dict[str, str] = {}  # kind -> timed name
        if args.fla:
            for kind, (name, fn) in fla_references(op, args.chunk_size).items():
                # fla's chunked linear attention has a fixed chunk of 64, its chunked delta rule no padding.
                fits = {"linear_attn": T % 64 == 0, "delta_rule": T % args.chunk_size == 0}.get(op, True)
                if kind == "chunk" and not fits:
                    continue
                fla_names[kind] = f"fla:{name}"
                (fast if kind == "chunk" else slow)[f"fla:{name}"] = fn
        for fn in fast.values():
            time_once(fn, inputs)  # warm-up (allocator, first-call dispatch)
        timed = {**time_forms(fast, inputs, args.repeats), **time_forms(slow, inputs, args.slow_repeats)}
        for form, t in timed.items():
            print(f"  {op:17s} {form:34s} fwd {t['fwd_s']:.3f}s  fwd+bwd {t['fwd_bwd_s']:.3f}s", file=sys.stderr)
        naive = timed.get("naive_recurrent")
        fused = timed.get("fused_recurrent")
        fla_chunk = timed.get(fla_names.get("chunk", ""))
        fla_recurrent = timed.get(fla_names.get("recurrent", ""))
        for form, t in timed.items():
            row = {
                "op": op,
                "form": form,
                "fwd_s": round(t["fwd_s"], 4),
                "fwd_bwd_s": round(t["fwd_bwd_s"], 4),
                "fwd_bwd_median_s": round(t["fwd_bwd_median_s"], 4),
            }
            if naive is not None:
                row["speedup_fwd"] = round(naive["fwd_s"] / t["fwd_s"], 2)
                row["speedup_fwd_bwd"] = round(naive["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
                if form != "naive_recurrent":
                    row["max_rel_err"] = max(rel_err(t["tensors"][k], naive["tensors"][k]) for k in naive["tensors"])
            if fused is not None and form == "chunk":
                row["speedup_fwd_bwd_vs_fused"] = round(fused["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
            if fla_chunk is not None and form == "chunk":
                row["fla_chunk_over_ours_fwd_bwd"] = round(fla_chunk["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
            if fla_recurrent is not None and form == "chunk":
                row["fla_recurrent_over_ours_fwd_bwd"] = round(fla_recurrent["fwd_bwd_s"] / t["fwd_bwd_s"], 2)
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
    cols = ("fwd s", 8), ("fwd+bwd s", 10), ("median", 8), ("x fwd", 7), ("x fwd+bwd", 10), ("max rel err", 12)
    head = f"{'op':17s} {'form':34s} " + " ".join(f"{name:>{width}s}" for name, width in cols)
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "-"
        x_f = f"{r['speedup_fwd']:.1f}" if "speedup_fwd" in r else "-"
        x_fb = f"{r['speedup_fwd_bwd']:.1f}" if "speedup_fwd_bwd" in r else "-"
        times = f"{r['fwd_s']:8.3f} {r['fwd_bwd_s']:10.3f} {r['fwd_bwd_median_s']:8.3f}"
        print(f"{r['op']:17s} {r['form']:34s} {times} {x_f:>7s} {x_fb:>10s} {err:>12s}")
    c = report["config"]
    print(
        f"\nB={c['B']} T={c['T']} H={c['H']} K=V={c['K']} chunk={c['chunk_size']} float32, {c['threads']} thread(s); "
        "times best of the rounds (median: fwd+bwd median); x = speedup over naive_recurrent; "
        "error = worst of output and gradients vs naive_recurrent"
    )
    chunk_rows = [r for r in report["results"] if r["form"] == "chunk"]
    if not chunk_rows:
        return
    # The targets for the chunked forms, forward+backward, side by side in this run.
    print("\nchunked fwd+bwd vs the targets (>= 20x the step-by-step forms, faster than fla's chunk ref, err <= 1e-5):")
    head = (
        ("op", 17),
        ("ms chunk", 9),
        ("x naive_recurrent", 18),
        ("x fused_recurrent", 18),
        ("x fla chunk", 12),
        ("x fla recurrent", 16),
        ("rel err", 9),
    )
    print(" ".join(f"{name:>{width}s}" if i else f"{name:{width}s}" for i, (name, width) in enumerate(head)))

    def ratio(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    for r in chunk_rows:
        cells = (
            f"{r['fwd_bwd_s'] * 1e3:9.1f}",
            f"{ratio(r, 'speedup_fwd_bwd', '.1f'):>18s}",
            f"{ratio(r, 'speedup_fwd_bwd_vs_fused', '.1f'):>18s}",
            f"{ratio(r, 'fla_chunk_over_ours_fwd_bwd', '.2f'):>12s}",
            f"{ratio(r, 'fla_recurrent_over_ours_fwd_bwd', '.1f'):>16s}",
            f"{ratio(r, 'max_rel_err', '.1e'):>9s}",
        )
        print(f"{r['op']:17s} " + " ".join(cells))
    print("x fla chunk / x fla recurrent: fla's pure-PyTorch reference time over ours ('-': fla has none)")


def main(argv: list[str] | None = None) -> int:
    report = run(parse_args(argv))
    print(json.dumps(report))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
