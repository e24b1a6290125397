"""`LoopConfig`: which window of a pretrained model to loop, how often, and with which update rule."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from recurrent_depth.config import check_field_names, is_int, is_real

MODES = ("block", "layer")
RULES = ("naive", "damped", "rk")
STASH_POLICIES = ("first", "last")
WHEN = ("prefill", "always")
# The key under which a looped model's settings live in its config.json.
CONFIG_KEY = "loop"


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
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"LoopConfig window must satisfy 0 <= start <= end, got start={self.start} end={self.end}")
        if self.iterations < 1:
            raise ValueError(f"LoopConfig.iterations must be >= 1, got {self.iterations}")
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
