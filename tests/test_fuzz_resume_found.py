"""Regressions found by a differential fuzzer of training resume (random tiny runs over the optimizers, schedules,
depth samplers, accumulation, QK-clip, distillation, SFT and LoRA: N steps straight vs a crash, Ctrl-C or kill -9
at step k then --resume; a changed setting or a damaged newest checkpoint on resume)."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("resume_found_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def save_teacher(train_root, path, seed):
    torch.manual_seed(seed)
    config = rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)
    rd.RecurrentDepthLM(config).save_pretrained(path, tokenizer=train_root / "tokenizer")


def crash_at(step):
    def on_step(trainer, record):
        if record["step"] == step:
            raise StopTraining
    return on_step


def test_a_resume_after_the_teacher_was_retrained_in_place_is_refused(train_root, tmp_path):
    """A distilling run's teacher retrained (or replaced) in place between the stop and --resume was taken as it
    was: the run went on distilling another model's logits, with no word, where a changed --init-from directory is
    refused. Its checkpoints now record the teacher (as the start directory is), and a teacher rewritten with the
    same weights (a copy without its mtimes) still resumes."""
    teacher = tmp_path / "teacher"
    save_teacher(train_root, teacher, seed=11)

    def config(out, **extra):
        return tiny_train_config(train_root, tmp_path / out, max_steps=3, save_every=1, eval_batches=1,
                                 eval_depths=[1], teacher=str(teacher), teacher_depth=1, distill_alpha=0.5, **extra)

    with pytest.raises(StopTraining):
        Trainer(config("run"), on_step=crash_at(1)).run()
    save_teacher(train_root, teacher, seed=11)  # the same weights written again: a new mtime, the same content
    with pytest.raises(StopTraining):
        Trainer(config("run", resume=True), on_step=crash_at(2)).run()
    save_teacher(train_root, teacher, seed=12)  # retrained in place
    listing = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"the teacher .*teacher changed since the run started") as info:
        Trainer(config("run", resume=True))
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == listing == ["step-00000001",
                                                                                               "step-00000002"]
