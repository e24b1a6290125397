"""`prepare_dataset`: corpus -> document split -> tokens -> packed rows -> shards on disk.

Streaming throughout: documents are read one at a time, tokenised in small batches into a
temporary on-disk store, then packed (in a seeded document order) straight into shard files.
Peak memory is one batch of documents plus one shard write buffer, whatever the corpus size.

The output directory is a cache: ``dataset.json`` records a key over everything that
determines the rows (corpus hash, tokenizer hash, every packing parameter); a later call with
the same key reuses the shards instead of rebuilding them.

Several processes may share the directory (a sweep's runs, two seeds started at once): each key's
shards live in their own subdirectory ``shards-<key[:16]>/``, built in a hidden temporary one and
published by one rename, and never changed or removed by a writer of another key, so a reader
never sees a partial file. Two writers of one key take turns (an flock on ``.shards-<key[:16]>.lock``;
the second reuses the first's shards), and the temporaries of a writer that died are removed by the
next writer that finds their key's lock free. The top-level ``dataset.json``, ``train.json`` and
``validation.json`` describe the key prepared (or reused) last, for tools that open the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from recurrent_depth.config import is_int
from recurrent_depth.data.corpus import Corpus, Document, DocumentSplit, load_corpus, require_text
from recurrent_depth.data.packing import PackingStats, pack_documents, tokenize_documents
from recurrent_depth.data.shards import (
    DEFAULT_MAX_SHARD_BYTES,
    SHARD_FORMAT,
    SHARD_FORMAT_VERSION,
    ShardDataset,
    ShardWriter,
    TokenizedDocs,
    read_index,
    shards_complete,
    token_dtype,
    write_index,
)
from recurrent_depth.data.tokenizer import document_token_ids, load_tokenizer, tokenizer_sha256, vocab_span
from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    held_lock,
    read_json,
    remove_tree,
)

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
PREPARE_VERSION = 1
SPLITS = ("train", "validation")
SET_PREFIX = "shards-"  # one key's shards: out_dir/shards-<key[:16]>/
# How long a writer waits for another packing the same key (a large corpus takes hours), then says who holds it.
PREPARE_LOCK_TIMEOUT_S = 6 * 3600.0
VIEW_LOCK_TIMEOUT_S = 300.0  # the top-level indexes are a few small files: rewritten in well under a second


@dataclass
class PreparedDataset:
    """Where the shards are, plus the metadata a run should record."""

    out_dir: Path
    train_index: Path
    val_index: Path | None  # None when val_fraction == 0
    metadata: dict[str, Any]

    def dataset(self, split: str = "train", **kwargs: Any) -> ShardDataset:
        """A :class:`ShardDataset` over one split (kwargs: seed, shuffle, rank, world_size, vocab_size)."""
        if split == "train":
            return ShardDataset(self.train_index, **kwargs)
        if split == "validation":
            if self.val_index is None:
                raise ValueError("split 'validation' does not exist: prepared with val_fraction=0")
            return ShardDataset(self.val_index, **kwargs)
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")


def _count_bytes(docs: Iterator[Document], counter: dict[str, int]) -> Iterator[Document]:
    for doc in docs:
        counter["documents"] += 1
        counter["bytes"] += len(doc.text.encode("utf-8"))
        yield doc


def _progress(docs: Iterator[Document], total: int | None, label: str, enabled: bool) -> Iterator[Document]:
    if not enabled:
        return docs
    from tqdm import tqdm

    return iter(tqdm(docs, total=total, desc=f"tokenising {label}", unit="doc", disable=None))  # terminal only


def prepare_dataset(
    corpus_spec: str | Path | Corpus,
    tokenizer: Tokenizer | str | Path,
    seq_len: int,
    out_dir: str | Path,
    val_fraction: float = 0.05,
    seed: int = 0,
    *,
    keep_all: bool = False,
    val_keep_all: bool = True,
    append_eos: bool = True,
    shuffle_documents: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    batch_size: int = 64,
    progress: bool = False,
    lock_timeout: float = PREPARE_LOCK_TIMEOUT_S,
) -> PreparedDataset:
    """Write train (and validation) shards of ``seq_len + 1``-token rows; reuse them if current.

    Args:
        corpus_spec: ``"stdlib"``, a directory (of text files, of ``.parquet`` files, or a saved
            dataset), a ``.jsonl`` or ``.parquet`` file (text field ``text``), or a :class:`Corpus`
            (``load_corpus(spec, text_field=...)`` for another field).
        tokenizer: a `tokenizers.Tokenizer`, or a directory / ``tokenizer.json`` path.
        seq_len: model context; rows hold ``seq_len + 1`` tokens (inputs + shifted labels).
        out_dir: the shards' directory (a cache); not inside a directory corpus, which would read them
            as documents (a ValueError; a hidden directory in it is fine).
        val_fraction: share of documents held out, decided per document id (see
            :class:`DocumentSplit`); 0 writes no validation split.
        seed: seeds the split and the document order before packing.
        keep_all: False = the paper's rule for training rows (a row that fills drops the rest
            of its document); True = keep every token.
        val_keep_all: the same switch for validation rows; default True so the small held-out
            set is not thinned.
        append_eos: end every document with ``<|end_text|>`` (``<|begin_text|>`` always starts
            one), so a model learns where documents end.
        shuffle_documents: pack documents in a seeded random order rather than corpus order.
        max_shard_bytes: size bound of one shard file.
        batch_size: documents per tokenizer call.
        progress: show tqdm bars.
        lock_timeout: seconds to wait for another process packing the same key (its shards are then
            reused) before a TimeoutError naming that process.
    Returns:
        :class:`PreparedDataset` with index paths and metadata: ``corpus`` (CorpusInfo),
        ``tokenizer`` (hash, vocab size: its largest id + 1, special ids), ``params``, ``splits`` (documents,
        bytes, rows, tokens, dropped tokens per split), ``key`` and ``reused``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    if not (0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if not is_int(seed) or seed < 0:  # (numpy's own error came only after every document was tokenised)
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    specials = document_token_ids(tok)  # ours, or a retrofitted model's own document tokens
    # (its largest id + 1, the model's vocabulary: a tokenizer.json numbering a token past its count makes that id)
    vocab_size = vocab_span(tok)
    dtype = token_dtype(vocab_size)
    corpus = load_corpus(corpus_spec)
    _check_out_outside(corpus, Path(out_dir))
    info = corpus.info()
    require_text(info)
    if val_fraction > 0 and info.num_documents == 1:
        # (the split takes whole documents: one of them leaves validation empty whatever val_fraction is)
        raise ValueError(
            f"data: corpus {info.name!r} holds a single document, and the train/validation split takes whole "
            "documents: split its text into several files (or JSONL lines); prepare_dataset(val_fraction=0) "
            "writes no validation split"
        )

    params = {
        "seq_len": seq_len,
        "val_fraction": val_fraction,
        "seed": seed,
        "keep_all": keep_all,
        "val_keep_all": val_keep_all,
        "append_eos": append_eos,
        "shuffle_documents": shuffle_documents,
        "max_shard_bytes": max_shard_bytes,
    }
    tok_meta = {"sha256": tokenizer_sha256(tok), "vocab_size": vocab_size, "special_token_ids": specials}
    key_source = {"version": PREPARE_VERSION, "corpus": info.sha256, "tokenizer": tok_meta["sha256"]}
    key_source.update(params)
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()
    out = Path(out_dir)
    wanted = SPLITS if val_fraction > 0 else SPLITS[:1]
    home = out / set_name(key)

    def _write_shards(work: Path) -> dict[str, Any]:
        """Every split's shards and index, then dataset.json, into the private directory `work`."""
        plan = DocumentSplit.plan(corpus.ids(), val_fraction, seed)
        split_meta: dict[str, dict[str, Any]] = {}
        for k, split in enumerate(wanted):
            counter = {"documents": 0, "bytes": 0}
            docs = _count_bytes(plan.select(iter(corpus), split), counter)
            docs = _progress(docs, None, split, progress)
            store = TokenizedDocs.write(work / f".{split}-docs", tokenize_documents(docs, tok, batch_size), dtype)
            stats = PackingStats()
            row_keep_all = keep_all if split == "train" else val_keep_all
            rows = pack_documents(
                store,
                seq_len,
                specials["begin_text"],
                specials["end_text"] if append_eos else None,
                keep_all=row_keep_all,
                shuffle_seed=(seed, k) if shuffle_documents else None,
                stats=stats,
            )
            with ShardWriter(work, split, seq_len + 1, dtype, max_shard_bytes) as writer:
                writer.write_rows(rows)
            store.delete()
            if writer.num_rows == 0:
                raise ValueError(
                    f"data: the {split} split of {info.name!r} ({counter['documents']} documents, "
                    f"{stats.tokens_in} tokens) does not fill one row of seq_len + 1 = {seq_len + 1} tokens; "
                    "use a smaller seq_len, more data, or (for validation) a larger val_fraction"
                )
            split_meta[split] = {
                "documents": counter["documents"],
                "bytes": counter["bytes"],
                "keep_all": row_keep_all,
                "rows": writer.num_rows,
                "tokens": writer.num_rows * (seq_len + 1),
                "packing": stats.to_dict(),
            }
            write_index(
                work / f"{split}.json",
                {
                    "format": SHARD_FORMAT,
                    "version": SHARD_FORMAT_VERSION,
                    "split": split,
                    "dtype": dtype.name,
                    "seq_len": seq_len,
                    "row_len": seq_len + 1,
                    "num_rows": writer.num_rows,
                    "num_tokens": writer.num_rows * (seq_len + 1),
                    "vocab_size": vocab_size,
                    "shards": writer.shards,
                    "key": key,
                },
            )

        metadata = {
            "key": key,
            "corpus": info.to_dict(),
            "tokenizer": tok_meta,
            "params": params,
            "split": plan.to_dict(),
            "splits": split_meta,
        }

        atomic_write_text(work / DATASET_FILE, json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        return metadata

    result = _load_if_current(home, key, wanted, tok_meta)
    if result is None:
        out.mkdir(parents=True, exist_ok=True)
        # (the message waits a second: another process only peeking at the lock, to tidy, lets go at once)
        with held_lock(out / f".{home.name}.lock", lock_timeout, "the token shards lock", warn_after=1.0) as locked:
            # A writer of this key that held the lock meanwhile has published its shards: reuse them.
            result = _load_if_current(home, key, wanted, tok_meta)
            if result is None:
                if locked:
                    _remove_temporaries(out, home.name)  # (a dead writer's: with the lock ours, none is alive)
                work = out / f".{home.name}.tmp-{os.getpid()}"
                remove_tree(work, ignore_errors=True)  # (a dead writer's of our pid, on a file system without locks)
                work.mkdir()
                try:
                    metadata = _write_shards(work)
                    # (unlocked, another writer of this key may have published meanwhile: theirs is kept)
                    result = None if locked else _load_if_current(home, key, wanted, tok_meta)
                    if result is None:
                        _publish_set(work, home)
                except BaseException:
                    remove_tree(work, ignore_errors=True)
                    raise
                if result is None:
                    result = _result(home, wanted, {**metadata, "reused": False})
                else:
                    remove_tree(work, ignore_errors=True)
    _show(out, home, wanted)
    with contextlib.suppress(OSError):  # (tidying only: a read-only cache is still reused)
        _remove_dead_temporaries(out)
    return result


# a name of each kind of file `prepare_dataset` writes in its out_dir (indexes, shards, temporary files)
SHARD_FILE_NAMES = ("x.json", "x.bin", "x.tmp")


def corpus_would_read(corpus: Corpus, directory: str | Path, names: tuple[str, ...] = SHARD_FILE_NAMES) -> bool:
    """Whether files like `names` written under `directory` would be read by `corpus` (a directory of text or
    Parquet files reads every file under it; a hidden directory in it, ".cache/data", is not read)."""
    if corpus.kind not in ("directory", "parquet") or corpus.path is None or not corpus.path.is_dir():
        return False
    root, target = corpus.path, Path(directory).resolve()
    if not target.is_relative_to(root):
        return False
    suffixes = getattr(corpus, "suffixes", None)  # (a DirectoryCorpus of .py files reads no .json or .bin file)
    if suffixes and not any(name.endswith(tuple(suffixes)) for name in names):
        return False
    skipped = ("_", ".") if corpus.kind == "parquet" else (".",)  # (the parts a directory walk leaves out)
    return not any(part.startswith(skipped) or part == "__pycache__" for part in target.relative_to(root).parts)


def _check_out_outside(corpus: Corpus, out: Path) -> None:
    """A one-line ValueError when `out` lies where the corpus reads every file (`corpus_would_read`): the shards
    and indexes written mid-run would be read as documents (by the next split's pass, and by every later run,
    whose corpus hash then never matches the cache)."""
    if not corpus_would_read(corpus, out):
        return
    raise ValueError(f"data: out_dir {str(out)!r} lies inside the corpus directory {corpus.name!r}, which reads every "
                     "file under it: its shards would become documents and the cache would never be reused; write "
                     "them outside it (rdepth train: an --out outside --data, or --data-dir)")


def _result(out: Path, splits: tuple[str, ...], metadata: dict[str, Any]) -> PreparedDataset:
    val = out / "validation.json" if "validation" in splits else None
    return PreparedDataset(out, out / "train.json", val, metadata)


def load_prepared(out_dir: str | Path, key: str, val_fraction: float,
                  tokenizer: dict[str, Any] | None = None) -> PreparedDataset | None:
    """The complete shards in `out_dir` if they were prepared under `key` (the `metadata["key"]` of a
    `prepare_dataset` result), without reading the corpus again; None otherwise. `tokenizer`: that result's
    tokenizer metadata, recorded in place of the stored one (`_load_if_current`)."""
    return _load_if_current(Path(out_dir) / set_name(key), key, SPLITS if val_fraction > 0 else SPLITS[:1], tokenizer)


def set_name(key: str) -> str:
    """The subdirectory of an out_dir that holds the shards of `key` (64 bits of it: dataset.json there
    holds the whole key, checked before any reuse)."""
    return f"{SET_PREFIX}{key[:16]}"


def _temporaries(out: Path, name: str = "*") -> list[Path]:
    """The work directories (`.NAME.tmp-PID`) and set-aside damaged sets (`.NAME.old-PID`) of a key's writers."""
    pattern = name if name != "*" else f"{SET_PREFIX}*"
    return [*out.glob(f".{pattern}.tmp-*"), *out.glob(f".{pattern}.old-*")]


def _remove_temporaries(out: Path, name: str) -> None:
    """Remove the leftovers of key `name`'s writers; call holding that key's lock (none of them is alive)."""
    for path in _temporaries(out, name):
        remove_tree(path, ignore_errors=True)


def _remove_dead_temporaries(out: Path) -> None:
    """Remove the leftovers of other keys' writers that died (kill -9, a lost node): a key's are removed only
    when its lock is free, so a live writer's work directory is never touched."""
    names = {path.name[1:].rsplit(".tmp-" if ".tmp-" in path.name else ".old-", 1)[0] for path in _temporaries(out)}
    for name in sorted(names):
        try:
            with held_lock(out / f".{name}.lock", 0, "the token shards lock") as locked:
                if locked:  # (unlocked, a live writer's cannot be told from a dead one's)
                    _remove_temporaries(out, name)
        except TimeoutError:
            continue  # (its writer is alive)


def _publish_set(work: Path, home: Path) -> None:
    """Rename the finished `work` to `home`: one rename, so a reader finds all of a key's files or none. A `home`
    there already failed the completeness check (damaged by hand: this key's lock is ours): it is set aside and
    removed."""
    fsync_dir(work)
    old = None
    if home.exists() or home.is_symlink():
        old = home.with_name(f".{home.name}.old-{os.getpid()}")
        os.rename(home, old)
    os.rename(work, home)
    fsync_dir(home.parent)
    if old is not None:
        remove_tree(old, ignore_errors=True)


def _show(out: Path, home: Path, splits: tuple[str, ...]) -> None:
    """Point the top-level dataset.json and split indexes of `out` at `home`'s shards (the key prepared last), for
    tools that open `out/train.json`; the indexes name files inside `home`, which no other key's writer changes.
    A run reads its own `home`, so where `out` cannot be written (a read-only cache) this is skipped, with a
    warning."""
    try:
        source = (home / DATASET_FILE).read_bytes()
        with contextlib.suppress(OSError, ValueError):  # (a missing or foreign view is rewritten)
            shown = [shard["file"] for split in splits for shard in read_index(out / f"{split}.json")["shards"]]
            if (out / DATASET_FILE).read_bytes() == source and all(f.startswith(f"{home.name}/") for f in shown):
                return
        with held_lock(out / ".view.lock", VIEW_LOCK_TIMEOUT_S, "the token shards view lock", warn_after=5.0):
            (out / DATASET_FILE).unlink(missing_ok=True)  # (first: a half-rewritten view names no key)
            for split in SPLITS:
                if split in splits:
                    index = read_index(home / f"{split}.json")
                    index["shards"] = [{**shard, "file": f"{home.name}/{shard['file']}"} for shard in index["shards"]]
                    write_index(out / f"{split}.json", index)
                else:
                    (out / f"{split}.json").unlink(missing_ok=True)
            atomic_write_bytes(out / DATASET_FILE, source)
    except OSError as exc:
        log.warning("token shards: could not update the indexes in %s (%s); the shards are in %s", out, exc, home)


def _load_if_current(out: Path, key: str, splits: tuple[str, ...],
                     tokenizer: dict[str, Any] | None = None) -> PreparedDataset | None:
    """The shards in `out` if prepared under `key` and complete, else None. `tokenizer`: the metadata of the
    tokenizer the key names, as this code measures it, recorded in place of the stored one (whose vocab_size older
    code took as the token count, too small for a tokenizer.json that numbers a token past its count)."""
    meta_path = out / DATASET_FILE
    if not meta_path.is_file():
        return None
    try:
        metadata = read_json(meta_path, CONFIG_MAX_BYTES, "dataset metadata")
    except (ValueError, OSError):
        return None  # unreadable: prepared again
    if not isinstance(metadata, dict) or not isinstance(metadata.get("splits"), dict):
        return None  # another tool's dataset.json, or a damaged one: prepared again
    if metadata.get("key") != key or set(metadata["splits"]) != set(splits):
        return None
    if not all(shards_complete(out / f"{split}.json") for split in splits):
        return None
    if tokenizer is not None:
        metadata["tokenizer"] = tokenizer
    return _result(out, splits, {**metadata, "reused": True})


# Below this share of a split's tokens kept by the paper's rule, `packing_report` warns.
KEEP_WARNING_SHARE = 0.5


def packing_report(metadata: dict[str, Any]) -> tuple[str, list[str]]:
    """What packing kept, for a person: one line with the tokens each split kept under its rule and
    what the other rule would keep, and warnings (the paper's rule kept under half of the training
    tokens; the validation split is larger than the training split), each saying what to change."""
    row_len = int(metadata["params"]["seq_len"]) + 1
    parts: list[str] = []
    warnings: list[str] = []
    splits = metadata["splits"]
    for split, label in (("train", "training"), ("validation", "validation")):
        if split not in splits:
            continue
        info = splits[split]
        stats = info["packing"]
        offered, kept = int(stats["tokens_in"]), int(stats["tokens_packed"])
        every = offered // row_len  # the rows keep_all packs: every token but an unfinished last row
        share = kept / offered if offered else 0.0
        if info["keep_all"]:
            rule = "every token packed"
        else:
            rule = (f"the paper's rule, which drops the rest of a document once a row fills; keep_all would "
                    f"keep {every:,} rows, {every * row_len / max(offered, 1):.1%}")
        parts.append(f"{info['rows']:,} {label} rows ({kept:,} of {offered:,} tokens, {share:.1%}: {rule})")
        if split == "train" and not info["keep_all"] and share < KEEP_WARNING_SHARE:
            warnings.append(
                f"warning: the paper's packing rule kept {share:.1%} of {metadata['corpus']['name']}'s training "
                f"tokens ({info['rows']:,} rows of {row_len}): its documents are longer than a row and each gives "
                f"at most one. To train on all of them ({every:,} rows) pass --keep-all (keep_all: true); or use "
                f"a longer --seq-len")
    train_rows = splits["train"]["rows"]
    val_rows = splits.get("validation", {}).get("rows", 0)
    if val_rows > train_rows:
        dropped = not splits["train"]["keep_all"]
        fix = ("pass --keep-all to pack every training token too" if dropped
               else "use more data or a smaller --val-fraction")
        warnings.append(f"warning: the validation split ({val_rows:,} rows) is larger than the training split "
                        f"({train_rows:,} rows): validation packs every token"
                        f"{', training the paper’s rule' if dropped else ''}; {fix}")
    return "packed " + " and ".join(parts) + f" of {row_len} tokens", warnings
