"""A learned exit gate read along a trajectory (Ouro): when would each token stop?

A model with `ModelConfig.exit_gate` gives, at every recurrence step i, each token's probability of
stopping there, lambda_i = `model.exit_probability(s_i)`. As Ouro's reference (and the `gate` exit
criterion, `inference/criteria.py`) does, the exit distribution over steps 1..S is

    p_i = lambda_i * prod_{j<i} (1 - lambda_j)  (i < S),   p_S = prod_{j<S} (1 - lambda_j)

(the last step takes the mass left), its cumulative sum reaches 1 at step S, the expected exit step
is sum_i i p_i, and a token leaves at the first step whose cumulative p reaches the threshold q (the
model config's `exit_gate_threshold`, else the criterion's default 1: the last step). Up to the
last step, the cumulative distribution does not depend on S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def has_exit_gate(model: Any) -> bool:
    """Whether `model` has a learned exit gate (Ouro's `early_exit_gate`)."""
    return bool(getattr(getattr(model, "config", None), "exit_gate", False))


@dataclass
class ExitGate:
    """The gate along one prompt's trajectory; steps 1..S are columns 0..S-1.

    probability: [T, S] lambda_i, the gate's stop probability at step i given the token got there
    cumulative:  [T, S] float32, the cumulative exit distribution (1 at step S)
    threshold:   q, the cumulative probability at which a token leaves
    """

    probability: np.ndarray
    cumulative: np.ndarray
    threshold: float

    @property
    def distribution(self) -> np.ndarray:
        """[T, S] p_i, the probability of exiting exactly at step i."""
        return np.diff(self.cumulative.astype(np.float64), axis=-1, prepend=0.0)

    @property
    def expected_step(self) -> np.ndarray:
        """[T] the mean exit step sum_i i p_i."""
        steps = np.arange(1, self.cumulative.shape[-1] + 1)
        return self.distribution @ steps

    @property
    def exit_step(self) -> np.ndarray:
        """[T] the first step (1-based) whose cumulative exit probability reaches `threshold`."""
        # the last column is exactly 1 >= any threshold in (0, 1], so every token has one; compared in
        # float32, as the criterion compares its float32 mass
        return np.argmax(self.cumulative >= np.float32(self.threshold), axis=-1) + 1

    def token_dict(self, t: int) -> dict[str, Any]:
        return {
            "probability": self.probability[t].tolist(),
            "cumulative": self.cumulative[t].tolist(),
            "expected_exit_step": float(self.expected_step[t]),
            "exit_step": int(self.exit_step[t]),
        }

    def summary(self) -> dict[str, Any]:
        expected, exits = self.expected_step, self.exit_step
        return {
            "threshold": self.threshold,
            "steps": int(self.cumulative.shape[-1]),
            "mean_expected_exit_step": float(expected.mean()),
            "min_expected_exit_step": float(expected.min()),
            "max_expected_exit_step": float(expected.max()),
            "median_exit_step": float(np.median(exits)),
            "exit_step_counts": {str(int(s)): int(n) for s, n in zip(*np.unique(exits, return_counts=True))},
            "mean_probability": self.probability.mean(axis=0).tolist(),
        }


@torch.no_grad()
def exit_gate_along(model: Any, raw_states: np.ndarray) -> ExitGate:
    """The gate of `model` on raw states [S+1, T, h] (s_0..s_S, `Trajectory.states("raw")`).

    The sums are the `gate` exit criterion's own (`ExitCriterion`, float32, step by step), so a token's
    exit step is the one `exit_criterion="gate"` stops it at with S steps at most. The states are cast
    back to the model's dtype (they were stored as float32 from it, exactly), so lambda is what the
    model's forward computes on them.
    """
    from recurrent_depth.inference.criteria import ExitCriterion, resolve_criterion

    if not has_exit_gate(model):
        raise ValueError("this model has no exit gate (ModelConfig.exit_gate is false)")
    num_steps = raw_states.shape[0] - 1
    if num_steps < 1:
        raise ValueError("the exit gate needs at least one recurrence step after s_0")
    param = next(model.parameters())
    lambdas: list[torch.Tensor] = []

    def gate(state: torch.Tensor) -> torch.Tensor:  # the model's gate, each step's lambda kept on the way
        lambdas.append(model.exit_probability(state))
        return lambdas[-1]

    criterion = ExitCriterion(*resolve_criterion("gate", model.config.exit_gate_threshold), gate=gate)
    masses = []
    for i in range(num_steps + 1):
        state = torch.from_numpy(np.asarray(raw_states[i])).to(param.device, param.dtype)[None]  # [1, T, h]
        if i == 0:
            criterion.start(state, model.config.vocab_size)
        else:
            criterion.update(state, None)
            masses.append(criterion.mass[0].cpu().numpy())
    cumulative = np.stack(masses, axis=-1)  # [T, S] float32: the exit mass through step i
    cumulative[:, -1] = 1.0  # the last step takes the mass left
    probability = torch.stack(lambdas, dim=-1)[0].cpu().numpy()
    return ExitGate(probability=probability, cumulative=cumulative, threshold=criterion.threshold)
