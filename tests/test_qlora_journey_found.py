"""Found by a QLoRA user-journey hunt (a tiny transformers Llama retrofitted, `rdepth sft --lora --weights int4`, then
generate / serve / eval / lm-eval / export with the adapter on int8 / int4 and float weights)."""

from __future__ import annotations

import copy

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.lora import LoraSpec, add_lora, attach_adapter, save_adapter
from tests.test_serving import model_dir  # noqa: F401 - the fixture

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):  # noqa: F811 - the fixture
    """A QLoRA adapter (trained-on format int4) of the tiny base with random A and B, so that it changes the logits."""
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(model_dir), LoraSpec(rank=2, weights="int4"),
                       base_dir=model_dir, seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return save_adapter(wrapped, tmp_path_factory.mktemp("qlora_journey") / "adapter")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_lm_eval_backend_puts_a_peft_adapter_on_quantized_weights(model_dir, adapter, weights):  # noqa: F811
    """`rdepth lm-eval --model_args pretrained=M,peft=A,weights=int4` failed: HFLM's PeftModel.from_pretrained knows
    no int8 / int4 layer of ours ("Target module Int4WeightLinear ... is not supported"). Now its scores are those of
    `rdepth eval --lora A --weights int4` (the adapter unmerged on the quantized layers)."""
    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM

    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), peft=str(adapter), weights=weights, dtype="float32",
                              num_steps=3, init_scale=0.0, device="cpu", batch_size=1)
    ours = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir, weights=weights), adapter).eval()
    ids = torch.tensor([[5, 17, 33, 2, 40, 9]])
    with torch.no_grad():
        want = ours(ids, num_steps=3, init_scale=0.0).logits
        plain = rd.RecurrentDepthLM.from_pretrained(model_dir, weights=weights)(ids, num_steps=3, init_scale=0.0).logits
    got = lm._model_call(ids)
    assert not torch.allclose(want, plain, atol=1e-3)  # (the adapter matters)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_lm_eval_backend_refuses_a_dora_adapter_on_quantized_weights_naming_it(model_dir, tmp_path):  # noqa: F811
    import peft

    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
    from recurrent_depth.train.lora import target_modules

    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    dora = peft.get_peft_model(model, peft.LoraConfig(r=2, use_dora=True,
                                                      target_modules=target_modules(model, LoraSpec(parts=("coda",)))))
    save_adapter(dora, tmp_path / "dora")
    with pytest.raises(ValueError, match=r"^cannot load the LoRA adapter .*dora onto int8 weights: it is a DoRA"):
        RecurrentDepthEvalLM(pretrained=str(model_dir), peft=str(tmp_path / "dora"), weights="int8", device="cpu")


def test_quantizing_after_attaching_makes_the_same_layers_so_merging_refuses_in_one_line(model_dir, adapter):  # noqa: F811
    """docs: `quantize_weights(attach_adapter(float_model, A), "int4")` is "the other order: the same layers". It left
    peft's own LoRA layers over the int4 ones, whose `merge_and_unload` failed with an AttributeError
    ('Int4WeightLinear' object has no attribute 'weight'), not the one-line refusal the quantized-first order gives."""
    from recurrent_depth.weight_quant import quantize_weights

    after = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir), adapter)
    quantize_weights(after, "int4")
    first = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int4"), adapter)
    layer = after.transformer.core_block[0].attn.Wqkv
    assert type(layer) is type(first.transformer.core_block[0].attn.Wqkv)
    with pytest.raises(ValueError, match=r"^cannot merge a LoRA adapter into int4:g32 weights"):
        layer.merge()


def test_include_head_quantizes_a_head_that_carries_an_adapter():
    """`quantize_weights(model, include_head=True)` left a head carrying a peft LoRA adapter float, silently."""
    import peft

    from recurrent_depth.weight_quant import Int8WeightLinear, dequantize_weights, quantize_weights

    def untied() -> rd.RecurrentDepthLM:
        torch.manual_seed(0)
        return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64, tie_embeddings=False))

    model = untied()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    assert quantize_weights(wrapped, "int8", include_head=True) == quantize_weights(untied(), "int8", include_head=True)
    assert type(model.lm_head.base_layer) is Int8WeightLinear
    reference = copy.deepcopy(model)
    dequantize_weights(reference)
    ids = torch.tensor([[5, 17, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, num_steps=2, init_scale=0.0).logits,
                                   reference(ids, num_steps=2, init_scale=0.0).logits, rtol=0, atol=1e-4)


def test_a_dora_adapter_goes_on_layers_dequantized_again(model_dir, adapter):  # noqa: F811
    """After `dequantize_weights` the LoRA layers made for int4 ones hold float weights again: a DoRA adapter added
    then was refused as going "on None weights"."""
    import peft

    from recurrent_depth.train.lora import load_lora
    from recurrent_depth.weight_quant import dequantize_weights

    wrapped = load_lora(rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int4"), adapter)
    assert dequantize_weights(wrapped) > 0
    wrapped.add_adapter("dora", peft.LoraConfig(r=2, use_dora=True, target_modules=["transformer.adapter"]))
    assert wrapped.transformer.adapter.use_dora["dora"]
