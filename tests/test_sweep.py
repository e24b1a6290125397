"""`rdepth sweep`: planning, resuming (between and within runs), Slurm emission and the collected table."""

import csv
import json
import re
from pathlib import Path

import pytest
import yaml

from recurrent_depth.cli import main
from recurrent_depth.scaling import (
    TABLE_COLUMNS,
    collect_sweep,
    emit_sweep,
    load_sweep,
    load_table,
    run_sweep,
    sweep_status,
)
from recurrent_depth.scaling.sweep import DONE_FILE, RUN_CONFIG, data_key, run_dir
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.trainer import Trainer
from tests.train_support import VOCAB, OneThread, write_corpus


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep_root")
    write_corpus(root / "corpus")
    return root


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def write_sweep(path, root=None, **changes):
    base = {"preset": "tiny", "data": "stdlib", "seq_len": 32, "batch_size": 4, "max_steps": 3, "eval_batches": 1,
            "optim": {"lr": 0.003, "warmup_steps": 1}}
    if root is not None:
        base.update(data=str(root / "corpus"), vocab_size=VOCAB, val_fraction=0.1, keep_all=True)
    sweep = {"base": base, "grid": {"hidden_size": [32, 64], "mean_recurrence": [2, 4]},
             "runs": [{"core_layers": 1, "mean_recurrence": 1}, {"core_layers": 2, "mean_recurrence": 1}],
             "test_depths": [1, 2]}
    sweep.update(changes)
    sweep = {k: v for k, v in sweep.items() if v is not None}
    path.write_text(yaml.safe_dump(sweep))
    return path


def test_grid_and_list_expand_to_validated_runs_with_stable_names(tmp_path):
    plan = load_sweep(write_sweep(tmp_path / "s.yaml"))
    names = [r.name for r in plan.runs]
    assert names == ["h32-r2", "h32-r4", "h64-r2", "h64-r4", "c1-r1", "c2-r1"]
    assert names == [r.name for r in load_sweep(write_sweep(tmp_path / "again.yaml")).runs]
    by_name = {r.name: r.config for r in plan.runs}
    assert by_name["h64-r4"]["model"] == {"hidden_size": 64} and by_name["h64-r4"]["mean_recurrence"] == 4
    # a non-recurrent variant: fixed depth 1, one backprop step, real core layers set on the model
    assert by_name["c2-r1"]["depth_scheme"] == "fixed" and by_name["c2-r1"]["backprop_depth"] == 1
    assert by_name["c2-r1"]["model"] == {"core_layers": 2}
    assert all(c["eval_depths"] == [1, 2] for c in by_name.values())
    tokens = load_sweep(write_sweep(tmp_path / "t.yaml", grid={"tokens": [1000], "lr": [0.01]}, runs=None)).runs[0]
    assert tokens.name == "lr0.01-tok1000"
    assert tokens.config["max_tokens"] == 1000 and tokens.config["optim"]["lr"] == 0.01
    assert tokens.config["max_steps"] == 3  # the base's own budget stays
    widths = {"model": [{"hidden_size": 32, "intermediate_size": 88}, {"hidden_size": 64, "intermediate_size": 176}]}
    wide = load_sweep(write_sweep(tmp_path / "w.yaml", grid=widths, runs=None)).runs[1]
    assert wide.name == "h64-intermediate_size=176" and wide.config["model"] == widths["model"][1]


def test_relative_data_paths_of_a_grid_are_made_absolute_like_the_bases(tmp_path, monkeypatch):
    """Only the base's paths were made absolute: a grid's `data: [corpus_a]` reached the emitted (Slurm)
    commands relative to wherever the task started."""
    monkeypatch.chdir(tmp_path)
    for name in ("corpus_a", "corpus_b"):
        write_corpus(tmp_path / name)
    plan = load_sweep(write_sweep(tmp_path / "s.yaml", grid={"data": ["corpus_a", "corpus_b"]}, runs=None))
    assert [r.config["data"] for r in plan.runs] == [str(tmp_path / "corpus_a"), str(tmp_path / "corpus_b")]
    assert [r.name for r in plan.runs] == ["data=corpus_a", "data=corpus_b"]  # names keep what the file says
    monkeypatch.setenv("HOME", str(tmp_path))
    home = load_sweep(write_sweep(tmp_path / "h.yaml", grid={"data": ["~/corpus_a"]}, runs=None)).runs[0]
    assert home.config["data"] == str(tmp_path / "corpus_a")  # not <cwd>/~/corpus_a


def test_the_example_sweep_plans_its_24_runs():
    plan = load_sweep(Path(__file__).parent.parent / "examples" / "sweep_small.yaml")
    flat = [r.config for r in plan.runs if r.config["mean_recurrence"] == 1]
    assert len(plan.runs) == 24 and sorted(c["model"]["core_layers"] for c in flat) == [1, 1, 2, 2, 4, 4]
    assert all(c["depth_scheme"] == "fixed" and c["backprop_depth"] == 1 for c in flat)


@pytest.mark.parametrize(("changes", "message"), [
    ({"gird": {"seed": [0]}}, "unknown key(s) 'gird'"),
    ({"grid": {}, "runs": None}, "grid must be a non-empty mapping"),
    ({"grid": {"seed": []}}, "grid.seed must be a non-empty list"),
    ({"grid": None, "runs": None}, "no runs"),
    ({"grid": {"widht": [1]}}, "unknown key 'widht'"),
    ({"grid": {"hidden_size": [-8]}}, "run 'h-8'"),
    ({"grid": {"mean_recurrence": [0]}}, "mean_recurrence=0 is invalid"),
    ({"test_depths": []}, "test_depths must be a non-empty list"),
    ({"grid": {"seed": list(range(101)), "lr": [0.1] * 100}}, "the grid makes 10100 runs, at most 10000"),
    ({"runs": [{"seed": 0}, {"seed": 0}]}, "two runs have the same settings"),
])
def test_bad_sweep_files_get_one_line_errors(tmp_path, capsys, changes, message):
    path = write_sweep(tmp_path / "bad.yaml", **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_sweep(path)
    assert main(["sweep", "emit", str(path), "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rdepth sweep: error:") and message in err and "\n" not in err


def test_a_run_whose_data_cannot_be_prepared_is_named(train_root, tmp_path, capsys):
    """The shared tokenizer and shards are prepared before any run starts: a run whose data path does not exist
    stopped the sweep with the data's error alone, not saying which of the runs names it."""
    path = write_sweep(tmp_path / "s.yaml", train_root, grid=None,
                       runs=[{"seed": 0}, {"seed": 1, "data": str(tmp_path / "missing")}])
    assert main(["sweep", "emit", str(path), "--out", str(tmp_path / "sw")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.match(r"rdepth sweep: error: run 'data=\S*missing-s1': data: '\S*missing' does not exist", err), err
    assert "\n" not in err


def test_a_finished_run_without_its_metrics_log_keeps_its_tokens_and_flops(tmp_path):
    """A finished run whose metrics.jsonl was removed went into the table as 0 tokens and 0 FLOPs, "finished"."""
    from recurrent_depth.config import ModelConfig
    from recurrent_depth.scaling.sweep import PlannedRun, run_rows

    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(preset="tiny", seq_len=32, batch_size=4, max_steps=4, mean_recurrence=2)
    (out / "run.json").write_text(json.dumps({
        "config": cfg.to_dict(), "model_config": ModelConfig.from_preset("tiny").to_dict(), "seq_len": 32,
        "parameters": 1000, "tokens_per_step": 128, "world_size": 1, "finished": {"step": 4}}))
    (out / "eval.jsonl").write_text(json.dumps({"final": True, "val_loss_by_depth": {"1": 5.0, "2": 4.9}}) + "\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens": 128 * i}) + "\n" for i in (1, 2, 3, 4)))
    run = PlannedRun("r2", {"mean_recurrence": 2}, {})
    logged = run_rows(out, run, [1, 2])
    (out / "metrics.jsonl").unlink()
    unlogged = run_rows(out, run, [1, 2])
    assert [(r["tokens"], r["train_flops"]) for r in unlogged] == [(r["tokens"], r["train_flops"]) for r in logged]
    assert unlogged[0]["tokens"] == 512 and unlogged[0]["train_flops"] > 0


def fake_runner(calls):
    """Stands in for `rdepth train`: writes what a finished run leaves (run.json's finish record, model/)."""

    def run(out, threads):
        calls.append(out.name)
        (out / "model").mkdir(exist_ok=True)
        (out / "model" / "config.json").write_text("{}")
        (out / "run.json").write_text(json.dumps({"finished": {"step": 4}}))
        return 0

    return run


def test_sweep_run_help_says_threads_are_each_runs(capsys):
    """`sweep run --threads` sets each run's threads (default threads_per_run), not this process's torch's."""
    with pytest.raises(SystemExit):
        main(["sweep", "run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads N torch CPU threads of each run (default: the sweep file's threads_per_run, 1)" in text
    assert "default: torch's" not in text


def test_a_killed_sweep_continues_without_redoing_finished_runs(train_root, tmp_path):
    config, sweep_dir = write_sweep(tmp_path / "s.yaml", train_root), tmp_path / "sweep"
    calls = []
    stop_after_two = fake_runner(calls)

    def killed(out, threads):  # the sweep is killed once two runs have finished
        if len(calls) == 2:
            raise KeyboardInterrupt
        return stop_after_two(out, threads)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(config, sweep_dir, jobs=1, runner=killed, log=lambda _: None)
    first = list(calls)
    assert len(first) == 2 and sorted(sweep_status(sweep_dir).values()).count("done") == 2
    stamps = {n: (run_dir(sweep_dir, n) / DONE_FILE).stat().st_mtime_ns for n in first}
    states = run_sweep(config, sweep_dir, jobs=2, runner=fake_runner(calls), log=lambda _: None)
    assert set(states.values()) == {"done"} and len(calls) == 6 and not set(calls[2:]) & set(first)
    assert stamps == {n: (run_dir(sweep_dir, n) / DONE_FILE).stat().st_mtime_ns for n in first}
    run_sweep(config, sweep_dir, runner=fake_runner(calls), log=lambda _: None)
    assert len(calls) == 6  # nothing left to run


def test_a_changed_base_is_refused_for_runs_already_started(train_root, tmp_path, capsys):
    """A new base lr kept the run names, so the finished runs counted as done (their results from the old lr)
    while their train.yaml was rewritten to the new one."""
    config, sweep_dir = write_sweep(tmp_path / "s.yaml", train_root), tmp_path / "sweep"
    calls = []
    run_sweep(config, sweep_dir, jobs=1, runner=fake_runner(calls), log=lambda _: None)
    before = (run_dir(sweep_dir, "h32-r2") / RUN_CONFIG).read_text()
    changed = write_sweep(tmp_path / "changed.yaml", train_root)
    sweep = yaml.safe_load(changed.read_text())
    sweep["base"]["optim"]["lr"] = 0.01
    changed.write_text(yaml.safe_dump(sweep))
    assert main(["sweep", "run", str(changed), "--out", str(sweep_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "changes the settings of 6 run(s) already started" in err and "optim.lr: 0.003 -> 0.01" in err
    assert "\n" not in err and len(calls) == 6
    assert (run_dir(sweep_dir, "h32-r2") / RUN_CONFIG).read_text() == before
    budget = write_sweep(tmp_path / "budget.yaml", train_root)  # what --resume may change still may
    sweep = yaml.safe_load(budget.read_text())
    sweep["base"]["eval_batches"] = 2
    budget.write_text(yaml.safe_dump(sweep))
    run_sweep(budget, sweep_dir, runner=fake_runner(calls), log=lambda _: None)
    assert len(calls) == 6


def test_emit_writes_a_slurm_array_and_one_command_per_run(train_root, tmp_path, capsys):
    config, sweep_dir = write_sweep(tmp_path / "s.yaml", train_root), tmp_path / "sweep"
    assert main(["sweep", "emit", str(config), "--out", str(sweep_dir), "--slurm", "--sbatch=--time=00:30:00"]) == 0
    script = (sweep_dir / "sweep.slurm").read_text()
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --array=0-5\n" in script
    assert "#SBATCH --time=00:30:00\n" in script and "SLURM_ARRAY_TASK_ID" in script
    commands = (sweep_dir / "commands.txt").read_text().splitlines()
    assert len(commands) == 6
    for command, run in zip(commands, load_sweep(config).runs):
        config_path = run_dir(sweep_dir.resolve(), run.name) / RUN_CONFIG
        assert f"recurrent_depth.cli train --config {config_path}" in command
        written = TrainConfig.from_yaml(config_path)  # what the array task trains: out in the sweep, resumable
        assert written.out == str(config_path.parent) and written.resume
        # one tokenizer and one set of shards for all (same data settings), prepared before any task starts
        assert written.data_dir == str(sweep_dir.resolve() / "shared" / data_key(run.config) / "data")
        assert (Path(written.tokenizer) / "tokenizer.json").is_file()
        assert (Path(written.data_dir) / "validation.json").is_file()
    assert len({data_key(r.config) for r in load_sweep(config).runs}) == 1
    written = emit_sweep(config, sweep_dir, nproc=2, slurm=False, log=lambda _: None)
    assert written == [sweep_dir.resolve() / "commands.txt"]
    assert (sweep_dir / "commands.txt").read_text().count("torchrun --standalone --nproc_per_node=2") == 6


def test_real_runs_resume_mid_run_and_are_collected_into_the_table(train_root, tmp_path):
    config = write_sweep(tmp_path / "s.yaml", train_root, grid=None,
                         runs=[{"mean_recurrence": 2, "save_every": 2}, {"core_layers": 1, "mean_recurrence": 1}])
    sweep_dir = tmp_path / "sweep"
    emit_sweep(config, sweep_dir, slurm=False, log=lambda _: None)
    # A run killed mid-way: it left a checkpoint at step 2 of 3 and no done marker.
    partial = run_dir(sweep_dir, "r2-save_every=2")
    Trainer(TrainConfig.from_yaml(partial / RUN_CONFIG).replace(max_steps=2)).run()
    (partial / "run.json").write_text(json.dumps({"not": "finished"}))  # as a kill leaves it: no finish record
    assert sweep_status(sweep_dir) == {"r2-save_every=2": "partial", "c1-r1": "pending"}
    # A run finished outside `sweep run` (a Slurm array task, say) counts as finished: it is not started again.
    Trainer(TrainConfig.from_yaml(run_dir(sweep_dir, "c1-r1") / RUN_CONFIG)).run()
    assert sweep_status(sweep_dir) == {"r2-save_every=2": "partial", "c1-r1": "done"}

    states = run_sweep(config, sweep_dir, jobs=2, log=lambda _: None)  # a real `rdepth train` process
    assert states == {"r2-save_every=2": "done", "c1-r1": "done"}
    assert "resumed from" in (partial / "sweep.log").read_text()
    assert not (run_dir(sweep_dir, "c1-r1") / "sweep.log").exists()
    steps = [json.loads(line)["step"] for line in (partial / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

    rows = collect_sweep(sweep_dir, log=lambda _: None)
    with open(sweep_dir / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == TABLE_COLUMNS and len(table) == len(rows) == 4
    assert json.loads((sweep_dir / "results.json").read_text())["rows"] == rows
    read = load_table(sweep_dir / "results.csv")  # what `rdepth scaling fit` reads: every row
    assert read.skipped == 0 and len(read.rows) == 4
    by = {(r["run"], r["test_depth"]): r for r in rows}
    deep, flat = by[("r2-save_every=2", 2)], by[("c1-r1", 1)]
    assert flat["mean_recurrence"] == 1 and flat["train_depth_mean"] == 1 and flat["core_layers"] == 1
    assert deep["mean_recurrence"] == 2 and deep["tokens"] == 3 * 4 * 32 and deep["status"] == "finished"
    assert deep["flops_per_token_test"] > by[("r2-save_every=2", 1)]["flops_per_token_test"]
    assert 0 < deep["params_non_embedding"] < deep["params"] and deep["train_flops"] > flat["train_flops"] > 0
    assert all(r["loss"] > 0 for r in rows)
    # a test depth the runs were not evaluated at: evaluated now, on their validation rows, and cached
    plan = json.loads((sweep_dir / "sweep.json").read_text())
    (sweep_dir / "sweep.json").write_text(json.dumps({**plan, "test_depths": [1, 2, 3]}))
    again = {(r["run"], r["test_depth"]): r for r in collect_sweep(sweep_dir, log=lambda _: None)}
    assert again[("c1-r1", 2)]["loss"] == by[("c1-r1", 2)]["loss"] and again[("c1-r1", 3)]["loss"] > 0
    assert json.loads((run_dir(sweep_dir, "c1-r1") / "sweep_eval.json").read_text()).keys() >= {"3"}
