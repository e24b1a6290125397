"""The two RL objectives over one rollout batch: GRPO's clipped ratio and Kimi K2's ratio regression.

Both plug into the trainer as an `Objective` (`train/objective.py`): the forward recomputes the
completion log-probs at each token's recorded depth (`policy_logprobs`), the loss follows; the
"output" handed to `RolloutSource.observe` is the loss's statistics (a dict).

GRPO (advantages normalised within each group of G rollouts of one prompt):

    A_i  = (r_i - mean_j r_j) / (std_j r_j + eps)      (the sample std, n - 1: trl's)
    rho  = pi_theta / pi_old, per token
    loss = -(1 / sum_i |y_i|) sum_i sum_t min(rho A_i, clip(rho, 1 - eps_c, 1 + eps_h) A_i) + beta KL
    KL   = k3 per token: pi_ref / pi_theta - log(pi_ref / pi_theta) - 1, normalised like the first term

Variants (trl's GRPOTrainer names in brackets): the std is the group's ("group", the default), the whole
batch's ("batch"; every rank's rewards under torchrun) or none ("none") [scale_rewards]; eps_h defaults to
eps_c [epsilon_high, DAPO's clip-higher]; the normalisation (`LEVELS`) is "token" above [bnpo], "sequence"
(each rollout's tokens first, then the rollouts) [grpo], "global-token" (the tokens of every rank's rollouts;
"token" on one process) [dapo] or "constant" (rollouts x max_new_tokens, Dr. GRPO) [dr_grpo].

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

from recurrent_depth.train.distributed import DistEnv, summed_over_ranks
from recurrent_depth.train.rl.rollouts import RolloutSettings, policy_logprobs

LEVELS = ("token", "sequence", "global-token", "constant")
# trl's `loss_type` names for the levels (`rdepth rl --loss-type`): the same numbers on the same inputs
LOSS_TYPES = {"bnpo": "token", "grpo": "sequence", "dapo": "global-token", "dr_grpo": "constant"}
SCALES = ("group", "batch", "none")


def group_advantages(rewards: Tensor, group_size: int, valid: Tensor | None = None, normalize: bool = True,
                     eps: float = 1e-4, scale: str = "group", env: DistEnv | None = None) -> Tensor:
    """A `[N]` for rewards `[N]` laid out as consecutive groups of `group_size` rollouts of one prompt.

    normalize: divide by a standard deviation (the sample one, n - 1, over the valid rollouts, as trl's GRPOTrainer:
    its `nanstd` applies Bessel's correction) + eps (GRPO); otherwise
    only subtract the group mean (K2). scale (with normalize): whose std, the group's ("group") or the whole
    batch's rewards ("batch"; with `env` of several ranks, every rank's: `batch_std`), or none ("none": as
    normalize=False). Invalid rollouts get advantage 0, and so does every rollout of a group whose valid
    rewards are all equal (also at eps=0: no 0 / 0, and no +-1 from the rounding error of its mean)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [groups * group_size={group_size}], got shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is invalid: expected one of {SCALES}")
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    r = torch.where(valid, rewards, 0.0).view(-1, group_size).double()
    v = valid.view(-1, group_size)
    count = v.sum(dim=1, keepdim=True).clamp(min=1)
    mean = r.sum(dim=1, keepdim=True) / count
    lowest = torch.where(v, r, torch.inf).amin(dim=1, keepdim=True)
    highest = torch.where(v, r, -torch.inf).amax(dim=1, keepdim=True)
    varies = v & (lowest < highest)  # the rollouts that can carry a signal
    centred = torch.where(varies, r - mean, 0.0)
    if normalize and scale == "group":
        # (a group that varies has >= 2 valid rewards: count - 1 > 0 where the std is used)
        std = (centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = torch.where(varies, centred / (std + eps), 0.0)
    elif normalize and scale == "batch":
        centred = torch.where(varies, centred / (batch_std(r[v], env) + eps), 0.0)
    return centred.view(-1).to(rewards.dtype)


def batch_std(rewards: Tensor, env: DistEnv | None = None) -> float:
    """The sample std (n - 1, trl's `nanstd`) of `rewards` (a rank's valid ones) around their mean; with `env` of
    several ranks, of every rank's together, as trl gathers all processes' rewards for scale_rewards="batch". Every
    rank must call it (two float64 all-reduces: the count and sum, then the squared deviations from the global mean).
    0 under two rewards (then no group varies: every advantage is 0 anyway)."""
    def total(values: list[float]) -> list[float]:
        return summed_over_ranks(values, torch.float64, env).tolist() if env is not None and env.enabled else values

    r = rewards.double()
    count, summed = total([float(r.numel()), float(r.sum())])
    if count < 2:  # (no group with two valid rewards on any rank: every advantage is 0 anyway)
        return 0.0
    (squares,) = total([float((r - summed / count).square().sum())])
    return math.sqrt(squares / (count - 1))


def grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, clip_eps: float = 0.2,
              beta: float = 0.0, ref_logp: Tensor | None = None, level: str = "token",
              clip_eps_high: float | None = None, rows: Tensor | None = None,
              max_new_tokens: int | None = None) -> tuple[Tensor, dict]:
    """GRPO's loss (module docstring) for log-probs `[B, N]` of the completion tokens, `mask` `[B, N]`
    marking the scored ones, advantages `[B]`. Returns (loss, statistics).

    clip_eps_high: the upper clip (None: clip_eps). rows (bool `[B]`): the rollouts the "sequence" mean and
    the "constant" count run over, a row without scored tokens counting 0 (None: the rows with a scored
    token). max_new_tokens: the "constant" level's length (None: N). "global-token" is "token" here: the
    trainer weighs each rank's loss by its share of all ranks' tokens (`GRPO.scored_tokens`)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is invalid: expected one of {LEVELS}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    # An unscored position (the padding after a stop, a rollout left out) gets ratio 1 and KL 0 here rather than a
    # weight of 0 below: the pad's log-probs there can drift hundreds of nats apart at a low temperature, and
    # exp(that) * 0 = inf * 0 = NaN made the whole step's loss and gradient NaN (the step skipped).
    scored = mask.bool()
    logp = torch.where(scored, logp, old_logp.to(logp.dtype))
    if ref_logp is not None:
        ref_logp = torch.where(scored, ref_logp.to(logp.dtype), logp)
    mask = mask.to(logp.dtype)
    rows = mask.sum(dim=1) > 0 if rows is None else rows.bool()
    ratio = (logp - old_logp).exp()
    A = advantages[:, None].to(logp.dtype)
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - clip_eps, 1 + high) * A)
    per_token = -surrogate
    kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("grpo_loss with beta > 0 needs ref_logp (the reference policy's log-probs)")
        log_ratio = ref_logp - logp
        kl = log_ratio.exp() - log_ratio - 1
        per_token = per_token + beta * kl

    def reduce(x: Tensor, how: str) -> Tensor:
        if how in ("token", "global-token"):
            return (x * mask).sum() / mask.sum().clamp(min=1)
        if how == "constant":
            return (x * mask).sum() / (rows.sum().clamp(min=1) * (max_new_tokens or mask.shape[1]))
        per_row = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_row[rows].sum() / rows.sum().clamp(min=1)

    # (the statistics are means over tokens, or rollouts: a constant's share of a mean would not read as one)
    means = "sequence" if level == "sequence" else "token"
    clipped = (ratio < 1 - clip_eps) | (ratio > 1 + high)
    stats = {"clip_fraction": float(reduce(clipped.to(logp.dtype), means).detach())}
    # trl's GRPOTrainer metrics, its definitions: the scored tokens where the clip binds (the ratio past the bound
    # on the side the advantage pushes it), a mean over tokens whatever the level
    low = (ratio < 1 - clip_eps) & (A < 0)
    high_side = (ratio > 1 + high) & (A > 0)
    for name, hit in (("low", low), ("high", high_side), ("region", low | high_side)):
        stats[f"clip_ratio/{name}_mean"] = float(reduce(hit.to(logp.dtype), "token").detach())
    if kl is not None:
        stats["kl"] = float(reduce(kl, means).detach())
    return reduce(per_token, level), stats


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


def check_variants(clip_eps_high: Any, mask_truncated: Any, scale_rewards: Any = "group") -> None:
    """A one-line ValueError for an upper clip not a finite number > 0 (or None), a mask_truncated not a bool, or a
    scale_rewards not one of `SCALES`."""
    high = clip_eps_high
    if high is not None and (isinstance(high, bool) or not isinstance(high, int | float) or not 0 < high < math.inf):
        raise ValueError(f"clip_eps_high={high!r} (--clip-eps-high) is invalid: expected a finite number > 0")
    if not isinstance(mask_truncated, bool):
        raise ValueError(f"mask_truncated={mask_truncated!r} (--mask-truncated) is invalid: expected True or False")
    if scale_rewards not in SCALES:
        raise ValueError(f"scale_rewards={scale_rewards!r} (--scale-rewards) is invalid: expected one of {SCALES}")


@dataclass
class GRPO:
    """GRPO as a trainer `Objective` over the batches of a `RolloutSource` with the same `settings`."""

    settings: RolloutSettings
    clip_eps: float = 0.2
    beta: float = 0.0
    level: str = "token"
    eps: float = 1e-4
    clip_eps_high: float | None = None  # the upper clip 1 + clip_eps_high (None: clip_eps)
    scale_rewards: str = "group"
    mask_truncated: bool = False  # a rollout cut by max_new_tokens (no stop) carries no loss (DAPO)
    env: DistEnv | None = None  # the ranks under torchrun: scale_rewards="batch" takes the std of all their rewards

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"GRPO level={self.level!r} is invalid: expected one of {LEVELS}")
        # (a NaN passes `beta < 0`; `if beta:` in grpo_loss would then ask for a reference never made)
        if not 0 < self.clip_eps < 1 or not 0 <= self.beta < math.inf or not 0 <= self.eps < math.inf:
            raise ValueError(f"GRPO needs 0 < clip_eps < 1 and finite beta >= 0 and eps >= 0, got "
                             f"clip_eps={self.clip_eps}, beta={self.beta}, eps={self.eps}")
        check_variants(self.clip_eps_high, self.mask_truncated, self.scale_rewards)

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def loss_mask(self, batch: dict[str, Tensor]) -> Tensor:
        """The tokens that carry the loss `[B, N]`: those of the rollouts with a reward (and, under
        mask_truncated, that stopped before max_new_tokens)."""
        rows = batch["reward_valid"]
        if self.mask_truncated:
            rows = rows & ~batch["truncated"]
        return batch["completion_mask"] & rows[:, None]

    def scored_tokens(self, batch: dict[str, Tensor]) -> int | None:
        """For the "global-token" level, the tokens the trainer weighs this rank's loss by (their share of
        all ranks': the mean over every rank's tokens, trl's dapo); None leaves each rank's own mean."""
        return int(self.loss_mask(batch).sum()) if self.level == "global-token" else None

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: Any,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        logp = policy_logprobs(model, batch, self.settings)
        valid = batch["reward_valid"]
        A = group_advantages(batch["rewards"], self.settings.group_size, valid, normalize=True, eps=self.eps,
                             scale=self.scale_rewards, env=self.env)
        loss, stats = grpo_loss(logp, batch["old_logp"], A, self.loss_mask(batch), clip_eps=self.clip_eps,
                                clip_eps_high=self.clip_eps_high, beta=self.beta, ref_logp=batch.get("ref_logp"),
                                level=self.level, rows=valid, max_new_tokens=int(batch["max_new_tokens"]))
        return loss, stats


@dataclass
class K2:
    """Kimi K2's objective as a trainer `Objective` over the batches of a `RolloutSource`."""

    settings: RolloutSettings
    tau: float = 1.0
    mask_truncated: bool = False  # a rollout cut by max_new_tokens (no stop) carries no loss

    def __post_init__(self) -> None:
        if not 0 < self.tau < math.inf:
            raise ValueError(f"K2 tau={self.tau!r} is invalid: expected a finite number > 0")
        check_variants(None, self.mask_truncated)

    needs_reference = False

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: Any,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        logp = policy_logprobs(model, batch, self.settings)
        valid = batch["reward_valid"]
        A = group_advantages(batch["rewards"], self.settings.group_size, valid, normalize=False)
        # (a truncated rollout keeps its place in its group's mean, as under GRPO, and leaves the loss)
        rows = valid & ~batch["truncated"] if self.mask_truncated else valid
        loss = k2_loss(logp, batch["old_logp"], A, batch["completion_mask"], tau=self.tau, rows=rows)
        return loss, {}
