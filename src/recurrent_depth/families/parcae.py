"""Parcae checkpoints (arXiv 2604.12946, github.com/sandyresearch/parcae) in this library's terms.

A Parcae model directory holds `config.json` (a `ParcaeConfig` saved by `parcae_lm`: its dataclass fields
plus `_class_name`) and its `state_dict`. `parcae_config_values` turns the config into `ModelConfig`
field values, with a one-line error for every setting this library cannot run; `parcae_state_dict` renames
(and fuses) the tensors, `parcae_header` their header entries. `checkpoint` uses them, so a Parcae
directory with safetensors weights loads like any other model directory (docs/looped-family.md, "Parcae").

Nothing here imports `config` (which calls `parcae_config_values`): values in, values out.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PARCAE_CLASS = "ParcaeConfig"
# float32's machine epsilon, torch.finfo(torch.float32).eps: Parcae's QK-norm is `F.rms_norm(x, (D,))`,
# whose eps=None means this in fp32.
FP32_EPS = 2.0**-23

# The ParcaeConfig defaults of every key read here (parcae_lm/models/config.py, models/parcae/config.py),
# for a config.json that leaves one out. A file saved by parcae_lm holds them all.
DEFAULTS: dict[str, Any] = {
    "block_size": 4096, "n_embd": 4096, "intermediate_size": None, "num_attention_heads": 32,
    "num_key_value_heads": None, "vocab_size": 50254, "padding_multiple": 512, "padded_vocab_size": None,
    "rope_settings": {}, "use_abacus": False, "block_class_name": "TransformerPreNormBlock",
    "norm_class_name": "LayerNorm", "norm_eps": 1e-5, "mlp_class_name": "BaseMLP", "nonlin_name": "GELU",
    "bias": False, "qk_bias": False, "init_strategy": "scaled", "mup_model_scaling_factor": 1,
    "use_fused_head": "pytorch", "clip_qkv": None, "qk_norm": False, "logit_softcap": None,
    "injection_type": "diagonal", "n_layers_in_recurrent_block": 4, "n_layers_in_prelude": 1,
    "n_layers_in_coda": 1, "state_init": "like-init", "recurrent_embedding_dimension": 1024,
    "recurrent_intermediation_embedding_dimension": 3520, "recurrent_num_attention_heads": None,
    "prelude_norm": False, "mean_recurrence": 32, "mean_backprop_depth": 8, "tie_embeddings": False,
    "simple_ops": False,
}
INJECTIONS = {"diagonal": "diagonal", "linear": "concat", "add": "add"}
# Parcae's nonlinearity names (torch.nn classes, or its ReLU2 = relu(x)^2 / 2) -> ModelConfig.mlp_activation.
ACTIVATIONS = {"ReLU2": "relu2_half", "GELU": "gelu", "SiLU": "silu", "ReLU": "relu"}
MLPS = {"BaseMLP": False, "GatedMLP": True}  # -> ModelConfig.mlp_gated
# Init strategies whose logit scale is 1 and whose embedding std is sqrt(2 / 5h) (parcae_lm/utils/init.py's
# table) -> whether they scale the embedding by sqrt(h) ("takase"). The others scale logits or embeddings
# in ways ModelConfig has no field for.
INIT_STRATEGIES = {"scaled": False, "scaled-zero": False, "scaled-geiping": False, "scaled-stuck": False,
                   "small": False, "takase": True}
# Settings of training, monitoring or the kernels used: they do not change what a forward computes.
TRAINING_KEYS = frozenset({
    "name", "hf_config", "randomize_positions_from", "attn_impl", "init_orthogonal", "skip_initialization",
    "debias_attention", "center_attention", "activation_checkpoint_impl", "strategy", "sampling_scheme",
    "lockstep_n", "lockstep_k", "curriculum_target", "recurrent_iteration_method", "model_class_name",
    "_is_recurrent_block_config", "_class_name", "init",
})


def is_parcae_config(data: dict[str, Any]) -> bool:
    """A Parcae `config.json`: it names its class, or has Parcae's injection and recurrent width."""
    return data.get("_class_name") == PARCAE_CLASS or ("injection_type" in data
                                                        and "recurrent_embedding_dimension" in data)


def has_value_embedding(layer: int, layers: int) -> bool:
    """Parcae's (nanochat's) rule for the layers that hold one: every other layer, the last included."""
    return layer % 2 == (layers - 1) % 2


def value_embedding_layers(prelude: int, core: int, coda: int, mean_recurrence: int,
                           backprop_depth: int) -> list[int]:
    """The unique layers (0-based over prelude, core, coda) whose value embedding Parcae applies.

    Parcae builds a table `value_embeds.{i}` for the layers `has_value_embedding(i, P + R + C)`, and a gate
    `attn.ve_gate` in the blocks `has_value_embedding(layer_id, R * mean_backprop_depth)`, where a block's
    layer_id is i in the prelude, P + j in the core and P + R * mean_recurrence + c in the coda
    (models/parcae/parcae.py:44-73, modules/mixer.py:18-47). A layer uses its embedding only when it has both.
    """
    unique = prelude + core + coda
    gates = backprop_depth * core  # ParcaeConfig.n_layer
    layer_ids = [*range(prelude), *(prelude + j for j in range(core)),
                 *(prelude + core * mean_recurrence + c for c in range(coda))]
    return [i for i, layer_id in enumerate(layer_ids)
            if has_value_embedding(i, unique) and has_value_embedding(layer_id, gates)]


def parcae_config_values(data: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig field values for a Parcae `config.json`; a one-line ValueError for what we cannot run."""
    v = {**DEFAULTS, **data}
    if v.get("_class_name", PARCAE_CLASS) != PARCAE_CLASS:
        raise ValueError(f"config.json: _class_name={v['_class_name']!r}; only Parcae's looped models "
                         f"({PARCAE_CLASS}) load here")

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"Parcae config.json: {key}={v.get(key)!r} is not supported: {why}")

    h, heads = v["n_embd"], v["num_attention_heads"]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (h, heads)):
        refuse("n_embd", "n_embd and num_attention_heads must be integers > 0")
    intermediate = v["intermediate_size"] if v["intermediate_size"] is not None else 4 * h
    kv_heads = v["num_key_value_heads"] if v["num_key_value_heads"] is not None else heads
    cap = v["logit_softcap"]
    checks = [
        ("mup_model_scaling_factor", v["mup_model_scaling_factor"] == 1, "muP width scaling is not implemented"),
        ("recurrent_embedding_dimension", v["recurrent_embedding_dimension"] == h,
         f"the recurrent state must be as wide as the model (n_embd={h})"),
        ("recurrent_intermediation_embedding_dimension",
         v["recurrent_intermediation_embedding_dimension"] == intermediate,
         f"the core's MLP must be as wide as the other blocks' (intermediate_size={intermediate})"),
        ("recurrent_num_attention_heads", v["recurrent_num_attention_heads"] in (None, heads),
         f"the core must have the other blocks' {heads} heads"),
        ("num_key_value_heads", kv_heads == heads,
         "Parcae's core always has one kv head per head, so every block must (grouped-query attention only "
         "outside the core has no ModelConfig field)"),
        ("block_class_name", v["block_class_name"] == "TransformerPreNormBlock", "only pre-norm blocks"),
        ("norm_class_name", v["norm_class_name"] == "RMSNorm" and not v["simple_ops"], "only RMSNorm"),
        ("mlp_class_name", v["mlp_class_name"] in MLPS, f"one of {sorted(MLPS)}"),
        ("nonlin_name", v["nonlin_name"] in ACTIVATIONS, f"one of {sorted(ACTIVATIONS)}"),
        ("injection_type", v["injection_type"] in INJECTIONS, f"one of {sorted(INJECTIONS)}"),
        ("init_strategy", v["init_strategy"] in INIT_STRATEGIES,
         f"it scales logits or embeddings differently; supported: {sorted(INIT_STRATEGIES)}"),
        ("logit_softcap", cap is None or (isinstance(cap, int | float) and not isinstance(cap, bool)
                                          and math.isfinite(cap) and cap > 0),
         "it must be null or a finite number > 0 (the tanh cap)"),
        ("clip_qkv", v["clip_qkv"] is None, "no q/k/v clipping"),
        ("use_abacus", not v["use_abacus"], "no Abacus embeddings"),
        ("use_fused_head", v["use_fused_head"] != "full-triton" or v["tie_embeddings"],
         "an untied full-triton head stores its weight transposed"),
        ("state_init", v["state_init"] in ("like-init", "zero"),
         "s_0 must be 'like-init' (a truncated normal) or 'zero'"),
    ]
    for key, ok, why in checks:
        if not ok:
            refuse(key, why)
    rope = v["rope_settings"] if isinstance(v["rope_settings"], dict) else {}
    if not rope.get("use_rope", True):
        refuse("rope_settings", "models without RoPE")
    condense = rope.get("rope_condense_ratio", 1)
    embedding_scale = INIT_STRATEGIES[v["init_strategy"]]
    # like-init: s_0 ~ TruncNormal(0, 2/(5h), ±3 sigma) times the embedding scale; ours draws sqrt(2/(5h)) *
    # init_scale * sqrt(h), so init_scale = 1 with the sqrt(h) scale (Huginn's) and 1/sqrt(h) without.
    init_scale = 0.0 if v["state_init"] == "zero" else (1.0 if embedding_scale else 1 / math.sqrt(h))
    vocab = v["padded_vocab_size"]
    if vocab is None:
        multiple = v["padding_multiple"]
        vocab = -(-v["vocab_size"] // multiple) * multiple
    prelude, core, coda = v["n_layers_in_prelude"], v["n_layers_in_recurrent_block"], v["n_layers_in_coda"]
    mean, backprop = v["mean_recurrence"], v["mean_backprop_depth"]
    layer_counts = (prelude, core, coda, mean, backprop)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layer_counts):
        refuse("n_layers_in_prelude", "layer counts, mean_recurrence and mean_backprop_depth must be integers >= 0")
    unknown = sorted(set(data) - set(DEFAULTS) - TRAINING_KEYS)
    if unknown:
        raise ValueError(f"Parcae config.json: unknown keys {unknown}")
    return dict(
        vocab_size=vocab, hidden_size=h, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=intermediate,
        prelude_layers=prelude, core_layers=core, coda_layers=coda, mean_recurrence=mean,
        mean_backprop_depth=backprop, max_seq_len=v["block_size"], rope_base=float(rope.get("rope_base", 50_000)),
        rope_scaling=None if condense == 1 else {"rope_type": "linear", "factor": float(condense)},
        norm_eps=v["norm_eps"], qk_bias=v["qk_bias"], bias=v["bias"], tie_embeddings=v["tie_embeddings"],
        qk_norm=v["qk_norm"], qk_norm_eps=FP32_EPS if v["qk_norm"] else None, init_scale=init_scale,
        block_layout="pre-norm", rope_style="interleaved", mlp_gated=MLPS[v["mlp_class_name"]],
        mlp_activation=ACTIVATIONS[v["nonlin_name"]], embedding_scale=embedding_scale, norm_before_coda=False,
        final_norm=True, injection=INJECTIONS[v["injection_type"]], state_init="random",
        prelude_norm=v["prelude_norm"], coda_projection=True,
        value_embeddings=value_embedding_layers(prelude, core, coda, mean, backprop),
        # Parcae caps the fp32 logits (after its logit scale, 1 for the strategies above) as cap * tanh(x / cap)
        # (models/parcae/parcae.py:210-212, 230-232): the formula of our `head`
        final_logit_softcapping=None if cap is None else float(cap),
    )


def parcae_state_dict(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Parcae's tensors under our names (for a `config` from `parcae_config_values`): see `rename`."""
    import torch  # here, not above: `config` imports this module and stays free of torch

    return rename(state, config, torch.cat, lambda like: torch.ones(config.head_dim, dtype=like.dtype))


HeaderEntry = tuple[str, tuple[int, ...]]  # (safetensors dtype, shape)


def parcae_header(header: dict[str, HeaderEntry], config: Any) -> dict[str, HeaderEntry]:
    """The same renaming on safetensors header entries {name: (dtype, shape)}, to check a directory
    before any tensor is read."""
    def cat(entries: list[HeaderEntry]) -> HeaderEntry:
        return entries[0][0], (sum(e[1][0] for e in entries), *entries[0][1][1:])

    return rename(header, config, cat, lambda like: (like[0], (config.head_dim,)))


def rename(entries: dict[str, Any], config: Any, cat: Any, gain_of_one: Any) -> dict[str, Any]:
    """Parcae names -> ours, for tensors or header entries (`cat` joins a list of them along rows,
    `gain_of_one(like)` makes a QK-norm gain like the entry given).

    Per block: attn.c_q / c_k / c_v fused into attn.Wqkv (rows [q | k | v]), attn.c_proj -> attn.proj,
    norm_2 -> norm_3 (a pre-norm block's second norm), QK-norm gains of one (Parcae's has none); per used
    value embedding, `value_embeds.{i}` and the block's `attn.ve_gate` -> that block's `attn.value_embed` /
    `attn.ve_gate`; transformer.C -> transformer.coda_projection; a linear injection's
    transformer.adapter.adapter -> transformer.adapter. Dropped: the RoPE table `freqs_cis` (recomputed)
    and the value-embedding tables and gates Parcae builds but never applies. Anything else unknown is
    kept, for the loader to report.
    """
    prefixes = ["module.", "_orig_mod.", "model."]  # what parcae_lm's own loader strips (receval/models/parcae.py)
    cleaned: dict[str, Any] = {}
    for name, entry in entries.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
        cleaned[name] = entry
    cleaned.pop("freqs_cis", None)
    parts = [("prelude", config.prelude_layers), ("core_block", config.core_layers), ("coda", config.coda_layers)]
    blocks = [f"transformer.{part}.{i}" for part, count in parts for i in range(count)]
    out: dict[str, Any] = {}
    for index, block in enumerate(blocks):
        attn = f"{block}.attn"
        for suffix in ("weight", "bias"):
            qkv = [cleaned.pop(f"{attn}.c_{x}.{suffix}", None) for x in "qkv"]
            if all(e is not None for e in qkv):
                out[f"{attn}.Wqkv.{suffix}"] = cat(qkv)
            else:  # leave what is there under its own name: the loader names what is missing
                out.update({f"{attn}.c_{x}.{suffix}": e for x, e in zip("qkv", qkv, strict=True) if e is not None})
            if f"{attn}.c_proj.{suffix}" in cleaned:
                out[f"{attn}.proj.{suffix}"] = cleaned.pop(f"{attn}.c_proj.{suffix}")
        wte = cleaned.get("transformer.wte.weight")
        if config.qk_norm and wte is not None:  # Parcae's QK-norm has no gain: ours at one
            for norm in ("q_norm", "k_norm"):
                out[f"{attn}.{norm}.weight"] = gain_of_one(wte)
        if f"{block}.norm_2.weight" in cleaned:
            out[f"{block}.norm_3.weight"] = cleaned.pop(f"{block}.norm_2.weight")
        table, gate = cleaned.pop(f"value_embeds.{index}.weight", None), cleaned.pop(f"{attn}.ve_gate.weight", None)
        if index in config.value_embeddings:
            for name, entry in ((f"{attn}.value_embed.weight", table), (f"{attn}.ve_gate.weight", gate)):
                if entry is not None:
                    out[name] = entry
    renames = {"transformer.C.": "transformer.coda_projection.", "transformer.adapter.adapter.": "transformer.adapter."}
    for name, entry in cleaned.items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        out[name] = entry
    return out
