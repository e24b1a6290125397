"""Huginn-size decode against the memory roofline (issue 29 item 1).

    python benchmarks/decode_roofline.py                    # huginn-0125 shape, bf16, 3 tokens a config
    python benchmarks/decode_roofline.py --layers 1 --tokens 2 --configs fixed,official   # quick check

Decoding one token at batch 1 multiplies a single row by every weight it passes, so its speed is
bounded by how fast the machine streams those weights (and the KV cache) from memory. In one run:

* the memory read bandwidth: a streaming `torch.sum` over a buffer far larger than the caches,
  best of several repeats, at the thread count the decode uses;
* the `huginn-0125` preset (3.56 B parameters) with random weights, built directly in the
  decode dtype (no fp32 copy first: fp32 then cast would peak near 21 GB);
* per config, measured decode tokens/s (prefill and the first token excluded) and the bytes each
  decoded token reads at the steps it actually ran: embedding row, prelude, r x (adapter + core),
  coda + final norm + head once (or after every step for KL exit, which reads the logits each
  step), plus the K/V rows every attention call reads; their roofline tokens/s is
  bandwidth / bytes, and the fraction measured / roofline.

Configs: `fixed` (r = --num-steps), `kl` (KL exit; with random weights the exit depth is arbitrary,
so its roofline uses the realised steps), `shared-4` (fixed r on a 4-slot shared KV cache), and
`official` (the official implementation's loop shape, frozen in `benchmarks/generation.py`), and
`int8` (fixed r after `recurrent_depth.weight_quant.quantize_weights`: int8 weights per output
channel in every transformer linear, quantized in place after the other configs ran; the C++
`int8_linear` at decode rows: bf16 rows as exact int16 x int8 integer dots, fp32 rows as float dots)
and `int4` (fixed r on group-32 4-bit weights: the C++ `int4_linear` at decode rows, or torch's
int4 kernel with C++ off; bf16 and fp32; quantized after int8 is undone, from its dequantized
weights: random weights, so only the speed is measured). Their bytes count the packed weights and scales.
On CPUs without native bf16 (no AVX512-BF16 / AMX-BF16) bf16 products are emulated: `--dtype auto`
then runs fp32 and bf16 and the roofline note says which is nearer the limit.
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import recurrent_depth as rd
from recurrent_depth.accel import decode_cpp, quant_cpp
from recurrent_depth.weight_quant import QuantizedLinear, dequantize_weights, quantize_weights, quantized_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import preset_name  # noqa: E402
from generation import official_style_loop, read_bandwidth  # noqa: E402  (the frozen official-style loop)

CONFIGS = ("fixed", "kl", "shared-4", "official", "int8", "int4")
QUANTIZED = ("int8", "int4")  # run last, in this order: each quantizes the model in place
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="huginn-0125", type=preset_name, help="model preset (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None,
                   help="core layers instead of the preset's (fewer for a quick check; default: the preset's)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32", "both"), default="auto",
                   help="weight dtype; auto = bf16 where the CPU has native bf16, else both (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated configs from {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--tokens", type=int, default=3,
                   help="new tokens per config, the first (from the prefill) not timed (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=32, help="recurrence depth r (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default: %(default)s)")
    p.add_argument("--bandwidth-gb", type=float, default=2.0,
                   help="buffer size of the bandwidth read, GB (default: %(default)s)")
    p.add_argument("--bandwidth-repeats", type=int, default=5, help="bandwidth reads, best kept (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and the prompt (default: %(default)s)")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs: unknown {bad or 'empty list'}; choose from {', '.join(CONFIGS)}")
    if args.tokens < 2:
        p.error("--tokens must be at least 2 (the first token comes from the prefill and is not timed)")
    for name in ("num_steps", "prompt_len", "bandwidth_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be at least 1")
    if args.bandwidth_gb <= 0:
        p.error("--bandwidth-gb must be positive")
    return args


# ------------------------------------------------------------------------------ machine
def cpu_flags(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU model and the flags that decide bf16 / int8 matmul speed (empty where unreadable)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)  # the first CPU's lines are at the top
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return dict(model=model, flags=[f for f in wanted if f in flags],
                native_bf16=bool({"avx512_bf16", "amx_bf16"} & flags))


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# ------------------------------------------------------------------------------ model and bytes
def build_model(config: rd.ModelConfig, dtype: torch.dtype, seed: int) -> rd.RecurrentDepthLM:
    """The model with random (Takase-init) weights created in `dtype` directly, so the peak is the
    model's own size: the default dtype is switched while the parameters are made."""
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        model = rd.RecurrentDepthLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def param_bytes(modules: Any) -> int:
    """Bytes of the parameters of a module or a list of modules (each tensor once), quantized weights
    and their scales (the quantized layers' buffers) included."""
    seen, total = set(), 0
    for module in modules if isinstance(modules, (list, tuple)) else [modules]:
        quantized = [t for m in module.modules() if isinstance(m, QuantizedLinear) for t in m.buffers(recurse=False)]
        for p in [*module.parameters(), *quantized]:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class PartBytes:
    """Bytes one pass over each part of the model reads (from its parameter tensors)."""

    embedding_row: int  # one row of the embedding: the token's input
    prelude: int
    adapter: int
    core: int  # one step: every core layer once
    readout: int  # coda + final norm + head (the full head matrix, tied or not)
    kv_row: int  # K and V of one position in one attention layer
    prelude_layers: int
    core_layers: int
    coda_layers: int

    @classmethod
    def of(cls, model: rd.RecurrentDepthLM) -> PartBytes:
        t, cfg = model.transformer, model.config
        wte = t.wte.weight
        adapter = [t.adapter] if "adapter" in t else []
        readout = [*t.coda, t.ln_f, model.lm_head] + ([t.coda_projection] if "coda_projection" in t else [])
        return cls(
            embedding_row=wte.shape[1] * wte.element_size(),
            prelude=param_bytes(list(t.prelude) + ([t.ln_prelude] if "ln_prelude" in t else [])),
            adapter=param_bytes(adapter) if adapter else 0,
            core=param_bytes(list(t.core_block)),
            readout=param_bytes(readout),
            kv_row=2 * cfg.num_kv_heads * cfg.head_dim * wte.element_size(),
            prelude_layers=cfg.prelude_layers, core_layers=cfg.core_layers, coda_layers=cfg.coda_layers,
        )


def token_bytes(parts: PartBytes, steps: int, context: int, readout_every_step: bool) -> dict[str, int]:
    """Bytes one decoded token reads at `steps` core steps with `context` cached positions plus
    itself: weights (embedding row, prelude, steps x (adapter + core), the readout once or after
    every step) and KV (every attention call reads K and V of all `context + 1` positions; under a
    shared-K policy at fixed depth each slot holds every position, so the count is the same)."""
    readouts = steps if readout_every_step else 1
    weights = parts.embedding_row + parts.prelude + steps * (parts.adapter + parts.core) + readouts * parts.readout
    calls = parts.prelude_layers + steps * parts.core_layers + readouts * parts.coda_layers
    kv = calls * (context + 1) * parts.kv_row
    return dict(weights=weights, kv=kv, total=weights + kv)


def roofline(parts: PartBytes, steps: list[int], prompt_len: int, readout_every_step: bool,
             bandwidth_gb_s: float) -> dict[str, float]:
    """Mean bytes per timed token (token k of the timed ones has prompt_len + k cached positions,
    the first new token coming from the prefill) and the tokens/s reading them at the bandwidth."""
    per = [token_bytes(parts, s, prompt_len + k, readout_every_step) for k, s in enumerate(steps, start=1)]
    total = sum(p["total"] for p in per)
    return dict(
        weight_gb_per_token=sum(p["weights"] for p in per) / len(per) / 1e9,
        kv_mb_per_token=sum(p["kv"] for p in per) / len(per) / 1e6,
        roofline_tokens_per_s=len(per) * bandwidth_gb_s * 1e9 / total,
    )


# ------------------------------------------------------------------------------ runs
def run_config(name: str, model: rd.RecurrentDepthLM, ids: torch.Tensor, r: int,
               tokens: int) -> tuple[float, list[int]]:
    """Measured decode tokens/s (first token excluded) and the steps of each timed token."""
    if name == "official":
        out = official_style_loop(model, ids, r, tokens)
        return out.tokens_per_second, [r] * (tokens - 1)
    options: dict[str, Any] = dict(num_steps=r, init_scale=0.0)
    if name in QUANTIZED:
        if not quantized_weights(model):
            raise ValueError(f"the {name} config needs a model quantized by quantize_weights")
    elif name == "kl":
        options["exit_criterion"] = "kl"
    elif name == "shared-4":
        options["kv_policy"] = "shared-4"
    out = rd.generate(model, ids, max_new_tokens=tokens, **options)
    return out.tokens_per_second, [int(s) for s in out.steps[0, 1:].tolist()]


def measure_dtype(dtype_name: str, config: rd.ModelConfig, args: argparse.Namespace, bandwidth: float,
                  log: Callable[[str], None]) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    start = time.perf_counter()
    model = build_model(config, dtype, args.seed)
    built = time.perf_counter() - start
    parts = PartBytes.of(model)
    model_bytes = param_bytes(model)
    log(f"[{dtype_name}] built {model_bytes / 1e9:.2f} GB of weights in {built:.0f}s")
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=g)
    rows: dict[str, Any] = {}
    names = [c for c in args.configs if c not in QUANTIZED]  # the quantized last: they change the model
    names += [name for name in QUANTIZED if name in args.configs]
    with torch.inference_mode():
        for name in names:
            if name in QUANTIZED:
                start = time.perf_counter()
                dequantize_weights(model)  # (int4 after int8: from int8's rounding, the same speed)
                quantize_weights(model, name)
                parts = PartBytes.of(model)
                log(f"[{dtype_name}] {name}: quantized to {param_bytes(model) / 1e9:.2f} GB in "
                    f"{time.perf_counter() - start:.0f}s")
            start = time.perf_counter()
            tps, steps = run_config(name, model, ids, args.num_steps, args.tokens)
            line = roofline(parts, steps, args.prompt_len, name == "kl", bandwidth)
            rows[name] = dict(
                tokens_per_s=round(tps, 4), mean_steps=round(sum(steps) / len(steps), 2),
                weight_gb_per_token=round(line["weight_gb_per_token"], 3),
                kv_mb_per_token=round(line["kv_mb_per_token"], 3),
                roofline_tokens_per_s=line["roofline_tokens_per_s"],  # at this bandwidth; `rescore` restates it
                fraction_of_roofline=round(tps / line["roofline_tokens_per_s"], 3),
            )
            if name in QUANTIZED and "fixed" in rows:
                rows[name]["speedup_vs_fixed"] = round(tps / rows["fixed"]["tokens_per_s"], 3)
            log(f"[{dtype_name}] {name}: {rows[name]} ({time.perf_counter() - start:.0f}s with the prefill)")
    del model
    return dict(model_gb=round(model_bytes / 1e9, 3), build_seconds=round(built, 1), configs=rows, bandwidth=bandwidth)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_flags()
    dtypes = {"auto": ["bf16"] if cpu["native_bf16"] else ["fp32", "bf16"], "both": ["fp32", "bf16"]}.get(
        args.dtype, [args.dtype])
    overrides = {} if args.layers is None else dict(core_layers=args.layers)
    config = rd.ModelConfig.from_preset(args.preset, **overrides)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    free = available_bytes()
    parameters = count_parameters(config)
    for name in dtypes:
        need = parameters * torch.finfo(DTYPES[name]).bits // 8
        if free is not None and need > 0.85 * free:
            raise SystemExit(f"--dtype {name}: the model needs {need / 1e9:.1f} GB, more than 85% of the "
                             f"{free / 1e9:.1f} GB available; use --layers or another --dtype")
    # The bandwidth moves with other jobs' load on a shared machine: probe it before the model is
    # built and again after it is freed (never both in memory), and take the best, the roofline's
    # most demanding reading. A run inside a quieter or busier minute still moves the fraction.
    # The C++ kernels build at their first use (once per machine): before anything is timed.
    for kernels in (decode_cpp.load_decoder, quant_cpp.load):
        if quant_cpp.cpp_enabled() and kernels() is None:
            log(f"C++ kernels unavailable ({decode_cpp.build_failure() or quant_cpp.failure()}): Python paths")
    samples = [read_bandwidth(int(args.bandwidth_gb * 1e9), args.bandwidth_repeats)]
    log(f"read bandwidth {samples[0]:.1f} GB/s ({torch.get_num_threads()} threads)")
    results = {}
    for name in dtypes:
        results[name] = measure_dtype(name, config, args, max(samples), log)
        samples.append(read_bandwidth(int(args.bandwidth_gb * 1e9), args.bandwidth_repeats))
        log(f"read bandwidth {samples[-1]:.1f} GB/s after the {name} runs")
    bandwidth = max(samples)
    rescore(results, bandwidth)
    roofline_dtype = "bf16" if cpu["native_bf16"] or "fp32" not in results else "fp32"
    record = dict(
        benchmark="decode_roofline", preset=args.preset, core_layers=config.core_layers,
        parameters=parameters, num_steps=args.num_steps, prompt_len=args.prompt_len,
        tokens=args.tokens, timed_tokens=args.tokens - 1, threads=torch.get_num_threads(), cpu=cpu,
        bandwidth_gb_s=round(bandwidth, 2), bandwidth_samples_gb_s=[round(b, 2) for b in samples],
        bandwidth_buffer_gb=args.bandwidth_gb,
        roofline_dtype=roofline_dtype, dtypes=results,
        torch=torch.__version__, python=platform.python_version(),
        load_average=[round(x, 2) for x in os.getloadavg()],
    )
    print(json.dumps(record))
    cols = ["tokens_per_s", "mean_steps", "weight_gb_per_token", "kv_mb_per_token", "roofline_tokens_per_s",
            "fraction_of_roofline"]
    for name, res in results.items():
        print(f"\n{name} ({res['model_gb']} GB of weights)")
        print(f"{'config':<10}" + "".join(f"{c:>24}" for c in cols))
        for cfg_name, row in res["configs"].items():
            print(f"{cfg_name:<10}" + "".join(f"{row[c]!s:>24}" for c in cols))
    print(f"\n{cpu['model']}; flags {' '.join(cpu['flags'])}; bf16 "
          f"{'native' if cpu['native_bf16'] else 'emulated (no AVX512-BF16 / AMX-BF16)'}; "
          f"read bandwidth {bandwidth:.1f} GB/s at {torch.get_num_threads()} threads (best of "
          f"{', '.join(f'{b:.1f}' for b in samples)}); "
          f"the roofline headline uses {roofline_dtype}")
    for name, res in results.items():
        for quant in QUANTIZED:
            row = res["configs"].get(quant)
            if row is not None and "speedup_vs_fixed" in row:
                print(f"{name}: {quant} weights decode {row['speedup_vs_fixed']}x the {name} fixed-depth decode")
    return 0


def rescore(results: dict[str, Any], bandwidth_gb_s: float) -> None:
    """Restate every row's roofline at the final bandwidth (the rooflines scale with it)."""
    for res in results.values():
        for row in res["configs"].values():
            roof = row["roofline_tokens_per_s"] * bandwidth_gb_s / res["bandwidth"]
            row["roofline_tokens_per_s"] = round(roof, 4)
            row["fraction_of_roofline"] = round(row["tokens_per_s"] / roof, 3)
        del res["bandwidth"]


def count_parameters(config: rd.ModelConfig) -> int:
    """Unique parameters of a model of `config`, without allocating it (a meta-device build)."""
    with torch.device("meta"):
        model = rd.RecurrentDepthLM(config)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    sys.exit(main())
