"""Distillation follow-ups: the teacher runs in its stored dtype under the trainer's bf16 autocast (cached and
on-the-fly targets agree up to the cache's float16 rounding); a distill cache of other rows is refused for every
teacher, random initial state or not, with a message that says how to get this run's cache."""

import json
import re

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train import distill_cache
from recurrent_depth.train.distill import Distillation, load_teacher
from recurrent_depth.train.trainer import Trainer
from tests.train_support import VOCAB, OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("distill2_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


class Rows:
    """A ShardDataset stand-in: `len`, `row_len` and `rows(indices)` in storage order."""

    def __init__(self, num_rows: int, row_len: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(5)
        self.data = torch.randint(0, vocab, (num_rows, row_len), generator=generator).numpy()
        self.row_len = row_len

    def __len__(self) -> int:
        return len(self.data)

    def rows(self, indices):
        return self.data[list(indices)]


def save_teacher(path, state_init="random", vocab=VOCAB, tokenizer=None):
    torch.manual_seed(11)
    config = rd.ModelConfig.from_preset("tiny", vocab_size=vocab, max_seq_len=64, state_init=state_init)
    rd.RecurrentDepthLM(config).save_pretrained(path, tokenizer=tokenizer)
    return path


def test_under_bf16_autocast_the_teacher_runs_in_its_stored_dtype_so_cached_targets_equal_on_the_fly_ones(tmp_path):
    """The cache writer ran the teacher outside autocast, the trainer's on-the-fly teacher inside its bf16 autocast
    (`--dtype bf16`): a float32 teacher's logits moved by ~0.01 (25x the cache's float16 rounding). Autocast is off
    around the teacher now: its on-the-fly top-k, rounded to float16, is exactly what the cache holds."""
    vocab, k = 64, 8
    teacher = load_teacher(save_teacher(tmp_path / "teacher", vocab=vocab), 2)
    objective = Distillation(teacher, alpha=0.5, temperature=1.0, top_k=k, seed=0, position=lambda: 0)
    data = Rows(4, 17, vocab)
    distill_cache.write_cache(objective.teacher_logits, data, tmp_path / "cache", top_k=k, vocab_size=vocab,
                              data_key="key", teacher_info={}, batch_size=4, log=lambda _: None)
    cached = distill_cache.CachedTeacher(tmp_path / "cache", data, top_k=k, vocab_size=vocab, data_key="key")
    rows = torch.from_numpy(data.rows(range(4))).long()
    batch = {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the trainer's step runs the objective under
        logits = objective.teacher_logits(batch["input_ids"], position=0)  # (the write batch's position and rows)
        values, indices = cached.top(batch)
    assert logits.dtype == torch.float32
    top = logits.topk(k, dim=-1)
    assert torch.equal(top.indices, indices)
    assert torch.equal(top.values.half().float(), values)  # the cache's documented rounding, and nothing else


def test_a_cache_of_other_rows_says_which_directory_to_delete_or_which_option_to_change(tmp_path):
    """The refusal ended in "(write it again for these shards)", which did not say how."""
    data = Rows(4, 5, VOCAB)
    distill_cache.write_cache(lambda ids, first: torch.randn(*ids.shape, VOCAB), data, tmp_path / "cache", top_k=3,
                              vocab_size=VOCAB, data_key="k", teacher_info={"seed": 0}, batch_size=2,
                              log=lambda _: None)
    cache = tmp_path / "cache"
    hint = f"(delete {cache} to write it again for this run, or give --distill-cache (distill_cache) another directory)"
    cases = [(dict(data=data, data_key="other", seed=None), "its data_key is 'k', the run's 'other' "),
             (dict(data=data, data_key="other", seed=3), "its data_key is 'k', the run's 'other'; it was written "
                                                         "with seed 0, this run's is 3, and the seed also splits "
                                                         "and packs the training data "),
             (dict(data=Rows(5, 5, VOCAB), data_key="k", seed=0), "its num_rows is 4, the run's 5 ")]
    for case, says in cases:
        with pytest.raises(ValueError) as info:
            distill_cache.matching_manifest(cache, case["data"], top_k=3, vocab_size=VOCAB,
                                            data_key=case["data_key"], seed=case["seed"])
        assert str(info.value) == f"distill_cache {cache} does not match this run: {says}{hint}"
        with pytest.raises(ValueError, match="^distill_cache .* does not match this run: .*another directory\\)$"):
            distill_cache.CachedTeacher(cache, case["data"], top_k=3, vocab_size=VOCAB, data_key=case["data_key"])
    with pytest.raises(ValueError, match="a training row is not in the cache .*another directory"):
        distill_cache.CachedTeacher(cache, data, top_k=3, vocab_size=VOCAB, data_key="k").lookup(data.data[0] + 1)


@pytest.mark.parametrize("state_init", ["random", "embedding"])
def test_another_seed_is_refused_for_every_teacher_and_the_cache_is_kept(train_root, tmp_path, state_init):
    """--seed also splits and packs the data: a teacher whose initial state is not random (Ouro's `embedding`)
    met the data-key refusal, while a random-start teacher had the cache of the other seed's rows written over.
    Both are refused now, naming the seed, and the cache is left as it was."""
    root = train_root
    teacher = save_teacher(tmp_path / "teacher", state_init, tokenizer=root / "tokenizer")
    cache = tmp_path / "cache"
    options = dict(teacher=str(teacher), teacher_depth=1, distill_top_k=4, distill_cache_only=True,
                   distill_cache=str(cache))
    Trainer(tiny_train_config(root, tmp_path / "a", **options))
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["teacher"]["random_state"] is (state_init == "random")
    with pytest.raises(ValueError, match=f"its data_key is .* written with seed 0, this run's is 1, .*delete "
                                         f"{re.escape(str(cache))} to write it again for this run, or give "
                                         f"--distill-cache"):
        Trainer(tiny_train_config(root, tmp_path / "b", seed=1, **options))
    assert json.loads((cache / "manifest.json").read_text()) == manifest
