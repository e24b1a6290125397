"""Weight-only quantization (`recurrent_depth.weight_quant`), int8, int4 and nf4: quality, small-shape
speed, kernel speed.

    python benchmarks/weight_quant.py --model runs/quickstart/model            # a trained model directory
    python benchmarks/weight_quant.py --model DIR --skip-kernels --rows 16     # quick
    python benchmarks/weight_quant.py --kernels-only                           # the Huginn-shape products only

In one run:

* teacher-forced agreement, per format (`--formats`, default int8, int4, int4:g128 and nf4): on `--rows`
  rows of the model directory's validation shards (`--data`, default `DIR/../data/validation.json`,
  what `rdepth quickstart` writes; held out from training), the first `--tokens` tokens of each, the
  fraction of positions whose argmax token is the same with quantized weights as without, with its
  standard error over rows (positions of one row are not independent: the row is the unit), and the
  mean KL divergence of the quantized model's next-token distribution from the unquantized one's.
  In float32 (int8: the dequantized reference; int4: torch's kernel where it takes the shape) and
  bf16 (the kernels against bf16 weights), at `--num-steps`;
* small-shape decode tokens/s of the same model, unquantized (the fused runner) and per format (the
  reference runner: the quantized model's), per dtype; at this size decoding is bound by Python
  dispatch, not weight bytes, so this is not where quantization pays;
* the kernel: ms per product of one Huginn-0125 linear (K, N below) at M = 1 and 8 rows, bf16
  activations: `x @ W^T` with bf16 weights (ATen), the C++ bf16 stream the bf16 decode uses
  (`quant_cpp.bf16_linear`; "stream", when C++ is on), `Int8WeightLinear` (the C++ `int8_linear` at
  these row counts), `Int4WeightLinear` (group 32: the C++ `int4_linear` where C++ is on, else torch's
  kernel), as "int4_torch", the same in torch's kernel layout (`aten._weight_int4pack_mm_for_cpu`),
  `Nf4WeightLinear` (block 64: the C++ `nf4_linear` where C++ is on, else the reference), as "nf4_dq" the same with
  its absmax double-quantized ("nf4:dq"), and as "nf4_ref" nf4's reference path (dequantize, then the product: what
  nf4 ran before its kernel, and runs with C++ off), alternating in `--repeats` rounds (the best of each kept),
  with the bytes each product reads (packed weights + scales + zero points, counted from the stored tensors) and
  the GB/s that implies; and at
  M = 1 the same with float32 activations (fp32 weights against both int4 products and the nf4 ones in float32).
  `--shapes` also takes "tinyllama.mlp.fc" (2048 x 5632, a 1B model's MLP: the docs' nf4 figures). Threads: torch's
  (`OMP_NUM_THREADS=1` or `2` before the command).

Prints one JSON line, then tables. The clock is CPU time (`time.process_time`) at one thread and
wall time otherwise; the load average is in the record.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _args import checked_model_dir, weight_formats

import recurrent_depth as rd
from recurrent_depth.accel import quant_cpp
from recurrent_depth.data.shards import ShardDataset
from recurrent_depth.weight_quant import Int4WeightLinear, Int8WeightLinear, Nf4WeightLinear, quantize_weights

# Huginn-0125's linear shapes (K = in, N = out): Wqkv, half of MLP fc (gate or up), MLP proj, adapter.
HUGINN_SHAPES = {"Wqkv": (5280, 3 * 5280), "mlp.fc/2": (5280, 17920), "mlp.proj": (17920, 5280),
                 "adapter": (2 * 5280, 5280)}
# Other shapes `--shapes` takes: a 1B model's MLP up / gate (TinyLlama-1.1B: hidden 2048, intermediate 5632).
SHAPES = {**HUGINN_SHAPES, "tinyllama.mlp.fc": (2048, 5632)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a trained model directory (needed unless --kernels-only)")
    p.add_argument("--data", default=None, help="validation shard index (default: MODEL/../data/validation.json)")
    p.add_argument("--formats", default="int8,int4,int4:g128,nf4", type=weight_formats,
                   help="comma-separated weight formats to compare (default: %(default)s)")
    p.add_argument("--rows", type=int, default=64, help="validation rows for the agreement (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=64, help="positions per row (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=None, help="recurrence depth (default: the model's mean)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="kernel timing rounds, best kept (default: %(default)s)")
    p.add_argument("--skip-kernels", action="store_true", help="skip the Huginn-shape kernel timings")
    p.add_argument("--skip-decode", action="store_true", help="skip the small-shape decode timings")
    p.add_argument("--kernels-only", action="store_true", help="only the Huginn-shape kernel timings")
    p.add_argument("--shapes", default=",".join(HUGINN_SHAPES),
                   help=f"comma-separated shapes to time, of {','.join(SHAPES)} (default: %(default)s)")
    args = p.parse_args(argv)
    if args.rows < 2 or args.tokens < 1 or args.decode_tokens < 2 or args.repeats < 1:
        p.error("--rows must be >= 2 (a standard error), --tokens and --repeats >= 1, --decode-tokens >= 2")
    if args.model is None and not args.kernels_only:
        p.error("--model is required unless --kernels-only")
    args.model = checked_model_dir(p, args.model)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes {unknown} unknown: expected some of {list(SHAPES)}")
    return args


def mean_and_standard_error(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def agreement(plain: rd.RecurrentDepthLM, quantized: rd.RecurrentDepthLM, rows: torch.Tensor,
              num_steps: int) -> dict[str, Any]:
    """Argmax agreement (mean over rows, its standard error over rows) and mean KL(unquantized ||
    quantized) over every position of `rows`."""
    per_row: list[float] = []
    kl = 0.0
    with torch.inference_mode():
        for chunk in rows.split(8):
            want = plain(chunk, num_steps=num_steps, init_scale=0.0).logits.float()
            got = quantized(chunk, num_steps=num_steps, init_scale=0.0).logits.float()
            per_row += (want.argmax(-1) == got.argmax(-1)).float().mean(-1).tolist()
            kl += float(F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="sum"))
    mean, se = mean_and_standard_error(per_row)
    positions = rows.numel()
    return dict(positions=positions, argmax_agreement=round(mean, 5), standard_error=round(se, 5),
                rows_at_100_percent=sum(v == 1.0 for v in per_row), mean_kl=float(f"{kl / positions:.3g}"))


def decode_speed(models: dict[str, rd.RecurrentDepthLM], prompt: torch.Tensor, num_steps: int,
                 tokens: int) -> dict[str, float]:
    """Greedy decode tokens/s per model (best of two runs each, alternating)."""
    best: dict[str, float] = {}
    for _ in range(2):
        for name, m in models.items():
            out = rd.generate(m, prompt, max_new_tokens=tokens, num_steps=num_steps, init_scale=0.0)
            best[name] = max(best.get(name, 0.0), out.tokens_per_second)
    return {name: round(v, 2) for name, v in best.items()}


def model_figures(args: argparse.Namespace, log) -> dict[str, Any]:
    model = rd.RecurrentDepthLM.from_pretrained(args.model).eval()
    num_steps = args.num_steps or model.config.mean_recurrence
    data = Path(args.data) if args.data else Path(args.model).resolve().parent / "data" / "validation.json"
    shards = ShardDataset(data, shuffle=False)
    count = min(args.rows, len(shards))
    rows = torch.from_numpy(shards.rows(list(range(count))).astype("int64"))[:, :args.tokens]
    quality: dict[str, dict[str, Any]] = {}
    speed: dict[str, dict[str, float]] = {}
    for dname, dtype in DTYPES.items():
        start = time.perf_counter()
        plain = copy.deepcopy(model).to(dtype)
        quantized = {}
        for fmt in args.formats:
            quantized[fmt] = copy.deepcopy(plain)
            quantize_weights(quantized[fmt], fmt)
            quality.setdefault(fmt, {})[dname] = agreement(plain, quantized[fmt], rows, num_steps)
        if not args.skip_decode:
            speed[dname] = decode_speed({"unquantized": plain, **quantized}, rows[:1, :16], num_steps,
                                        args.decode_tokens)
        log(f"[{dname}] {({f: quality[f][dname] for f in args.formats})} {speed.get(dname)} "
            f"({time.perf_counter() - start:.0f}s)")
    return dict(model=str(args.model), parameters=model.num_parameters(), rows=count, tokens=int(rows.shape[1]),
                num_steps=num_steps, agreement=quality, decode_tokens_per_s=speed)


# ------------------------------------------------------------------------------ kernels


def _clock():
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def alternating_best_ms(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Best ms per call of each function, the functions alternating within each round."""
    clock = _clock()
    for fn in fns.values():
        fn()  # warm-up
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], (clock() - start) * 1e3)
    return best


def shape_timings(K: int, N: int, g: torch.Generator, repeats: int) -> dict[str, dict[str, Any]]:
    """bf16 / int8 / int4 / nf4 products at M = 1 and 8 (bf16 activations), and fp32 / int4 / nf4 at M = 1."""
    linear = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.normal_(0, K ** -0.5, generator=g)
    rows = _bf16_rows(copy.deepcopy(linear).to(torch.bfloat16), g, repeats)  # the copies go when it returns
    rows["fp32 M=1"] = _fp32_row(linear, g, repeats)
    return rows


def _bf16_rows(linear: torch.nn.Linear, g: torch.Generator, repeats: int) -> dict[str, dict[str, Any]]:
    weight = linear.weight.detach()
    int8 = Int8WeightLinear.from_linear(linear)
    int4 = Int4WeightLinear.from_linear(linear, 32)  # the C++ product where C++ is on
    int4_torch = Int4WeightLinear.from_linear(linear, 32, kernel_layout=True)  # (Huginn's shapes fit at group 32)
    nf4, nf4_dq = _nf4_layers(linear)
    read = dict(bf16=weight.numel() * 2, stream=weight.numel() * 2, int8=int8.quantized_bytes(),
                int4=int4.quantized_bytes(), int4_torch=int4_torch.quantized_bytes(), **_nf4_bytes(nf4, nf4_dq))
    kernels = quant_cpp.load() if quant_cpp.cpp_enabled() else None
    rows = {}
    for M in (1, 8):
        x = torch.randn(M, linear.in_features, generator=g).to(torch.bfloat16)
        fns = dict(bf16=lambda x=x: x @ weight.t(), int8=lambda x=x: int8(x), int4=lambda x=x: int4(x),
                   int4_torch=lambda x=x: int4_torch(x), **_nf4_fns(nf4, nf4_dq, x))
        if kernels is not None:  # the bf16 decode's own product (`accel.runner._bf16_stream`)
            fns["stream"] = lambda x=x: kernels.bf16_linear(x, weight, None, None)
        rows[f"bf16 M={M}"] = _row(alternating_best_ms(fns, repeats), read)
    return rows


def _fp32_row(linear: torch.nn.Linear, g: torch.Generator, repeats: int) -> dict[str, Any]:
    weight = linear.weight.detach()
    int4 = Int4WeightLinear.from_linear(linear, 32)
    int4_torch = Int4WeightLinear.from_linear(linear, 32, kernel_layout=True)
    nf4, nf4_dq = _nf4_layers(linear)
    x = torch.randn(1, linear.in_features, generator=g)
    ms = alternating_best_ms(dict(fp32=lambda: x @ weight.t(), int4=lambda: int4(x), int4_torch=lambda: int4_torch(x),
                                  **_nf4_fns(nf4, nf4_dq, x)), repeats)
    return _row(ms, dict(fp32=weight.numel() * 4, int4=int4.quantized_bytes(),
                         int4_torch=int4_torch.quantized_bytes(), **_nf4_bytes(nf4, nf4_dq)))


def _nf4_layers(linear: torch.nn.Linear) -> tuple[Nf4WeightLinear, Nf4WeightLinear]:
    """nf4 at block 64 (the C++ product where C++ is on), with a bf16 absmax and double-quantized."""
    return Nf4WeightLinear.from_linear(linear), Nf4WeightLinear.from_linear(linear, double_quant=True)


def _nf4_fns(nf4: Nf4WeightLinear, nf4_dq: Nf4WeightLinear, x: torch.Tensor) -> dict[str, Any]:
    return dict(nf4=lambda: nf4(x), nf4_dq=lambda: nf4_dq(x), nf4_ref=lambda: nf4._reference(x))


def _nf4_bytes(nf4: Nf4WeightLinear, nf4_dq: Nf4WeightLinear) -> dict[str, int]:
    return dict(nf4=nf4.quantized_bytes(), nf4_dq=nf4_dq.quantized_bytes(), nf4_ref=nf4.quantized_bytes())


def _row(ms: dict[str, float], read: dict[str, int]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, t in ms.items():
        row[f"{name}_ms"] = round(t, 3)
        row[f"{name}_mb"] = round(read[name] / 1e6, 2)
        row[f"{name}_gb_s"] = round(read[name] / t / 1e6, 2)
    dense = next(iter(ms))
    for name in list(ms)[1:]:
        row[f"{name}_speedup"] = round(ms[dense] / ms[name], 3)
        if "stream" in ms and name != "stream":  # against the C++ bf16 stream, the bf16 decode's product
            row[f"{name}_vs_stream"] = round(ms["stream"] / ms[name], 3)
    return row


def kernel_timings(shapes: list[str], repeats: int, log) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in shapes:
        K, N = SHAPES[name]
        start = time.perf_counter()
        out[f"{name} [{K}x{N}]"] = shape_timings(K, N, g, repeats)
        log(f"[kernels] {name}: {out[f'{name} [{K}x{N}]']} ({time.perf_counter() - start:.0f}s)")
    return out


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return [f for f in wanted if f in flags]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    load_before = [round(x, 2) for x in os.getloadavg()]
    record: dict[str, Any] = dict(benchmark="weight_quant")
    if not args.kernels_only:
        record.update(model_figures(args, log))
    kernels = {} if args.skip_kernels else kernel_timings(args.shapes, args.repeats, log)
    record.update(kernels=kernels, clock="process_time" if torch.get_num_threads() == 1 else "perf_counter",
                  threads=torch.get_num_threads(), cpu_flags=cpu_flags(), torch=torch.__version__,
                  python=platform.python_version(), load_average_before=load_before,
                  load_average_after=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(record))
    if "agreement" in record:
        print(f"\n{'format':<10}{'dtype':<6}{'argmax agreement':>18}{'s.e.':>9}{'mean KL':>11}"
              f"{'decode tok/s':>14}{'unquantized':>13}")
        for fmt, per_dtype in record["agreement"].items():
            for dname, q in per_dtype.items():
                s = record["decode_tokens_per_s"].get(dname, {})
                print(f"{fmt:<10}{dname:<6}{q['argmax_agreement']:>18}{q['standard_error']:>9}{q['mean_kl']:>11}"
                      f"{s.get(fmt, '-'):>14}{s.get('unquantized', '-'):>13}")
    if kernels:
        print(f"\n{'product':<30}{'acts':<8}{'dense ms':>9}{'stream ms':>10}{'int8 ms':>9}{'int4 ms':>9}"
              f"{'int4 torch ms':>14}{'nf4 ms':>9}{'nf4 dq ms':>10}{'nf4 ref ms':>11}{'int8 x':>8}{'int4 x':>8}"
              f"{'nf4 x':>8}{'int8 x str':>11}"
              f"{'int4 x str':>11}"
              f"{'dense GB/s':>11}{'stream GB/s':>12}{'int8 GB/s':>10}{'int4 GB/s':>10}")
        for name, per in kernels.items():
            for acts, k in per.items():
                dense = "bf16" if acts.startswith("bf16") else "fp32"
                print(f"{name:<30}{acts:<8}{k[f'{dense}_ms']:>9}{k.get('stream_ms', '-'):>10}"
                      f"{k.get('int8_ms', '-'):>9}{k['int4_ms']:>9}{k['int4_torch_ms']:>14}{k['nf4_ms']:>9}"
                      f"{k['nf4_dq_ms']:>10}{k['nf4_ref_ms']:>11}"
                      f"{k.get('int8_speedup', '-'):>8}{k['int4_speedup']:>8}{k['nf4_speedup']:>8}"
                      f"{k.get('int8_vs_stream', '-'):>11}"
                      f"{k.get('int4_vs_stream', '-'):>11}{k[f'{dense}_gb_s']:>11}{k.get('stream_gb_s', '-'):>12}"
                      f"{k.get('int8_gb_s', '-'):>10}{k['int4_gb_s']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
