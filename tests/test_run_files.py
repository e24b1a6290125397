"""What a training run keeps of the files it starts from: the start directory's retrofit.json and
generation_config.json in its checkpoints and model/, and the tokenizer it trained on across a --resume."""

import json
import shutil

import pytest
import torch

from recurrent_depth.cli import main
from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train.trainer import Trainer
from tests.test_init_from import _swap_two_token_ids, train_flags, write_ours
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("run_files_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def retrofitted(root, tmp_path):
    """A tiny Llama retrofitted into a recurrent model (with retrofit.json), given generation defaults."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recurrent_depth.checkpoint import copy_tokenizer
    from recurrent_depth.families.retrofit import retrofit_to_dir

    torch.manual_seed(0)
    src = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(src)
    copy_tokenizer(root / "tokenizer", src)
    out = tmp_path / "rd"
    retrofit_to_dir(src, out, prelude=1, core=(1, 3), coda=1, mean_recurrence=2, backprop_depth=1)
    (out / "generation_config.json").write_text(json.dumps({"num_steps": 3, "max_new_tokens": 5}) + "\n")
    return out


def test_a_run_from_a_retrofitted_model_keeps_its_provenance_and_generation_defaults(train_root, tmp_path):
    """A run's checkpoints and model/ held the tokenizer only: a model retrofitted, fine-tuned, then exported or
    served lost where it came from (retrofit.json) and its generation defaults (generation_config.json)."""
    from recurrent_depth.generation_config import generation_defaults

    start = retrofitted(train_root, tmp_path)
    run = tmp_path / "run"
    assert main(train_flags(train_root, start, run, "--max-steps", "1", "--save-every", "1", "--threads", "1")) == 0
    for directory in (run / "model", run / "checkpoints" / ckpt.checkpoint_name(1)):
        for name in ("retrofit.json", "generation_config.json"):
            assert (directory / name).read_bytes() == (start / name).read_bytes(), (directory, name)
    assert generation_defaults(str(run / "model"), "auto", "test") == {"num_steps": 3, "max_new_tokens": 5,
                                                                        "eos_token_id": []}  # (the file sets none)
    for model, out in ((start, tmp_path / "exported-start"), (run / "model", tmp_path / "exported-run")):
        assert main(["export", "--model", str(model), "--out", str(out)]) == 0
    for name in ("retrofit.json", "generation_config.json"):
        assert (tmp_path / "exported-run" / name).read_bytes() == (tmp_path / "exported-start" / name).read_bytes()


def test_a_generation_config_no_export_could_carry_is_refused_before_training(train_root, tmp_path, capsys):
    start = retrofitted(train_root, tmp_path)
    (start / "generation_config.json").write_text("[1, 2]\n")
    assert main(train_flags(train_root, start, tmp_path / "run", "--max-steps", "1", "--threads", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rdepth train: error: ")
    assert "generation_config.json is not a JSON object: fix or remove it before training" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "dangling"])
def test_a_retrofit_record_that_is_no_regular_file_is_refused_before_training(train_root, tmp_path, capsys,
                                                                               special):
    """As generation_config.json is: such a retrofit.json was left out without a word, and the run's checkpoints
    and model/ lost the record of their source."""
    import os

    start = retrofitted(train_root, tmp_path)
    (start / "retrofit.json").unlink()
    if special == "fifo":
        os.mkfifo(start / "retrofit.json")
    else:
        (start / "retrofit.json").symlink_to("/dev/zero" if special == "dev-zero" else tmp_path / "gone.json")
    assert main(train_flags(train_root, start, tmp_path / "run", "--max-steps", "1", "--threads", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rdepth train: error: ")
    assert "retrofit.json is not a regular file: replace or remove it before training" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_tokenizer_replaced_before_the_first_checkpoint_is_refused_on_resume(train_root, tmp_path):
    """Resume compared the start directory's tokenizer with the checkpoint's copy only: replaced after the run
    started but before its first checkpoint, the copy was the replacement, and the resume trained on other ids.
    The start record holds the digests of the run's tokenizer files as it started."""
    source = tmp_path / "source"
    write_ours(source, train_root)
    options = dict(init_from=str(source), tokenizer=None, max_steps=2, save_every=2, eval_batches=1)

    def replace_tokenizer(trainer, record):
        if record["step"] == 1:
            _swap_two_token_ids(source / "tokenizer.json")

    Trainer(tiny_train_config(train_root, tmp_path / "run", **options), on_step=replace_tokenizer).run()
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 3}, resume=True)
    with pytest.raises(ValueError, match=rf"^cannot resume from \S+step-00000002: the tokenizer in {source} changed "
                                         r"since the run started \(tokenizer.json differs from the one the run "
                                         r"started with\), so the run would train on other token ids; put back"):
        Trainer(resumed)


def test_a_start_record_of_older_code_without_tokenizer_digests_resumes(train_root, tmp_path):
    source = tmp_path / "source"
    write_ours(source, train_root)
    options = dict(init_from=str(source), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    checkpoint = tmp_path / "run" / "checkpoints" / ckpt.checkpoint_name(1)
    state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
    assert set(state["start"]["tokenizer"]) == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    del state["start"]["tokenizer"]
    (checkpoint / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    ckpt.write_manifest(checkpoint)  # (sealed again, as older code wrote it)
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    assert Trainer(again).run().steps == 2


@pytest.mark.parametrize("recorded", [{"tokenizer.json": 5}, ["a"]])
def test_malformed_tokenizer_digests_in_a_start_record_are_a_damaged_checkpoint(tmp_path, recorded):
    from recurrent_depth.train.trainer_checkpoints import check_same_start

    start = {"directory": str(tmp_path / "model"), "identity": "a" * 64, "content": "b" * 64, "tokenizer": {}}
    with pytest.raises(ValueError, match=r"records start=.*tokenizer: file digests\); the checkpoint is damaged$"):
        check_same_start(tmp_path / "checkpoint", {**start, "tokenizer": recorded}, start)


def own_tokenizer_run(root, out, **overrides):
    """A run from scratch that trains its own tokenizer into out/tokenizer."""
    values = dict(tokenizer=None, vocab_size=300, max_steps=1, eval_batches=1, data_dir=None)
    return tiny_train_config(root, out, **{**values, **overrides})


def test_a_resume_whose_own_tokenizer_was_deleted_takes_the_checkpoints_copy(train_root, tmp_path, monkeypatch):
    """out/tokenizer deleted before --resume: the tokenizer was trained again (another tokenizers version, another
    machine could give other ids, and a large corpus takes long); now the checkpoint's copy is put back."""
    import recurrent_depth.data as data

    run = tmp_path / "run"
    Trainer(own_tokenizer_run(train_root, run)).run()
    before = {p.name: p.read_bytes() for p in (run / "tokenizer").iterdir()}
    shutil.rmtree(run / "tokenizer")

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(data, "build_tokenizer", no_training)
    said = []
    assert Trainer(own_tokenizer_run(train_root, run, max_steps=2, resume=True), log=said.append).run().steps == 2
    assert {p.name: p.read_bytes() for p in (run / "tokenizer").iterdir()} == before
    assert any("restored the run's tokenizer" in line for line in said)


def test_a_resume_whose_own_tokenizer_was_replaced_is_refused_in_one_line(train_root, tmp_path):
    """Replaced, it was taken as the run's: the token shards were packed again with it (over the run's cache), and
    the resume then failed on the data position, naming the data rather than the tokenizer."""
    run = tmp_path / "run"
    Trainer(own_tokenizer_run(train_root, run)).run()
    _swap_two_token_ids(run / "tokenizer" / "tokenizer.json")
    with pytest.raises(ValueError, match=rf"^cannot resume from \S+step-00000001: the tokenizer in {run / 'tokenizer'} "
                                         r"changed since the run started \(tokenizer.json differs from the one "
                                         r"the run started with\)"):
        Trainer(own_tokenizer_run(train_root, run, max_steps=2, resume=True))
