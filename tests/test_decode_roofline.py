"""The byte counting of benchmarks/decode_roofline.py on a tiny model (the benchmark itself is heavy)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.weight_quant import Int4WeightLinear, Int8WeightLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_roofline as dr  # noqa: E402


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    return dr.build_model(rd.ModelConfig.from_preset("tiny"), torch.bfloat16, seed=0)


def test_build_is_in_the_requested_dtype_and_tied(model):
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    assert float(model.lm_head.weight.detach().float().std()) > 0  # the init ran on the bf16 tensors


def test_parts_cover_every_weight_once(model):
    parts = dr.PartBytes.of(model)
    # The tied embedding is read as the head, so the parts sum to the model's bytes exactly.
    assert parts.prelude + parts.adapter + parts.core + parts.readout == dr.param_bytes(model)
    cfg = model.config
    core = sum(p.numel() for p in model.transformer.core_block.parameters()) * 2
    assert parts.core == core
    assert parts.kv_row == 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert parts.embedding_row == cfg.hidden_size * 2


def test_token_bytes_fixed_and_readout_every_step(model):
    parts = dr.PartBytes.of(model)
    cfg = model.config
    r, context = 5, 9
    fixed = dr.token_bytes(parts, r, context, readout_every_step=False)
    assert fixed["weights"] == parts.embedding_row + parts.prelude + r * (parts.adapter + parts.core) + parts.readout
    calls = cfg.prelude_layers + r * cfg.core_layers + cfg.coda_layers
    assert fixed["kv"] == calls * (context + 1) * parts.kv_row
    kl = dr.token_bytes(parts, r, context, readout_every_step=True)
    assert kl["weights"] - fixed["weights"] == (r - 1) * parts.readout
    assert kl["kv"] - fixed["kv"] == (r - 1) * cfg.coda_layers * (context + 1) * parts.kv_row


def test_roofline_uses_each_tokens_steps_and_context(model):
    parts = dr.PartBytes.of(model)
    line = dr.roofline(parts, [3, 7], prompt_len=4, readout_every_step=True, bandwidth_gb_s=10.0)
    total = dr.token_bytes(parts, 3, 5, True)["total"] + dr.token_bytes(parts, 7, 6, True)["total"]
    assert line["roofline_tokens_per_s"] == pytest.approx(2 * 10e9 / total)


def test_bad_configs_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        dr.parse_args(["--configs", "fixed,int5"])
    assert "unknown ['int5']" in capsys.readouterr().err


def test_int8_parts_count_the_int8_weights_and_scales():
    model = dr.build_model(rd.ModelConfig.from_preset("tiny"), torch.bfloat16, seed=0)
    before = dr.PartBytes.of(model)
    dr.quantize_weights(model, "int8")
    after = dr.PartBytes.of(model)
    core = sum(2 * p.numel() for n, p in model.transformer.core_block.named_parameters())  # norms and biases
    core += sum(m.qweight.numel() + 4 * m.scales.numel() for m in model.transformer.core_block.modules()
                if isinstance(m, Int8WeightLinear))
    assert after.core == core < before.core
    assert after.readout < before.readout  # the coda is quantized (the head is not)


def test_int4_parts_count_the_packed_weights_and_scales_after_int8_is_undone():
    model = dr.build_model(rd.ModelConfig.from_preset("tiny"), torch.float32, seed=0)
    dr.quantize_weights(model, "int8")
    dr.dequantize_weights(model)
    dr.quantize_weights(model, "int4")
    core = sum(4 * p.numel() for p in model.transformer.core_block.parameters())  # norms and biases
    core += sum(m.qweight.numel() + m.scales_and_zeros.numel() * m.scales_and_zeros.element_size()
                for m in model.transformer.core_block.modules() if isinstance(m, Int4WeightLinear))
    assert dr.PartBytes.of(model).core == core
    assert not any(isinstance(m, Int8WeightLinear) for m in model.modules())
