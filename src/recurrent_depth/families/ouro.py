"""The Ouro (ByteDance LoopLM, arXiv 2510.25741) checkpoint dialect: its config.json keys and tensor names.

An Ouro directory (`ByteDance/Ouro-1.4B`, `-2.6B`) holds a Qwen2-style `config.json` (`model_type: "ouro"`,
plus `total_ut_steps` and `early_exit_threshold`) and safetensors with the reference's names. It loads
into our model (`OURO_ARCHITECTURE` in config.py: the whole stack looped `total_ut_steps` times, four
norms per block, `model.norm` after every step, the exit gate) with these renames, q/k/v and gate/up
fused by concatenating rows in that order (our `Wqkv` is [q | k | v], our `mlp.fc` is [gate | up]):

    model.embed_tokens.weight                             transformer.wte.weight
    model.layers.N.self_attn.{q,k,v}_proj.weight          transformer.core_block.N.attn.Wqkv.weight
    model.layers.N.self_attn.o_proj.weight                transformer.core_block.N.attn.proj.weight
    model.layers.N.mlp.{gate,up}_proj.weight              transformer.core_block.N.mlp.fc.weight
    model.layers.N.mlp.down_proj.weight                   transformer.core_block.N.mlp.proj.weight
    model.layers.N.input_layernorm.weight                 transformer.core_block.N.norm_1.weight
    model.layers.N.input_layernorm_2.weight               transformer.core_block.N.norm_2.weight
    model.layers.N.post_attention_layernorm.weight        transformer.core_block.N.norm_3.weight
    model.layers.N.post_attention_layernorm_2.weight      transformer.core_block.N.norm_4.weight
    model.norm.weight                                     transformer.ln_f.weight
    model.early_exit_gate.{weight,bias}                   transformer.exit_gate.{weight,bias}
    lm_head.weight                                        lm_head.weight (absent when tied)

A leaf module (it imports only `files`): `config` arguments are `ModelConfig`s, read by attribute only,
so that config.py can import this file without an import circle.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from recurrent_depth.files import clipped_names

if TYPE_CHECKING:  # config.py imports this module, and config imports no torch (`rdepth --version` stays light)
    import torch

OURO_MODEL_TYPE = "ouro"

# Keys the config translation reads (anything else is informational: ignored, with a warning when unknown).
SHAPE_KEYS: dict[str, str] = {  # required: Ouro key -> ModelConfig field
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "core_layers", "num_attention_heads": "num_heads",
}
OPTIONAL_KEYS: dict[str, tuple[str, Any]] = {  # Ouro key -> (ModelConfig field, the reference's default)
    "num_key_value_heads": ("num_kv_heads", None),  # None: = num_attention_heads
    "head_dim": ("head_dim", None),  # None: hidden_size // num_attention_heads
    "max_position_embeddings": ("max_seq_len", 32768),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "tie_word_embeddings": ("tie_embeddings", False),
    "early_exit_threshold": ("exit_gate_threshold", 1.0),
    "bos_token_id": ("bos_token_id", None),
    "eos_token_id": ("eos_token_id", None),
    "pad_token_id": ("pad_token_id", None),
}
# Read and checked here (what each means: `ouro_config_values`).
CHECKED_KEYS = ("hidden_act", "rope_theta", "rope_scaling", "rope_parameters", "total_ut_steps", "attention_dropout",
                "use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "early_exit_step")
# The reference's informational keys (weight init, an unused chunk size) on top of transformers' bookkeeping.
INFORMATIONAL_KEYS = frozenset({"initializer_range", "chunk_size"})
OURO_KEYS = frozenset(SHAPE_KEYS) | frozenset(OPTIONAL_KEYS) | frozenset(CHECKED_KEYS) | INFORMATIONAL_KEYS

# ModelConfig field -> the Ouro key it comes from (to name the file's key in an error).
OURO_KEY_FOR_FIELD: dict[str, str] = {
    **{field: key for key, field in SHAPE_KEYS.items()}, **{field: key for key, (field, _) in OPTIONAL_KEYS.items()},
    "mlp_activation": "hidden_act", "rope_base": "rope_theta", "rope_scaling": "rope_scaling",
    "mean_recurrence": "total_ut_steps", "mean_backprop_depth": "total_ut_steps", "attention_windows": "sliding_window",
}

# transformers' ACT2FN name -> our mlp_activation (the exact same function only).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
DEFAULT_UT_STEPS = 4  # the reference's getattr(config, "total_ut_steps", 4)


def is_ouro_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") == OURO_MODEL_TYPE


def ouro_config_values(data: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` field values (besides `OURO_ARCHITECTURE`) for an Ouro `config.json`.

    Sliding-window layers (`layer_types`, or use_sliding_window with max_window_layers, Qwen2's rule) set
    `attention_windows`. A key we cannot honour is a one-line ValueError naming it: sliding layers without a
    window, a rope type other than default / linear / llama3, an activation other than silu / gelu /
    gelu_pytorch_tanh / relu, attention dropout, a default `early_exit_step`. `total_ut_steps` (T) sets
    `mean_recurrence` and `mean_backprop_depth` (training backpropagates through all T steps, as Ouro was trained).
    """
    missing = [key for key in SHAPE_KEYS if key not in data]
    if missing:
        raise ValueError(f"Ouro config.json has no {missing}: every Ouro config states its shape")
    values: dict[str, Any] = {field: data[key] for key, field in SHAPE_KEYS.items()}
    for key, (field, default) in OPTIONAL_KEYS.items():
        values[field] = data.get(key, default)
    if values["num_kv_heads"] is None:
        values["num_kv_heads"] = values["num_heads"]

    act = data.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"Ouro config.json hidden_act={act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    values["mlp_activation"] = ACTIVATIONS[act]

    values["rope_base"], values["rope_scaling"] = _rope(data)

    steps = data.get("total_ut_steps", DEFAULT_UT_STEPS)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"Ouro config.json total_ut_steps={steps!r} is invalid: expected an integer >= 1")
    values["mean_recurrence"] = values["mean_backprop_depth"] = steps

    dropout = data.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise ValueError(f"Ouro config.json attention_dropout={dropout!r} is not supported: this library has no "
                         f"attention dropout (set it to 0.0; it acts in training only)")
    if data.get("early_exit_step") is not None:
        raise ValueError(f"Ouro config.json early_exit_step={data['early_exit_step']!r} is not supported: set it to "
                         f"null and choose the depth per call (num_steps, or the exit gate's threshold)")
    sliding = _sliding_layers(data, values["core_layers"])
    if sliding:  # (the reference's Qwen2 sliding mask: the last `sliding_window` keys, the query's own included)
        window = data.get("sliding_window", 4096) if data.get("use_sliding_window", False) else None
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"Ouro config.json: layers {sliding} use sliding-window attention (layer_types or "
                             f"max_window_layers) but use_sliding_window={data.get('use_sliding_window', False)!r} / "
                             f"sliding_window={data.get('sliding_window')!r} give no window >= 1 (the reference has "
                             f"none for them either)")
        values["attention_windows"] = [window if i in sliding else None for i in range(values["core_layers"])]
    return values


def _rope(data: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(rope_base, rope_scaling) from `rope_theta` and `rope_scaling` (transformers 4), or from transformers 5's
    `rope_parameters` ({"rope_type", "rope_theta", ...}); ModelConfig checks the scaling's fields."""
    params = data.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"Ouro config.json rope_parameters={params!r} is invalid: expected an object")
        base = params.get("rope_theta", data.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        base, scaling = data.get("rope_theta", 10000.0), data.get("rope_scaling")
    if scaling is None:
        return base, None
    if not isinstance(scaling, dict):
        raise ValueError(f"Ouro config.json rope_scaling={scaling!r} is invalid: expected null or an object")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return base, None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"Ouro config.json rope_scaling rope_type {kind!r} is not supported; supported: "
                         f"default, linear, llama3")
    return base, {"rope_type": kind, **{k: v for k, v in scaling.items() if k not in ("rope_type", "type")}}


def _sliding_layers(data: dict[str, Any], layers: Any) -> list[int]:
    """The layers the reference runs with a sliding window (Qwen2Config's rule when `layer_types` is absent:
    layers >= max_window_layers, if use_sliding_window and a window are set)."""
    use = data.get("use_sliding_window", False)
    if not isinstance(use, bool):  # (the string "false" is true to the reference: every layer would slide)
        raise ValueError(f"Ouro config.json use_sliding_window={use!r} is invalid: expected true or false")
    types = data.get("layer_types")
    if types is None:
        window = data.get("sliding_window", 4096) if use else None
        first = data.get("max_window_layers", 28)
        if window is None or not isinstance(layers, int):
            return []
        if not isinstance(first, int) or isinstance(first, bool):  # (was read as "no sliding layers")
            raise ValueError(f"Ouro config.json max_window_layers={first!r} is invalid: expected an integer (the "
                             f"first sliding layer)")
        return list(range(max(first, 0), layers))
    allowed = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or len(types) != layers or any(t not in allowed for t in types):
        raise ValueError(f"Ouro config.json layer_types must list {allowed[0]!r} or {allowed[1]!r} for each of the "
                         f"num_hidden_layers={layers!r} layers, got {types!r}")
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


# ------------------------------------------------------------------------------------------- tensor names
# Ours under `transformer.core_block.N.` <- the reference's under `model.layers.N.`, rows concatenated in order.
LAYER_SOURCES: dict[str, tuple[str, ...]] = {
    "attn.Wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
    "norm_1.weight": ("input_layernorm.weight",),
    "norm_2.weight": ("input_layernorm_2.weight",),
    "norm_3.weight": ("post_attention_layernorm.weight",),
    "norm_4.weight": ("post_attention_layernorm_2.weight",),
}
TOP_SOURCES: dict[str, str] = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.ln_f.weight": "model.norm.weight",
    "transformer.exit_gate.weight": "model.early_exit_gate.weight",
    "transformer.exit_gate.bias": "model.early_exit_gate.bias",
    "lm_head.weight": "lm_head.weight",
}
EMBEDDING = TOP_SOURCES["transformer.wte.weight"]
# RoPE buffers some exports carry: recomputed from the config, never read.
_ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")  # (a bounded index: names come from the file)


def tensor_sources(config: Any) -> dict[str, tuple[str, ...]]:
    """Our tensor name -> the Ouro tensors concatenated (rows) into it, for `config` (a ModelConfig)."""
    sources = {ours: (theirs,) for ours, theirs in TOP_SOURCES.items()}
    for n in range(config.core_layers):
        for ours, theirs in LAYER_SOURCES.items():
            sources[f"transformer.core_block.{n}.{ours}"] = tuple(f"model.layers.{n}.{name}" for name in theirs)
    return sources


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor an Ouro file of `config` holds, with its shape (`lm_head.weight` only when untied)."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,), "input_layernorm_2.weight": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm_2.weight": (h,),
    }
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
              "model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for n in range(config.core_layers):
        shapes.update({f"model.layers.{n}.{name}": shape for name, shape in layer.items()})
    return shapes


def translate_header(
    header: dict[str, tuple[str, tuple[int, ...]]], config: Any, floating: frozenset[str] | set[str], where: Any,
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The safetensors header entries of an Ouro directory, checked against `config` in the file's own names
    (one ValueError line: layer count, missing / unexpected / mis-shaped / non-float tensors), then renamed
    and fused into ours: {our name: (dtype, shape)}. `floating`: the safetensors dtype codes of float tensors.
    """
    header = {name: entry for name, entry in header.items() if not _ROTARY_BUFFER.search(name)}
    expected = expected_shapes(config)
    tied_head = config.tie_embeddings and "lm_head.weight" in header
    if tied_head:  # an extra copy of the tied head: the loader checks that it equals the embedding
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    problems = []
    layers = {int(m.group(1)) for name in header if (m := _LAYER.match(name))}
    if layers and len(layers) != config.core_layers:
        problems.append(f"config.json num_hidden_layers={config.core_layers} but the weights hold {len(layers)} layers")
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    mis_shaped = sorted(f"{name}: file {tuple(header[name][1])} vs config {expected[name]}"
                        for name in set(header) & set(expected) if tuple(header[name][1]) != expected[name])
    not_float = sorted(f"{name}: {header[name][0]}" for name in set(header) & set(expected)
                       if header[name][0] not in floating)
    for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected),
                        ("mis-shaped tensors", mis_shaped), ("tensors that are not floating point", not_float)):
        if names:
            problems.append(f"{what}: {clipped_names(names)}")
    if problems:
        raise ValueError(f"cannot load Ouro checkpoint {where}: " + "; ".join(problems))
    out = {}
    for ours, theirs in tensor_sources(config).items():
        if theirs[0] in header:
            entries = [header[name] for name in theirs]
            rows = sum(shape[0] for _, shape in entries)
            out[ours] = (entries[0][0], (rows, *entries[0][1][1:]))
    return out


def fuse_state(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """An Ouro state dict (checked by `translate_header`) under our names, q/k/v and gate/up concatenated by rows.

    Takes the tensors out of `state` as it goes, so each layer's parts are freed once fused."""
    import torch

    out = {}
    for ours, theirs in tensor_sources(config).items():
        if theirs[0] not in state:
            continue  # a tied head stored once
        parts = [state.pop(name) for name in theirs]
        out[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out
