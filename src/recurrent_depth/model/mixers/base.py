"""The token-mixer interface: what every mixer receives and the registry that builds them by name.

A mixer maps `[B, T, h] -> [B, T, h]`. It is called as `mixer(x, ctx, layer_key)` where `ctx`
(one `MixerContext` per forward call) carries positions, masks and the cache, and `layer_key`
names this layer at this recurrence step (`("core", j, step)`), which is how the cache keeps
one entry per (layer, step). Output projections are named `proj` so the Takase init finds them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from recurrent_depth.config import MODEL_PARTS, ModelConfig, rope_scaling_key
from recurrent_depth.model.cache import ModelCache
from recurrent_depth.model.layers import rope_at

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
    cache: ModelCache | None
    rope_base: float
    max_seq_len: int
    rope_scaling: tuple | None = None  # `config.rope_scaling_key(config.rope_scaling)`
    token_ids: Tensor | None = None  # [B, T] the new tokens, for layers with a value embedding
    # {layer_key: softmax probabilities [B, H, T, T_past + T]} when the caller asked for attention weights
    # (`RecurrentDepthLM.forward(output_attentions=True)`): softmax attention (attention, mla, dsa, nsa) then
    # runs as plain math and records each application here; other mixers record nothing. None: the fast path.
    attentions: dict[tuple, Tensor] | None = None
    # [B, T] the cache column of each new token where rows sit at different columns (`make_context`'s
    # row_columns, the serving pool); None: columns past_len .. past_len + T - 1 in every row. (A window reads it.)
    query_columns: Tensor | None = None
    _rope: dict[int | tuple, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def is_causal(self) -> bool:
        """True when SDPA's own causal flag is exact (no padding, no past)."""
        return self.attn_mask is None and self.past_len == 0 and self.positions.shape[1] > 1

    def rope(self, dim: int, base: float | None = None) -> tuple[Tensor, Tensor]:
        """(cos, sin) at this call's positions for a rotary dim, each [B, T, 1, dim/2], fp32. `base`: a layer's
        own RoPE base, unscaled (`ModelConfig.layer_rope_bases`); None: the model's rope_base and rope_scaling."""
        key = dim if base is None else (dim, base)
        if key not in self._rope:
            # [B, T, dim/2, 2]
            picked = (rope_at(self.positions, dim, self.max_seq_len, self.rope_base, self.rope_scaling) if base is None
                      else rope_at(self.positions, dim, self.max_seq_len, base))
            self._rope[key] = (picked[..., 0].unsqueeze(2), picked[..., 1].unsqueeze(2))
        return self._rope[key]


# ModelConfig options that only some mixers implement: name -> (its value at unique layer i where a config sets it,
# None where it is left at its default; how to leave it unset). A mixer class names those it implements in
# `config_options` and those with nothing to act on in it in `moot_config_options` (a mixer without RoPE has no
# rotation for rope_style to choose); `check_config_options` refuses any other set option, so none is silently ignored.
MIXER_CONFIG_OPTIONS: dict[str, tuple[Callable[[ModelConfig, int], Any], str]] = {
    "qk_norm": (lambda c, i: c.qk_norm or None, "set qk_norm false"),
    "layer_rope_bases": (lambda c, i: c.layer_rope_bases[i] if c.layer_rope_bases else None,
                         "give that layer null in layer_rope_bases"),
    "attn_logit_softcapping": (lambda c, i: c.attn_logit_softcapping, "set attn_logit_softcapping null"),
    "eager_attention": (lambda c, i: c.eager_attention or None, "set eager_attention false"),
    "query_pre_attn_scalar": (lambda c, i: c.query_pre_attn_scalar, "set query_pre_attn_scalar null"),
    # (muP's default: the rule resolved, so a muP model is told its mixer keeps its own 1/sqrt scale)
    "attn_scale": (lambda c, i: "1/d" if c.attention_scale_rule == "1/d" else None,
                   "set attn_scale='1/sqrt(d)' to accept that mixer's own scale"),
    "rope_style": (lambda c, i: None if c.rope_style == "interleaved" else c.rope_style,
                   "set rope_style='interleaved'"),
    "rope_scaling": (lambda c, i: c.rope_scaling if rope_scaling_key(c.rope_scaling) is not None else None,
                     "set rope_scaling null"),
    "num_kv_heads": (lambda c, i: None if c.num_kv_heads == c.num_heads else c.num_kv_heads,
                     "set num_kv_heads to num_heads"),
    "qkv_bias": (lambda c, i: c.qkv_bias or None, "set qkv_bias false"),
}


def check_config_options(config: ModelConfig, layers: list[tuple[str, str, nn.Module]]) -> None:
    """A one-line ValueError for a set `MIXER_CONFIG_OPTIONS` entry that a layer's mixer would ignore, or that the
    config sets away from its default while no layer implements it (every mixer finds it moot). layers: (part, mixer
    name, mixer) of each unique layer in order.
    A mixer without the two class attributes (a factory registered elsewhere) is taken to implement none of them."""
    for option, (value_at, unset) in MIXER_CONFIG_OPTIONS.items():
        doers = [n for n, f in sorted(_MIXERS.items()) if option in getattr(f, "config_options", ())]
        ors, ands = " or ".join(map(repr, doers)), " and ".join(map(repr, doers))
        values = []
        for i, (part, name, mixer) in enumerate(layers):
            value = value_at(config, i)
            if value is None:
                continue
            values.append(value)
            if option in getattr(mixer, "config_options", ()) or option in getattr(mixer, "moot_config_options", ()):
                continue
            raise ValueError(
                f"ModelConfig.{option} applies to layer {i}, whose mixer is not {ors}: {option}={value!r} is "
                f"implemented by the {ands} mixer{'s' if len(doers) > 1 else ''} only, but the {part} uses mixer "
                f"{name!r}, which would ignore it; {unset} or use {'one of those mixers' if len(doers) > 1 else 'it'} "
                f"there")
        # (a field left at its default, as attn_scale resolved by muP, was not asked for: nothing to refuse)
        field = next(f for f in dataclasses.fields(config) if f.name == option)
        if (values and getattr(config, option) != field.default
                and not any(option in getattr(mixer, "config_options", ()) for _, _, mixer in layers)):
            used = sorted({name for _, name, _ in layers})
            verb = "do" if len(doers) > 1 else "does"
            raise ValueError(f"ModelConfig.{option}={values[0]!r} has no effect: no layer's mixer implements it (this "
                             f"model's mixers {used} have nothing it acts on; {ands} {verb}); {unset}")


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


def check_mixer_name(name: str, part: str) -> None:
    """A ValueError naming `name` unless it is a registered mixer."""
    if name not in _MIXERS:
        raise ValueError(f"unknown mixer {name!r} for the {part}; available: {available_mixers()}")


def build_mixer(name: str, config: ModelConfig, part: str, **options: Any) -> nn.Module:
    """Construct mixer `name` for a block of `part` ("prelude" / "core" / "coda").

    `options` (from `ModelConfig.mixer_options`) may be flat keyword arguments, given to every
    mixer, or scoped: a dict under a mixer's name or a part's name applies only there, e.g.
    `{"gated_deltanet": {"conv_size": 4}, "prelude": {"window": 64}}`. Options the mixer does not
    accept raise a ValueError that lists the ones it does.
    """
    check_mixer_name(name, part)
    factory = _MIXERS[name]
    options = scoped_options(name, part, options)
    accepted = _accepted_options(factory)
    unknown = sorted(set(options) - accepted) if accepted is not None else []
    if unknown:
        raise ValueError(
            f"mixer_options {unknown} are not options of mixer {name!r} (used in the {part}); it accepts "
            f"{sorted(accepted)}. Scope options to one mixer or part, e.g. mixer_options={{{name!r}: {{...}}}}"
        )
    return factory(config, part=part, **options)


def scoped_options(name: str, part: str, options: dict[str, Any]) -> dict[str, Any]:
    """Flat options plus those scoped under `name` and then under `part` (later ones win).

    A key is a scope when it names a registered mixer or a part and its value is a dict.
    """
    scopes = set(_MIXERS) | set(MODEL_PARTS)
    out = {k: v for k, v in options.items() if not (k in scopes and isinstance(v, dict))}
    for scope in (name, part):
        if isinstance(options.get(scope), dict):
            out.update(options[scope])
    return out


def _accepted_options(factory: MixerFactory) -> set[str] | None:
    """Named keyword parameters of a factory (None when it takes **kwargs and checks them itself).

    A mixer class may name its own options and pass the others on to its base class (`**shared`):
    its options are then those of each `__init__` up its method resolution order, to the first one
    without **kwargs. One that reaches `nn.Module`'s `**kwargs` checks its options itself.
    """
    if isinstance(factory, type):
        inits = [c.__dict__["__init__"] for c in factory.__mro__ if "__init__" in c.__dict__]
    else:
        inits = [factory]
    accepted: set[str] = set()
    for init in inits:
        params = inspect.signature(init).parameters
        accepted |= {n for n, p in params.items()
                     if n not in ("self", "config", "part") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return accepted
    return None
