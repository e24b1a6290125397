"""A stand-in for Ouro's `configuration_ouro.OuroConfig`, used only by `record.py` in a scratch environment.

The reference `modeling_ouro.py` imports `.configuration_ouro.OuroConfig`, which the repository it was
taken from does not ship. This class holds the fields that modeling file reads, with the defaults the
released OuroConfig is reported to carry (Qwen2Config's, since Ouro's config is derived from Qwen2's;
see README.md in this directory for where each field and default comes from). It is never imported by
the library or its tests: it needs transformers 4.x and is loaded only through `record.py`.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.configuration_utils import layer_type_validation
from transformers.modeling_rope_utils import rope_config_validation


class OuroConfig(PretrainedConfig):
    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = 32,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = 4096,
        max_window_layers: int = 28,
        layer_types: list[str] | None = None,
        attention_dropout: float = 0.0,
        total_ut_steps: int = 4,
        early_exit_threshold: float | None = 1.0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # Qwen2's rule: the window exists only when use_sliding_window is set.
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window if use_sliding_window else None
        self.max_window_layers = max_window_layers
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        # The modeling file reads getattr(config, "head_dim", hidden // heads): never leave it None.
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.attention_dropout = attention_dropout
        # Backward compatibility, as in Qwen2Config: a rope_scaling "type" is also its "rope_type".
        if self.rope_scaling is not None and "type" in self.rope_scaling:
            self.rope_scaling["rope_type"] = self.rope_scaling["type"]
        rope_config_validation(self)
        self.layer_types = layer_types
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if self.sliding_window is not None and i >= max_window_layers else "full_attention"
                for i in range(num_hidden_layers)
            ]
        layer_type_validation(self.layer_types, num_hidden_layers)
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
