"""Retrofitted recurrence (McLeish et al., arXiv 2511.07384): a pretrained transformers causal LM made a
recurrent-depth model by surgery on its layers.

    source layers   0 .. N-1 | ... dropped ... | A .. B-1 | ... dropped ... | L-M .. L-1
    ours            prelude  |                 |   core   |                 |   coda

    e   = prelude(wte(x))                        no sqrt(h) embedding scale: the source has none
    s_i = core(adapter([s_{i-1} | e]))          i = 1..r, the 2h -> h concat adapter (as Huginn)
    p   = lm_head(ln_f(coda(s_r)))              ln_f = the source's final norm; the coda reads s_r raw

    model = retrofit("meta-llama/Llama-3.2-1B", prelude=4, core=(6, 12), coda=4)   # a local directory
    model.save_pretrained("runs/llama-rd")      # or `rdepth retrofit --model DIR --prelude 4 --core 6:12 ...`

Sources: a transformers Llama, Mistral, Phi-3, Qwen2, Qwen3, OLMo-2, Gemma, Gemma 2 or Gemma 3 (text) `*ForCausalLM`
directory (config.json and safetensors, read with this library's bounded readers: no transformers model is built,
no code is run, the dropped layers are never read), or such a model already in memory. Sliding-window layers keep their
window (`ModelConfig.attention_windows`, one entry per kept layer): Mistral's and Phi-3's `sliding_window` on
every layer, Qwen2's and Qwen3's on the layers `layer_types` (or use_sliding_window with max_window_layers)
marks sliding, Gemma 2's and 3's the layers its `layer_types` marks. Gemma 2's attention and final logit
soft-capping, `query_pre_attn_scalar` and Gemma 3's local RoPE base on its sliding layers are ModelConfig fields.
Everything else (GPT-2, multimodal Gemma 3, MoE models, partial rotary, rope types other than default / linear /
llama3) is a one-line ValueError naming what stands in the way.

The adapter's initialisation (`ADAPTER_INITS`, docs/looped-family.md): the default "e" = [0 | I] passes
the prelude output into the core and ignores the state, so at initialisation the model computes exactly
the source network with the dropped layers removed, at every depth r (with every layer kept and r = 1 it
is the source model, which tests/test_retrofit.py checks logit for logit).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.checkpoint import TOKENIZER_FILES, read_header_shapes, read_state_dict
from recurrent_depth.config import (
    HUGINN_MODEL_TYPE,
    MAX_NUM_STEPS,
    MODEL_TYPE,
    ROPE_SCALING_KEYS,
    ModelConfig,
    is_int,
    is_real,
)
from recurrent_depth.families.ouro import OURO_MODEL_TYPE
from recurrent_depth.families.parcae import is_parcae_config
from recurrent_depth.files import (
    CONFIG_MAX_BYTES,
    TOKENIZER_MAX_BYTES,
    atomic_write_bytes,
    atomic_write_text,
    inside,
    read_bytes,
    read_json,
)
from recurrent_depth.model.recurrent import RecurrentDepthLM

LOOP_CONFIG_KEY = "loop"  # recurrent_depth.looping.config.CONFIG_KEY (not imported: that module needs transformers)

# model_type -> block layout. Llama, Mistral, Phi-3, Qwen2 and Qwen3 are pre-norm; OLMo-2 norms each
# branch's output. Mistral is the Llama block without biases; Phi-3 fuses q/k/v (qkv_proj) and gate/up
# (gate_up_proj) in the row order our Wqkv and mlp.fc use.
# In bf16 / fp16 every type rounds where its transformers code rounds, so the logits equal transformers' bit for
# bit in every dtype: all but OLMo-2 rotate (RoPE) in the model's dtype (transformers_rounding); OLMo-2 rotates in
# float32, as our default, and multiplies its norm gains in float32 before rounding (norm_float32_gain). Gemma 2
# attends as plain math (eager_attention), as transformers' Gemma 2 does by default; the others' default is SDPA.
SUPPORTED_MODEL_TYPES: dict[str, str] = {"llama": "pre-norm", "mistral": "pre-norm", "phi3": "pre-norm",
                                         "qwen2": "pre-norm", "qwen3": "pre-norm", "olmo2": "post-norm",
                                         "gemma": "pre-norm", "gemma2": "peri-norm", "gemma3_text": "peri-norm"}
# Gemma (1) is the Llama block with sqrt(h)-scaled embeddings, (1 + weight) RMSNorm gains (weight stored as it is,
# added in float32 by the norm: norm_unit_offset), the tanh GELU (its legacy hidden_act "gelu" means it) and tied
# embeddings by default; in bf16 / fp16 it rounds where transformers rounds (transformers_rounding).
# Gemma 2 and 3 norm each branch's input and output (four norms, our peri-norm block), scale the logits by
# query_pre_attn_scalar^-1/2, alternate sliding and full layers (layer_types) and read hidden_activation;
# Gemma 2 soft-caps the attention and final logits; Gemma 3 adds QK-norm ((1 + w) gains) and a RoPE base per
# layer type (the sliding layers' local base, unscaled).
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
_GEMMA2_TYPES = ("gemma2", "gemma3_text")
# Gemma2Config's / Gemma3TextConfig's values where a config.json leaves a key out.
_GEMMA2_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window_pattern": 2},
    "gemma3_text": {"query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window_pattern": 6},
}
# The model types whose attention applies `sliding_window` to every layer whenever it is set (no
# use_sliding_window switch), and those whose `layer_types` (or, without it, use_sliding_window and
# max_window_layers: layers >= max_window_layers slide) say which layers take the window.
_SLIDING_WINDOW_TYPES = ("mistral", "phi3")
_LAYER_TYPES_TYPES = ("qwen2", "qwen3")
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config's and Qwen3Config's
# The model types whose code reads attention_bias (Mistral and Phi-3 have no biases); only Llama's reads mlp_bias
# (a stray mlp_bias in another type's config.json changes nothing there: it was looked for as MLP bias tensors).
_BIAS_KEY_TYPES = ("llama", "qwen3", "olmo2", "gemma", "gemma2", "gemma3_text")
_MLP_BIAS_KEY_TYPES = ("llama",)
# transformers' head_dim where a config.json leaves it out (hidden_size // num_attention_heads for the others).
_DEFAULT_HEAD_DIM = {"gemma": 256, "gemma2": 256, "gemma3_text": 256, "qwen3": 128}
# transformers' num_key_value_heads where a config.json leaves it out (num_attention_heads for the others, and for a
# null in every type): a source without the key was refused as a tensor-shape mismatch.
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32, "gemma": 16, "gemma2": 4, "gemma3_text": 4}
# transformers' rms_norm_eps where a config.json leaves it out (1e-6 for the others).
_DEFAULT_NORM_EPS = {"phi3": 1e-5, "olmo2": 1e-5}
# transformers' sliding_window where a config.json leaves it out (MistralConfig's 4096: applied; Phi-3's None)
_DEFAULT_SLIDING_WINDOW = {"mistral": 4096}
# transformers' hidden_act names -> ours (gelu_new and gelu_pytorch_tanh are both the tanh approximation).
HIDDEN_ACTS: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                               "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
# The adapter W [h, 2h] acting on [s | e]:
#   e       [0 | I]       passes the prelude output: the pruned source network at every depth (default)
#   state   [I | 0]       passes the state: the first step sees only the noise s_0, never the input
#   mean    0.5 [I | I]   the average: at s_0 = 0 the core reads e / 2, a scale its weights never saw
#   sum     [I | I]       additive injection s + e: the source at r = 1 with s_0 = 0, growing with r
#   random  Huginn's init (truncated normal, std sqrt(2 / 5h)): the pretrained core sees noise at first
ADAPTER_INITS: tuple[str, ...] = ("e", "state", "mean", "sum", "random")
DEFAULT_ADAPTER_INIT = "e"
# Depth defaults written into the model's config (flags on `rdepth retrofit`; `rdepth train` can change
# both). r̄ = 4 makes the test-time dial visible at a CPU's budget; k = 8 is the paper's truncation.
DEFAULT_MEAN_RECURRENCE = 4
DEFAULT_BACKPROP_DEPTH = 8
# Written beside config.json: where the weights came from and which source layer each one is.
PROVENANCE_FILE = "retrofit.json"
SOURCE_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# A source with only a sentencepiece model (no tokenizer.json): copied, and converted to tokenizer.json where
# transformers can (it needs the sentencepiece package), since this library reads tokenizer.json only.
SENTENCEPIECE_FILE = "tokenizer.model"
# Source config keys that would change the computation in a way this converter does not reproduce:
# refused when present with a value other than the harmless one.
# (key -> (refused?, what is supported))
_REFUSED_KEYS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_experts": (lambda v: bool(v), "dense MLPs only"),
    "num_local_experts": (lambda v: bool(v), "dense MLPs only"),
    "attn_logit_softcapping": (lambda v: v is not None, "null"),
    "final_logit_softcapping": (lambda v: v is not None, "null"),
    "partial_rotary_factor": (lambda v: v not in (None, 1, 1.0), "1.0, a fully rotated head"),
    "use_bidirectional_attention": (lambda v: bool(v), "causal attention"),
    # transformers' mask builders attend both ways unless `getattr(config, "is_causal", True)` is truthy
    "is_causal": (lambda v: not v, "true, causal attention"),
}
# Model types users bring most often among those refused, with what stands in the way.
_REFUSED_TYPES: dict[str, str] = {
    "gemma3": "Gemma 3's multimodal model (Gemma3ForConditionalGeneration) is not a causal LM of text; its text "
              "model (model_type gemma3_text, Gemma3ForCausalLM) converts",
}
# Sources that already are recurrent-depth models (model_type -> whose): there is nothing to retrofit.
_LOOPED_TYPES: dict[str, str] = {MODEL_TYPE: "saved by this library", HUGINN_MODEL_TYPE: "Huginn-0125",
                                 OURO_MODEL_TYPE: "Ouro"}
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
# The weights' dtypes `retrofit(dtype=...)` takes (the CLI's --dtype offers the first three).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def fail(message: str) -> ValueError:
    return ValueError(f"retrofit: {message}")


@dataclass(frozen=True)
class Surgery:
    """Which source layers go where: prelude = [0, prelude), core = [core[0], core[1]) (half-open, like a
    Python slice), coda = the last `coda` layers; the layers between the parts are dropped."""

    prelude: int
    core: tuple[int, int]
    coda: int

    def check(self, num_layers: int) -> None:
        """A one-line ValueError unless the parts fit a source of `num_layers` layers without overlapping."""
        a, b = self.core
        for name, value in (("prelude", self.prelude), ("coda", self.coda), ("core start", a), ("core end", b)):
            if not is_int(value) or value < 0:
                raise fail(f"{name}={value!r} is invalid: expected an integer >= 0")
        if b <= a:
            raise fail(f"core {a}:{b} is empty: expected A:B with A < B (half-open, like a Python slice)")
        if b > num_layers:
            raise fail(f"core {a}:{b} is out of range: the source has {num_layers} layers (0..{num_layers - 1})")
        if self.prelude + self.coda > num_layers:
            raise fail(f"prelude {self.prelude} + coda {self.coda} layers exceed the source's {num_layers}")
        if a < self.prelude:
            raise fail(f"core {a}:{b} overlaps the prelude (layers 0:{self.prelude})")
        if b > num_layers - self.coda:
            raise fail(f"core {a}:{b} overlaps the coda (layers {num_layers - self.coda}:{num_layers})")

    def layer_map(self, num_layers: int) -> list[tuple[str, int, int]]:
        """(our part's module name, index in it, source layer) for every kept layer, in order."""
        a, b = self.core
        first_coda = num_layers - self.coda
        return ([("prelude", i, i) for i in range(self.prelude)]
                + [("core_block", j, a + j) for j in range(b - a)]
                + [("coda", c, first_coda + c) for c in range(self.coda)])

    def dropped(self, num_layers: int) -> list[int]:
        kept = {src for _, _, src in self.layer_map(num_layers)}
        return [i for i in range(num_layers) if i not in kept]


def parse_core(core: str | tuple[int, int]) -> tuple[int, int]:
    """'A:B' or (A, B) -> (A, B), or a one-line ValueError (the values are checked by Surgery.check)."""
    if not isinstance(core, str):  # (a tuple or list; an int or a 1-tuple was a bare TypeError / unpack error)
        if isinstance(core, list | tuple) and len(core) == 2:
            return core[0], core[1]
        raise fail(f"core={core!r} is invalid: expected (A, B) or 'A:B', a half-open range of source layers")
    a, sep, b = core.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), int(b)
    except ValueError:
        raise fail(f"core {core!r} is invalid: expected A:B, a half-open range of source layers such as 4:10") from None


# ---------------------------------------------------------------------------------------------- the source
@dataclass
class Source:
    """A transformers causal LM to convert: its config (as a dict), its tensor names and a reader for them."""

    config: dict[str, Any]
    names: set[str]
    read: Callable[[set[str]], dict[str, Tensor]]
    description: str
    directory: Path | None = None  # the tokenizer files are copied from here


def read_source(model_or_dir: Any) -> Source:
    """A transformers `PreTrainedModel` in memory, or a directory holding its config.json and safetensors."""
    if isinstance(model_or_dir, str | os.PathLike):
        path = Path(model_or_dir)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise fail(f"--model {str(path)!r} is not a model directory (no config.json)")
        config = read_json(path / "config.json", CONFIG_MAX_BYTES, "config file")
        if not isinstance(config, dict):
            raise fail(f"{path / 'config.json'} is not a JSON object")
        try:
            names = set(read_header_shapes(path))
        except FileNotFoundError as exc:
            raise fail(str(exc)) from None
        return Source(config, names, lambda wanted: read_state_dict(path, names=wanted), str(path), path)
    if isinstance(model_or_dir, nn.Module) and hasattr(getattr(model_or_dir, "config", None), "to_dict"):
        state = model_or_dir.state_dict()
        return Source(model_or_dir.config.to_dict(), set(state), lambda wanted: {n: state[n] for n in wanted},
                      type(model_or_dir).__name__)
    raise fail(f"expected a model directory or a transformers model, got {type(model_or_dir).__name__}")


def check_architecture(hf: Mapping[str, Any]) -> str:
    """The block layout of a supported source, or a one-line ValueError naming what is not supported."""
    model_type = hf.get("model_type")
    # (a Parcae config.json has no model_type: it was refused as "model_type None", naming nothing)
    looped = "Parcae" if is_parcae_config(hf) else _LOOPED_TYPES.get(model_type) if isinstance(model_type, str) \
        else None
    if looped is not None:
        raise fail(f"the source is already a recurrent-depth model ({looped}): nothing to retrofit; pass its "
                   f"directory as --model to rdepth generate / serve / eval, or to train --init-from")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        reason = _REFUSED_TYPES.get(model_type, "") if isinstance(model_type, str) else ""
        reason = f"{reason}; " if reason else ""
        raise fail(f"cannot convert model_type {model_type!r}: {reason}supported are "
                   f"{', '.join(SUPPORTED_MODEL_TYPES)} (transformers causal LMs)")
    architectures = hf.get("architectures") or []
    if not isinstance(architectures, list) or any(not str(a).endswith("ForCausalLM") for a in architectures):
        raise fail(f"cannot convert architectures {architectures!r}: expected a *ForCausalLM model")
    if hf.get(LOOP_CONFIG_KEY) is not None:  # (a directory `rdepth loop search --save` wrote, or a looped model)
        raise fail(f"cannot convert a looped model (its config holds loop={hf[LOOP_CONFIG_KEY]!r}): retrofit would "
                   f"drop the loop; convert the base model (the same weights without the 'loop' entry in config.json, "
                   f"or after recurrent_depth.looping.remove_loop)")
    quantization = hf.get("quantization_config")
    if quantization:  # (its packed or scaled tensors were refused later as "an architecture variant")
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise fail(f"cannot convert a quantized checkpoint (quantization_config quant_method={method!r}): convert "
                   f"its unquantized (float) weights")
    for key, (refused, supported) in _REFUSED_KEYS.items():
        if model_type in _GEMMA2_TYPES and key.endswith("_softcapping"):  # (converted: gemma2_setting)
            continue
        if key in hf and refused(hf[key]):
            raise fail(f"cannot convert {model_type} with {key}={hf[key]!r}: not implemented here (supported: "
                       f"{supported})")
    layer_types = hf.get("layer_types")
    if layer_types is not None and model_type not in _LAYER_TYPES_TYPES + _GEMMA2_TYPES:  # (never read there)
        listed = layer_types if isinstance(layer_types, list) else [layer_types]
        other = sorted({str(t) for t in listed if t != "full_attention"})
        if other:
            raise fail(f"cannot convert {model_type} with layer_types {other}: transformers' {model_type} "
                       f"attention does not read layer_types (only qwen2, qwen3, gemma2 and gemma3_text mix sliding "
                       f"and full layers)")
    if model_type in _GEMMA2_TYPES and gemma2_setting(hf, "query_pre_attn_scalar") is None:  # (was head_dim's scale)
        raise fail(f"cannot convert {model_type} with query_pre_attn_scalar=null: transformers' {model_type} attention "
                   f"scales the logits by query_pre_attn_scalar^-1/2 and has none for null (set it: head_dim gives the "
                   f"usual scale)")
    if model_type == "gemma3_text" and gemma2_setting(hf, "attn_logit_softcapping") is not None:
        raise fail(f"cannot convert gemma3_text with attn_logit_softcapping={hf['attn_logit_softcapping']!r}: "
                   f"transformers' Gemma 3 attention does not apply it (supported: null)")
    act_key = "hidden_activation" if model_type in _GEMMA2_TYPES else "hidden_act"
    act = hf.get(act_key, "gelu_pytorch_tanh" if model_type in _GEMMA2_TYPES else "silu")
    if not isinstance(act, str) or act not in HIDDEN_ACTS:
        raise fail(f"cannot convert {act_key} {act!r}: supported are {sorted(HIDDEN_ACTS)}")
    return SUPPORTED_MODEL_TYPES[model_type]


def source_windows(hf: Mapping[str, Any], num_layers: int) -> list[int | None]:
    """Each source layer's sliding window (None: full attention), as transformers' attention applies it: a
    window of W keys up to and including the query's own (`kv_idx > q_idx - W`). Mistral and Phi-3 window
    every layer with `sliding_window`; Qwen2 and Qwen3 the layers `layer_types` marks "sliding_attention"
    (without it: layers >= max_window_layers, when use_sliding_window), with `sliding_window` when
    use_sliding_window is true. A window >= max_position_embeddings changes nothing: None."""
    model_type = hf.get("model_type")
    if model_type in _SLIDING_WINDOW_TYPES:
        window = hf.get("sliding_window", _DEFAULT_SLIDING_WINDOW.get(model_type))  # (null: none; absent: default)
        sliding = list(range(num_layers)) if window is not None else []
    elif model_type in _LAYER_TYPES_TYPES:
        use = hf.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise fail(f"use_sliding_window={use!r} is invalid: expected true or false")
        window = hf.get("sliding_window", 4096) if use else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = hf.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
            if not is_int(first):
                raise fail(f"max_window_layers={first!r} is invalid: expected an integer")
            sliding = list(range(max(first, 0), num_layers)) if window is not None else []
        else:
            sliding = _listed_sliding_layers(layer_types, num_layers)
            if sliding and window is None:
                raise fail(f"cannot convert {model_type} whose layer_types mark layers {sliding} sliding_attention "
                           f"with use_sliding_window={use!r} / sliding_window=null: transformers has no window for "
                           f"them either (set use_sliding_window true and sliding_window, or mark them "
                           f"full_attention)")
    elif model_type in _GEMMA2_TYPES:  # (every layer_types "sliding_attention" layer takes sliding_window)
        window, sliding = gemma2_setting(hf, "sliding_window"), gemma_sliding_layers(hf, num_layers)
        if sliding and window is None:
            raise fail(f"cannot convert {model_type} whose layers {sliding} are sliding_attention with "
                       f"sliding_window=null: transformers has no window for them either (set sliding_window, or mark "
                       f"them full_attention in layer_types)")
    else:
        return [None] * num_layers
    if sliding and not (is_int(window) and window >= 1):
        raise fail(f"sliding_window={window!r} is invalid: expected null or an integer >= 1")
    context = hf.get("max_position_embeddings")
    if is_int(context) and is_int(window) and window >= context:
        sliding = []  # (the window covers every position the model reads)
    return [window if i in sliding else None for i in range(num_layers)]


def _listed_sliding_layers(layer_types: Any, num_layers: int) -> list[int]:
    """The layers a `layer_types` list marks "sliding_attention", or a one-line ValueError."""
    allowed = ("full_attention", "sliding_attention")
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(
            t not in allowed for t in layer_types):
        raise fail(f"layer_types={layer_types!r} is invalid: expected {allowed[0]!r} or {allowed[1]!r} for "
                   f"each of the num_hidden_layers={num_layers} layers")
    return [i for i, t in enumerate(layer_types) if t == "sliding_attention"]


def gemma2_setting(hf: Mapping[str, Any], key: str) -> Any:
    """A Gemma 2 / 3 config key, or transformers' default where config.json leaves it out."""
    return hf[key] if key in hf else _GEMMA2_DEFAULTS[hf["model_type"]][key]


def gemma_sliding_layers(hf: Mapping[str, Any], num_layers: int) -> list[int]:
    """Gemma 2's / 3's sliding layers: those `layer_types` marks, else every layer but each `pattern`-th (Gemma
    2: every other one, from layer 0; Gemma 3: sliding_window_pattern, 6 by default)."""
    if hf.get("layer_types") is not None:
        return _listed_sliding_layers(hf["layer_types"], num_layers)
    pattern = 2 if hf["model_type"] == "gemma2" else gemma2_setting(hf, "sliding_window_pattern")
    if not is_int(pattern) or pattern < 1:
        raise fail(f"sliding_window_pattern={pattern!r} is invalid: expected an integer >= 1")
    return [i for i in range(num_layers) if (i + 1) % pattern]


def gemma3_rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3's (global theta, our rope_scaling, local theta): transformers 5's per-layer-type rope_parameters
    (full_attention / sliding_attention) or the older rope_theta / rope_scaling (full layers) and
    rope_local_base_freq (sliding layers, never scaled)."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise fail(f"rope_parameters={params!r} is invalid: expected a JSON object or null")
    if hf.get("rope_scaling") is not None and not isinstance(hf["rope_scaling"], dict):
        raise fail(f"rope_scaling={hf['rope_scaling']!r} is invalid: expected a JSON object or null")
    params = params or {}
    if params and (set(params) - {"full_attention", "sliding_attention"}
                   or not all(v is None or isinstance(v, dict) for v in params.values())):
        raise fail(f"rope_parameters={params!r} is invalid for gemma3_text: expected one JSON object per layer type "
                   f"(full_attention, sliding_attention)")
    full = {**(params.get("full_attention") or {}), **(hf.get("rope_scaling") or {})}
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    context = {"max_position_embeddings": hf["max_position_embeddings"]} if "max_position_embeddings" in hf else {}
    theta, scaling = rope_settings({"rope_parameters": full, **context}, top_level_original=False)
    try:
        local_theta, local_scaling = rope_settings({"rope_parameters": local, **context}, top_level_original=False)
    except ValueError as exc:  # (name the sliding layers' RoPE: their base may be rope_local_base_freq)
        raise fail(f"the sliding layers' RoPE: {str(exc).removeprefix('retrofit: ')}") from None
    if local_scaling is not None:
        raise fail(f"cannot convert gemma3_text whose sliding layers' RoPE is scaled ({local_scaling['rope_type']!r}): "
                   f"only their base is implemented here")
    return theta, scaling, local_theta


def rope_settings(hf: Mapping[str, Any], top_level_original: bool = True) -> tuple[float, dict[str, Any] | None]:
    """(theta, our rope_scaling) from transformers 5's `rope_parameters` or the older rope_theta/rope_scaling.

    A llama3 scaling without original_max_position_embeddings takes max_position_embeddings, as in transformers,
    where a top-level original_max_position_embeddings (Phi-3's key) overrides the rope dict's unless
    `top_level_original` is false (per-layer-type rope_parameters: Gemma 3)."""
    params = hf.get("rope_parameters")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise fail(f"{key}={hf[key]!r} is invalid: expected a JSON object or null")
    # transformers reads a non-empty `rope_scaling` over `rope_parameters` when a config.json holds both, and the
    # chosen dict's own rope_theta over the top-level one (a rope_theta inside rope_scaling was ignored)
    if isinstance(params, dict) and params and not hf.get("rope_scaling"):
        if any(isinstance(v, dict) for v in params.values()):
            raise fail(f"cannot convert per-layer-type rope_parameters {sorted(params)}")
        scaling = dict(params)
    else:
        scaling = dict(hf.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", hf.get("rope_theta", 10000.0))
    # (transformers 5 keeps Phi-3's partial_rotary_factor here: it was ignored, the whole head rotated)
    if scaling.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise fail(f"cannot convert rope partial_rotary_factor={scaling['partial_rotary_factor']!r}: only a fully "
                   f"rotated head is implemented here")
    if not is_real(theta) or theta <= 1:
        raise fail(f"rope_theta={theta!r} is invalid: expected a number > 1")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        raise fail(f"cannot convert rope_type {kind!r}: supported are {', '.join(ROPE_SCALING_KEYS)}")
    if kind == "default":
        return float(theta), None
    if kind == "llama3":  # as transformers' standardize_rope_params fills the pretraining context length
        # (was refused as missing, or the top-level value transformers prefers ignored: other frequencies)
        if top_level_original and "original_max_position_embeddings" in hf:
            scaling["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        elif "max_position_embeddings" in hf:
            scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    missing = [key for key in ROPE_SCALING_KEYS[kind] if key not in scaling]
    if missing:
        raise fail(f"rope_type {kind!r} lacks {missing}")
    if "attention_factor" in scaling and scaling["attention_factor"] not in (None, 1, 1.0):
        raise fail(f"cannot convert rope attention_factor={scaling['attention_factor']!r}")
    return float(theta), {"rope_type": kind, **{key: scaling[key] for key in ROPE_SCALING_KEYS[kind]}}


def _activation(hf: Mapping[str, Any]) -> str:
    """Our mlp_activation for the source's hidden_act (Gemma 2 / 3: hidden_activation). transformers' GemmaConfig
    reads Gemma 1's legacy "gelu" as the tanh GELU; Gemma 2's and 3's "gelu" is the exact one."""
    default = "gelu_pytorch_tanh" if hf.get("model_type") in _GEMMA_TYPES else "silu"
    act = HIDDEN_ACTS[hf.get("hidden_activation" if hf.get("model_type") in _GEMMA2_TYPES else "hidden_act", default)]
    return "gelu_tanh" if act == "gelu" and hf.get("model_type") == "gemma" else act


def transformers_config_default(model_type: str, key: str) -> tuple[str, Any]:
    """(class name, value) of transformers' config class for `model_type` where a config.json leaves `key` out."""
    from transformers import CONFIG_MAPPING  # (lazily: only a config.json that leaves such a key out needs it)

    config_class = CONFIG_MAPPING[model_type]
    return config_class.__name__, getattr(config_class(), key, None)


def with_context_length(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """`hf` with max_position_embeddings as transformers reads it: its config class's default where config.json
    leaves the key out (its llama3 RoPE and the sliding-window check read that default too); a value that gives no
    context length is refused naming the key, not our max_seq_len."""
    key = "max_position_embeddings"
    if key in hf and is_int(hf[key]) and hf[key] >= 1:
        return hf
    name, default = transformers_config_default(hf["model_type"], key)
    if key not in hf and is_int(default) and default >= 1:
        return {**hf, key: default}
    if key not in hf:  # (no supported type's class lacks one: a guard for a transformers that drops it)
        raise fail(f"{key} is missing and transformers' {name} has no default: set it to the context length")
    raise fail(f"{key}={hf[key]!r} is invalid: expected an integer >= 1, the context length (transformers' {name} "
               f"default, {default!r}, applies only where the key is absent)")


def model_config(hf: Mapping[str, Any], surgery: Surgery, mean_recurrence: int = DEFAULT_MEAN_RECURRENCE,
                 backprop_depth: int = DEFAULT_BACKPROP_DEPTH) -> ModelConfig:
    """Our ModelConfig for the retrofitted model of source config `hf` (a config.json as a dict).

    bos / eos / pad_token_id are config.json's own, None where it leaves them out: transformers' generate reads them
    from generation_config.json, or without one from config.json as it stands (not the config class's defaults,
    which only `model.config` shows), so a config.json without eos_token_id never stops there either."""
    layout = check_architecture(hf)
    hf = with_context_length(hf)
    num_layers = hf.get("num_hidden_layers")
    if not is_int(num_layers) or num_layers < 1:
        raise fail(f"num_hidden_layers={num_layers!r} is invalid: expected an integer >= 1")
    surgery.check(num_layers)
    model_type = hf["model_type"]
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if not (is_int(hidden) and is_int(heads) and heads > 0):
        raise fail(f"hidden_size={hidden!r} / num_attention_heads={heads!r} are invalid: expected integers >= 1")
    kv_heads = hf.get("num_key_value_heads", _DEFAULT_KV_HEADS.get(model_type)) or heads
    if "num_key_value_heads" not in hf and heads % kv_heads:  # (named: the default is in no file the user has)
        raise fail(f"num_key_value_heads is missing, and transformers' {model_type} default, {kv_heads}, does not "
                   f"divide num_attention_heads={heads}: set it in config.json")
    # Llama, Qwen3 and OLMo-2 may bias every attention projection (attention_bias) and Llama the MLP
    # (mlp_bias): our `bias` biases every linear map, the ones the source lacks start at zero. Qwen2
    # always biases q, k and v, never o.
    attention_bias, mlp_bias = source_biases(hf)
    any_bias = model_type != "qwen2" and (attention_bias or mlp_bias)
    gemma2 = model_type in _GEMMA2_TYPES
    local_bases: list[float | None] = []
    if model_type == "gemma3_text":  # the sliding layers rotate with their own (local) base
        theta, scaling, local = gemma3_rope(hf)
        sliding = set(gemma_sliding_layers(hf, num_layers))
        local_bases = [local if src in sliding else None for _, _, src in surgery.layer_map(num_layers)]
    else:
        theta, scaling = rope_settings(hf)
    windows = source_windows(hf, num_layers)
    kept = [windows[src] for _, _, src in surgery.layer_map(num_layers)]
    values = dict(
        vocab_size=hf.get("vocab_size"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type, hidden // heads),
        intermediate_size=hf.get("intermediate_size"),
        prelude_layers=surgery.prelude, core_layers=surgery.core[1] - surgery.core[0], coda_layers=surgery.coda,
        mean_recurrence=mean_recurrence, mean_backprop_depth=backprop_depth,
        max_seq_len=hf.get("max_position_embeddings"), rope_base=theta, rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", _DEFAULT_NORM_EPS.get(model_type, 1e-6)), qk_bias=False, bias=any_bias,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "olmo2", "gemma3_text"), qk_norm_full_width=model_type == "olmo2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", model_type in _GEMMA_TYPES)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"), pad_token_id=hf.get("pad_token_id"),
        block_layout=layout, rope_style="half", mlp_activation=_activation(hf),
        # (bf16 / fp16 rounded where transformers rounds, so equal to it in every dtype: see SUPPORTED_MODEL_TYPES)
        embedding_scale=model_type in _GEMMA_TYPES, norm_unit_offset=model_type in _GEMMA_TYPES,
        transformers_rounding=model_type != "olmo2", norm_float32_gain=model_type == "olmo2",
        eager_attention=model_type == "gemma2",  # (Gemma 2's transformers code has no SDPA: always eager math)
        norm_before_coda=False, final_norm=True, injection="concat",
        attention_windows=kept if any(w is not None for w in kept) else [],
        query_pre_attn_scalar=gemma2_setting(hf, "query_pre_attn_scalar") if gemma2 else None,
        attn_logit_softcapping=gemma2_setting(hf, "attn_logit_softcapping") if gemma2 else None,
        final_logit_softcapping=gemma2_setting(hf, "final_logit_softcapping") if gemma2 else None,
        layer_rope_bases=local_bases if any(b is not None for b in local_bases) else [],
    )
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise fail(f"the source's config does not make a valid model: {exc}") from None


# ---------------------------------------------------------------------------------------------- tensors
def _source_layer_names(cfg: ModelConfig, model_type: str = "llama") -> dict[str, list[str]]:
    """Our tensor name (relative to a block) -> the source tensors (relative to model.layers.i.) it is made of."""
    p = "self_attn."
    if model_type == "phi3":  # already fused, rows [q | k | v] and [gate | up] as ours; no biases, no QK-norm
        return {"attn.Wqkv.weight": [f"{p}qkv_proj.weight"], "attn.proj.weight": [f"{p}o_proj.weight"],
                "mlp.fc.weight": ["mlp.gate_up_proj.weight"], "mlp.proj.weight": ["mlp.down_proj.weight"],
                "norm_1.weight": ["input_layernorm.weight"], "norm_3.weight": ["post_attention_layernorm.weight"]}
    names: dict[str, list[str]] = {
        "attn.Wqkv.weight": [f"{p}q_proj.weight", f"{p}k_proj.weight", f"{p}v_proj.weight"],
        "attn.proj.weight": [f"{p}o_proj.weight"],
        "mlp.fc.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.proj.weight": ["mlp.down_proj.weight"],
    }
    if cfg.bias or cfg.qkv_bias:
        names["attn.Wqkv.bias"] = [f"{p}q_proj.bias", f"{p}k_proj.bias", f"{p}v_proj.bias"]
    if cfg.bias:
        names |= {"attn.proj.bias": [f"{p}o_proj.bias"], "mlp.fc.bias": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
                  "mlp.proj.bias": ["mlp.down_proj.bias"]}
    if cfg.qk_norm:
        names |= {"attn.q_norm.weight": [f"{p}q_norm.weight"], "attn.k_norm.weight": [f"{p}k_norm.weight"]}
    if cfg.block_layout == "pre-norm":
        names |= {"norm_1.weight": ["input_layernorm.weight"], "norm_3.weight": ["post_attention_layernorm.weight"]}
    elif cfg.block_layout == "peri-norm":  # Gemma 2 / 3: each branch's input and output normed
        names |= {"norm_1.weight": ["input_layernorm.weight"], "norm_2.weight": ["post_attention_layernorm.weight"],
                  "norm_3.weight": ["pre_feedforward_layernorm.weight"],
                  "norm_4.weight": ["post_feedforward_layernorm.weight"]}
    else:
        names |= {"norm_2.weight": ["post_attention_layernorm.weight"],
                  "norm_4.weight": ["post_feedforward_layernorm.weight"]}
    return names


def adapter_weight(init: str, h: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """The adapter's [h, 2h] weight acting on [s | e] (see ADAPTER_INITS)."""
    eye = torch.eye(h, dtype=torch.float32)
    zero = torch.zeros(h, h)
    if init == "e":
        weight = torch.cat([zero, eye], dim=1)
    elif init == "state":
        weight = torch.cat([eye, zero], dim=1)
    elif init == "mean":
        weight = 0.5 * torch.cat([eye, eye], dim=1)
    elif init == "sum":
        weight = torch.cat([eye, eye], dim=1)
    elif init == "random":
        std = math.sqrt(2 / (5 * h))
        weight = torch.empty(h, 2 * h)
        nn.init.trunc_normal_(weight, std=std, a=-3 * std, b=3 * std, generator=torch.Generator().manual_seed(seed))
    else:
        raise fail(f"adapter_init={init!r} is invalid: expected one of {', '.join(ADAPTER_INITS)}")
    return weight.to(dtype)


def convert_state(source: Source, cfg: ModelConfig, surgery: Surgery, adapter_init: str,
                  dtype: torch.dtype | None, seed: int = 0) -> dict[str, Tensor]:
    """Our state dict (tied lm_head left out) from the source's tensors; dropped layers are never read."""
    num_layers = source.config["num_hidden_layers"]
    plan: dict[str, list[str]] = {"transformer.wte.weight": ["model.embed_tokens.weight"],
                                  "transformer.ln_f.weight": ["model.norm.weight"]}
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = ["lm_head.weight"]
    for part, j, i in surgery.layer_map(num_layers):
        for ours, theirs in _source_layer_names(cfg, source.config["model_type"]).items():
            plan[f"transformer.{part}.{j}.{ours}"] = [f"model.layers.{i}.{name}" for name in theirs]
    wanted = {name for parts in plan.values() for name in parts}
    zero_filled = _zero_filled_biases(source.config, wanted)
    missing = sorted(wanted - source.names - zero_filled)
    if missing:
        raise fail(f"the source lacks tensors {missing[:6]}{' ...' if len(missing) > 6 else ''} that a "
                   f"{source.config['model_type']} layer holds")
    # (a stored bias the config switches off was read, where transformers leaves it out: other logits)
    unread = sorted(zero_filled & source.names)
    if unread:
        model_type = source.config["model_type"]
        mlp = ".mlp." in unread[0]
        key, readers = ("mlp_bias", _MLP_BIAS_KEY_TYPES) if mlp else ("attention_bias", _BIAS_KEY_TYPES)
        why = f"its {key} is not true" if model_type in readers else f"transformers' {model_type} has no such biases"
        raise fail(f"the source stores bias tensors {unread[:4]}{' ...' if len(unread) > 4 else ''} that transformers "
                   f"ignores when loading it ({why}): a checkpoint whose config does not match its weights")
    dropped = tuple(f"model.layers.{i}." for i in surgery.dropped(num_layers))
    tied_head = {"lm_head.weight"} & source.names if cfg.tie_embeddings else set()
    unknown = sorted(n for n in source.names - wanted - tied_head
                     if not n.endswith(_IGNORED_TENSOR_SUFFIXES) and not n.startswith(dropped))
    if unknown:
        raise fail(f"the source holds tensors this converter does not know: {unknown[:6]}"
                   f"{' ...' if len(unknown) > 6 else ''} (an architecture variant it cannot convert)")
    tensors = source.read((wanted - zero_filled) | tied_head)
    not_float = sorted(f"{n}: {t.dtype}" for n, t in tensors.items() if not t.is_floating_point())
    if not_float:
        raise fail(f"tensors {not_float[:4]} are not floating point (a quantized checkpoint cannot be converted)")
    # (a NaN or inf weight was converted into a model that generates garbage, without a word)
    broken = sorted(n for n, t in tensors.items() if not t.is_meta and not bool(torch.isfinite(t).all()))
    if broken:
        raise fail(f"tensors {broken[:4]}{' ...' if len(broken) > 4 else ''} of the source hold NaN or inf: a "
                   f"damaged checkpoint")
    if tied_head and not torch.equal(tensors.pop("lm_head.weight"), tensors["model.embed_tokens.weight"]):
        raise fail("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    out_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    device = tensors["model.embed_tokens.weight"].device  # (a model in memory on a GPU: the new tensors join it)
    state: dict[str, Tensor] = {}
    for ours, theirs in plan.items():  # (Gemma's norm weights w as they are: our norm_unit_offset adds the 1)
        pieces = [tensors[name] if name in tensors
                  else torch.zeros(tensors[name.removesuffix("bias") + "weight"].shape[0])  # a bias the source lacks
                  for name in theirs]
        state[ours] = torch.cat([t.to(device=device, dtype=out_dtype) for t in pieces], dim=0).contiguous()
    # (a weight beyond float16's range became inf on the cast, without a word: a model generating garbage)
    cast = any(t.dtype != out_dtype for t in tensors.values())  # (the source's tensors were checked above)
    overflow = cast and sorted(n for n, t in state.items() if not t.is_meta and not bool(torch.isfinite(t).all()))
    if overflow:
        raise fail(f"tensors {overflow[:4]}{' ...' if len(overflow) > 4 else ''} overflow {out_dtype} (--dtype): "
                   f"keep the source's dtype or choose float32 / bfloat16")
    h = cfg.hidden_size
    state["transformer.adapter.weight"] = adapter_weight(adapter_init, h, out_dtype, seed).to(device)
    if cfg.bias:
        state["transformer.adapter.bias"] = torch.zeros(h, dtype=out_dtype, device=device)
    return state


def source_biases(hf: Mapping[str, Any]) -> tuple[bool, bool]:
    """(attention biased, MLP biased) as the source's transformers code reads its config: Qwen2 always biases
    q/k/v, the _BIAS_KEY_TYPES read attention_bias, Llama alone reads mlp_bias."""
    model_type = hf.get("model_type")
    attention = model_type == "qwen2" or (model_type in _BIAS_KEY_TYPES and bool(hf.get("attention_bias", False)))
    return attention, model_type in _MLP_BIAS_KEY_TYPES and bool(hf.get("mlp_bias", False))


def _zero_filled_biases(hf: Mapping[str, Any], names: set[str]) -> set[str]:
    """The bias tensors among `names` that our `bias` adds and the source does not have: attention biases
    unless the source biases its attention (Qwen2 always, the others with attention_bias), MLP biases unless
    mlp_bias. They start at zero, which leaves the function unchanged."""
    attention, mlp = source_biases(hf)
    return {name for name in names if name.endswith(".bias") and not (mlp if ".mlp." in name else attention)}


def model_from_state(cfg: ModelConfig, state: dict[str, Tensor]) -> RecurrentDepthLM:
    """A RecurrentDepthLM holding `state` (shapes checked against the model's, one line on a mismatch)."""
    with torch.device("meta"):
        model = RecurrentDepthLM(cfg)
    expected = model.state_dict()
    required = set(expected) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(state) == required, sorted(set(state) ^ required)  # the plan covers exactly the model
    wrong = [f"{name}: source {tuple(state[name].shape)} vs model {tuple(expected[name].shape)}"
             for name in sorted(state) if state[name].shape != expected[name].shape]
    if wrong:
        raise fail(f"tensor shapes do not match the config: {wrong[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


# ---------------------------------------------------------------------------------------------- entry points
def retrofit(
    model_or_dir: Any,
    prelude: int,
    core: tuple[int, int] | str,
    coda: int,
    *,
    adapter_init: str = DEFAULT_ADAPTER_INIT,
    mean_recurrence: int = DEFAULT_MEAN_RECURRENCE,
    backprop_depth: int = DEFAULT_BACKPROP_DEPTH,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> RecurrentDepthLM:
    """A recurrent-depth model from a transformers Llama / Mistral / Phi-3 / Qwen2 / Qwen3 / OLMo-2 / Gemma 1-3 causal
    LM (a directory or a model in memory): prelude = source layers [0, prelude), core = [a, b), coda = the last
    `coda` layers.

    dtype: None keeps the source's (the embedding's) dtype. `seed` seeds the "random" adapter init only.
    """
    if adapter_init not in ADAPTER_INITS:
        raise fail(f"adapter_init={adapter_init!r} is invalid: expected one of {', '.join(ADAPTER_INITS)}")
    # checked here, not by ModelConfig, so the error names the option rather than the source's config
    # (r̄ = 0 would run no core step: the coda would read the noise s_0, whatever the input)
    for name, value, low in (("mean_recurrence", mean_recurrence, 1), ("backprop_depth", backprop_depth, 0)):
        if not is_int(value) or not low <= value <= MAX_NUM_STEPS:
            raise fail(f"{name}={value!r} (--{name.replace('_', '-')}) is invalid: expected an integer in "
                       f"[{low}, {MAX_NUM_STEPS}]")
    if dtype is not None and dtype not in _DTYPES:  # (a name or an int dtype failed deep in torch, many lines)
        raise fail(f"dtype={dtype!r} is invalid: expected None (the source's) or one of {', '.join(map(str, _DTYPES))}")
    surgery = Surgery(prelude, parse_core(core), coda)
    source = read_source(model_or_dir)
    cfg = model_config(source.config, surgery, mean_recurrence, backprop_depth)
    return model_from_state(cfg, convert_state(source, cfg, surgery, adapter_init, dtype, seed))


def retrofit_to_dir(
    model_dir: str | os.PathLike[str], out: str | os.PathLike[str], prelude: int, core: tuple[int, int] | str,
    coda: int, **options: Any,
) -> dict[str, Any]:
    """`retrofit` a model directory and save the result to `out` as a model directory of ours (config.json,
    model.safetensors, the source's tokenizer files and generation_config.json, retrofit.json); returns what
    retrofit.json records."""
    source_dir, out = Path(model_dir), Path(out)
    if out.resolve() == source_dir.resolve():
        raise fail(f"--out {str(out)!r} is the source directory: write the retrofitted model elsewhere")
    if out.exists() and not out.is_dir():  # (found only after the whole conversion, as "[Errno 17] File exists")
        raise fail(f"--out {str(out)!r} is a file, not a directory: choose a new or existing directory")
    from recurrent_depth.generation_config import GENERATION_CONFIG_FILE, check_generation_defaults

    check_generation_defaults(source_dir, remote_code=False, before="retrofitting")  # (before the conversion)
    model = retrofit(source_dir, prelude, core, coda, **options)
    hf = read_json(source_dir / "config.json", CONFIG_MAX_BYTES, "config file")
    num_layers = hf["num_hidden_layers"]
    surgery = Surgery(prelude, parse_core(core), coda)
    model.save_pretrained(out)
    copied, note = copy_source_tokenizer(source_dir, out)
    # the source's generation defaults (its eos ids, e.g. Qwen's [<|im_end|>, <|endoftext|>], and sampling
    # settings), which `rdepth generate` / `serve` read as transformers reads them for the source
    if (source_dir / GENERATION_CONFIG_FILE).is_file():
        atomic_write_bytes(out / GENERATION_CONFIG_FILE,
                           read_bytes(source_dir / GENERATION_CONFIG_FILE, CONFIG_MAX_BYTES, "generation config"))
    else:  # (not one of a model written to --out before)
        (out / GENERATION_CONFIG_FILE).unlink(missing_ok=True)
    record = {
        "source": str(source_dir), "model_type": hf["model_type"], "source_layers": num_layers,
        "layers": {part.replace("core_block", "core"): [src for p, _, src in surgery.layer_map(num_layers) if p == part]
                   for part in ("prelude", "core_block", "coda")},
        "dropped": surgery.dropped(num_layers),
        "adapter_init": options.get("adapter_init", DEFAULT_ADAPTER_INIT),
        "parameters": model.num_parameters(),
        "source_parameters": source_parameters(source_dir),
        "tokenizer_files": copied,
    }
    if note:
        record["tokenizer_note"] = note
    atomic_write_text(out / PROVENANCE_FILE, json.dumps(record, indent=2) + "\n")
    return record


def source_parameters(model_dir: Path) -> int:
    """Parameters stored in a directory's weight files (a tied head is stored once), from the headers."""
    return sum(math.prod(shape) for _, shape in read_header_shapes(model_dir).values())


def copy_source_tokenizer(source_dir: Path, out: Path) -> tuple[list[str], str | None]:
    """The source's tokenizer files into `out`, each a bounded regular file inside the source directory (a
    hub snapshot's symlinks into its blob store are followed); returns the names copied (a tokenizer.json
    converted from a sentencepiece tokenizer.model among them) and a note when the model directory has no
    tokenizer.json."""
    copied, files = [], {}
    for name in TOKENIZER_FILES:  # an --out that held another model's tokenizer: none of it may stay beside this one
        if not (source_dir / name).exists() and (out / name).is_file():
            (out / name).unlink()
    for name in (*SOURCE_TOKENIZER_FILES, SENTENCEPIECE_FILE):
        if (source_dir / name).exists():
            path = inside(source_dir, name, "tokenizer file", follow_links=True)
            files[name] = read_bytes(path, TOKENIZER_MAX_BYTES, "tokenizer file")
            atomic_write_bytes(out / name, files[name])
            copied.append(name)
    if "tokenizer.json" in files:
        return copied, None
    if SENTENCEPIECE_FILE not in files:
        return copied, f"{source_dir} has no tokenizer.json or {SENTENCEPIECE_FILE}: the model has no tokenizer"
    converted, reason = sentencepiece_to_json(files, read_bytes(source_dir / "config.json", CONFIG_MAX_BYTES,
                                                                "config file"))
    if converted is not None:
        atomic_write_bytes(out / "tokenizer.json", converted)
        return [*copied, "tokenizer.json"], None
    return copied, (f"{source_dir} has only a sentencepiece {SENTENCEPIECE_FILE}, which could not be converted to "
                    f"tokenizer.json ({reason}): copied as it is, for transformers' AutoTokenizer (with "
                    f"sentencepiece installed); rdepth's commands need a tokenizer.json: install sentencepiece and "
                    f"retrofit again, or pass --tokenizer DIR")


def sentencepiece_to_json(files: Mapping[str, bytes], config: bytes) -> tuple[bytes | None, str]:
    """transformers' conversion of a sentencepiece tokenizer.model (with the source's tokenizer_config.json and
    config.json, which name its class) to a tokenizer.json: (its bytes, "") or (None, why not). It reads
    copies of the already bounded files in a private directory, offline, with no remote code."""
    import tempfile

    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None, "transformers is not installed"
    with tempfile.TemporaryDirectory(prefix="rdepth-spm-") as tmp:
        for name, data in {**files, "config.json": config}.items():
            (Path(tmp) / name).write_bytes(data)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # (its fallbacks log tracebacks-worth of warnings before failing)
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, use_fast=True, trust_remote_code=False,
                                                      local_files_only=True)
            if not hasattr(tokenizer, "backend_tokenizer"):
                return None, f"transformers loaded it as {type(tokenizer).__name__}, not a fast tokenizer"
            saved = Path(tmp) / "converted"
            tokenizer.save_pretrained(str(saved))
            return read_bytes(saved / "tokenizer.json", TOKENIZER_MAX_BYTES, "tokenizer file"), ""
        except Exception as exc:  # (sentencepiece missing, a damaged model file: transformers raises many kinds)
            import importlib.util

            if importlib.util.find_spec("sentencepiece") is None:  # (then it tried tiktoken's format: a parse error)
                return None, "transformers needs the sentencepiece package for it, which is not installed"
            lines = str(exc).strip().splitlines()
            return None, f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        finally:
            hf_logging.set_verbosity(verbosity)
