"""The server under cancellation and shutdown, as production clients hit it: a long prefill counts as
running (/health, /metrics), a full queue's 429 says when to retry, and a client that stops reading its
stream cannot make shutdown end in uvicorn's cancellation tracebacks."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from recurrent_depth.serving import build_app
from recurrent_depth.serving.transport import Server, make_server
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def test_a_long_prefill_counts_as_running_and_a_full_queue_says_when_to_retry(model_dir):  # noqa: F811
    app = build_app(model_dir, model_name="tiny", max_batch=1, max_queue=1, tokenizer_workers=1)
    scheduler = app.state.scheduler
    hold, inside = threading.Event(), threading.Event()
    prefill = scheduler.batch.add

    def long_prefill(*args, **kwargs):  # a prefill of a deep request over a long prompt
        inside.set()
        hold.wait(30)
        return prefill(*args, **kwargs)

    scheduler.batch.add = long_prefill
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    with LiveServer(app) as live:
        answers: list[httpx.Response] = []
        first = threading.Thread(target=lambda: answers.append(httpx.post(live.url + "/v1/completions", json=body,
                                                                          timeout=60)))
        first.start()
        assert inside.wait(30)
        health = httpx.get(live.url + "/health").json()
        running = metric(live.url, "rdepth_running_sequences")
        second = threading.Thread(target=lambda: answers.append(httpx.post(live.url + "/v1/completions", json=body,
                                                                           timeout=60)))
        second.start()
        deadline = time.monotonic() + 30
        while len(scheduler.waiting) < 1:  # the second request waits for the only row
            assert time.monotonic() < deadline
            time.sleep(0.01)
        full = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        hold.set()
        first.join(60)
        second.join(60)
        idle = httpx.get(live.url + "/health").json()
        idle_running = metric(live.url, "rdepth_running_sequences")
    # the request being prefilled is neither waiting nor (before the fix) running: the server read as idle
    assert (health["running"], health["waiting"], running) == (1, 0, 1.0), health
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
    assert full.headers.get("retry-after") == "1"
    assert [a.status_code for a in answers] == [200, 200]
    assert (idle["running"], idle["waiting"], idle_running) == (0, 0, 0.0), idle


class StalledServer(Server):
    """`rdepth serve`'s server with a short drain, so uvicorn's own limit comes in a test's time."""

    DRAIN_S = 1.5
    ABORT_S = 1.0


def test_shutdown_aborts_a_stream_whose_client_stopped_reading(model_dir):  # noqa: F811
    """A client that keeps its connection but reads nothing blocks its stream's send on a full socket: the
    503 cannot go out, and uvicorn cancelled the handler at its limit with an ERROR traceback."""
    app = build_app(model_dir, model_name="tiny", num_steps=2, tokenizer_workers=1)
    base = make_server(app, host="127.0.0.1", port=0, log_level="warning", read_timeout=30.0, grace=0.2,
                       drain=app.state.drain)
    server = StalledServer(base.config, grace=0.2, drain=app.state.drain)
    records: list[logging.LogRecord] = []  # (after uvicorn's Config, which sets its loggers' handlers)
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "recurrent_depth")]
    for lg in loggers:
        lg.addHandler(handler)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (accepted sockets inherit it)
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    client = socket.socket()
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        port = listener.getsockname()[1]
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "n": 4, "logprobs": 20, "stream": True,
                           "ignore_eos": True}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        url = f"http://127.0.0.1:{port}"
        while httpx.get(url + "/health").json()["running"] or app.state.scheduler.waiting:  # all generated ...
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # ... and the client reads none of it
        start = time.monotonic()
        server.should_exit = True
        thread.join(30)
        took = time.monotonic() - start
    finally:
        client.close()
        for lg in loggers:
            lg.removeHandler(handler)
    assert not thread.is_alive()
    counted = app.state.scheduler.metrics.requests
    assert sum(n for (endpoint, _), n in counted.items() if endpoint == "completions") == 1, counted
    logged = "\n".join(r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in records)
    assert "CancelledError" not in logged and "timeout graceful shutdown exceeded" not in logged, logged
    assert took < 0.2 + StalledServer.DRAIN_S + 1.0, took
