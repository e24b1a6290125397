"""The hand-written pieces behind the chunked ops' speed: custom backward passes and helpers.

tests/test_ops.py checks every public op end to end against the naive loops (outputs, states and
all gradients, at odd sizes). Here the custom `torch.autograd.Function`s are checked on their
own with `torch.autograd.gradcheck` (float64 finite differences, so the backward formulas are
tested against the forward pass and not against another implementation of the same formulas),
and the helpers they use against plain torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recurrent_depth.ops._common import matmul_add_
from recurrent_depth.ops.gated_delta_rule.chunk import _ChunkDeltaRule, unit_lower_inverse
from recurrent_depth.ops.gla.chunk import _ChunkGLAFactored
from recurrent_depth.ops.linear_attn.chunk import _ChunkLinearAttn

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv64(seed: int, BH: int, N: int, C: int, K: int, V: int):
    """A generator and chunked float64 q, k `[BH, N, C, K]`, v `[BH, N, C, V]` drawn from it (in that order)."""
    gen = _gen(seed)
    q, k = (torch.randn(BH, N, C, K, generator=gen, dtype=torch.float64) for _ in range(2))
    return gen, q, k, torch.randn(BH, N, C, V, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("C", [1, 3, 16, 17, 32, 64], ids=lambda c: f"C{c}")
def test_unit_lower_inverse_matches_dense_inverse(C: int):
    gen = _gen()
    # Entries of the size of β k_i·k_j with unit keys (|A_ij| < 1); the upper part and diagonal are noise.
    A = torch.rand(2, 3, C, C, generator=gen, dtype=torch.float64) * 2 - 1
    L = torch.eye(C, dtype=torch.float64) + A.tril(-1)
    got = unit_lower_inverse(A)
    ref = torch.linalg.inv(L)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-12
    assert torch.equal(got.triu(1), torch.zeros_like(got))
    assert torch.equal(got.diagonal(dim1=-2, dim2=-1), torch.ones(2, 3, C, dtype=torch.float64))


def _delta_inputs(BH: int, N: int, C: int, K: int, V: int, gated: bool, with_state: bool):
    gen = _gen(1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = rand(BH, N, C, K)
    k = F.normalize(rand(BH, N, C, K), dim=-1)
    v = rand(BH, N, C, V)
    beta = torch.sigmoid(rand(BH, N, C))
    g = F.logsigmoid(rand(BH, N, C) + 1.0) if gated else None
    S0 = rand(BH, K, V) * 0.5 if with_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, beta, g, S0)]


@pytest.mark.parametrize("with_state", [True, False], ids=["S0", "no-S0"])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("dims", [(2, 3, 4, 5, 3), (1, 2, 8, 3, 6)], ids=["C4-K5-V3", "C8-K3-V6"])
def test_chunk_delta_rule_backward_passes_gradcheck(dims: tuple[int, ...], gated: bool, with_state: bool):
    """Gradients of o and of the final state w.r.t. q, k, v, beta, g and S0 by finite differences."""
    inputs = _delta_inputs(*dims, gated=gated, with_state=with_state)
    assert torch.autograd.gradcheck(_ChunkDeltaRule.apply, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_chunk_gated_delta_rule_factored_decay_matches_exact_decay(monkeypatch: pytest.MonkeyPatch):
    """While every |G| ≤ MAX_FACTORED_LOG_DECAY the decay matrix D is the outer product e^{G} e^{−G}ᵀ;
    it must give what the exact exp(G_i − G_j) path gives: outputs, state and every gradient."""
    import recurrent_depth.ops.gated_delta_rule.chunk as gdr

    inputs = _delta_inputs(2, 3, 8, 5, 3, gated=True, with_state=True)
    gen = _gen(2)
    w_o = torch.randn(2, 3, 8, 3, generator=gen, dtype=torch.float64)
    w_S = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)

    def run() -> list[torch.Tensor]:
        for x in inputs:
            x.grad = None
        o, S = _ChunkDeltaRule.apply(*inputs)
        ((o * w_o).sum() + (S * w_S).sum()).backward()
        return [o.detach(), S.detach(), *(x.grad for x in inputs)]

    factored = run()
    monkeypatch.setattr(gdr, "MAX_FACTORED_LOG_DECAY", -1.0)  # |G| ≤ -1 never holds: the exact path
    exact = run()
    for name, a, b in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], factored, exact, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-12, name
    # The exact path's backward on its own, by finite differences.
    assert torch.autograd.gradcheck(_ChunkDeltaRule.apply, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_chunk_delta_rule_survives_zero_beta_and_keys():
    """Zero beta rows and zero keys (padding) must not produce NaNs in the backward pass."""
    q, k, v, beta, g, S0 = _delta_inputs(1, 2, 4, 3, 3, gated=True, with_state=True)
    with torch.no_grad():
        beta[:, 1].zero_()
        k[:, 0, 2].zero_()
    o, S = _ChunkDeltaRule.apply(q, k, v, beta, g, S0)
    (o.sum() + S.sum()).backward()
    for x in (q, k, v, beta, g, S0):
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("with_state", [True, False], ids=["S0", "no-S0"])
@pytest.mark.parametrize("dims", [(2, 3, 4, 5, 3), (1, 1, 5, 2, 7)], ids=["N3-C4-K5-V3", "N1-C5-K2-V7"])
def test_chunk_linear_attn_backward_passes_gradcheck(dims: tuple[int, ...], with_state: bool):
    BH, N, C, K, V = dims
    gen, q, k, v = _qkv64(2, *dims)
    S0 = torch.randn(BH, K, V, generator=gen, dtype=torch.float64) if with_state else None
    inputs = [x.requires_grad_() if x is not None else None for x in (q, k, v, S0)]
    assert torch.autograd.gradcheck(_ChunkLinearAttn.apply, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_matmul_add_accumulates_in_place_with_transposed_operands():
    gen = _gen(3)
    out = torch.randn(2, 3, 4, 5, generator=gen)
    a = torch.randn(2, 3, 6, 4, generator=gen).mT  # [2, 3, 4, 6], a transposed view
    b = torch.randn(2, 3, 6, 5, generator=gen)
    expected = out + a @ b
    got = matmul_add_(out, a, b)
    assert got is out
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_state", [True, False], ids=["S0", "no-S0"])
@pytest.mark.parametrize("dims", [(2, 3, 4, 5, 3), (1, 1, 6, 2, 7)], ids=["N3-C4-K5-V3", "N1-C6-K2-V7"])
def test_chunk_gla_factored_backward_passes_gradcheck(dims: tuple[int, ...], with_state: bool):
    BH, N, C, K, V = dims
    gen, q, k, v = _qkv64(4, *dims)
    G = F.logsigmoid(torch.randn(BH, N, C, K, generator=gen, dtype=torch.float64)).cumsum(-2)
    S0 = torch.randn(BH, K, V, generator=gen, dtype=torch.float64) if with_state else None
    inputs = [x.requires_grad_() if x is not None else None for x in (q, k, v, G, S0)]
    assert torch.autograd.gradcheck(_ChunkGLAFactored.apply, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
