"""Model configuration as users build and edit it: one-line errors naming the field they set, preset overrides
that re-derive what the preset derived, our config.json read as transformers reads it, construction-time refusals,
and `rdepth info`'s quantized-cache figures against a count by hand."""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd


def test_more_heads_than_channels_is_blamed_on_num_heads_not_head_dim():
    # num_heads > hidden_size derives head_dim = 0: the error named head_dim, a field the user never set
    for heads in (128, 10**30):
        with pytest.raises(ValueError, match=rf"^ModelConfig.num_heads={heads} is invalid: expected a divisor of "
                                             r"hidden_size=64$"):
            rd.ModelConfig.from_preset("tiny", num_heads=heads)
    with pytest.raises(ValueError, match=r"^ModelConfig.head_dim=0 is invalid: expected an integer >= 1$"):
        rd.ModelConfig.from_preset("tiny", head_dim=0)


@pytest.mark.parametrize("changes, field", [
    ({"block_layout": []}, "block_layout"),
    ({"block_layout": {}}, "block_layout"),
    ({"rope_scaling": {"rope_type": []}}, "rope_scaling"),
    ({"rope_scaling": {"type": {"linear": 2}}}, "rope_scaling"),
])
def test_unhashable_values_from_json_are_one_line_errors_naming_the_field(changes, field):
    # (a list or an object where a name belongs was a TypeError: unhashable type)
    with pytest.raises(ValueError, match=rf"^ModelConfig.{field}") as info:
        rd.ModelConfig.from_dict({**rd.ModelConfig().to_dict(), **changes})
    assert "\n" not in str(info.value)


def _edited_config_json() -> dict:
    """Our config.json with the head counts under transformers' names (as a user porting a Llama config writes)."""
    data = rd.ModelConfig.from_preset("tiny").to_dict()
    for name in ("num_heads", "num_kv_heads", "head_dim"):
        data.pop(name)
    return {**data, "num_attention_heads": 8, "num_key_value_heads": 2}


def test_transformers_names_in_our_config_json_are_read_as_transformers_reads_them(tmp_path):
    data = _edited_config_json()
    config = rd.ModelConfig.from_dict(data)  # was: 4 heads, 4 kv heads (the defaults), silently
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 2, 8)
    assert config == rd.ModelConfig.from_preset("tiny", num_heads=8, num_kv_heads=2)
    pytest.importorskip("transformers")
    from recurrent_depth.integrations.hf_config import RecurrentDepthConfig

    (tmp_path / "config.json").write_text(json.dumps(data))
    assert RecurrentDepthConfig.from_pretrained(tmp_path).to_model_config() == config  # one file, one model
    same = rd.ModelConfig.from_dict({**rd.ModelConfig().to_dict(), "max_position_embeddings": 256,
                                     "tie_word_embeddings": True, "num_hidden_layers": 4})
    assert same == rd.ModelConfig()


@pytest.mark.parametrize("changes, needle", [
    ({"num_attention_heads": 8}, r"^config keys num_attention_heads=8 and num_heads=4 disagree"),
    ({"max_position_embeddings": 512}, r"^config keys max_position_embeddings=512 and max_seq_len=256 disagree"),
    ({"num_hidden_layers": 12}, r"^config key num_hidden_layers=12 disagrees with prelude_layers \+ core_layers"),
])
def test_transformers_names_that_disagree_with_ours_are_refused(changes, needle):
    with pytest.raises(ValueError, match=needle) as info:
        rd.ModelConfig.from_dict({**rd.ModelConfig().to_dict(), **changes})
    assert "\n" not in str(info.value)


def test_preset_overrides_re_derive_the_presets_derived_head_dim_and_kv_heads():
    # huginn-0125 pins head_dim=96 and num_kv_heads=55 (both derived: 5280 // 55, no GQA); a narrower model kept
    # them, a 5280-wide attention in a 2640-wide model, or refused num_heads=16 for num_kv_heads=55
    half = rd.ModelConfig.from_preset("huginn-0125", hidden_size=2640)
    assert (half.head_dim, half.num_kv_heads) == (48, 55)
    assert half.to_huginn_dict()["n_embd"] == 2640  # the official layout (which derives head_dim) expresses it
    small = rd.ModelConfig.from_preset("huginn-0125", hidden_size=1024, num_heads=16)
    assert (small.head_dim, small.num_kv_heads) == (64, 16)
    # the same model as one written out in full (a plain reference: hidden_size // num_heads, kv = heads)
    explicit = {**rd.config.PRESETS["huginn-0125"], "hidden_size": 1024, "num_heads": 16, "head_dim": 64,
                "num_kv_heads": 16}
    assert small == rd.ModelConfig(**explicit)
    ouro = rd.ModelConfig.from_preset("ouro-1.4b", hidden_size=1024)
    assert (ouro.head_dim, ouro.num_kv_heads) == (64, 16)
    # what the override or the preset set on purpose stays: an explicit head_dim, tiny-ouro's GQA
    assert rd.ModelConfig.from_preset("huginn-0125", hidden_size=2640, head_dim=96).head_dim == 96
    assert rd.ModelConfig.from_preset("tiny-ouro", num_heads=8).num_kv_heads == 2
    assert rd.ModelConfig.from_preset("huginn-0125", hidden_size=2640, num_kv_heads=5).num_kv_heads == 5


def test_query_pre_attn_scalar_is_refused_where_the_mixer_ignores_it():
    # the other mixers scale their logits by their own width: the setting did nothing, silently
    config = rd.ModelConfig(query_pre_attn_scalar=16.0, mixer={"core": "linear_attention"})
    needle = r"^ModelConfig.query_pre_attn_scalar applies to layer 1, whose mixer is not 'attention'"
    with pytest.raises(ValueError, match=needle), torch.device("meta"):
        rd.RecurrentDepthLM(config)
    with torch.device("meta"):
        rd.RecurrentDepthLM(rd.ModelConfig(query_pre_attn_scalar=16.0, mixer={"core": "attention"}))


def test_info_prices_quantized_kv_of_per_part_mixers_and_kv_heads(tmp_path, capsys):
    from recurrent_depth.cli import main
    from recurrent_depth.inference.kv_codec import KVQuant

    spec = "k=prod:3.5,v=mse:3.5"
    # 1 prelude + 1 coda layer with 4 kv heads; 2 core layers with 1 kv head (mixer_options), a per-part dict that
    # names 'attention' throughout (was refused: "this model's mixer is {'core': 'attention'}")
    config = rd.ModelConfig(mixer={"core": "attention"}, mixer_options={"core": {"num_kv_heads": 1}})
    torch.manual_seed(0)
    rd.RecurrentDepthLM(config).save_pretrained(tmp_path / "m")
    assert main(["info", "--model", str(tmp_path / "m"), "--kv-quant", spec, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    per_head = KVQuant.parse(spec).bytes_per_token(config.head_dim, 1, context=config.max_seq_len)
    # by hand: layer caches per token x kv heads; last-step keeps one slot per core layer, per-step one per step
    last_step = (2 * 4 + 2 * 1) * per_head
    per_step = (2 * 4 + 2 * config.mean_recurrence * 1) * per_head
    quantized = info["kv_cache_bytes_per_token_quantized_by_kv_policy"]
    assert quantized["last-step+deepest"] == round(last_step)  # was 192 for 240 (a floored layer count)
    assert quantized["per-step+deepest"] == round(per_step)
