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


def is_lora_layer(module: Any) -> bool:
    """A peft LoRA layer (any kind: Linear, Embedding, ...)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _active_unmerged(layer: Any) -> list[str]:
    """The adapters peft's forward adds on top of the base layer (none when merged or disabled, as peft)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def idle_adapter_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters of LoRA adapters that peft's forward does not add (turned off, disabled or merged):
    they change no output, so nothing should train or copy them (e.g. the other adapters of a
    `--lora-modules` server)."""
    idle: set[str] = set()
    for prefix, module in model.named_modules():
        if not is_lora_layer(module):
            continue
        active = set(_active_unmerged(module))
        for name, _ in module.named_parameters(prefix=prefix):
            tail = name[len(prefix):].split(".")
            # (peft's adapter tensors: lora_A.<adapter>.weight, lora_magnitude_vector.<adapter>.weight, ...)
            if len(tail) > 2 and tail[1].startswith("lora_") and tail[2] not in active:
                idle.add(name)
    return idle


def unsupported_lora(layer: Any) -> str | None:
    """Why `low_rank_term` cannot reproduce this LoRA layer's forward (None: it can)."""
    if not isinstance(getattr(layer, "base_layer", None), nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        return f"{type(layer).__name__} over {type(getattr(layer, 'base_layer', None)).__name__}"
    for name in _active_unmerged(layer):
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
    names = _active_unmerged(layer)
    if not names:
        return None
    a = torch.cat([layer.lora_A[name].weight for name in names])  # [r, in]
    b = torch.cat([layer.lora_B[name].weight * layer.scaling[name] for name in names], dim=1)  # [out, r]
    return a.t().to(dtype), b.t().to(dtype).contiguous()
