"""Document sources: the embedded `stdlib` corpus, a directory of text files, a JSONL file, Parquet files
and a Hugging Face dataset saved with `save_to_disk`.

Every corpus is a re-iterable stream of :class:`Document` in a canonical order (sorted by id),
so a second pass yields exactly the same documents and the content hash in :class:`CorpusInfo`
identifies the data a run saw. Documents are read lazily, one at a time: a corpus larger than
RAM streams.

The train/validation split is document-level and decided by hashing each document id with a
seed (:class:`DocumentSplit`): it needs no random state, is the same on every machine, and a
document never changes side when other documents are added or removed.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import platform
import re
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from recurrent_depth.data.parquet_pages import column_pages
from recurrent_depth.files import clipped_names

# Path components that put a file outside the embedded corpus (DESIGN.md, "The embedded corpus").
STDLIB_EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3"}
)
# Bytes inspected for a NUL when deciding that a file is binary.
_BINARY_SNIFF_BYTES = 8192
# Bytes read at a time from a corpus file.
_READ_CHUNK_BYTES = 1 << 20
# A file larger than this is read as several documents of about this many characters (see FileTreeCorpus).
PART_BYTES = 64 << 20
# Longest JSONL line read (bytes, without its newline). Lines are read with this bound, so a file with no
# newline (a wrong file, or one huge JSON array) is refused in bounded memory instead of read whole.
JSONL_MAX_LINE_BYTES = 4 * PART_BYTES
# The field (JSONL) or column (Parquet, saved dataset) that holds a record's text unless told otherwise.
DEFAULT_TEXT_FIELD = "text"
# Rows converted to Python strings at a time from a Parquet file or a saved dataset: memory holds this many
# texts (and, for Parquet, the text column of one row group), never the whole file.
TABLE_BATCH_ROWS = 1024
# Most text bytes converted at a time from a Parquet row group: a row group of long texts is read in batches of
# fewer rows, sized from its footer, so a batch stays about this large.
TABLE_BATCH_BYTES = PART_BYTES
# Longest text value of a Parquet file or a saved dataset (bytes): the bound of a JSONL line.
TABLE_MAX_VALUE_BYTES = JSONL_MAX_LINE_BYTES
# Largest state.json, dataset_info.json or dataset_dict.json of a saved dataset read (a few KiB when written by
# save_to_disk); a larger one is refused before it is read.
SAVED_JSON_MAX_BYTES = 16 << 20

CorpusKind = Literal["stdlib", "directory", "jsonl", "parquet", "datasets", "memory"]


@dataclass(frozen=True)
class Document:
    """One training document: a stable id (a relative path, or a line number) and its text."""

    id: str
    text: str


@dataclass(frozen=True)
class CorpusInfo:
    """What a run must record to know which data it saw.

    ``sha256`` hashes every (id, text) pair in canonical order, so two machines with the same
    files get the same hash and any edit, addition or removal changes it.
    """

    name: str  # "stdlib", or the path the user gave
    kind: CorpusKind
    path: str | None  # absolute root directory or file; None for in-memory corpora
    num_documents: int
    num_bytes: int  # UTF-8 bytes of all document texts
    sha256: str
    num_skipped: int  # files skipped as binary or not UTF-8 (directory corpora)
    python_version: str | None = None  # stdlib only: the content depends on the Python build

    def to_dict(self) -> dict:
        return asdict(self)


class Corpus:
    """A re-iterable, sorted stream of documents. Subclasses implement :meth:`__iter__`."""

    name: str
    kind: CorpusKind
    path: Path | None = None
    python_version: str | None = None

    def __iter__(self) -> Iterator[Document]:
        raise NotImplementedError

    @property
    def num_skipped(self) -> int:
        """Files skipped during the most recent complete pass (0 for sources that never skip)."""
        return 0

    def ids(self) -> Iterator[str]:
        for doc in self:
            yield doc.id

    def info(self) -> CorpusInfo:
        """Count, size and content hash (one streaming pass; cached on the object)."""
        cached = getattr(self, "_info", None)
        if cached is not None:
            return cached
        digest = hashlib.sha256()
        count = 0
        total = 0
        previous_id: str | None = None
        for doc in self:
            if previous_id is not None and doc.id <= previous_id:
                raise AssertionError(f"corpus {self.name!r} is not sorted by id at {doc.id!r}")
            previous_id = doc.id
            _hash_document(digest, doc)
            count += 1
            total += len(doc.text.encode("utf-8"))
        info = CorpusInfo(
            name=self.name,
            kind=self.kind,
            path=None if self.path is None else str(self.path),
            num_documents=count,
            num_bytes=total,
            sha256=digest.hexdigest(),
            num_skipped=self.num_skipped,
            python_version=self.python_version,
        )
        self._info = info
        return info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def require_text(info: CorpusInfo) -> None:
    """ValueError (one line) for a corpus with no documents, or whose documents are all empty: neither a
    tokenizer nor a row can be made from it (the errors further on would blame vocab_size or seq_len)."""
    if info.num_documents == 0:
        skipped = f" ({info.num_skipped} file(s) skipped: binary or not UTF-8)" if info.num_skipped else ""
        raise ValueError(f"data: corpus {info.name!r} has no documents{skipped}")
    if info.num_bytes == 0:
        raise ValueError(f"data: corpus {info.name!r} has {info.num_documents} document(s), all of them empty")


def _id_bytes(doc_id: str) -> bytes:
    # A file name that is not valid UTF-8 reaches us with surrogate escapes (os.fsdecode);
    # encoding them back gives the name's own bytes instead of a UnicodeEncodeError.
    return doc_id.encode("utf-8", "surrogateescape")


def _hash_document(digest: hashlib._Hash, doc: Document) -> None:
    # Length-prefix both fields so ("ab", "c") and ("a", "bc") hash differently.
    for field in (_id_bytes(doc.id), doc.text.encode("utf-8")):
        digest.update(len(field).to_bytes(8, "little"))
        digest.update(field)


def corpus_sha256(docs: Iterable[Document]) -> str:
    """Content hash of documents, taken in id order (the hash :meth:`Corpus.info` records)."""
    digest = hashlib.sha256()
    for doc in sorted(docs, key=lambda d: d.id):
        _hash_document(digest, doc)
    return digest.hexdigest()


class DocumentListCorpus(Corpus):
    """An in-memory corpus (tests, API users). Documents are kept sorted by id; ids must be unique."""

    kind = "memory"

    def __init__(self, docs: Iterable[Document | str], name: str = "memory") -> None:
        items = [d if isinstance(d, Document) else Document(f"{i:09d}", d) for i, d in enumerate(docs)]
        items.sort(key=lambda d: d.id)
        for a, b in zip(items, items[1:]):
            if a.id == b.id:
                raise ValueError(f"documents: duplicate id {a.id!r}; ids must be unique")
        self._docs = items
        self.name = name

    def __iter__(self) -> Iterator[Document]:
        return iter(self._docs)

    def __len__(self) -> int:
        return len(self._docs)


def _walk_sorted(
    root: Path, skip_dir: Callable[[str], bool], follow_dir_link: Callable[[str, Path], bool] | None = None
) -> list[str]:
    """Relative POSIX paths of regular files under ``root``, sorted. A directory symlink is followed where
    ``follow_dir_link(relative path, resolved target)`` says so (never without it); a directory already walked,
    or one holding ``root``, is not walked again, so a link back to an ancestor cannot loop."""
    found: list[str] = []
    seen: set[Path] = set()
    top = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_dir_link is not None):
        rel_dir = Path(dirpath).relative_to(root)
        kept = []
        for d in sorted(dirnames):  # (sorted: which of two paths to one directory is walked does not vary)
            if skip_dir(d):
                continue
            if follow_dir_link is not None:
                target = Path(dirpath, d).resolve()
                if target in seen or top.is_relative_to(target):
                    continue
                if os.path.islink(os.path.join(dirpath, d)) and not follow_dir_link((rel_dir / d).as_posix(), target):
                    continue
                seen.add(target)
            kept.append(d)
        dirnames[:] = kept
        for fname in filenames:
            found.append((rel_dir / fname).as_posix())
    found.sort()
    return found


def _text_chunks(path: Path) -> Iterator[str] | None:
    """The UTF-8 text of a file (less a leading BOM) in pieces of about `_READ_CHUNK_BYTES`, read as they are
    consumed; None for a binary file, known from its first 8 KiB alone (a sparse 2 GB file is never read further).
    Undecodable bytes raise UnicodeDecodeError when the piece holding them is reached."""
    handle = open(path, "rb")  # noqa: SIM115 - closed by the generator below
    head = handle.read(_BINARY_SNIFF_BYTES)
    if b"\x00" in head:
        handle.close()
        return None

    def pieces() -> Iterator[str]:
        # A BOM starting the file is not text (an editor's mark; the JSONL reader drops it too). Stripped here, not
        # by the "utf-8-sig" incremental decoder, which reads a file of b"\xef" or b"\xef\xbb" (a cut BOM) as "".
        decoder = codecs.getincrementaldecoder("utf-8")()
        at_start = True
        with handle:
            chunk = head
            while chunk:
                text = decoder.decode(chunk)
                if at_start and text:
                    text, at_start = text.removeprefix("\ufeff"), False
                yield text
                chunk = handle.read(_READ_CHUNK_BYTES)
            yield decoder.decode(b"", final=True)

    return pieces()


def _read_text_file(path: Path) -> str | None:
    """A whole file's UTF-8 text (None: binary or not UTF-8), read in chunks (never a second copy as bytes)."""
    chunks = _text_chunks(path)
    if chunks is None:
        return None
    try:
        return "".join(chunks)
    except UnicodeDecodeError:
        return None


def _text_parts(path: Path, part_chars: int) -> Iterator[str]:
    """A large file's text in parts of about `part_chars` characters, cut after a newline where there is one."""
    pending = ""
    for piece in _text_chunks(path) or ():
        pending += piece
        while len(pending) >= part_chars:
            cut = pending.rfind("\n", 0, part_chars) + 1 or part_chars
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


class FileTreeCorpus(Corpus):
    """The files `files()` lists under `path`, one document each; binary and non-UTF-8 files are
    skipped and counted in `num_skipped`.

    Files are read in chunks, never whole as bytes: a binary file is recognised from its first 8 KiB
    without reading the rest, and a file larger than `PART_BYTES` is checked in one streaming pass
    and then read as several documents (`<path>#part-00001`, ... of about `PART_BYTES` each, cut at a
    newline), so memory stays bounded by a part, not by the largest file. A file named like one of
    those parts beside it (two documents, one id) is a ValueError.
    """

    _skipped = 0

    def files(self) -> list[str]:
        raise NotImplementedError

    def readable(self, rel: str) -> Path | None:
        """The file to read for `rel`, or None to skip it."""
        return self.path / rel

    def __iter__(self) -> Iterator[Document]:
        skipped = 0
        # A file read in parts has the ids "<rel>#part-NNNNN", which sort after a sibling like "<rel> copy" (a
        # space sorts before "#"): visit the files in the order of their ids, so documents come sorted by id.
        planned: list[tuple[str, str, Path | None, bool]] = []
        for rel in self.files():
            full = self.readable(rel)
            parted = full is not None and full.stat().st_size > PART_BYTES
            planned.append((f"{rel}#part-" if parted else rel, rel, full, parted))
        large = {rel for _, rel, _, parted in planned if parted}
        for _, rel, _, _ in planned:
            match = _PART_SUFFIX.search(rel)
            if match and rel[: match.start()] in large:  # (one id twice, or ids out of order if it is large too)
                raise ValueError(f"data: {rel!r} in {self.name} is named like a part of the large file "
                                 f"{rel[: match.start()]!r}, which is read in parts with ids '<path>#part-NNNNN': "
                                 "rename it")
        planned.sort(key=lambda item: item[0])
        for _, rel, full, parted in planned:
            if full is not None and parted:
                if _is_utf8_text(full):
                    for k, part in enumerate(_text_parts(full, PART_BYTES), start=1):
                        yield Document(f"{rel}#part-{k:05d}", part)
                    continue
                text = None
            else:
                text = _read_text_file(full) if full is not None else None
            if text is None:
                skipped += 1
                continue
            yield Document(rel, text)
        self._skipped = skipped

    @property
    def num_skipped(self) -> int:
        return self._skipped


def _is_utf8_text(path: Path) -> bool:
    """Whether a file is UTF-8 text (not binary), in one streaming pass that keeps no more than a chunk."""
    chunks = _text_chunks(path)
    if chunks is None:
        return False
    try:
        for _ in chunks:
            pass
    except UnicodeDecodeError:
        return False
    return True


class StdlibCorpus(FileTreeCorpus):
    """The embedded default corpus: the running Python's standard-library ``.py`` sources.

    Files are sorted by path relative to ``sysconfig.get_paths()["stdlib"]``; any file with a
    path component in :data:`STDLIB_EXCLUDED_DIRS` is left out (about 660 files, ~11 MB on
    CPython 3.11). Content differs between Python builds, hence ``python_version`` in the info.
    """

    kind = "stdlib"

    def __init__(self, root: str | Path | None = None) -> None:
        self.path = Path(root if root is not None else sysconfig.get_paths()["stdlib"]).resolve()
        if not self.path.is_dir():
            raise ValueError(f"stdlib corpus: directory {self.path} does not exist")
        self.name = "stdlib"
        self.python_version = f"{platform.python_implementation()} {platform.python_version()}"

    def files(self) -> list[str]:
        paths = _walk_sorted(self.path, lambda d: d in STDLIB_EXCLUDED_DIRS or d == "__pycache__")
        return [p for p in paths if p.endswith(".py")]


class DirectoryCorpus(FileTreeCorpus):
    """Every text file under a directory (recursive, sorted by relative path).

    Hidden files and directories (names starting with ".") and ``__pycache__`` are not visited.
    Binary files (a NUL byte in the first 8 KiB) and files that are not valid UTF-8 are skipped
    and counted in ``num_skipped``. ``suffixes`` (e.g. ``(".py", ".md")``) restricts the files.
    A file symlink that leads out of the directory is a ValueError (a link to ``/etc/passwd`` must not
    become a training document) unless ``follow_symlinks=True``; so is a directory symlink that leads out,
    whose files ``follow_symlinks=True`` reads (a directory link inside is not followed: its files are read
    at their own paths).
    """

    kind = "directory"

    def __init__(
        self, root: str | Path, suffixes: Sequence[str] | None = None, follow_symlinks: bool = False
    ) -> None:
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"data: {str(root)!r} is not a directory")
        self.path = root.resolve()
        self.name = str(root)
        self.suffixes = tuple(suffixes) if suffixes else None
        self.follow_symlinks = follow_symlinks

    def _follow_dir_link(self, rel: str, target: Path) -> bool:
        if target.is_relative_to(self.path):
            return False  # (its files are read where they are: following would read them twice)
        if not self.follow_symlinks:  # (its files were silently left out, even with --follow-symlinks)
            raise ValueError(
                f"data: directory {rel!r} in {self.name} is a symlink to {target}, outside the directory; "
                f"pass --follow-symlinks (follow_symlinks=True) to read its files"
            )
        return True

    def files(self) -> list[str]:
        paths = _walk_sorted(self.path, lambda d: d.startswith(".") or d == "__pycache__", self._follow_dir_link)
        paths = [p for p in paths if not Path(p).name.startswith(".")]
        if self.suffixes is not None:
            paths = [p for p in paths if p.endswith(self.suffixes)]
        return paths

    def readable(self, rel: str) -> Path | None:
        full = self.path / rel
        if not full.is_file():  # a dangling symlink or a special file
            return None
        if not self.follow_symlinks and not full.resolve().is_relative_to(self.path):
            raise ValueError(
                f"data: {rel!r} in {self.name} is a symlink to {full.resolve()}, outside the directory; "
                f"pass --follow-symlinks (follow_symlinks=True) to read it"
            )
        return full


def json_line(raw: bytes, where: str, first: bool = False) -> Any:
    """The JSON value of one JSONL line (bytes, its newline included), or a one-line ValueError naming `where`
    (FILE:LINE) and the column. Decoded here as UTF-8 (a BOM may start the `first` line), not by json.loads(bytes),
    which guesses UTF-16/32 from the first bytes and then names the wrong codec; parsed without its newline, which
    the parser would count as a second line ("line 2 column 1")."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        # (exc.start counts from after a BOM that utf-8-sig stripped: count it from the line's start)
        at = exc.start + len(raw) - len(exc.object)
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[at]:02x} at byte {at + 1} of the line)") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # (a number of over 4300 digits: Python's int limit, raised without the line)
        raise ValueError(f"{where}: JSON the parser cannot read ({exc})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to parse") from None


class JsonlCorpus(Corpus):
    """One document per line of a JSONL file, taken from the string field ``text_field``.

    Document ids are the 1-based line numbers, zero-padded (``"line-0000000001"``, see `record_id`) so
    that id order is file order. Blank lines are skipped. A line that is not a JSON object with a
    string ``text_field`` raises ``ValueError`` naming the file and line.
    """

    kind = "jsonl"

    def __init__(self, path: str | Path, text_field: str = DEFAULT_TEXT_FIELD) -> None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"data: JSONL file {str(path)!r} does not exist")
        self.path = path.resolve()
        self.name = str(path)
        self.text_field = text_field

    def __iter__(self) -> Iterator[Document]:
        limit = JSONL_MAX_LINE_BYTES
        with open(self.path, "rb") as handle:
            for lineno, raw in enumerate(iter(lambda: handle.readline(limit + 1), b""), start=1):
                where = f"{self.path}:{lineno}"
                if len(raw) > limit and not raw.endswith(b"\n"):
                    raise ValueError(f"{where}: line longer than {limit:,} bytes; split the document, or put very "
                                     "large documents in a directory of text files (read in parts)")
                if not raw.strip():
                    continue
                record = json_line(raw, where, first=lineno == 1)
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
                if self.text_field not in record:
                    raise ValueError(
                        f"{where}: missing field {self.text_field!r} (fields: {sorted(record)[:10]})"
                    )
                text = record[self.text_field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{where}: field {self.text_field!r} must be a string, got {type(text).__name__}"
                    )
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(
                        f"{where}: field {self.text_field!r} is not valid Unicode text "
                        f"(an unpaired surrogate escape such as \\ud800 at character {exc.start})"
                    ) from None
                yield Document(record_id(lineno), text)


def record_id(number: int, prefix: str = "") -> str:
    """The id of a file's `number`-th record (1-based), zero-padded so that id order is file order.

    JSONL lines, Parquet rows and saved-dataset rows share it, so the same texts in any of these formats
    are the same corpus: the same hash, the same validation documents, the same rows. `prefix` names the
    file within a directory of Parquet files."""
    return f"{prefix}line-{number:010d}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_no_text_field(text_field: str, spec: str) -> None:
    """A text field picks a column of records; a corpus of whole text files has none, so a field the user
    chose must not be dropped silently."""
    if text_field != DEFAULT_TEXT_FIELD:
        raise ValueError(
            f"data: text_field (--text-field) {text_field!r} picks a field of .jsonl, .parquet or saved-dataset "
            f"records, but {spec!r} is read as whole text files, one document each; leave --text-field out"
        )


def _pyarrow() -> Any:
    """The pyarrow module (with its Parquet reader); not a core dependency (`datasets` brings it)."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - ParquetFile, used by ParquetCorpus
    except ImportError:
        raise ValueError("data: reading Parquet needs pyarrow, which is not installed: pip install "
                         "'recurrent-depth[data]' (or pyarrow)") from None
    return pyarrow


def _check_text_column(schema: Any, field: str, where: str) -> None:
    """ValueError (one line, naming `where`) unless the pyarrow `schema` has a string column `field`. A
    column types every row alike, so a missing or non-string one is named once, for the file."""
    pa = _pyarrow()
    if field not in schema.names:
        raise ValueError(f"{where}: missing column {field!r} (columns: {clipped_names(schema.names)}); "
                         f"name the text column with --text-field")
    if schema.names.count(field) > 1:  # (pyarrow allows it; schema.field() would raise a KeyError)
        raise ValueError(f"{where}: {schema.names.count(field)} columns are named {field!r}; "
                         "the text column must be named once")
    kind = schema.field(field).type
    if pa.types.is_dictionary(kind):  # a categorical column (pandas) of strings
        kind = kind.value_type
    is_string_view = getattr(pa.types, "is_string_view", lambda _: False)  # (pyarrow >= 16)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_string_view(kind)):
        raise ValueError(f"{where}: column {field!r} must hold strings, got {schema.field(field).type}")


def _table_documents(batches: Iterable[Any], field: str, where: str, prefix: str = "") -> Iterator[Document]:
    """Documents from pyarrow record batches (or tables) of the string column `field`, rows numbered from 1.

    An empty string is an (empty) document and a null a ValueError naming the row: the rules of a JSONL
    line's `""` and `null`. So are a text longer than `TABLE_MAX_VALUE_BYTES` (the JSONL line bound) and one
    that is not UTF-8 (pyarrow does not check the bytes of a string column it reads)."""
    number = 0
    for batch in batches:
        column = batch.column(field)
        _check_value_sizes(column, field, where, number)
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:
            raise ValueError(f"{where}:row {number + _first_undecodable(column) + 1}: field {field!r} is not "
                             "valid UTF-8") from None
        for text in texts:
            number += 1
            if text is None:
                raise ValueError(f"{where}:row {number}: field {field!r} is null; drop the row or give it a text")
            yield Document(record_id(number, prefix), text)


def _too_long(field: str, size: int) -> str:
    return (f"field {field!r} holds {size:,} bytes, more than {TABLE_MAX_VALUE_BYTES:,}; split the document, or "
            "put very large documents in a directory of text files (read in parts)")


def _check_value_sizes(column: Any, field: str, where: str, rows_before: int) -> None:
    """ValueError naming the row of the first value of the pyarrow string `column` longer than
    `TABLE_MAX_VALUE_BYTES`: the bound a JSONL line has."""
    pa = _pyarrow()
    import pyarrow.compute as pc

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())  # (binary_length takes no dictionary or string_view)
    lengths = pc.binary_length(column)
    longest = pc.max(lengths).as_py()
    if longest is not None and longest > TABLE_MAX_VALUE_BYTES:
        index = pc.index(pc.greater(lengths, TABLE_MAX_VALUE_BYTES), True).as_py()
        raise ValueError(f"{where}:row {rows_before + index + 1}: {_too_long(field, lengths[index].as_py())}")


def _first_undecodable(column: Any) -> int:
    """The index of the first value of `column` that is not UTF-8 (on the error path only: one at a time)."""
    for index in range(len(column)):
        try:
            column[index].as_py()
        except UnicodeDecodeError:
            return index
    raise AssertionError("no undecodable value")  # (called after to_pylist() failed to decode one)


class ParquetCorpus(Corpus):
    """One document per row of a Parquet file, or of every ``.parquet`` file under a directory, taken
    from the string column ``text_field``.

    A directory's files are found as :class:`DirectoryCorpus` finds them (recursive; hidden names and
    ``__pycache__`` left out; the same symlink rule), sorted by path. Paths with a part starting with
    ``_`` (Spark's ``_SUCCESS``, ``_metadata``, ``_temporary/``) are left out, as pyarrow.dataset leaves
    them out; any other file that is not ``.parquet`` is a ValueError: a directory is read as Parquet
    files or as text files, never as a mix of both.

    Ids are :func:`record_id` s: ``line-0000000001`` for the rows of a single file (the ids of a JSONL file
    with the same texts), ``<relative path>/line-0000000001`` in a directory. Rows are read
    `TABLE_BATCH_ROWS` at a time with pyarrow's ``iter_batches`` (the text column only), so memory holds
    about one row group's texts, never the whole file.
    """

    kind = "parquet"

    def __init__(
        self, path: str | Path, text_field: str = DEFAULT_TEXT_FIELD, follow_symlinks: bool = False
    ) -> None:
        _pyarrow()  # a missing pyarrow is named before anything is read
        path = Path(path)
        if path.is_dir():
            self._files = _parquet_files(DirectoryCorpus(path, follow_symlinks=follow_symlinks))
        elif path.is_file():
            self._files = [("", path.resolve())]
        elif path.exists():
            raise ValueError(f"data: Parquet file {str(path)!r} is not a regular file")
        else:
            raise ValueError(f"data: Parquet file {str(path)!r} does not exist")
        self.path = path.resolve()
        self.name = str(path)
        self.text_field = text_field

    def _open(self, file: Path) -> Any:
        """A `pyarrow.parquet.ParquetFile` whose text column is checked; ValueError naming the file otherwise."""
        pa = _pyarrow()
        try:  # a buffered stream: a row group's column is read a buffer at a time, not whole into memory
            handle = pa.parquet.ParquetFile(file, buffer_size=_READ_CHUNK_BYTES, pre_buffer=False)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{file}: not a readable Parquet file ({_one_line(exc)})") from None
        try:
            _check_text_column(handle.schema_arrow, self.text_field, str(file))
        except ValueError:
            handle.close()
            raise
        return handle

    def __iter__(self) -> Iterator[Document]:
        pa = _pyarrow()
        for prefix, file in self._files:
            with self._open(file) as handle:
                batches = _row_group_batches(handle, file, self.text_field, str(file))
                try:
                    yield from _table_documents(batches, self.text_field, str(file), prefix)
                except (pa.ArrowException, OSError) as exc:  # a damaged page (ours are plain ValueErrors)
                    raise ValueError(f"{file}: cannot be read ({_one_line(exc)})") from None

    def ids(self) -> Iterator[str]:
        """From the files' row counts, without reading a text: every row is a document (a null is an error)."""
        for prefix, file in self._files:
            with self._open(file) as handle:
                num_rows = _footer_rows(handle.metadata, str(file))
            for number in range(1, num_rows + 1):
                yield record_id(number, prefix)


def _footer_rows(metadata: Any, where: str) -> int:
    """The row count of a Parquet footer, the same in the file's header and its row groups (what `ids()` and
    `__iter__` count from), else a one-line ValueError naming `where`."""
    groups = sum(metadata.row_group(group).num_rows for group in range(metadata.num_row_groups))
    if groups != metadata.num_rows:
        raise ValueError(f"{where}: damaged footer: it counts {metadata.num_rows:,} rows but its row groups "
                         f"{groups:,}; rewrite the file")
    return groups


def _group_batch_rows(raw: Any, metadata: Any, group: int, leaf: int, field: str, where: str, first_row: int) -> int:
    """The rows of a batch read from row group `group`, from its page headers; a ValueError when a page is larger
    than `TABLE_MAX_VALUE_BYTES` (it holds a text that long, or would be decoded whole to find out), or when its
    pages hold another number of rows than its footer says.

    A batch holds about `TABLE_BATCH_BYTES` of text: fewer rows where the texts are long, and where a dictionary
    page could hand the same long text to every row (each row of a batch gets its own copy)."""
    rows = metadata.row_group(group).num_rows
    last_row = first_row + rows - 1
    span = f"row {first_row}" if rows == 1 else f"rows {first_row}-{last_row}"
    chunk = metadata.row_group(group).column(leaf)
    claimed = chunk.total_uncompressed_size
    if rows > 0 and claimed > rows * TABLE_MAX_VALUE_BYTES:
        raise ValueError(f"{where}:{span}: field {field!r} takes {claimed:,} bytes, more than "
                         f"{TABLE_MAX_VALUE_BYTES:,} a row; split the documents, or put very large "
                         "documents in a directory of text files (read in parts)")
    total = dictionary = counted = 0
    for page in column_pages(raw, chunk, f"{where}: cannot be read (column {field!r}, row group {group + 1})"):
        if max(page.uncompressed, page.compressed) > TABLE_MAX_VALUE_BYTES:
            at = span if page.dictionary or page.rows == 0 else (
                f"rows {first_row + counted}-{min(first_row + counted + page.rows - 1, last_row)}")
            raise ValueError(f"{where}:{at}: field {field!r} has a page of {max(page.uncompressed, page.compressed):,} "
                             f"bytes, more than {TABLE_MAX_VALUE_BYTES:,}, the longest text read: split the "
                             "documents, or write the file with smaller pages (pyarrow's data_page_size)")
        total += page.uncompressed
        dictionary = max(dictionary, page.uncompressed if page.dictionary else 0)
        counted += page.rows
    if counted != rows:
        raise ValueError(f"{where}:{span}: damaged row group: the pages of field {field!r} hold {counted:,} rows, "
                         f"its footer says {rows:,}; rewrite the file")
    batch_rows = min(TABLE_BATCH_ROWS, TABLE_BATCH_BYTES * rows // max(total, 1))
    if dictionary:
        batch_rows = min(batch_rows, TABLE_BATCH_BYTES // dictionary)
    return 1 << (max(batch_rows, 1).bit_length() - 1)  # (a power of two: row groups alike share one read)


def _row_group_batches(handle: Any, file: Path, field: str, where: str) -> Iterator[Any]:
    """Record batches of the column `field` of the `pyarrow.parquet.ParquetFile` `handle` of `file`.

    Each row group's page headers are read first (`_group_batch_rows`), so a page that would be too large
    to decode is refused before it is read, and batches are sized from what the pages hold. Consecutive row
    groups with the same batch size are read together, up to about `TABLE_BATCH_BYTES`: pyarrow's
    ``iter_batches`` costs time in the number of row groups of the file at each call, so one call per row
    group made a file of 100,000 tiny row groups take hours. A read that yields another number of rows than
    the footer says (what `ids()` counts from) is a ValueError naming the rows."""
    metadata = handle.metadata
    _footer_rows(metadata, where)
    leaf = [metadata.schema.column(i).path for i in range(metadata.num_columns)].index(field)
    run: list[int] = []
    run_rows = run_bytes = run_batch = 0
    first_row = 1

    def read_run() -> Iterator[Any]:
        read = 0
        for batch in handle.iter_batches(batch_size=run_batch, row_groups=run, columns=[field]):
            read += batch.num_rows
            yield batch
        if read != run_rows:
            raise ValueError(f"{where}:rows {first_row}-{first_row + run_rows - 1}: damaged file: {read:,} rows "
                             f"read, its footer says {run_rows:,}; rewrite the file")

    with open(file, "rb") as raw:
        for group in range(metadata.num_row_groups):
            if metadata.row_group(group).num_rows == 0:
                continue  # (pyarrow writes one for an empty table, with no pages: nothing to read)
            batch_rows = _group_batch_rows(raw, metadata, group, leaf, field, where, first_row + run_rows)
            if run and (batch_rows != run_batch or run_bytes >= TABLE_BATCH_BYTES):
                yield from read_run()
                first_row += run_rows
                run, run_rows, run_bytes = [], 0, 0
            run.append(group)
            run_batch = batch_rows
            run_rows += metadata.row_group(group).num_rows
            run_bytes += metadata.row_group(group).column(leaf).total_uncompressed_size
        if run:
            yield from read_run()


def _parquet_files(tree: DirectoryCorpus) -> list[tuple[str, Path]]:
    """(id prefix, file) for each ``.parquet`` file of `tree`, in the order of their ids (see ParquetCorpus)."""
    found: list[tuple[str, Path]] = []
    for rel in tree.files():
        if any(part.startswith("_") for part in Path(rel).parts):
            continue  # Spark / Hadoop bookkeeping, not data
        if not rel.lower().endswith(".parquet"):
            raise ValueError(
                f"data: {tree.name!r} holds .parquet files and other files ({rel!r}); a directory is read as "
                "Parquet files or as text files, not both: move the other files out, or point --data at the "
                "directory of the Parquet files"
            )
        full = tree.readable(rel)  # (a symlink out of the directory is refused unless follow_symlinks)
        if full is not None:
            found.append((f"{rel}/", full))
    # "/" ends the prefix because no file's path starts with another file's path and "/": ordering the files
    # by prefix orders their ids ("a.parquet" and "a.parquet x.parquet" as paths would not).
    found.sort(key=lambda item: item[0])
    return found


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()) or (
        path / "dataset_dict.json"
    ).is_file()


class SavedDatasetCorpus(Corpus):
    """One document per row of a Hugging Face dataset saved with ``save_to_disk``, taken from the string
    column ``text_field``; of a ``DatasetDict``, its ``train`` split (as ``rdepth sft`` reads one).

    Read with ``datasets.load_from_disk`` (offline), which memory-maps the ``.arrow`` files, and
    `TABLE_BATCH_ROWS` rows at a time. Ids are :func:`record_id` s of the row numbers, the ids of a
    JSONL file with the same texts.

    The directory is checked before datasets reads it: its JSON files are bounded (`SAVED_JSON_MAX_BYTES`),
    and every ``.arrow`` file state.json names must be a file of the directory (a name like ``../x.arrow``
    is refused), with the symlink rule of :class:`DirectoryCorpus` (a link out is refused unless
    ``follow_symlinks``), as is a ``train`` split directory that is a link out.
    """

    kind = "datasets"

    def __init__(
        self, path: str | Path, text_field: str = DEFAULT_TEXT_FIELD, follow_symlinks: bool = False
    ) -> None:
        path = Path(path)
        if not is_saved_dataset(path):
            raise ValueError(f"data: {str(path)!r} is not a directory written by save_to_disk "
                             "(no state.json and dataset_info.json, nor dataset_dict.json)")
        self.path = path.resolve()
        self.name = str(path)
        self.text_field = text_field
        self.follow_symlinks = follow_symlinks
        self._dataset = self._load()

    def _inside(self, full: Path, what: str) -> Path:
        """`full`, unless it resolves outside the directory (a symlink out, without follow_symlinks)."""
        if not self.follow_symlinks and not full.resolve().is_relative_to(self.path):
            raise ValueError(f"data: {what} in {self.name} is a symlink to {full.resolve()}, outside the directory; "
                             "pass --follow-symlinks (follow_symlinks=True) to read it")
        return full

    def _json(self, file: Path) -> Any:
        """The JSON object of one of the directory's small JSON files, or a one-line ValueError naming it."""
        where = f"data: {self.name!r}: {file.name}"
        if file.stat().st_size > SAVED_JSON_MAX_BYTES:
            raise ValueError(f"{where} holds {file.stat().st_size:,} bytes, more than {SAVED_JSON_MAX_BYTES:,}; "
                             "save_to_disk writes a few KiB: is it the file datasets wrote?")
        value = json_line(file.read_bytes(), where, first=True)
        if not isinstance(value, dict):
            raise ValueError(f"{where} must hold a JSON object, got {type(value).__name__}")
        return value

    def _dataset_directory(self) -> Path:
        """The directory of the Dataset to read (the root, or a DatasetDict's `train`), its files checked."""
        root = self.path
        if not ((root / "state.json").is_file() and (root / "dataset_info.json").is_file()):
            # a DatasetDict (datasets.load_from_disk tries a Dataset first, as here): only its train split is read
            splits = self._json(root / "dataset_dict.json").get("splits")
            if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
                raise ValueError(f"data: {self.name!r}: dataset_dict.json must list its splits as strings "
                                 f"under 'splits', got {splits!r:.80}")
            if "train" not in splits:
                raise ValueError(f"data: {self.name!r} is a DatasetDict with splits {clipped_names(sorted(splits))} "
                                 "and no 'train'")
            root = self._inside(root / "train", "split 'train'")
            for name in ("state.json", "dataset_info.json"):
                if not (root / name).is_file():
                    raise ValueError(f"data: {self.name!r}: its split 'train' has no {name}")
        self._json(root / "dataset_info.json")  # (bounded before datasets reads it whole)
        files = self._json(root / "state.json").get("_data_files")
        if files == []:  # (save_to_disk of a dataset of no rows writes no .arrow file; datasets cannot load it)
            raise ValueError(f"data: {self.name!r} is a saved dataset of no rows (state.json lists no .arrow file)")
        if not isinstance(files, list) or not files:
            raise ValueError(f"data: {self.name!r}: state.json must list the .arrow files under '_data_files'")
        for entry in files:
            name = entry.get("filename") if isinstance(entry, dict) else None
            # save_to_disk writes plain file names: "../x.arrow" or "/x.arrow" would read a file of another place
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"data: {self.name!r}: state.json names {name!r:.80} as a data file; expected the "
                                 "name of an .arrow file in its directory")
            full = root / name
            if not full.is_file():
                raise ValueError(f"data: {self.name!r}: state.json names {name!r}, which is not a file "
                                 f"of {root}")
            self._inside(full, repr(full.relative_to(self.path).as_posix()))
        return root

    def _load(self) -> Any:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, as data/chat.py reads them
        try:
            import datasets
        except ImportError:
            raise ValueError(f"data: {self.name!r} is a saved Hugging Face dataset; reading it needs the datasets "
                             "package, which is not installed: pip install "
                             "'recurrent-depth[data]' (or datasets)") from None
        directory = self._dataset_directory()
        try:
            table = datasets.Dataset.load_from_disk(str(directory), keep_in_memory=False)
        except Exception as exc:  # datasets raises many kinds; the message is what the user needs
            raise ValueError(f"data: {self.name!r} cannot be read with datasets ({_one_line(exc)})") from None
        _check_text_column(table.data.schema, self.text_field, str(self.path))
        return table

    def __iter__(self) -> Iterator[Document]:
        column = self._dataset.select_columns([self.text_field]).with_format("arrow")
        yield from _table_documents(column.iter(batch_size=TABLE_BATCH_ROWS), self.text_field, str(self.path))

    def ids(self) -> Iterator[str]:
        """From the row count, without reading a text: every row is a document (a null is an error)."""
        return (record_id(number) for number in range(1, self._dataset.num_rows + 1))


def load_corpus(
    spec: str | Path | Corpus, text_field: str = DEFAULT_TEXT_FIELD, follow_symlinks: bool = False
) -> Corpus:
    """A corpus from a spec: ``"stdlib"``; a directory (a dataset saved with ``save_to_disk``, a directory
    of ``.parquet`` files, or else a directory of text files); a ``.jsonl`` or a ``.parquet`` file.

    ``text_field``: the field or column of a record's text (JSONL, Parquet, saved dataset); any other
    value than the default with ``stdlib`` or a directory of text files is a ValueError, not ignored.
    ``follow_symlinks``: a directory corpus reads files that are symlinks out of the directory."""
    if isinstance(spec, Corpus):
        return spec
    text = str(spec)
    expected = ("expected 'stdlib', a directory (of text files, of .parquet files, or a dataset saved with "
                "save_to_disk), or a .jsonl or .parquet file")
    if text == "stdlib":
        _check_no_text_field(text_field, text)
        return StdlibCorpus()
    if not text.strip():  # (Path("") is the current directory: an unset shell variable read every file there)
        raise ValueError(f"data: {text!r} is empty; {expected}")
    path = Path(text).expanduser()
    if path.is_dir():
        if is_saved_dataset(path):
            return SavedDatasetCorpus(path, text_field=text_field, follow_symlinks=follow_symlinks)
        tree = DirectoryCorpus(path, follow_symlinks=follow_symlinks)
        # (a FIFO or a dangling link named .parquet is skipped as in a text directory: it decides nothing)
        if any(rel.lower().endswith(".parquet") and (tree.path / rel).is_file() for rel in tree.files()):
            return ParquetCorpus(path, text_field=text_field, follow_symlinks=follow_symlinks)
        _check_no_text_field(text_field, text)
        return tree
    suffix = path.suffix.lower()
    if path.is_file() and suffix == ".jsonl":
        return JsonlCorpus(path, text_field=text_field)
    if path.is_file() and suffix == ".parquet":
        return ParquetCorpus(path, text_field=text_field)
    if path.is_file():
        raise ValueError(f"data: {text!r} is a file but not .jsonl or .parquet; {expected} (a text file is read "
                         "from a directory of them: pass the directory holding it)")
    if path.exists():  # a FIFO, a socket, a device: never opened (a FIFO would block the read)
        raise ValueError(f"data: {text!r} is not a regular file or a directory; {expected}")
    raise ValueError(f"data: {text!r} does not exist; {expected}")


_PART_SUFFIX = re.compile(r"#part-\d{5}$")  # a large file's part (`FileTreeCorpus`): "<rel>#part-00001"


def _split_key(doc_id: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, id): the same on every machine and Python. The parts of one large
    file share their file's number, so they fall on one side (split apart, one text trained and validated on)."""
    digest = hashlib.sha256(f"{seed}\x00".encode() + _id_bytes(_PART_SUFFIX.sub("", doc_id))).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass(frozen=True)
class DocumentSplit:
    """Document-level train/validation assignment.

    A document is in validation when ``sha256(seed, id)`` mapped to [0, 1) is below
    ``val_fraction`` (the parts of a large file: its path's, so all fall on one side). Build it
    with :meth:`plan`, which also guarantees non-empty sides: when the threshold leaves validation
    empty (tiny corpora) the document with the smallest key is moved there, and when it leaves
    training empty the largest-key document is moved back.
    """

    val_fraction: float
    seed: int
    forced_validation: str | None = None
    forced_train: str | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.val_fraction < 1.0):
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")

    @classmethod
    def plan(cls, doc_ids: Iterable[str], val_fraction: float, seed: int = 0) -> DocumentSplit:
        """One streaming pass over the ids; memory does not grow with the corpus."""
        if not (0.0 <= val_fraction < 1.0):
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        count = num_val = 0
        lowest: tuple[float, str] | None = None
        highest: tuple[float, str] | None = None
        for doc_id in doc_ids:
            key = _split_key(doc_id, seed)
            count += 1
            num_val += key < val_fraction
            if lowest is None or (key, doc_id) < lowest:
                lowest = (key, doc_id)
            if highest is None or (key, doc_id) > highest:
                highest = (key, doc_id)
        forced_val = forced_train = None
        if lowest is not None and highest is not None:
            if val_fraction > 0 and num_val == 0 and count >= 2:
                forced_val = lowest[1]
            if num_val == count:
                forced_train = highest[1]
        return cls(val_fraction, seed, forced_val, forced_train)

    def is_validation(self, doc_id: str) -> bool:
        if doc_id == self.forced_train:
            return False
        if doc_id == self.forced_validation:
            return True
        return _split_key(doc_id, self.seed) < self.val_fraction

    def select(self, docs: Iterable[Document], side: Literal["train", "validation"]) -> Iterator[Document]:
        """The documents of one side, in corpus order."""
        if side not in ("train", "validation"):
            raise ValueError(f"side must be 'train' or 'validation', got {side!r}")
        want_val = side == "validation"
        for doc in docs:
            if self.is_validation(doc.id) == want_val:
                yield doc

    def to_dict(self) -> dict:
        return asdict(self)

