"""Training-free looping of a pretrained transformers causal LM (the "Reuse Middle Layers" method).

For a window g = L_b∘…∘L_a of decoder layers, F_g(x) = g(x) − x is a residual field and one pass
is one forward-Euler step of size 1 on dx/dt = F_g(x). Naive looping takes K such steps and lands
at "t = K", a state the later layers never saw; damped Euler takes K steps of size 1/K towards the
same "t = 1" endpoint as the base model::

    naive   x_{k+1} = g(x_k)
    damped  x_{k+1} = x_k + (g(x_k) − x_k) / K                 k = 0..K−1
    rk      out     = β·g(x_0) + (1 − β)·E_K(x_0)              E_K = damped-Euler endpoint

`apply_loop(model, cfg)` registers forward hooks on the model's own decoder layers, so the model
keeps building masks, position embeddings and caches its way and the loop re-calls each window
layer with exactly the arguments the model called it with. Weights, `generate`, `save_pretrained`
and the state dict are untouched; the settings go into `config.loop`.

KV cache during a cached forward (prefill with a cache, decode steps): the loop passes attend over
the cache's canonical past plus the current tokens' keys of the same pass and append nothing
(`_PeekCache`); one stash pass per window layer writes the current tokens' KV: the first pass,
from the pre-loop state (``stash="first"``, free) or an extra pass from the post-loop state
(``stash="last"``, one more window pass). The cache keeps the base model's size.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from recurrent_depth.looping.config import CONFIG_KEY, LoopConfig, check_loopable_dir
from recurrent_depth.looping.structure import (
    find_decoder_layers,
    hidden_of,
    output_hidden,
    with_hidden,
    with_output_hidden,
)

try:  # transformers is a dependency, but keep the import error readable
    from transformers import cache_utils
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:  # pragma: no cover
    raise ImportError("recurrent_depth.looping needs transformers >= 5") from exc

# DynamicLayer subclasses whose `keys` are not the plain full past (windowed, quantized or recurrent
# state); looked up by name since not every transformers 5.x release has all of them.
_NOT_FULL_DYNAMIC = tuple(
    getattr(cache_utils, name)
    for name in ("DynamicSlidingWindowLayer", "BaseQuantizedLayer", "LinearAttentionCacheLayerMixin")
    if hasattr(cache_utils, name)
)


def _is_full_dynamic(layer: Any) -> bool:
    """Whether a cache layer holds exactly the past keys/values, grown by concatenation (what `_PeekCache` mimics).

    Static layers preallocate the whole length, so their `keys` would pass a length check and then
    give attention a key length that does not match the mask.
    """
    return (isinstance(layer, DynamicLayer) and not isinstance(layer, _NOT_FULL_DYNAMIC)
            and not getattr(layer, "is_sliding", False))


@contextlib.contextmanager
def _not_recorded() -> Iterator[None]:
    """Keep the loop's own layer calls out of `output_hidden_states` / `output_attentions`.

    transformers 5 records those with forward hooks that read a context variable (its collector);
    unset it while the loop runs. Without that variable (another transformers version) the extra
    passes would be recorded, which changes only those optional outputs.
    """
    try:
        from transformers.utils import output_capturing
    except ImportError:  # pragma: no cover
        yield
        return
    collector = getattr(output_capturing, "_active_collector", None)
    if collector is None:  # pragma: no cover
        yield
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)


class _PeekCache:
    """A read-only view of a transformers cache: `update` returns past + current keys, stores nothing.

    `past` is the number of cached tokens before this forward (the current tokens' own stash-pass KV
    may already be in the cache and is left out). Only full-attention dynamic layers are supported;
    any other cache method a layer calls is refused, since running it could write state.
    """

    _READ_ONLY = frozenset({"get_seq_length", "get_mask_sizes", "get_query_offset", "is_compileable", "is_sliding"})

    def __init__(self, cache: Cache, past: int) -> None:
        self._cache = cache
        self._past = past

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._past == 0:
            return key_states, value_states
        layer = self._cache.layers[layer_idx]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not _is_full_dynamic(layer) or not isinstance(keys, torch.Tensor) or keys.shape[-2] < self._past:
            raise ValueError(
                f"looping at decode needs a full-attention dynamic KV cache; layer {layer_idx} holds a "
                f"{type(layer).__name__} (use the default DynamicCache, or loop with when='prefill')"
            )
        return (torch.cat([keys[..., : self._past, :], key_states], dim=-2),
                torch.cat([values[..., : self._past, :], value_states], dim=-2))

    def __getattr__(self, name: str) -> Any:
        if name in _PeekCache._READ_ONLY:
            return getattr(self._cache, name)
        raise ValueError(f"looping cannot run a layer that calls cache.{name} (only attention KV caches are supported)")


def _swap_cache(args: tuple, kwargs: dict[str, Any], make: Callable[[Cache], Any]) -> tuple[tuple, dict[str, Any]]:
    """The same call with every `Cache` argument replaced by `make(cache)` (GPT-2 passes it positionally)."""
    return (
        tuple(make(a) if isinstance(a, Cache) else a for a in args),
        {k: make(v) if isinstance(v, Cache) else v for k, v in kwargs.items()},
    )


def _find_cache(args: tuple, kwargs: dict[str, Any]) -> Cache | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Cache):
            return value
    return None


def combine(rule: str, iterations: int, beta: float, x0: torch.Tensor, g: Callable[[torch.Tensor], torch.Tensor],
            first: torch.Tensor | None = None) -> torch.Tensor:
    """K passes of the window `g` from `x0` under `rule` (see the module docstring).

    `first` is g(x0) when already computed (the model's own call of the window).
    """
    y = g(x0) if first is None else first
    if rule == "naive":
        x = y
        for _ in range(iterations - 1):
            x = g(x)
        return x
    step = 1.0 / iterations
    x = x0 + step * (y - x0)
    for _ in range(iterations - 1):
        x = x + step * (g(x) - x)
    if rule == "rk":
        return beta * y + (1.0 - beta) * x
    return x


class Looper:
    """The hooks that loop a model's window; `apply_loop` makes one, `remove()` restores the base model.

    skip_identity: K = 1 leaves the model untouched (exactly the base model); tests switch it off
        to send K = 1 through the loop path.
    """

    def __init__(self, model: nn.Module, cfg: LoopConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.skip_identity = True
        self.owner, self.layers = find_decoder_layers(model)
        cfg.check_depth(len(self.layers))
        indices = list(range(cfg.start, cfg.end + 1))
        self.groups: list[list[int]] = [indices] if cfg.mode == "block" else [[i] for i in indices]
        self._handles: list[Any] = []
        self._past: int | None = None  # cached tokens before the current forward; None: no cache
        self._active = False  # whether the current forward loops
        self._inside = False  # the loop's own layer calls bypass the hooks
        # the model's arguments to each window layer (hidden states, cache), held only while that window runs
        self._calls: dict[int, tuple[tuple, dict[str, Any]]] = {}
        # The hooks are partials of bound methods, not closures: `copy.deepcopy(model)` then copies them with
        # this Looper, so a copy's loop passes run the copy's layers (a closure kept running the original's).
        for group in self.groups:
            for i in group:
                self._handles.append(
                    self.layers[i].register_forward_pre_hook(functools.partial(self._before_layer, i), with_kwargs=True)
                )
            last = group[-1]
            # prepended: later hooks (transformers' output recording) see the combined state
            self._handles.append(self.layers[last].register_forward_hook(
                functools.partial(self._after_window, group), with_kwargs=True, prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.model, "_looper", None) is self:
            del self.model._looper
            if hasattr(self.model.config, CONFIG_KEY):
                delattr(self.model.config, CONFIG_KEY)

    # ---------------------------------------------------------------- hooks
    def _start_forward(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """At the window's first layer (the first hooked call of every forward): decide whether to loop.

        The past length is read from this layer's own cache entry, which this forward has not written yet.
        """
        cache = _find_cache(args, kwargs)
        self._past = None if cache is None else cache.get_seq_length(self.cfg.start)
        identity = self.skip_identity and self.cfg.iterations == 1
        self._active = not identity and (self.cfg.when == "always" or not self._past)
        self._calls.clear()

    def _writes_later(self) -> bool:
        """Whether the stash pass comes after the loop (so the model's own window call must not write)."""
        return self.cfg.stash == "last" and self._past is not None

    def _before_layer(self, index: int, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if self._inside:
            return None
        if index == self.cfg.start:
            self._start_forward(args, kwargs)
        if not self._active:
            return None
        where = f"decoder layer {index} ({type(module).__name__})"
        hidden_of(args, kwargs, where)
        self._calls[index] = (args, kwargs)
        if self._writes_later():
            return _swap_cache(args, kwargs, self._peek)
        return None

    def _peek(self, cache: Cache) -> _PeekCache:
        return _PeekCache(cache, self._past or 0)

    def _after_window(self, group: list[int], module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any):
        if self._inside or not self._active:
            return None
        where = f"decoder layer {group[-1]} ({type(module).__name__})"
        try:
            x0 = hidden_of(*self._calls[group[0]], where)
            first = output_hidden(output, where)
            self._inside = True
            with _not_recorded():
                out = combine(self.cfg.rule, self.cfg.iterations, self.cfg.beta, x0,
                              lambda x: self._window(group, x, write=False), first=first)
                if self._writes_later():
                    self._window(group, out, write=True)
        finally:
            self._inside = False
            # released as the window ends: kept until the next forward, they held the last forward's
            # activations and its KV cache alive (after `generate`, until the model ran again)
            for i in group:
                self._calls.pop(i, None)
        return with_output_hidden(output, out)

    def _window(self, group: list[int], x: torch.Tensor, *, write: bool) -> torch.Tensor:
        """One pass of the window's layers with the model's own arguments; the cache is written only if `write`."""
        for i in group:
            args, kwargs = self._calls[i]
            args, kwargs = with_hidden(args, kwargs, x)
            if not write:
                args, kwargs = _swap_cache(args, kwargs, self._peek)
            x = output_hidden(self.layers[i](*args, **kwargs), f"decoder layer {i}")
        return x


def apply_loop(model: nn.Module, cfg: LoopConfig | dict[str, Any]) -> Looper:
    """Loop `model`'s window in place (replacing any loop applied before) and record it in `model.config.loop`."""
    if isinstance(cfg, dict):
        cfg = LoopConfig.from_dict(cfg)
    if not isinstance(cfg, LoopConfig):
        raise ValueError(f"apply_loop needs a LoopConfig or a dict of its fields, got {type(cfg).__name__}")
    looper = Looper(model, cfg)  # (first: a window that does not fit leaves the loop applied before in place)
    previous = getattr(model, "_looper", None)
    if previous is not None:
        previous.remove()
    model._looper = looper
    setattr(model.config, CONFIG_KEY, cfg.to_dict())
    return looper


def remove_loop(model: nn.Module) -> None:
    """Return `model` to the base model (no-op if it is not looped)."""
    looper = getattr(model, "_looper", None)
    if looper is not None:
        looper.remove()


def loop_of(model: nn.Module) -> LoopConfig | None:
    """The loop applied to `model`, if any."""
    looper = getattr(model, "_looper", None)
    return None if looper is None else looper.cfg


def load_causal_lm(path: str | Any, **kwargs: Any) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, with a config.json transformers cannot build or whose
    shapes disagree with the weights (hidden_size not divisible by the heads, a vocab_size smaller than its
    pad_token_id, ...) as one ValueError naming `path`: transformers raises RuntimeError, AssertionError or
    huggingface_hub's validation errors there, each a traceback. A config.json describing tensors the weights
    lack (no num_hidden_layers: Llama's default 32 layers over 4 stored) is refused too: transformers only logs
    them and initialises them at random, and the loops were scored on that model."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM

    kwargs.pop("output_loading_info", None)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    except (RuntimeError, AssertionError, TypeError, StrictDataclassError) as exc:
        raise ValueError(f"cannot load {path} as a transformers causal LM: {' '.join(str(exc).split())}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"cannot load {path}: its weights lack {len(missing)} tensor(s) its config.json describes "
                         f"(e.g. {missing[0]}), which would be random; is config.json the one saved with them?")
    return model


def from_pretrained(path: str, loop: LoopConfig | dict[str, Any] | None = None, **kwargs: Any) -> nn.Module:
    """Load a transformers causal LM (`AutoModelForCausalLM`, no remote code) and re-apply the loop in its
    config.json (or `loop`, which overrides it). Other keyword arguments go to `from_pretrained`."""
    if kwargs.get("trust_remote_code"):
        raise ValueError("recurrent_depth.looping.from_pretrained does not run remote code")
    if isinstance(loop, dict):
        loop = LoopConfig.from_dict(loop)  # (refused before the model is built, as the stored one)
    check_loopable_dir(path)
    model = load_causal_lm(path, **kwargs)
    stored = getattr(model.config, CONFIG_KEY, None)
    chosen = loop if loop is not None else stored
    if chosen is not None:
        apply_loop(model, chosen)
    return model
