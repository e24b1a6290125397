"""Continuous batching at the depth level: every row recurs at its own pace.

`BatchDecoder` keeps the running sequences as rows 0..n-1 of a `SlotKVPool`. `add` runs one
request's prompt (its own prefill, at full depth) into a free row and picks its first token.
`step` is one *iteration*, which advances every row by one recurrence step:

1. start: rows holding a chosen token embed it (prelude) and draw s_0 (random from the row's own
   generator, zeros, or the previous token's final state with warm start);
2. recur: one core step for every row that is inside a token, each at its own step index (so at
   its own KV slot), with its own exit criterion and threshold;
3. finish: rows that met their criterion or reached their depth read their logits (coda), fill
   the KV slots they did not reach with their deepest entry, and choose their next token.

Under `exit_kv="compute"` (the Ouro reference's loop) a row whose criterion holds keeps its state
of that step as its output (`exit_state`) and recurs on to its depth for the KV of every step; it
finishes there, read out at the exit state (the prompt's last position likewise, in `add`).

A row therefore starts its next token as soon as its previous one exits, instead of waiting for
the deepest row of the batch: adaptive exit saves real compute. Rows at the same fixed depth
start their tokens together (a row that joins such a cohort waits for its next token boundary),
which keeps a batch of fixed-depth requests in lockstep, with one model call per step for all.

Each row computes what `recurrent_depth.inference.generate` computes for that request alone, in
the same order, from the same generator; a matmul over B rows rounds differently from one row, so
logits are equal to float rounding (~1e-5), and an adaptive exit sitting at its threshold within
that rounding can stop a step earlier or later than alone (docs/serving.md). `remove` frees a row
by moving the last row into its place. The core
runs through the inference package's recurrence engine (`inference.engine.Recurrence`, over the
`FastRunner` of Huginn-layout models, the model's own modules for the other all-attention
architectures, e.g. Ouro): the prefill as `run`, each iteration as `step_rows`;
token choice, per-row generators and exit statistics (`RowCriterion`) are the inference
package's own classes. `add(..., should_stop=)` lets a caller end a prefill between core steps.

`BatchDecoder(model, rows, row_adapters=...)` (the multi-adapter server's, `serving/adapters.py`) mixes LoRA
adapters: `add(..., peft_adapter=NAME)` gives a row its own, which every model call of it adds
(`inference.lora_layers.RowAdapters`), whichever adapter is turned on.

`BatchDecoder(model, rows, kv_quant=SPEC)` keeps every row's entries as code rows
(`kv_pool.QuantizedSlotKVPool`): each row then equals `generate(..., kv_quant=SPEC)` alone, and
takes requests whose `kv_quant` is SPEC or unset.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.inference.cache import layer_windows
from recurrent_depth.inference.criteria import ExitCriterion, Gate, RowCriterion, gate_for
from recurrent_depth.inference.engine import Pass, Recurrence
from recurrent_depth.inference.lora_layers import RowAdapters
from recurrent_depth.inference.options import ResolvedOptions
from recurrent_depth.inference.quant_cache import KVQuant, kv_quant_for_model
from recurrent_depth.inference.runner import Step
from recurrent_depth.inference.sampling import RowGenerators, TokenChooser
from recurrent_depth.inference.session import adaptive_schedule
from recurrent_depth.model.recurrent import all_attention
from recurrent_depth.serving.kv_pool import SlotKVPool, make_pool


@dataclass
class RowRequest:
    """One sequence to generate.

    options: validated `ResolvedOptions` (autoregressive mode). seed: the row's generator seed.
    top_logprobs: None for no logprobs, else how many alternatives to report per token (0 = only
    the chosen token's). prompt_logprobs: also score the prompt tokens (OpenAI `echo` + `logprobs`).
    """

    prompt: list[int]
    options: ResolvedOptions
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


def prefill_prompt(engine: Recurrence, pass_: Pass, opts: ResolvedOptions, generator: torch.Generator | None,
                   gate: Gate | None, vocab_size: int) -> tuple[Tensor, int]:
    """The core steps of one unpadded prompt `pass_` as its session alone runs them (`Session.prefill`,
    `computing_prefill`, `adaptive_prefill`): s_0, then `num_steps` steps; under exit_kv="compute" every
    step runs and the last position is read at the step its criterion holds; under `exit_in_prefill` the
    positions stop together where the criterion holds. Returns (raw states `[1, T, h]`, the steps its
    first token took).

    The batch's prefill and the prompt scores of a request generated alone both run this, so they write
    (and, with a quantized cache, calibrate on) the KV entries their session writes, in the same order."""
    # As `Session.initial_states` for one unpadded row: no draw at all when init_scale is 0 (s_0 = e for Ouro).
    zeros = opts.init_scale == 0 and engine.runner.model.config.state_init == "random"
    s = torch.zeros_like(pass_.e) if zeros else engine.initial_state(pass_.e, opts.init_scale, generator)
    if opts.criterion is None or not (opts.exit_kv == "compute" or opts.exit_in_prefill):
        return engine.run(s, pass_, opts.num_steps), opts.num_steps
    criterion = ExitCriterion(opts.criterion, opts.threshold, gate)
    if opts.exit_kv == "compute":
        s, _, used, _ = engine.run_computing(s, pass_, criterion, vocab_size, max_steps=opts.num_steps,
                                             min_steps=opts.min_steps, check_every=opts.check_every)
    else:
        schedule = adaptive_schedule(opts.num_steps, opts.max_steps, opts.min_steps, opts.check_every,
                                     opts.min_steps_rule)
        s, _, used, _ = engine.run_adaptive(s, pass_, criterion, vocab_size, **schedule)
    return s, int(used[0])


@dataclass(eq=False)
class Sequence:
    """A running row: its request, generator and token chooser, and where it is.

    length: cache columns written (prompt + finished tokens); the current token sits at column
    `length`. pending: the chosen token not yet fed. phase: steps run for the current token, or
    None while the row waits to start its pending token.
    """

    request: RowRequest
    generators: RowGenerators
    chooser: TokenChooser
    length: int
    pending: int = -1
    phase: int | None = None
    exit_step: int | None = None  # exit_kv="compute": the step the criterion held at (None: not yet)
    tag: object = None  # the caller's handle
    peft_adapter: str | None = None  # the peft name of the LoRA adapter the row adds (None: the base alone)
    # The request never changes once its row exists, so what follows from its options is computed once
    # (the scheduler asks for these several times per row and step).

    @cached_property
    def options(self) -> ResolvedOptions:
        return self.request.options

    @cached_property
    def adaptive(self) -> bool:
        return self.options.criterion is not None

    @cached_property
    def computing(self) -> bool:
        """exit_kv="compute": the row recurs on to its depth after its criterion holds."""
        return self.adaptive and self.options.exit_kv == "compute"

    @cached_property
    def limit(self) -> int:
        """The most steps a token may run: max_steps with an exit criterion, else num_steps."""
        return self.options.max_steps if self.adaptive else self.options.num_steps

    @cached_property
    def row_slots(self) -> int:
        """Core KV slots this row uses (its policy's slot rule at its deepest step)."""
        return self.options.policy.slots.num_slots(self.options.deepest_step)

    def slot(self, step: int) -> int:
        """The KV slot of core step `step` under the row's slot rule."""
        return self.options.policy.slots.slot(step)

    @cached_property
    def criterion_key(self) -> tuple[str, float] | None:
        opts = self.options
        return (opts.criterion.name, opts.threshold) if opts.criterion is not None else None


class BatchDecoder:
    """Rows of independent requests decoded together, one recurrence step per `step()`."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """All-attention models, of any block layout (the fused runner takes Huginn's; the others, e.g. Ouro,
        run the model's own modules over the same pool), with or without per-layer windows (each row's
        window ends at its own column: `attention.window_mask`)."""
        return all_attention(model)

    @staticmethod
    def runs(options: ResolvedOptions) -> bool:
        """Whether the batch's step loop implements these options: the official code's schedule
        (exit in prefill, its min_steps rule past step 0, check every n steps), the normed warm
        start and GradMem (its memory written by gradient steps before the prefill) run alone,
        through `stream_generate`."""
        adaptive = options.criterion is not None
        return not (
            (adaptive and (options.exit_in_prefill or options.check_every > 1
                           or (options.min_steps_rule == "skip" and options.min_steps > 0)))
            or (options.warm_start and options.warm_start_source == "normed")
            or options.gradmem_tokens > 0
            or options.ttt_params is not None  # TTT-E2E: generates from its own adapted weights
        )

    def takes_kv_quant(self, kv_quant: str | None) -> bool:
        """Whether a request's `kv_quant` is what the pool stores (unset: whatever the pool stores)."""
        return kv_quant is None or KVQuant.parse(kv_quant) == self.kv_quant

    def __init__(self, model: torch.nn.Module, max_rows: int, kv_quant: KVQuant | str | None = None,
                 row_adapters: RowAdapters | None = None) -> None:
        """row_adapters: the LoRA layers' per-row adapters (the multi-adapter server's `ServedAdapters.rows`, where
        they mix): each row adds the adapter `add` gave it, in every model call, whichever adapter is on."""
        self.model = model
        self.config = model.config
        self.kv_quant = None if kv_quant is None else kv_quant_for_model(model, kv_quant)
        self.row_adapters = row_adapters
        self.engine = self._new_engine()  # over the fast runner (see `supports`), built without autograd
        self.runner = self.engine.runner
        self.device = model.device
        self.max_rows = max_rows
        self.rows: list[Sequence] = []
        self.iterations = 0  # step() calls that ran the core
        self.core_rows = 0  # rows summed over those calls
        # Contexts of recent state-reading calls (core, coda), reused while the same rows sit at
        # the same columns: a fixed-depth cohort keeps one context for every step of a token.
        self._contexts: dict[tuple, tuple[Step, Tensor, Tensor]] = {}
        self._allocate()

    def _allocate(self) -> None:
        h, V, R = self.config.hidden_size, self.config.vocab_size, self.max_rows
        dtype = self.model.dtype
        # sliding-window layers hold each row's recent columns (kv_pool; `RDEPTH_FULL_WINDOW_CACHE=1`: every column)
        self.pool = make_pool(self.kv_quant, self.device, layer_windows(self.model), self.config.head_dim)
        # Per-row tensors, indexed like the pool's rows: the current token's state and injection,
        # and the latest logits of rows whose exit criterion reads them.
        self.state = torch.zeros(R, h, dtype=dtype, device=self.device)
        self.embedded = torch.zeros(R, h, dtype=dtype, device=self.device)
        self.injected = torch.zeros(R, h, dtype=dtype, device=self.device)
        self.logits = torch.zeros(R, V, device=self.device)
        self.exit_state = torch.zeros(R, h, dtype=dtype, device=self.device)  # exit_kv="compute" rows' output
        self.criteria: dict[tuple[str, float], RowCriterion] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def rebuild_runner(self) -> None:
        """Build the runner anew from the model as it is now, e.g. after its active LoRA adapter changed (the fast
        runner reads weights and low-rank terms when it is built); only while no row runs."""
        if self.rows:
            raise RuntimeError(f"the runner cannot change under {len(self.rows)} running rows")
        on_step = self.engine.on_step
        self.engine = self._new_engine()
        self.engine.on_step = on_step
        self.runner = self.engine.runner
        self._contexts.clear()  # (they hold the old runner's steps)

    def _new_engine(self) -> Recurrence:
        """The recurrence over a new runner; with row adapters, one that adds each row's own (`RowAdapters`)."""
        with self.row_adapters.for_runner() if self.row_adapters is not None else nullcontext():
            return Recurrence(self.model)

    def _adapters_of(self, rows: list[int]) -> AbstractContextManager:
        """The context of a model call of `rows`: each adds its own adapter (no row adapters: nothing)."""
        if self.row_adapters is None:
            return nullcontext()
        return self.row_adapters.use([self.rows[b].peft_adapter for b in rows])

    def reset(self) -> None:
        """Forget every row and the KV storage (after an error left them in an unknown state)."""
        self.rows = []
        self._contexts.clear()
        self._allocate()

    # ------------------------------------------------------------------ joining and leaving
    @torch.inference_mode()
    def add(self, request: RowRequest, tag: object = None, should_stop: Callable[[], bool] | None = None,
            peft_adapter: str | None = None) -> tuple[Sequence | None, TokenResult | None, PromptScores | None]:
        """Prefill a request into a new row and choose its first token; peft_adapter: the peft name of the LoRA
        adapter the row adds (None: the base; needs the batch's `row_adapters`).

        Returns (the row, its first token, prompt scores when asked for). With max_new_tokens = 0
        only the prompt is scored and no row is kept (row and token are None). should_stop is
        checked between the prefill's core steps; when it fires, `inference.engine.Stopped` is
        raised and no row is kept.
        """
        if len(self.rows) >= self.max_rows:
            raise RuntimeError(f"the batch is full ({self.max_rows} rows)")
        if peft_adapter is not None and self.row_adapters is None:
            raise ValueError(f"a row of adapter {peft_adapter!r} cannot join a batch without row adapters: build the "
                             "BatchDecoder with row_adapters")
        request = replace(request, options=request.options.bound(self.config.core_layers))
        opts = request.options
        if not SlotKVPool.takes(opts.policy):
            raise ValueError(f"kv_policy {opts.policy.name!r} cannot join the batch (see SlotKVPool.takes)")
        if not self.takes_kv_quant(opts.kv_quant):
            raise ValueError(f"kv_quant={opts.kv_quant!r} cannot join a batch whose KV pool stores "
                             f"{self.kv_quant.name if self.kv_quant else 'full-precision entries'}")
        gate = gate_for(opts.criterion, self.model)  # a ValueError for a gate the model lacks, before any work
        T = len(request.prompt)
        generators = RowGenerators([request.seed], 1, self.device)
        chooser = TokenChooser(opts, self.config.vocab_size, generators)
        ids = torch.tensor([request.prompt], dtype=torch.long, device=self.device)
        chooser.observe_prompt(ids, torch.ones_like(ids, dtype=torch.bool))
        seq = Sequence(request, generators, chooser, length=T, tag=tag, peft_adapter=peft_adapter)
        row = len(self.rows)
        self.pool.reserve(seq.row_slots, row + 1, T + opts.max_new_tokens,
                          max_rows=self.max_rows, max_capacity=self.config.max_seq_len)

        engine, pool = self.engine, self.pool
        depth = opts.num_steps  # the prompt runs at full depth
        table = torch.tensor([[seq.slot(i) for i in range(depth)]], dtype=torch.long)
        pool.set_policy(row, opts.policy)
        pool.bind_prefill(row, T, table)
        adapters = nullcontext() if self.row_adapters is None else self.row_adapters.use([peft_adapter])
        with adapters:
            pass_ = engine.begin(ids, None, pool)
            engine.should_stop = should_stop
            try:
                s, first_steps = prefill_prompt(engine, pass_, opts, generators[0], gate, self.config.vocab_size)
            finally:
                engine.should_stop = None
            logits = engine.readout(s, pass_, last_only=not request.prompt_logprobs)[0]  # [T or 1, V]
        pool.close_prefill(row, T, depth, seq.row_slots)

        scores = None
        if request.prompt_logprobs:
            k = request.top_logprobs or 0
            picked, tops = logprobs_of(logits[:-1], ids[0, 1:], k) if T > 1 else ([], [])
            scores = PromptScores([None, *picked], [None, *tops])
        if opts.max_new_tokens == 0:
            return None, None, scores
        self.state[row] = s[0, -1]  # what a warm start continues from
        first = self._choose([seq], logits[-1:], [first_steps], ["prefill"])[0]
        seq.pending = first.token
        self.rows.append(seq)
        key = seq.criterion_key
        if key is not None and key not in self.criteria:
            self.criteria[key] = RowCriterion(opts.criterion, opts.threshold, self.max_rows, self.config.vocab_size,
                                              gate)
        return seq, first, scores

    @torch.inference_mode()
    def remove(self, seq: Sequence) -> None:
        """Free a row; the last row moves into its place."""
        row = self.rows.index(seq)
        last = len(self.rows) - 1
        if row != last:
            moved = self.rows[last]
            self.pool.move_row(last, row, moved.length + 1)  # + the column of its current token
            for table in (self.state, self.embedded, self.injected, self.logits, self.exit_state):
                table[row] = table[last]
            for crit in self.criteria.values():
                crit.move(last, row)
            self.rows[row] = moved
        self.rows.pop()
        # A criterion's statistics are per row and restart with each token: drop it with its last row, or
        # requests with ever new thresholds would add one (with [max_rows, ...] tensors) per threshold, forever.
        key = seq.criterion_key
        if key is not None and all(r.criterion_key != key for r in self.rows):
            self.criteria.pop(key, None)

    # ------------------------------------------------------------------ one iteration
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, TokenResult]]:
        """Advance every row by one recurrence step; returns the rows that finished a token."""
        if not self.rows:
            return []
        starting = self._may_start()
        if starting:
            self._start(starting)
        done: list[tuple[int, str]] = [(b, "fixed") for b in starting if self.rows[b].limit == 0]
        recurring = [b for b, r in enumerate(self.rows) if r.phase is not None and r.phase < r.limit]
        if recurring:
            done += self._recur(recurring)
        return self._finish(done) if done else []

    def _may_start(self) -> list[int]:
        """Rows with a pending token that start it now. A fixed-depth row waits while rows of the
        same fixed depth are inside a token, so such rows form one cohort that recurs in lockstep."""
        busy = {r.limit for r in self.rows if not r.adaptive and r.phase is not None}
        return [b for b, r in enumerate(self.rows) if r.phase is None and (r.adaptive or r.limit not in busy)]

    def _select(self, rows: list[int]) -> slice | Tensor:
        """An index for the per-row tables: a slice (a view) when the rows are contiguous."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return torch.tensor(rows, device=self.device)

    def _context(self, rows: list[int], held: list[int], ids: Tensor | None = None
                 ) -> tuple[Step, Tensor, Tensor, Tensor | None]:
        """A model-call context for one token per row in `rows`, each at its own position; `held`: the rows'
        held positions in the pool's windowed layers (`SlotKVPool.hold`).

        Returns (the runner's Step, the rows as a tensor, their columns, their held positions or None where
        they are the columns)."""
        columns = [self.rows[b].length for b in rows]
        if ids is None:  # core / coda calls: each row's current token (layers with a value embedding read it)
            ids = torch.tensor([[self.rows[b].pending] for b in rows], dtype=torch.long, device=self.device)
        step = self.runner.context(ids, None, self.pool, row_columns=columns)
        held_cols = None
        if held != columns:  # windows count keys from each row's held position (only windowed layers read it)
            held_cols = torch.tensor(held, dtype=torch.long, device=self.device)
            step.ctx.query_columns = held_cols[:, None]
        return step, torch.tensor(rows, dtype=torch.long, device=self.device), step.ctx.positions[:, 0], held_cols

    def _bind(self, rows: list[int], ids: Tensor | None = None, core_steps: list[int] | None = None) -> Step:
        """Bind the pool to `rows` for the next model call and return its context."""
        held = self.pool.hold(rows, [self.rows[b].length for b in rows])  # (may move a row's windowed columns)
        if ids is None:  # the context depends only on which rows, their columns and their current tokens
            key = (tuple(rows), tuple((self.rows[b].length, self.rows[b].pending) for b in rows), tuple(held))
            if key not in self._contexts:
                if len(self._contexts) >= 16:
                    self._contexts.clear()
                self._contexts[key] = self._context(rows, held)
            step, row_index, cols, held_cols = self._contexts[key]
        else:
            step, row_index, cols, held_cols = self._context(rows, held, ids)
        core_slots = None if core_steps is None else [self.rows[b].slot(i) for b, i in zip(rows, core_steps)]
        self.pool.bind_tokens(rows, row_index, cols, step.ctx.past_len + 1, core_slots, core_steps, held_cols)
        return step

    def _start(self, rows: list[int]) -> None:
        """Embed each row's pending token and set its initial state (as `Session.initial_states`)."""
        seqs = [self.rows[b] for b in rows]
        index = self._select(rows)
        ids = torch.tensor([[r.pending] for r in seqs], dtype=torch.long, device=self.device)
        step = self._bind(rows, ids)
        with self._adapters_of(rows):
            e = self.runner.embed(ids, step)  # [m, 1, h]
            self.embedded[index] = e[:, 0]
            self.injected[index] = self.runner.inject(e)[:, 0]
        for j, (b, r) in enumerate(zip(rows, seqs)):
            opts = r.options
            if opts.warm_start:
                continue  # the state still holds the previous token's final state
            if opts.init_scale == 0 and self.runner.model.config.state_init == "random":
                self.state[b] = 0
            else:
                self.state[b] = self.runner.initial_state(e[j : j + 1], opts.init_scale, r.generators[0])[0, 0]
        for r in seqs:
            r.phase = 0
            r.exit_step = None
        for key, crit in self.criteria.items():
            members = [b for b, r in zip(rows, seqs) if r.criterion_key == key]
            if members:
                sub = torch.tensor(members, device=self.device)
                crit.start(sub, self.state[sub])

    def _recur(self, rows: list[int]) -> list[tuple[int, str]]:
        """One core step for each row at its own step; returns the rows that exit, with why."""
        seqs = [self.rows[b] for b in rows]
        index = self._select(rows)
        step = self._bind(rows, core_steps=[r.phase for r in seqs])
        pass_ = Pass(step, self.embedded[index].unsqueeze(1), self.injected[index].unsqueeze(1))
        with self._adapters_of(rows):
            state = self.engine.step_rows(self.state[index].unsqueeze(1), pass_)[:, 0]
        self.state[index] = state
        self.iterations += 1
        self.core_rows += len(rows)
        for r in seqs:
            r.phase += 1
        # Rows still deciding: computing rows past their exit step only run on for their KV.
        deciding = [(b, r) for b, r in zip(rows, seqs) if r.adaptive and r.exit_step is None]
        reading = [b for b, r in deciding if self.criteria[r.criterion_key].needs_logits]
        if reading:  # output-based criteria: logits after every step (the coda's KV follows along)
            read_index = self._select(reading)
            with self._adapters_of(reading):
                self.logits[read_index] = self.runner.predict(self.state[read_index].unsqueeze(1),
                                                              self._bind(reading), last_only=True)[:, 0]
        converged = set()
        for key, crit in self.criteria.items():
            members = [b for b, r in deciding if r.criterion_key == key]
            if not members:
                continue
            sub = torch.tensor(members, device=self.device)
            met = crit.update(sub, self.state[sub], self.logits[sub] if crit.needs_logits else None).tolist()
            converged |= {b for b, m in zip(members, met) if m and self.rows[b].phase >= self.rows[b].options.min_steps}
        done = []
        for b, r in zip(rows, seqs):
            if b in converged and r.computing:  # keep its output, recur on for the KV
                r.exit_step = r.phase
                self.exit_state[b] = self.state[b]
            if b in converged and not r.computing:
                done.append((b, "converged"))
            elif r.phase >= r.limit:
                done.append((b, "converged" if r.exit_step is not None else "max-steps" if r.adaptive else "fixed"))
        return done

    def _finish(self, done: list[tuple[int, str]]) -> list[tuple[Sequence, TokenResult]]:
        """Logits, KV fill and the next token for rows whose current token exited."""
        rows = [b for b, _ in done]
        seqs = [self.rows[b] for b in rows]
        index = self._select(rows)
        for b, r in zip(rows, seqs):
            if r.exit_step is not None:  # read out (and warm-start) at the exit state
                self.state[b] = self.exit_state[b]
        # Rows whose criterion does not read logits (fixed depth, latent criteria): one coda pass.
        unread = [b for b, r in zip(rows, seqs) if not (r.adaptive and self.criteria[r.criterion_key].needs_logits)]
        if unread:
            unread_index = self._select(unread)
            with self._adapters_of(unread):
                self.logits[unread_index] = self.runner.predict(self.state[unread_index].unsqueeze(1),
                                                                self._bind(unread), last_only=True)[:, 0]
        self.pool.close_tokens(rows, [r.length for r in seqs], [r.phase for r in seqs], [r.row_slots for r in seqs])
        steps = [r.phase if r.exit_step is None else r.exit_step for r in seqs]
        results = self._choose(seqs, self.logits[index], steps, [why for _, why in done])
        for r, result in zip(seqs, results):
            r.length += 1
            r.phase = None
            r.pending = result.token
        return list(zip(seqs, results))

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
        results = [TokenResult(t, s, why) for t, s, why in zip(tokens.tolist(), steps, reasons)]
        want = [b for b, r in enumerate(rows) if r.request.top_logprobs is not None]
        if want:
            k = max(rows[b].request.top_logprobs for b in want)
            idx = torch.tensor(want, device=logits.device)
            picked, tops = logprobs_of(logits[idx], tokens[idx], k)
            for j, b in enumerate(want):
                results[b].logprob = picked[j]
                results[b].top = tops[j][: rows[b].request.top_logprobs]
        return results
