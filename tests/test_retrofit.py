"""Retrofitted recurrence (families/retrofit.py): transformers Llama / Mistral / Phi-3 / Qwen2 / Qwen3 / OLMo-2 /
Gemma 1-3 -> RecurrentDepthLM.

With every layer kept, r = 1, s_0 = 0 and the adapter [0 | I], the retrofitted model is the source model:
its logits equal transformers' own (fp32, tiny random configs with every norm and bias perturbed), which
checks the block layout, norms, RoPE (theta, llama3 scaling, rotate-half), GQA, head_dim, biases,
QK-norms and tied embeddings. Then: dropped layers, the other adapter inits, unsupported architectures
(one-line errors) and the CLI's directory (our loader, `rdepth generate`).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.families.retrofit import ADAPTER_INITS, PROVENANCE_FILE, Surgery, retrofit

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

SOURCES = {
    "llama-llama3-rope-tied": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE,
                                                                    tie_word_embeddings=True)),
    "llama-linear-rope-biases": lambda: LlamaForCausalLM(LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        attention_bias=True, mlp_bias=False, hidden_act="gelu_pytorch_tanh")),
    "qwen2-bias-untied": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default",
                                                                                          "rope_theta": 30000.0})),
    "qwen3-qknorm-headdim": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=12, tie_word_embeddings=True)),
    "olmo2-postnorm": lambda: Olmo2ForCausalLM(Olmo2Config(**SHAPE)),
    # Mistral is the Llama block; a sliding window that covers the context (here = max_position_embeddings)
    # changes nothing. Phi-3 fuses q/k/v and gate/up.
    "mistral-no-window-headdim": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None, head_dim=12)),
    "mistral-window-covers-context-tied": lambda: MistralForCausalLM(MistralConfig(
        **SHAPE, sliding_window=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0})),
    "phi3-fused": lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 30000.0})),
    # Sliding windows shorter than the 40-token test sequence: Qwen2's layers >= max_window_layers, Qwen3's
    # layer_types mixing sliding and full layers, Mistral's and Phi-3's window on every layer.
    "qwen2-sliding-from-layer-2": lambda: Qwen2ForCausalLM(Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=7, max_window_layers=2)),
    "qwen3-layer-types-mixed": lambda: Qwen3ForCausalLM(Qwen3Config(
        **SHAPE, use_sliding_window=True, sliding_window=5, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    "mistral-window-8": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=8)),
    "phi3-window-9": lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, sliding_window=9)),
    # Gemma (1): sqrt(h)-scaled embeddings, (1 + weight) norm gains, the tanh GELU, tied by default
    "gemma-tied-attention-bias": lambda: GemmaForCausalLM(GemmaConfig(**SHAPE, head_dim=12, attention_bias=True)),
    # Gemma 2: four norms per block, query_pre_attn_scalar, attention and final logit soft-capping (caps low
    # enough to bite), every other layer sliding (window 6 < the 40 tokens). Gemma 3: QK-norm, a local RoPE base
    # on its sliding layers and a linearly scaled global one on the full layers, a final soft-cap, no attention one.
    "gemma2-softcaps-sliding": lambda: Gemma2ForCausalLM(Gemma2Config(
        **SHAPE, head_dim=12, query_pre_attn_scalar=20, sliding_window=6, attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0)),
    "gemma3-local-rope-qknorm": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **SHAPE, head_dim=12, query_pre_attn_scalar=20, sliding_window=6, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}})),
}


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its init (norm gains off 1, biases off 0), so a mis-mapped one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.float().eval()


@pytest.fixture(scope="module", params=sorted(SOURCES))
def source(request):
    torch.manual_seed(0)
    return request.param, perturbed(SOURCES[request.param]())


def test_every_layer_kept_at_one_step_equals_the_source(source):
    name, hf = source
    model = retrofit(hf, prelude=2, core=(2, 4), coda=1, adapter_init="e")
    cfg = model.config
    assert (cfg.prelude_layers, cfg.core_layers, cfg.coda_layers) == (2, 2, 1)
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.max_seq_len) == (1, 2, 0, 64)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
        got = model(ids, num_steps=1, init_scale=0.0).logits
    assert want.abs().max() > 1  # logits of a size where a mapping error would show
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # s_0 is ignored by [0 | I]: the pruned source at any depth; a random s_0 changes nothing at r = 1.
    torch.testing.assert_close(model(ids, num_steps=1).logits, want, rtol=1e-5, atol=1e-4)


def test_the_mapping_is_not_vacuous():
    """The parity above fails when a mapping is wrong: swap a layer's two norms and the logits move."""
    torch.manual_seed(0)
    hf = perturbed(SOURCES["llama-llama3-rope-tied"]())
    model = retrofit(hf, prelude=2, core=(2, 4), coda=1)
    block = model.transformer.core_block[0]
    with torch.no_grad():
        block.norm_1.weight, block.norm_3.weight = block.norm_3.weight, block.norm_1.weight
    ids = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        assert not torch.allclose(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits, atol=1e-2)


def test_dropped_layers_give_the_right_shapes_and_the_pruned_source():
    torch.manual_seed(0)
    hf = perturbed(LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_hidden_layers": 8})))
    model = retrofit(hf, prelude=2, core=(4, 6), coda=1, mean_recurrence=3, backprop_depth=2)
    cfg = model.config
    assert (cfg.prelude_layers, cfg.core_layers, cfg.coda_layers) == (2, 2, 1)
    assert (cfg.mean_recurrence, cfg.mean_backprop_depth) == (3, 2)
    assert model.transformer.adapter.weight.shape == (32, 64)
    assert model.num_parameters() == cfg.num_parameters()
    # layers 2, 3 and 6 are gone: our core's first layer is source layer 4, the coda source layer 7
    source_layers = hf.model.layers
    ours = model.transformer
    torch.testing.assert_close(ours.core_block[0].attn.proj.weight, source_layers[4].self_attn.o_proj.weight)
    torch.testing.assert_close(ours.coda[0].mlp.proj.weight, source_layers[7].mlp.down_proj.weight)
    # [0 | I] ignores the state: every depth is the pruned source network
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        x = hf.model.embed_tokens(ids)
        pos = torch.arange(12)[None]
        rope = hf.model.rotary_emb(x, pos)
        for i in (0, 1, 4, 5, 7):
            x = source_layers[i](x, attention_mask=None, position_ids=pos, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
        want = hf.lm_head(hf.model.norm(x))
        for r in (1, 3):
            torch.testing.assert_close(model(ids, num_steps=r, init_scale=0.0).logits, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("init", ADAPTER_INITS)
def test_adapter_inits(init):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    w = retrofit(hf, prelude=1, core=(1, 3), coda=1, adapter_init=init, seed=3).transformer.adapter.weight
    s_part, e_part = w[:, :32], w[:, 32:]
    eye = torch.eye(32)
    expected = {"e": (0 * eye, eye), "state": (eye, 0 * eye), "mean": (eye / 2, eye / 2), "sum": (eye, eye)}
    if init == "random":
        assert 0.05 < float(w.detach().std()) < 0.5 and not torch.allclose(w, torch.zeros_like(w))
    else:
        torch.testing.assert_close(s_part, expected[init][0])
        torch.testing.assert_close(e_part, expected[init][1])


@pytest.mark.parametrize("surgery,needle", [
    ((2, (1, 3), 1), "overlaps the prelude"),
    ((1, (3, 5), 1), "overlaps the coda"),
    ((1, (2, 2), 1), "is empty"),
    ((1, (2, 9), 1), "out of range"),
    ((3, (3, 4), 3), "exceed"),
])
def test_bad_surgery_is_one_line(surgery, needle):
    with pytest.raises(ValueError, match=needle) as info:
        Surgery(*surgery).check(5)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make,needle", [
    (lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64)), "model_type 'gpt2'"),
    # sliding layers without a window: transformers' own forward raises ("Could not find a `sliding_window`")
    (lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=False, layer_types=["sliding_attention"] * 5)),
     r"layer_types mark layers \[0, 1, 2, 3, 4\] sliding_attention with use_sliding_window=False"),
    (lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                                     "factor": 2.0})), "rope_type 'yarn'"),
    (lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, partial_rotary_factor=0.5)), r"partial_rotary_factor=0.5.*supported"),
    (lambda: Phi3ForCausalLM(Phi3Config(**SHAPE, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})),
     "rope_type 'longrope': supported are default, linear, llama3"),
    # (transformers' Gemma 3 attention never applies it: converting it would change the model)
    (lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=8, attn_logit_softcapping=50.0)),
     r"gemma3_text with attn_logit_softcapping=50.0: transformers' Gemma 3 attention does not apply it"),
    (lambda: Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=8, sliding_window=None)),
     r"gemma2 whose layers \[0, 2, 4\] are sliding_attention with sliding_window=null"),
])
def test_unconvertible_architectures_are_one_line_errors(make, needle):
    with pytest.raises(ValueError, match=needle) as info:
        retrofit(make(), prelude=1, core=(1, 2), coda=0)
    assert "\n" not in str(info.value) and str(info.value).startswith("retrofit:")



def test_a_mistral_config_without_sliding_window_has_transformers_default_window(tmp_path):
    """A Mistral config.json that leaves sliding_window out gets MistralConfig's 4096, which transformers applies;
    it was read as no window and converted (logits differ past 4096 tokens)."""
    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**{**SHAPE, "max_position_embeddings": 8192}, sliding_window=None))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["sliding_window"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert retrofit(tmp_path, prelude=1, core=(1, 2), coda=0).config.attention_windows == [4096, 4096]


def test_a_gemma_directory_with_the_legacy_gelu_converts_as_transformers_reads_it(tmp_path):
    """Gemma's released config.json files say hidden_act "gelu", which transformers' GemmaConfig reads as the tanh
    GELU, and leave tie_word_embeddings out (GemmaConfig's default: tied)."""
    torch.manual_seed(0)
    hf = perturbed(GemmaForCausalLM(GemmaConfig(**SHAPE, head_dim=8)))
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_act"] = "gelu"
    config.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = retrofit(tmp_path, prelude=2, core=(2, 4), coda=1)
    assert model.config.mlp_activation == "gelu_tanh" and model.config.tie_embeddings
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_gemma3_directory_in_the_older_rope_format_converts_as_transformers_reads_it(tmp_path):
    """A Gemma 3 config.json of the older format: rope_theta and rope_scaling for the full layers,
    rope_local_base_freq for the sliding ones, sliding_window_pattern instead of layer_types. Retrofitted from
    the directory, the model is transformers' own loaded from it; saved and loaded, it keeps each layer's base."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    perturbed(SOURCES["gemma3-local-rope-qknorm"]()).save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=100.0,
                  sliding_window_pattern=3)  # layers 2 (and 5, ...) full
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    assert hf.config.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    model = retrofit(tmp_path / "src", prelude=2, core=(2, 4), coda=1)
    assert model.config.layer_rope_bases == [100.0, 100.0, None, 100.0, 100.0]
    assert model.config.attention_windows == [6, 6, None, 6, 6]
    model.save_pretrained(tmp_path / "ours")
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "ours")
    assert model.config.layer_rope_bases == [100.0, 100.0, None, 100.0, 100.0]
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_a_gemma2_config_without_its_gemma_keys_gets_transformers_defaults():
    """Gemma2Config's defaults where a config.json leaves the keys out: soft-caps 50 / 30, query_pre_attn_scalar and
    head_dim 256, a 4096 window on every other layer from layer 0, hidden_activation gelu_pytorch_tanh."""
    from recurrent_depth.families.retrofit import model_config

    hf = {**SHAPE, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "max_position_embeddings": 8192}
    cfg = model_config(hf, Surgery(1, (1, 3), 1))
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar, cfg.head_dim) == (
        50.0, 30.0, 256, 256)
    assert cfg.attention_windows == [4096, None, 4096, 4096] and cfg.mlp_activation == "gelu_tanh"  # layers 0, 1, 2, 4
    assert cfg.block_layout == "peri-norm" and cfg.tie_embeddings and cfg.layer_rope_bases == []


@pytest.mark.parametrize("make", [lambda: GemmaForCausalLM(GemmaConfig(**SHAPE)),
                                  lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE))])
def test_a_config_without_head_dim_gets_transformers_default(tmp_path, make):
    """GemmaConfig's head_dim defaults to 256 and Qwen3Config's to 128, not hidden_size // num_attention_heads (8 here):
    such a config.json was refused as a shape mismatch."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    perturbed(make()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = retrofit(tmp_path, prelude=2, core=(2, 4), coda=1)
    assert model.config.head_dim == hf.config.head_dim > 8
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_a_gemma2_exact_gelu_stays_exact():
    """Gemma 1's legacy hidden_act "gelu" means the tanh GELU; Gemma 2's hidden_activation "gelu" is the exact one in
    transformers (ACT2FN), and converts as such."""
    torch.manual_seed(0)
    hf = perturbed(Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=8, hidden_activation="gelu")))
    model = retrofit(hf, prelude=2, core=(2, 4), coda=1)
    assert model.config.mlp_activation == "gelu"
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_dropped_layers_keep_each_kept_layers_own_window(tmp_path):
    """Qwen2 slides layers >= max_window_layers: the retrofitted model gives each kept layer its source layer's
    window (in the saved config.json too), and leaves a window covering the context out (it changes nothing)."""
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=7, max_window_layers=3))
    model = retrofit(hf, prelude=1, core=(2, 4), coda=1)  # source layers 0 | 2, 3 | 4
    assert model.config.attention_windows == [None, None, 7, 7]
    model.save_pretrained(tmp_path)
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path).config.attention_windows == [None, None, 7, 7]
    covering = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=64, max_window_layers=0))
    assert retrofit(covering, prelude=1, core=(1, 2), coda=0).config.attention_windows == []

def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(tmp_path):
    """transformers reads a config.json's non-empty rope_scaling over its rope_parameters; retrofit read
    rope_parameters and converted a linearly scaled RoPE as the default one (logits differed, no error)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    perturbed(LlamaForCausalLM(LlamaConfig(**SHAPE))).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default"
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = retrofit(tmp_path, prelude=2, core=(2, 4), coda=1, adapter_init="e", dtype=torch.float32)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits.float(),
                                   rtol=1e-5, atol=1e-4)


def test_a_looped_model_is_refused_rather_than_retrofitted_without_its_loop(tmp_path):
    """A directory `rdepth loop search --save` wrote (config.json holds "loop") or a looped model in memory:
    retrofitting it silently dropped the loop."""
    from recurrent_depth.looping import LoopConfig, apply_loop, remove_loop

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    apply_loop(hf, LoopConfig(start=1, end=2, iterations=3))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["loop"]["iterations"] == 3
    for source in (tmp_path, hf):
        with pytest.raises(ValueError, match=r"^retrofit: cannot convert a looped model \(its config holds") as info:
            retrofit(source, prelude=1, core=(1, 3), coda=1)
        assert "\n" not in str(info.value)
    remove_loop(hf)
    retrofit(hf, prelude=1, core=(1, 3), coda=1)  # the base model converts


@pytest.mark.parametrize("case, family", [("parcae/released-layout", "Parcae"), ("ouro/config_a", "Ouro")])
def test_a_recurrent_depth_source_is_named_as_one(tmp_path, capsys, case, family):
    """A Parcae directory (whose config.json has no model_type) was refused as "cannot convert model_type None"."""
    from pathlib import Path

    source = Path(__file__).parent / "goldens" / case
    code = main(["retrofit", "--model", str(source), "--prelude", "1", "--core", "1:2", "--coda", "0",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and f"already a recurrent-depth model ({family}): nothing to retrofit" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bias", [False, True])
def test_a_model_in_memory_keeps_its_device(bias):
    """The adapter (and the biases the source lacks) were made on the CPU whatever the source's device: a
    GPU model in memory gave a model split across devices. The meta device stands in for the GPU here."""
    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=bias))
    model = retrofit(hf, prelude=1, core=(1, 3), coda=1)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.transformer.adapter.weight.device.type == "meta"


def test_unknown_tensors_are_refused(tmp_path):
    """A variant with weights this converter does not map (here an extra per-layer tensor) is refused."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.router.weight"] = torch.zeros(4, 32)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="does not know.*router"):
        retrofit(tmp_path, prelude=1, core="1:3", coda=1)


@pytest.mark.parametrize("edit, needle", [
    ({"hidden_act": ["silu"]}, r"hidden_act \['silu'\]: supported are"),  # was a TypeError (unhashable list)
    ({"rope_scaling": [1]}, r"rope_scaling=\[1\] is invalid: expected a JSON object or null"),  # was a TypeError
    ({"rope_parameters": [1]}, r"rope_parameters=\[1\] is invalid"),  # was ignored: the default RoPE
    # (transformers 5 keeps Phi-3's factor in rope_parameters: with no top-level key it was ignored)
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     r"rope partial_rotary_factor=0.75: only a fully rotated head"),
    ({"model_type": ["llama"]}, r"cannot convert model_type \['llama'\]: supported are"),
    ({"rope_parameters": {"rope_type": ["linear"], "rope_theta": 1e4}}, r"cannot convert rope_type \['linear'\]"),
])
def test_malformed_source_configs_are_one_line_errors(edit, needle):
    from recurrent_depth.families.retrofit import model_config

    hf = {**LlamaConfig(**SHAPE).to_dict(), **edit}
    with pytest.raises(ValueError, match=rf"^retrofit: .*{needle}") as info:
        model_config(hf, Surgery(1, (1, 3), 1))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config_class, eps", [(LlamaConfig, 1e-6), (Olmo2Config, 1e-5), (Phi3Config, 1e-5)])
def test_a_config_without_rms_norm_eps_gets_transformers_default(config_class, eps):
    """(OLMo-2's and Phi-3's default is 1e-5: a config.json that left the key out got 1e-6)"""
    from recurrent_depth.families.retrofit import model_config

    hf = config_class(**{k: v for k, v in SHAPE.items() if k != "rms_norm_eps"}).to_dict()
    assert hf.pop("rms_norm_eps") == eps
    assert model_config(hf, Surgery(1, (1, 3), 1)).norm_eps == eps


@pytest.mark.parametrize("name", ["llama-llama3-rope-tied", "mistral-window-covers-context-tied", "phi3-fused",
                                  "olmo2-postnorm", "qwen2-sliding-from-layer-2", "qwen3-layer-types-mixed",
                                  "gemma-tied-attention-bias", "gemma2-softcaps-sliding",
                                  "gemma3-local-rope-qknorm"])
def test_generation_after_retrofit_equals_transformers_greedy(name):
    """Our engine (KV cache, both runners) at r = 1 generates the source model's greedy tokens."""
    from recurrent_depth.inference.generate import generate

    torch.manual_seed(0)
    hf = perturbed(SOURCES[name]())
    model = retrofit(hf, prelude=2, core=(2, 4), coda=1)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for fast in (True, False):
        out = generate(model, ids, max_new_tokens=24, num_steps=1, init_scale=0.0, eos_token_id=[], fast=fast)
        assert out.sequences.tolist() == want.tolist()


def test_a_bf16_sharded_directory_converts_exactly(tmp_path):
    """A half-precision checkpoint in many shards (model.safetensors.index.json): the weights keep their dtype
    by default, and in fp32 the model is transformers' own loaded from the same files."""
    torch.manual_seed(0)
    perturbed(LlamaForCausalLM(LlamaConfig(**SHAPE))).to(torch.bfloat16).save_pretrained(tmp_path,
                                                                                        max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert {p.dtype for p in retrofit(tmp_path, 2, (2, 4), 1).parameters()} == {torch.bfloat16}
    model = retrofit(tmp_path, 2, (2, 4), 1, dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_a_weight_float16_cannot_hold_is_refused_rather_than_made_inf():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[0, 0] = 1e6  # fine in fp32 and bf16, inf in fp16
    with pytest.raises(ValueError, match=r"^retrofit: tensors \['transformer.prelude.1.mlp.proj.weight'\] overflow "
                                         r"torch.float16 \(--dtype\)"):
        retrofit(hf, prelude=2, core=(2, 4), coda=1, dtype=torch.float16)
    assert retrofit(hf, prelude=2, core=(2, 4), coda=1, dtype=torch.bfloat16).transformer.prelude[1].mlp.proj.weight[
        0, 0].isfinite()


def test_an_out_path_that_is_a_file_is_refused_before_converting(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    # before the source is read: a missing source would otherwise be the error
    code = main(["retrofit", "--model", str(tmp_path / "missing"), "--prelude", "1", "--core", "1:3", "--coda", "1",
                 "--out", str(tmp_path / "out"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith(f"retrofit: --out {str(tmp_path / 'out')!r} is a file, not a directory: choose "
                                      f"a new or existing directory")


def test_a_missing_tensor_is_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(**SHAPE)).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.2.self_attn.qkv_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"^retrofit: the source lacks tensors \['model.layers.2.self_attn.qkv_proj"):
        retrofit(tmp_path, prelude=1, core="2:4", coda=1)
    retrofit(tmp_path, prelude=1, core="3:4", coda=1)  # a dropped layer is never read


def test_cli_writes_a_directory_our_loader_and_generate_read(tmp_path, capsys):
    from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=300)
    specials = special_token_ids(tok)
    src = tmp_path / "qwen3"
    torch.manual_seed(0)
    shape = {**SHAPE, "vocab_size": tok.get_vocab_size(), "bos_token_id": specials["begin_text"],
             "eos_token_id": specials["end_text"], "pad_token_id": specials["pad"]}
    hf = perturbed(Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=8)))
    hf.save_pretrained(src)
    save_tokenizer(tok, src)
    out = tmp_path / "rd"
    code = main(["retrofit", "--model", str(src), "--prelude", "1", "--core", "2:4", "--coda", "1", "--out", str(out),
                 "--mean-recurrence", "2", "--threads", "1"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layers"] == {"prelude": [0], "core": [2, 3], "coda": [4]} and summary["dropped"] == [1]
    assert json.loads((out / PROVENANCE_FILE).read_text())["adapter_init"] == "e"
    model = rd.RecurrentDepthLM.from_pretrained(out)
    assert model.config.block_layout == "pre-norm" and model.config.qk_norm and model.config.mean_recurrence == 2
    assert (out / "tokenizer.json").is_file()
    ids = torch.tensor([tok.encode("def f(x):").ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits,
                                   retrofit(src, 1, (2, 4), 1)(ids, num_steps=1, init_scale=0.0).logits)
    code = main(["generate", "--model", str(out), "--prompt", "def f(x):", "--max-new-tokens", "3",
                 "--num-steps", "2", "--threads", "1"])
    assert code == 0 and capsys.readouterr().out.strip()
    code = main(["retrofit", "--model", str(src), "--prelude", "2", "--core", "1:3", "--coda", "1", "--out",
                 str(tmp_path / "bad"), "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "overlaps the prelude" in err and "\n" not in err
    code = main(["retrofit", "--model", str(src), "--prelude", "1", "--core", "2:4", "--coda", "1", "--out",
                 str(tmp_path / "bad"), "--backprop-depth", "-1", "--threads", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("retrofit: backprop_depth=-1 (--backprop-depth) is invalid: expected an "
                                      "integer in [0, 1024]")


@pytest.mark.parametrize("option, value", [("mean_recurrence", -1), ("backprop_depth", -1),
                                           ("backprop_depth", 1.5), ("mean_recurrence", 10**6),
                                           ("mean_recurrence", 0)])  # r̄ = 0: the coda would read the noise s_0
def test_bad_depth_options_name_the_option_before_the_source_is_read(tmp_path, option, value):
    # the source is never read: a missing directory would otherwise be the error
    low = 1 if option == "mean_recurrence" else 0
    with pytest.raises(ValueError, match=rf"^retrofit: {option}={value!r} \(--{option.replace('_', '-')}\) is "
                                         rf"invalid: expected an integer in \[{low}, 1024\]$"):
        retrofit(tmp_path / "missing", prelude=1, core=(1, 2), coda=0, **{option: value})


def test_the_papers_recipe_trains_a_retrofitted_model_then_heals_it(tmp_path):
    """`rdepth train --init-from` on a retrofitted directory: the depth curriculum (25 % of the steps),
    Poisson-lognormal depths, truncated backprop (k = 2), Muon; then a healing run from that run directory
    on other data. The architecture survives both runs; only the depth settings may change."""
    from tests.train_support import VOCAB, prepare_root, write_corpus

    root = prepare_root(tmp_path / "root")
    from recurrent_depth.data import special_token_ids
    from recurrent_depth.data.tokenizer import load_tokenizer
    from recurrent_depth.families.retrofit import retrofit_to_dir

    specials = special_token_ids(load_tokenizer(root / "tokenizer"))
    torch.manual_seed(0)
    src = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": VOCAB, "max_position_embeddings": 64,
                                    "bos_token_id": specials["begin_text"], "eos_token_id": specials["end_text"],
                                    "pad_token_id": specials["pad"]})).save_pretrained(src)
    from recurrent_depth.checkpoint import copy_tokenizer

    copy_tokenizer(root / "tokenizer", src)
    retrofit_to_dir(src, tmp_path / "rd", prelude=1, core=(2, 4), coda=1, mean_recurrence=3, backprop_depth=2)
    common = ["--val-fraction", "0.1", "--keep-all", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
              "--eval-depths", "1,3", "--no-tensorboard", "--no-progress", "--threads", "1"]
    assert main(["train", "--init-from", str(tmp_path / "rd"), "--data", str(root / "corpus"), "--data-dir",
                 str(root / "data"), "--max-steps", "8", "--depth-curriculum", "0.25", "--depth-scheme",
                 "poisson-lognormal", "--backprop-depth", "2", "--max-depth", "8", "--optimizer", "muon",
                 "--out", str(tmp_path / "run"), *common]) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["optim"]["name"] == "muon" and run["config"]["depth_curriculum"] == 0.25
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "num_steps" in m]
    assert len(steps) == 8 and all(k <= 2 for m in steps for k in m["grad_steps"])
    # the depths drawn are the curriculum's (ramp over 2 of the 8 steps from depth 1), not the plateau's
    from recurrent_depth.train.depth import DepthSampler

    def draws(ramp_steps):
        sampler = DepthSampler(mean_recurrence=3, backprop_depth=2, seed=0, max_steps=8, ramp_steps=ramp_steps)
        return [[sum(d), d[1]] for d in (sampler.sample(i, 0) for i in range(8))]

    assert [[m["num_steps"][0], m["grad_steps"][0]] for m in steps] == draws(2) != draws(0)
    write_corpus(tmp_path / "general", num_docs=30, seed=5)  # the "general data" of the healing phase
    assert main(["train", "--init-from", str(tmp_path / "run"), "--data", str(tmp_path / "general"),
                 "--max-steps", "2", "--optimizer", "muon", "--out", str(tmp_path / "healed"), *common]) == 0
    healed = rd.RecurrentDepthLM.from_pretrained(tmp_path / "healed" / "model")
    trained = rd.RecurrentDepthLM.from_pretrained(tmp_path / "run" / "model")
    assert healed.config == trained.config == rd.RecurrentDepthLM.from_pretrained(tmp_path / "rd").config
    assert healed.config.block_layout == "pre-norm" and healed.config.rope_style == "half"
    assert not torch.equal(healed.transformer.adapter.weight, trained.transformer.adapter.weight)


def test_a_retrofitted_model_with_its_own_tokenizer_trains(tmp_path):
    """A Llama-3-style tokenizer (no <|begin_text|>): data preparation frames documents with its own
    <|begin_of_text|> / <|end_of_text|>, and `rdepth train --init-from` runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from recurrent_depth.data.prepare import prepare_dataset
    from recurrent_depth.families.retrofit import retrofit_to_dir
    from tests.train_support import write_corpus

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)} | {"[UNK]": len(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    begin, end = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    src = tmp_path / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**SHAPE, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 64,
                                    "bos_token_id": begin, "eos_token_id": end})).save_pretrained(src)
    tok.save(str(src / "tokenizer.json"))
    retrofit_to_dir(src, tmp_path / "rd", prelude=1, core=(2, 4), coda=1, mean_recurrence=2, backprop_depth=1)
    write_corpus(tmp_path / "corpus", num_docs=20, seed=1)
    data = prepare_dataset(str(tmp_path / "corpus"), tmp_path / "rd", 32, tmp_path / "data", val_fraction=0.1,
                           keep_all=True)
    specials = data.metadata["tokenizer"]["special_token_ids"]
    assert (specials["begin_text"], specials["end_text"]) == (begin, end)
    assert main(["train", "--init-from", str(tmp_path / "rd"), "--data", str(tmp_path / "corpus"), "--data-dir",
                 str(tmp_path / "data2"), "--max-steps", "2", "--val-fraction", "0.1", "--keep-all", "--seq-len", "32",
                 "--batch-size", "2", "--eval-batches", "1", "--eval-depths", "1", "--no-tensorboard",
                 "--no-progress", "--threads", "1", "--out", str(tmp_path / "run")]) == 0
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "run" / "model").config.bos_token_id == begin


def sentencepiece_source(path):
    """A tiny Llama whose only tokenizer is a sentencepiece tokenizer.model (a BPE ModelProto built with
    protobuf: no sentencepiece package needed) and its tokenizer_config.json."""
    from transformers.utils import sentencepiece_model_pb2_new as spm

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path)
    proto = spm.ModelProto()
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.normalizer_spec.add_dummy_prefix = True
    for i, (piece, kind) in enumerate([("<unk>", 2), ("<s>", 3), ("</s>", 3), *((p, 1) for p in
                                       ["▁", "h", "e", "l", "o", "he", "ll", "▁he", "llo", "▁hello"])]):
        proto.pieces.add(piece=piece, score=-float(i), type=kind)
    (path / "tokenizer.model").write_bytes(proto.SerializeToString())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                            "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


@pytest.mark.parametrize("converts", [True, False])
def test_a_sentencepiece_only_source_keeps_its_tokenizer(tmp_path, capsys, monkeypatch, converts):
    """Only tokenizer.json-family files were copied: a source with a tokenizer.model got no tokenizer."""
    from tokenizers import Tokenizer, models

    from recurrent_depth.families import retrofit as retrofit_module

    src = sentencepiece_source(tmp_path / "llama")
    converted = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>")).to_str().encode()
    seen = {}

    def conversion(files, config):  # (transformers' own needs the sentencepiece package: tested below)
        seen.update(files)
        return (converted, "") if converts else (None, "ImportError: no sentencepiece")

    monkeypatch.setattr(retrofit_module, "sentencepiece_to_json", conversion, raising=False)
    out = tmp_path / "rd"
    assert main(["retrofit", "--model", str(src), "--prelude", "1", "--core", "1:4", "--coda", "1", "--out", str(out),
                 "--threads", "1"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.strip().splitlines()[-1])
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    assert set(seen) == {"tokenizer.model", "tokenizer_config.json"}
    assert (out / "tokenizer_config.json").is_file()
    if converts:
        assert (out / "tokenizer.json").read_bytes() == converted and "tokenizer.json" in record["tokenizer_files"]
        assert "tokenizer_note" not in record
    else:
        assert not (out / "tokenizer.json").exists()
        assert "only a sentencepiece tokenizer.model, which could not be converted" in record["tokenizer_note"]
        assert "rdepth retrofit: note:" in captured.err
        assert main(["generate", "--model", str(out), "--prompt", "hello", "--max-new-tokens", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "has only a sentencepiece tokenizer.model" in err[-1]
    from recurrent_depth.checkpoint import copy_tokenizer

    copy_tokenizer(out, tmp_path / "saved-again")  # what save_pretrained / export / a checkpoint copy
    assert (tmp_path / "saved-again" / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()


def test_an_out_directory_keeps_no_tokenizer_of_the_model_written_there_before(tmp_path):
    """Retrofitting into an --out that held another model left its tokenizer and chat template there, beside the
    new weights: commands then used them although retrofit.json said the model has no tokenizer."""
    from tokenizers import Tokenizer, models

    from recurrent_depth.families.retrofit import retrofit_to_dir

    torch.manual_seed(0)
    first, bare, out = tmp_path / "first", tmp_path / "bare", tmp_path / "rd"
    for src in (first, bare):
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(src)
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(first / "tokenizer.json"))
    (first / "chat_template.jinja").write_text("{{ messages }}")
    retrofit_to_dir(first, out, prelude=1, core=(2, 4), coda=1)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    record = retrofit_to_dir(bare, out, prelude=1, core=(2, 4), coda=1)
    assert record["tokenizer_files"] == [] and "no tokenizer" in record["tokenizer_note"]
    assert not (out / "tokenizer.json").exists() and not (out / "chat_template.jinja").exists()


def test_the_sources_generation_config_is_kept_and_a_stale_one_removed(tmp_path):
    """The retrofitted directory lost the source's generation_config.json: a Qwen's eos list [<|im_end|>,
    <|endoftext|>] and sampling defaults, which `rdepth generate` / `serve` read as transformers reads them."""
    from recurrent_depth.families.retrofit import retrofit_to_dir
    from recurrent_depth.generation_config import generation_defaults

    torch.manual_seed(0)
    src, bare, out = tmp_path / "src", tmp_path / "bare", tmp_path / "rd"
    for path in (src, bare):
        LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "do_sample": True,
                                                            "temperature": 0.7, "top_p": 0.8}))
    (bare / "generation_config.json").unlink()
    retrofit_to_dir(src, out, prelude=1, core=(2, 4), coda=1)
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    defaults = generation_defaults(str(out), "auto", "generate")
    assert defaults["eos_token_id"] == [2, 3] and defaults["temperature"] == 0.7
    retrofit_to_dir(bare, out, prelude=1, core=(2, 4), coda=1)
    assert not (out / "generation_config.json").exists()
    (bare / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="generation_config.json is not a JSON object: fix or remove it before "
                                         "retrofitting"):
        retrofit_to_dir(bare, tmp_path / "never", prelude=1, core=(2, 4), coda=1)
    assert not (tmp_path / "never").exists()


def test_sentencepiece_conversion_gives_a_tokenizer_json_or_one_line_reason(tmp_path):
    import importlib.util

    from tokenizers import Tokenizer

    from recurrent_depth.families.retrofit import sentencepiece_to_json

    src = sentencepiece_source(tmp_path / "llama")
    files = {name: (src / name).read_bytes() for name in ("tokenizer.model", "tokenizer_config.json")}
    converted, reason = sentencepiece_to_json(files, (src / "config.json").read_bytes())
    if importlib.util.find_spec("sentencepiece") is None:
        assert converted is None and reason and "\n" not in reason
    else:
        assert Tokenizer.from_str(converted.decode()).encode("hello").tokens[-1] == "▁hello"


GEMMA_SOURCES = ["gemma-tied-attention-bias", "gemma2-softcaps-sliding", "gemma3-local-rope-qknorm"]
# one source of every other type (windows, QK-norms, a head_dim of its own, OLMo-2's post-norm among them)
HALF_PRECISION_SOURCES = ["llama-llama3-rope-tied", "mistral-window-8", "phi3-window-9", "qwen2-sliding-from-layer-2",
                          "qwen3-qknorm-headdim", "olmo2-postnorm", *GEMMA_SOURCES]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", HALF_PRECISION_SOURCES)
def test_half_precision_equals_transformers_bit_for_bit(tmp_path, name, dtype):
    """A bf16 / fp16 source of every type retrofitted at r = 1 is transformers' own model of that dtype bit for bit,
    saved and loaded too: RoPE (and Gemma's embedding scale and soft-caps) rounded where transformers rounds them
    (transformers_rounding; OLMo-2 rotates in float32), Gemma's (1 + w) norm gains added in float32
    (norm_unit_offset), OLMo-2's gains multiplied in float32 (norm_float32_gain); greedy decoding through our
    cache follows. Neither the fused runner nor the remote code takes such a model."""
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.inference.generate import generate
    from recurrent_depth.integrations.export import check_exportable

    torch.manual_seed(0)
    perturbed(SOURCES[name]()).save_pretrained(tmp_path / "src")
    hf = type(SOURCES[name]()).from_pretrained(tmp_path / "src", dtype=dtype).eval()
    model = retrofit(tmp_path / "src", prelude=2, core=(2, 4), coda=1, dtype=dtype)
    gemma, olmo2 = name in GEMMA_SOURCES, name.startswith("olmo2")
    cfg = model.config
    assert (cfg.norm_unit_offset, cfg.transformers_rounding, cfg.norm_float32_gain) == (gemma, not olmo2, olmo2)
    assert torch.equal(model.transformer.ln_f.weight, hf.model.norm.weight)  # w as the source stores it
    assert not FastRunner.supports(model)
    with pytest.raises(ValueError, match="Huginn's architecture only"):
        check_exportable(cfg)
    model.save_pretrained(tmp_path / "rd")
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path / "rd", dtype=dtype)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits.float()
        assert torch.equal(model(ids, num_steps=1, init_scale=0.0).logits, want)
        assert torch.equal(loaded(ids, num_steps=1, init_scale=0.0).logits, want)
    if dtype == torch.bfloat16:
        prompt = ids[:1, :6]
        with torch.no_grad():
            greedy = hf.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        for fast in (True, False):
            out = generate(model, prompt, max_new_tokens=16, num_steps=1, init_scale=0.0, eos_token_id=[], fast=fast)
            assert out.sequences.tolist() == greedy.tolist()


@pytest.mark.parametrize("norm", ["norm_unit_offset", "norm_float32_gain"])
def test_a_model_with_non_huginn_norms_takes_neither_the_fused_runner_nor_the_remote_code(norm):
    """The fused runner (accel/runner.py) and the remote-code file implement Huginn's norms only: a model with
    (1 + w) gains or float32 gains, even of Huginn's layout, takes the reference runner, and export refuses it in
    one line."""
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.integrations.export import check_exportable
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    torch.manual_seed(0)
    assert FastRunner.supports(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")))
    assert not FastRunner.supports(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", **{norm: True})))
    with pytest.raises(ValueError, match=rf"Huginn's architecture only; this model sets \['{norm}'\]"):
        check_exportable(rd.ModelConfig.from_preset("tiny", **{norm: True}))
    with pytest.raises(ValueError, match=rf"config.json sets {norm}=True"):
        remote.RecurrentDepthConfig(**{norm: True})
    with pytest.raises(ValueError, match=r"^ModelConfig.transformers_rounding=True is invalid: expected false unless "
                                         r"rope_style is 'half'"):
        rd.ModelConfig.from_preset("tiny", transformers_rounding=True)
