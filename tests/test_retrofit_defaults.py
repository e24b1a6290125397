"""Retrofit of a config.json that leaves keys out, read as transformers reads the same directory.

max_position_embeddings: transformers' config class fills its default (LlamaConfig's 2048, ...), which its llama3
RoPE and its sliding-window check read; ours refused the directory naming our own field (ModelConfig.max_seq_len).
bos / eos / pad_token_id: transformers' `model.config` shows the class defaults too (LlamaConfig's eos 2, Gemma's 1,
Phi-3's 32000, OLMo-2's 50279), but its `generate` reads generation_config.json, or without one config.json as it
stands: where the key is absent it never stops. Ours keeps config.json's own ids, so it stops where transformers'
generate stops (filling the class defaults would end the row at the first such token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from recurrent_depth.families.retrofit import Surgery, model_config, retrofit
from recurrent_depth.inference.generate import generate
from tests import test_fuzz_retrofit_found as found

SHAPE = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


def test_a_llama3_rope_without_max_position_embeddings_takes_transformers_default(tmp_path):
    """Neither max_position_embeddings nor original_max_position_embeddings: transformers scales from LlamaConfig's
    2048 (was refused: "ModelConfig.max_seq_len=None is invalid")."""
    def edit(config: dict) -> None:
        config.pop("max_position_embeddings")
        config["rope_parameters"] = {**found.LLAMA3, "rope_theta": 10000.0}

    found.assert_equals_transformers(tmp_path, found.llama(), edit)
    assert retrofit(tmp_path, prelude=1, core=(1, 2), coda=0).config.max_seq_len == \
        CONFIG_MAPPING["llama"]().max_position_embeddings


@pytest.mark.parametrize("model_type", ["llama", "mistral", "phi3", "qwen2", "qwen3", "olmo2", "gemma", "gemma2",
                                        "gemma3_text"])
def test_every_type_without_max_position_embeddings_takes_its_config_class_default(model_type):
    """(Mistral's default window 4096 stays a window under MistralConfig's 131072 positions.)"""
    config_class = CONFIG_MAPPING[model_type]
    hf = config_class(**SHAPE, vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0).to_dict()
    del hf["max_position_embeddings"]
    cfg = model_config(hf, Surgery(1, (1, 2), 0))
    assert cfg.max_seq_len == config_class().max_position_embeddings
    if model_type == "mistral":
        assert cfg.attention_windows == [4096, 4096]


@pytest.mark.parametrize("value", [None, 0, "2048", True])
def test_a_max_position_embeddings_without_a_context_length_names_the_sources_key(value):
    hf = CONFIG_MAPPING["llama"](**SHAPE, vocab_size=96).to_dict()
    hf["max_position_embeddings"] = value
    with pytest.raises(ValueError) as info:
        model_config(hf, Surgery(1, (1, 2), 0))
    assert str(info.value) == (f"retrofit: max_position_embeddings={value!r} is invalid: expected an integer >= 1, "
                               f"the context length (transformers' LlamaConfig default, 2048, applies only where the "
                               f"key is absent)")


# the supported types whose config class has an eos default (Qwen2's and Qwen3's is None: nothing to fill)
EOS_DEFAULT_TYPES = ["llama", "mistral", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("keys", ["absent", "present"])
@pytest.mark.parametrize("model_type", EOS_DEFAULT_TYPES)
def test_greedy_generate_stops_where_transformers_generate_stops(tmp_path, model_type, keys):
    """A directory without generation_config.json whose config.json lacks the special ids (absent: neither stops)
    or sets them to the class defaults (present: both stop at eos); its first greedy token is made the class's eos."""
    defaults = CONFIG_MAPPING[model_type]()
    eos = defaults.eos_token_id
    vocab = max(96, max(i for i in (defaults.bos_token_id, eos, defaults.pad_token_id) if i is not None) + 8)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**SHAPE, vocab_size=vocab)).float().eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (1, 5), generator=gen)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        logits = hf(ids).logits[0, -1]
        first = int(logits.argmax())  # the eos row becomes this row, scaled so that its logit beats it
        head = hf.get_output_embeddings().weight
        head[eos] = head[first] * (1.5 if logits[first] > 0 else 0.5)
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    for key in SPECIAL_IDS:
        config.pop(key, None)
        if keys == "present":
            config[key] = getattr(defaults, key)
    (tmp_path / "config.json").write_text(json.dumps(config))

    theirs = AutoModelForCausalLM.from_pretrained(Path(tmp_path)).float().eval()
    with torch.no_grad():
        want = theirs.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist()
    assert want[5] == eos  # (the test's teeth: a row that stops at eos ends there)
    assert len(want) == (6 if keys == "present" else 11)
    model = retrofit(tmp_path, prelude=1, core=(1, 2), coda=0)
    got = generate(model, ids, max_new_tokens=6, num_steps=1, init_scale=0.0).sequences[0].tolist()
    assert got == want
