"""NF4 weights (QLoRA's block-wise NormalFloat 4-bit, `weights="nf4"` / `--weights nf4[:gN]`): the levels, the
round trip against int4's at equal bytes, the byte count, a partial last block, decoding equal to the reference path
and to the dequantized twin, QLoRA gradients equal to the dequantized float reference's, the adapter's recorded base
format, and the one parser's one-line refusals."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.weight_quant import (
    NF4_LEVELS,
    Int4WeightLinear,
    Nf4WeightLinear,
    check_weights,
    dequantize_weights,
    held_weights,
    parse_weights,
    quantize_weights,
    quantized_weight_bytes,
    unpack_nibbles,
)
from tests.test_serving import model_dir  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), hidden_size=64))


def gaussian_linear(out_features: int, in_features: int, seed: int = 0) -> nn.Linear:
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)))
    return linear


def test_the_levels_are_normal_quantiles_scaled_to_plus_minus_one_with_an_exact_zero():
    levels = NF4_LEVELS.double()
    assert levels.shape == (16,) and bool((levels[1:] > levels[:-1]).all())
    assert levels[0] == -1 and levels[-1] == 1
    assert int((levels == 0).sum()) == 1 and int((levels > 0).sum()) == 8 and int((levels < 0).sum()) == 7
    # quantiles of N(0, 1): on each side the levels sit at evenly spaced probabilities from 1/2 out to the
    # outermost one (the mean of 1 - 1/32 and 1 - 1/30, see `nf4_levels`), scaled by its quantile
    outer = ((1 - 1 / 32) + (1 - 1 / 30)) / 2
    scale = torch.special.ndtri(torch.tensor(outer, dtype=torch.float64))
    positive = torch.special.ndtr(levels[8:] * scale) - 0.5
    negative = 0.5 - torch.special.ndtr(levels[:7].flip(0) * scale)
    torch.testing.assert_close(positive, (outer - 0.5) * torch.arange(1, 9, dtype=torch.float64) / 8)
    torch.testing.assert_close(negative, (outer - 0.5) * torch.arange(1, 8, dtype=torch.float64) / 7)


@pytest.mark.parametrize("block", [32, 64, 128])
def test_round_trip_error_is_below_int4s_at_equal_bytes_on_gaussian_weights(block):
    """One absmax a block where int4 keeps a scale and a zero: nf4:gN stores the bytes of int4:g2N, and on
    Gaussian weights (what NF4's levels are the quantiles of) its round trip is the more accurate."""
    linear = gaussian_linear(128, 512)
    nf4 = Nf4WeightLinear.from_linear(linear, block)
    int4 = Int4WeightLinear.from_linear(linear, 2 * block, kernel_layout=False)
    assert nf4.quantized_bytes() == int4.quantized_bytes() == 128 * 512 // 2 + 128 * 512 // block * 2
    error = {name: (layer.dequantize() - linear.weight).pow(2).mean().sqrt().item()
             for name, layer in (("nf4", nf4), ("int4", int4))}
    assert error["nf4"] < error["int4"], error
    # each weight lands on its nearest level: within half the widest gap between levels, times its block's absmax
    absmax = linear.weight.detach().abs().view(128, -1, block).amax(-1, keepdim=True)
    half_gap = (NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max() / 2
    assert bool(((nf4.dequantize() - linear.weight).abs().view(128, -1, block) <= half_gap * absmax * 1.01).all())


def test_a_partial_last_block_is_padded_with_the_zero_level_as_int4_pads_its_groups():
    linear = gaussian_linear(6, 75, seed=1)  # 75 = 2 blocks of 32 + 11
    layer = Nf4WeightLinear.from_linear(linear, 32)
    assert layer.qweight.shape == (6, 48) and layer.absmax.shape == (6, 3) and layer.absmax.dtype == torch.bfloat16
    codes = unpack_nibbles(layer.qweight)
    assert bool((NF4_LEVELS[codes[:, 75:].long()] == 0).all())
    weight = layer.dequantize()
    assert weight.shape == (6, 75) and (weight - linear.weight).abs().max() < 0.5
    x = torch.randn(3, 75, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x), F.linear(x, weight, linear.bias))
    assert torch.equal(layer.dequantized().weight, weight)


def test_bytes_are_counted_exactly_and_the_format_is_held():
    model = tiny_model()
    shapes = [m.weight.shape for m in model.transformer.modules() if type(m) is nn.Linear]
    assert quantize_weights(model, "nf4:g32") == len(shapes) > 0
    assert held_weights(model) == "nf4:g32"
    # half a byte a weight (rows padded to whole blocks) + a bf16 absmax per block of each row
    assert quantized_weight_bytes(model) == sum(o * (-(-i // 32) * 32) // 2 + o * -(-i // 32) * 2 for o, i in shapes)
    assert quantize_weights(model, "nf4:g32") == 0  # the same format keeps its codes
    with pytest.raises(ValueError, match="already holds nf4:g32 weights"):
        quantize_weights(model, "nf4")
    assert dequantize_weights(model) == len(shapes) and held_weights(model) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generation_with_nf4_equals_the_reference_path_and_the_dequantized_twin(dtype):
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.inference.runner import make_runner

    model = tiny_model().to(dtype).eval()
    quantize_weights(model, "nf4")
    assert isinstance(make_runner(model), FastRunner)  # the fused runner, through the layers' own (reference) product
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    prompt = torch.tensor([[5, 17, 33, 2, 40], [7, 9, 11, 13, 15]])
    gen = dict(max_new_tokens=6, num_steps=3, init_scale=0.0, output_logits=True)
    want = generate(model, prompt, fast=False, **gen)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for m, fast in ((model, True), (twin, False), (twin, True)):
        got = generate(m, prompt, fast=fast, **gen)
        assert torch.equal(got.sequences, want.sequences), (m is twin, fast)
        torch.testing.assert_close(got.logits.float(), want.logits.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("bias", [False, True])
def test_the_layers_gradients_equal_autograd_through_the_dequantized_weight(bias):
    layer = Nf4WeightLinear.from_linear(gaussian_linear(48, 40, seed=3).requires_grad_(False), 32)
    if not bias:
        layer.bias = None
    saved: list[torch.Size] = []
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(4))
    grads = []
    for fn in (layer, lambda v: F.linear(v, layer.dequantize(), layer.bias)):
        v = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            out = fn(v)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
        grads.append((out.detach(), v.grad))
        if fn is layer:  # (QLoRA's memory: no dequantized weight kept until the backward)
            assert not [s for s in saved if s.numel() == 48 * 40]
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)


def test_qlora_adapter_gradients_on_nf4_equal_the_dequantized_float_ones_and_the_format_is_recorded(tmp_path):
    pytest.importorskip("peft")
    from recurrent_depth.train.lora import WEIGHTS_KEY, LoraSpec, add_lora, recorded_base, save_adapter

    model = add_lora(tiny_model(), LoraSpec(rank=2, weights="nf4:g32"), seed=1)
    assert type(model.get_base_model().transformer.core_block[0].attn.Wqkv.base_layer) is Nf4WeightLinear
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 after peft's init: values everywhere, so every A gets a gradient too
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    reference = copy.deepcopy(model)
    assert dequantize_weights(reference) > 0  # float layers holding the dequantized weights, the same adapter on them
    for name, param in reference.named_parameters():
        param.requires_grad_("lora_" in name)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (model, reference):
        logits = m(ids[:, :-1], num_steps=3, init_scale=0.0).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "lora_" in n})
    got, want = grads
    assert got.keys() == want.keys() and any(".prelude." in n and want[n].abs().sum() > 0 for n in got)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5 * want[name].abs().max().item(),
                                   msg=name)
    # the adapter records the format it was trained on, and that record reads back (a resume rebuilds that base)
    save_adapter(model, tmp_path / "adapter")
    assert recorded_base(tmp_path / "adapter")[WEIGHTS_KEY] == "nf4:g32"


def test_the_one_parser_takes_nf4_and_refuses_bad_blocks_in_one_line(model_dir, capsys):  # noqa: F811
    from recurrent_depth.cli import build_parser, main

    assert parse_weights("nf4") == ("nf4", 64) and parse_weights("nf4:g32") == ("nf4", 32)
    assert check_weights("nf4:g256") == "nf4:g256"
    for bad in ("nf4:g0", "nf5", "nf4:g48", "nf4:", "NF4", "nf4g64"):
        with pytest.raises(ValueError, match=rf"^weights='{bad}' is invalid: expected .* 'nf4' \(block 64\) or one "
                                             r"of 'nf4:g32', 'nf4:g64', 'nf4:g128', 'nf4:g256' \(or None\)$"):
            check_weights(bad)
    base = ["generate", "--model", str(model_dir), "--prompt", "a=1", "--max-new-tokens", "2", "--num-steps", "2",
            "--threads", "1"]
    assert main([*base, "--weights", "nf4:g32"]) == 0 and capsys.readouterr().out.strip()
    for bad in ("nf4:g0", "nf5"):
        assert main([*base, "--weights", bad]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and f"weights='{bad}' is invalid" in errors[0], errors
    pytest.importorskip("peft")
    from recurrent_depth.train.lora import lora_spec_from_args

    args = build_parser().parse_args(["train", "--lora", "--weights", "nf4:g32"])
    assert lora_spec_from_args(args).weights == "nf4:g32"
    with pytest.raises(ValueError, match=r"^weights='nf5' is invalid"):
        lora_spec_from_args(build_parser().parse_args(["sft", "--lora", "--weights", "nf5"]))


def test_the_benchmarks_take_nf4():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _args import weight_formats

    assert weight_formats("int4,nf4,nf4:g128") == ["int4", "nf4", "nf4:g128"]
