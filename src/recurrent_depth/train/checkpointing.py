"""Training checkpoints: weights, optimizer, RNG and loop state, written atomically, nothing pickled.

A checkpoint is a directory `<out>/checkpoints/step-00000050/` holding

    config.json, model.safetensors, tokenizer files   a model directory (any --model option loads it)
    optimizer.safetensors + optimizer.json            optimizer state: tensors + their JSON skeleton
    rng.safetensors (+ rng-rank<r>.safetensors)       torch RNG states of every rank
    trainer_state.json                                step, micro-batch index, tokens, data position, ...

    manifest.json                                     size and sha256 of every other file

It is written into a hidden temporary directory (every file fsynced), which is then renamed into
place and the parent directory fsynced: after a crash, even `kill -9`, a `step-*` directory is
either complete or absent. Old checkpoints are renamed away before deletion for the same reason.

Before writing, the free space is checked against the bytes the checkpoint needs, and old
checkpoints beyond `keep_last` are pruned first (on a full disk the oldest kept one too, since
`keep_last` counts the checkpoint about to be written). A failed write removes its temporary
directory and raises `CheckpointWriteError`, one line naming the path.

On resume, `newest_valid_checkpoint` checks each checkpoint against its manifest and what its files
say against each other (`checkpoint_problem`), and falls back to the newest valid one. A checkpoint
without a valid manifest is invalid too: the manifest is written last, so its absence means the
directory was not finished by this library (or was edited since), and its structure alone proves
nothing about its data. `set_aside` renames an invalid one to `step-N.invalid-<k>` (never deleted),
so the step can be written again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from recurrent_depth.files import (
    file_sha256,
    fsync_dir,
    fsync_file,
    parse_safetensors_header,
    read_json,
    remove_tree,
)

CHECKPOINTS_DIR = "checkpoints"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "recurrent-depth-checkpoint-manifest"
REQUIRED_FILES = ("config.json", "model.safetensors", OPTIMIZER_TENSORS, OPTIMIZER_META, TRAINER_STATE)
_NAME = re.compile(r"^step-(\d{8,})$")
_SET_ASIDE = re.compile(r"^step-\d{8,}\.invalid-\d+$")  # (`set_aside`'s names)
MAX_JSON_BYTES = 256 << 20  # a manifest / trainer state / optimizer skeleton larger than this is not ours
# Bytes a checkpoint needs besides its tensors (JSON files, tokenizer, filesystem slack).
_SPACE_MARGIN = 4 << 20


class CheckpointWriteError(OSError):
    """A checkpoint or model directory could not be written (full disk, permissions): one line naming it."""
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step-\d{8,}$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


# ------------------------------------------------------------------ nested state <-> tensors + JSON
def flatten_state(obj: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nested state (dicts, lists, tuples, tensors, plain scalars) into JSON and tensors.

    Every tensor is replaced by `{"__tensor__": key}` and returned in the tensor dict under `key`;
    dicts with non-string keys (optimizer state is keyed by int) become `{"__items__": [[k, v], ...]}`
    and tuples `{"__tuple__": [...]}`, so `unflatten_state` rebuilds the object exactly.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = path or "tensor"
            if key in tensors:  # two paths spelled the same ("a.b" key vs a -> b): keep both
                key = f"{key}#{len(tensors)}"
            tensors[key] = value.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
                return {k: encode(v, f"{path}.{k}" if path else k) for k, v in value.items()}
            return {"__items__": [[_encode_key(k), encode(v, f"{path}.{k}")] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise ValueError(f"cannot store {type(value).__name__} at {path!r} in a checkpoint (no pickling)")

    return encode(obj, prefix), tensors


def unflatten_state(meta: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`."""
    if isinstance(meta, dict):
        if set(meta) == {"__tensor__"}:
            return tensors[meta["__tensor__"]]
        if set(meta) == {"__items__"}:
            return {k: unflatten_state(v, tensors) for k, v in meta["__items__"]}
        if set(meta) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in meta["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in meta.items()}
    if isinstance(meta, list):
        return [unflatten_state(v, tensors) for v in meta]
    return meta


def _encode_key(key: Any) -> Any:
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise ValueError(f"cannot store a dict key of type {type(key).__name__} in a checkpoint")
    return key


# ------------------------------------------------------------------ file helpers
def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    fsync_file(path)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            out[name] = handle.get_tensor(name)
    return out


def save_state_files(directory: Path, stem: str, state: Any) -> None:
    """Write `state` as `<stem>.safetensors` + `<stem>.json` (see `flatten_state`)."""
    meta, tensors = flatten_state(state)
    write_tensors(directory / f"{stem}.safetensors", tensors)
    write_json(directory / f"{stem}.json", meta)


def load_state_files(directory: Path, stem: str) -> Any:
    """The state `save_state_files` wrote; a damaged pair of files is one ValueError naming them."""
    tensor_file = directory / f"{stem}.safetensors"
    meta = read_json(directory / f"{stem}.json", MAX_JSON_BYTES, "checkpoint file")
    parse_safetensors_header(tensor_file)  # truncated or not safetensors: a one-line error
    tensors = read_tensors(tensor_file)
    try:
        return unflatten_state(meta, tensors)
    except KeyError as exc:
        raise ValueError(f"{directory / f'{stem}.json'} names tensor {exc} that {tensor_file} does not hold") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{directory / f'{stem}.json'} is not a state this library wrote: {exc}") from None


# ------------------------------------------------------------------ RNG
def rng_state_tensors() -> dict[str, torch.Tensor]:
    """This process's torch RNG states (CPU and, when present, every CUDA device)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = state
    return out


def restore_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


# ------------------------------------------------------------------ directories
def checkpoints_root(out: str | Path) -> Path:
    return Path(out) / CHECKPOINTS_DIR


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_dir() and all((entry / f).is_file() for f in REQUIRED_FILES):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def holds_any_checkpoint(root: str | Path) -> bool:
    """Whether `root` holds a checkpoint, valid or not: a `step-N` directory (complete or not), or one set aside as
    invalid (`step-N.invalid-<k>`, `set_aside`). `list_checkpoints` lists the complete ones only."""
    root = Path(root)
    return root.is_dir() and any((_NAME.match(e.name) or _SET_ASIDE.match(e.name)) and e.is_dir()
                                 for e in root.iterdir())


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def begin_checkpoint(root: Path, step: int) -> Path:
    """A fresh temporary directory to write step `step`'s files into.

    Temporary and trash directories left by a crash during an earlier save or prune (of any step)
    are removed first: nothing else writes into `root`, and they would otherwise stay forever."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.is_dir() and _LEFTOVER.match(entry.name):
            remove_tree(entry)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    tmp.mkdir()
    return tmp


def commit_checkpoint(
    tmp: Path, step: int, keep_last: int | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Write the manifest, atomically publish `tmp` as `step-<step>`; then keep only the newest `keep_last`.

    An invalid checkpoint already holding that name (say, the corrupt newest one a resume skipped) is set
    aside first; a valid one is never overwritten."""
    for entry in tmp.iterdir():
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    write_manifest(tmp)
    fsync_dir(tmp)
    final = tmp.parent / checkpoint_name(step)
    if final.exists():
        problem = checkpoint_problem(final)
        if problem is None:
            raise ValueError(f"checkpoint {final} already exists; refusing to overwrite it")
        moved = set_aside(final)
        if log is not None:
            log(f"checkpoint {final} was invalid ({problem}): moved it to {moved.name} before writing this step")
    os.rename(tmp, final)
    fsync_dir(tmp.parent)
    if keep_last is not None:
        prune_checkpoints(tmp.parent, keep_last)
    return final


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (each renamed away first, then removed)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    _prune(root, keep_last)


def _prune(root: Path, keep: int) -> None:
    found = list_checkpoints(root)
    for _, path in found[: max(0, len(found) - keep)]:
        trash = path.with_name(f".trash-{path.name}")
        os.rename(path, trash)
        remove_tree(trash)
    fsync_dir(root)


# ------------------------------------------------------------------ checksums and validation
def write_manifest(directory: Path) -> None:
    """`manifest.json`: size and sha256 of every other file in `directory` (read back after fsync)."""
    files = {
        entry.name: {"bytes": entry.stat().st_size, "sha256": file_sha256(entry)}
        for entry in sorted(directory.iterdir())
        if entry.is_file() and entry.name != MANIFEST
    }
    write_json(directory / MANIFEST, {"format": MANIFEST_FORMAT, "version": 1, "files": files})


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, in a few words (None: it can).

    Every file its `manifest.json` lists must be present with its size and sha256, and the files must
    agree with each other and with the directory's name (`content_problem`). A checkpoint without a
    manifest (one written before manifests existed, or whose manifest was removed) is invalid: only the
    manifest vouches for the tensor data, which no structural check can."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    if not (path / MANIFEST).is_file():
        return (f"no {MANIFEST} (its data cannot be checked: a checkpoint from before manifests, or one "
                "whose manifest was removed)")
    try:
        return _manifest_problem(path) or content_problem(path)
    except (OSError, ValueError) as exc:
        return _one_line(exc)


def content_problem(path: Path) -> str | None:
    """What in a checkpoint's files contradicts the rest (None: nothing): the loop counters of
    `trainer_state.json` (non-negative integers, `step` the one in the directory's name), the data
    position, its `config` (an object) and `world_size` (an integer >= 1) where present, every safetensors
    header, and the RNG files (a CPU generator state of the right size)."""
    state = read_trainer_state(path)
    for name in ("step", "micro_step", "tokens", "skipped_steps"):
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{TRAINER_STATE}: {name} must be a non-negative integer, got {value!r}"
    elapsed = state["elapsed_s"]
    if isinstance(elapsed, bool) or not isinstance(elapsed, int | float) or not 0 <= elapsed < float("inf"):
        return f"{TRAINER_STATE}: elapsed_s must be a non-negative number, got {elapsed!r}"
    per_step = state.get("tokens_per_step")  # (optional: a data= source's measured tokens per step)
    if per_step is not None and (isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1):
        return f"{TRAINER_STATE}: tokens_per_step must be an integer >= 1 or null, got {per_step!r}"
    match = _NAME.match(path.name)
    if match and int(match.group(1)) != state["step"]:
        return f"{TRAINER_STATE} says step {state['step']}, the directory is step {int(match.group(1))}"
    data_problem = _data_state_problem(state["data"])
    if data_problem:
        return f"{TRAINER_STATE}: {data_problem}"
    # (read by the resume's checks: a list here was a TypeError traceback, a string world_size a riddle)
    config = state.get("config", {})
    if not isinstance(config, dict):
        return f"{TRAINER_STATE}: config must be a JSON object (the run's settings), not {type(config).__name__}"
    world = state.get("world_size")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        return f"{TRAINER_STATE}: world_size must be an integer >= 1, got {world!r}"
    for name in ("model.safetensors", OPTIMIZER_TENSORS):
        try:
            parse_safetensors_header(path / name)
        except ValueError as exc:
            return f"{name} is not a readable safetensors file ({_one_line(exc)})"
    read_json(path / OPTIMIZER_META, MAX_JSON_BYTES, "checkpoint file")
    for entry in sorted(path.glob("rng*.safetensors")):
        problem = rng_file_problem(entry)
        if problem:
            return problem
    return None


def _data_state_problem(data: Any) -> str | None:
    """A data position (a dict of plain values; a shard dataset's `epoch` and `position` in range)."""
    if not isinstance(data, dict):
        return f"data must be a JSON object, got {type(data).__name__}"
    counters = {k: data[k] for k in ("epoch", "position", "num_rows") if k in data}
    for name, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"data.{name} must be a non-negative integer, got {value!r}"
    if "position" in counters and "num_rows" in counters and counters["position"] >= max(counters["num_rows"], 1):
        return f"data.position {counters['position']} is past the {counters['num_rows']} rows"
    return None


def rng_file_problem(path: Path) -> str | None:
    """An RNG file must hold the CPU generator's state (`torch_cpu`, uint8, the size this torch uses)."""
    try:
        header = parse_safetensors_header(path)
    except ValueError as exc:
        return f"{path.name} is not a readable safetensors file ({_one_line(exc)})"
    expected = (torch.get_rng_state().numel(),)
    found = header.get("torch_cpu")
    if found != ("U8", expected):
        names = ", ".join(sorted(header)[:5]) or "nothing"
        return (f"{path.name} does not hold a CPU RNG state (torch_cpu, U8 of shape {list(expected)}); "
                f"it holds {names}")
    return None


def _manifest_problem(path: Path) -> str | None:
    manifest = read_json(path / MANIFEST, MAX_JSON_BYTES, "checkpoint file")
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return f"{MANIFEST} is not a checkpoint manifest"
    for name in REQUIRED_FILES:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, entry in files.items():
        file = path / name
        if "/" in name or name in ("", ".", "..") or not isinstance(entry, dict):
            return f"{MANIFEST} has an invalid entry {name!r}"
        if not file.is_file():
            return f"missing {name}"
        size = file.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, {MANIFEST} says {entry.get('bytes')}"
        if file_sha256(file) != entry.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST}"
    return None


def newest_valid_checkpoint(root: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `root` that passes `checkpoint_problem`, and the newer ones it skipped
    (path, why), newest first. Directories named `step-N` count even when incomplete."""
    root = Path(root)
    skipped: list[tuple[Path, str]] = []
    if not root.is_dir():
        return None, skipped
    named = sorted(((int(m.group(1)), e) for e in root.iterdir() if (m := _NAME.match(e.name)) and e.is_dir()),
                   reverse=True)
    for _, path in named:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def set_aside(path: Path) -> Path:
    """Rename an invalid checkpoint to `<name>.invalid-<k>` (the first free k): kept, but out of the way."""
    k = 1
    while (target := path.with_name(f"{path.name}.invalid-{k}")).exists():
        k += 1
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


# ------------------------------------------------------------------ disk space and failed writes
def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested state (what writing it to safetensors needs)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def directory_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.iterdir() if entry.is_file())


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Raise `CheckpointWriteError` when `directory`'s filesystem has less than `needed` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CheckpointWriteError(
            f"not enough disk space to write {what}: it needs about {_megabytes(needed)}, "
            f"{_megabytes(free)} free in {directory}"
        )


def make_room(root: Path, step: int, needed: int, keep_last: int | None,
              log: Callable[[str], None] | None = None) -> None:
    """Before writing checkpoint `step`: prune to `keep_last`, check the free space for `needed` bytes.

    `keep_last` counts the checkpoint about to be written, so when the disk is short the oldest kept one
    is removed first, but only if that makes enough room (never for a write that would fail anyway)."""
    root.mkdir(parents=True, exist_ok=True)
    needed += _SPACE_MARGIN
    if keep_last is not None:
        prune_checkpoints(root, keep_last)
    free = shutil.disk_usage(root).free
    found = list_checkpoints(root)
    if free < needed and keep_last is not None and found and len(found) >= keep_last:
        oldest = found[0][1]
        if free + directory_bytes(oldest) >= needed:
            if log is not None:
                log(f"low disk space ({_megabytes(free)} free, {_megabytes(needed)} needed): removing {oldest} "
                    f"before writing step {step} (keep_last={keep_last} counts the new checkpoint)")
            _prune(root, keep_last - 1)
    check_free_space(root, needed, f"checkpoint {root / checkpoint_name(step)}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


@contextmanager
def staged_write(tmp: Path, final: Path, what: str) -> Iterator[None]:
    """Remove `tmp` when writing into it fails; an OS or safetensors error becomes one line naming `final`."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, CheckpointWriteError):
            raise
        raise CheckpointWriteError(f"could not write {what} {final}: {_one_line(exc)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_staging(final: Path) -> None:
    """Remove what a process killed while writing `final` left beside it (`.<name>.tmp-<pid>`, a whole model's
    copy, and `.<name>.old-<pid>`, see `publish_directory`): those of processes that are gone, or of this one."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(tmp|old)-(\d+)$")
    if not final.parent.is_dir():
        return
    for entry in final.parent.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not _process_alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # (a leftover of an earlier process that had this pid: this process writes it afresh)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # (another user's process, or unknown: kept)
    return True


def publish_directory(tmp: Path, final: Path) -> None:
    """Move a fully written directory `tmp` to `final`, replacing an older `final` (kept until the new one
    is in place, so a crash leaves the old or the new directory, never an empty one)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        remove_tree(old)


class StateView:
    """What `save_pretrained` needs from a model: a config and a state dict (e.g. gathered from FSDP)."""

    def __init__(self, config: Any, state: dict[str, torch.Tensor]) -> None:
        self.config = config
        self._state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.config.tie_embeddings:
            return {k: v for k, v in self._state.items() if k != "lm_head.weight"}
        return self._state


@dataclass
class LoadedCheckpoint:
    path: Path
    model_state: dict[str, torch.Tensor]
    optimizer_state: Any
    trainer_state: dict[str, Any]
    rng: dict[str, torch.Tensor]


TRAINER_STATE_FIELDS = ("step", "micro_step", "tokens", "skipped_steps", "elapsed_s", "data")


def read_trainer_state(path: Path) -> dict[str, Any]:
    """`trainer_state.json` of a checkpoint, with the fields a resume needs (else one ValueError)."""
    state = read_json(path / TRAINER_STATE, MAX_JSON_BYTES, "checkpoint file")
    missing = [name for name in TRAINER_STATE_FIELDS if not isinstance(state, dict) or name not in state]
    if missing:
        raise ValueError(f"{path / TRAINER_STATE} lacks the fields {missing}; the checkpoint is damaged")
    return state


def load_checkpoint(path: str | Path, rank: int = 0) -> LoadedCheckpoint:
    """Read every part of a checkpoint directory (this rank's RNG state included)."""
    from recurrent_depth.checkpoint import read_state_dict

    path = Path(path)
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"{path} is not a complete training checkpoint: missing {missing}")
    rng_file = path / (RNG_TENSORS if rank == 0 else f"rng-rank{rank}.safetensors")
    return LoadedCheckpoint(
        path=path,
        model_state=read_state_dict(path),
        optimizer_state=load_state_files(path, "optimizer"),
        trainer_state=read_trainer_state(path),
        rng=read_tensors(rng_file) if rng_file.is_file() else {},
    )
