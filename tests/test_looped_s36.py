"""Retrofit sources whose config.json leaves out num_key_value_heads (families/retrofit.py, model_config).

transformers reads an absent num_key_value_heads as its config class's default (MistralConfig 8, Qwen3Config 32,
Gemma2Config 4), not as num_attention_heads (Llama's, Phi-3's and OLMo-2's rule, and every class's for null): such a
checkpoint was refused as a tensor-shape mismatch although transformers loads it.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from recurrent_depth.families.retrofit import retrofit

# num_attention_heads chosen so that transformers' default KV-head count is a proper divisor of it
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3, max_position_embeddings=32)
SOURCES = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, num_attention_heads=16, num_key_value_heads=8,
                                                        head_dim=4, sliding_window=None)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**{**SHAPE, "hidden_size": 64}, num_attention_heads=64,
                                                  num_key_value_heads=32, head_dim=4)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**SHAPE, num_attention_heads=8, num_key_value_heads=4,
                                                     head_dim=4, query_pre_attn_scalar=4)),
}


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_config_without_num_key_value_heads_gets_transformers_default(tmp_path, name):
    torch.manual_seed(0)
    source = SOURCES[name]()
    with torch.no_grad():
        for p in source.parameters():  # (norm gains off 1: a misplaced tensor shows)
            p.add_(0.3 * torch.randn_like(p))
    source.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # the default, not the heads
    model = retrofit(tmp_path, prelude=1, core=(1, 2), coda=1)
    assert model.config.num_kv_heads == hf.config.num_key_value_heads
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_every_supported_type_reads_an_absent_num_key_value_heads_as_transformers_does():
    """The same for each supported model type, from the config alone (no weights): ours equals what transformers'
    config class reads from the same config.json."""
    from transformers import CONFIG_MAPPING

    from recurrent_depth.families.retrofit import SUPPORTED_MODEL_TYPES, Surgery, model_config

    for model_type in SUPPORTED_MODEL_TYPES:
        hf = {**SHAPE, "hidden_size": 256, "num_attention_heads": 64, "head_dim": 4, "model_type": model_type}
        want = CONFIG_MAPPING[model_type].from_dict(hf).num_key_value_heads
        assert model_config(hf, Surgery(1, (1, 2), 1)).num_kv_heads == want, model_type
    # a default that does not divide the heads (transformers cannot build that model either) is named as such
    hf = {**SHAPE, "num_attention_heads": 2, "head_dim": 16, "model_type": "gemma2", "query_pre_attn_scalar": 16}
    with pytest.raises(ValueError, match=r"^retrofit: num_key_value_heads is missing, and transformers' gemma2 "
                                         r"default, 4, does not divide num_attention_heads=2: set it in config.json$"):
        model_config(hf, Surgery(1, (1, 2), 1))
