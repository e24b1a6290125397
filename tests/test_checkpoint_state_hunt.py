"""Checkpoint files are untrusted: a trainer_state.json or optimizer.json of the wrong types (its manifest rewritten to
match, so only the content checks can tell) is set aside like any invalid checkpoint, or refused in one line; it was a
TypeError / KeyError traceback, at the resume or at the first step after it."""

import json
import shutil
import types

import pytest
import torch

from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train import trainer_checkpoints as tc
from recurrent_depth.train.distributed import DistEnv
from recurrent_depth.train.optim import OptimConfig, build_optimizers
from recurrent_depth.train.trainer import LoopState, Trainer
from tests.train_support import prepare_root, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def run_to_4(tmp_path_factory):
    """A 4-step tiny run (checkpoints at steps 2 and 4), copied by each test that damages it."""
    root = prepare_root(tmp_path_factory.mktemp("train_root"))
    out = tmp_path_factory.mktemp("run") / "run"
    Trainer(tiny_train_config(root, out, max_steps=4, save_every=2)).run()
    return root, out


def _edit_json(checkpoint, name, edit):
    data = json.loads((checkpoint / name).read_text())
    edit(data)
    (checkpoint / name).write_text(json.dumps(data))
    (checkpoint / ckpt.MANIFEST).unlink()
    ckpt.write_manifest(checkpoint)  # (a matching manifest: only the content checks can tell)


def _groups(data):
    return [group for opt in data["optimizers"] for group in opt["param_groups"]]


@pytest.mark.parametrize(("name", "edit", "reason"), [
    ("trainer_state.json", lambda s: s.__setitem__("config", [1]), "trainer_state.json: config must be a JSON object"),
    ("trainer_state.json", lambda s: s.__setitem__("world_size", "1"),
     "trainer_state.json: world_size must be an integer >= 1"),
    ("optimizer.json", lambda s: [g.__setitem__("eps", "x") for g in _groups(s)],
     "optimizer.safetensors: optimizer 0: parameter group 'matrices': eps is 'x', expected a number"),
    ("optimizer.json", lambda s: [g.__setitem__("betas", [0.9]) for g in _groups(s)], "betas is [0.9], expected 2"),
    ("optimizer.json", lambda s: [entry.__setitem__("step", "x") for opt in s["optimizers"]
                                  for _, entry in opt["state"]["__items__"]], "step of parameter 0 is 'x'"),
], ids=["config-list", "world-size-string", "eps-string", "betas-short", "step-string"])
def test_a_checkpoint_of_the_wrong_types_is_set_aside_and_resume_falls_back(run_to_4, tmp_path, name, edit, reason):
    root, template = run_to_4
    out = tmp_path / "run"
    shutil.copytree(template, out)
    shutil.rmtree(out / "model")  # (else the resume would find the run finished)
    newest = out / "checkpoints" / "step-00000004"
    _edit_json(newest, name, edit)
    lines = []
    trainer = Trainer(tiny_train_config(root, out, max_steps=4, save_every=2, resume=True), log=lines.append)
    assert trainer.resume_from == out / "checkpoints" / "step-00000002" and trainer.state.step == 2
    skipped = [line for line in lines if line.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and reason in skipped[0], lines
    assert (out / "checkpoints" / "step-00000004.invalid-1").is_dir()
    trainer.close()


@pytest.mark.parametrize("preset", ["demo", "demo-muon", "huginn-0125"])
def test_the_optimizer_states_this_library_writes_pass_the_type_checks(tiny_model, preset):
    """No false alarm: a state saved after a step (every optimizer kind) fits the optimizer that wrote it."""
    torch.manual_seed(0)
    optimizer = build_optimizers(tiny_model, OptimConfig.from_preset(preset))
    tiny_model(torch.randint(0, 64, (1, 8)), num_steps=(0, 1)).logits.float().square().mean().backward()
    optimizer.step()
    meta, tensors = ckpt.flatten_state(optimizer.state_dict())  # as saved and read back
    assert tc.optimizer_state_problem(optimizer, ckpt.unflatten_state(json.loads(json.dumps(meta)), tensors)) is None


class _Rows:
    """A data source whose position this checkpoint's data state is not (a KeyError inside its own load)."""

    def load_state_dict(self, state):
        self.cursor = int(state["cursor"])


def test_a_data_position_the_source_cannot_read_is_one_line_and_changes_nothing(tiny_model, tmp_path):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trainer = types.SimpleNamespace(model=tiny_model, wrapped=tiny_model, optimizer=None, env=DistEnv(),
                                    state=LoopState(), source=_Rows(), tokens_per_step=None, log=lambda message: None)
    zeros = {k: torch.zeros_like(v) for k, v in before.items()}
    state = {"step": 4, "micro_step": 4, "tokens": 512, "skipped_steps": 0, "elapsed_s": 1.0,
             "data": {"epoch": 0, "position": 16}}
    loaded = ckpt.LoadedCheckpoint(tmp_path / "step-00000004", zeros, {}, state, {})
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000004: its data position .* is not one of "
                                         r"this run's data \(KeyError: 'cursor'\)") as caught:
        tc.apply_checkpoint(trainer, loaded)
    assert "\n" not in str(caught.value)
    assert trainer.state.step == 0  # nothing applied: the weights are the model's still
    assert all(torch.equal(v, before[k]) for k, v in tiny_model.state_dict().items())
