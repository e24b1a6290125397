"""`rdepth sweep`: many normal `rdepth train` runs from one YAML, resumable one by one, in one table.

A sweep file holds a base training config (`base:`, the keys `rdepth train --config` takes), the
runs (`grid:`, a cartesian product of value lists, and/or `runs:`, an explicit list of override
mappings) and `test_depths:` (the depths at which every finished run is evaluated)::

    base: {preset: tiny, data: stdlib, seq_len: 64, batch_size: 8, max_steps: null}
    grid: {hidden_size: [64, 128], mean_recurrence: [2, 4], tokens: [200000]}
    runs: [{core_layers: 1, mean_recurrence: 1}, {core_layers: 2, mean_recurrence: 1}]
    test_depths: [1, 2, 4, 8]

An override key is a ModelConfig field (`hidden_size`, `core_layers`, ...: into `model:`), a
TrainConfig field (`mean_recurrence`, `seed`, `max_steps`, ...), `tokens` (= `max_tokens`) or `lr`
(= `optim.lr`); a `model:` value is a mapping of ModelConfig fields set together (a width with its
`intermediate_size`, say). `mean_recurrence: 1` means a non-recurrent run: fixed depth 1, one backprop step.

Each run lives in `SWEEP_DIR/runs/<name>/` (the name spells its overrides, so it is the same in every
invocation) with its config `train.yaml`; it is finished when its trainer recorded a finish in
run.json and wrote model/, and the sweep then drops an atomic `sweep_done.json` beside them. A
finished run is never started again; an unfinished one is started with `resume: true`, so the
trainer continues from its newest checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import csv
import hashlib
import io
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from recurrent_depth.config import ModelConfig, is_int, is_real
from recurrent_depth.files import CONFIG_MAX_BYTES, atomic_write_text, read_json, read_text
from recurrent_depth.train.config import TrainConfig, load_yaml

SWEEP_KEYS = ("base", "grid", "runs", "test_depths", "threads_per_run")
PLAN_FILE = "sweep.json"
RUNS_DIR = "runs"
SHARED_DIR = "shared"  # tokenizers and token shards that runs of the same data settings share
RUN_CONFIG = "train.yaml"
DONE_FILE = "sweep_done.json"
EVAL_CACHE = "sweep_eval.json"
LOG_FILE = "sweep.log"
# Override keys that are not a TrainConfig / ModelConfig field of the same name.
ALIASES = {"tokens": "max_tokens", "lr": "optim.lr"}
# Training config keys the sweep sets itself, with why: a base or run value for them would be replaced unseen.
SET_BY_SWEEP = {"out": "each run writes into SWEEP_DIR/runs/NAME", "resume": "an unfinished run resumes",
                "eval_depths": "every run is evaluated at the sweep's test_depths"}
# Short names for the run directory (others are spelled out).
NAME_PARTS = {"hidden_size": "h", "prelude_layers": "p", "core_layers": "c", "coda_layers": "d",
              "mean_recurrence": "r", "tokens": "tok", "max_tokens": "tok", "lr": "lr", "seed": "s"}
# The table `collect` writes: one row per (run, test depth). `rdepth scaling fit` reads these columns.
TABLE_COLUMNS = ("run", "seed", "hidden_size", "prelude_layers", "core_layers", "coda_layers", "mean_recurrence",
                 "train_depth_mean", "test_depth", "lr", "params", "params_non_embedding", "tokens", "train_flops",
                 "flops_per_token_test", "loss", "status")
MODEL_FIELDS = frozenset(f.name for f in fields(ModelConfig))
TRAIN_FIELDS = frozenset(f.name for f in fields(TrainConfig)) - {"model", "optim", "out", "resume"}
MAX_RUNS = 10_000
MAX_NAME_CHARS = 200  # file systems allow 255 bytes a name


@dataclass(frozen=True)
class PlannedRun:
    name: str
    overrides: dict[str, Any]  # the grid / runs entry, as written
    config: dict[str, Any]  # the run's training config (base + overrides), as written to train.yaml


@dataclass(frozen=True)
class SweepPlan:
    runs: list[PlannedRun]
    test_depths: list[int]
    threads_per_run: int

    def to_dict(self) -> dict[str, Any]:
        return {"test_depths": self.test_depths, "threads_per_run": self.threads_per_run,
                "runs": [{"name": r.name, "overrides": r.overrides, "config": r.config} for r in self.runs]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepPlan:
        runs = [PlannedRun(r["name"], r["overrides"], r["config"]) for r in data["runs"]]
        return cls(runs=runs, test_depths=[int(d) for d in data["test_depths"]],
                   threads_per_run=int(data["threads_per_run"]))


# ---------------------------------------------------------------------------------------------- planning
def load_sweep(path: str | Path) -> SweepPlan:
    """The runs a sweep file describes, each validated as a TrainConfig; ValueError names what is wrong."""
    import yaml

    p = Path(path)
    text = read_text(p, CONFIG_MAX_BYTES, "sweep config")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"sweep config {str(p)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    except ValueError as exc:  # (nested too deeply, too many values once its aliases are expanded)
        raise ValueError(f"sweep config {str(p)!r}: {exc}") from None
    return plan_sweep(data, source=str(p))


def plan_sweep(data: Any, source: str = "sweep config") -> SweepPlan:
    """The plan of a parsed sweep mapping (see the module docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with base, grid/runs and test_depths at the top")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(SWEEP_KEYS)}")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise ValueError(f"{source}: base must be a mapping of training config keys")
    for key, why in SET_BY_SWEEP.items():
        if key in base:
            raise ValueError(f"{source}: base.{key} is set by the sweep ({why})")
    entries = [_flattened(e, source, base.get("mean_recurrence")) for e in
               _grid_entries(data.get("grid"), source) + _listed_entries(data.get("runs"), source)]
    if not entries:
        raise ValueError(f"{source}: no runs: give a non-empty grid: and/or runs:")
    if len(entries) > MAX_RUNS:
        raise ValueError(f"{source}: {len(entries)} runs, at most {MAX_RUNS}")
    test_depths = data.get("test_depths")
    if (not isinstance(test_depths, list) or not test_depths
            or not all(is_int(d) and d >= 1 for d in test_depths)):
        raise ValueError(f"{source}: test_depths must be a non-empty list of integers >= 1, got {test_depths!r}")
    threads = data.get("threads_per_run", 1)
    if not is_int(threads) or threads < 1:
        raise ValueError(f"{source}: threads_per_run must be an integer >= 1, got {threads!r}")
    base = _absolute_paths(base)
    runs: list[PlannedRun] = []
    seen: dict[str, dict[str, Any]] = {}
    for overrides in entries:
        name = run_name(overrides)
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(f"{source}: run name {name[:60]!r}... is longer than {MAX_NAME_CHARS} characters "
                             "(a directory name): vary fewer keys per run")
        if name in seen:
            raise ValueError(f"{source}: {_name_clash(seen[name], overrides, name)}")
        seen[name] = overrides
        config = run_config(base, overrides, sorted(set(test_depths)))
        try:
            TrainConfig.from_dict(config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: run {name!r}: {exc}") from None
        runs.append(PlannedRun(name, overrides, config))
    return SweepPlan(runs=_separate_distill_caches(runs), test_depths=sorted(set(test_depths)),
                     threads_per_run=int(threads))


def _grid_entries(grid: Any, source: str) -> list[dict[str, Any]]:
    if grid is None:
        return []
    if not isinstance(grid, dict) or not grid:
        raise ValueError(f"{source}: grid must be a non-empty mapping of key -> list of values")
    for key, values in grid.items():
        _check_key(key, source, "grid")
        if not isinstance(values, list) or not values:
            raise ValueError(f"{source}: grid.{key} must be a non-empty list of values, got {values!r}")
    keys = list(grid)
    count = math.prod(len(grid[k]) for k in keys)
    if count > MAX_RUNS:
        raise ValueError(f"{source}: the grid makes {count} runs, at most {MAX_RUNS}")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _listed_entries(runs: Any, source: str) -> list[dict[str, Any]]:
    if runs is None:
        return []
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{source}: runs must be a non-empty list of mappings")
    for i, entry in enumerate(runs):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: runs[{i}] must be a mapping of overrides, got {entry!r}")
        for key in entry:
            _check_key(key, source, f"runs[{i}]")
    return [dict(entry) for entry in runs]


def _flattened(entry: dict[str, Any], source: str, base_recurrence: Any = None) -> dict[str, Any]:
    """An entry whose `model:` mapping (several ModelConfig fields that go together, like a width and its MLP
    size) is spread into single overrides."""
    model = entry.pop("model", None)
    if model is None:
        return _check_entry(entry, source, base_recurrence)
    if not isinstance(model, dict) or not all(isinstance(k, str) and k in MODEL_FIELDS for k in model):
        raise ValueError(f"{source}: a model: value must be a mapping of ModelConfig fields, got {model!r}")
    clash = sorted(set(model) & set(entry))
    if clash:
        raise ValueError(f"{source}: {', '.join(clash)} set twice in one run (in model: and beside it)")
    return _check_entry({**entry, **model}, source, base_recurrence)


def _check_entry(entry: dict[str, Any], source: str, base_recurrence: Any = None) -> dict[str, Any]:
    """Refuse a run whose overrides contradict each other: its name would record settings it does not train
    with (`tokens` and `max_tokens` both set one budget; a non-recurrent run, its own mean_recurrence 1 or else
    the base's `base_recurrence`, trains at depth 1, fixed)."""
    by_setting: dict[str, list[str]] = {}
    for key in entry:
        by_setting.setdefault(ALIASES.get(key, key), []).append(key)
    twice = [" and ".join(keys) for keys in by_setting.values() if len(keys) > 1]
    if twice:
        raise ValueError(f"{source}: {'; '.join(twice)} set one setting twice in run {entry!r}: keep one")
    if entry.get("mean_recurrence", base_recurrence) == 1:
        forced = {"depth_scheme": "fixed", "backprop_depth": 1}
        bad = [f"{k}={entry[k]!r}" for k, v in forced.items() if k in entry and entry[k] != v]
        if bad:
            whose = "" if "mean_recurrence" in entry else " (the base's)"
            raise ValueError(f"{source}: run {entry!r}: mean_recurrence 1{whose} is a non-recurrent run (depth_scheme "
                             f"fixed, backprop_depth 1), which {', '.join(bad)} contradicts")
    return entry


def _check_key(key: Any, source: str, where: str) -> None:
    if key in SET_BY_SWEEP:
        raise ValueError(f"{source}: {where}: {key} is set by the sweep ({SET_BY_SWEEP[key]})")
    if not isinstance(key, str) or not (key in ALIASES or key in MODEL_FIELDS or key in TRAIN_FIELDS
                                        or key == "model"):
        raise ValueError(f"{source}: {where}: unknown key {key!r}; expected a ModelConfig or TrainConfig field, "
                         f"{' or '.join(ALIASES)}")


def _absolute_paths(base: dict[str, Any]) -> dict[str, Any]:
    """Relative paths of the base config, made absolute: the runs start in other directories (Slurm)."""
    out = dict(base)
    for key in ("data", "tokenizer", "data_dir", "init_from", "teacher", "distill_cache"):
        value = out.get(key)
        # (not "": abspath made it the current directory, which the run then trained on; TrainConfig refuses it)
        if isinstance(value, str) and value.strip() and value != "stdlib" and not os.path.isabs(value):
            out[key] = os.path.abspath(os.path.expanduser(value))  # (`~/corpus` is the home's, as the trainer reads it)
    return out


def run_name(overrides: dict[str, Any]) -> str:
    """A directory name spelling a run's overrides, in their sorted key order (`c2-h64-r4-tok200000`)."""
    if not overrides:
        return "base"
    parts = []
    for key in sorted(overrides):
        value = overrides[key]
        text = format(value, "g") if is_real(value) and not is_int(value) else str(value)
        text = "".join(ch if ch.isalnum() or ch in ".-+" else "_" for ch in text)
        parts.append(f"{NAME_PARTS.get(key, key + '=')}{text}")
    return "-".join(parts)


def _name_clash(first: dict[str, Any], second: dict[str, Any], name: str) -> str:
    """Why two runs got the same name `name`: the same settings, or values the name spells alike (a number to 6
    significant digits, a character outside [A-Za-z0-9.+-] as `_`): then which values collide."""
    differ = [key for key in sorted(set(first) | set(second)) if first.get(key) != second.get(key)]
    if not differ:
        return f"two runs have the same settings {second!r} (run {name!r})"
    values = "; ".join(f"{key}={first.get(key)!r} and {key}={second.get(key)!r}" for key in differ)
    return (f"two runs get the same name {name!r}: {values} are spelled alike in a run name (numbers to 6 "
            f"significant digits, characters other than [A-Za-z0-9.+-] as '_'): make them differ there")


def run_config(base: dict[str, Any], overrides: dict[str, Any], test_depths: list[int]) -> dict[str, Any]:
    """The training config of one run: base, then its overrides, evaluated at the test depths at its end."""
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    model, optim = dict(config.get("model") or {}), dict(config.get("optim") or {})
    for key, value in overrides.items():
        key = ALIASES.get(key, key)
        if key == "optim.lr":
            optim["lr"] = value
        elif key in MODEL_FIELDS and key not in TRAIN_FIELDS:
            model[key] = value
        else:
            config[key] = value
    if "max_tokens" in overrides or "tokens" in overrides:
        config.setdefault("max_steps", None)  # the token budget is the run's length
    if config.get("mean_recurrence") == 1:  # non-recurrent: one core pass every step (whatever the base says)
        config["depth_scheme"], config["backprop_depth"] = "fixed", 1
    config["model"], config["optim"] = model, optim
    config["eval_depths"] = test_depths
    config.setdefault("progress", False)
    config.setdefault("tensorboard", False)
    return _absolute_paths(config)  # a grid's or a run's own data / tokenizer paths too, not only the base's


# ---------------------------------------------------------------------------------------------- state
def run_dir(sweep_dir: Path, name: str) -> Path:
    return Path(sweep_dir) / RUNS_DIR / name


def data_key(config: dict[str, Any]) -> str | None:
    """Which shared tokenizer + token shards a run can use: a hash of the settings they depend on; None for a
    run that names its own tokenizer, data_dir or init_from (those it keeps)."""
    if any(config.get(key) is not None for key in ("tokenizer", "data_dir", "init_from")):
        return None
    return _hash(_data_settings(TrainConfig.from_dict(config)))


def _data_settings(cfg: TrainConfig) -> list[Any]:
    """The settings a run's tokenizer and packed rows depend on (when the run prepares them itself)."""
    return [cfg.data, cfg.text_field, cfg.follow_symlinks, cfg.tokenizer_vocab_size(), cfg.tokenizer_max_bytes,
            cfg.val_fraction, cfg.keep_all, cfg.seq_len or cfg.model_config().max_seq_len, cfg.seed]


def _hash(settings: list[Any]) -> str:
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]


# What a distillation cache holds (train/distill_cache.py): the teacher's top-k at its depth over the run's rows
# (its data settings, or its own tokenizer / shards), and for a teacher whose initial state is random, the noise
# the seed and the batch size fix. (Counted always: the sweep does not read the teacher.)
DISTILL_CACHE_SETTINGS = ("teacher", "teacher_depth", "distill_top_k", "seed", "batch_size", "tokenizer",
                          "data_dir", "init_from")


def distill_cache_key(config: dict[str, Any]) -> str:
    """A hash of the settings a run's distillation cache depends on: runs with the same key can share one."""
    cfg = TrainConfig.from_dict(config)
    return _hash([_data_settings(cfg), *(getattr(cfg, name) for name in DISTILL_CACHE_SETTINGS)])


def _separate_distill_caches(runs: list[PlannedRun]) -> list[PlannedRun]:
    """Runs that name one `distill_cache` but need different caches in it (another seed, top-k, seq_len, ...)
    each get their settings' own `DIR/cache-<key>`. A directory holds one cache: one after another they wrote it
    again every run (or failed: `does not match this run`), at once (--jobs) over each other's shards. Runs that
    need the same cache keep DIR and share it (`write_cache` writes it once, under a lock)."""
    keys: dict[str, set[str]] = {}
    for run in runs:
        if run.config.get("distill_cache"):
            keys.setdefault(run.config["distill_cache"], set()).add(distill_cache_key(run.config))
    separated = []
    for run in runs:
        path = run.config.get("distill_cache")
        if path and len(keys[path]) > 1:
            config = {**run.config, "distill_cache": str(Path(path) / f"cache-{distill_cache_key(run.config)}")}
            run = PlannedRun(run.name, run.overrides, config)
        separated.append(run)
    return separated


def prepare_shared_data(config: dict[str, Any], where: Path, log: Callable[[str], None] = print) -> None:
    """Train the tokenizer and pack the shards once for every run of the same data settings (else each run
    would spend its first seconds, on the embedded corpus ~20 s, doing the same), as `rdepth train` would."""
    from recurrent_depth.data import build_tokenizer, load_corpus, prepare_dataset

    cfg = TrainConfig.from_dict({k: v for k, v in config.items() if k not in ("tokenizer", "data_dir")})
    tok_dir, data_dir = where / "tokenizer", where / "data"
    if (tok_dir / "tokenizer.json").is_file() and (data_dir / "validation.json").is_file():
        return
    start = time.perf_counter()
    source = load_corpus(cfg.data, text_field=cfg.text_field, follow_symlinks=cfg.follow_symlinks)
    if not (tok_dir / "tokenizer.json").is_file():
        build_tokenizer(source, cfg.tokenizer_vocab_size(), val_fraction=cfg.val_fraction, seed=cfg.seed,
                        max_bytes=cfg.tokenizer_max_bytes, out_dir=tok_dir)
    prepare_dataset(source, tok_dir, cfg.seq_len or cfg.model_config().max_seq_len, data_dir,
                    val_fraction=cfg.val_fraction, seed=cfg.seed, keep_all=cfg.keep_all)
    log(f"sweep: prepared the tokenizer and shards in {where} ({time.perf_counter() - start:.1f}s)")


def _write_plan(plan: SweepPlan, sweep_dir: Path, log: Callable[[str], None] = print) -> SweepPlan:
    """SWEEP_DIR/sweep.json and each run's train.yaml (JSON, which is YAML), with out and resume set and the
    shared data prepared; returns the plan as written (with the shared tokenizer and data_dir paths)."""
    sweep_dir = Path(sweep_dir).resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    shared = []
    for run in plan.runs:
        config = dict(run.config)
        key = data_key(config)
        if key is not None:
            where = sweep_dir / SHARED_DIR / key
            shared.append((run.name, dict(config), where))
            config.update(tokenizer=str(where / "tokenizer"), data_dir=str(where / "data"))
        runs.append(PlannedRun(run.name, run.overrides, config))
    _refuse_changed_runs(runs, sweep_dir)  # before anything is written
    for name, config, where in shared:
        try:
            prepare_shared_data(config, where, log)
        except ValueError as exc:  # (a data path that does not exist, too little data for a row: name the run)
            raise ValueError(f"run {name!r}: {exc}") from None
    plan = SweepPlan(runs=runs, test_depths=plan.test_depths, threads_per_run=plan.threads_per_run)
    atomic_write_text(sweep_dir / PLAN_FILE, json.dumps(plan.to_dict(), indent=2) + "\n")
    for run in plan.runs:
        out = run_dir(sweep_dir, run.name)
        out.mkdir(parents=True, exist_ok=True)
        config = {**run.config, "out": str(out), "resume": True}
        atomic_write_text(out / RUN_CONFIG, json.dumps(config, indent=2) + "\n")
    return plan


def _refuse_changed_runs(runs: list[PlannedRun], sweep_dir: Path) -> None:
    """A ValueError when a run that has started (run.json or checkpoints) would get a config it cannot continue
    with: a finished one would otherwise count as done with results of the old settings (its train.yaml
    rewritten to the new ones), an unfinished one fail at --resume with its reason only in sweep.log."""
    from recurrent_depth.train.trainer_checkpoints import config_changes

    changed = []
    for run in runs:
        out = run_dir(sweep_dir, run.name)
        checkpoints = out / "checkpoints"
        started = (out / "run.json").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))
        previous = _read_json_or_none(out / RUN_CONFIG) if started else None
        if not isinstance(previous, dict):
            continue
        try:
            before = TrainConfig.from_dict(previous).to_dict()
        except (TypeError, ValueError):  # written by another version: the trainer's own resume check decides
            continue
        planned = TrainConfig.from_dict({**run.config, "out": str(out), "resume": True})
        changes = config_changes(before, planned.to_dict())
        if changes:
            changed.append(f"{run.name} ({', '.join(changes)})")
    if changed:
        raise ValueError(f"the sweep file changes the settings of {len(changed)} run(s) already started in "
                         f"{sweep_dir}: {'; '.join(changed)}; restore them, or give the changed sweep a new --out")


def read_plan(sweep_dir: str | Path) -> SweepPlan:
    path = Path(sweep_dir) / PLAN_FILE
    if not path.is_file():
        raise ValueError(f"{sweep_dir} is not a sweep directory (no {PLAN_FILE}; start one with rdepth sweep run)")
    try:
        plan = SweepPlan.from_dict(read_json(path, CONFIG_MAX_BYTES, "sweep plan"))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is damaged: {exc!r}") from None
    for run in plan.runs:  # (a name is a directory under runs/: an int was a TypeError, "../x" a path outside)
        if not isinstance(run.name, str) or run.name in ("", ".", "..") or "/" in run.name or "\\" in run.name:
            raise ValueError(f"{path} is damaged: run name {run.name!r} is not a directory name")
    return plan


def _read_json_or_none(path: Path) -> Any:
    try:
        return read_json(path, 64 << 20, path.name)
    except (OSError, ValueError):
        return None


def run_state(out: Path) -> str:
    """done (finished: the trainer's finish record and model/), partial (checkpoints), or pending."""
    if (out / DONE_FILE).is_file():
        return "done"
    if trainer_finished(out):
        mark_done(out, {"marked_by": "status"})
        return "done"
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        return "partial"
    return "pending"


def trainer_finished(out: Path) -> bool:
    """Whether the trainer ended this run (a finish record in run.json) and wrote its model directory."""
    record = _read_json_or_none(out / "run.json")
    return (isinstance(record, dict) and isinstance(record.get("finished"), dict)
            and (out / "model" / "config.json").is_file())


def mark_done(out: Path, info: dict[str, Any]) -> None:
    atomic_write_text(out / DONE_FILE, json.dumps({"finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info})
                      + "\n")


def sweep_status(sweep_dir: str | Path) -> dict[str, str]:
    """Each run's state by name (done, partial, pending)."""
    plan = read_plan(sweep_dir)
    return {run.name: run_state(run_dir(Path(sweep_dir), run.name)) for run in plan.runs}


# ---------------------------------------------------------------------------------------------- running
def train_command(config_path: Path, threads: int, nproc: int = 1) -> list[str]:
    """The plain `rdepth train` (or torchrun) command that runs one sweep run."""
    if nproc > 1:
        return ["torchrun", "--standalone", f"--nproc_per_node={nproc}", "-m", "recurrent_depth.cli", "train",
                "--config", str(config_path), "--threads", str(threads)]
    return [sys.executable, "-m", "recurrent_depth.cli", "train", "--config", str(config_path), "--threads",
            str(threads)]


# The `rdepth train` processes a sweep has running, so that stopping the sweep stops them the trainer's way.
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by stop_runs: a run that starts after it is stopped at once


def subprocess_runner(out: Path, threads: int) -> int:
    """Run one sweep run as its own `rdepth train` process, its output appended to out/sweep.log.

    The process gets a session of its own, so a Ctrl-C at the terminal reaches only the sweep, which passes
    exactly one SIGINT on (`stop_runs`): the trainer then saves a checkpoint after its step (a second would
    stop it at once)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if _STOPPING.is_set():
        return 130
    with open(out / LOG_FILE, "ab") as log:
        process = subprocess.Popen(train_command(out / RUN_CONFIG, threads), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        with _LIVE_LOCK:  # (stop_runs takes its list under this lock: a process is either in it or told here)
            _LIVE.add(process)
            if _STOPPING.is_set():
                process.send_signal(signal.SIGINT)
        try:
            return process.wait()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(process)


def stop_runs(timeout: float = 600.0) -> None:
    """Ask every running `rdepth train` of this sweep to stop (SIGINT: checkpoint, then exit) and wait for them."""
    with _LIVE_LOCK:
        _STOPPING.set()
        live = list(_LIVE)
    for process in live:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in live:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()


def default_jobs(threads_per_run: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // threads_per_run)


def run_sweep(config: str | Path, sweep_dir: str | Path, jobs: int | None = None, threads: int | None = None,
              runner: Callable[[Path, int], int] = subprocess_runner,
              log: Callable[[str], None] = print) -> dict[str, str]:
    """Run every unfinished run of the sweep (`jobs` at a time, each with `threads` torch threads, default the
    file's threads_per_run); returns each run's state at the end."""
    if jobs is not None and (not is_int(jobs) or jobs < 1):  # (before the plan, tokenizer and shards are written)
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    plan = load_sweep(config)
    if threads is not None:
        if not is_int(threads) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        plan = SweepPlan(runs=plan.runs, test_depths=plan.test_depths, threads_per_run=threads)
    from recurrent_depth.cli.common import THREADS_PER_CORE

    limit = THREADS_PER_CORE * (os.cpu_count() or 1)
    if plan.threads_per_run > limit:  # (each run's `rdepth train --threads` refuses it: every run failed at start)
        raise ValueError(f"threads_per_run {plan.threads_per_run} is more than each run's rdepth train takes here "
                         f"(at most {limit}: {THREADS_PER_CORE} per CPU core)")
    sweep_dir = Path(sweep_dir).resolve()
    plan = _write_plan(plan, sweep_dir, log)
    jobs = jobs or default_jobs(plan.threads_per_run)
    states = {run.name: run_state(run_dir(sweep_dir, run.name)) for run in plan.runs}
    todo = [run.name for run in plan.runs if states[run.name] != "done"]
    log(f"sweep: {len(plan.runs)} runs, {len(plan.runs) - len(todo)} finished, {len(todo)} to run "
        f"({jobs} at a time, {plan.threads_per_run} thread(s) each) in {sweep_dir}")

    def one(name: str) -> tuple[str, int, float]:
        out = run_dir(sweep_dir, name)
        start = time.perf_counter()
        rc = runner(out, plan.threads_per_run)
        seconds = time.perf_counter() - start
        if rc == 0 and trainer_finished(out):
            mark_done(out, {"seconds": round(seconds, 1), "marked_by": "sweep run"})
        return name, rc, seconds

    _STOPPING.clear()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    previous = _terminate_as_interrupt()
    try:
        for future in concurrent.futures.as_completed([pool.submit(one, name) for name in todo]):
            name, rc, seconds = future.result()
            states[name] = run_state(run_dir(sweep_dir, name))
            outcome = "finished" if states[name] == "done" else f"failed (exit {rc}; see {LOG_FILE})"
            log(f"sweep: {name} {outcome} in {seconds:.1f}s")
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)  # start nothing more
        log("sweep: interrupted; the running runs save a checkpoint and stop (run the sweep again to continue)")
        stop_runs()
        raise
    finally:
        pool.shutdown(wait=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return states


def _terminate_as_interrupt() -> Any:
    """SIGTERM (a scheduler's or `kill`'s) stops the sweep as Ctrl-C does; returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # A sweep started in the background by a script ignores SIGINT, and its runs would inherit that (until the
    # trainer's loop installs its handler): the sweep's stop request must reach a run that is still starting.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return signal.signal(signal.SIGTERM, interrupt)


def emit_sweep(config: str | Path, sweep_dir: str | Path, nproc: int = 1, slurm: bool = True,
               slurm_options: list[str] | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """commands.txt (one plain command per run) and, with `slurm`, sweep.slurm, a job array running them."""
    plan = load_sweep(config)
    sweep_dir = Path(sweep_dir).resolve()
    plan = _write_plan(plan, sweep_dir, log)
    threads = plan.threads_per_run
    lines = []
    for run in plan.runs:
        command = " ".join(_quote(part) for part in train_command(run_dir(sweep_dir, run.name) / RUN_CONFIG,
                                                                  threads, nproc))
        lines.append(f"OMP_NUM_THREADS={threads} {command}")
    written = [sweep_dir / "commands.txt"]
    atomic_write_text(written[0], "\n".join(lines) + "\n")
    if slurm:
        options = [f"#SBATCH {opt}" for opt in (slurm_options or [])]
        script = "\n".join([
            "#!/bin/bash",
            "#SBATCH --job-name=rdepth-sweep",
            f"#SBATCH --array=0-{len(plan.runs) - 1}",
            "#SBATCH --ntasks=1",
            f"#SBATCH --cpus-per-task={threads * nproc}",
            f"#SBATCH --output={sweep_dir / 'slurm'}/%A_%a.out",
            *options,
            "# One run of the sweep per array task: line SLURM_ARRAY_TASK_ID + 1 of commands.txt.",
            "# A finished run is not redone (its train.yaml has resume: true); `rdepth sweep collect` gathers them.",
            "set -euo pipefail",
            f"line=$(sed -n \"$((SLURM_ARRAY_TASK_ID + 1))p\" {_quote(str(sweep_dir / 'commands.txt'))})",
            'eval "$line"',
            "",
        ])
        (sweep_dir / "slurm").mkdir(exist_ok=True)
        written.append(sweep_dir / "sweep.slurm")
        atomic_write_text(written[1], script)
    return written


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


# ---------------------------------------------------------------------------------------------- collecting
def collect_sweep(sweep_dir: str | Path, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The table of every finished run at every test depth (results.csv, results.json in sweep_dir)."""
    sweep_dir = Path(sweep_dir)
    plan = read_plan(sweep_dir)
    rows: list[dict[str, Any]] = []
    for run in plan.runs:
        out = run_dir(sweep_dir, run.name)
        state = run_state(out)
        if state != "done":
            log(f"sweep collect: {run.name} is {state}: left out")
            continue
        rows.extend(run_rows(out, run, plan.test_depths))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(TABLE_COLUMNS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(sweep_dir / "results.csv", buffer.getvalue())
    atomic_write_text(sweep_dir / "results.json", json.dumps({"columns": list(TABLE_COLUMNS), "rows": rows},
                                                             indent=2) + "\n")
    log(f"sweep collect: {len(rows)} rows from {len({r['run'] for r in rows})} finished runs of {len(plan.runs)} "
        f"-> {sweep_dir / 'results.csv'}")
    return rows


def run_rows(out: Path, run: PlannedRun, test_depths: list[int]) -> list[dict[str, Any]]:
    """One finished run's table rows: its size, tokens, FLOPs, and validation loss at each test depth."""
    from recurrent_depth.train.flops import training_step_flops

    record = read_json(out / "run.json", 64 << 20, "run file")
    cfg = TrainConfig.from_dict(record["config"])
    model_cfg = ModelConfig.from_dict(record["model_config"])
    seq_len = int(record["seq_len"])
    steps = _metrics(out)
    finished_step = int(record["finished"]["step"])
    if steps:
        tokens = steps[-1]["tokens"]
    elif record.get("tokens_per_step"):  # metrics.jsonl removed or emptied: the trainer's own count (was 0 tokens)
        tokens = int(record["tokens_per_step"]) * finished_step
    else:
        raise ValueError(f"{out} has no metrics.jsonl and its run.json no tokens_per_step: its training tokens and "
                         "FLOPs are unknown")
    train_flops, depth_mean = _train_flops(steps, model_cfg, cfg, seq_len, int(record.get("world_size") or 1),
                                           finished_step)
    losses = _losses(out, cfg, model_cfg, test_depths)
    params = int(record["parameters"])
    embedding = model_cfg.vocab_size * model_cfg.hidden_size * (1 if model_cfg.tie_embeddings else 2)
    mean_recurrence = 1.0 if cfg.baseline else float(cfg.mean_recurrence or model_cfg.mean_recurrence)
    rows = []
    for depth in test_depths:
        per_token = training_step_flops(model_cfg, 1, seq_len, (0, depth)).forward / seq_len
        rows.append({
            "run": run.name, "seed": cfg.seed, "hidden_size": model_cfg.hidden_size,
            "prelude_layers": model_cfg.prelude_layers, "core_layers": model_cfg.core_layers,
            "coda_layers": model_cfg.coda_layers, "mean_recurrence": mean_recurrence,
            "train_depth_mean": depth_mean if depth_mean is not None else mean_recurrence, "test_depth": depth,
            "lr": cfg.optim.lr, "params": params, "params_non_embedding": params - embedding, "tokens": tokens,
            "train_flops": train_flops, "flops_per_token_test": per_token, "loss": losses.get(depth),
            "status": "finished" if losses.get(depth) is not None else "no_loss",
        })
    return rows


def _metrics(out: Path) -> list[dict[str, Any]]:
    text = read_text(out / "metrics.jsonl", 1 << 30, "metrics log") if (out / "metrics.jsonl").is_file() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _train_flops(steps: list[dict[str, Any]], model_cfg: ModelConfig, cfg: TrainConfig, seq_len: int,
                 world_size: int, finished_step: int) -> tuple[float, float | None]:
    """(training FLOPs at the depths each micro-batch drew, their mean), from metrics.jsonl; without recorded
    depths, every micro-batch of the logged steps (of `finished_step` steps without a log) at the expected
    depth r̄ (its mean None). Under --depth-per-rank a record's `num_steps` is rank 0's depths only; its
    `num_steps_by_rank` / `grad_steps_by_rank` hold every rank's, each rank's batch run at its own."""
    from recurrent_depth.model.depth import truncate
    from recurrent_depth.train.flops import training_step_flops

    rows = cfg.batch_size * world_size
    total, depth_rows, counted_rows = 0.0, 0.0, 0
    for step in steps:
        by_rank = step.get("num_steps_by_rank"), step.get("grad_steps_by_rank")
        if by_rank[0] and by_rank[1]:  # (rows, depths, grad depths) of each rank's batch
            parts = [(cfg.batch_size, drawn, grads) for drawn, grads in zip(*by_rank)]
        else:  # one depth per micro-batch for every rank
            parts = [(rows, step.get("num_steps") or [], step.get("grad_steps") or [])]
        for part_rows, drawn, grads in parts:
            for depth, grad in zip(drawn, grads):
                total += training_step_flops(model_cfg, part_rows, seq_len, (depth - grad, grad)).total
                depth_rows += depth * part_rows
                counted_rows += part_rows
    if counted_rows:
        return total, depth_rows / counted_rows
    mean = max(1, round(cfg.mean_recurrence or model_cfg.mean_recurrence))
    k = cfg.backprop_depth or model_cfg.mean_backprop_depth
    micro = (len(steps) or finished_step) * cfg.grad_accum
    return micro * training_step_flops(model_cfg, rows, seq_len, truncate(mean, k)).total, None


def _losses(out: Path, cfg: TrainConfig, model_cfg: ModelConfig, test_depths: list[int]) -> dict[int, float | None]:
    """Validation loss by depth: the run's final evaluation, then the cache, then evaluated now (and cached).
    None: measured, not finite (a diverged run; the logs hold it as null): its rows are `no_loss`."""

    def loss(value: Any) -> float | None:  # (a null made collect fail with float()'s TypeError)
        return float(value) if is_real(value) else None

    losses: dict[int, float | None] = {}
    if (out / "eval.jsonl").is_file():
        for line in read_text(out / "eval.jsonl", 1 << 30, "evaluation log").splitlines():
            entry = json.loads(line) if line.strip() else {}
            if entry.get("final") and isinstance(entry.get("val_loss_by_depth"), dict):
                losses = {int(d): loss(v) for d, v in entry["val_loss_by_depth"].items()}
    cache = _read_json_or_none(out / EVAL_CACHE) or {}
    losses.update({int(d): loss(v) for d, v in cache.items()})
    missing = [d for d in test_depths if d not in losses]
    if missing:
        measured = evaluate_run(out, cfg, missing)
        losses.update({d: measured.get(d) for d in missing})  # (not finite: None, cached as null, not redone)
        atomic_write_text(out / EVAL_CACHE, json.dumps({str(d): losses[d] for d in sorted(losses)}) + "\n")
    return losses


def evaluate_run(out: Path, cfg: TrainConfig, depths: list[int]) -> dict[int, float]:
    """Validation loss of a finished run's model at `depths`, on its own validation rows, as its trainer measures."""
    from recurrent_depth.data.shards import ShardDataset
    from recurrent_depth.model.recurrent import RecurrentDepthLM
    from recurrent_depth.train.validation import validation_loss_by_depth

    data_dir = Path(cfg.data_dir) if cfg.data_dir is not None else out / "data"
    model = RecurrentDepthLM.from_pretrained(out / "model")
    val = ShardDataset(data_dir / "validation.json", shuffle=False)
    result = validation_loss_by_depth(model, val, sorted(depths), batch_size=cfg.batch_size,
                                      max_batches=cfg.eval_batches, dtype=cfg.dtype, seed=cfg.seed)
    return {int(d): float(v) for d, v in result.loss.items() if math.isfinite(v)}
