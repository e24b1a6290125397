"""Start-up order of `rdepth train`, `sft` and `rl`: a check that needs no tokenizer, model or tokenized data refuses
a bad run before that work is done (it came after a tokenizer was trained, or a model loaded, or not at all)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
import recurrent_depth.data as data_module
import recurrent_depth.train.init_from as init_from_module
import recurrent_depth.train.rl.recipe as rl_recipe
import recurrent_depth.train.sft as sft_module
from recurrent_depth.cli import main
from recurrent_depth.train.checkpointing import REQUIRED_FILES
from tests.train_support import VOCAB, OneThread, prepare_root

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--seq-len", "32", "--no-progress", "--no-tensorboard"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return prepare_root(tmp_path_factory.mktemp("startup_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def stop_at(monkeypatch, module, name: str) -> list[str]:
    """Replace `module.name` (the expensive step) by one that records the call and ends the run there."""
    calls: list[str] = []

    def reached(*args, **kwargs):
        calls.append(name)
        raise ValueError(f"reached {name}")

    monkeypatch.setattr(module, name, reached)
    return calls


def refusal(capsys, argv: list[str]) -> str:
    """The one-line error of a refused command."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def own_corpus(root: Path, tmp_path: Path) -> Path:
    """A copy of the corpus that a run writing into it (the old behaviour) cannot spoil for the other tests."""
    return Path(shutil.copytree(root / "corpus", tmp_path / "corpus"))


def fake_checkpoint(out: Path) -> None:
    step = out / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (step / name).write_text("{}")


@pytest.mark.parametrize("data_dir", [False, True])
def test_an_out_inside_the_corpus_is_refused_before_a_tokenizer_is_trained(root, tmp_path, monkeypatch, capsys,
                                                                         data_dir):
    """--out inside --data was refused only once the tokenizer was trained (its shards' out/data lay inside too),
    and with --data-dir elsewhere not at all: the run's tokenizer, logs and checkpoints became documents of the
    corpus that every later session (--resume) read."""
    corpus = own_corpus(root, tmp_path)
    trained = stop_at(monkeypatch, data_module, "build_tokenizer")
    extra = ["--data-dir", str(tmp_path / "shards")] if data_dir else []
    line = refusal(capsys, [*TRAIN, "--data", str(corpus), "--out", str(corpus / "run"), *extra])
    assert f"--out {corpus / 'run'} lies inside --data {corpus}" in line
    assert trained == [] and not (corpus / "run").exists()
    # a hidden directory in it is not read: that run goes on to train its tokenizer
    assert refusal(capsys, [*TRAIN, "--data", str(corpus), "--out", str(corpus / ".runs" / "a"), *extra]).endswith(
        "reached build_tokenizer")
    assert trained == ["build_tokenizer"]


def test_a_data_dir_inside_the_corpus_is_refused_before_a_tokenizer_is_trained(root, tmp_path, monkeypatch, capsys):
    corpus = own_corpus(root, tmp_path)
    trained = stop_at(monkeypatch, data_module, "build_tokenizer")
    line = refusal(capsys, [*TRAIN, "--data", str(corpus), "--data-dir", str(corpus / "shards"),
                            "--out", str(tmp_path / "out")])
    assert f"--data-dir {corpus / 'shards'} lies inside --data {corpus}" in line and trained == []
    assert not (tmp_path / "out").exists()


def test_vocab_size_beside_a_given_tokenizer_must_be_its_size(root, tmp_path, monkeypatch, capsys):
    """--tokenizer DIR --vocab-size N silently trained a model of DIR's vocabulary: N sizes a tokenizer trained
    here, and a model from scratch has exactly its tokenizer's vocabulary (no padding past it)."""
    packed = stop_at(monkeypatch, data_module, "prepare_dataset")
    given = [*TRAIN, "--data", str(root / "corpus"), "--tokenizer", str(root / "tokenizer"),
             "--out", str(tmp_path / "out")]
    line = refusal(capsys, [*given, "--vocab-size", str(VOCAB + 64)])
    assert f"TrainConfig.vocab_size={VOCAB + 64} (--vocab-size)" in line
    assert f"whose ids need a vocabulary of {VOCAB} (its largest id + 1)" in line
    assert packed == [] and not (tmp_path / "out").exists()
    assert refusal(capsys, [*given, "--vocab-size", str(VOCAB)]).endswith("reached prepare_dataset")  # (the same)


def test_a_model_vocab_override_that_the_tokenizer_contradicts_is_refused_first(root, tmp_path, monkeypatch, capsys):
    """--model-set vocab_size=M was refused only once the tokenizer was trained and the shards were packed."""
    trained = stop_at(monkeypatch, data_module, "build_tokenizer")
    packed = stop_at(monkeypatch, data_module, "prepare_dataset")
    base = [*TRAIN, "--data", str(root / "corpus"), "--out", str(tmp_path / "out"), "--model-set", "vocab_size=700"]
    line = refusal(capsys, [*base, "--vocab-size", "600"])  # (a tokenizer of 600 would be trained here)
    assert "TrainConfig.model.vocab_size=700 disagrees with the tokenizer's vocabulary (600)" in line
    line = refusal(capsys, [*base, "--tokenizer", str(root / "tokenizer")])
    assert f"TrainConfig.model.vocab_size=700 disagrees with the tokenizer's vocabulary ({VOCAB})" in line
    assert trained == [] and packed == []


def test_train_lora_checks_out_before_the_model_loads(root, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).save_pretrained(
        model_dir, tokenizer=root / "tokenizer")
    fake_checkpoint(tmp_path / "out")
    loaded = stop_at(monkeypatch, init_from_module, "load_for_training")
    line = refusal(capsys, [*TRAIN, "--lora", "--init-from", str(model_dir), "--data", str(root / "corpus"),
                            "--out", str(tmp_path / "out")])
    assert "already holds checkpoints; pass --resume" in line and loaded == []


def test_sft_checks_its_files_and_out_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A missing --val-data was named after the model loaded and --data's examples were tokenized; an --out
    holding checkpoints (no --resume) after that too."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    built = stop_at(monkeypatch, sft_module, "sft_trainer")
    sft = ["sft", "--init-from", str(tmp_path / "model"), "--data", str(data), "--max-steps", "1"]
    line = refusal(capsys, [*sft, "--val-data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "a")])
    assert line.endswith(f"--val-data {str(tmp_path / 'missing.jsonl')!r} does not exist")
    line = refusal(capsys, [*sft, "--val-data", str(tmp_path / "chats.txt"), "--out", str(tmp_path / "a")])
    assert f"--val-data {str(tmp_path / 'chats.txt')!r}" in line  # (not a file: a suffix SFT reads neither)
    fake_checkpoint(tmp_path / "b")
    assert "already holds checkpoints" in refusal(capsys, [*sft, "--out", str(tmp_path / "b")])
    assert built == []
    assert refusal(capsys, [*sft, "--out", str(tmp_path / "c")]).endswith("reached sft_trainer")


def test_rl_checks_out_and_reward_before_the_model_loads(tmp_path, monkeypatch, capsys):
    loaded = stop_at(monkeypatch, rl_recipe, "load_start_model")
    rl = ["rl", "--init-from", str(tmp_path / "model"), "--updates", "1"]
    (tmp_path / "a" / "model").mkdir(parents=True)  # an earlier run's model/, no checkpoint
    assert "holds the model/ of an earlier run" in refusal(capsys, [*rl, "--out", str(tmp_path / "a")])
    line = refusal(capsys, [*rl, "--out", str(tmp_path / "b"), "--reward", "no_such_reward_module_x:score"])
    assert "cannot import module 'no_such_reward_module_x'" in line
    assert loaded == []
    assert refusal(capsys, [*rl, "--out", str(tmp_path / "b")]).endswith("reached load_start_model")
