"""A token id outside the model's vocabulary in training data is one line naming where it is in the user's data:
the shard file and its row there (and the rank under torchrun), or the SFT record's file:line, with the id and the
vocabulary. It named the row of a *batch* (a shuffled draw no one can trace back), or was torch's IndexError where
the id was only a target (a row's last token) or negative."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, load_examples
from recurrent_depth.data.shards import ShardDataset, read_index, shard_file
from recurrent_depth.data.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
from recurrent_depth.train import TrainConfig, validation_loss_by_depth
from recurrent_depth.train.sft import sft
from recurrent_depth.train.trainer import Trainer
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config

BAD = VOCAB + 7


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Corpus, tokenizer and packed shards (under root / "data"), which each test copies before planting an id."""
    root = prepare_root(tmp_path_factory.mktemp("tokrow"))
    with Trainer(tiny_train_config(root, root / "prepare")):
        pass
    return root


def data_copy(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root / "data", tmp_path / "data"))


def plant(index_path: Path, storage_row: int, position: int, value: int) -> tuple[Path, int]:
    """Write `value` at `position` of storage row `storage_row` of a split; (its shard file, its row there)."""
    index = read_index(index_path)
    start = 0
    for shard in index["shards"]:
        if storage_row < start + shard["num_rows"]:
            file = shard_file(index_path, shard)
            rows = np.memmap(file, dtype=index["dtype"], mode="r+", shape=(shard["num_rows"], index["row_len"]))
            rows[storage_row - start, position] = value
            rows.flush()
            return file, storage_row - start
        start += shard["num_rows"]
    raise AssertionError(f"no storage row {storage_row}")


def named(file: Path, row: int, position: int, rank: str = "") -> str:
    return (rf"^token id {BAD}, outside the model's vocabulary \[0, {VOCAB}\), at {re.escape(str(file))} row {row}"
            rf"{re.escape(rank)}, position {position}: ")


@pytest.mark.parametrize("position", [5, 32], ids=["input", "last-token-a-target-only"])
def test_training_names_the_shard_file_and_row_of_an_id_past_the_vocabulary(root, tmp_path, position):
    """`rdepth train`: the row the first batch draws holds the id; the error names its file and row (it named
    "row 0" of the batch, or was cross_entropy's "Target 391 is out of bounds" for a row's last token)."""
    cfg = tiny_train_config(root, tmp_path / "run", data_dir=str(data_copy(root, tmp_path)), max_steps=2)
    with Trainer(cfg) as trainer:
        first = int(trainer.train_data.order(0)[0])  # (the first row of the first batch: a shuffled storage row)
        file, row = plant(trainer.train_data.index_path, first, position, BAD)
        assert row > 0  # (else the batch's row would be the file's row by chance)
        with pytest.raises(ValueError, match=named(file, row, position)):
            trainer.run()


def test_a_rank_under_torchrun_names_itself(root, tmp_path):
    data = data_copy(root, tmp_path)
    index = next(data.glob("train.json"))
    ranks = [ShardDataset(index, seed=0, rank=r, world_size=2, vocab_size=VOCAB) for r in (0, 1)]
    order = ranks[0].order(0)
    file, row = plant(index, int(order[3]), 2, BAD)  # (rank 1's second row of the first global batch of 2 x 2)
    assert ranks[0].next_batch(2).shape == (2, 33)
    with pytest.raises(ValueError, match=named(file, row, 2, " (rank 1 of 2)")):
        ranks[1].next_batch(2)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).eval()


def test_validation_names_the_shard_file_and_row(root, tmp_path, model):
    """validation_loss_by_depth named only the id ("validation rows hold token id ...") and let a negative one
    reach the embedding (IndexError)."""
    index = data_copy(root, tmp_path) / "validation.json"
    file, row = plant(index, 5, 9, BAD)
    with pytest.raises(ValueError, match=named(file, row, 9)):
        validation_loss_by_depth(model, ShardDataset(index, shuffle=False), [1], batch_size=2, max_batches=4)

    class Rows:  # (any dataset with `iter_batches`: named by its storage row)
        def __len__(self) -> int:
            return 6

        def iter_batches(self, batch_size: int, drop_last: bool = False):
            rows = torch.randint(0, VOCAB, (6, 9))
            rows[3, 2] = -1
            yield from rows.split(batch_size)

    with pytest.raises(ValueError, match=r"^token id -1, outside the model's vocabulary \[0, 384\), at validation row "
                                         r"3, position 2: "):
        validation_loss_by_depth(model, Rows(), [1], batch_size=2, max_batches=3)


def test_distillation_names_the_shard_file_and_row(root, tmp_path):
    """The distillation cache reads every train row through the teacher, 4 at a time: the id at storage row 5 was
    "row 1" of a batch."""
    teacher = tmp_path / "teacher"
    torch.manual_seed(11)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        teacher, tokenizer=root / "tokenizer")
    data = data_copy(root, tmp_path)
    file, row = plant(data / "train.json", 5, 3, BAD)
    cfg = tiny_train_config(root, tmp_path / "run", data_dir=str(data), max_steps=2, teacher=str(teacher),
                            teacher_depth=1, distill_top_k=4, distill_cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=named(file, row, 3)):
        Trainer(cfg)


def test_sft_refuses_a_tokenizer_past_the_vocabulary_and_names_the_record(root, tmp_path):
    """A tokenizer.json that numbers a token past its count (so past the model's vocabulary) passed `rdepth sft`'s
    size check, which counted tokens: the run trained, then failed a packed batch's row, or the save of model/ at its
    end. Now it is refused up front; and an `ExampleEncoder` given such a tokenizer names the record, file:line."""
    text = "kappa kappa theta"
    tokenizer = json.loads((root / "tokenizer" / "tokenizer.json").read_text())
    moved = max(load_tokenizer(root / "tokenizer").encode(text, add_special_tokens=False).ids)  # (a merge)
    vocab = tokenizer["model"]["vocab"]
    vocab[next(k for k, v in vocab.items() if v == moved)] = 900
    model_dir = tmp_path / "model"
    specials = special_token_ids(load_tokenizer(root / "tokenizer"))
    config = rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64, bos_token_id=specials["begin_text"],
                                        eos_token_id=eos_token_ids(specials), pad_token_id=specials["pad"])
    rd.RecurrentDepthLM(config).save_pretrained(model_dir, tokenizer=root / "tokenizer")
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    chats = tmp_path / "chats.jsonl"
    records = [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]] * 3
    records.insert(2, [{"role": "user", "content": "say it"}, {"role": "assistant", "content": text}])
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    cfg = TrainConfig(init_from=str(model_dir), data=str(chats), seq_len=32, batch_size=4, max_steps=1,
                      eval_batches=1, progress=False, tensorboard=False, out=str(tmp_path / "sft"))
    with pytest.raises(ValueError, match=rf"^the tokenizer in {re.escape(str(model_dir))} makes ids up to 900, "
                                         rf"outside .*vocab_size={VOCAB}$"):
        sft(cfg)
    with pytest.raises(ValueError, match=rf"^token id 900, outside the model's vocabulary \[0, {VOCAB}\), at "
                                         rf"{re.escape(str(chats))}:3, position \d+: the tokenizer of "):
        load_examples(chats, ExampleEncoder(model_dir, config))
