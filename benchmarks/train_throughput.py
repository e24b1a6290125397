"""Training throughput and AFU of the recurrent-depth model, recurrent vs the non-recurrent baseline.

AFU (achieved FLOP utilisation) = model FLOPs per second of a full training step (forward, loss,
backward, the trainer's AdamW step: torch's fused kernel on CPU and CUDA) divided by the FLOP/s of
square matmuls (2048, 3072, 4096; the best size, and
the best of torch.mm's operand layouts and the library's blocked a^T @ b) measured in the same run
and dtype. Model FLOPs are counted by hand
(`recurrent_depth.train.flops`: linear layers + causal attention; activation recompute and the
optimizer are overhead, not model FLOPs). Shapes: `small` (h 256) and a wide variant (h 1024,
16 heads, MLP 2816); recurrent steps run at the sampler's expected depth (r̄ + 1 = 9 steps, the
last k = 4 with gradients), the baseline runs one core pass.

    python benchmarks/train_throughput.py                  # about 4 minutes on 2 cores
    python benchmarks/train_throughput.py --clock cpu      # on a busy machine: CPU time, 1 thread
    python benchmarks/train_throughput.py --compile        # torch.compile the core blocks in every case
    python benchmarks/train_throughput.py --compile-mode max-autotune-no-cudagraphs   # mode of compiled cases
    python benchmarks/train_throughput.py --default-malloc # glibc's malloc as is (the trainer tunes it)
    python benchmarks/train_throughput.py --shapes h1024 --dtypes bf16 --compare-plain   # one shape and dtype,
                                                           # and the plain model (accel off) beside it

Without --compile, the fp32 `small` cases also run with the core blocks compiled (the trainer's
`compile: true`), reported as `afu_small_fp32_compiled` beside the eager figure.

Each case is also bracketed by a 2048 product timed right before and after it (`afu_nearby_*`, the
AFU* column), since on a shared machine the load can change between the peak measurement at the start
and the case (with the CPU clock too: neighbours on the same cores slow a product's CPU time through
the caches and memory bandwidth they share).

On a CPU without native bf16 matmuls (no AVX512-BF16 / AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`
is False) bf16 runs ~4x slower than fp32 even in the library's blocked products (torch.mm alone is
slower still); a case whose one step would not fit the remaining time budget is reported as null with
the reason.

Prints one JSON line (afu_small_fp32, afu_small_bf16, afu_h1024_fp32, afu_h1024_bf16, ...) and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth import accel
from recurrent_depth.accel.allocator import keep_freed_memory
from recurrent_depth.accel.linear import blocked_tn_mm
from recurrent_depth.train.config import COMPILE_MODES
from recurrent_depth.train.flops import training_step_flops
from recurrent_depth.train.optim import OptimConfig, build_optimizers

SHAPES = {
    "small": dict(),
    "h1024": dict(hidden_size=1024, num_heads=16, intermediate_size=2816),
}
# Tokens per step (batch x sequence) for each shape: enough rows to keep the GEMMs efficient.
BATCH = {"small": (8, 256), "h1024": (4, 256)}
# Emulated bf16 (no AVX512-BF16 / AMX) runs ~4x slower than fp32 even in the fastest layout: fewer rows
# per step so that a few timed steps fit the budget (512 tokens: the GEMMs stay >= 512 x h x h; at 256
# tokens h1024 ran 12% below its 512-token speed, fewer rows per worker-thread block).
EMULATED_BATCH = {"small": (2, 256), "h1024": (2, 256)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Clock:
    """Wall time, or this process's CPU time (all threads) for comparisons on a busy machine."""

    def __init__(self, kind: str) -> None:
        self.now = time.perf_counter if kind == "wall" else time.process_time


# The square products the peak is taken over: torch.mm in each operand layout, and the library's own
# blocked a^T @ b (what its Linear uses for emulated bf16, where it beats every torch.mm layout ~2x).
SQUARE_PRODUCTS = {
    "a@b": lambda a, b: torch.mm(a, b),
    "a@b^T": lambda a, b: torch.mm(a, b.t()),
    "a^T@b": lambda a, b: torch.mm(a.t(), b),
    "a^T@b blocked": blocked_tn_mm,
}
BLOCKED = "a^T@b blocked"


def matmul_peak(dtype: torch.dtype, clock: Clock, sizes=(2048, 3072, 4096), min_seconds: float = 0.6,
                slow_seconds: float = 2.0, products: tuple[str, ...] | None = None) -> dict:
    """Best median FLOP/s of square products over `sizes`, timed with the product that is fastest at
    the first size among `products` (default: those within 2x of the fastest at n=512).

    A probe at n=1024 comes first: when one product there already takes over `slow_seconds`, the
    probe's figure is the peak, since a 2048 product would take minutes.
    """
    products = products or _competitive_products(dtype)
    probe = _mm_seconds(1024, dtype, clock, products[0], repeats=1)[0]
    if probe > slow_seconds:
        return {"flops": 2 * 1024**3 / probe, "size": 1024, "product": products[0],
                "by_size": {"1024": 2 * 1024**3 / probe},
                "note": f"one 1024 product took {probe:.1f}s: larger sizes skipped"}
    if len(products) > 1:
        first = {name: _mm_seconds(sizes[0], dtype, clock, name, repeats=1)[0] for name in products}
        products = (min(first, key=first.get),)
    results = {}
    for n in sizes:
        times = _mm_seconds(n, dtype, clock, products[0], repeats=20, min_seconds=min_seconds)
        results[n] = 2 * n**3 / statistics.median(times)
    best = max(results, key=results.get)
    return {"flops": results[best], "size": best, "product": products[0],
            "by_size": {str(k): v for k, v in results.items()}}


@functools.cache
def _competitive_products(dtype: torch.dtype, names: tuple[str, ...] = tuple(SQUARE_PRODUCTS)) -> tuple[str, ...]:
    """Those of the square products `names` within 2x of the fastest of them at n=512, fastest first.

    oneDNN's emulated bf16 is ~40x slower as a @ b than in the other layouts; timing it at 2048 would
    take most of the budget.
    """
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    speed = {}
    for name in names:
        product = SQUARE_PRODUCTS[name]
        product(a, b)
        start = time.perf_counter()
        for _ in range(3):
            product(a, b)
        speed[name] = 1 / (time.perf_counter() - start)
    fastest = max(speed.values())
    return tuple(sorted((name for name in speed if speed[name] >= fastest / 2), key=speed.get, reverse=True))


def _mm_seconds(n: int, dtype: torch.dtype, clock: Clock, product: str, repeats: int,
                min_seconds: float = 0.0) -> list[float]:
    """Times of `repeats` products (fewer once `min_seconds` is reached), after one warm-up."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    fn = SQUARE_PRODUCTS[product]
    fn(a, b)
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < min_seconds):
        start = clock.now()
        fn(a, b)
        times.append(clock.now() - start)
    return times


def train_step(model, optimizer, rows, num_steps, dtype) -> None:
    inputs, targets = rows[:, :-1], rows[:, 1:]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ctx:
        out = model(inputs, num_steps=num_steps)
    F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(shape: str, dtype_name: str, recurrent: bool, peak: float, peak_product: str, clock: Clock,
            budget_left: float,
            compile_core: bool, bracket: bool, min_seconds: float = 3.0, compile_mode: str = "default",
            use_accel: bool = True) -> dict:
    cfg = rd.ModelConfig.from_preset("small", **SHAPES[shape])
    emulated = dtype_name == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    B, T = (EMULATED_BATCH if emulated else BATCH)[shape]
    k = cfg.mean_backprop_depth
    num_steps = (cfg.mean_recurrence + 1 - k, k) if recurrent else (0, 1)
    flops = training_step_flops(cfg, B, T, num_steps)
    row = {"shape": shape, "dtype": dtype_name, "mode": "recurrent" if recurrent else "baseline",
           "compiled": compile_core, "accel": use_accel, "num_steps": list(num_steps), "tokens_per_step": B * T,
           "model_tflop_per_step": flops.total / 1e12}
    # Two steps at matmul peak is the least this case can take; skip it if that does not fit.
    floor = 2 * flops.total / peak
    if floor > budget_left:
        row["skipped"] = (f"two steps need >= {floor:.0f}s at this dtype's matmul speed; "
                          f"{max(budget_left, 0):.0f}s of the budget are left for it")
        return row
    nearby_peak = functools.partial(matmul_peak, DTYPES[dtype_name], clock, sizes=(2048,), min_seconds=0.3,
                                    products=(peak_product,))
    before = nearby_peak()["flops"] if bracket else None
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).train()
    accel.apply(model, enabled=None if use_accel else False)  # as the trainer does (RDEPTH_NO_ACCEL=1: plain)
    if compile_core:
        from recurrent_depth.train.trainer import compile_core as apply_compile

        apply_compile(model, compile_mode)
    # The trainer's AdamW (`optim.name: adamw`): torch's fused kernel where it has one, as the trainer builds it.
    optimizer = build_optimizers(model, OptimConfig(name="adamw", lr=1e-4))
    rows = torch.randint(0, cfg.vocab_size, (B, T + 1))
    start = clock.now()
    train_step(model, optimizer, rows, num_steps, DTYPES[dtype_name])  # warm-up
    first = clock.now() - start
    times: list[float] = []
    # At least 3 timed steps (the median of a busy machine's timings is noisy), more up to min_seconds,
    # fewer only when this case's share of the budget runs out.
    while len(times) < 10 and (len(times) < 3 or sum(times) < min_seconds):
        if times and first + sum(times) + times[-1] > budget_left:
            break
        start = clock.now()
        train_step(model, optimizer, rows, num_steps, DTYPES[dtype_name])
        times.append(clock.now() - start)
    seconds = statistics.median(times)
    row.update(step_s=seconds, steps_timed=len(times), tokens_per_s=B * T / seconds,
               model_tflops=flops.total / seconds / 1e12, afu=flops.total / seconds / peak)
    if before is not None:
        # The 2048 product timed right before and after this case: on a shared machine the load moves,
        # and numerator and denominator should see the same conditions.
        after = nearby_peak()["flops"]
        nearby = (before + after) / 2
        row.update(nearby_peak_gflops=nearby / 1e9, afu_nearby=flops.total / seconds / nearby)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or process CPU time for a busy machine (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 with --clock cpu)")
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for the whole run (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the core blocks (default: off)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile mode of the compiled cases (default: %(default)s)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc thresholds alone (the trainer raises them on CPU: "
                             "keep_freed_memory)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                        help="model shapes to measure (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES),
                        help="dtypes to measure (default: all)")
    parser.add_argument("--compare-plain", action="store_true",
                        help="also run each bf16 recurrent case on the plain model (accel off: the "
                             "composite RMSNorm under autocast), the before of the accel fast paths")
    args = parser.parse_args(argv)
    # (checked here, not with benchmarks/_args.py: ab_commits.py loads this file alone, without its directory)
    if args.threads is not None and args.threads < 1:  # 0 silently meant torch's default
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if not args.budget > 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    kept_freed_memory = False if args.default_malloc else keep_freed_memory()
    threads = args.threads or (1 if args.clock == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    clock = Clock(args.clock)
    deadline = clock.now() + args.budget

    bf16_native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    peaks = {}
    rows = []
    cases = {dtype: [(shape, recurrent, args.compile, True) for shape in args.shapes for recurrent in (True, False)]
             for dtype in args.dtypes}
    if not args.compile and "fp32" in cases and "small" in args.shapes:
        cases["fp32"] += [("small", True, True, True), ("small", False, True, True)]
    if args.compare_plain and "bf16" in cases:
        cases["bf16"] += [(shape, True, args.compile, False) for shape in args.shapes]
    torch_mm_peaks = {}
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        peaks[dtype_name] = matmul_peak(dtype, clock)
        if peaks[dtype_name]["product"] == BLOCKED:
            # For comparison: what the best torch.mm layout reaches (the AFU denominator before the
            # library had its blocked product).
            plain = _competitive_products(dtype, tuple(name for name in SQUARE_PRODUCTS if name != BLOCKED))
            torch_mm_peaks[dtype_name] = matmul_peak(dtype, clock, sizes=(2048,), products=plain)
        for i, (shape, recurrent, compiled, use_accel) in enumerate(cases[dtype_name]):
            # Share what is left among the cases still to run, emulated bf16's included.
            pending = len(cases[dtype_name]) - i + (len(cases.get("bf16", ())) if dtype_name == "fp32" else 0)
            left = (deadline - clock.now()) / pending
            rows.append(measure(shape, dtype_name, recurrent, peaks[dtype_name]["flops"],
                                peaks[dtype_name]["product"], clock, left,
                                compiled, bracket=True, compile_mode=args.compile_mode,
                                use_accel=use_accel))
    result: dict = {
        "benchmark": "train_throughput",
        "clock": args.clock,
        "threads": threads,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "keep_freed_memory": kept_freed_memory,
        "bf16_native": bf16_native,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "matmul_peak_gflops": {k: v["flops"] / 1e9 for k, v in peaks.items()},
        "matmul_peak_size": {k: v["size"] for k, v in peaks.items()},
        "matmul_peak_product": {k: v["product"] for k, v in peaks.items()},
        "matmul_peak_torch_mm_gflops": {k: v["flops"] / 1e9 for k, v in torch_mm_peaks.items()},
        "matmul_notes": {k: v["note"] for k, v in peaks.items() if "note" in v},
    }
    for row in rows:
        suffix = ("" if row["mode"] == "recurrent" else "_baseline") + (
            "_compiled" if row["compiled"] and not args.compile else "") + ("" if row["accel"] else "_plain")
        key = f"{row['shape']}_{row['dtype']}{suffix}"
        result[f"afu_{key}"] = row.get("afu")
        if "afu_nearby" in row:
            result[f"afu_nearby_{key}"] = row["afu_nearby"]
        result[f"tokens_per_s_{key}"] = row.get("tokens_per_s")
        if "skipped" in row:
            result[f"skipped_{key}"] = row["skipped"]
    result["rows"] = rows
    result["seconds"] = args.budget - (deadline - clock.now())
    print(json.dumps(result))

    print(f"\nmatmul peak ({args.clock} clock, {threads} thread(s)): "
          + ", ".join(f"{k} {v['flops'] / 1e9:.1f} GFLOP/s at n={v['size']} as {v['product']}"
                    for k, v in peaks.items()))
    print(f"{'shape':<7}{'dtype':<6}{'mode':<20}{'depth':<8}{'tok/step':>9}{'step s':>9}{'tok/s':>9}"
          f"{'TFLOP/s':>9}{'AFU':>7}{'AFU*':>7}")
    for row in rows:
        depth = f"{row['num_steps'][0]}+{row['num_steps'][1]}"
        mode = row["mode"] + (" compiled" if row["compiled"] else "") + ("" if row["accel"] else " plain")
        if "skipped" in row:
            print(f"{row['shape']:<7}{row['dtype']:<6}{mode:<20}{depth:<8}{row['tokens_per_step']:>9}  "
                  f"skipped: {row['skipped']}")
            continue
        print(f"{row['shape']:<7}{row['dtype']:<6}{mode:<20}{depth:<8}{row['tokens_per_step']:>9}"
              f"{row['step_s']:>9.3f}{row['tokens_per_s']:>9.0f}{row['model_tflops']:>9.3f}{row['afu']:>7.2f}"
              + (f"{row['afu_nearby']:>7.2f}" if "afu_nearby" in row else ""))
    for k, v in torch_mm_peaks.items():
        print(f"{k}: torch.mm's best square product reaches {v['flops'] / 1e9:.1f} GFLOP/s at n=2048 as "
              f"{v['product']}; the AFU above is against the faster blocked product")
    print("AFU* = against the 2048 matmul timed right before and after the case (same machine load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
