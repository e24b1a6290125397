"""Model configuration: one typed dataclass, validated once, saved beside every checkpoint.

`ModelConfig` speaks four dialects of `config.json`: our own field names (written by
`to_dict`), the official Huginn-0125 `RavenConfig` keys (`n_embd`, `n_heads`,
`n_layers_in_prelude`, ...), which `from_dict` translates through `HUGINN_KEY_MAP`, Ouro's
(`model_type: "ouro"`, Qwen2's keys plus `total_ut_steps`), translated by `families/ouro.py`, and a
Parcae `ParcaeConfig`'s (`_class_name: "ParcaeConfig"`), translated by `families/parcae.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recurrent_depth.families.ouro import (
    OURO_KEY_FOR_FIELD,
    OURO_KEYS,
    OURO_MODEL_TYPE,
    is_ouro_config,
    ouro_config_values,
)
from recurrent_depth.families.parcae import is_parcae_config, parcae_config_values, value_embedding_layers
from recurrent_depth.files import CONFIG_MAX_BYTES, atomic_write_text, parse_json, read_text

MODEL_TYPE = "recurrent_depth"
HUGINN_MODEL_TYPE = "huginn_raven"
MODEL_PARTS = ("prelude", "core", "coda")
# `ModelConfig.attn_scale` values (None resolves by muP, see `ModelConfig.attention_scale_rule`).
ATTN_SCALES = (None, "1/sqrt(d)", "1/d")


class MupShapeWarning(UserWarning):
    """A muP config (`mup_base_width`) whose shapes or attention scale are not muP's."""


# The deepest recurrence any entry point runs unless asked for more (`--max-depth` on `train`,
# `generate` and `serve`): 8x the 128 iterations the paper takes as a state's limit point, 32x
# Huginn-0125's mean recurrence. One token at this depth already runs 4,096 core layers; a depth
# from a config or a request beyond it is far more likely a mistake (or an attack) than a wish,
# and would otherwise run for hours with nothing able to interrupt it.
MAX_NUM_STEPS = 1024
# Layers per part (prelude, core, coda): Huginn-0125 has 2/4/2; the deepest released transformers ~130.
MAX_LAYERS = 1024
# Parameters a config may describe: 280x Huginn-0125, more than fits in one machine's memory. A bound
# checked before anything is allocated, so a typo (`hidden_size: 100000000`) is one line, not an
# out-of-memory traceback minutes later.
MAX_PARAMETERS = 10**12
# Context length: positions are indexed with 32-bit-safe integers; RoPE tables are built lazily.
MAX_SEQ_LEN = 2**31 - 1
# float32's largest and smallest normal numbers. The logits are float32: a soft-capping value outside this range
# rounds to inf or 0 there, and cap * tanh(x / cap) is NaN or 0 for every token (checked on the config).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
# query_pre_attn_scalar's range. It stands in for head_dim in the logits' 1/sqrt scale (Gemma's: 144 to 256): below
# 1 the scale exceeds any head_dim's, beyond 1e12 the logits shrink a millionfold (every key weighted alike), and
# from about 1e92 SDPA's scale rounds to 0 in float32 and every logit is NaN.
QUERY_PRE_ATTN_SCALAR_RANGE = (1.0, 1e12)


def check_depth(value: Any, name: str, ceiling: int | None = None, low: int = 0) -> None:
    """A ValueError naming `name` unless `value` is None or an integer in [low, ceiling] (MAX_NUM_STEPS)."""
    ceiling = MAX_NUM_STEPS if ceiling is None else ceiling
    if value is not None and (not is_int(value) or not low <= value <= ceiling):
        raise ValueError(
            f"{name}={value!r} is invalid: expected an integer in [{low}, {ceiling}] (the depth ceiling; "
            f"raise it with --max-depth)"
        )


def is_int(value: Any) -> bool:
    """An int that is not a bool (config values from YAML/JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float (not a bool, not a string that looks like a number)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_field_names(names: Any, cls: type, what: str, listed_as: str = "allowed",
                      extra: tuple[str, ...] = ()) -> None:
    """One ValueError line, `unknown <what> [...]; <listed_as>: [...]`, for names (the keys of a config
    mapping) that are neither fields of the dataclass `cls` nor in `extra`."""
    known = {f.name for f in dataclasses.fields(cls)} | set(extra)
    unknown = sorted(set(names) - known, key=str)
    if unknown:
        near = {name: did_you_mean(str(name), known) for name in unknown}
        hint = "; ".join(f"{name!r}: did you mean {m}?" for name, m in near.items() if m)
        raise ValueError(f"unknown {what} {unknown}{f' ({hint})' if hint else ''}; {listed_as}: {sorted(known)}")


def did_you_mean(name: str, known: Any) -> str:
    """The known names closest to a mistyped `name`, quoted and joined by "or" ("" if none is close)."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return " or ".join(repr(c) for c in close)


# Official Huginn `config.json` key -> our field.
HUGINN_KEY_MAP: dict[str, str] = {
    "n_embd": "hidden_size",
    "n_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "n_layers_in_prelude": "prelude_layers",
    "n_layers_in_recurrent_block": "core_layers",
    "n_layers_in_coda": "coda_layers",
    "block_size": "max_seq_len",
    "padded_vocab_size": "vocab_size",
    "tie_embeddings": "tie_embeddings",
    "tie_word_embeddings": "tie_embeddings",
    "intermediate_size": "intermediate_size",
    "mean_recurrence": "mean_recurrence",
    "mean_backprop_depth": "mean_backprop_depth",
    "rope_base": "rope_base",
    "norm_eps": "norm_eps",
    "qk_bias": "qk_bias",
    "bias": "bias",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
    "init_scale": "init_scale",  # not in the official file; written by our Huginn-format config on save
}
# transformers' names for our fields (`RecurrentDepthConfig.attribute_map`), which transformers' loader honours in
# our own config.json: read the same here (a value that disagrees with our key's is refused), so that the library
# and transformers build the same model from one file instead of one of them silently taking the default.
TRANSFORMERS_ALIASES: dict[str, str] = {
    "max_position_embeddings": "max_seq_len",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "tie_word_embeddings": "tie_embeddings",
}
# Keys of HUGINN_KEY_MAP that the official code derives (from n_heads) or aliases rather than reads: not written
# by `ModelConfig.to_huginn_dict`.
HUGINN_DERIVED_KEYS = frozenset({"num_key_value_heads", "tie_word_embeddings"})

# Keys that describe the file rather than the model (transformers bookkeeping, informational
# Huginn fields whose value the forward pass hard-codes). Accepted and ignored on load.
IGNORED_KEYS = frozenset(
    {
        "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "model_type",
        "_name_or_path", "use_cache", "return_dict", "output_hidden_states", "output_attentions",
        "is_encoder_decoder", "tokenizer_class", "chunk_size_feed_forward", "problem_type",
        "id2label", "label2id", "_attn_implementation_autoset", "_commit_hash",
        # Huginn informational fields (the forward pass hard-codes their values)
        "n_layers", "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size_padded",
        "padding_multiple", "norm_class_name", "mlp_class_name", "nonlin_name", "block_class_name",
        "architecture_class_name", "init_strategy", "init_orthogonal", "state_init", "injection_type",
        "activation_checkpoint_impl", "sampling_scheme", "test_time_noise", "test_time_noise_type",
        "effective_expected_depth", "init_values", "head_dim", "num_key_value_heads", "vocab_size",
    }
)


@dataclass
class ModelConfig:
    """Shape and defaults of a recurrent-depth LM: prelude -> r x core (with input injection) -> coda.

    `mixer` is the token mixer of every block: one registered name, or a dict with one name per
    part (`{"prelude": "attention", "core": "gated_deltanet", "coda": "attention"}`);
    `mixer_options` are keyword arguments for the mixer constructors (e.g. `{"window": 128}`).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None  # None -> num_heads (no GQA, as Huginn)
    head_dim: int | None = None  # None -> hidden_size // num_heads
    intermediate_size: int = 176
    prelude_layers: int = 1
    core_layers: int = 2
    coda_layers: int = 1
    mean_recurrence: int = 4
    mean_backprop_depth: int = 2
    max_seq_len: int = 256
    rope_base: float = 50_000.0
    norm_eps: float = 1e-6
    qk_bias: bool = True
    qk_norm: bool = False  # per-head RMSNorm of q and k (gain [head_dim]) before RoPE; off in Huginn
    qk_norm_per_head: bool = False  # with qk_norm: a gain per head ([heads, head_dim]), so QK-clip clips heads alone
    bias: bool = False
    tie_embeddings: bool = True
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None  # an id, or several (end of text and end of turn)
    pad_token_id: int | None = None
    mixer: str | dict[str, str] = "attention"
    mixer_options: dict[str, Any] = field(default_factory=dict)
    # muP (Tensor Programs V): the width at which muP equals the standard parametrization; None = standard.
    mup_base_width: int | None = None
    # muP: head_dim of the base-width model. None: head_dim * mup_base_width / hidden_size (a sweep at a fixed head
    # count, as widening hidden_size alone is); set it to head_dim when a sweep adds heads of a fixed size.
    mup_base_head_dim: int | None = None
    # Attention logits q.k times "1/sqrt(d)" (the standard, Huginn's) or "1/d" (muP's, Tensor Programs V, written
    # sqrt(d_0)/d so the base-width model is the standard one); None: "1/d" under muP, else "1/sqrt(d)".
    attn_scale: str | None = None
    # ---- architecture family (docs/looped-family.md). The defaults are Huginn's; PRESETS name the others.
    block_layout: str = "sandwich"  # see BLOCK_LAYOUTS
    rope_style: str = "interleaved"  # "interleaved" pairs (Huginn) or "half" rotation (Llama, Qwen, OLMo, Ouro)
    rope_scaling: dict[str, Any] | None = None  # None, {"rope_type": "linear", "factor": f} or Llama 3's "llama3"
    qkv_bias: bool = False  # a bias on the q/k/v projection (Qwen2), whatever `bias` says
    qk_norm_full_width: bool = False  # with qk_norm: one RMSNorm over all heads' q (and k) at once (OLMo-2)
    mlp_activation: str = "silu"  # the MLP's activation (the gate's, when gated): see MLP_ACTIVATIONS
    embedding_scale: bool = True  # wte(x) * sqrt(h) (Huginn); off: wte(x) as is
    # bf16 / fp16 values rounded where transformers' implementation rounds them (every retrofitted type but OLMo-2,
    # so they equal transformers bit for bit): the sqrt(h) embedding scale rounded to the model's dtype before the
    # product, the rotate-half RoPE (rope_style "half") and the soft-capped attention and final logits computed in
    # the model's dtype. Off: those in float32 (or the exact sqrt(h)), rounded once (Huginn's). The same values in
    # float32.
    transformers_rounding: bool = False
    # Every RMSNorm gain stored as w and applied as (1 + w), added and multiplied in float32 and rounded once
    # (transformers' GemmaRMSNorm: retrofitted Gemma 1-3, so they equal transformers in bf16 / fp16 too);
    # off: the gain w itself, times the normalised x rounded to x's dtype first (Huginn's).
    norm_unit_offset: bool = False
    # Every RMSNorm gain multiplied in float32 and the product rounded to x's dtype once (transformers'
    # Olmo2RMSNorm: retrofitted OLMo-2, so it equals transformers in bf16 / fp16 too); off: the normalised x
    # rounded first, then times the gain in x's dtype (Huginn's). The same values in float32.
    norm_float32_gain: bool = False
    # Every 'attention' layer attends as plain math (`eager_attention`: the logits in the model's dtype under
    # transformers_rounding, a float32 softmax), never SDPA, whose kernels round differently in bf16 / fp16: set for
    # retrofitted Gemma 2, whose transformers code always attends that way. Off: SDPA (Huginn's) unless a layer
    # soft-caps its logits or returns its weights. In float32 the two agree up to rounding.
    eager_attention: bool = False
    norm_before_coda: bool = True  # the coda reads ln_f(s_r) (Huginn) or s_r itself
    final_norm: bool = True  # logits = lm_head(ln_f(coda output)); off: lm_head(coda output)
    step_norm: bool = False  # ln_f after every core step, and the normed state carried on (Ouro)
    injection: str = "concat"  # how e enters each step: see INJECTIONS
    state_init: str = "random"  # s_0: "random" (Huginn's truncated normal) or the "embedding" e itself (Ouro)
    exit_gate: bool = False  # a learned exit head Linear(h, 1) on each step's latent (Ouro's early_exit_gate)
    # With exit_gate: the threshold q of the gate's exit rule (leave at the first step whose cumulative exit
    # probability reaches q) when a call names none; Ouro's early_exit_threshold. None: the criterion's own default.
    exit_gate_threshold: float | None = None
    mlp_gated: bool = True  # proj(act(gate) * up) (Huginn, Llama); false: proj(act(fc(x))) (Parcae, GPT-2)
    qk_norm_eps: float | None = None  # QK-norm's epsilon; None: norm_eps (Parcae: float32's machine epsilon)
    prelude_norm: bool = False  # an RMSNorm `ln_prelude` on the prelude's output, so e is normed (Parcae)
    coda_projection: bool = False  # a Linear(h, h) the coda reads the last state through (Parcae's C)
    # Unique layers (0-based over prelude, core, coda) whose attention adds a token-keyed value embedding,
    # gated per kv head by 2 sigmoid(W x[:32]) (nanochat's, in Parcae): see `Attention.add_value_embedding`.
    value_embeddings: list[int] = field(default_factory=list)
    # A sliding window per unique layer (0-based over prelude, core, coda, one entry each): null = full attention,
    # W = the last W keys up to and including the query's own (transformers' sliding_window). []: no per-layer
    # windows (mixer_options' `window` may still window a whole part). Only 'attention' layers take a window.
    attention_windows: list[int | None] = field(default_factory=list)
    # Gemma 2 / 3 (docs/looped-family.md): the attention logits q.k times query_pre_attn_scalar^-1/2 instead of
    # head_dim^-1/2 (None: attn_scale's rule); tanh soft-capping cap * tanh(x / cap) of every 'attention' layer's
    # logits (before the mask and softmax, computed as plain math, not SDPA) and of the LM head's logits (None: off);
    # a RoPE base per unique layer ([] or one entry each: null = rope_base with rope_scaling, a number = that base,
    # unscaled: Gemma 3's local base on its sliding layers).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_rope_bases: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if (self.head_dim is None and is_int(self.hidden_size) and is_int(self.num_heads)
                and self.num_heads > 0):
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()
        for problem in self.mup_shape_problems():
            # warnings' default filter shows each message once, however often a config is rebuilt
            warnings.warn(problem, MupShapeWarning, stacklevel=3)  # the line that built the config

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(cond: bool, name: str, expected: str) -> None:
            if not cond:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name, None)!r} is invalid: expected {expected}"
                )

        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            need(is_int(value) and value >= 1, name, "an integer >= 1")
        for name in ("prelude_layers", "core_layers", "coda_layers", "mean_recurrence",
                     "mean_backprop_depth"):
            value = getattr(self, name)
            need(is_int(value) and value >= 0, name, "an integer >= 0")
        need(self.core_layers >= 1, "core_layers", "at least 1 layer in the recurrent core")
        for name in ("prelude_layers", "core_layers", "coda_layers"):
            need(getattr(self, name) <= MAX_LAYERS, name, f"at most {MAX_LAYERS} layers (MAX_LAYERS)")
        for name in ("mean_recurrence", "mean_backprop_depth"):
            need(getattr(self, name) <= MAX_NUM_STEPS, name,
                 f"at most {MAX_NUM_STEPS} steps (MAX_NUM_STEPS, the depth ceiling)")
        need(self.max_seq_len <= MAX_SEQ_LEN, "max_seq_len", f"at most {MAX_SEQ_LEN} (MAX_SEQ_LEN)")
        need(self.hidden_size % self.num_heads == 0, "num_heads",
             f"a divisor of hidden_size={self.hidden_size}")
        # (after num_heads: more heads than channels derives head_dim 0, which would blame head_dim)
        need(is_int(self.head_dim) and self.head_dim >= 1, "head_dim", "an integer >= 1")
        need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
             f"a divisor of num_heads={self.num_heads} (grouped-query attention)")
        need(self.head_dim % 2 == 0, "head_dim", "an even number (rotary embedding rotates pairs)")
        need(is_real(self.rope_base) and self.rope_base > 1, "rope_base", "a number > 1")
        need(is_real(self.norm_eps) and 0 < self.norm_eps < 1, "norm_eps", "a number in (0, 1)")
        need(is_real(self.init_scale) and self.init_scale >= 0, "init_scale", "a number >= 0")
        for name in ("qk_bias", "qk_norm", "qk_norm_per_head", "bias", "tie_embeddings"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        need(self.qk_norm or not self.qk_norm_per_head, "qk_norm_per_head",
             "false unless qk_norm is true (it shapes QK-norm's gains)")
        def token_id(value: Any) -> bool:
            return is_int(value) and 0 <= value < self.vocab_size

        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if name == "eos_token_id" and isinstance(value, list | tuple):
                need(len(value) > 0 and all(token_id(v) for v in value), name,
                     f"None, a token id or a non-empty list of token ids in [0, {self.vocab_size})")
                self.eos_token_id = list(value)  # a list in config.json either way
                continue
            need(value is None or token_id(value), name, f"None or a token id in [0, {self.vocab_size})")
        if isinstance(self.mixer, dict):
            unknown = set(self.mixer) - set(MODEL_PARTS)
            need(not unknown, "mixer", f"a name or a dict with keys {MODEL_PARTS} (got extra {sorted(unknown)})")
            need(all(isinstance(v, str) for v in self.mixer.values()), "mixer", "string mixer names")
        else:
            need(isinstance(self.mixer, str), "mixer", "a mixer name or a dict part -> name")
        need(isinstance(self.mixer_options, dict), "mixer_options", "a dict of keyword arguments")
        need(self.mup_base_width is None or (is_int(self.mup_base_width) and self.mup_base_width >= 1),
             "mup_base_width", "None (standard parametrization) or an integer >= 1 (muP's base width)")
        need(self.mup_base_width is None or not self.tie_embeddings, "mup_base_width",
             "None with tie_embeddings=True: muP treats the embedding (input) and head (output) differently, "
             "so set tie_embeddings false")
        need(self.mup_base_head_dim is None or (is_int(self.mup_base_head_dim) and self.mup_base_head_dim >= 1),
             "mup_base_head_dim", "None (head_dim scaled to the base width) or an integer >= 1")
        need(self.mup_base_head_dim is None or self.mup_base_width is not None, "mup_base_head_dim",
             "None unless mup_base_width is set (it describes muP's base model)")
        need(self.attn_scale in ATTN_SCALES, "attn_scale", f"None or one of {list(ATTN_SCALES[1:])}")
        need(self.attn_scale != "1/d" or self.mup_base_width is not None, "attn_scale",
             "'1/sqrt(d)' or None without mup_base_width ('1/d' is muP's, its constant set by the base width)")
        need(isinstance(self.block_layout, str) and self.block_layout in BLOCK_LAYOUTS, "block_layout",
             f"one of {sorted(BLOCK_LAYOUTS)}")
        need(self.rope_style in ("interleaved", "half"), "rope_style", "'interleaved' or 'half'")
        need(self.mlp_activation in MLP_ACTIVATIONS, "mlp_activation", f"one of {sorted(MLP_ACTIVATIONS)}")
        need(self.injection in INJECTIONS, "injection", f"one of {sorted(INJECTIONS)}")
        need(self.state_init in ("random", "embedding"), "state_init", "'random' or 'embedding'")
        for name in ("qkv_bias", "qk_norm_full_width", "embedding_scale", "norm_before_coda", "final_norm",
                     "step_norm", "exit_gate"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        for name in ("mlp_gated", "prelude_norm", "coda_projection", "transformers_rounding", "norm_unit_offset",
                     "norm_float32_gain", "eager_attention"):
            need(isinstance(getattr(self, name), bool), name, "true or false")
        need(self.rope_style == "half" or not self.transformers_rounding, "transformers_rounding",
             "false unless rope_style is 'half' (transformers' rotation; the interleaved one is Huginn's)")
        need(self.qk_norm_eps is None or (is_real(self.qk_norm_eps) and 0 < self.qk_norm_eps < 1), "qk_norm_eps",
             "None (norm_eps) or a number in (0, 1)")
        layers = self.value_embeddings
        need(isinstance(layers, list | tuple) and all(is_int(i) and 0 <= i < self.num_layers for i in layers)
             and len(set(layers)) == len(layers), "value_embeddings",
             f"a list of distinct layer indices in [0, {self.num_layers}) (prelude, core, coda counted in order)")
        self.value_embeddings = sorted(layers)
        need(not layers or self.hidden_size >= VALUE_GATE_CHANNELS, "value_embeddings",
             f"[] with hidden_size < {VALUE_GATE_CHANNELS} (the gate reads the first {VALUE_GATE_CHANNELS} channels)")
        windows = self.attention_windows
        need(isinstance(windows, list | tuple) and (not windows or len(windows) == self.num_layers)
             and all(w is None or (is_int(w) and 1 <= w <= MAX_SEQ_LEN) for w in windows), "attention_windows",
             f"[] or a list of {self.num_layers} entries (prelude, core, coda layers in order), each null (full "
             f"attention) or an integer window in [1, {MAX_SEQ_LEN}] (MAX_SEQ_LEN)")
        self.attention_windows = list(windows)
        scalar = self.query_pre_attn_scalar
        low, high = QUERY_PRE_ATTN_SCALAR_RANGE
        need(scalar is None or (is_real(scalar) and low <= scalar <= high), "query_pre_attn_scalar",
             f"None or a number in [{low:g}, {high:g}] (the logits are scaled by its inverse square root, as by "
             f"head_dim's)")
        need(self.query_pre_attn_scalar is None or (self.mup_base_width is None and self.attn_scale != "1/d"),
             "query_pre_attn_scalar", "None under muP (mup_base_width / attn_scale '1/d' set the attention scale)")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            need(value is None or (is_real(value) and FLOAT32_TINY <= value <= FLOAT32_MAX), name,
                 f"None or a number in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}] (the tanh cap, within float32's "
                 f"range: the logits are float32)")
        bases = self.layer_rope_bases
        need(isinstance(bases, list | tuple) and (not bases or len(bases) == self.num_layers)
             and all(b is None or (is_real(b) and b > 1) for b in bases), "layer_rope_bases",
             f"[] or a list of {self.num_layers} entries (prelude, core, coda layers in order), each null (rope_base) "
             f"or a RoPE base > 1")
        self.layer_rope_bases = list(bases)
        need(self.qk_norm or not self.qk_norm_full_width, "qk_norm_full_width",
             "false unless qk_norm is true (it shapes QK-norm)")
        need(not (self.qk_norm_full_width and self.qk_norm_per_head), "qk_norm_full_width",
             "false with qk_norm_per_head (one norm over all heads, or a gain per head: not both)")
        need(self.exit_gate_threshold is None or (is_real(self.exit_gate_threshold)
                                                  and 0 < self.exit_gate_threshold <= 1),
             "exit_gate_threshold", "None or a number in (0, 1] (a cumulative exit probability)")
        need(self.exit_gate_threshold is None or self.exit_gate, "exit_gate_threshold",
             "None unless exit_gate is true (it is the exit gate's threshold)")
        check_rope_scaling(self.rope_scaling)
        count = self.num_parameters()
        if count > MAX_PARAMETERS:
            raise ValueError(
                f"ModelConfig describes {count:.3g} parameters (hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, vocab_size={self.vocab_size}, "
                f"{self.num_layers} layers), more than MAX_PARAMETERS={MAX_PARAMETERS:.0e}; check these sizes"
            )

    @property
    def width_multiplier(self) -> float:
        """muP's m = hidden_size / mup_base_width (1 under the standard parametrization)."""
        return 1.0 if self.mup_base_width is None else self.hidden_size / self.mup_base_width

    @property
    def attention_scale_rule(self) -> str:
        """`attn_scale` resolved: "1/d" under muP unless set, else "1/sqrt(d)"."""
        if self.attn_scale is not None:
            return self.attn_scale
        return "1/sqrt(d)" if self.mup_base_width is None else "1/d"

    @property
    def base_head_dim(self) -> float:
        """muP's d_0, the head_dim of the base-width model (`mup_base_head_dim`, else scaled with the width)."""
        if self.mup_base_width is None:
            raise ValueError("base_head_dim is muP's: set ModelConfig.mup_base_width")
        if self.mup_base_head_dim is not None:
            return float(self.mup_base_head_dim)
        return self.head_dim * self.mup_base_width / self.hidden_size

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: d^-1/2, or muP's sqrt(d_0)/d (equal to it where head_dim is d_0)."""
        d = self.head_dim
        if self.query_pre_attn_scalar is not None:  # (Gemma 2 / 3; refused under muP)
            return float(self.query_pre_attn_scalar) ** -0.5
        if self.attention_scale_rule == "1/sqrt(d)" or self.base_head_dim == d:
            return d**-0.5
        return math.sqrt(self.base_head_dim) / d

    def mup_shape_problems(self) -> list[str]:
        """Why these shapes are not muP's (empty when they are, or muP is off): each a one-line warning."""
        if self.mup_base_width is None:
            return []
        d0, d = self.base_head_dim, self.head_dim
        problems = []
        if d0 != int(d0):
            problems.append(
                f"muP: head_dim={d} at hidden_size={self.hidden_size} scales to {d0:g} at mup_base_width="
                f"{self.mup_base_width}, not a whole head: these shapes do not grow from the base width; set "
                f"mup_base_head_dim (to head_dim={d} if the sweep adds heads)")
        if self.attention_scale_rule == "1/sqrt(d)" and d0 != d:
            problems.append(
                f"muP with attn_scale='1/sqrt(d)' while head_dim grows from {d0:g} (base width) to {d}: not muP "
                f"(Tensor Programs V scales attention by 1/d); leave attn_scale unset or '1/d', or set "
                f"mup_base_head_dim={d} if the heads, not head_dim, grow with width")
        return problems

    # ------------------------------------------------------------------ derived values
    @property
    def num_layers(self) -> int:
        """Unique layers: prelude + core + coda."""
        return self.prelude_layers + self.core_layers + self.coda_layers

    @property
    def effective_expected_depth(self) -> int:
        """Layers run at the mean recurrence: P + C + R * r̄ (sets the Takase output-layer init)."""
        return self.prelude_layers + self.coda_layers + self.core_layers * self.mean_recurrence

    def mixer_for(self, part: str) -> str:
        if isinstance(self.mixer, dict):
            return self.mixer.get(part, "attention")
        return self.mixer

    def num_parameters(self) -> int:
        """Unique parameters of the default attention model (tied embedding counted once)."""
        h, hd, nh, nkv, inter = (self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                 self.intermediate_size)
        if self.qk_norm_full_width:
            gains = (nh + nkv) * hd
        else:
            gains = ((nh + nkv) if self.qk_norm_per_head else 2) * hd * self.qk_norm
        qkv_bias = (nh + 2 * nkv) * hd * (self.bias or self.qkv_bias)
        attn = h * (nh + 2 * nkv) * hd + nh * hd * h + (nh + nkv) * hd * self.qk_bias + gains + qkv_bias
        attn += h * self.bias  # the output projection's bias
        if self.mlp_gated:
            mlp = 3 * inter * h + (2 * inter + h) * self.bias
        else:
            mlp = 2 * inter * h + (inter + h) * self.bias
        block = attn + mlp + BLOCK_LAYOUTS[self.block_layout] * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        adapter = {"concat": 2 * h * h + h * self.bias, "diagonal": h * h + 2 * h}.get(self.injection, 0)
        extras = h * self.prelude_norm + (h * h + h * self.bias) * self.coda_projection
        # each value embedding: a [vocab, kv width] table and its gate Linear(32, kv heads), no bias
        extras += len(self.value_embeddings) * (self.vocab_size * nkv * hd + VALUE_GATE_CHANNELS * nkv)
        return emb + self.num_layers * block + adapter + extras + h + (h + 1) * self.exit_gate

    @property
    def uses_huginn_layout(self) -> bool:
        """Every architecture-family field at Huginn's value (what the fused runner and the remote-code
        export implement)."""
        return (all(getattr(self, name) == value for name, value in HUGINN_ARCHITECTURE.items())
                and self.attention_scale == self.head_dim**-0.5)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """The named shape in `PRESETS` ("tiny", "small", "huginn-0125", ...) with `overrides` (field=value) on top.

        A preset's head_dim and num_kv_heads that are the derived defaults (hidden_size // num_heads, num_heads)
        are derived again from overridden hidden_size / num_heads unless overridden themselves, as when unset: a
        huginn-0125 at hidden_size=2640 has head_dim 48, not a 5280-wide attention in a 2640-wide model. Likewise a
        preset's special-token ids (bos/eos/pad_token_id) name tokens of its own vocabulary: with vocab_size
        overridden to another size they are unset (None) unless overridden themselves (give your tokenizer's), so
        huginn-0125 at vocab_size=32000 does not keep bos_token_id=65504."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields are {sorted(names)}")
        values = dict(PRESETS[name])
        heads, width = values.get("num_heads"), values.get("hidden_size")
        if ("hidden_size" in overrides or "num_heads" in overrides) and "head_dim" not in overrides \
                and is_int(heads) and heads > 0 and values.get("head_dim") == width // heads:
            values.pop("head_dim", None)
        if "num_heads" in overrides and "num_kv_heads" not in overrides and values.get("num_kv_heads") == heads:
            values.pop("num_kv_heads", None)
        if "vocab_size" in overrides and overrides["vocab_size"] != values.get("vocab_size"):
            for token in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (the preset's tokenizer's ids)
                values.pop(token, None)
        values.update(overrides)
        return cls(**values)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["model_type"] = MODEL_TYPE
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from our own keys, an official Huginn `config.json` (detected by its keys) or an Ouro one
        (`model_type: "ouro"`). Our own keys may come with transformers' names for four of them
        (`TRANSFORMERS_ALIASES`: num_attention_heads, ...), read as transformers reads them; `IGNORED_KEYS`
        (transformers' bookkeeping, informational Huginn keys) are ignored, and num_hidden_layers must be the sum of
        the three parts' layers; any other key is a one-line error."""
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {type(data).__name__}")
        if is_parcae_config(data):  # Parcae's own keys (families/parcae.py)
            return cls(**parcae_config_values(data))
        check_not_foreign_model_type(data)
        if is_huginn_config(data):
            return cls._from_huginn(data)
        if is_ouro_config(data):
            return cls._from_ouro(data)
        names = {f.name for f in dataclasses.fields(cls)}
        if "rope_parameters" in data and data["rope_parameters"] is None:  # what transformers wrote for an unset
            # rope_scaling when a config class (the remote-code file's, before it had the field) did not declare it
            data = {k: v for k, v in data.items() if k != "rope_parameters"}
        unknown = sorted(set(data) - names - IGNORED_KEYS - set(TRANSFORMERS_ALIASES))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known keys are {sorted(names)}")
        values = {k: v for k, v in data.items() if k in names}
        for alias, name in TRANSFORMERS_ALIASES.items():
            if alias not in data:
                continue
            if values.get(name) is not None and values[name] != data[alias]:
                raise ValueError(f"config keys {alias}={data[alias]!r} and {name}={values[name]!r} disagree ({alias} "
                                 f"is transformers' name for {name}): keep one")
            values[name] = data[alias]
        config = cls(**values)
        layers = data.get("num_hidden_layers")
        if layers is not None and layers != config.num_layers:
            raise ValueError(f"config key num_hidden_layers={layers!r} disagrees with prelude_layers + core_layers + "
                             f"coda_layers = {config.num_layers} (it is their sum): drop it or set those")
        return config

    @classmethod
    def _from_huginn(cls, data: dict[str, Any]) -> ModelConfig:
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in HUGINN_KEY_MAP:
                values[HUGINN_KEY_MAP[key]] = value
        # RavenConfig's transformers aliases (attribute_map), used when its own key is absent.
        for alias, name in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                            ("num_attention_heads", "num_heads")):
            if name not in values and alias in data:
                values[name] = data[alias]
        embd, heads = values.get("hidden_size"), values.get("num_heads")
        if is_int(embd) and is_int(heads) and heads > 0:
            values.setdefault("head_dim", embd // heads)  # else validation names the field
        values.setdefault("num_kv_heads", values.get("num_heads"))
        values.setdefault("rope_base", 50_000.0)
        values.setdefault("norm_eps", 1e-6)
        # The official file hard-codes these special tokens (huginn-0125.md §1).
        vocab = values.get("vocab_size", 0)
        official_vocab = is_int(vocab) and vocab > 65509
        values.setdefault("bos_token_id", 65504 if official_vocab else None)
        values.setdefault("eos_token_id", 65505 if official_vocab else None)
        values.setdefault("pad_token_id", 65509 if official_vocab else None)
        if values.get("bias") is True:  # (any other value: validation names the field)
            raise ValueError("an official Huginn config with bias: true is not supported: the official code puts that "
                             "bias on the adapter only, while this library's bias is on every linear layer (no "
                             "official checkpoint sets it)")
        unknown = sorted(set(data) - set(HUGINN_KEY_MAP) - IGNORED_KEYS)
        if unknown:
            warnings.warn(f"ignoring Huginn config keys this library does not use: {unknown}", stacklevel=3)
        return cls(**values)

    def to_huginn_dict(self) -> dict[str, Any]:
        """This config in the official `RavenConfig` keys (`model_type: huginn_raven`), for a directory the official
        modeling code loads. The official code derives the head count of k/v and the head width from n_heads and
        hard-codes the rest of the architecture, so a config it cannot express is refused in one line naming the
        fields: what `from_dict` reads back from the written keys must be this config."""
        if self.bias:  # (the official code gives the key another meaning)
            raise ValueError("the official Huginn-0125 layout cannot express this model's bias=True (the official "
                             "code's bias is the adapter's only; its attention and MLP have none, so it would drop "
                             "their biases): save it in the library's layout")
        values = {key: getattr(self, name) for key, name in HUGINN_KEY_MAP.items() if key not in HUGINN_DERIVED_KEYS}
        values.update(model_type=HUGINN_MODEL_TYPE, architectures=["RavenForCausalLM"], n_layers=self.num_layers,
                      vocab_size=self.vocab_size)
        back = type(self).from_dict(values)
        differs = sorted(f.name for f in dataclasses.fields(self) if getattr(back, f.name) != getattr(self, f.name))
        if differs:
            raise ValueError(f"the official Huginn-0125 layout cannot express this model's "
                             f"{', '.join(f'{name}={getattr(self, name)!r}' for name in differs)} (the official "
                             f"code hard-codes {', '.join(f'{name}={getattr(back, name)!r}' for name in differs)}): "
                             f"save it in the library's layout")
        return {key: values[key] for key in sorted(values)}

    @classmethod
    def _from_ouro(cls, data: dict[str, Any]) -> ModelConfig:
        """Ouro's keys (`families/ouro.py`) on top of `OURO_ARCHITECTURE`; a bad value is one line naming it."""
        values = {**OURO_ARCHITECTURE, **ouro_config_values(data)}
        unknown = sorted(set(data) - OURO_KEYS - IGNORED_KEYS)
        if unknown:
            warnings.warn(f"ignoring Ouro config keys this library does not use: {unknown}", stacklevel=3)
        try:
            return cls(**values)
        except ValueError as exc:
            named = re.match(r"ModelConfig\.(\w+)", str(exc))
            key = OURO_KEY_FOR_FIELD.get(named.group(1)) if named else None
            raise ValueError(f"Ouro config.json{f' {key}' if key else ''}: {exc}") from None

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            atomic_write_text(Path(path), text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike[str]) -> ModelConfig:
        text = str(path_or_text)
        if not text.lstrip().startswith("{"):
            path = Path(path_or_text)
            if path.is_dir():
                path = path / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"no config file at {path}")
            text = read_text(path, CONFIG_MAX_BYTES, "config file")
        return cls.from_dict(parse_json(text, "config"))


# Block layouts -> RMSNorms per block. norm_1 / norm_3 come before the mixer / MLP, norm_2 / norm_4 after:
#   sandwich   x = n2(x + mix(n1(x)));  x = n4(x + mlp(n3(x)))    Huginn: every block ends in a norm
#   peri-norm  x = x + n2(mix(n1(x)));  x = x + n4(mlp(n3(x)))    Ouro's four norms (Gemma-2 style)
#   pre-norm   x = x + mix(n1(x));      x = x + mlp(n3(x))        Llama, Qwen2, Qwen3
#   post-norm  x = x + n2(mix(x));      x = x + n4(mlp(x))        OLMo-2
BLOCK_LAYOUTS: dict[str, int] = {"sandwich": 4, "peri-norm": 4, "pre-norm": 2, "post-norm": 2}
# The MLP's activation: proj(act(gate) * up) gated, proj(act(fc(x))) not. relu2_half = relu(x)^2 / 2 (Parcae's).
MLP_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2_half")
# How the injection e enters core step i (s_i = core(x_i)):
#   concat  x_i = adapter([s_{i-1} | e])    Huginn, retrofitted recurrence (a 2h -> h linear map)
#   add     x_i = s_{i-1} + e
#   none    x_i = s_{i-1}                   Ouro: the whole stack looped on its own output
#   diagonal  x_i = exp(-dt A) * s_{i-1} + dt * (B e)   Parcae: A = exp(A_log) > 0 and dt = softplus(dt_bias)
#             per channel, so the state's own factor lies in (0, 1); B a learned h x h map (init I)
INJECTIONS = ("concat", "add", "none", "diagonal")
# Channels of the layer input that a value embedding's gate reads (nanochat's and Parcae's constant).
VALUE_GATE_CHANNELS = 32
# Modules whose weights' fan-in does not grow with the width (a value embedding reads the vocabulary, its gate
# VALUE_GATE_CHANNELS channels): muP's input weights (their init in the model, their lr in train/optim.py).
FIXED_FAN_IN_MODULES = ("value_embed", "ve_gate")
# rope_scaling types: the keys each needs (besides "rope_type"), as transformers' configs spell them.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# The architecture fields at Huginn's values (ModelConfig's defaults).
HUGINN_ARCHITECTURE: dict[str, Any] = dict(
    block_layout="sandwich", rope_style="interleaved", rope_scaling=None, qkv_bias=False, qk_norm_full_width=False,
    mlp_activation="silu", embedding_scale=True, norm_before_coda=True, final_norm=True, step_norm=False,
    injection="concat", state_init="random", exit_gate=False, mlp_gated=True, qk_norm_eps=None, prelude_norm=False,
    coda_projection=False, value_embeddings=[], attn_logit_softcapping=None, final_logit_softcapping=None,
    layer_rope_bases=[], transformers_rounding=False, norm_unit_offset=False, norm_float32_gain=False,
    eager_attention=False,
)


def check_rope_scaling(value: Any) -> None:
    """A ValueError naming rope_scaling unless it is None or a supported {"rope_type": ..., ...} dict."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"ModelConfig.rope_scaling={value!r} is invalid: expected None or a dict")
    kind = value.get("rope_type", value.get("type"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        raise ValueError(f"ModelConfig.rope_scaling: rope_type {kind!r} is not supported; supported: "
                         f"{sorted(ROPE_SCALING_KEYS)}")
    if "rope_type" in value and "type" in value and value["type"] != kind:
        raise ValueError(f"ModelConfig.rope_scaling: type={value['type']!r} and rope_type={kind!r} disagree (type is "
                         f"the older name of rope_type): keep one")
    # transformers' keys per type (its `_validate_*_rope_parameters`, which only warns about others): the type's own,
    # and partial_rotary_factor at 1 (the whole head rotated, all that is implemented here). Its rope_theta is our
    # rope_base, a field of its own: read here it would be ignored.
    for key in sorted(set(value) - {"rope_type", "type", "partial_rotary_factor", *ROPE_SCALING_KEYS[kind]}, key=str):
        hint = "; set the base with ModelConfig.rope_base" if key == "rope_theta" else ""
        raise ValueError(f"ModelConfig.rope_scaling[{key!r}] is not a key of rope_type {kind!r}; its keys: "
                         f"{['rope_type', *ROPE_SCALING_KEYS[kind]]}{hint}")
    if not (is_real(value.get("partial_rotary_factor", 1)) and value.get("partial_rotary_factor", 1) == 1):
        raise ValueError(f"ModelConfig.rope_scaling['partial_rotary_factor']={value['partial_rotary_factor']!r} is "
                         f"not supported: expected 1 (only a fully rotated head is implemented)")
    for key in ROPE_SCALING_KEYS[kind]:
        number = value.get(key)
        if not is_real(number) or number <= 0:
            raise ValueError(f"ModelConfig.rope_scaling[{key!r}]={number!r} is invalid: expected a number > 0 "
                             f"(rope_type {kind!r} needs {list(ROPE_SCALING_KEYS[kind])})")
    if kind == "llama3" and not is_int(value["original_max_position_embeddings"]):
        raise ValueError(f"ModelConfig.rope_scaling['original_max_position_embeddings']="
                         f"{value['original_max_position_embeddings']!r} is invalid: expected an integer > 0 (the "
                         f"pretraining context length)")
    if kind == "llama3" and not value["high_freq_factor"] > value["low_freq_factor"]:
        raise ValueError("ModelConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor")


def rope_scaling_key(value: dict[str, Any] | None) -> tuple | None:
    """A hashable form of a (checked) rope_scaling dict, for table caches: None for no scaling."""
    if value is None:
        return None
    kind = value.get("rope_type", value.get("type"))
    if kind == "default":
        return None
    return (kind, *(float(value[key]) for key in ROPE_SCALING_KEYS[kind]))


# The model_type values a config.json we read may carry (Parcae's configs carry none).
KNOWN_MODEL_TYPES = (MODEL_TYPE, HUGINN_MODEL_TYPE, OURO_MODEL_TYPE)


def check_not_foreign_model_type(data: dict[str, Any]) -> None:
    """Refuse another transformers architecture's config (llama, gpt2, ...) before its keys are read as ours.

    Without this a plain Llama read as ours lists a dozen "unknown config keys", and GPT-2's `n_embd`
    passes for an official Huginn config.
    """
    model_type = data.get("model_type")
    if model_type is not None and model_type not in KNOWN_MODEL_TYPES and isinstance(data.get("loop"), dict):
        # (`recurrent_depth.looping`'s key: a directory `rdepth loop search --save` or save_pretrained wrote)
        raise ValueError(f"config.json is a transformers {model_type!r} model looped by `rdepth loop` (its config "
                         f"holds loop=...), not a recurrent-depth one: load it with "
                         f"recurrent_depth.looping.from_pretrained and decode with its generate, or score it "
                         f"with `rdepth loop eval --model DIR`")
    if model_type is not None and model_type not in KNOWN_MODEL_TYPES:
        raise ValueError(f"config.json is a transformers {model_type!r} checkpoint, not a recurrent-depth one: "
                         f"convert it with `rdepth retrofit` (Llama, Mistral, Phi-3, Qwen2, Qwen3, OLMo-2, "
                         f"Gemma 1 / 2 / 3) or loop its middle layers with `rdepth loop`")


def is_huginn_config(data: dict[str, Any]) -> bool:
    return (data.get("model_type") == HUGINN_MODEL_TYPE or "n_embd" in data) and not is_parcae_config(data)


# Ouro / LoopLM (arXiv 2510.25741): the whole stack is the recurrent core, looped on its own ln_f-normed
# output from s_0 = wte(x), four norms per block, rotate-half RoPE, a learned exit gate; no prelude, coda,
# injection or embedding scale (docs/looped-family.md).
OURO_ARCHITECTURE: dict[str, Any] = dict(
    block_layout="peri-norm", rope_style="half", qk_bias=False, embedding_scale=False, norm_before_coda=False,
    final_norm=False, step_norm=True, injection="none", state_init="embedding", exit_gate=True,
    prelude_layers=0, coda_layers=0,
)

# Parcae (arXiv 2604.12946): pre-norm blocks with an ungated relu(x)^2/2 MLP, gainless QK-norm after RoPE (equal
# to ours with gains of one), value embeddings every other layer, a normed prelude output, the diagonal
# injection, a Linear C into the coda; s_0 ~ TruncNormal(0, 2/(5h)) (init_scale 1/sqrt(h)) (docs/looped-family.md).
PARCAE_ARCHITECTURE: dict[str, Any] = dict(
    block_layout="pre-norm", rope_style="interleaved", qk_bias=False, qk_norm=True, qk_norm_eps=2.0**-23,
    mlp_gated=False, mlp_activation="relu2_half", embedding_scale=False, norm_before_coda=False,
    injection="diagonal", prelude_norm=True, coda_projection=True, tie_embeddings=True, norm_eps=1e-5,
    rope_base=50_000.0,
)


def parcae_preset(hidden: int, layers: int, vocab: int = 32768, mean: int = 8, backprop: int = 4) -> dict[str, Any]:
    """A Parcae shape: `layers` each in prelude, core and coda, head_dim 128, MLP 4h (the released models')."""
    return dict(
        PARCAE_ARCHITECTURE, vocab_size=vocab, hidden_size=hidden, num_heads=hidden // 128, num_kv_heads=hidden // 128,
        intermediate_size=4 * hidden, prelude_layers=layers, core_layers=layers, coda_layers=layers,
        mean_recurrence=mean, mean_backprop_depth=backprop, max_seq_len=2048, init_scale=1 / math.sqrt(hidden),
        value_embeddings=value_embedding_layers(layers, layers, layers, mean, backprop),
    )


PRESETS: dict[str, dict[str, Any]] = {
    # SandyResearch's released Parcae models (parcae_lm/configs/parcae/*.py at dee8363): their parameter counts
    # plus our QK-norm gains of one (2 x 128 per layer).
    "parcae-140m": parcae_preset(768, 2),
    "parcae-370m": parcae_preset(1024, 4),
    "parcae-770m": parcae_preset(1280, 6),
    "parcae-1.3b": parcae_preset(1536, 8),
    # The paper's model: 3,564,976,800 unique parameters (huginn-0125.md §1).
    "huginn-0125": dict(
        vocab_size=65536, hidden_size=5280, num_heads=55, num_kv_heads=55, head_dim=96,
        intermediate_size=17920, prelude_layers=2, core_layers=4, coda_layers=2,
        mean_recurrence=32, mean_backprop_depth=8, max_seq_len=4096, rope_base=50_000.0,
        norm_eps=1e-6, qk_bias=True, tie_embeddings=True,
        bos_token_id=65504, eos_token_id=65505, pad_token_id=65509,
    ),
    # ByteDance's Ouro-1.4B and Ouro-2.6B shapes (T = total_ut_steps = 4; the 2.6B has 48 layers).
    "ouro-1.4b": dict(
        OURO_ARCHITECTURE, vocab_size=49152, hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=128,
        intermediate_size=5632, core_layers=24, mean_recurrence=4, mean_backprop_depth=4, max_seq_len=65536,
        rope_base=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    ),
    "ouro-2.6b": dict(
        OURO_ARCHITECTURE, vocab_size=49152, hidden_size=2048, num_heads=16, num_kv_heads=16, head_dim=128,
        intermediate_size=5632, core_layers=48, mean_recurrence=4, mean_backprop_depth=4, max_seq_len=65536,
        rope_base=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    ),
    "tiny-ouro": dict(
        OURO_ARCHITECTURE, vocab_size=256, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=176,
        core_layers=2, mean_recurrence=4, mean_backprop_depth=4, max_seq_len=256, tie_embeddings=False,
    ),
    # For tests: seconds to build and run.
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_heads=4, intermediate_size=176, prelude_layers=1,
        core_layers=2, coda_layers=1, mean_recurrence=4, mean_backprop_depth=2, max_seq_len=256,
    ),
    # For CPU demos (quickstart): depth 4 sits below the mean recurrence of 8.
    "small": dict(
        vocab_size=4096, hidden_size=256, num_heads=4, intermediate_size=704, prelude_layers=1,
        core_layers=2, coda_layers=1, mean_recurrence=8, mean_backprop_depth=4, max_seq_len=512,
    ),
}
