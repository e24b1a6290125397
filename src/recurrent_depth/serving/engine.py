"""The continuous-batching scheduler (`BatchScheduler`): one thread that owns the model and runs every
request, an iteration at a time.

Each iteration it (1) drops sequences whose client left or whose time ran out, (2) admits waiting
requests into free rows (their prefill, up to a prompt-token budget per iteration, so running rows
are not starved), (3) advances every running row of the batch by one recurrence step
(`BatchDecoder.step`; rows that finish a token deliver it) and (4) advances each solo session
(speculative decoding, unsupported mixers) by one token. A prefill or a solo token checks its
job's deadline between core steps (the recurrence engine's `should_stop`), so a request past its
timeout ends within one core step with a 504; `last_progress` is the time of the last core step.
Requests therefore join and leave the
running batch between steps, and each row runs at its own depth.

The HTTP layer talks to the scheduler through `submit` (non-blocking; a bounded queue refuses with
`QueueFull` instead of growing) and receives `PromptEvent` / `TokenOut` / `Done` / `Failed`
events through each job's `sink`, called on the scheduler thread.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from recurrent_depth.inference.engine import Stopped
from recurrent_depth.inference.options import OptionError
from recurrent_depth.inference.quant_cache import KVQuant, kv_quant_for_model
from recurrent_depth.serving.adapters import ServedAdapters
from recurrent_depth.serving.batch import BatchDecoder, PromptScores, RowRequest, TokenResult
from recurrent_depth.serving.metrics import Metrics
from recurrent_depth.serving.solo import SoloRun
from recurrent_depth.serving.text import TextState

log = logging.getLogger("recurrent_depth.serving")
_ANY = object()  # (`_take_admissible`: no solo job runs, so one of any adapter may start)
MAX_SCHEDULER_SIZE = 1 << 24  # rows, queued requests or prompt tokens per iteration: past any machine's memory


class QueueFull(Exception):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineUnavailable(Exception):
    """The scheduler is stopping or has failed (HTTP 503)."""


class UnknownAdapter(ValueError):
    """A job names a LoRA adapter the scheduler does not serve (HTTP 404: e.g. unloaded since it was checked)."""

    def __init__(self, name: str, served: tuple[str, ...]) -> None:
        super().__init__(f"a job names the LoRA adapter {name!r}, which this scheduler does not serve (its adapters: "
                         f"{list(served)})")
        self.name = name


# ---------------------------------------------------------------------------------------- events
@dataclass
class PromptEvent:
    index: int
    scores: PromptScores


@dataclass
class TokenOut:
    index: int
    token: int
    text: str
    steps: int
    reason: str
    logprob: float | None
    top: list[tuple[int, float]] | None


@dataclass
class Done:
    index: int
    finish_reason: str  # "stop" | "length"
    text: str  # the tail of the text held back until the end
    completion_tokens: int
    core_steps: int
    ttt_flops: float | None = None  # TTT-E2E's inner-loop FLOPs, for usage
    # vLLM's stop_reason: the stop string matched, or the `stop_token_ids` id that ended it (None: the model's
    # eos / end of turn, the length, anything else)
    stop_reason: int | str | None = None


@dataclass
class Failed:
    index: int
    status: int
    message: str
    error_type: str
    code: str | None = None  # the error body's `code`, as a plain request's answer gives it (e.g. "shutting_down")


Event = PromptEvent | TokenOut | Done | Failed


# ---------------------------------------------------------------------------------------- jobs
@dataclass(eq=False)
class Job:
    """One sequence to generate (one choice of one API request).

    solo: run through `stream_generate` (needed for speculative decoding); generation_kwargs
    are then the `generate` arguments. stop_ids end the sequence (the stop token is counted, and
    shown only with include_stop_str_in_output); those of them in reported_stop_ids (the request's
    own, not the model's eos) are its `stop_reason`. text handles stop strings. deadline:
    `time.monotonic()` after which it fails.
    """

    row: RowRequest
    max_tokens: int
    stop_ids: frozenset[int]
    text: TextState
    sink: Callable[[Event], None]
    deadline: float
    index: int = 0
    solo: bool = False
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    finished: bool = False
    completion_tokens: int = 0
    core_steps: int = 0
    first_token_at: float | None = None
    ttt_flops: float | None = None
    # the served name of the LoRA adapter it runs with: what the request's `model` named (`--lora-modules`,
    # `ServedAdapters.names`); None: the base
    served_adapter: str | None = None
    # ... that adapter's peft name, bound by `submit`: the adapter it was accepted for, also once that is unloaded
    # (and its served name loaded again with other weights); the scheduler's identity of the adapter
    peft_adapter: str | None = None
    reported_stop_ids: frozenset[int] = frozenset()

    @property
    def trains(self) -> bool:
        """A TTT-E2E request: it holds a copy of its weight subset while it runs (one at a time)."""
        return self.row.options.ttt_params is not None

    def emit(self, event: Event) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a dead consumer must never stop the engine
            log.debug("dropping an event for a job whose consumer is gone", exc_info=True)


class BatchScheduler:
    """The continuous-batching scheduler: owns the model and runs submitted jobs, an iteration at a time,
    on a background thread (requests join and leave the running batch between steps)."""

    def __init__(
        self,
        model: torch.nn.Module,
        metrics: Metrics | None = None,
        *,
        max_batch: int = 32,
        max_queue: int = 256,
        prefill_tokens: int = 4096,
        kv_quant: str | KVQuant | None = None,
        adapters: ServedAdapters | None = None,
    ) -> None:
        """kv_quant: the server's KV quantization (None: full precision): the batch's pool stores
        code rows, and requests that do not set `kv_quant` use it (see `handlers.Handlers.make_jobs`).
        adapters: the LoRA adapters on `model` that jobs name (`Job.served_adapter`): the batch's rows each add their
        own (`_mixing`), solo jobs run one adapter at a time (`_take_admissible`); where the adapters cannot mix
        (`ServedAdapters.mixes`), every job does."""
        # (upper bounds keep a typo from sizing tensors past int64: --max-batch 10**23 was a TypeError traceback)
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1),
                                 ("prefill_tokens", prefill_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SCHEDULER_SIZE:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer in [{low}, {MAX_SCHEDULER_SIZE}]")
        self.model = model.eval()
        self.metrics = metrics or Metrics()
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens
        self.kv_quant = None if kv_quant is None else kv_quant_for_model(model, kv_quant, "--kv-quant")
        self.adapters = adapters
        if adapters is not None:
            adapters.turn_on(None)  # (the base until a job names an adapter)
        self.batch = (BatchDecoder(model, max_batch, self.kv_quant, row_adapters=self._row_adapters())
                      if BatchDecoder.supports(model) else None)
        # time.monotonic() of the last completed core step or delivered token (None before the first), for /health.
        self.last_progress: float | None = None
        if self.batch is not None:
            self.batch.engine.on_step = self._progress
        self.solos: list[tuple[Job, SoloRun]] = []
        # admitted this iteration, not yet prefilled: out of `waiting`, and running (a long prefill read as idle)
        self.starting: list[Job] = []
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.failure: str | None = None
        self.thread: threading.Thread | None = None
        # runtime LoRA loads / unloads (`load_adapter`, `unload_adapter`), run at the switch point in order
        self.adapter_updates: deque[tuple[Callable[[], None], Future]] = deque()
        # unloads whose drop is not queued yet: adapters unloaded (no longer served: new jobs naming them are refused)
        # that waiting jobs accepted before still need: {peft name: the unload's answer}, until `_queue_drops` queues
        # their drop (`ServedAdapters.retired` holds them too, and keeps them until the drop has run)
        self.pending_unloads: dict[str, Future] = {}
        if adapters is not None:
            self.metrics.gauges["rdepth_lora_adapters"] = lambda: len(self.adapter_names)
        self.metrics.gauges["rdepth_queue_depth"] = lambda: len(self.waiting)
        self.metrics.gauges["rdepth_running_sequences"] = lambda: self.running
        self.metrics.gauges["rdepth_max_batch"] = lambda: self.max_batch
        self.metrics.gauges["rdepth_kv_pool_bytes"] = lambda: self.batch.pool.nbytes() if self.batch is not None else 0

    # ------------------------------------------------------------------ HTTP side
    @property
    def batches(self) -> bool:
        """True when the model runs in the continuous batch (else every request is solo)."""
        return self.batch is not None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The served LoRA adapters' names (`--lora-modules`): what a job's `served_adapter` (a request's `model`)
        may be."""
        if self.adapters is None:
            return ()
        return self.adapters.names

    @property
    def running(self) -> int:
        return (len(self.batch) if self.batch is not None else 0) + len(self.solos) + len(self.starting)

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.stopping and self.thread is not None and self.thread.is_alive()

    def start(self) -> None:
        if self.thread is not None:
            return
        self.thread = threading.Thread(target=self._run, name="rdepth-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs (all or none). Raises QueueFull or EngineUnavailable, or ValueError for a job naming an
        adapter this scheduler lacks (`UnknownAdapter`, a ValueError; refused here: the switch to it would stop the
        engine for every client). The check holds the lock an unload takes, so no job slips in behind one; each job
        gets its adapter's peft name (`Job.peft_adapter`) under it, which it keeps through an unload."""
        with self.cond:
            for job in jobs:
                if job.served_adapter is not None and job.served_adapter not in self.adapter_names:
                    raise UnknownAdapter(job.served_adapter, self.adapter_names)
            if not self.healthy:
                raise EngineUnavailable(self.failure or "the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(
                    f"the server is at capacity ({len(self.waiting)} requests waiting, at most {self.max_queue}); "
                    "retry later"
                )
            for job in jobs:
                job.peft_adapter = (None if job.served_adapter is None
                                    else self._served_adapters().peft_name(job.served_adapter))
            self.waiting.extend(jobs)
            self.cond.notify()

    def load_adapter(self, name: str, directory: str | Path) -> Future:
        """Serve the LoRA adapter in `directory` as `name` too (`ServedAdapters.add`), once nothing runs: the
        future's result is None, or its error a one-line ValueError (nothing changed)."""
        return self._update_adapters(lambda: self._served_adapters().add(name, directory))

    def unload_adapter(self, name: str) -> Future:
        """Stop serving LoRA adapter `name` at once (`ServedAdapters.retire`: a job naming it is then an
        `UnknownAdapter`, and a load may take the name again), and delete its layers (`drop`) once no job accepted
        for it waits or runs: those finish with it, as vLLM's unload leaves them (each holds its peft name,
        `submit`). The future's result is None once the layers are gone; its error a ValueError when no adapter of
        that name is loaded (nothing changed), or the drop's.

        (An unload was a 409 while jobs for the adapter waited: under steady traffic for it every retry met one.)
        The name goes under the lock `submit` takes, so no job for it is queued behind the check; peft's delete of
        the layers runs outside it, at the switch point: submit runs on the HTTP event loop, which a lock held
        through the delete stalled for every request."""
        try:
            adapters = self._served_adapters()
        except ValueError as exc:
            return _failed(exc)
        answer: Future = Future()
        with self.cond:
            if not self.healthy:
                raise EngineUnavailable(self.failure or "the server is shutting down")
            try:
                peft_name = adapters.retire(name)
            except ValueError as exc:
                return _failed(exc)
            self.pending_unloads[peft_name] = answer
            self._queue_drops()
        return answer

    def _queue_drops(self) -> None:
        """Queue the `drop` of each unloaded adapter no waiting job needs any more (lock held): it runs at the
        switch point, once the running jobs, its own among them, have finished (new ones wait meanwhile, as for a
        load). Called before the iteration's admission, so the jobs admitted in the last one already run."""
        for peft_name, answer in list(self.pending_unloads.items()):
            if any(job.peft_adapter == peft_name and not job.cancelled for job in self.waiting):
                continue
            del self.pending_unloads[peft_name]
            # (a future of its own: the drop must run also where the unload's client left, cancelling `answer`)
            done: Future = Future()
            done.add_done_callback(partial(_pass_on, answer))
            self.adapter_updates.append((partial(self._served_adapters().drop, peft_name), done))
            self.cond.notify()

    def _served_adapters(self) -> ServedAdapters:
        if self.adapters is None:
            raise ValueError("this server serves no LoRA adapters: start it with --lora-updates-root DIR")
        return self.adapters

    def _update_adapters(self, update: Callable[[], None]) -> Future:
        """Queue `update` of the served adapters for the scheduler thread, which runs it at the point it switches
        adapters: nothing running (new requests wait until it is done; running ones finish first)."""
        future: Future = Future()
        with self.cond:
            if not self.healthy:
                raise EngineUnavailable(self.failure or "the server is shutting down")
            self.adapter_updates.append((update, future))
            self.cond.notify()
        return future

    def cancel(self, jobs: list[Job]) -> None:
        """The client is gone: free the jobs' rows at the next iteration (no events follow)."""
        with self.cond:
            for job in jobs:
                job.cancelled = True
            self.cond.notify()

    # ------------------------------------------------------------------ scheduler thread
    def _progress(self) -> None:
        self.last_progress = time.monotonic()

    def _expired(self, job: Job) -> Callable[[], bool]:
        """The check the recurrence runs between core steps: the client left or the deadline passed.

        Each check also counts as progress for /health's stall check: it runs between two steps of
        work, and TTT-E2E's inner steps and GradMem's write steps report nothing else (a long one
        made /health answer 503 "stalled" while the engine was busy)."""
        def check() -> bool:
            now = self.last_progress = time.monotonic()
            return job.cancelled or now > job.deadline

        return check

    def _stopped(self, job: Job) -> None:
        if not job.cancelled:
            self._fail(job, 504, "the request timed out during generation", "timeout")

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self.cond:
                        # (`pending_unloads` too: where an unloaded adapter's last job started and ended in one
                        # iteration, no waiting job holds its drop, which `_queue_drops` below queues; asleep, it
                        # never did)
                        while (not self.stopping and not self.waiting and self.running == 0
                               and not self.adapter_updates and not self.pending_unloads):
                            self.cond.wait()
                        if self.stopping:
                            break
                        now = time.monotonic()
                        self._purge_waiting(now)
                        self._queue_drops()  # (an unloaded adapter whose last waiting job started or left)
                        # a LoRA load / unload waits for the running requests to end: none starts meanwhile
                        admitted = [] if self.adapter_updates else self._take_admissible()
                    self._reap(now)
                    # (not before the jobs admitted above start: an update queued since then skipped them, lost,
                    # and an unload's drop deleted the layers they were accepted for)
                    if self.adapter_updates and self.running == 0 and not admitted:
                        self._run_adapter_updates()
                        continue
                    if admitted:
                        self._switch_for(admitted)  # (before `starting`: it switches only while nothing runs)
                    self.starting = admitted
                    while self.starting:
                        self._start(self.starting[0])
                        self.starting.pop(0)
                    if self.batch is not None and len(self.batch):
                        self._decode()
                    for job, run in list(self.solos):
                        self._advance_solo(job, run)
        except BaseException as exc:  # noqa: BLE001 - report any crash of the loop to every client
            self.failure = f"the generation engine stopped: {type(exc).__name__}: {exc}"
            log.error("engine thread crashed:\n%s", traceback.format_exc())
        finally:
            reason = self.failure or "the server is shutting down"
            code = "engine_unavailable" if self.failure else "shutting_down"  # (the handlers' codes for the same)
            with self.cond:
                pending = list(self.waiting)
                self.waiting.clear()
            pending += [seq.tag for seq in (self.batch.rows if self.batch is not None else [])]
            pending += [job for job, _ in self.solos] + self.starting
            for job in pending:
                self._fail(job, 503, reason, "service_unavailable", code)
            with self.cond:
                updates = list(self.adapter_updates)
                self.adapter_updates.clear()
                answers = list(self.pending_unloads.values())  # (unloads whose drop was not queued yet)
                self.pending_unloads.clear()
            for future in [future for _, future in updates] + answers:
                _settle(future, EngineUnavailable(reason))

    def _purge_waiting(self, now: float) -> None:
        """Drop waiting jobs whose client left; fail those whose deadline passed (lock held)."""
        kept: deque[Job] = deque()
        for job in self.waiting:
            if job.cancelled:
                continue
            if now > job.deadline:
                self._fail(job, 504, "the request timed out while waiting in the queue", "timeout")
                continue
            kept.append(job)
        self.waiting = kept

    def _take_admissible(self) -> list[Job]:
        """Waiting jobs that fit the free rows and this iteration's prompt-token budget (lock held)."""
        free = self.max_batch - self.running
        budget = self.prefill_tokens
        out: list[Job] = []
        # TTT-E2E requests run one at a time (each holds a weight copy): while one runs, the
        # others keep their place in the queue and the requests behind them go ahead.
        training = any(job.trains for job, _ in self.solos)
        held: list[Job] = []
        # Where rows do not mix (an adapter that is not a plain low-rank pair), LoRA adapters (--lora-modules) run
        # one at a time. While one runs, its jobs are admitted up to the first
        # job of another; that one and the jobs behind it wait until nothing runs. Then the oldest waiting job's
        # adapter goes next (`_run` switches to it): every job of it waiting now moves to the front, the others
        # keeping their order behind, so they all join this phase, also those the free rows or this iteration's
        # budget leave for later iterations (held back by the first job of another adapter, they had to wait
        # for a phase of their own: prompts over half the budget ran one row per phase).
        # Where the batch's rows mix adapters (`_mixing`), only solo jobs run one adapter at a time: a solo job of
        # another adapter than the running solos' waits, and every solo job behind it too (so it does not starve),
        # while the batch's jobs behind them go ahead.
        mixing = self._mixing()
        solo_adapter: Any = self._adapter_in_use() if self.solos else _ANY
        solo_blocked = False
        if mixing:
            adapter = None  # (unused)
        elif self.waiting and not self.running:
            adapter = self.waiting[0].peft_adapter
            self.waiting = deque(sorted(self.waiting, key=lambda job: job.peft_adapter != adapter))  # (stable)
        else:
            adapter = self._adapter_in_use()
        while self.waiting and len(out) < free:
            job = self.waiting[0]
            if job.trains and training:
                held.append(self.waiting.popleft())
                continue
            if mixing and job.solo:
                if solo_blocked or solo_adapter not in (_ANY, job.peft_adapter):
                    solo_blocked = True
                    held.append(self.waiting.popleft())
                    continue
                solo_adapter = job.peft_adapter
            elif not mixing and job.peft_adapter != adapter:
                break
            cost = len(job.row.prompt)
            if out and cost > budget:
                break
            budget -= cost
            training = training or job.trains
            out.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(held))
        return out

    def _adapter_in_use(self) -> str | None:
        """The peft name of the adapter turned on (`Job.peft_adapter`'s kind; None: the base)."""
        return self.adapters.active if self.adapters is not None else None

    def _mixing(self) -> bool:
        """Whether the batch's rows each add their own LoRA adapter (`ServedAdapters.mixes`): then the adapter
        turned on is the solo jobs' alone."""
        return self.batch is not None and self.batch.row_adapters is not None

    def _row_adapters(self) -> Any:
        """The batch's per-row adapters (`BatchDecoder(row_adapters=)`): the served adapters' where they mix."""
        return self.adapters.rows if self.adapters is not None and self.adapters.mixes else None

    def _switch_for(self, admitted: list[Job]) -> None:
        """Turn on the adapter the admitted jobs need: their first solo job's where rows mix, else the first's."""
        if self._mixing():
            job = next((job for job in admitted if job.solo), None)
            if job is not None and job.peft_adapter != self._adapter_in_use():
                self._switch_adapter(job.peft_adapter)
        elif admitted and admitted[0].peft_adapter != self._adapter_in_use():
            self._switch_adapter(admitted[0].peft_adapter)

    def _switch_adapter(self, peft_name: str | None) -> None:
        """Turn the LoRA adapter of `peft_name` (`Job.peft_adapter`) on (None: the base alone) while nothing runs,
        and rebuild the batch's runner from the switched model; where rows mix, while no solo job runs (the batch's rows
        add their own adapters whichever is on: its runner stays)."""
        assert self.adapters is not None, "a job names an adapter, but the server has none"
        if self._mixing():
            assert not self.solos, "the adapter switches only while no solo job runs"
            self.adapters.turn_on(peft_name)
        else:
            assert self.running == 0, "the adapter switches only while nothing runs"
            self.adapters.turn_on(peft_name)
            if self.batch is not None:
                self.batch.rebuild_runner()
        self.metrics.adapter_switch()

    def _run_adapter_updates(self) -> None:
        """Run the queued LoRA loads / unloads (nothing runs), each answering its future; then the base is on and
        the batch's runner is rebuilt from the changed model (peft's layers changed under it)."""
        assert self.running == 0, "the adapters change only while nothing runs"
        with self.cond:
            updates = list(self.adapter_updates)
            self.adapter_updates.clear()
        for update, future in updates:
            if not future.set_running_or_notify_cancel():  # (its client left before it ran)
                continue
            try:
                update()
            except Exception as exc:  # noqa: BLE001 - the requester's error (a bad adapter), not the engine's
                future.set_exception(exc)
            else:
                future.set_result(None)
        if self.adapters is not None:
            self.adapters.turn_on(None)
        if self.batch is not None:
            self.batch.row_adapters = self._row_adapters()  # (an adapter loaded that cannot mix: phases again)
            self.batch.rebuild_runner()

    def _reap(self, now: float) -> None:
        """Free rows of cancelled jobs; fail jobs past their deadline."""
        if self.batch is not None:
            for seq in list(self.batch.rows):
                job: Job = seq.tag
                if job.cancelled or now > job.deadline:
                    self.batch.remove(seq)
                    if not job.cancelled:
                        self._fail(job, 504, "the request timed out during generation", "timeout")
        for job, run in list(self.solos):
            if job.cancelled or now > job.deadline:
                self._drop_solo(job, run)
                if not job.cancelled:
                    self._fail(job, 504, "the request timed out during generation", "timeout")

    def _start(self, job: Job) -> None:
        """Prefill a job and deliver its first token (or its prompt scores alone)."""
        self.metrics.prompt(len(job.row.prompt))
        try:
            if job.solo or self.batch is None:
                run = SoloRun(self.model, job.row, job.generation_kwargs, tag=job, should_stop=self._expired(job))
                job.ttt_flops = run.stream.session.stats.get("ttt_flops")
                run.watch(self._expired(job), self._progress)
                if job.row.prompt_logprobs:
                    job.emit(PromptEvent(job.index, run.prompt_scores()))
                if job.max_tokens == 0:
                    self._finish(job, "length")
                    return
                self.solos.append((job, run))
                self._advance_solo(job, run)
                return
            peft_adapter = job.peft_adapter if self._mixing() else None  # (else the one on)
            seq, first, scores = self.batch.add(job.row, tag=job, should_stop=self._expired(job),
                                                peft_adapter=peft_adapter)
        except Stopped:  # past its deadline (or abandoned) between two prefill steps
            self._stopped(job)
            return
        except OptionError as exc:  # the request's own options, failing as they run (a TTT lr that diverged)
            self._fail(job, 400, str(exc), "invalid_request_error")
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
            log.error("prefill failed:\n%s", traceback.format_exc())
            self._fail(job, 500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
            return
        if scores is not None:
            job.emit(PromptEvent(job.index, scores))
        if seq is None:
            self._finish(job, "length")
        elif self._deliver(job, first):
            self.batch.remove(seq)

    def _decode(self) -> None:
        """One iteration of the batch: every row advances one recurrence step."""
        rows = list(self.batch.rows)
        iterations, core_rows = self.batch.iterations, self.batch.core_rows
        try:
            finished = self.batch.step()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
            log.error("decode step failed:\n%s", traceback.format_exc())
            self.batch.reset()
            for seq in rows:
                self._fail(seq.tag, 500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
            return
        if self.batch.iterations > iterations:
            self.metrics.decode_step(self.batch.core_rows - core_rows)
        for seq, result in finished:
            if self._deliver(seq.tag, result):
                self.batch.remove(seq)

    def _advance_solo(self, job: Job, run: SoloRun) -> None:
        try:
            result = run.next()
        except Stopped:
            self._drop_solo(job, run)
            self._stopped(job)
            return
        except OptionError as exc:  # the request's own options, failing as they run (a GradMem lr that diverged)
            self._drop_solo(job, run)
            self._fail(job, 400, str(exc), "invalid_request_error")
            return
        except Exception as exc:  # noqa: BLE001
            log.error("solo generation failed:\n%s", traceback.format_exc())
            self._drop_solo(job, run)
            self._fail(job, 500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")
            return
        if result is None:  # the session ended on its own (its stop rules equal ours)
            self._drop_solo(job, run)
            self._finish(job, "length")
        elif self._deliver(job, result):
            self._drop_solo(job, run)

    def _drop_solo(self, job: Job, run: SoloRun) -> None:
        self.solos = [(j, r) for j, r in self.solos if j is not job]
        run.close()

    # ------------------------------------------------------------------ results
    def _deliver(self, job: Job, result: TokenResult) -> bool:
        """Send one token to the job's client; returns True when the job is finished."""
        now = self.last_progress = time.monotonic()
        job.completion_tokens += 1
        job.core_steps += result.steps
        self.metrics.token(result.steps)
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.first_token(now - job.arrival)
        finish = None
        hit = False
        stop_reason: int | str | None = None
        if result.token in job.stop_ids:
            text, finish = job.text.push_stop_token(result.token), "stop"
            if result.token in job.reported_stop_ids:
                stop_reason = result.token
        else:
            text, hit = job.text.push(result.token)
            if hit:
                finish, stop_reason = "stop", job.text.matched
        if finish is None and job.completion_tokens >= job.max_tokens and not self._finishes_round(job):
            finish = "length"
        job.emit(TokenOut(job.index, result.token, text, result.steps, result.reason, result.logprob, result.top))
        if finish is not None:
            self._finish(job, finish, tail=not hit, stop_reason=stop_reason)
        return finish is not None

    @staticmethod
    def _finishes_round(job: Job) -> bool:
        """A speculative row with finish_round commits the whole round that reaches max_tokens, as
        `generate` does: its (solo) session ends it, with reason "length"."""
        options = job.row.options
        return job.solo and options.finish_round and options.mode == "speculative"

    def _finish(self, job: Job, reason: str, tail: bool = True, stop_reason: int | str | None = None) -> None:
        job.finished = True
        text = job.text.flush() if tail else ""
        if tail and job.text.matched is not None:  # the held-back tail completed a stop string (one with a U+FFFD)
            reason, stop_reason = "stop", job.text.matched
        job.emit(Done(job.index, reason, text, job.completion_tokens, job.core_steps, job.ttt_flops, stop_reason))

    def _fail(self, job: Job, status: int, message: str, error_type: str, code: str | None = None) -> None:
        if job.finished:
            return
        job.finished = True
        job.emit(Failed(job.index, status, message, error_type, code))


def _settle(future: Future, exc: BaseException | None) -> None:
    """Answer `future` with `exc` (None: done), unless its caller has called it off."""
    if future.set_running_or_notify_cancel():
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)


def _pass_on(answer: Future, done: Future) -> None:
    """Answer `answer` as `done` ended (a drop's outcome, to the unload that asked for it)."""
    _settle(answer, done.exception())


def _failed(exc: BaseException) -> Future:
    """A future already failed with `exc` (an adapter update refused before it is queued)."""
    future: Future = Future()
    future.set_exception(exc)
    return future


# The scheduler's earlier name (`recurrent_depth.serving.Engine`), kept for code that imports it.
Engine = BatchScheduler
