"""Test-time compute compared on one trained model: more recurrence, GradMem, TTT-E2E, against FLOPs.

    python benchmarks/test_time_compute.py --model runs/quickstart/model
    python benchmarks/test_time_compute.py --model DIR --docs 4 --tokens 256 --plot docs/images/test_time_compute.png

Quality: the held-out next-token loss of the second half of each long standard-library document
(the quickstart's validation files, `evaluation/tasks` `stdlib_dataset`'s split) given its first
half, in nats per token, averaged over documents. Each method spends test-time compute its own way:

- depth r = 1..32: the whole document at r core steps (the first half is the context);
- TTT-E2E (`inference/ttt_e2e.py`): `steps` inner steps on the first half's next-token loss,
  updating the core's MLPs (`--ttt-params`), then the document at the model's r̄ with the updated
  weights;
- GradMem (`inference/gradmem.py`, where this checkout has it): the first half written into m
  memory tokens by `steps` steps, then the second half read after the memory alone (the context
  dropped).

Cost: model FLOPs from the library's counter (`train.flops.training_step_flops`): the evaluation
forward (forward only) plus every inner forward and backward pass (backward = 2x forward, as the
counter counts a training step). "matched depth loss" is the loss of plain recurrence at the same
budget (linear in log FLOPs between the two nearest depths; the deepest depth past its end).
Shells accuracy (`--shells-model`, a model trained on the shells task): greedy answers to shell-game
problems through `rd.generate`, the problem as the context. A measurement: no pass threshold.
Prints one JSON line, then a table; `--plot` writes the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _args import checked_model_dir, out_file, positive_int

import recurrent_depth as rd
from recurrent_depth.data.corpus import DocumentSplit, StdlibCorpus
from recurrent_depth.data.tokenizer import load_tokenizer
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.inference.sampling import RowGenerators
from recurrent_depth.inference.ttt_e2e import adapt
from recurrent_depth.train.flops import training_step_flops

try:  # GradMem lives in its own branch until merged; its rows need it
    from recurrent_depth.inference import gradmem
except ImportError:
    gradmem = None


def documents(tokenizer: Any, count: int, tokens: int, seed: int) -> list[torch.Tensor]:
    """The first `tokens` ids of the first `count` held-out stdlib files that have that many."""
    corpus = StdlibCorpus()
    split = DocumentSplit.plan(corpus.ids(), 0.02, seed=seed)
    docs = []
    for doc in split.select(corpus, "validation"):
        ids = tokenizer.encode(doc.text).ids
        if len(ids) >= tokens:
            docs.append(torch.tensor(ids[:tokens])[None])
        if len(docs) >= count:
            break
    if len(docs) < count:
        raise SystemExit(f"only {len(docs)} held-out stdlib files have {tokens} tokens; lower --tokens or --docs")
    return docs


def forward_flops(cfg: Any, seq_len: int, depth: int) -> float:
    return training_step_flops(cfg, 1, seq_len, (depth, 0)).forward


def second_half_loss(model: Any, ids: torch.Tensor, depth: int, seed: int) -> float:
    """Mean loss of ids[T/2:] given ids[:T/2], one forward at `depth`."""
    half = ids.shape[1] // 2
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(ids, num_steps=depth, generator=generator).logits[0]
    return float(F.cross_entropy(logits[half - 1 : -1], ids[0, half:]))


def depth_rows(model: Any, docs: list[torch.Tensor], depths: list[int], seed: int) -> list[dict]:
    cfg, rows = model.config, []
    for r in depths:
        losses = [second_half_loss(model, d, r, seed) for d in docs]
        rows.append({"method": "depth", "setting": f"r={r}", "depth": r,
                     "flops": forward_flops(cfg, docs[0].shape[1], r), "loss": sum(losses) / len(losses)})
    return rows


def ttt_rows(model: Any, docs: list[torch.Tensor], steps_grid: list[int], args: argparse.Namespace) -> list[dict]:
    cfg, rows = model.config, []
    r = cfg.mean_recurrence
    for steps in steps_grid:
        opts = GenerationOptions(ttt_params=args.ttt_params, ttt_steps=steps, ttt_lr=args.ttt_lr,
                                 ttt_optimizer=args.ttt_optimizer, seed=args.seed).validate(r)
        losses, inner, context = [], 0.0, []
        for d in docs:
            half = d.shape[1] // 2
            adaptation = adapt(model, d[:, :half], opts, final_loss=True)
            losses.append(second_half_loss(adaptation.model, d, r, args.seed))
            inner += adaptation.flops / len(docs)
            context.append(adaptation.losses[-1] - adaptation.losses[0] if adaptation.losses else 0.0)
        rows.append({"method": "ttt-e2e", "setting": f"steps={steps}", "depth": r, "steps": steps,
                     "flops": forward_flops(cfg, docs[0].shape[1], r) + inner, "loss": sum(losses) / len(losses),
                     "context_loss_change": sum(context) / len(context)})
    return rows


def gradmem_rows(model: Any, docs: list[torch.Tensor], grid: list[tuple[int, int]], args: argparse.Namespace,
                 ) -> list[dict]:
    cfg, rows = model.config, []
    r = cfg.mean_recurrence
    for tokens, steps in grid:
        losses, inner = [], 0.0
        for d in docs:
            half = d.shape[1] // 2
            write = gradmem.write_memory(model, d[:, :half], tokens=tokens, steps=steps, lr=args.gradmem_lr,
                                         depth=r, seed=args.seed)
            generators = RowGenerators(args.seed, 1, torch.device("cpu"))
            with torch.no_grad():
                loss = gradmem.memory_loss(model, write.memory, d[:, half:], r, generators=generators)
            losses.append(float(loss[0]))
            inner += (write.flops or 0.0) / len(docs)
        rows.append({"method": "gradmem", "setting": f"m={tokens},steps={steps}", "depth": r, "steps": steps,
                     "tokens": tokens, "flops": forward_flops(cfg, tokens + docs[0].shape[1] // 2, r) + inner,
                     "loss": sum(losses) / len(losses)})
    return rows


def matched_depth_loss(depth: list[dict], flops: float) -> float:
    """Plain recurrence's loss at `flops`: linear in log FLOPs between the nearest depths."""
    points = sorted((row["flops"], row["loss"]) for row in depth)
    if flops <= points[0][0]:
        return points[0][1]
    for (f0, l0), (f1, l1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return l0 + t * (l1 - l0)
    return points[-1][1]


def shells_accuracy(model_dir: str, depths: list[int], steps_grid: list[int], grid: list[tuple[int, int]],
                    args: argparse.Namespace) -> list[dict]:
    """Greedy shell-game accuracy at each depth, each TTT-E2E step count and each GradMem setting
    (the problem is the context; GradMem generates from its memory alone)."""
    from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
    from recurrent_depth.evaluation.reasoning.tasks import get_task

    model = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    encoder = ProblemEncoder(load_tokenizer(model_dir))  # bos + the problem, as the task's training rows
    task, rng = get_task("shells"), random.Random(args.seed)
    problems = [task.sample(rng, args.shells_swaps) for _ in range(args.shells_problems)]
    cfg, rows = model.config, []
    settings = [("depth", f"r={r}", {"num_steps": r}) for r in depths]
    settings += [("ttt-e2e", f"steps={s}", {"ttt_params": args.ttt_params, "ttt_steps": s, "ttt_lr": args.ttt_lr,
                                            "ttt_optimizer": args.ttt_optimizer}) for s in steps_grid]
    if gradmem is not None:
        settings += [("gradmem", f"m={m},steps={s}", {"gradmem_tokens": m, "gradmem_steps": s,
                                                      "gradmem_lr": args.gradmem_lr}) for m, s in grid]
    for method, setting, kwargs in settings:
        right, flops = 0, 0.0
        for problem in problems:
            ids = [encoder.bos, *encoder.encode_text(problem.prompt)]
            out = rd.generate(model, [ids], max_new_tokens=len(encoder.encode_text(problem.answer)),
                              seed=args.seed, eos_token_id=[], **kwargs)
            right += out.token_lists()[0] == encoder.encode_text(problem.answer)
            r = kwargs.get("num_steps", cfg.mean_recurrence)
            read = kwargs["gradmem_tokens"] if method == "gradmem" else len(ids)  # GradMem reads its memory
            inner = out.stats.get("ttt_flops") or out.stats.get("gradmem_flops") or 0.0
            flops += forward_flops(cfg, read, r) + inner
        rows.append({"method": method, "setting": setting, "accuracy": right / len(problems),
                     "flops": flops / len(problems)})
    return rows


def plot(rows: list[dict], shells: list[dict], path: Path) -> None:
    """Loss against FLOPs per method (and, with shells rows, accuracy against FLOPs beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(rows, "loss", "held-out loss of the second half (nats/token)", "stdlib documents: loss")]
    if shells:
        panels.append((shells, "accuracy", "shells accuracy (greedy)", "shell game: accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (data, key, ylabel, title) in zip(axes[0], panels):
        for method, marker in (("depth", "o"), ("ttt-e2e", "s"), ("gradmem", "^")):
            mine = [r for r in data if r["method"] == method]
            if not mine:
                continue
            ax.plot([r["flops"] for r in mine], [r[key] for r in mine], marker=marker, label=method)
            for r in mine:
                ax.annotate(r["setting"], (r["flops"], r[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("test-time model FLOPs per problem (evaluation forward + inner passes)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: recurrence vs GradMem vs TTT-E2E")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a trained model directory (with its tokenizer.json)")
    p.add_argument("--docs", type=int, default=4, help="held-out stdlib documents")
    p.add_argument("--tokens", type=int, default=256, help="tokens per document (context = the first half)")
    p.add_argument("--depths", default="1,2,4,8,16,32")
    p.add_argument("--ttt-steps", default="1,2,4,8")
    p.add_argument("--ttt-params", default="core-mlp")
    p.add_argument("--ttt-lr", type=float, default=1e-3)
    p.add_argument("--ttt-optimizer", default="adam", choices=["sgd", "adam"])
    p.add_argument("--gradmem-grid", default="8:1,8:4,16:4,16:8", help="memory tokens:steps pairs")
    p.add_argument("--gradmem-lr", type=float, default=1.0)
    p.add_argument("--shells-model", default=None, help="a model trained on the shells task (accuracy rows)")
    p.add_argument("--shells-problems", type=int, default=32)
    p.add_argument("--shells-swaps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--plot", default=None, type=out_file,
                   help="write the figure here (e.g. docs/images/test_time_compute.png)")
    args = p.parse_args()
    args.model = checked_model_dir(p, args.model)
    args.shells_model = checked_model_dir(p, args.shells_model, "--shells-model")
    torch.set_num_threads(args.threads)
    started = time.time()
    model = rd.RecurrentDepthLM.from_pretrained(args.model).eval()
    tokenizer = load_tokenizer(args.model)
    docs = documents(tokenizer, args.docs, args.tokens, args.seed)
    depths = [int(x) for x in args.depths.split(",")]
    steps_grid = [int(x) for x in args.ttt_steps.split(",")]
    rows = depth_rows(model, docs, depths, args.seed)
    depth = list(rows)
    rows += ttt_rows(model, docs, steps_grid, args)
    notes = []
    grid = [tuple(int(v) for v in pair.split(":")) for pair in args.gradmem_grid.split(",")]
    if gradmem is not None:
        rows += gradmem_rows(model, docs, grid, args)
    else:
        notes.append("GradMem rows skipped: recurrent_depth.inference.gradmem is not in this checkout "
                     "(branch gradmem not merged)")
    for row in rows:
        row["matched_depth_loss"] = round(matched_depth_loss(depth, row["flops"]), 4)
        row["loss"] = round(row["loss"], 4)
    shells = shells_accuracy(args.shells_model, depths, steps_grid, grid, args) if args.shells_model else []
    if not args.shells_model:
        notes.append("shells accuracy not measured: pass --shells-model (a model trained with rdepth quickstart "
                     "--task shells)")
    report = {"model": str(args.model), "docs": args.docs, "tokens": args.tokens,
              "ttt": {"params": args.ttt_params, "lr": args.ttt_lr, "optimizer": args.ttt_optimizer},
              "gradmem_lr": args.gradmem_lr, "rows": rows, "shells": shells, "notes": notes,
              "seconds": round(time.time() - started, 1)}
    print(json.dumps(report))
    print(f"\n{'method':<9} {'setting':<16} {'GFLOPs':>9} {'loss':>8} {'matched depth loss':>19}")
    for row in rows:
        print(f"{row['method']:<9} {row['setting']:<16} {row['flops'] / 1e9:>9.3f} {row['loss']:>8.4f} "
              f"{row['matched_depth_loss']:>19.4f}")
    for row in shells:
        print(f"shells {row['method']:<9} {row['setting']:<12} {row['flops'] / 1e9:>9.3f} GFLOPs "
              f"accuracy {row['accuracy']:.3f}")
    for note in notes:
        print("note:", note)
    if args.plot:
        plot(rows, shells, Path(args.plot))


if __name__ == "__main__":
    main()
