"""recurrent_depth.quant: packing, rotations, Lloyd–Max codebooks, the quantizers' theorems, bytes.

Tolerances: distortion within ±5 % of the Lloyd–Max value integrated from the density (2000 random
unit vectors: the Monte Carlo error is < 1 %); bias within 3 standard errors; scores equal
decode-then-matmul to float32 rounding (1e-4 relative to the score scale).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import integrate

from recurrent_depth.quant import (
    QJL,
    ChannelSplit,
    Codes,
    HadamardRotation,
    PolarQuant,
    QuantSpec,
    Raw16,
    TurboQuantMSE,
    TurboQuantProd,
    build_quantizer,
    kv_bytes_per_token,
    make_rotation,
    pack_bits,
    packed_nbytes,
    parse_kv_quant,
    select_outlier_channels,
    sphere_codebook,
    unpack_bits,
)
from recurrent_depth.quant.codebook import polar_angle_codebook
from recurrent_depth.quant.turboquant import dither_weights, residual_code

SPECS = ["mse:1", "mse:2", "mse:3", "mse:4", "mse:2.5", "mse:3.5", "prod:1", "prod:2", "prod:3", "prod:2.5",
         "prod:3.5", "mse:3:hadamard", "prod:3.5:hadamard", "qjl:1", "qjl:2", "qjl:2:out4", "polar",
         "polar:3.875:hadamard",
         "raw:16", "raw:16:fp16"]


def unit_vectors(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)


def expected_bytes(spec: str, d: int) -> int:
    """Bytes per vector from the method's definition (written out independently of the library)."""
    method, *rest = spec.split(":")
    bits = float(rest[0]) if rest else None

    def whole(method: str, d: int, b: int) -> int:
        if method == "mse":
            return b * d // 8 + 2  # indices + fp16 norm
        return (b - 1) * d // 8 + d // 8 + 2 + 1  # mse indices + QJL signs + fp16 norm + residual norm byte

    if method in ("mse", "prod"):
        if bits.is_integer():
            return whole(method, d, int(bits))
        n_out = int((bits - math.floor(bits)) * d)
        return whole(method, n_out, math.floor(bits) + 1) + whole(method, d - n_out, math.floor(bits))
    if method == "qjl":  # signs + fp16 norm, + 2 bytes per bf16 outlier channel (`qjl:b:outN`)
        return int(bits * d) // 8 + 2 + (2 * int(rest[1][3:]) if len(rest) > 1 else 0)
    if method == "polar":
        blocks = d // 16
        return blocks * (8 * 4 + 4 * 2 + 2 * 2 + 1 * 2) // 8 + 2 * blocks  # angles + one fp16 radius per block
    return 2 * d  # raw


# --- packing ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16])
def test_pack_round_trip_and_size(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (3, 2, 37), generator=gen)  # 37: bytes do not divide evenly
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, math.ceil(37 * bits / 8))
    assert packed_nbytes(37, bits) == packed.shape[-1]
    assert torch.equal(unpack_bits(packed, bits, 37), values)


def test_pack_rejects_widths_without_a_word_sized_chunk():
    with pytest.raises(ValueError, match="bits per packed value must be one of"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 9)


def test_pack_layout_is_msb_first():
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1]), 1).tolist() == [0b10110001, 0b10000000]
    assert pack_bits(torch.tensor([3, 0, 2, 1]), 2).tolist() == [0b11001001]
    assert pack_bits(torch.tensor([5, 1, 7]), 3).tolist() == [0b10100111, 0b10000000]  # across a byte boundary


# --- rotations --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,dim", [("qr", 128), ("qr", 60), ("qr", 3), ("hadamard", 128), ("hadamard", 64),
                                      ("hadamard", 1)])
def test_rotation_orthogonal_and_inverse(kind, dim):
    rot = make_rotation(kind, dim, seed=7)
    pi = rot.matrix().double()
    torch.testing.assert_close(pi @ pi.T, torch.eye(dim, dtype=torch.float64), atol=1e-5, rtol=0)
    x = torch.randn(5, dim)
    torch.testing.assert_close(rot.forward(x), x @ rot.matrix().T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rot.inverse(rot.forward(x)), x, atol=1e-5, rtol=1e-5)
    assert rot.state_nbytes == 8


def test_hadamard_is_sylvester_times_signs():
    h = torch.ones(1, 1)
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    rot = HadamardRotation(16, seed=3)
    signs = torch.diagonal(h @ rot.matrix()) / 4  # Π = H diag(s) / 4  ->  H Π = 16 diag(s) / 4
    assert set(signs.round().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(rot.matrix(), h @ torch.diag(signs.round()) / 4)


@pytest.mark.parametrize("kind", ["qr", "hadamard"])
def test_rotation_seeded(kind):
    a, b, c = (make_rotation(kind, 64, seed=s).matrix() for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- Lloyd–Max codebooks and TurboQuant_mse ---------------------------------------------------------------------

def sphere_density(d: int):
    c = math.exp(math.lgamma(d / 2) - math.lgamma((d - 1) / 2)) / math.sqrt(math.pi)
    return lambda x: c * (1 - x * x) ** ((d - 3) / 2)


def integrated_distortion(centroids, density, lo: float, hi: float) -> tuple[float, list[float]]:
    """Distortion E(X − Q(X))² by quadrature, and each cell's conditional mean (the centroid condition)."""
    bounds = [lo, *((a + b) / 2 for a, b in zip(centroids[:-1], centroids[1:])), hi]
    total, means = 0.0, []
    for c, a, b in zip(centroids, bounds[:-1], bounds[1:]):
        total += integrate.quad(lambda x, c=c: (x - c) ** 2 * density(x), a, b, epsabs=1e-14)[0]
        mass = integrate.quad(density, a, b, epsabs=1e-14)[0]
        means.append(integrate.quad(lambda x: x * density(x), a, b, epsabs=1e-14)[0] / mass)
    return total, means


@pytest.mark.parametrize("bits,approx", [(1, 0.363), (2, 0.118), (3, 0.0345), (4, 0.0095)])
def test_mse_distortion_matches_lloyd_max_and_theorem_1(bits, approx):
    d = 128
    centroids = sphere_codebook(d, bits)
    per_coord, means = integrated_distortion(centroids, sphere_density(d), -1.0, 1.0)
    np.testing.assert_allclose(centroids, means, atol=1e-6)  # each centroid is its cell's mean: Lloyd–Max
    lloyd_max = d * per_coord
    assert lloyd_max == pytest.approx(approx, rel=0.05)
    x = unit_vectors(2000, d, seed=bits)
    quant = TurboQuantMSE(d, bits, seed=0)
    measured = ((x - quant.decode(quant.encode(x))) ** 2).sum(-1).mean().item()
    assert measured == pytest.approx(lloyd_max, rel=0.05)
    assert 4.0**-bits < measured < math.sqrt(3) * math.pi / 2 * 4.0**-bits  # Theorem 3 lower, Theorem 1 upper


def test_mse_hadamard_rotation_reaches_the_same_distortion():
    x = unit_vectors(2000, 128, seed=11)
    quant = TurboQuantMSE(128, 2, rotation="hadamard", seed=0)
    measured = ((x - quant.decode(quant.encode(x))) ** 2).sum(-1).mean().item()
    assert measured == pytest.approx(128 * integrated_distortion(sphere_codebook(128, 2), sphere_density(128),
                                                                 -1.0, 1.0)[0], rel=0.05)


def test_mse_keeps_the_norm():
    x = 37.0 * unit_vectors(200, 64, seed=1)
    quant = TurboQuantMSE(64, 4)
    rel = ((x - quant.decode(quant.encode(x))) ** 2).sum(-1).mean() / 37.0**2
    assert rel < 0.015  # the unit-vector distortion at 4 bits (≈0.0095 at this d) scaled by ‖x‖²


# --- inner products: TurboQuant_prod and QJL --------------------------------------------------------------------

SEEDS, PAIRS = 200, 16  # 3200 estimates; standard errors from the 200 per-seed means (pairs share a seed)


def inner_product_errors(make, d: int = 128, rho: float = 0.6) -> torch.Tensor:
    """[SEEDS, PAIRS] errors ⟨y, x̃⟩ − ⟨y, x⟩ for fixed unit pairs with ⟨x, y⟩ = rho, over quantizer seeds."""
    x = unit_vectors(PAIRS, d, seed=100)
    z = unit_vectors(PAIRS, d, seed=101)
    z = torch.nn.functional.normalize(z - (z * x).sum(-1, keepdim=True) * x, dim=-1)
    y = rho * x + math.sqrt(1 - rho**2) * z
    errors = []
    for seed in range(SEEDS):
        quant = make(seed)
        scores = quant.score(y.unsqueeze(1), quant.encode(x.unsqueeze(1)))  # [PAIRS, 1, 1]
        errors.append(scores.flatten() - rho)
    return torch.stack(errors).double()


def bias_z(errors: torch.Tensor) -> float:
    per_seed = errors.mean(1)
    return (per_seed.mean() / (per_seed.std() / math.sqrt(len(per_seed)))).item()


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_prod_unbiased_within_theorem_2(bits):
    d = 128
    errors = inner_product_errors(lambda s: TurboQuantProd(d, bits, seed=s), d)
    assert abs(bias_z(errors)) < 3
    assert errors.var().item() < math.sqrt(3) * math.pi**2 / d * 4.0**-bits  # Theorem 2, ‖y‖ = 1


@pytest.mark.parametrize("spec", ["prod:2.5", "prod:3.5"])
def test_prod_split_unbiased(spec):
    """Each group's estimate is unbiased, so their sum is (no variance theorem covers the split)."""
    assert abs(bias_z(inner_product_errors(lambda s: build_quantizer(spec, 128, seed=s)))) < 3


def test_prod_residual_norm_byte_is_unbiased_stochastic_rounding():
    """‖r‖ is one byte: q·Δ is one of the two grid points around ‖r‖, and its mean over the hash
    weights (the seed) is ‖r‖ (within 3 standard errors over 4000 seeds)."""
    step, rho = 1.1 / 255, 0.3456
    signs = (torch.randn(64, generator=torch.Generator().manual_seed(0)) > 0).long()
    stored = torch.stack([residual_code(torch.tensor([rho]), signs, dither_weights(64, s), step)
                          for s in range(4000)]).double().flatten() * step
    assert set(stored.tolist()) <= {math.floor(rho / step) * step, math.ceil(rho / step) * step}
    assert abs(stored.mean().item() - rho) < 3 * stored.std().item() / math.sqrt(len(stored))
    # The grid covers every residual: at 1 + 1 bits (the widest) for a vector on a rotated axis.
    quant = TurboQuantProd(64, 2, seed=0)
    worst = quant.rotation.inverse(torch.eye(64)[:1])  # Πx = e_1: one coordinate 1, the others 0
    unit = quant.rotation.forward(worst)
    residual = unit - quant.codebook.decode(quant.codebook.encode(unit), 64)
    assert residual.norm() / quant.residual_step < 255  # no clamp: the rounding stays unbiased
    assert quant.encode(worst).fields["residual"].item() == pytest.approx(residual.norm() / quant.residual_step, abs=1)


@pytest.mark.parametrize("m", [128, 256])
def test_qjl_unbiased_within_variance_bound(m):
    errors = inner_product_errors(lambda s: QJL(128, m, seed=s))
    assert abs(bias_z(errors)) < 3
    assert errors.var().item() < math.pi / (2 * m)  # QJL lemma, unit vectors


def test_mse_inner_products_are_biased():
    """The bias test above can fail: TurboQuant_mse at 1 bit shrinks inner products by ≈ 2/π."""
    errors = inner_product_errors(lambda s: TurboQuantMSE(128, 1, seed=s))
    assert bias_z(errors) < -10
    assert errors.mean().item() == pytest.approx((2 / math.pi - 1) * 0.6, rel=0.1)


# --- PolarQuant -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_polar_bits_and_round_trip(d):
    quant = PolarQuant(d)
    assert quant.bits == 3.875 and quant.bits_per_coordinate == 3.875
    assert quant.bytes_per_vector == d * 3.875 / 8
    x = 5.0 * unit_vectors(1000, d, seed=d)
    codes = quant.encode(x)
    assert codes.nbytes == 1000 * d * 3.875 / 8
    rel = (((x - quant.decode(codes)) ** 2).sum(-1) / 25.0).mean().item()
    assert rel < 0.05  # 3.875 bits: between TurboQuant_mse at 3 bits (0.034) and 2 bits (0.118)
    fine = PolarQuant(d, level_bits=(8, 5, 5, 5))
    fine_rel = ((x - fine.decode(fine.encode(x))) ** 2).sum(-1).mean().item() / 25.0
    assert fine_rel < 1e-3  # finer angles: the polar transform itself inverts exactly


def test_polar_level_1_codebook_is_uniform():
    level1 = polar_angle_codebook(1, 4)
    np.testing.assert_allclose(level1, [(k + 0.5) * 2 * math.pi / 16 for k in range(16)], atol=1e-6)


@pytest.mark.parametrize("level", [2, 3, 4])
def test_polar_angle_codebooks_are_lloyd_max(level):
    power = (1 << (level - 1)) - 1
    norm = integrate.quad(lambda x: math.sin(2 * x) ** power, 0, math.pi / 2)[0]
    centroids = polar_angle_codebook(level, 2)
    _, means = integrated_distortion(centroids, lambda x: math.sin(2 * x) ** power / norm, 0, math.pi / 2)
    np.testing.assert_allclose(centroids, means, atol=1e-6)
    np.testing.assert_allclose(np.array(centroids) + centroids[::-1], math.pi / 2, atol=1e-6)  # symmetric


# --- every method: bytes, scoring, determinism, the raw codec ---------------------------------------------------

def reachable_tensors(obj, seen=None):
    """Every tensor reachable from obj through dataclass fields, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from reachable_tensors(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from reachable_tensors(v, seen)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from reachable_tensors(v, seen)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("spec", SPECS)
def test_packed_bytes_exact(spec, d):
    quant = build_quantizer(spec, d, seed=3)
    x = torch.randn(2, 3, 5, d)
    codes = quant.encode(x)
    assert codes.shape == x.shape
    assert quant.bytes_per_vector == codes.bytes_per_vector == expected_bytes(spec, d)
    assert codes.nbytes == 30 * expected_bytes(spec, d)
    assert sum(t.numel() * t.element_size() for t in reachable_tensors(codes)) == codes.nbytes
    assert all(t.dtype in (torch.uint8, torch.float16) or (name, t.dtype) == ("outliers", torch.bfloat16)
               for name, t in codes.fields.items())  # QJL's outlier channels are bf16
    if spec.startswith("raw"):
        assert codes.nbytes == 2 * x.numel()
    else:
        assert codes.nbytes < 2 * x.numel() / 3.5  # every spec here, norms counted, is > 3.5x smaller than fp16


@pytest.mark.parametrize("spec", SPECS)
def test_score_equals_decode_then_matmul(spec):
    quant = build_quantizer(spec, 64, seed=5)
    keys, queries = torch.randn(2, 3, 11, 64), torch.randn(2, 3, 4, 64)
    codes = quant.encode(keys)
    reference = queries @ quant.decode(codes).mT
    scores = quant.score(queries, codes)
    assert scores.shape == (2, 3, 4, 11)
    torch.testing.assert_close(scores, reference, atol=1e-4 * reference.abs().max().item(), rtol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_deterministic_with_seed(spec):
    x = torch.randn(7, 64)
    a, b, c = (build_quantizer(spec, 64, seed=s).encode(x) for s in (4, 4, 5))
    assert all(torch.equal(a.fields[k], b.fields[k]) for k in a.fields)
    if not spec.startswith("raw"):
        assert any(not torch.equal(a.fields[k], c.fields[k]) for k in a.fields)


@pytest.mark.parametrize("dtype_name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_raw_codec_is_exact_through_packed_storage(dtype_name, dtype):
    x = (torch.randn(4, 9, 64) * 100).to(dtype)
    x[0, 0, :4] = torch.tensor([-0.0, torch.finfo(dtype).tiny / 4, torch.finfo(dtype).max, -torch.finfo(dtype).min])
    quant = Raw16(64, dtype_name)
    codes = quant.encode(x)
    assert codes.fields["values"].dtype == torch.uint8 and codes.nbytes == x.numel() * 2
    decoded = quant.decode(codes)
    assert torch.equal(decoded.to(dtype).view(torch.int16), x.view(torch.int16))  # bit for bit, -0.0 included
    rest = quant.encode(x[1:])  # without the specials, whose products overflow
    assert torch.equal(quant.score(x[1:, :3].float(), rest), x[1:, :3].float() @ x[1:].float().mT)


def test_codes_cat_and_narrow_along_tokens():
    quant = build_quantizer("prod:2.5", 64, seed=1)
    x = torch.randn(2, 10, 64)
    whole = quant.encode(x)
    parts = Codes.cat([quant.encode(x[:, :3]), quant.encode(x[:, 3:])], axis=1)
    assert all(torch.equal(whole.fields[k], parts.fields[k]) for k in whole.fields)
    tail = whole.narrow(1, 4, 6)
    torch.testing.assert_close(quant.decode(tail), quant.decode(whole)[:, 4:])
    with pytest.raises(ValueError, match="leading axis"):
        whole.narrow(2, 0, 1)


def test_zero_vectors_decode_to_zero():
    for spec in ("mse:3", "prod:3", "qjl:1", "polar", "mse:2.5"):
        quant = build_quantizer(spec, 64)
        assert torch.equal(quant.decode(quant.encode(torch.zeros(2, 64))), torch.zeros(2, 64))


# --- channel split ----------------------------------------------------------------------------------------------

def test_split_groups_and_calibration():
    quant = build_quantizer("mse:2.5", 128)
    assert isinstance(quant, ChannelSplit)
    assert (quant.outlier.dim, quant.outlier.bits, quant.regular.dim, quant.regular.bits) == (64, 3, 64, 2)
    assert build_quantizer("prod:3.5", 64).outlier.spec == "prod:4"
    assert build_quantizer("mse:2.25", 128).outlier.dim == 32
    x = torch.randn(500, 128)
    loud = [3, 17, 40, 99]
    x[:, loud] *= 20
    assert select_outlier_channels(x, 4) == loud
    small = build_quantizer("mse:2.03125", 128)  # 4 outlier channels
    calibrated = small.calibrated(x)
    assert calibrated.outlier_channels == loud
    err = lambda q: ((x - q.decode(q.encode(x))) ** 2).sum(-1).mean().item()  # noqa: E731
    assert err(calibrated) < err(small)


# --- specs and bad arguments ------------------------------------------------------------------------------------

def test_spec_parsing_and_bytes_per_token():
    specs = parse_kv_quant("k=prod:3.5, v=mse:3.5")
    assert specs == {"k": QuantSpec("prod", 3.5), "v": QuantSpec("mse", 3.5)}
    assert str(specs["k"]) == "prod:3.5" and QuantSpec.parse("polar").bits == 3.875
    assert QuantSpec.parse("MSE:4:Hadamard") == QuantSpec("mse", 4, "hadamard")
    per_head = expected_bytes("prod:3.5", 64) + expected_bytes("mse:3.5", 64)
    assert kv_bytes_per_token(specs, head_dim=64, num_kv_heads=4, num_layers=3) == per_head * 4 * 3
    assert kv_bytes_per_token(parse_kv_quant("k=qjl:2"), 128, 1) == 128 * 2 // 8 + 2 + 2 * 128  # v stays bf16


@pytest.mark.parametrize("spec,dim,match", [
    ("mse:0", 64, "bits must be a number > 0"),
    ("prod:-1", 64, "bits must be a number > 0"),
    ("mse:9", 64, r"bits must be in \[1, 8\]"),
    ("zip:3", 64, "unknown quantization method 'zip'"),
    ("mse", 64, "needs a bit width"),
    ("mse:three", 64, "must be a number"),
    ("mse:3:givens", 64, "unknown rotation 'givens'"),
    ("raw:8", 64, "16-bit codec"),
    ("polar:3", 64, "reference layout"),
    ("polar", 40, "not a multiple of 16"),
    ("qjl:1.01", 64, "sketch of"),
    ("mse:2.3", 64, "whole number"),
    ("mse:3:hadamard", 96, "power-of-two size, got 96"),
    ("prod:2.25:hadamard", 128, "power-of-two size, got 96"),
])
def test_bad_specs(spec, dim, match):
    with pytest.raises(ValueError, match=match):
        build_quantizer(spec, dim)


@pytest.mark.parametrize("call,match", [
    (lambda: make_rotation("hadamard", 60), "power-of-two size, got 60"),
    (lambda: make_rotation("dct", 64), "unknown rotation"),
    (lambda: TurboQuantMSE(64, 2.5), "integer"),
    (lambda: QJL(64, 0), "sketch size"),
    (lambda: build_quantizer("mse:3", 64).encode(torch.randn(2, 32)), "built for D = 64"),
    (lambda: build_quantizer("mse:3", 64).encode(torch.full((1, 64), float("nan"))), "non-finite"),
    (lambda: build_quantizer("mse:3", 64).encode(torch.full((1, 64), 1e5)), "fp16 range"),
    (lambda: build_quantizer("mse:3", 64).decode(build_quantizer("mse:2", 64).encode(torch.randn(1, 64))),
     "cannot be decoded"),
    (lambda: parse_kv_quant("k=prod:3,k=mse:3"), "given twice"),
    (lambda: parse_kv_quant("q=mse:3"), "k=... or v=..."),
    (lambda: parse_kv_quant(""), "KV quantization spec"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
