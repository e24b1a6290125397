"""The two RL objectives over one rollout batch: GRPO's clipped ratio and Kimi K2's ratio regression.

Both plug into the trainer as an `Objective` (`train/objective.py`): the forward recomputes the
completion log-probs at each token's recorded depth (`policy_logprobs`), the loss follows; the
"output" handed to `RolloutSource.observe` is the loss's statistics (a dict).

GRPO (advantages normalised within each group of G rollouts of one prompt):

    A_i  = (r_i - mean_j r_j) / (std_j r_j + eps)
    rho  = pi_theta / pi_old, per token
    loss = -(1 / sum_i |y_i|) sum_i sum_t min(rho A_i, clip(rho, 1 - eps_c, 1 + eps_c) A_i) + beta KL
    KL   = k3 per token: pi_ref / pi_theta - log(pi_ref / pi_theta) - 1, normalised like the first term

("token" normalisation; "sequence" averages each rollout's tokens first, then the rollouts.)

K2 (advantages only centred; sequence log-probs, i.e. the sum over the completion's tokens):

    A_i  = r_i - mean_j r_j
    loss = mean_i (A_i - tau log(pi_theta(y_i | x) / pi_old(y_i | x)))^2

A rollout whose reward is missing (`reward_valid` False: its reward function raised under
`on_reward_error="skip"`) is left out of its group's statistics and of the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.train.rl.rollouts import RolloutSettings, policy_logprobs

LEVELS = ("token", "sequence")


def group_advantages(rewards: Tensor, group_size: int, valid: Tensor | None = None, normalize: bool = True,
                     eps: float = 1e-4) -> Tensor:
    """A `[N]` for rewards `[N]` laid out as consecutive groups of `group_size` rollouts of one prompt.

    normalize: divide by the group's standard deviation (population, over its valid rollouts) + eps
    (GRPO); otherwise only subtract the group mean (K2). Invalid rollouts get advantage 0, and so does
    every rollout of a group whose valid rewards are all equal (also at eps=0: no 0 / 0, and no +-1
    from the rounding error of its mean)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [groups * group_size={group_size}], got shape {tuple(rewards.shape)}")
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    r = torch.where(valid, rewards, 0.0).view(-1, group_size).double()
    v = valid.view(-1, group_size)
    count = v.sum(dim=1, keepdim=True).clamp(min=1)
    mean = r.sum(dim=1, keepdim=True) / count
    lowest = torch.where(v, r, torch.inf).amin(dim=1, keepdim=True)
    highest = torch.where(v, r, -torch.inf).amax(dim=1, keepdim=True)
    varies = v & (lowest < highest)  # the rollouts that can carry a signal
    centred = torch.where(varies, r - mean, 0.0)
    if normalize:
        std = (centred.square().sum(dim=1, keepdim=True) / count).sqrt()
        centred = torch.where(varies, centred / (std + eps), 0.0)
    return centred.view(-1).to(rewards.dtype)


def grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float = 0.2,
              beta: float = 0.0, ref_logp: Tensor | None = None, level: str = "token") -> tuple[Tensor, dict]:
    """GRPO's loss (module docstring) for log-probs `[B, N]` of the completion tokens, `mask` `[B, N]`
    marking the scored ones, advantages `[B]`. Returns (loss, statistics)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is invalid: expected one of {LEVELS}")
    mask = mask.to(logp.dtype)
    ratio = (logp - old_logp).exp()
    A = advantages[:, None].to(logp.dtype)
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + clip_eps) * A)
    per_token = -surrogate
    kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("grpo_loss with beta > 0 needs ref_logp (the reference policy's log-probs)")
        log_ratio = ref_logp - logp
        kl = log_ratio.exp() - log_ratio - 1
        per_token = per_token + beta * kl

    def reduce(x: Tensor) -> Tensor:
        if level == "token":
            return (x * mask).sum() / mask.sum().clamp(min=1)
        lengths = mask.sum(dim=1)
        rows = lengths > 0
        return ((x * mask).sum(dim=1)[rows] / lengths[rows]).sum() / rows.sum().clamp(min=1)

    stats = {"clip_fraction": float(reduce(((ratio - 1).abs() > clip_eps).to(logp.dtype)).detach())}
    if kl is not None:
        stats["kl"] = float(reduce(kl).detach())
    return reduce(per_token), stats


def k2_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, tau: float = 1.0,
            rows: Tensor | None = None) -> Tensor:
    """K2's loss (module docstring): per-token log-probs `[B, N]` summed over `mask` to sequence
    log-probs; `rows` (bool `[B]`) limits the mean to valid rollouts."""
    mask = mask.to(logp.dtype)
    log_ratio = ((logp - old_logp) * mask).sum(dim=1)
    err = (advantages.to(logp.dtype) - tau * log_ratio).square()
    if rows is None:
        return err.mean()
    return err[rows].sum() / rows.sum().clamp(min=1)


@dataclass
class GRPO:
    """GRPO as a trainer `Objective` over the batches of a `RolloutSource` with the same `settings`."""

    settings: RolloutSettings
    clip_eps: float = 0.2
    beta: float = 0.0
    level: str = "token"
    eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"GRPO level={self.level!r} is invalid: expected one of {LEVELS}")
        # (a NaN passes `beta < 0`; `if beta:` in grpo_loss would then ask for a reference never made)
        if not 0 < self.clip_eps < 1 or not 0 <= self.beta < math.inf or not 0 <= self.eps < math.inf:
            raise ValueError(f"GRPO needs 0 < clip_eps < 1 and finite beta >= 0 and eps >= 0, got "
                             f"clip_eps={self.clip_eps}, beta={self.beta}, eps={self.eps}")

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: Any,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        logp = policy_logprobs(model, batch, self.settings)
        valid = batch["reward_valid"]
        A = group_advantages(batch["rewards"], self.settings.group_size, valid, normalize=True, eps=self.eps)
        mask = batch["completion_mask"] & valid[:, None]
        loss, stats = grpo_loss(logp, batch["old_logp"], A, mask, clip_eps=self.clip_eps, beta=self.beta,
                                ref_logp=batch.get("ref_logp"), level=self.level)
        return loss, stats


@dataclass
class K2:
    """Kimi K2's objective as a trainer `Objective` over the batches of a `RolloutSource`."""

    settings: RolloutSettings
    tau: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.tau < math.inf:
            raise ValueError(f"K2 tau={self.tau!r} is invalid: expected a finite number > 0")

    needs_reference = False

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: Any,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        logp = policy_logprobs(model, batch, self.settings)
        valid = batch["reward_valid"]
        A = group_advantages(batch["rewards"], self.settings.group_size, valid, normalize=False)
        loss = k2_loss(logp, batch["old_logp"], A, batch["completion_mask"], tau=self.tau, rows=valid)
        return loss, {}
