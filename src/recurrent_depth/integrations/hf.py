"""transformers 5 wrapper: `AutoModelForCausalLM` loads our checkpoints, official Huginn-0125 ones and Ouro's.

    import recurrent_depth  # registers the Auto classes (lazily, see integrations/autoregister.py)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)          # ours, Huginn-0125 or Ouro, no remote code
    out = model(input_ids, num_steps=8, init_scale=0.0)         # same logits as RecurrentDepthLM
    ids = model.generate(input_ids, max_new_tokens=16, num_steps=8, kv_budget=4)

`RecurrentDepthForCausalLM` holds the very modules of a `RecurrentDepthLM` (`transformer`,
`lm_head`) as its own children, so parameter names are the checkpoint's and the math is the
library's: the wrapper only translates transformers' calling conventions (`cache`, `use_cache`,
`return_dict`, ...). transformers 5 pitfalls handled here (see reference/ecosystem.md): the cache
keyword is `cache` (``past_key_values`` is accepted as an alias), `_tied_weights_keys` is a dict,
`GenerationMixin` is inherited explicitly, and `generate()` never builds a config-sized
`DynamicCache` (one cache layer per (layer, step) is created lazily by `RecurrentDepthCache`).

Options only `recurrent_depth.generate` implements (per-token exit, warm start, self-speculative
drafts) are routed there by :meth:`RecurrentDepthForCausalLM.generate`.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from recurrent_depth.inference.options import DEFAULTS, OptionError
from recurrent_depth.inference.schema import (
    OFFICIAL_ALIASES,
    OPTIONS,
    canonical,
    kwarg_spelling,
    names_for,
    resolved_auto,
)
from recurrent_depth.integrations.hf_config import (
    DEFAULT_DEPTH_SCHEME,
    HuginnRavenConfig,
    OuroConfig,
    RecurrentDepthConfig,
    check_depth_scheme,
)
from recurrent_depth.model.cache import attend_floats, no_decode_views, parse_kv_policy, update_heads_via_kv
from recurrent_depth.model.recurrent import RecurrentDepthLM, takase_init_
from recurrent_depth.weight_quant import check_saveable, check_weights, quantize_weights


# ---------------------------------------------------------------------------------------------- cache
class RecurrentDepthCache(DynamicCache):
    """A transformers `DynamicCache` that is also a recurrent-depth cache (see model/cache.py).

    Every (layer, step) pair gets its own transformers cache layer, created lazily, keys and values
    stored as transformers does, `[B, Hkv, T, D]`:

        prelude layer i -> i;   coda layer c -> P + c;   core layer j at step t -> P + C + slot(t) * R + j

    with slot(t) the slot rule of the cache's `KVPolicy` (`recurrent_depth.model.cache`): t
    (per-step) or t mod k (shared-K / `kv_budget=k`, the paper's zero-shot KV sharing: step t reads
    and writes slot t mod k, overwriting what an earlier step of the same call wrote there), and
    the official strategies' compressions (`compress-sN`, `compress-anchor`; `compress-rN` keeps one
    store for all core layers, j = 0).
    Recurrent states of non-attention mixers are kept per (layer, slot) in `states`, by the same rule.
    transformers' own loop runs every token at the same depth, so the lookup rule never applies
    here; per-token exit runs in `recurrent_depth.generate`, whose caches follow the same policies.
    Beam search (`reorder_cache`), `batch_select_indices` and `crop` (attention-only) work as in
    transformers; `get_seq_length()` is the number of committed tokens.
    """

    attends_from_codes = False  # keys and values stored as floats
    update_heads = update_heads_via_kv
    attend = attend_floats
    decode_views = no_decode_views

    def __init__(
        self, prelude_layers: int, core_layers: int, coda_layers: int, kv_budget: int | None = None,
        kv_policy: str | None = None,
    ) -> None:
        super().__init__()
        self.policy = parse_kv_policy(kv_policy, kv_budget, core_layers=core_layers)
        self.prelude_layers = prelude_layers
        self.core_layers = core_layers
        self.coda_layers = coda_layers
        self.kv_budget = self.policy.budget
        self.states: dict[tuple, Any] = {}
        self._seen = 0
        self.depth: int | None = None  # the fewest core steps a committed call ran (None: no core step cached)
        self._call_depth: int | None = None

    @classmethod
    def for_config(cls, config: Any, kv_budget: int | None = None, kv_policy: str | None = None) -> RecurrentDepthCache:
        mc = config.to_model_config() if hasattr(config, "to_model_config") else config
        return cls(mc.prelude_layers, mc.core_layers, mc.coda_layers, kv_budget, kv_policy)

    # ------------------------------------------------------------------ the model's cache protocol
    @property
    def seq_len(self) -> int:
        return self._seen

    def layer_index(self, key: tuple) -> int:
        part = key[0]
        if part == "prelude":
            return key[1]
        if part == "coda":
            return self.prelude_layers + key[1]
        if part == "core":
            base, slot = self.policy.split(key, 1 << 62)
            layer = base[1] if len(base) > 1 else 0  # compress-rN: one store for all core layers
            return self.prelude_layers + self.coda_layers + slot * self.core_layers + layer
        raise ValueError(f"unknown layer key {key!r}")

    def update_kv(self, key: tuple, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        """Store this call's k, v `[B, T, Hkv, D]` for layer `key`; return all positions' `[B, past + T, Hkv, D]`."""
        idx = self.layer_index(key)
        self._note_step(key)
        while len(self.layers) <= idx:
            self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[idx]
        new_k, new_v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, D]
        T = k.shape[1]
        held = layer.get_seq_length()
        if held and layer.keys.shape[0] != new_k.shape[0]:  # (not torch.cat's "Sizes of tensors must match")
            raise ValueError(f"the cache holds {layer.keys.shape[0]} rows but this call has {new_k.shape[0]}: a cache "
                             "continues the batch that filled it (a beam search's holds batch x num_beams rows, and "
                             "num_return_sequences' batch x that many)")
        if held == self._seen:
            layer.update(new_k, new_v)
        elif held == self._seen + T and self.policy.slots.shares_slots:
            # A shared slot that an earlier step of this call already wrote: overwrite those positions.
            layer.keys = torch.cat([layer.keys[:, :, : self._seen], new_k], dim=2)
            layer.values = torch.cat([layer.values[:, :, : self._seen], new_v], dim=2)
        else:
            raise RuntimeError(
                f"cache layer {key} holds {held} positions but {self._seen} are committed; this "
                "(layer, step) was skipped for some tokens. Per-token early exit needs the fallback "
                "policies of recurrent_depth.generate"
            )
        return layer.keys.transpose(1, 2), layer.values.transpose(1, 2)

    def key_mask(self, key: tuple) -> Tensor | None:
        return None  # every token runs every step in transformers' loop: nothing to leave out

    def get_state(self, key: tuple) -> Any:
        return self.states.get(self.policy.split(key, 1 << 62))

    def set_state(self, key: tuple, value: Any) -> None:
        self._note_step(key)
        # keyed by the policy's slot, as the library's caches key them: a core step under kv_budget=k reads the state
        # of slot step mod k (kv_budget on a recurrent-state core was ignored here, and recurrent_depth.generate's
        # tokens differed from transformers' loop)
        self.states[self.policy.split(key, 1 << 62)] = value

    def advance(self, num_tokens: int) -> None:
        self._seen += num_tokens
        if self._call_depth is not None:
            self.depth = self._call_depth if self.depth is None else min(self.depth, self._call_depth)
        self._call_depth = None

    def _note_step(self, key: tuple) -> None:
        if key[0] == "core" and len(key) > 2:
            self._call_depth = max(self._call_depth or 0, key[2] + 1)

    def check_depth(self, num_steps: int) -> None:
        """Refuse, before anything is written, a call deeper than the cached tokens ran: their entries (or recurrent
        states) of the extra steps do not exist (shared KV slots exist, as the paper's approximate sharing reads)."""
        self._call_depth = None  # (a new call: what a failed one noted is not committed)
        if (self._seen and self.depth is not None and num_steps > self.depth
                and (self.states or not self.policy.slots.shares_slots)):
            raise ValueError(f"the cache holds {self._seen} tokens computed with {self.depth} core steps; this call "
                             f"runs {num_steps}: continue a cache at the num_steps that filled it, or start a new one")

    def nbytes(self) -> int:
        total = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)
        return total + sum(t.nbytes for t in _tensors(self.states))

    # ------------------------------------------------------------------ transformers' protocol
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    @property
    def is_croppable(self) -> bool:
        return not self.states and super().is_croppable

    def crop(self, tokens_to_remove: int) -> None:
        if self.states:
            raise ValueError("crop: recurrent mixer states cannot be rolled back; use an attention-only model")
        if tokens_to_remove > 0:  # transformers' legacy form: the length to keep
            tokens_to_remove = tokens_to_remove - self._seen
        if tokens_to_remove == 0:
            return
        super().crop(tokens_to_remove)
        self._seen += tokens_to_remove

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.states = _map_tensors(self.states, lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.states = _map_tensors(self.states, lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.states = _map_tensors(self.states, lambda t: t[indices])


def _tensors(value: Any) -> list[Tensor]:
    """Every tensor in a nest of lists, tuples and dicts, in order (one walk: `_map_tensors`'s)."""
    found: list[Tensor] = []
    _map_tensors(value, found.append)
    return found


def _map_tensors(value: Any, fn: Any) -> Any:
    """`value` with `fn` applied to each tensor in its nest of lists, tuples and dicts."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, list | tuple):
        items = [_map_tensors(v, fn) for v in value]
        # a NamedTuple state (FalconState, TTTKVBState) takes its fields as arguments, not one iterable
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------- model
@dataclass
class RecurrentDepthCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the recurrent-depth extras.

    latent_states: ln_f(s_r) `[B, T, h]`; final_state: the raw s_r `[B, T, h]`;
    hidden_states (with ``output_hidden_states=True``): the raw states s_0..s_r, each `[B, T, h]`.
    attentions (with ``output_attentions=True``): one entry per application of a layer, in the order
    they run: the P prelude layers, then the R core layers of step 1, of step 2, ... of step r, then the
    C coda layers (P + R r + C entries; `attention_layer_keys` names them). A softmax-attention layer's
    (attention, mla, dsa, nsa) entry is its weights `[B, H, T, T_past + T]`; another mixer's (deltanet, ...) None.
    """

    latent_states: Tensor | None = None
    final_state: Tensor | None = None


# From the options schema (inference/schema.py), official aliases included: what only
# `recurrent_depth.generate` implements (routes the call there) and what transformers' own loop
# understands too (passed along when a call is routed).
ROUTED_GENERATE_OPTIONS = names_for("hf", "routed")
SHARED_GENERATE_OPTIONS = (*names_for("hf", "shared"), "attention_mask")
# transformers' generate arguments at the values that ask for nothing (one beam, one sequence per prompt, no
# attention weights): a call routed to `recurrent_depth.generate` accepts them; any other value is refused there.
# transformers' `GenerationConfig._get_default_generation_params()["top_k"]`: the top-k of a sampled call that sets none
_HF_DEFAULT_TOP_K = 50
# transformers generate arguments at the values that ask for nothing (a caller passing its defaults explicitly)
_NO_OP_GENERATE_VALUES: dict[str, Any] = {"output_attentions": False, "output_hidden_states": False, "num_beams": 1,
                                          "num_return_sequences": 1, "output_scores": False, "output_logits": False,
                                          "min_new_tokens": 0, "min_length": 0, "length_penalty": 1.0,
                                          "early_stopping": False, "no_repeat_ngram_size": 0, "num_beam_groups": 1}
# Every option transformers `generate` takes by our names or the official ones (attention_mask is
# transformers' own): picked out of the kwargs and a GenerationConfig, aliases resolved, together.
HF_OPTION_NAMES = frozenset((*names_for("hf"), *OFFICIAL_ALIASES))
_STANDARD_FIELDS = frozenset(GenerationConfig().__dict__)  # transformers' own (do_sample, top_k, ...)
# forward() keyword arguments transformers may send that carry no information for this model
# (generate(..., stop_strings=, tokenizer=) passes the tokenizer on to forward with the model kwargs).
_IGNORED_FORWARD_KWARGS = ("cache_position", "token_type_ids", "tokenizer")
# trl's padding-free collator adds the varlen kernels' example boundaries: the restarts of its position_ids, which
# forward() reads (`_packed_document_ids`), so they carry nothing more.
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class RecurrentDepthForCausalLM(PreTrainedModel, GenerationMixin):
    """transformers causal LM over the library's `RecurrentDepthLM` (same parameters, same math)."""

    config_class = RecurrentDepthConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # attention runs through F.scaled_dot_product_attention, as plain math for output_attentions, soft-capped layers
    # and an `eager_attention` config (retrofitted Gemma 2), which reports "eager" (`get_correct_attn_implementation`)
    _supports_sdpa = True
    _no_split_modules = ["SandwichBlock"]
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    _keys_to_ignore_on_load_unexpected = [r"^freqs_cis$"]  # the official file's RoPE buffer
    _head_instead: str | None = None  # a subclass's head in place of the lm_head (hf_seq_cls.py: "score.weight")

    def __init__(self, config: RecurrentDepthConfig | HuginnRavenConfig) -> None:
        super().__init__(config)
        core = RecurrentDepthLM(config.to_model_config())
        # Adopt the modules, not the RecurrentDepthLM object: parameter names stay the checkpoint's
        # (`transformer.*`, `lm_head.weight`) and moving/casting this model moves the core's too.
        self.transformer = core.transformer
        self.lm_head = core.lm_head
        object.__setattr__(self, "_core", core)  # not a submodule: its parameters are ours
        self._output_projections = {
            id(m) for name, m in self.named_modules() if name.endswith(("attn.proj", "mlp.proj"))
        }
        self.post_init()

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """transformers' choice (sdpa by default), except "eager" for an `eager_attention` config (retrofitted
        Gemma 2), whose layers attend as plain math whatever is asked: `config._attn_implementation` says what runs."""
        chosen = super().get_correct_attn_implementation(requested_attention, is_init_check)
        return "eager" if getattr(self.config, "eager_attention", False) else chosen

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' `from_pretrained`; without `dtype=` the weights keep their stored dtype.

        transformers 5 defaults to ``dtype="auto"``, which takes the config's `dtype` / `torch_dtype`
        first: Huginn-0125's config says bfloat16 over float32 files, so the Auto classes would load
        another model than `RecurrentDepthLM.from_pretrained` (which keeps the stored dtype).
        `weights="int8"` / `"int4"` / `"int4:g<group>"` quantizes the linear layers after loading
        (`recurrent_depth.weight_quant`; None: as stored).
        """
        weights = check_weights(kwargs.pop("weights", None))
        # the directory transformers reads: a local path joined with `subfolder=`, as transformers joins them
        local = (Path(pretrained_model_name_or_path) / (kwargs.get("subfolder") or "")
                 if _is_local_dir(pretrained_model_name_or_path) else None)
        if local is not None:
            # The library's bounded checks first (config, weight files and headers against the config),
            # so a hostile directory is one line here too, before transformers reads a tensor.
            from recurrent_depth.checkpoint import check_model_dir

            if check_model_dir(local, model_class=RecurrentDepthLM, head_instead=cls._head_instead).is_parcae:
                raise ValueError(f"{pretrained_model_name_or_path} is a Parcae directory, whose tensor names "
                                 f"transformers cannot map: load it with recurrent_depth.RecurrentDepthLM."
                                 f"from_pretrained (and save_pretrained it for transformers)")
        if kwargs.get("dtype") is None and kwargs.get("torch_dtype") is None:
            from recurrent_depth.checkpoint import stored_dtype

            dtype = stored_dtype(local) if local is not None else None
            if dtype is not None:
                kwargs["dtype"] = dtype
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        quantize_weights(model.core, weights)  # the wrapper shares the core's modules: both quantized
        if local is not None and model.can_generate():
            _stop_at_turn_end(model, local)
        return model

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' `save_pretrained`, refused for quantized weights (a directory nothing loads)."""
        check_saveable(self, save_directory)
        _keep_our_generation_options(getattr(self, "generation_config", None))
        from recurrent_depth.checkpoint import untied_head

        if not untied_head(self):
            out = super().save_pretrained(save_directory, *args, **kwargs)
        else:
            # a head no longer tied to the embedding (peft's merge_and_unload of modules_to_save=["lm_head"]): saved
            # untied, as it computes; a tied config beside two different tensors is a directory that does not load
            self.config.tie_word_embeddings = False
            try:
                out = super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                self.config.tie_word_embeddings = True
        _keep_remote_code(self.config, save_directory)
        return out

    @property
    def base_model(self) -> nn.Module:
        """The backbone as a callable module: `base_model(input_ids, ...)` returns `last_hidden_state`, what the
        lm_head reads (so `lm_head(last_hidden_state)` are the logits). trl's fused LM head (SFTTrainer,
        GRPOTrainer, RLOOTrainer) calls it; transformers' default, the `transformer` ModuleDict, is not callable."""
        return _Backbone(self)

    # ------------------------------------------------------------------ plumbing
    @property
    def core(self) -> RecurrentDepthLM:
        """The library model sharing these parameters (for `recurrent_depth.generate` and analysis)."""
        self._sync_runtime_config()
        return self._core

    def _sync_runtime_config(self) -> None:
        """Copy the fields users change after loading (depth, init scale, context) into the core's config."""
        core_cfg = self._core.config
        for name, hf_name in (("mean_recurrence", "mean_recurrence"), ("init_scale", "init_scale"),
                              ("mean_backprop_depth", "mean_backprop_depth"),
                              ("max_seq_len", "max_position_embeddings")):
            value = getattr(self.config, hf_name)
            if getattr(core_cfg, name) != value:
                setattr(core_cfg, name, value)
                try:
                    core_cfg.validate()
                except ValueError as exc:
                    raise ValueError(f"config.{hf_name}={value!r}: {exc}") from None
        self._core.gradient_checkpointing = self.is_gradient_checkpointing
        self._core.training = self.training
        head = self._modules.get("lm_head")
        if head is not None and self._core._modules.get("lm_head") is not head:
            # a head replaced by plain attribute assignment (peft's modules_to_save=["lm_head"] wrapper, and its
            # merge_and_unload putting the trained copy back): the core computes the logits, so it must use it too
            self._core.lm_head = head

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self, "_gradient_checkpointing", False))

    @property
    def is_activation_checkpointing(self) -> bool:  # transformers 5's name
        return self.is_gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Per-iteration activation checkpointing (the paper's), applied by the core's loop. transformers'
        `every_n_layers` / `offload` (the Trainer passes them) have no effect: every core step is checkpointed."""
        self._gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self._gradient_checkpointing = False

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        **kwargs: Any) -> None:  # transformers 5's name, what the Trainer calls
        self.gradient_checkpointing_enable(activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        self.gradient_checkpointing_disable()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value
        self._core.lm_head = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """transformers' resize; the core's config takes the new vocabulary size (its id checks use it)."""
        if self._core.config.value_embeddings:
            raise ValueError(f"resize_token_embeddings: this model has value embeddings (layers "
                             f"{self._core.config.value_embeddings}), vocabulary-sized tables it cannot resize")
        out = super().resize_token_embeddings(*args, **kwargs)
        if hasattr(self.config, "padded_vocab_size"):  # Huginn's config: the embedding's size is this key's
            self.config.padded_vocab_size = self.config.vocab_size
        self._core.config.vocab_size = self.config.vocab_size
        return out

    def _prepare_generation_config(self, generation_config: Any, **kwargs: Any) -> tuple[GenerationConfig, dict]:
        """transformers' merge, except that our options stay model kwargs: it carries custom entries of the model's
        generation config over, and an entry of the same name swallows the keyword (generate() merged them)."""
        config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        for name in HF_OPTION_NAMES - _STANDARD_FIELDS:
            if name in config.__dict__:
                delattr(config, name)
                if kwargs.get(name) is not None:
                    model_kwargs[name] = kwargs[name]
        if getattr(config, "dola_layers", None) is not None:
            import recurrent_depth.integrations.remote.modeling_recurrent_depth as remote  # (shared message)

            raise ValueError(remote.DOLA_IN_GENERATE)
        return config, model_kwargs

    def _prepare_generated_length(self, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' lengths, then the library's bound: a run past max_seq_len is refused before it starts (it
        failed at the first token past it, the tokens generated until then lost)."""
        config = super()._prepare_generated_length(generation_config, *args, **kwargs)
        limit, length = self._core.config.max_seq_len, kwargs.get("input_ids_length")
        # (the last token is sampled, never fed: max_seq_len + 1 tokens in all fit)
        if isinstance(length, int) and config.max_length is not None and config.max_length > limit + 1:
            raise ValueError(f"generate: prompt length {length} + {config.max_length - length} new tokens "
                             f"(max_new_tokens / max_length) run past the model's max_seq_len={limit}")
        return config

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() would build DynamicCache(config) with one layer per config layer; we need one
        # per (layer, step), so forward() creates a RecurrentDepthCache on its first cached call.
        return False

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                                      *args: Any, **kwargs: Any) -> Any:
        """Assisted decoding (`assistant_model=`, `prompt_lookup_num_tokens=`) needs the cache before the first
        forward, where the other modes let forward() create it: give it one (with the call's KV options)."""
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        # (chunked prefill, `prefill_chunk_size=`, too: it was "Cannot use prefill chunking without a cache")
        needs_cache = (getattr(generation_mode, "value", None) == "assisted_generation"
                       or generation_config.prefill_chunk_size is not None)
        if needs_cache and model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = RecurrentDepthCache.for_config(
                self._core.config, model_kwargs.get("kv_budget"), model_kwargs.get("kv_policy"))
        return out

    def _get_candidate_generator(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' candidate generator; an assistant of another architecture (`assistant_model=` a small Llama)
        gets none of this model's options, which it failed on as "model_kwargs are not used by the model"."""
        import recurrent_depth.integrations.remote.modeling_recurrent_depth as remote  # (shared helper, see forward)

        return remote.drop_unread_options(super()._get_candidate_generator(*args, **kwargs), _GENERATE_FORWARD_OPTIONS)

    def _get_logits_processor(self, generation_config: GenerationConfig, *args: Any, **kwargs: Any) -> Any:
        """transformers' processors, with the call's forward options bound to classifier-free guidance's own forwards
        (`guidance_scale`): it calls the model for the unconditional logits without the model kwargs, so they ran at
        config.mean_recurrence and the config's init_scale, not at the call's num_steps / init_scale."""
        import recurrent_depth.integrations.remote.modeling_recurrent_depth as remote  # (shared helper, see forward)

        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        remote.bind_forward_options(processors, kwargs.get("model_kwargs"), _GENERATE_FORWARD_OPTIONS)
        return processors

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The Takase init of `RecurrentDepthLM.reset_parameters`, one module at a time.

        transformers calls this only for modules whose weights were not loaded; its guards skip
        parameters that were.
        """
        mc = self._core.config
        std = math.sqrt(2 / (5 * mc.hidden_size))
        out_std = std / math.sqrt(2 * mc.effective_expected_depth)
        takase_init_(module, std, out_std if id(module) in self._output_projections else std)
        for name in ("qk_bias", "q_bias", "k_bias"):
            param = module._parameters.get(name)
            if param is not None:
                nn.init.zeros_(param)

    def train(self, mode: bool = True) -> RecurrentDepthForCausalLM:
        super().train(mode)
        self._core.training = mode
        return self

    def _training_depth(self, generator: torch.Generator | None) -> tuple[int, int]:
        """(no-grad steps, grad steps) of a training-mode forward given no num_steps: `config.depth_scheme`'s draw
        around `mean_recurrence` (fixed: exactly it), gradients through the last `mean_backprop_depth` steps."""
        scheme = check_depth_scheme(getattr(self.config, "depth_scheme", DEFAULT_DEPTH_SCHEME))
        return replace(self._core.depth_sampler(), scheme=scheme).sample_from(generator)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        num_steps: int | tuple[int, int] | None = None,
        init_scale: float | None = None,
        input_states: Tensor | None = None,
        kv_budget: int | None = None,
        kv_policy: str | None = None,
        generator: torch.Generator | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        inputs_embeds: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> RecurrentDepthCausalLMOutput | tuple:
        """`RecurrentDepthLM.forward` with transformers' conventions.

        num_steps / init_scale / input_states / generator: as `RecurrentDepthLM.forward` (None ->
        `config.mean_recurrence` in eval mode, in train mode a depth drawn by `config.depth_scheme`: the paper's
        poisson-lognormal by default, "fixed" for exactly mean_recurrence; `config.init_scale`).
        cache: a `RecurrentDepthCache` (an empty transformers cache is replaced by one); with
        `use_cache=True` and no cache, one is created with `kv_policy` / `kv_budget` (None = one
        entry per step; see `recurrent_depth.model.cache.parse_kv_policy`).
        labels: `[B, T]` unshifted, -100 ignored (shifted inside, as transformers does).
        logits_to_keep (as transformers' models take it): the last n positions' logits only (0: all), or those of a
        1-D tensor of positions; without labels the vocabulary head runs at those positions only (the library's
        `logits_at`), so transformers' `generate`, which passes 1 to a forward that names it, makes no [B, T, V]
        logits for a long prompt.
        output_attentions (None: `config.output_attentions`): the attention weights of every layer application
        (see `RecurrentDepthCausalLMOutput.attentions`), computed as plain math instead of SDPA.
        """
        cache = _cache_alias(cache, kwargs)
        unknown = sorted(k for k in kwargs if k not in _IGNORED_FORWARD_KWARGS + _PACKING_KWARGS)
        if position_ids is None and any(kwargs.get(k) is not None for k in _PACKING_KWARGS):
            raise ValueError(f"{[k for k in _PACKING_KWARGS if kwargs.get(k) is not None]} mark packed examples: "
                             "pass their position_ids (restarting at 0 at each example), which keep them apart")
        if unknown:
            raise ValueError(
                f"unexpected forward() arguments {unknown}; recurrent-depth options are num_steps, "
                "init_scale, input_states, kv_budget, kv_policy, generator (exit / warm start / draft options "
                "belong to generate())"
            )
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported: pass input_ids (the prelude scales the embedding; "
                             "peft's prompt tuning and p-tuning, which pass it, do not work with this model: "
                             "use LoRA)")
        if input_ids is None:
            raise ValueError("input_ids is required")
        policy = parse_kv_policy(kv_policy, kv_budget, core_layers=self._core.config.core_layers)
        self._sync_runtime_config()
        if num_steps is None and self.training:  # (trainers pass none: the config's depth_scheme draws it)
            num_steps = self._training_depth(generator)
        if use_cache is None:  # as transformers' models do: no cache while training with checkpointing (it would
            # turn the checkpointing off: the core checkpoints only uncached calls)
            use_cache = self.config.use_cache and not (self.training and self.is_gradient_checkpointing)
        document_ids = _packed_document_ids(input_ids, attention_mask, position_ids, cache)
        if document_ids is not None:  # packed rows (trl's padding_free / packing): one sequence per row in a cache
            use_cache = False
        return_dict = self.config.return_dict if return_dict is None else return_dict
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions

        if cache is not None and not isinstance(cache, RecurrentDepthCache):
            if not isinstance(cache, Cache) or cache.get_seq_length() != 0:
                raise ValueError(
                    f"cache must be a RecurrentDepthCache (or an empty transformers Cache), got "
                    f"{type(cache).__name__} holding {getattr(cache, 'get_seq_length', lambda: '?')()} tokens (peft's "
                    f"prefix tuning passes its prefixes so, which this model does not support: use LoRA)"
                )
            cache = None
            use_cache = document_ids is None  # (packed rows take no cache, as above)
        if cache is None and use_cache:
            cache = RecurrentDepthCache.for_config(self._core.config, kv_budget, kv_policy)
        if cache is not None and kv_budget is not None and cache.kv_budget != kv_budget:
            raise ValueError(f"kv_budget={kv_budget} differs from the cache's kv_budget={cache.kv_budget}")
        if cache is not None and kv_policy is not None and cache.policy != policy:
            raise ValueError(f"kv_policy={kv_policy!r} differs from the cache's policy {cache.policy.name!r}")
        if cache is not None and (num_steps is not None or not self.training):  # (None in training: a drawn depth)
            cache.check_depth(sum(self._core.resolve_num_steps(num_steps)))

        # (the exported remote-code file's helpers: that file cannot import the library, so this shares them; imported
        # here, as importing that module imports transformers, whose registration hook imports this one)
        import recurrent_depth.integrations.remote.modeling_recurrent_depth as remote

        kept = remote.kept_positions(logits_to_keep, input_ids.shape[1])
        logits_at = None
        if kept is not None and labels is None:  # (a loss reads every position's logits)
            logits_at = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            logits_at[:, kept[0].to(input_ids.device)] = True
        out = self._core(
            input_ids, num_steps, labels=None, attention_mask=attention_mask, position_ids=position_ids,
            document_ids=document_ids, input_states=input_states, init_scale=init_scale, generator=generator,
            cache=cache, output_all_states=bool(output_hidden_states), output_attentions=bool(output_attentions),
            logits_at=logits_at,
        )
        loss = None
        if labels is not None:
            self._core.check_inputs(input_ids, labels, None, None, None)
            reduction = "mean" if num_items_in_batch is None else "sum"
            loss = F.cross_entropy(
                out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), labels[:, 1:].reshape(-1).long(),
                ignore_index=-100, reduction=reduction,
            )
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
        hidden = tuple(out.all_states.unbind(0)) if out.all_states is not None else None
        attentions = None
        if out.attentions is not None:
            keys = attention_layer_keys(self._core.config, sum(out.num_steps))
            attentions = tuple(out.attentions.get(key) for key in keys)
        if logits_at is not None:  # [B * kept columns, V] in (row, position) order -> [B, kept, V]
            logits = out.logits.view(input_ids.shape[0], len(kept[0]), out.logits.shape[-1])
            logits = logits[:, kept[1].to(logits.device)]
        else:
            logits = remote.kept_logits(out.logits, logits_to_keep)
        result = RecurrentDepthCausalLMOutput(
            loss=loss, logits=logits, cache=cache if use_cache else None,
            hidden_states=hidden, attentions=attentions, latent_states=out.latent_states, final_state=out.final_state,
        )
        return result if return_dict else result.to_tuple()

    # ------------------------------------------------------------------ generate
    def generate(self, inputs: Tensor | None = None, generation_config: Any = None, **kwargs: Any) -> Any:
        """transformers' `generate`, plus `recurrent_depth.generate` for what it alone implements.

        `num_steps`, `init_scale`, `kv_budget` and `kv_policy` (official: `cache_lookup_strategy`)
        work in transformers' own loop (greedy, sampling, beam search, stopping criteria...). Any
        option the schema marks ``hf="routed"`` (`ROUTED_GENERATE_OPTIONS`: ``exit_criterion``,
        ``exit_threshold``, ``warm_start``, ``draft_steps``, ..., and the official ``criterion``,
        ``continuous_compute``, ``lookahead_for_draft``) routes the call to
        `recurrent_depth.generate`, which also honours ``eos_token_id`` (an id or a list) and
        ``pad_token_id`` (what fills the rows that stopped early, as in transformers; without an
        ``attention_mask``, a row's leading pad ids are padding, as transformers infers its mask) and
        samples with transformers' ``top_k=50`` when nothing sets it (``top_k=0``: no filter); it
        returns the sequences, or with ``return_dict_in_generate=True`` the library's output
        (`sequences`, `steps`, ...); a ``streamer`` (`TextStreamer`, ...) is fed as transformers' loop
        feeds it. ``defaults="official"`` follows the official model's dispatch:
        a routed call takes the official code's defaults (see `GenerationOptions`); any other call
        runs in transformers' own loop, as the official `generate` hands it to transformers.

        A `GenerationConfig` (positional, as the Huginn-0125 model card passes it, or
        ``generation_config=``) works as in transformers: its fields are the base, keyword
        arguments win; our options (and the official aliases) may be set on it too. The official
        ``cache_kwargs={"lookup_strategy": ...}`` is ``cache_lookup_strategy``.
        """
        if kwargs.get("input_states") is not None:  # (transformers' loop used them for the prompt, then failed)
            import recurrent_depth.integrations.remote.modeling_recurrent_depth as remote

            raise ValueError(remote.INPUT_STATES_IN_GENERATE)
        defaults = kwargs.pop("defaults", None)
        if defaults is not None and defaults not in DEFAULTS:
            raise ValueError(f"generate: defaults={defaults!r} is invalid: expected None or one of {DEFAULTS}")
        _cache_kwargs_alias(kwargs)
        # transformers' rule: eos_token_id=None in the call means no eos (its loop then runs to the length); a routed
        # call read None as "not given" and stopped at the model's eos
        no_eos = "eos_token_id" in kwargs and kwargs["eos_token_id"] is None
        config_options, config_fields = _split_generation_config(generation_config)
        # the model's own generation config (generation_config.json): our options set on it are defaults too
        own, _ = _split_generation_config(getattr(self, "generation_config", None))
        picked = {k: kwargs.pop(k) for k in list(kwargs) if k in HF_OPTION_NAMES}
        try:
            own, own_as = canonical({k: v for k, v in own.items() if k not in _STANDARD_FIELDS})
            base, base_as = canonical(config_options)
            # (exit_threshold="auto" is the threshold of the criterion in force: resolved after the merge)
            given, given_as = canonical(picked, resolve_auto=False)
            base, base_as = own | base, own_as | base_as
            # transformers' rule: a keyword argument replaces the generation config's value
            given = {k: v for k, v in given.items() if v is not None}
            values = resolved_auto({k: v for k, v in (base | given).items() if v is not None})
        except OptionError as exc:
            raise ValueError(f"generate: {exc}") from None
        given_as = {k: name for k, name in base_as.items() if k not in given} | given_as
        # a KV policy asked for by this call (or its GenerationConfig) with no cache to keep it: transformers' loop
        # decoded exactly, ignoring it, while a routed call (the library always caches) applied it
        asked = {**config_options, **picked}
        kv_asked = sorted(k for k in ("kv_budget", "kv_policy", "cache_lookup_strategy") if asked.get(k) is not None)
        if kv_asked and kwargs.get("use_cache", config_fields.get("use_cache")) is False:
            raise ValueError(f"generate: use_cache=False decodes without a KV cache, so {', '.join(kv_asked)} (how "
                             "the cache is kept) would do nothing: drop one of them")
        routed = {k: v for k, v in values.items() if OPTIONS[k].hf == "routed"}
        if set(routed) == {"output_logits"}:  # transformers' own flag too: its loop gives the tuple it documents
            routed = {}
        if not routed:
            # our options travel as kwargs (num_steps, kv_policy, ...); transformers' own fields stay on the config
            kwargs.update((k, v) for k, v in values.items() if k in given or k not in _STANDARD_FIELDS)
            if generation_config is not None:
                generation_config = _without_options(generation_config)
            _check_continued_cache(inputs if inputs is not None else kwargs.get("input_ids"),
                                   kwargs.get("cache", kwargs.get("past_key_values")))
            # as recurrent_depth.generate does: decode in eval mode. In training mode (a trainer generating
            # rollouts, trl's GRPO) every forward would draw its own depth, and a token's cache entries would
            # stop short of the next token's depth (RuntimeError, or mixed steps in shared slots).
            was_training = self.training
            self.eval()
            try:
                return super().generate(inputs, generation_config=generation_config, **kwargs)
            finally:
                self.train(was_training)
        # the lengths given in the call itself (the official loops read only these and the config's max_length)
        call_lengths = {"max_new_tokens": given.get("max_new_tokens"), "max_length": kwargs.get("max_length")}
        kwargs.update((k, v) for k, v in values.items() if k not in routed)
        for name, value in config_fields.items():  # max_length, stop_strings, eos_token_id, ...
            kwargs.setdefault(name, value)
        if defaults != "official" or generation_config is None:
            # the model's own generation config (generation_config.json) under both, as transformers' loop takes it
            # (the official loops read it when no config is passed): what the library runs of it was ignored here
            model_own = getattr(self, "generation_config", None)
            model_own = {**model_own.to_diff_dict()} if isinstance(model_own, GenerationConfig) else {}
            for name in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id",
                         "pad_token_id", "stop_strings"):
                if model_own.get(name) is not None and kwargs.get(name) is None:
                    kwargs[name] = model_own[name]
        if no_eos:
            kwargs["eos_token_id"] = []
        if defaults is not None:
            routed["defaults"] = defaults
        return self._generate_with_library(inputs, routed, kwargs, given_as, call_lengths)

    def _generate_with_library(
        self, inputs: Tensor | None, routed: dict[str, Any], kwargs: dict[str, Any], given_as: dict[str, str],
        call_lengths: dict[str, Any] | None = None,
    ) -> Any:
        """`recurrent_depth.generate` with transformers' arguments translated (the generation
        config's fields are in `kwargs` by now)."""
        from recurrent_depth.inference import generate as rd_generate

        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("generate: input_ids are required")
        return_dict = bool(kwargs.pop("return_dict_in_generate", False))
        options: dict[str, Any] = dict(routed)
        for name in SHARED_GENERATE_OPTIONS:
            value = kwargs.pop(name, None)
            if value is not None:
                options[name] = value
        max_length = kwargs.pop("max_length", None)
        gc = self.generation_config
        if routed.get("defaults") == "official":
            # The official loops' rule (_prep_generate_args): max_new_tokens only from the call's kwargs, capped
            # by a max_length also given there; else max_length (the call's, else the generation config's, else
            # transformers' 20) minus the prompt; no token when that is <= 0, except the speculative loop's
            # prefill token.
            call = call_lengths or {}
            if call.get("max_new_tokens") is not None:
                new = call["max_new_tokens"]
                if call.get("max_length") is not None:
                    new = min(new, call["max_length"] - input_ids.shape[-1])
            else:
                new = (max_length or gc.max_length or 20) - input_ids.shape[-1]
            speculative = "draft_steps" in routed and not {"exit_criterion", "exit_threshold"} & set(routed)
            options["max_new_tokens"] = max(new, 1 if speculative else 0)
        elif "max_new_tokens" not in options:  # transformers' rule: max_length counts the prompt
            if max_length is None and gc.max_new_tokens is not None:
                options["max_new_tokens"] = gc.max_new_tokens
            elif max_length is None and gc.max_length is None:
                options["max_new_tokens"] = 20  # transformers' model-agnostic default: 20 new tokens
            else:
                options["max_new_tokens"] = (max_length or gc.max_length) - input_ids.shape[-1]
        options.setdefault("num_steps", None)  # None: the config's mean_recurrence, as in forward()
        if routed.get("defaults") != "official":
            # transformers' loop samples with top_k=50 when neither the call nor a generation config sets it, and
            # top_k=0 turns the filter off (the library's None), in a greedy call too (it was refused there); the
            # official profile applies its own rule
            top_k = options.setdefault("top_k", _HF_DEFAULT_TOP_K) if options.get("do_sample") else options.get("top_k")
            if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 0:
                del options["top_k"]
        stop_strings = kwargs.pop("stop_strings", None)
        tokenizer = kwargs.pop("tokenizer", None)
        if stop_strings:
            given = options.get("stop")
            given = [given] if isinstance(given, str | int) else list(given or [])
            options["stop"] = given + ([stop_strings] if isinstance(stop_strings, str) else list(stop_strings))
        eos = kwargs.pop("eos_token_id", None)
        if eos is not None:  # transformers' rule: the call's eos replaces the generation config's
            options["eos_token_id"] = list(eos) if isinstance(eos, list | tuple) else eos
        pad = _pad_id(kwargs.pop("pad_token_id", None))  # (the library pads with the model config's; set after)
        if routed.get("defaults") != "official" and options.get("attention_mask") is None:
            # transformers' rule without an attention_mask: a prompt's leading pad ids are padding, not tokens
            mask = _mask_from_padding(input_ids, gc.pad_token_id if pad is None else pad,
                                      options.get("eos_token_id", gc.eos_token_id))
            if mask is not None:
                options["attention_mask"] = mask
        for name in ("bos_token_id", "use_cache"):
            kwargs.pop(name, None)
        streamer = kwargs.pop("streamer", None)
        for name in _NO_OP_GENERATE_VALUES:  # asking for nothing is no conflict
            if name in kwargs and _asks_for_nothing(name, kwargs[name]):
                del kwargs[name]
        if kwargs:
            raise ValueError(
                f"generate: {sorted(kwargs)} cannot be combined with {sorted(routed)}; those run in "
                f"recurrent_depth.generate, which also takes {list(SHARED_GENERATE_OPTIONS)}, max_length, "
                "stop_strings (with tokenizer=), streamer and return_dict_in_generate"
            )
        feed = None if streamer is None else _StreamerFeed(streamer, input_ids, pad)
        try:
            out = rd_generate(self.core, input_ids, tokenizer=tokenizer, streamer=feed, **options)
        except OptionError as exc:
            raise exc.spelled(kwarg_spelling(given_as)) from None
        if pad is not None and pad != out.pad_token_id:
            out = _repadded(out, pad)
        if feed is not None:
            feed.end(out.pad_token_id)
        return out if return_dict else out.sequences


class _StreamerFeed:
    """A transformers streamer (`TextStreamer`, `TextIteratorStreamer`, any `put`/`end` object) fed by a routed call
    as transformers' loop feeds it: `put` the prompt ids, then one `[B]` tensor of new tokens per step, then `end()`.
    The library commits tokens row by row (a speculative row several at once), so step i is put once every row has
    its token i or has finished before i; a finished row's place holds the pad id, as in transformers' loop (the
    call's `pad_token_id`, else the library's, known at the end). The prompt goes at the first token (or the end):
    transformers checks its options before it puts anything, and a call the library refuses (an OptionError) put the
    prompt with no `end()` after it, a `TextIteratorStreamer`'s reader waiting for good. (Routed calls refused
    `streamer=` before this feed.)"""

    def __init__(self, streamer: Any, input_ids: Tensor, pad: int | None) -> None:
        self.streamer = streamer
        self.rows = 1 if input_ids.dim() == 1 else input_ids.shape[0]
        self.pad = pad
        self.tokens: dict[int, dict[int, int]] = {}  # step -> row -> token
        self.lengths: dict[int, int] = {}  # row -> its number of new tokens, once finished
        self.step = 0
        self.prompt: Tensor | None = input_ids.cpu()  # (None once put)

    def _put_prompt(self) -> None:
        if self.prompt is not None:
            prompt, self.prompt = self.prompt, None
            self.streamer.put(prompt)

    def __call__(self, event: Any) -> None:
        self._put_prompt()
        self.tokens.setdefault(event.index, {})[event.row] = event.token
        if event.finished:
            self.lengths[event.row] = event.index + 1
        self._flush()

    def _flush(self) -> None:
        while self.step in self.tokens:
            have = self.tokens[self.step]
            waiting = [r for r in range(self.rows) if r not in have and self.lengths.get(r, math.inf) > self.step]
            if waiting or (len(have) < self.rows and self.pad is None):
                return
            self.streamer.put(torch.tensor([have.get(r, self.pad) for r in range(self.rows)]))
            del self.tokens[self.step]
            self.step += 1

    def end(self, pad: int) -> None:
        self._put_prompt()  # (no token generated: the prompt, then the end, as transformers' loop)
        self.pad = pad if self.pad is None else self.pad
        self._flush()
        self.streamer.end()


class _Backbone(nn.Module):
    """`RecurrentDepthForCausalLM.base_model`: the model's forward without the lm_head (prelude, core steps, coda,
    ln_f). It takes the model's forward arguments (`num_steps`, `attention_mask`, `position_ids`, ...) and holds
    the model's `transformer` modules as its children."""

    def __init__(self, owner: RecurrentDepthForCausalLM, forward: Any = None) -> None:
        super().__init__()
        self.transformer = owner.transformer
        object.__setattr__(self, "_owner", owner)  # not a submodule: the backbone is part of the owner
        # the causal LM's forward (a subclass with another head, hf_seq_cls.py, passes it bound to itself): the class's,
        # not the instance's `forward`, which wrappers replace (trl's fused head, accelerate's autocast): called from
        # inside the wrapped call, the wrapper ran again nested, and the same torch.autocast object entered twice
        # left autocast on for the rest of the process
        object.__setattr__(self, "_forward", type(owner).forward.__get__(owner) if forward is None else forward)

    def forward(self, *args: Any, **kwargs: Any) -> BaseModelOutputWithPast:
        if kwargs.get("labels") is not None:
            raise ValueError("base_model() returns hidden states, it takes no labels: call the model for a loss")
        kwargs["return_dict"] = True
        core = self._owner._core
        # the core's predict() ends in head(x); read the lm_head's input instead (an instance attribute shadows
        # the method for this call only)
        core.head = lambda x: core.transformer.ln_f(x) if core.config.final_norm else x
        try:
            out = self._forward(*args, **kwargs)
        finally:
            del core.head
        return BaseModelOutputWithPast(last_hidden_state=out.logits, cache=out.cache, hidden_states=out.hidden_states,
                                       attentions=out.attentions)


class RavenForCausalLM(RecurrentDepthForCausalLM):
    """The official Huginn-0125 architecture name, loaded through our implementation (no remote code)."""

    config_class = HuginnRavenConfig


def attention_layer_keys(config: Any, num_steps: int) -> list[tuple]:
    """The layer keys of a forward at `num_steps` in the order `output_attentions` lists them: ("prelude", i),
    then ("core", j, step) step by step, then ("coda", c)."""
    return [*(("prelude", i) for i in range(config.prelude_layers)),
            *(("core", j, step) for step in range(num_steps) for j in range(config.core_layers)),
            *(("coda", c) for c in range(config.coda_layers))]


def _is_local_dir(path: Any) -> bool:
    try:
        return os.path.isdir(path)
    except (TypeError, ValueError):
        return False


def _asks_for_nothing(name: str, value: Any) -> bool:
    """Whether transformers' generate argument `name` (`_NO_OP_GENERATE_VALUES`) at `value` changes nothing: None, a
    false flag, or the number that asks for nothing (num_beams 1, min_new_tokens 0, length_penalty 1.0, ...)."""
    nothing = _NO_OP_GENERATE_VALUES[name]
    if value is None or (isinstance(nothing, bool) and not value):
        return True
    return not isinstance(nothing, bool) and isinstance(value, int | float) and not isinstance(value, bool) and (
        value == nothing)


def _pad_id(value: Any) -> int | None:
    """transformers' `pad_token_id` (an int, or a one-element tensor as its loop keeps it) as an int."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"generate: pad_token_id={value!r} is invalid: expected one token id (an int)")


def _mask_from_padding(input_ids: Any, pad: Any, eos: Any) -> Tensor | None:
    """transformers' attention mask for a call that passes none (`_prepare_attention_mask_for_generation`): where the
    prompt holds the pad id, and it is no eos id, those positions are padding. The library takes left padding, so
    only each row's leading pad ids are masked; None when no row starts with one (a routed call treated a
    left-padded batch's pads as tokens: its rows differed from transformers' loop and from the rows alone)."""
    if isinstance(pad, Tensor) and pad.numel() == 1:
        pad = pad.item()
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or isinstance(pad, bool) or not isinstance(pad, int):
        return None
    eos = eos.tolist() if isinstance(eos, Tensor) else eos
    if pad in (eos if isinstance(eos, list | tuple) else [eos]):
        return None  # (transformers' rule: a pad id that is also an eos id says nothing about padding)
    leading = (input_ids == pad).long().cumprod(-1).bool()
    return (~leading).long() if bool(leading.any()) else None


def _repadded(out: Any, pad: int) -> Any:
    """The library's output with the positions after each row's last token filled with `pad` (transformers' rule:
    rows that stopped early are padded with the call's, else the generation config's, pad_token_id)."""
    new = out.sequences.shape[1] - out.prompt_length
    done = torch.arange(new) >= out.lengths[:, None]  # [B, new]: past the row's last token
    sequences = out.sequences.clone()
    sequences[:, out.prompt_length:] = sequences[:, out.prompt_length:].masked_fill(done, pad)
    predictions = None if out.predictions is None else out.predictions.masked_fill(done, pad)
    return replace(out, sequences=sequences, predictions=predictions, pad_token_id=pad)


def _split_generation_config(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A `GenerationConfig`'s fields set away from their defaults: (our options and official aliases,
    transformers' own fields). transformers keeps unknown `GenerationConfig(...)` kwargs as attributes."""
    if config is None:
        return {}, {}
    if not isinstance(config, GenerationConfig):
        raise ValueError(f"generate: generation_config must be a transformers GenerationConfig, got "
                         f"{type(config).__name__}")
    values = config.to_diff_dict()
    values.pop("transformers_version", None)
    ours = {k: v for k, v in values.items() if k in HF_OPTION_NAMES}
    return ours, {k: v for k, v in values.items() if k not in ours}


# forward() options that generate passes as model kwargs, what any other forward of the same call must run with:
# the schema's options that forward() takes (num_steps, init_scale, kv_budget, kv_policy), and the call's generator
_GENERATE_FORWARD_OPTIONS = (*(name for name in inspect.signature(RecurrentDepthForCausalLM.forward).parameters
                               if name in HF_OPTION_NAMES), "generator")


def _check_continued_cache(input_ids: Any, cache: Any) -> None:
    """A cache passed to generate() holds the conversation so far: the prompt must hold it and at least one token
    more. transformers feeds the tokens past the cache, and all of them again when none are past it (silently wrong
    logits); a shorter prompt left an empty input."""
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and isinstance(cache, Cache):
        held = cache.get_seq_length()
        if held and held >= input_ids.shape[1]:
            raise ValueError(f"generate: the cache holds {held} tokens but input_ids has {input_ids.shape[1]}: pass "
                             "the whole conversation (the cached tokens and at least one new one) as input_ids")


def _keep_remote_code(config: Any, save_directory: Any) -> None:
    """A model loaded from an `rdepth export --remote-code` directory keeps that directory's `auto_map` in its config,
    and transformers writes it back, but not the file it names (our class is the library's, not that file's): the
    copy then failed to load with `trust_remote_code=True` without the library (OSError: no file named
    modeling_recurrent_depth.py). Write the file beside the map, as the export does."""
    from recurrent_depth.files import atomic_write_text
    from recurrent_depth.integrations.export import REMOTE_CODE_FILE, remote_code_source

    auto_map = getattr(config, "auto_map", None) or {}
    module = REMOTE_CODE_FILE.removesuffix(".py")
    if os.path.isdir(save_directory) and any(str(v).startswith(f"{module}.") for v in auto_map.values()):
        atomic_write_text(Path(save_directory) / REMOTE_CODE_FILE, remote_code_source())


def _keep_our_generation_options(config: GenerationConfig | None) -> None:
    """transformers loads a generation_config.json marked `_from_model_config` without its custom entries, so our
    options set on a model's derived `generation_config` (num_steps, ...) were lost on reload: unmark it."""
    if (config is not None and getattr(config, "_from_model_config", False)
            and any(name in config.__dict__ for name in HF_OPTION_NAMES - _STANDARD_FIELDS)):
        config._from_model_config = False


def _without_options(config: GenerationConfig) -> GenerationConfig:
    """A copy of `config` without our options (they are passed as kwargs instead)."""
    import copy

    out = copy.deepcopy(config)
    for name in HF_OPTION_NAMES - _STANDARD_FIELDS:
        if name in out.__dict__:
            delattr(out, name)
    return out


def _cache_kwargs_alias(kwargs: dict[str, Any]) -> None:
    """The official model card's ``cache_kwargs={"lookup_strategy": ...}``: ``cache_lookup_strategy``."""
    extra = kwargs.pop("cache_kwargs", None)
    if extra is None:
        return
    if not isinstance(extra, dict) or set(extra) - {"lookup_strategy"}:
        raise ValueError(f"generate: cache_kwargs={extra!r} is invalid: expected {{'lookup_strategy': NAME}} "
                         "(the official cache_lookup_strategy)")
    if "lookup_strategy" in extra:
        if kwargs.get("cache_lookup_strategy") not in (None, extra["lookup_strategy"]):
            raise ValueError("generate: cache_kwargs['lookup_strategy'] and cache_lookup_strategy set the same "
                             "option (kv_policy); give one of them")
        kwargs["cache_lookup_strategy"] = extra["lookup_strategy"]


# transformers' hub arguments (the Auto classes pass them on), and arguments that change nothing here: remote
# code is never run (our class is registered for the model type), attention runs as the config says (SDPA, or plain
# math for eager_attention / soft-capped layers).
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
_NO_EFFECT_KWARGS = ("trust_remote_code", "code_revision", "_from_auto", "_from_pipeline", "attn_implementation",
                     "low_cpu_mem_usage", "use_safetensors")
# loading options this class has no use for, accepted when they ask for nothing
_UNSET_ONLY_KWARGS = ("gguf_file", "max_memory", "quantization_config", "offload_folder", "offload_state_dict")


class OuroForCausalLM(RecurrentDepthForCausalLM):
    """An Ouro directory (model type ``ouro``) through the Auto classes, without remote code.

    `from_pretrained` reads the directory with the library's loader (`RecurrentDepthLM.from_pretrained`: the
    bounded, header-checked read; Ouro's tensors renamed and q/k/v, gate/up fused, `families/ouro.py`) and
    returns a `RecurrentDepthForCausalLM` whose config is our `RecurrentDepthConfig`: `save_pretrained`
    writes our format. Arguments: `dtype` / `torch_dtype` (default and ``"auto"``: the stored dtype),
    `device_map` (a device; ``"auto"``: the first GPU, else the CPU), `weights` ("int8", "int4",
    "int4:g<group>"), `config` (an `OuroConfig`, e.g. with `total_ut_steps` changed), transformers' hub
    arguments for a Hub id.
    """

    config_class = OuroConfig

    def __init__(self, config: OuroConfig | RecurrentDepthConfig) -> None:
        if isinstance(config, OuroConfig):  # built from a config (from_config): our config from the start
            config = RecurrentDepthConfig.from_model_config(config.to_model_config())
        super().__init__(config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise ValueError(f"OuroForCausalLM.from_pretrained takes no positional arguments after the path, got "
                             f"{len(args)}")
        hub = {name: kwargs.pop(name) for name in _HUB_KWARGS if name in kwargs}
        adapter = kwargs.pop("adapter_kwargs", None) or {}
        if "_adapter_model_path" in adapter:
            raise ValueError(f"{pretrained_model_name_or_path} holds a peft adapter; load its base model, then the "
                             f"adapter with peft")
        for name in _NO_EFFECT_KWARGS:
            kwargs.pop(name, None)
        for name in _UNSET_ONLY_KWARGS:  # (lm-eval's hf backend passes them all, as None)
            if name in kwargs and kwargs[name] is None:
                del kwargs[name]
        dtype = kwargs.pop("dtype", None)
        torch_dtype = kwargs.pop("torch_dtype", None)
        dtype = torch_dtype if dtype is None else dtype
        weights = kwargs.pop("weights", None)
        device = _device_from_map(kwargs.pop("device_map", None))
        directory = _local_model_dir(pretrained_model_name_or_path, hub)
        config = kwargs.pop("config", None)
        if config is None:
            config, kwargs = OuroConfig.from_pretrained(str(directory), return_unused_kwargs=True, **kwargs)
        if kwargs:
            raise ValueError(f"OuroForCausalLM.from_pretrained: unsupported arguments {sorted(kwargs)}; it takes "
                             f"dtype, device_map, config, Ouro config keys and transformers' hub arguments")
        if not hasattr(config, "to_model_config"):
            raise ValueError(f"config must be an OuroConfig (or one of ours), got {type(config).__name__}")
        overrides = config.to_model_config().to_dict()
        overrides.pop("model_type")
        model = RecurrentDepthLM.from_pretrained(
            directory, dtype=None if dtype == "auto" else dtype, device=device, config_overrides=overrides,
            weights=weights,
        )
        wrapped = from_library_model(model)
        wrapped.config.name_or_path = str(pretrained_model_name_or_path)
        # transformers' output flags given to from_pretrained (or set on the config) went to the OuroConfig only
        for name in ("output_hidden_states", "return_dict", "use_cache"):
            setattr(wrapped.config, name, getattr(config, name, getattr(wrapped.config, name)))
        if getattr(config, "output_attentions", False):
            wrapped.set_attn_implementation("eager")  # transformers' rule for output_attentions on the config
            wrapped.config.output_attentions = True
        _read_generation_config(wrapped, directory)
        _stop_at_turn_end(wrapped, directory)
        return wrapped


def _device_from_map(device_map: Any) -> Any:
    """The one device a `device_map` names: ours are single-device models."""
    if device_map is None:
        return "cpu"
    if device_map == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, str | int | torch.device):
        return device_map
    if isinstance(device_map, dict) and len(set(device_map.values())) == 1:
        return next(iter(device_map.values()))
    raise ValueError(f"device_map={device_map!r} is not supported: pass one device (e.g. 'cpu', 'cuda:0' or 'auto')")


def _local_model_dir(name: Any, hub: dict[str, Any]) -> Path:
    """`name` (joined with `subfolder`) when it is a local directory, else a Hub snapshot of its config and
    safetensors (huggingface_hub, honouring HF_HUB_OFFLINE and the hub arguments)."""
    subfolder = hub.pop("subfolder", None) or ""
    local = Path(name) / subfolder
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json"]
    hub.pop("proxies", None)
    snapshot = snapshot_download(str(name), allow_patterns=[f"{subfolder}/{p}" if subfolder else p for p in patterns],
                                 **hub)
    return Path(snapshot) / subfolder


def _read_generation_config(model: PreTrainedModel, directory: Path) -> None:
    """The directory's generation_config.json (bounded read), as transformers' loader would take it."""
    from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

    path = directory / "generation_config.json"
    if path.is_file():
        model.generation_config = GenerationConfig.from_dict(read_json(path, CONFIG_MAX_BYTES, "generation config"))


def _stop_at_turn_end(model: RecurrentDepthForCausalLM, directory: Path) -> None:
    """Join the ids a chat turn ends at in `directory` (its tokenizer's chat template: `<|end_turn|>`, ChatML's
    `<|im_end|>`; `serving.text.turn_end_ids`, where `rdepth serve` stops a chat) to the loaded generation config's
    eos_token_id, after its own ids, else the model's eos: a directory saved without them in generation_config.json
    (the library's layout) stopped transformers' `generate` at eos only, so a chat ran on into a made-up next turn.
    `integrations.export.stop_at_turn_end` writes the same ids into the directories it exports."""
    config = getattr(model, "generation_config", None)
    if not isinstance(config, GenerationConfig) or not (directory / "tokenizer.json").is_file():
        return  # (no tokenizer: no chat template; the server's text module is not even imported)
    from recurrent_depth.generation_config import with_turn_end
    from recurrent_depth.serving.text import turn_end_ids

    turn_end = turn_end_ids(directory, model.core.config.vocab_size)
    if turn_end:
        own = config.eos_token_id
        config.eos_token_id = with_turn_end(model.core.config.eos_token_id if own is None else own, turn_end)


def _packed_document_ids(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                         cache: Any) -> Tensor | None:
    """Padding-free packing's rows (no attention mask, `position_ids` restarting at 0 inside a row, as trl's
    `padding_free=True` / `packing=True` collator writes them): each example's document id `[B, T]`, so attention
    stays inside it (transformers' models read the same restarts); None for any other batch."""
    if isinstance(cache, Cache) and not isinstance(cache, RecurrentDepthCache) and cache.get_seq_length() == 0:
        cache = None  # (an empty transformers cache holds nothing: forward() replaces it)
    if (position_ids is None or attention_mask is not None or cache is not None or input_ids.shape[-1] < 2
            or not isinstance(position_ids, Tensor) or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, input_ids.shape[0]) or position_ids.shape[1] != input_ids.shape[1]):
        return None
    # ([1, T] position_ids serve every row, as the core reads them: the rows share their examples' bounds)
    restarts = position_ids.expand(input_ids.shape)[:, 1:] == 0
    if not bool(restarts.any()):
        return None
    return torch.cat([torch.zeros_like(restarts[:, :1]), restarts], dim=1).long().cumsum(-1)


def _cache_alias(cache: Any, kwargs: dict[str, Any]) -> Any:
    """transformers 4 called the cache `past_key_values`; accept it so old callers are not silently wrong."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None:
        if cache is not None and cache is not legacy:
            raise ValueError("pass the cache once: `cache` and `past_key_values` were both given")
        return legacy
    return cache


def register_models() -> None:
    """`AutoModelForCausalLM.register` for every config class (idempotent)."""
    from transformers.models.auto.modeling_auto import AutoModel, AutoModelForCausalLM

    from recurrent_depth.integrations.hf_config import register_configs

    register_configs()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for auto in (AutoModelForCausalLM, AutoModel):
        auto.register(RecurrentDepthConfig, RecurrentDepthForCausalLM, exist_ok=True)
        auto.register(HuginnRavenConfig, RavenForCausalLM, exist_ok=True)
        auto.register(OuroConfig, OuroForCausalLM, exist_ok=True)
    # The Trainer shifts the labels for `label_smoothing_factor` only for class names in this table (register()
    # does not add them): without them its smoothed loss compared logits at i with the label at i, not i + 1.
    for config_class, model_class in ((RecurrentDepthConfig, RecurrentDepthForCausalLM),
                                      (HuginnRavenConfig, RavenForCausalLM), (OuroConfig, OuroForCausalLM)):
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(config_class.model_type, model_class.__name__)


def from_library_model(model: RecurrentDepthLM) -> RecurrentDepthForCausalLM:
    """Wrap an in-memory `RecurrentDepthLM` for transformers-based tools (lm-eval's HFLM, pipelines...).

    The wrapper shares the model's parameters and its config: setting `wrapper.config.mean_recurrence`
    (or init_scale, max_position_embeddings) changes the default depth of both.
    """
    config = RecurrentDepthConfig.from_model_config(model.config)
    with torch.device("meta"):
        wrapped = RecurrentDepthForCausalLM(config)
    wrapped.transformer = model.transformer
    wrapped.lm_head = model.lm_head
    object.__setattr__(wrapped, "_core", model)
    wrapped._output_projections = {
        id(m) for name, m in wrapped.named_modules() if name.endswith(("attn.proj", "mlp.proj"))
    }
    wrapped.train(model.training)
    return wrapped
