"""Step-by-step FALCON (Falcon-1; "prefix-aligned" fast-weight learning, arXiv 2608.27763): the
ground truth for the chunked form.

The state S [K, V] is an online regressor trained on the prefix-aligned pair (x_t, y_t) =
(k_{t−1}, v_t): the key of the previous token predicts this token's value. One normalised
least-mean-squares (NLMS) step on ½‖Sᵀx_t − y_t‖² per token:

    S_t = S_{t−1} + β_t x_t (y_t − S_{t−1}ᵀ x_t)ᵀ / (ε + ‖x_t‖²)        o_t = S_tᵀ (scale · q_t)

with x_0 = 0 (no key before the first token: no update). The decode state carries the last key.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from recurrent_depth.ops._common import (
    acc_dtype,
    autocast_off,
    check_inputs,
    check_like,
    check_state,
    heads_first,
    steps,
)


class FalconState(NamedTuple):
    """Decode state: the regressor `S [B, H, K, V]` and the last key seen `last_key [B, H, K]`."""

    S: torch.Tensor
    last_key: torch.Tensor


def check_falcon_state(state: object, B: int, H: int, K: int, V: int, ref: torch.Tensor) -> None:
    if not isinstance(state, FalconState):
        raise ValueError(f"initial_state must be a FalconState, got {type(state).__name__}")
    check_state(state.S, B, H, K, V, ref)
    check_like("initial_state.last_key", state.last_key, (B, H, K), "[B, H, K]", ref)


def check_eps(eps: float, initial_state: FalconState | None) -> float:
    """ε of the NLMS step β / (ε + ‖x‖²): a negative or non-finite ε is refused, and so is ε = 0 without an
    initial state, whose x_0 = 0 would make every output NaN (0 / 0)."""
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if eps == 0 and initial_state is None:
        raise ValueError("eps=0 needs an initial_state: without one the first key x_0 is zero, and "
                         "beta / (eps + |x_0|^2) is 0 / 0")
    return float(eps)


def previous_keys(k: torch.Tensor, initial_state: FalconState | None) -> torch.Tensor:
    """[B, T, H, K]: x_t = k_{t−1}, the first one from the state (zeros at the start of a sequence)."""
    first = k.new_zeros(k[:, :1].shape) if initial_state is None else initial_state.last_key[:, None].to(k.dtype)
    return torch.cat([first, k[:, :-1]], dim=1)


@autocast_off
def naive_recurrent_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: FalconState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, FalconState | None]:
    """FALCON one token at a time. q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (NLMS step size).

    Returns `(o [B, T, H, V] in q's dtype, FalconState or None)`.
    """
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, beta=beta)
    eps = check_eps(eps, initial_state)
    dt, out_dtype = acc_dtype(q, k), q.dtype
    if initial_state is None:
        S = q.new_zeros(B, H, K, V, dtype=dt)
    else:
        check_falcon_state(initial_state, B, H, K, V, q)
        S = initial_state.S.to(dt)
    x = heads_first(previous_keys(k.to(dt), initial_state), dt)
    q, v, beta = (heads_first(t, dt) for t in (q, v, beta))
    outs = []
    for q_t, x_t, v_t, b_t in zip(steps(q * scale, 2), steps(x, 2), steps(v, 2), steps(beta[..., None], 2)):
        error = v_t - torch.einsum("bhkv,bhk->bhv", S, x_t)
        step = b_t / (eps + x_t.pow(2).sum(-1, keepdim=True))
        S = S + torch.einsum("bhk,bhv->bhkv", x_t, step * error)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))
    o = torch.stack(outs, dim=1).to(out_dtype)
    return o, FalconState(S, k[:, -1].to(dt)) if output_final_state else None
