"""A run starting from step 0 in an `out` that holds an earlier session's record (every checkpoint invalid under
--resume, or a run that stopped before its first checkpoint) set its checkpoints aside but emptied metrics.jsonl and
eval.jsonl and replaced run.json and model/: the earlier session's history was lost. It is now moved, whole, to
`out/previous-<k>/`, and one line says where."""

from __future__ import annotations

import json

import pytest

from recurrent_depth.cli import main
from recurrent_depth.train import trainer_checkpoints
from recurrent_depth.train.run_record import set_aside_run_record
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.test_train_loop import one_thread, train_root  # noqa: F401 - fixtures (one_thread is autouse)
from tests.train_support import tiny_train_config


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def record_of(out):
    """The bytes of what a run leaves in `out` besides its checkpoints."""
    files = [out / "run.json", out / "metrics.jsonl", out / "eval.jsonl", *sorted((out / "model").iterdir())]
    return {f.relative_to(out).as_posix(): f.read_bytes() for f in files}


def cli_flags(train_root, out, *extra):  # noqa: F811 - the fixture's value
    return ["train", "--preset", "tiny", "--data", str(train_root / "corpus"), "--tokenizer",
            str(train_root / "tokenizer"), "--data-dir", str(train_root / "data"), "--val-fraction", "0.1",
            "--keep-all", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--eval-depths", "1",
            "--no-tensorboard", "--no-progress", "--threads", "1", "--out", str(out), *extra]


def test_resume_with_every_checkpoint_invalid_keeps_the_earlier_record(train_root, tmp_path, capsys):  # noqa: F811
    """`rdepth train --resume` where every checkpoint is damaged: the checkpoints were set aside, and the run from
    scratch then emptied metrics.jsonl (4 steps -> its own 2), replaced eval.jsonl and run.json, and at its end the
    earlier run's model/."""
    out = tmp_path / "run"
    assert main(cli_flags(train_root, out, "--max-steps", "4", "--save-every", "2")) == 0
    before = record_of(out)
    for step in ("step-00000002", "step-00000004"):
        (out / "checkpoints" / step / "trainer_state.json").write_text("{not json")
    capsys.readouterr()
    assert main(cli_flags(train_root, out, "--max-steps", "2", "--save-every", "2", "--resume")) == 0
    said = capsys.readouterr().out.splitlines()
    assert names(out / "checkpoints") == ["step-00000002", "step-00000002.invalid-1", "step-00000004.invalid-1"]
    assert record_of(out / "previous-1") == before  # (byte for byte, model/ included)
    assert steps(out / "metrics.jsonl") == [1, 2]
    assert json.loads((out / "run.json").read_text())["config"]["max_steps"] == 2
    [line] = [line for line in said if "starting from scratch" in line]
    assert line == (f"no valid checkpoint in {out / 'checkpoints'}: starting from scratch; moved the earlier "
                    f"session's run.json, metrics.jsonl, eval.jsonl, model/ to {out / 'previous-1'} (kept, not "
                    "overwritten)")


def test_a_checkpoint_that_fails_to_load_and_no_older_one_keeps_the_earlier_record(train_root, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    """The other way to run out of checkpoints: one that passes its manifest but does not load (set aside by
    `trainer_checkpoints.resume`)."""
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, save_every=2, eval_batches=1),
            log=lambda _: None).run()
    before = record_of(tmp_path)
    monkeypatch.setattr(trainer_checkpoints, "load_for_resume", lambda trainer, path: (None, "an I/O error"))
    messages: list[str] = []
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, resume=True, eval_batches=1),
            log=messages.append).run()
    assert record_of(tmp_path / "previous-1") == before
    assert steps(tmp_path / "metrics.jsonl") == [1, 2]
    assert [m for m in messages if "starting from scratch" in m] == [
        f"no valid checkpoint in {tmp_path / 'checkpoints'}: starting from scratch; moved the earlier session's "
        f"run.json, metrics.jsonl, eval.jsonl, model/ to {tmp_path / 'previous-1'} (kept, not overwritten)"]


def test_a_run_restarted_after_failing_before_its_first_checkpoint_keeps_each_earlier_record(train_root,  # noqa: F811
                                                                                            tmp_path):
    """Without --resume an `out` holding only logs and run.json (the run failed before its first checkpoint) is
    trained in again, as docs/training.md says: that emptied the failed session's metrics.jsonl. Each restart now
    sets its predecessor's record aside in the next free previous-<k>."""
    def crash_at(step):
        def on_step(trainer, record):
            if record["step"] == step:
                raise StopTraining
        return on_step

    cfg = tiny_train_config(train_root, tmp_path, max_steps=3, save_every=10, eval_batches=1)
    (tmp_path / "previous-1").write_text("a file of the user's: never reused or replaced\n")
    messages: list[str] = []
    for crash in (2, 1):
        with pytest.raises(StopTraining):
            Trainer(cfg, on_step=crash_at(crash), log=messages.append).run()
    assert names(tmp_path) == [".rdepth.lock", "eval.jsonl", "metrics.jsonl", "previous-1", "previous-2", "run.json"]
    assert steps(tmp_path / "previous-2" / "metrics.jsonl") == [1, 2] and steps(tmp_path / "metrics.jsonl") == [1]
    assert (tmp_path / "previous-1").read_text() == "a file of the user's: never reused or replaced\n"
    # (eval.jsonl was empty: no evaluation ran before the crash, so nothing of it needed keeping)
    assert names(tmp_path / "previous-2") == ["metrics.jsonl", "run.json"]
    assert [m for m in messages if "previous" in m] == [
        f"{tmp_path} holds the record of an earlier run and no checkpoint: starting from scratch; moved the earlier "
        f"session's run.json, metrics.jsonl to {tmp_path / 'previous-2'} (kept, not overwritten)"]


def test_resume_into_a_new_directory_says_it_starts_from_scratch_once(train_root, tmp_path):  # noqa: F811
    messages: list[str] = []
    Trainer(tiny_train_config(train_root, tmp_path / "new", max_steps=2, resume=True, eval_batches=1),
            log=messages.append).run()
    assert [m for m in messages if "scratch" in m] == [
        f"no valid checkpoint in {tmp_path / 'new' / 'checkpoints'}: starting from scratch"]
    assert not any(p.name.startswith("previous") for p in (tmp_path / "new").iterdir())


def test_set_aside_run_record_moves_only_what_records_something(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "tensorboard").mkdir()
    assert set_aside_run_record(tmp_path, ("run.json", "metrics.jsonl", "tensorboard")) is None
    (tmp_path / "tensorboard" / "events").write_text("x")
    assert set_aside_run_record(tmp_path, ("run.json", "metrics.jsonl", "tensorboard")) == (
        tmp_path / "previous-1", ["tensorboard"])
    assert names(tmp_path) == ["metrics.jsonl", "previous-1"]
