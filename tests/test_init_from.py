"""`rdepth train --init-from DIR`: DIR's config, weights and tokenizer, a fresh optimizer; only depth may change."""

import json

import pytest
import torch
from safetensors import safe_open

import recurrent_depth as rd
from recurrent_depth.checkpoint import copy_tokenizer, weight_files
from recurrent_depth.cli import main
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.test_checkpoint import write_official_layout
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("init_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def tiny_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64))


def write_ours(path, root):
    tiny_model().save_pretrained(path, tokenizer=root / "tokenizer")


def write_official(path, root):
    """The official layout (Huginn config keys, bf16 shards + index, lm_head stored, freqs_cis) + tokenizer."""
    write_official_layout(tiny_model(), path, dtype=torch.bfloat16)
    copy_tokenizer(root / "tokenizer", path)


def stored_tensors(directory):
    tensors = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def train_flags(root, init_from, out, *extra):
    return ["train", "--init-from", str(init_from), "--data", str(root / "corpus"), "--data-dir", str(root / "data"),
            "--val-fraction", "0.1", "--keep-all", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
            "--eval-depths", "1", "--no-tensorboard", "--no-progress", "--out", str(out), *extra]


@pytest.mark.parametrize("write", [write_ours, write_official], ids=["ours", "official"])
def test_zero_steps_save_dirs_tensors_bit_for_bit_in_its_dtype_and_its_config(train_root, tmp_path, write):
    source = tmp_path / "source"
    write(source, train_root)
    assert main(train_flags(train_root, source, tmp_path / "run", "--max-steps", "0")) == 0
    saved, original = stored_tensors(tmp_path / "run" / "model"), stored_tensors(source)
    original.pop("freqs_cis", None)  # the official RoPE buffer: not a weight (we compute our own)
    if "lm_head.weight" in original and "lm_head.weight" not in saved:  # tied: stored once, as the embedding
        assert torch.equal(original.pop("lm_head.weight"), original["transformer.wte.weight"])
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    config = rd.ModelConfig.from_json(tmp_path / "run" / "model" / "config.json")
    assert config == rd.ModelConfig.from_json(source / "config.json")
    assert (tmp_path / "run" / "model" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["init_from"] == str(source) and run["model_config"]["hidden_size"] == 64


def test_a_run_directory_trains_on_and_resumes_exactly(train_root, tmp_path):
    """A run directory is found through its model/; a crash then --resume repeats the uninterrupted losses."""
    write_ours(tmp_path / "first" / "model", train_root)
    options = dict(init_from=str(tmp_path / "first"), tokenizer=None, max_steps=4, save_every=2,
                   model={"mean_recurrence": 3})
    straight = Trainer(tiny_train_config(train_root, tmp_path / "a", **options)).run()
    assert straight.model.config.mean_recurrence == 3 and straight.model.dtype == torch.float32

    def crash_at_3(trainer, record):
        if record["step"] == 3:
            raise StopTraining

    with pytest.raises(StopTraining):
        Trainer(tiny_train_config(train_root, tmp_path / "b", **options), on_step=crash_at_3).run()
    resumed = Trainer(tiny_train_config(train_root, tmp_path / "b", resume=True, **options)).run()
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == straight.losses
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


def test_a_resume_may_name_another_preset_which_a_model_directory_ignores(train_root, tmp_path):
    """`--preset` is ignored with --init-from (docs/post-training.md), yet a resume naming another one was refused
    as a changed configuration; another seed still is."""
    write_ours(tmp_path / "source", train_root)
    options = dict(init_from=str(tmp_path / "source"), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True,
                                preset="small")
    with pytest.raises(ValueError, match=r"the configuration changed \(seed: 0 -> 1\)"):
        Trainer(resumed.replace(seed=1))
    assert Trainer(resumed).run().steps == 2


def test_a_resume_from_a_model_directory_changed_since_the_run_started_is_refused(train_root, tmp_path):
    """--resume compared --init-from by its path only: the same directory retrained (or replaced by another model
    of the same config) since the run started was taken as the same start. Its identity (`model_identity`) is in
    each checkpoint and run.json now, and a change is refused in one line naming the directory. The same weights
    written again (a copy without its mtimes) still resume."""
    import os
    import shutil

    from recurrent_depth.checkpoint import TRAINING_TOKENIZER_FILES, file_digests, model_content_sample, model_identity

    source = tmp_path / "source"
    write_ours(source, train_root)
    options = dict(init_from=str(source), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    start = {"directory": str(source.resolve()), "identity": model_identity(source),
             "content": model_content_sample(source), "tokenizer": file_digests(source, TRAINING_TOKENIZER_FILES),
             "files": {}}  # (source holds no retrofit.json or generation_config.json)
    assert state["start"] == start and json.loads((tmp_path / "run" / "run.json").read_text())["start"] == start
    shutil.copyfile(source / "model.safetensors", tmp_path / "copy")  # the same bytes, a new mtime
    os.replace(tmp_path / "copy", source / "model.safetensors")
    os.utime(source / "model.safetensors", ns=(2, 2))
    assert model_identity(source) != start["identity"]
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    assert Trainer(again).run().steps == 2
    torch.manual_seed(8)  # "retrained" in place: other weights, the same config and directory
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        source, tokenizer=train_root / "tokenizer")
    os.utime(source / "model.safetensors", ns=(1, 1))  # (a new mtime even on a coarse-grained clock)
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 3}, resume=True)
    with pytest.raises(ValueError, match=rf"^cannot resume from \S+step-00000002: {source.resolve()} changed since "
                                         r"the run started from it \(the model directories' config.json or weights "
                                         r"differ\); resume with the model the run started from$"):
        Trainer(resumed)


def _swap_two_token_ids(tokenizer_json):
    """The same tokenizer file with two vocabulary entries' ids swapped: the same size, other token ids."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer_json.write_text(json.dumps(data))


def test_a_resume_after_the_start_directorys_tokenizer_was_replaced_in_place_is_refused(train_root, tmp_path):
    """--resume compared the start directory's config.json and weights only: its tokenizer.json replaced in place
    (other ids for the same vocabulary size) resumed without a word and trained on other token ids. Now the
    tokenizer's files as the run started (its start record; the checkpoint's copy for a record of older code) are
    compared (one line naming the file); special_tokens_map.json, which training never reads, may change."""
    source = tmp_path / "source"
    write_ours(source, train_root)
    options = dict(init_from=str(source), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    (source / "special_tokens_map.json").write_text("{}\n")
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    assert Trainer(again).run().steps == 2  # (a checkpoint written as before this check: it resumes unchanged)
    _swap_two_token_ids(source / "tokenizer.json")
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 3}, resume=True)
    with pytest.raises(ValueError, match=rf"^cannot resume from \S+step-00000002: the tokenizer in {source} changed "
                                         r"since the run started \(tokenizer.json differs from the one the run "
                                         r"started with\), so the run would train on other token ids; put back the "
                                         r"tokenizer the run started with$"):
        Trainer(resumed)


def test_the_tokenizer_check_covers_the_chat_template_and_passes_a_checkpoint_without_a_copy(tmp_path):
    """The files that decide what a run trains on: tokenizer.json, and the chat template `rdepth sft` and `rdepth rl`
    render chats with (chat_template.jinja or tokenizer_config.json's). A checkpoint holding no tokenizer copy (a run
    given token shards without one) has nothing to compare."""
    from recurrent_depth.train.trainer_checkpoints import check_same_tokenizer

    checkpoint, tokenizer = tmp_path / "checkpoint", tmp_path / "tokenizer"
    for directory in (checkpoint, tokenizer):
        directory.mkdir()
        (directory / "tokenizer.json").write_text("{}")
        (directory / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    check_same_tokenizer(checkpoint, tokenizer)
    (tokenizer / "chat_template.jinja").write_text("{{ bos_token }}")  # (it takes precedence over the config's)
    (tokenizer / "tokenizer_config.json").write_text('{"chat_template": "{{ bos_token }}"}')
    with pytest.raises(ValueError, match=r"\(tokenizer_config.json, chat_template.jinja differ from"):
        check_same_tokenizer(checkpoint, tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    check_same_tokenizer(checkpoint, tokenizer)


@pytest.mark.parametrize("changes, field", [
    ({"model": {"hidden_size": 32}}, "model.hidden_size=32 differs"),
    ({"model": {"vocab_size": 512}}, "model.vocab_size=512 differs"),
    ({"vocab_size": 512}, "vocab_size=512 differs"),
    ({"seq_len": 128}, "seq_len=128 is longer than .* max_seq_len=64"),
    ({"tokenizer": "elsewhere"}, "tokenizer='elsewhere' differs"),
], ids=["shape", "model-vocab", "vocab", "seq-len", "tokenizer"])
def test_a_change_other_than_depth_is_a_one_line_error_naming_the_field(train_root, tmp_path, changes, field):
    write_ours(tmp_path / "source", train_root)
    cfg = tiny_train_config(train_root, tmp_path / "run", init_from=str(tmp_path / "source"), tokenizer=None)
    with pytest.raises(ValueError, match=field):
        Trainer(cfg.replace(**changes))
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_tokenizer_setting_holding_dirs_own_tokenizer_is_accepted(train_root, tmp_path):
    """A config naming the tokenizer DIR was trained with (its run's tokenizer/, byte for byte DIR's) was refused as
    one that "differs from the tokenizer in DIR"; another tokenizer still is."""
    from recurrent_depth.train.init_from import resolved_config

    write_ours(tmp_path / "source", train_root)
    cfg = tiny_train_config(train_root, tmp_path / "run", init_from=str(tmp_path / "source"))
    assert cfg.tokenizer == str(train_root / "tokenizer")  # (the tokenizer the source was saved with)
    assert resolved_config(cfg).tokenizer == str(tmp_path / "source")
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((train_root / "tokenizer" / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match=f"tokenizer='{other}' differs from the tokenizer in"):
        resolved_config(cfg.replace(tokenizer=str(other)))


def test_cli_names_a_directory_that_holds_no_model(train_root, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(train_flags(train_root, tmp_path / "empty", tmp_path / "run", "--max-steps", "1")) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("rdepth train: error: init_from=") and "no config.json" in error


def test_print_config_shows_the_model_directorys_config_as_the_run_records_it(train_root, tmp_path, capsys):
    """`rdepth train --init-from DIR --print-config` printed `model: {}`, no tokenizer and no seq_len (the preset's
    defaults), not the DIR config the run trains and writes to run.json (`rdepth sft --print-config` resolved it)."""
    write_ours(tmp_path / "source", train_root)
    assert main(["train", "--init-from", str(tmp_path / "source"), "--data", "unused", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["hidden_size"] == tiny_model().config.hidden_size and printed["seq_len"] == 64
    assert printed["tokenizer"] == str(tmp_path / "source")
    assert main(["train", "--init-from", str(tmp_path / "source"), "--model-set", "hidden_size=32",
                 "--print-config"]) == 2  # (a refused change is refused here too)
    assert "hidden_size=32 differs" in capsys.readouterr().err


def test_a_lora_adapter_trained_from_a_bf16_directory_is_written_in_bf16(train_root, tmp_path):
    """`train --lora` wrote the adapter in float32 where `sft --lora` (and train without --lora) write DIR's dtype."""
    write_official(tmp_path / "source", train_root)
    assert main(train_flags(train_root, tmp_path / "source", tmp_path / "run", "--max-steps", "1", "--lora",
                            "--lora-rank", "2", "--lora-parts", "coda")) == 0
    tensors = stored_tensors_of(tmp_path / "run" / "model" / "adapter_model.safetensors")
    assert tensors and {t.dtype for t in tensors.values()} == {torch.bfloat16}


def stored_tensors_of(file):
    with safe_open(str(file), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
