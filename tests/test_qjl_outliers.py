"""QJL's outlier channels (`qjl:b:outN`): N channels per vector kept in bf16 outside the sign sketch.

Oracles: the exact inner product (the estimate is unbiased over the sketch seed: bias within 3
standard errors over 200 seeds x 16 pairs, as tests/test_quant.py checks the bare estimator) and the
QJL lemma's variance bound applied to the sketched channels only; the bytes are the storage of every
tensor a quantized cache holds (as tests/test_quant_cache.py checks the other methods).
"""

from __future__ import annotations

import math

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.quant_cache import KVQuant, layer_codec
from recurrent_depth.quant import QJL, QuantSpec, build_quantizer
from recurrent_depth.quant.rows import RowCodec, row_codec
from tests.test_quant import bias_z
from tests.test_quant_cache import MASK, PROMPT, TOL, _reachable_tensors, filled_cache, logits_of

pytestmark = pytest.mark.usefixtures("one_thread")

D, N_OUT, SEEDS, PAIRS = 64, 4, 200, 16


def loud_pairs() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Keys x and queries y [PAIRS, D] whose channels `loud` hold most of each key's energy."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(PAIRS, D, generator=g), torch.randn(PAIRS, D, generator=g)
    loud = [3, 17, 40, 61]
    x[:, loud] *= 8
    return x, y, loud


def estimate_errors(spec: str) -> tuple[torch.Tensor, QJL]:
    """[SEEDS, PAIRS] errors of the estimated ⟨y, x⟩ over quantizer seeds (outliers calibrated on x)."""
    x, y, _ = loud_pairs()
    errors = []
    for seed in range(SEEDS):
        quant = build_quantizer(spec, D, seed=seed)
        quant = quant.calibrated(x) if quant.outliers else quant
        scores = quant.score(y.unsqueeze(1), quant.encode(x.unsqueeze(1)))  # [PAIRS, 1, 1]
        errors.append(scores.flatten() - (x * y).sum(-1))
    return torch.stack(errors).double(), quant


def test_outlier_channels_keep_the_estimate_unbiased_and_cut_its_variance():
    x, y, loud = loud_pairs()
    errors, quant = estimate_errors(f"qjl:2:out{N_OUT}")
    assert quant.outlier_channels == loud  # calibration finds the loud channels
    assert abs(bias_z(errors)) < 3
    # Only the sketched channels are noisy: the estimator's exact variance over S on them is
    # ((π/2)·‖y_reg‖²‖x_reg‖² − ⟨y_reg, x_reg⟩²) / m (m = 2·D); pooled over the pairs, within 15 %
    # (the sample variances' own spread is ~3 %).
    reg = quant.regular_channels
    xr, yr = x[:, reg].double(), y[:, reg].double()
    exact = (math.pi / 2 * yr.pow(2).sum(-1) * xr.pow(2).sum(-1) - (xr * yr).sum(-1) ** 2) / (2 * D)
    assert 0.85 < (errors.var(0) / exact).mean().item() < 1.15
    bare, _ = estimate_errors("qjl:2")  # the same sign bits over all channels: the loud ones dominate ‖x‖²
    assert abs(bias_z(bare)) < 3
    assert errors.var().item() < 0.25 * bare.var().item()


def test_bytes_per_vector_and_codes_count_the_outliers():
    quant = build_quantizer("qjl:2:out4", D)
    assert quant.spec == "qjl:2:out4" and str(QuantSpec.parse("QJL:2:OUT4")) == "qjl:2:out4"
    assert quant.bytes_per_vector == 2 * D // 8 + 2 + 2 * N_OUT  # signs, the fp16 norm, 4 bf16 channels
    assert quant.bytes_per_vector == build_quantizer("qjl:2", D).bytes_per_vector + 2 * N_OUT
    assert quant.state_nbytes == 8 + D // 8  # seed and the outlier-channel mask
    x, _, loud = loud_pairs()
    codes = quant.encode(x.view(4, 4, D))
    assert codes.nbytes == PAIRS * quant.bytes_per_vector == codes.bytes_per_vector * PAIRS
    assert torch.equal(quant.decode(codes).view(PAIRS, D)[:, :N_OUT], x[:, :N_OUT].bfloat16().float())
    codec = row_codec(quant)
    assert isinstance(codec, RowCodec) and codec.nbytes == quant.bytes_per_vector
    # Without outliers the quantizer is the old one, bit for bit (same sketch seed and layout).
    plain, old = build_quantizer("qjl:2", D, seed=3), QJL(D, 2 * D, seed=3)
    assert torch.equal(plain.encode(x).fields["signs"], old.encode(x).fields["signs"])


@pytest.mark.parametrize("spec,error", [
    ("qjl:2:out0", "qjl's option is outN"), ("qjl:2:out", "qjl's option is outN"),
    ("qjl:2:out99999", "qjl's option is outN"), ("qjl:2:hadamard", "qjl's option is outN"),
    ("qjl:2:out64", "at least one channel stays in the sketch"), ("qjl:16:out1", "more than the 1024"),
])
def test_bad_outlier_options_are_one_line_errors(spec, error):
    with pytest.raises(ValueError, match=error) as info:
        build_quantizer(spec, D)
    assert "\n" not in str(info.value)


def test_the_cache_calibrates_each_heads_outliers():
    """A layer codec keeps each KV head's loud channels (the first write's) in bf16: row h decodes
    them exactly to bf16, and reads equal decode-then-matmul."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g)
    loud = [sorted(torch.randperm(16, generator=g)[:2].tolist()) for _ in range(3)]
    for h, channels in enumerate(loud):
        x[:, h, :, channels] *= 6
    codec = layer_codec("k=qjl:2:out2", "k", 16, x)
    assert codec.perm[:, :2].tolist() == loud and codec.state_nbytes == 3 * 2
    assert layer_codec("k=qjl:2:out2,outliers=first", "k", 16, x).perm is None
    rows = codec.encode(x)
    decoded = codec.decode(rows)
    for h, channels in enumerate(loud):
        assert torch.equal(decoded[:, h][..., channels], x[:, h][..., channels].bfloat16().float())
    q = torch.randn(2, 3, 5, 16, generator=g)
    weights = torch.softmax(torch.randn(2, 3, 5, 40, generator=g), dim=-1)
    torch.testing.assert_close(codec.score(q, rows), q @ decoded.mT, atol=TOL, rtol=0)
    torch.testing.assert_close(codec.combine(weights, rows), weights @ decoded, atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


KV = "k=qjl:2:out4,v=mse:3"


def test_every_tensor_reachable_from_a_qjl_outlier_cache_is_the_reported_bytes(model):
    cfg = model.config
    cache = filled_cache(model, KV, "per-step")
    calibrated = [c for pair in cache.codecs._layers.values() for c in pair if getattr(c, "perm", None) is not None]
    assert len(calibrated) == 2 + cfg.core_layers  # every layer's keys (the default rule)
    assert cache.codecs.state_nbytes() == 8 + len(calibrated) * cfg.num_kv_heads * math.ceil(cfg.head_dim / 8)
    fields = {name: value for name, value in vars(cache).items() if name not in ("codecs", "kv_quant")}
    entries = [t for t in _reachable_tensors(fields) if t.dtype not in (torch.long, torch.bool)]
    assert entries and all(t.dtype == torch.uint8 for t in entries)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in entries}
    assert sum(storages.values()) == cache.nbytes()
    per_layer = KVQuant.parse(KV).bytes_per_token(cfg.head_dim, cfg.num_kv_heads)
    k_bytes = build_quantizer("qjl:2:out4", cfg.head_dim).bytes_per_vector
    assert per_layer == (k_bytes + build_quantizer("mse:3", cfg.head_dim).bytes_per_vector) * cfg.num_kv_heads
    assert cache.nbytes() == 2 * 9 * (2 + cfg.core_layers * cache.num_core_slots) * per_layer


@pytest.mark.parametrize("attn", ["codes", "dequantize"])
def test_qjl_outlier_cache_equals_its_dequantized_dynamic_reference(model, attn):
    kwargs = dict(attention_mask=MASK, kv_quant=f"{KV},attn={attn}", max_new_tokens=4, num_steps=4,
                  init_scale=0.0, output_logits=True)
    static = generate(model, PROMPT, **kwargs)
    plain = generate(model, PROMPT, cache_implementation="dynamic", **kwargs)
    assert torch.equal(static.sequences, plain.sequences)
    torch.testing.assert_close(logits_of(static), logits_of(plain), atol=TOL, rtol=0)
    assert torch.equal(static.cache_bytes, plain.cache_bytes)
    first = generate(model, PROMPT, **{**kwargs, "kv_quant": f"{KV},attn={attn},outliers=first"})
    assert not torch.allclose(logits_of(static), logits_of(first))  # the calibration reaches generation
