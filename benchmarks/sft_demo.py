"""The SFT worked example, measured: a tiny model pretrained here, fine-tuned on arithmetic chats.

    python benchmarks/sft_demo.py --out runs/sft-demo                 # pretrain tiny, then SFT
    python benchmarks/sft_demo.py --out runs/sft-demo --base DIR      # SFT a model directory you have

1. without --base, `tiny` is pretrained on the standard library's source (`rdepth train`, --base-steps);
2. --examples arithmetic examples are written to <out>/arithmetic.jsonl, half as chats, half as
   prompt/completion pairs;
3. `rdepth sft` with --max-steps 0 measures the held-out loss of the starting model, then --steps SFT
   steps (same seed: the same held-out examples) measure it after fine-tuning.

Prints one JSON line (held-out loss per depth before and after, the run's seconds), then a table.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

from _args import checked_model_dir, out_dir, positive_int_list


def write_examples(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            if i % 2:
                record = {"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                       {"role": "assistant", "content": f"{a} + {b} = {a + b}"}]}
            else:
                record = {"prompt": f"{a} + {b} =", "completion": f" {a + b}"}
            handle.write(json.dumps(record) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/sft-demo", type=out_dir)
    parser.add_argument("--base", default=None, help="a model directory to fine-tune (default: pretrain tiny here)")
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--depths", default="1,2,4,8", type=positive_int_list)
    args = parser.parse_args()
    args.base = checked_model_dir(parser, args.base, "--base")

    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.sft import sft
    from recurrent_depth.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    depths = args.depths
    quiet = dict(progress=False, tensorboard=False)
    base = args.base
    started = time.perf_counter()
    if base is None:
        base = str(out / "base")
        if not (Path(base) / "model" / "config.json").is_file():
            Trainer(TrainConfig(preset="tiny", data="stdlib", seq_len=128, batch_size=8, max_steps=args.base_steps,
                                out=base, eval_depths=depths, **quiet)).run()
    base_s = time.perf_counter() - started
    for old in ("sft-0", "sft"):  # a fresh SFT each time (the base is kept)
        shutil.rmtree(out / old, ignore_errors=True)
    data = write_examples(out / "arithmetic.jsonl", args.examples)
    common = dict(init_from=base, data=str(data), seq_len=128, batch_size=8, eval_depths=depths, eval_batches=8,
                  val_fraction=0.05, optim=OptimConfig.from_preset("demo", lr=1e-3, warmup_steps=10), **quiet)
    before = sft(TrainConfig(max_steps=0, out=str(out / "sft-0"), **common)).final_eval
    started = time.perf_counter()
    after = sft(TrainConfig(max_steps=args.steps, out=str(out / "sft"), **common))
    result = {
        "base": base, "examples": args.examples, "steps": args.steps, "base_train_s": round(base_s, 1),
        "sft_s": round(time.perf_counter() - started, 1), "heldout_tokens": after.final_eval.tokens,
        "before": {str(d): round(v, 4) for d, v in before.loss.items()},
        "after": {str(d): round(v, 4) for d, v in after.final_eval.loss.items()},
    }
    print(json.dumps(result))
    print(f"{'depth':>5}  {'held-out loss before':>20}  {'after':>8}")
    for d in depths:
        print(f"{d:>5}  {before.loss[d]:>20.4f}  {after.final_eval.loss[d]:>8.4f}")


if __name__ == "__main__":
    main()
