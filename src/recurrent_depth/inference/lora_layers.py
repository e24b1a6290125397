"""peft's LoRA layers, duck-typed on their attributes (nothing here imports peft): which layers they are and which
adapters their forward adds. Read by the fused runner (`accel/lora.py`), TTT-E2E's parameter choice and the
multi-adapter server."""

from __future__ import annotations

from typing import Any

from torch import nn


def is_lora_layer(module: Any) -> bool:
    """A peft LoRA layer (any kind: Linear, Embedding, ...)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def active_unmerged(layer: Any) -> list[str]:
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
        active = set(active_unmerged(module))
        for name, _ in module.named_parameters(prefix=prefix):
            tail = name[len(prefix):].split(".")
            # (peft's adapter tensors: lora_A.<adapter>.weight, lora_magnitude_vector.<adapter>.weight, ...)
            if len(tail) > 2 and tail[1].startswith("lora_") and tail[2] not in active:
                idle.add(name)
    return idle
