"""Fenwick-tree levels of log-linear attention, its decode state and its input checks.

Token s is in level ℓ of query t (s ≤ t) when ℓ = bit_length(t XOR s): level 0 is {t} itself,
level ℓ ≥ 1 is the aligned block of 2^(ℓ−1) tokens that shares t's bits above ℓ − 1 and has bit
ℓ − 1 clear (it exists only when t has bit ℓ − 1 set). Positions are absolute, counted from the
first token of the sequence, which is why the decode state carries its `offset`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from recurrent_depth.ops._common import check_inputs, check_like, check_tensor


class LogLinearState(NamedTuple):
    """Decode state of log-linear attention after `offset` tokens.

    `levels [B, H, L, K, V]`: level ℓ holds Σ_{s in level ℓ of query offset−1} decay(s→offset−1) k_s v_sᵀ
    (the Fenwick buckets of the last token seen). At most bit_length(offset − 1) + 1 levels are in use;
    the rest are zeros. `offset`: number of tokens already seen (the next token's absolute position).
    """

    levels: torch.Tensor
    offset: int


def levels_needed(num_positions: int) -> int:
    """Levels used by positions 0 .. num_positions − 1: bit_length(num_positions − 1) + 1."""
    return max(num_positions - 1, 0).bit_length() + 1


def trailing_ones(n: int) -> int:
    """Number of trailing one bits of n ≥ 0 (how many levels merge when moving from n to n + 1)."""
    return (~n & (n + 1)).bit_length() - 1


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bit_length of a non-negative integer tensor."""
    out = torch.zeros_like(x)
    b = 0
    while bool((x >> b).any()):
        out += (x >> b) > 0
        b += 1
    return out


def level_matrix(C: int, device: torch.device) -> torch.Tensor:
    """`[C, C]` long: entry (i, j) = bit_length(i XOR j), the level of key j for query i (j ≤ i)."""
    i = torch.arange(C, device=device)
    return bit_length(i[:, None] ^ i[None, :])


def check_log_linear_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None,
    initial_state: object,
) -> tuple[int, int, int, int, int, int, float, torch.Tensor | None, int]:
    """Validate; return `(B, T, H, K, V, L, scale, initial levels or None, offset)`."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, g=g)
    check_tensor("level_scales", level_scales)
    if level_scales.dim() != 4 or level_scales.shape[:3] != (B, T, H):
        raise ValueError(
            f"level_scales must have shape [B, T, H, L] with B, T, H = {B}, {T}, {H} as in q, "
            f"got {tuple(level_scales.shape)}"
        )
    check_like("level_scales", level_scales, tuple(level_scales.shape), "[B, T, H, L]", q)
    L = level_scales.shape[-1]
    levels0, offset = None, 0
    if initial_state is not None:
        if not (isinstance(initial_state, tuple) and len(initial_state) == 2):
            raise ValueError(
                "initial_state must be a LogLinearState(levels [B, H, L, K, V], offset), "
                f"got {type(initial_state).__name__}"
            )
        levels0, offset = initial_state
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 1:
            raise ValueError(
                f"initial_state.offset must be the number of tokens already seen, an int >= 1, got {offset!r}"
                " (pass initial_state=None to start a new sequence)"
            )
        check_tensor("initial_state.levels", levels0)
        L0 = levels0.shape[2] if levels0.dim() == 5 else -1
        check_like("initial_state.levels", levels0, (B, H, max(L0, 1), K, V), "[B, H, L, K, V]", q)
        held = levels_needed(offset)
        if held > L0:
            raise ValueError(
                f"initial_state.levels has {L0} levels but {offset} tokens need at least "
                f"{held} (= bit_length({offset - 1}) + 1)"
            )
    need = levels_needed(offset + T)
    if need > L:
        raise ValueError(
            f"level_scales has L={L} levels but positions up to {offset + T - 1} need at least {need} "
            f"(= bit_length({offset + T - 1}) + 1)"
        )
    return B, T, H, K, V, L, scale, levels0, offset
