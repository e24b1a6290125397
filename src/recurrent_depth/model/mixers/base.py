"""The token-mixer interface: what every mixer receives and the registry that builds them by name.

A mixer maps `[B, T, h] -> [B, T, h]`. It is called as `mixer(x, ctx, layer_key)` where `ctx`
(one `MixerContext` per forward call) carries positions, masks and the cache, and `layer_key`
names this layer at this recurrence step (`("core", j, step)`), which is how the cache keeps
one entry per (layer, step). Output projections are named `proj` so the Takase init finds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.layers import rope_table

LayerKey = tuple  # ("prelude", i) | ("core", j, step) | ("coda", c)


@dataclass
class MixerContext:
    """Per-forward facts shared by every layer (built once, read many times).

    positions: [B, T] absolute positions of the new tokens (left padding shifts them per row).
    key_valid: [B, T_past + T] bool, True for real tokens, or None when nothing is padded.
    attn_mask: [B, 1, T, T_past + T] bool (True = may attend), or None when plain causal suffices.
    cache: a cache object (see `model/cache.py`) or None for a plain parallel forward.
    """

    positions: Tensor
    past_len: int
    key_valid: Tensor | None
    attn_mask: Tensor | None
    cache: Any | None
    rope_base: float
    max_seq_len: int
    _rope: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def is_causal(self) -> bool:
        """True when SDPA's own causal flag is exact (no padding, no past)."""
        return self.attn_mask is None and self.past_len == 0 and self.positions.shape[1] > 1

    def rope(self, dim: int) -> tuple[Tensor, Tensor]:
        """(cos, sin) at this call's positions for a rotary dim, each [B, T, 1, dim/2], fp32."""
        if dim not in self._rope:
            table = rope_table(dim, self.max_seq_len, self.rope_base, self.positions.device)
            picked = table[self.positions]  # [B, T, dim/2, 2]
            self._rope[dim] = (picked[..., 0].unsqueeze(2), picked[..., 1].unsqueeze(2))
        return self._rope[dim]


MixerFactory = Callable[..., nn.Module]
_MIXERS: dict[str, MixerFactory] = {}


def register_mixer(name: str) -> Callable[[MixerFactory], MixerFactory]:
    def decorate(factory: MixerFactory) -> MixerFactory:
        if name in _MIXERS:
            raise ValueError(f"mixer {name!r} is already registered")
        _MIXERS[name] = factory
        return factory

    return decorate


def available_mixers() -> list[str]:
    return sorted(_MIXERS)


def build_mixer(name: str, config: ModelConfig, part: str, **options: Any) -> nn.Module:
    """Construct mixer `name` for a block of `part` ("prelude" / "core" / "coda")."""
    if name not in _MIXERS:
        raise ValueError(f"unknown mixer {name!r} for the {part}; available: {available_mixers()}")
    return _MIXERS[name](config, part=part, **options)


