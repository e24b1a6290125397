"""Weight-only quantization bugs found by a hunt (weight_quant.py):

- `model.to(dtype)` / `.half()` after quantizing cast the codes' scales: float32 int8 scales reached the C++
  product as bf16 (a RuntimeError, "int8_linear: scales float32 [out]"), bf16 int4 (scale, zero) pairs lost
  bits as fp16, and `dequantize_weights` gave back linears in the old dtype beside the model's new one;
- `quantize_weights(model, fmt, include_head=True)` on a model already holding `fmt` returned 0 and left the
  head float (the option silently ignored);
- a module without `.transformer` failed with an AttributeError traceback instead of one line.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recurrent_depth as rd
from recurrent_depth.weight_quant import Int8WeightLinear, QuantizedLinear, dequantize_weights, quantize_weights

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = dict(num_steps=2, init_scale=0.0)


def _quantized(fmt: str, preset: str = "tiny") -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset(preset)).eval()
    assert quantize_weights(model, fmt) > 0
    return model


def _codes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buf.clone() for name, buf in model.named_buffers()
            if isinstance(model.get_submodule(name.rpartition(".")[0]), QuantizedLinear)}


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_casting_a_quantized_model_keeps_its_codes_and_dequantizes_in_the_new_dtype(fmt):
    model = _quantized(fmt)
    before = _codes(model)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        cast(model)
        after = _codes(model)
        assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    model.to(torch.bfloat16)
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    assert {m.weight.dtype for m in twin.modules() if type(m) is nn.Linear} == {torch.bfloat16}
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(twin(ids, **STEPS).logits).all()  # (float32 linears on bf16 rows raised)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_float32_model_cast_to_bf16_after_quantizing_decodes_with_cpp(fmt, monkeypatch):
    from recurrent_depth.accel import quant_cpp

    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    if quant_cpp.load() is None:
        pytest.skip(f"the C++ kernels cannot build here: {quant_cpp.failure()}")
    model = _quantized(fmt).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    out = rd.generate(model, ids, max_new_tokens=3, **STEPS)  # raised "int8_linear: scales float32 [out]"
    assert out.sequences.shape == (1, 8)


def test_include_head_on_a_model_already_holding_the_format_quantizes_the_head():
    model = _quantized("int8", "tiny-ouro")  # Ouro's head is untied
    assert type(model.lm_head) is nn.Linear
    assert quantize_weights(model, "int8", include_head=True) == 1  # returned 0, head left float
    assert isinstance(model.lm_head, Int8WeightLinear)
    assert quantize_weights(model, "int8", include_head=True) == 0


def test_quantizing_a_module_that_is_not_our_model_is_one_line():
    with pytest.raises(ValueError, match="quantize_weights takes a RecurrentDepthLM .* got Sequential"):
        quantize_weights(nn.Sequential(nn.Linear(4, 4)), "int8")
