"""RL rollout throughput: batched rollouts with adaptive exit (KL) against fixed depth at the same r.

    python benchmarks/rl_rollouts.py                          # seeded `small` model (vocab 288), r = 16
    python benchmarks/rl_rollouts.py --model runs/quickstart-shells/model --num-steps 32
    python benchmarks/rl_rollouts.py --quick                  # smoke test: tiny model, short rollouts

Configurations: fixed depth r, KL exit (the criterion reads the logits, so every checked step
also runs the coda and lm_head) and latent-diff exit (reads the state only), each at max r.
Each configuration makes the same rollout batches (`RolloutSource.next_batch`: P shells prompts x G
rollouts, sampled with top-k, the same seeds) through the generation runtime, and reports:
- `rollout_tokens_per_s`: completion tokens of the batch / seconds of its `generate` call (best of
  --repeats batches, the configurations taking turns; the rollouts differ between batches, the
  configurations see the same prompts);
- `mean_depth`: core steps per completion token (r for fixed depth);
- `replay_s`: one teacher-forced replay of the batch at its recorded depths (`policy_logprobs`,
  no gradient), the training forward's cost without the backward, and `plain_forward_s`: the
  model's plain forward of the same batch at depth r (what the replay costs beside it);
- `x_vs_fixed`: rollout tokens/s over the fixed-depth configuration's.
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from typing import Any

import torch
from _args import checked_model_dir, positive_int, preset_name

import recurrent_depth as rd
from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
from recurrent_depth.evaluation.reasoning.tasks import ShellGame
from recurrent_depth.train.rl import (
    RolloutSettings,
    RolloutSource,
    ShapedReward,
    TaskPrompts,
    TaskReward,
    policy_logprobs,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (tokenizer inside); default: a seeded preset")
    p.add_argument("--preset", default="small", type=preset_name,
                   help="the seeded model's preset without --model (default: small)")
    p.add_argument("--num-steps", type=positive_int, default=16, help="r: fixed depth, and the exit's max steps")
    p.add_argument("--exit-threshold", type=float, default=None, help="KL threshold (default: the criterion's)")
    p.add_argument("--latent-threshold", type=float, default=None,
                   help="latent-diff threshold (default: the criterion's)")
    p.add_argument("--kv-policy", default="per-step+deepest")
    p.add_argument("--prompts-per-step", type=positive_int, default=4)
    p.add_argument("--group-size", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=16)
    p.add_argument("--swaps", type=int, default=8, help="shells difficulty of the prompts")
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--quick", action="store_true", help="tiny model, short rollouts, one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.num_steps, args.max_new_tokens, args.repeats, args.group_size = "tiny", 8, 6, 1, 4
    args.model = checked_model_dir(p, args.model)
    return args


def load(args: argparse.Namespace) -> tuple[rd.RecurrentDepthLM, ProblemEncoder]:
    if args.model is not None:
        from recurrent_depth.data.tokenizer import load_tokenizer

        return rd.RecurrentDepthLM.from_pretrained(args.model), ProblemEncoder(load_tokenizer(args.model))
    torch.manual_seed(0)
    encoder = ProblemEncoder()
    config = dataclasses.replace(rd.ModelConfig.from_preset(args.preset), vocab_size=encoder.tokenizer.get_vocab_size())
    return rd.RecurrentDepthLM(config), encoder


def rollout_source(model: rd.RecurrentDepthLM, encoder: ProblemEncoder, generation: dict[str, Any],
                   args: argparse.Namespace) -> RolloutSource:
    task = ShellGame()
    settings = RolloutSettings(group_size=args.group_size, generation=generation, seed=0)
    reward = ShapedReward(TaskReward(task), max_depth=args.num_steps, max_new_tokens=args.max_new_tokens)
    return RolloutSource(model, TaskPrompts(task, [args.swaps]), reward, settings, encoder=encoder)


def measure_once(model: rd.RecurrentDepthLM, source: RolloutSource, args: argparse.Namespace) -> dict[str, float]:
    """One rollout batch, its replay and the plain forward of the same batch."""
    batch = source.next_batch(args.prompts_per_step)
    mask = batch["completion_mask"]
    record = {"tokens_per_s": int(mask.sum()) / source.last_rollout_s,
              "depth": float(batch["token_depths"][:, -mask.shape[1]:][mask].float().mean())}
    start = time.perf_counter()
    with torch.no_grad():
        policy_logprobs(model, batch, source.settings)
    record["replay_s"] = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        model(batch["input_ids"], args.num_steps, attention_mask=batch["attention_mask"], init_scale=0.0)
    record["plain_s"] = time.perf_counter() - start
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, encoder = load(args)
    common = {"num_steps": args.num_steps, "max_new_tokens": args.max_new_tokens, "do_sample": True, "top_k": 20,
              "kv_policy": args.kv_policy}
    configs = {"fixed r": common,
               "kl exit": {**common, "exit_criterion": "kl", "exit_threshold": args.exit_threshold},
               "latent exit": {**common, "exit_criterion": "latent-diff", "exit_threshold": args.latent_threshold}}
    sources = {name: rollout_source(model, encoder, generation, args) for name, generation in configs.items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for source in sources.values():  # warm-up (first calls), not counted
        measure_once(model, source, args)
    for _ in range(args.repeats):  # the configurations take turns, so a busy spell on the machine hits all
        for name, source in sources.items():
            runs[name].append(measure_once(model, source, args))
    results = {name: {"rollout_tokens_per_s": round(max(r["tokens_per_s"] for r in rs), 1),
                      "mean_depth": round(sum(r["depth"] for r in rs) / len(rs), 2),
                      "replay_s": round(min(r["replay_s"] for r in rs), 4),
                      "plain_forward_s": round(min(r["plain_s"] for r in rs), 4),
                      "rows": args.prompts_per_step * args.group_size} for name, rs in runs.items()}
    fixed = results["fixed r"]["rollout_tokens_per_s"]
    for r in results.values():
        r["x_vs_fixed"] = round(r["rollout_tokens_per_s"] / fixed, 2) if fixed else None
    record = {"benchmark": "rl_rollouts", "model": args.model or f"seeded {args.preset}", "num_steps": args.num_steps,
              "kv_policy": args.kv_policy, "threads": torch.get_num_threads(), "machine": platform.processor() or
              platform.machine(), "results": results}
    print(json.dumps(record))
    print(f"\n{'config':<12} {'rows':>5} {'tokens/s':>10} {'mean depth':>11} {'replay s':>9} {'plain s':>8} "
          f"{'x fixed':>8}")
    for name, r in results.items():
        print(f"{name:<12} {r['rows']:>5} {r['rollout_tokens_per_s']:>10} {r['mean_depth']:>11} {r['replay_s']:>9} "
              f"{r['plain_forward_s']:>8} {r['x_vs_fixed']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
