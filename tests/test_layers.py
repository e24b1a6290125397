"""Building blocks: RoPE (the accel conversions of Linear and RMSNorm are tested in test_accel.py)."""

import pytest
import torch

from recurrent_depth.model import layers


def rope_reference(x, cos, sin):
    """Rotate pairs (x[2i], x[2i+1]) by the angle whose cosine and sine are given, in float32."""
    out = torch.empty(x.shape, dtype=torch.float32)
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out.to(x.dtype)


@pytest.mark.parametrize("compiling", [False, True], ids=["complex", "real-under-compile"])
@pytest.mark.parametrize("layout", ["contiguous", "odd-offset-slice", "bf16"])
def test_apply_rope_matches_the_pairwise_formula(monkeypatch, compiling, layout):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    torch.manual_seed(0)
    table = layers.rope_table(60, 37, 50000.0)  # odd length, head dim 60
    cos, sin = table[..., 0][None, :, None], table[..., 1][None, :, None]
    if layout == "odd-offset-slice":  # a view into a fused projection starting at an odd column
        x = torch.randn(2, 37, 1 + 3 * 60)[..., 1 : 1 + 3 * 60].unflatten(-1, (3, 60))
    else:
        x = torch.randn(2, 37, 3, 60, dtype=torch.bfloat16 if layout == "bf16" else torch.float32)
    # The complex product may fuse a multiply-add: equal to one rounding (1 ulp of float32 / bfloat16).
    torch.testing.assert_close(layers.apply_rope(x, cos, sin), rope_reference(x, cos, sin), atol=1e-6, rtol=1e-6)


def test_a_unit_offset_norm_is_transformers_gemma_norm_bit_for_bit():
    """`unit_offset` (ModelConfig.norm_unit_offset): the gain 1 + w added and multiplied in float32 and rounded once,
    as transformers' GemmaRMSNorm, in every dtype; a gain of one at init; the accel norm keeps that formula."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from recurrent_depth.accel.norm import convert_norms

    torch.manual_seed(0)
    ours, theirs = layers.RMSNorm(48, 1e-6, unit_offset=True), GemmaRMSNorm(48, 1e-6)
    x = torch.randn(3, 5, 48) * 4
    with torch.no_grad():
        assert torch.equal(ours(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # gain one at init
        ours.weight.copy_(torch.randn(48) * 0.3)
        theirs.weight.copy_(ours.weight)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(ours.to(dtype)(x.to(dtype)), theirs.to(dtype)(x.to(dtype)))
    ours.float(), theirs.float()
    fast = torch.nn.Sequential(ours)
    assert convert_norms(fast) == 1
    for dtype in (torch.float32, torch.bfloat16):  # an fp32 gain (training): the autograd path and the one without
        x_in = x.to(dtype).requires_grad_()
        assert torch.equal(fast[0](x_in), theirs(x_in))
        with torch.no_grad():
            assert torch.equal(fast[0](x_in), theirs(x_in))


def test_a_float32_gain_norm_is_transformers_olmo2_norm_bit_for_bit():
    """`float32_gain` (ModelConfig.norm_float32_gain): the gain multiplied in float32 and rounded once, as
    transformers' Olmo2RMSNorm, in every dtype (Huginn's norm rounds before the gain: not equal in bf16); the
    accel norm keeps that formula."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from recurrent_depth.accel.norm import convert_norms

    torch.manual_seed(0)
    ours, theirs = layers.RMSNorm(48, 1e-6, float32_gain=True), Olmo2RMSNorm(48, 1e-6)
    x = torch.randn(3, 5, 48) * 4
    with torch.no_grad():
        ours.weight.copy_(1 + torch.randn(48) * 0.3)
        theirs.weight.copy_(ours.weight)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert torch.equal(ours.to(dtype)(x.to(dtype)), theirs.to(dtype)(x.to(dtype)))
        huginn = layers.RMSNorm(48, 1e-6).to(torch.bfloat16)
        huginn.weight.copy_(ours.weight)
        assert not torch.equal(huginn(x.bfloat16()), theirs(x.bfloat16()))
        ours.float(), theirs.float()  # an fp32 gain on bf16 input (autocast): the accel norm's C++ pass
        assert convert_norms(torch.nn.Sequential(ours)) == 1
        assert torch.equal(ours(x.bfloat16()), theirs(x.bfloat16()))
    x_in = x.clone().requires_grad_()  # float32 (the accel norm's autograd path): the same formula
    assert torch.equal(ours(x_in), theirs(x_in))


def test_the_rounded_half_rotation_is_transformers_rope_in_every_dtype():
    """`apply_rope_half_rounded` (ModelConfig.transformers_rounding) is transformers' apply_rotary_pos_emb with
    cos, sin of the model's dtype; in float32 it equals `apply_rope_half`, in bf16 / fp16 it does not."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    table = layers.rope_table(16, 9, 10000.0)
    cos, sin = table[..., 0][None, :, None], table[..., 1][None, :, None]  # [1, T, 1, D/2]
    x = torch.randn(2, 9, 3, 16) * 3
    assert torch.equal(layers.apply_rope_half_rounded(x, cos, sin), layers.apply_rope_half(x, cos, sin))
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        full_cos, full_sin = (torch.cat([t, t], -1)[:, :, 0].to(dtype) for t in (cos, sin))  # [1, T, D]
        want, _ = apply_rotary_pos_emb(xd, xd, full_cos, full_sin, unsqueeze_dim=2)
        assert torch.equal(layers.apply_rope_half_rounded(xd, cos, sin), want)
        assert not torch.equal(layers.apply_rope_half(xd, cos, sin), want)


def test_qk_clip_scales_a_unit_offset_gain_not_its_weight():
    """QK-clip scales a QK-norm's gain; with (1 + w) gains that is 1 + w, not w."""
    import recurrent_depth as rd

    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", qk_norm=True, norm_unit_offset=True))
    attn = model.transformer.prelude[0].attn
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.randn(norm.weight.shape) * 0.3)
        before = [1 + norm.weight.clone() for norm in (attn.q_norm, attn.k_norm)]
        attn.clip_heads(torch.tensor([0.25, 1.0, 1.0, 1.0]))  # one shared gain: every head by the smallest, sqrt 0.5
    for norm, gain in zip((attn.q_norm, attn.k_norm), before, strict=True):
        torch.testing.assert_close(1 + norm.weight, 0.5 * gain)
