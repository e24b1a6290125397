"""The model pieces a generation loop calls: `ModelRunner`, the plain reference, and `make_runner`.

`ModelRunner` calls the model's own `make_context`, `embed`, `core_step` and `predict`. Faster
runners computing the same functions are applied from outside, as `accel.apply` is to the model:
a package offers a factory with `register_fast_runner`, and `make_runner` takes the first runner a
factory builds for the model, unless `fast=False`. `import recurrent_depth` registers the fused
`FastRunner` of all-attention models (`recurrent_depth.accel.runner`; off with `RDEPTH_NO_ACCEL=1`),
so this module imports nothing from `accel`. Outputs agree with the reference to float rounding
(tests compare both at odd sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.model.cache import ModelCache
from recurrent_depth.model.mixers import MixerContext


@dataclass
class Step:
    """One model call's context: the model's `MixerContext` plus the fast path's rotary factors."""

    ctx: MixerContext
    freqs: Tensor | None = None  # complex [B, T, 1, D/2]


class ModelRunner:
    """Reference implementation: the model's own methods."""

    name = "reference"

    def __init__(self, model: Any) -> None:
        self.model = model

    def context(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: ModelCache | None,
        position_ids: Tensor | None = None, row_columns: list[int] | None = None,
    ) -> Step:
        return Step(self.model.make_context(input_ids, attention_mask, position_ids, cache, row_columns))

    def embed(self, input_ids: Tensor, step: Step, inputs_embeds: Tensor | None = None) -> Tensor:
        """e = prelude(wte(ids)), or prelude(inputs_embeds) where given (`[B, T, h]`, before the scale)."""
        return self.model.embed(input_ids, step.ctx, inputs_embeds)

    def inject(self, e: Tensor) -> Tensor:
        """What every recurrence step of these positions needs from e (the reference: e itself)."""
        return e

    def core_step(self, state: Tensor, injected: Tensor, e: Tensor, index: int, step: Step) -> Tensor:
        return self.model.core_step(state, e, index, step.ctx)

    def core_steps(self, state: Tensor, injected: Tensor, e: Tensor, steps: range, step: Step) -> Tensor:
        """Core steps `steps` in order with nothing between them (a fused runner may run them in one call)."""
        for index in steps:
            state = self.core_step(state, injected, e, index, step)
        return state

    def predict(self, state: Tensor, step: Step, last_only: bool = False) -> Tensor:
        """Logits float32 from raw states `[B, T, h]`: `[B, T, V]`, or `[B, 1, V]` with last_only.

        The coda always runs on every position, because it writes the coda's KV cache.
        """
        model = self.model
        x = model.latent(state)
        for c, block in enumerate(model.transformer.coda):
            x = block(x, step.ctx, ("coda", c))
        if last_only:
            x = x[:, -1:]
        return model.head(x)

    def initial_state(self, e: Tensor, init_scale: float, generator: torch.Generator | None) -> Tensor:
        return self.model.initial_state(e, init_scale, generator)

    def final_norm(self, state: Tensor) -> Tensor:
        """ln_f of raw states `[B, T, h]` (the model's `latent_states`; the state itself without
        `norm_before_coda`)."""
        return self.model.latent(state)


# A factory builds a faster runner for a model, or returns None (the model is not supported, or a switch is off).
RunnerFactory = Callable[[Any], "ModelRunner | None"]
_FAST_RUNNERS: list[RunnerFactory] = []


def register_fast_runner(factory: RunnerFactory) -> None:
    """Offer `factory` to `make_runner` (once; factories are asked in the order they were registered)."""
    if factory not in _FAST_RUNNERS:
        _FAST_RUNNERS.append(factory)


def make_runner(model: Any, fast: bool = True) -> ModelRunner:
    """The runner for one generation call (no gradients): the first registered fast runner built for
    `model` when `fast`, else the reference.

    A fast runner is built per call, not cached on the model: its copies and folded weights would
    go stale if a weight changed through `param.data`, which no version counter records.
    """
    if fast:
        for factory in _FAST_RUNNERS:
            runner = factory(model)
            if runner is not None:
                return runner
    return ModelRunner(model)
