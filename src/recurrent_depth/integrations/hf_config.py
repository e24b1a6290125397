"""transformers configs for our checkpoints (``recurrent_depth``), official Huginn-0125 ones (``huginn_raven``)
and Ouro's (``ouro``).

Each is a thin `PretrainedConfig` subclasses whose fields are the file's own keys, so a config
saved by transformers reads back with `ModelConfig.from_json` and vice versa. Each converts to
the library's `ModelConfig` with :meth:`to_model_config`, which also validates it (a bad value
raises a `ValueError` naming the field). The runtime defaults that lm-eval's ``hf`` backend
overrides through ``--model_args`` live here: ``mean_recurrence`` (the depth used when
``num_steps`` is not given), ``init_scale`` and ``max_position_embeddings`` (the context).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from types import MappingProxyType
from typing import Any

from transformers import PretrainedConfig

from recurrent_depth.config import HUGINN_KEY_MAP, HUGINN_MODEL_TYPE, MODEL_TYPE, ModelConfig
from recurrent_depth.families.ouro import OURO_KEYS, OURO_MODEL_TYPE
from recurrent_depth.model.depth import SCHEMES

# Keys transformers writes into every config.json; `ModelConfig.from_dict` ignores them.
_HF_BOOKKEEPING = ("model_type", "architectures", "transformers_version", "dtype", "auto_map", "use_cache")
# A sequence classifier's config keys (ModelConfig ignores them), and transformers' default labels (num_labels=2).
_CLASSIFIER_KEYS = ("id2label", "label2id", "problem_type")
_DEFAULT_ID2LABEL = {0: "LABEL_0", 1: "LABEL_1"}
# Outputs the Trainer leaves out of its predictions (what `compute_metrics` gets is then the logits, as for any
# causal LM, not a tuple with the cache and the latent states).
_INFERENCE_EXTRAS = ["cache", "past_key_values", "latent_states", "final_state"]
# The depth a training-mode forward runs when it is given no num_steps (what trl's and transformers' trainers do):
# `depth_scheme` on the config, a runtime setting (unlike `init_scale`, not written to config.json).
DEFAULT_DEPTH_SCHEME = "poisson-lognormal"


def check_depth_scheme(value: Any) -> str:
    """`value` if it names a depth scheme (`recurrent_depth.model.depth.SCHEMES`), else a one-line error."""
    if value not in SCHEMES:
        raise ValueError(f"config.depth_scheme={value!r} is invalid: expected one of {', '.join(SCHEMES)}")
    return value


def check_config_file(path: Any) -> None:
    """For a local model directory (or config file): the library's bounded read of its config.json
    (a regular file of at most CONFIG_MAX_BYTES, JSON nested at most so deep), one line otherwise.
    Runs before transformers reads the file in our configs' `from_pretrained`."""
    from pathlib import Path

    from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

    try:
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        elif not os.path.lexists(file):
            return  # a hub name: transformers resolves (and downloads) it
    except (TypeError, ValueError):
        return
    if os.path.lexists(file):
        read_json(file, CONFIG_MAX_BYTES, "config file")


class _CheckedConfigFile:
    """What our config classes share: `from_pretrained` reads a local config.json bounded first, and
    `from_dict` validates (through `to_model_config`) after transformers has applied its overrides."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        check_config_file(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """transformers applies `from_pretrained(..., field=value)` overrides after `__init__`: validate again."""
        out = super().from_dict(config_dict, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        config.to_model_config()
        check_depth_scheme(getattr(config, "depth_scheme", DEFAULT_DEPTH_SCHEME))
        return out


class RecurrentDepthConfig(_CheckedConfigFile, PretrainedConfig):
    """Our `config.json` (the fields of `ModelConfig`) as a transformers config.

    Aliases for transformers' standard names: ``max_position_embeddings`` -> ``max_seq_len``,
    ``num_attention_heads`` -> ``num_heads``, ``num_key_value_heads`` -> ``num_kv_heads``,
    ``tie_word_embeddings`` -> ``tie_embeddings``; ``num_hidden_layers`` is prelude + core + coda.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = _INFERENCE_EXTRAS
    attribute_map = {
        "max_position_embeddings": "max_seq_len",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "tie_word_embeddings": "tie_embeddings",
    }
    # No remote code (a class attribute, not a field: never written). trl reads `config.auto_map` for an
    # architecture name transformers does not export (AttributeError without it).
    auto_map = MappingProxyType({})

    vocab_size: int = 256
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
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
    qk_norm: bool = False
    qk_norm_per_head: bool = False
    bias: bool = False
    tie_embeddings: bool = True
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    mixer: Any = "attention"
    mixer_options: dict = field(default_factory=dict)
    mup_base_width: int | None = None
    mup_base_head_dim: int | None = None
    attn_scale: str | None = None
    block_layout: str = "sandwich"
    rope_style: str = "interleaved"
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    qk_norm_full_width: bool = False
    mlp_activation: str = "silu"
    embedding_scale: bool = True
    norm_before_coda: bool = True
    final_norm: bool = True
    step_norm: bool = False
    injection: str = "concat"
    state_init: str = "random"
    exit_gate: bool = False
    exit_gate_threshold: float | None = None
    mlp_gated: bool = True
    qk_norm_eps: float | None = None
    prelude_norm: bool = False
    coda_projection: bool = False
    value_embeddings: list[int] = field(default_factory=list)
    attention_windows: list = field(default_factory=list)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_rope_bases: list = field(default_factory=list)
    transformers_rounding: bool = False
    norm_unit_offset: bool = False
    norm_float32_gain: bool = False
    eager_attention: bool = False
    use_cache: bool = True
    # Training mode without num_steps: "poisson-lognormal" (the paper's randomized depth around mean_recurrence),
    # "fixed" (mean_recurrence steps) or "uniform"; gradients through the last mean_backprop_depth steps. Not saved.
    depth_scheme: str = DEFAULT_DEPTH_SCHEME

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        check_depth_scheme(self.depth_scheme)
        resolved = self.to_model_config()  # validates, and fills num_kv_heads / head_dim
        self.num_kv_heads = resolved.num_kv_heads
        self.head_dim = resolved.head_dim
        if not self.architectures:  # the library's config.json has none; trl's model loading indexes it (DPO's
            # reference model: TypeError on None)
            self.architectures = ["RecurrentDepthForCausalLM"]

    @property
    def num_hidden_layers(self) -> int:
        return self.prelude_layers + self.core_layers + self.coda_layers

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs: Any) -> RecurrentDepthConfig:
        values = config.to_dict()
        values.pop("model_type")
        return cls(**values, **kwargs)

    def to_model_config(self) -> ModelConfig:
        names = [f.name for f in dataclasses.fields(ModelConfig)]
        return ModelConfig(**{name: getattr(self, name) for name in names})

    def to_dict(self) -> dict[str, Any]:
        """Our fields plus transformers' bookkeeping keys: what `ModelConfig.from_json` reads back."""
        full = super().to_dict()
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        out = {k: v for k, v in full.items() if k in names or k in _HF_BOOKKEEPING}
        # a sequence classifier's labels (hf_seq_cls.py), when set: its num_labels reads back from id2label
        if full.get("problem_type") is not None or full.get("id2label") != _DEFAULT_ID2LABEL:
            out.update((k, full[k]) for k in _CLASSIFIER_KEYS if k in full)
        return out


# Huginn keys stored as is; defaults are the official Huginn-0125 values.
_HUGINN_DEFAULTS: dict[str, Any] = {
    "n_embd": 5280, "n_heads": 55, "n_layers": 8, "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "mean_recurrence": 32,
    "mean_backprop_depth": 8, "block_size": 4096, "vocab_size": 65536, "padded_vocab_size": 65536,
    "intermediate_size": 17920, "bias": False, "qk_bias": True, "tie_embeddings": True,
    "norm_eps": 1e-6, "rope_base": 50_000.0,
}


class HuginnRavenConfig(_CheckedConfigFile, PretrainedConfig):
    """The official Huginn-0125 `config.json` (model type ``huginn_raven``), keys kept as the file has them.

    Informational keys of the official file (``norm_class_name``, ``state_init``, ...) are kept as
    attributes and written back on save. ``init_scale`` is ours (the official code passes it to
    ``forward`` only); its default 1.0 is the official behaviour (a random initial state).
    """

    model_type = HUGINN_MODEL_TYPE
    keys_to_ignore_at_inference = _INFERENCE_EXTRAS
    attribute_map = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "block_size",
        "tie_word_embeddings": "tie_embeddings",
    }

    n_embd: int = 5280
    n_heads: int = 55
    n_layers: int = 8
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    block_size: int = 4096
    vocab_size: int = 65536
    padded_vocab_size: int | None = None
    intermediate_size: int = 17920
    bias: bool = False
    qk_bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    rope_base: float = 50_000.0
    init_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: Any = None
    pad_token_id: int | None = None
    use_cache: bool = True
    depth_scheme: str = DEFAULT_DEPTH_SCHEME  # as RecurrentDepthConfig's (not written to config.json)

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        check_depth_scheme(self.depth_scheme)
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        resolved = self.to_model_config()  # validate now, not at the first forward
        # The official file hard-codes its special tokens; ModelConfig knows them (65504/65505/65509).
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(resolved, name))

    def huginn_dict(self) -> dict[str, Any]:
        """The keys `ModelConfig` understands, in the official file's naming."""
        out = {key: getattr(self, key) for key in _HUGINN_DEFAULTS}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if isinstance(value, list | tuple) and key != "eos_token_id":  # bos / pad: the model needs one
                value = value[0] if value else None
            if value is not None:
                out[key] = value
        return {k: v for k, v in out.items() if k in HUGINN_KEY_MAP or k == "vocab_size"}

    def to_dict(self) -> dict[str, Any]:
        """The official keys; without `auto_map`, whose remote-code files are not saved with us."""
        out = super().to_dict()
        out.pop("auto_map", None)
        out.pop("depth_scheme", None)  # (a runtime setting, not the official file's)
        return out

    def to_model_config(self) -> ModelConfig:
        values = self.huginn_dict()
        values["model_type"] = HUGINN_MODEL_TYPE
        config = ModelConfig.from_dict(values)
        config.init_scale = self.init_scale
        config.validate()
        return config


class OuroConfig(_CheckedConfigFile, PretrainedConfig):
    """An Ouro `config.json` (model type ``ouro``: ByteDance's Ouro-1.4B / -2.6B), keys kept as the file has them.

    The defaults are the reference config class's (Qwen2's, plus `total_ut_steps` 4 and
    `early_exit_threshold` 1.0: tests/goldens/ouro/README.md). `to_model_config` translates it through
    `recurrent_depth.families.ouro`, refusing what the library cannot run (a rope type, ...) with one
    line naming the key. A model loaded from it is ours (`OuroForCausalLM` in hf.py), with our config.
    """

    model_type = OURO_MODEL_TYPE

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    attention_dropout: float = 0.0
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: Any = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.to_model_config()  # validate now, not at the first forward

    def ouro_dict(self) -> dict[str, Any]:
        """The keys the Ouro translation reads, as this config holds them."""
        values = {key: getattr(self, key) for key in sorted(OURO_KEYS) if hasattr(self, key)}
        values["model_type"] = OURO_MODEL_TYPE
        return values

    def to_model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.ouro_dict())


def register_configs() -> None:
    """`AutoConfig.register` for every model type (idempotent)."""
    from transformers.models.auto.configuration_auto import AutoConfig

    AutoConfig.register(MODEL_TYPE, RecurrentDepthConfig, exist_ok=True)
    AutoConfig.register(HUGINN_MODEL_TYPE, HuginnRavenConfig, exist_ok=True)
    AutoConfig.register(OURO_MODEL_TYPE, OuroConfig, exist_ok=True)
