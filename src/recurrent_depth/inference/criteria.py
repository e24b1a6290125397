"""Per-token exit criteria for adaptive recurrence (the paper's §6.1 and the reference's evaluators).

Each criterion keeps per-row statistics across the steps of one token. `start(prev_state)` is
called with s_0 `[B, h]` (or `[B, T, h]`), then `update(state, logits)` at every evaluated step
with the raw state and, for output-based criteria, the last position's logits `[B, V]`; it
returns bool `[B]`: "this row may stop now". With several positions (a prompt that may exit
during prefill) the latent statistics are averaged over a row's real positions, as the
reference does. Default thresholds are the reference's ("auto"), except `kl`, which uses the
paper's 5e-4 (the reference's 1e-3 under `defaults="official"`, see `official_threshold`).

| name             | statistic after step t                                  | exits when     | default |
|------------------|---------------------------------------------------------|----------------|---------|
| kl               | KL(p_{t-1} || p_t), clamped at 0 (p_0 = uniform)        | < threshold    | 5e-4    |
| minp-kl          | kl after min-p filtering: probs < 0.1 max set to 1/V    | < threshold    | 1e-5    |
| entropy-diff     | |H(p_t) - H(p_{t-1})| (H_0 = 100)                      | < threshold    | 1e-3    |
| latent-diff      | ||s_t - s_{t-1}|| / ||s_t|| on raw states                | < threshold    | 0.03    |
| cosine           | 1 - cos(s_t, s_{t-1}), clamped at 0                     | < threshold    | 1e-3    |
| argmax-stability | consecutive steps with an unchanged argmax              | >= threshold   | 5       |
| gate             | cumulative exit probability sum_{j<=t} p_j (Ouro's gate) | >= threshold   | 1.0     |
| none             | (the reference's adaptive path that never exits)        | never          | 0       |

With `<`, a threshold of 0 never exits (the statistics are >= 0), which makes "threshold 0" equal
to fixed depth; argmax-stability counts steps, so its threshold is an integer >= 1. cosine never
exits at a step whose previous state is zero (the first step after s_0 = 0, init_scale 0), where
the angle is undefined (the reference's 0/0 is NaN), whatever the threshold.

`gate` is Ouro's learned exit (arXiv 2510.25741; `OuroForCausalLM.forward` with `exit_threshold=q`):
lambda_t = sigmoid(exit_gate(s_t)) on each step's state (the model's `exit_probability`), the exit
distribution p_t = lambda_t * prod_{j<t} (1 - lambda_j) with the remaining mass at the last step, and
a token leaves at the first step whose cumulative p reaches q, in (0, 1]. The row state is the
survival product prod (1 - lambda_j) and the cumulative mass, summed step by step as the reference
sums its pdf. The default q = 1 is the reference's behaviour without `exit_threshold`: the last step
(the cumulative mass reaches 1 only there, unless the gate is certain). It reads the gate at every
step, so it needs `check_every=1` and no unchecked steps (`GenerationOptions` refuses the others),
and a model with an exit gate (`gate_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class CriterionSpec:
    name: str
    default_threshold: float
    needs_logits: bool
    integer_threshold: bool = False
    official_threshold: float | None = None  # the reference's "auto" where it differs from ours
    reads_gate: bool = False  # reads the model's exit gate (`gate_for`)


# A model's exit gate: raw states [..., h] -> exit probability lambda [...] float32.
Gate = Callable[[Tensor], Tensor]


CRITERIA: dict[str, CriterionSpec] = {
    "kl": CriterionSpec("kl", 5e-4, True, official_threshold=1e-3),
    "minp-kl": CriterionSpec("minp-kl", 1e-5, True),
    "entropy-diff": CriterionSpec("entropy-diff", 1e-3, True),
    "latent-diff": CriterionSpec("latent-diff", 0.03, False),
    "cosine": CriterionSpec("cosine", 1e-3, False),
    "argmax-stability": CriterionSpec("argmax-stability", 5, True, integer_threshold=True),
    "gate": CriterionSpec("gate", 1.0, False, reads_gate=True),
    "none": CriterionSpec("none", 0.0, False),
}


def gate_for(spec: CriterionSpec | None, model: Any) -> Gate | None:
    """The exit gate a criterion reads: the model's `exit_probability` for `gate`, None for the others;
    a one-line ValueError when the model has no exit gate."""
    if spec is None or not spec.reads_gate:
        return None
    if not model.config.exit_gate:
        raise ValueError(
            f"exit_criterion={spec.name!r} reads the model's learned exit gate, and this model has none "
            "(ModelConfig.exit_gate is false: Ouro-style models have one); choose another criterion"
        )
    return model.exit_probability


def resolve_criterion(name: str | None, threshold: float | None,
                      official: bool = False) -> tuple[CriterionSpec | None, float | None]:
    """Validate a criterion name and threshold; None threshold -> the criterion's default (the
    reference's "auto" value when `official`)."""
    if name is None:
        if threshold is not None:
            raise ValueError(
                f"exit_threshold={threshold!r} was given without an exit_criterion; choose one of {sorted(CRITERIA)}"
            )
        return None, None
    if not isinstance(name, str) or name not in CRITERIA:
        raise ValueError(f"exit_criterion={name!r} is unknown: expected None or one of {sorted(CRITERIA)}")
    spec = CRITERIA[name]
    if threshold is None:
        official_default = spec.official_threshold if official else None
        return spec, float(spec.default_threshold if official_default is None else official_default)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float):
        raise ValueError(f"exit_threshold={threshold!r} is invalid: expected a number >= 0")
    try:
        as_float = float(threshold)
    except OverflowError:
        raise ValueError(f"exit_threshold={threshold!r} is invalid: too large for a float") from None
    if math.isnan(as_float):
        raise ValueError(f"exit_threshold={threshold!r} is invalid: expected a number >= 0")
    if spec.integer_threshold:
        if not math.isfinite(threshold) or threshold < 1 or threshold != int(threshold):
            raise ValueError(
                f"exit_threshold={threshold!r} is invalid for {name!r}: expected an integer >= 1 "
                "(the number of consecutive steps with an unchanged argmax)"
            )
    elif spec.reads_gate:
        if not 0 < threshold <= 1:
            raise ValueError(
                f"exit_threshold={threshold!r} is invalid for {name!r}: expected a number in (0, 1] "
                "(the cumulative exit probability q at which a token leaves)"
            )
    elif threshold < 0:
        raise ValueError(f"exit_threshold={threshold!r} is invalid for {name!r}: expected a number >= 0")
    return spec, float(threshold)


class ExitCriterion:
    """Running statistics of one criterion for a batch of rows during one token's recurrence.

    `row_state()` / `load_row_state()` expose the per-row statistics (batch-first tensors), so
    `RowCriterion` can keep them for rows that start their tokens at different steps.
    """

    ROW_STATE = ("prev", "prev_probs", "count", "survival", "mass")

    def __init__(self, spec: CriterionSpec, threshold: float, gate: Gate | None = None) -> None:
        if spec.reads_gate and gate is None:
            raise ValueError(f"exit_criterion={spec.name!r} needs the model's exit gate (see gate_for)")
        self.spec = spec
        self.threshold = threshold
        self.gate = gate
        self.last_statistic: Tensor | None = None

    def row_state(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.ROW_STATE if hasattr(self, name)}

    def load_row_state(self, state: dict[str, Tensor]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def needs_logits(self) -> bool:
        return self.spec.needs_logits

    def start(self, state: Tensor, vocab_size: int, valid: Tensor | None = None) -> None:
        """Reset for a new token whose initial state is `state` `[B, h]`, or for the positions
        `[B, T, h]` of a prompt (valid: bool `[B, T]`, the real ones; None = all)."""
        B = state.shape[0]
        name = self.spec.name
        self.valid = valid
        if name in ("kl", "minp-kl"):
            self.prev = torch.full((B, vocab_size), -math.log(vocab_size), dtype=torch.float32, device=state.device)
            self.prev_probs = self.prev.exp()
        elif name == "entropy-diff":
            self.prev = torch.full((B,), 100.0, dtype=torch.float32, device=state.device)
        elif name in ("latent-diff", "cosine"):
            self.prev = state.float()
        elif name == "argmax-stability":
            self.prev = torch.full((B,), -1, dtype=torch.long, device=state.device)
            self.count = torch.zeros(B, dtype=torch.long, device=state.device)
        elif name == "gate":  # per position: prod_j (1 - lambda_j) and sum_j p_j so far
            self.survival = torch.ones(state.shape[:-1], dtype=torch.float32, device=state.device)
            self.mass = torch.zeros(state.shape[:-1], dtype=torch.float32, device=state.device)

    def _per_row(self, stat: Tensor) -> Tensor:
        """`[B]` from a per-position statistic `[B]` or `[B, T]` (the mean over real positions)."""
        if stat.dim() == 1:
            return stat
        if self.valid is None:
            return stat.mean(-1)
        valid = self.valid.to(stat.dtype)
        return (stat * valid).sum(-1) / valid.sum(-1).clamp(min=1)

    def update(self, state: Tensor | None, logits: Tensor | None) -> Tensor:
        """Statistics after one more step; returns bool `[B]` (criterion met).

        state: raw states `[B, h]` or `[B, T, h]` (read by the latent criteria only); logits: `[B, V]`
        of the last position (read by the output criteria only, see `needs_logits`)."""
        name = self.spec.name
        if name in ("kl", "minp-kl"):
            logp = F.log_softmax(logits.float(), dim=-1)
            if name == "minp-kl":
                logp = _min_p_filtered(logp)
            # KL(prev || current) = sum p_prev (log p_prev - log p_cur): the reference's
            # F.kl_div(log p_cur, log p_prev, reduction="none", log_target=True).sum(-1), as one dot product.
            stat = torch.linalg.vecdot(self.prev_probs, self.prev - logp).clamp_(min=0)
            self.prev, self.prev_probs = logp, logp.exp()
            met = stat < self.threshold
        elif name == "entropy-diff":
            logp = F.log_softmax(logits.float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            stat = (entropy - self.prev).abs()
            self.prev = entropy
            met = stat < self.threshold
        elif name == "latent-diff":
            s = state.float()
            stat = self._per_row((s - self.prev).norm(dim=-1) / s.norm(dim=-1).clamp(min=1e-12))
            self.prev = s
            met = stat < self.threshold
        elif name == "cosine":
            s = state.float()
            stat = self._per_row((1 - F.cosine_similarity(s, self.prev, dim=-1, eps=1e-12)).clamp(min=0))
            # a zero previous state (s_0 at init_scale 0) has no angle: no exit there (the reference's 0/0 is NaN)
            undefined = self._per_row((self.prev.norm(dim=-1) == 0).float()) > 0
            self.prev = s
            met = (stat < self.threshold) & ~undefined
        elif name == "argmax-stability":
            top = logits.argmax(-1)
            self.count = torch.where(top == self.prev, self.count + 1, torch.zeros_like(self.count))
            self.prev = top
            stat = self.count
            met = stat >= self.threshold
        elif name == "gate":
            lam = self.gate(state)
            self.mass = self.mass + lam * self.survival  # p_t = lambda_t * prod_{j<t} (1 - lambda_j)
            self.survival = self.survival * (1 - lam)
            stat = self._per_row(self.mass)
            met = stat >= self.threshold
        else:  # none (a latent criterion: it reads the state's batch size only)
            stat = torch.zeros(state.shape[0], dtype=torch.float32, device=state.device)
            met = torch.zeros_like(stat, dtype=torch.bool)
        self.last_statistic = stat
        return met


def _min_p_filtered(logp: Tensor) -> Tensor:
    """Log-probabilities `[B, V]` after the reference's min-p filter: every probability below 0.1 x
    the row's largest becomes 1/V, then the row is renormalised."""
    probs = logp.exp()
    low = probs < 0.1 * probs.max(-1, keepdim=True).values
    probs = torch.where(low, 1.0 / probs.shape[-1], probs)
    return (probs / probs.sum(-1, keepdim=True)).log()


class RowCriterion:
    """One criterion and threshold with per-row statistics for `capacity` rows that start their
    tokens whenever their previous one ends (the serving batch): `start` and `update` gather the
    rows concerned into a working `ExitCriterion`, run it, and scatter its row state back."""

    def __init__(self, spec: CriterionSpec, threshold: float, capacity: int, vocab_size: int,
                 gate: Gate | None = None) -> None:
        self.spec = spec
        self.threshold = threshold
        self.gate = gate
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.store: dict[str, Tensor] = {}

    @property
    def needs_logits(self) -> bool:
        return self.spec.needs_logits

    def _scatter(self, crit: ExitCriterion, rows: Tensor) -> None:
        for name, value in crit.row_state().items():
            if name not in self.store:
                self.store[name] = value.new_zeros(self.capacity, *value.shape[1:])
            self.store[name][rows] = value

    def start(self, rows: Tensor, state: Tensor) -> None:
        """Rows `[m]` begin a token whose initial state is `state` `[m, h]`."""
        crit = ExitCriterion(self.spec, self.threshold, self.gate)
        crit.start(state, self.vocab_size)
        self._scatter(crit, rows)

    def update(self, rows: Tensor, state: Tensor, logits: Tensor | None) -> Tensor:
        """One more step for rows `[m]` (raw state `[m, h]`, logits `[m, V]`); bool `[m]`: met."""
        crit = ExitCriterion(self.spec, self.threshold, self.gate)
        crit.load_row_state({name: stored[rows] for name, stored in self.store.items()})
        met = crit.update(state, logits)
        self._scatter(crit, rows)
        return met

    def move(self, src: int, dst: int) -> None:
        for stored in self.store.values():
            stored[dst] = stored[src]
