"""`rdepth train --init-from DIR`: a vocabulary padded past the tokenizer's, and a run directory without model/."""

import copy
import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.train.objective import LanguageModeling, batch_loss
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.test_init_from import train_flags
from tests.train_support import OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("init_hunt_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


class FirstBatch(LanguageModeling):
    """The language-modeling loss, keeping the first micro-batch, its depth, its s_0 generator state and loss."""

    def __init__(self):
        self.first = None

    def loss(self, model, batch, num_steps, generator):
        state = generator.get_state() if generator is not None else None
        loss, output = super().loss(model, batch, num_steps, generator)
        if self.first is None:
            self.first = (copy.deepcopy(batch), num_steps, state, loss.item())
        return loss, output


def test_a_vocabulary_padded_past_the_tokenizer_with_a_special_id_there_trains_from_dirs_weights(train_root, tmp_path):
    """DIR's vocabulary may be larger than its tokenizer's (`find_tokenizer` allows it), but `rdepth train` built a
    throwaway config from the tokenizer's vocabulary with DIR's token ids and refused the run after packing the
    data: `ModelConfig.pad_token_id=500 is invalid: expected None or a token id in [0, 384)`. It trains now, from
    DIR's weights: the first step's loss is a plain evaluation of DIR on that batch, depth and s_0."""
    source = tmp_path / "padded"
    torch.manual_seed(7)
    config = rd.ModelConfig.from_preset("tiny", vocab_size=512, max_seq_len=64, pad_token_id=500)
    rd.RecurrentDepthLM(config).save_pretrained(source, tokenizer=train_root / "tokenizer")  # (384 tokens)
    objective = FirstBatch()
    cfg = tiny_train_config(train_root, tmp_path / "run", init_from=str(source), tokenizer=None, vocab_size=None,
                            max_steps=1, eval_batches=1, eval_depths=[1])
    Trainer(cfg, objective=objective).run()
    saved = rd.ModelConfig.from_json(tmp_path / "run" / "model" / "config.json")
    assert saved == config and saved.pad_token_id == 500

    batch, num_steps, state, loss = objective.first
    plain = rd.RecurrentDepthLM.from_pretrained(source, dtype=torch.float32).train()
    with torch.no_grad():
        output = plain(batch["input_ids"], num_steps=num_steps, generator=torch.Generator().set_state(state))
    assert num_steps is not None and batch_loss(output, batch).item() == loss


def test_a_run_directory_without_model_names_its_checkpoints(train_root, tmp_path, capsys):
    """A run stopped before its end has checkpoints and no model/: `--init-from` it (or its checkpoints/) said only
    "expected a model directory, a run directory holding model/, ...". It names the newest checkpoint now (a model
    directory itself, which trains on)."""
    source = tmp_path / "source"
    torch.manual_seed(7)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=384, max_seq_len=64)).save_pretrained(
        source, tokenizer=train_root / "tokenizer")

    def stop_at_2(trainer, record):
        if record["step"] == 2:
            raise StopTraining

    cfg = tiny_train_config(train_root, tmp_path / "stopped", init_from=str(source), tokenizer=None, max_steps=4,
                            save_every=2, eval_batches=1, eval_depths=[1])
    with pytest.raises(StopTraining):
        Trainer(cfg, on_step=stop_at_2).run()
    newest = tmp_path / "stopped" / "checkpoints" / "step-00000002"
    assert newest.is_dir() and not (tmp_path / "stopped" / "model").exists()
    for given in (tmp_path / "stopped", tmp_path / "stopped" / "checkpoints"):
        assert main(train_flags(train_root, given, tmp_path / "run", "--max-steps", "1")) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]  # (one line, after the threads note)
        assert error.startswith("rdepth train: error: init_from=") and error.endswith(
            f"it holds checkpoints and no model/ (a run that has not finished): start from a checkpoint, e.g. the "
            f"newest {newest}, or finish that run with --resume")
    assert not (tmp_path / "run").exists()
    assert main(train_flags(train_root, newest, tmp_path / "run", "--max-steps", "0")) == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["init_from"] == str(newest)
