"""The low-rank terms of unmerged peft LoRA layers, for runners that read weights directly.

peft's `lora.Linear` keeps the base `nn.Linear` as `base_layer` (its `weight` and `bias` are the base
layer's) and adds `scale * B (A x)` per active adapter in its forward. The fused decode runner
(`accel/runner.py`) multiplies by the weights itself instead of calling the module, so it reads
that term here and adds it, exactly as peft's forward does (dropout is the identity in eval mode).
Duck-typed on peft's attributes, so nothing here imports peft.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.inference.lora_layers import active_unmerged, is_lora_layer


def unsupported_lora(layer: Any) -> str | None:
    """Why `low_rank_term` cannot reproduce this LoRA layer's forward (None: it can)."""
    if not isinstance(getattr(layer, "base_layer", None), nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        return f"{type(layer).__name__} over {type(getattr(layer, 'base_layer', None)).__name__}"
    for name in active_unmerged(layer):
        if layer.use_dora.get(name, False):
            return f"adapter {name!r} uses DoRA"
        if getattr(layer, "lora_bias", {}).get(name, False):
            return f"adapter {name!r} has a LoRA bias"
        if name in getattr(layer, "lora_variant", {}):
            return f"adapter {name!r} is a LoRA variant ({type(layer.lora_variant[name]).__name__})"
        if not isinstance(layer.lora_A[name], nn.Linear):
            return f"adapter {name!r} is not a plain low-rank pair"
    return None


def low_rank_term(layer: Any, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor] | None:
    """`(A^T [in, r], (scale B)^T [r, out])`, the active unmerged adapters stacked along r, so that
    `layer(x) = base(x) + (x @ A^T) @ (scale B)^T`; None for a plain layer or nothing to add.
    dtype: the activations' (peft may keep the adapters of a bf16 model in float32)."""
    if not is_lora_layer(layer):
        return None
    names = active_unmerged(layer)
    if not names:
        return None
    a = torch.cat([layer.lora_A[name].weight for name in names])  # [r, in]
    b = torch.cat([layer.lora_B[name].weight * layer.scaling[name] for name in names], dim=1)  # [out, r]
    return a.t().to(dtype), b.t().to(dtype).contiguous()
