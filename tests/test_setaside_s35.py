"""Hardening of `set_aside_run_record` (a run from step 0 moving an earlier session's record to out/previous-<k>)
and of the logs it leaves: links, a failure or a kill midway, entries that are not regular files."""

from __future__ import annotations

import os
import socket

import pytest

from recurrent_depth.train import run_record
from recurrent_depth.train.run_record import JsonlLog, set_aside_run_record
from recurrent_depth.train.trainer import EARLIER_RUN_NAMES, Trainer, check_out_state
from tests.test_train_loop import one_thread, train_root  # noqa: F401 - fixtures (one_thread is autouse)
from tests.train_support import tiny_train_config


def earlier_record(out):
    """run.json, metrics.jsonl and a model/ that is a relative link to a directory beside `out`."""
    out.mkdir()
    (out / "run.json").write_text('{"config": {}}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out.parent / "shared_model").mkdir()
    (out.parent / "shared_model" / "config.json").write_text("{}\n")
    os.symlink(os.path.join(os.pardir, "shared_model"), out / "model")
    return out


def listing(directory):
    return {p.name: os.readlink(p) if p.is_symlink() else p.read_text() if p.is_file() else "dir"
            for p in directory.iterdir()}


def test_a_relative_link_set_aside_still_points_where_it_did(tmp_path):
    """model/ -> ../shared_model moved as it was into previous-1 resolved to out/shared_model: nothing."""
    out = earlier_record(tmp_path / "run")
    assert set_aside_run_record(out, EARLIER_RUN_NAMES) == (out / "previous-1", ["run.json", "metrics.jsonl", "model"])
    assert os.path.samefile(out / "previous-1" / "model", tmp_path / "shared_model")
    assert sorted(os.listdir(out)) == ["previous-1"]


def test_links_that_resolve_to_nothing_are_set_aside_as_they_are(tmp_path):
    """A dangling or looping model/ or tensorboard/ was left in place (it held nothing readable), and the run then
    failed at its end writing model/, or at once creating tensorboard/."""
    out = tmp_path / "run"
    out.mkdir()
    os.symlink("model", out / "model")
    os.symlink(str(tmp_path / "nowhere"), out / "tensorboard")
    assert set_aside_run_record(out, EARLIER_RUN_NAMES) == (out / "previous-1", ["tensorboard", "model"])
    assert listing(out / "previous-1") == {"model": "model", "tensorboard": str(tmp_path / "nowhere")}


def test_a_move_that_fails_midway_leaves_the_record_whole_where_it_was(tmp_path, monkeypatch):
    """A failed rename (permissions, another device) left part of the record in previous-1 and the rest in `out`,
    while the error told the user to move it all out of `out`."""
    out = earlier_record(tmp_path / "run")
    before = listing(out)
    rename = os.rename

    def failing(source, destination):
        if os.path.basename(source) == "run.json":
            raise PermissionError(13, "Permission denied", str(source))
        rename(source, destination)

    monkeypatch.setattr(run_record.os, "rename", failing)
    with pytest.raises(PermissionError):
        set_aside_run_record(out, EARLIER_RUN_NAMES)
    assert listing(out) == before  # (the re-pointed link back as it was, no previous-1)
    monkeypatch.undo()
    assert set_aside_run_record(out, EARLIER_RUN_NAMES)[0] == out / "previous-1"


def test_a_run_killed_midway_leaves_no_model_for_the_next_run_to_refuse(tmp_path, monkeypatch):
    """model/ moved last: a run killed after its first move left model/ with no valid checkpoint, which the next
    run (--resume too) refused, telling the user to delete it."""
    out = earlier_record(tmp_path / "run")
    calls = []
    make_link = os.symlink

    def killed_after_one(*args):
        calls.append(args)
        if len(calls) > 1:
            raise KeyboardInterrupt
        make_link(*args)

    monkeypatch.setattr(run_record.os, "symlink", killed_after_one)
    monkeypatch.setattr(run_record.os, "rename", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        set_aside_run_record(out, EARLIER_RUN_NAMES)
    monkeypatch.undo()
    check_out_state(out, resume=True)  # (not refused)
    assert set_aside_run_record(out, EARLIER_RUN_NAMES) == (out / "previous-2", ["run.json", "metrics.jsonl"])
    assert sorted(os.listdir(out / "previous-1")) == ["model"]


@pytest.mark.parametrize("kind", ["socket", "directory"])
def test_a_log_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path, kind, monkeypatch):
    """A socket failed with a bare OSError, a directory with IsADirectoryError (a FIFO blocked the run forever)."""
    path = tmp_path / "metrics.jsonl"
    if kind == "socket":
        monkeypatch.chdir(tmp_path)  # (a socket's path is bound in at most 107 bytes)
        server = socket.socket(socket.AF_UNIX)
        server.bind(path.name)
    else:
        path.mkdir()
    try:
        with pytest.raises(ValueError, match="metrics.jsonl is not a regular file"):
            JsonlLog(path)
    finally:
        if kind == "socket":
            server.close()


def test_a_start_model_inside_the_record_is_refused_before_it_moves(train_root, tmp_path):  # noqa: F811
    """`--resume --init-from OUT/model` with every checkpoint invalid: the start model (its tokenizer's source too for
    sft/rl) moved to previous-1, the run's checkpoints and model/ were written without tokenizer files, and its
    run.json named as its start the model/ it then replaced."""
    out = tmp_path / "run"
    Trainer(tiny_train_config(train_root, out, max_steps=2, save_every=2, eval_batches=1, eval_depths=[1]),
            log=lambda _: None).run()
    (out / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{not json")
    cfg = tiny_train_config(train_root, out, max_steps=2, save_every=2, eval_batches=1, eval_depths=[1], resume=True,
                            init_from=str(out / "model"))
    with pytest.raises(ValueError, match=f"--init-from {out / 'model'} lies in {out / 'model'}, of the earlier "
                                         "session's record"):
        Trainer(cfg, log=lambda _: None)
    assert not (out / "previous-1").exists() and (out / "model" / "model.safetensors").is_file()
    (out / "model").rename(tmp_path / "start")  # (as the line says: then the run starts, the rest set aside)
    Trainer(cfg.replace(init_from=str(tmp_path / "start")), log=lambda _: None).close()
    assert sorted(os.listdir(out / "previous-1")) == ["eval.jsonl", "metrics.jsonl", "run.json"]
