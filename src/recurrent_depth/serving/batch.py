"""Continuous batching with per-sequence depth: sequences join and leave between decode steps.

`BatchDecoder` keeps the running sequences as rows 0..n-1 of a `SlotKVPool`. `add` runs one
request's prompt (its own prefill, at full depth) into a free row and picks its first token;
`step` feeds every row its pending token in one batched call and runs the recurrence with each
row's own settings: its depth (`num_steps`), its exit criterion and threshold, its KV budget, warm
start or a fresh s_0 from its own generator. A row that stops early keeps its state, logits and
cache entries (a per-row write mask), exactly as `recurrent_depth.inference`'s autoregressive loop
does for a batch, so each row produces what `generate` would produce for that request alone:
same tokens, same steps per token, logits equal to float rounding. `remove` frees a row by moving
the last row into it, so the running rows stay contiguous.

The model pieces are `recurrent_depth.inference.runner.FastRunner`'s (all-attention models);
token choice, per-row generators and exit statistics are the inference package's own classes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.criteria import ExitCriterion
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.inference.runner import FastRunner
from recurrent_depth.inference.sampling import RowGenerators, TokenChooser
from recurrent_depth.serving.kv_pool import SlotKVPool


@dataclass
class RowRequest:
    """One sequence to generate.

    options: validated `GenerationOptions` (autoregressive mode). seed: the row's generator seed.
    top_logprobs: None for no logprobs, else how many alternatives to report per token (0 = only
    the chosen token's). prompt_logprobs: also score the prompt tokens (OpenAI `echo` + `logprobs`).
    """

    prompt: list[int]
    options: GenerationOptions
    seed: int
    top_logprobs: int | None = None
    prompt_logprobs: bool = False


@dataclass
class TokenResult:
    """One generated token: id, recurrence steps, why the recurrence stopped, log-probabilities
    (raw model distribution) of the token and of the top alternatives when asked for."""

    token: int
    steps: int
    reason: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class PromptScores:
    """Log-probabilities of prompt tokens 1.. given their prefix (token 0 has none)."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


def logprobs_of(logits: Tensor, chosen: Tensor, k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """log p(chosen) `[N]` and the top-k (id, log p) of each row of logits `[N, V]`."""
    logp = F.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, chosen[:, None])[:, 0].tolist()
    if k <= 0:
        return picked, [[] for _ in picked]
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return picked, tops


@dataclass(eq=False)
class Sequence:
    """A running row: its request, its generator and token chooser, and where it is."""

    request: RowRequest
    generators: RowGenerators
    chooser: TokenChooser
    length: int  # columns written to the cache (prompt + fed tokens)
    pending: int = -1  # the last chosen token, fed at the next step
    last_state: Tensor | None = None  # raw final state of the last position [h] (warm start)
    tag: object = None  # the caller's handle
    generated: int = 0

    @property
    def options(self) -> GenerationOptions:
        return self.request.options

    @property
    def limit(self) -> int:
        """The most steps a new token may run: max_steps with an exit criterion, else num_steps."""
        opts = self.options
        return opts.max_steps if opts.criterion is not None else opts.num_steps

    @property
    def row_slots(self) -> int:
        """Core KV slots this row uses (as `inference.cache._SlotPolicy.core_slots`)."""
        opts = self.options
        deepest = opts.deepest_step
        return max(1, deepest if opts.kv_budget is None else min(opts.kv_budget, deepest))


def slot_table(budgets: list[int | None], row_slots: list[int], steps: int, device: torch.device) -> Tensor:
    """Slot of each (row, core step) `[B, steps]`: step under the full policy, step mod k under a
    budget k; clamped to the row's slots (only rows past their own depth ever hit the clamp, and
    their writes are masked)."""
    i = torch.arange(steps, device=device)[None]
    k = torch.tensor([b or 0 for b in budgets], device=device)[:, None]
    slots = torch.where(k > 0, i % k.clamp(min=1), i)
    return torch.minimum(slots, torch.tensor(row_slots, device=device)[:, None] - 1)


class BatchDecoder:
    """Rows of independent requests decoded together, one token per row per `step`."""

    CONVERGED, MAX_STEPS, FIXED = "converged", "max-steps", "fixed"

    @staticmethod
    def supports(model: object) -> bool:
        """All-attention models without a window (the Huginn architecture)."""
        return FastRunner.supports(model)

    def __init__(self, model: torch.nn.Module, max_rows: int) -> None:
        self.model = model
        self.config = model.config
        self.runner = FastRunner(model)
        self.device = model.device
        self.max_rows = max_rows
        self.pool = SlotKVPool(self.device)
        self.rows: list[Sequence] = []

    def __len__(self) -> int:
        return len(self.rows)

    def reset(self) -> None:
        """Forget every row and the KV storage (after an error left them in an unknown state)."""
        self.pool = SlotKVPool(self.device)
        self.rows = []

    # ------------------------------------------------------------------ joining
    @torch.inference_mode()
    def add(self, request: RowRequest, tag: object = None) -> tuple[Sequence | None, TokenResult | None,
                                                                   PromptScores | None]:
        """Prefill a request into a new row and choose its first token.

        Returns (the row, its first token, prompt scores when asked for). With max_new_tokens = 0
        only the prompt is scored and no row is kept (row and token are None).
        """
        if len(self.rows) >= self.max_rows:
            raise RuntimeError(f"the batch is full ({self.max_rows} rows)")
        opts = request.options
        T = len(request.prompt)
        generators = RowGenerators([request.seed], 1, self.device)
        chooser = TokenChooser(opts, self.config.vocab_size, generators)
        ids = torch.tensor([request.prompt], dtype=torch.long, device=self.device)
        chooser.observe_prompt(ids, torch.ones_like(ids, dtype=torch.bool))
        seq = Sequence(request, generators, chooser, length=T, tag=tag)
        row = len(self.rows)
        self.pool.reserve(seq.row_slots, row + 1, T + opts.max_new_tokens,
                          max_rows=self.max_rows, max_capacity=self.config.max_seq_len)

        runner, pool = self.runner, self.pool
        depth = opts.num_steps  # the prompt runs at full depth
        table = slot_table([opts.kv_budget], [seq.row_slots], depth, self.device)
        pool.bind_prefill(row, T, table)
        step = runner.context(ids, None, None)
        step.ctx.cache = pool
        e = runner.embed(ids, step)
        injected = runner.inject(e)
        # As `Session.initial_states` for one unpadded row: no draw at all when init_scale is 0.
        scale = opts.init_scale
        s = torch.zeros_like(e) if scale == 0 else runner.initial_state(e, scale, generators[0])
        for i in range(depth):
            s = runner.core_step(s, injected, e, i, step)
        logits = runner.predict(s, step, last_only=not request.prompt_logprobs)[0]  # [T or 1, V]
        pool.close_prefill(row, T, depth, seq.row_slots)

        scores = None
        if request.prompt_logprobs:
            k = request.top_logprobs or 0
            picked, tops = logprobs_of(logits[:-1], ids[0, 1:], k) if T > 1 else ([], [])
            scores = PromptScores([None, *picked], [None, *tops])
        if opts.max_new_tokens == 0:
            return None, None, scores
        seq.last_state = s[0, -1]
        first = self._choose([seq], logits[-1:], [depth], ["prefill"])[0]
        seq.pending = first.token
        self.rows.append(seq)
        return seq, first, scores

    @torch.inference_mode()
    def remove(self, seq: Sequence) -> None:
        """Free a row; the last row moves into its place."""
        row = self.rows.index(seq)
        last = len(self.rows) - 1
        if row != last:
            moved = self.rows[last]
            self.pool.move_row(last, row, moved.length)
            self.rows[row] = moved
        self.rows.pop()

    # ------------------------------------------------------------------ one decode step
    @torch.inference_mode()
    def step(self) -> list[TokenResult]:
        """Feed every row its pending token; returns each row's next token (in row order)."""
        rows = self.rows
        n = len(rows)
        if n == 0:
            return []
        runner, pool, device = self.runner, self.pool, self.device
        V = self.config.vocab_size
        ids = torch.tensor([[r.pending] for r in rows], dtype=torch.long, device=device)
        positions = [r.length for r in rows]
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        limits_list = [r.limit for r in rows]
        depth = max(limits_list)
        row_slots = [r.row_slots for r in rows]
        pool.bind_decode(n, pos, slot_table([r.options.kv_budget for r in rows], row_slots, depth, device))

        step = runner.context(ids, None, None, position_ids=pos[:, None])
        ctx = step.ctx
        ctx.cache = pool
        L = max(positions) + 1
        ctx.past_len = L - 1
        if min(positions) != L - 1:  # rows of different lengths: hide each row's columns past its own
            valid = torch.arange(L, device=device)[None] <= pos[:, None]  # [B, L]
            ctx.key_valid = valid
            ctx.attn_mask = valid[:, None, None, :]  # [B, 1, 1, L]
        e = runner.embed(ids, step)  # [B, 1, h]
        injected = runner.inject(e)
        state = self._initial_states(rows, e)

        # Exit criteria: one statistics object per (criterion, threshold), over its rows.
        groups: dict[tuple[str, float], list[int]] = defaultdict(list)
        for b, r in enumerate(rows):
            if r.options.criterion is not None:
                groups[(r.options.criterion.name, r.options.threshold)].append(b)
        criteria = []
        for b_list in groups.values():
            opts = rows[b_list[0]].options
            crit = ExitCriterion(opts.criterion, opts.threshold)
            idx = torch.tensor(b_list, device=device)
            min_steps = torch.tensor([rows[b].options.min_steps for b in b_list], device=device)
            crit.start(state[idx, 0], V)
            criteria.append((crit, idx, min_steps))
        has_criteria = bool(criteria)
        needs_logits = torch.tensor(
            [r.options.criterion is not None and r.options.criterion.needs_logits for r in rows], device=device
        )
        any_logit_rows = bool(needs_logits.any())
        limits = torch.tensor(limits_list, device=device)
        fixed_code = [self.FIXED if r.options.criterion is None else self.MAX_STEPS for r in rows]
        converged = torch.zeros(n, dtype=torch.bool, device=device)
        steps = torch.zeros(n, dtype=torch.long, device=device)
        running = limits > 0
        logits = None
        shortest = min(limits_list)
        someone_stopped = False
        for i in range(depth):
            if i > 0:
                running &= i < limits
            everyone = not someone_stopped and i < shortest
            if has_criteria and not everyone and not bool(running.any()):
                break
            pool.write_mask = None if everyone else running
            new_state = runner.core_step(state, injected, e, i, step)
            state = new_state if everyone else torch.where(running[:, None, None], new_state, state)
            steps += running
            step_logits = None
            if any_logit_rows:
                wanted = running & needs_logits
                pool.write_mask = wanted  # only these rows' coda entries follow this step
                step_logits = runner.predict(state, step, last_only=True)[:, 0]
                logits = step_logits if logits is None else torch.where(wanted[:, None], step_logits, logits)
            for crit, idx, min_steps in criteria:
                if crit.needs_logits and step_logits is None:
                    continue
                met = crit.update(state[idx, 0], step_logits[idx] if crit.needs_logits else None)
                stopping = met & running[idx] & (i + 1 >= min_steps)
                if bool(stopping.any()):  # the one host sync per group and step that exits need
                    converged[idx] |= stopping
                    running[idx] &= ~stopping
                    someone_stopped = True
        # Rows whose logits are not yet final (fixed depth, latent criteria): one coda pass.
        final = ~needs_logits
        if bool(final.any()):
            pool.write_mask = None if bool(final.all()) else final
            final_logits = runner.predict(state, step, last_only=True)[:, 0]
            logits = final_logits if logits is None else torch.where(final[:, None], final_logits, logits)
        pool.write_mask = None
        pool.close_decode(steps, torch.tensor(row_slots, device=device))

        for b, r in enumerate(rows):
            r.length += 1
            r.last_state = state[b, 0]
        converged_list = converged.tolist()
        reasons = [self.CONVERGED if c else fixed_code[b] for b, c in enumerate(converged_list)]
        results = self._choose(rows, logits, steps.tolist(), reasons)
        for r, res in zip(rows, results):
            r.pending = res.token
        return results

    def _initial_states(self, rows: list[Sequence], e: Tensor) -> Tensor:
        """s_0 `[B, 1, h]` per row: the previous final state (warm start), zeros (init_scale 0),
        or a draw from the row's own generator, as `Session.initial_states` does alone."""
        if all(not r.options.warm_start and r.options.init_scale == 0 for r in rows):
            return torch.zeros_like(e)
        parts = []
        for b, r in enumerate(rows):
            opts = r.options
            if opts.warm_start:
                parts.append(r.last_state.to(e.dtype)[None])
            elif opts.init_scale == 0:
                parts.append(torch.zeros_like(e[b, 0])[None])
            else:
                parts.append(self.runner.initial_state(e[b : b + 1], opts.init_scale, r.generators[0])[0, 0][None])
        return torch.cat(parts)[:, None]

    def _choose(self, rows: list[Sequence], logits: Tensor, steps: list[int], reasons: list[str]) -> list[TokenResult]:
        """Each row's token from its logits `[B, V]` with its own chooser; logprobs when asked for."""
        tokens = logits.argmax(-1)
        plain = [not r.options.do_sample and r.chooser.seen is None for r in rows]
        if not all(plain):
            tokens = tokens.clone()
            for b, r in enumerate(rows):
                if not plain[b]:
                    tokens[b] = r.chooser.choose(logits[b : b + 1], [0])[0]
        for b, r in enumerate(rows):
            r.chooser.observe(tokens[b : b + 1])
            r.generated += 1
        token_list = tokens.tolist()
        results = [TokenResult(t, s, why) for t, s, why in zip(token_list, steps, reasons)]
        want = [b for b, r in enumerate(rows) if r.request.top_logprobs is not None]
        if want:
            k = max(rows[b].request.top_logprobs for b in want)
            idx = torch.tensor(want, device=logits.device)
            picked, tops = logprobs_of(logits[idx], tokens[idx], k)
            for j, b in enumerate(want):
                results[b].logprob = picked[j]
                results[b].top = tops[j][: rows[b].request.top_logprobs]
        return results
