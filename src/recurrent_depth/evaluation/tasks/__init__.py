"""Offline lm-evaluation-harness tasks shipped with the library (data generated in code, no downloads).

    rdepth lm-eval run --model recurrent-depth --model_args pretrained=DIR --tasks rd_chains_mc
    lm-eval run ... --include_path "$(python -m recurrent_depth.evaluation.tasks)"

`rdepth lm-eval` adds this directory to `--include_path` by itself. Tasks:

- ``rd_chains_mc``: multi-hop variable chains, the answer digit scored among 0-9 (acc);
- ``rd_chains_gen``: the same problems answered by generation (exact match);
- ``rd_addition_gen``: multi-digit addition by generation (exact match);
- ``rd_stdlib_bpb``: bits per byte on Python standard-library source files (rolling log-likelihood).

Difficulty and size are set in each YAML's ``dataset_kwargs`` and can be overridden with lm-eval's
``--metadata '{"hops": [8, 12], "count": 200}'``.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
TASK_NAMES = ("rd_chains_mc", "rd_chains_gen", "rd_addition_gen", "rd_stdlib_bpb")
