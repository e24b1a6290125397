"""A run from scratch records its tokenizer files' digests as it starts (`start.tokenizer` in each checkpoint's
trainer_state.json), as a run from a model directory does: a tokenizer replaced in place before the first checkpoint,
whose copy that checkpoint then holds, is refused on --resume in one line, before any token shard is packed with it."""

import json
import shutil

import pytest

from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train.trainer import Trainer
from recurrent_depth.train.trainer_checkpoints import check_same_start
from tests.test_init_from import _swap_two_token_ids
from tests.train_support import prepare_root, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("tokenizer_start_root"))


def replace_at_step_one(tokenizer_json):
    """An `on_step` hook: the tokenizer replaced in place after the run started, before its first checkpoint."""
    def hook(trainer, record):
        if record["step"] == 1:
            _swap_two_token_ids(tokenizer_json)
    return hook


def test_a_given_tokenizer_replaced_before_the_first_checkpoint_is_refused_before_packing(train_root, tmp_path):
    """`rdepth train --tokenizer DIR` from scratch recorded nothing of DIR: the resume compared DIR with the
    checkpoint's copy (the replacement), packed the token shards again with it over the run's cache, and failed
    naming the data; a chat_template.jinja replaced so resumed without a word. Put back, the run resumes."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(train_root / "tokenizer", tokenizer)
    original = (tokenizer / "tokenizer.json").read_bytes()
    options = dict(tokenizer=str(tokenizer), data_dir=str(tmp_path / "data"), max_steps=2, save_every=2,
                   eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options),
            on_step=replace_at_step_one(tokenizer / "tokenizer.json")).run()
    shards = (tmp_path / "data" / "dataset.json").read_bytes()
    resumed = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 3}, resume=True)
    with pytest.raises(ValueError, match=rf"^cannot resume from \S+step-00000002: the tokenizer in {tokenizer} changed "
                                         r"since the run started \(tokenizer.json differs from the one the run "
                                         r"started with\), so the run would train on other token ids; put back"):
        Trainer(resumed)
    assert (tmp_path / "data" / "dataset.json").read_bytes() == shards  # (the run's shards were not packed again)
    (tokenizer / "tokenizer.json").write_bytes(original)
    assert Trainer(resumed).run().steps == 3


def test_a_from_scratch_checkpoint_of_older_code_without_a_start_record_resumes(train_root, tmp_path):
    options = dict(max_steps=1, eval_batches=1)
    Trainer(tiny_train_config(train_root, tmp_path / "run", **options)).run()
    checkpoint = tmp_path / "run" / "checkpoints" / ckpt.checkpoint_name(1)
    state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
    assert set(state["start"]) == {"tokenizer"} and state["start"]["tokenizer"]["tokenizer.json"] is not None
    state["start"] = None  # (as older code wrote a run from scratch's)
    (checkpoint / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    ckpt.write_manifest(checkpoint)
    again = tiny_train_config(train_root, tmp_path / "run", **{**options, "max_steps": 2}, resume=True)
    assert Trainer(again).run().steps == 2


def own_tokenizer_run(root, out, **overrides):
    """A run from scratch that trains its own tokenizer into out/tokenizer."""
    values = dict(tokenizer=None, vocab_size=300, max_steps=2, save_every=2, eval_batches=1, data_dir=None)
    return tiny_train_config(root, out, **{**values, **overrides})


def test_an_own_tokenizer_replaced_before_the_first_checkpoint_is_refused(train_root, tmp_path):
    """out/tokenizer was compared with the checkpoint's copy only: replaced before the first checkpoint, the resume
    packed the shards again with it and failed naming the data. Deleted as well, the checkpoint's copy (the
    replacement) is not put back either."""
    run = tmp_path / "run"
    Trainer(own_tokenizer_run(train_root, run), on_step=replace_at_step_one(run / "tokenizer" / "tokenizer.json")).run()
    resumed = own_tokenizer_run(train_root, run, max_steps=3, resume=True)
    refusal = (r"^cannot resume from \S+step-00000002: the tokenizer in \S+ changed since the run started "
               r"\(tokenizer.json differs from the one the run started with\)")
    with pytest.raises(ValueError, match=refusal):
        Trainer(resumed)
    shutil.rmtree(run / "tokenizer")
    with pytest.raises(ValueError, match=refusal):
        Trainer(resumed)
    assert not (run / "tokenizer").exists()


def test_a_start_record_of_a_run_from_scratch_holds_digests_only(tmp_path):
    """No model directory to compare (it was a damaged checkpoint); a record without digests still is one."""
    digests = {"tokenizer": {"tokenizer.json": "a" * 64}}
    check_same_start(tmp_path / "checkpoint", digests, digests)
    for recorded in ({}, {"tokenizer": None}, {"tokenizer": {}, "directory": "x"}):
        with pytest.raises(ValueError, match=r"records start=.*tokenizer: file digests\); the checkpoint is damaged$"):
            check_same_start(tmp_path / "checkpoint", recorded, digests)
