"""The post-training demo (docs/post-training.md): the shells model, then SFT, then RL with KL exit.

    rdepth quickstart --task shells --out runs/quickstart-shells          # the start: trained on <= 16 swaps
    python benchmarks/post_training_demo.py --base runs/quickstart-shells/model --out runs/post-training

1. SFT data: shells problems of 1..20 swaps with their solver's answers, in the task's own
   prompt/completion format (`{"prompt": "2>abdcab=", "completion": "0"}`), plus a held-out file.
2. A short SFT learning-rate sweep (held-out answer loss at depth 16 picks the rate; the official
   example's rates are for 3.5B parameters), then SFT at the chosen rate (`rdepth sft`).
3. A short RL learning-rate sweep (accuracy at 20 swaps with KL exit picks the rate), then RL
   (`rdepth rl`, GRPO, rollouts with KL exit at its default threshold, also in the prompt, since the
   answer is predicted at the prompt's last position; top-k sampling; reward: the answer right, minus a
   compute penalty of 0.1 x depth / 32), on 20-26 swaps, where the SFT model still errs.
4. Each model (before SFT, after SFT, after RL) answers fresh problems at 16 and 20 swaps with KL exit
   at the default threshold (at most 32 steps, exit in the prompt too), greedy, s0 = 0 (the RL
   rollouts' initial state); also at fixed depth 16. Printed as JSON and a table, plotted to `post_training.png`.

Every training step runs through the real CLI (`rdepth sft`, `rdepth rl`) in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from _args import checked_model_dir, out_dir, positive_int

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import load_tokenizer
from recurrent_depth.evaluation.reasoning import ShellGame

MAX_DEPTH = 32


def write_examples(path: Path, count: int, difficulties: range, seed: int) -> None:
    rng, task = random.Random(seed), ShellGame()
    with path.open("w") as f:
        for _ in range(count):
            problem = task.sample(rng, rng.choice(list(difficulties)))
            f.write(json.dumps({"prompt": problem.prompt, "completion": problem.answer}) + "\n")


def rdepth(*args: str) -> None:
    command = [sys.executable, "-m", "recurrent_depth.cli", *args]
    print("$ rdepth " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def final_heldout_loss(run: Path, depth: int) -> float:
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line.strip()]
    return float(records[-1]["val_loss_by_depth"][str(depth)])


@torch.no_grad()
def evaluate(model_dir: Path, swaps: int, count: int, seed: int, exit_criterion: str | None,
             num_steps: int) -> dict[str, float]:
    """Accuracy and mean core steps of the answer token on `count` fresh problems of `swaps` swaps."""
    model = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    bos = model.config.bos_token_id
    rng, task = random.Random(seed), ShellGame()
    problems = [task.sample(rng, swaps) for _ in range(count)]
    ids = torch.tensor([[bos, *tokenizer.encode(p.prompt).ids] for p in problems])  # same length: no padding
    # exit_in_prefill: the answer is predicted at the prompt's last position, so its depth is the prefill's
    out = rd.generate(model, ids, max_new_tokens=1, num_steps=num_steps, exit_criterion=exit_criterion,
                      exit_in_prefill=exit_criterion is not None, init_scale=0.0)
    answers = [tokenizer.decode([int(t)]) for t in out.sequences[:, ids.shape[1]]]
    correct = sum(a.strip() == p.answer for a, p in zip(answers, problems))
    return {"accuracy": correct / count, "mean_steps": float(out.steps[:, 0].float().mean())}


def sft(base: Path, out: Path, data: Path, val: Path, lr: float, steps: int, args: argparse.Namespace) -> Path:
    if not (out / "model").is_dir():
        rdepth("sft", "--init-from", str(base), "--data", str(data), "--val-data", str(val), "--seq-len", "128",
               "--batch-size", str(args.sft_batch), "--max-steps", str(steps), "--optimizer", "adamw", "--lr", str(lr),
               "--eval-depths", "4,16", "--eval-batches", "4", "--eval-interval", str(steps), "--save-every",
               str(steps), "--no-progress", "--no-tensorboard", "--threads", str(args.threads), "--seed", "0",
               "--out", str(out))
    return out


def rl(start: Path, out: Path, lr: float, updates: int, args: argparse.Namespace) -> Path:
    if not (out / "model").is_dir():
        rdepth("rl", "--init-from", str(start), "--out", str(out), "--task", "shells", "--difficulty",
               args.rl_difficulties, "--objective", "grpo", "--group-size", "8", "--prompts-per-step", "4",
               "--updates", str(updates), "--lr", str(lr), "--optimizer", "adamw", "--beta", "0.0",
               "--num-steps", str(MAX_DEPTH), "--exit-criterion", "kl", "--exit-in-prefill", "--do-sample",
               "--top-k", "3",
               "--compute-penalty", str(args.compute_penalty),
               "--max-new-tokens", "2", "--save-every", str(updates), "--threads", str(args.threads))
    return out / "model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="the shells model directory (rdepth quickstart)")
    parser.add_argument("--out", type=lambda text: Path(out_dir(text)), default=Path("runs/post-training"))
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--sft-lrs", default="3e-4,1e-3,3e-3")
    parser.add_argument("--sft-sweep-steps", type=int, default=60)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--sft-batch", type=int, default=16)
    parser.add_argument("--rl-lrs", default="1e-4,3e-4")
    parser.add_argument("--compute-penalty", type=float, default=0.1,
                        help="RL reward: answer correct (1/0) minus this times the answer's depth / 32")
    parser.add_argument("--rl-sweep-updates", type=int, default=15)
    parser.add_argument("--rl-updates", type=int, default=60)
    parser.add_argument("--rl-difficulties", default="20,22,24,26")
    parser.add_argument("--count", type=int, default=300, help="problems per evaluation cell")
    args = parser.parse_args()
    args.base = Path(checked_model_dir(parser, str(args.base), "--base"))
    torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data, val = out / "sft.jsonl", out / "sft-val.jsonl"
    write_examples(data, 6000, range(1, 21), seed=0)
    write_examples(val, 400, range(1, 21), seed=1)

    sft_sweep = {lr: final_heldout_loss(sft(args.base, out / f"sft-sweep-{lr}", data, val, float(lr),
                                            args.sft_sweep_steps, args), 16) for lr in args.sft_lrs.split(",")}
    sft_lr = min(sft_sweep, key=sft_sweep.get)
    sft_model = sft(args.base, out / "sft", data, val, float(sft_lr), args.sft_steps, args) / "model"

    rl_sweep = {}
    for lr in args.rl_lrs.split(","):
        model = rl(sft_model, out / f"rl-sweep-{lr}", float(lr), args.rl_sweep_updates, args)
        score = evaluate(model, 20, args.count // 2, seed=7, exit_criterion="kl", num_steps=MAX_DEPTH)
        rl_sweep[lr] = score["accuracy"]
    rl_lr = max(rl_sweep, key=rl_sweep.get)
    rl_model = rl(sft_model, out / "rl", float(rl_lr), args.rl_updates, args)

    stages = {"before SFT": args.base, "after SFT": sft_model, "after RL": rl_model}
    table = {}
    for stage, model_dir in stages.items():
        row = {}
        for swaps in (16, 20):
            kl = evaluate(model_dir, swaps, args.count, seed=100 + swaps, exit_criterion="kl", num_steps=MAX_DEPTH)
            fixed = evaluate(model_dir, swaps, args.count, seed=100 + swaps, exit_criterion=None, num_steps=16)
            row[f"acc_{swaps}_kl"], row[f"steps_{swaps}_kl"] = kl["accuracy"], kl["mean_steps"]
            row[f"acc_{swaps}_r16"] = fixed["accuracy"]
        table[stage] = row

    result = {"sft_lr_sweep_heldout_loss_r16": sft_sweep, "sft_lr": float(sft_lr),
              "rl_lr_sweep_acc20_kl": rl_sweep, "rl_lr": float(rl_lr), "stages": table,
              "count_per_cell": args.count, "seconds": round(time.perf_counter() - started, 1)}
    (out / "post_training.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(f"\nSFT lr sweep (held-out answer loss, r=16): {sft_sweep} -> {sft_lr}")
    print(f"RL lr sweep (accuracy, 20 swaps, KL exit): {rl_sweep} -> {rl_lr}\n")
    print("| stage | acc 16 (KL exit) | steps 16 | acc 20 (KL exit) | steps 20 | acc 16 (r=16) | acc 20 (r=16) |")
    print("|---|---|---|---|---|---|---|")
    for stage, r in table.items():
        print(f"| {stage} | {r['acc_16_kl']:.3f} | {r['steps_16_kl']:.2f} | {r['acc_20_kl']:.3f} | "
              f"{r['steps_20_kl']:.2f} | {r['acc_16_r16']:.3f} | {r['acc_20_r16']:.3f} |")
    plot(table, out / "post_training.png")
    return 0


def plot(table: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for swaps, marker in ((16, "o"), (20, "s")):
        left.plot(stages, [table[s][f"acc_{swaps}_kl"] for s in stages], marker=marker, label=f"{swaps} swaps")
        right.plot(stages, [table[s][f"steps_{swaps}_kl"] for s in stages], marker=marker, label=f"{swaps} swaps")
    left.set_ylabel("accuracy (KL exit)")
    right.set_ylabel("mean core steps of the answer")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("shells: post-training with SFT, then RL (KL exit at the default threshold)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
