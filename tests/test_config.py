import json
import warnings

import pytest

import recurrent_depth as rd
from recurrent_depth.config import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_round_trip_json(name):
    cfg = rd.ModelConfig.from_preset(name)
    assert rd.ModelConfig.from_json(cfg.to_json()) == cfg


def test_huginn_preset_has_the_papers_parameter_count():
    assert rd.ModelConfig.from_preset("huginn-0125").num_parameters() == 3_564_976_800


def test_small_preset_mean_recurrence_is_above_depth_4():
    assert rd.ModelConfig.from_preset("small").mean_recurrence >= 8


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_heads": 5}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"core_layers": 0}, "core_layers"),
        ({"mean_recurrence": -1}, "mean_recurrence"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"eos_token_id": 256}, "eos_token_id"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"mixer": {"middle": "attention"}}, "mixer"),
        ({"head_dim": 15, "num_heads": 1, "hidden_size": 15}, "head_dim"),
        # wrong types (e.g. from a hand-written config.json) name the field instead of a TypeError
        ({"hidden_size": "abc"}, "hidden_size"),
        ({"rope_base": "fast"}, "rope_base"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"qk_bias": 2}, "qk_bias"),
        ({"tie_embeddings": "no"}, "tie_embeddings"),
        ({"bias": None}, "bias"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        rd.ModelConfig.from_preset("tiny", **overrides)


def test_unknown_preset_and_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="unknown preset"):
        rd.ModelConfig.from_preset("gigantic")
    with pytest.raises(ValueError, match="unknown config keys"):
        rd.ModelConfig.from_dict({"hidden_size": 64, "hidden_sise": 3})


HUGINN_CONFIG_JSON = {
    "architectures": ["RavenForCausalLM"],
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig"},
    "model_type": "huginn_raven",
    "n_embd": 5280, "n_heads": 55, "n_layers": 8, "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2, "mean_recurrence": 32,
    "mean_backprop_depth": 8, "block_size": 4096, "vocab_size": 65536, "padding_multiple": 4096,
    "intermediate_size": 17920, "bias": False, "qk_bias": True, "tie_embeddings": True,
    "norm_eps": 1e-6, "norm_class_name": "RMSNorm_llama", "init_strategy": "takase",
    "state_init": "like-init", "injection_type": "linear", "torch_dtype": "bfloat16",
    "transformers_version": "4.47.1", "sampling_scheme": "poisson-lognormal-filling",
}


def test_reads_the_official_huginn_config_keys():
    cfg = rd.ModelConfig.from_dict(json.loads(json.dumps(HUGINN_CONFIG_JSON)))
    assert cfg == rd.ModelConfig.from_preset("huginn-0125")


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_another_transformers_model_type_is_not_read_as_huginn_or_ours(model_type):
    # GPT-2 has n_embd, which alone marks an official Huginn config
    with pytest.raises(ValueError, match=f"transformers '{model_type}' checkpoint, not a recurrent-depth one.*"
                                         "rdepth retrofit.*rdepth loop"):
        rd.ModelConfig.from_dict({"model_type": model_type, "n_embd": 64, "n_layer": 2, "hidden_size": 64})


def test_a_looped_transformers_config_says_how_to_run_it():
    # it was told to "loop its middle layers with `rdepth loop`", which it already is
    looped = {"model_type": "llama", "hidden_size": 64, "loop": {"start": 2, "end": 3, "iterations": 2}}
    with pytest.raises(ValueError, match=r"transformers 'llama' model looped by `rdepth loop` .*"
                                         r"recurrent_depth.looping.from_pretrained"):
        rd.ModelConfig.from_dict(looped)


def test_init_scale_in_a_huginn_format_config_is_kept():
    # Our transformers config writes init_scale into the Huginn-format config.json; reading it back must
    # not drop it (a model saved with init_scale=0.0 came back with 1.0).
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no "ignoring Huginn config keys" warning
        cfg = rd.ModelConfig.from_dict({**HUGINN_CONFIG_JSON, "init_scale": 0.0})
    assert cfg.init_scale == 0.0


def test_an_official_config_with_bias_true_is_refused_in_one_line():
    # the official code's bias is the adapter's alone; ours would add attention and MLP biases it lacks
    with pytest.raises(ValueError, match="bias: true is not supported: the official code puts that bias on the "
                                         "adapter only"):
        rd.ModelConfig.from_dict({**HUGINN_CONFIG_JSON, "bias": True})


def test_unknown_preset_override_names_the_field():
    with pytest.raises(ValueError, match="hidden_sise"):
        rd.ModelConfig.from_preset("tiny", hidden_sise=32)


@pytest.mark.parametrize(
    "changes, field",
    [({"n_heads": 0}, "num_heads"), ({"n_heads": "55"}, "num_heads"), ({"n_embd": None}, "hidden_size"),
     ({"vocab_size": "65536"}, "vocab_size"), ({"vocab_size": None}, "vocab_size")],
    ids=["heads-0", "heads-str", "embd-none", "vocab-str", "vocab-none"],
)
def test_bad_values_in_an_official_config_name_the_field(changes, field):
    # Huginn's derived values (head_dim = n_embd // n_heads, the special ids by vocab size) must not
    # raise ZeroDivisionError / TypeError before validation can name the field.
    with pytest.raises(ValueError, match=field):
        rd.ModelConfig.from_dict({**HUGINN_CONFIG_JSON, **changes})


def test_official_config_with_transformers_alias_keys_is_read_not_defaulted():
    # RavenConfig maps hidden_size -> n_embd and num_attention_heads -> n_heads; a config written with
    # the aliases must not silently fall back to our defaults (hidden 64, 4 heads).
    data = {k: v for k, v in HUGINN_CONFIG_JSON.items() if k not in ("n_embd", "n_heads")}
    cfg = rd.ModelConfig.from_dict({**data, "hidden_size": 5280, "num_attention_heads": 55})
    assert cfg == rd.ModelConfig.from_preset("huginn-0125")


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff{")
    with pytest.raises(ValueError, match="config.json is not UTF-8"):
        rd.ModelConfig.from_json(tmp_path)
