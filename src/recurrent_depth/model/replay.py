"""A teacher-forced forward in which every position runs the depth a generation recorded for it.

RL scores rollouts that chose their own depth (adaptive exit): position p ran `depths[b, p]` core
steps when it was generated. `RecurrentDepthLM.forward(..., replay=DepthReplay(depths, policy))`
recomputes the logits of such a sequence in one parallel pass, core step by core step:

- at step i a position with depth d > i computes its step; one with d <= i keeps its state;
- the keys and values a position offers at step i follow the rollout's KV policy: `deepest` gives
  the entry of its last computed step (min(i, d - 1), the fill rule of `model/cache.py`), `skip` and
  `full` hide it from steps i >= d (with one entry per step the two rules are the same);
- gradients flow through each position's last `backprop_depth` steps only (its state entering them is
  a constant, and its steps before them, keys and values included, are constants for everyone),
  which is training's truncated backprop with the window placed per position.

Only per-step slots replay in one pass: under a shared slot (`shared-K`, `anchor-K`, compress) a
token reads another token's entry of a *later* step (slot i mod K holds its last step of that
residue), which a pass that computes step i for every position before step i + 1 cannot know.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.model.cache import (
    KVPolicy,
    PerStep,
    attend_floats,
    no_decode_views,
    parse_kv_policy,
    update_heads_via_kv,
)

REPLAY_LOOKUPS = ("deepest", "skip", "full")


@dataclass(frozen=True)
class DepthReplay:
    """What `RecurrentDepthLM.forward(replay=...)` needs to rerun a rollout at its recorded depths.

    depths: long `[B, T]`, core steps each position ran (values below 1, e.g. padding, run 1 step).
    kv_policy: the rollout's policy name (`parse_kv_policy`); per-step slots with deepest, skip or full.
    backprop_depth: k, the last k steps of each position get gradients (>= 1).
    """

    depths: Tensor
    kv_policy: str = "per-step+deepest"
    backprop_depth: int = 8

    def policy(self, core_layers: int) -> KVPolicy:
        """The parsed policy; a one-line ValueError for one this pass cannot replay."""
        policy = parse_kv_policy(self.kv_policy, core_layers=core_layers)
        if not isinstance(policy.slots, PerStep) or policy.lookup.name not in REPLAY_LOOKUPS:
            raise ValueError(
                f"kv_policy={self.kv_policy!r} cannot be replayed: a depth replay needs per-step slots with one "
                f"of the lookups {list(REPLAY_LOOKUPS)} (under shared slots a token reads another token's later "
                "step); generate the rollouts with e.g. 'per-step+deepest' or 'per-step+skip'"
            )
        return policy

    def check(self, batch_shape: tuple[int, int], mixers: list[str], core_layers: int) -> KVPolicy:
        depths = self.depths
        if not isinstance(depths, Tensor) or depths.dtype.is_floating_point or depths.dtype == torch.bool:
            raise ValueError("replay.depths must be an integer tensor [batch, seq_len] of core steps per position")
        if tuple(depths.shape) != tuple(batch_shape):
            raise ValueError(f"replay.depths must have the shape of input_ids {tuple(batch_shape)}, "
                             f"got {tuple(depths.shape)}")
        if isinstance(self.backprop_depth, bool) or not isinstance(self.backprop_depth, int) or self.backprop_depth < 1:
            raise ValueError(f"replay.backprop_depth={self.backprop_depth!r} is invalid: expected an integer >= 1")
        if any(m != "attention" for m in mixers):
            raise ValueError(f"a depth replay needs the softmax 'attention' mixer in every part, got {mixers}")
        return self.policy(core_layers)


class ReplayKV:
    """The `ModelCache` of one replay pass: core layers read each column's entry under the policy.

    It keeps, per core layer, each column's keys and values of its last computed step, and hands a
    column outside its gradient window as a constant."""

    seq_len = 0
    attends_from_codes = False  # (floats: attention reads `update_kv`'s keys and values)
    decode_views = no_decode_views

    def __init__(self, depths: Tensor, grad_from: Tensor) -> None:
        self.depths = depths  # [B, T]
        self.grad_from = grad_from  # [B, T]: first step with gradients
        self.last: dict[int, tuple[Tensor, Tensor]] = {}

    def update_kv(self, key: tuple, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        if key[0] != "core":
            return k, v
        layer, step = key[1], key[2]
        live = (step >= self.grad_from)[..., None, None]
        k, v = torch.where(live, k, k.detach()), torch.where(live, v, v.detach())
        if layer in self.last:
            ran = (self.depths > step)[..., None, None]
            old_k, old_v = self.last[layer]
            k, v = torch.where(ran, k, old_k), torch.where(ran, v, old_v)
        self.last[layer] = (k, v)
        return k, v

    def update_heads(self, key: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return update_heads_via_kv(self, key, k, v)

    def attend(self, key: tuple, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
               kernels: Any = None) -> Tensor:
        return attend_floats(self, key, q, k, v, attn_mask, is_causal, kernels)

    def key_mask(self, key: tuple) -> Tensor | None:
        return None  # hiding columns is per query (see `hidden_mask`), so no row of the attention is empty

    def get_state(self, key: tuple) -> Any:
        return None

    def set_state(self, key: tuple, value: Any) -> None:
        raise ValueError("a depth replay runs softmax attention only (no recurrent mixer state)")

    def advance(self, num_tokens: int) -> None:
        return None

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.last.values())


def hidden_mask(attn_mask: Tensor | None, reached: Tensor) -> Tensor:
    """The attention mask `[B, 1, T, T]` of a step that hides the columns that did not reach it
    (`reached` bool `[B, T]`); a query always sees itself, so a finished position's row is never empty."""
    T = reached.shape[1]
    device = reached.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    base = causal if attn_mask is None else attn_mask
    itself = torch.eye(T, dtype=torch.bool, device=device)[None, None]
    return base & (reached[:, None, None, :] | itself)


def replay_core(model: Any, state: Tensor, e: Tensor, ctx: Any, replay: DepthReplay) -> Tensor:
    """The core steps of a replay forward: raw states `[B, T, h]` after each position's own depth."""
    policy = replay.check(tuple(state.shape[:2]), [model.config.mixer_for(p) for p in ("prelude", "core", "coda")],
                          model.config.core_layers)
    depths = replay.depths.to(state.device).long().clamp(min=1)
    grad_from = (depths - replay.backprop_depth).clamp(min=0)
    cache = ReplayKV(depths, grad_from)
    hides = policy.lookup.hides_columns
    grad = torch.is_grad_enabled()
    for step in range(int(depths.max())):
        reached = depths > step
        live = step >= grad_from
        step_ctx = replace(ctx, cache=cache, attn_mask=hidden_mask(ctx.attn_mask, reached) if hides else ctx.attn_mask,
                           _rope=ctx._rope)
        with torch.set_grad_enabled(grad and bool(live.any())):  # before every window: no graph at all
            new = model.core_step(state, e, step, step_ctx)
        new = torch.where(live[..., None], new, new.detach())
        state = torch.where(reached[..., None], new, state)
    return state
