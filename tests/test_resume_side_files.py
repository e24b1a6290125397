"""A resumed run from --init-from DIR keeps DIR's retrofit.json and generation_config.json as the run started with
them (its checkpoints' copies), not as DIR holds them when it resumes."""

import json

import pytest

from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train.trainer import Trainer
from tests.test_init_from import write_ours
from tests.train_support import OneThread, prepare_root, tiny_train_config

STARTED = {"generation_config.json": json.dumps({"temperature": 0.7}) + "\n",
           "retrofit.json": json.dumps({"source": "llama", "layers": [0, 1]}) + "\n"}


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("side_files_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def source_with(root, directory, files):
    write_ours(directory, root)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def run_files(directory):
    return {name: (directory / name).read_text() for name in STARTED if (directory / name).exists()}


@pytest.mark.parametrize("change", ["edited", "removed", "added"])
def test_a_resumed_run_keeps_the_side_files_it_started_with(train_root, tmp_path, change):
    """The run crashed (max_steps), DIR's generation_config.json was edited (temperature 0.7 -> 0.1), removed, or
    added where DIR had none, then --resume: the checkpoints held what the run started with, the final model/
    silently what DIR held at the resume."""
    started = {} if change == "added" else STARTED
    source = source_with(train_root, tmp_path / "source", started)
    options = dict(init_from=str(source), tokenizer=None, max_steps=2, save_every=2, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    if change == "removed":
        for name in STARTED:
            (source / name).unlink()
    else:
        (source / "generation_config.json").write_text(json.dumps({"temperature": 0.1}) + "\n")
        (source / "retrofit.json").write_text(json.dumps({"source": "other"}) + "\n")
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 3}, resume=True)
    trainer = Trainer(resumed)
    assert trainer.run().steps == 3
    checkpoints = tmp_path / "run" / "checkpoints"
    for directory in (checkpoints / ckpt.checkpoint_name(2), checkpoints / ckpt.checkpoint_name(3),
                      tmp_path / "run" / "model"):
        assert run_files(directory) == started, directory
    # (the next resume still finds the checkpoint's copies recorded as the run's)
    state = json.loads((checkpoints / ckpt.checkpoint_name(3) / ckpt.TRAINER_STATE).read_text())
    assert sorted(state["start"]["files"]) == sorted(started)
    if change != "edited":
        return
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 4}, resume=True)
    assert Trainer(again).run().steps == 4
    assert run_files(tmp_path / "run" / "model") == started


def test_a_checkpoint_of_older_code_without_the_files_record_keeps_the_start_directorys(train_root, tmp_path):
    """A start record without `files` (written before it existed): the start directory's files are kept, as then."""
    source = source_with(train_root, tmp_path / "source", STARTED)
    options = dict(init_from=str(source), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    checkpoint = tmp_path / "run" / "checkpoints" / ckpt.checkpoint_name(1)
    state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
    del state["start"]["files"]
    (checkpoint / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    for name in STARTED:  # (older code's checkpoints held no copies)
        (checkpoint / name).unlink()
    ckpt.write_manifest(checkpoint)  # (sealed again, as older code wrote it)
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    assert Trainer(again).run().steps == 2
    assert run_files(tmp_path / "run" / "model") == STARTED


def test_a_checkpoint_without_the_copy_its_start_record_names_is_refused_in_one_line(train_root, tmp_path):
    source = source_with(train_root, tmp_path / "source", STARTED)
    options = dict(init_from=str(source), tokenizer=None, max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    checkpoint = tmp_path / "run" / "checkpoints" / ckpt.checkpoint_name(1)
    (checkpoint / "generation_config.json").write_text("{}\n")
    ckpt.write_manifest(checkpoint)  # (its manifest agrees: only the start record tells)
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    with pytest.raises(ValueError, match=r"^cannot resume from \S+step-00000001: it holds no copy of the "
                                         r"'generation_config.json' the run started with \(its start record's "
                                         r"files\); the checkpoint is damaged$"):
        Trainer(again)


@pytest.mark.parametrize("files", [{"generation_config.json": 5}, ["a"]])
def test_a_malformed_files_record_is_a_damaged_checkpoint(tmp_path, files):
    from recurrent_depth.train.trainer_checkpoints import check_same_start

    start = {"directory": str(tmp_path / "model"), "identity": "a" * 64, "content": "b" * 64, "tokenizer": {}}
    with pytest.raises(ValueError, match=r"records start=.*files and tokenizer: file digests\); the checkpoint is "
                                         r"damaged$"):
        check_same_start(tmp_path / "checkpoint", {**start, "files": files}, start)
