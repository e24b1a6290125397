"""A --resume that finds every checkpoint invalid sets them aside (`step-N.invalid-<k>`), then, much later in its
start-up (after tokenizing, building the model), moves the earlier record, model/ included, to out/previous-<k>.
Stopped in between (Ctrl-C while tokenizing, a kill), it left model/ beside only invalid checkpoints, and every
later run, with or without --resume, was refused with "delete out/model": a dead end left only by hand. --resume now
takes that state (and moves the record as it would have); a run without it is told to pass --resume."""

from __future__ import annotations

import pytest

from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train.trainer import Trainer, check_out_state
from tests.test_resume_s35 import record_of
from tests.test_train_loop import one_thread, train_root  # noqa: F401 - fixtures (one_thread is autouse)
from tests.train_support import tiny_train_config


def test_a_resume_stopped_after_setting_its_checkpoints_aside_is_not_a_dead_end(train_root, tmp_path,  # noqa: F811
                                                                                monkeypatch):
    out = tmp_path / "run"
    cfg = tiny_train_config(train_root, out, max_steps=2, save_every=2, eval_batches=1, eval_depths=[1])
    Trainer(cfg, log=lambda _: None).run()
    before = record_of(out)
    (out / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{not json")

    def ctrl_c(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_setup_shards", ctrl_c)  # (Ctrl-C while tokenizing, after the set-aside)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg.replace(resume=True), log=lambda _: None)
    monkeypatch.undo()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002.invalid-1"]
    assert (out / "model").is_dir()
    with pytest.raises(ValueError, match="only invalid checkpoints in .*; pass --resume to start from scratch there"):
        check_out_state(out, resume=False)
    messages: list[str] = []
    Trainer(cfg.replace(resume=True), log=messages.append).run()
    assert record_of(out / "previous-1") == before  # (byte for byte, model/ included)
    assert f"no valid checkpoint in {out / 'checkpoints'}: starting from scratch; moved the earlier session's " \
           f"run.json, metrics.jsonl, eval.jsonl, model/ to {out / 'previous-1'} (kept, not overwritten)" in messages


def test_which_model_dir_beside_no_valid_checkpoint_resume_takes(tmp_path):
    """Set-aside or incomplete checkpoints beside model/: --resume takes it (starting from scratch); with no
    checkpoint at all (a --max-steps 0 run, checkpoints deleted) model/ is still refused, with or without it."""
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    root = ckpt.checkpoints_root(out)
    root.mkdir()
    (root / ".tmp-step-00000004").mkdir()  # (a checkpoint write that never finished: no checkpoint)
    (root / "notes").mkdir()
    for resume in (False, True):
        with pytest.raises(ValueError, match="no checkpoint to resume from; choose a new --out, or delete"):
            check_out_state(out, resume=resume)
    for name in ("step-00000002.invalid-1", "step-00000004"):  # (the second: missing its files)
        (root / name).mkdir()
        check_out_state(out, resume=True)
        with pytest.raises(ValueError, match="pass --resume to start from scratch"):
            check_out_state(out, resume=False)
        (root / name).rmdir()
