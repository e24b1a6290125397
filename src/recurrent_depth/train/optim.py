"""Optimizers for recurrent-depth training: the paper's Adam, AdamW and Muon, with Huginn's parameter groups.

* :class:`HuginnAdam` (alias :data:`ELLISAdam`, the reference code's name): Adam with atan2 in place of
  epsilon, AdaFactor-style update clipping, first-step moment initialisation and "fully" decoupled
  weight decay, each behind its own switch.
* :func:`build_optimizers`: splits a model's parameters the way Huginn does (matrices, tied
  embedding/head, norms and biases without weight decay) and returns an :class:`OptimizerSet`.
  ``"muon"`` sends the 2-D block and adapter matrices to ``torch.optim.Muon`` (through
  :class:`recurrent_depth.train.muon.Muon`, which can orthogonalise in float32 on CPUs that emulate
  bf16) and the rest to AdamW.
* :class:`OptimConfig`: the optimizer, schedule and clipping recipe as one validated dataclass,
  with presets (``"huginn-0125"`` = the official launch config of the paper's main run: the paper's
  peak lr 4e-5, but the config's trapezoid cool-down, where the paper trained at a constant rate;
  ``"demo"`` = tuned for short CPU runs from scratch; ``"finetune"`` and ``"finetune-lora"`` = the
  defaults of runs that start from a model directory, every weight or a LoRA adapter).
* :func:`clip_and_check_grads`: gradient-norm clipping that reports non-finite gradients so the
  trainer can skip (and count) the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from recurrent_depth.config import FIXED_FAN_IN_MODULES, check_field_names, is_int
from recurrent_depth.train.muon import MAX_NS_STEPS, NS_DTYPES, Muon
from recurrent_depth.train.schedule import lr_at

BIAS_CORRECTIONS: tuple[str, ...] = ("outside", "inside", "none")
OPTIMIZERS: tuple[str, ...] = ("adamw", "ellis-adam", "muon")
MUON_ADJUST_LR: tuple[str, ...] = ("original", "match_rms_adamw")

# Substrings that mark a parameter as the (tied) token embedding / output head.
EMBEDDING_KEYS: tuple[str, ...] = ("wte", "embed", "lm_head")
# Substrings that mark a parameter as exempt from weight decay (RMSNorm gains, biases, qk_bias).
NO_DECAY_KEYS: tuple[str, ...] = ("norm", "bias")


class HuginnAdam(Optimizer):
    """The Adam variant Huginn-0125 was trained with (``ELLISAdam`` in the reference code).

    Per parameter tensor, at step ``t`` (1-based), with gradient ``g``:

    .. code-block:: text

        m, v = (g, g*g) at t = 1 if running_init else (0, 0)       # state before the first update
        m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
        s = lr
        if update_clipping:  v = max(v, eps^2)  (stored);  s = s / max(1, sqrt(mean(g*g / v)))
        weight decay:        p *= 1 - (lr/initial_lr)*wd   if fully_decoupled_wd   else   1 - lr*wd
        bias_correction "outside" (the reference):  s = s/(1-b1^t);  u = A(m, sqrt(v)/sqrt(1-b2^t))
                        "inside"  (Everett et al.): u = A(m/(1-b1^t), sqrt(v/(1-b2^t)))
                        "none":                     u = A(m, sqrt(v))
        A(x, y) = a*atan2(x, b*y)   if atan2   else   x/(y + eps)
        p -= s*u

    With every switch on (the defaults) this is the official optimizer exactly, including its
    in-place floor ``v >= eps^2`` when update clipping is on. ``eps`` is then used only inside the
    clipping RMS. With ``atan2=False, update_clipping=False, running_init=False,
    fully_decoupled_wd=False`` it is ``torch.optim.AdamW``.

    Args:
        params: parameters or param-group dicts (groups may override any keyword below).
        lr: learning rate. ``initial_lr`` (default: the group's lr at construction) is the peak lr that
            fully decoupled weight decay divides by, so decay per step is ``wd * lr / initial_lr``:
            ``wd`` itself, scaled only by the schedule's shape.
        betas: (b1, b2), each in [0, 1).
        eps: epsilon for the clipping RMS floor and, without atan2, the Adam denominator.
        weight_decay: decoupled weight decay (>= 0).
        atan2: use ``a*atan2(m, b*sqrt(v))`` instead of ``m / (sqrt(v) + eps)`` (scale invariant,
            bounded by ``a*pi/2`` per coordinate).
        atan2_a, atan2_b: the ``a`` and ``b`` of the atan2 update (the reference uses 1, 1;
            adam-atan2-pytorch defaults to 1.27, 1).
        update_clipping: divide the step by ``max(1, RMS(g / sqrt(v)))`` per tensor (StableAdamW).
        running_init: initialise ``m = g`` and ``v = g*g`` on the first step instead of zeros.
        bias_correction: where Adam's bias correction goes (see the formula): ``"outside"``,
            ``"inside"`` or ``"none"``. Without ``atan2``, "outside" and "inside" are the same (Adam);
            "none" drops the correction with or without ``atan2``.
        fully_decoupled_wd: ``True`` for ``p *= 1 - (lr/initial_lr)*wd`` (the reference), ``False`` for
            AdamW's ``p *= 1 - lr*wd``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 4e-5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        atan2: bool = True,
        atan2_a: float = 1.0,
        atan2_b: float = 1.0,
        update_clipping: bool = True,
        running_init: bool = True,
        bias_correction: str = "outside",
        fully_decoupled_wd: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, tuple | list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            atan2=atan2,
            atan2_a=atan2_a,
            atan2_b=atan2_b,
            update_clipping=update_clipping,
            running_init=running_init,
            bias_correction=bias_correction,
            fully_decoupled_wd=fully_decoupled_wd,
        )
        _validate_adam_hparams(defaults, where="HuginnAdam")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (also used by ``__init__``), plus ``initial_lr`` and validation, so a
        group added after construction is stepped like the others."""
        index = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            group.setdefault("initial_lr", group["lr"])
            _validate_adam_hparams(group, where=f"HuginnAdam param group {index}")
            group["betas"] = tuple(group["betas"])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        grad = param.grad
        assert grad is not None
        if grad.is_sparse:
            raise ValueError("HuginnAdam does not support sparse gradients")
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        state = self.state[param]
        if not state:
            # `step` as a float tensor, as torch's Adam keeps it (load_state_dict leaves it uncast); float32 whatever
            # torch's default dtype (under a bf16 default the count stopped at 256, and the bias correction with it).
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if group["running_init"]:
                state["exp_avg"] = grad.detach().clone(memory_format=torch.preserve_format)
                state["exp_avg_sq"] = (grad * grad).clone(memory_format=torch.preserve_format)
            else:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        t = float(state["step"])

        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        step_size: float | torch.Tensor = lr
        if group["update_clipping"]:
            # The reference floors v in place, so the floor persists into later steps and the denominator.
            v.clamp_(min=eps * eps)
            # At least float32: in float16 eps^2 rounds to 0, and one zero gradient made the RMS 0/0 = NaN.
            wide = torch.promote_types(grad.dtype, torch.float32)
            rms = grad.to(wide).square().div_(v.to(wide).clamp(min=eps * eps)).mean().sqrt()
            step_size = lr / rms.clamp(min=1.0)

        wd = group["weight_decay"]
        if wd != 0:
            decay = (lr / group["initial_lr"]) * wd if group["fully_decoupled_wd"] else lr * wd
            param.mul_(1 - decay)

        bias1 = 1 - beta1**t
        bias2 = 1 - beta2**t
        where = group["bias_correction"]
        if where == "outside":
            step_size = step_size / bias1
            num, den = m, v.sqrt().div_(math.sqrt(bias2))
        elif where == "inside":
            num, den = m / bias1, (v / bias2).sqrt_()
        else:
            num, den = m, v.sqrt()

        if group["atan2"]:
            update = torch.atan2(num, den.mul_(group["atan2_b"])).mul_(group["atan2_a"])
        else:
            update = num / den.add_(eps)
        param.sub_(update.mul_(step_size))


ELLISAdam = HuginnAdam
"""The reference code's name for :class:`HuginnAdam`."""


def _validate_adam_hparams(h: dict[str, Any], where: str) -> None:
    _check_real(h["lr"], f"{where}: lr", low=0.0)
    betas = h["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (b1, b2), got {betas!r}")
    for i, beta in enumerate(betas):
        _check_real(beta, f"{where}: betas[{i}]", low=0.0, high=1.0, high_open=True)
    _check_real(h["eps"], f"{where}: eps", low=0.0, low_open=True)
    _check_real(h["weight_decay"], f"{where}: weight_decay", low=0.0)
    _check_real(h["atan2_a"], f"{where}: atan2_a", low=0.0, low_open=True)
    _check_real(h["atan2_b"], f"{where}: atan2_b", low=0.0, low_open=True)
    if h["bias_correction"] not in BIAS_CORRECTIONS:
        raise ValueError(f"{where}: bias_correction must be one of {BIAS_CORRECTIONS}, got {h['bias_correction']!r}")
    for switch in ("atan2", "update_clipping", "running_init", "fully_decoupled_wd"):
        if not isinstance(h[switch], bool):
            raise ValueError(f"{where}: {switch} must be True or False, got {h[switch]!r}")
    if "initial_lr" in h and h["weight_decay"] > 0 and h["fully_decoupled_wd"]:
        _check_real(
            h["initial_lr"],
            f"{where}: initial_lr (needed by fully decoupled weight decay)",
            low=0.0,
            low_open=True,
        )


def _check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite real number in the given range."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "" if high is None else f"{high:g}" + (")" if high_open else "]")
        rng = f"{lo or '(-inf'}, {hi or 'inf)'}"
        raise ValueError(f"{name} must be a finite number in {rng}, got {value!r}")


# ----------------------------------------------------------------------------------------------------------
# Parameter groups


def parameter_kind(name: str, param: torch.Tensor) -> str:
    """How Huginn treats a parameter: ``"no_decay"``, ``"embedding"`` or ``"matrix"``.

    * ``no_decay``: names containing "norm" or "bias" (RMSNorm gains, ``attn.qk_bias``) and any tensor with
      fewer than 2 dims. No weight decay.
    * ``embedding``: names containing "wte", "embed" or "lm_head" (tied in Huginn). Weight decay on, as in
      the reference; never Muon (an embedding is a lookup table, not a linear map).
    * ``matrix``: every other tensor (block weights, the adapter). Weight decay on; Muon if 2-D.
    """
    if param.ndim < 2 or any(key in name for key in NO_DECAY_KEYS):
        return "no_decay"
    if any(key in name for key in EMBEDDING_KEYS):
        return "embedding"
    return "matrix"


def split_parameters(
    named_params: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Group trainable parameters by :func:`parameter_kind`, each tensor once (tied weights deduped by id)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {"matrix": [], "embedding": [], "no_decay": []}
    seen: set[int] = set()
    for name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        groups[parameter_kind(name, param)].append((name, param))
    return groups


class OptimizerSet:
    """Several optimizers stepped together (e.g. Muon for matrices + AdamW for the rest).

    ``param_groups`` is the concatenation of every optimizer's groups (what the LR schedule sets); each
    group carries ``name`` and ``lr_scale`` (its lr relative to the recipe's base lr). ``state_dict``
    holds only tensors and plain Python data, so it round-trips through ``torch.load(weights_only=True)``.
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("OptimizerSet needs at least one optimizer, got none")
        self.optimizers: list[Optimizer] = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kinds": [type(opt).__name__ for opt in self.optimizers],
            "optimizers": [opt.state_dict() for opt in self.optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kinds = [type(opt).__name__ for opt in self.optimizers]
        if state.get("kinds") != kinds:
            raise ValueError(
                f"optimizer state is for {state.get('kinds')!r} but this run uses {kinds!r}; "
                "resume with the same optimizer recipe"
            )
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)

    def __iter__(self) -> Iterator[Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def __repr__(self) -> str:
        parts = [f"{type(o).__name__}({', '.join(g.get('name', '?') for g in o.param_groups)})" for o in self]
        return f"OptimizerSet[{'; '.join(parts)}]"


def mup_lr_multiplier(name: str, param: torch.Tensor, width_multiplier: float) -> float:
    """muP's Adam learning-rate multiplier of one parameter (Tensor Programs V, Table 3), m = width / base width.

    * hidden matrices (every block's projections, prelude, recurrent core and coda alike, and the
      adapter): 1/m (lr proportional to 1/fan_in); the core's weights are hidden weights however
      many times the recurrence applies them;
    * the token embedding: 1/sqrt(m): the model multiplies it by sqrt(h), so an update of size lr
      moves the embedding output by sqrt(h) lr; 1/sqrt(m) keeps that width-independent;
    * the (untied) output head: 1/m, with its init std divided by sqrt(m) (the model does this);
    * norm gains and biases: 1;
    * input weights whose fan-in does not grow with width (a value embedding, a lookup from the vocabulary,
      and its gate, read from 32 channels): 1, with an init that does not shrink with width either.
    """
    if parameter_kind(name, param) == "no_decay" or any(f"{module}." in name for module in FIXED_FAN_IN_MODULES):
        return 1.0
    if "wte" in name or "embed" in name:
        return width_multiplier**-0.5
    return 1.0 / width_multiplier


def mup_groups(groups: list[dict], named: dict[int, str], width_multiplier: float) -> list[dict]:
    """Each group split by muP multiplier: same settings, `lr_scale` times the multiplier, name suffixed."""
    out = []
    for group in groups:
        by_scale: dict[float, list] = {}
        for item in group["params"]:
            param = item[1]
            by_scale.setdefault(mup_lr_multiplier(named[id(param)], param, width_multiplier), []).append(item)
        for scale, items in by_scale.items():
            lr_scale = group["lr_scale"] * scale
            out.append({**group, "name": f"{group['name']}@mup{scale:.4g}", "params": items,
                        "lr": group["lr"] * scale, "lr_scale": lr_scale})
    return out


def fused_row_blocks(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """The separate matrices inside each fused projection, by rows: attention's `Wqkv` [q | k | v] and the
    gated MLP's `fc` [gate | up] (what Muon's `row_blocks` orthogonalises one by one). Other mixers'
    projections are separate matrices already, or fused in ways this does not split."""
    from recurrent_depth.model.layers import GatedMLP
    from recurrent_depth.model.mixers.attention import Attention

    blocks: dict[int, tuple[int, ...]] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            blocks[id(module.Wqkv.weight)] = (q, kv, kv)
        elif isinstance(module, GatedMLP):
            half = module.fc.weight.shape[0] // 2
            blocks[id(module.fc.weight)] = (half, half)
    return blocks


# Devices with torch's fused AdamW kernel: one pass over each tensor for the whole update (on a CPU with
# AVX-512, the h1024 benchmark's optimizer step took 0.04 s fused against 0.11 s for the per-op loop).
FUSED_ADAMW_DEVICES: tuple[str, ...] = ("cpu", "cuda")


def adamw(groups: list[dict], recipe: OptimConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``groups`` with the recipe's lr, betas and eps, fused where torch has
    the kernel (every parameter a plain floating-point tensor on CPU or CUDA): the same update in one
    pass per tensor instead of one per op. Sharded (DTensor) or other parameters take the default."""
    params = [p for g in groups for p in g["params"]]
    params = [p[1] if isinstance(p, tuple) else p for p in params]
    fused = all(
        type(p) in (torch.Tensor, nn.Parameter) and p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES
        for p in params
    )
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas, eps=recipe.eps, fused=fused or None)


def build_optimizers(model: nn.Module, recipe: OptimConfig) -> OptimizerSet:
    """Build the recipe's optimizer(s) over ``model``'s trainable parameters.

    Groups (each dict also carries ``name``, ``lr_scale`` and torch's ``param_names``):

    * ``"adamw"`` / ``"ellis-adam"``: one ``torch.optim.AdamW`` / :class:`HuginnAdam` with groups
      ``matrices`` and ``embeddings`` (``recipe.weight_decay``) and ``no_decay`` (norms, biases; wd 0).
    * ``"muon"``: ``torch.optim.Muon`` (:class:`~recurrent_depth.train.muon.Muon`, Newton-Schulz in
      ``recipe.muon_ns_dtype``) over the ``matrices`` that are linear-layer weights, the diagonal injection's ``B``
      included (lr ``recipe.muon_lr``,
      so ``lr_scale = muon_lr / lr``) plus AdamW over ``embeddings`` and ``no_decay`` (and any other
      matrix: convolution filters, per-level mixing weights, tensors that are not 2-D).

    Tied weights (Huginn's ``lm_head.weight`` is ``transformer.wte.weight``) are optimized once.
    With muP (``model.config.mup_base_width``) every AdamW / HuginnAdam group is split by
    :func:`mup_lr_multiplier`; Muon's matrices keep Muon's own shape scaling (its orthogonalised
    update already fixes each step's spectral norm, whatever the width).
    """
    parts = split_parameters(model.named_parameters(remove_duplicate=False))
    if not any(parts.values()):
        raise ValueError("build_optimizers: the model has no trainable parameters")

    def group(name: str, items: list[tuple[str, torch.Tensor]], wd: float, lr_scale: float = 1.0) -> dict:
        return {
            "name": name,
            "params": list(items),  # (name, tensor) pairs: torch records them as group["param_names"]
            "weight_decay": wd,
            "lr": recipe.lr * lr_scale,
            "lr_scale": lr_scale,
        }

    config = getattr(model, "config", None)
    width_multiplier = config.width_multiplier if getattr(config, "mup_base_width", None) is not None else None
    named = {id(p): n for n, p in model.named_parameters()}

    def with_mup(groups: list[dict]) -> list[dict]:
        return groups if width_multiplier is None else mup_groups(groups, named, width_multiplier)

    wd = recipe.weight_decay
    if recipe.name == "muon":
        # Muon orthogonalises linear maps; other 2-D weights (a depthwise convolution's [channels, taps]
        # filters, per-level mixing weights) are not maps between feature spaces and stay with AdamW.
        from recurrent_depth.model.layers import DiagonalInjection

        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        # Parcae's injection (`injection="diagonal"`) holds its adapter matrix B [h, h] (e -> state) bare: a linear map
        linear_weights |= {id(m.B) for m in model.modules() if isinstance(m, DiagonalInjection)}
        muon_items = [(n, p) for n, p in parts["matrix"] if p.ndim == 2 and id(p) in linear_weights]
        other_matrices = [(n, p) for n, p in parts["matrix"] if not (p.ndim == 2 and id(p) in linear_weights)]
        adam_groups = [
            group("embeddings", parts["embedding"] + other_matrices, wd),
            group("no_decay", parts["no_decay"], 0.0),
        ]
        optimizers: list[Optimizer] = []
        if muon_items:
            muon_group = group("matrices", muon_items, recipe.muon_weight_decay, recipe.muon_lr / recipe.lr)
            optimizers.append(
                Muon(
                    [muon_group],
                    ns_dtype=recipe.muon_ns_dtype,
                    row_blocks=fused_row_blocks(model) if recipe.muon_split_fused else None,
                    lr=recipe.muon_lr,
                    weight_decay=recipe.muon_weight_decay,
                    momentum=recipe.muon_momentum,
                    nesterov=recipe.muon_nesterov,
                    ns_steps=recipe.muon_ns_steps,
                    adjust_lr_fn=recipe.muon_adjust_lr,
                )
            )
        adam_groups = with_mup([g for g in adam_groups if g["params"]])
        if adam_groups:
            optimizers.append(adamw(adam_groups, recipe))
        return OptimizerSet(optimizers)

    groups = [
        group("matrices", parts["matrix"], wd),
        group("embeddings", parts["embedding"], wd),
        group("no_decay", parts["no_decay"], 0.0),
    ]
    groups = with_mup([g for g in groups if g["params"]])
    if recipe.name == "adamw":
        return OptimizerSet([adamw(groups, recipe)])
    return OptimizerSet(
        [
            HuginnAdam(
                groups,
                lr=recipe.lr,
                betas=recipe.betas,
                eps=recipe.eps,
                atan2=recipe.atan2,
                update_clipping=recipe.update_clipping,
                running_init=recipe.running_init,
                bias_correction=recipe.bias_correction,
                fully_decoupled_wd=recipe.fully_decoupled_wd,
            )
        ]
    )


# ----------------------------------------------------------------------------------------------------------
# Gradient clipping


def clip_and_check_grads(params: Iterable[torch.Tensor], max_norm: float | None) -> tuple[float, bool]:
    """Clip the global gradient norm to ``max_norm`` unless it is non-finite; return ``(norm, finite)``.

    ``norm`` is the total 2-norm of all gradients *before* clipping (``inf``/``nan`` included as is).
    When ``finite`` is False the gradients are left untouched and the caller must skip the optimizer
    step (and count it): stepping on a non-finite gradient would poison the weights and the moments.
    ``max_norm=None`` only measures. Parameters without a gradient are ignored. Call it after the
    data-parallel reduction so every rank sees the same norm.
    """
    if max_norm is not None:
        _check_real(max_norm, "max_norm", low=0.0, low_open=True)
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0, True
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    if hasattr(norm, "full_tensor"):  # DTensor grads (FSDP2): reduce the shard norms into the global one
        norm = norm.full_tensor()
    value = float(norm)
    finite = math.isfinite(value)
    if finite and max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm)
    return value, finite


# ----------------------------------------------------------------------------------------------------------
# Recipe


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer, LR schedule and gradient clipping for one training run.

    Schedule (see :func:`recurrent_depth.train.schedule.lr_at`): linear warmup over ``warmup_steps``
    optimizer steps, constant ``lr``, then a linear cool-down to ``min_lr`` over the last
    ``cooldown_steps`` (or ``cooldown_fraction`` of the run; at most one of the two).
    """

    name: str = "ellis-adam"
    lr: float = 4e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    eps: float = 1e-6
    # HuginnAdam switches ("ellis-adam" only)
    atan2: bool = True
    update_clipping: bool = True
    running_init: bool = True
    bias_correction: str = "outside"
    fully_decoupled_wd: bool = True
    # torch.optim.Muon settings ("muon" only; AdamW with lr/betas/eps/weight_decay handles the rest)
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_weight_decay: float = 0.0
    muon_adjust_lr: str | None = None
    muon_ns_dtype: str = "auto"  # Newton-Schulz dtype: "auto" (float32 on CPUs emulating bf16), "bfloat16", "float32"
    # Orthogonalise fused projections block by block (q, k, v of Wqkv; gate, up of the MLP), as Kimi K2's Muon
    # treats them (separate matrices there); false: each fused weight is one matrix (torch.optim.Muon's view).
    muon_split_fused: bool = False
    # step control
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    cooldown_steps: int | None = None
    cooldown_fraction: float | None = None
    min_lr: float = 0.0
    skip_first_step: bool = False  # the official trainer applies no update on its first optimizer step
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.betas, tuple | list) or len(self.betas) != 2:
            raise ValueError(f"optim.betas must be a pair (b1, b2), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))  # YAML/JSON give lists
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name must be one of {OPTIMIZERS}, got {self.name!r}")
        _check_real(self.lr, "optim.lr", low=0.0, low_open=True)
        for i, beta in enumerate(self.betas):
            _check_real(beta, f"optim.betas[{i}]", low=0.0, high=1.0, high_open=True)
        _check_real(self.weight_decay, "optim.weight_decay", low=0.0)
        _check_real(self.eps, "optim.eps", low=0.0, low_open=True)
        if self.bias_correction not in BIAS_CORRECTIONS:
            raise ValueError(f"optim.bias_correction must be one of {BIAS_CORRECTIONS}, got {self.bias_correction!r}")
        _check_real(self.muon_lr, "optim.muon_lr", low=0.0, low_open=True)
        _check_real(self.muon_momentum, "optim.muon_momentum", low=0.0, high=1.0, high_open=True)
        if not is_int(self.muon_ns_steps) or not 1 <= self.muon_ns_steps <= MAX_NS_STEPS:
            raise ValueError(f"optim.muon_ns_steps must be an integer in [1, {MAX_NS_STEPS}], "
                             f"got {self.muon_ns_steps!r}")
        _check_real(self.muon_weight_decay, "optim.muon_weight_decay", low=0.0)
        if self.muon_adjust_lr is not None and self.muon_adjust_lr not in MUON_ADJUST_LR:
            raise ValueError(
                f"optim.muon_adjust_lr must be None or one of {MUON_ADJUST_LR}, got {self.muon_adjust_lr!r}"
            )
        for switch in ("atan2", "update_clipping", "running_init", "fully_decoupled_wd", "muon_nesterov",
                       "muon_split_fused"):  # (a string "false" is truthy: it would turn the switch on)
            if not isinstance(getattr(self, switch), bool):
                raise ValueError(f"optim.{switch} must be true or false, got {getattr(self, switch)!r}")
        if self.muon_ns_dtype not in NS_DTYPES:
            raise ValueError(f"optim.muon_ns_dtype must be one of {NS_DTYPES}, got {self.muon_ns_dtype!r}")
        if self.grad_clip is not None:
            _check_real(self.grad_clip, "optim.grad_clip (None disables clipping)", low=0.0, low_open=True)
        if not is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.cooldown_steps is not None and self.cooldown_fraction is not None:
            raise ValueError(
                "optim.cooldown_steps and optim.cooldown_fraction are exclusive; got "
                f"{self.cooldown_steps!r} and {self.cooldown_fraction!r}"
            )
        if self.cooldown_steps is not None and (not is_int(self.cooldown_steps) or self.cooldown_steps < 0):
            raise ValueError(f"optim.cooldown_steps must be None or an integer >= 0, got {self.cooldown_steps!r}")
        if self.cooldown_fraction is not None:
            _check_real(self.cooldown_fraction, "optim.cooldown_fraction", low=0.0, high=1.0)
        _check_real(self.min_lr, "optim.min_lr", low=0.0, high=self.lr)
        if not isinstance(self.skip_first_step, bool):
            raise ValueError(f"optim.skip_first_step must be true or false, got {self.skip_first_step!r}")
        if not isinstance(self.description, str):  # (a YAML date was accepted, then failed the checkpoint's JSON)
            raise ValueError(f"optim.description must be a string, got {self.description!r}")

    # -- presets and plain-data round trip --

    @classmethod
    def from_preset(cls, preset: str, /, **overrides: Any) -> OptimConfig:
        """A named recipe (one of `OPTIM_PRESETS`: ``"huginn-0125"``, ``"demo"``, ``"demo-muon"``,
        ``"k2-muon"``, ``"finetune"``, ``"finetune-lora"``), optionally with fields overridden.

        The preset is positional-only, so the optimizer's own `name` field can be overridden too:
        ``OptimConfig.from_preset("demo", name="adamw")``. The two cool-down lengths are exclusive, so
        overriding one (``cooldown_steps`` or ``cooldown_fraction``) replaces the preset's other.
        """
        if not isinstance(preset, str) or preset not in OPTIM_PRESETS:  # (a list or mapping is unhashable)
            raise ValueError(f"optimizer preset must be one of {tuple(OPTIM_PRESETS)}, got {preset!r}")
        return OPTIM_PRESETS[preset].updated(**overrides)

    def updated(self, **overrides: Any) -> OptimConfig:
        """This recipe with fields overridden; one cool-down length given replaces the recipe's other."""
        self._check_field_names(overrides)
        for given, other in (("cooldown_steps", "cooldown_fraction"), ("cooldown_fraction", "cooldown_steps")):
            if overrides.get(given) is not None and other not in overrides:
                overrides[other] = None
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimConfig:
        cls._check_field_names(data)
        return cls(**data)

    @classmethod
    def _check_field_names(cls, data: dict[str, Any]) -> None:
        check_field_names(data, cls, "optim field(s)")

    # -- schedule --

    def cooldown_for(self, total_steps: int | None) -> int:
        """Cool-down length in optimizer steps for a run of ``total_steps`` (0 if none or unknown length)."""
        if self.cooldown_steps is not None:
            if total_steps is None and self.cooldown_steps > 0:
                raise ValueError("optim.cooldown_steps needs a known total number of steps (got total_steps=None)")
            return self.cooldown_steps
        if self.cooldown_fraction is not None and total_steps is not None:
            return int(round(self.cooldown_fraction * total_steps))
        return 0

    def lr_at(self, step: int, total_steps: int | None) -> float:
        """The base learning rate at optimizer step ``step`` (0-based) of a ``total_steps`` run."""
        return lr_at(
            step,
            base_lr=self.lr,
            warmup=self.warmup_steps,
            total=total_steps,
            cooldown=self.cooldown_for(total_steps),
            min_lr=self.min_lr,
        )


# benchmarks/optim_sweep.py (150 steps, the small layout at h 128, byte-level stdlib, batch 8 x 64):
# val loss at depth 8 -- adamw 1e-3/3e-3/5e-3/1e-2: 2.017/1.726/1.881/4.155; ellis-adam
# 1e-3/2e-3/3e-3/5e-3/1e-2: 2.105/1.845/1.790/1.907/4.107; muon (adamw 3e-3) 0.01/0.02/0.05:
# 1.611/1.629/3.607. The demo keeps the paper's optimizer (and its per-step weight decay) at the lr that
# won for it; AdamW at the same lr was 0.06 lower on this toy. Muon wins per step (the sweep ran with
# torch.optim.Muon's bf16 Newton-Schulz, 7.9 s per `small` step on an AVX2 EPYC that emulates bf16;
# muon_ns_dtype "auto" now runs it in float32 there: 0.20 s, vs 29 ms for ellis-adam).
# The Muon demos below are this recipe with Muon on the matrices (same lr, schedule and clipping).
_DEMO = OptimConfig(
    name="ellis-adam",
    lr=3e-3,
    betas=(0.9, 0.95),
    weight_decay=4e-5,
    eps=1e-6,
    grad_clip=1.0,
    warmup_steps=50,
    cooldown_fraction=0.2,
    min_lr=0.0,
    description="short CPU runs: the paper's optimizer at the lr that won benchmarks/optim_sweep.py",
)

_FINETUNE = replace(
    _DEMO,
    lr=1e-5,
    weight_decay=0.0,
    warmup_steps=10,
    description="fine-tuning every weight of a pretrained model: the paper's optimizer at lr 1e-5",
)
OPTIM_PRESETS: dict[str, OptimConfig] = {
    # huginn-0125.md section 5: launch_configs/frontier_nebel_512_nodes.yaml (schedule in micro-batch steps,
    # which equal optimizer steps there: micro-batch 1 per rank, no accumulation). The paper's main run
    # used the same peak lr (4e-5) but a constant rate: the 4096-step cool-down is the launch config's.
    "huginn-0125": OptimConfig(
        name="ellis-adam",
        lr=4e-5,
        betas=(0.9, 0.95),
        weight_decay=4e-5,
        eps=1e-6,
        atan2=True,
        update_clipping=True,
        running_init=True,
        bias_correction="outside",
        fully_decoupled_wd=True,
        grad_clip=1.0,
        warmup_steps=4096,
        cooldown_steps=4096,
        min_lr=0.0,
        skip_first_step=True,  # huginn-0125.md section 5: "the first optimizer step is skipped too"
        description="the official launch config's ELLISAdam recipe (4096 GPUs, 16.8M tokens per step; "
                    "the paper's peak lr 4e-5, the config's cool-down: the paper ran at a constant rate)",
    ),
    "demo": _DEMO,
    "demo-muon": replace(
        _DEMO,
        name="muon",
        muon_lr=0.01,
        muon_momentum=0.95,
        weight_decay=0.0,
        description="Muon (matrices) + AdamW (rest), best per step in benchmarks/optim_sweep.py; needs fast bf16",
    ),
    # Kimi K2's Muon (Moonshot's "Muon is scalable" recipe): every matrix on its own (q, k, v and gate, up
    # split out of the fused weights), the update rescaled to AdamW's RMS (0.2 sqrt(max(rows, cols))) so the
    # AdamW learning rate serves both, and decoupled weight decay 0.1. The demo's lr and schedule.
    "k2-muon": replace(
        _DEMO,
        name="muon",
        muon_lr=3e-3,
        muon_momentum=0.95,
        muon_adjust_lr="match_rms_adamw",
        muon_weight_decay=0.1,
        muon_split_fused=True,
        weight_decay=0.0,
        description="Kimi K2's Muon: per-matrix (fused q|k|v and gate|up split), AdamW-RMS-matched lr, "
                    "decoupled weight decay 0.1",
    ),
    # The defaults of a run from a model directory (--init-from: continued pretraining, SFT) that names no preset
    # and no lr (train/config.py `default_optim_preset`); the demo's 3e-3 is a from-scratch rate, 75x the 4e-5
    # Huginn-0125 was pretrained at. The paper's optimizer (the demo's, so checkpoints hold the same state), at
    # a rate in the usual fine-tuning range: trl's SFT default is 2e-5; we take 1e-5, a quarter of Huginn's
    # pretraining peak and the `rdepth rl` default, since a step of ellis-adam (atan2, update clipping) is as
    # large as Adam's. A LoRA adapter starts at zero and moves only its low-rank update: the usual 1e-4
    # (QLoRA's 1e-4..2e-4). No weight decay (trl's and the official SFT example's: decay pulls the pretrained
    # weights toward 0, not toward where they started), 10 warmup steps, the demo's 20% linear cool-down.
    # Measured: `tiny` pretrained 400 steps at the demo's 3e-3 (LM loss 0.636 on held-out code), then 60 SFT steps
    # on arithmetic answers (loss 6.57 before), answer / LM loss after -- demo 1.17 / 2.08 (the model wrecked);
    # every weight at 1e-5, 3e-5, 1e-4, 3e-4, 1e-3: 5.88/0.636, 4.53/0.637, 2.42/0.648, 1.41/0.801, 1.20/1.32;
    # LoRA (r 8) at 1e-4, 3e-4, 1e-3: 5.63/0.637, 3.97/0.641, 1.62/0.862. The LM loss starts to suffer near a
    # tenth of the pretraining rate, so these defaults are safe, not fast, for a model as small as this one
    # (whose own rate was 75x Huginn's): name --lr to learn faster.
    "finetune": _FINETUNE,
    "finetune-lora": replace(
        _FINETUNE,
        lr=1e-4,
        description="training a LoRA adapter on a pretrained model: the paper's optimizer at lr 1e-4",
    ),
}
