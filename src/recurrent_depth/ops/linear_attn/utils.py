"""The state of (normalised) linear attention and its checks."""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import check_like, check_state

# Added to the normaliser q·z, as in flash-linear-attention, so an all-zero prefix gives 0 not NaN.
NORMALIZER_EPS = 1e-10

LinearAttnState = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def check_linear_attn_state(
    state: object, normalize: bool, B: int, H: int, K: int, V: int, ref: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split an `initial_state` into `(S [B, H, K, V], z [B, H, K])`.

    Without `normalize` the state is the tensor `S`; with it, the pair `(S, z)` where `z` is the
    running sum of keys (the normaliser's memory).
    """
    if state is None:
        return None, None
    if not normalize:
        if isinstance(state, tuple):
            raise ValueError("initial_state must be a tensor [B, H, K, V] when normalize=False, got a tuple")
        return check_state(state, B, H, K, V, ref), None
    if not (isinstance(state, tuple) and len(state) == 2):
        raise ValueError(
            "initial_state must be the pair (S [B, H, K, V], z [B, H, K]) when normalize=True, "
            f"got {type(state).__name__}"
        )
    S, z = state
    check_state(S, B, H, K, V, ref)
    check_like("initial_state z", z, (B, H, K), "[B, H, K]", ref)
    return S, z
