"""QK-clip (the "Clip" of Kimi K2's MuonClip): keep every attention head's max logit at most tau.

After each optimizer step, for each query head h of each attention layer,

    S_max,h = max over the step's batch (all micro-batches, all ranks) and all recurrence steps of
              the pre-softmax logit q_i . k_j / sqrt(d)
    gamma_h = tau / S_max,h   if S_max,h > tau   (else the head is left untouched, bit for bit)

and the head's logits are scaled by gamma_h by rescaling its weights (see each mixer's
`clip_heads`): sqrt(gamma_h) on W_q's rows and q-bias and on the key head's W_k rows and k-bias;
with grouped-query attention (one key head for several query heads) all of gamma_h on the query
side; with QK-norm on the gains (shared by the heads, so by the layer's smallest gamma; per head for
per-head or full-width gains); for MLA
the head-specific parts only (not the shared rotary key). The core's W_q, W_k serve all r
iterations, so a core layer's S_max is the max over every iteration: the mixer keeps a running
max over its calls. The maxima come from the training forward itself (the mixers record them
while `record_max_logit` is set), never from a second forward. Works after any optimizer.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.config import MODEL_PARTS, is_real
from recurrent_depth.model.mixers.logits import MaxLogitRecorder

# Mixers whose logits are per-head softmax logits q.k with a `clip_heads` rule.
CLIPPABLE_MIXERS: tuple[str, ...] = ("attention", "mla")


class QKClip:
    """Records per-head max logits of `model`'s attention layers and, with `threshold`, clips them.

    threshold: tau (> 0), or None to record the max logit only (no clipping). Clipping needs every attention
    layer's weights trainable: under a LoRA adapter (frozen base) it is refused; recording works there.
    Call `step()` once after every optimizer step: it reduces the maxima over ranks (all_reduce
    MAX when torch.distributed is initialised), clips (unless `apply=False`), starts the next
    step's maxima and returns `{"max_logit": float | None, "qk_clipped_heads": int}`.
    """

    def __init__(self, model: nn.Module, threshold: float | None = None) -> None:
        if threshold is not None and (not is_real(threshold) or threshold <= 0):
            raise ValueError(f"qk_clip threshold={threshold!r} is invalid: expected a number > 0 (tau)")
        config = getattr(model, "config", None)
        if config is not None:
            for part in MODEL_PARTS:
                count = getattr(config, "core_layers" if part == "core" else f"{part}_layers")
                name = config.mixer_for(part)
                if count and name not in CLIPPABLE_MIXERS:
                    raise ValueError(
                        f"QK-clip / max-logit recording needs softmax attention with per-head q.k logits "
                        f"(mixers {list(CLIPPABLE_MIXERS)}), but the {part} uses {name!r}, which has no such logits"
                    )
        if (threshold is not None and config is not None and getattr(config, "qk_norm", False)
                and not getattr(config, "qk_norm_per_head", False)
                and not getattr(config, "qk_norm_full_width", False)):
            # Under QK-norm the clip can act only on the norm's gains; one gain shared by a layer's heads
            # means clipping its worst head rescales every head of the layer (not Kimi K2's per-head rule).
            warnings.warn("QK-clip with a QK-norm gain shared by the heads clips each layer by its smallest "
                          "gamma (all its heads at once); set qk_norm_per_head=true for the per-head rule "
                          "(docs/training.md)", stacklevel=2)
        self.threshold = None if threshold is None else float(threshold)
        self.layers: list[tuple[str, Any]] = [
            (name, module) for name, module in model.named_modules() if isinstance(module, MaxLogitRecorder)
        ]
        if not self.layers:
            raise ValueError("QK-clip found no attention layer to record (the model has no softmax attention)")
        frozen = [name for name, module in self.layers if any(not p.requires_grad for p in module.parameters())]
        if self.threshold is not None and frozen:
            # A LoRA run trains and saves only the adapter: clipping would rescale frozen base weights (lost on
            # save) and leave the adapter's low-rank update, and so the logits, unclipped.
            raise ValueError(f"QK-clip needs trainable attention weights, but {frozen[0]}'s are frozen (a LoRA adapter "
                             "cannot be rescaled per head); drop qk_clip (record_max_logit only records) or train "
                             "every weight")
        for _, module in self.layers:
            module.record_max_logit = True
            module.reset_max_logit()

    def maxima(self) -> list[Tensor]:
        """Per layer, the [H] max logits of this step so far, reduced over ranks (-inf: not run)."""
        found = []
        for _, module in self.layers:
            value = module.max_logit
            if value is None:
                value = torch.full((module.num_heads,), float("-inf"), device=next(module.parameters()).device)
            found.append(value.float())
        flat = torch.cat(found)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        return list(flat.split([len(v) for v in found]))

    def step(self, apply: bool = True) -> dict[str, Any]:
        maxima = self.maxima()
        # One copy to the host for every decision below (a GPU syncs once per step, not once per layer).
        on_host = [m.tolist() for m in torch.cat(maxima).cpu().split([len(m) for m in maxima])]
        clipped = 0
        if self.threshold is not None and apply:
            tau = self.threshold
            for (_, module), s_max, values in zip(self.layers, maxima, on_host, strict=True):
                over = [v > tau for v in values]  # NaN and -inf compare False: those heads are left alone
                if any(over):
                    over_t = torch.tensor(over, device=s_max.device)
                    gamma = torch.where(over_t, tau / s_max.double(), torch.ones_like(s_max, dtype=torch.float64))
                    module.clip_heads(gamma)
                    clipped += sum(over)
        for _, module in self.layers:
            module.reset_max_logit()
        flat = [v for values in on_host for v in values]
        overall = math.nan if any(math.isnan(v) for v in flat) else max(flat, default=-math.inf)
        return {"max_logit": overall if math.isfinite(overall) else None, "qk_clipped_heads": clipped}

    def per_layer(self) -> dict[str, list[float]]:
        """The current (unreduced) per-head maxima by layer name, for experiments and debugging."""
        return {name: m.max_logit.tolist() for name, m in self.layers if m.max_logit is not None}

    def close(self) -> None:
        """Stop recording (the mixers compute nothing extra afterwards)."""
        for _, module in self.layers:
            module.record_max_logit = False
            module.reset_max_logit()
