"""Token shards prepared by several processes in one directory at once (a sweep's runs, two seeds started together):
readers never see a partial file, writers of one key take turns, writers of different keys keep their own files,
and a writer killed with SIGKILL leaves nothing that blocks or is read."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from recurrent_depth.data.prepare import prepare_dataset, set_name
from recurrent_depth.data.shards import ShardDataset, read_index, shards_complete
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.files import held_lock

SEQ_LEN = 16
SHARD_BYTES = 40 * (SEQ_LEN + 1) * 2  # several shards per split, so a reader opens files one after another
JOIN_S = 60.0  # a bound on every wait for a child: a hang fails the test instead of stalling the suite


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A small JSONL corpus and a tokenizer directory (paths: a spawned child loads them itself)."""
    root = tmp_path_factory.mktemp("inputs")
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(60 + i % 9)) for i in range(48)]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    save_tokenizer(train_tokenizer(texts, vocab_size=300), root / "tok")
    return corpus, root / "tok"


def _prepare(corpus: Path, tok: Path, out: Path, seed: int, **kwargs):
    return prepare_dataset(corpus, tok, SEQ_LEN, out, val_fraction=0.2, seed=seed, max_shard_bytes=SHARD_BYTES,
                           **kwargs)


def _child(corpus: Path, tok: Path, out: Path, seed: int, hold: float, started, results) -> None:
    """Prepare the shards of `seed` in `out`; with `hold`, pause that long once its first split is tokenised (the
    key's lock held, its work directory begun) and set `started`, so the parent acts while it writes."""
    import recurrent_depth.data.prepare as prepare

    if hold:
        pack = prepare.pack_documents

        def slow_pack(*args, **kwargs):
            if not started.is_set():
                started.set()
                time.sleep(hold)
            yield from pack(*args, **kwargs)

        prepare.pack_documents = slow_pack
    data = _prepare(corpus, tok, out, seed, lock_timeout=JOIN_S)
    results.put({"seed": seed, "reused": data.metadata["reused"], "key": data.metadata["key"],
                 "index": str(data.train_index)})


def _start(ctx, inputs, out: Path, seed: int, hold: float, results):
    started = ctx.Event()
    process = ctx.Process(target=_child, args=(*inputs, out, seed, hold, started, results), daemon=True)
    process.start()
    return process, started


def _finish(processes, results, count: int) -> list[dict]:
    try:
        got = [results.get(timeout=JOIN_S) for _ in range(count)]
    finally:
        for process in processes:
            process.join(JOIN_S)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes), [process.exitcode for process in processes]
    return sorted(got, key=lambda r: (r["seed"], r["reused"]))


def _temporaries(out: Path) -> list[Path]:
    return sorted(out.glob(".shards-*.tmp-*")) + sorted(out.glob(".shards-*.old-*"))


def test_two_writers_of_one_key_take_turns_and_the_second_reuses_the_first(inputs, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")  # (fork after the tokenizers library ran threads can hang)
    out, results = tmp_path / "data", ctx.Queue()
    first, started = _start(ctx, inputs, out, 0, 1.0, results)
    assert started.wait(JOIN_S)  # it holds the key's lock, mid-write
    second, _ = _start(ctx, inputs, out, 0, 0.0, results)
    got = _finish([first, second], results, 2)
    assert [r["reused"] for r in got] == [False, True] and got[0]["key"] == got[1]["key"]
    assert got[0]["index"] == got[1]["index"] and shards_complete(got[0]["index"])
    assert len(list(out.glob("shards-*"))) == 1 and not _temporaries(out)


def test_writers_of_two_keys_at_once_keep_their_own_files(inputs, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out, results = tmp_path / "data", ctx.Queue()
    slow, started = _start(ctx, inputs, out, 0, 1.0, results)
    assert started.wait(JOIN_S)
    fast, _ = _start(ctx, inputs, out, 1, 0.0, results)  # packs and publishes while the other is still writing
    a, b = _finish([slow, fast], results, 2)
    assert not a["reused"] and not b["reused"] and a["key"] != b["key"] and a["index"] != b["index"]
    for result in (a, b):
        assert shards_complete(result["index"]) and read_index(result["index"])["key"] == result["key"]
        data = ShardDataset(result["index"], shuffle=False)
        assert data.rows(np.arange(len(data))).shape == (len(data), SEQ_LEN + 1)
    # the top-level index names the files of the key prepared last, which are whole
    view = read_index(out / "train.json")
    assert view["key"] in (a["key"], b["key"]) and len(ShardDataset(out / "train.json")) == view["num_rows"]
    assert not _temporaries(out)


def test_a_reader_keeps_reading_while_another_key_is_packed_in_its_directory(inputs, tmp_path: Path) -> None:
    """A run resuming (a new ShardDataset over its shards) while a run with another seed packs the same --data-dir
    failed with "mmap length is greater than file size" or a missing index: the other run deleted and rewrote them."""
    out = tmp_path / "data"
    mine = _prepare(*inputs, out, 0)
    expected = mine.dataset("train", shuffle=False).rows(np.arange(mine.metadata["splits"]["train"]["rows"]))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    other, started = _start(ctx, inputs, out, 1, 0.5, results)
    reads = 0
    try:
        while other.is_alive() or reads < 3:
            data = ShardDataset(mine.train_index, shuffle=False)
            np.testing.assert_array_equal(data.rows(np.arange(len(data))), expected)
            len(ShardDataset(out / "train.json"))  # the top-level view is whole too, whichever key it names
            reads += 1
            if other.exitcode is not None and not results.empty():
                break
    finally:
        (result,) = _finish([other], results, 1)
    assert started.is_set() and reads >= 3 and not result["reused"]
    assert shards_complete(mine.train_index) and mine.metadata["key"] != result["key"]


def test_a_killed_writer_blocks_nothing_and_its_temporaries_are_removed(inputs, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out, results = tmp_path / "data", ctx.Queue()
    victim, started = _start(ctx, inputs, out, 1, JOIN_S, results)
    assert started.wait(JOIN_S)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(JOIN_S)
    assert victim.exitcode == -signal.SIGKILL
    leftovers = _temporaries(out)
    assert leftovers and not list(out.glob("shards-*"))  # its work directory, never published
    # Another key's writer finds the dead writer's lock free and removes its work directory.
    other = _prepare(*inputs, out, 0, lock_timeout=5)
    assert not other.metadata["reused"] and not _temporaries(out)
    # The killed writer's key is prepared at once (the kernel dropped its lock), whole.
    start = time.monotonic()
    again = _prepare(*inputs, out, 1, lock_timeout=5)
    assert time.monotonic() - start < 5 and not again.metadata["reused"] and shards_complete(again.train_index)
    assert shards_complete(other.train_index) and not _temporaries(out)


def test_a_lock_held_too_long_is_one_line_naming_its_holder(inputs, tmp_path: Path) -> None:
    key = _prepare(*inputs, tmp_path / "first", 0).metadata["key"]
    out = tmp_path / "data"
    out.mkdir()
    with held_lock(out / f".{set_name(key)}.lock", 5), pytest.raises(
        TimeoutError, match=rf"token shards lock .* is still held by process {os.getpid()} after 0\.3 s"
    ):
        _prepare(*inputs, out, 0, lock_timeout=0.3)
    assert not list(out.glob("shards-*")) and not _temporaries(out)


def test_a_file_system_without_locks_still_prepares_with_a_warning(inputs, tmp_path: Path, monkeypatch, caplog) -> None:
    """Where flock is refused (ENOLCK: some network file systems) the shards are prepared unlocked, as before."""
    import errno
    import fcntl
    import logging

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        data = _prepare(*inputs, tmp_path / "data", 0)
    assert shards_complete(data.train_index) and "cannot be taken (No locks available)" in caplog.text
