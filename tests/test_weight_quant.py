"""Weight-only quantization (weight_quant.py), int8 per output channel and int4 group-wise: the
kernels against the plain reference, the quantization error bounds, the byte counts, and every
decoding mode, the server's batch, the loader, the CLI and the transformers route against a model
holding the dequantized weights.

Tolerances: torch's int8 kernel takes bf16 activations and returns bf16, so its products match the
float32 reference (dequantize, then matmul) to bf16 output rounding: |error| <= 2^-7 of the row's
largest |value| (observed <= 2^-8). With C++ off (the suite's default) the float32 int8 path is the
reference computation itself, so a quantized float32 model gives bit-equal tokens and logits to its
dequantized twin; with it on, decode rows take the C++ product, equal to float32 rounding. torch's int4
kernel takes float32, bf16 and fp16: float32 products agree with the reference to float32 rounding
(a different summation order: observed <= 3e-6 of the row's largest value), bf16 ones within 2^-7
(observed <= 2^-8), fp16 within 2^-9 (observed 5e-4); a float32 int4 model therefore gives the same
tokens as its twin and logits within 1e-5, and its layers the kernel refuses are bit-equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.weight_quant import (
    Int4WeightLinear,
    Int8WeightLinear,
    check_weights,
    dequantize_int4,
    dequantize_int8,
    dequantize_weights,
    logical_parameters,
    pack_nibbles,
    parse_weights,
    quantize_int4,
    quantize_int8,
    quantize_weights,
    quantized_weight_bytes,
    quantized_weights,
    unpack_nibbles,
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


# ---------------------------------------------------------------- int4 layers


def _int4_reference(layer: Int4WeightLinear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize in float32 (from the unpacked values), then multiply in float32."""
    out = x.float() @ layer.dequantize().t()
    return out if layer.bias is None else out + layer.bias.float()


INT4_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}


@pytest.mark.parametrize("M,K,N,group", [(1, 64, 32, 32), (3, 96, 48, 32), (7, 256, 80, 64), (8, 256, 16, 128),
                                         (2, 512, 32, 256)])
@pytest.mark.parametrize("dtype", list(INT4_TOLERANCE))
def test_int4_kernel_matches_the_dequantized_reference(M, K, N, group, dtype):
    linear = nn.Linear(K, N, bias=M % 2 == 1).to(dtype)
    layer = Int4WeightLinear.from_linear(linear, group)
    x = torch.randn(2, M, K).to(dtype)
    assert layer.kernel_layout and layer.uses_kernel(x)
    out = layer(x)
    assert out.shape == (2, M, N) and out.dtype == dtype
    ref = _int4_reference(layer, x)
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    assert ((out.float() - ref).abs() / scale).max() <= INT4_TOLERANCE[dtype]


@pytest.mark.parametrize("K,N,group", [(40, 7, 32), (96, 48, 64), (176, 64, 32), (64, 24, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_shapes_the_kernel_refuses_take_the_reference_exactly(K, N, group, dtype):
    """The kernel needs out % 16 == 0 and in % group == 0 (it raises otherwise): those layers store
    plain nibbles (padded to whole groups) and compute dequantize-then-F.linear."""
    layer = Int4WeightLinear.from_linear(nn.Linear(K, N).to(dtype), group)
    x = torch.randn(3, K).to(dtype)
    assert not layer.kernel_layout and not layer.uses_kernel(x)
    expected = nn.functional.linear(x, layer.dequantize(dtype), layer.bias)
    assert torch.equal(layer(x), expected)
    assert layer.qweight.shape == (N, -(-K // group) * group // 2)


@pytest.mark.parametrize("fmt", ["int8", "int4-kernel-layout"])
def test_input_gradients_through_the_kernel_layers_take_the_reference(fmt):
    """torch's int8 / int4 kernels have no derivative: a call with autograd through x (GradMem's memory
    gradient through a frozen quantized model) takes the reference, x's gradient the dequantized weight's."""
    linear = nn.Linear(32, 16).to(torch.bfloat16)
    layer = (Int8WeightLinear.from_linear(linear) if fmt == "int8"
             else Int4WeightLinear.from_linear(linear, 32, kernel_layout=True))
    x = torch.randn(12, 32).to(torch.bfloat16).requires_grad_()
    layer(x).float().square().sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    nn.functional.linear(x_ref, layer.dequantize(torch.bfloat16), layer.bias).float().square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_gradmem_runs_on_a_bf16_model_with_quantized_weights():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval().to(torch.bfloat16)
    quantize_weights(model, "int8")
    out = generate(model, torch.randint(0, 64, (1, 12)), max_new_tokens=2, num_steps=2, gradmem_tokens=2,
                   gradmem_steps=1)
    assert out.sequences.shape[1] == 14


def test_int4_error_bound_and_the_stored_values_round_trip():
    torch.manual_seed(0)
    w = torch.randn(48, 100) * torch.logspace(-3, 1, 48)[:, None] + torch.randn(48, 1)  # offsets too
    w[5] = 0.0  # an all-zero row
    w[7, :32] = 0.25  # a constant group
    q, sz = quantize_int4(w, 32)
    assert q.shape == (48, 128) and sz.shape == (4, 48, 2) and int(q.max()) <= 15
    assert torch.equal(sz, sz.to(torch.bfloat16).float())  # the bf16 kernel reads the same scales and zeros
    scale, zero = (sz[..., i].t().repeat_interleave(32, 1)[:, :100] for i in (0, 1))
    err = (dequantize_int4(q, sz, 100) - w).abs()
    # half a step, plus the bf16 rounding of the zero and of the scale (at the clamped ends)
    assert (err <= 0.5 * scale + 2**-8 * (zero.abs() + 15 * scale) + 1e-7).all()
    assert torch.equal(dequantize_int4(q, sz, 100)[5], torch.zeros(100))
    assert torch.equal(dequantize_int4(q, sz, 100)[7, :32], torch.full((32,), 0.25))
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    for K, N in ((96, 48), (100, 48)):  # the kernel's packed layout and the plain one read back the values
        linear = nn.Linear(K, N)
        layer = Int4WeightLinear.from_linear(linear, 32)
        assert layer.kernel_layout == (K % 32 == 0)
        assert torch.equal(layer.unpacked()[:, :K], quantize_int4(linear.weight, 32)[0][:, :K])


def test_bytes_are_counted_as_stored():
    fp32 = Int4WeightLinear.from_linear(nn.Linear(96, 48), 32)  # kernel layout: 96 / 2 bytes a row
    assert fp32.quantized_bytes() == 48 * 48 + 3 * 48 * 2 * 4  # + (scale, zero) per group in float32
    bf16 = Int4WeightLinear.from_linear(nn.Linear(100, 48).to(torch.bfloat16), 32)  # plain, padded to 128
    assert bf16.quantized_bytes() == 48 * 64 + 4 * 48 * 2 * 2
    int8 = Int8WeightLinear.from_linear(nn.Linear(100, 48))
    assert int8.quantized_bytes() == 48 * 100 + 48 * 4
    model = nn.Sequential(fp32, bf16, int8, nn.Linear(3, 3))
    assert quantized_weight_bytes(model) == fp32.quantized_bytes() + bf16.quantized_bytes() + int8.quantized_bytes()


# ---------------------------------------------------------------- whole models


FORMATS = ("int8", "int4", "int4:g64")


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[rd.RecurrentDepthLM, rd.RecurrentDepthLM]]:
    """Per format: (quantized tiny float32 model, its twin holding the dequantized weights as plain nn.Linear)."""
    from recurrent_depth.model.recurrent import blocks_of

    torch.manual_seed(1234)
    base = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    out = {}
    for fmt in FORMATS:
        model = copy.deepcopy(base)
        swapped = quantize_weights(model, fmt)
        assert swapped == 4 * len(blocks_of(model)) + 1  # qkv, proj, fc, out per block, and the adapter
        assert type(model.lm_head) is nn.Linear  # the head is not quantized by default
        twin = copy.deepcopy(model)
        dequantize_weights(twin)
        assert quantized_weights(model) and not quantized_weights(twin)
        out[fmt] = model, twin
    int4 = [m for m in out["int4"][0].modules() if isinstance(m, Int4WeightLinear)]
    assert {m.kernel_layout for m in int4} == {True, False}  # tiny's mlp.proj (in 176) takes the reference
    return out


def _same_decode(out, ref, fmt: str) -> None:
    assert torch.equal(out.sequences, ref.sequences)
    if fmt == "int8":  # the float32 reference computation itself
        assert torch.equal(out.logits, ref.logits)
    else:
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)


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
INT4_MODES = ("fixed", "kl", "kv-share-4", "speculative", "parallel", "sampled")  # a representative set


@pytest.mark.parametrize("fmt,mode", [("int8", m) for m in MODES] + [("int4", m) for m in INT4_MODES]
                         + [("int4:g64", "fixed")])
def test_every_decoding_mode_gives_the_dequantized_models_tokens(pairs, fmt, mode, monkeypatch):
    monkeypatch.setenv("RDEPTH_NO_ACCEL", "1")  # both on the reference runner (the quantized one always is)
    model, twin = pairs[fmt]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    kw = dict(dict(max_new_tokens=6, num_steps=4, init_scale=0.0, output_logits=True, seed=3), **MODES[mode])
    _same_decode(generate(model, ids, **kw), generate(twin, ids, **kw), fmt)


FUSED_CASES = [("int8", m) for m in ("fixed", "kl", "kv-share-4", "speculative", "parallel")] + [
    ("int4", "fixed"), ("int4", "kv-share-4")]


@pytest.mark.parametrize("fmt,mode", FUSED_CASES)
def test_the_fused_runner_decodes_a_quantized_model_as_the_reference_runner(pairs, fmt, mode, monkeypatch):
    """Quantized layers run inside the fused runner (their own kernels, the rest of the step fused): the
    reference runner's tokens, and its logits to float32 rounding, with padded rows."""
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.inference.runner import make_runner

    model, _ = pairs[fmt]
    assert type(make_runner(model)) is FastRunner
    calls = []
    layer_type = Int8WeightLinear if fmt == "int8" else Int4WeightLinear
    forward = layer_type.forward
    monkeypatch.setattr(layer_type, "forward", lambda self, x: calls.append(x.shape) or forward(self, x))
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 256, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    kw = dict(dict(max_new_tokens=6, num_steps=4, init_scale=0.0, output_logits=True, seed=3), **MODES[mode])
    fused = generate(model, ids, attention_mask=mask, **kw)
    assert len(calls) >= 6 * 4 * 3  # the fused runner multiplied through the layers (3+ blocks, 4 a block)
    assert sum(shape[0] <= 8 for shape in calls) >= 5 * 4 * 3  # at decode rows too (the C++ products)
    reference = generate(model, ids, attention_mask=mask, fast=False, **kw)
    assert torch.equal(fused.sequences, reference.sequences)
    torch.testing.assert_close(fused.logits, reference.logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_bf16_quantized_model_decodes_in_the_fused_runner_as_its_forward(fmt):
    """bf16: each decoded token's logits from the fused runner (the C++ products at decode rows) are the
    model's own forward's on the same tokens (teacher-forced), to bf16 rounding."""
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.inference.runner import make_runner

    torch.manual_seed(5)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).to(torch.bfloat16).eval()
    quantize_weights(model, fmt)
    assert type(make_runner(model)) is FastRunner
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    out = generate(model, ids, max_new_tokens=5, num_steps=3, init_scale=0.0, output_logits=True)
    with torch.no_grad():
        forced = model(out.sequences, num_steps=3, init_scale=0.0).logits[:, 4:-1].float()
    assert (out.logits.float() - forced).abs().max() <= 0.02 * forced.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_server_batch_with_quantized_weights(pairs, fmt, monkeypatch):
    monkeypatch.setenv("RDEPTH_NO_ACCEL", "1")
    model, twin = pairs[fmt]
    jobs = [([5, 9, 2, 7], dict(max_new_tokens=4, num_steps=3, init_scale=0.0)),
            ([1, 4], dict(max_new_tokens=4, num_steps=2, init_scale=0.0, exit_criterion="kl", exit_threshold=1e-2))]
    got, want = serve_in_one_batch(model, jobs), serve_in_one_batch(twin, jobs)
    assert [[r.token for r in got[j]] for j in got] == [[r.token for r in want[j]] for j in want]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_bf16_model_decodes_close_to_its_dequantized_twin(fmt):
    """The kernel path in a whole model: same greedy tokens, logits within bf16 rounding."""
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny")
    model = rd.RecurrentDepthLM(cfg).to(torch.bfloat16).eval()
    quantize_weights(model, fmt)
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        a = model(ids, num_steps=3, init_scale=0.0).logits.float()
        b = twin(ids, num_steps=3, init_scale=0.0).logits.float()
    assert (a - b).abs().max() <= 0.05 * b.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_logical_parameters_count_a_quantized_model_as_its_float_original(pairs, fmt):
    model, twin = pairs[fmt]
    assert model.num_parameters() < twin.num_parameters()  # the codes are buffers
    assert logical_parameters(model) == logical_parameters(twin) == twin.num_parameters()


def test_bad_weights_values_are_one_line_errors():
    assert check_weights(None) is None and check_weights("int8") == "int8" and check_weights("int4") == "int4"
    assert parse_weights("int4") == ("int4", 32) and parse_weights("int4:g128") == ("int4", 128)
    for bad in ("int3", "int4:g16", "int4:g", "int4g32", "int4:g32x", "INT8"):
        with pytest.raises(ValueError, match=rf"weights='{bad}' is invalid: expected 'int8', 'int4' \(group 32\) "
                                             r"or one of 'int4:g32', 'int4:g64', 'int4:g128', 'int4:g256'"):
            check_weights(bad)
    with pytest.raises(ValueError, match="int4 group size 16 is invalid"):
        quantize_int4(torch.randn(4, 32), 16)


def test_int4_kernel_layout_refuses_other_devices_and_dtypes_in_one_line():
    layer = Int4WeightLinear.from_linear(nn.Linear(64, 32), 32)
    with pytest.raises(ValueError, match="take float32/bfloat16/float16 activations on the CPU, got torch.float64"):
        layer(torch.randn(2, 64, dtype=torch.float64))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8w")
    make_model_dir(path)
    return path


@pytest.mark.parametrize("fmt,cls", [("int8", Int8WeightLinear), ("int4", Int4WeightLinear)])
def test_loader_and_transformers_route(model_dir, fmt, cls):
    from transformers import AutoModelForCausalLM

    loaded = rd.RecurrentDepthLM.from_pretrained(model_dir, weights=fmt)
    assert isinstance(loaded.transformer.core_block[0].attn.Wqkv, cls)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, weights=fmt).eval()
    assert isinstance(hf.transformer.core_block[0].mlp.fc, cls)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        expected = loaded(ids, num_steps=2, init_scale=0.0).logits
        got = hf(ids, num_steps=2, init_scale=0.0).logits
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weights='fp4' is invalid"):
        rd.RecurrentDepthLM.from_pretrained(model_dir, weights="fp4")


def test_a_quantized_model_is_not_saved_into_a_directory_nothing_loads(model_dir, tmp_path):
    """Its qweight / scales tensors were written and every loader then refused the directory."""
    from transformers import AutoModelForCausalLM

    loaded = rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int8")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, weights="int4")
    for model, out in ((loaded, tmp_path / "ours"), (hf, tmp_path / "hf"), (hf.core, tmp_path / "core")):
        with pytest.raises(ValueError, match="quantized .* weights, which no loader reads"):
            model.save_pretrained(out)
        assert not out.exists()
    dequantize_weights(loaded)  # the documented way out: the float layers save and load again
    loaded.save_pretrained(tmp_path / "float")
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "float").config == loaded.config


def test_cli_generate_with_quantized_weights_and_a_bad_value(model_dir, capsys):
    from recurrent_depth.cli import main

    base = ["generate", "--model", str(model_dir), "--prompt", "a=1", "--max-new-tokens", "3", "--num-steps", "2",
            "--threads", "1"]
    for fmt in ("int8", "int4", "int4:g64"):
        assert main([*base, "--weights", fmt]) == 0
        assert capsys.readouterr().out.strip()
    assert main([*base, "--weights", "int4:g16"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "weights='int4:g16' is invalid" in errors[0]


def test_build_app_quantizes_a_model_in_memory_and_refuses_a_bad_format_first(model_dir):
    from recurrent_depth.serving import build_app

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    params = model.num_parameters()
    app = build_app(model, weights="int4")
    assert isinstance(model.transformer.core_block[0].attn.Wqkv, Int4WeightLinear)
    # the banner counts the quantized weights too (they are buffers: it used to show the rest only)
    assert f"({params / 1e6:.2f}M parameters," in app.state.banner("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="weights='int4:g16' is invalid"):
        build_app(model_dir, weights="int4:g16")


def test_quantizing_a_quantized_model_keeps_the_same_format_and_refuses_another():
    """A second quantize_weights with another format returned 0 and left the first one in place, silently
    (and build_app(weights=) skipped any quantized model, whatever its format)."""
    from recurrent_depth.serving import build_app
    from recurrent_depth.weight_quant import held_weights

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    assert held_weights(model) is None
    assert quantize_weights(model, "int8") > 0 and held_weights(model) == "int8"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_weights(model, "int8") == 0  # the same format again: nothing to do
    for other in ("int4", "int4:g64"):
        with pytest.raises(ValueError, match=f"weights='{other}' cannot be applied: this model already holds "
                                             "int8 weights; call .*dequantize_weights"):
            quantize_weights(model, other)
        with pytest.raises(ValueError, match="already holds int8 weights"):
            build_app(model, weights=other)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing requantized or half-swapped
    build_app(model, weights="int8")  # the format it holds is accepted
    dequantize_weights(model)
    assert quantize_weights(model, "int4:g64") > 0 and held_weights(model) == "int4:g64"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_an_accel_converted_model_is_quantized(fmt):
    """`accel.apply` (the trainer's model) makes the linears a subclass of nn.Linear, which quantize_weights
    skipped: 0 layers swapped and the float weights kept, silently (build_app(trainer.model, weights=...))."""
    from recurrent_depth import accel
    from recurrent_depth.weight_quant import held_weights

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", tie_embeddings=False)).eval()
    plain = copy.deepcopy(model)
    assert accel.apply(model, enabled=True)["linears"] > 0
    assert quantize_weights(model, fmt, include_head=True) == quantize_weights(plain, fmt, include_head=True) > 0
    assert held_weights(model) == held_weights(plain)
    assert not any(isinstance(m, nn.Linear) for m in model.transformer.modules()) and not isinstance(model.lm_head,
                                                                                                     nn.Linear)


@pytest.fixture
def cpp_kernels(monkeypatch):
    """The C++ int8 and int4 products on (the suite's conftest turns C++ off), or a skip where it cannot build."""
    from recurrent_depth.accel import quant_cpp

    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    if quant_cpp.load() is None:
        pytest.skip(f"the C++ kernels cannot build here: {quant_cpp.failure()}")


def _on_two_threads(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) without autograd, two threads splitting the weight rows."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            return layer(x)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("K", [64, 37])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_take_the_cpp_int8_product(cpp_kernels, rows, K, bias, dtype):
    """Up to 8 float32 or bf16 rows: the C++ product (one pass over the int8 rows, float32 sums), equal to
    the float32 reference to float32 rounding (bf16: then rounded once, within bf16 unit roundoff), two
    threads splitting the rows; more rows, or a graph through x: torch's kernel or the reference."""
    torch.manual_seed(K + rows)
    layer = Int8WeightLinear.from_linear(nn.Linear(K, 50, bias=bias).to(dtype))  # (50: a last block of two rows)
    x = torch.randn(rows, K).to(dtype)
    reference = _reference(layer, x)
    out = _on_two_threads(layer, x.view(1, rows, K))
    assert layer.uses_cpp(x) == (rows <= 8) and out.dtype == dtype
    out = out.view(rows, 50).float()
    if dtype == torch.float32:
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        if rows > 8:
            assert torch.equal(out, layer._reference(x))
    elif rows <= 8:  # one bf16 rounding (unit roundoff 2^-8), plus x's entries below 2^-8 of the row's largest
        # power of two 2^ex, which the int16 form rounds to within 2^(ex - 16) (see `int16_row`)
        half_step = torch.ldexp(torch.ones(rows, 1), torch.frexp(x.float().abs().amax(1, keepdim=True)).exponent - 16)
        weights = dequantize_int8(layer.qweight, layer.scales).abs().sum(1)
        assert ((out - reference).abs() <= 2**-8 * reference.abs() * (1 + 1e-4) + half_step * weights + 1e-6).all()
    assert not layer.uses_cpp(x.clone().requires_grad_())


# K = 1125: 17 steps of 64 (AVX-512; across an int32 flush at 1024), one of 32 (AVX2) and 5 single entries
@pytest.mark.parametrize("K", [77, 1125])
def test_bf16_rows_within_eight_binades_are_dotted_exactly(cpp_kernels, K):
    """bf16 rows whose entries lie within 8 binades of the row's largest are exact int16 multiples of a
    power of two, so the C++ product is the exact dot times the scale, rounded to float32 once and then
    to bf16: bit-equal to that computed in float64 here. A row with a NaN or inf takes the float path
    (NaN out) and leaves the other rows as they are; an all-zero row gives zeros."""
    from recurrent_depth.accel import quant_cpp

    g = torch.Generator().manual_seed(7)
    magnitude = torch.ldexp(torch.ones(4, K), torch.randint(-7, 1, (4, K), generator=g))  # 2^-7 .. 1
    x = (magnitude * (1 + torch.rand(4, K, generator=g))).bfloat16() * torch.randn(4, K, generator=g).sign()
    x = x.bfloat16()
    layer = Int8WeightLinear.from_linear(nn.Linear(K, 9, bias=False))
    q, scales = layer.qweight, layer.scales
    exact = ((x.double() @ q.double().t()) * scales.double()).float().bfloat16()
    assert torch.equal(quant_cpp.load().int8_linear(x, q, scales, None), exact)
    x[1, 5], x[2] = float("nan"), 0.0
    out = quant_cpp.load().int8_linear(x, q, scales, None)
    assert out[1].isnan().all() and torch.equal(out[2], torch.zeros(9, dtype=torch.bfloat16))
    assert torch.equal(out[[0, 3]], exact[[0, 3]])


def test_float32_int8_model_decodes_with_cpp_as_its_dequantized_twin(cpp_kernels):
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    quantized = copy.deepcopy(model)
    quantize_weights(quantized, "int8")
    twin = copy.deepcopy(quantized)
    dequantize_weights(twin)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=5, num_steps=3, init_scale=0.0, output_logits=True)
    out, ref = generate(quantized, ids, **kw), generate(twin, ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
# (640, 32) and (1056, 32): bf16 rows take the AVX-512 pairs (8 pairs a block), then AVX2's last pairs, or
# its last unpaired chunk.
@pytest.mark.parametrize("K,group", [(64, 32), (100, 32), (320, 64), (256, 256), (640, 32), (1056, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_take_the_cpp_int4_product(cpp_kernels, rows, K, group, dtype):
    """With C++ on every int4 layer stores plain nibbles and bf16 (scale, zero) pairs per output channel,
    whatever its shape (K = 100: padded to whole groups). Up to 8 float32 or bf16 rows take the C++
    product (float32 sums, two threads splitting the rows; bf16 rows in integers), within float32
    rounding of the float32 reference (bf16: within one output rounding); more rows, or a graph through
    x, the reference exactly."""
    torch.manual_seed(K + rows)
    layer = Int4WeightLinear.from_linear(nn.Linear(K, 50, bias=rows % 2 == 1).to(dtype), group)
    assert not layer.kernel_layout and layer.scales_and_zeros.dtype == torch.bfloat16
    assert layer.scales_and_zeros.shape == (50, -(-K // group), 2)
    x = torch.randn(rows, K).to(dtype)
    reference = _int4_reference(layer, x)
    out = _on_two_threads(layer, x.view(1, rows, K))
    assert layer.uses_cpp(x) == (rows <= 8) and out.dtype == dtype
    out = out.view(rows, 50).float()
    scale = reference.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    assert ((out - reference).abs() / scale).max() <= (1e-5 if dtype == torch.float32 else 2**-7)
    if rows > 8:
        assert torch.equal(out, layer._reference(x).float())
    assert not layer.uses_cpp(x.clone().requires_grad_())


def test_cpp_int4_nan_row_and_layout_choice(cpp_kernels):
    """A bf16 row with a NaN gives NaN and leaves the other rows as computed alone; `kernel_layout=True`
    still stores torch's layout (and takes its kernel), and refuses a shape the kernel cannot take."""
    from recurrent_depth.accel import quant_cpp

    layer = Int4WeightLinear.from_linear(nn.Linear(96, 20, bias=False), 32)
    x = torch.randn(3, 96).bfloat16()
    alone = [layer(x[i:i + 1]) for i in range(3)]
    x[1, 7] = float("nan")
    out = quant_cpp.load().int4_linear(x, layer.qweight, layer.scales_and_zeros, 32, None)
    assert out[1].isnan().all() and torch.equal(out[0], alone[0][0]) and torch.equal(out[2], alone[2][0])
    kernel = Int4WeightLinear.from_linear(nn.Linear(96, 32), 32, kernel_layout=True)
    assert kernel.kernel_layout and kernel.uses_kernel(x) and not kernel.uses_cpp(x)
    assert torch.equal(kernel.unpacked()[:, :96], quantize_int4(kernel.dequantized().weight, 32)[0][:, :96])
    with pytest.raises(ValueError, match=r"torch's int4 kernel does not take a \(20, 96\) weight at group 32"):
        Int4WeightLinear.from_linear(nn.Linear(96, 20), 32, kernel_layout=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_model_decodes_with_cpp_as_its_dequantized_twin(cpp_kernels, dtype):
    """Every layer in plain layout through the C++ product at decode, the reference at the prompt: the
    twin's greedy tokens (float32: logits within 1e-4; bf16: within bf16 rounding of the logits' range)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).to(dtype).eval()
    quantize_weights(model, "int4")
    assert not any(m.kernel_layout for m in model.modules() if isinstance(m, Int4WeightLinear))
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=5, num_steps=3, init_scale=0.0, output_logits=True)
    out, ref = generate(model, ids, **kw), generate(twin, ids, **kw)
    if dtype == torch.float32:
        assert torch.equal(out.sequences, ref.sequences)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    else:  # (bf16 weights: the twin rounds every dequantized weight to bf16, the kernel does not)
        first = out.logits[:, 0].float()
        assert (first - ref.logits[:, 0].float()).abs().max() <= 0.05 * first.abs().max()
