"""The recurrence engine: the one place outside `RecurrentDepthLM.forward` that iterates the core.

Every interface that runs a model step by step (each `generate` mode, the server's continuous
batch, lm-eval scoring, analysis trajectories, training validation) computes the same three
things: a **prefill** of some positions (prelude, then core steps), a **step loop** in which rows
may run their own number of steps under an exit criterion, and a **readout** (raw states, ln_f
states, or logits) at chosen depths. `Recurrence` does each once, over a `ModelRunner` (the
model's own modules, or the fused `FastRunner` for all-attention models) and a `StepCache`
(`recurrent_depth.model.cache`), whose KV policy decides what each (layer, step) reads:

- `begin(ids, mask, cache)` -> `Pass`: the call's context, e = prelude(ids) and its injection;
- `run(state, pass_, steps, active=)`: core steps `steps` (a range), optionally for a subset of
  rows or (row, column) pairs only (the others keep their state and their cache entries);
- `run_adaptive(...)`: one new position per row, each row stopping on its own exit criterion;
- `run_computing(...)`: every position runs every step (every KV entry written), each row's last
  position is read at the step its criterion first holds (`exit_kv="compute"`, Ouro's reference);
- `depths(state, pass_, wanted)`: yields the raw state at each wanted depth of one pass;
- `step_rows(state, pass_)`: one core step for rows at different steps (the serving batch's pool
  maps each row to its own slot), for schedulers that advance one step per iteration;
- `readout(state, pass_)`: logits from raw states (coda on every position, so its cache fills).

`should_stop` (a callable returning True) is checked between core steps; when it fires the loop
raises `Stopped`, so a caller past its deadline ends within one step, prefill included.
`on_step`, when set, is called after every completed core step (the server's progress clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.criteria import ExitCriterion
from recurrent_depth.inference.output import REASON_CODE
from recurrent_depth.inference.runner import ModelRunner, Step, make_runner
from recurrent_depth.model.cache import ModelCache

CONVERGED = REASON_CODE["converged"]
MAX_STEPS = REASON_CODE["max-steps"]
FIXED = REASON_CODE["fixed"]


class Stopped(Exception):
    """The engine's `should_stop` hook asked the step loop to stop (e.g. a request's deadline)."""


@dataclass
class Pass:
    """One model call's positions: the runner's context, e = prelude(ids) `[B, T, h]` and the
    part of every core step's input that depends on e only (`runner.inject(e)`)."""

    step: Step
    e: Tensor
    injected: Tensor


class Recurrence:
    """Prefill, step loop and readout over one runner (see the module docstring)."""

    def __init__(self, model: Any, fast: bool = True, runner: ModelRunner | None = None) -> None:
        self.model = model
        self.runner = runner if runner is not None else make_runner(model, fast)
        self.should_stop: Callable[[], bool] | None = None
        self.on_step: Callable[[], None] | None = None

    # ------------------------------------------------------------------ passes
    def begin(self, ids: Tensor, mask: Tensor | None = None, cache: ModelCache | None = None,
              position_ids: Tensor | None = None, row_columns: Tensor | None = None,
              inputs_embeds: Tensor | None = None) -> Pass:
        """Context, prelude and injection for `ids` `[B, T]` (mask: `[B, cached + T]`).

        row_columns: `[B]` the column of each row's single new token, for rows of different
        lengths in one call (the serving batch); see `RecurrentDepthLM.make_context`.
        inputs_embeds: `[B, T, h]` the prelude's input instead of wte(ids) (GradMem's memory prompt)."""
        step = self.runner.context(ids, mask, cache, position_ids, row_columns)
        e = self.runner.embed(ids, step, inputs_embeds)
        return Pass(step, e, self.runner.inject(e))

    def rebind(self, ids: Tensor, mask: Tensor | None, cache: ModelCache | None, e: Tensor, injected: Tensor) -> Pass:
        """A pass over positions whose prelude already ran (their e and injection are given)."""
        return Pass(self.runner.context(ids, mask, cache), e, injected)

    def initial_state(self, e: Tensor, init_scale: float, generator: torch.Generator | None) -> Tensor:
        return self.runner.initial_state(e, init_scale, generator)

    def final_norm(self, state: Tensor) -> Tensor:
        """ln_f of raw states `[B, T, h]` (what the official fixed-depth loop warm-starts from)."""
        return self.runner.final_norm(state)

    def readout(self, state: Tensor, pass_: Pass, last_only: bool = False) -> Tensor:
        """Logits float32 `[B, T, V]` (or `[B, 1, V]`) from raw states `[B, T, h]`."""
        return self.runner.predict(state, pass_.step, last_only=last_only)

    # ------------------------------------------------------------------ the step loop
    def _tick(self) -> None:
        if self.on_step is not None:
            self.on_step()
        if self.should_stop is not None and self.should_stop():
            raise Stopped("stopped between core steps")

    def _core(self, state: Tensor, pass_: Pass, index: int) -> Tensor:
        return self.runner.core_step(state, pass_.injected, pass_.e, index, pass_.step)

    def run(self, state: Tensor, pass_: Pass, steps: range | int, active: Tensor | None = None) -> Tensor:
        """Core steps `steps` (an int n = range(n)) on raw states `[B, T, h]`.

        active: None (every position) or bool `[B]` / `[B, T]`: only those rows / (row, column)
        pairs step; the others keep their state and, through the cache's write mask, their KV entries.
        """
        steps = range(steps) if isinstance(steps, int) else steps
        if self.should_stop is not None and self.should_stop():
            raise Stopped("stopped before the first core step")
        cache = pass_.step.ctx.cache
        if active is not None and bool(active.all()):
            active = None
        if active is None:
            if self.should_stop is None and self.on_step is None:  # no hook between steps: the runner's own loop
                return self.runner.core_steps(state, pass_.injected, pass_.e, steps, pass_.step)
            for i in steps:
                state = self._core(state, pass_, i)
                self._tick()
            return state
        keep = active if active.dim() == 2 else active[:, None].expand(state.shape[:2])  # [B, T]
        outer = cache.write_mask if cache is not None else None  # a caller's mask for the whole pass
        for i in steps:
            if cache is not None:
                cache.write_mask = keep
            new = self._core(state, pass_, i)
            if cache is not None:
                cache.write_mask = outer
            state = torch.where(keep[..., None], new, state)
            self._tick()
        return state

    def run_adaptive(
        self, state: Tensor, pass_: Pass, criterion: ExitCriterion | None, vocab_size: int, *,
        num_steps: int, max_steps: int, min_steps: int = 1, active: Tensor | None = None,
        first_check: int = 1, check_every: int = 1, read_last_check: bool = False, valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """New positions (`state` `[B, T, h]`: one token per row, or a prompt) recur until each row's
        criterion holds; a row's positions stop together.

        Without a criterion every row runs `num_steps`. The criterion is evaluated (statistic and
        check) after steps first_check, first_check + check_every, ...; a row may exit at an
        evaluated step once it has run `min_steps`. A row that has exited keeps its state and
        logits, and the write mask keeps its cache entries as at its exit, so every row gets
        exactly what it would get alone. A row that reaches max_steps is read out at its final
        state, or with `read_last_check` (the reference's loop) keeps the logits of its last
        evaluated step. active: bool `[B]`, rows that still generate; valid: bool `[B, T]`, real
        positions (the latent criteria average over them).
        Returns (final raw state `[B, T, h]`, last-position logits `[B, V]`, steps `[B]`, exit codes `[B]`).
        """
        B, T = state.shape[:2]
        device = state.device
        if active is None:
            active = torch.ones(B, dtype=torch.bool, device=device)
        if criterion is None:  # fixed depth: no masks, no checks
            state = self.run(state, pass_, num_steps)
            logits = self.readout(state, pass_, last_only=True)[:, 0]
            return state, logits, torch.where(active, num_steps, 0), torch.full((B,), FIXED, device=device)

        if self.should_stop is not None and self.should_stop():
            raise Stopped("stopped before the first core step")
        cache = pass_.step.ctx.cache
        running = active.clone()
        everyone = bool(running.all())  # fast path while no row has stopped
        criterion.start(state[:, 0] if T == 1 else state, vocab_size, valid if T > 1 else None)
        # While every row runs they have all run the same number of steps: count per row only after that.
        steps = None if everyone else torch.zeros(B, dtype=torch.long, device=device)
        codes = torch.full((B,), MAX_STEPS, dtype=torch.long, device=device)
        logits = None
        ran = 0
        evaluated = False
        for i in range(max_steps):
            if not everyone and cache is not None:
                cache.write_mask = running[:, None].expand(B, T)
            new_state = self._core(state, pass_, i)
            ran = i + 1
            if everyone:
                state = new_state
            else:
                state = torch.where(running[:, None, None], new_state, state)
                steps += running
            evaluated = ran >= first_check and (ran - first_check) % check_every == 0
            if evaluated:
                step_logits = None
                if criterion.needs_logits:
                    step_logits = self.readout(state, pass_, last_only=True)[:, 0]
                    logits = step_logits if logits is None or everyone else torch.where(
                        running[:, None], step_logits, logits
                    )
                met = criterion.update(None if criterion.needs_logits else (state[:, 0] if T == 1 else state),
                                       step_logits)
                if ran >= min_steps:
                    stopping = met if everyone else met & running
                    if bool(stopping.any()):  # the one host sync per step that exit decisions need
                        if steps is None:
                            steps = torch.where(active, ran, 0)
                        codes = torch.where(stopping, CONVERGED, codes)
                        running &= ~stopping
                        everyone = False
                        if not bool(running.any()):
                            break
            if cache is not None:
                cache.write_mask = None
            self._tick()
        if cache is not None:
            cache.write_mask = None
        if steps is None:
            steps = torch.where(active, ran, 0)
        if logits is None:  # latent criteria: one coda pass on every row's exit state
            logits = self.readout(state, pass_, last_only=True)[:, 0]
        elif not (evaluated or read_last_check):  # rows at max_steps past their last check
            if cache is not None:  # (the coda entries of exited rows stay those of their exit)
                cache.write_mask = running[:, None].expand(B, T).clone()
            logits = torch.where(running[:, None], self.readout(state, pass_, last_only=True)[:, 0], logits)
            if cache is not None:
                cache.write_mask = None
        return state, logits, steps, codes

    def run_computing(
        self, state: Tensor, pass_: Pass, criterion: ExitCriterion, vocab_size: int, *,
        max_steps: int, min_steps: int = 1, first_check: int = 1, check_every: int = 1,
        active: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Positions `[B, T, h]` (a token per row, or a prompt) all run `max_steps` core steps, so every
        step writes its KV; the output of each row's last position is its state at the first evaluated
        step (from `min_steps` on) where its criterion holds, else at max_steps. Earlier positions of a
        prompt are read at full depth.

        This is the Ouro reference's loop (every step runs, the logits come from the exit step), for any
        criterion: the statistic is evaluated on the last position's state after each step and, for
        output criteria, on its logits with the rest of the positions at full depth. active: bool `[B]`,
        rows that still generate (the others write nothing). Returns (raw states `[B, T, h]` with the last
        position at its exit state, its logits `[B, V]`, exit steps `[B]`, exit codes `[B]`); every active
        row has run max_steps (close the cache at that depth).
        """
        B, T = state.shape[:2]
        device = state.device
        if active is None:
            active = torch.ones(B, dtype=torch.bool, device=device)
        cache = pass_.step.ctx.cache
        last_states = []  # the last position's state after each step
        start = state[:, -1]
        active_mask = None if bool(active.all()) else active
        for i in range(max_steps):
            state = self.run(state, pass_, range(i, i + 1), active=active_mask)
            last_states.append(state[:, -1])
        undecided = active.clone()
        steps = torch.where(active, max_steps, 0)
        codes = torch.full((B,), MAX_STEPS, dtype=torch.long, device=device)
        exit_state = state[:, -1].clone()
        criterion.start(start, vocab_size)
        for i, last in enumerate(last_states):
            ran = i + 1
            if ran < first_check or (ran - first_check) % check_every or not bool(undecided.any()):
                continue
            step_logits = None
            if criterion.needs_logits:  # the last position at this step, the rest at full depth
                step_logits = self._read_last(state, last, pass_, undecided)
            met = criterion.update(None if criterion.needs_logits else last, step_logits)
            if ran >= min_steps:
                stopping = met & undecided
                steps = torch.where(stopping, ran, steps)
                codes = torch.where(stopping, CONVERGED, codes)
                exit_state = torch.where(stopping[:, None], last, exit_state)
                undecided &= ~stopping
        state = state.clone()
        state[:, -1] = exit_state
        if cache is not None and active_mask is not None:  # the coda entries of rows that no longer generate stay
            cache.write_mask = active[:, None].expand(B, T).clone()
        logits = self.readout(state, pass_, last_only=True)[:, 0]
        if cache is not None:
            cache.write_mask = None
        return state, logits, steps, codes

    def _read_last(self, state: Tensor, last: Tensor, pass_: Pass, rows: Tensor) -> Tensor:
        """Logits `[B, V]` of the last position at state `last` `[B, h]`, the others at `state`; only
        `rows` write their (coda) cache entries, which the final readout rewrites anyway."""
        cache = pass_.step.ctx.cache
        probe = state.clone()
        probe[:, -1] = last
        if cache is not None:
            cache.write_mask = rows[:, None].expand(probe.shape[:2]).clone()
        logits = self.readout(probe, pass_, last_only=True)[:, 0]
        if cache is not None:
            cache.write_mask = None
        return logits

    def step_rows(self, state: Tensor, pass_: Pass) -> Tensor:
        """One core step for rows that may be at different steps (`state` `[B, 1, h]`); the bound
        cache (the serving pool) maps each row to the slot of its own step."""
        state = self._core(state, pass_, 0)
        self._tick()
        return state

    # ------------------------------------------------------------------ readout at depths
    def depths(self, state: Tensor, pass_: Pass, wanted: Sequence[int]) -> Iterator[tuple[int, Tensor]]:
        """Yield `(depth, raw state [B, T, h])` for each depth in `wanted` (ascending), running the
        core once to the deepest: the state at depth d equals a d-step forward from the same s_0."""
        done = 0
        for depth in wanted:
            if depth > done:
                state = self.run(state, pass_, range(done, depth))
                done = depth
            yield depth, state
