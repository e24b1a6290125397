"""Log-likelihood of continuations under every test-time compute control, with steps per token.

The lm-eval backend calls these for `loglikelihood` requests:

- fixed depth and a full cache (the default): one batched forward per request batch, exactly the
  model's forward (`batched_logprobs`);
- per-token early exit, a KV budget, or warm start: the context but its last token is prefilled
  at full depth, then the last context token and the continuation are fed one token at a time
  (teacher forcing), each recurring until its exit criterion holds (at most `num_steps`), so every
  scored prediction runs under the criterion (the engine's `run_adaptive`). Earlier tokens' KV
  entries are read through the inference caches under the request's KV policy (`kv_policy` /
  `kv_budget`), exactly as `recurrent_depth.generate` does when it decodes (`stepwise_logprobs`;
  sliding-window layers hold O(W) columns, as generate's);
  with `exit_kv="compute"` each token runs every step for its KV and is read at its exit step
  (the engine's `run_computing`, the Ouro reference), the whole context too, as `generate`'s
  prefill runs a prompt under it (its last position predicts the first continuation token);
- with `exit_in_prefill` (the official profile's default under an exit criterion) the whole
  context runs as `generate`'s adaptive prefill: a row's context positions stop together at the
  criterion's step, whose logits predict the first continuation token; the rest of the
  continuation is then fed token by token as above. This is exactly `generate(context,
  teacher_tokens=continuation)` under the same options.

Both return, per request, the summed log-probability of the continuation, whether it is the
greedy continuation, and the recurrence steps each continuation token was predicted with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.cache import bind_policy, layer_windows, make_cache
from recurrent_depth.inference.criteria import ExitCriterion, gate_for, resolve_criterion
from recurrent_depth.inference.engine import Recurrence
from recurrent_depth.inference.quant_cache import kv_quant_for_model
from recurrent_depth.inference.sampling import RowGenerators
from recurrent_depth.inference.session import (
    RANDOMIZED_LOOKUP_STREAM,
    adaptive_schedule,
    check_policy_for_model,
    check_position_counters,
)
from recurrent_depth.model.recurrent import RecurrentDepthLM, mixers_with


@dataclass
class Scored:
    logprob: float
    is_greedy: bool
    steps: list[int]  # recurrence steps behind the prediction of each continuation token


Generators = torch.Generator | Sequence[torch.Generator] | None
# log-probabilities made at once in fixed-depth scoring: 64 MiB of float32, over glibc's largest heap allocation
# (32 MiB), so that each block is mapped and unmapped (smaller ones fragmented the heap: peak RSS varied by 40 %)
LOG_SOFTMAX_ELEMENTS = 2**24


def _row_states(draw, e: Tensor, scale: float, generator: Generators, valid: Tensor | None = None) -> Tensor:
    """s_0 for `e` `[B, T, h]` by `draw(e, scale, generator)`: from one stream for the batch, or with one
    generator per row (`Sequence`) each row's from its own over its real columns (`valid` `[B, T]`, None:
    all), as `generate` draws a row's, so that a row's draw does not depend on the rows beside it."""
    if generator is None or isinstance(generator, torch.Generator):
        return draw(e, scale, generator)
    s = torch.zeros_like(e)
    for b, g in enumerate(generator):
        cols = valid[b].nonzero()[:, 0] if valid is not None else torch.arange(e.shape[1], device=e.device)
        if len(cols):
            s[b, cols] = draw(e[b : b + 1, cols], scale, g)[0]
    return s


def _check_generators(generator: Generators, count: int) -> None:
    if generator is not None and not isinstance(generator, torch.Generator) and len(generator) != count:
        raise ValueError(f"generator: expected one torch.Generator, or one per request ({count}), "
                         f"got {len(generator)}")


def _check_request(context: Sequence[int], continuation: Sequence[int]) -> None:
    if len(context) == 0:
        raise ValueError("each request needs a non-empty context (lm-eval puts the prefix token there)")
    if len(continuation) == 0:
        raise ValueError("each request needs a non-empty continuation to score")


def _target_logprobs(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's log-probability of its target, and whether the target is the row's argmax (a function, so
    that one block's log-softmax is freed before the next one's is made)."""
    logp = F.log_softmax(logits, -1)
    return logp.gather(-1, targets[:, None])[:, 0], logp.argmax(-1) == targets


@torch.no_grad()
def batched_logprobs(
    model: RecurrentDepthLM,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    num_steps: int,
    pad_token_id: int,
    init_scale: float | None = None,
    generator: Generators = None,
) -> list[Scored]:
    """Fixed depth: right-pad `context + continuation[:-1]` and run one forward. generator: one stream for
    the batch's s_0, or one generator per request (each row's s_0 drawn from its own, batch-independent, as
    `generate` draws a row's)."""
    for context, continuation in requests:
        _check_request(context, continuation)
    _check_generators(generator, len(requests))
    rows = [list(c) + list(x)[:-1] for c, x in requests]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_token_id, dtype=torch.long, device=model.device)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, device=model.device)
    states = None
    if not isinstance(generator, torch.Generator | None) and model.config.state_init != "random":
        generator = None  # a model whose s_0 is e draws nothing: no per-request streams to pass on
    if not isinstance(generator, torch.Generator | None):
        # Each row draws as `generate(context, teacher_tokens=continuation)` does: the context's s_0 at
        # once, then each fed continuation token's, so the same seed gives generate's numbers.
        scale = model.config.init_scale if init_scale is None else init_scale
        states = torch.zeros((len(rows), T, model.config.hidden_size), device=model.device,
                             dtype=model.transformer.wte.weight.dtype)
        for b, ((context, _), g) in enumerate(zip(requests, generator)):
            n = len(context)
            states[b, :n] = model.initial_state(states[b : b + 1, :n], scale, g)[0]
            for t in range(n, len(rows[b])):
                states[b, t] = model.initial_state(states[b : b + 1, t : t + 1], scale, g)[0, 0]
        generator = None
    # The head at the scored positions only (from each row's last context token): logits [N, V], not [B, T, V];
    # their log-softmax a block of rows at a time (a row's is its own): the same values as over the whole forward.
    scored = torch.zeros((len(rows), T), dtype=torch.bool, device=model.device)
    for b, (context, continuation) in enumerate(requests):
        scored[b, len(context) - 1 : len(context) - 1 + len(continuation)] = True
    logits = model(ids, num_steps=num_steps, init_scale=init_scale, generator=generator, input_states=states,
                   logits_at=scored).logits
    targets = torch.tensor([t for _, continuation in requests for t in continuation], device=logits.device)
    chosen = torch.empty(len(targets), device=logits.device)  # each target's log-probability
    hit = torch.empty(len(targets), dtype=torch.bool, device=logits.device)  # is it the argmax
    per_block = max(1, LOG_SOFTMAX_ELEMENTS // logits.shape[-1])
    for i in range(0, len(targets), per_block):
        block = slice(i, i + per_block)
        chosen[block], hit[block] = _target_logprobs(logits[block], targets[block])
    out = []
    first = 0  # each request's rows, in order
    for _, continuation in requests:
        n = len(continuation)
        out.append(Scored(float(chosen[first : first + n].sum()), bool(hit[first : first + n].all()),
                          [num_steps] * n))
        first += n
    return out


@torch.no_grad()
def stepwise_logprobs(
    model: RecurrentDepthLM,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    num_steps: int,
    pad_token_id: int,
    exit_criterion: str | None = None,
    exit_threshold: float | None = None,
    min_steps: int = 1,
    kv_budget: int | None = None,
    warm_start: bool = False,
    init_scale: float | None = None,
    generator: Generators = None,
    kv_policy: str | None = None,
    kv_quant: str | None = None,
    exit_kv: str = "lookup",
    min_steps_rule: str = "exit",
    check_every: int = 1,
    warm_start_source: str = "raw",
    exit_in_prefill: bool = False,
) -> list[Scored]:
    """Teacher-forced, token by token: early exit per token and row, KV sharing, warm start, a
    quantized KV cache (`kv_quant`, see `recurrent_depth.inference.quant_cache`). min_steps_rule,
    check_every and warm_start_source mean what they mean in `generate` (`GenerationOptions`).
    exit_in_prefill (with an exit criterion): the whole context runs as `generate`'s adaptive prefill
    reads a prompt, its positions stopping together at the criterion's step, which also predicts the
    first continuation token; the rest of the continuation is fed one token at a time as above.
    generator: one stream for every s_0 draw of the batch, or one generator per request: each row then
    draws from its own as `generate` draws a row's (over its real columns), independent of the batch."""
    for context, continuation in requests:
        _check_request(context, continuation)
    _check_generators(generator, len(requests))
    spec, threshold = resolve_criterion(exit_criterion, exit_threshold)
    if exit_kv not in ("lookup", "compute"):
        raise ValueError(f"exit_kv={exit_kv!r} is invalid: expected 'lookup' or 'compute'")
    gate = gate_for(spec, model)
    skip = min_steps_rule == "skip"  # (the official rule: the first min_steps steps unchecked, 0 allowed)
    if min_steps_rule not in ("exit", "skip"):
        raise ValueError(f"min_steps_rule={min_steps_rule!r} is invalid: expected 'exit' or 'skip'")
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < (0 if skip else 1):
        raise ValueError(f"min_steps={min_steps!r} is invalid: expected an integer >= {0 if skip else 1}")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every={check_every!r} is invalid: expected an integer >= 1")
    if warm_start_source not in ("raw", "normed"):
        raise ValueError(f"warm_start_source={warm_start_source!r} is invalid: expected 'raw' or 'normed'")
    if exit_kv == "compute" and skip:
        raise ValueError("exit_kv='compute' takes min_steps_rule='exit'")
    if exit_in_prefill and spec is None:
        raise ValueError("exit_in_prefill=True needs an exit_criterion")
    if exit_in_prefill and exit_kv == "compute":
        raise ValueError("exit_kv='compute' takes exit_in_prefill=False")
    # what generate refuses for this model: a lookup that needs softmax attention, a KV quantization it cannot take
    policy = bind_policy(kv_policy, kv_budget, model.config.core_layers)
    check_policy_for_model(model, SimpleNamespace(policy=policy, kv_policy=kv_policy, defaults=None))
    if kv_quant is not None:
        kv_quant_for_model(model, kv_quant)
    scale = model.config.init_scale if init_scale is None else init_scale
    device = model.device
    B = len(requests)
    Lc = max(len(c) for c, _ in requests)
    Ln = max(len(x) for _, x in requests)
    longest = max(len(c) + len(x) - 1 for c, x in requests)
    if longest > model.config.max_seq_len:
        raise ValueError(
            f"context + continuation of {longest} tokens exceeds max_seq_len={model.config.max_seq_len}"
        )

    def apart(groups: list[list[int]]) -> list[Scored]:
        """Each group of rows scored as its own batch, the results in the order of `requests`."""
        single = generator is None or isinstance(generator, torch.Generator)
        out: list[Scored] = [None] * B  # type: ignore[list-item]
        for group in groups:
            scored = stepwise_logprobs(
                model, [requests[b] for b in group], num_steps, pad_token_id, exit_criterion, exit_threshold,
                min_steps, kv_budget, warm_start, init_scale, generator if single else [generator[b] for b in group],
                kv_policy=kv_policy, kv_quant=kv_quant, exit_kv=exit_kv,
                min_steps_rule=min_steps_rule, check_every=check_every, warm_start_source=warm_start_source,
                exit_in_prefill=exit_in_prefill,
            )
            for b, item in zip(group, scored):
                out[b] = item
        return out

    rows_apart = B > 1 and spec is not None and exit_kv != "compute" and mixers_with(model, "shared_counter")
    if rows_apart or Lc + Ln - 1 > model.config.max_seq_len:
        # A mixer whose state keeps one position count for the batch (log-linear, TTT-KVB) cannot let rows
        # exit at different steps: score each row alone (generate refuses; a scorer is handed batches).
        # Otherwise every row fits alone, but aligned at one column (the longest context's) the batch does not:
        # a long context beside a long continuation. Score the halves apart rather than refuse them.
        return apart([[b] for b in range(B)] if rows_apart else [list(range(B // 2)), list(range(B // 2, B))])
    short = [b for b, (context, _) in enumerate(requests) if len(context) == 1]
    whole = exit_in_prefill or (exit_kv == "compute" and spec is not None)  # the whole context prefilled
    if (kv_quant is not None or warm_start) and not whole and 0 < len(short) < B:
        # A quantized cache calibrates its outlier channels on each row's first write: the prefill of the
        # context but its last token, which a one-token context does not have (alone, its row calibrates on
        # the write of that token). A warm start would start that token from a padding column's state
        # (alone, from its s_0). Score the one-token contexts as a batch of their own.
        return apart([short, [b for b in range(B) if b not in short]])
    # a shared core slot (kv_budget, kv_policy) that a log-linear state cannot take
    check_position_counters(model, policy, B, None, num_steps)
    ctx_ids = torch.full((B, Lc), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, Lc), dtype=torch.long, device=device)
    for b, (context, _) in enumerate(requests):  # left padding: every continuation starts at column Lc
        ctx_ids[b, Lc - len(context) :] = torch.tensor(list(context), device=device)
        mask[b, Lc - len(context) :] = 1
    # generate's cache: sliding-window layers drop the columns no window reaches (every write is at the end)
    cache = make_cache("static", B, num_steps, kv_budget, capacity=Lc + Ln, device=device, policy=kv_policy,
                       core_layers=model.config.core_layers, kv_quant=kv_quant, windows=layer_windows(model))
    engine = Recurrence(model, fast=False)  # the model's own modules
    if generator is not None and not isinstance(generator, torch.Generator):  # the randomized lookup's draws, as
        rows = RowGenerators([g.initial_seed() for g in generator], B, device)  # generate derives a row's
        cache.lookup_generators = rows.derived(RANDOMIZED_LOOKUP_STREAM)
    criterion = ExitCriterion(spec, threshold, gate) if spec is not None else None
    schedule = adaptive_schedule(num_steps, num_steps, min_steps, check_every, min_steps_rule)  # generate's

    # Prefill all but the last context token at full depth; every prediction that is scored
    # (from the last context token on) then runs under the exit criterion. With exit_in_prefill,
    # the whole context runs under it instead, as generate's prefill reads a prompt.
    last_state = None
    prefilled = None
    computing = exit_kv == "compute" and criterion is not None
    if exit_in_prefill or computing:  # the whole context, as `Session.adaptive_prefill` / `computing_prefill`
        cache.mark_prompt(mask.bool())
        pass_ = engine.begin(ctx_ids, mask, cache)
        state = _row_states(engine.initial_state, pass_.e, scale, generator, mask.bool())
        if computing:  # every position runs every step, the last one is read at its exit step
            state, logits, used, _ = engine.run_computing(state, pass_, criterion, model.config.vocab_size,
                                                          max_steps=num_steps, min_steps=min_steps,
                                                          check_every=check_every)
            cache.close(num_steps, Lc)
        else:  # a row's positions stop together
            state, logits, used, _ = engine.run_adaptive(state, pass_, criterion, model.config.vocab_size,
                                                         valid=mask.bool(), **schedule)
            cache.close(used[:, None].expand(B, Lc).contiguous(), Lc)
        cache.advance(Lc)
        last_state = state[:, -1:]
        prefilled = (logits, used)
    elif Lc > 1:
        cache.mark_prompt(mask[:, :-1].bool())  # calibrated KV quantizers: each row from its own context
        pass_ = engine.begin(ctx_ids[:, :-1], mask[:, :-1], cache)
        state = engine.run(_row_states(engine.initial_state, pass_.e, scale, generator, mask[:, :-1].bool()),
                           pass_, num_steps)
        engine.readout(state, pass_)  # fills the coda's cache entries
        cache.close(num_steps, Lc - 1)
        cache.advance(Lc - 1)
        last_state = state[:, -1:]

    targets = torch.full((B, Ln), pad_token_id, dtype=torch.long, device=device)
    lengths = torch.tensor([len(x) for _, x in requests], device=device)
    for b, (_, continuation) in enumerate(requests):
        targets[b, : len(continuation)] = torch.tensor(list(continuation), device=device)
    feed = torch.cat([ctx_ids[:, -1:], targets[:, :-1]], dim=1)  # the token whose position predicts each target
    logprob = torch.zeros(B, device=device)
    greedy = torch.ones(B, dtype=torch.bool, device=device)
    steps = torch.zeros((B, Ln), dtype=torch.long, device=device)
    first = 0
    if prefilled is not None:  # the prefill's logits predict the first target
        logits, used = prefilled
        steps[:, 0] = used
        lp = F.log_softmax(logits.float(), -1)
        logprob += lp.gather(-1, targets[:, :1])[:, 0]
        greedy &= lp.argmax(-1) == targets[:, 0]
        first = 1
    for j in range(first, Ln):
        live = j < lengths  # rows already done feed padding; their results are unused
        mask = torch.cat([mask[:, : Lc - 1 + j], torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        ids = feed[:, j : j + 1]
        pass_ = engine.begin(ids, mask, cache)
        if warm_start and last_state is not None:
            state = engine.final_norm(last_state) if warm_start_source == "normed" else last_state
        else:
            state = _row_states(engine.initial_state, pass_.e, scale, generator)
        if computing:  # every step's KV written
            state, logits, used, _ = engine.run_computing(state, pass_, criterion, model.config.vocab_size,
                                                          max_steps=num_steps, min_steps=min_steps,
                                                          check_every=check_every)
            cache.close(num_steps, 1)
        else:
            state, logits, used, _ = engine.run_adaptive(state, pass_, criterion, model.config.vocab_size,
                                                         **schedule)
            cache.close(used[:, None], 1)
        cache.advance(1)
        last_state = state
        steps[:, j] = used
        lp = F.log_softmax(logits.float(), -1)
        target = targets[:, j]
        logprob += torch.where(live, lp.gather(-1, target[:, None])[:, 0], 0.0)
        greedy &= ~live | (lp.argmax(-1) == target)
    return [
        Scored(float(logprob[b]), bool(greedy[b]), steps[b, : int(lengths[b])].tolist()) for b in range(B)
    ]

