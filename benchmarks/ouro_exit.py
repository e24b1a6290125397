"""Ouro's exit gate at the runtime: decode speed against the realised mean steps, and KV bytes per token.

    python benchmarks/ouro_exit.py                      # Ouro-1.4B's shape (24 layers, h 2048), bf16
    python benchmarks/ouro_exit.py --layers 2 --new-tokens 6    # a quick run

An Ouro-1.4B-shaped model (`ModelConfig.from_preset("ouro-1.4b")`, T = 4) with random weights
(the preset's init). The gate is calibrated on the decoded positions of the fixed-depth run (one full
forward of prompt + continuation at T, every step's state: at fixed depth the same states decoding
saw): its weight scaled so its logit has standard deviation `--gate-spread` over them (positions and
steps then differ in lambda, so tokens exit at different steps), and its bias set by bisection so the
reference exit rule at q gives a mean exit step of `--target-mean` there. Early exits change later
tokens' states, so the realised distribution of each setting's decoded exit steps is reported.
Per setting (batch 1, greedy, same prompt): decode tokens/s (tokens after the first, which the
prefill gives), the mean steps per decoded token, its histogram, and the KV bytes each decoded token
adds to the cache (logical bytes the policy keeps: `GenerationOutput.cache_bytes` increments). Settings
run interleaved over --repeats rounds after a warm-up run, best speed kept. Prints one JSON line, then a
table with the machine's load average (the 2 cores are shared: speeds are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter

import torch
from _args import positive_int

import recurrent_depth as rd

SETTINGS = [  # name, generate options (besides the gate's q)
    ("fixed T=4, per-step", dict()),
    ("gate, lookup, per-step", dict(exit_criterion="gate")),
    ("gate, compute, per-step", dict(exit_criterion="gate", exit_kv="compute")),
    ("fixed T=4, last-step", dict(kv_policy="last-step")),
    ("gate, lookup, last-step", dict(exit_criterion="gate", kv_policy="last-step")),
    ("gate, lookup, shared-2", dict(exit_criterion="gate", kv_policy="shared-2")),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=positive_int, default=24,
                   help="layers of the looped stack (default: Ouro-1.4B's 24)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="weights and activations (default: %(default)s; float32 needs ~5.7 GB at 24 layers)")
    p.add_argument("--q", type=float, default=0.5, help="the gate's exit threshold (default: %(default)s)")
    p.add_argument("--target-mean", type=float, default=2.5,
                   help="mean exit step the gate's bias is calibrated to on the prompt (default: %(default)s)")
    p.add_argument("--gate-spread", type=float, default=1.5,
                   help="std of the gate's logit over the prompt's positions and steps (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=12, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=8, help="new tokens per run (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=1, help="rounds, best speed kept (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: %(default)s)")
    args = p.parse_args(argv)
    # the first token is the prefill's and the first decoded one's KV increment holds the prompt's last entry:
    # KV bytes per token need two more (fewer divided by zero, or wrote NaN into the JSON)
    if args.new_tokens < 3:
        p.error(f"--new-tokens must be at least 3, got {args.new_tokens}")
    return args


def reference_exit_steps(lambdas: torch.Tensor, q: float) -> torch.Tensor:
    """Exit step (1-based) per column of lambdas `[T, N]` under the reference's cumulative rule."""
    steps = lambdas.shape[0]
    survival = torch.cumprod(1 - lambdas, 0)
    before = torch.cat([torch.ones_like(survival[:1]), survival[:-1]])
    pdf = torch.cat([lambdas[:-1] * before[:-1], before[-1:]])
    reached = torch.cumsum(pdf, 0) >= q
    first = torch.where(reached.any(0), reached.float().argmax(0), steps - 1)
    return first + 1


@torch.no_grad()
def calibrate_gate(model: rd.RecurrentDepthLM, seq: torch.Tensor, first: int, q: float, target: float,
                   spread: float) -> dict:
    """Scale the gate's weight to a logit std of `spread` and set its bias so the mean exit step at q of
    positions `first`.. of `seq` `[1, L]` is `target`; returns what it found."""
    steps = model.config.mean_recurrence
    states = model(seq, num_steps=steps, output_all_states=True).all_states[1:, 0, first:]  # [T, N, h]
    gate = model.transformer.exit_gate
    logit = (model.latent(states).float() @ gate.weight.float()[0])  # [T, P] without the bias
    raw_std = logit.std()
    gate.weight.mul_(spread / float(raw_std))
    logit = logit * (spread / float(raw_std))
    low, high = -20.0, 20.0  # a larger bias exits earlier
    for _ in range(50):
        mid = (low + high) / 2
        mean = float(reference_exit_steps(torch.sigmoid(logit + mid), q).float().mean())
        low, high = (mid, high) if mean > target else (low, mid)
    gate.bias.fill_((low + high) / 2)
    lambdas = model.exit_probability(states)  # with the bias as stored (in the model's dtype)
    exits = reference_exit_steps(lambdas, q)
    return {"bias": float(gate.bias.float()), "weight_scale": spread / float(raw_std),
            "calibration_positions": exits.numel(), "calibrated_mean_exit": round(float(exits.float().mean()), 3),
            "calibrated_exit_histogram": dict(sorted(Counter(exits.tolist()).items())),
            "lambda_mean_per_step": [round(float(x), 3) for x in lambdas.mean(1)]}


def run_setting(model: rd.RecurrentDepthLM, ids: torch.Tensor, options: dict, q: float, new_tokens: int) -> dict:
    gate = {"exit_threshold": q} if options.get("exit_criterion") == "gate" else {}
    out = rd.generate(model, ids, max_new_tokens=new_tokens, **options, **gate)
    decoded = out.steps[0, 1:].tolist()  # the first token is the prefill's
    bytes_per_token = (out.cache_bytes[0, 1:] - out.cache_bytes[0, :-1]).float()
    return {"tokens_per_second": out.tokens_per_second, "mean_steps": sum(decoded) / len(decoded),
            "steps_histogram": dict(sorted(Counter(decoded).items())),
            "kv_bytes_per_token": float(bytes_per_token[1:].mean()),  # tokens whose own depth the increment counts
            "tokens": out.token_lists()[0], "kv_policy": out.kv_policy}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]  # the machine is shared: its load is part of the result
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = rd.ModelConfig.from_preset("ouro-1.4b", core_layers=args.layers)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the run's dtype: no float32 copy of 1.4 B weights
    try:
        model = rd.RecurrentDepthLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    ids = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    # The fixed-depth run first: its continuation calibrates the gate, and it warms up (its speed is not kept).
    warmup = run_setting(model, ids, SETTINGS[0][1], args.q, args.new_tokens)
    continuation = torch.tensor([warmup["tokens"][:-1]])
    # positions prompt_len.. hold the fed tokens, whose states gave decoded tokens 2..N
    gate = calibrate_gate(model, torch.cat([ids, continuation], 1), args.prompt_len, args.q, args.target_mean,
                          args.gate_spread)
    results: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, options in SETTINGS:
            r = run_setting(model, ids, options, args.q, args.new_tokens)
            if name not in results or r["tokens_per_second"] > results[name]["tokens_per_second"]:
                results[name] = r
    fixed = results["fixed T=4, per-step"]["tokens_per_second"]
    for r in results.values():
        r["speedup_vs_fixed"] = r["tokens_per_second"] / fixed
    report = {
        "benchmark": "ouro_exit", "layers": args.layers, "parameters": model.num_parameters(),
        "dtype": args.dtype, "q": args.q, "target_mean_exit": args.target_mean, "gate_spread": args.gate_spread,
        "gate": gate,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "threads": args.threads,
        "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "same_tokens_lookup_vs_compute": results["gate, lookup, per-step"]["tokens"]
        == results["gate, compute, per-step"]["tokens"],
        "results": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in results.items()},
    }
    print(json.dumps(report))
    print(f"\nOuro-1.4B shape, {args.layers} layers ({model.num_parameters() / 1e9:.2f} B parameters), {args.dtype}, "
          f"q = {args.q}, gate weight x{gate['weight_scale']:.2f}, bias {gate['bias']:.3f} (calibrated mean exit "
          f"{gate['calibrated_mean_exit']} over {gate['calibration_positions']} positions)")
    print(f"1-minute load average before / after: {load_before:.1f} / {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print(f"{'setting':28s} {'tok/s':>7s} {'x fixed':>7s} {'steps':>6s} {'KiB/token':>10s}  exit steps")
    for name, r in results.items():
        kib = r["kv_bytes_per_token"] / 1024
        print(f"{name:28s} {r['tokens_per_second']:7.3f} {r['speedup_vs_fixed']:7.2f} {r['mean_steps']:6.2f} "
              f"{kib:10.1f}  {r['steps_histogram']}")
    return report


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"done in {time.perf_counter() - start:.0f} s")
