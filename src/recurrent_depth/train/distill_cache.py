"""Cached teacher logits: the teacher's top-k over every training row, written once, read while training.

    <cache>/manifest.json        format, version, data key, rows, seq_len, k, vocab_size, index dtype,
                                 teacher (directory, depth, identity, random_state, seed; raw logits),
                                 write_batch_size, shards
    <cache>/values_00000.npy     float16 [rows, seq_len, k]   the teacher's k largest logits, descending
    <cache>/indices_00000.npy    int16 / int32 [rows, seq_len, k]   their token ids (int16 when vocab <= 32767)

Bytes per token: k * (2 + 2) with int16 indices (k * 6 with int32): 256 bytes at k = 64 and vocab <= 32767,
against 4 * vocab for full fp32 logits (16 KB at vocab 4096, 262 KB at 65536). `bytes_per_token` prints it.

Rows are stored in the shards' storage order (row i of the train split); the trainer finds a batch row's
cache row by its tokens (`CachedTeacher.lookup`: a hash of the row's token ids -> storage index), so the
shuffled order, epochs and resumes need nothing extra. A cache is refused (one-line ValueError naming the
directory to delete or the option to point elsewhere) when its data key, row count, seq_len or k differs from the
run's, whatever its teacher (`matching_manifest`, checked first: a cache of other rows is never written over), or
a batch row is not in it; a cache of another
teacher (`teacher_change`: its identity, a hash of config.json and the weight files' names, sizes and mtimes, or
its depth differs) or of other teacher noise (a teacher whose initial state is random: the seed or the write batch
size, which fix each row's draw, differs) is written again by the trainer, which says why; settings the cache does
not depend on (temperature, alpha, the learning rate, the data order) reuse it. Files are read with
`np.load(allow_pickle=False)`, memory-mapped, shapes and dtypes checked against the manifest.

Crash safety: each shard is written under a temporary name, fsynced and renamed when whole, and the manifest
(the completeness marker) last, the same way: a write killed midway leaves no manifest. After each whole shard
`progress.json` (atomically too) lists the shards done with the cache's settings; the next write with the same
settings checks those shards' shapes and resumes after the last whole one (the rows come out the same as in
one go: each batch's teacher noise is seeded by its first row), other settings start over. A shard found
truncated on load (a copy cut short) is a one-line error.

Runs started together with one cache (a sweep's --jobs) write it one at a time under an flock (`WRITE_LOCK`); one
that waited finds the cache written with its settings and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    AtomicFile,
    atomic_write_text,
    clipped,
    held_lock,
    open_regular,
    read_json,
    reopen_path,
)

CACHE_FORMAT = "rdepth-distill-cache"
CACHE_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"  # the shards written so far, while a write is under way
WRITE_LOCK = ".write.lock"  # held while a process writes the cache (an flock: dropped when its holder dies)
ROWS_PER_SHARD = 1024


def index_dtype(vocab_size: int) -> np.dtype:
    """The smallest signed integer type that holds every token id."""
    return np.dtype(np.int16) if vocab_size <= np.iinfo(np.int16).max + 1 else np.dtype(np.int32)


def bytes_per_token(top_k: int, vocab_size: int) -> int:
    return top_k * (2 + index_dtype(vocab_size).itemsize)


def row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.int64).tobytes(), digest_size=16).digest()


def write_cache(teacher_logits: Any, dataset: Any, out: str | Path, *, top_k: int, vocab_size: int,
                data_key: str | None, teacher_info: dict[str, Any], batch_size: int = 8,
                log: Any = print) -> dict[str, Any]:
    """Run `teacher_logits(input_ids [B, T], first_row) -> [B, T, V]` over every row of `dataset` (a ShardDataset,
    storage order) and write the top-k shards and manifest to `out`; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Runs started together with one cache (a sweep's --jobs) write it one at a time: the shards' temporary names
    # are fixed, so two writers tore each other's files. No time limit: a live holder is writing (hours for a
    # large teacher), and a dead one's lock is gone.
    with held_lock(out / WRITE_LOCK, float("inf"), "the distill cache write lock"):
        return _write_cache_locked(teacher_logits, dataset, out, top_k=top_k, vocab_size=vocab_size,
                                   data_key=data_key, teacher_info=teacher_info, batch_size=batch_size, log=log)


def _write_cache_locked(teacher_logits: Any, dataset: Any, out: Path, *, top_k: int, vocab_size: int,
                        data_key: str | None, teacher_info: dict[str, Any], batch_size: int,
                        log: Any) -> dict[str, Any]:
    seq_len = int(dataset.row_len) - 1
    k = min(top_k, vocab_size)
    idx_type = index_dtype(vocab_size)
    header = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "data_key": data_key, "num_rows": len(dataset),
              "seq_len": seq_len, "top_k": k, "vocab_size": vocab_size, "index_dtype": idx_type.name,
              "bytes_per_token": bytes_per_token(k, vocab_size), "teacher": teacher_info,
              # a recurrent teacher's s_0 is drawn once per write batch: the rows' noise depends on it
              "write_batch_size": batch_size}
    written = _read_manifest(out)
    if written is not None and {key: written.get(key) for key in header} == json.loads(json.dumps(header)):
        log(f"distill cache: {out} was written meanwhile with these settings (by another run): reusing it")
        return written
    (out / MANIFEST).unlink(missing_ok=True)  # (an earlier cache's: its shards are written over from here on)
    shards = _finished_shards(out, header, (seq_len, k), idx_type, log)
    for first in range(len(shards) * ROWS_PER_SHARD, len(dataset), ROWS_PER_SHARD):
        rows = np.arange(first, min(first + ROWS_PER_SHARD, len(dataset)))
        values = np.empty((rows.size, seq_len, k), dtype=np.float16)
        indices = np.empty((rows.size, seq_len, k), dtype=idx_type)
        for start in range(0, rows.size, batch_size):
            chunk = torch.from_numpy(dataset.rows(rows[start:start + batch_size]))
            logits = teacher_logits(chunk[:, :-1], int(rows[start])).float()
            top = logits.topk(k, dim=-1)
            values[start:start + chunk.shape[0]] = top.values.cpu().numpy().astype(np.float16)
            indices[start:start + chunk.shape[0]] = top.indices.cpu().numpy().astype(idx_type)
        number = len(shards)
        # each shard under a temporary name, fsynced and renamed when whole: a kill leaves no torn shard
        for name, array in ((f"values_{number:05d}.npy", values), (f"indices_{number:05d}.npy", indices)):
            with AtomicFile(out / name) as handle:
                np.save(handle, array)
        shards.append({"values": f"values_{number:05d}.npy", "indices": f"indices_{number:05d}.npy",
                       "num_rows": int(rows.size)})
        # the shards whole on disk so far, for a write killed later to resume from (after both files are renamed)
        atomic_write_text(out / PROGRESS, json.dumps({**header, "rows_per_shard": ROWS_PER_SHARD,
                                                      "shards": shards}, indent=2) + "\n")
    manifest = {**header, "shards": shards}
    # the manifest is the completeness marker: written last, atomically, after every shard is on disk
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    (out / PROGRESS).unlink(missing_ok=True)
    log(f"distill cache: {len(dataset)} rows x {seq_len} tokens, top-{k}, {manifest['bytes_per_token']} bytes "
        f"per token (fp16 values + {idx_type.name} indices; full fp32 logits: {4 * vocab_size}) -> {out}")
    return manifest


def _finished_shards(out: Path, header: dict[str, Any], row_shape: tuple[int, int], idx_type: np.dtype,
                     log: Any) -> list[dict[str, Any]]:
    """The shards an interrupted write of this very cache (same header, shard size) left whole in `out`, in
    order, per its progress file; none where there is no such file or it belongs to other settings. A shard
    the file lists is used only if both its files load with the expected shape (else it and later ones are
    written again)."""
    path = out / PROGRESS
    if not path.is_file():
        return []
    try:
        progress = read_json(path, CONFIG_MAX_BYTES, "distill cache progress")
    except (OSError, ValueError):
        return []
    expected = json.loads(json.dumps({**header, "rows_per_shard": ROWS_PER_SHARD}))
    if not isinstance(progress, dict) or any(progress.get(key) != value for key, value in expected.items()):
        log(f"distill cache: {out / PROGRESS} is from other settings; writing the cache from the start")
        return []
    listed = progress.get("shards")
    done: list[dict[str, Any]] = []
    for number, shard in enumerate(listed if isinstance(listed, list) else []):
        rows = min(ROWS_PER_SHARD, header["num_rows"] - number * ROWS_PER_SHARD)
        names = {"values": f"values_{number:05d}.npy", "indices": f"indices_{number:05d}.npy"}
        if rows <= 0 or shard != {**names, "num_rows": rows}:
            break
        if not all((out / name).is_file() for name in names.values()):  # (a FIFO would hang np.load)
            break
        try:
            shapes = [(a.shape, a.dtype) for a in (np.load(out / names[kind], mmap_mode="r", allow_pickle=False)
                                                   for kind in ("values", "indices"))]
        except (OSError, ValueError, EOFError):
            break
        if shapes != [((rows, *row_shape), np.dtype(np.float16)), ((rows, *row_shape), idx_type)]:
            break
        done.append(shard)
    if done:
        log(f"distill cache: resuming after {len(done)} whole shard(s) ({sum(d['num_rows'] for d in done)} of "
            f"{header['num_rows']} rows) in {out}")
    return done


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """The finished cache's manifest in `out`; None when there is none or it cannot be read."""
    try:
        manifest = read_json(out / MANIFEST, CONFIG_MAX_BYTES, "distill cache manifest")
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def has_cache(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def teacher_change(path: str | Path, teacher_info: dict[str, Any], write_batch_size: int) -> str | None:
    """Why the finished cache at `path` holds other teacher logits than this run's teacher would write: a line
    saying so when the teacher's identity (config and weight files) or depth differs, or, for a teacher that draws
    its initial state at random (`random_state`), the seed or the write batch size (`write_batch_size`: rows
    that share one draw) that fixed its noise; None when nothing differs, or when the cache records no identity
    (written before identities were) or cannot be read (`CachedTeacher` says why). `teacher_info`:
    `distill.teacher_summary` with the run's `seed`. (Options applied after the cache, such as the temperature,
    alpha or learning rate, are not in it: changing them reuses the cache.)"""
    try:
        manifest = read_json(Path(path) / MANIFEST, CONFIG_MAX_BYTES, "distill cache manifest")
    except (OSError, ValueError):
        return None
    recorded = manifest.get("teacher") if isinstance(manifest, dict) else None
    if not isinstance(recorded, dict) or "identity" not in recorded:
        return None
    directory = teacher_info.get("directory")
    noisy = teacher_info.get("random_state", True)  # (the same identity: the same state_init as the recorded one)
    # What the manifest records is shown clipped (a file can hold megabytes there); a malformed value differs
    # from this run's, so the cache is written again.
    if recorded.get("identity") != teacher_info.get("identity"):
        reason = (f"the teacher {directory} changed since (its config.json or weight files differ)"
                  if recorded.get("directory") == directory else
                  f"it is the cache of teacher {clipped(recorded.get('directory'))}, not of {directory}")
    elif recorded.get("depth") != teacher_info.get("depth"):
        reason = (f"it holds the teacher at depth {clipped(recorded.get('depth'))}, this run's is "
                  f"{teacher_info.get('depth')}")
    elif noisy and recorded.get("seed") != teacher_info.get("seed"):
        reason = (f"its teacher's initial states were drawn with seed {clipped(recorded.get('seed'))}, this run's "
                  f"seed is {teacher_info.get('seed')}")
    elif noisy and manifest.get("write_batch_size") != write_batch_size:
        reason = (f"its teacher's initial states were drawn per batch of {clipped(manifest.get('write_batch_size'))} "
                  f"rows, this run's batch_size is {write_batch_size}")
    else:
        return None
    return f"distill cache: {path} is out of date ({reason}): writing it again"


def rewrite_hint(path: Path) -> str:
    """How a run gets its own cache where `path` holds another's (one directory holds one cache)."""
    return f"delete {path} to write it again for this run, or give --distill-cache (distill_cache) another directory"


def matching_manifest(path: str | Path, dataset: Any, *, top_k: int, vocab_size: int, data_key: str | None,
                      seed: int | None = None) -> dict[str, Any]:
    """The manifest of the finished cache at `path` when it holds this run's rows (data key, row count, seq_len), k
    and vocabulary; else a one-line ValueError naming the first that differs and how to get this run's cache.
    Checked before `teacher_change` for every teacher: a cache of other rows is never written over. `seed`: the
    run's, named when the data key differs with it (the trainer's --seed also splits and packs the data)."""
    path = Path(path)
    manifest = read_json(path / MANIFEST, CONFIG_MAX_BYTES, "distill cache manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        raise ValueError(f"distill_cache {path}: {MANIFEST} is not a {CACHE_FORMAT} manifest ({rewrite_hint(path)})")
    expected = {"version": CACHE_VERSION, "data_key": data_key, "num_rows": len(dataset),
                "seq_len": int(dataset.row_len) - 1, "top_k": min(top_k, vocab_size), "vocab_size": vocab_size,
                "index_dtype": index_dtype(vocab_size).name}
    for name, value in expected.items():
        if manifest.get(name) != value:
            recorded = manifest.get("teacher")
            written_seed = recorded.get("seed") if isinstance(recorded, dict) else None
            why = (f"; it was written with seed {clipped(written_seed)}, this run's is {seed}, and the seed also "
                   f"splits and packs the training data" if name == "data_key" and seed is not None
                   and written_seed is not None and written_seed != seed else "")
            raise ValueError(f"distill_cache {path} does not match this run: its {name} is "
                             f"{clipped(manifest.get(name))}, the run's {value!r}{why} ({rewrite_hint(path)})")
    return manifest


class CachedTeacher:
    """The cache at `path`, checked against the run's data; `top(batch)` gives (values, indices) per row."""

    def __init__(self, path: str | Path, dataset: Any, *, top_k: int, vocab_size: int, data_key: str | None) -> None:
        self.path = Path(path)
        self.manifest = manifest = matching_manifest(path, dataset, top_k=top_k, vocab_size=vocab_size,
                                                     data_key=data_key)
        seq_len = int(dataset.row_len) - 1
        self.values: list[np.ndarray] = []
        self.indices: list[np.ndarray] = []
        self.vocab_size = vocab_size
        starts = [0]
        shards = manifest.get("shards")
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and isinstance(s.get("values"), str) and isinstance(s.get("indices"), str)
                and isinstance(s.get("num_rows"), int) and not isinstance(s["num_rows"], bool) and s["num_rows"] >= 0
                for s in shards):
            raise ValueError(f"distill_cache {self.path}: {MANIFEST} 'shards' must be a list of objects with string "
                             f"'values' and 'indices' file names and an integer 'num_rows' >= 0")
        for shard in shards:
            rows = int(shard["num_rows"])
            shape = (rows, seq_len, manifest["top_k"])
            for kind, dtype, into in (("values", np.float16, self.values),
                                      ("indices", index_dtype(vocab_size), self.indices)):
                name = Path(str(shard[kind])).name  # no paths outside the cache
                # a regular file (a FIFO hung np.load), memory-mapped through the very file checked
                fd, _ = open_regular(self.path / name, None, "distill cache shard")
                with os.fdopen(fd, "rb") as handle:
                    try:
                        array = np.load(reopen_path(handle, self.path / name), mmap_mode="r", allow_pickle=False)
                    except (ValueError, EOFError) as exc:  # (a truncated .npy: "mmap length is greater ...")
                        raise ValueError(f"distill_cache {self.path / name} is truncated or damaged "
                                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): "
                                         f"the cache is incomplete; delete {self.path} to write it "
                                         f"again") from None
                if array.shape != shape or array.dtype != dtype:
                    raise ValueError(f"distill_cache {self.path / name}: shape {array.shape} {array.dtype}, "
                                     f"expected {shape} {np.dtype(dtype).name}")
                into.append(array)
            starts.append(starts[-1] + rows)
        if starts[-1] != len(dataset):
            raise ValueError(f"distill_cache {self.path}: its shards hold {starts[-1]} rows, the run's {len(dataset)} "
                             f"({rewrite_hint(self.path)})")
        self.starts = np.asarray(starts)
        self.row_of = {row_key(dataset.rows([i])[0]): i for i in range(len(dataset))}

    def lookup(self, row: np.ndarray) -> int:
        index = self.row_of.get(row_key(row))
        if index is None:
            raise ValueError(f"distill_cache {self.path}: a training row is not in the cache (the cache belongs "
                             f"to other shards: {rewrite_hint(self.path)})")
        return index

    def top(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(values float32 [B, T, k], indices int64 [B, T, k]) for the batch's rows."""
        rows = torch.cat([batch["input_ids"][:, :1], batch["targets"]], dim=1).cpu().numpy()
        values, indices = [], []
        for row in rows:
            i = self.lookup(row)
            shard = int(np.searchsorted(self.starts, i, side="right") - 1)
            values.append(np.asarray(self.values[shard][i - self.starts[shard]], dtype=np.float32))
            indices.append(np.asarray(self.indices[shard][i - self.starts[shard]], dtype=np.int64))
        values_, indices_ = np.stack(values), np.stack(indices)
        # (checked per batch, not per file: a cache is gigabytes; an id out of range was an IndexError from the loss)
        if indices_.size and (indices_.min() < 0 or indices_.max() >= self.vocab_size):
            raise ValueError(f"distill_cache {self.path}: token ids in [{indices_.min()}, {indices_.max()}], outside "
                             f"the vocabulary [0, {self.vocab_size}): the cache is damaged")
        if not np.isfinite(values_).all():
            raise ValueError(f"distill_cache {self.path}: NaN or inf teacher logits: the cache is damaged")
        device = batch["input_ids"].device
        return torch.from_numpy(values_).to(device), torch.from_numpy(indices_).to(device)
