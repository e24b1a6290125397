"""Per-head maximum of pre-softmax attention logits, recorded from the training forward (for QK-clip).

SDPA never returns its logits, so a recording mixer computes max_(i, j allowed) q_i . k_j * scale
per head itself, under no_grad, from the q and k it is about to hand to SDPA: one extra q k^T
product over the causal lower triangle (query blocks of `BLOCK` rows against the keys up to the
block's end, so about half of the full T x S product), never materialised for the whole sequence.
A module applied several times in one forward (a recurrent core block runs r times) keeps the
running maximum over its calls, which is what QK-clip needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recurrent_depth.model.mixers.common import upcast

BLOCK = 128


def head_max_logits(q: Tensor, k: Tensor, scale: float, mask: Tensor | None, is_causal: bool) -> Tensor:
    """max over batch, queries and allowed keys of q . k * scale, per query head: [H] float32.

    q: [B, T, H, D]; k: [B, S, Hkv, D] (query head h reads key head h // (H / Hkv), as SDPA's GQA);
    mask: [B or 1, 1, T, S] bool (True = may attend) or None; is_causal: SDPA's flag (then S == T).
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    with torch.no_grad():
        qh = q.detach().permute(0, 2, 1, 3).reshape(B, Hkv, G, T, D)  # [B, Hkv, G, T, D]
        kt = k.detach().permute(0, 2, 3, 1)[:, :, None]  # [B, Hkv, 1, D, S]
        best = torch.full((Hkv, G), float("-inf"), dtype=torch.float32, device=q.device)

        def update(scores: Tensor, allowed: Tensor | None = None) -> None:
            nonlocal best
            scores = upcast(scores)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))

        for t0 in range(0, T, BLOCK):
            t1 = min(T, t0 + BLOCK)
            block = qh[:, :, :, t0:t1]
            if mask is not None:
                update(block @ kt, mask[..., t0:t1, :].unsqueeze(2))  # [B or 1, 1, 1, t1 - t0, S]
            elif not is_causal:
                update(block @ kt)
            else:  # keys before the block are all allowed; only the diagonal block needs the triangle
                if t0:
                    update(block @ kt[..., :t0])
                rows = torch.arange(t0, t1, device=q.device)[:, None]
                update(block @ kt[..., t0:t1], torch.arange(t0, t1, device=q.device)[None, :] <= rows)
        best = best * scale  # max(c x) = c max(x) for c > 0, and rounding is monotonic
    return best.reshape(H)


class MaxLogitRecorder:
    """Mixin of the attention mixers: `record_max_logit = True` makes training forwards keep, in
    `max_logit` [H], the running per-head maximum of the logits (None until the first call);
    `reset_max_logit()` starts over (QK-clip does after each optimizer step)."""

    record_max_logit: bool = False
    max_logit: Tensor | None = None

    def observe_logits(self, q: Tensor, k: Tensor, scale: float, mask: Tensor | None, is_causal: bool) -> None:
        found = head_max_logits(q, k, scale, mask, is_causal)
        self.max_logit = found if self.max_logit is None else torch.maximum(self.max_logit, found)

    def reset_max_logit(self) -> None:
        self.max_logit = None


@torch.no_grad()
def scale_parameter(param: Tensor, multiplier: Tensor) -> None:
    """param *= multiplier (param's full shape), computed in float64; entries times exactly 1 stay
    bit-identical. Works on FSDP2's sharded DTensor parameters (the multiplier is sharded alike)."""
    m = multiplier.to(device=param.device, dtype=torch.float64).contiguous()
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        m = distribute_tensor(m, param.device_mesh, param.placements)
    param.copy_((param.to(torch.float64) * m).to(param.dtype))
