"""Log-likelihood of continuations under every test-time compute control, with steps per token.

`score_continuations` is what the lm-eval backend calls for `loglikelihood` requests:

- fixed depth and a full cache (the default): one batched forward per request batch, exactly the
  model's forward (`batched_logprobs`);
- per-token early exit, a KV budget, or warm start: the context but its last token is prefilled
  at full depth, then the last context token and the continuation are fed one token at a time
  (teacher forcing), each recurring until its exit criterion holds (at most `num_steps`), so every
  scored prediction runs under the criterion. Earlier tokens' KV entries are read through the
  inference caches (slot i mod k under a budget; the deepest entry for tokens that exited early),
  exactly as `recurrent_depth.generate` does when it decodes (`stepwise_logprobs`).

Both return, per request, the summed log-probability of the continuation, whether it is the
greedy continuation, and the recurrence steps each continuation token was predicted with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.cache import make_cache
from recurrent_depth.inference.criteria import ExitCriterion, resolve_criterion
from recurrent_depth.model.recurrent import RecurrentDepthLM


@dataclass
class Scored:
    logprob: float
    is_greedy: bool
    steps: list[int]  # recurrence steps behind the prediction of each continuation token


def _check_request(context: Sequence[int], continuation: Sequence[int]) -> None:
    if len(context) == 0:
        raise ValueError("each request needs a non-empty context (lm-eval puts the prefix token there)")
    if len(continuation) == 0:
        raise ValueError("each request needs a non-empty continuation to score")


@torch.no_grad()
def batched_logprobs(
    model: RecurrentDepthLM,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    num_steps: int,
    pad_token_id: int,
    init_scale: float | None = None,
    generator: torch.Generator | None = None,
) -> list[Scored]:
    """Fixed depth: right-pad `context + continuation[:-1]` and run one forward."""
    for context, continuation in requests:
        _check_request(context, continuation)
    rows = [list(c) + list(x)[:-1] for c, x in requests]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_token_id, dtype=torch.long, device=model.device)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row, device=model.device)
    logp = F.log_softmax(model(ids, num_steps=num_steps, init_scale=init_scale, generator=generator).logits, -1)
    out = []
    for b, (context, continuation) in enumerate(requests):
        start = len(context) - 1
        picked = logp[b, start : start + len(continuation)]  # [n, V]
        target = torch.tensor(list(continuation), device=picked.device)
        total = float(picked.gather(-1, target[:, None]).sum())
        greedy = bool((picked.argmax(-1) == target).all())
        out.append(Scored(total, greedy, [num_steps] * len(continuation)))
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
    generator: torch.Generator | None = None,
) -> list[Scored]:
    """Teacher-forced, token by token: early exit per token and row, KV sharing, warm start."""
    for context, continuation in requests:
        _check_request(context, continuation)
    spec, threshold = resolve_criterion(exit_criterion, exit_threshold)
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 1:
        raise ValueError(f"min_steps={min_steps!r} is invalid: expected an integer >= 1")
    scale = model.config.init_scale if init_scale is None else init_scale
    device = model.device
    B = len(requests)
    Lc = max(len(c) for c, _ in requests)
    Ln = max(len(x) for _, x in requests)
    if Lc + Ln - 1 > model.config.max_seq_len:
        raise ValueError(
            f"context + continuation of {Lc + Ln - 1} tokens exceeds max_seq_len={model.config.max_seq_len}"
        )
    ctx_ids = torch.full((B, Lc), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((B, Lc), dtype=torch.long, device=device)
    for b, (context, _) in enumerate(requests):  # left padding: every continuation starts at column Lc
        ctx_ids[b, Lc - len(context) :] = torch.tensor(list(context), device=device)
        mask[b, Lc - len(context) :] = 1
    cache = make_cache("static", B, num_steps, kv_budget, capacity=Lc + Ln, device=device)

    # Prefill all but the last context token at full depth; every prediction that is scored
    # (from the last context token on) then runs under the exit criterion.
    last_state = None
    if Lc > 1:
        step_ctx = model.make_context(ctx_ids[:, :-1], mask[:, :-1], cache=cache)
        e = model.embed(ctx_ids[:, :-1], step_ctx)
        state = model.initial_state(e, scale, generator)
        for i in range(num_steps):
            state = model.core_step(state, e, i, step_ctx)
        model.predict(model.transformer.ln_f(state), step_ctx)  # fills the coda's cache entries
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
    criterion = ExitCriterion(spec, threshold) if spec is not None else None
    for j in range(Ln):
        live = j < lengths  # rows already done feed padding; their results are unused
        mask = torch.cat([mask[:, : Lc - 1 + j], torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        ids = feed[:, j : j + 1]
        step_ctx = model.make_context(ids, mask, cache=cache)
        e = model.embed(ids, step_ctx)
        if warm_start and last_state is not None:
            state = last_state
        else:
            state = model.initial_state(e, scale, generator)
        state, logits, used = _recur(model, state, e, step_ctx, cache, num_steps, criterion, min_steps)
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


def _recur(
    model: RecurrentDepthLM,
    state: Tensor,
    e: Tensor,
    step_ctx,
    cache,
    num_steps: int,
    criterion: ExitCriterion | None,
    min_steps: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """One new position per row: iterate until each row's criterion holds. -> (state, logits [B, V], steps [B])."""
    B = state.shape[0]
    if criterion is None:
        for i in range(num_steps):
            state = model.core_step(state, e, i, step_ctx)
        logits = model.predict(model.transformer.ln_f(state), step_ctx)[:, -1]
        return state, logits, torch.full((B,), num_steps, dtype=torch.long, device=state.device)
    running = torch.ones(B, dtype=torch.bool, device=state.device)
    used = torch.zeros(B, dtype=torch.long, device=state.device)
    logits = None
    criterion.start(state[:, 0], model.config.vocab_size)
    for i in range(num_steps):
        cache.write_mask = running[:, None]  # rows that exited keep their entries as at their exit
        new_state = model.core_step(state, e, i, step_ctx)
        state = torch.where(running[:, None, None], new_state, state)
        used += running
        step_logits = None
        if criterion.needs_logits:
            step_logits = model.predict(model.transformer.ln_f(state), step_ctx)[:, -1]
            logits = step_logits if logits is None else torch.where(running[:, None], step_logits, logits)
        met = criterion.update(state[:, 0], step_logits)
        if i + 1 >= min_steps:
            running &= ~met
            if not bool(running.any()):
                break
    cache.write_mask = None
    if logits is None:  # latent criteria: read the logits once, at each row's exit state
        logits = model.predict(model.transformer.ln_f(state), step_ctx)[:, -1]
    return state, logits, used
