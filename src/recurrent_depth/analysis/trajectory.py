"""Latent trajectories: every token's state at every recurrence step.

A run is `s_0 -> s_1 -> ... -> s_S` with `s_i = core(adapter(concat[s_{i-1}, e]))`; this module
records, for i = 0..S, the raw state `s_i` and the final-norm view `ln_f(s_i)` (what the paper's
plots use, and what the coda reads in Huginn's layout), and optionally what the model would predict
if it stopped at step i (entropy, top token and its probability: the model's own readout of s_i).
It can keep running past S, without storing, up to an approximate limit point `s*` (the paper's
128 steps from the same s_0).

Memory: raw + normed states take `2 * (S+1) * B * T * h * 4` bytes (0.5 GB for Huginn-0125 at
S=128, T=100). With `out_dir` they stream step by step into `.npy` files opened as memory maps,
so only one step is ever held in RAM, and the files can be reopened with `Trajectory.load`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from recurrent_depth.config import is_real
from recurrent_depth.inference.engine import Recurrence
from recurrent_depth.model.recurrent import check_scale_has_a_draw

# Above this, in-memory collection refuses and asks for `out_dir` (a memory map on disk).
DEFAULT_MAX_IN_MEMORY_BYTES = 1 << 30
STATE_FILES = {"raw": "raw_states.npy", "normed": "normed_states.npy"}
META_FILE = "trajectory.json"
OPTIONAL_FILES = ("entropy.npy", "top_ids.npy", "top_probs.npy", "limit.npy")


@dataclass
class StepState:
    """One step of a run: `raw` s_i and `normed` ln_f(s_i), both [B, T, h] tensors."""

    step: int
    raw: Tensor
    normed: Tensor


@dataclass
class Trajectory:
    """The states of one run, as float32 numpy arrays (memory maps when streamed to disk).

    raw:        [S+1, B, T, h] s_0..s_S
    normed:     [S+1, B, T, h] ln_f(s_0)..ln_f(s_S)
    entropy:    [S+1, B, T] next-token entropy (nats) of the prediction read at each step, or None
    top_ids:    [S+1, B, T] int64 most likely next token at each step, or None
    top_probs:  [S+1, B, T] its probability, or None
    limit:      [B, T, h] ln_f(s*) after `limit_steps` steps from the same s_0, or None
    input_ids:  [B, T] int64; attention_mask [B, T] (1 = real token) or None for no padding
    """

    raw: np.ndarray
    normed: np.ndarray
    input_ids: np.ndarray
    attention_mask: np.ndarray | None = None
    entropy: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_probs: np.ndarray | None = None
    limit: np.ndarray | None = None
    limit_steps: int | None = None
    seed: int | None = None
    init_scale: float = 1.0
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return self.raw.shape[0] - 1

    @property
    def batch_size(self) -> int:
        return self.raw.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.raw.shape[3]

    def positions(self, row: int = 0) -> np.ndarray:
        """Indices of the real (unpadded) tokens of batch row `row`, in order."""
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row={row} is out of range: the trajectory has batch size {self.batch_size}")
        if self.attention_mask is None:
            return np.arange(self.raw.shape[2])
        return np.flatnonzero(self.attention_mask[row])

    def states(self, kind: str = "normed", row: int = 0) -> np.ndarray:
        """[S+1, T_row, h] states of one row's real tokens ("raw" or "normed")."""
        if kind not in STATE_FILES:
            raise ValueError(f"kind={kind!r} is invalid: expected one of {sorted(STATE_FILES)}")
        pos = self.positions(row)
        data = self.raw if kind == "raw" else self.normed
        # Left padding makes the real tokens a contiguous suffix, so this slice stays a view.
        return data[:, row, pos[0] : pos[-1] + 1] if len(pos) else data[:, row, :0]

    def token_ids(self, row: int = 0) -> np.ndarray:
        return self.input_ids[row, self.positions(row)]

    @classmethod
    def load(cls, path: str | Path) -> Trajectory:
        """Reopen a trajectory written with `collect_trajectory(..., out_dir=path)` (memory-mapped)."""
        path = Path(path)
        if not (path / META_FILE).is_file():
            raise FileNotFoundError(f"{path} has no {META_FILE}; is it a trajectory directory?")
        meta = json.loads((path / META_FILE).read_text())
        arrays = {
            name: np.load(path / f"{name}.npy", mmap_mode="r")
            for name in ("entropy", "top_ids", "top_probs", "limit")
            if (path / f"{name}.npy").exists()
        }
        mask = meta.get("attention_mask")
        return cls(
            raw=np.load(path / STATE_FILES["raw"], mmap_mode="r"),
            normed=np.load(path / STATE_FILES["normed"], mmap_mode="r"),
            input_ids=np.asarray(meta["input_ids"], dtype=np.int64),
            attention_mask=None if mask is None else np.asarray(mask, dtype=np.int64),
            limit_steps=meta.get("limit_steps"),
            seed=meta.get("seed"),
            init_scale=meta.get("init_scale", 1.0),
            path=path,
            meta=meta,
            **arrays,
        )


def _check_ids(model: Any, input_ids: Tensor, attention_mask: Tensor | None) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a tensor [batch, seq_len>0], got {got}")
    limit = model.config.max_seq_len
    if input_ids.shape[1] > limit:
        raise ValueError(
            f"the prompt has {input_ids.shape[1]} tokens but the model's max_seq_len is {limit}; "
            "shorten the prompt"
        )
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.bool()
        # Left padding only: once a row has a real token, every later one is real.
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
            raise ValueError("attention_mask must use left padding (zeros before the first real token only)")
        if not bool(mask.any(dim=1).all()):
            raise ValueError("attention_mask has a row without any real token")
    # The model's own checks (integer dtype, ids inside the vocabulary, a 0/1 mask), so a bad id is a
    # ValueError here instead of an IndexError from inside the embedding.
    model.check_inputs(input_ids, None, attention_mask, None, None)


def _check_steps(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {minimum}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded `torch.Generator` on `device` (None for seed None: torch's global RNG)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} is invalid: expected an integer or None")
    return torch.Generator(device=device).manual_seed(seed)


def resolve_init_scale(model: Any, init_scale: float | None) -> float:
    """The s_0 scale a run uses: `init_scale`, or None for the model config's own, as the model's forward
    reads it (1 for Huginn; Parcae's like-init is 1/sqrt(h), its zero init 0). A finite number >= 0, and, for a model
    whose s_0 is its embedding (Ouro), 0 or its config's own, as the forward refuses any other (it would be ignored)."""
    scale = getattr(model.config, "init_scale", 1.0) if init_scale is None else init_scale
    if not is_real(scale) or scale < 0:
        raise ValueError(f"init_scale={scale!r} is invalid: expected a finite number >= 0")
    check_scale_has_a_draw(model.config, scale)
    return float(scale)


@torch.no_grad()
def iterate_states(
    model: Any,
    input_ids: Tensor,
    num_steps: int,
    *,
    attention_mask: Tensor | None = None,
    init_scale: float | None = None,
    seed: int | None = 0,
    input_states: Tensor | None = None,
) -> Iterator[tuple[StepState, Any]]:
    """Yield `(StepState, ctx)` for steps 0..num_steps of one run, computing each on demand.

    Runs the recurrence engine over the model's own modules (`inference.engine.Recurrence`), so the
    states are exactly those of `model(input_ids, num_steps, init_scale=..., generator=...)` (per row, in a batch);
    init_scale None is the model config's, as in the forward.
    `ctx` is the mixer context, which `model.predict(model.latent(raw), ctx)` needs to read logits.
    s_0 is drawn from a generator seeded with `seed` (or given as `input_states` [B, T, h]); in a batch,
    each row's from its own generator seeded with `seed`, over its real tokens, so a row's states are
    those of its prompt run alone (`model(row, ..., generator=...)`), whatever the padding and neighbours.
    """
    _check_ids(model, input_ids, attention_mask)
    _check_steps("num_steps", num_steps, 0)
    init_scale = resolve_init_scale(model, init_scale)
    input_ids = input_ids.to(model.device)
    mask = None if attention_mask is None else attention_mask.to(model.device)
    engine = Recurrence(model, fast=False)  # the model's own modules
    pass_ = engine.begin(input_ids, mask)
    e = pass_.e
    if input_states is not None:
        if tuple(input_states.shape) != tuple(e.shape):
            raise ValueError(f"input_states must have shape {tuple(e.shape)}, got {tuple(input_states.shape)}")
        state = input_states.to(device=e.device, dtype=e.dtype)
    elif seed is not None and (e.shape[0] > 1 or mask is not None) and model.config.state_init == "random":
        # each row's s_0 drawn alone from `seed` over its real tokens (zeros on its padding), as the row's
        # prompt run alone draws it: a row's trajectory does not depend on its padding or its neighbours
        # (a single padded row too: drawn over the padded length, its s_0 was another prompt's)
        state = torch.zeros_like(e)
        first = mask.long().argmax(dim=1).tolist() if mask is not None else [0] * e.shape[0]
        for b, start in enumerate(first):
            generator = make_generator(seed, e.device)
            state[b, start:] = engine.initial_state(e[b : b + 1, start:], init_scale, generator)[0]
    else:
        state = engine.initial_state(e, init_scale, make_generator(seed, e.device))
    ln_f = model.transformer.ln_f
    for depth, s in engine.depths(state, pass_, range(num_steps + 1)):
        yield StepState(depth, s, ln_f(s)), pass_.step.ctx


def predictions(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From logits [B, T, V]: entropy in nats [B, T], top token [B, T], its probability [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top_logp, top_ids = logp.max(dim=-1)
    return entropy, top_ids, top_logp.exp()


def _allocate(shape: tuple[int, ...], dtype: Any, out_dir: Path | None, name: str) -> np.ndarray:
    if out_dir is None:
        return np.empty(shape, dtype=dtype)
    return np.lib.format.open_memmap(out_dir / name, mode="w+", dtype=dtype, shape=shape)


def estimate_bytes(num_steps: int, batch: int, seq_len: int, hidden: int) -> int:
    """Bytes `collect_trajectory` stores for raw + normed float32 states."""
    return 2 * (num_steps + 1) * batch * seq_len * hidden * 4


def collect_trajectory(
    model: Any,
    input_ids: Tensor,
    num_steps: int,
    *,
    attention_mask: Tensor | None = None,
    init_scale: float | None = None,
    seed: int | None = 0,
    input_states: Tensor | None = None,
    limit_steps: int | None = None,
    with_predictions: bool = True,
    out_dir: str | Path | None = None,
    max_in_memory_bytes: int = DEFAULT_MAX_IN_MEMORY_BYTES,
    progress: bool = False,
) -> Trajectory:
    """Run the recurrence and record every token's state at steps 0..num_steps.

    Args:
        input_ids: [B, T] token ids; attention_mask [B, T] for left-padded batches.
        num_steps: S, the number of recurrence steps to record.
        init_scale, seed: s_0 ~ the model's truncated normal scaled by init_scale, drawn from a
            generator seeded with `seed` (same seed -> same trajectory). init_scale 0 -> s_0 = 0;
            None (default) -> the model config's init_scale, as the model's forward.
        limit_steps: if given (>= num_steps), keep iterating to this many steps from the same s_0
            and store ln_f(s_limit) as the approximate limit point s* (the paper uses 128).
        with_predictions: also record entropy / top token / its probability at every step (runs
            the coda once per step).
        out_dir: stream the arrays into .npy memory maps in this directory (for long runs).
        max_in_memory_bytes: without out_dir, refuse runs whose states exceed this size.
        progress: show a progress bar.
    Returns:
        a `Trajectory` (float32 arrays; see its docstring for shapes).
    """
    _check_steps("num_steps", num_steps, 0)
    init_scale = resolve_init_scale(model, init_scale)  # (recorded in the trajectory as the value used)
    if limit_steps is not None:
        _check_steps("limit_steps", limit_steps, num_steps)
    B, T = input_ids.shape if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else (0, 0)
    h = model.config.hidden_size
    size = estimate_bytes(num_steps, B, T, h)
    path = None if out_dir is None else Path(out_dir)
    if path is None and size > max_in_memory_bytes:
        raise ValueError(
            f"the trajectory needs {size / 2**20:.0f} MiB ({num_steps + 1} steps x {B} x {T} tokens x {h} "
            f"x 2 views, float32), above max_in_memory_bytes={max_in_memory_bytes}; pass out_dir=... to "
            "stream it to disk, or use fewer steps or tokens"
        )
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        # A reused directory must not mix runs: without this, `Trajectory.load` would pick up an
        # earlier run's limit point or predictions, and an interrupted run would look complete. Every file is
        # made anew: a symbolic link of one's name is replaced, not written through to its target.
        for name in (META_FILE, *STATE_FILES.values(), *OPTIONAL_FILES):
            (path / name).unlink(missing_ok=True)
    shape = (num_steps + 1, B, T, h)
    raw = _allocate(shape, np.float32, path, STATE_FILES["raw"])
    normed = _allocate(shape, np.float32, path, STATE_FILES["normed"])
    pred = None
    if with_predictions:
        pred = (
            _allocate(shape[:3], np.float32, path, "entropy.npy"),
            _allocate(shape[:3], np.int64, path, "top_ids.npy"),
            _allocate(shape[:3], np.float32, path, "top_probs.npy"),
        )
    limit = None
    total = num_steps if limit_steps is None else limit_steps
    steps = iterate_states(
        model, input_ids, total, attention_mask=attention_mask, init_scale=init_scale, seed=seed,
        input_states=input_states,
    )
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, total=total + 1, desc="recurrence steps", unit="step", disable=None)  # on a terminal only
    with torch.no_grad():
        for state, ctx in steps:
            i = state.step
            if i <= num_steps:
                raw[i] = state.raw.float().cpu().numpy()
                normed[i] = state.normed.float().cpu().numpy()
                if pred is not None:
                    # what the coda reads is model.latent(s): ln_f(s) for Huginn's layout only (a retrofitted
                    # or Ouro model reads s itself, Parcae's a projection), so the normed view is not it
                    logits = model.predict(model.latent(state.raw), ctx)
                    for array, value in zip(pred, predictions(logits)):
                        array[i] = value.cpu().numpy()
            if i == total and limit_steps is not None:
                limit = state.normed.float().cpu().numpy()
    mask = None if attention_mask is None else attention_mask.cpu().numpy().astype(np.int64)
    traj = Trajectory(
        raw=raw, normed=normed, input_ids=input_ids.cpu().numpy().astype(np.int64), attention_mask=mask,
        entropy=None if pred is None else pred[0], top_ids=None if pred is None else pred[1],
        top_probs=None if pred is None else pred[2], limit=limit, limit_steps=limit_steps, seed=seed,
        init_scale=float(init_scale), path=path,
    )
    if path is not None:
        _finish_on_disk(traj, path)
    return traj


def remove_trajectory(path: str | Path) -> None:
    """Delete the files `collect_trajectory(..., out_dir=path)` writes (and the folder, if that leaves
    it empty): an interrupted run's gigabytes, or an older run's states beside a newer report."""
    path = Path(path)
    for name in (META_FILE, *STATE_FILES.values(), *OPTIONAL_FILES):
        (path / name).unlink(missing_ok=True)
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()


def _finish_on_disk(traj: Trajectory, path: Path) -> None:
    for array in (traj.raw, traj.normed, traj.entropy, traj.top_ids, traj.top_probs):
        if isinstance(array, np.memmap):
            array.flush()
    if traj.limit is not None:
        np.save(path / "limit.npy", traj.limit)
    traj.meta = {
        "num_steps": traj.num_steps,
        "limit_steps": traj.limit_steps,
        "seed": traj.seed,
        "init_scale": traj.init_scale,
        "input_ids": traj.input_ids.tolist(),
        "attention_mask": None if traj.attention_mask is None else traj.attention_mask.tolist(),
        "shape": list(traj.raw.shape),
    }
    (path / META_FILE).write_text(json.dumps(traj.meta) + "\n")

