"""Caches keyed by (layer, recurrence step).

The model talks to a cache through four methods:
- `seq_len`: tokens already cached (the next call's positions start here);
- `update_kv(key, k, v, ctx) -> (k_all, v_all)`: store this call's keys/values `[B, T, Hkv, D]`
  for layer `key` and return those of every position so far, `[B, seq_len + T, Hkv, D]`;
- `get_state(key)` / `set_state(key, value)`: per-layer recurrent state for non-attention mixers;
- `advance(T)`: called once by the model after a forward has written T new tokens.

`DynamicCache` is the plain `full` policy (one entry per step). Policies with a step budget,
fallbacks for early-exited tokens and preallocation live in `recurrent_depth.inference.cache`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class DynamicCache:
    """One growing KV tensor pair (and one recurrent state) per layer key."""

    def __init__(self) -> None:
        self.kv: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.states: dict[tuple, Any] = {}
        self.seq_len = 0

    def update_kv(self, key: tuple, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        if key in self.kv:
            old_k, old_v = self.kv[key]
            if old_k.shape[0] != k.shape[0]:
                raise ValueError(
                    f"batch size {k.shape[0]} differs from the {old_k.shape[0]} rows this cache holds; "
                    "use a new cache for a new batch"
                )
            if old_k.shape[1] != self.seq_len:
                raise RuntimeError(
                    f"cache entry {key} holds {old_k.shape[1]} positions but {self.seq_len} are cached; "
                    "this layer/step was skipped for some tokens (use an inference cache policy with "
                    "a fallback for early-exited tokens)"
                )
            k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
        elif self.seq_len:
            raise RuntimeError(f"cache has no entry for {key} at {self.seq_len} cached positions")
        self.kv[key] = (k, v)
        return k, v

    def get_state(self, key: tuple) -> Any:
        return self.states.get(key)

    def set_state(self, key: tuple, value: Any) -> None:
        self.states[key] = value

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def nbytes(self) -> int:
        total = sum(k.nbytes + v.nbytes for k, v in self.kv.values())
        for state in self.states.values():
            total += sum(t.nbytes for t in _tensors(state))
        return total


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
