"""What one micro-batch's loss is: an `Objective`, the trainer's one pluggable step.

The loop (`train/trainer.py`) owns everything around the loss: the depth draw, the initial-state
generator, autocast, gradient accumulation and sync, clipping, the optimizer and checkpoints. An
objective owns the forward and the scalar it returns, so recipes whose loss is not next-token
cross-entropy (RL's policy-gradient losses, distillation) reuse the loop instead of writing one.

    loss, output = objective.loss(model, batch, num_steps, generator)

`num_steps` and `generator` are the trainer's depth draw for this micro-batch (`None` for a model
without a depth sampler); an objective may ignore them (RL replays each token at the depth its
rollout recorded). `output` is handed to `BatchSource.observe` and may be anything.

An objective whose loss is a mean over scored tokens also says how many a batch has:
`objective.scored_tokens(batch) -> int`. The trainer then weights each micro-batch by its share of the
step's scored tokens (all micro-batches, all ranks), so that the step's gradient and reported loss are one
process's token mean over the whole global batch, however the tokens fall into micro-batches and ranks
(a rank with fewer answer tokens no longer counts more per token). Without it (RL's objectives, whose
means are over rollouts), each micro-batch counts the same.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NumSteps = int | tuple[int, int] | None


class Objective(Protocol):
    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: NumSteps,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        """The forward of one micro-batch and its scalar loss (mean over what it scores)."""
        ...


def scored_tokens(batch: dict[str, Tensor]) -> int | None:
    """How many tokens `batch_loss` averages over: the `targets` that are not -100, else the `labels` after the
    first position that are not -100 (the model shifts them inside); None for a batch with neither."""
    if "targets" in batch:
        return int((batch["targets"] != -100).sum())
    if "labels" in batch:
        return int((batch["labels"][:, 1:] != -100).sum())
    return None


def batch_loss(output: Any, batch: dict[str, Tensor]) -> Tensor:
    """Cross-entropy of `output.logits` against `batch["targets"]` (-100 unscored), else the model's own
    `output.loss` (from `batch["labels"]`); see `recurrent_depth.train.batches`."""
    if "targets" in batch:
        return F.cross_entropy(output.logits.flatten(0, 1), batch["targets"].flatten())
    loss = getattr(output, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss: give each batch `targets` (next-token ids) or `labels` "
                         "the model scores itself")
    return loss


class LanguageModeling:
    """The default: the batch's keyword arguments (all but `targets`) into the model at the drawn depth,
    scored by `batch_loss` (next-token cross-entropy, or the model's own `loss`)."""

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: NumSteps,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "targets"}
        if num_steps is not None:
            inputs["num_steps"] = num_steps
            inputs["generator"] = generator
        output = model(**inputs)
        return batch_loss(output, batch), output

    def scored_tokens(self, batch: dict[str, Tensor]) -> int | None:
        return scored_tokens(batch)
