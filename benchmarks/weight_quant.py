"""Weight-only int8 quantization (`recurrent_depth.weight_quant`): quality, small-shape speed, kernel speed.

    python benchmarks/weight_quant.py --model runs/quickstart/model            # a trained model directory
    python benchmarks/weight_quant.py --model DIR --skip-kernels --rows 8      # quick

In one run:

* teacher-forced agreement: on `--rows` rows of the model directory's validation shards
  (`--data`, default `DIR/../data/validation.json`, what `rdepth quickstart` writes), the fraction
  of positions whose argmax token is the same with int8 weights as without, and the mean KL
  divergence of the int8 model's next-token distribution from the unquantized one's, in float32
  (the dequantized reference path) and bf16 (torch's int8 kernel against bf16 weights), at
  `--num-steps`;
* small-shape decode tokens/s of the same model, unquantized (the fused runner) and int8 (the
  reference runner: the quantized model's), per dtype; at this size decoding is bound by Python
  dispatch, not weight bytes, so this is not where int8 pays;
* the kernel: ms per product of one Huginn-0125 linear (K, N below) at M = 1 and 8 rows, bf16
  `x @ W^T` against `aten._weight_int8pack_mm`, and the weight bytes / s each reaches.

Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.data.shards import ShardDataset
from recurrent_depth.weight_quant import Int8WeightLinear, quantize_weights

# Huginn-0125's linear shapes (K = in, N = out): Wqkv, MLP fc (gate and up), MLP proj, adapter.
HUGINN_SHAPES = {"Wqkv": (5280, 3 * 5280), "mlp.fc": (5280, 2 * 17920), "mlp.proj": (17920, 5280),
                 "adapter": (2 * 5280, 5280)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a trained model directory")
    p.add_argument("--data", default=None, help="validation shard index (default: MODEL/../data/validation.json)")
    p.add_argument("--rows", type=int, default=32, help="validation rows for the agreement (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=None, help="recurrence depth (default: the model's mean)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode timing (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="kernel timing repeats, best kept (default: %(default)s)")
    p.add_argument("--skip-kernels", action="store_true", help="skip the Huginn-shape kernel timings")
    args = p.parse_args(argv)
    if args.rows < 1 or args.decode_tokens < 2 or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1, --decode-tokens >= 2")
    return args


def agreement(model: rd.RecurrentDepthLM, rows: torch.Tensor, num_steps: int, dtype: torch.dtype) -> dict[str, Any]:
    """Argmax agreement and mean KL(unquantized || int8) over every position of `rows`, in `dtype`."""
    plain = copy.deepcopy(model).to(dtype)
    quantized = copy.deepcopy(plain)
    layers = quantize_weights(quantized, "int8")
    same = total = 0
    kl = 0.0
    with torch.inference_mode():
        for row in rows.split(4):
            want = plain(row, num_steps=num_steps, init_scale=0.0).logits.float()
            got = quantized(row, num_steps=num_steps, init_scale=0.0).logits.float()
            same += int((want.argmax(-1) == got.argmax(-1)).sum())
            total += want.shape[0] * want.shape[1]
            kl += float(F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                 reduction="sum"))
    return dict(layers_quantized=layers, positions=total, argmax_agreement=round(same / total, 5),
                mean_kl=float(f"{kl / total:.3g}"))


def decode_speed(model: rd.RecurrentDepthLM, prompt: torch.Tensor, num_steps: int, tokens: int,
                 dtype: torch.dtype) -> dict[str, float]:
    """Greedy decode tokens/s, unquantized and int8 (best of two runs each)."""
    plain = copy.deepcopy(model).to(dtype)
    quantized = copy.deepcopy(plain)
    quantize_weights(quantized, "int8")
    out = {}
    for name, m in (("unquantized", plain), ("int8", quantized)):
        runs = [rd.generate(m, prompt, max_new_tokens=tokens, num_steps=num_steps, init_scale=0.0)
                for _ in range(2)]
        out[name] = round(max(r.tokens_per_second for r in runs), 2)
    out["int8_over_unquantized"] = round(out["int8"] / out["unquantized"], 3)
    return out


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def kernel_timings(repeats: int) -> dict[str, Any]:
    """ms per product and weight GB/s, bf16 matmul against the int8 kernel, at Huginn's shapes."""
    g = torch.Generator().manual_seed(0)
    rows = {}
    for name, (K, N) in HUGINN_SHAPES.items():
        for M, row in shape_timings(K, N, g, repeats).items():
            rows[f"{name} [{M}x{K}]x[{K}x{N}]"] = row
    return rows


def shape_timings(K: int, N: int, g: torch.Generator, repeats: int) -> dict[int, dict[str, float]]:
    weight = torch.randn(N, K, generator=g).to(torch.bfloat16)
    layer = Int8WeightLinear.from_linear(torch.nn.Linear(K, N, bias=False).to(torch.bfloat16))
    out = {}
    for M in (1, 8):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        bf16 = best_ms(lambda x=x: x @ weight.t(), repeats)
        int8 = best_ms(lambda x=x: layer(x), repeats)
        out[M] = dict(bf16_ms=round(bf16, 3), int8_ms=round(int8, 3), speedup=round(bf16 / int8, 3),
                      bf16_weight_gb_s=round(2 * N * K / bf16 / 1e6, 2), int8_weight_gb_s=round(N * K / int8 / 1e6, 2))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = rd.RecurrentDepthLM.from_pretrained(args.model).eval()
    num_steps = args.num_steps or model.config.mean_recurrence
    data = Path(args.data) if args.data else Path(args.model).resolve().parent / "data" / "validation.json"
    shards = ShardDataset(data, shuffle=False)
    count = min(args.rows, len(shards))
    rows = torch.from_numpy(shards.rows(list(range(count))).astype("int64"))[:, :-1]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    quality = {}
    speed = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        start = time.perf_counter()
        quality[name] = agreement(model, rows, num_steps, dtype)
        speed[name] = decode_speed(model, rows[:1, :16], num_steps, args.decode_tokens, dtype)
        log(f"[{name}] {quality[name]} {speed[name]} ({time.perf_counter() - start:.0f}s)")
    kernels = {} if args.skip_kernels else kernel_timings(args.repeats)
    record = dict(
        benchmark="weight_quant", model=str(args.model), parameters=model.num_parameters(), rows=count,
        seq_len=int(rows.shape[1]), num_steps=num_steps, agreement=quality, decode_tokens_per_s=speed,
        kernels=kernels, threads=torch.get_num_threads(), torch=torch.__version__,
        python=platform.python_version(), load_average=[round(x, 2) for x in os.getloadavg()],
    )
    print(json.dumps(record))
    print(f"\n{'dtype':<6}{'argmax agreement':>18}{'mean KL':>12}{'decode tok/s plain':>20}{'int8':>10}")
    for name in quality:
        q, s = quality[name], speed[name]
        print(f"{name:<6}{q['argmax_agreement']:>18}{q['mean_kl']:>12}{s['unquantized']:>20}{s['int8']:>10}")
    if kernels:
        print(f"\n{'product':<36}{'bf16 ms':>10}{'int8 ms':>10}{'speedup':>10}{'bf16 GB/s':>11}{'int8 GB/s':>11}")
        for name, k in kernels.items():
            print(f"{name:<36}{k['bf16_ms']:>10}{k['int8_ms']:>10}{k['speedup']:>10}{k['bf16_weight_gb_s']:>11}"
                  f"{k['int8_weight_gb_s']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
