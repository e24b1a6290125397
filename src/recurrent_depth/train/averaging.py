"""Post-hoc weight averaging over saved checkpoints (the paper's released "EMA" model).

Huginn-0125's averaged model (`huginn_swa_75_7_ema_0.9_merge`) is an exponential moving average
over saved checkpoints, not one kept during training: take the last N checkpoints at a dilation
d (every d-th one, counting back from the newest), then, oldest first,

    ema = w_1;   ema = beta * ema + (1 - beta) * w_i   for i = 2..N        (beta = 0.9)

so the newest checkpoint weighs 1 - beta and older ones decay geometrically. The direction is an
assumption: the paper says only "an exponential moving average starting from our last checkpoint
with beta = 0.9" and the official repository has no averaging code; passing the paths newest first
gives the other reading (the newest weighs the most).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from recurrent_depth.checkpoint import TOKENIZER_FILES, file_digests, read_state_dict
from recurrent_depth.config import ModelConfig
from recurrent_depth.files import CONFIG_MAX_BYTES, TOKENIZER_MAX_BYTES, atomic_write_bytes, read_bytes, read_json
from recurrent_depth.train.checkpointing import (
    CHECKPOINTS_DIR,
    TRAINER_STATE,
    StateView,
    checkpoints_root,
    list_checkpoints,
)

# A training run's own folders: training and --resume write there (model/ is republished whole, step-*
# under checkpoints/ are set aside and pruned; data/, tokenizer/ and tensorboard/ hold the run's files).
RUN_FOLDERS = (CHECKPOINTS_DIR, "model", "data", "tokenizer", "tensorboard")


def select_checkpoints(paths: Sequence[Path], last: int, dilation: int = 1) -> list[Path]:
    """Every `dilation`-th of `paths` (oldest first), counting back from the newest, at most `last`."""
    if not isinstance(last, int) or isinstance(last, bool) or last < 1:
        raise ValueError(f"last={last!r} is invalid: expected an integer >= 1")
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise ValueError(f"dilation={dilation!r} is invalid: expected an integer >= 1")
    picked = list(paths)[::-1][::dilation][:last]
    return picked[::-1]


def run_folder_holding(path: str | Path) -> Path | None:
    """The training checkpoint, or run folder (`RUN_FOLDERS` of a directory holding run.json or checkpoints/),
    that `path` is or lies inside; None if none."""
    path = Path(path).resolve()
    for folder in (path, *path.parents):
        if (folder / TRAINER_STATE).is_file():
            return folder
        run = folder.parent
        if folder.name in RUN_FOLDERS and ((run / "run.json").is_file() or (run / CHECKPOINTS_DIR).is_dir()):
            return folder
    return None


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of a training run directory (or of its `checkpoints/` folder), oldest first."""
    run_dir = Path(run_dir)
    root = run_dir if run_dir.name == "checkpoints" else checkpoints_root(run_dir)
    found = [path for _, path in list_checkpoints(root)]
    if not found:
        raise ValueError(f"no complete checkpoints under {root}")
    return found


def run_model_dtype(run_dir: str | Path) -> torch.dtype | None:
    """The dtype a training run writes its model/ in (checkpoints keep the trained float32): its model/'s
    stored dtype, else that of the directory it started from (run.json's init_from); None if neither is known."""
    from recurrent_depth.checkpoint import stored_dtype

    run_dir = Path(run_dir)
    run_dir = run_dir.parent if run_dir.name == "checkpoints" else run_dir
    dtype = stored_dtype(run_dir / "model")
    if dtype is not None or not (run_dir / "run.json").is_file():
        return dtype
    run = read_json(run_dir / "run.json", 64 << 20, "run.json")
    init_from = run.get("config", {}).get("init_from") if isinstance(run, dict) else None
    if not isinstance(init_from, str):
        return None
    from recurrent_depth.train.init_from import find_model_dir

    try:
        return stored_dtype(find_model_dir(init_from))
    except ValueError:  # the start directory moved or is gone: keep the checkpoints' dtype
        return None


def ema_state(paths: Sequence[Path], beta: float = 0.9) -> dict[str, torch.Tensor]:
    """The EMA (oldest first) of the floating-point weights of `paths`; other tensors from the newest.

    Accumulates in float32 (float64 for float64 weights) and returns each tensor in its stored dtype.
    """
    if not paths:
        raise ValueError("need at least one checkpoint to average")
    if not isinstance(beta, int | float) or isinstance(beta, bool) or not 0 <= beta < 1:
        raise ValueError(f"beta={beta!r} is invalid: expected a number in [0, 1)")
    configs = [read_json(Path(p) / "config.json", CONFIG_MAX_BYTES, "config file") for p in paths]
    for path, config in zip(paths[1:], configs[1:]):
        if config != configs[0]:
            raise ValueError(f"{path} has a different config.json from {paths[0]}; only one model's checkpoints "
                             "can be averaged")
    first = _finite_state(paths[0])
    dtypes = {k: v.dtype for k, v in first.items()}
    ema = {k: (v.to(torch.float64 if v.dtype == torch.float64 else torch.float32) if v.is_floating_point() else v)
           for k, v in first.items()}
    for path in paths[1:]:
        state = _finite_state(path)
        if set(state) != set(ema):
            raise ValueError(f"{path} holds different tensors from {paths[0]}")
        for name, tensor in state.items():
            if tensor.shape != ema[name].shape:  # (same config.json, other weights: lerp_'s traceback otherwise)
                raise ValueError(f"{path} holds {name} of shape {tuple(tensor.shape)}, {paths[0]} of shape "
                                 f"{tuple(ema[name].shape)}; only one model's checkpoints can be averaged")
            if tensor.is_floating_point():
                ema[name].lerp_(tensor.to(ema[name].dtype), 1.0 - beta)
            else:
                ema[name] = tensor
    return {k: v.to(dtypes[k]) for k, v in ema.items()}


def _finite_state(path: Path) -> dict[str, torch.Tensor]:
    """read_state_dict(path), refused where a floating-point tensor holds NaN or inf: one diverged checkpoint
    would make every averaged weight it touches NaN, a model written without a word."""
    state = read_state_dict(path)
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path} holds NaN or inf in {name} (a diverged checkpoint?); leave it out of the "
                             "average (--checkpoints, --last)")
    return state


def agreed_source(paths: Sequence[Path], names: Sequence[str], advice: str) -> Path | None:
    """The newest of `paths` holding any of `names` (files an averaged model keeps from its inputs), once every input
    holding any is found to hold the same ones (absent ones included); else a one-line ValueError naming the files
    and `advice`. An input holding none has no say: a checkpoint of a run not started from a retrofitted model holds no
    retrofit.json, for one."""
    found = [(path, digests) for path, digests in ((path, file_digests(path, names)) for path in paths)
             if any(digest is not None for digest in digests.values())]
    if not found:
        return None
    newest, kept = found[-1]
    for path, digests in found[:-1]:
        differing = [name for name in names if digests[name] != kept[name]]
        if differing:
            raise ValueError(f"cannot average {path} and {newest}: they hold different {', '.join(differing)} "
                             f"({advice})")
    return newest


def average_checkpoints(
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    beta: float = 0.9,
    last: int | None = None,
    dilation: int = 1,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Average checkpoints (model directories, oldest first) into the model directory `out`.

    last/dilation select which of `paths` enter the average (default: all). The average keeps what its inputs
    carry beside their weights, so that it generates, serves, exports and trains as they do: the tokenizer
    files (from `tokenizer_dir` when given), retrofit's record of the source (retrofit.json) and the generation
    defaults (generation_config.json); inputs holding different copies of one are refused (`agreed_source`).
    dtype: the floating-point weights are written in it (None: the checkpoints' own; `run_model_dtype` gives a
    run's). Returns `out`.
    """
    from recurrent_depth.checkpoint import save_pretrained
    from recurrent_depth.families.retrofit import PROVENANCE_FILE
    from recurrent_depth.generation_config import GENERATION_CONFIG_FILE
    from recurrent_depth.integrations.export import read_companions

    chosen = [Path(p) for p in paths]
    if last is not None or dilation != 1:
        chosen = select_checkpoints(chosen, last if last is not None else len(chosen), dilation)
    for path in chosen:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is not a model directory (no config.json)")
        # A LoRA run's checkpoint holds the peft-wrapped state (base_model.model...lora_A...): its
        # average would be written under those names, a directory no loader can read.
        if (path / "adapter_config.json").is_file():
            raise ValueError(f"{path} is a LoRA run's checkpoint (adapter_config.json): averaging LoRA adapters "
                             f"is not supported; average a full-weight run, or merge the adapter "
                             f"(rdepth export --merge-lora) instead")
    out = Path(out)
    if any(out.resolve() == Path(p).resolve() for p in paths):
        raise ValueError(f"out={str(out)!r} is one of the checkpoints being averaged; choose a new directory")
    if (out / TRAINER_STATE).exists():  # (one not averaged: its manifest would no longer match its weights)
        raise ValueError(f"out={str(out)!r} is a training checkpoint; writing the average there would break it "
                         f"for --resume: choose a new directory")
    if (out / "run.json").is_file() or (out / "checkpoints").is_dir():  # a run's own directory, not a model's
        raise ValueError(f"out={str(out)!r} is a training run directory; writing the average there would mix a "
                         f"model's files into the run's (and hide its model/): choose a new directory")
    held = run_folder_holding(out)
    if held is not None:  # (the average would be replaced, set aside or pruned by the run, or mixed into its files)
        raise ValueError(f"out={str(out)!r} lies in {str(held)!r}, a training run's own folder or checkpoint: training "
                         f"and --resume write there; choose a directory outside it (beside the run)")
    if tokenizer_dir is not None and not any((Path(tokenizer_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer_dir={str(tokenizer_dir)!r} holds no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES)})")
    tokenizer_source = Path(tokenizer_dir) if tokenizer_dir is not None else agreed_source(
        chosen, TOKENIZER_FILES, "other token ids: average one model's checkpoints, or choose the tokenizer with "
                                 "--tokenizer / tokenizer_dir=")
    companions = {  # {file: the input it is copied from}
        PROVENANCE_FILE: agreed_source(chosen, (PROVENANCE_FILE,), "models retrofitted from other sources or "
                                                                   "layers: average one model's checkpoints"),
        GENERATION_CONFIG_FILE: agreed_source(chosen, (GENERATION_CONFIG_FILE,), "other generation defaults: make "
                                                                                 "the files agree, or remove them"),
    }
    # Every file the average keeps beside its weights, read (bounded) before `out` changes: a refused one (a
    # retrofit.json over the size limit, a FIFO in --tokenizer, a dangling link) left a model already in `out`
    # without its tokenizer, or with the new one beside its old weights; and --tokenizer OUT lost OUT's tokenizer.
    # Each input's retrofit.json and generation_config.json are refused as a run's start refuses them.
    kept: dict[str, bytes] = {}
    for path in chosen:
        files = read_companions(path, before="averaging")
        kept |= {name: files[name] for name, source in companions.items() if source == path}
    if tokenizer_source is not None:  # (as `copy_tokenizer` reads them)
        kept |= {name: read_bytes(tokenizer_source / name, TOKENIZER_MAX_BYTES, "tokenizer file")
                 for name in TOKENIZER_FILES if (tokenizer_source / name).exists()}
    state = ema_state(chosen, beta)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    config = ModelConfig.from_json(chosen[-1] / "config.json")
    out.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, *companions):  # (not a mix with those of a model written there before)
        (out / name).unlink(missing_ok=True)
    for name, data in kept.items():
        atomic_write_bytes(out / name, data)
    save_pretrained(StateView(config, state), out, metadata={"averaged_from": json.dumps([str(p) for p in chosen]),
                                                               "ema_beta": str(beta)})
    return out
