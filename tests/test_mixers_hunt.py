"""Chunked ops on short calls: a call shorter than `chunk_size` (a few-token prompt, a speculative
verify step) runs in chunks no longer than it needs, and still equals the step-by-step loop.

Before the fix every chunked op padded such a call up to one whole chunk: 3 tokens at
chunk_size=1024 built 1024×1024 blocks (450 ms for the gated delta rule instead of ~1 ms), and
TTT-KVB padded a short call up to a whole mini-batch. float64 throughout, so the reference
comparison is tight (1e-10, rounding at 1e-16).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from recurrent_depth import ops
from recurrent_depth.model.mixers.log_linear_delta import (
    chunk_log_linear_gated_delta_rule,
    recurrent_log_linear_gated_delta_rule,
)
from recurrent_depth.ops import LogLinearState, TTTKVBState

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, H, K, V = 2, 3, 2, 5, 7
LONG_CHUNK = 1024
LEVELS = 12  # enough Fenwick levels for positions up to 2047


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(B, T, H, K), "k": F.normalize(randn(B, T, H, K), dim=-1), "v": randn(B, T, H, V),
        "beta": torch.sigmoid(randn(B, T, H)), "g": F.logsigmoid(randn(B, T, H) + 2.0),
        "gk": F.logsigmoid(randn(B, T, H, K)) / 4, "lam": F.softplus(randn(B, T, H, LEVELS)),
        "S0": randn(B, H, K, V) * 0.3, "levels0": randn(B, H, LEVELS, K, V) * 0.3,
    }


@dataclass(frozen=True)
class Case:
    module: str  # where the op's `to_chunks` is watched
    chunk: Callable
    naive: Callable
    args: tuple[str, ...]  # positional inputs, in call order
    state: Callable[[dict], object] | None = None  # initial state from the inputs


CASES = {
    "linear_attn": Case("recurrent_depth.ops.linear_attn.chunk", ops.chunk_linear_attn,
                        ops.naive_recurrent_linear_attn, ("q", "k", "v"), lambda x: x["S0"]),
    "delta_rule": Case("recurrent_depth.ops.gated_delta_rule.chunk", ops.chunk_delta_rule,
                       ops.naive_recurrent_delta_rule, ("q", "k", "v", "beta"), lambda x: x["S0"]),
    "gated_delta_rule": Case("recurrent_depth.ops.gated_delta_rule.chunk", ops.chunk_gated_delta_rule,
                             ops.naive_recurrent_gated_delta_rule, ("q", "k", "v", "g", "beta"), lambda x: x["S0"]),
    "gla": Case("recurrent_depth.ops.gla.chunk", ops.chunk_gla, ops.naive_recurrent_gla, ("q", "k", "v", "gk"),
                lambda x: x["S0"]),
    "falcon": Case("recurrent_depth.ops.gated_delta_rule.chunk", ops.chunk_falcon, ops.naive_recurrent_falcon,
                   ("q", "k", "v", "beta")),
    # a carried state at an odd absolute position (1001): chunks must stay aligned to it
    "log_linear_attn": Case("recurrent_depth.ops.log_linear_attn.chunk", ops.chunk_log_linear_attn,
                            ops.naive_recurrent_log_linear_attn, ("q", "k", "v", "g", "lam"),
                            lambda x: LogLinearState(x["levels0"], 1001)),
    "log_linear_gated_delta_rule": Case("recurrent_depth.model.mixers.log_linear_delta",
                                        chunk_log_linear_gated_delta_rule, recurrent_log_linear_gated_delta_rule,
                                        ("q", "k", "v", "g", "beta", "lam")),
}


def watch_chunk_widths(monkeypatch: pytest.MonkeyPatch, module_name: str) -> list[int]:
    """Record the chunk width (dim 3 of `[B, H, N, C, ...]`) of every `to_chunks` call in a module."""
    module = importlib.import_module(module_name)
    original = module.to_chunks
    widths: list[int] = []

    def recording(x: torch.Tensor, C: int, *args: object, **kwargs: object) -> torch.Tensor:
        widths.append(C)
        return original(x, C, *args, **kwargs)

    monkeypatch.setattr(module, "to_chunks", recording)
    return widths


@pytest.mark.parametrize("case", list(CASES))
def test_a_short_call_is_not_padded_to_a_long_chunk_and_equals_the_loop(case, monkeypatch):
    c = CASES[case]
    widths = watch_chunk_widths(monkeypatch, c.module)
    x = inputs()
    args = [x[name] for name in c.args]
    state = c.state(x) if c.state else None
    o, final = c.chunk(*args, initial_state=state, output_final_state=True, chunk_size=LONG_CHUNK)
    assert widths and max(widths) <= 4, f"{case}: chunks of {max(widths)} for a call of {T} tokens"
    o_ref, final_ref = c.naive(*args, initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(final, final_ref, strict=True) if isinstance(final, tuple) else [(final, final_ref)]:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # (a LogLinearState's offset: exact)


def test_ttt_kvb_call_inside_one_mini_batch_is_not_padded_to_it(monkeypatch):
    widths = watch_chunk_widths(monkeypatch, "recurrent_depth.ops.ttt_kvb.chunk")
    x = inputs(1)
    q, k, v, beta = x["q"], x["k"], x["v"], x["beta"]
    state = TTTKVBState(x["S0"], x["S0"] + 0.1, 2)  # resuming 2 tokens into a mini-batch of 1024
    o, final = ops.chunk_ttt_kvb(q, k, v, beta, initial_state=state, output_final_state=True, mini_batch=LONG_CHUNK)
    assert max(widths) == 2 + T, f"chunks of {max(widths)} for {T} tokens after 2"
    o_ref, final_ref = ops.naive_recurrent_ttt_kvb(q, k, v, beta, initial_state=state, output_final_state=True,
                                                   mini_batch=LONG_CHUNK)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final.start, final_ref.start, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final.current, final_ref.current, rtol=1e-10, atol=1e-10)
    assert final.offset == final_ref.offset == 2 + T
