"""Shared setup of the serving pool and runtime-LoRA tests: the batch decoder's join-and-leave schedule
(tests/test_serve_window_pool*.py) and a live server with runtime loads whose decode steps can be held
(tests/test_serve_unload_drain.py, tests/test_review_s33.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving import build_app
from recurrent_depth.serving.batch import BatchDecoder, RowRequest
from tests.test_serving import LiveServer

# ------------------------------------------------------------------------------ the batch decoder's pool


def serve_rows(model, work: list[tuple[list[int], dict]], max_rows: int = 3,
               kv_quant: str | None = None) -> tuple[dict[int, list], BatchDecoder, int]:
    """Run `work` ((prompt, generate kwargs) per job) through one BatchDecoder: rows join as room frees (at most
    `max_rows` at once, later ones mid-way through others) and leave when done (the last row moves into the freed
    one). Returns each job's results (job index: results), the decoder and its largest windowed-layer allocation
    (bytes) over the run."""
    dec = BatchDecoder(model, max_rows=max_rows, kv_quant=kv_quant)
    out: dict[int, list] = {}
    pending = list(range(len(work)))
    peak = 0
    while pending or len(dec):
        if pending and len(dec) < max_rows:
            j = pending.pop(0)
            prompt, kw = work[j]
            opts = GenerationOptions(**kw).validate(model.config.mean_recurrence)
            _, first, _ = dec.add(RowRequest(prompt, opts, j, top_logprobs=0), tag=j)
            out[j] = [first]
        for seq, result in dec.step():
            out[seq.tag].append(result)
            if len(out[seq.tag]) >= work[seq.tag][1]["max_new_tokens"]:
                dec.remove(seq)
        peak = max(peak, windowed_nbytes(dec))
    return out, dec, peak


def windowed_nbytes(dec: BatchDecoder) -> int:
    """Bytes the decoder's pool holds for its windowed layers (keys and values, float or code rows)."""
    return sum(K.nbytes + V.nbytes for base, (K, V) in dec.pool.kv.items() if base in dec.pool.windows)


# ------------------------------------------------------------------------------ a live server, runtime LoRA
WAIT = 10.0  # seconds for what takes milliseconds unless it waits for a held request
BODY = {"max_tokens": 4, "temperature": 0, "init_scale": 0, "num_steps": 3, "ignore_eos": True}


def runtime_lora_server(model_dir: Path, root: Path, **settings) -> Iterator[LiveServer]:
    """A live server of `model_dir` with runtime loads from `root` on, no adapter at start, one row (a second
    request waits); `settings`: more `build_app` arguments. For a module fixture: `yield from` it."""
    app = build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root, max_batch=1,
                    **settings)
    with LiveServer(app) as server:
        yield server


def wait_for(condition, what: str) -> None:
    """Poll `condition` until true; fail with `what` after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, **BODY}, timeout=60)


def run(results: dict, key: str, call, *args) -> threading.Thread:
    """`call(*args)` on a thread of its own, its result into results[key]."""
    thread = threading.Thread(target=lambda: results.update({key: call(*args)}), daemon=True)
    thread.start()
    return thread


class Gates:
    """The scheduler's decode steps wait while the gate of a prompt in the batch is closed (`hold`)."""

    def __init__(self, scheduler, *prompts: list[int]) -> None:
        self.scheduler, self.step = scheduler, scheduler.batch.step
        self.gates = {tuple(p): threading.Event() for p in prompts}
        self.inside = threading.Event()  # (a step has waited)

    def hold(self):
        for seq in self.scheduler.batch.rows:
            gate = self.gates.get(tuple(seq.tag.row.prompt))
            if gate is not None and not gate.is_set():
                self.inside.set()
                gate.wait(60)
        return self.step()

    def open(self, prompt: list[int]) -> None:
        self.gates[tuple(prompt)].set()

    def __enter__(self) -> Gates:
        self.scheduler.batch.step = self.hold
        return self

    def __exit__(self, *exc) -> None:  # (a failure must not leave the scheduler's thread waiting)
        for gate in self.gates.values():
            gate.set()
        self.scheduler.batch.step = self.step
