"""Token-by-token decoding: fixed depth, per-token adaptive exit, warm start, sampling.

Per new token: embed it (prelude), start from s_0 (random, zeros, or with warm start the previous
token's final state, raw or ln_f-normed per `warm_start_source`), iterate the core, and read the
logits. With an exit criterion each row stops on its own: a row that has exited keeps its state
and logits, and a write mask keeps its cache entries as they were at its exit, so every row gets
exactly what it would get alone. With `exit_in_prefill` the prompt runs under the criterion too.
With `exit_kv="compute"` every token (and the prompt) runs every step, writing every KV entry, and
is read at the step its criterion first holds (`Recurrence.run_computing`, Ouro's reference loop).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from recurrent_depth.inference.output import EXIT_REASONS, REASON_CODE, TokenEvent
from recurrent_depth.inference.session import Session


def decode(session: Session) -> Iterator[TokenEvent]:
    """Prefill (at full depth unless `exit_in_prefill`), then one token at a time until every row stops."""
    opts, engine, cache = session.options, session.engine, session.cache
    B, T = session.B, session.T
    adaptive = opts.criterion is not None
    if session.computing:
        last_state, logits, used, _ = session.computing_prefill()
        steps = used.tolist()
    elif adaptive and opts.exit_in_prefill:
        last_state, logits, used, _ = session.adaptive_prefill()
        steps = used.tolist()
    else:
        last_state, logits = session.prefill(opts.num_steps)
        steps = [opts.num_steps] * B
    codes = [REASON_CODE["prefill"]] * B  # the first token: the prompt's last position
    last_state = last_state[:, None]  # [B, 1, h]
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
        pass_ = engine.begin(ids, session.mask(column + 1), cache)
        if not opts.warm_start:
            state = session.initial_states(pass_.e, session.unfinished)
        elif opts.warm_start_source == "normed":
            state = engine.final_norm(last_state)
        else:
            state = last_state
        if session.computing:  # every step's KV is written: close at max_steps
            last_state, logits, used, exit_codes = engine.run_computing(
                state, pass_, session.criterion, session.vocab_size, active=active, **session.compute_schedule,
            )
            cache.close(torch.where(active, opts.max_steps, 0)[:, None], 1)
        else:
            last_state, logits, used, exit_codes = engine.run_adaptive(
                state, pass_, session.criterion, session.vocab_size, active=active, **session.schedule,
            )
            cache.close(used[:, None] if adaptive else opts.num_steps, 1)
        cache.advance(1)
        column += 1
        steps, codes = used.tolist(), exit_codes.tolist()

