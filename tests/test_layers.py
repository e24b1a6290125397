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
