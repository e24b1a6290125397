"""Where the trainer's micro-batches come from: a `BatchSource`.

A batch is a dict of the model's keyword arguments (`input_ids [B, T]`, optionally `position_ids`,
`attention_mask`, ...) plus how it is scored, one of:

- `targets [B, T]`: next-token ids aligned with the logits (position t predicts `targets[:, t]`);
  the trainer takes the cross-entropy of `output.logits` against them, `-100` unscored (the loss mask);
- `labels [B, T]`: unshifted labels the model scores itself (the Hugging Face rule: shifted inside,
  `-100` ignored); the trainer uses `output.loss`.

`RowBatches` serves the packed token shards (`rdepth train`); recipes with their own data (fresh
reasoning problems, an instruction set) subclass `BatchSource`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch with its tensors on `device` (the trainer's): a source may serve them on the CPU."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


class BatchSource:
    """A stream of training micro-batches (see the module docstring for the batch layout)."""

    # `observe` metrics that count the micro-batch's work: a step's record holds their sum over its
    # micro-batches and, under torchrun, over the ranks (the other metrics are the last micro-batch's)
    summed_metrics: tuple[str, ...] = ()
    # `observe` metrics averaged over the ranks under torchrun (a rank's None left out); any metric in neither
    # tuple is rank 0's alone
    rank_mean_metrics: tuple[str, ...] = ()

    def next_batch(self, batch_size: int) -> dict[str, Tensor]:
        raise NotImplementedError

    def observe(self, batch: dict[str, Tensor], output: Any) -> dict[str, Any]:
        """Called under `no_grad` after each micro-batch's forward; metrics to add to the step's record
        (the last micro-batch's with gradient accumulation, or the sum for `summed_metrics`). A
        curriculum updates itself here. The trainer fetches all of a step's micro-batches (`next_batch`)
        before it runs and observes the first: it weights their losses by their scored tokens."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream, saved in checkpoints. A source of fresh random problems has none, so a
        resumed run continues with new draws rather than the exact ones an uninterrupted run makes."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        """What the data is, for `run.json`."""
        return {"source": type(self).__name__}


class RowBatches(BatchSource):
    """Packed rows `[B, T + 1]` of a `ShardDataset` as `input_ids = rows[:, :-1]`, `targets = rows[:, 1:]`."""

    def __init__(self, dataset: Any, device: torch.device | str = "cpu", metadata: dict[str, Any] | None = None):
        self.dataset = dataset
        self.device = torch.device(device)
        self.metadata = metadata or {}

    def next_batch(self, batch_size: int) -> dict[str, Tensor]:
        rows = self.dataset.next_batch(batch_size).to(self.device)  # [B, T + 1]
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        return {k: self.metadata.get(k) for k in ("corpus", "tokenizer", "params", "splits", "key")}
