"""Token shards on disk, the resumable ShardDataset, and prepare_dataset end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from recurrent_depth.data.corpus import Document, DocumentListCorpus, DocumentSplit
from recurrent_depth.data.prepare import prepare_dataset
from recurrent_depth.data.shards import (
    SHARD_FORMAT,
    SHARD_FORMAT_VERSION,
    ShardDataset,
    ShardWriter,
    TokenizedDocs,
    shards_complete,
    token_dtype,
    write_index,
)
from recurrent_depth.data.tokenizer import special_token_ids, train_tokenizer


def _write_split(root: Path, rows: np.ndarray, dtype, max_shard_bytes: int, split: str = "train") -> Path:
    with ShardWriter(root, split, rows.shape[1], dtype, max_shard_bytes) as writer:
        writer.write_rows(rows)
    index = root / f"{split}.json"
    write_index(index, {
        "format": SHARD_FORMAT, "version": SHARD_FORMAT_VERSION, "split": split, "dtype": np.dtype(dtype).name,
        "seq_len": rows.shape[1] - 1, "row_len": rows.shape[1], "num_rows": writer.num_rows,
        "num_tokens": rows.size, "shards": writer.shards,
    })
    return index


@pytest.fixture
def rows() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 65536, size=(37, 9))  # odd sizes on purpose


def test_token_dtype() -> None:
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


@pytest.mark.parametrize("max_shard_bytes", [1, 5 * 9 * 2, 10**9], ids=["row-per-shard", "5-rows", "one-shard"])
def test_shards_round_trip(tmp_path: Path, rows: np.ndarray, max_shard_bytes: int) -> None:
    index = _write_split(tmp_path, rows, np.uint16, max_shard_bytes)
    data = ShardDataset(index, shuffle=False)
    expected_shards = {1: 37, 90: 8, 10**9: 1}[max_shard_bytes]
    assert len(data.index["shards"]) == expected_shards
    assert len(data) == 37 and data.seq_len == 8
    assert all(np.array_equal(data[i], rows[i]) for i in range(37))
    assert np.array_equal(data.rows([36, 0, 17, 17]), rows[[36, 0, 17, 17]])
    assert torch.equal(torch.cat(list(data.iter_batches(5))), torch.from_numpy(rows))
    assert shards_complete(index) and not list(tmp_path.glob("*.tmp"))
    file = tmp_path / data.index["shards"][-1]["file"]
    np.testing.assert_array_equal(np.fromfile(file, dtype=np.uint16)[-9:], rows[-1])  # raw memmap layout


def test_uint32_shards_hold_large_ids(tmp_path: Path) -> None:
    rows = np.array([[0, 70000, 2**32 - 1]], dtype=np.int64)
    index = _write_split(tmp_path, rows, token_dtype(2**20), 10**6)
    assert ShardDataset(index)[0].tolist() == rows[0].tolist()


def test_writer_rejects_out_of_range_ids_and_cleans_up(tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match=r"token ids must be in \[0, 65535\]"),
        ShardWriter(tmp_path, "train", 3, np.uint16) as writer,
    ):
        writer.write(np.array([1, 2, 3]))
        writer._flush()  # make sure a shard file is open when the error comes
        writer.write(np.array([1, 2, 70000]))
    assert list(tmp_path.iterdir()) == []  # the unfinished shard's temp file is gone
    with pytest.raises(ValueError, match="row must have 3 tokens"):
        ShardWriter(tmp_path, "train", 3, np.uint16).write(np.array([1, 2]))


def test_incomplete_shard_is_detected(tmp_path: Path, rows: np.ndarray) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 10**9)
    file = tmp_path / "train-00000.bin"
    file.write_bytes(file.read_bytes()[:-2])
    assert not shards_complete(index)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_dataset_names_a_damaged_shard(tmp_path: Path, rows: np.ndarray, damage: str) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 5 * 9 * 2)
    file = tmp_path / "train-00003.bin"
    if damage == "missing":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"train-00003\.bin (is missing|has 88 bytes), expected 90"):
        ShardDataset(index)


@pytest.mark.parametrize("text, message", [("{", "not valid JSON"), ("[1]", "a JSON list")], ids=["torn", "list"])
def test_bad_index_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "train.json").write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        ShardDataset(tmp_path / "train.json")
    assert "train.json" in str(err.value)


@pytest.mark.parametrize("bad", [0, -5, 2.5])
def test_writer_rejects_non_positive_shard_size(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive int"):
        ShardWriter(tmp_path, "train", 9, np.uint16, bad)


def test_order_is_seeded_and_each_epoch_is_a_permutation(tmp_path: Path, rows: np.ndarray) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 10**9)
    a, b, c = ShardDataset(index, seed=1), ShardDataset(index, seed=1), ShardDataset(index, seed=2)
    epoch = torch.cat([a.next_batch(37)])
    assert torch.equal(epoch, b.next_batch(37)) and not torch.equal(epoch, c.next_batch(37))
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, rows.tolist()))
    assert a.state_dict()["epoch"] == 1 and a.state_dict()["position"] == 0
    assert not torch.equal(a.next_batch(37), epoch)  # a new epoch, a new order


@pytest.mark.parametrize("stop_after", [1, 4, 9], ids=lambda n: f"stop{n}")
def test_resume_matches_uninterrupted(tmp_path: Path, rows: np.ndarray, stop_after: int) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 64)
    straight = ShardDataset(index, seed=3)
    expected = [straight.next_batch(5) for _ in range(15)]  # 75 rows: crosses two epochs
    first = ShardDataset(index, seed=3)
    got = [first.next_batch(5) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive JSON
    assert all(type(v) is int for v in state.values())
    resumed = ShardDataset(index, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(5) for _ in range(15 - stop_after)]
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


def test_load_state_dict_rejects_mismatch(tmp_path: Path, rows: np.ndarray) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 10**9)
    state = ShardDataset(index, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed=3 in the checkpoint but 4 here"):
        ShardDataset(index, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="position must be in"):
        ShardDataset(index, seed=3).load_state_dict({**state, "position": 37})


def test_load_state_dict_rejects_rows_built_from_other_data(tmp_path: Path, rows: np.ndarray) -> None:
    """Shards rebuilt from another corpus or tokenizer can have the same row count; the index's key tells."""
    index = _write_split(tmp_path, rows, np.uint16, 10**9)
    meta = json.loads(index.read_text())
    index.write_text(json.dumps({**meta, "key": "a" * 64}))
    state = ShardDataset(index, seed=3).state_dict()
    assert state["data_key"] == "a" * 64
    index.write_text(json.dumps({**meta, "key": "b" * 64}))
    with pytest.raises(ValueError, match="built from other data"):
        ShardDataset(index, seed=3).load_state_dict(state)
    # a checkpoint written before the key was recorded still resumes
    legacy = {k: v for k, v in state.items() if k != "data_key"}
    ShardDataset(index, seed=3).load_state_dict(legacy)


def test_ranks_share_position_and_see_disjoint_rows(tmp_path: Path, rows: np.ndarray) -> None:
    index = _write_split(tmp_path, rows, np.uint16, 10**9)
    ranks = [ShardDataset(index, seed=0, rank=r, world_size=3) for r in range(3)]
    single = ShardDataset(index, seed=0)
    for _ in range(3):
        parts = [d.next_batch(4) for d in ranks]
        assert torch.equal(torch.cat(parts), single.next_batch(12))
        assert len({d.state_dict()["position"] for d in ranks}) == 1
    with pytest.raises(ValueError, match="rank must be in"):
        ShardDataset(index, rank=3, world_size=3)


def test_tokenized_docs_round_trip(tmp_path: Path) -> None:
    docs = [np.arange(n) for n in (3, 0, 5, 1)]
    store = TokenizedDocs.write(tmp_path / "docs", docs, np.uint16)
    assert len(store) == 4 and [store[i].tolist() for i in range(4)] == [d.tolist() for d in docs]
    store.delete()
    assert list(tmp_path.iterdir()) == []


def _corpus() -> DocumentListCorpus:
    docs = []
    for i in range(60):
        body = "".join(f"    value_{j} = compute({i}, {j})\n" for j in range(i % 7 + 1))
        docs.append(Document(f"mod_{i:02d}.py", f"def function_{i}():\n{body}    return value_0\n"))
    return DocumentListCorpus(docs, name="synthetic")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(_corpus(), vocab_size=320)


def test_prepare_dataset_writes_reuses_and_rebuilds(tmp_path: Path, tok) -> None:
    corpus = _corpus()
    out = tmp_path / "data"
    prepared = prepare_dataset(corpus, tok, seq_len=16, out_dir=out, val_fraction=0.2, seed=1)
    meta = prepared.metadata
    assert not meta["reused"]
    assert meta["corpus"]["sha256"] == corpus.info().sha256 and meta["corpus"]["num_documents"] == 60
    train, val = meta["splits"]["train"], meta["splits"]["validation"]
    assert train["documents"] + val["documents"] == 60 and val["documents"] > 0
    split = DocumentSplit.plan(corpus.ids(), 0.2, seed=1)
    assert val["documents"] == sum(split.is_validation(d.id) for d in corpus)
    for part in (train, val):
        p = part["packing"]
        assert p["tokens_in"] == p["tokens_packed"] + p["tokens_dropped"] and part["tokens"] == part["rows"] * 17
    assert train["packing"]["tokens_dropped"] > val["packing"]["tokens_dropped"]  # drop rule vs keep_all
    assert json.loads((out / "dataset.json").read_text())["key"] == meta["key"]

    ids = special_token_ids(tok)
    data = prepared.dataset("train", shuffle=False)
    assert len(data) == train["rows"] and data.seq_len == 16
    first_tokens = {int(data[i][0]) for i in range(len(data))}
    assert first_tokens == {ids["begin_text"]}  # drop rule: every row starts a new document
    val_rows = np.stack([prepared.dataset("validation")[i] for i in range(val["rows"])])
    assert (val_rows == ids["end_text"]).sum() > 0

    again = prepare_dataset(corpus, tok, seq_len=16, out_dir=out, val_fraction=0.2, seed=1)
    assert again.metadata["reused"] and again.metadata["key"] == meta["key"]
    changed = prepare_dataset(corpus, tok, seq_len=16, out_dir=out, val_fraction=0.2, seed=1, keep_all=True)
    assert not changed.metadata["reused"] and changed.metadata["key"] != meta["key"]
    assert changed.metadata["splits"]["train"]["rows"] > train["rows"]
    no_val = prepare_dataset(corpus, tok, seq_len=16, out_dir=out, val_fraction=0.0, seed=1)
    assert no_val.val_index is None and not (out / "validation.json").exists()
    assert no_val.metadata["splits"]["train"]["documents"] == 60
    with pytest.raises(ValueError, match="split 'validation' does not exist"):
        no_val.dataset("validation")


def test_prepare_dataset_is_deterministic(tmp_path: Path, tok) -> None:
    a = prepare_dataset(_corpus(), tok, seq_len=8, out_dir=tmp_path / "a", val_fraction=0.1, seed=2, keep_all=True)
    b = prepare_dataset(_corpus(), tok, seq_len=8, out_dir=tmp_path / "b", val_fraction=0.1, seed=2, keep_all=True)
    for split in ("train", "validation"):
        files_a = sorted(a.out_dir.glob(f"{split}-*.bin"))  # (the key's own subdirectory)
        assert files_a and [f.read_bytes() for f in files_a] == [(b.out_dir / f.name).read_bytes() for f in files_a]
    assert a.metadata["key"] == b.metadata["key"]
    # keep_all: every document token ends up in a row, except the unfinished last row
    assert a.metadata["splits"]["train"]["packing"]["tokens_dropped"] < 9


def test_rebuild_after_interrupted_write(tmp_path: Path, tok) -> None:
    out = tmp_path / "data"
    prepared = prepare_dataset(_corpus(), tok, seq_len=16, out_dir=out, val_fraction=0.2)
    (prepared.out_dir / "train-00000.bin").write_bytes(b"torn")  # as if a crash corrupted a shard
    (prepared.out_dir / "train-00000.bin.tmp").write_bytes(b"leftover")
    again = prepare_dataset(_corpus(), tok, seq_len=16, out_dir=out, val_fraction=0.2)
    assert not again.metadata["reused"] and again.metadata["key"] == prepared.metadata["key"]
    assert shards_complete(again.train_index) and not list(out.rglob("*.tmp"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq_len": 0}, "seq_len must be an int >= 1"),
        ({"seq_len": 16, "val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
        ({"seq_len": 100_000}, "does not fill one row"),
        ({"seq_len": 16, "max_shard_bytes": 0}, "max_shard_bytes must be a positive int"),
    ],
    ids=["seq-len-zero", "val-fraction-one", "corpus-too-small", "shard-bytes-zero"],
)
def test_prepare_dataset_errors(tmp_path: Path, tok, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_dataset(_corpus(), tok, out_dir=tmp_path, **kwargs)


def test_prepare_dataset_accepts_a_tokenizer_directory(tmp_path: Path, tok) -> None:
    from recurrent_depth.data.tokenizer import save_tokenizer

    save_tokenizer(tok, tmp_path / "tok")
    prepared = prepare_dataset(_corpus(), tmp_path / "tok", seq_len=16, out_dir=tmp_path / "d", val_fraction=0.0)
    assert prepared.metadata["tokenizer"]["vocab_size"] == 320
    assert json.loads(prepared.train_index.read_text())["dtype"] == "uint16"


# ------------------------------------------------------------------ issue 33 item 1: what packing kept, said
def test_the_packing_report_says_what_each_rule_keeps_and_warns_when_the_papers_rule_keeps_little(
        tmp_path: Path, tok) -> None:
    from recurrent_depth.data.prepare import packing_report

    long_docs = DocumentListCorpus([Document(f"f{i}", "x = compute(1, 2)\n" * 200) for i in range(6)], name="mytext")
    prepared = prepare_dataset(long_docs, tok, seq_len=32, out_dir=tmp_path / "drop", val_fraction=0.2, seed=0)
    summary, warnings = packing_report(prepared.metadata)
    train, val = (prepared.metadata["splits"][s] for s in ("train", "validation"))
    offered = train["packing"]["tokens_in"]
    assert summary.startswith(f"packed {train['rows']} training rows ({train['rows'] * 33:,} of {offered:,} tokens")
    assert f"keep_all would keep {offered // 33:,} rows" in summary
    assert f"{val['rows']:,} validation rows" in summary and "every token packed" in summary
    assert train["rows"] * 33 < offered / 2  # (each long document gives at most one row)
    assert warnings[0].startswith("warning: the paper's packing rule kept ") and "--keep-all" in warnings[0]
    assert "mytext's training tokens" in warnings[0]
    assert val["rows"] > train["rows"] and warnings[1].startswith("warning: the validation split")

    kept = prepare_dataset(long_docs, tok, seq_len=32, out_dir=tmp_path / "all", val_fraction=0.2, seed=0,
                           keep_all=True)
    summary, warnings = packing_report(kept.metadata)
    assert kept.metadata["splits"]["train"]["rows"] == offered // 33 and warnings == []
    assert summary.startswith(f"packed {offered // 33:,} training rows")
