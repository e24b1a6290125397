"""Continued training and resume, as a mature trainer's user expects: what a hunt over stop-and-resume found."""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.test_train_loop import one_thread, train_root  # noqa: F401 - fixtures (one_thread is autouse)
from tests.train_support import tiny_train_config


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_runs_tensorboard_shows_each_step_once(train_root, tmp_path):  # noqa: F811 - the fixture
    """A run crashed after step 5 and resumed from its step-3 checkpoint redoes steps 4 and 5: metrics.jsonl dropped
    the first session's lines for them, but tensorboard kept its points beside the new ones (two curves zigzagging
    over steps 4..5, here with other values: the resume raised --max-steps, which moves the cool-down)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def crash_at_5(trainer, record):
        if record["step"] == 5:
            raise StopTraining

    options = dict(save_every=3, tensorboard=True, eval_interval=2)
    with pytest.raises(StopTraining):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, **options), on_step=crash_at_5,
                log=lambda _: None).run()
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=7, resume=True, **options), log=lambda _: None).run()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/loss")]
    logged = [(m["step"], m["loss"]) for m in lines(tmp_path / "metrics.jsonl")]
    assert [step for step, _ in shown] == list(range(1, 8))
    assert shown == [(step, pytest.approx(loss)) for step, loss in logged]
    assert [e.step for e in events.Scalars("val_loss/depth_4")] == [2, 4, 6, 7]  # (step 2's from the first session)


def test_a_later_run_of_the_same_trainer_continues_the_run_and_logs_it(train_root, tmp_path):  # noqa: F811
    """`Trainer.run()` may be called again (it takes the lock and wraps the model again), say after a `stop_when`
    hook paused it. The second call logged nothing (the first had closed metrics.jsonl and eval.jsonl: its steps
    were trained and checkpointed, but missing from the logs), and one with nothing left to train failed with
    `checkpoint ... already exists; refusing to overwrite it` (it saved the step the first call had saved)."""
    paused = [True]
    trainer = Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, save_every=2),
                      stop_when=lambda t: "paused" if paused[0] and t.state.step >= 2 else None, log=lambda _: None)
    first = trainer.run()
    assert (first.steps, first.stop_reason) == (2, "paused")
    again = trainer.run()  # (still paused: nothing to train, nothing to save again)
    assert (again.steps, again.last_checkpoint) == (2, tmp_path / "checkpoints" / "step-00000002")
    paused[0] = False
    result = trainer.run()
    assert (result.steps, result.stop_reason) == (4, "max_steps")
    metrics = lines(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["loss"] for m in metrics] == result.losses
    assert [(e["step"], e["final"]) for e in lines(tmp_path / "eval.jsonl")] == [(2, True), (4, True)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    written = rd.RecurrentDepthLM.from_pretrained(tmp_path / "model").state_dict()  # (written by the last run())
    assert all(torch.equal(tensor, written[name]) for name, tensor in result.model.state_dict().items())
