"""Config options that only some mixers implement (`MIXER_CONFIG_OPTIONS`): each mixer class says which it honours,
and the model refuses one that a layer's mixer would ignore; plus from_preset's token ids with another vocab_size
and rope_scaling's keys."""

import warnings

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.config import rope_scaling_key
from recurrent_depth.model.mixers import available_mixers, build_mixer
from recurrent_depth.model.mixers.base import MIXER_CONFIG_OPTIONS, MixerContext

pytestmark = pytest.mark.usefixtures("one_thread")

# one setting per option, and the config it differs from in that option alone
MUP = dict(mup_base_width=32, tie_embeddings=False)
SETTINGS: dict[str, tuple[dict, dict]] = {
    "qk_norm": ({}, dict(qk_norm=True)),
    "attn_logit_softcapping": ({}, dict(attn_logit_softcapping=0.05)),
    "query_pre_attn_scalar": ({}, dict(query_pre_attn_scalar=1.0)),
    "attn_scale": ({**MUP, "attn_scale": "1/sqrt(d)"}, {**MUP, "attn_scale": "1/d"}),
    "rope_style": ({}, dict(rope_style="half")),
    "rope_scaling": ({}, dict(rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "num_kv_heads": ({}, dict(num_kv_heads=2)),
    "qkv_bias": ({}, dict(qkv_bias=True)),
    "eager_attention": ({}, dict(eager_attention=True)),  # (plain math rounds unlike SDPA, float64 too)
}


def mixer_output(name: str, changes: dict) -> torch.Tensor:
    """One mixer of `name` built from a tiny config with `changes`, seeded, run on a fixed input: [1, 12, 64]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (muP's shape warning)
        config = rd.ModelConfig(max_seq_len=64, **changes)
    torch.manual_seed(0)
    mixer = build_mixer(name, config, "core").double()
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    ctx = MixerContext(positions=torch.arange(12)[None] * 5, past_len=0, key_valid=None, attn_mask=None, cache=None,
                       rope_base=config.rope_base, max_seq_len=config.max_seq_len,
                       rope_scaling=rope_scaling_key(config.rope_scaling))
    with torch.no_grad():
        return mixer(x, ctx, ("core", 0, 0))


def test_the_settings_cover_every_option_built_by_the_mixer():
    # (layer_rope_bases is set on the built layer by the model: tests/test_model_family.py covers it)
    assert set(SETTINGS) == set(MIXER_CONFIG_OPTIONS) - {"layer_rope_bases"}


@pytest.mark.parametrize("name", available_mixers())
def test_each_mixer_declares_what_it_honours_truthfully(name):
    """The declarations against behaviour: an option a mixer says it implements changes its output, one it does not
    (moot or ignored) leaves the output exactly as it was, which is why the model refuses or lets it pass."""
    from recurrent_depth.model.mixers.base import _MIXERS

    cls = _MIXERS[name]
    for option, (off, on) in SETTINGS.items():
        same = torch.equal(mixer_output(name, off), mixer_output(name, on))
        honoured = option in cls.config_options
        assert same is not honoured, f"{name} {'honours' if honoured else 'ignores'} {option}, but its output " \
                                     f"{'did not change' if same else 'changed'}"


@pytest.mark.parametrize("mixer", ["mla", "dsa", "nsa"])
@pytest.mark.parametrize("option", ["rope_style", "attn_scale", "num_kv_heads"])
def test_sparse_and_latent_attention_refuse_what_they_would_ignore(mixer, option):
    """These mixers rotate interleaved pairs and scale by their own head width whatever the config says, and mla /
    dsa share one latent in place of kv heads: the setting was accepted and did nothing (identical logits)."""
    _, on = SETTINGS[option]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = rd.ModelConfig(mixer={"core": mixer}, **on)
    if mixer == "nsa" and option == "num_kv_heads":  # (nsa has kv heads: its GQA follows the config)
        with torch.device("meta"):
            assert rd.RecurrentDepthLM(config).transformer.core_block[0].attn.num_kv_heads == 2
        return
    needle = (rf"^ModelConfig.{option} applies to layer 1, whose mixer is not 'attention'.*{option}=.*the core "
              rf"uses mixer '{mixer}', which would ignore it")
    with pytest.raises(ValueError, match=needle) as info, torch.device("meta"):
        rd.RecurrentDepthLM(config)
    assert "\n" not in str(info.value)


def test_options_without_a_mechanism_pass_in_a_hybrid_and_are_refused_where_nothing_takes_them():
    # a gated DeltaNet core has no RoPE and no kv heads: the attention prelude and coda take them
    hybrid = rd.ModelConfig(mixer={"core": "gated_deltanet"}, rope_style="half", num_kv_heads=2,
                            rope_scaling={"rope_type": "linear", "factor": 2.0})
    with torch.device("meta"):
        assert rd.RecurrentDepthLM(hybrid).transformer.prelude[0].attn.num_kv_heads == 2
    for changes in (dict(rope_style="half"), dict(num_kv_heads=2)):
        option = next(iter(changes))
        with pytest.raises(ValueError, match=rf"^ModelConfig.{option}=.* has no effect: no layer's mixer implements "
                                             rf"it \(this model's mixers \['gla'\]"), torch.device("meta"):
            rd.RecurrentDepthLM(rd.ModelConfig(mixer="gla", **changes))


def test_qk_norm_and_qkv_bias_are_refused_where_ignored():
    # mla's q-LoRA norm is called q_norm: the old check (a q_norm attribute) let qk_norm pass, doing nothing
    config = rd.ModelConfig(mixer={"core": "mla"}, mixer_options={"mla": {"q_lora_rank": 8}}, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm=True is implemented by the 'attention' mixer only, but the core "
                                         "uses mixer 'mla'"), torch.device("meta"):
        rd.RecurrentDepthLM(config)
    with pytest.raises(ValueError, match=r"^ModelConfig.qkv_bias applies to layer 1.*mixer 'gla'"), \
            torch.device("meta"):
        rd.RecurrentDepthLM(rd.ModelConfig(mixer={"core": "gla"}, qkv_bias=True))


def test_mup_default_attention_scale_is_refused_for_a_mixer_with_its_own():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = rd.ModelConfig(mixer={"core": "mla"}, **MUP)  # attn_scale None: muP's 1/d
        accepted = rd.ModelConfig(mixer={"core": "mla"}, attn_scale="1/sqrt(d)", **MUP)
    with pytest.raises(ValueError, match=r"attn_scale='1/d'.*set attn_scale='1/sqrt\(d\)'"), torch.device("meta"):
        rd.RecurrentDepthLM(config)
    # a recurrent mixer has no softmax logits (its output is normalised): muP's attention layers beside it keep 1/d,
    # and a model of it alone is refused only when 1/d is asked for by name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hybrid, pure = rd.ModelConfig(mixer={"core": "gla"}, **MUP), rd.ModelConfig(mixer="gla", **MUP)
        named = rd.ModelConfig(mixer="gla", attn_scale="1/d", **MUP)
    with torch.device("meta"):
        rd.RecurrentDepthLM(accepted), rd.RecurrentDepthLM(hybrid), rd.RecurrentDepthLM(pure)
    with pytest.raises(ValueError, match=r"^ModelConfig.attn_scale='1/d' has no effect"), torch.device("meta"):
        rd.RecurrentDepthLM(named)


def test_a_preset_with_another_vocab_size_drops_its_token_ids():
    # was: "ModelConfig.bos_token_id=65504 is invalid: expected None or a token id in [0, 32000)", an id never set
    config = rd.ModelConfig.from_preset("huginn-0125", vocab_size=32000)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    assert rd.ModelConfig.from_preset("huginn-0125", vocab_size=32000, eos_token_id=2).eos_token_id == 2
    same = rd.ModelConfig.from_preset("huginn-0125", vocab_size=65536)
    assert (same.bos_token_id, same.eos_token_id, same.pad_token_id) == (65504, 65505, 65509)


@pytest.mark.parametrize("scaling, needle", [
    ({"rope_type": "linear", "factor": 2.0, "factr": 3.0}, r"rope_scaling\['factr'\] is not a key of rope_type"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, r"'rope_theta'.*set the base with .*rope_base"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192.5}, r"\['original_max_position_embeddings'\]=8192.5 .*an integer"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"type": "linear", "rope_type": "llama3", "factor": 2.0}, "disagree"),
])
def test_rope_scaling_refuses_keys_and_values_it_would_ignore(scaling, needle):
    with pytest.raises(ValueError, match=needle) as info:
        rd.ModelConfig(rope_scaling=scaling)
    assert "\n" not in str(info.value)
    # transformers' optional partial_rotary_factor at 1 (a fully rotated head) and the older "type" are kept
    rd.ModelConfig(rope_scaling={"type": "linear", "factor": 2.0, "partial_rotary_factor": 1.0})
