"""`rdepth eval --lm-eval-include-path DIR`: a user's own lm-eval task folder swept over depth beside the rd_* tasks
(the sweep indexed only the shipped tasks, so such a task was "unknown")."""

from __future__ import annotations

import json
import os
import re

import pytest

from recurrent_depth.cli import main
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

# one choice only: accuracy 1 at every depth, whatever the tiny model's weights
TASK_YAML = """task: mine_mc
custom_dataset: !function mine_utils.dataset
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: ["1"]
doc_to_target: 0
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

TASK_UTILS = """from datasets import Dataset, DatasetDict


def dataset(**_):
    return DatasetDict(test=Dataset.from_list([{"q": "a=1;?a="}, {"q": "b=1;?b="}]))
"""


@pytest.fixture
def indexed(monkeypatch):
    """The include paths each TaskManager gets; lm-eval's own ~15k configs left out (10+ s to index)."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    seen: list[list[str]] = []
    manager = lm_eval.tasks.TaskManager

    class OursOnly(manager):  # type: ignore[misc, valid-type]
        def __init__(self, *args, include_path=None, **kwargs):
            seen.append(list(include_path))
            super().__init__(*args, include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OursOnly)
    return seen


def test_rdepth_eval_sweeps_a_task_from_the_users_include_path(tmp_path, indexed):
    from recurrent_depth.evaluation.tasks import TASKS_DIR

    tasks, empty = tmp_path / "tasks", tmp_path / "empty"
    tasks.mkdir()
    empty.mkdir()
    (tasks / "mine_mc.yaml").write_text(TASK_YAML)
    (tasks / "mine_utils.py").write_text(TASK_UTILS)
    make_model_dir(tmp_path / "model", max_seq_len=64)
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tmp_path / "model"), "--data", "none", "--depths", "1,2",
                 "--lm-eval-tasks", "mine_mc,rd_chains_mc", "--limit", "2", "--out", str(out),
                 "--lm-eval-include-path", f"{empty}{os.pathsep}{tasks}", "--threads", "1"]) == 0
    # `a:b` split into folders, ours after them (as `rdepth lm-eval --include_path` orders them)
    assert indexed == [[str(empty), str(tasks), str(TASKS_DIR)]]
    scores = json.loads((out / "results.json").read_text())["lm_eval"]["0"]
    assert scores["mine_mc/acc"] == {"1": 1.0, "2": 1.0}
    assert set(scores["rd_chains_mc/acc"]) == {"1", "2"}  # the shipped tasks are still there


@pytest.mark.parametrize("case, message", [
    ("missing", r"^rdepth eval: error: lm_eval_include_path \(--lm-eval-include-path\) '.*nowhere' does not exist: "
                r"expected a folder of lm-eval task YAML files$"),
    ("file", r"^rdepth eval: error: lm_eval_include_path \(--lm-eval-include-path\) '.*mine_mc.yaml' is a file, "
             r"not a directory: expected a folder of lm-eval task YAML files$"),
    ("no_tasks", r"^rdepth eval: error: lm_eval_include_path=\[.*\] applies to lm_eval_tasks \(--lm-eval-tasks\), "
                 r"and none is given$"),
])
def test_rdepth_eval_names_a_bad_include_path_in_one_line(tmp_path, capsys, indexed, case, message):
    make_model_dir(tmp_path / "model", max_seq_len=64)
    (tmp_path / "mine_mc.yaml").write_text(TASK_YAML)
    path = {"missing": tmp_path / "nowhere", "file": tmp_path / "mine_mc.yaml", "no_tasks": tmp_path}[case]
    tasks = [] if case == "no_tasks" else ["--lm-eval-tasks", "rd_chains_mc"]
    # the good folder first: every entry is checked, not only the first
    assert main(["eval", "--model", str(tmp_path / "model"), "--data", "none", *tasks, "--out",
                 str(tmp_path / "eval"), "--lm-eval-include-path", str(tmp_path), "--lm-eval-include-path",
                 str(path), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and re.match(message, errors[0]), err
    assert indexed == [] and not (tmp_path / "eval").exists()  # refused before lm-eval indexes anything
