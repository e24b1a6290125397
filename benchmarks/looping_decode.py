"""Decode speed of a looped transformers model: base vs prefill-only looping vs every-token looping.

    python benchmarks/looping_decode.py --model runs/loop-demo/model --window 3-4 --iterations 3

Per mode (batch 1, greedy, `model.generate` with a DynamicCache): prefill seconds and decode tokens/s
(best of --repeats; decode time = time of N new tokens minus time of 1, so prefill is excluded), the
paper's FLOPs ratio 1 + (K − 1)·w, and the window passes per decoded token. Modes run interleaved
in each round so machine load hits them alike. Without --model, a random Llama (h 128, 8 layers).
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from _args import checked_model_dir, positive_int

from recurrent_depth.looping import LoopConfig, apply_loop, remove_loop


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a transformers causal LM directory (default: a random Llama)")
    p.add_argument("--window", default="3-4", help="first-last layer of the loop window (default: %(default)s)")
    p.add_argument("--iterations", type=positive_int, default=3, help="K (default: %(default)s)")
    p.add_argument("--rule", default="damped", help="update rule (default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="new tokens per run (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds, best kept (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: %(default)s)")
    args = p.parse_args(argv)
    if args.new_tokens < 2:  # decode speed is the time of N tokens minus that of 1: N = 1 divides by zero
        p.error(f"--new-tokens must be at least 2, got {args.new_tokens}")
    a, _, b = args.window.partition("-")
    try:
        args.window = (int(a), int(b or a))
    except ValueError:
        p.error(f"--window: expected FIRST-LAST layer indices (e.g. 3-4), got {args.window!r}")
    if not 0 <= args.window[0] <= args.window[1]:
        p.error(f"--window: expected 0 <= FIRST <= LAST, got {args.window[0]}-{args.window[1]}")
    args.model = checked_model_dir(p, args.model)
    return args


def _model(path: str | None):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@torch.no_grad()
def _time_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = _model(args.model)
    num_layers = model.config.num_hidden_layers
    start, end = args.window
    if end >= num_layers:
        raise SystemExit(f"looping_decode.py: error: --window {start}-{end}: the model has {num_layers} layers "
                         f"(0-{num_layers - 1})")
    modes: dict[str, LoopConfig | None] = {
        "base": None,
        "prefill-only": LoopConfig(start, end, iterations=args.iterations, rule=args.rule, when="prefill"),
        "every-token first": LoopConfig(start, end, iterations=args.iterations, rule=args.rule, when="always"),
        "every-token last": LoopConfig(start, end, iterations=args.iterations, rule=args.rule, when="always",
                                       stash="last"),
    }
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    best: dict[str, dict[str, float]] = {m: {"prefill_s": float("inf"), "decode_s": float("inf")} for m in modes}
    for cfg in modes.values():  # warm-up
        apply_loop(model, cfg) if cfg is not None else remove_loop(model)
        _time_generate(model, ids, 2)
    for _ in range(args.repeats):
        for name, cfg in modes.items():
            apply_loop(model, cfg) if cfg is not None else remove_loop(model)
            one = _time_generate(model, ids, 1)
            full = _time_generate(model, ids, args.new_tokens)
            best[name]["prefill_s"] = min(best[name]["prefill_s"], one)
            best[name]["decode_s"] = min(best[name]["decode_s"], max(full - one, 1e-9))
    remove_loop(model)
    w = (end - start + 1) / num_layers
    rows = {}
    for name, cfg in modes.items():
        k = 1 if cfg is None else cfg.iterations
        decode_k = k if cfg is not None and cfg.when == "always" else 1
        passes = decode_k + (1 if cfg is not None and cfg.when == "always" and cfg.stash == "last" else 0)
        # generate's prefill is a cached forward: stash "last" adds one window pass there too (1 + K·w)
        prefill_passes = k + (1 if cfg is not None and cfg.stash == "last" else 0)
        rows[name] = {
            "prefill_s": round(best[name]["prefill_s"], 4),
            "decode_tokens_per_s": round((args.new_tokens - 1) / best[name]["decode_s"], 1),
            "prefill_flops_ratio": round(1 + (prefill_passes - 1) * w, 4),
            "decode_flops_ratio": round(1 + (passes - 1) * w, 4),
            "window_passes_per_decoded_token": passes,
        }
    base_rate = rows["base"]["decode_tokens_per_s"]
    for row in rows.values():
        row["decode_speed_vs_base"] = round(row["decode_tokens_per_s"] / base_rate, 3)
    result = {
        "benchmark": "looping_decode", "model": args.model or "random llama h128 x8", "window": [start, end],
        "iterations": args.iterations, "rule": args.rule, "num_layers": num_layers, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "modes": rows,
    }
    print(json.dumps(result))
    print(f"{'mode':<18} {'prefill s':>9} {'decode tok/s':>12} {'vs base':>8} {'FLOPs× prefill':>14} "
          f"{'FLOPs× decode':>13}")
    for name, row in rows.items():
        print(f"{name:<18} {row['prefill_s']:>9.4f} {row['decode_tokens_per_s']:>12.1f} "
              f"{row['decode_speed_vs_base']:>8.3f} {row['prefill_flops_ratio']:>14.3f} "
              f"{row['decode_flops_ratio']:>13.3f}")
    return result


if __name__ == "__main__":
    main()
