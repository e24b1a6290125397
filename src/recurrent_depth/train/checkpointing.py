"""Training checkpoints: weights, optimizer, RNG and loop state, written atomically, nothing pickled.

A checkpoint is a directory `<out>/checkpoints/step-00000050/` holding

    config.json, model.safetensors, tokenizer files   a model directory (any --model option loads it)
    optimizer.safetensors + optimizer.json            optimizer state: tensors + their JSON skeleton
    rng.safetensors (+ rng-rank<r>.safetensors)       torch RNG states of every rank
    trainer_state.json                                step, micro-batch index, tokens, data position, ...

It is written into a hidden temporary directory (every file fsynced), which is then renamed into
place and the parent directory fsynced: after a crash, even `kill -9`, a `step-*` directory is
either complete or absent. Old checkpoints are renamed away before deletion for the same reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CHECKPOINTS_DIR = "checkpoints"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
TRAINER_STATE = "trainer_state.json"
REQUIRED_FILES = ("config.json", "model.safetensors", OPTIMIZER_TENSORS, OPTIMIZER_META, TRAINER_STATE)
_NAME = re.compile(r"^step-(\d{8,})$")
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
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


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
    from recurrent_depth.files import parse_safetensors_header, read_json

    tensor_file = directory / f"{stem}.safetensors"
    meta = read_json(directory / f"{stem}.json", 256 * 2**20, "checkpoint file")
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
            shutil.rmtree(entry)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    tmp.mkdir()
    return tmp


def commit_checkpoint(tmp: Path, step: int, keep_last: int | None = None) -> Path:
    """Atomically publish `tmp` as `step-<step>`; then keep only the newest `keep_last`."""
    for entry in tmp.iterdir():
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(tmp)
    final = tmp.parent / checkpoint_name(step)
    if final.exists():
        raise ValueError(f"checkpoint {final} already exists; refusing to overwrite it")
    os.rename(tmp, final)
    fsync_dir(tmp.parent)
    if keep_last is not None:
        prune_checkpoints(tmp.parent, keep_last)
    return final


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (each renamed away first, then removed)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for _, path in list_checkpoints(root)[:-keep_last]:
        trash = path.with_name(f".trash-{path.name}")
        os.rename(path, trash)
        shutil.rmtree(trash)
    fsync_dir(root)


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
    from recurrent_depth.files import read_json

    state = read_json(path / TRAINER_STATE, 256 * 2**20, "checkpoint file")
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
