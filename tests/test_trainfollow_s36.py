"""Follow-ups in training from session 36.

1. `--init-from DIR --mean-recurrence R` runs now save R; the checkpoints of such a run started by older code kept
   DIR's depth in their config, and `--resume` refused them as a changed config ("model.mean_recurrence: 4 -> 6").
   They now go on as they started (DIR's depth in the saved config), said in one line.
2. `rdepth loop pretrain` read its shards without the model's vocabulary: a bad id was an embedding IndexError, not
   the line naming the shard file and row that `rdepth train` gives.
3. `rdepth train --tokenizer DIR` from scratch sized the model by the tokenizer's token count: a tokenizer.json
   numbering a token past it failed at the first batch, blaming "another model". The vocabulary is now its
   largest id + 1, as `--init-from` and `sft` measure a tokenizer.
"""

from __future__ import annotations

import json
import shutil

import pytest

from recurrent_depth.cli import main
from recurrent_depth.train.config import TrainConfig
from tests.test_leftovers_s36 import train_root  # noqa: F401 - (a fixture)
from tests.train_support import VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(train_root):  # noqa: F811 - (a fixture)
    """A tokenizer, a corpus and a tiny source model at depth (4, 2): test_leftovers_s36's."""
    return train_root


COMMON = ("--val-fraction", "0.1", "--keep-all", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1",
          "--eval-depths", "1", "--no-tensorboard", "--no-progress", "--threads", "1")


def train_from(root, out, *extra):
    return main(["train", "--init-from", str(root / "source"), "--data", str(root / "corpus"), "--data-dir",
                 str(root / "data"), "--depth-scheme", "fixed", "--out", str(out), *COMMON, *extra])


# ------------------------------------------------------------------- 1. resuming an --init-from run of older code
def test_a_resume_of_an_older_init_from_run_keeps_its_checkpoints_depth(root, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    with monkeypatch.context() as old_code:  # (before the fix: DIR's depth stayed in the run's model config)
        old_code.setattr(TrainConfig, "trained_depth_fields", lambda self: {})
        assert train_from(root, out, "--mean-recurrence", "6", "--max-steps", "1") == 0
    assert json.loads((out / "model" / "config.json").read_text())["mean_recurrence"] == 4
    capsys.readouterr()

    assert train_from(root, out, "--mean-recurrence", "6", "--max-steps", "2", "--resume") == 0
    said = capsys.readouterr().out
    assert (f"model config: keeps {root / 'source'}'s mean_recurrence 4 (the run trains at 6), as this run's "
            "checkpoints record it (a run started before --init-from runs saved the depth they train at, or a "
            "--model-set): model/config.json records it, the default depth of generate, eval and serve\n") in said
    assert "model config: mean_recurrence 4 -> 6" not in said  # (not the line of a run that saves its depth)
    assert "resumed from" in said and "depth fixed r̄=6.0" in said
    assert json.loads((out / "model" / "config.json").read_text())["mean_recurrence"] == 4
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["num_steps"] for m in metrics if m.get("step") == 2] == [[6]]

    # another depth, or a --model-set of another model config, is still a change
    assert train_from(root, out, "--mean-recurrence", "8", "--max-steps", "3", "--resume") == 2
    assert "the configuration changed (mean_recurrence: 6.0 -> 8.0)" in capsys.readouterr().err
    assert train_from(root, out, "--mean-recurrence", "6", "--model-set", "mean_recurrence=6", "--max-steps", "3",
                      "--resume") == 2
    assert "the configuration changed (model.mean_recurrence: 4 -> 6)" in capsys.readouterr().err


# ------------------------------------------------------------------------ 2. `rdepth loop pretrain` names the row
def test_pretrain_names_the_shard_row_of_an_id_past_the_models_vocabulary(tmp_path, monkeypatch):
    from recurrent_depth.looping import pretrain as pretrain_module

    build = pretrain_module.llama_config
    # a model narrower than the data's ids (every row starts with <|begin_text|>, id 268 of 300; its padding id
    # inside, which the embedding requires)
    monkeypatch.setattr(pretrain_module, "llama_config", lambda recipe, vocab_size, specials:
                        build(recipe, 260, {**specials, "pad": 0}))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"{i}.txt").write_text(" ".join(f"word{j % 37} thing{(j * i) % 11}" for j in range(400)))
    recipe = pretrain_module.PretrainRecipe(data=str(data), vocab_size=300, hidden_size=16, num_layers=2,
                                            num_heads=2, num_kv_heads=1, intermediate_size=32, seq_len=16,
                                            batch_size=2, max_steps=1, val_fraction=0.25)
    with pytest.raises(ValueError, match=r"^token id \d+, outside the model's vocabulary \[0, 260\), at "
                                         r".*/shards-[0-9a-f]+/(train|validation)-00000\.bin row \d+, position \d+: "
                                         r"the data was tokenized for another model"):
        pretrain_module.pretrain(tmp_path / "out", recipe, log=lambda _: None)


# ------------------------------------------------------------- 3. a tokenizer whose ids go past its token count
def gapped_tokenizer(root, directory):
    """The run's tokenizer with the space byte symbol ("Ġ", in every document) renumbered past the token count."""
    shutil.copytree(root / "tokenizer", directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["model"]["vocab"]["Ġ"] = VOCAB + 100
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def test_a_run_from_scratch_sizes_the_vocabulary_by_the_tokenizers_largest_id(root, tmp_path, capsys):
    tokenizer = gapped_tokenizer(root, tmp_path / "tok")
    assert main(["train", "--preset", "tiny", "--tokenizer", str(tokenizer), "--data", str(root / "corpus"),
                 "--data-dir", str(tmp_path / "data"), "--max-steps", "1", "--out", str(tmp_path / "run"),
                 *COMMON]) == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB + 101


def test_shards_of_older_code_are_reused_with_the_vocabulary_measured_now(root, tmp_path):
    """Older code recorded the token count as the shards' vocabulary: a rerun after the fix reuses the shards, and
    must not take the stale count (the model would be sized by it again)."""
    from recurrent_depth.data import prepare_dataset
    from recurrent_depth.data.prepare import DATASET_FILE, load_prepared

    tokenizer = gapped_tokenizer(root, tmp_path / "tok")
    first = prepare_dataset(str(root / "corpus"), tokenizer, 32, tmp_path / "data", val_fraction=0.1, keep_all=True)
    assert first.metadata["tokenizer"]["vocab_size"] == VOCAB + 101
    stored = json.loads((first.out_dir / DATASET_FILE).read_text())
    stored["tokenizer"]["vocab_size"] = VOCAB  # (as older code wrote it)
    (first.out_dir / DATASET_FILE).write_text(json.dumps(stored))
    again = prepare_dataset(str(root / "corpus"), tokenizer, 32, tmp_path / "data", val_fraction=0.1, keep_all=True)
    assert again.metadata["reused"] and again.metadata["tokenizer"]["vocab_size"] == VOCAB + 101
    # the other ranks' reading of rank 0's shards takes rank 0's tokenizer metadata
    other = load_prepared(tmp_path / "data", again.metadata["key"], 0.1, again.metadata["tokenizer"])
    assert other is not None and other.metadata["tokenizer"]["vocab_size"] == VOCAB + 101
