"""Self-speculative decoding (paper §6.4): draft with N steps, verify with M > N in one forward.

A round starts from the pending token y (chosen, not yet fed). It drafts `lookahead` tokens
autoregressively at N steps, feeding y, d_1, ..., d_{L-1}. Then one forward over those L columns
continues their states from step N to step M: the draft states are reused, because steps 0..N-1
of a position depend only on steps 0..N-1 of earlier positions (the recurrence is causal in both
time and depth), so they are exactly what an M-step forward would compute. The verifier's
choice g_t at each column is compared with the draft d_t:

- exact mode (verification_threshold = 1): accept while d_t == argmax g_t; the output is
  identical to greedy decoding at M steps;
- probability mode (threshold < 1): accept while p_M(d_t) >= threshold * max p_M.

The first rejected draft is replaced by the verifier's token. Columns holding rejected drafts are
rolled back when every row rejected them, and hidden by the attention mask otherwise, so rows of
a batch advance independently. A row stops at max_new_tokens, or with `finish_round` (the
official loop) at the end of the round that reaches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from recurrent_depth.inference.cache import MULTI_QUERY_WINDOW_SLACK
from recurrent_depth.inference.output import TokenEvent
from recurrent_depth.inference.session import Session


def decode(session: Session) -> Iterator[TokenEvent]:
    opts, engine, cache = session.options, session.engine, session.cache
    M, N = opts.num_steps, opts.draft_steps
    exact = opts.verification_threshold >= 1.0
    lookup = cache.policy.lookup
    hides = lookup.hides_columns or lookup.reads_per_step  # lookups that read the columns' depths
    # With a random s_0 the drafts' first N steps are not what a fresh M-step pass computes; the official loop
    # verifies with such a pass (and its draw), so under official defaults ours does too.
    fresh_verify = (opts.defaults == "official" and opts.init_scale > 0
                    and session.model.config.state_init == "random")
    _, logits = session.prefill(M)  # (a model this mode cannot run was refused up front: check_mode_for_model)
    rows = session.unfinished
    pending = session.chooser.choose(logits, rows)  # [B]
    nbytes = session.row_bytes()
    for b in rows:
        yield session.commit(b, int(pending[b]), M, "prefill", logits[b] if opts.output_logits else None, nbytes[b])
    column = session.T
    rounds = drafted = accepted = 0
    max_len = session.model.config.max_seq_len
    while session.unfinished:
        rows = session.unfinished
        active = session.unfinished_mask()
        # Position of each row's pending token: its real columns so far. Drafts must stay within
        # max_seq_len (a row needs at most its remaining tokens, which validation made fit); finished
        # rows feed padding on hidden columns, so their positions stop growing.
        position = session.valid[:, :column].sum(1).tolist()
        L = min(opts.lookahead, *(max_len - position[b] for b in rows))
        session.mask(column + L)  # (makes room for the columns hidden below)
        # windowed layers keep what the verify reads after seeking back over the drafts (inference/cache.py)
        session.hold_back(_window_back(session, rows, column, L))
        for b in range(session.B):
            if b not in rows:
                session.hide(b, column, column + L)
        feed = torch.where(active, pending, session.pad_token_id)
        ids, states, embeds, injections, drafts = [], [], [], [], []
        draws: list[list[Tensor | None]] = []  # row generators' states before each draft's s_0 draw
        for t in range(L):  # draft: L tokens at N steps each (fewer near max_seq_len)
            draws.append(_generator_states(session, rows, fresh_verify))
            token_ids = feed[:, None]
            pass_ = engine.begin(token_ids, session.mask(column + t + 1), cache)
            s = engine.run(session.initial_states(pass_.e, rows), pass_, N)
            draft_logits = engine.readout(s, pass_, last_only=True)[:, 0]
            if hides:  # record the draft's N steps: a lookup that reads depths would read a stale one
                cache.close(N, 1)
            cache.advance(1)
            feed = draft_logits.argmax(-1)
            ids.append(token_ids)
            states.append(s)
            embeds.append(pass_.e)
            injections.append(pass_.injected)
            drafts.append(feed)
        # verify: one forward over the L columns, steps N..M-1 on top of the draft states and entries
        cache.seek(column)
        token_ids = torch.cat(ids, 1)
        pass_ = engine.rebind(token_ids, session.mask(column + L), cache, torch.cat(embeds, 1),
                              torch.cat(injections, 1))
        if fresh_verify:  # the official verify pass: all M steps again, from a fresh s_0 (its own draw)
            s = engine.run(session.initial_states(pass_.e, rows), pass_, M)
        else:
            s = engine.run(torch.cat(states, 1), pass_, range(N, M))
        verify_logits = engine.readout(s, pass_)  # [B, L, V]
        cache.close(M, L)
        cache.advance(L)
        draft = torch.stack(drafts, 1)  # [B, L]: d_1..d_L
        best = verify_logits.argmax(-1)  # [B, L]: the verifier's token after each column
        if exact:
            ok = draft == best
        else:
            probs = verify_logits.softmax(-1)
            p_draft = probs.gather(-1, draft[..., None])[..., 0]
            ok = p_draft >= opts.verification_threshold * probs.max(-1).values
        n_ok = ok.long().cumprod(1).sum(1).tolist()  # leading accepted drafts per row
        draft_list, best_list = draft.tolist(), best.tolist()
        rounds += 1
        drafted += L * len(rows)
        # A token chosen after column c reports the bytes of columns [0, c + 1), as autoregressive decoding
        # does: the accepted ones, not the round's rejected drafts beyond them.
        nbytes_after: dict[int, list[int]] = {}
        keep_columns = []
        for b in rows:
            n = n_ok[b]
            accepted += n
            emitted = [(draft_list[b][t], "accepted", t) for t in range(n)]
            if n < L:
                emitted.append((best_list[b][n], "corrected", n))
            committed = 0
            for i, (token, reason, t) in enumerate(emitted):
                if t not in nbytes_after:
                    nbytes_after[t] = session.row_bytes(column + t + 1)
                event = session.commit(b, token, M, reason, verify_logits[b, t] if opts.output_logits else None,
                                       nbytes_after[t][b])
                pending[b] = token
                committed += 1
                # finish_round goes on past max_new_tokens, but never past max_seq_len tokens in all (the
                # pending token sits at position[b], this one at position[b] + 1 + i)
                ends = session.recorder.finished[b] and not (
                    opts.finish_round and session.recorder.finish_reasons[b] == "length"
                    and position[b] + 2 + i < max_len
                )
                if event.finished and not ends and i + 1 < len(emitted):  # finish_round: the round goes on
                    event = replace(event, finished=False)
                yield event
                if ends:
                    break
            # Column c holds the pending token and c + t holds d_t for t >= 1: real iff committed and fed,
            # i.e. min(n, L - 1) + 1 columns, or fewer when the row finished inside the round.
            keep_columns.append(committed)
        # Roll back the columns every row rejected; hide the other rejected ones row by row.
        keep = max(keep_columns, default=L)
        for i, (b, k) in enumerate(zip(rows, keep_columns)):
            if k < keep:
                session.hide(b, column + k, column + keep)
            state = draws[k][i] if k < L else None
            if state is not None:  # the next s_0 is the one greedy decoding draws for that column
                session.generators[b].set_state(state)
        cache.truncate(column + keep)
        column += keep
    session.stats.update(
        rounds=rounds, drafted_tokens=drafted, accepted_drafts=accepted,
        acceptance_rate=round(accepted / drafted, 4) if drafted else 0.0,
    )


def _window_back(session: Session, rows: list[int], column: int, lookahead: int) -> int:
    """The columns a windowed layer keeps beyond its window W while a round drafts `lookahead` tokens from
    `column`: the lookahead - 1 drafts the verify seeks back over, and the most hidden columns (a batch's rejected
    drafts) among an unfinished row's last W - 1 real ones before `column`, the widest W's (a query sees W real
    tokens, so such a row's window spans those columns more; a narrower window's span holds no more of them)."""
    windows = session.cache_windows
    if not windows:
        return 0
    seen = max(windows.values()) - 1  # the real columns before `column` that a query there sees
    hidden = int(hidden_in_window(session.valid[rows, :column], seen).max()) if rows and seen and column else 0
    return lookahead - 1 + hidden + MULTI_QUERY_WINDOW_SLACK  # (the verify reads its L queries at once)


def hidden_in_window(valid: Tensor, seen: int) -> Tensor:
    """Per row of `valid` (bool `[R, C]`: real columns), the hidden columns among its last `seen` real ones: those
    from the oldest of them on that are not real (0 for a row with no real column). One tensor computation for
    every row, so that a round reads the result with one device sync."""
    after = valid.flip(1).cumsum(1, dtype=torch.int32).flip(1)  # real columns from c on: [R, C]
    counted = after[:, :1].clamp(max=seen)  # the real columns seen: the last min(all, seen)
    # a hidden column lies after the oldest real one seen iff fewer than `counted` real ones follow it
    return (~valid & (after < counted)).sum(1)


def _generator_states(session: Session, rows: list[int], fresh_verify: bool) -> list[Tensor | None]:
    """Each row's s_0 generator state, so that the draws of rejected drafts can be undone: a row's next column
    then starts from the s_0 that token-by-token decoding draws for it, and the exact mode equals greedy
    decoding with a random s_0 too. None where nothing is undone: the official loop's (a fresh verify draw,
    or torch's global RNG)."""
    return [None if fresh_verify or (g := session.generators[b]) is None else g.get_state() for b in rows]
