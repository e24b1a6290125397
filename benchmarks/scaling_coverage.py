"""Bootstrap coverage of the scaling-law fits: how often the percentile interval holds the true parameter.

For each form, DRAWS synthetic tables are drawn from a known law (recurrent_depth.scaling.synthetic:
sweep-shaped, per-run log-normal noise), each is fitted with RESAMPLES bootstrap resamples over runs,
and we count the draws whose LEVEL interval covers the truth. Prints a JSON line and a table.

    python benchmarks/scaling_coverage.py --draws 100 --resamples 100 --level 0.8
"""

from __future__ import annotations

import argparse
import json
import math
import time

from _args import positive_int

from recurrent_depth.scaling import fit_law, parse_rows, synthetic_rows
from recurrent_depth.scaling.synthetic import DEFAULT_TRUTH

TARGETS = {"kaplan-c": [], "joint": ["alpha", "beta"], "iso-depth": ["alpha", "beta", "phi"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=positive_int, default=100)
    parser.add_argument("--resamples", type=positive_int, default=100)
    parser.add_argument("--level", type=float, default=0.8)
    parser.add_argument("--noise", type=float, default=0.01, help="per-run log-normal noise sd")
    parser.add_argument("--forms", nargs="+", default=["joint", "iso-depth"], choices=list(TARGETS))
    args = parser.parse_args()
    if not 0 < args.level < 1:  # fit_law's ValueError came after the first form's draws
        parser.error(f"--level must be in (0, 1), got {args.level}")
    started = time.time()
    results = {}
    for form in args.forms:
        targets = TARGETS[form]
        covered = dict.fromkeys(targets, 0)
        widths = dict.fromkeys(targets, 0.0)
        for draw in range(args.draws):
            rows = synthetic_rows(noise=args.noise, seed=1000 + draw, token_budgets=(1e6, 4e6, 16e6))
            if form == "joint":  # the joint law's truth: only non-recurrent runs (there N_eff = N)
                rows = [r for r in rows if r["mean_recurrence"] == 1]
            fit = fit_law(parse_rows(rows), form, bootstrap=args.resamples, level=args.level, holdout="none",
                          seed=draw)
            intervals = fit.intervals()
            for name in targets:
                low, high = intervals[name]
                covered[name] += low <= DEFAULT_TRUTH[name] <= high
                widths[name] += (high - low) / args.draws
        n = args.draws
        results[form] = {name: {"coverage": covered[name] / n, "covered": covered[name], "draws": n,
                                "binomial_sd": math.sqrt(args.level * (1 - args.level) / n),
                                "mean_width": widths[name]} for name in targets}
    print(json.dumps({"benchmark": "scaling_coverage", "level": args.level, "resamples": args.resamples,
                      "noise": args.noise, "seconds": round(time.time() - started, 1), "results": results}))
    print(f"{'form':10} {'param':6} {'coverage':>8} {'nominal':>8} {'±1 sd':>6} {'mean width':>10}")
    for form, params in results.items():
        for name, r in params.items():
            print(f"{form:10} {name:6} {r['coverage']:8.2f} {args.level:8.2f} {r['binomial_sd']:6.3f} "
                  f"{r['mean_width']:10.4f}")


if __name__ == "__main__":
    main()
