"""What the differential fuzz of `recurrent_depth.ops` found, plus a seeded sweep of its odd cases.

Each op's forms (chunked, fused recurrent, step-by-step reference) are compared in float64 on
outputs, final states and gradients (inputs and initial state), so they agree to rounding: 1e-9.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from recurrent_depth import ops
from recurrent_depth.model.mixers.log_linear_delta import (
    chunk_log_linear_gated_delta_rule,
    recurrent_log_linear_gated_delta_rule,
)
from recurrent_depth.ops import FalconState, LogLinearState, TTTKVBState
from recurrent_depth.ops.log_linear_attn.utils import levels_needed

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = dict(rtol=1e-9, atol=1e-9)


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------
def test_naive_log_linear_reads_a_state_with_more_levels_than_level_scales():
    """A carried `LogLinearState` may hold more levels than this call's `level_scales` (L0 > L: the
    forms return max(L, L0) levels). The step-by-step reference indexed λ by every held level and
    raised IndexError; the levels λ does not cover weigh 0, as in the chunked and fused forms."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V, offset = 2, 3, 2, 3, 4, 5
    L = levels_needed(offset + T)  # 4
    levels0 = randn(gen, B, H, L + 2, K, V) * 0.3
    levels0[:, :, levels_needed(offset):] = 0  # a real state: levels above its position are empty
    state = LogLinearState(levels0, offset)
    q, k, v = randn(gen, B, T, H, K), F.normalize(randn(gen, B, T, H, K), dim=-1), randn(gen, B, T, H, V)
    g, lam = F.logsigmoid(randn(gen, B, T, H) + 2), F.softplus(randn(gen, B, T, H, L))
    args = (q, k, v, g, lam)
    o, final = ops.naive_recurrent_log_linear_attn(*args, initial_state=state, output_final_state=True)
    for form in (ops.fused_recurrent_log_linear_attn, ops.chunk_log_linear_attn):
        o_f, final_f = form(*args, initial_state=state, output_final_state=True)
        torch.testing.assert_close(o, o_f, **TOL)
        torch.testing.assert_close(final.levels, final_f.levels, **TOL)
        assert final.offset == final_f.offset == offset + T
    assert final.levels.shape[2] == L + 2


# ---------------------------------------------------------------------------------------------------
# The sweep: per op, its forms and how to build its inputs and state.
Build = Callable[[torch.Generator, int, int, int, int, int, int], tuple[list[torch.Tensor], object, dict]]


def _qkv(gen: torch.Generator, B: int, T: int, H: int, K: int, V: int) -> list[torch.Tensor]:
    return [randn(gen, B, T, H, K), F.normalize(randn(gen, B, T, H, K), dim=-1), randn(gen, B, T, H, V)]


def _beta(gen: torch.Generator, B: int, T: int, H: int) -> torch.Tensor:
    return torch.sigmoid(randn(gen, B, T, H))


def _g(gen: torch.Generator, B: int, T: int, H: int) -> torch.Tensor:
    return F.logsigmoid(randn(gen, B, T, H) + 2.0)


def _log_linear(gen, B, T, H, K, V, offset, delta):  # noqa: ANN001, ANN202
    L = levels_needed(offset + T) + 1
    args = [*_qkv(gen, B, T, H, K, V), _g(gen, B, T, H)]
    if delta:
        args.append(_beta(gen, B, T, H))
    args.append(F.softplus(randn(gen, B, T, H, L)))
    if not offset:
        return args, None, {}
    levels = randn(gen, B, H, L, K, V) * 0.3
    levels[:, :, levels_needed(offset):] = 0
    return args, LogLinearState(levels, offset), {}


OPS: dict[str, tuple[dict[str, Callable], Build]] = {
    "delta_rule": (
        dict(chunk=ops.chunk_delta_rule, fused=ops.fused_recurrent_delta_rule, naive=ops.naive_recurrent_delta_rule),
        lambda gen, B, T, H, K, V, s: ([*_qkv(gen, B, T, H, K, V), _beta(gen, B, T, H)],
                                       randn(gen, B, H, K, V) * 0.3 if s else None, {}),
    ),
    "gated_delta_rule": (
        dict(chunk=ops.chunk_gated_delta_rule, fused=ops.fused_recurrent_gated_delta_rule,
             naive=ops.naive_recurrent_gated_delta_rule),
        lambda gen, B, T, H, K, V, s: ([*_qkv(gen, B, T, H, K, V), _g(gen, B, T, H), _beta(gen, B, T, H)],
                                       randn(gen, B, H, K, V) * 0.3 if s else None, {}),
    ),
    "gla": (
        dict(chunk=ops.chunk_gla, fused=ops.fused_recurrent_gla, naive=ops.naive_recurrent_gla),
        lambda gen, B, T, H, K, V, s: ([*_qkv(gen, B, T, H, K, V), F.logsigmoid(randn(gen, B, T, H, K)) / 4],
                                       randn(gen, B, H, K, V) * 0.3 if s else None, {}),
    ),
    "linear_attn_normalized": (
        dict(chunk=ops.chunk_linear_attn, fused=ops.fused_recurrent_linear_attn, naive=ops.naive_recurrent_linear_attn),
        lambda gen, B, T, H, K, V, s: (
            [F.elu(randn(gen, B, T, H, K)) + 1, F.elu(randn(gen, B, T, H, K)) + 1, randn(gen, B, T, H, V)],
            (randn(gen, B, H, K, V) * 0.3, randn(gen, B, H, K).abs() + 0.5) if s else None, {"normalize": True}),
    ),
    "falcon": (
        dict(chunk=ops.chunk_falcon, naive=ops.naive_recurrent_falcon),
        lambda gen, B, T, H, K, V, s: (
            [*_qkv(gen, B, T, H, K, V), _beta(gen, B, T, H)],
            FalconState(randn(gen, B, H, K, V) * 0.3, F.normalize(randn(gen, B, H, K), dim=-1)) if s else None, {}),
    ),
    "ttt_kvb": (
        dict(chunk=ops.chunk_ttt_kvb, naive=ops.naive_recurrent_ttt_kvb),
        lambda gen, B, T, H, K, V, s: (
            [*_qkv(gen, B, T, H, K, V), _beta(gen, B, T, H) / 2],
            TTTKVBState(randn(gen, B, H, K, V) * 0.3, randn(gen, B, H, K, V) * 0.3, 2) if s else None,
            {"mini_batch": 3}),
    ),
    "log_linear_attn": (
        dict(chunk=ops.chunk_log_linear_attn, fused=ops.fused_recurrent_log_linear_attn,
             naive=ops.naive_recurrent_log_linear_attn),
        lambda gen, B, T, H, K, V, s: _log_linear(gen, B, T, H, K, V, 13 if s else 0, delta=False),
    ),
    "log_linear_gated_delta_rule": (
        dict(chunk=chunk_log_linear_gated_delta_rule, naive=recurrent_log_linear_gated_delta_rule),
        lambda gen, B, T, H, K, V, s: _log_linear(gen, B, T, H, K, V, 13 if s else 0, delta=True),
    ),
}


def state_tensors(state: object) -> list[torch.Tensor]:
    if state is None:
        return []
    if isinstance(state, torch.Tensor):
        return [state]
    return [x for x in state if isinstance(x, torch.Tensor)]


def with_tensors(state: object, tensors: list[torch.Tensor]) -> object:
    """`state` with its tensors replaced, in order, by `tensors` (ints such as offsets kept)."""
    if state is None or isinstance(state, torch.Tensor):
        return tensors[0] if tensors else None
    it = iter(tensors)
    values = [next(it) if isinstance(x, torch.Tensor) else x for x in state]
    return type(state)(*values) if hasattr(state, "_fields") else tuple(values)


def transposed(x: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (dims 1 and 2 swapped in memory)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() >= 3 else x


# (B, T, H, K, V, chunk, initial state): odd head dims, T at chunk - 1, chunk + 1 and primes
SHAPES = [(1, 1, 1, 1, 1, 4, True), (2, 5, 3, 3, 5, 4, False), (3, 7, 2, 5, 2, 8, True), (2, 9, 1, 7, 3, 8, True)]


@pytest.mark.parametrize("op", list(OPS))
def test_forms_agree_on_odd_non_contiguous_shapes_with_gradients(op):
    forms, build = OPS[op]
    for i, (B, T, H, K, V, C, with_state) in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(i)
        args, state, extra = build(gen, B, T, H, K, V, with_state)
        scale = random.Random(i).choice([None, 0.37])
        results = {}
        for name, fn in forms.items():
            leaves = [x.detach().clone().requires_grad_(True) for x in [*args, *state_tensors(state)]]
            call_args = [transposed(x) for x in leaves[: len(args)]]
            call_state = with_tensors(state, [transposed(x) for x in leaves[len(args):]])
            kw = dict(extra)
            if name == "chunk" and "mini_batch" not in kw:
                kw["chunk_size"] = C
            o, final = fn(*call_args, scale=scale, initial_state=call_state, output_final_state=True, **kw)
            results[name] = (o, final, leaves)
        o_ref, final_ref, _ = results["naive"]
        w_o = randn(gen, *o_ref.shape)
        w_f = [randn(gen, *x.shape) for x in state_tensors(final_ref)]
        grads = {}
        for name, (o, final, leaves) in results.items():
            loss = (o * w_o).sum() + sum((x * w).sum() for x, w in zip(state_tensors(final), w_f, strict=True))
            grads[name] = torch.autograd.grad(loss, leaves, allow_unused=True)
            if isinstance(state, LogLinearState):  # levels above the state's position are empty by contract
                grads[name] = list(grads[name])
                grads[name][-1] = grads[name][-1][:, :, : levels_needed(state.offset)]
        for name, (o, final, _) in results.items():
            where = f"{op} {name} shape #{i}"
            torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m, w=where: f"{w}: o: {m}")
            if isinstance(final, LogLinearState | TTTKVBState):  # the position count: exact
                assert final.offset == final_ref.offset, where
            for a, b in zip(state_tensors(final), state_tensors(final_ref), strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=lambda m, w=where: f"{w}: final state: {m}")
            for a, b in zip(grads[name], grads["naive"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=lambda m, w=where: f"{w}: gradient: {m}")


@pytest.mark.parametrize("op", list(OPS))
def test_an_empty_sequence_or_batch_is_refused_in_one_line(op):
    forms, build = OPS[op]
    args, _, extra = build(torch.Generator().manual_seed(0), 2, 3, 2, 3, 4, False)
    for empty in ([x[:, :0] for x in args], [x[:0] for x in args]):
        for name, fn in forms.items():
            with pytest.raises(ValueError) as info:
                fn(*empty, **extra)
            assert "\n" not in str(info.value), f"{op} {name}"
