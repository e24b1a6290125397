"""Caches keyed by (layer, recurrence step), and the KV policies every cache storage follows.

The protocol (`ModelCache`: what the model's layers and the fused runner call; `StepCache`: what
the recurrence engine adds for per-token depth) names every method the runtime calls on a cache
(tests/test_cache_protocol.py checks the calls and the storages). `ModelCache` is implemented by
every storage: the plain `DynamicCache` below (one growing tensor per key), the generation caches
of `recurrent_depth.inference.cache` (a preallocated static store and its plain per-column
reference, both `StepCache`s), the serving slot pool (`recurrent_depth.serving.kv_pool`) and the
transformers `Cache` of `integrations/hf.py`. A storage with quantized entries holds a codec
(`recurrent_depth.inference.kv_codec.CodeRows`) and says so with `attends_from_codes`.

A **KV policy** says which entry a (layer, step) reads and writes. It has two independent rules,
each a small class written once here:

- the slot rule, for core layers (prelude and coda layers keep one entry per token): `PerStep`
  (slot = step), `SharedBudget(k)` (slot = step mod k, the paper's zero-shot KV sharing; k = 1 is
  `last-step`, the vLLM layout), `Anchor(k)` (slot = min(step, k)) or `FlatGroups(N, L)` (the
  official `compress-rN`: one store for all L core layers, N consecutive flat steps per slot).
  Every rule writes a prefix: a column that ran d steps holds slots [0, entries(d)).
- the lookup rule, for tokens that ran fewer steps than a later token reads (adaptive exit):
  `Deepest` (read the token's deepest entry of the same core layer, the paper's remark 6.1),
  `Skip` (leave the token out at steps it did not reach), `Full` (leave it out where it did not
  write the slot), `AlwaysLast` and `Randomized` (pick a slot per column at every read while
  some column lacks the current one).

`parse_kv_policy` builds one from our names ("shared-4+skip", ...) or from an official
`cache_lookup_strategy` name (seal-rg/recurrent-pretraining at 59e0b69, `HuginnDynamicCache`):

    full -> per-step+full            skip -> per-step+skip (the same rule)
    latest-m4, available-m4 -> per-step+deepest
    always-last-m4 -> per-step+always-last      randomized -> per-step+randomized
    compress-sN -> shared-(N/L)      compress-rN -> FlatGroups(N, L)      compress-anchor -> anchor-8
    <lookup>-compress-<c>: both (a shared slot read by official skip is our full);
    compress-<c> alone: lookup full.

The official code indexes steps flat (prelude layers, then core layer j at recurrence i at
P + i L + j, with Huginn's P = 2, L = 4 hard-coded); these are the general forms, equal to it on
Huginn's layout. compress-sN and compress-rN depend on L: their policy is unbound (`KVPolicy.bound`)
until `KVPolicy.bind(core_layers)` (caches bind it; `kv_policy_from_official(strategy, config)`
parses and binds at once, for the options' `cache_lookup_strategy` alias). A rule with no meaning
on a layout is a one-line ValueError: compress-sN with N not a multiple of L (core layers would
share a slot), a same-layer lookup (deepest, always-last, randomized) with compress-rN.
A new lookup rule is one more class with `fill_index`, `visible`, `read_slots` and its flags,
plus its entry in `LOOKUPS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

LayerKey = tuple  # ("prelude", i) | ("core", j, step) | ("coda", c)
# A read's uniform draws for the randomized lookup: (rows bool `[B]` that draw, columns n) -> `[B, n]` in [0, 1).
Uniforms = Callable[[Tensor, int], Tensor]


class DecodeViews(NamedTuple):
    """`ModelCache.decode_views`' answer: one key store and one value store `[B, Hkv, capacity, width]`
    per layer key, and `codecs` None (float entries, width D) or each key's (key codec, value codec),
    whose code rows (width: a row's bytes) the stores hold."""

    keys: list[Tensor]
    values: list[Tensor]
    codecs: list[tuple[Any, Any]] | None = None


class ModelCache(Protocol):
    """What the model's layers call (see `RecurrentDepthLM.forward` and the mixers).

    seq_len: columns already cached (the next call's positions start here).
    update_kv: store this call's keys/values `[B, T, Hkv, D]` for `key` and return those of every
      column so far, `[B, seq_len + T, Hkv, D]`. update_heads: the same in head-major layout,
      `[B, Hkv, T, D]` in, `[B, Hkv, seq_len + T, D]` out (the fused runner's).
    key_mask: None, or bool `[B, seq_len + T]`: which columns `key` may attend to (a lookup rule
      that leaves tokens out, e.g. `Skip`); the attention mixers combine it with the causal mask.
    attends_from_codes: softmax attention calls `attend` instead of `update_kv` (a quantized storage
      reads attention from its code rows). attend: write k, v `[B, Hkv, T, D]`, return softmax
      attention of q `[B, H, T, D]` over every visible column `[B, H, T, Dv]` (kernels: fused code
      kernels from `recurrent_depth.accel.quant`, or None); float storages use `attend_floats`.
    get_state / set_state: per-layer recurrent state of non-attention mixers.
    advance: the model wrote T new columns. nbytes: bytes the cache holds (allocated).
    decode_views: for a fused decode writing one new column per row at `seq_len` itself (the C++ decode
      of `recurrent_depth.accel.decode_cpp`), the stores `[B, Hkv, capacity, width]` of `keys` (grown
      to hold the column) as `DecodeViews`: floats, or a quantized storage's code rows with each key's
      codecs; None where the storage must be written through `update_heads` / `attend` (a write mask, a
      lookup that hides or re-picks columns, a window or a dequantizing read, a storage or codec not yet
      made, or one kept otherwise: `no_decode_views`).
    """

    seq_len: int
    attends_from_codes: bool

    def update_kv(self, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]: ...
    def update_heads(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...
    def attend(self, key: LayerKey, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
               is_causal: bool, kernels: Any = None) -> Tensor: ...
    def key_mask(self, key: LayerKey) -> Tensor | None: ...
    def get_state(self, key: LayerKey) -> Any: ...
    def set_state(self, key: LayerKey, value: Any) -> None: ...
    def advance(self, num_tokens: int) -> None: ...
    def nbytes(self) -> int: ...
    def decode_views(self, keys: Sequence[LayerKey]) -> DecodeViews | None: ...


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
# Every slot rule writes a prefix: a column that ran d steps holds slots [0, entries(d)) of each
# base (one base per core layer, or one shared by all core layers for `FlatGroups`).
@dataclass(frozen=True)
class PerStep:
    """One entry per recurrence step: step i uses slot i."""

    name = "per-step"
    budget = None
    shares_slots = False  # no two steps of one layer write one slot
    per_layer = True  # each core layer has its own slots

    def slot(self, step: int) -> int:
        return step

    def num_slots(self, deepest: int) -> int:
        """Slots a core layer needs when no token runs more than `deepest` steps."""
        return max(1, deepest)

    def entries(self, depth: Tensor) -> Tensor:
        """Slots (of one base) a column that ran `depth` steps wrote: slots [0, entries) hold entries."""
        return depth

    def bind(self, core_layers: int) -> PerStep:
        return self


@dataclass(frozen=True)
class SharedBudget:
    """k entries per core layer: step i reads and writes slot i mod k (the paper's KV sharing)."""

    budget: int
    shares_slots = True
    per_layer = True

    @property
    def name(self) -> str:
        return "last-step" if self.budget == 1 else f"shared-{self.budget}"

    def slot(self, step: int) -> int:
        return step % self.budget

    def num_slots(self, deepest: int) -> int:
        return max(1, min(self.budget, deepest))

    def entries(self, depth: Tensor) -> Tensor:
        return depth.clamp(max=self.budget)

    def bind(self, core_layers: int) -> SharedBudget:
        return self


@dataclass(frozen=True)
class Anchor:
    """Steps 0..keep-1 keep their own slot; every later step shares slot `keep` (the official
    `compress-anchor`, keep = 8 recurrences)."""

    keep: int
    budget = None
    shares_slots = True
    per_layer = True

    @property
    def name(self) -> str:
        return f"anchor-{self.keep}"

    def slot(self, step: int) -> int:
        return min(step, self.keep)

    def num_slots(self, deepest: int) -> int:
        return max(1, min(self.keep + 1, deepest))

    def entries(self, depth: Tensor) -> Tensor:
        return depth.clamp(max=self.keep + 1)

    def bind(self, core_layers: int) -> Anchor:
        return self


@dataclass(frozen=True)
class FlatGroups:
    """The official `compress-rN` on the flat step index: core layer j at step i has flat index
    f = i * core_layers + j, and N consecutive flat indices share one slot (f // N) of one store
    for all core layers, so a layer reads what another layer of its group wrote last."""

    size: int
    core_layers: int
    budget = None
    shares_slots = True
    per_layer = False

    @property
    def name(self) -> str:
        return f"compress-r{self.size}"

    def flat_slot(self, layer: int, step: int) -> int:
        return (step * self.core_layers + layer) // self.size

    def num_slots(self, deepest: int) -> int:
        return max(1, -(-deepest * self.core_layers // self.size))

    def entries(self, depth: Tensor) -> Tensor:
        return torch.div(depth * self.core_layers + self.size - 1, self.size, rounding_mode="floor")

    def bind(self, core_layers: int) -> FlatGroups:
        if core_layers != self.core_layers:
            raise ValueError(f"kv_policy {self.name!r} was bound to {self.core_layers} core layers, not {core_layers}")
        return self


@dataclass(frozen=True)
class Unbound:
    """An official compression (`compress-sN`, `compress-rN`) given on the flat step index: it
    becomes a slot rule once the model's core layer count is known (`KVPolicy.bind`)."""

    kind: str  # "s" or "r"
    size: int
    budget = None
    shares_slots = True

    @property
    def per_layer(self) -> bool:
        return self.kind == "s"  # compress-rN groups core layers together

    @property
    def name(self) -> str:
        return f"compress-{self.kind}{self.size}"

    def bind(self, core_layers: int) -> PerStep | SharedBudget | FlatGroups:
        n, L = self.size, core_layers
        if self.kind == "s":
            if n % L:
                raise ValueError(
                    f"kv_policy {self.name!r} has no meaning on a model with {L} core layers: slot = flat step "
                    f"mod {n} keeps each core layer apart only when {n} is a multiple of {L}"
                )
            return SharedBudget(n // L)
        return PerStep() if n == 1 else FlatGroups(n, L)

    def _unbound(self, *_: Any) -> Any:
        raise RuntimeError(f"kv_policy {self.name!r} needs the model's layout first (KVPolicy.bind(core_layers))")

    slot = num_slots = entries = _unbound


SlotRule = PerStep | SharedBudget | Anchor | FlatGroups | Unbound


# ---------------------------------------------------------------------------- lookup rules
# A lookup rule says what a core step reads of a column that ran fewer steps than it (or, for the
# official `always-last` / `randomized`, of every column once one column lacks the step):
#   fill_index: settled once, when a column closes (copy entries into slots it did not reach);
#   visible:    which columns the attention sees (None: all);
#   read_slots: chosen at every read, per column (None: the step's own slot); `uniform` gives the
#               randomized lookup its draws (None: torch's global RNG).
@dataclass(frozen=True)
class Deepest:
    """A token that ran d steps is read at its deepest entry (slot of step d - 1) for later steps
    (the official `latest-m4` / `available-m4`)."""

    name = "deepest"
    hides_columns = False
    same_layer = True  # reads another step of the same core layer
    reads_per_step = False

    @staticmethod
    def fill_index(depth: Tensor, num_slots: int) -> Tensor:
        """Long `[S, B, T]`: the slot whose entry slot s of each column holds once closed.

        Slot s < d holds step s; a slot the token did not reach takes slot d - 1. (Under a budget
        k, d >= k wrote every slot, and then min(s, d - 1) = s.)"""
        return torch.minimum(torch.arange(num_slots, device=depth.device)[:, None, None],
                             (depth - 1).clamp(min=0)[None])

    @staticmethod
    def visible(step: int, slot: int, depth: Tensor, slots: SlotRule) -> Tensor | None:
        return None  # every column is read (at its deepest entry)

    @staticmethod
    def read_slots(step: int, slot: int, depth: Tensor, num_new: int, slots: SlotRule,
                   uniform: Uniforms | None = None) -> Tensor | None:
        return None


@dataclass(frozen=True)
class Skip:
    """A token that ran d steps is left out of the attention of core steps >= d."""

    name = "skip"
    hides_columns = True  # caches then answer `key_mask` for core keys
    same_layer = False
    reads_per_step = False

    @staticmethod
    def fill_index(depth: Tensor, num_slots: int) -> Tensor | None:
        return None  # unreached entries are never read

    @staticmethod
    def visible(step: int, slot: int, depth: Tensor, slots: SlotRule) -> Tensor | None:
        """Bool like `depth`: the columns that reached core step `step`."""
        return depth > step

    read_slots = staticmethod(Deepest.read_slots)


@dataclass(frozen=True)
class Full:
    """A column is read at a slot iff it wrote that slot (the official dynamic cache's `full`,
    which stacks whatever this step's slot holds). One entry per step: the same as `skip`; under a
    shared slot a token stays visible wherever an earlier step of it wrote the slot."""

    name = "full"
    hides_columns = True
    same_layer = False
    reads_per_step = False
    fill_index = staticmethod(Skip.fill_index)

    @staticmethod
    def visible(step: int, slot: int, depth: Tensor, slots: SlotRule) -> Tensor | None:
        return slots.entries(depth) > slot

    read_slots = staticmethod(Deepest.read_slots)


def _lacking_rows(slot: int, depth: Tensor, slots: SlotRule) -> Tensor:
    """Bool `[B]`: rows with a closed column (`depth` `[B, n]`) that did not write `slot`."""
    return (slots.entries(depth) <= slot).any(dim=1)


def _with_new(depth: Tensor, step: int, num_new: int) -> Tensor:
    """`depth` `[B, n]` followed by the `num_new` columns being computed, which reached `step`."""
    return torch.cat([depth, depth.new_full((depth.shape[0], num_new), step + 1)], dim=1)


@dataclass(frozen=True)
class _PerRead:
    """A lookup that, while some earlier column lacks this step's slot, reads every column at a slot
    of the same core layer that `choose` picks from what it wrote; otherwise this step's slot."""

    hides_columns = False
    same_layer = True
    reads_per_step = True
    fill_index = staticmethod(Skip.fill_index)
    visible = staticmethod(Deepest.visible)

    @classmethod
    def read_slots(cls, step: int, slot: int, depth: Tensor, num_new: int, slots: SlotRule,
                   uniform: Uniforms | None = None) -> Tensor | None:
        """Long `[B, n + num_new]`: the slot each column is read at (`depth` `[B, n]`: closed columns)."""
        held = slots.entries(_with_new(depth, step, num_new))  # each column wrote slots [0, held)
        lacking = _lacking_rows(slot, depth, slots)
        return torch.where(lacking[:, None], cls.choose(held, slot, lacking, uniform), slot)


@dataclass(frozen=True)
class AlwaysLast(_PerRead):
    """The official `always-last-m4`: the highest slot the column wrote (it may lie above this step)."""

    name = "always-last"

    @staticmethod
    def choose(held: Tensor, slot: int, lacking: Tensor, uniform: Uniforms | None) -> Tensor:
        return (held - 1).clamp(min=0)


@dataclass(frozen=True)
class Randomized(_PerRead):
    """The official `randomized` (a sanity check): a uniformly drawn slot at or below this one that the
    column wrote. Draws come from `uniform` (generation: each row's generator from the seed), or
    without one from torch's global RNG, as the official code does."""

    name = "randomized"

    @staticmethod
    def choose(held: Tensor, slot: int, lacking: Tensor, uniform: Uniforms | None) -> Tensor:
        count = held.clamp(min=1, max=slot + 1)
        draws = (torch.rand(count.shape, dtype=torch.float32, device=count.device) if uniform is None
                 else uniform(lacking, count.shape[1]))
        return (draws * count).long().clamp(max=count - 1)


LookupRule = Deepest | Skip | Full | AlwaysLast | Randomized
SLOT_RULES = ("per-step", "last-step", "shared-K", "anchor-K", "compress-sN", "compress-rN")
LOOKUPS: dict[str, Any] = {"deepest": Deepest(), "skip": Skip(), "full": Full(), "always-last": AlwaysLast(),
                           "randomized": Randomized()}


@dataclass(frozen=True)
class KVPolicy:
    """A slot rule and a lookup rule (see the module docstring)."""

    slots: SlotRule
    lookup: LookupRule

    def __post_init__(self) -> None:
        if self.lookup.same_layer and not self.slots.per_layer:
            raise ValueError(
                f"kv_policy {self.name!r} is invalid: {self.slots.name} shares one slot among core layers, so the "
                f"{self.lookup.name!r} lookup (another step of the same core layer) has no meaning; use 'full'"
            )

    @property
    def name(self) -> str:
        return f"{self.slots.name}+{self.lookup.name}"

    @property
    def budget(self) -> int | None:
        return self.slots.budget

    @property
    def bound(self) -> bool:
        return not isinstance(self.slots, Unbound)

    def bind(self, core_layers: int) -> KVPolicy:
        """This policy on a model with `core_layers` core layers (resolves `compress-sN` / `compress-rN`;
        a ValueError names a rule that has no meaning on that layout)."""
        return self if self.bound else KVPolicy(self.slots.bind(core_layers), self.lookup)

    def split(self, key: LayerKey, num_slots: int) -> tuple[tuple, int]:
        """(base key, slot): core keys `("core", j, step)` -> `(("core", j), slot)` (`(("core",), slot)`
        when all core layers share slots), others slot 0."""
        if key[0] != "core":
            return key, 0
        if self.slots.per_layer:
            base, slot = key[:2], self.slots.slot(key[2])
        else:
            base, slot = ("core",), self.slots.flat_slot(key[1], key[2])
        if slot >= num_slots:
            raise RuntimeError(
                f"step {key[2]} exceeds the cache's {num_slots} core slots (policy {self.name}); size the "
                "cache for the deepest step run"
            )
        return base, slot

    def slot_of(self, key: LayerKey) -> int:
        return self.split(key, 1 << 62)[1]

    def visible(self, key: LayerKey, depth: Tensor) -> Tensor | None:
        """Bool like `depth` (`[B, n]`, steps each column ran): which columns core key `key` attends to."""
        return self.lookup.visible(key[2], self.slot_of(key), depth, self.slots)

    def visible_above(self, step: int) -> int:
        """For a lookup that hides columns, on a per-layer slot rule: core step `step` sees exactly the
        columns that ran more than this many steps (`skip`: the step; `full`: its slot)."""
        return step if isinstance(self.lookup, Skip) else self.slots.slot(step)

    def read_slots(self, key: LayerKey, depth: Tensor, num_new: int, uniform: Uniforms | None = None
                   ) -> Tensor | None:
        """None, or long `[B, n + num_new]`: the slot of `key`'s base each column is read at."""
        return self.lookup.read_slots(key[2], self.slot_of(key), depth, num_new, self.slots, uniform)


# Official strategy names (`cache_lookup_strategy`): "<lookup>", "<lookup>-compress-<c>" or "compress-<c>".
OFFICIAL_LOOKUPS = {"full": "full", "skip": "skip", "latest-m4": "deepest", "available-m4": "deepest",
                    "always-last-m4": "always-last", "randomized": "randomized"}
OFFICIAL_ANCHOR_RECURRENCES = 8  # compress-anchor keeps the first 8 recurrences
_OFFICIAL = re.compile(r"(?:(?P<lookup>[a-z0-9-]+?)-)?compress-(?P<compress>s\d+|r\d+|anchor)|(?P<only>[a-z0-9-]+)")


def _official_policy(spec: str, field: str = "kv_policy") -> KVPolicy | None:
    """The policy of an official strategy name, or None if `spec` is not one (slots unbound for
    compress-sN / compress-rN: see `KVPolicy.bind`)."""
    match = _OFFICIAL.fullmatch(spec)
    if match is None:
        return None
    name = match["only"] if match["only"] is not None else match["lookup"]
    if name is not None and name not in OFFICIAL_LOOKUPS:
        return None
    compress = match["compress"]
    if compress is None:
        slots: SlotRule = PerStep()
    elif compress == "anchor":
        slots = Anchor(OFFICIAL_ANCHOR_RECURRENCES)
    elif int(compress[1:]) < 1:
        raise ValueError(f"{field}={spec!r} is invalid: compress-{compress[0]}N needs N >= 1")
    else:
        slots = Unbound(compress[0], int(compress[1:]))
    # The official `skip` and `full` read a column wherever it wrote the (possibly shared) slot; a bare
    # compression takes the official default lookup, `full` (the official code fails where an entry is missing).
    lookup = "full" if name in (None, "skip") and compress is not None else OFFICIAL_LOOKUPS[name or "full"]
    try:
        return KVPolicy(slots, LOOKUPS[lookup])
    except ValueError as exc:
        raise ValueError(f"{field}={spec!r}: {exc}") from None


def _our_slots(part: str) -> SlotRule | None:
    if part == "per-step":
        return PerStep()
    if part == "last-step":
        return SharedBudget(1)
    kind, _, number = part.rpartition("-")
    if kind == "compress" and number[:1] in ("s", "r"):
        kind, number = f"compress-{number[0]}", number[1:]
    if not number.isdigit() or int(number) < 1:
        return None
    rules = {"shared": SharedBudget, "anchor": Anchor, "compress-s": lambda n: Unbound("s", n),
             "compress-r": lambda n: Unbound("r", n)}
    return rules[kind](int(number)) if kind in rules else None


def parse_kv_policy(spec: Any = None, kv_budget: Any = None, core_layers: int | None = None) -> KVPolicy:
    """A `KVPolicy` from its name and/or a KV budget.

    spec: None, one of our names "<slots>", "<lookup>" or "<slots>+<lookup>", or an official
    strategy name (`cache_lookup_strategy`, see `kv_policy_from_official`).
    Our slots: "per-step" (default), "last-step" (= shared-1), "shared-K" (K >= 1), "anchor-K"
    (steps >= K share slot K); lookups: "deepest" (default), "skip", "full", "always-last",
    "randomized". kv_budget=K is the same as slots "shared-K" (both may be given if they agree).
    core_layers: the model's core layer count, to resolve official compress-sN / compress-rN now
    (otherwise the policy is unbound until a cache binds it).
    """
    if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
        raise ValueError(f"kv_budget={kv_budget!r} is invalid: expected None (one entry per step) or an integer >= 1")
    slots: SlotRule | None = None
    lookup = None
    if spec is not None:
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"kv_policy={spec!r} is invalid: expected a name such as 'per-step', 'shared-4+skip'")
        official = _official_policy(spec) if "+" not in spec and spec not in LOOKUPS else None
        if official is not None:
            slots, lookup = official.slots, official.lookup
        else:
            for part in spec.split("+"):
                if part in LOOKUPS and lookup is None:
                    lookup = LOOKUPS[part]
                elif slots is None and _our_slots(part) is not None:
                    slots = _our_slots(part)
                else:
                    raise ValueError(
                        f"kv_policy={spec!r} is invalid at {part!r}: expected '<slots>', '<lookup>' or "
                        f"'<slots>+<lookup>' with slots one of {list(SLOT_RULES[:4])} (K an integer >= 1) and lookup "
                        f"one of {sorted(LOOKUPS)}, or an official strategy ({'/'.join(OFFICIAL_LOOKUPS)}, "
                        "optionally followed by -compress-sN / -compress-rN / -compress-anchor)"
                    )
    if kv_budget is not None:
        if slots is not None and slots.budget != kv_budget:
            raise ValueError(f"kv_budget={kv_budget} contradicts kv_policy={spec!r}; give one of them")
        slots = SharedBudget(kv_budget)
    policy = KVPolicy(slots or PerStep(), lookup or LOOKUPS["deepest"])
    return policy if core_layers is None else policy.bind(core_layers)


def kv_policy_from_official(strategy: str, config: Any) -> KVPolicy:
    """The policy of an official `cache_lookup_strategy` on the model of `config` (a `ModelConfig`,
    or anything with `core_layers`); a ValueError names a strategy that is unknown or has no
    meaning on that layout."""
    field = "cache_lookup_strategy"
    if not isinstance(strategy, str) or (policy := _official_policy(strategy, field)) is None:
        raise ValueError(
            f"cache_lookup_strategy={strategy!r} is invalid: expected one of {list(OFFICIAL_LOOKUPS)}, optionally "
            "followed by -compress-sN / -compress-rN / -compress-anchor, or compress-sN / -rN / -anchor alone"
        )
    try:
        return policy.bind(config.core_layers)
    except ValueError as exc:
        raise ValueError(f"{field}={strategy!r}: {exc}") from None


def grown_slot_count(held: int, slot: int, limit: int | None = None) -> int:
    """Core slots a storage holding `held` grows to so that `slot` fits: doubled until it does (at most `limit`)."""
    count = held
    while count <= slot:
        count *= 2
    return count if limit is None else min(count, limit)


def settle_new_slots(store: Tensor, held: int, fill: Tensor) -> None:
    """After a storage grew from `held` core slots, give the new slots of its closed columns what the
    lookup rule settles them to (in place).

    store: `[S, B, Hkv, C', D]` with slots [0, held) filled; fill: long `[S, B, C]` (C <= C'), the
    slot each (slot, row, column) entry takes, as a lookup's `fill_index`. A closed column ran at most
    `held` steps, so its fill is below `held`; a value at or above it (a column or row whose rule never
    reads these slots) is clamped, copying an entry that is never read."""
    columns = fill.shape[2]
    cols = store[..., :columns, :]
    index = fill[held:].clamp(max=held - 1)[:, :, None, :, None].expand(store.shape[0] - held, *cols.shape[1:])
    store[held:, ..., :columns, :] = torch.gather(cols, 0, index)


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


def no_decode_views(cache: ModelCache, keys: Sequence[LayerKey]) -> None:
    """`decode_views` of a storage that is written through `update_kv` / `update_heads` only."""
    return None


def update_heads_via_kv(cache: ModelCache, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """`update_heads` of a storage whose layout is `update_kv`'s: `[B, Hkv, T, D]` in, `[B, Hkv, S, D]` out."""
    K, V = cache.update_kv(key, k.transpose(1, 2), v.transpose(1, 2))
    return K.transpose(1, 2), V.transpose(1, 2)


def attend_floats(cache: ModelCache, key: LayerKey, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                  is_causal: bool, kernels: Any = None) -> Tensor:
    """`attend` of a storage holding floats: `update_heads`, then SDPA over every visible column with the
    storage's `key_mask` (q `[B, H, T, D]`, k, v `[B, Hkv, T, D]` -> `[B, H, T, Dv]`; kernels unused)."""
    K, V = cache.update_heads(key, k, v)
    key_mask = cache.key_mask(key)
    if key_mask is not None:
        attn_mask, is_causal = combine_key_mask(attn_mask, key_mask, q.shape[2]), False
    return F.scaled_dot_product_attention(q, K, V, attn_mask=attn_mask, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != K.shape[1])


class DynamicCache:
    """One growing KV tensor pair (and one recurrent state) per layer key."""

    attends_from_codes = False
    update_heads = update_heads_via_kv
    attend = attend_floats
    decode_views = no_decode_views

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
