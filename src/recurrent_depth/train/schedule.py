"""Learning-rate schedule: linear warmup, constant, optional linear cool-down ("trapezoid", as Huginn).

Steps are 0-based optimizer steps. Both ramps leave out their zero end, so the first and the last
step of a run have a nonzero rate even when ``min_lr`` is 0:

    warmup    (step < warmup):            lr = base_lr * (step + 1) / warmup
    cool-down (last ``cooldown`` steps):  lr = min_lr + (base_lr - min_lr) * (total - step) / cooldown
    otherwise:                            lr = base_lr

When warmup and cool-down overlap (short runs) the smaller of the two values wins. A ramp longer
than the run is cut, not squeezed: with ``warmup > total`` the run never reaches ``base_lr``, and with
``cooldown > total`` every step lies on the cool-down line (the trainer's projected length of a
time-capped run can fall below a fixed ``cooldown``; that must not stop the run).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from recurrent_depth.config import is_int, is_real


def lr_at(
    step: int,
    base_lr: float,
    warmup: int,
    total: int | None,
    cooldown: int = 0,
    min_lr: float = 0.0,
) -> float:
    """The learning rate at optimizer step ``step`` (0-based) of a run of ``total`` steps.

    Args:
        step: 0-based optimizer step, ``0 <= step < total``.
        base_lr: the peak (constant-phase) learning rate, > 0.
        warmup: number of linear warmup steps (>= 0).
        total: planned number of optimizer steps, or ``None`` for an open-ended run (needs ``cooldown=0``).
        cooldown: number of final steps that decay linearly towards ``min_lr`` (0 = none); may exceed ``total``.
        min_lr: the value the cool-down decays to, in ``[0, base_lr]``.
    """
    if not is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if not is_real(base_lr) or base_lr <= 0:
        raise ValueError(f"base_lr must be a finite number > 0, got {base_lr!r}")
    if not is_int(warmup) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not is_int(cooldown) or cooldown < 0:
        raise ValueError(f"cooldown must be an integer >= 0, got {cooldown!r}")
    if not is_real(min_lr) or not 0 <= min_lr <= base_lr:
        raise ValueError(f"min_lr must be in [0, base_lr={base_lr!r}], got {min_lr!r}")
    if total is None:
        if cooldown:
            raise ValueError(f"a cool-down ({cooldown} steps) needs a known total number of steps, got total=None")
    else:
        if not is_int(total) or total < 1:
            raise ValueError(f"total must be None or an integer >= 1, got {total!r}")
        if step >= total:
            raise ValueError(f"step must be < total ({total}), got {step}; raise the total to train longer")

    lr = base_lr
    if step < warmup:
        lr = base_lr * (step + 1) / warmup
    if total is not None and cooldown and step >= total - cooldown:
        lr = min(lr, min_lr + (base_lr - min_lr) * (total - step) / cooldown)
    return lr


def set_lr(optimizers: Any, lr: float) -> None:
    """Set ``group["lr"] = lr * group.get("lr_scale", 1.0)`` on every param group.

    ``optimizers`` is a ``torch.optim.Optimizer``, anything with ``param_groups`` (an ``OptimizerSet``),
    or an iterable of those. ``lr_scale`` lets one schedule drive groups with different peak rates
    (Muon's matrices at ``muon_lr`` next to AdamW at ``lr``).
    """
    if not is_real(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    for group in _param_groups(optimizers):
        group["lr"] = lr * group.get("lr_scale", 1.0)


def _param_groups(optimizers: Any) -> Iterable[dict[str, Any]]:
    if hasattr(optimizers, "param_groups"):
        return optimizers.param_groups
    return [group for opt in optimizers for group in opt.param_groups]

