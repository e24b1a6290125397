"""torch.optim.Muon whose Newton-Schulz iteration may run in float32, for CPUs that emulate bf16.

torch.optim.Muon always orthogonalises the update in bf16. On a CPU without native bf16 (no
AVX512-BF16 or AMX) oneDNN emulates those products, and two of the iteration's three (`A @ A` and
`B @ X`) fall in the layout it runs ~30x slower: one Muon step of the `small` model took 7.9 s
there, against 34 ms for the paper's Adam. In float32 the same iteration is a few milliseconds per
matrix and rounds less. `Muon(ns_dtype="auto")` (the default here) picks float32 on such CPUs and
bf16 everywhere else, where `step` is torch.optim.Muon's own; the state (`momentum_buffer`) and
param groups are torch's, so checkpoints move freely between the two.

`row_blocks` orthogonalises a fused projection block by block: `{id(Wqkv): (q_rows, k_rows, v_rows)}`
makes q, k and v three matrices, as Kimi K2 runs Muon (each a separate W there), so each block's
spectral norm moves by its own lr, not by a share of the fused matrix's; each block gets the
per-matrix lr of its own shape. The weight layout does not change (the blocks are row views).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recurrent_depth.accel.cpu import cpu_emulates_bf16

NS_DTYPES = ("auto", "bfloat16", "float32")


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon (same order of operations) in `dtype`.

    Returns an approximately orthogonalised `update` (singular values ~ U(0.5, 1.5)), in `dtype`.
    """
    a, b, c = coefficients
    x = update.to(dtype)
    wide = update.size(0) > update.size(1)
    if wide:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if wide else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix learning rate: "original" sqrt(max(1, rows/cols)), or
    "match_rms_adamw" 0.2 sqrt(max(rows, cols))."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def resolve_ns_dtype(ns_dtype: str, params: list[Tensor]) -> torch.dtype:
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
    if ns_dtype == "auto":
        on_cpu = all(p.device.type == "cpu" for p in params)
        return torch.float32 if on_cpu and cpu_emulates_bf16() else torch.bfloat16
    return getattr(torch, ns_dtype)


MAX_NS_STEPS = 99  # torch.optim.Muon's bf16 step raises at 100 or more (its float32 twin here must agree)


def check_group(group: dict) -> None:
    """One-line errors for the settings torch.optim.Muon takes unchecked (or refuses only at its first bf16
    step): the same group must be valid in either Newton-Schulz dtype, on every machine."""
    steps, momentum, coefficients = group["ns_steps"], group["momentum"], group["ns_coefficients"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_NS_STEPS:
        raise ValueError(f"Muon ns_steps={steps!r} is invalid: expected an integer in [1, {MAX_NS_STEPS}]")
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
        # momentum 1 never moves the buffer from zero: every update would be 0
        raise ValueError(f"Muon momentum={momentum!r} is invalid: expected a number in [0, 1)")
    if not isinstance(coefficients, tuple | list) or len(coefficients) != 3:
        raise ValueError(f"Muon ns_coefficients={coefficients!r} is invalid: expected three numbers (a, b, c)")


class Muon(torch.optim.Muon):
    """torch.optim.Muon with `ns_dtype`: "bfloat16" (torch's step, unchanged), "float32", or "auto"
    (float32 when every parameter is on a CPU that emulates bf16, else bfloat16); and `row_blocks`
    (see the module docstring), whose parameters always take this class's own step. Groups are checked by
    `check_group` (ns_steps in [1, 99], momentum in [0, 1)), so a setting fails at construction on every machine."""

    def __init__(self, params, *, ns_dtype: str = "auto", row_blocks: dict[int, tuple[int, ...]] | None = None,
                 **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = resolve_ns_dtype(ns_dtype, [p for g in self.param_groups for p in g["params"]])
        self.row_blocks = dict(row_blocks or {})
        for group in self.param_groups:
            for param in group["params"]:
                blocks = self.row_blocks.get(id(param))
                if blocks is not None and sum(blocks) != param.shape[0]:
                    raise ValueError(f"Muon row_blocks {blocks} do not add up to the {param.shape[0]} rows "
                                     f"of a {tuple(param.shape)} parameter")

    def add_param_group(self, param_group: dict) -> None:
        """torch's (also what `__init__` calls per group), plus `check_group`: a bad group is refused, not kept."""
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16 and not self.row_blocks:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"].item() if isinstance(group["lr"], Tensor) else group["lr"]
            momentum = group["momentum"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse or torch.is_complex(param):
                    raise RuntimeError("Muon supports dense real gradients only")
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                param.mul_(1 - lr * group["weight_decay"])
                blocks = self.row_blocks.get(id(param), (param.shape[0],))
                for rows, block in zip(param.split(blocks), update.split(blocks)):
                    block = newton_schulz(block, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                          self.ns_dtype)
                    rows.add_(block, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows.shape))
        return loss
