"""Read a model's predictions at many depths in one pass.

Running the core to depth 32 passes through depths 1, 2, 4, ... on the way, with the same s_0:
`logits_at_depths` applies the coda at each requested depth instead of re-running the prelude
and the first steps for every depth. The result at depth d equals `model(ids, num_steps=d)` with
the same initial state (the tests check it), at the cost of one pass to the deepest depth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from recurrent_depth.inference.engine import Recurrence
from recurrent_depth.model.recurrent import RecurrentDepthLM


def check_depths(depths: Sequence[int], name: str = "depths") -> list[int]:
    """Sorted, de-duplicated depths; each an integer >= 0."""
    if not depths:
        raise ValueError(f"{name} is empty: give at least one depth (an integer >= 0)")
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{name} contains {d!r}: expected integers >= 0")
    return sorted(set(depths))


@torch.no_grad()
def logits_at_depths(
    model: RecurrentDepthLM,
    input_ids: Tensor,
    depths: Sequence[int],
    attention_mask: Tensor | None = None,
    init_scale: float | None = None,
    generator: torch.Generator | None = None,
    input_states: Tensor | None = None,
) -> Iterator[tuple[int, Tensor]]:
    """Yield `(depth, logits [B, T, V] float32)` for each depth in ascending order.

    The initial state is drawn once (from `generator`, scaled by `init_scale`, default the config's),
    or given (`input_states` `[B, T, h]`, as the model's forward takes it), and shared by every depth,
    as one forward at the deepest depth would see it.
    """
    wanted = check_depths(depths)
    scale = model.config.init_scale if init_scale is None else init_scale
    model.check_inputs(input_ids, None, attention_mask, input_states, None)
    engine = Recurrence(model, fast=False)  # the model's own modules
    pass_ = engine.begin(input_ids, attention_mask)
    s0 = input_states.to(pass_.e.dtype) if input_states is not None else engine.initial_state(pass_.e, scale, generator)
    for depth, state in engine.depths(s0, pass_, wanted):
        yield depth, engine.readout(state, pass_)
