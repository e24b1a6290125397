"""Per-head maximum of pre-softmax attention logits, recorded from the training forward (for QK-clip).

SDPA never returns its logits, so a recording mixer computes max_(i, j allowed) q_i . k_j * scale
per head itself, under no_grad, from the q and k it is about to hand to SDPA: one extra q k^T
product over the causal lower triangle (query blocks of `BLOCK` rows against the keys up to the
block's end, so about half of the full T x S product), never materialised for the whole sequence.
A module applied several times in one forward (a recurrent core block runs r times) keeps the
running maximum over its calls, which is what QK-clip needs.

Why it is written this way (it runs at every attention call of a training step, so its cost is
QK-clip's cost): the query heads that share a key head are stacked as rows of one matrix, so each
block is a single `bmm` against the key head with no broadcast copies of k; every block's scores
go into one buffer allocated once per call (the CPU allocator does not cache, and a fresh
multi-MB result per block costs page faults); the causal triangle is masked in place on the
diagonal block only; maxima are taken in the input dtype (max commutes with the exact upcast) and
no value is read back to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recurrent_depth.model.mixers.common import upcast

BLOCK = 32  # query rows per product; 32 was fastest at the small preset (T 512) on CPU, 64 and 128 slower


def head_max_logits(q: Tensor, k: Tensor, scale: float, mask: Tensor | None, is_causal: bool) -> Tensor:
    """max over batch, queries and allowed keys of q . k * scale, per query head: [H] float32.

    q: [B, T, H, D]; k: [B, S, Hkv, D] (query head h reads key head h // (H / Hkv), as SDPA's GQA);
    mask: [B or 1, 1, T, S] bool (True = may attend) or None; is_causal: SDPA's flag (then S == T).
    """
    B, T, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    causal = mask is None and is_causal
    with torch.no_grad():
        # row t * G + g of batch entry (b, j) is query t of head j * G + g, which reads key head j
        qg = q.detach().reshape(B, T, Hkv, G, D).transpose(1, 2).reshape(B * Hkv, T * G, D)
        kt = k.detach().permute(0, 2, 3, 1).reshape(B * Hkv, D, S)
        rows = min(BLOCK, T)
        buffer = torch.empty(B * Hkv * rows * G * S, dtype=q.dtype, device=q.device)
        above = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1) if causal else None
        best = torch.full((Hkv, G), float("-inf"), dtype=q.dtype, device=q.device)
        for t0 in range(0, T, BLOCK):
            t1 = min(T, t0 + BLOCK)
            n, keys = t1 - t0, t1 if causal else S  # causal: the keys after the block are all masked
            out = buffer[: B * Hkv * n * G * keys].view(B * Hkv, n * G, keys)
            scores = torch.bmm(qg[:, t0 * G:t1 * G], kt[:, :, :keys], out=out).view(B, Hkv, n, G, keys)
            if mask is not None:
                scores.masked_fill_(~mask[:, :, t0:t1, None, :], float("-inf"))
            elif causal:  # keys before the block are all allowed; only the diagonal block needs the triangle
                scores[..., t0:t1].masked_fill_(above[:n, None, :n], float("-inf"))
            found = scores.amax(dim=-1).amax(dim=(0, 2))  # [Hkv, G]
            best = torch.maximum(best, found)
        best = upcast(best) * scale  # max(c x) = c max(x) for c > 0, and rounding is monotonic
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
def scale_parameter(param: Tensor, multiplier: Tensor, offset: float = 0.0) -> None:
    """param *= multiplier (param's full shape), computed in float64; entries times exactly 1 stay
    bit-identical. offset: the parameter is a gain's part beside a constant, gain = offset + param (a norm's
    (1 + w), `ModelConfig.norm_unit_offset`), and the gain is what is scaled.
    Works on FSDP2's sharded DTensor parameters: every rank holds the same full multiplier (QK-clip all-reduces
    the maxima first) and multiplies its own shard by its own slice of it, cut exactly as the parameter is
    (`src_data_rank=None`: no communication)."""
    m = multiplier.to(device=param.device, dtype=torch.float64).contiguous()
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        m = distribute_tensor(m, param.device_mesh, param.placements, src_data_rank=None)
    p64 = param.to(torch.float64)
    scaled = torch.where(m == 1, p64, (p64 + offset) * m - offset) if offset else p64 * m
    param.copy_(scaled.to(param.dtype))
