"""Decode speed with a LoRA adapter unmerged (both runners) against the same adapter merged.

    python benchmarks/lora_decode.py --preset small --rank 8 --new-tokens 32 --repeats 3

The adapter sits on every part and kind (`LoraSpec()`), with random B so it changes the outputs; the
merged model is `merge_lora` of a copy. Each case generates greedily from the same prompt at a fixed
depth; the best of `--repeats` runs (process CPU time, one torch thread) is reported, with whether the
unmerged runs produced the merged model's tokens. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from _args import positive_int, preset_name

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.runner import make_runner
from recurrent_depth.train.lora import LoraSpec, add_lora, merge_lora


def best_seconds(model, ids: torch.Tensor, repeats: int, **kwargs) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.process_time()
        out = generate(model, ids, **kwargs)
        times.append(time.process_time() - start)
    return min(times), out.sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", type=preset_name)
    parser.add_argument("--rank", type=positive_int, default=8)
    parser.add_argument("--num-steps", type=positive_int, default=8)
    parser.add_argument("--prompt-len", type=positive_int, default=16)
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = rd.RecurrentDepthLM(rd.ModelConfig.from_preset(args.preset)).eval()
    wrapped = add_lora(base, LoraSpec(rank=args.rank, alpha=2 * args.rank))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.02)
    unmerged = wrapped.get_base_model()
    merged = merge_lora(copy.deepcopy(wrapped))
    ids = torch.randint(0, base.config.vocab_size, (1, args.prompt_len), generator=g)
    kw = dict(max_new_tokens=args.new_tokens, num_steps=args.num_steps, init_scale=0.0)
    cases = {
        "merged, fast runner": (merged, True),
        "unmerged, fast runner": (unmerged, True),
        "merged, reference runner": (merged, False),
        "unmerged, reference runner": (unmerged, False),
    }
    rows = {}
    reference = None
    for name, (model, fast) in cases.items():
        seconds, tokens = best_seconds(model, ids, args.repeats, fast=fast, **kw)
        reference = tokens if reference is None else reference
        rows[name] = {"runner": type(make_runner(model, fast)).__name__, "tokens_per_s": args.new_tokens / seconds,
                      "same_tokens_as_merged_fast": bool(torch.equal(tokens, reference))}
    print(json.dumps({"preset": args.preset, "rank": args.rank, "num_steps": args.num_steps,
                      "new_tokens": args.new_tokens, "cases": rows}))
    print(f"{'case':28s} {'runner':12s} {'tok/s':>8s}  same tokens")
    for name, row in rows.items():
        print(f"{name:28s} {row['runner']:12s} {row['tokens_per_s']:8.1f}  {row['same_tokens_as_merged_fast']}")


if __name__ == "__main__":
    main()
