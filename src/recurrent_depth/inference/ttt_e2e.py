"""TTT-E2E: a few gradient steps of next-token loss on the context (the prompt), updating a chosen
subset of the model's weights, then generation with the updated weights (Tandon et al.,
"End-to-End Test-Time Training for Long Context", arXiv:2512.23675, 2025).

THE INNER LOOP. The prompt's next-token loss L(W) = -(1/(T-1)) sum_t log p(x_{t+1} | x_<=t; W)
is minimized over the chosen weights W (`ttt_params`) by `ttt_steps` optimizer steps (`ttt_lr`,
`ttt_optimizer` sgd | adam); every other weight stays frozen. Each step is one forward at
recurrence depth `ttt_depth` (default num_steps) with truncated backprop as in training: the
first `ttt_depth - ttt_backprop` core steps without gradients, the last `ttt_backprop` under
autograd (default: the model's mean_backprop_depth, capped at the depth), and its s_0 drawn
from the request's seed. The paper's procedure differs in three ways, stated in
docs/test-time-training.md: it meta-learns the initial weights for the inner loop at training
time (a pretrained model here has no such training), it updates the MLPs of the last quarter of
the blocks (here `core-mlp`, the recurrent core's MLPs, is the nearest named subset) and it steps
once per mini-batch of the context as it reads it; here each step sees the whole prompt.

BASE WEIGHTS ARE NEVER WRITTEN. The updated weights live in a *shadow* of the model: a copy of
its module tree whose chosen parameters are fresh tensors and whose every other parameter and
buffer is the base model's own tensor (shared, not copied). The inner loop trains the shadow,
generation runs on it, and the base model is never written, so it is bit-identical after a
request whether the request succeeds or fails, and the server's continuous batch (which runs
the base model) and concurrent requests never see another request's update. The memory cost
is the copied subset (plus two Adam moments with `ttt_optimizer="adam"`, and a float32 master of
bf16 / fp16 weights, which the optimizer steps so that small steps are not rounded away): `copy_bytes`.

COST. Each step is counted by `train.flops.training_step_flops` on the 1 x T prompt at depth
(n, k) (the library's counter: backward = 2x the forward of what gradients flow through), the
same rule GradMem's write is counted by, so test-time methods compare under one accounting.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.inference.engine import Stopped
from recurrent_depth.inference.lora_layers import idle_adapter_parameters
from recurrent_depth.inference.options import TTT_OPTIMIZERS, OptionError, ResolvedOptions
from recurrent_depth.train.flops import training_step_flops
from recurrent_depth.weight_quant import QuantizedLinear, held_weights

# Weights the optimizer steps through a float32 master copy: a small step (SGD at lr 1e-3) is mostly
# below a bf16 weight's rounding step and would be lost if applied to the weight itself.
LOW_PRECISION = (torch.bfloat16, torch.float16)

# Why a generate call with max_new_tokens=0 skips TTT-E2E's inner loop and GradMem's write steps
# (their stats' ttt_skipped / gradmem_skipped): no token is generated to read the result.
NOTHING_GENERATED = "max_new_tokens=0: no token is generated to read the result"

# Named weight subsets (`ttt_params`); any other value is a comma-separated list of globs over
# `model.named_parameters()` names.
PARAMETER_SETS = {
    "core-mlp": ("transformer.core_block.*.mlp.*",),
    "core": ("transformer.core_block.*", "transformer.adapter.*"),
    "prelude": ("transformer.prelude.*",),
    "coda": ("transformer.coda.*",),
    "all": ("*",),
}


def select_parameters(model: nn.Module, spec: str) -> list[str]:
    """The parameter names `spec` chooses: a `PARAMETER_SETS` name or comma-separated globs
    (e.g. "transformer.core_block.1.*,transformer.ln_f.weight"; a tied weight answers to each of
    its names, e.g. "lm_head.weight", and is returned under its first). OptionError when it is
    empty, a glob matches nothing, a named set finds none of its parts in this model, or it names
    quantized weights."""
    if not isinstance(spec, str) or not spec.strip():
        raise OptionError("ttt_params", f"ttt_params={spec!r} is invalid: expected one of "
                          f"{sorted(PARAMETER_SETS)} or comma-separated globs over parameter names")
    named_set = spec.strip() in PARAMETER_SETS
    patterns = PARAMETER_SETS.get(spec.strip(), tuple(p.strip() for p in spec.split(",")))
    idle = idle_adapter_parameters(model)  # (LoRA adapters that are off change nothing: not copied, not trained)
    # Every name a parameter answers to (a tied head's too) -> the one name it is counted under.
    canonical = {id(p): name for name, p in model.named_parameters()}
    aliases = {name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] not in idle}
    hint = f"named sets: {sorted(PARAMETER_SETS)}; names look like {next(reversed(aliases))!r}"
    _refuse_quantized(model, spec, patterns)
    chosen: list[str] = []
    for pattern in patterns:
        matched = [aliases[n] for n in aliases if fnmatch.fnmatchcase(n, pattern)]
        # a named set's parts may be missing (Ouro has no adapter, prelude or coda); a glob must match
        if not pattern or (not matched and not named_set):
            raise OptionError("ttt_params", f"ttt_params={spec!r} is invalid: {pattern!r} matches no parameter "
                              f"of this model ({hint})")
        chosen += [n for n in matched if n not in chosen]
    if not chosen:
        raise OptionError("ttt_params", f"ttt_params={spec!r} is invalid: this model has no such weights ({hint})")
    return chosen


def _refuse_quantized(model: nn.Module, spec: str, patterns: tuple[str, ...]) -> None:
    """OptionError when `patterns` name a quantized layer's weight: it is held as integers (a buffer,
    not a parameter), so it cannot take a step, and training the rest instead would ignore the request."""
    quantized = [f"{name}.weight" for name, module in model.named_modules() if isinstance(module, QuantizedLinear)]
    hit = next((n for n in quantized for p in patterns if fnmatch.fnmatchcase(n, p)), None)
    if hit is not None:
        raise OptionError("ttt_params", f"ttt_params={spec!r} is invalid: it names weights held quantized "
                          f"({held_weights(model)}), e.g. {hit!r}, which take no gradient step; load the model "
                          "unquantized for TTT-E2E, or name unquantized weights only")


def refuse_inference_weights(model: nn.Module, what: str) -> None:
    """A one-line ValueError when `model`'s weights were made under `torch.inference_mode()`: autograd cannot
    save them for a backward pass (torch's own error is a multi-line RuntimeError deep in the first step)."""
    if any(p.is_inference() for p in model.parameters()):
        raise ValueError(f"{what} backpropagates through the model, but its weights were created under "
                         "torch.inference_mode(), which makes tensors no backward pass can use: load or build the "
                         "model outside inference_mode (torch.no_grad() is fine)")


def copy_bytes(model: nn.Module, names: list[str], optimizer: str = "sgd") -> int:
    """Bytes a request's copy of the chosen weights holds: the weights, their gradients, and
    Adam's two moments (`optimizer="adam"`); for bf16 / fp16 weights also their float32 masters and
    the masters' gradients (the moments are then float32). Tied weights are counted once."""
    if optimizer not in TTT_OPTIMIZERS:
        raise OptionError("ttt_optimizer", f"ttt_optimizer={optimizer!r} is invalid: expected one of "
                          f"{TTT_OPTIMIZERS}")
    params = dict(model.named_parameters(remove_duplicate=False))
    unique = {id(params[n]): params[n] for n in names}
    total = 0
    for p in unique.values():
        low = p.dtype in LOW_PRECISION
        stepped = 4 if low else p.element_size()  # what the optimizer steps: the weight or its float32 master
        per = stepped * (4 if optimizer == "adam" else 2)  # it and its gradient (and Adam's two moments)
        if low:
            per += 2 * p.element_size()  # the shadow's weight itself and autograd's gradient in its dtype
        total += p.numel() * per
    return total


def copy_parts(model: nn.Module, names: list[str], optimizer: str = "sgd") -> str:
    """What `copy_bytes` counts for these weights, in words (for a message about the copy's size)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    parts = "weights and gradients" + (", Adam moments" if optimizer == "adam" else "")
    if any(params[name].dtype in LOW_PRECISION for name in names):
        parts += ", float32 masters of its bf16/fp16 weights"
    return parts


def shadow_model(model: nn.Module, names: list[str]) -> tuple[nn.Module, list[nn.Parameter]]:
    """A copy of `model`'s module tree whose parameters `names` are fresh copies (requires_grad)
    and whose other parameters and buffers are `model`'s own tensors (frozen in the shadow only by
    not being handed to the optimizer; they never receive a step). Tied parameters stay tied.
    Returns the shadow and its trainable parameters."""
    wanted = set(names)
    fresh: dict[int, nn.Parameter] = {}  # id of a base tensor -> its copy (ties share one)
    copies: dict[int, nn.Module] = {}

    def clone(module: nn.Module, prefix: str) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        twin = copy.copy(module)  # a new object; its dicts are copied below, so nothing is shared by mistake
        copies[id(module)] = twin
        twin._parameters = dict(module._parameters)
        twin._buffers = dict(module._buffers)
        twin._modules = {}
        for key, p in module._parameters.items():
            if p is not None and prefix + key in wanted:
                if id(p) not in fresh:
                    fresh[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=True)
                twin._parameters[key] = fresh[id(p)]
        for key, child in module._modules.items():
            twin._modules[key] = None if child is None else clone(child, f"{prefix}{key}.")
        return twin

    with torch.inference_mode(False):
        shadow = clone(model, "")
    # a tie reached under a name outside `names` (tied head and embedding) must use the copy too
    for module in copies.values():
        for key, p in module._parameters.items():
            if p is not None and id(p) in fresh:
                module._parameters[key] = fresh[id(p)]
    return shadow, list(fresh.values())


@dataclass
class Adaptation:
    """What `adapt` returns: the shadow model holding the updated weights, and the figures.

    losses: the context's loss before each step (step k's forward), then after the last step
      when `final_loss` was asked for. flops: model FLOPs of the inner forward and backward
      passes (`train.flops`), None where the counter does not count the model's mixers.
    """

    model: nn.Module
    parameters: list[str]
    losses: list[float]
    flops: float | None
    steps: int
    depth: tuple[int, int]
    lr: float
    optimizer: str
    copy_bytes: int
    seconds: float
    skipped: str | None = None  # why the inner loop did not run (`skipped`): then no step, no copy

    def stats(self) -> dict[str, Any]:
        """JSON-friendly figures for a `GenerationOutput.stats` (the ttt_* keys)."""
        stats = {"ttt_steps": self.steps, "ttt_depth": list(self.depth), "ttt_lr": self.lr,
                 "ttt_optimizer": self.optimizer, "ttt_parameters": len(self.parameters),
                 "ttt_copy_mb": round(self.copy_bytes / 2**20, 3), "ttt_flops": self.flops,
                 "ttt_losses": [round(x, 5) for x in self.losses], "ttt_seconds": round(self.seconds, 4)}
        if self.skipped is not None:
            stats["ttt_skipped"] = self.skipped
        return stats


def inner_depth(model: nn.Module, options: ResolvedOptions) -> tuple[int, int]:
    """(n, k): the inner forward's core steps without and with gradients."""
    depth = options.ttt_depth if options.ttt_depth is not None else options.num_steps
    k = options.ttt_backprop if options.ttt_backprop is not None else model.config.mean_backprop_depth
    if k > depth:
        if options.ttt_backprop is not None:
            raise OptionError("ttt_backprop", f"ttt_backprop={k} is invalid: expected <= the inner depth "
                              f"(ttt_depth or num_steps) = {depth}")
        k = depth
    return depth - k, k


def inner_flops(model: nn.Module, seq_len: int, depth: tuple[int, int], steps: int) -> float | None:
    """FLOPs of `steps` inner forward + backward passes on one row of `seq_len` tokens."""
    try:
        return steps * training_step_flops(model.config, 1, seq_len, depth).total
    except ValueError:  # a mixer the counter does not count
        return None


def context_loss(model: nn.Module, ids: Tensor, depth: tuple[int, int], init_scale: float, seed: int | None,
                 ) -> Tensor:
    """Mean next-token loss of `ids` [1, T] at depth (n, k), s_0 from `seed` (None: torch's RNG)."""
    generator = None
    if seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(seed % (2**63))
    return model(ids, num_steps=depth, labels=ids, init_scale=init_scale, generator=generator).loss


def _checked(model: nn.Module, input_ids: Tensor, options: ResolvedOptions) -> tuple[list[str], tuple[int, int]]:
    """OptionError (or ValueError for the model) unless the inner loop can run on `input_ids`;
    returns the chosen parameter names and the inner depth (n, k)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise OptionError("ttt_params", f"TTT-E2E adapts one set of weights to one context: expected one prompt "
                          f"(batch 1), got a batch of {input_ids.shape[0]}")
    if input_ids.shape[1] < 2:
        raise OptionError("ttt_params", "TTT-E2E needs a prompt of at least 2 tokens (its loss predicts token "
                          "t+1 from tokens <= t)")
    refuse_inference_weights(model, "TTT-E2E (ttt_params)")
    return select_parameters(model, options.ttt_params), inner_depth(model, options)


def skipped(model: nn.Module, input_ids: Tensor, options: ResolvedOptions, reason: str) -> Adaptation:
    """`adapt`'s checks without its inner loop, for a call whose weights nothing reads (e.g.
    max_new_tokens=0): no copy, no step; the result's model is `model` and its stats say `reason`."""
    names, depth = _checked(model, input_ids, options)
    return Adaptation(model=model, parameters=names, losses=[], flops=0.0, steps=0, depth=depth, lr=options.ttt_lr,
                      optimizer=options.ttt_optimizer, copy_bytes=0, seconds=0.0, skipped=reason)


def adapt(model: nn.Module, input_ids: Tensor, options: ResolvedOptions, final_loss: bool = False,
          should_stop: Callable[[], bool] | None = None) -> Adaptation:
    """Run the inner loop on the prompt `input_ids` [1, T] (T >= 2) and return the shadow model
    that holds the updated weights; `model` itself is never written. should_stop: checked before
    each inner step (a request's deadline); when it returns True, `engine.Stopped` is raised."""
    started = time.perf_counter()
    names, depth = _checked(model, input_ids, options)
    nbytes = copy_bytes(model, names, options.ttt_optimizer)
    seed = options.seed
    if isinstance(seed, list | tuple) and len(seed) == 1:  # one seed per row, for the one row: the same seed
        seed = seed[0]
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    shadow, params = shadow_model(model, names)
    losses: list[float] = []
    # Nothing to restore on failure: only the shadow's own copies are stepped (and its modes set).
    with torch.inference_mode(False), torch.enable_grad():
        ids = input_ids.clone()  # an inference-mode tensor cannot be saved for backward
        shadow.eval()
        # what the optimizer steps: each weight, or a float32 master of a bf16 / fp16 one (LOW_PRECISION)
        stepped = [p.detach().float() if p.dtype in LOW_PRECISION else p for p in params]
        if options.ttt_optimizer == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(stepped, lr=options.ttt_lr)
        else:
            optimizer = torch.optim.SGD(stepped, lr=options.ttt_lr)
        for step in range(options.ttt_steps):
            if should_stop is not None and should_stop():
                raise Stopped("stopped between TTT-E2E inner steps")
            step_seed = None if seed is None else seed + step
            loss = context_loss(shadow, ids, depth, options.init_scale, step_seed)
            # the gradient of the chosen weights only (autograd.grad: the frozen weights, which
            # the base model shares, never get a .grad); a weight the loss does not reach gets none
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            if all(g is None for g in grads):  # e.g. the core's weights with no backpropagated step (depth 0)
                raise OptionError("ttt_params", f"ttt_params={options.ttt_params!r} get no gradient at the inner "
                                  f"depth {depth} (steps without, with gradients): no inner step would change "
                                  "them; raise ttt_depth / ttt_backprop (or num_steps), or choose other parts")
            for q, g in zip(stepped, grads):
                q.grad = None if g is None else g.to(q.dtype)
            optimizer.step()
            with torch.no_grad():
                for p, q in zip(params, stepped):
                    if q is not p:
                        p.copy_(q)
            losses.append(float(loss.detach()))
            # a step that diverged would generate from non-finite weights: garbage tokens, NaN stats
            if not math.isfinite(losses[-1]) or not all(bool(p.isfinite().all()) for p in params):
                raise OptionError("ttt_lr", f"ttt_lr={options.ttt_lr:g} made the inner loop diverge: at step "
                                  f"{step + 1} the context loss is {losses[-1]:g} or the updated weights are not "
                                  "finite; lower ttt_lr")
        for p in params + stepped:  # generation reads the weights only
            p.grad = None
            p.requires_grad_(False)
        if final_loss:
            with torch.no_grad():
                losses.append(float(context_loss(shadow, ids, depth, options.init_scale, seed)))
    return Adaptation(
        model=shadow, parameters=names, losses=losses,
        flops=inner_flops(model, input_ids.shape[1], depth, options.ttt_steps),
        steps=options.ttt_steps, depth=depth, lr=options.ttt_lr, optimizer=options.ttt_optimizer,
        copy_bytes=nbytes, seconds=time.perf_counter() - started,
    )
