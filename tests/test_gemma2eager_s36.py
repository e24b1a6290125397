"""Retrofitted Gemma 2 attends as plain math (`ModelConfig.eager_attention`), and weight-file precedence.

transformers' Gemma 2 has no SDPA (`Gemma2PreTrainedModel._supports_sdpa = False`): it always attends as its eager
math, soft-capped or not. Our model used that math only for soft-capped layers and SDPA otherwise, so a Gemma 2 with
`attn_logit_softcapping` null was 0.19 (bf16) / 0.019 (fp16) apart from transformers on logits up to 3.9.
A directory holding both `model.safetensors` and `model.safetensors.index.json` loaded the shards named by the index;
transformers loads the single file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3TextConfig, GemmaConfig

import recurrent_depth as rd
from recurrent_depth.families.retrofit import Surgery, model_config, retrofit
from recurrent_depth.inference.generate import generate
from recurrent_depth.model.mixers import attention as attention_module
from tests.test_retrofit import SHAPE, perturbed


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


@pytest.fixture(scope="module")
def gemma2_uncapped(tmp_path_factory) -> Path:
    """A Gemma 2 whose attention logits are not soft-capped (the final ones are), with every other layer sliding."""
    path = tmp_path_factory.mktemp("gemma2-uncapped")
    torch.manual_seed(0)
    perturbed(Gemma2ForCausalLM(Gemma2Config(**SHAPE, head_dim=12, query_pre_attn_scalar=20, sliding_window=6,
                                             attn_logit_softcapping=None, final_logit_softcapping=4.0))
              ).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemma2_without_attention_softcap_equals_transformers_bit_for_bit(gemma2_uncapped, dtype):
    hf = Gemma2ForCausalLM.from_pretrained(gemma2_uncapped, dtype=dtype).eval()
    assert hf.config._attn_implementation == "eager"  # (transformers' default for Gemma 2)
    model = retrofit(gemma2_uncapped, prelude=2, core=(2, 4), coda=1, dtype=dtype)
    assert model.config.eager_attention and model.config.attn_logit_softcapping is None
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits.float())
    # cached decoding: transformers' greedy tokens, and each step's logits the full forward's, bit for bit
    prompt = ids[:1, :6]
    out = generate(model, prompt, max_new_tokens=12, num_steps=1, init_scale=0.0, eos_token_id=[], output_logits=True)
    with torch.no_grad():
        greedy = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        full = model(out.sequences, num_steps=1, init_scale=0.0).logits[:, prompt.shape[1] - 1:-1]
    assert out.sequences.tolist() == greedy.tolist()
    assert torch.equal(out.logits, full)


def test_only_gemma2_sources_attend_eagerly():
    """transformers' Gemma (1) and Gemma 3 default to SDPA (bit-exact with ours already), as every other type does."""
    surgery = Surgery(prelude=1, core=(1, 2), coda=1)
    small = dict(SHAPE, num_hidden_layers=3, head_dim=8)
    for config, eager in ((Gemma2Config(**small, attn_logit_softcapping=None), True),
                          (GemmaConfig(**small), False), (Gemma3TextConfig(**small), False)):
        assert model_config(config.to_dict(), surgery).eager_attention is eager, config.model_type


def test_eager_attention_layers_attend_as_plain_math_through_every_cache(monkeypatch):
    """Full forward, the float KV cache and a quantized one (its columns read back as floats), on windowed and full
    layers: every attention call goes through `eager_attention`, none through SDPA or the codes kernels."""
    from recurrent_depth.accel.runner import FastRunner

    config = rd.ModelConfig.from_preset("tiny", eager_attention=True, rope_style="half", transformers_rounding=True,
                                        attention_windows=[3, None, 2, None])
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config).eval()
    assert not FastRunner.supports(model)
    calls = {"attention": 0, "eager": 0}
    real_eager = attention_module.eager_attention

    def counted(*args, **kwargs):
        calls["eager"] += 1
        return real_eager(*args, **kwargs)

    def no_sdpa(*args, **kwargs):
        raise AssertionError("an eager_attention layer called SDPA")

    monkeypatch.setattr(attention_module, "eager_attention", counted)
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", no_sdpa)
    for module in model.modules():
        if isinstance(module, attention_module.Attention):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__("attention", calls["attention"] + 1))
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(prompt, num_steps=2, init_scale=0.0)
    for kv_quant in (None, "k=prod:3.5,v=mse:3.5"):
        out = generate(model, prompt, max_new_tokens=5, num_steps=2, init_scale=0.0, eos_token_id=[],
                       output_logits=True, kv_quant=kv_quant)
        if kv_quant is None:
            with torch.no_grad():
                full = model(out.sequences, num_steps=2, init_scale=0.0).logits[:, prompt.shape[1] - 1:-1]
            torch.testing.assert_close(out.logits, full, rtol=1e-5, atol=1e-5)
    assert calls["attention"] > 0 and calls["eager"] == calls["attention"]


def test_eager_attention_is_saved_checked_and_refused_where_not_implemented(tmp_path):
    from recurrent_depth.integrations.export import check_exportable
    from recurrent_depth.integrations.hf_config import RecurrentDepthConfig
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    config = rd.ModelConfig.from_preset("tiny", eager_attention=True)
    rd.RecurrentDepthLM(config).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eager_attention"] is True
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path).config.eager_attention is True
    assert RecurrentDepthConfig.from_model_config(config).to_model_config().eager_attention is True
    with pytest.raises(ValueError, match=r"Huginn's architecture only; this model sets \['eager_attention'\]"):
        check_exportable(config)
    with pytest.raises(ValueError, match=r"config.json sets eager_attention=True"):
        remote.RecurrentDepthConfig(eager_attention=True)
    with pytest.raises(ValueError, match=r"^ModelConfig.eager_attention='yes' is invalid: expected true or false"):
        rd.ModelConfig.from_preset("tiny", eager_attention="yes")
    with pytest.raises(ValueError, match=r"eager_attention.*mixer 'gla'.*set eager_attention false"), \
            torch.device("meta"):
        rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer={"core": "gla"}, eager_attention=True))


def test_model_safetensors_beside_an_index_is_the_file_loaded(tmp_path):
    """transformers' from_pretrained looks for model.safetensors before the index; so do we."""
    torch.manual_seed(0)
    config = rd.ModelConfig.from_preset("tiny")
    sharded, single = rd.RecurrentDepthLM(config), rd.RecurrentDepthLM(config)
    sharded.save_pretrained(tmp_path / "sharded", max_shard_bytes=64_000)
    single.save_pretrained(tmp_path / "both")
    assert not torch.equal(sharded.transformer.wte.weight, single.transformer.wte.weight)
    for shard in (tmp_path / "sharded").glob("model*.safetensors*"):
        (tmp_path / "both" / shard.name).write_bytes(shard.read_bytes())
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path / "both")
    want = single.state_dict()
    assert all(torch.equal(t, want[name]) for name, t in loaded.state_dict().items())
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "both")
    assert torch.equal(hf.get_input_embeddings().weight, single.transformer.wte.weight)
