"""Hardware tuning applied from outside the model (the model package itself is plain PyTorch).

    from recurrent_depth import accel
    applied = accel.apply(model)        # {"linears": 14, "norms": 17}; `accel.apply(model, enabled=False)` = {}

- `convert_linears` (`accel.linear`): bf16/fp16 training products on CPU in the fast GEMM layouts of
  the machine (emulated bf16: blocked a^T @ b; native bf16: the forward from a cached contiguous W^T);
- `convert_norms` (`accel.norm`): the fp32 RMSNorm with a hand-written backward (1.7x);
- `keep_freed_memory` (`accel.allocator`): glibc thresholds for training loops;
- `choose_threads` / `configure_threads` (`accel.threads`): the thread count for the machine now;
- `cpu_emulates_bf16` (`accel.cpu`): the probe the choices above rest on.
- `FastRunner` (`accel.runner`): the fused decode runner for all-attention models; `import recurrent_depth`
  registers it with `inference.runner.make_runner` (`fast=False` there is its own switch).

Each conversion swaps the class of existing layers (no new parameters, names or buffers), so a
converted model saves the state dict of the plain one, and `restore(model)` undoes it. One switch
turns all of it off: `enabled=False`, the trainer's `accel: false` (`rdepth train --no-accel`), or the
environment variable `RDEPTH_NO_ACCEL=1`.
"""

from __future__ import annotations

import os

from torch import nn

from recurrent_depth.accel.cpu import cpu_emulates_bf16
from recurrent_depth.accel.linear import convert_linears, restore_linears
from recurrent_depth.accel.norm import convert_norms, restore_norms
from recurrent_depth.accel.threads import ThreadGuard, choose_threads, configure_threads

DISABLE_ENV = "RDEPTH_NO_ACCEL"


def enabled_by_default() -> bool:
    """False when the environment says `RDEPTH_NO_ACCEL` (any value but "", "0")."""
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


def apply(model: nn.Module, enabled: bool | None = None) -> dict[str, int]:
    """Convert `model` in place where it helps on this machine; returns the layers converted by kind.

    `enabled=None` follows `RDEPTH_NO_ACCEL`; False converts nothing."""
    if enabled is None:
        enabled = enabled_by_default()
    if not enabled:
        return {}
    return {"norms": convert_norms(model), "linears": convert_linears(model)}


def restore(model: nn.Module) -> None:
    """The plain model again (undoes `apply`)."""
    restore_linears(model)
    restore_norms(model)


__all__ = [
    "DISABLE_ENV",
    "ThreadGuard",
    "apply",
    "choose_threads",
    "configure_threads",
    "convert_linears",
    "convert_norms",
    "cpu_emulates_bf16",
    "enabled_by_default",
    "restore",
]
