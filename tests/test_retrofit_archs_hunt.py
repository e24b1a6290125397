"""Retrofit on the config variants users bring (families/retrofit.py): keys that change transformers' math are
refused in one line, keys transformers never reads are not, and bad Python-API input is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from recurrent_depth.families.retrofit import retrofit

SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)


@pytest.fixture(autouse=True)
def one_thread():
    from tests.train_support import OneThread

    with OneThread():
        yield


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.float().eval()


def one_line(call, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        call()
    assert str(info.value).startswith("retrofit:") and "\n" not in str(info.value)


def test_a_bidirectional_is_causal_false_source_is_refused_not_made_causal():
    """transformers' mask builders attend both ways when config.is_causal is false: it was converted into a causal
    model (logits up to 15.7 apart on a tiny Llama)."""
    torch.manual_seed(0)
    hf = perturbed(LlamaForCausalLM(LlamaConfig(**SHAPE, is_causal=False)))
    ids = torch.arange(3, 13).unsqueeze(0)
    with torch.no_grad():  # (the key really changes transformers' model: an early position reads later ones)
        changed = hf(ids).logits[0, 0] - hf(ids[:, :1]).logits[0, 0]
    assert changed.abs().max() > 1e-3
    one_line(lambda: retrofit(hf, prelude=1, core=(1, 2), coda=1), r"llama with is_causal=False.*causal attention")


@pytest.mark.parametrize("make", [lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8, mlp_bias=True)),
                                  lambda: Olmo2ForCausalLM(Olmo2Config(**SHAPE, mlp_bias=True))])
def test_an_mlp_bias_key_the_source_never_reads_converts_exactly(make):
    """Only Llama's MLP reads mlp_bias: on Qwen3 / OLMo-2 the source has no MLP biases, and the conversion was
    refused as lacking them."""
    torch.manual_seed(0)
    hf = perturbed(make())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = retrofit(hf, prelude=1, core=(1, 2), coda=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=1, init_scale=0.0).logits, hf(ids).logits,
                                   rtol=1e-5, atol=1e-4)


def test_a_quantized_checkpoint_is_refused_by_its_config(tmp_path):
    """A config.json with quantization_config (FP8 / GPTQ / bitsandbytes ...) holds weights that are not the model's
    float values: with float-typed tensors (an FP8 block-scaled export without its scales) it was converted."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    one_line(lambda: retrofit(tmp_path, prelude=1, core=(1, 2), coda=1), r"quantized checkpoint.*quant_method='fp8'")


@pytest.mark.parametrize("options, needle", [
    (dict(core=(1,)), r"core=\(1,\) is invalid"),                  # was: "not enough values to unpack"
    (dict(core=2), r"core=2 is invalid: expected \(A, B\) or 'A:B'"),  # was: "'int' object is not iterable"
    (dict(core=(1, 2), dtype="bfloat16"), r"dtype='bfloat16' is invalid"),  # was: a many-line TypeError from torch
    (dict(core=(1, 2), dtype=torch.int8), r"dtype=torch.int8 is invalid"),  # was: a load_state_dict traceback
])
def test_bad_python_api_arguments_are_one_line(options, needle):
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE))
    one_line(lambda: retrofit(hf, prelude=1, coda=1, **options), needle)
