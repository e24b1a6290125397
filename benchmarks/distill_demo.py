"""Deep -> shallow distillation: a student at r = 4 taught by the same model at r = 32, against no teacher.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/distill_demo.py --out runs/distill-demo

1. a teacher is trained (tiny preset, stdlib packed with keep_all, Poisson-lognormal depth around
   --teacher-mean), unless --teacher DIR;
2. two students start from the teacher's weights (`init_from`) and train at a fixed depth 4 for the same
   --student-steps on the same batches: one with the teacher at depth --teacher-depth (alpha, T, top-k as
   given), one without (plain cross-entropy);
3. everything is scored on the same validation rows (the trainer's own final evaluation) at depths 4 and 32.

Prints one JSON line, then a table; writes <out>/results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _args import checked_model_dir, out_dir, positive_int

from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.trainer import Trainer


def run(cfg: TrainConfig) -> tuple[dict[int, float], float]:
    start = time.perf_counter()
    result = Trainer(cfg).run()
    return {int(d): float(v) for d, v in result.final_eval.loss.items()}, time.perf_counter() - start


STUDENT_DEPTH = 4


def eval_depths(teacher_depth: int) -> list[int]:
    """The student's depth and the teacher's, once each: --teacher-depth 4 evaluated and printed r = 4 twice."""
    return list(dict.fromkeys([STUDENT_DEPTH, teacher_depth]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/distill-demo", type=out_dir)
    parser.add_argument("--teacher", default=None, help="an existing teacher model directory (skips step 1)")
    parser.add_argument("--teacher-steps", type=positive_int, default=300)
    parser.add_argument("--teacher-mean", type=float, default=8.0)
    parser.add_argument("--student-steps", type=positive_int, default=100)
    parser.add_argument("--teacher-depth", type=positive_int, default=32)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seq-len", type=positive_int, default=64)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=positive_int, default=8)
    args = parser.parse_args()
    args.teacher = checked_model_dir(parser, args.teacher, "--teacher")
    out = Path(args.out)
    depths = eval_depths(args.teacher_depth)
    common: dict[str, Any] = dict(data="stdlib", keep_all=True, seq_len=args.seq_len, batch_size=args.batch_size,
                                  eval_batches=args.eval_batches, eval_depths=depths,
                                  data_dir=str(out / "data"), progress=False, tensorboard=False, seed=0)
    report: dict[str, Any] = {"settings": vars(args)}
    teacher = args.teacher
    if teacher is None:
        cfg = TrainConfig(preset="tiny", out=str(out / "teacher"), max_steps=args.teacher_steps,
                          mean_recurrence=args.teacher_mean,
                          optim=OptimConfig.from_preset("demo", lr=args.lr, warmup_steps=20), **common)
        report["teacher"], report["teacher_seconds"] = run(cfg)
        teacher = str(out / "teacher" / "model")
    student_optim = OptimConfig.from_preset("demo", lr=args.lr / 3, warmup_steps=10)
    student = dict(init_from=teacher, depth_scheme="fixed", mean_recurrence=STUDENT_DEPTH, max_steps=args.student_steps,
                   optim=student_optim, **common)
    report["plain"], report["plain_seconds"] = run(TrainConfig(out=str(out / "plain"), **student))
    report["distilled"], report["distilled_seconds"] = run(TrainConfig(
        out=str(out / "distilled"), teacher=teacher, teacher_depth=args.teacher_depth, distill_alpha=args.alpha,
        distill_temperature=args.temperature, distill_top_k=args.top_k, **student))
    print(json.dumps(report))
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'model':<28}" + "".join(f"{'val loss r=' + str(d):>16}" for d in depths) + f"{'seconds':>10}")
    rows = [(f"teacher (trained r̄={args.teacher_mean:g})", "teacher"), ("student, no teacher", "plain"),
            (f"student, teacher r={args.teacher_depth}", "distilled")]
    for label, key in rows:
        if key not in report:
            continue
        seconds = report.get(f"{key}_seconds", 0.0)
        print(f"{label:<28}" + "".join(f"{report[key][d]:>16.4f}" for d in depths) + f"{seconds:>10.0f}")


if __name__ == "__main__":
    main()
