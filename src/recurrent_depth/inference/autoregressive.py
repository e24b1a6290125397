"""Token-by-token decoding: fixed depth, per-token adaptive exit, warm start, sampling.

Per new token: embed it (prelude), start from s_0 (random, zeros, or the previous token's raw
final state with warm start), iterate the core, and read the logits. With an exit criterion each
row stops on its own: a row that has exited keeps its state and logits, and a write mask keeps
its cache entries as they were at its exit, so every row gets exactly what it would get alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from recurrent_depth.inference.output import EXIT_REASONS, REASON_CODE, TokenEvent
from recurrent_depth.inference.runner import Step
from recurrent_depth.inference.session import Session

CONVERGED = REASON_CODE["converged"]
MAX_STEPS = REASON_CODE["max-steps"]
FIXED = REASON_CODE["fixed"]


def recur(
    session: Session, state: Tensor, injected: Tensor, e: Tensor, step: Step, active: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the core for one new position per row.

    state, injected, e: `[B, 1, h]`; active: bool `[B]` rows that still generate.
    Returns (final raw state `[B, 1, h]`, logits `[B, V]`, steps `[B]`, exit codes `[B]`).
    """
    opts, runner, cache = session.options, session.runner, session.cache
    B = state.shape[0]
    criterion = session.criterion
    if criterion is None:  # fixed depth: no masks, no checks
        for i in range(opts.num_steps):
            state = runner.core_step(state, injected, e, i, step)
        logits = runner.predict(state, step, last_only=True)[:, 0]
        steps = torch.where(active, opts.num_steps, 0)
        return state, logits, steps, torch.full((B,), FIXED, device=state.device)

    running = active.clone()
    everyone = bool(running.all())  # fast path while no row has stopped
    criterion.start(state[:, 0], session.vocab_size)
    # While every row runs they have all run the same number of steps: count per row only after that.
    steps = None if everyone else torch.zeros(B, dtype=torch.long, device=state.device)
    codes = torch.full((B,), MAX_STEPS, dtype=torch.long, device=state.device)
    logits = None
    ran = 0
    for i in range(opts.max_steps):
        if not everyone:
            cache.write_mask = running[:, None]
        new_state = runner.core_step(state, injected, e, i, step)
        ran = i + 1
        if everyone:
            state = new_state
        else:
            state = torch.where(running[:, None, None], new_state, state)
            steps += running
        step_logits = None
        if criterion.needs_logits:
            step_logits = runner.predict(state, step, last_only=True)[:, 0]
            logits = step_logits if logits is None or everyone else torch.where(
                running[:, None], step_logits, logits
            )
        met = criterion.update(None if criterion.needs_logits else state[:, 0], step_logits)
        if ran >= opts.min_steps:
            stopping = met if everyone else met & running
            if bool(stopping.any()):  # the one host sync per step that exit decisions need
                if steps is None:
                    steps = torch.where(active, ran, 0)
                codes = torch.where(stopping, CONVERGED, codes)
                running &= ~stopping
                everyone = False
                if not bool(running.any()):
                    break
    cache.write_mask = None
    if steps is None:
        steps = torch.where(active, ran, 0)
    if logits is None:  # latent criteria: one coda pass on every row's exit state
        logits = runner.predict(state, step, last_only=True)[:, 0]
    return state, logits, steps, codes


def decode(session: Session) -> Iterator[TokenEvent]:
    """Prefill at full depth, then one token at a time until every row stops."""
    opts, runner, cache = session.options, session.runner, session.cache
    B, T = session.B, session.T
    last_state, logits = session.prefill(opts.num_steps)
    last_state = last_state[:, None]  # [B, 1, h]
    steps = [opts.num_steps] * B
    codes = [REASON_CODE["prefill"]] * B
    column = T
    for _ in range(opts.max_new_tokens):
        rows = session.unfinished
        tokens = session.chooser.choose(logits, rows)
        token_list = tokens.tolist()
        nbytes = session.row_bytes()
        for b in rows:
            event = session.commit(b, token_list[b], steps[b], EXIT_REASONS[codes[b]],
                                   logits[b] if opts.output_logits else None, nbytes[b])
            token_list[b] = event.token  # differs from the choice only under teacher forcing
            yield event
        if session.teacher is not None:
            tokens = torch.tensor(token_list, device=session.device)
        active = session.unfinished_mask()
        session.chooser.observe(tokens, active)
        if not session.unfinished:
            break
        # Feed the new tokens (finished rows feed padding; their results are never used).
        ids = torch.where(active, tokens, session.pad_token_id)[:, None]
        step = runner.context(ids, session.mask(column + 1), cache)
        e = runner.embed(ids, step)
        injected = runner.inject(e)
        if opts.warm_start:
            state = last_state
        else:
            state = session.initial_states(e, session.unfinished)
        last_state, logits, used, exit_codes = recur(session, state, injected, e, step, active)
        cache.close(used[:, None] if opts.exit_criterion else opts.num_steps, 1)
        cache.advance(1)
        column += 1
        steps, codes = used.tolist(), exit_codes.tolist()

