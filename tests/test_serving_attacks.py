"""Issue 33 (server): per-request KV specs bounded before any allocation, a budget for all request
bodies together, one host per Host header, a named tokenizer that must be one, shutdown with the
engine stuck (every open request a JSON 503), and the first quantized request's kernel load kept
off the scheduler thread. `benchmarks/serving_attacks.py` runs the same attacks at full size."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import httpx
import pytest

import recurrent_depth as rd
from recurrent_depth.accel import quant as accel_quant
from recurrent_depth.accel import quant_cpp
from recurrent_depth.quant import QJL, QuantSpec
from recurrent_depth.serving import Engine, ServerSettings, build_app, create_app
from recurrent_depth.serving.text import TextCodec
from recurrent_depth.serving.transport import host_name
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures
from tests.test_serving_hardening import GuardedServer, raw_exchange

pytestmark = pytest.mark.usefixtures("one_thread")
BODY = {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def budget_server(model_dir):  # noqa: F811
    """Bodies of at most 1 MiB each, 2 MiB together."""
    app = build_app(model_dir, model_name="tiny", max_body_bytes=1 << 20, max_body_total=2 << 20, read_timeout=5.0)
    with LiveServer(app) as live:
        yield live


# ---------------------------------------------------------------------------------------- 9. KV specs
def test_a_kv_spec_past_its_bounds_is_a_400_naming_the_field_at_once(budget_server):
    with pytest.raises(ValueError, match=r"qjl bits must be in \(0, 16\]"):
        QuantSpec.parse("qjl:17")
    with pytest.raises(ValueError, match="at most 16"):
        QJL(64, 16 * 64 + 1)
    assert QuantSpec.parse("qjl:16").build(64).bytes_per_vector == 2 * 64 + 2  # the bound costs what bf16 does
    for spec in ("k=qjl:10000,v=mse:3", "k=qjl:100000", "k=mse:3,seed=" + "9" * 5000, "k=mse:3,seed=" + "9" * 30):
        t = time.monotonic()
        r = httpx.post(budget_server.url + "/v1/completions", json=dict(BODY, kv_quant=spec), timeout=60)
        took = time.monotonic() - t
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "kv_quant", r.text
        assert len(error["message"]) < 400 and took < 1.0, (took, error)


# ---------------------------------------------------------------------------------------- 11. body budget
def _open_body(port: int, size: int, sent: int) -> socket.socket:
    """A connection that has sent a request head announcing `size` bytes and `sent` of them."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % size + _body(size)[:sent])
    return sock


def _body(size: int) -> bytes:
    text = json.dumps(BODY).encode()
    return text + b" " * (size - len(text))


def _answer(sock: socket.socket) -> bytes:
    out = b""
    while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        out += chunk
    sock.close()
    return out


def test_bodies_under_the_limit_cannot_add_up_past_the_budget(budget_server):
    size, part = 1_000_000, 900_000
    first, second = (_open_body(budget_server.port, size, part) for _ in range(2))
    time.sleep(0.5)  # both bodies' first 900 kB are held: 1.8 of the 2 MiB
    third = _answer(_open_body(budget_server.port, size, part))
    assert third.startswith(b"HTTP/1.1 503") and b"body_budget_exceeded" in third and b"retry-after: 1" in third, third
    for sock in (first, second):
        sock.sendall(_body(size)[part:])
    assert all(_answer(s).startswith(b"HTTP/1.1 200") for s in (first, second))
    again = httpx.post(budget_server.url + "/v1/completions", content=_body(size),
                       headers={"Content-Type": "application/json"}, timeout=60)
    assert again.status_code == 200, again.text  # the finished bodies gave their bytes back
    with pytest.raises(ValueError, match="below max_body_bytes"):
        create_app(Engine(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))), TextCodec(None, 256),
                   ServerSettings("tiny", max_body_bytes=1 << 20, max_body_total=1 << 19))


# ---------------------------------------------------------------------------------------- 19. Host, tokenizer
def test_a_host_header_names_exactly_one_host(budget_server):
    for value in ("127.0.0.1:80, evil.com", "127.0.0.1 evil.com", "127.0.0.1:80:80", "evil.com@127.0.0.1", ""):
        assert host_name(value) is None, value
    assert [host_name(v) for v in ("LOCALHOST:8000", "[::1]:80", "::1", "127.0.0.1")] == [
        "localhost", "::1", "::1", "127.0.0.1"]
    for header in (b"Host: 127.0.0.1:80, evil.com\r\n", b"Host: 127.0.0.1\r\nHost: evil.com\r\n"):
        answer = raw_exchange(budget_server.port, b"GET /health HTTP/1.1\r\n" + header + b"\r\n")
        assert answer.startswith((b"HTTP/1.1 421", b"HTTP/1.1 400")), answer  # h11 itself refuses two Hosts


def test_a_named_tokenizer_that_is_missing_or_not_a_file_is_refused_at_start_up(model_dir, tmp_path, capsys):  # noqa: F811
    from recurrent_depth.cli import main

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    for path, match in ((tmp_path / "nope", "no such file"), (fifo, "not a regular file"),
                        (tmp_path, "not a regular file"), (model_dir / "config.json", "not a valid tokenizers")):
        with pytest.raises(ValueError, match=match):
            build_app(model_dir, tokenizer_dir=path)
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        build_app(model_dir, tokenizer_dir=model_dir / "..")
    assert main(["serve", "--model", str(model_dir), "--tokenizer", str(tmp_path / "nope")]) != 0
    assert "no such file or directory" in capsys.readouterr().err
    assert TextCodec(model_dir / "tokenizer.json", 320, 256).has_tokenizer  # the file itself is fine


# ---------------------------------------------------------------------------------------- 10. shutdown
def test_shutdown_with_the_engine_stuck_answers_every_open_request_with_a_json_503(model_dir):  # noqa: F811
    """One request inside a prefill that does not return, others queued, one streaming, one still
    sending its body: all get a JSON 503 (the stream an error event and [DONE]) at the grace period."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "recurrent_depth")]
    for lg in loggers:
        lg.addHandler(handler)
    app = build_app(model_dir, model_name="tiny")
    scheduler = app.state.scheduler
    hold, inside = threading.Event(), threading.Event()
    prefill = scheduler.batch.add

    def stuck_prefill(*args, **kwargs):  # e.g. the first quantized call building its kernels
        inside.set()
        hold.wait(60)
        return prefill(*args, **kwargs)

    scheduler.batch.add = stuck_prefill
    out: dict[str, object] = {}
    try:
        with GuardedServer(app, grace=0.5) as live:
            def plain(i):
                out[i] = httpx.post(live.url + "/v1/completions", json=BODY, timeout=60)

            def streamed():
                with httpx.stream("POST", live.url + "/v1/completions", json=dict(BODY, stream=True),
                                  timeout=60) as r:
                    out["stream"] = (r.status_code, [line for line in r.iter_lines() if line])

            threads = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
            threads.append(threading.Thread(target=streamed))
            threads[0].start()
            assert inside.wait(30)
            for t in threads[1:]:
                t.start()
            deadline = time.monotonic() + 30
            while httpx.get(live.url + "/health").json()["waiting"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            slow = _open_body(live.port, 1000, 10)  # still sending its body
            time.sleep(0.2)
            t = time.monotonic()
            live.server.should_exit = True
            for th in threads:
                th.join(30)
            took = time.monotonic() - t
            out["slow"] = _answer(slow)
            hold.set()
    finally:
        hold.set()
        for lg in loggers:
            lg.removeHandler(handler)
    assert took < 3.0, took  # the 0.5 s grace, not uvicorn's deadline
    for i in range(4):
        r = out[i]
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    status, lines = out["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines
    assert json.loads(lines[-2][len("data: "):])["error"]["type"] == "service_unavailable"
    assert out["slow"].startswith(b"HTTP/1.1 503") and b"shutting_down" in out["slow"], out["slow"]
    logged = "\n".join(r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in records)
    assert "Traceback" not in logged and "Cancel " not in logged and "Exception in ASGI" not in logged, logged


# ---------------------------------------------------------------------------------------- 17. kernel build
def test_a_first_kernel_build_does_not_stop_other_requests(model_dir, monkeypatch):  # noqa: F811
    """The C++ kernels' load (a 2 s stand-in for a first build) runs in a thread the quantized request
    awaits; a plain request sent meanwhile is answered at once, and the quantized one afterwards."""
    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    monkeypatch.setattr(accel_quant, "_KERNELS", accel_quant.CodeKernels(compile=False, cpp=True))
    building = threading.Event()

    def slow_build():
        building.set()
        time.sleep(2.0)
        return None  # "cannot build here": the eager path runs

    monkeypatch.setattr(quant_cpp, "load", slow_build)
    with LiveServer(build_app(model_dir, model_name="tiny", num_steps=2)) as live:
        quantized = {}
        thread = threading.Thread(target=lambda: quantized.update(r=httpx.post(
            live.url + "/v1/completions", json=dict(BODY, max_tokens=2, kv_quant="k=prod:3.5,v=mse:3.5"), timeout=60)))
        thread.start()
        assert building.wait(30)
        t = time.monotonic()
        plain = httpx.post(live.url + "/v1/completions", json=BODY, timeout=60)
        took = time.monotonic() - t
        thread.join(60)
    assert plain.status_code == 200 and took < 1.0, (took, plain.text)
    assert quantized["r"].status_code == 200, quantized["r"].text
