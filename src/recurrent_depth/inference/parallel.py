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

The sweeps' own per-column buffers (latent states, input tokens, step counts: `_Columns`) hold the columns from
the sweeps' start on, so like a windowed layer's KV (inference/cache.py) they stay bounded in a long generation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.cache import MULTI_QUERY_WINDOW_SLACK
from recurrent_depth.inference.output import TokenEvent
from recurrent_depth.inference.session import Session

# Columns the buffers allocate beyond the sweep's span, so that they reallocate (dropping the frozen columns) once
# every ~this many committed tokens, each time copying the span only.
BUFFER_ROOM = 64


class _Columns:
    """The sweeps' per-column buffers over columns [first, first + held): inputs `tokens` `[B, held]` (beyond a
    row's front, guesses), raw states `states` `[B, held, h]`, `done` (steps run) and `fresh` (steps since the
    input last changed). A column before every unfinished row's front is final and no sweep reads it again (the
    fronts never move back), so `hold` drops such columns when a sweep needs a column past the buffers: they hold
    the sweeps' span and `room` columns more, not the whole generation. Values at held columns never change on a
    drop; a column never held starts as the full buffers started (padding, zeros)."""

    def __init__(self, B: int, h: int, dtype: torch.dtype, device: torch.device, pad: int, first: int,
                 room: int) -> None:
        self.pad, self.room, self.first = pad, room, first
        self.tokens = torch.full((B, 0), pad, dtype=torch.long, device=device)
        self.states = torch.zeros(B, 0, h, dtype=dtype, device=device)
        self.done = torch.zeros(B, 0, dtype=torch.long, device=device)
        self.fresh = torch.zeros_like(self.done)
        self.peak_nbytes = 0

    def hold(self, lo: int, hi: int) -> int:
        """Make columns [lo, hi) held (columns before lo may go); returns `first`, the buffers' column 0."""
        held = self.tokens.shape[1]
        if hi <= self.first + held:
            return self.first
        skip = min(lo - self.first, held)  # the frozen columns dropped
        size = hi - lo + self.room

        def moved(old: Tensor, fill: int) -> Tensor:
            new = old.new_full((old.shape[0], size, *old.shape[2:]), fill)
            new[:, : held - skip] = old[:, skip:]
            return new

        self.tokens = moved(self.tokens, self.pad)
        self.states, self.done, self.fresh = moved(self.states, 0), moved(self.done, 0), moved(self.fresh, 0)
        self.first = lo
        nbytes = sum(t.nbytes for t in (self.tokens, self.states, self.done, self.fresh))
        self.peak_nbytes = max(self.peak_nbytes, nbytes)
        return self.first


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
    columns = _Columns(B, session.model.config.hidden_size, session.model.dtype, session.device,
                       session.pad_token_id, first=T, room=BUFFER_ROOM)
    columns.hold(T, T + 1)
    columns.tokens[:, 0] = first  # inputs of the columns; beyond a row's front they are guesses
    front = [T] * B  # per row: the first column not yet frozen
    ends = [T] * B  # per row: one past its last column in the wavefront
    sweeps = columns_run = 0
    while session.unfinished:
        rows = session.unfinished
        # New positions join a row's wavefront while fewer than `wavefront` refine: a position far beyond
        # the front runs on a guess of a guess, and every extra position makes each forward dearer.
        adds = {b: min(opts.headway, stop_column - ends[b], opts.wavefront - (ends[b] - front[b])) for b in rows}
        start = min(front[b] for b in rows)
        end = max(ends[b] + max(adds[b], 0) for b in rows)
        # Columns before `start` are frozen in every unfinished row: their entries are final, and the buffers
        # (from column `base` on) may drop them. The sweep reads and writes columns [start, end], tokens to end.
        base = columns.hold(start, end + 1)
        a, z = start - base, end - base  # the sweep's columns in the buffers
        tokens, states, done, fresh = columns.tokens, columns.states, columns.done, columns.fresh
        for b in rows:
            end_b, add = ends[b] - base, adds[b]
            if add > 0:
                tokens[b, end_b + 1 : end_b + add] = tokens[b, end_b]  # unknown yet: repeat the guess
                states[b, end_b : end_b + add] = session.initial_states(states[:, end_b : end_b + add], [b])[b]
                ends[b] += add
        cache.seek(start)
        width = end - start
        columns_run += width
        lo = torch.tensor(front, device=session.device)
        hi = torch.tensor(ends, device=session.device)
        at = torch.arange(start, end, device=session.device)
        write = (at[None] >= lo[:, None]) & (at[None] < hi[:, None])
        write &= session.unfinished_mask()[:, None]  # [B, W]: the (row, column) pairs this sweep refines
        everyone = bool(write.all())
        cache.write_mask = None if everyone else write
        ids = tokens[:, a:z]
        pass_ = engine.begin(ids, session.mask(end), cache)
        active = None if everyone else write
        previous = engine.run(states[:, a:z], pass_, range(inner - 1), active=active)
        s = engine.run(previous, pass_, range(inner - 1, inner), active=active)
        logits = engine.readout(s, pass_)  # [B, W, V]
        cache.write_mask = None
        # (before the write-back below: with one inner step `previous` is a view of `states`)
        statistic = _statistic(name, s, previous) if name is not None else None
        states[:, a:z] = s
        done[:, a:z] += inner * write
        fresh[:, a:z] += inner * write
        cache.close(done[:, a:z], width)
        predicted = _choose(session, logits, rows, [(front[b] - start, ends[b] - start) for b in rows])
        used = ids.tolist()  # the inputs this sweep ran on, before the guesses move
        upcoming = tokens[:, a + 1 : z + 1]
        changed = write & (predicted != upcoming)
        tokens[:, a + 1 : z + 1] = torch.where(write, predicted, upcoming)
        fresh[:, a + 1 : z + 1].masked_fill_(changed, 0)
        predicted_l, done_l = predicted.tolist(), done[:, a:z].tolist()
        fresh_l = fresh[:, a:z].tolist()
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
                if tokens[b, c + 1 - base] != token:  # a teacher's or sampled token that differs from the guess
                    tokens[b, c + 1 - base] = token
                    fresh[b, c + 1 - base] = 0
                if c + 1 < ends[b] and used[b][j + 1] != token:
                    break  # the next position ran on a wrong guess: it refines on the right input first
        sweeps += 1
    # the tokens the sweeps committed: each row's first token came from the prefill, not from a sweep
    swept = sum(max(session.recorder.count(b) - 1, 0) for b in range(B))
    session.stats.update(sweeps=sweeps, tokens_per_sweep=round(swept / max(1, sweeps), 3),
                         mean_wavefront=round(columns_run / max(1, sweeps), 2), buffer_bytes=columns.peak_nbytes)
