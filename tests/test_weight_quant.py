"""Weight-only int8 quantization (weight_quant.py): the kernel against the plain reference, the
quantization error bound, and every decoding mode, the server's batch, the loader, the CLI and the
transformers route against a model holding the dequantized weights.

Tolerances: torch's int8 kernel takes bf16 activations and returns bf16, so its products match the
float32 reference (dequantize, then matmul) to bf16 output rounding: |error| <= 2^-7 of the row's
largest |value| (observed <= 2^-8). The float32 path is the reference computation itself, so a
quantized float32 model gives bit-equal tokens and logits to its dequantized twin.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.weight_quant import (
    Int8WeightLinear,
    check_weights,
    dequantize_int8,
    dequantize_weights,
    quantize_int8,
    quantize_weights,
    quantized_weights,
)
from tests.batch_support import serve_in_one_batch
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(layer: Int8WeightLinear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize in float32, then multiply in float32."""
    w = dequantize_int8(layer.qweight, layer.scales)
    out = x.float() @ w.t()
    return out if layer.bias is None else out + layer.bias.float()


@pytest.mark.parametrize("M,K,N", [(1, 32, 5), (3, 48, 13), (7, 160, 33), (8, 64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_the_dequantized_reference(M, K, N, bias):
    linear = nn.Linear(K, N, bias=bias).to(torch.bfloat16)
    layer = Int8WeightLinear.from_linear(linear)
    x = torch.randn(2, M, K).to(torch.bfloat16)  # 3-D input: the layer flattens and restores the shape
    assert layer.uses_kernel(x)
    out = layer(x)
    assert out.shape == (2, M, N) and out.dtype == torch.bfloat16
    ref = _reference(layer, x)
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    assert ((out.float() - ref).abs() / scale).max() <= 2**-7


@pytest.mark.parametrize("K", [13, 40, 129])
def test_widths_the_kernel_gets_wrong_take_the_reference(K):
    """K % 16 != 0 reads past the rows in `aten._weight_int8pack_mm` (NaN or a crash, measured): the
    layer computes those in the reference path instead, exactly."""
    layer = Int8WeightLinear.from_linear(nn.Linear(K, 7).to(torch.bfloat16))
    x = torch.randn(3, K).to(torch.bfloat16)
    assert not layer.uses_kernel(x)
    expected = nn.functional.linear(x, dequantize_int8(layer.qweight, layer.scales, torch.bfloat16),
                                    layer.bias)
    assert torch.equal(layer(x), expected)


def test_quantize_dequantize_error_is_within_half_a_step_per_channel():
    w = torch.randn(37, 29) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0  # an all-zero row
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (37,)
    assert torch.equal(scales, scales.to(torch.bfloat16).float())  # the kernel's bf16 scale is the same
    err = (dequantize_int8(q, scales) - w).abs().amax(dim=1)
    assert (err <= scales / 2 * (1 + 1e-6)).all()
    assert torch.equal(dequantize_int8(q, scales)[5], torch.zeros(29))


@pytest.fixture(scope="module")
def pair() -> tuple[rd.RecurrentDepthLM, rd.RecurrentDepthLM]:
    """(quantized tiny float32 model, its twin holding the dequantized weights as plain nn.Linear)."""
    torch.manual_seed(1234)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    swapped = quantize_weights(model, "int8")
    from recurrent_depth.model.recurrent import blocks_of

    assert swapped == 4 * len(blocks_of(model)) + 1  # qkv, proj, fc, out per block, and the adapter
    assert type(model.lm_head) is nn.Linear  # the head is not quantized by default
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    assert quantized_weights(model) and not quantized_weights(twin)
    return model, twin


MODES = {
    "fixed": dict(),
    "kl": dict(exit_criterion="kl", exit_threshold=1e-2),
    "entropy-diff": dict(exit_criterion="entropy-diff"),
    "kv-share-4": dict(kv_budget=4),
    "kv-policy-last": dict(kv_policy="last-step"),
    "warm-start": dict(warm_start=True, exit_criterion="latent-diff", exit_threshold=0.1),
    "speculative": dict(draft_steps=2, lookahead=3),
    "parallel": dict(sampler="parallel", inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1),
    "sampled": dict(do_sample=True, temperature=0.8, top_k=40, init_scale=1.0),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_decoding_mode_gives_the_dequantized_models_tokens(pair, mode, monkeypatch):
    monkeypatch.setenv("RDEPTH_NO_ACCEL", "1")  # both on the reference runner (the quantized one always is)
    model, twin = pair
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    kw = dict(dict(max_new_tokens=6, num_steps=4, init_scale=0.0, output_logits=True, seed=3), **MODES[mode])
    out, ref = generate(model, ids, **kw), generate(twin, ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.logits, ref.logits)


def test_quantized_model_takes_the_reference_runner(pair):
    from recurrent_depth.accel.runner import FastRunner

    model, twin = pair
    assert not FastRunner.supports(model) and FastRunner.supports(twin)


def test_server_batch_with_int8_weights(pair, monkeypatch):
    monkeypatch.setenv("RDEPTH_NO_ACCEL", "1")
    model, twin = pair
    jobs = [([5, 9, 2, 7], dict(max_new_tokens=4, num_steps=3, init_scale=0.0)),
            ([1, 4], dict(max_new_tokens=4, num_steps=2, init_scale=0.0, exit_criterion="kl", exit_threshold=1e-2))]
    got, want = serve_in_one_batch(model, jobs), serve_in_one_batch(twin, jobs)
    assert [[r.token for r in got[j]] for j in got] == [[r.token for r in want[j]] for j in want]


def test_bf16_model_decodes_close_to_its_dequantized_twin():
    """The kernel path in a whole model: same greedy tokens, logits within bf16 rounding."""
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny")
    model = rd.RecurrentDepthLM(cfg).to(torch.bfloat16).eval()
    quantize_weights(model, "int8")
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        a = model(ids, num_steps=3, init_scale=0.0).logits.float()
        b = twin(ids, num_steps=3, init_scale=0.0).logits.float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


def test_bad_weights_values_are_one_line_errors():
    assert check_weights(None) is None and check_weights("int8") == "int8"
    with pytest.raises(ValueError, match=r"weights='int3' is invalid: expected one of \['int8'\]"):
        check_weights("int3")
    with pytest.raises(ValueError, match="int4' is not implemented yet"):
        check_weights("int4")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8w")
    make_model_dir(path)
    return path


def test_loader_and_transformers_route(model_dir):
    from transformers import AutoModelForCausalLM

    loaded = rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int8")
    assert isinstance(loaded.transformer.core_block[0].attn.Wqkv, Int8WeightLinear)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, weights="int8").eval()
    assert isinstance(hf.transformer.core_block[0].mlp.fc, Int8WeightLinear)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = loaded(ids, num_steps=2, init_scale=0.0).logits
        got = hf(ids, num_steps=2, init_scale=0.0).logits
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weights='fp4' is invalid"):
        rd.RecurrentDepthLM.from_pretrained(model_dir, weights="fp4")


def test_cli_generate_with_int8_weights_and_a_bad_value(model_dir, capsys):
    from recurrent_depth.cli import main

    base = ["generate", "--model", str(model_dir), "--prompt", "a=1", "--max-new-tokens", "3", "--num-steps", "2",
            "--threads", "1"]
    assert main([*base, "--weights", "int8"]) == 0
    assert capsys.readouterr().out.strip()
    assert main([*base, "--weights", "int4"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "int4' is not implemented yet" in errors[0]
