"""Learning-rate sweep of the three optimizer recipes on a short CPU run; picks the `demo` preset.

The problem: the `small` model's layout (1/2/1 layers, r_bar 8, k 4) at half its width (h 128,
so a sweep fits a shared 2-core machine) on byte-level tokens (vocab 256, no tokenizer to train)
of the embedded stdlib corpus, sequences of 64 bytes, batch 8,
the paper's depth sampler, warmup then a 20% linear cool-down, clipping at 1.0. Each run is scored
by validation loss at depth 8 (the training mean) on fixed held-out batches, so the ranking depends
on the seeds only, not on machine load; seconds per step are reported alongside.

    python benchmarks/optim_sweep.py                 # the default grid (about 15 min on one free core)
    python benchmarks/optim_sweep.py --steps 60 --grid adamw:3e-3 ellis-adam:3e-3 muon:3e-3:0.02

Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from _args import positive_int

import recurrent_depth as rd
from recurrent_depth.data.corpus import load_corpus
from recurrent_depth.train import DepthSampler, OptimConfig, build_optimizers, clip_and_check_grads, set_lr

DEFAULT_GRID = [
    "adamw:1e-3",
    "adamw:3e-3",
    "adamw:1e-2",
    "ellis-adam:1e-3",
    "ellis-adam:3e-3",
    "ellis-adam:1e-2",
    "muon:3e-3:0.01",
    "muon:3e-3:0.02",
    "muon:3e-3:0.05",
]


def load_bytes(limit: int) -> torch.Tensor:
    chunks, size = [], 0
    for doc in load_corpus("stdlib"):
        data = doc.text.encode("utf-8")
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, gen: torch.Generator, size: int, length: int) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - length - 1, (size,), generator=gen)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])  # [B, T + 1]


def run(spec: str, train: torch.Tensor, val: list[torch.Tensor], args: argparse.Namespace) -> dict:
    parts = spec.split(":")
    name, lr = parts[0], float(parts[1])
    overrides = {"muon_lr": float(parts[2])} if len(parts) > 2 else {}
    recipe = OptimConfig(
        name=name,
        lr=lr,
        weight_decay=args.weight_decay,
        warmup_steps=max(1, args.steps // 10),
        cooldown_fraction=0.2,
        **overrides,
    )
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset(
        "small",
        vocab_size=256,
        hidden_size=args.hidden,
        head_dim=args.hidden // 4,
        intermediate_size=int(args.hidden * 2.75),
        max_seq_len=args.seq_len + 1,
    )
    model = rd.RecurrentDepthLM(cfg).train()
    opts = build_optimizers(model, recipe)
    sampler = DepthSampler(cfg.mean_recurrence, cfg.mean_backprop_depth, seed=0)
    data_gen = torch.Generator().manual_seed(1)
    s0_gen = torch.Generator().manual_seed(2)
    skipped = 0
    start = time.perf_counter()
    for step in range(args.steps):
        set_lr(opts, recipe.lr_at(step, args.steps))
        ids = batch(train, data_gen, args.batch, args.seq_len)
        out = model(ids, num_steps=sampler.sample(step), labels=ids, generator=s0_gen)  # shifted inside
        opts.zero_grad()
        out.loss.backward()
        _, finite = clip_and_check_grads(model.parameters(), recipe.grad_clip)
        if finite:
            opts.step()
        else:
            skipped += 1
    seconds = (time.perf_counter() - start) / args.steps
    model.eval()
    losses = []
    with torch.no_grad():
        for i, ids in enumerate(val):
            gen = torch.Generator().manual_seed(100 + i)
            losses.append(model(ids, num_steps=cfg.mean_recurrence, labels=ids, generator=gen).loss.item())
    return {
        "spec": spec,
        "name": name,
        "lr": lr,
        "muon_lr": overrides.get("muon_lr"),
        "val_loss": sum(losses) / len(losses),
        "s_per_step": seconds,
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=150, help="optimizer steps per run (default: 150)")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="bytes per sequence (default: 64)")
    parser.add_argument("--hidden", type=positive_int, default=128, help="hidden size; MLP 2.75x (default: 128)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default: 0.0)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default: 1)")
    parser.add_argument(
        "--grid", nargs="+", default=DEFAULT_GRID, help="name:lr[:muon_lr] entries (default: %(default)s)"
    )
    args = parser.parse_args()
    for spec in args.grid:  # a malformed entry failed only when its turn came, after the runs before it
        parts = spec.split(":")
        try:
            if not 2 <= len(parts) <= 3:
                raise ValueError
            OptimConfig(name=parts[0], lr=float(parts[1]), **({"muon_lr": float(parts[2])} if len(parts) > 2 else {}))
        except ValueError as exc:
            parser.error(f"--grid {spec!r}: expected name:lr[:muon_lr]{f' ({exc})' if str(exc) else ''}")
    torch.set_num_threads(args.threads)
    tokens = load_bytes(4_000_000)
    cut = int(0.95 * len(tokens))
    train, held_out = tokens[:cut], tokens[cut:]
    val_gen = torch.Generator().manual_seed(3)
    val = [batch(held_out, val_gen, 8, args.seq_len) for _ in range(4)]
    results = []
    for spec in args.grid:
        results.append(run(spec, train, val, args))
        print(f"{spec}: val loss {results[-1]['val_loss']:.4f}", file=sys.stderr, flush=True)
    best = min(results, key=lambda r: r["val_loss"])
    best_by_name = {}
    for r in results:
        if r["name"] not in best_by_name or r["val_loss"] < best_by_name[r["name"]]["val_loss"]:
            best_by_name[r["name"]] = r
    print(json.dumps({"benchmark": "optim_sweep", "steps": args.steps, "best": best["spec"], "results": results}))
    print(f"{'recipe':<22} {'val loss @8':>12} {'s/step':>8} {'skipped':>8}")
    for r in results:
        mark = " *" if r is best else (" +" if best_by_name[r["name"]] is r else "")
        print(f"{r['spec']:<22} {r['val_loss']:>12.4f} {r['s_per_step']:>8.3f} {r['skipped']:>8}{mark}")


if __name__ == "__main__":
    main()
