"""Token shards on disk: flat NumPy memmaps of packed rows plus a small JSON index.

Layout of a split called ``train`` in a directory::

    train.json          {"format", "version", "split", "dtype", "seq_len", "row_len",
                         "num_rows", "num_tokens", "shards": [{"file", "num_rows"}], ...}
    train-00000.bin     num_rows * row_len tokens, C order, dtype uint16 (vocab <= 65536) or uint32
    train-00001.bin     ...

Every file is written streaming (rows never accumulate in memory) into a temporary name,
fsynced and renamed, and the index is written after its shards, so a crash leaves either a
complete split or none (`prepare_dataset` also writes a whole key's splits in a private directory
and publishes it by one rename: see data/prepare.py). :class:`ShardDataset` memory-maps the
shards and reads rows lazily in a seeded order whose position is a few plain ints
(:meth:`ShardDataset.state_dict`), so a trainer resumes on exactly the next row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recurrent_depth.config import is_int
from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    AtomicFile,
    atomic_write_text,
    inside,
    naming,
    read_json,
)

if TYPE_CHECKING:  # (imported where a batch is made: the tokenizer tools and corpus readers run without torch)
    import torch

SHARD_FORMAT = "recurrent-depth-token-shards"
SHARD_FORMAT_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 512 * 2**20
_WRITE_BUFFER_ROWS = 1024


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


TOKENIZED_ELSEWHERE = "the data was tokenized for another model (another tokenizer), or is damaged"


def check_token_ids(rows: np.ndarray, vocab_size: int, where: Callable[[int], str],
                    cause: str = TOKENIZED_ELSEWHERE) -> None:
    """A one-line ValueError for the first id of `rows` [N, L] outside [0, vocab_size): its value, the vocabulary,
    `where(n)` of its row (the caller's provenance: a shard file and row, a source file and line), its position
    and the likely `cause`. Host data only (NumPy): it runs on every batch, before the batch reaches the device."""
    if rows.size and (rows.min() < 0 or rows.max() >= vocab_size):
        n, t = np.argwhere((rows < 0) | (rows >= vocab_size))[0]
        raise ValueError(f"token id {int(rows[n, t])}, outside the model's vocabulary [0, {vocab_size}), at "
                         f"{where(int(n))}, position {int(t)}: {cause}")


def _check_ids(tokens: np.ndarray, dtype: np.dtype) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(
            f"token ids must be in [0, {np.iinfo(dtype).max}] for {dtype.name} storage, "
            f"got range [{tokens.min()}, {tokens.max()}]"
        )


class ShardWriter:
    """Stream rows of ``row_len`` tokens into ``<prefix>-NNNNN.bin`` files of bounded size.

    Use as a context manager; :attr:`shards` lists ``{"file", "num_rows"}`` once closed. On an
    exception the unfinished shard's temporary file is removed.
    """

    def __init__(
        self,
        out_dir: str | Path,
        prefix: str,
        row_len: int,
        dtype: np.dtype | type,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.row_len = int(row_len)
        self.dtype = np.dtype(dtype)
        if self.row_len < 1:
            raise ValueError(f"row_len must be >= 1, got {row_len}")
        integral = isinstance(max_shard_bytes, (int, np.integer)) and not isinstance(max_shard_bytes, bool)
        if not integral or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
        # A bound below one row still stores one row per shard.
        self.rows_per_shard = max(1, int(max_shard_bytes) // (self.row_len * self.dtype.itemsize))
        self.shards: list[dict[str, Any]] = []
        self.num_rows = 0
        self._file: AtomicFile | None = None
        self._handle = None
        self._rows_in_shard = 0
        self._buffer: list[np.ndarray] = []

    def __enter__(self) -> ShardWriter:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException as failure:  # (a full disk at the last flush: remove the unfinished shard)
                self._abandon(failure)
                raise
        else:
            self._abandon(exc)

    def _abandon(self, exc: BaseException) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.__exit__(type(exc), exc, None)

    def write(self, row: np.ndarray) -> None:
        row = np.asarray(row).reshape(-1)
        if row.size != self.row_len:
            raise ValueError(f"row must have {self.row_len} tokens, got {row.size}")
        _check_ids(row, self.dtype)
        self._buffer.append(row.astype(self.dtype))
        if len(self._buffer) >= _WRITE_BUFFER_ROWS:
            self._flush()

    def write_rows(self, rows: Iterable[np.ndarray]) -> None:
        for row in rows:
            self.write(row)

    def _flush(self) -> None:
        pending = self._buffer
        self._buffer = []
        start = 0
        while start < len(pending):
            if self._file is None:
                name = f"{self.prefix}-{len(self.shards):05d}.bin"
                self._file = AtomicFile(self.out_dir / name)
                self._handle = self._file.__enter__()
                self.shards.append({"file": name, "num_rows": 0})
                self._rows_in_shard = 0
            take = min(self.rows_per_shard - self._rows_in_shard, len(pending) - start)
            with naming(self._file.path):
                self._handle.write(np.stack(pending[start : start + take]).tobytes())
            start += take
            self._rows_in_shard += take
            self.num_rows += take
            self.shards[-1]["num_rows"] = self._rows_in_shard
            if self._rows_in_shard == self.rows_per_shard:
                self._close_shard()

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.__exit__(None, None, None)
            self._file = None
            self._handle = None

    def close(self) -> list[dict[str, Any]]:
        if self._buffer:
            self._flush()
        self._close_shard()
        return self.shards


def write_index(path: str | Path, index: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(index, indent=2, sort_keys=True) + "\n")


def read_index(path: str | Path) -> dict[str, Any]:
    """A shard index, checked: its format, `row_len`, `num_rows`, `dtype` and a `shards` list of
    `{"file": a name inside the index's directory, "num_rows": int}`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"shards: index {str(path)!r} does not exist")
    index = read_json(path, CONFIG_MAX_BYTES, "shards: index")
    if not isinstance(index, dict):
        raise ValueError(f"shards: {str(path)!r} is not a {SHARD_FORMAT} index (a JSON {type(index).__name__})")
    if index.get("format") != SHARD_FORMAT or index.get("version") != SHARD_FORMAT_VERSION:
        raise ValueError(
            f"shards: {str(path)!r} is not a {SHARD_FORMAT} v{SHARD_FORMAT_VERSION} index "
            f"(format={index.get('format')!r}, version={index.get('version')!r})"
        )
    shards = index.get("shards")
    if not isinstance(shards, list) or not all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and is_int(s.get("num_rows")) and s["num_rows"] >= 0
        for s in shards
    ):
        raise ValueError(f"shards: {str(path)!r}: 'shards' must be a list of {{'file': name, 'num_rows': int}}")
    for name in ("row_len", "num_rows"):
        if not is_int(index.get(name)) or index[name] < (1 if name == "row_len" else 0):
            raise ValueError(f"shards: {str(path)!r}: {name!r} must be a non-negative integer, got {index.get(name)!r}")
    if index.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"shards: {str(path)!r}: 'dtype' must be uint16 or uint32, got {index.get('dtype')!r}")
    return index


def shard_file(index_path: str | Path, shard: dict[str, Any], allow_outside: bool = False) -> Path:
    """The file of one shard entry, inside the index's directory unless `allow_outside`."""
    return inside(Path(index_path).parent, shard["file"], f"shards: {Path(index_path).name} names file",
                  allow_outside)


def shards_complete(index_path: str | Path) -> bool:
    """True when the index exists and every shard it lists has exactly the expected size."""
    try:
        index = read_index(index_path)
        files = [shard_file(index_path, shard) for shard in index["shards"]]
    except (ValueError, OSError):
        return False
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard, file in zip(index["shards"], files):
        if not file.is_file() or file.stat().st_size != shard["num_rows"] * index["row_len"] * itemsize:
            return False
    return True


class ShardDataset:
    """Lazily read packed rows ``[row_len]`` from a shard index, in a seeded, resumable order.

    Order: epoch ``e`` visits every row once in ``default_rng([seed, e]).permutation(len)``
    (or in storage order with ``shuffle=False``). :meth:`next_batch` consumes
    ``batch_size * world_size`` rows of that order per call and returns this rank's
    ``batch_size`` of them, so all ranks share one position and see disjoint rows.

    Resume: ``state_dict()`` is ``{"epoch", "position", "seed", "num_rows", "shuffle",
    "world_size"}`` (plain ints); ``load_state_dict`` restores it and checks that the data and
    settings match.

    ``vocab_size`` (the model's): every row read is checked to hold ids in ``[0, vocab_size)``, and an
    id outside is a one-line error naming its shard file, its row there (:meth:`where`) and its position.
    """

    def __init__(
        self,
        index_path: str | Path,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        allow_outside: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1 or None, got {vocab_size!r}")
        self.vocab_size = vocab_size
        if world_size < 1 or not (0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if not is_int(seed) or seed < 0:  # (numpy's own error came at the first batch, naming no seed)
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.index_path = Path(index_path)
        self.index = read_index(self.index_path)
        self.row_len: int = int(self.index["row_len"])
        self.seq_len: int = self.row_len - 1
        self.dtype = np.dtype(self.index["dtype"])
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank = rank
        self.world_size = world_size
        counts = [int(s["num_rows"]) for s in self.index["shards"]]
        self._starts = np.cumsum([0] + counts)  # global row index where each shard begins
        self.num_rows = int(self._starts[-1])
        if self.num_rows != int(self.index["num_rows"]):
            raise ValueError(f"shards: {self.index_path} lists {self.num_rows} rows, header says "
                             f"{self.index['num_rows']}")
        self._files = [shard_file(self.index_path, shard, allow_outside) for shard in self.index["shards"]]
        for file, rows in zip(self._files, counts):
            expected = rows * self.row_len * self.dtype.itemsize
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"has {size} bytes"
                raise ValueError(
                    f"shards: {file} {found}, expected {expected} ({rows} rows of {self.row_len} "
                    f"{self.dtype.name} tokens); the split is incomplete or damaged, prepare it again"
                )
        self._maps: list[np.memmap | None] = [None] * len(counts)
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_rows

    def _shard(self, k: int) -> np.memmap:
        mapped = self._maps[k]
        if mapped is None:
            file = self._files[k]
            rows = int(self.index["shards"][k]["num_rows"])
            mapped = np.memmap(file, dtype=self.dtype, mode="r", shape=(rows, self.row_len))
            self._maps[k] = mapped
        return mapped

    def __getitem__(self, i: int) -> np.ndarray:
        """Row ``i`` in storage order, as int64 ``[row_len]``."""
        if not (-self.num_rows <= i < self.num_rows):
            raise IndexError(f"row {i} out of range for {self.num_rows} rows")
        return self.rows([i % self.num_rows])[0]

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows at storage indices, int64 ``[len(indices), row_len]``."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((indices.size, self.row_len), dtype=np.int64)
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        for k in np.unique(shard_of):
            sel = shard_of == k
            out[sel] = self._shard(int(k))[indices[sel] - self._starts[k]]
        if self.vocab_size is not None:  # (the rows' storage indices name them only if an id is bad)
            check_token_ids(out, self.vocab_size, lambda n: self.where(int(indices[n])))
        return out

    def where(self, index: int) -> str:
        """Storage row `index` as a user finds it: its shard file and 0-based row there (and this rank's number
        under torchrun)."""
        k = int(np.searchsorted(self._starts, index, side="right") - 1)
        rank = f" (rank {self.rank} of {self.world_size})" if self.world_size > 1 else ""
        return f"{self._files[k]} row {index - int(self._starts[k])}{rank}"

    def order(self, epoch: int) -> np.ndarray:
        """Storage indices in the order epoch ``epoch`` visits them."""
        if self._order_epoch != epoch or self._order is None:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                self._order = np.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """This rank's next ``batch_size`` rows, int64 ``[batch_size, row_len]``; crosses epochs."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.num_rows == 0:
            raise ValueError(f"shards: {self.index_path} holds no rows")
        need = batch_size * self.world_size
        picked: list[np.ndarray] = []
        while need > 0:
            order = self.order(self.epoch)
            take = min(need, self.num_rows - self.position)
            picked.append(order[self.position : self.position + take])
            self.position += take
            need -= take
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
        chosen = np.concatenate(picked)[self.rank * batch_size : (self.rank + 1) * batch_size]
        import torch

        return torch.from_numpy(self.rows(chosen))

    def iter_batches(self, batch_size: int, drop_last: bool = False) -> Iterator[torch.Tensor]:
        """One pass in storage order (for evaluation); this rank's share; leaves the position alone."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        import torch

        mine = np.arange(self.rank, self.num_rows, self.world_size)
        for start in range(0, mine.size, batch_size):
            chunk = mine[start : start + batch_size]
            if drop_last and chunk.size < batch_size:
                return
            yield torch.from_numpy(self.rows(chunk))

    def state_dict(self) -> dict[str, int | str]:
        state: dict[str, int | str] = {
            "epoch": int(self.epoch),
            "position": int(self.position),
            "seed": self.seed,
            "num_rows": self.num_rows,
            "shuffle": int(self.shuffle),
            "world_size": self.world_size,
        }
        if "key" in self.index:
            # What the rows were built from (corpus, tokenizer, packing): rebuilt shards with the same row
            # count are still other data.
            state["data_key"] = str(self.index["key"])
        return state

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        for key in ("epoch", "position", "seed", "num_rows", "shuffle", "world_size"):
            if not is_int(state.get(key)) or state[key] < 0:  # (a state of another data source, or damaged)
                raise ValueError(f"data state: {key!r} must be an int >= 0, got {state.get(key)!r}; "
                                 "resume from a checkpoint of a run on token shards")
        for key in ("seed", "num_rows", "shuffle", "world_size"):
            mine = self.state_dict()[key]
            if int(state[key]) != mine:
                raise ValueError(
                    f"data state: {key}={state[key]} in the checkpoint but {mine} here; "
                    "resume with the same data, seed and world size"
                )
        saved_key, my_key = state.get("data_key"), self.state_dict().get("data_key")
        if saved_key is not None and my_key is not None and saved_key != my_key:
            raise ValueError(
                f"data state: the checkpoint's rows were built from other data (key {str(saved_key)[:12]}...) than "
                f"{self.index_path} (key {my_key[:12]}...: another corpus, tokenizer or packing); resume "
                "with the same data"
            )
        position = int(state["position"])
        if not (0 <= position < max(self.num_rows, 1)):
            raise ValueError(f"data state: position must be in [0, {self.num_rows}), got {position}")
        self.epoch = int(state["epoch"])
        self.position = position


class TokenizedDocs(Sequence):
    """Variable-length token lists on disk (``<prefix>.tokens`` + ``<prefix>.offsets``).

    The intermediate between tokenising and packing: it lets the packer visit documents in a
    shuffled order without holding the corpus's tokens in memory.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        self.offsets = np.fromfile(self._path(".offsets"), dtype=np.int64)
        total = int(self.offsets[-1])
        self.tokens = (
            np.memmap(self._path(".tokens"), dtype=self.dtype, mode="r", shape=(total,))
            if total
            else np.empty(0, dtype=self.dtype)
        )

    def _path(self, suffix: str) -> Path:
        return self.prefix.with_name(self.prefix.name + suffix)

    @classmethod
    def write(cls, prefix: str | Path, docs: Iterable[np.ndarray], dtype: np.dtype | type) -> TokenizedDocs:
        prefix = Path(prefix)
        dtype = np.dtype(dtype)
        tokens_path = prefix.with_name(prefix.name + ".tokens")
        offsets_path = prefix.with_name(prefix.name + ".offsets")
        end = 0
        pending = [0]
        with naming(tokens_path), open(tokens_path, "wb") as tokens_file, open(offsets_path, "wb") as offsets_file:
            for doc in docs:
                arr = np.asarray(doc).reshape(-1)
                _check_ids(arr, dtype)
                tokens_file.write(arr.astype(dtype).tobytes())
                end += arr.size
                pending.append(end)
                if len(pending) >= 65536:
                    offsets_file.write(np.asarray(pending, dtype=np.int64).tobytes())
                    pending = []
            offsets_file.write(np.asarray(pending, dtype=np.int64).tobytes())
        return cls(prefix, dtype)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            raise TypeError("TokenizedDocs does not support slicing")
        if not (0 <= i < len(self)):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        return np.asarray(self.tokens[self.offsets[i] : self.offsets[i + 1]], dtype=np.int64)

    def delete(self) -> None:
        self.tokens = np.empty(0, dtype=self.dtype)  # release the memmap before unlinking
        for suffix in (".tokens", ".offsets"):
            self._path(suffix).unlink(missing_ok=True)
