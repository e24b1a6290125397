"""Parcae (arXiv 2604.12946): its diagonal injection, its blocks, and its checkpoints loaded as ours.

The goldens in tests/goldens/parcae/ were recorded with Parcae's own code (parcae_lm at commit dee8363,
`record_goldens.py` there): two tiny random models, their config.json as parcae_lm saves it, and their
fp32 logits from a fixed s_0. Our loader must reproduce them.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth.config import is_huginn_config
from recurrent_depth.families.parcae import parcae_config_values, value_embedding_layers
from recurrent_depth.model.layers import DiagonalInjection

GOLDENS = Path(__file__).parent / "goldens" / "parcae"
NAMES = ["released-layout", "linear-gated"]


def golden(name: str) -> tuple[rd.RecurrentDepthLM, dict[str, torch.Tensor], dict]:
    model = rd.RecurrentDepthLM.from_pretrained(GOLDENS / name)
    return model, load_file(GOLDENS / name / "goldens.safetensors"), json.loads((GOLDENS / name / "goldens.json")
                                                                                .read_text())


def parcae_json(name: str = "released-layout") -> dict:
    return json.loads((GOLDENS / name / "config.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_loaded_parcae_model_reproduces_parcae_logits(name):
    model, g, meta = golden(name)
    logits = model(g["input_ids"], num_steps=meta["steps"], input_states=g["state"]).logits
    torch.testing.assert_close(logits, g["logits"], rtol=0, atol=1e-5)
    # s_0 drawn as Parcae's like-init draws it, from the same seed: init_scale carries its width.
    torch.manual_seed(meta["seed_state"])
    drawn = model.initial_state(model.transformer.wte(g["input_ids"]), model.config.init_scale)
    torch.testing.assert_close(drawn, g["like_init_state"], rtol=0, atol=1e-6)


def test_the_translated_configs_say_what_parcae_runs():
    released, _, meta = golden("released-layout")
    c = released.config
    assert (c.injection, c.block_layout, c.mlp_gated, c.mlp_activation, c.prelude_norm, c.coda_projection) == (
        "diagonal", "pre-norm", False, "relu2_half", True, True)
    assert (c.norm_before_coda, c.embedding_scale, c.qk_norm_eps, c.value_embeddings) == (
        False, False, 2.0**-23, [1, 3, 5])
    assert math.isclose(c.init_scale, 1 / math.sqrt(32))
    # our QK-norm keeps gains (of one): 2 x head_dim per layer more than Parcae's 54,144
    assert released.num_parameters() == c.num_parameters() == meta["parameters"] + 6 * 2 * 8
    gated, _, meta = golden("linear-gated")
    c = gated.config
    assert (c.injection, c.mlp_gated, c.mlp_activation, c.embedding_scale, c.value_embeddings) == (
        "concat", True, "silu", True, [3])
    # Parcae also builds value-embedding table 1 and the gates of layers 0 and 2, which it never uses
    assert gated.num_parameters() == c.num_parameters() == meta["parameters"] - 64 * 32 - 2 * 4 * 32
    assert not is_huginn_config(parcae_json())  # Parcae's n_embd & co. are not Huginn's


def test_value_embedding_layers_follow_parcae_rule():
    # tables every other layer from the last; gates by layer id against R * mean_backprop_depth
    assert value_embedding_layers(2, 2, 2, 8, 4) == [1, 3, 5]  # parcae-small-140m
    assert value_embedding_layers(2, 1, 1, 2, 1) == [3]
    assert value_embedding_layers(1, 2, 1, 3, 2) == [1, 3]


def test_diagonal_injection_follows_its_formula_and_contracts():
    inj = DiagonalInjection(8)
    assert torch.allclose(inj.decay(), torch.full((8,), 5**-0.5))  # Parcae's init: decay 1/sqrt(5), B = I
    assert torch.equal(inj.B, torch.eye(8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in inj.parameters():
            p.copy_(3 * torch.randn(p.shape, generator=gen))
    s, e = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    dt = torch.log1p(torch.exp(inj.dt_bias))
    want = torch.exp(-dt * torch.exp(inj.A_log)) * s + dt * (e @ inj.B.T)
    torch.testing.assert_close(inj(s, e), want)
    assert bool(((inj.decay() > 0) & (inj.decay() < 1)).all())  # whatever the weights
    config = rd.ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=48, injection="diagonal")
    model = rd.RecurrentDepthLM(config)
    assert torch.equal(model.transformer.adapter.B, torch.eye(32))  # reset_parameters keeps Parcae's init
    assert model.num_parameters() == config.num_parameters()


def test_prefill_then_decode_equals_the_full_forward():
    """Value embeddings read each call's token ids: decoding one token at a time must see its own."""
    model, g, _ = golden("released-layout")
    ids = g["input_ids"]
    full = model(ids, num_steps=3, init_scale=0.0).logits
    for fast in (True, False):
        out = rd.generate(model, ids[:, :4], max_new_tokens=3, num_steps=3, teacher_tokens=ids[:, 4:7],
                          output_logits=True, fast=fast, init_scale=0.0)
        torch.testing.assert_close(out.logits[:, :3], full[:, 3:6], rtol=1e-4, atol=1e-4)


def test_a_converted_parcae_model_saves_and_reloads_in_our_format(tmp_path):
    model, g, meta = golden("released-layout")
    model.save_pretrained(tmp_path / "ours")
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path / "ours")
    assert again.config == model.config
    logits = again(g["input_ids"], num_steps=meta["steps"], input_states=g["state"]).logits
    torch.testing.assert_close(logits, g["logits"], rtol=0, atol=1e-5)


def test_logit_softcap_caps_the_logits_as_parcae_does(tmp_path):
    """Parcae's head: logits = cap * tanh(lm_head(ln_f(x)).float() / cap), in its forward and its loss
    (parcae_lm/models/parcae/parcae.py:210-212, 230-232 at dee8363), applied here to its recorded logits."""
    shutil.copytree(GOLDENS / "released-layout", tmp_path, dirs_exist_ok=True)
    cap = 2.0  # below the largest recorded logit (about 3.9), so the cap changes them
    (tmp_path / "config.json").write_text(json.dumps({**parcae_json(), "logit_softcap": cap}))
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    _, g, meta = golden("released-layout")
    assert model.config.final_logit_softcapping == cap
    out = model(g["input_ids"], num_steps=meta["steps"], input_states=g["state"], labels=g["input_ids"])
    want = cap * torch.tanh(g["logits"] / cap)
    torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-5)
    want_loss = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, 64), g["input_ids"][:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, want_loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize("change,needle", [
    ({"logit_softcap": 0.0}, "logit_softcap"),
    ({"logit_softcap": "15"}, "logit_softcap"),
    ({"recurrent_embedding_dimension": 64}, "recurrent_embedding_dimension"),
    ({"norm_class_name": "LayerNorm"}, "norm_class_name"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"init_strategy": "takase-scaled"}, "init_strategy"),
    ({"state_init": "normal"}, "state_init"),
    ({"_class_name": "GPTConfig"}, "_class_name"),
    ({"surprise": 1}, "unknown keys"),
])
def test_what_we_cannot_run_is_a_one_line_error(change, needle):
    with pytest.raises(ValueError, match=needle) as info:
        rd.ModelConfig.from_dict({**parcae_json(), **change})
    assert "\n" not in str(info.value)


def test_pickled_parcae_weights_are_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(parcae_json()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pickled weights") as info:
        rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)


def test_missing_parcae_tensors_are_named(tmp_path):
    shutil.copy(GOLDENS / "released-layout" / "config.json", tmp_path / "config.json")
    state = load_file(GOLDENS / "released-layout" / "model.safetensors")
    del state["transformer.adapter.A_log"]
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: \['transformer.adapter.A_log'\]"):
        rd.RecurrentDepthLM.from_pretrained(tmp_path)


def test_parcae_values_are_plain_model_config_fields():
    values = parcae_config_values(parcae_json())
    assert rd.ModelConfig(**values) == rd.ModelConfig.from_dict(parcae_json())


# parcae_lm/configs/parcae/parcae-small-140m.py at dee8363, as its registry hands it to ParcaeConfig
SMALL_140M = dict(
    _class_name="ParcaeConfig", name="parcae-small-140m", block_size=2048, vocab_size=32768, padding_multiple=64,
    n_embd=768, num_attention_heads=6, num_key_value_heads=6, intermediate_size=3072, bias=False,
    tie_embeddings=True, block_class_name="TransformerPreNormBlock", norm_class_name="RMSNorm", norm_eps=1e-5,
    mlp_class_name="BaseMLP", nonlin_name="ReLU2", qk_norm=True, logit_softcap=None, prelude_norm=True,
    init_strategy="scaled-zero", init_orthogonal=True, injection_type="diagonal", state_init="like-init",
    recurrent_embedding_dimension=768, recurrent_intermediation_embedding_dimension=3072,
    n_layers_in_recurrent_block=2, n_layers_in_prelude=2, n_layers_in_coda=2, mean_recurrence=8,
    sampling_scheme="poisson-truncated-full", mean_backprop_depth=4, recurrent_iteration_method="per-sequence",
)


@pytest.mark.parametrize("name,parcae_count,layers", [
    ("parcae-140m", 144_323_136, 6), ("parcae-370m", 388_003_328, 12),
    ("parcae-770m", 776_655_680, 18), ("parcae-1.3b", 1_338_591_744, 24),
])
def test_parcae_presets_count_what_parcae_builds(name, parcae_count, layers):
    """Parameter counts of parcae_lm's models (built on the meta device in the scratch environment) plus our
    QK-norm gains of one, 2 x 128 per layer."""
    assert rd.ModelConfig.from_preset(name).num_parameters() == parcae_count + layers * 2 * 128


def test_the_140m_config_file_translates_to_the_preset():
    assert rd.ModelConfig.from_dict(SMALL_140M) == rd.ModelConfig.from_preset("parcae-140m")



def test_lora_leaves_the_diagonal_injection_out():
    from recurrent_depth.train.lora import LoraSpec, target_modules

    model, _, _ = golden("released-layout")
    names = target_modules(model, LoraSpec())
    assert "transformer.adapter" not in names and "transformer.core_block.0.attn.Wqkv" in names
    with pytest.raises(ValueError, match="select no linear layer"):
        target_modules(model, LoraSpec(parts=("adapter",)))


def test_flops_count_two_mlp_matrices_when_ungated():
    from recurrent_depth.train.flops import block_linear_flops

    gated = rd.ModelConfig.from_preset("parcae-140m", mlp_gated=True)
    ungated = rd.ModelConfig.from_preset("parcae-140m")
    assert block_linear_flops(gated) - block_linear_flops(ungated) == 2.0 * 3072 * 768
