"""GradMem: write a context into a few memory tokens by test-time gradient descent, then generate
from the memory instead of the context (Kuratov et al., "GradMem: Learning to Write Context into
Memory with Test-Time Gradient Descent", ICML 2026, arXiv:2603.13875).

WRITE. The memory M `[m, h]` is m vectors in the token-embedding space (what wte gives, before the
model's sqrt(h) scale), prepended to the context C = c_1..c_n. Its loss is the context's
next-token loss given the memory, c_1 read at the memory's last position:

    L_write(M) = -(1/n) sum_{t=1..n} log p(c_t | M, c_<t)

and N plain gradient steps M <- M - lr * dL_write/dM run on it with the model frozen: the gradient
is taken with respect to M only (`torch.autograd.grad`), so no weight gets a gradient or changes.
Each step is one forward and one backward pass over [M; C] at the write depth, its s_0 drawn anew
from the row's generator (as a training step draws it).

READ. The context is dropped: the prompt is [M; query], M at positions 0..m-1 as in the write
and the query after it (none: generation continues from the memory alone).

The paper meta-learns the model and the initial memory M_0 so that a few steps suffice; a
pretrained recurrent-depth model has no learned M_0, so M_0 is the embeddings of the context's
last m tokens ("tail": with 0 steps, generation reads the truncated context) or random vectors at
the embedding's scale ("random", from the seed). Rows are written independently: row b's loss is
its own mean, so a row in a batch gets the memory it gets alone.

Cost: each step counted by `train.flops.training_step_flops` on the B x (m + n_max) tokens that
run (the library's counter, backward = 2x forward, so that every test-time method is counted by
the same rule; a frozen model needs only the input gradients, about half of that backward).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.engine import Stopped
from recurrent_depth.inference.options import GRADMEM_INITS, OptionError, ResolvedOptions
from recurrent_depth.inference.sampling import RowGenerators
from recurrent_depth.inference.session import prepare_inputs
from recurrent_depth.inference.ttt_e2e import NOTHING_GENERATED, refuse_inference_weights
from recurrent_depth.train.flops import training_step_flops


@dataclass
class MemoryWrite:
    """What `write_memory` returns.

    memory: `[B, m, h]` float32, the written memory (token-embedding space).
    losses: losses[k][b] = L_write of row b at the memory step k started from (k = 0..steps-1);
      the loss of the final memory is not evaluated (that would be one more forward).
    flops: model FLOPs of the write's forward and backward passes (`train.flops`), None where the
      counter does not count the model's mixers (softmax attention only).
    """

    memory: Tensor
    losses: list[list[float]]
    flops: float | None
    steps: int
    depth: int
    lr: float
    context_tokens: list[int]
    seconds: float

    def stats(self) -> dict[str, Any]:
        """JSON-friendly figures for a `GenerationOutput.stats` (the gradmem_* keys)."""
        return {"gradmem_tokens": int(self.memory.shape[1]), "gradmem_steps": self.steps,
                "gradmem_depth": self.depth, "gradmem_lr": self.lr, "gradmem_context_tokens": self.context_tokens,
                "gradmem_flops": self.flops, "gradmem_losses": self.losses,
                "gradmem_seconds": round(self.seconds, 4)}


def check_model(model: Any) -> None:
    """ValueError unless memory tokens can stand in `model`'s input: a layer with value embeddings
    reads token ids, which memory positions do not have; or whose weights autograd cannot use."""
    refuse_inference_weights(model, "GradMem (gradmem_tokens)")
    if model.config.value_embeddings:
        layers = list(model.config.value_embeddings)
        raise ValueError(f"GradMem needs a model without value embeddings (layers {layers} read token ids, which "
                         "memory tokens do not have)")


def check_contexts(model: Any, lengths: list[int], tokens: int, init: str) -> None:
    """OptionError unless contexts of these lengths can be written into `tokens` memory tokens."""
    longest = max(lengths)
    if tokens + longest > model.config.max_seq_len:
        raise OptionError("gradmem_tokens", f"gradmem_tokens={tokens} + a context of {longest} tokens exceed the "
                          f"model's max_seq_len={model.config.max_seq_len}")
    short = [b for b, n in enumerate(lengths) if n < tokens]
    if init == "tail" and short:
        raise OptionError("gradmem_init", f"gradmem_init='tail' starts the memory from the context's last "
                          f"gradmem_tokens={tokens} tokens, but row {short[0]}'s context has {lengths[short[0]]}; "
                          "use fewer gradmem_tokens or gradmem_init='random'")


def check_prompts(model: Any, prompt_lengths: list[int], options: ResolvedOptions) -> None:
    """OptionError (or ValueError for the model) unless a generate call's prompts of these lengths
    can be split into context and query and written (a server checks this before queueing)."""
    check_model(model)
    q = options.gradmem_query_tokens
    short = [b for b, n in enumerate(prompt_lengths) if n <= q]
    if short:
        raise OptionError("gradmem_query_tokens", f"gradmem_query_tokens={q} leaves row {short[0]} no context to "
                          f"write: its prompt has {prompt_lengths[short[0]]} tokens (the context is the prompt "
                          "before its last gradmem_query_tokens tokens)")
    check_contexts(model, [n - q for n in prompt_lengths], options.gradmem_tokens, options.gradmem_init)


def _as_rows(ids: Any, lengths: Any, name: str, vocab_size: int) -> tuple[Tensor, list[int]]:
    """`[T]` or right-padded `[B, T]` ids and each row's length (None: T), checked."""
    if not isinstance(ids, Tensor):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name} must be a tensor or a (nested) list of token ids: {exc}") from None
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} must have shape [T] or [batch, T] with T >= 1, got {tuple(ids.shape)}")
    B, T = ids.shape
    if lengths is None:
        rows = [T] * B
    else:
        rows = list(lengths.tolist() if isinstance(lengths, Tensor) else lengths)
        integers = all(isinstance(n, int) and not isinstance(n, bool) for n in rows)
        if len(rows) != B or not integers or any(not 1 <= n <= T for n in rows):
            raise ValueError(f"{name} lengths must be {B} integers in [1, {T}], got {rows}")
    valid = torch.arange(T)[None] < torch.tensor(rows)[:, None]
    bad = valid & ((ids.cpu() < 0) | (ids.cpu() >= vocab_size))
    if bool(bad.any()):
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}[{b}, {t}]={int(ids[b, t])} is outside the vocabulary [0, {vocab_size})")
    return ids.long(), rows


def _placeholder(model: Any) -> int:
    """The id standing at memory columns (never embedded: their input is the memory)."""
    pad = model.config.pad_token_id
    return pad if pad is not None and 0 <= pad < model.config.vocab_size else 0


def initial_memory(model: Any, context_ids: Tensor, lengths: list[int], tokens: int, init: str,
                   generators: RowGenerators) -> Tensor:
    """M_0 `[B, m, h]` float32: "tail" = wte of each row's last m context tokens; "random" = normal
    vectors with the standard deviation of wte's entries, from the row's generator."""
    wte = model.transformer.wte.weight
    B = context_ids.shape[0]
    if init == "tail":
        check_contexts(model, lengths, tokens, init)
        tails = torch.stack([context_ids[b, lengths[b] - tokens : lengths[b]] for b in range(B)])
        return wte.detach()[tails.to(wte.device)].float()
    if init == "random":
        std = float(wte.detach().float().std())
        draws = [torch.randn(tokens, wte.shape[1], generator=generators[b], device=wte.device) for b in range(B)]
        return torch.stack(draws) * std
    raise ValueError(f"gradmem_init={init!r} is invalid: expected one of {GRADMEM_INITS}")


def memory_loss(model: Any, memory: Tensor, ids: Tensor, num_steps: int, lengths: list[int] | None = None,
                init_scale: float | None = None, generators: RowGenerators | None = None) -> Tensor:
    """Per-row mean next-token loss `[B]` of `ids` (`[B, T]`, right-padded to `lengths`) given the
    memory `[B, m, h]` before them, the first id read at the memory's last position; differentiable
    in `memory`. L_write of a context, or the held-out loss of a continuation read from the memory.

    s_0 is drawn per row from `generators` (None: the global RNG) over its real positions only, so
    a row's loss does not depend on the rows beside it; at `init_scale` (None: the model config's)."""
    init_scale = model.config.init_scale if init_scale is None else init_scale
    B, T = ids.shape
    m = memory.shape[1]
    lengths = [T] * B if lengths is None else lengths
    wte = model.transformer.wte
    device = wte.weight.device
    ids = ids.to(device)
    holder = torch.full((B, m), _placeholder(model), dtype=torch.long, device=device)
    full_ids = torch.cat([holder, ids], dim=1)
    embeds = torch.cat([memory.to(device=device, dtype=wte.weight.dtype), wte(ids)], dim=1)
    states = None
    if model.config.state_init == "random":
        states = torch.zeros_like(embeds)
        if init_scale != 0:
            for b in range(B):
                n = m + lengths[b]
                generator = generators[b] if generators is not None else None
                states[b, :n] = model.initial_state(embeds[b : b + 1, :n], init_scale, generator)[0]
    logits = model(full_ids, num_steps=num_steps, inputs_embeds=embeds, input_states=states).logits
    predicted = logits[:, m - 1 : m - 1 + T]  # position m-1+t predicts ids[:, t]
    real = torch.arange(T, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    targets = torch.where(real, ids, -100)
    losses = F.cross_entropy(predicted.reshape(B * T, -1), targets.reshape(-1), ignore_index=-100, reduction="none")
    return (losses.view(B, T) * real).sum(1) / real.sum(1)


def write_flops(model: Any, batch: int, seq_len: int, depth: int, steps: int) -> float | None:
    """Model FLOPs of `steps` write steps (forward + backward on [batch, seq_len] at `depth`), or
    None where `train.flops` does not count the model's mixers."""
    if steps == 0:
        return 0.0
    try:
        return steps * training_step_flops(model.config, batch, seq_len, (0, depth)).total
    except ValueError:
        return None


def write_memory(model: Any, context_ids: Any, *, tokens: int, steps: int, lr: float, depth: int | None = None,
                 lengths: Any = None, init: str = "tail", memory: Tensor | None = None,
                 init_scale: float | None = None, seed: Any = None,
                 should_stop: Callable[[], bool] | None = None) -> MemoryWrite:
    """GradMem's WRITE: `steps` SGD steps on `tokens` memory tokens prepended to the context.

    context_ids: `[T]` or `[B, T]` ids, rows right-padded to `lengths` (None: every row has T).
    depth: recurrence depth of each write pass, >= 1 (None: the model's mean_recurrence).
    init: "tail" or "random" (see `initial_memory`); `memory` (`[m, h]` or `[B, m, h]`) gives M_0 instead.
    init_scale, seed: s_0's scale (None: the model config's) and the per-row seeds (an int: row b uses
      seed + b), as generation's.
    should_stop: checked before each step; when it returns True the write raises `engine.Stopped`.

    The model's weights receive no gradient and are left as they were (bit for bit); its
    train/eval mode is restored. Returns a `MemoryWrite`.
    """
    check_model(model)
    cfg = model.config
    ids, rows = _as_rows(context_ids, lengths, "context_ids", cfg.vocab_size)
    B, T = ids.shape
    for name, value, low in (("tokens", tokens, 1), ("steps", steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"gradmem {name}={value!r} is invalid: expected an integer >= {low}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf"):
        raise ValueError(f"gradmem lr={lr!r} is invalid: expected a finite number > 0")
    depth = cfg.mean_recurrence if depth is None else depth
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:  # a random s_0 at depth 0 ignores M
        raise ValueError(f"gradmem depth={depth!r} is invalid: expected an integer >= 1")
    check_contexts(model, rows, tokens, init if memory is None else "given")
    generators = RowGenerators(seed, B, model.device)
    if memory is None:
        mem = initial_memory(model, ids, rows, tokens, init, generators)
    else:
        mem = memory.detach().float().to(model.device)
        mem = mem[None].expand(B, -1, -1) if mem.dim() == 2 else mem
        if tuple(mem.shape) != (B, tokens, cfg.hidden_size):
            raise ValueError(f"memory must have shape [{tokens}, {cfg.hidden_size}] or [{B}, {tokens}, "
                             f"{cfg.hidden_size}], got {tuple(memory.shape)}")
        mem = mem.clone()
    start = time.perf_counter()
    losses: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        # Gradients even inside a generation's no-grad or inference mode; the ids are cloned there
        # so that autograd may save them.
        with torch.inference_mode(False), torch.enable_grad():
            ids = ids.clone()
            mem = mem.clone()
            for _ in range(steps):
                if should_stop is not None and should_stop():
                    raise Stopped("stopped between GradMem write steps")
                mem.requires_grad_(True)
                loss = memory_loss(model, mem, ids, depth, rows, init_scale, generators)
                (grad,) = torch.autograd.grad(loss.sum(), mem)  # row b's gradient is its own loss's
                losses.append([float(v) for v in loss.detach()])
                mem = (mem - lr * grad).detach()
                # a diverged write would generate from a non-finite memory: garbage tokens, NaN stats
                bad = [b for b in range(B) if not (math.isfinite(losses[-1][b]) and bool(mem[b].isfinite().all()))]
                if bad:
                    raise OptionError("gradmem_lr", f"gradmem_lr={lr:g} made the write diverge: after step "
                                      f"{len(losses)} row {bad[0]}'s loss is {losses[-1][bad[0]]:g} or its memory "
                                      "is not finite; lower gradmem_lr")
    finally:
        model.train(was_training)
    return MemoryWrite(memory=mem.detach(), losses=losses, flops=write_flops(model, B, tokens + T, depth, steps),
                       steps=steps, depth=depth, lr=float(lr), context_tokens=rows,
                       seconds=time.perf_counter() - start)


def memory_prompt(model: Any, memory: Tensor, query_ids: Any = None, query_lengths: Any = None
                  ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The READ prompt [M; query] of each row, left-padded as generation takes it.

    memory `[B, m, h]`; query_ids `[Tq]` / `[B, Tq]` right-padded to `query_lengths`, or None (the
    memory alone). Returns (ids `[B, m + Tq]` with a placeholder id at memory columns, attention
    mask or None, the memory columns bool `[B, m + Tq]`, the prompt's embeddings `[B, m + Tq, h]`:
    wte(ids) with the memory at its columns)."""
    B, m, h = memory.shape
    wte = model.transformer.wte
    device = wte.weight.device
    if query_ids is None:
        q, rows = torch.zeros(B, 0, dtype=torch.long), [0] * B
    else:
        q, rows = _as_rows(query_ids, query_lengths, "query_ids", model.config.vocab_size)
        if q.shape[0] != B:
            raise ValueError(f"query_ids has {q.shape[0]} rows for a memory of {B}")
    Tq = q.shape[1]
    holder = _placeholder(model)
    ids = torch.full((B, m + Tq), holder, dtype=torch.long)
    embedded = torch.zeros(B, m + Tq, dtype=torch.bool)
    valid = torch.zeros(B, m + Tq, dtype=torch.bool)
    for b in range(B):
        pad = Tq - rows[b]
        embedded[b, pad : pad + m] = True
        valid[b, pad:] = True
        ids[b, pad + m :] = q[b, : rows[b]]
    ids, embedded = ids.to(device), embedded.to(device)
    with torch.no_grad():
        embeds = wte(ids)
        embeds[embedded] = memory.to(device=device, dtype=embeds.dtype).reshape(B * m, h)
    mask = None if bool(valid.all()) else valid.to(device)
    return ids, mask, embedded, embeds


def read_prompt(model: Any, memory: Tensor, query_ids: Any = None, attention_mask: Any = None
                ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """`memory_prompt` for a memory `[B, m, h]` (or `[m, h]`) and a query given as generation takes a
    prompt: `[B, Tq]` / `[Tq]` ids left-padded with `attention_mask`, or None."""
    if not isinstance(memory, Tensor) or memory.dim() not in (2, 3) or not memory.dtype.is_floating_point:
        raise ValueError("memory must be a floating-point tensor [m, h] or [B, m, h] (write_memory(...).memory)")
    memory = memory[None] if memory.dim() == 2 else memory
    B, m, h = memory.shape
    if m == 0 or h != model.config.hidden_size:
        raise ValueError(f"memory must have shape [B, m >= 1, hidden_size={model.config.hidden_size}], "
                         f"got {tuple(memory.shape)}")
    if query_ids is None:
        return memory_prompt(model, memory)
    ids, mask = prepare_inputs(model, query_ids, attention_mask)
    if ids.shape[0] != B and B == 1:
        memory = memory.expand(ids.shape[0], -1, -1)
    elif ids.shape[0] != B:
        raise ValueError(f"query_ids has {ids.shape[0]} rows for a memory of {B}")
    rows = [ids[b][mask[b]] if mask is not None else ids[b] for b in range(ids.shape[0])]
    query, lengths = _right_padded(rows, _placeholder(model))
    return memory_prompt(model, memory, query, lengths)


@dataclass
class GradMemPlan:
    """A generate call with gradmem_tokens > 0: its prompt split into the context (written into
    the memory) and the query (its last gradmem_query_tokens tokens), and the READ prompt's layout.
    `write(session)` runs the WRITE and gives the session its prompt embeddings."""

    model: Any
    options: ResolvedOptions
    context: Tensor  # [B, Tc] right-padded
    context_lengths: list[int]
    query: Tensor  # [B, Tq] right-padded
    query_lengths: list[int]
    read_ids: Tensor
    read_mask: Tensor | None
    embedded: Tensor

    @classmethod
    def split(cls, model: Any, input_ids: Tensor, mask: Tensor | None, options: ResolvedOptions) -> GradMemPlan:
        """Each left-padded prompt row `[B, T]` as context + query; the READ prompt laid out with a
        placeholder memory (its embeddings come with `write`)."""
        B, T = input_ids.shape
        q = options.gradmem_query_tokens
        real = [input_ids[b][mask[b]] if mask is not None else input_ids[b] for b in range(B)]
        check_prompts(model, [r.numel() for r in real], options)
        contexts = [r[: r.numel() - q] for r in real]
        queries = [r[r.numel() - q :] for r in real]
        context, context_lengths = _right_padded(contexts, _placeholder(model))
        if q:
            query, query_lengths = _right_padded(queries, _placeholder(model))
        else:
            query, query_lengths = torch.zeros(B, 0, dtype=torch.long), [0] * B
        placeholder = torch.zeros(B, options.gradmem_tokens, model.config.hidden_size)
        read_ids, read_mask, embedded, _ = memory_prompt(model, placeholder, query if q else None,
                                                         query_lengths if q else None)
        return cls(model, options, context, context_lengths, query, query_lengths, read_ids, read_mask, embedded)

    def write(self, session: Any) -> MemoryWrite:
        """Run the WRITE (stoppable like the session's core steps), set the session's prompt
        embeddings, and add the gradmem_* figures to its stats. A call that generates nothing
        (max_new_tokens=0) reads no memory: it keeps M_0, takes no step, and its stats say so."""
        o = self.options
        skip = o.max_new_tokens == 0
        result = write_memory(
            self.model, self.context, tokens=o.gradmem_tokens, steps=0 if skip else o.gradmem_steps, lr=o.gradmem_lr,
            depth=o.num_steps if o.gradmem_depth is None else o.gradmem_depth, lengths=self.context_lengths,
            init=o.gradmem_init, init_scale=o.init_scale, seed=o.seed, should_stop=session.engine.should_stop,
        )
        q = self.query if self.query.shape[1] else None
        _, _, _, embeds = memory_prompt(self.model, result.memory, q, self.query_lengths if q is not None else None)
        session.prompt_embeds = embeds
        session.stats.update(result.stats())
        if skip:
            session.stats["gradmem_skipped"] = NOTHING_GENERATED
        return result


def _right_padded(rows: list[Tensor], pad: int) -> tuple[Tensor, list[int]]:
    lengths = [r.numel() for r in rows]
    out = torch.full((len(rows), max(lengths)), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : lengths[b]] = r.cpu()
    return out, lengths
