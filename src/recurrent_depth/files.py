"""Files: reading what a user hands us (configs, indexes, tokenizers, weight headers) as untrusted
input, and writing ours crash-safely (`AtomicFile`, `atomic_write_text`, `atomic_path`, at the end):
the one place the library writes a file atomically.

Every read here is bounded: only regular files (never a device such as /dev/zero, a FIFO or a
socket, which would hang or never end), of at most a stated size, opened without blocking; JSON
nested deeper than Python's recursion limit is a ValueError, not a RecursionError; a path named
inside a directory must stay inside it unless the caller allows otherwise. Every failure is one
ValueError (or FileNotFoundError) line naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)

MiB = 2**20
# Bounds on what we read whole. Generous for real files (the official Huginn-0125 config.json is
# 2 KB, its tokenizer.json 4 MB; the largest public tokenizer.json files are ~35 MB).
CONFIG_MAX_BYTES = 16 * MiB
TOKENIZER_MAX_BYTES = 256 * MiB
# safetensors' own limit on the JSON header of a weight file.
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000


def open_regular(path: str | os.PathLike[str], max_bytes: int | None = None, what: str = "file") -> tuple[int, int]:
    """(file descriptor, size) of a regular file of at most `max_bytes`, opened read-only without blocking.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer; the fstat then
    refuses it (and every other non-regular file) before anything is read.
    """
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, expected a file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {path}{link_note(path)} is not a regular file (a directory, device, FIFO or "
                             "socket); refusing to read it")
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(f"{what} {path} has {info.st_size:,} bytes, more than the {max_bytes:,} allowed")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_bytes(path: str | os.PathLike[str], max_bytes: int, what: str = "file") -> bytes:
    """The content of a regular file of at most `max_bytes` (a file growing while read is cut off there)."""
    fd, _ = open_regular(path, max_bytes, what)
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {path} has more than the {max_bytes:,} bytes allowed")
    return data


def file_sha256(path: str | os.PathLike[str], max_bytes: int | None = None, what: str = "file") -> str:
    """The sha256 of a regular file (of at most `max_bytes`), streamed in 1 MiB reads."""
    fd, _ = open_regular(path, max_bytes, what)
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as handle:
        while chunk := handle.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def read_text(path: str | os.PathLike[str], max_bytes: int, what: str = "file") -> str:
    data = read_bytes(path, max_bytes, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text: {exc}") from None


def parse_json(text: str | bytes, source: str) -> Any:
    """json.loads with one-line errors: invalid JSON and JSON nested too deeply to parse."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source} is JSON nested too deeply to parse") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source} is not UTF-8 text: {exc}") from None
    except ValueError as exc:  # (a number of over 4300 digits: Python's int limit, which named no source)
        raise ValueError(f"{source} is JSON the parser cannot read: {exc}") from None


def read_json(path: str | os.PathLike[str], max_bytes: int = CONFIG_MAX_BYTES, what: str = "file") -> Any:
    return parse_json(read_text(path, max_bytes, what), f"{what} {path}")


def inside(
    root: str | os.PathLike[str], name: Any, what: str, allow_outside: bool = False, follow_links: bool = False
) -> Path:
    """`root / name`, refused (ValueError) unless it lies inside `root`.

    An absolute name or a `..` component would make a file in someone else's directory tree ours to
    read; so would a symlink leading out, unless `follow_links` (weight files: a Hugging Face hub
    snapshot's files are symlinks into its blob store next door). `allow_outside=True` is the
    caller's explicit opt-in to any path.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"{what} {name!r} is not a file name")
    path = Path(root) / name
    if not allow_outside:
        escapes = Path(name).is_absolute() or ".." in Path(name).parts
        if not escapes and not follow_links:
            escapes = not path.resolve().is_relative_to(Path(root).resolve())
        if escapes:
            raise ValueError(f"{what} {name!r} lies outside {root}; only files inside the directory are read")
    return path


def link_note(path: str | os.PathLike[str]) -> str:
    """" (a symlink to TARGET)" for a path that is one, so that an error names the file actually read."""
    try:
        return f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
    except OSError:
        return ""


# The dtypes the safetensors format defines (its header may name no other).
SAFETENSORS_DTYPES = frozenset({"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "C64"})
MESSAGE_NAME_CHARS = 120
PATH_MAX_CHARS = 4096  # Linux's PATH_MAX: a longer path recorded in a file is no path (and would fill a message)


def clipped(value: Any, limit: int = MESSAGE_NAME_CHARS) -> str:
    """`repr(value)`, cut to about `limit` characters: a name read from a file goes into a one-line error,
    and a file can hold a name of 90 MB."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def clipped_names(names: Any, shown: int = 5) -> str:
    """The first `shown` of `names`, each clipped, and how many more: a list for a one-line error."""
    names = list(names)
    more = f", and {len(names) - shown:,} more" if len(names) > shown else ""
    return "[" + ", ".join(clipped(n) for n in names[:shown]) + more + "]"


def parse_safetensors_header(path: str | os.PathLike[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header, read without its data."""
    fd, size = open_regular(path, None, "weights file")
    with os.fdopen(fd, "rb") as handle:
        return read_safetensors_header(handle, size, path)


def read_safetensors_header(
    handle: BinaryIO, size: int, path: str | os.PathLike[str]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`parse_safetensors_header` of an open regular file of `size` bytes (read from its start).

    Checks what the safetensors format promises (an 8-byte little-endian header length, a JSON
    header of at most 100 MB, each tensor's bytes inside the file, the file ending where its last
    tensor does), so that a truncated, padded or forged file is a one-line error before anything is
    allocated for its tensors, and a file is only as large as the tensors it declares: a symlink to a
    huge file is refused at once, not mapped.
    """
    head = handle.read(8)
    if len(head) < 8:
        raise ValueError(f"weights file {path}{link_note(path)} is not a safetensors file: it has only {size} bytes")
    length = int.from_bytes(head, "little")
    if length > min(SAFETENSORS_HEADER_MAX_BYTES, size - 8):
        raise ValueError(
            f"weights file {path}{link_note(path)} is not a readable safetensors file: its header claims "
            f"{length:,} bytes (the file has {size:,}; truncated or not safetensors)"
        )
    header = parse_json(handle.read(length), f"the safetensors header of {path}")
    if not isinstance(header, dict):
        raise ValueError(f"weights file {path} has a safetensors header that is not a JSON object")
    data_bytes = size - 8 - length
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    extent = 0
    for name, entry in header.items():
        if name == "__metadata__":  # (safetensors itself fails on anything else, in an error naming no file)
            if not (isinstance(entry, dict) and all(isinstance(value, str) for value in entry.values())):
                raise ValueError(f"weights file {path}: the header's __metadata__ is malformed (expected an object "
                                 f"of strings)")
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            valid = dtype in SAFETENSORS_DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
            valid = valid and isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise ValueError(f"weights file {path}: the header entry of {clipped(name)} is malformed "
                             f"(expected a safetensors dtype, a shape and data offsets)")
        if end > data_bytes:
            raise ValueError(
                f"weights file {path} is truncated: tensor {clipped(name)} ends at byte {end:,} of the data, "
                f"which holds {data_bytes:,}"
            )
        tensors[name] = (dtype, shape)
        extent = max(extent, end)
    if data_bytes > extent:
        raise ValueError(
            f"weights file {path}{link_note(path)} has {data_bytes - extent:,} bytes past its last tensor "
            f"({size:,} in all): not a safetensors file (which ends with its data)"
        )
    return tensors


def reopen_path(handle: BinaryIO, path: str | os.PathLike[str]) -> str:
    """A path that opens the very file `handle` has open (/proc/self/fd/N, where there is one), for a
    reader that takes only a path: a symlink swapped after the checks cannot change what it reads."""
    proc = f"/proc/self/fd/{handle.fileno()}"
    return proc if os.path.exists(proc) else os.fspath(path)


# ---------------------------------------------------------------- crash-safe writes
# Write a temporary file, fsync it, rename it over the target: a reader sees either the old
# complete file or the new complete file, never a torn one, even after kill -9 or a power loss
# (the directory is fsynced after the rename).
TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Persist a rename inside ``path`` (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else's writer (safetensors' `save_file`) to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def remove_tree(path: Path, ignore_errors: bool = False) -> None:
    """Delete `path`: a directory with everything in it, a file, or a symlink, which loses only the link (what it
    points to, say a checkpoint moved to another disk, is not ours to delete; rmtree refuses a link anyway).
    ignore_errors: a missing `path`, and what of a directory cannot be removed, pass in silence (tidying a cache's
    leftovers, which another process may be removing too); otherwise the OSError is raised."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=ignore_errors)
    else:
        path.unlink(missing_ok=ignore_errors)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with AtomicFile(path) as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _publish(tmp: Path, path: Path) -> None:
    """Rename the fully written and fsynced `tmp` over `path`, and persist the rename."""
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """``with atomic_path(path) as tmp: writer(tmp)`` for writers that take a file name rather than a
    handle (safetensors' ``save_file``): ``tmp`` is fsynced and published under ``path`` when the block
    exits without an exception, removed otherwise (``path`` then untouched)."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        yield tmp
        fsync_file(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _publish(tmp, path)


def with_path(exc: OSError, path: str | os.PathLike[str]) -> OSError:
    """`exc` naming `path` when it names no file: a write that fails on a full disk says only
    "[Errno 28] No space left on device", not which file could not be written."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), os.fspath(path))


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Re-raise an OSError of the block that names no file as one naming `path` (see `with_path`)."""
    try:
        yield
    except OSError as exc:
        named = with_path(exc, path)
        if named is exc:
            raise
        raise named from None


class AtomicFile:
    """``with AtomicFile(path) as f: f.write(...)`` streams into ``path + ".tmp"`` and publishes
    it under ``path`` only when the block exits without an exception (otherwise the temporary
    file is removed and ``path`` is untouched)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self._handle: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        self.tmp.unlink(missing_ok=True)  # (a symbolic link of that name would be written through to its target)
        self._handle = open(self.tmp, "wb")  # noqa: SIM115 - closed in __exit__
        return self._handle

    def __exit__(self, exc_type, exc, tb) -> None:
        handle = self._handle
        assert handle is not None
        if exc_type is not None:
            with contextlib.suppress(OSError):  # (closing flushes: on a full disk that fails again)
                handle.close()
            self.tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and (named := with_path(exc, self.path)) is not exc:
                raise named from None
            return
        try:
            with naming(self.path):
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        except BaseException:
            with contextlib.suppress(OSError):
                handle.close()
            self.tmp.unlink(missing_ok=True)
            raise
        _publish(self.tmp, self.path)


# ---------------------------------------------------------------- locks between processes
LOCK_POLL_SECONDS = 0.2


@contextmanager
def held_lock(path: str | Path, timeout: float, what: str = "lock", warn_after: float = 0.0) -> Iterator[bool]:
    """An exclusive lock on the file `path` between processes, held for the block.

    An flock, not the file's existence: the kernel drops it when its holder ends, however it ends
    (kill -9 included), so a lock file left behind never blocks anyone. A live holder is waited for
    (one message once `warn_after` seconds have passed, naming the file and its pid), for at most `timeout`
    seconds: then a TimeoutError line. Yields whether the lock is held: False (after a warning) where the file
    system has no locks, and the block runs unlocked.
    """
    import errno
    import fcntl

    path = Path(path)
    with naming(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        began = time.monotonic()
        deadline = began + timeout
        told = False
        locked = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} {path} is still held by process {holder} after {timeout:g} s; "
                                       "try again once that process is done") from None
                if not told and time.monotonic() - began >= warn_after:
                    log.warning("waiting for %s %s, held by process %s", what, path, holder)
                    told = True
                time.sleep(LOCK_POLL_SECONDS)
            except OSError as exc:  # (a file system without locks, as lock_directory: go on unlocked, warned)
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise with_path(exc, path) from None
                log.warning("%s %s cannot be taken (%s): nothing stops another process meanwhile", what, path,
                            exc.strerror)
                locked = False
                break
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the messages of those who wait
        yield locked
    finally:
        os.close(fd)  # (releases the flock)


DIR_LOCK_FILE = ".rdepth.lock"


def lock_directory(directory: str | Path, what: str = "output directory") -> BinaryIO | None:
    """Take the exclusive flock of `directory`'s lock file (`DIR_LOCK_FILE`) without waiting, for as long
    as the returned file stays open (close it to release; the kernel drops it when the process ends, however
    it ends). A holder is refused at once: a ValueError line naming the directory and the holding process.
    None (and a logged warning) where the file system, or the platform, has no locks."""
    import errno

    try:
        import fcntl
    except ImportError:  # (not POSIX)
        log.warning("%s %s is not locked on this platform: nothing stops another run from writing it meanwhile",
                    what, directory)
        return None
    path = Path(directory) / DIR_LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    with naming(path):
        fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        who = "another run in this process" if holder == str(os.getpid()) else f"process {holder}"
        raise ValueError(f"{what} {directory} is in use by {who} (it holds {path}); wait for it to finish or "
                         "choose another directory") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise with_path(exc, path) from None
        log.warning("%s %s cannot be locked (%s): nothing stops another run from writing it meanwhile", what,
                    directory, exc.strerror)
        return None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return os.fdopen(fd, "r+b")


@contextmanager
def locked_directory(directory: str | Path, what: str = "output directory") -> Iterator[None]:
    """`lock_directory` held for the block (for a clean-up before a run, which then takes the lock itself)."""
    lock = lock_directory(directory, what)
    try:
        yield
    finally:
        if lock is not None:
            lock.close()


def check_out_dir(out: str | Path, flag: str = "--out") -> None:
    """A one-line ValueError when the output directory `out` is an existing file (mkdir's own error
    is a bare "[Errno 17] File exists")."""
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{flag} {out} is an existing file, not a directory; choose another path")


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf), however nested in dicts and lists, as None: what
    strict JSON can hold (`json.dumps(..., allow_nan=False)`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value
