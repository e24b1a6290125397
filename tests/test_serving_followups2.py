"""Server follow-ups: shutdown error codes, the exit status of a signalled shutdown, the preparation pool's
respawn tasks, log capture of uvicorn's errors, and the chat template's start-up render under a memory limit."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

import recurrent_depth as rd
from recurrent_depth.serving import build_app
from recurrent_depth.serving.chat_template import ChatTemplate
from recurrent_depth.serving.engine import BatchScheduler, Failed
from recurrent_depth.serving.metrics import Metrics
from recurrent_depth.serving.prep import PrepPool, PrepSpec
from recurrent_depth.serving.protocol import APIError, Limits
from recurrent_depth.serving.streaming import Channel, OpenRequests, collect, stream
from recurrent_depth.serving.transport import make_server

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- shutdown codes
class FakeJob:
    """What the shutdown paths read of a job (its choice index) and write (its events)."""

    def __init__(self) -> None:
        self.finished, self.cancelled, self.index, self.events = False, False, 0, []

    def emit(self, event: object) -> None:
        self.events.append(event)


class CancelOnly:
    """A scheduler as `OpenRequests` sees it: it only cancels."""

    def __init__(self) -> None:
        self.cancelled: list[list] = []

    def cancel(self, jobs: list) -> None:
        self.cancelled.append(jobs)


def test_shutdown_gives_streams_and_plain_requests_the_same_error_code():
    """A stream's final error event at shutdown said `"code": null`, a plain request's 503 `"shutting_down"`."""

    async def main() -> tuple[dict, APIError]:
        scheduler = CancelOnly()
        requests = OpenRequests(scheduler)  # type: ignore[arg-type]
        streamed, plain = Channel(), Channel()
        stream_jobs, plain_jobs = [FakeJob()], [FakeJob()]
        requests.add(stream_jobs, time.monotonic(), streamed)  # type: ignore[arg-type]
        requests.add(plain_jobs, time.monotonic(), plain)  # type: ignore[arg-type]
        assert requests.end_all("the server is shutting down") == 2
        assert scheduler.cancelled == [stream_jobs, plain_jobs]
        far = time.monotonic() + 60
        response = stream(stream_jobs, [], streamed, requests, far, lambda e, c: [], lambda: None,  # type: ignore
                          lambda status: None)
        lines = [line async for line in response.body_iterator]
        assert lines[-1] == "data: [DONE]\n\n"
        with pytest.raises(APIError) as raised:
            await collect(None, plain_jobs, [], plain, requests, far)  # type: ignore[arg-type]
        return json.loads(lines[-2][len("data: "):]), raised.value

    event, error = asyncio.run(main())
    assert event["error"]["type"] == "service_unavailable" and event["error"]["code"] == "shutting_down", event
    assert error.status == 503 and error.code == "shutting_down"


def test_the_engines_own_shutdown_failures_carry_a_code():
    """Jobs the engine thread ends as it stops (queued, running) get the same code; a crash says its own."""
    torch_model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64))

    for failure, code in ((None, "shutting_down"), ("the generation engine stopped: boom", "engine_unavailable")):
        scheduler = BatchScheduler(torch_model, Metrics())
        job = FakeJob()
        scheduler.waiting.append(job)  # type: ignore[arg-type]
        scheduler.stopping, scheduler.failure = True, failure
        scheduler._run()  # (the thread's body: it stops at once and ends what is pending)
        (event,) = job.events
        assert isinstance(event, Failed) and event.status == 503 and event.code == code, event


# ---------------------------------------------------------------------------------------- respawn tasks
def test_a_worker_respawn_task_is_held_until_it_is_done(monkeypatch):
    """`_replace` started its respawn with create_task and dropped the task: the loop holds tasks weakly, so
    one could be garbage-collected mid-run (asyncio's docs), leaving the pool a worker short."""
    from recurrent_depth.serving import prep

    release = threading.Event()

    class SlowWorker:
        def __init__(self, spec: object) -> None:
            release.wait(10)

        def kill(self) -> None:
            pass

    monkeypatch.setattr(prep, "Worker", SlowWorker)

    async def main() -> None:
        pool = PrepPool(PrepSpec(None, 64, Limits(32, 2, 64), None, None), workers=1)
        pool.idle = asyncio.Queue()
        old = SlowWorker.__new__(SlowWorker)
        pool.all.add(old)
        pool._replace(old)
        await asyncio.sleep(0.05)
        held = [t for t in pool.respawns if not t.done()]
        assert len(held) == 1  # a strong reference while it runs
        gc.collect()
        release.set()
        await asyncio.wait_for(held[0], 10)
        assert not pool.respawns and pool.idle.qsize() == 1 and len(pool.all) == 1  # replaced, then let go

    asyncio.run(main())


# ---------------------------------------------------------------------------------------- exit status
SIGNALLED = textwrap.dedent("""
    import signal, sys
    from recurrent_depth.serving.transport import make_server

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def drain():
        pass

    for name in sys.argv[1:]:
        server = make_server(app, host="127.0.0.1", port=0, log_level="warning", read_timeout=5.0, grace=0.0,
                             drain=drain, banner=lambda url: "READY " + url)
        server.run()
        print("RETURNED " + name, flush=True)
""")


def test_a_signalled_graceful_shutdown_returns_and_exits_0():
    """uvicorn raised SIGINT / SIGTERM again after its graceful shutdown: `rdepth serve` exited 130 on Ctrl-C,
    and SIGTERM killed it (status -15). Both now return from `run()` (exit 0), with no traceback."""
    order = ["SIGTERM", "SIGINT"]
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED, *order], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = []
    try:
        for name in order:
            line = proc.stdout.readline()
            assert line.startswith("READY http://127.0.0.1:"), (line, proc.poll())
            assert httpx.get(line.split()[1] + "/", timeout=10).status_code == 204
            proc.send_signal(getattr(signal, name))
            seen.append(proc.stdout.readline().strip())
            if proc.poll() is not None and proc.returncode != 0:
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and seen == ["RETURNED SIGTERM", "RETURNED SIGINT"], (proc.returncode, seen, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# ---------------------------------------------------------------------------------------- log capture
def test_a_handler_attached_after_make_server_sees_uvicorns_tracebacks():
    """uvicorn's Config replaces its loggers' handlers: one attached before `make_server` saw nothing, so the
    shutdown test's "no traceback" check could not fail. Attached after, an application error is seen."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        raise RuntimeError("planted")

    async def drain() -> None:
        pass

    before: list[logging.LogRecord] = []
    after: list[logging.LogRecord] = []
    early, late = logging.Handler(), logging.Handler()
    early.emit, late.emit = before.append, after.append
    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(early)
    try:
        server = make_server(app, host="127.0.0.1", port=0, log_level="warning", read_timeout=5.0, grace=0.0,
                             drain=drain)
        uvicorn_log.addHandler(late)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 500
        server.should_exit = True
        thread.join(30)
    finally:
        uvicorn_log.removeHandler(early)
        uvicorn_log.removeHandler(late)
    assert not before
    assert any(r.levelno >= logging.ERROR and r.exc_info and "planted" in str(r.exc_info[1]) for r in after), after


# ---------------------------------------------------------------------------------------- start-up render
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# one step builds a 4 GiB string before any cap can look at it (the caps check values once built)
HUGE = "{{ ' ' | center(4294967296) }}" + CHATML


@pytest.fixture
def chatml_dir(tmp_path):
    from tokenizers import AddedToken

    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    tok = train_tokenizer(["hello world, a tiny corpus for a tiny tokenizer"] * 20, 300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    save_tokenizer(tok, tmp_path)
    return tmp_path, tok.token_to_id("<|im_end|>")


def test_the_start_up_template_render_runs_in_a_worker_not_in_the_server(chatml_dir, monkeypatch):
    """The end-of-turn probe rendered the chat template in the server process at start-up, with a deadline but
    no memory limit. It now runs in a preparation worker (memory limit, timeout); chat still stops there."""
    directory, im_end = chatml_dir
    (directory / "chat_template.jinja").write_text(CHATML)
    renders = []
    real = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **k: renders.append(1) or real(self, *a, **k))
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320))
    app = build_app(model, tokenizer_dir=directory, tokenizer_workers=1, worker_memory=256 << 20)
    codec = app.state.codec

    async def start_and_stop() -> set[int]:
        async with app.router.lifespan_context(app):
            return set(codec.chat_stop_ids)

    assert im_end not in codec.chat_stop_ids
    assert im_end in asyncio.run(start_and_stop())
    assert renders == []  # (a worker process rendered it: this one's render was never called)


def test_a_template_building_a_huge_value_is_stopped_by_the_workers_memory_limit(chatml_dir):
    directory, _ = chatml_dir
    (directory / "chat_template.jinja").write_text(HUGE)

    async def main() -> tuple[set[int], float]:
        pool = PrepPool(PrepSpec(str(directory), 320, Limits(256, 2, 320), None, 256 << 20), workers=1)
        await pool.start()
        try:
            t = time.monotonic()
            ids = await pool.end_of_turn()
            took = time.monotonic() - t
            ok, prompts = await pool.prepare("completions", b'{"model": "m", "prompt": "hello", "max_tokens": 1}')
            assert prompts and prompts[0]  # the worker still serves
            return ids, took
        finally:
            await pool.stop()

    ids, took = asyncio.run(main())
    assert ids == set() and took < 5  # MemoryError in the worker: no end-of-turn token, the server starts
