"""`LoopConfig`: which window of a pretrained model to loop, how often, and with which update rule."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recurrent_depth.config import check_field_names, is_int, is_real
from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

MODES = ("block", "layer")
RULES = ("naive", "damped", "rk")
STASH_POLICIES = ("first", "last")
WHEN = ("prefill", "always")
# The key under which a looped model's settings live in its config.json.
CONFIG_KEY = "loop"
# K above this is refused: each pass costs a window's FLOPs, and the method's gains are at K of 2 to 4.
MAX_ITERATIONS = 256
# Bounds on a model directory's config.json, checked before transformers builds the model from it.
MAX_DECODER_LAYERS = 1024
MAX_WIDTH = 1 << 17  # hidden and intermediate sizes
MAX_VOCAB = 1 << 23


@dataclass(frozen=True)
class LoopConfig:
    """A training-free loop over the decoder layers ``start..end`` (inclusive, 0-based).

    iterations: K, the number of window passes (1 = the base model).
    mode: ``"block"`` runs ``(L_end∘…∘L_start)^K``; ``"layer"`` runs ``L_end^K∘…∘L_start^K``
        (each layer its own one-layer window).
    rule: how K passes of the window g combine, starting from the window's input x0:
        ``"naive"``  x ← g(x), K times (reaches "t = K" of dx/dt = g(x) − x);
        ``"damped"`` x ← x + (g(x) − x)/K, K times (damped Euler: K steps of size 1/K, still "t = 1");
        ``"rk"``     β·g(x0) + (1 − β)·E_K(x0), E_K the damped-Euler endpoint.
    beta: β of ``"rk"`` (1 returns the base model; 0 is damped Euler).
    stash: which state writes the window's KV for the tokens of a cached forward: ``"first"`` the
        pre-loop state (the first pass writes; no extra cost), ``"last"`` the post-loop state (one
        extra window pass that only writes KV).
    when: ``"prefill"`` loops forwards that start from an empty (or no) cache and runs decode steps
        as the base model; ``"always"`` loops every decoded token too.
    """

    start: int
    end: int
    iterations: int = 2
    mode: str = "block"
    rule: str = "damped"
    beta: float = 0.5
    stash: str = "first"
    when: str = "prefill"

    def __post_init__(self) -> None:
        for name in ("start", "end", "iterations"):
            if not is_int(getattr(self, name)):
                raise ValueError(f"LoopConfig.{name} must be an integer, got {getattr(self, name)!r}")
        check_window(self.start, self.end, "LoopConfig window")
        if not 1 <= self.iterations <= MAX_ITERATIONS:
            raise ValueError(f"LoopConfig.iterations must be in [1, {MAX_ITERATIONS}], got {self.iterations}")
        for name, allowed in (("mode", MODES), ("rule", RULES), ("stash", STASH_POLICIES), ("when", WHEN)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LoopConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not is_real(self.beta) or not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"LoopConfig.beta must be a number in [0, 1], got {self.beta!r}")

    @property
    def width(self) -> int:
        """Layers in the window."""
        return self.end - self.start + 1

    def check_depth(self, num_layers: int) -> None:
        if self.end >= num_layers:
            raise ValueError(
                f"loop window [{self.start}, {self.end}] does not fit a model with {num_layers} decoder layers "
                f"(end must be <= {num_layers - 1})"
            )

    def flops_ratio(self, num_layers: int) -> float:
        """Forward FLOPs against the base model, by the paper's count 1 + (K − 1)·w (w = width / depth).

        Layer FLOPs only (embedding and head excluded), the ``"first"`` stash; ``"last"`` adds one window
        pass per cached token, see `docs/looping.md`.
        """
        return 1.0 + (self.iterations - 1) * self.width / num_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LoopConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a loop config must be a JSON object, got {type(data).__name__}")
        check_field_names(data, cls, "loop config field(s)")
        missing = sorted({"start", "end"} - set(data))
        if missing:
            raise ValueError(f"loop config is missing {missing}")
        return cls(**data)

    def label(self) -> str:
        """Short human-readable name, e.g. ``[2,3] block damped K=3``."""
        rule = f"rk β={self.beta:g}" if self.rule == "rk" else self.rule
        return f"[{self.start},{self.end}] {self.mode} {rule} K={self.iterations}"


def check_window(start: int, end: int, what: str) -> None:
    """The window rule, in one place: `LoopConfig` and `rdepth loop eval --windows` name `what` in the error."""
    if start < 0 or end < start:
        raise ValueError(f"{what} must satisfy 0 <= start <= end, got start={start} end={end}")


def check_loopable_dir(path: str | Path) -> None:
    """Refuse, in one line and before transformers allocates anything, a model directory whose config.json
    describes a model this machine cannot hold (`num_hidden_layers: 1e6` builds for minutes and gigabytes
    before failing) or stores a loop that `LoopConfig` refuses. A path that is not a local directory is left
    to transformers."""
    directory = Path(path)
    if not directory.is_dir():
        return
    config = read_json(directory / "config.json", CONFIG_MAX_BYTES, "config.json")
    if not isinstance(config, dict):
        raise ValueError(f"{directory / 'config.json'} is not a JSON object")
    where = f"{directory / 'config.json'}"
    sizes = {}
    for names, upper in ((("num_hidden_layers", "n_layer", "num_layers"), MAX_DECODER_LAYERS),
                         (("hidden_size", "n_embd", "d_model"), MAX_WIDTH),
                         (("intermediate_size", "n_inner"), MAX_WIDTH), (("vocab_size",), MAX_VOCAB)):
        for name in names:
            value = config.get(name)
            if value is None:
                continue
            if not is_int(value) or not 1 <= value <= upper:
                raise ValueError(f"{where}: {name} must be an integer in [1, {upper:,}], got {value!r}")
            sizes.setdefault(names[0], value)
    layers, hidden = sizes.get("num_hidden_layers", 1), sizes.get("hidden_size", 1)
    check_model_memory(layers, hidden, sizes.get("intermediate_size", 4 * hidden), sizes.get("vocab_size", 1),
                       f"{where} describes")
    if CONFIG_KEY in config and config[CONFIG_KEY] is not None:
        try:
            LoopConfig.from_dict(config[CONFIG_KEY])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: the stored loop is invalid: {exc}") from None


def check_model_memory(layers: int, hidden: int, inner: int, vocab: int, what: str) -> None:
    """A one-line ValueError when a decoder-only LM of these sizes would not fit this machine's memory in float32
    (`what` starts the message: "<config> describes"): it is refused before anything allocates."""
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner)
    memory = _physical_memory()
    if memory is not None and 4 * params > memory:
        raise ValueError(f"{what} a model of about {params / 1e9:,.1f} B parameters "
                         f"({4 * params / 1e9:,.1f} GB in float32), more than this machine's "
                         f"{memory / 1e9:,.1f} GB of memory")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
