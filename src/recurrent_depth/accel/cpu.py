"""What this CPU can do fast: the probes the tuning in `recurrent_depth.accel` decides on."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_emulates_bf16() -> bool:
    """True when oneDNN has no native bf16 GEMMs on this CPU (no AVX512-BF16 or AMX): bf16 matmuls are
    emulated there (~4.5x slower per token than fp32 in a linear layer, 40x in bf16 Newton-Schulz;
    measured, docs/training.md)."""
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def slow_bf16_warnings(device: torch.device, dtype: str, muon_ns_dtype: str | None) -> list[str]:
    """Warnings for a training run whose bf16 work this CPU would emulate (empty elsewhere)."""
    if device.type != "cpu" or not cpu_emulates_bf16():
        return []
    warnings = []
    if dtype == "bfloat16":
        warnings.append("warning: this CPU has no native bf16 matmuls; bfloat16 autocast will be slower than "
                        "float32 here")
    if muon_ns_dtype == "bfloat16":
        warnings.append("warning: muon_ns_dtype bfloat16 runs Muon's Newton-Schulz iteration in bf16, which this "
                        "CPU emulates; each optimizer step will be slow (muon_ns_dtype auto or float32 avoids it)")
    return warnings
