"""Caches keyed by (layer, recurrence step), and the KV policies every cache storage follows.

The protocol (`ModelCache`: what the model's layers call; `StepCache`: what a generation loop
adds) is implemented by three storages: the plain `DynamicCache` below (one growing tensor per
key), the generation caches of `recurrent_depth.inference.cache` (a preallocated static store and
its plain per-column reference) and the serving slot pool (`recurrent_depth.serving.kv_pool`);
the transformers `Cache` of `integrations/hf.py` follows `ModelCache`.

A **KV policy** says which entry a (layer, step) reads and writes. It has two independent rules,
each a small class written once here:

- the slot rule, for core layers (prelude and coda layers keep one entry per token):
  `PerStep` (slot = step, one entry per step, the reference's `full`) or `SharedBudget(k)`
  (slot = step mod k, the paper's zero-shot KV sharing; k = 1 is `last-step`, the vLLM layout);
- the lookup rule for tokens that ran fewer steps than a later token reads (adaptive exit):
  `Deepest` (read the token's deepest entry of the same core layer, the paper's remark 6.1; the
  reference's `latest-m4`) or `Skip` (leave the token out of the attention at steps it did not
  reach; the reference's `skip`).

`KVPolicy.parse("shared-4+skip")` builds one from its name (see `parse_kv_policy`). A new lookup
rule is one more class with `fill_index`, `visible` and `hides_columns` plus its entry in `LOOKUPS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

LayerKey = tuple  # ("prelude", i) | ("core", j, step) | ("coda", c)


class ModelCache(Protocol):
    """What the model's layers call (see `RecurrentDepthLM.forward` and the mixers).

    seq_len: columns already cached (the next call's positions start here).
    update_kv: store this call's keys/values `[B, T, Hkv, D]` for `key` and return those of every
      column so far, `[B, seq_len + T, Hkv, D]`.
    key_mask: None, or bool `[B, seq_len + T]`: which columns `key` may attend to (a lookup rule
      that leaves tokens out, e.g. `Skip`); the attention mixers combine it with the causal mask.
    get_state / set_state: per-layer recurrent state of non-attention mixers.
    advance: the model wrote T new columns. nbytes: bytes the cache holds (allocated).
    """

    seq_len: int

    def update_kv(self, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]: ...
    def key_mask(self, key: LayerKey) -> Tensor | None: ...
    def get_state(self, key: LayerKey) -> Any: ...
    def set_state(self, key: LayerKey, value: Any) -> None: ...
    def advance(self, num_tokens: int) -> None: ...
    def nbytes(self) -> int: ...


class StepCache(ModelCache, Protocol):
    """What the recurrence engine (`recurrent_depth.inference.engine`) adds for per-token depth.

    write_mask: None or bool `[B, T]`: only those (row, new column) entries are written.
    close(depth, T): the new columns ran `depth` (`[B, T]` or an int) steps; the lookup rule
      settles their unreached entries. truncate(n): forget columns from n on. seek(n): write at
      column n next, keeping every entry. logical_nbytes(valid, end): bytes per row `[B]` of every
      entry the policy keeps for the real columns in [0, end).
    """

    write_mask: Tensor | None
    policy: KVPolicy

    def close(self, depth: Tensor | int, num_tokens: int | None = None) -> None: ...
    def truncate(self, num_columns: int) -> None: ...
    def seek(self, num_columns: int) -> None: ...
    def logical_nbytes(self, valid: Tensor | None = None, core_only: bool = False,
                       end: int | None = None) -> Tensor: ...


# ---------------------------------------------------------------------------- slot rules
@dataclass(frozen=True)
class PerStep:
    """One entry per recurrence step: step i uses slot i."""

    name = "per-step"
    budget = None

    def slot(self, step: int) -> int:
        return step

    def num_slots(self, deepest: int) -> int:
        """Slots a core layer needs when no token runs more than `deepest` steps."""
        return max(1, deepest)


@dataclass(frozen=True)
class SharedBudget:
    """k entries per core layer: step i reads and writes slot i mod k (the paper's KV sharing)."""

    budget: int

    @property
    def name(self) -> str:
        return "last-step" if self.budget == 1 else f"shared-{self.budget}"

    def slot(self, step: int) -> int:
        return step % self.budget

    def num_slots(self, deepest: int) -> int:
        return max(1, min(self.budget, deepest))


# ---------------------------------------------------------------------------- lookup rules
@dataclass(frozen=True)
class Deepest:
    """A token that ran d steps is read at its deepest entry (slot of step d - 1) for later steps."""

    name = "deepest"
    hides_columns = False

    @staticmethod
    def fill_index(depth: Tensor, num_slots: int) -> Tensor:
        """Long `[S, B, T]`: the slot whose entry slot s of each column holds once closed.

        Slot s < d holds step s; a slot the token did not reach takes slot d - 1. (Under a budget
        k, d >= k wrote every slot, and then min(s, d - 1) = s.)"""
        return torch.minimum(torch.arange(num_slots, device=depth.device)[:, None, None],
                             (depth - 1).clamp(min=0)[None])

    @staticmethod
    def visible(step: int, depth: Tensor) -> Tensor | None:
        return None  # every column is read (at its deepest entry)


@dataclass(frozen=True)
class Skip:
    """A token that ran d steps is left out of the attention of core steps >= d."""

    name = "skip"
    hides_columns = True  # caches then answer `key_mask` for core keys

    @staticmethod
    def fill_index(depth: Tensor, num_slots: int) -> Tensor | None:
        return None  # unreached entries are never read

    @staticmethod
    def visible(step: int, depth: Tensor) -> Tensor | None:
        """Bool like `depth`: the columns that reached core step `step`."""
        return depth > step


SLOT_RULES = ("per-step", "last-step", "shared-K")
LOOKUPS: dict[str, Any] = {"deepest": Deepest(), "skip": Skip()}


@dataclass(frozen=True)
class KVPolicy:
    """A slot rule and a lookup rule (see the module docstring)."""

    slots: PerStep | SharedBudget
    lookup: Deepest | Skip

    @property
    def name(self) -> str:
        return f"{self.slots.name}+{self.lookup.name}"

    @property
    def budget(self) -> int | None:
        return self.slots.budget

    def split(self, key: LayerKey, num_slots: int) -> tuple[tuple, int]:
        """(base key, slot): core keys `("core", j, step)` -> `(("core", j), slot)`, others slot 0."""
        if key[0] != "core":
            return key, 0
        slot = self.slots.slot(key[2])
        if slot >= num_slots:
            raise RuntimeError(
                f"step {key[2]} exceeds the cache's {num_slots} core slots (policy {self.name}); size the "
                "cache for the deepest step run"
            )
        return key[:2], slot


def parse_kv_policy(spec: Any = None, kv_budget: Any = None) -> KVPolicy:
    """A `KVPolicy` from its name and/or a KV budget.

    spec: None or "<slots>", "<lookup>" or "<slots>+<lookup>", with slots one of "per-step"
    (default), "last-step" (= shared-1) or "shared-K" (K >= 1), and lookup "deepest" (default) or
    "skip". kv_budget=K is the same as slots "shared-K" (both may be given if they agree).
    """
    if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
        raise ValueError(f"kv_budget={kv_budget!r} is invalid: expected None (one entry per step) or an integer >= 1")
    slots: PerStep | SharedBudget | None = None
    lookup = None
    if spec is not None:
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"kv_policy={spec!r} is invalid: expected a name such as 'per-step', 'shared-4+skip'")
        for part in spec.split("+"):
            if part in LOOKUPS and lookup is None:
                lookup = LOOKUPS[part]
            elif slots is None and part == "per-step":
                slots = PerStep()
            elif slots is None and part == "last-step":
                slots = SharedBudget(1)
            elif slots is None and part.startswith("shared-") and part[7:].isdigit() and int(part[7:]) >= 1:
                slots = SharedBudget(int(part[7:]))
            else:
                raise ValueError(
                    f"kv_policy={spec!r} is invalid at {part!r}: expected '<slots>', '<lookup>' or '<slots>+<lookup>' "
                    f"with slots one of {list(SLOT_RULES)} (K an integer >= 1) and lookup one of {sorted(LOOKUPS)}"
                )
    if kv_budget is not None:
        if slots is not None and slots.budget != kv_budget:
            raise ValueError(f"kv_budget={kv_budget} contradicts kv_policy={spec!r}; give one of them")
        slots = SharedBudget(kv_budget)
    return KVPolicy(slots or PerStep(), lookup or LOOKUPS["deepest"])


def combine_key_mask(attn_mask: Tensor | None, key_mask: Tensor | None, num_queries: int) -> Tensor | None:
    """The attention mask `[B, 1, T, S]` of a call further limited to the columns `key_mask` `[B, S]`
    allows (None: `attn_mask` unchanged). The causal part is built when `attn_mask` is None."""
    if key_mask is None:
        return attn_mask
    S = key_mask.shape[1]
    if attn_mask is None:
        q_idx = torch.arange(S - num_queries, S, device=key_mask.device)[:, None]
        attn_mask = (torch.arange(S, device=key_mask.device)[None, :] <= q_idx)[None, None]
    return attn_mask & key_mask[:, None, None, :]


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

    def key_mask(self, key: tuple) -> Tensor | None:
        return None  # one entry per step, every column present

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
