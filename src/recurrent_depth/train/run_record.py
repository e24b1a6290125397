"""The record a training run leaves in its `out` directory, apart from checkpoints and weights:
`run.json` (what ran: config, versions, hardware, git revision, data), `metrics.jsonl` and
`eval.jsonl` (JSON lines, flushed per line, trimmed on resume) and `tensorboard/`. A run starting from step 0 where
an earlier session left its record sets that record aside whole (`set_aside_run_record`), never overwriting it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recurrent_depth.files import atomic_write_text, finite_or_null, fsync_dir, naming

# A `train.trainer.Trainer`: named, not imported, since the trainer imports this module (layers point one way).
Trainer = Any

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
RUN_FILE = "run.json"
TENSORBOARD_DIR = "tensorboard"
# Where `set_aside_run_record` keeps an earlier session's record: `out/previous-<k>` (the first free k).
PREVIOUS_DIR = "previous-{k}"
# A step's metrics record goes to tensorboard as `train/<key>`, each of its numbers (what objectives and sources
# add too: RL's `reward_mean`, SFT's `scored_tokens`, `indexer_kl`, ...) but these, plus `train/depth`.
TENSORBOARD_SKIPPED = ("step",)


def num_parameters(model: nn.Module) -> int:
    """Trainable + frozen parameters, tied ones once; an int8 / int4 layer's (a QLoRA base's) as its float weight's."""
    from recurrent_depth.weight_quant import logical_parameters

    return logical_parameters(model)


def run_metadata(trainer: Trainer) -> dict[str, Any]:
    """What `run.json` records about a trainer's run."""
    cfg, config = trainer.cfg, trainer.model_config
    return {
        "config": cfg.to_dict(),
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "model_class": type(trainer.model).__name__,
        "parameters": num_parameters(trainer.model),
        "seq_len": trainer.seq_len,
        "tokens_per_step": trainer.tokens_per_step,
        # (a baseline's every step is one core pass with gradient, whatever the sampler would draw)
        "sampler": ({"scheme": "baseline", "num_steps": [0, 1]} if cfg.baseline
                    else trainer.sampler.to_dict() if trainer.sampler is not None else None),
        "eval_depths": trainer.eval_depths,
        # (validation_state: the streams of each validation row's s_0, `validation.row_states`)
        "seeds": {"weights": cfg.seed, "data": cfg.seed, "depth": cfg.seed, "initial_state": cfg.seed + 1,
                  "validation_state": cfg.seed},
        "data": trainer.source.describe(),
        "tokenizer_dir": str(trainer.tokenizer_dir) if trainer.tokenizer_dir is not None else None,
        "resumed_from": str(trainer.resume_from) if trainer.resume_from else None,
        "start": trainer.start,  # the model directory the run started from (path and identity), if any
        "world_size": trainer.env.world_size,
        "backend": trainer.env.backend,
        "accel": trainer.accel,
        "git": git_revision(),
        "versions": library_versions(),
        "hardware": hardware_info(trainer.env.device),
        "command": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_run_file(out: Path, metadata: dict[str, Any]) -> None:
    """`out/run.json`, written crash-safely (values JSON lacks, such as paths, are written as text)."""
    atomic_write_text(out / RUN_FILE, json.dumps(metadata, indent=2, default=str) + "\n")


def git_revision(source: str | Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout this package runs from (None outside a git checkout).

    source: a file of the package (default this module). It must be tracked by the repository git finds
    around it: an installed copy inside another project's checkout (a venv in it, ignored) is not that
    project's code, so its commit is not recorded as the package's.
    """
    source = Path(source if source is not None else __file__).resolve()
    here = source.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return {"commit": None, "dirty": None}
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", source.name], cwd=here,
                                 capture_output=True, text=True, timeout=10)
        if tracked.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True, timeout=10)
        return {"commit": rev.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def library_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "numpy", "tokenizers", "safetensors", "transformers", "recurrent-depth"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def hardware_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def set_aside_run_record(out: Path, names: Sequence[str]) -> tuple[Path, list[str]] | None:
    """Move the entries of `names` (run.json, the logs, tensorboard/, model/) that `out` holds with something in them
    into a new `out/previous-<k>` (the first free k), under their own names: the record of an earlier session that a
    run starting from step 0 would overwrite, kept whole (a run directory as any tool reads one). Returns that
    directory and the names moved; None when `out` holds none of them (an empty file or directory records nothing).

    All or nothing: when a move fails (OSError), those done are moved back and the empty directory removed before the
    error is raised, so the record stays whole where it was. They move last to first: a process killed midway leaves
    the record split between the two, nothing lost, and the model/ the trainer names last already moved (one left
    beside no checkpoint at all is refused by the next run, `check_out_state`). A symbolic link moves as the link; a
    relative one that resolves is re-pointed, as it resolved from `out`."""
    present = [name for name in names if _holds_something(out / name)]
    if not present:
        return None
    k = 1
    while True:
        target = out / PREVIOUS_DIR.format(k=k)
        try:
            target.mkdir()  # (atomic: an existing entry of that name, file or directory, is never reused)
            break
        except FileExistsError:
            k += 1
    moved: list[tuple[str, str | None]] = []
    try:
        for name in reversed(present):
            moved.append((name, _move_down(out / name, target / name)))
    except OSError:
        for name, link in reversed(moved):
            if link is None:
                os.rename(target / name, out / name)
            else:
                os.symlink(link, out / name)
                (target / name).unlink()
        target.rmdir()
        raise
    fsync_dir(target)
    fsync_dir(out)
    return target, present


def record_entry_holding(out: Path, names: Sequence[str], path: str | Path) -> Path | None:
    """The entry `out/<name>` of `names` that `path` lies in (None: none), which `set_aside_run_record` would move
    away from under it: the path as named runs through the entry, or (the entry not a link, which moves alone) its
    files do."""
    named, real = Path(os.path.abspath(path)), Path(path).resolve()
    for name in names:
        entry = out / name
        if named.is_relative_to(os.path.abspath(entry)) or (
                not entry.is_symlink() and entry.exists() and real.is_relative_to(entry.resolve())):
            return entry
    return None


def _move_down(source: Path, destination: Path) -> str | None:
    """Rename `source` to `destination`, in a (real) directory in `source`'s. A relative symbolic link would then
    resolve from that directory (to nothing, or to something else): it is made anew there, `../` before its text, so
    it points where it did (one resolving to nothing, dangling or a loop, moves as it is). Returns that link's own
    text (None: a rename)."""
    if not source.is_symlink() or os.path.isabs(link := os.readlink(source)) or not source.exists():
        os.rename(source, destination)
        return None
    os.symlink(os.path.join(os.pardir, link), destination)
    source.unlink()
    return link


def _holds_something(path: Path) -> bool:
    if path.is_symlink() and not path.exists():  # dangling or a loop: the run would fail on it at its first write
        return True
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0


class JsonlLog:
    """Append-only JSON lines, flushed per line. On resume, lines after `keep_through` are dropped.
    `path=None` writes nothing (ranks other than 0, a run without `out`)."""

    def __init__(self, path: Path | None, keep_through: int = 0) -> None:
        self.path = path
        self.handle = None
        self.kept: list[dict[str, Any]] = []  # the records kept from an earlier session
        if path is None:
            return
        if path.exists() and not path.is_file():  # (a FIFO blocked the read below forever; a socket failed it)
            raise ValueError(f"{path} is not a regular file, so it cannot be the run's log: move it out of the "
                             "way, then run again")
        if path.exists():
            kept = []
            for number, line in enumerate(path.read_text().splitlines(), 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line torn by a crash: everything after it is newer anyway
                step = record.get("step", 0) if isinstance(record, dict) else None
                if isinstance(step, bool) or not isinstance(step, int):  # (an edited line: it cannot be placed)
                    raise ValueError(f"{path} line {number} is not a record of this run (a JSON object whose step "
                                     f"is an integer): fix or remove that line, then resume")
                if step <= keep_through:
                    kept.append(line)
                    self.kept.append(record)
            atomic_write_text(path, "".join(f"{line}\n" for line in kept))
        self.handle = open(path, "a")  # noqa: SIM115 (kept open for the run; closed by close())

    def write(self, record: dict[str, Any]) -> None:
        if self.handle is None:
            return
        # Strict JSON: a NaN or infinite value (a diverged validation loss) is written as null.
        with naming(self.path):
            self.handle.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def open_tensorboard(out: Path | None, enabled: bool, purge_step: int | None = None):
    """A tensorboard `SummaryWriter` in `out/tensorboard`; None when disabled or tensorboard is not installed.

    purge_step: the first step this session writes. TensorBoard then hides the events of earlier sessions from that
    step on (a run resumed from step k redoes k+1, ...: without it both sessions' points showed, as metrics.jsonl
    drops the lines after k)."""
    if not enabled or out is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: metrics.jsonl has everything
        return None
    return SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=purge_step)


def tensorboard_step(tb: Any, record: dict[str, Any]) -> None:
    """A step's metrics record as tensorboard scalars (nothing without a writer)."""
    if tb is None:
        return
    step = record["step"]
    for key, value in record.items():
        # (a flag, a list or a text is not a scalar; None is a value that was not finite)
        if key not in TENSORBOARD_SKIPPED and isinstance(value, int | float) and not isinstance(value, bool):
            tb.add_scalar(f"train/{key}", value, step)
    if record["num_steps"]:
        tb.add_scalar("train/depth", sum(record["num_steps"]) / len(record["num_steps"]), step)
