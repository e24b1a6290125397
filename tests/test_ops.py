"""recurrent_depth.ops: chunked == fused-recurrent == naive, in outputs, states and gradients.

Every op is exercised at odd sizes (T = 1, T not a multiple of the chunk, head dims like 60,
K != V) in float32, with an initial state so that every input, including the state, gets a
gradient. Error measure: the norm-relative error ‖got − ref‖ / ‖ref‖ over a whole tensor.

Tolerance table (float32, epsilon 1.2e-7). Observed worst cases over every op and shape below
are 3.6e-7 for outputs and states and 6.5e-7 for gradients (dbeta and dg of the gated delta rule);
they come only from different summation orders (a chunk sums up to 64 terms at once where the
loop adds one per step), so ~10x margins are safe and stay within the issue's 1e-5 target:

    what                                              tol    why
    outputs, final states (chunk / fused vs naive)    5e-6   float32 summation order, ≤ 3.6e-7 seen
    gradients (q, k, v, gates, beta, initial state)   1e-5   one more pass of the same sums, ≤ 6.5e-7 seen
    bfloat16 inputs vs a float32 reference            2e-2   one bf16 rounding of o (8-bit mantissa, 4e-3)
    float64 identities (reductions, oracles)          1e-10  exact algebra, rounding at 1e-16

fla's pure-PyTorch references compute in float32 whatever the input, so comparisons with them
use the float32 tolerances.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from recurrent_depth import ops
from recurrent_depth.ops import LogLinearState
from recurrent_depth.ops.gla.chunk import intra_chunk_factored, intra_chunk_subchunked
from recurrent_depth.ops.log_linear_attn.utils import level_matrix, levels_needed, trailing_ones

TOL_OUT = 5e-6
TOL_GRAD = 1e-5
TOL_BF16 = 2e-2
TOL_F64 = 1e-10


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ (absolute when ref is all zeros)."""
    diff = (got.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    return diff / scale if scale > 0 else diff


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------------
# One description per op: how to make its extra inputs (gates, beta, ...) and its state.


@dataclass(frozen=True)
class Op:
    name: str
    extras: tuple[str, ...]  # extra positional inputs after q, k, v, in call order
    chunk: Callable
    fused: Callable
    naive: Callable


OPS = [
    Op("linear_attn", (), ops.chunk_linear_attn, ops.fused_recurrent_linear_attn, ops.naive_recurrent_linear_attn),
    Op("delta_rule", ("beta",), ops.chunk_delta_rule, ops.fused_recurrent_delta_rule, ops.naive_recurrent_delta_rule),
    Op("gla", ("gk",), ops.chunk_gla, ops.fused_recurrent_gla, ops.naive_recurrent_gla),
    Op(
        "gated_delta_rule",
        ("g", "beta"),
        ops.chunk_gated_delta_rule,
        ops.fused_recurrent_gated_delta_rule,
        ops.naive_recurrent_gated_delta_rule,
    ),
    Op(
        "log_linear_attn",
        ("g", "lam"),
        ops.chunk_log_linear_attn,
        ops.fused_recurrent_log_linear_attn,
        ops.naive_recurrent_log_linear_attn,
    ),
]
OP_IDS = [op.name for op in OPS]

# Log-linear states in the main tests start at this (odd, chunk-unaligned) absolute position.
LOG_LINEAR_OFFSET = 5


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    K: int
    V: int
    chunk: int


SHAPES = {
    "T1": Shape(1, 1, 1, 8, 8, 16),
    "T37-C16-D60": Shape(2, 37, 2, 60, 60, 16),
    "T37-C16-K16-V24": Shape(1, 37, 3, 16, 24, 16),
    "T33-C8-K12-V20": Shape(2, 33, 1, 12, 20, 8),
    "T50-C64": Shape(1, 50, 2, 32, 16, 64),
}


def make_inputs(
    op: Op, s: Shape, seed: int = 0, dtype: torch.dtype = torch.float32, offset: int = LOG_LINEAR_OFFSET
) -> tuple[list[torch.Tensor], object]:
    """Random `[q, k, v, *extras]` and an initial state for `op` (keys unit-norm, gates decays)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    B, T, H, K, V = s.B, s.T, s.H, s.K, s.V
    q, k, v = randn(B, T, H, K), F.normalize(randn(B, T, H, K), dim=-1), randn(B, T, H, V)
    extra = {
        "beta": torch.sigmoid(randn(B, T, H)),
        "g": F.logsigmoid(randn(B, T, H) + 2.0),
        "gk": F.logsigmoid(randn(B, T, H, K)) / 4,
        "lam": F.softplus(randn(B, T, H, levels_needed(offset + T) + 1)),
    }
    tensors = [x.to(dtype) for x in [q, k, v, *(extra[e] for e in op.extras)]]
    if op.name == "log_linear_attn":
        state: object = LogLinearState(randn(B, H, levels_needed(offset), K, V).to(dtype) * 0.3, offset)
    else:
        state = randn(B, H, K, V).to(dtype) * 0.3
    return tensors, state


def state_tensors(state: object) -> list[torch.Tensor]:
    """The differentiable tensors inside a state (a tensor, an (S, z) pair or a LogLinearState)."""
    if isinstance(state, LogLinearState):
        return [state.levels]
    if isinstance(state, tuple):
        return list(state)
    return [state]


def with_grad(inputs: list[torch.Tensor], state: object) -> tuple[list[torch.Tensor], object]:
    """Fresh leaf copies that require gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    if isinstance(state, LogLinearState):
        return leaves, LogLinearState(state.levels.detach().clone().requires_grad_(), state.offset)
    return leaves, state.detach().clone().requires_grad_()


def run_with_grads(fn: Callable, inputs: list[torch.Tensor], state: object, **kw: object) -> dict[str, torch.Tensor]:
    """Run `fn`, backpropagate a fixed random cotangent; return outputs and all gradients."""
    leaves, st = with_grad(inputs, state)
    o, final = fn(*leaves, initial_state=st, output_final_state=True, **kw)
    final_t = state_tensors(final)
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    for f in final_t:
        loss = loss + (f * torch.randn(f.shape, generator=gen, dtype=f.dtype)).sum()
    loss.backward()
    out = {"o": o.detach()}
    out.update({f"final_state[{i}]": f.detach() for i, f in enumerate(final_t)})
    out.update({f"d_input[{i}]": x.grad for i, x in enumerate(leaves)})
    out.update({f"d_initial_state[{i}]": x.grad for i, x in enumerate(state_tensors(st))})
    return out


def tolerance(key: str) -> float:
    return TOL_GRAD if key.startswith("d_") else TOL_OUT


# ----------------------------------------------------------------------------------------------
# chunk == naive == fused_recurrent: outputs, final states and every gradient.


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_chunk_and_fused_recurrent_match_naive(op: Op, shape: str):
    s = SHAPES[shape]
    inputs, state = make_inputs(op, s)
    ref = run_with_grads(op.naive, inputs, state)
    chunk = run_with_grads(op.chunk, inputs, state, chunk_size=s.chunk)
    fused = run_with_grads(op.fused, inputs, state)
    for key, r in ref.items():
        assert_close(f"chunk {key}", chunk[key], r, tolerance(key))
        assert_close(f"fused {key}", fused[key], r, tolerance(key))


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_without_initial_state_and_default_scale(op: Op):
    s = SHAPES["T37-C16-K16-V24"]
    inputs, _ = make_inputs(op, s, offset=0)
    o_ref, S_ref = op.naive(*inputs, output_final_state=True)
    for fn, kw in ((op.chunk, {"chunk_size": 16}), (op.fused, {})):
        o, S = fn(*inputs, output_final_state=True, **kw)
        assert_close(f"{fn.__name__} o", o, o_ref, TOL_OUT)
        for a, b in zip(state_tensors(S), state_tensors(S_ref)):
            assert_close(f"{fn.__name__} state", a, b, TOL_OUT)
        assert fn(*inputs, **kw)[1] is None, "final_state must be None unless asked for"
    o_scaled, _ = op.chunk(*inputs, scale=0.5)
    o_scaled_ref, _ = op.naive(*inputs, scale=0.5)
    assert_close("explicit scale", o_scaled, o_scaled_ref, TOL_OUT)
    assert rel_err(o_scaled, o_ref) > 1e-3, "scale must change the output"


def test_linear_attn_normalize_matches_naive_in_outputs_and_gradients():
    s = SHAPES["T37-C16-D60"]
    op = OPS[0]
    (q, k, v), S0 = make_inputs(op, s)
    # Positive features keep the normaliser away from zero, as a feature map would.
    q, k = F.elu(q) + 1, F.elu(k) + 1
    state = (S0.abs(), torch.rand(s.B, s.H, s.K, generator=torch.Generator().manual_seed(3)))
    kw = {"normalize": True}

    def with_pair_grad(fn: Callable, **extra: object) -> dict[str, torch.Tensor]:
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        st = tuple(x.detach().clone().requires_grad_() for x in state)
        o, (S, z) = fn(*leaves, initial_state=st, output_final_state=True, **kw, **extra)
        (o.square().sum() + S.sum() + z.sum()).backward()
        return {"o": o, "S": S, "z": z, **{f"d{i}": x.grad for i, x in enumerate([*leaves, *st])}}

    ref = with_pair_grad(op.naive)
    for got in (with_pair_grad(op.chunk, chunk_size=16), with_pair_grad(op.fused)):
        for key in ref:
            assert_close(key, got[key].detach(), ref[key].detach(), TOL_GRAD)


# ----------------------------------------------------------------------------------------------
# State passing: running T1 then T2 with the state carried equals running T1 + T2.


@pytest.mark.parametrize("split", [1, 13, 16, 36], ids=lambda t: f"T1={t}")
@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_state_carried_across_calls_equals_one_pass(op: Op, split: int):
    s = Shape(2, 37, 2, 12, 20, 8)
    inputs, _ = make_inputs(op, s, offset=0)
    o_full, S_full = op.chunk(*inputs, output_final_state=True, chunk_size=8)
    first = [x[:, :split] for x in inputs]
    second = [x[:, split:] for x in inputs]
    for fn_a, fn_b in ((op.chunk, op.chunk), (op.chunk, op.fused), (op.fused, op.chunk)):
        kw_a = {"chunk_size": 8} if fn_a is op.chunk else {}
        kw_b = {"chunk_size": 8} if fn_b is op.chunk else {}
        o1, S1 = fn_a(*first, output_final_state=True, **kw_a)
        o2, S2 = fn_b(*second, initial_state=S1, output_final_state=True, **kw_b)
        name = f"{fn_a.__name__} then {fn_b.__name__}"
        assert_close(f"{name}: o", torch.cat([o1, o2], dim=1), o_full, TOL_OUT)
        for a, b in zip(state_tensors(S2), state_tensors(S_full)):
            assert_close(f"{name}: final state", a, b, TOL_OUT)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_prefill_then_token_by_token_decode_equals_full_pass(op: Op):
    s = Shape(1, 21, 2, 8, 8, 4)
    inputs, _ = make_inputs(op, s, offset=0)
    o_full, _ = op.chunk(*inputs, chunk_size=4)
    prefill = 6
    o, state = op.chunk(*[x[:, :prefill] for x in inputs], output_final_state=True, chunk_size=4)
    outs = [o]
    for t in range(prefill, s.T):
        o_t, state = op.fused(*[x[:, t : t + 1] for x in inputs], initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert_close("decode", torch.cat(outs, dim=1), o_full, TOL_OUT)


@pytest.mark.parametrize("op", OPS[:4], ids=OP_IDS[:4])
def test_zero_padded_steps_leave_the_state_untouched(op: Op):
    """Right padding with zero k, v, beta and log-gates must not change the state (fla bug class)."""
    s = Shape(2, 19, 2, 8, 6, 8)
    inputs, state = make_inputs(op, s)
    _, S = op.chunk(*inputs, initial_state=state, output_final_state=True, chunk_size=8)
    pad = 6
    padded = [torch.cat([x, torch.zeros_like(x[:, :pad])], dim=1) for x in inputs]
    padded[0][:, s.T :] = torch.randn(s.B, pad, s.H, s.K)  # queries of padded steps are arbitrary
    for fn, kw in ((op.chunk, {"chunk_size": 8}), (op.fused, {})):
        _, S_pad = fn(*padded, initial_state=state, output_final_state=True, **kw)
        assert_close(f"{fn.__name__} padded state", S_pad, S, TOL_OUT)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_chunked_forms_are_causal(op: Op):
    s = Shape(1, 30, 2, 8, 8, 8)
    inputs, _ = make_inputs(op, s, offset=0)
    o, _ = op.chunk(*inputs, chunk_size=8)
    t = 17
    perturbed = [x.clone() for x in inputs]
    for x in perturbed:
        x[:, t:] += 1.0
    o_p, _ = op.chunk(*perturbed, chunk_size=8)
    assert torch.equal(o[:, :t], o_p[:, :t]), "outputs before t must not depend on tokens at t or later"
    assert not torch.allclose(o[:, t:], o_p[:, t:])


# ----------------------------------------------------------------------------------------------
# Precision: bf16 inputs accumulate in float32; float64 inputs stay float64.


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_bf16_inputs_accumulate_in_float32(op: Op):
    s = SHAPES["T37-C16-K16-V24"]
    inputs, state = make_inputs(op, s, dtype=torch.bfloat16)
    o, final = op.chunk(*inputs, initial_state=state, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16
    assert all(x.dtype == torch.float32 for x in state_tensors(final))
    ref_inputs = [x.float() for x in inputs]
    ref_state = (
        LogLinearState(state.levels.float(), state.offset) if isinstance(state, LogLinearState) else state.float()
    )
    o_ref, final_ref = op.naive(*ref_inputs, initial_state=ref_state, output_final_state=True)
    assert_close("bf16 o", o, o_ref, TOL_BF16)
    for a, b in zip(state_tensors(final), state_tensors(final_ref)):
        assert_close("bf16 state", a, b, 1e-5)  # same fp32 accumulation, only the order differs
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    op.chunk(*leaves, chunk_size=16)[0].float().sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_float64_inputs_stay_float64(op: Op):
    s = SHAPES["T33-C8-K12-V20"]
    inputs, state = make_inputs(op, s, dtype=torch.float64)
    o, final = op.chunk(*inputs, initial_state=state, output_final_state=True, chunk_size=8)
    o_ref, final_ref = op.naive(*inputs, initial_state=state, output_final_state=True)
    assert o.dtype == torch.float64 and all(x.dtype == torch.float64 for x in state_tensors(final))
    assert_close("f64 o", o, o_ref, TOL_F64)
    for a, b in zip(state_tensors(final), state_tensors(final_ref)):
        assert_close("f64 state", a, b, TOL_F64)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
@pytest.mark.parametrize("form", ["chunk", "fused", "naive"])
def test_bf16_autocast_leaves_the_ops_in_float32(op: Op, form: str):
    """Under `torch.autocast` (the trainer's bf16 mode) the ops keep their own float32 arithmetic:
    the chunked forms used to raise on their in-place products, the loops to accumulate in bf16."""
    s = SHAPES["T37-C16-K16-V24"]
    inputs, state = make_inputs(op, s)
    kw = {"chunk_size": 16} if form == "chunk" else {}
    fn = getattr(op, form)
    ref = run_with_grads(fn, inputs, state, **kw)
    leaves, st = with_grad(inputs, state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, final = fn(*leaves, initial_state=st, output_final_state=True, **kw)
    assert o.dtype == torch.float32
    assert_close("autocast o", o, ref["o"], TOL_OUT)
    for i, f in enumerate(state_tensors(final)):
        assert f.dtype == torch.float32
        assert_close("autocast final state", f, ref[f"final_state[{i}]"], TOL_OUT)
    (o.sum() + sum(f.sum() for f in state_tensors(final))).backward()  # the hand-written backwards run
    assert all(torch.isfinite(x.grad).all() for x in leaves)


# ----------------------------------------------------------------------------------------------
# Reductions and independent oracles (float64, so they are exact up to rounding).


def test_gated_delta_rule_with_zero_decay_is_the_delta_rule():
    gdn, dr = OPS[3], OPS[1]
    (q, k, v, g, beta), S0 = make_inputs(gdn, Shape(2, 37, 2, 12, 20, 16), dtype=torch.float64)
    o_dr, S_dr = dr.chunk(q, k, v, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    o_gdn, S_gdn = gdn.chunk(
        q, k, v, torch.zeros_like(g), beta, initial_state=S0, output_final_state=True, chunk_size=16
    )
    assert_close("o", o_gdn, o_dr, TOL_F64)
    assert_close("state", S_gdn, S_dr, TOL_F64)
    o_naive, _ = gdn.naive(q, k, v, torch.zeros_like(g), beta, initial_state=S0)
    o_dr_naive, _ = dr.naive(q, k, v, beta, initial_state=S0)
    assert torch.equal(o_naive, o_dr_naive), "exp(0) = 1 exactly, so the naive forms agree bit for bit"


def test_log_linear_with_unit_level_weights_is_scalar_gate_linear_attention():
    (q, k, v, g, lam), _ = make_inputs(OPS[4], Shape(2, 45, 2, 12, 20, 8), dtype=torch.float64, offset=0)
    o_ll, _ = ops.chunk_log_linear_attn(q, k, v, g, torch.ones_like(lam), chunk_size=8)
    o_gla, _ = ops.chunk_gla(q, k, v, g[..., None].expand_as(q), chunk_size=8)
    assert_close("log-linear(λ=1) vs GLA", o_ll, o_gla, TOL_F64)


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_log_linear_forms_match_the_quadratic_definition(chunk: int):
    (q, k, v, g, lam), _ = make_inputs(OPS[4], Shape(2, 45, 2, 12, 20, chunk), dtype=torch.float64, offset=0)
    o_def = ops.naive_parallel_log_linear_attn(q, k, v, g, lam)
    assert_close("chunk", ops.chunk_log_linear_attn(q, k, v, g, lam, chunk_size=chunk)[0], o_def, TOL_F64)
    assert_close("fused", ops.fused_recurrent_log_linear_attn(q, k, v, g, lam)[0], o_def, TOL_F64)
    assert_close("naive recurrent", ops.naive_recurrent_log_linear_attn(q, k, v, g, lam)[0], o_def, TOL_F64)


def test_fenwick_level_helpers():
    lvl = level_matrix(8, torch.device("cpu"))
    assert lvl[5].tolist()[:6] == [3, 3, 3, 3, 1, 0]  # 5 = 0b101: level 1 is {4}, level 3 is {0..3}
    # Every pair (t, s <= t) lies in exactly one level; level l of t holds 2^(l-1) tokens when bit l-1 is set.
    for t in range(8):
        for ell in range(1, 4):
            size = int((lvl[t, : t + 1] == ell).sum())
            assert size == ((1 << (ell - 1)) if t >> (ell - 1) & 1 else 0)
    assert [trailing_ones(n) for n in range(8)] == [0, 1, 0, 2, 0, 1, 0, 3]
    assert [levels_needed(n) for n in (1, 2, 3, 4, 5, 1024, 1025)] == [1, 2, 3, 3, 4, 11, 12]


def test_gla_intra_chunk_paths_agree_and_strong_gates_stay_exact():
    gla = OPS[2]
    s = Shape(1, 64, 2, 16, 8, 64)
    (q, k, v, _), S0 = make_inputs(gla, s, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    # Moderate gates: both intra-chunk paths are valid and must agree exactly.
    G = (F.logsigmoid(torch.randn(1, 2, 1, 64, 16, generator=gen, dtype=torch.float64)) / 4).cumsum(-2)
    qc, kc, vc = (x.transpose(1, 2)[:, :, None] for x in (q, k, v))  # [B, H, N=1, C, D]
    fast = intra_chunk_factored(qc * G.exp(), kc, vc, G)
    assert_close("factored vs sub-chunked", fast, intra_chunk_subchunked(qc, kc, vc, G, 16), TOL_F64)
    # Strong gates (about e^-12 per token): e^{±G} would overflow, so the op must take the exact path.
    g = -12.0 * torch.rand(1, 64, 2, 16, generator=gen, dtype=torch.float64) - 6.0
    for dtype, tol in ((torch.float64, TOL_F64), (torch.float32, TOL_OUT)):
        args = [x.to(dtype) for x in (q, k, v, g)]
        o, S = gla.chunk(*args, initial_state=S0.to(dtype), output_final_state=True, chunk_size=64)
        o_ref, S_ref = gla.naive(*args, initial_state=S0.to(dtype), output_final_state=True)
        assert torch.isfinite(o).all()
        assert_close(f"strong gates {dtype} o", o, o_ref, tol)
        assert_close(f"strong gates {dtype} state", S, S_ref, tol)


@pytest.mark.parametrize("op", [OPS[3], OPS[4]], ids=["gated_delta_rule", "log_linear_attn"])
def test_strong_scalar_decays_do_not_overflow(op: Op):
    inputs, state = make_inputs(op, Shape(1, 40, 2, 8, 8, 16))
    gen = torch.Generator().manual_seed(5)
    inputs[3] = -30.0 * torch.rand(inputs[3].shape, generator=gen)  # exp(-30) per token
    o, _ = op.chunk(*inputs, initial_state=state, chunk_size=16)
    o_ref, _ = op.naive(*inputs, initial_state=state)
    assert torch.isfinite(o).all()
    assert_close("o", o, o_ref, TOL_OUT)


# ----------------------------------------------------------------------------------------------
# flash-linear-attention's pure-PyTorch references (fla-core; its naive.py files load by path).


def _fla_naive(op: str):
    fla = pytest.importorskip("fla")
    path = os.path.join(os.path.dirname(fla.__file__), "ops", op, "naive.py")
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matches_fla_naive_references():
    s = Shape(2, 64, 2, 16, 24, 16)
    gen = torch.Generator().manual_seed(11)
    (q, k, v, g, beta), S0 = make_inputs(OPS[3], s)
    gk = F.logsigmoid(torch.randn(s.B, s.T, s.H, s.K, generator=gen)) / 4

    fla_gdn = _fla_naive("gated_delta_rule")
    o_ref, S_ref = fla_gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True)
    o, S = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    assert_close("gated delta rule o", o, o_ref, TOL_OUT)
    assert_close("gated delta rule state", S, S_ref, TOL_OUT)

    fla_dr = _fla_naive("delta_rule")  # [B, H, T, D] layout, scale fixed at K^-0.5
    o_ref, S_ref = fla_dr.delta_rule_recurrence(*(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state=S0)
    o, S = ops.chunk_delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    assert_close("delta rule o", o, o_ref.transpose(1, 2), TOL_OUT)
    assert_close("delta rule state", S, S_ref, TOL_OUT)

    fla_gla = _fla_naive("gla")
    o_ref, S_ref = fla_gla.naive_recurrent_gla(q, k, v, gk, initial_state=S0, output_final_state=True)
    o, S = ops.chunk_gla(q, k, v, gk, initial_state=S0, output_final_state=True, chunk_size=16)
    assert_close("gla o", o, o_ref, TOL_OUT)
    assert_close("gla state", S, S_ref, TOL_OUT)

    fla_la = _fla_naive("linear_attn")  # normaliser memory z is [B, 1, H, K] there, [B, H, K] here
    qp, kp, z0 = F.elu(q) + 1, F.elu(k) + 1, torch.rand(s.B, s.H, s.K, generator=gen)
    o_ref, (S_ref, z_ref) = fla_la.naive_recurrent_linear_attn(
        qp, kp, v, initial_state=(S0, z0[:, None]), output_final_state=True, normalize=True
    )
    o, (S, z) = ops.chunk_linear_attn(qp, kp, v, initial_state=(S0, z0), output_final_state=True, normalize=True)
    assert_close("linear attn o", o, o_ref, TOL_OUT)
    assert_close("linear attn state", S, S_ref, TOL_OUT)
    assert_close("linear attn z", z, z_ref[:, 0], TOL_OUT)

    pytest.importorskip("numpy")
    fla_ll = _fla_naive("log_linear_attn")  # scale defaults to 1.0 there; pass it explicitly
    lam = F.softplus(torch.randn(s.B, s.T, s.H, levels_needed(s.T), generator=gen))
    o_ref = fla_ll.naive_log_linear_attn(q, k, v, g, lam, scale=0.7)
    o, _ = ops.chunk_log_linear_attn(q, k, v, g, lam, scale=0.7, chunk_size=16)
    assert_close("log-linear o", o, o_ref, TOL_OUT)


# ----------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.


def _good(op: Op) -> tuple[list[torch.Tensor], object]:
    return make_inputs(op, Shape(1, 5, 2, 4, 3, 4))


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
@pytest.mark.parametrize(
    "case",
    ["q-3d", "k-shape", "v-batch", "dtype-mix", "state-shape", "scale", "scale-type", "chunk", "int-tensor"],
)
def test_bad_inputs_raise_value_errors_naming_the_argument(op: Op, case: str):
    inputs, state = _good(op)
    q, k, v, *extras = inputs
    kw: dict[str, object] = {}
    word = {
        "q-3d": "q",
        "k-shape": "k",
        "v-batch": "v",
        "dtype-mix": "dtype",
        "state-shape": "initial_state",
        "scale": "scale",
        "scale-type": "scale",
        "chunk": "chunk_size",
        "int-tensor": "floating-point",
    }[case]
    if case == "q-3d":
        q = q[0]
    elif case == "k-shape":
        k = k[..., :-1]
    elif case == "v-batch":
        v = v[:, :-1]
    elif case == "dtype-mix":
        v = v.double()
    elif case == "state-shape":
        if isinstance(state, LogLinearState):
            kw["initial_state"] = LogLinearState(state.levels[..., :-1], state.offset)
        else:
            kw["initial_state"] = state[..., :-1]
    elif case == "scale":
        kw["scale"] = -1.0
    elif case == "scale-type":
        kw["scale"] = "0.5"
    elif case == "chunk":
        kw["chunk_size"] = 48
    elif case == "int-tensor":
        q = q.long()
    for fn in (op.chunk, op.fused, op.naive):
        extra_kw = dict(kw)
        if fn is not op.chunk:
            if case == "chunk":
                continue
            extra_kw.pop("chunk_size", None)
        with pytest.raises(ValueError, match=word):
            fn(q, k, v, *extras, **extra_kw)


@pytest.mark.parametrize("op", [o for o in OPS if o.extras], ids=[o.name for o in OPS if o.extras])
def test_bad_gate_shapes_raise(op: Op):
    inputs, _ = _good(op)
    for i, name in enumerate(op.extras, start=3):
        bad = list(inputs)
        bad[i] = bad[i][:, :-1]
        expected = {"lam": "^level_scales must", "g": "^g must", "gk": "^g must", "beta": "^beta must"}[name]
        for fn in (op.chunk, op.fused, op.naive):
            with pytest.raises(ValueError, match=expected):
                fn(*bad)


def test_log_linear_state_and_level_errors():
    op = OPS[4]
    (q, k, v, g, lam), state = _good(op)  # T = 5 from offset 5: positions up to 9 need 5 levels
    with pytest.raises(ValueError, match="level_scales has L=3 levels but positions up to 9 need at least 5"):
        op.chunk(q, k, v, g, lam[..., :3], initial_state=state)
    with pytest.raises(ValueError, match="LogLinearState"):
        op.chunk(q, k, v, g, lam, initial_state=state.levels)
    with pytest.raises(ValueError, match="offset"):
        op.fused(q, k, v, g, lam, initial_state=LogLinearState(state.levels, 0))
    with pytest.raises(ValueError, match="need at least 4"):
        op.naive(q, k, v, g, lam, initial_state=LogLinearState(state.levels[:, :, :2], 5))


def test_linear_attn_state_kind_must_match_normalize():
    (q, k, v), S0 = _good(OPS[0])
    with pytest.raises(ValueError, match="pair"):
        ops.chunk_linear_attn(q, k, v, initial_state=S0, normalize=True)
    with pytest.raises(ValueError, match="tensor"):
        ops.fused_recurrent_linear_attn(q, k, v, initial_state=(S0, S0[..., 0]))


def test_empty_sequence_is_rejected():
    (q, k, v, beta), _ = _good(OPS[1])
    with pytest.raises(ValueError, match="T"):
        ops.chunk_delta_rule(q[:, :0], k[:, :0], v[:, :0], beta[:, :0])
