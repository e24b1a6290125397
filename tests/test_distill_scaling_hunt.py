"""Bugs found using distillation, sweeps and scaling fits as a user would: each test failed before its fix."""

import csv
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from recurrent_depth.scaling import law_form, load_sweep, load_table, parse_rows
from recurrent_depth.scaling.fit import holdout_error
from recurrent_depth.train import distill
from recurrent_depth.train.distill import Distillation, Teacher


class DeviceRecorder(nn.Module):
    """A teacher whose one parameter sits on the meta device; records where its inputs arrive."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, device="meta"))
        self.seen = {}

    def forward(self, input_ids, num_steps, generator, **inputs):
        self.seen = {"input_ids": input_ids.device, "generator": generator,
                     **{k: v.device for k, v in inputs.items()}}
        return SimpleNamespace(logits=input_ids)


def test_the_teacher_gets_its_rows_on_its_own_device(monkeypatch):
    """The cache writer hands the teacher CPU rows from the shards: with the teacher on a GPU its first forward
    failed (embedding weights on cuda, ids on cpu), and its generator was drawn on the CPU."""
    monkeypatch.setattr(distill, "teacher_generator", lambda seed, position, device: ("generator", device))
    model = DeviceRecorder()
    objective = Distillation(Teacher(model, 4, None, 8, None), alpha=0.5, temperature=1.0, top_k=2, seed=0,
                             position=lambda: 0)
    objective.teacher_logits(torch.zeros(2, 3, dtype=torch.long), 0, position_ids=torch.zeros(2, 3))
    meta = torch.device("meta")
    assert model.seen == {"input_ids": meta, "generator": ("generator", meta), "position_ids": meta}


def test_relative_teacher_and_cache_paths_of_a_sweep_are_made_absolute(tmp_path, monkeypatch):
    """`teacher` and `distill_cache` stayed relative: an emitted (Slurm) command started elsewhere found no
    teacher, or wrote its own cache where it started."""
    monkeypatch.chdir(tmp_path)
    base = {"preset": "tiny", "data": "stdlib", "seq_len": 32, "batch_size": 4, "max_steps": 3,
            "teacher": "runs/teacher", "distill_top_k": 4, "distill_cache": "cache"}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": base, "grid": {"mean_recurrence": [2, 4]}, "test_depths": [1]}))
    config = load_sweep(path).runs[0].config
    assert config["teacher"] == str(tmp_path / "runs" / "teacher")
    assert config["distill_cache"] == str(tmp_path / "cache")


def joint_rows(count=10):
    """A hand-written table of the joint law: N and D but no train_flops and no params column; the runs'
    names sort in the opposite order to their compute."""
    form = law_form("joint")
    truth = np.array([math.log(1.7), math.log(400.0), 0.34, math.log(120.0), 0.28])
    rows = []
    for i in range(count):
        n, d = 1e5 * 2 ** (i % 5), 1e6 * 3 ** (i // 5) * 1.3 ** (i % 5)
        loss = float(form.predict(truth, {"params_non_embedding": np.array([n]), "tokens": np.array([d])})[0])
        rows.append({"run": f"run{count - i:02d}", "test_depth": 1, "mean_recurrence": 1, "loss": loss,
                     "status": "finished", "params_non_embedding": n, "tokens": d})
    return rows


def test_the_held_out_runs_are_the_largest_in_a_table_without_flops():
    """Without `train_flops` or `params` every run's compute was 0, so `--holdout largest` held out the runs
    whose names sort last (here the smallest) and reported their error as extrapolation."""
    rows = joint_rows()
    rows[-1]["loss"] *= 1.5  # the largest run is off the law: held out, its error shows
    table = parse_rows(rows)
    result = holdout_error(law_form("joint"), table.rows, "largest")
    assert result["held_out_runs"] == 2 and result["log_rmse"] > 0.2, result


def write_csv(path, rows, prefix="", header=None):
    columns = list(rows[0])
    with open(path, "w", newline="", encoding="utf-8") as handle:
        handle.write(prefix + ", ".join(header or columns) + "\n")
        csv.DictWriter(handle, columns).writerows(rows)
    return path


def test_a_spreadsheet_csv_with_a_byte_order_mark_and_spaced_header_loads(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark and hand-written headers have spaces after commas:
    both were "has no column 'run'"."""
    rows = joint_rows(4)
    table = load_table(write_csv(tmp_path / "excel.csv", rows, prefix="\ufeff"))
    assert [r["run"] for r in table.rows] == [r["run"] for r in rows]
    assert table.rows[0]["loss"] == pytest.approx(rows[0]["loss"])
    with pytest.raises(ValueError, match=r"has no column 'run' \(its columns: 'name', "):
        load_table(write_csv(tmp_path / "named.csv", rows, header=["name", *list(rows[0])[1:]]))


@pytest.mark.parametrize(("column", "value", "message"), [
    ("core_layers", 0, "'core_layers' is 0; it must be a finite positive number"),
    ("test_depth", 0, "'test_depth' is 0; it must be a finite positive number"),
    ("prelude_layers", -1, "'prelude_layers' is -1; it must be a finite non-negative number"),
])
def test_a_layer_count_or_depth_that_no_model_has_is_a_one_line_error(column, value, message):
    """core_layers 0 made every N_eff 0 (phi unidentifiable: the fit returned its starting value), a negative
    prelude or a test depth 0 fitted silently."""
    rows = [{**r, "prelude_layers": 0, "core_layers": 2, "coda_layers": 1} for r in joint_rows(4)]
    parse_rows(rows)  # (no prelude is a model)
    rows[2][column] = value
    with pytest.raises(ValueError, match=f"row 3: column {message}"):
        parse_rows(rows)


def test_a_second_row_of_a_run_at_one_depth_is_a_one_line_error():
    """A table pasted in twice or a copied row: the fit kept whichever row came first, silently."""
    rows = joint_rows(4)
    with pytest.raises(ValueError, match=r"row 5: run 'run04' already has a row at test_depth 1 \(row 1\)"):
        parse_rows([*rows, {**rows[0], "loss": 9.0}])


@pytest.mark.parametrize("budget", ["-5", "inf"])
def test_a_bad_budget_is_refused_before_any_fit(tmp_path, capsys, budget):
    """`--budget -5` was refused only after every form (and its bootstrap) had been fitted; `inf` gave N = inf."""
    from recurrent_depth.cli import main

    table = write_csv(tmp_path / "t.csv", joint_rows(4))
    assert main(["scaling", "fit", str(table), "--budget", budget, "--out", str(tmp_path / "fits")]) == 2
    err = capsys.readouterr().err
    assert "budget must be a finite positive number of FLOPs" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "fits").exists()
