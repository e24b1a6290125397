"""The server's continuous batch with and without quantized KV memory (`rdepth serve --kv-quant`).

    python benchmarks/serving_kv_quant.py                       # random `small` model, ~2 minutes on 2 cores
    python benchmarks/serving_kv_quant.py --kv-quant "none;k=prod:3.5,v=mse:3.5" --concurrency 4

Drives `serving.BatchDecoder` in this process (no HTTP: the figures are the batch's own) the way
the engine does: `--concurrency` rows run at once, a finished request's row is refilled at once
from the same list of requests (token-id prompts of varied length, greedy, every request its full
length), at fixed depth and with KL exit. For each `--kv-quant` spec side by side in one run:
decode tokens/s (prefills included, as a server's; the best of `--repeats` rounds in which the
configurations take turns, since other jobs on a shared machine move single figures a lot), the
pool's bytes at its peak (every layer, slot, row and column it allocated, every norm counted:
`pool.nbytes()`, `rdepth_kv_pool_bytes`), the bytes one column (one token of one row) holds
across all layers and slots, and both relative to full precision. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch
from _args import checked_model_dir, int_range, out_file, positive_int, preset_name

import recurrent_depth as rd
from recurrent_depth.inference.kv_codec import KVQuant
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, RowRequest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a saved model directory (default: a random --preset model)")
    p.add_argument("--preset", default="small", type=preset_name,
                   help="preset of the random model (default: %(default)s)")
    p.add_argument("--kv-quant", default="none;k=prod:3.5,v=mse:3.5;k=prod:2.5,v=mse:2.5",
                   help="';'-separated specs, 'none' = full precision (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=8, help="requests per run (default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=4, help="rows decoded at once (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int_range, default="8,32",
                   help="prompt length range (default: %(default)s)")
    p.add_argument("--max-tokens", type=int_range, default="12,24",
                   help="new tokens range per request (default: %(default)s)")
    p.add_argument("--num-steps", type=positive_int, default=16, help="recurrence depth (default: %(default)s)")
    p.add_argument("--exit-threshold", type=float, default=5e-4, help="KL exit threshold (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds, the configurations taking turns; the best of each is reported (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and requests (default: %(default)s)")
    p.add_argument("--out", default=None, type=out_file, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    args.model = checked_model_dir(p, args.model)
    try:  # a bad spec failed only after the model was built and the first warm-up ran
        for spec in args.kv_quant.split(";"):
            if spec.strip() != "none":
                KVQuant.parse(spec.strip())
    except ValueError as exc:
        p.error(f"--kv-quant: {exc}")
    return args


def run(model, requests: list[tuple[list[int], int]], options: dict, kv_quant: str | None,
        concurrency: int) -> dict:
    """All requests through one BatchDecoder, `concurrency` rows at a time; throughput and bytes."""
    dec = BatchDecoder(model, concurrency, kv_quant=kv_quant)
    pending, done, tokens, steps, peak = list(range(len(requests))), 0, 0, 0, 0
    wanted: dict[int, int] = {}
    start = time.perf_counter()
    while pending or len(dec):
        while pending and len(dec) < concurrency:
            j = pending.pop(0)
            prompt, n = requests[j]
            opts = GenerationOptions(max_new_tokens=n, init_scale=0.0, **options).validate(model.config.mean_recurrence)
            seq, first, _ = dec.add(RowRequest(prompt, opts, j), tag=j)
            wanted[j] = n - 1
            tokens, steps = tokens + 1, steps + first.steps
        for seq, result in dec.step():
            tokens, steps = tokens + 1, steps + result.steps
            wanted[seq.tag] -= 1
            if wanted[seq.tag] == 0:
                dec.remove(seq)
                done += 1
        peak = max(peak, dec.pool.nbytes())
    seconds = time.perf_counter() - start
    pool = dec.pool
    return {"kv_quant": kv_quant or "none", "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2), "steps_per_token": round(steps / tokens, 2),
            "mean_batch_rows": round(dec.core_rows / max(1, dec.iterations), 2), "peak_pool_bytes": peak,
            "pool_shape": [pool.slots, pool.rows, pool.capacity],
            "bytes_per_column": peak // (pool.rows * pool.capacity)}


TABLE = [  # (heading, width, cell)
    ("mode", 8, lambda r: r["mode"]), ("kv_quant", 24, lambda r: r["kv_quant"]),
    ("tok/s", 7, lambda r: f"{r['tokens_per_s']:.1f}"), ("speed", 6, lambda r: f"{r['speed_vs_first']:.2f}x"),
    ("steps/tok", 9, lambda r: f"{r['steps_per_token']:.2f}"), ("rows", 5, lambda r: f"{r['mean_batch_rows']:.1f}"),
    ("peak pool B", 12, lambda r: f"{r['peak_pool_bytes']:,d}"),
    ("B/column", 9, lambda r: f"{r['bytes_per_column']:,d}"),
    ("smaller", 7, lambda r: f"{r['bytes_vs_first']:.2f}x"),
]


def print_table(runs: list[dict]) -> None:
    print(" ".join(f"{heading:>{width}}" for heading, width, _ in TABLE))
    for r in runs:
        print(" ".join(f"{cell(r):>{width}}" for _, width, cell in TABLE))


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    if args.model is None:
        torch.manual_seed(args.seed)
        model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset(args.preset)).eval()
        source = f"random {args.preset}"
    else:
        model = rd.RecurrentDepthLM.from_pretrained(Path(args.model)).eval()
        source = args.model
    cfg = model.config
    sys.path.insert(0, str(Path(__file__).parent))
    from serving import random_requests  # the serving benchmark's requests

    requests = random_requests(rng, cfg.vocab_size, args.prompt_tokens, args.max_tokens, args.requests)
    specs = [None if s.strip() == "none" else s.strip() for s in args.kv_quant.split(";")]
    modes = {"fixed": dict(num_steps=args.num_steps),
             "kl-exit": dict(num_steps=args.num_steps, exit_criterion="kl", exit_threshold=args.exit_threshold)}
    best: dict[tuple[str, str | None], dict] = {}
    with torch.inference_mode():
        for spec in specs:
            run(model, requests[:1], dict(modes["fixed"], num_steps=2), spec, 1)  # warm-up (codec tables)
        for round_ in range(args.repeats):  # the configurations take turns; the best round of each counts
            for mode, options in modes.items():
                for spec in specs:
                    result = dict(mode=mode, **run(model, requests, options, spec, args.concurrency))
                    if (mode, spec) not in best or result["tokens_per_s"] > best[(mode, spec)]["tokens_per_s"]:
                        best[(mode, spec)] = result
                    print(f"  round {round_} {mode:8s} {result['kv_quant']:24s} {result['tokens_per_s']:8.1f} tok/s",
                          file=sys.stderr)
    runs = list(best.values())
    for r in runs:
        base = next(b for b in runs if b["mode"] == r["mode"] and b["kv_quant"] == runs[0]["kv_quant"])
        r["bytes_vs_first"] = round(base["peak_pool_bytes"] / r["peak_pool_bytes"], 2)
        r["speed_vs_first"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    summary = {
        "benchmark": "serving_kv_quant", "model": source, "dtype": str(model.dtype).removeprefix("torch."),
        "head_dim": cfg.head_dim, "num_kv_heads": cfg.num_kv_heads, "core_layers": cfg.core_layers,
        "num_steps": args.num_steps, "requests": args.requests, "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "threads": args.threads,
        "repeats": args.repeats, "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2), "platform": platform.platform(), "runs": runs,
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary) + "\n")
    print_table(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
