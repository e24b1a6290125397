"""Another commit against this checkout, in alternating subprocesses: median speed ratio and its spread.

    python benchmarks/ab_commits.py train --base acaedbb --rounds 5    # training tokens/s, a few short cases
    python benchmarks/ab_commits.py generation --base acaedbb --rounds 5
    python benchmarks/ab_commits.py serving --base acaedbb --rounds 3

The base commit's `src/` and `benchmarks/` are extracted (`git archive`) to a temporary directory; each
round runs both versions once, one after the other, in a fresh process with OMP_NUM_THREADS=1 and one
torch thread, swapping the order every round, so the load of a shared machine falls on both alike.
`train` calls each version's own `benchmarks/train_throughput.py::measure` on the `small` preset (fp32
recurrent, fp32 baseline, bf16 recurrent) with the process CPU-time clock; `generation` runs each
version's `benchmarks/generation.py` with short settings and compares wall and CPU-time tokens/s per mode;
`serving` runs this checkout's `benchmarks/serving.py` (the same client for both) against each version's
library with short settings: wall and server CPU-time tokens/s per depth mode and concurrency, and
`rd.generate` one request at a time.
Prints one JSON line (ratio = this checkout / base), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from _args import positive_int

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CASES = [("small", "fp32", True), ("small", "fp32", False), ("small", "bf16", True)]
GENERATION_ARGS = ["--num-steps", "8", "--prompt-len", "32", "--new-tokens", "32", "--repeats", "3",
                   "--agreement-prompts", "1", "--agreement-tokens", "8", "--no-baselines", "--threads", "1"]
SERVING_ARGS = ["--requests", "16", "--concurrency", "1,8", "--prompt-tokens", "8,32", "--max-tokens", "8,24",
                "--num-steps", "8", "--single-requests", "4"]
# Run in the child: the version's own `measure`, imported from its benchmarks/ directory.
TRAIN_CHILD = """
import importlib.util, json, sys
import torch
torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("tt", sys.argv[1])
tt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tt)
tt.keep_freed_memory()
clock = tt.Clock("cpu")
out = {}
for shape, dtype, recurrent in json.loads(sys.argv[2]):
    row = tt.measure(shape, dtype, recurrent, 1e12, "a@b^T", clock, 120.0, False, bracket=False, min_seconds=2.0)
    out[f"{shape}_{dtype}_{'recurrent' if recurrent else 'baseline'}:tokens_per_s"] = row["tokens_per_s"]
print(json.dumps(out))
"""


def extract(commit: str, into: Path) -> Path:
    archive = into / "base.tar"
    done = subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), commit, "src", "benchmarks"],
                          capture_output=True, text=True)
    if done.returncode != 0:  # an unknown commit: git's own line, not CalledProcessError's traceback
        raise SystemExit(f"ab_commits.py: error: --base {commit}: {done.stderr.strip().splitlines()[-1]}")
    with tarfile.open(archive) as tar:
        tar.extractall(into / "base", filter="data")
    return into / "base"


def run_version(kind: str, root: Path) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root / "src"))
    if kind == "train":
        cmd = [sys.executable, "-c", TRAIN_CHILD, str(root / "benchmarks" / "train_throughput.py"),
               json.dumps(TRAIN_CASES)]
    elif kind == "serving":
        cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), *SERVING_ARGS]
    else:
        cmd = [sys.executable, str(root / "benchmarks" / "generation.py"), *GENERATION_ARGS]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        raise SystemExit(f"{root}: {kind} benchmark failed:\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout.splitlines()[0])
    if kind == "generation":
        data = {f"{mode}:{key}": row[key] for mode, row in data["modes"].items()
                for key in ("tokens_per_s", "cpu_tokens_per_s")}
    if kind == "serving":
        runs = {f"{r['mode']}_c{r['concurrency']}:{key}": r[key] for r in data["runs"]
                for key in ("tokens_per_s", "cpu_tokens_per_s")}
        data = runs | {f"single_{mode}:{key}": row[key] for mode, row in data["single_stream"].items()
                       for key in ("tokens_per_s", "cpu_tokens_per_s")}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["train", "generation", "serving"])
    parser.add_argument("--base", default="main", help="commit to compare against (default: %(default)s)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds (default: %(default)s)")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"base": extract(args.base, Path(tmp)), "this": ROOT}
        for r in range(args.rounds):
            for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
                results[name].append(run_version(args.kind, roots[name]))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary = {}
    for key in results["base"][0]:
        pairs = [(a[key], b[key]) for a, b in zip(results["base"], results["this"]) if a[key] and b[key]]
        ratios = [b / a for a, b in pairs]
        summary[key] = {"base": round(statistics.median(a for a, _ in pairs), 1),
                        "this": round(statistics.median(b for _, b in pairs), 1),
                        "median_ratio": round(statistics.median(ratios), 3),
                        "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3)}
    print(json.dumps({"benchmark": "ab_commits", "kind": args.kind, "base": args.base, "rounds": args.rounds,
                      "summary": summary, "raw": results}))
    print(f"\n{'figure':<40}{'base':>10}{'this':>10}{'ratio':>8}  spread")
    for key, row in summary.items():
        print(f"{key:<40}{row['base']:>10}{row['this']:>10}{row['median_ratio']:>8}  "
              f"[{row['min_ratio']}, {row['max_ratio']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
