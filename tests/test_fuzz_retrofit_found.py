"""Found by a differential fuzzer (random small transformers configs, retrofitted with every layer kept at r = 1,
against transformers' own model loaded from the same config.json): the RoPE settings must be read as transformers'
`standardize_rope_params` reads them, or the logits differ without a word."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from recurrent_depth.families.retrofit import retrofit

SHAPE = dict(vocab_size=97, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


def llama() -> torch.nn.Module:
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def gemma3() -> torch.nn.Module:
    return Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"]))


def assert_equals_transformers(tmp_path: Path, model: torch.nn.Module, edit: Callable[[dict[str, Any]], None]) -> None:
    """`model` (weights perturbed) saved, its config.json edited, then ours and transformers' read from it."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    want_model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float().eval()
    ours = retrofit(tmp_path, prelude=1, core=(1, 2), coda=0)
    ids = torch.randint(0, 97, (1, 60), generator=torch.Generator().manual_seed(1))  # positions past 8 and 32
    with torch.no_grad():
        want = want_model(ids).logits
        got = ours(ids, num_steps=1, init_scale=0.0).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def legacy(scaling: dict[str, Any], **top: Any) -> Callable[[dict[str, Any]], None]:
    """The transformers-4 format: rope_scaling (and keys beside it) in place of rope_parameters."""
    def edit(config: dict[str, Any]) -> None:
        config.pop("rope_parameters")
        config.update(rope_scaling=scaling, **top)
    return edit


def test_a_llama3_rope_without_original_max_position_embeddings_takes_max_position_embeddings(tmp_path):
    """(was refused: "rope_type 'llama3' lacks ['original_max_position_embeddings']"; transformers fills it in)"""
    assert_equals_transformers(tmp_path, llama(), legacy(dict(LLAMA3), rope_theta=10000.0))


def test_gemma3_full_layers_llama3_rope_without_original_max_position_embeddings(tmp_path):
    assert_equals_transformers(tmp_path, gemma3(), lambda c: c.update(rope_parameters={
        "full_attention": {**LLAMA3, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}))


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path, form):
    """Phi-3's top-level key, which transformers puts over the rope dict's (ours read the rope dict's 32: other
    frequencies, logits off by several units)."""
    scaling = {**LLAMA3, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    assert_equals_transformers(tmp_path, llama(), lambda c: (c.pop("rope_parameters"), c.update(
        {form: scaling, "original_max_position_embeddings": 8})))


def test_a_rope_theta_inside_rope_scaling_is_the_base(tmp_path):
    """transformers reads the rope dict's rope_theta first; ours read only the top-level one (absent: 10000)."""
    assert_equals_transformers(tmp_path, llama(), legacy({"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0}))
    assert_equals_transformers(tmp_path, llama(), legacy({"rope_type": "linear", "factor": 2.0, "rope_theta": 50.0},
                                                         rope_theta=500000.0))


@pytest.mark.parametrize("switched_off", ["mlp_bias", "attention_bias"])
def test_stored_biases_the_config_switches_off_are_refused_not_read(tmp_path, switched_off):
    """A Llama saved with both biases whose config.json then lacks one key: transformers ignores those tensors
    (unexpected keys), ours read them into its zero-filled biases (logits off by units, without a word)."""
    LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop(switched_off)
    (tmp_path / "config.json").write_text(json.dumps(config))
    part = "mlp" if switched_off == "mlp_bias" else "self_attn"
    needle = rf"stores bias tensors \['model\.layers\.0\.{part}\..*its {switched_off} is not true"
    with pytest.raises(ValueError, match=needle) as info:
        retrofit(tmp_path, prelude=1, core=(1, 2), coda=0)
    assert str(info.value).startswith("retrofit:") and "\n" not in str(info.value)
    # the same checkpoint with its config matching its weights converts
    config[switched_off] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert retrofit(tmp_path, prelude=1, core=(1, 2), coda=0).config.bias
