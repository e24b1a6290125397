"""Retrofitted recurrence on the small Llama pretrained here: validation loss against test-time depth.

    python benchmarks/retrofit_demo.py --out runs/retrofit-demo --plot docs/images/retrofit_depth.png
    python benchmarks/retrofit_demo.py --out runs/retrofit-demo --base runs/loop-demo/model

1. without --base, `rdepth loop pretrain`'s Llama (h 128, 8 layers, stdlib, ~5 CPU minutes) is trained;
2. `rdepth retrofit` makes it a recurrent-depth model (--prelude, --core, --coda; adapter [0 | I]);
3. `rdepth train --init-from` trains that on the paper's recipe (depth curriculum over the first 25 % of
   the steps, Poisson-lognormal depth, backprop through the last k steps, Muon) for --steps steps;
4. the base model is trained further, same data, optimizer and batch, for as many steps as make the
   same training FLOPs (counted by `train/flops.py` from the depths the retrofit run actually drew);
5. every model is scored on the same held-out rows (the stdlib validation split): the base, the base
   looped without training (`recurrent_depth.looping`, the core's window, damped and naive rules, K = r),
   the retrofitted model before and after training, and the base trained further, at each --depths r.

Prints one JSON line, then a table; writes <out>/results.json and, with --plot, a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _args import checked_model_dir, out_dir, out_file, positive_int


@torch.no_grad()
def rows_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int = 16, num_steps: int | None = None) -> float:
    """Mean next-token loss (nats) over [N, T + 1] rows; `num_steps` for our models (s_0 from a fixed seed)."""
    model.eval()
    total, count = 0.0, 0
    generator = torch.Generator().manual_seed(0)
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i : i + batch_size]
        if num_steps is None:
            logits = model(batch[:, :-1]).logits
        else:
            logits = model(batch[:, :-1], num_steps=num_steps, generator=generator).logits
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    return total / count


def base_step_flops(cfg: Any, batch: int, seq_len: int) -> float:
    """Training FLOPs of one step of the plain (non-recurrent) base: forward + 2x backward over every layer."""
    from recurrent_depth.train.flops import attention_flops, block_linear_flops

    per_token = cfg.num_layers * (block_linear_flops(cfg) + attention_flops(cfg, seq_len))
    per_token += 2.0 * cfg.hidden_size * cfg.vocab_size
    return 3.0 * per_token * batch * seq_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/retrofit-demo", type=out_dir)
    parser.add_argument("--base", default=None, help="a transformers Llama directory (default: pretrain one here)")
    parser.add_argument("--prelude", type=int, default=2)
    parser.add_argument("--core", default="3:6")
    parser.add_argument("--coda", type=int, default=2)
    parser.add_argument("--steps", type=int, default=240, help="retrofit training steps")
    parser.add_argument("--mean-recurrence", type=int, default=4)
    parser.add_argument("--backprop-depth", type=int, default=2)
    parser.add_argument("--max-depth", type=int, default=16, help="cap on a sampled training depth")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's lr (embeddings, norms), both runs")
    parser.add_argument("--muon-lr", type=float, default=0.005, help="Muon's lr (matrices), both runs")
    parser.add_argument("--depths", default="1,2,4,8,16")
    parser.add_argument("--val-rows", type=int, default=64, help="held-out rows of 128 tokens")
    parser.add_argument("--plot", default=None, metavar="PNG", type=out_file)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (the figures: 1)")
    args = parser.parse_args()
    args.base = checked_model_dir(parser, args.base, "--base")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from recurrent_depth.config import ModelConfig
    from recurrent_depth.data import load_corpus, prepare_dataset
    from recurrent_depth.families.retrofit import Surgery, parse_core, retrofit, retrofit_to_dir
    from recurrent_depth.looping import LoopConfig, apply_loop, remove_loop
    from recurrent_depth.looping.pretrain import PretrainRecipe, pretrain
    from recurrent_depth.model.recurrent import RecurrentDepthLM
    from recurrent_depth.train.batches import RowBatches
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.flops import training_step_flops
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    depths = [int(d) for d in args.depths.split(",")]
    started, cpu_started = time.perf_counter(), time.process_time()
    timings: dict[str, float] = {}
    recipe = PretrainRecipe()
    base_dir = Path(args.base) if args.base else out / "base" / "model"
    if args.base is None and not (base_dir / "config.json").is_file():
        pretrain(out / "base", recipe)
        timings["pretrain_s"] = round(time.perf_counter() - started, 1)
    seq_len, B = recipe.seq_len, args.batch_size
    # The held-out rows and the training rows: the pretraining's split and packing (cached shards).
    data = prepare_dataset(load_corpus("stdlib"), base_dir, seq_len, out / "data", val_fraction=recipe.val_fraction,
                           seed=recipe.seed, keep_all=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    # (the model's vocabulary: an id outside it is refused as its row is read, naming the shard file and row)
    val = data.dataset("validation", shuffle=False, vocab_size=base.config.vocab_size)
    val_rows = val.next_batch(min(args.val_rows, val.num_rows))
    num_layers = base.config.num_hidden_layers
    a, b = parse_core(args.core)
    Surgery(args.prelude, (a, b), args.coda).check(num_layers)
    results: dict[str, Any] = {"base": {"loss": rows_loss(base, val_rows)}}

    # training-free looping of the base: the retrofit core's window, K = r passes
    for rule in ("damped", "naive"):
        losses = {}
        for r in depths:
            if r > 1:
                apply_loop(base, LoopConfig(start=a, end=b - 1, iterations=r, rule=rule))
            losses[r] = rows_loss(base, val_rows)
            if r > 1:
                remove_loop(base)
        results[f"looped_{rule}"] = {"loss_by_depth": losses}

    # the retrofit, before training (r-invariant with [0 | I]: the pruned base) and after
    retro_dir = out / "retrofitted"
    record = retrofit_to_dir(base_dir, retro_dir, args.prelude, (a, b), args.coda,
                             mean_recurrence=args.mean_recurrence, backprop_depth=args.backprop_depth)
    untrained = RecurrentDepthLM.from_pretrained(retro_dir)
    results["retrofit_init"] = {"loss_by_depth": {r: rows_loss(untrained, val_rows, num_steps=r) for r in depths},
                                "parameters": record["parameters"]}
    optim = OptimConfig.from_preset("demo-muon", lr=args.lr, muon_lr=args.muon_lr, warmup_steps=20,
                                    cooldown_fraction=0.2)
    common = dict(data="stdlib", data_dir=str(out / "data"), keep_all=True, seq_len=seq_len,
                  val_fraction=recipe.val_fraction, seed=recipe.seed, batch_size=B, optim=optim, eval_interval=0,
                  eval_batches=1, save_every=0, progress=False, tensorboard=False)
    t0 = time.perf_counter()
    cfg = TrainConfig(init_from=str(retro_dir), out=str(out / "retrofit-run"), max_steps=args.steps,
                      depth_scheme="poisson-lognormal", depth_curriculum=0.25, backprop_depth=args.backprop_depth,
                      max_depth=args.max_depth, eval_depths=[1, args.mean_recurrence], **common)
    run = Trainer(cfg, log=lambda _: None).run()
    timings["retrofit_train_s"] = round(time.perf_counter() - t0, 1)
    trained = run.model.eval()
    results["retrofit_trained"] = {"loss_by_depth": {r: rows_loss(trained, val_rows, num_steps=r) for r in depths}}
    metrics = [json.loads(line) for line in (out / "retrofit-run" / "metrics.jsonl").read_text().splitlines()]
    draws = [(n - k, k) for m in metrics if "num_steps" in m for n, k in zip(m["num_steps"], m["grad_steps"])]
    model_cfg: ModelConfig = trained.config
    retro_flops = sum(training_step_flops(model_cfg, B, seq_len, d).total for d in draws)

    # the base trained further at the same training FLOPs, same optimizer, data and batch
    full = retrofit(base_dir, prelude=a, core=(a, b), coda=num_layers - b).config  # the base's shape in our terms
    base_flops = base_step_flops(full, B, seq_len)
    base_steps = max(1, round(retro_flops / base_flops))
    further = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    t0 = time.perf_counter()
    base_cfg = TrainConfig(out=str(out / "base-further-run"), max_steps=base_steps,
                           **{k: v for k, v in common.items() if k not in ("data", "data_dir", "keep_all")})
    rows = data.dataset("train", seed=recipe.seed, vocab_size=further.config.vocab_size)
    Trainer(base_cfg, model=further, data=RowBatches(rows), tokenizer_dir=base_dir, log=lambda _: None).run()
    timings["base_further_train_s"] = round(time.perf_counter() - t0, 1)
    results["base_further"] = {"loss": rows_loss(further, val_rows)}

    tokens = len(draws) * B * seq_len
    summary = {
        "base_dir": str(base_dir), "surgery": {"prelude": args.prelude, "core": [a, b], "coda": args.coda},
        "layers": record["layers"], "dropped": record["dropped"],
        "parameters": {"base": sum(p.numel() for p in base.parameters()), "retrofit": record["parameters"]},
        "recipe": {"steps": args.steps, "mean_recurrence": args.mean_recurrence, "backprop_depth": args.backprop_depth,
                   "depth_curriculum": 0.25, "max_depth": args.max_depth, "optimizer": "muon", "lr": args.lr,
                   "muon_lr": args.muon_lr, "batch": [B, seq_len]},
        "training": {"retrofit": {"steps": len(draws), "tokens": tokens, "flops": retro_flops,
                                  "mean_depth": sum(sum(d) for d in draws) / len(draws)},
                     "base_further": {"steps": base_steps, "tokens": base_steps * B * seq_len,
                                      "flops": base_steps * base_flops}},
        "validation_tokens": int(val_rows[:, 1:].numel()), "depths": depths, "results": results,
        "seconds": {**timings, "total_s": round(time.perf_counter() - started, 1),
                    "cpu_s": round(time.process_time() - cpu_started, 1)},
        "threads": torch.get_num_threads(),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    print_table(summary)
    if args.plot:
        plot(summary, Path(args.plot))


def rows_of(summary: dict[str, Any]) -> list[tuple[str, list[float]]]:
    depths, res = summary["depths"], summary["results"]
    flat = {"base": "base (no depth dial)", "base_further": "base trained further (equal FLOPs)"}
    rows = []
    for key, label in (("base", flat["base"]), ("looped_damped", "base looped, damped (training-free)"),
                       ("looped_naive", "base looped, naive (training-free)"),
                       ("retrofit_init", "retrofitted, untrained ([0 | I])"),
                       ("retrofit_trained", "retrofitted, trained"), ("base_further", flat["base_further"])):
        entry = res[key]
        values = [entry["loss"]] * len(depths) if "loss" in entry else [entry["loss_by_depth"][r] for r in depths]
        rows.append((label, values))
    return rows


def print_table(summary: dict[str, Any]) -> None:
    depths = summary["depths"]
    print("\n| model | " + " | ".join(f"r = {r}" for r in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for label, values in rows_of(summary):
        print(f"| {label} | " + " | ".join(f"{v:.4f}" for v in values) + " |")
    t = summary["training"]
    print(f"\ntraining: retrofit {t['retrofit']['steps']} steps, {t['retrofit']['tokens']:,} tokens, "
          f"{t['retrofit']['flops']:.3g} FLOPs (mean depth {t['retrofit']['mean_depth']:.2f}); base further "
          f"{t['base_further']['steps']} steps, {t['base_further']['tokens']:,} tokens, "
          f"{t['base_further']['flops']:.3g} FLOPs")


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = summary["depths"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["k--", "C0-o", "C1-o", "C2:", "C3-o", "C4--"]
    for (label, values), style in zip(rows_of(summary), styles):
        ax.plot(depths, values, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("test-time depth r (core steps; loop passes K for the looped base)")
    ax.set_ylabel("validation loss (nats / token)")
    finite = [v for _, values in rows_of(summary) for v in values if math.isfinite(v)]
    low = min(finite)
    ax.set_ylim(low - 0.05, min(max(finite), low + 1.5) + 0.05)
    t = summary["training"]
    ax.set_title(f"Retrofitted recurrence on the 8-layer demo Llama ({t['retrofit']['tokens'] / 1e6:.2f}M tokens "
                 f"vs {t['base_further']['tokens'] / 1e6:.2f}M at equal FLOPs)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
