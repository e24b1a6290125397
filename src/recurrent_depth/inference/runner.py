"""The model pieces a generation loop calls: `ModelRunner`, the plain reference, and `make_runner`.

`ModelRunner` calls the model's own `make_context`, `embed`, `core_step` and `predict`. The fused
`FastRunner` (`recurrent_depth.accel.runner`) computes the same functions with far fewer tensor
operations for all-attention models; `make_runner` applies it from outside the model, by default,
unless `fast=False` or the accel switch (`RDEPTH_NO_ACCEL=1`) says no. Outputs agree with the
reference to float rounding (tests compare both at odd sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.model.mixers import MixerContext
from recurrent_depth.model.mixers.attention import Attention


@dataclass
class Step:
    """One model call's context: the model's `MixerContext` plus the fast path's rotary factors."""

    ctx: MixerContext
    freqs: Tensor | None = None  # complex [B, T, 1, D/2]


def blocks_of(model: Any) -> list[Any]:
    return [*model.transformer.prelude, *model.transformer.core_block, *model.transformer.coda]


def all_attention(model: Any) -> bool:
    """Every block mixes tokens with softmax attention (what cache lookups that hide columns need)."""
    return all(type(b.attn) is Attention for b in blocks_of(model))


class ModelRunner:
    """Reference implementation: the model's own methods."""

    name = "reference"

    def __init__(self, model: Any) -> None:
        self.model = model

    def context(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any, position_ids: Tensor | None = None,
        row_columns: list[int] | None = None,
    ) -> Step:
        return Step(self.model.make_context(input_ids, attention_mask, position_ids, cache, row_columns))

    def embed(self, input_ids: Tensor, step: Step) -> Tensor:
        return self.model.embed(input_ids, step.ctx)

    def inject(self, e: Tensor) -> Tensor:
        """What every recurrence step of these positions needs from e (the reference: e itself)."""
        return e

    def core_step(self, state: Tensor, injected: Tensor, e: Tensor, index: int, step: Step) -> Tensor:
        return self.model.core_step(state, e, index, step.ctx)

    def predict(self, state: Tensor, step: Step, last_only: bool = False) -> Tensor:
        """Logits float32 from raw states `[B, T, h]`: `[B, T, V]`, or `[B, 1, V]` with last_only.

        The coda always runs on every position, because it writes the coda's KV cache.
        """
        model = self.model
        x = model.transformer.ln_f(state)
        for c, block in enumerate(model.transformer.coda):
            x = block(x, step.ctx, ("coda", c))
        if last_only:
            x = x[:, -1:]
        return model.lm_head(model.transformer.ln_f(x)).float()

    def initial_state(self, e: Tensor, init_scale: float, generator: torch.Generator | None) -> Tensor:
        return self.model.initial_state(e, init_scale, generator)

    def final_norm(self, state: Tensor) -> Tensor:
        """ln_f of raw states `[B, T, h]` (the model's `latent_states`)."""
        return self.model.transformer.ln_f(state)


def make_runner(model: Any, fast: bool = True) -> ModelRunner:
    """The runner for one generation call (no gradients): the fast runner when asked for, allowed by
    the accel switch and supported, else the reference.

    A fast runner is built per call, not cached on the model: its copies and folded weights would
    go stale if a weight changed through `param.data`, which no version counter records. Building
    one costs about 7 ms for the `small` preset and 80 ms at h 1024 (58 M parameters) here.
    """
    from recurrent_depth.accel import enabled_by_default
    from recurrent_depth.accel.runner import FastRunner  # (accel.runner builds on this module)

    if not (fast and enabled_by_default() and FastRunner.supports(model)):
        return ModelRunner(model)
    with torch.no_grad():  # the copies and folded weights are constants, not graph nodes
        return FastRunner(model)
