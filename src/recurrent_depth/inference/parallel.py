"""A diffusion-forcing style parallel sampler (Geiping, Yang, Su 2025; the reference's
`generate_diffusion_style`).

Instead of finishing a token's recurrence before starting the next, keep a *wavefront* of
positions at the end of the sequence whose latent states refine together:

- every sweep runs `inner_steps` (at most `max_steps`) core steps on all wavefront positions in one forward, reads
  their logits, and uses each position's current prediction as the (guessed) input token of the
  next position; `headway` new positions join the wavefront per sweep;
- the front position (its input is final) freezes when its latent converges (`exit_criterion`
  latent-diff or cosine), when it has run `max_steps` steps *on its final input*, or when the
  wavefront holds more than `max_wavefront` positions. Freezing commits its prediction as the
  next token; if the next position's guess was right it may freeze in the same sweep.

Steps run while a position's input was a wrong guess do not count toward `max_steps` (the state
is kept, as a warm start, but the count restarts when the input changes). Without that rule a
position could freeze after a few steps on its true input, and on a model whose predictions
settle slowly most tokens would differ from sequential decoding; with it, a position always gets
its depth on the right input, and the speed-up comes from positions whose guesses were right.

Every core layer keeps one KV entry per position, its latest (KV sharing with budget 1), which
is what lets positions at different depths attend to each other. Rows of a batch keep their own
front; a write mask protects positions that one row has frozen while another row still refines
them, so each row gets what it would get alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.cache import MULTI_QUERY_WINDOW_SLACK
from recurrent_depth.inference.output import TokenEvent
from recurrent_depth.inference.session import Session


def _statistic(name: str, new: Tensor, old: Tensor) -> Tensor:
    """Latent change of the last step per position `[B, W]` (raw states `[B, W, h]`)."""
    new, old = new.float(), old.float()
    if name == "latent-diff":
        return (new - old).norm(dim=-1) / new.norm(dim=-1).clamp(min=1e-12)
    stat = (1 - F.cosine_similarity(new, old, dim=-1, eps=1e-12)).clamp(min=0)
    # a zero previous state (s_0 at init_scale 0) has no angle: never converged there, as criteria.py's cosine
    return stat.masked_fill(old.norm(dim=-1) == 0, float("inf"))


def _choose(session: Session, logits: Tensor, rows: list[int], spans: list[tuple[int, int]]) -> Tensor:
    """Tokens `[B, W]` from logits `[B, W, V]`; a sampled row draws noise for its own columns
    `[lo, hi)` of the window only (so a row in a batch draws what it would draw alone)."""
    processed = session.chooser.process(logits)
    if not session.options.do_sample:
        return processed.argmax(-1)
    probs = processed.float().softmax(-1)
    noise = torch.ones_like(probs)
    for b, (lo, hi) in zip(rows, spans):
        noise[b, lo:hi].exponential_(generator=session.generators[b])
    return (probs / noise).argmax(-1)


def decode(session: Session) -> Iterator[TokenEvent]:
    opts, engine, cache = session.options, session.engine, session.cache
    B, T = session.B, session.T
    limit = opts.max_steps
    # A sweep never runs more steps than a position may: inner_steps above max_steps (the default 4 at
    # num_steps 1) ran every token inner_steps deep, past the depth asked.
    inner = min(opts.inner_steps, limit)
    name = opts.criterion.name if opts.criterion is not None else None
    # Windowed layers keep their window from each sweep's start (fronts never move back, so neither do the sweeps'
    # seeks), and some columns more for the sweeps' multi-query reads (inference/cache.py).
    session.hold_back(MULTI_QUERY_WINDOW_SLACK)
    _, logits = session.prefill(opts.num_steps)  # (a model it cannot run was refused up front: check_mode_for_model)
    rows = session.unfinished
    first = session.chooser.choose(logits, rows)
    nbytes = session.row_bytes()
    for b in rows:
        event = session.commit(b, int(first[b]), opts.num_steps, "prefill",
                               logits[b] if opts.output_logits else None, nbytes[b])
        first[b] = event.token
        yield event
    # Column c's prediction is new token number c - T + 1, so the last one needed is T + max_new - 2.
    stop_column = T + opts.max_new_tokens - 1
    h = session.model.config.hidden_size
    tokens = torch.full((B, stop_column + 1), session.pad_token_id, dtype=torch.long, device=session.device)
    tokens[:, T] = first  # inputs of the columns; beyond a row's front they are guesses
    states = torch.zeros(B, max(stop_column, T), h, dtype=session.model.dtype, device=session.device)
    done = torch.zeros(B, max(stop_column, T) + 1, dtype=torch.long, device=session.device)
    fresh = torch.zeros_like(done)  # steps since the column's input token last changed
    front = [T] * B  # per row: the first column not yet frozen
    ends = [T] * B  # per row: one past its last column in the wavefront
    sweeps = columns_run = 0
    while session.unfinished:
        rows = session.unfinished
        # New positions join a row's wavefront while fewer than `wavefront` refine: a position far beyond
        # the front runs on a guess of a guess, and every extra position makes each forward dearer.
        for b in rows:
            end_b = ends[b]
            add = min(opts.headway, stop_column - end_b, opts.wavefront - (end_b - front[b]))
            if add > 0:
                tokens[b, end_b + 1 : end_b + add] = tokens[b, end_b]  # unknown yet: repeat the guess
                states[b, end_b : end_b + add] = session.initial_states(states[:, end_b : end_b + add], [b])[b]
                ends[b] = end_b + add
        start = min(front[b] for b in rows)
        end = max(ends[b] for b in rows)
        # Columns before `start` are frozen in every unfinished row: their entries are final.
        cache.seek(start)
        width = end - start
        columns_run += width
        columns = torch.arange(start, end, device=session.device)
        lo = torch.tensor(front, device=session.device)
        hi = torch.tensor(ends, device=session.device)
        write = (columns[None] >= lo[:, None]) & (columns[None] < hi[:, None])
        write &= session.unfinished_mask()[:, None]  # [B, W]: the (row, column) pairs this sweep refines
        everyone = bool(write.all())
        cache.write_mask = None if everyone else write
        ids = tokens[:, start:end]
        pass_ = engine.begin(ids, session.mask(end), cache)
        active = None if everyone else write
        previous = engine.run(states[:, start:end], pass_, range(inner - 1), active=active)
        s = engine.run(previous, pass_, range(inner - 1, inner), active=active)
        logits = engine.readout(s, pass_)  # [B, W, V]
        cache.write_mask = None
        # (before the write-back below: with one inner step `previous` is a view of `states`)
        statistic = _statistic(name, s, previous) if name is not None else None
        states[:, start:end] = s
        done[:, start:end] += inner * write
        fresh[:, start:end] += inner * write
        cache.close(done[:, start:end], width)
        predicted = _choose(session, logits, rows, [(front[b] - start, ends[b] - start) for b in rows])
        used = ids.tolist()  # the inputs this sweep ran on, before the guesses move
        upcoming = tokens[:, start + 1 : end + 1]
        changed = write & (predicted != upcoming)
        tokens[:, start + 1 : end + 1] = torch.where(write, predicted, upcoming)
        fresh[:, start + 1 : end + 1].masked_fill_(changed, 0)
        predicted_l, done_l = predicted.tolist(), done[:, start:end].tolist()
        fresh_l = fresh[:, start:end].tolist()
        stat_l = statistic.tolist() if statistic is not None else None
        # A token chosen at column c reports the bytes of columns [0, c + 1), as autoregressive decoding does:
        # the committed positions, not the guesses of the wavefront ahead of them.
        nbytes_after: dict[int, list[int]] = {}
        for b in rows:
            while front[b] < ends[b] and not session.recorder.finished[b]:
                c = front[b]
                j = c - start
                steps = done_l[b][j]
                settled = fresh_l[b][j]  # steps run on the final input
                if stat_l is not None and settled >= opts.min_steps and stat_l[b][j] < opts.threshold:
                    reason = "converged"
                elif settled >= limit:
                    reason = "max-steps"
                elif ends[b] - c > opts.max_wavefront:
                    reason = "wavefront"
                else:
                    break
                if c not in nbytes_after:
                    nbytes_after[c] = session.row_bytes(c + 1)
                event = session.commit(b, predicted_l[b][j], steps, reason,
                                       logits[b, j] if opts.output_logits else None, nbytes_after[c][b])
                token = event.token  # the prediction, or the teacher's token
                yield event
                front[b] = c + 1
                if tokens[b, c + 1] != token:  # a teacher's or sampled token that differs from the guess
                    tokens[b, c + 1] = token
                    fresh[b, c + 1] = 0
                if c + 1 < ends[b] and used[b][j + 1] != token:
                    break  # the next position ran on a wrong guess: it refines on the right input first
        sweeps += 1
    # the tokens the sweeps committed: each row's first token came from the prefill, not from a sweep
    swept = sum(max(session.recorder.count(b) - 1, 0) for b in range(B))
    session.stats.update(sweeps=sweeps, tokens_per_sweep=round(swept / max(1, sweeps), 3),
                         mean_wavefront=round(columns_run / max(1, sweeps), 2))
