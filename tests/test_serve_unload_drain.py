"""A runtime LoRA unload drains its adapter, as vLLM's (`POST /v1/unload_lora_adapter`; engine.BatchScheduler's
`unload_adapter`, adapters.ServedAdapters' `retire` / `drop`).

An unload asked while requests for the adapter were queued was a 409: under steady traffic for the adapter it
could not be unloaded at all. Now the name stops being served at once (a new request naming it is the usual 404),
the requests already accepted for it, running or queued, streamed or not, finish with the weights they were
accepted with, and its layers go (the unload answers) once none of them is left. The name is free at once: a load
of it with other weights serves those to the requests accepted after it, while the older ones finish on the old."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tests.serving_fixtures import BODY, WAIT, Gates, complete, run, runtime_lora_server, wait_for
from tests.test_serving import model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import adapters  # noqa: F401 - fixtures
from tests.test_serving_lora_updates import load, served, unload

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

RUNNING, QUEUED, LATER = [5, 17, 33, 2], [40, 41, 42], [7, 8]  # the prompts of three requests for "sql"


@pytest.fixture(scope="module")
def root(adapters, tmp_path_factory):  # noqa: F811 - the fixture
    out = tmp_path_factory.mktemp("drain_root")
    for name, path in adapters.items():
        shutil.copytree(path, out / name)
    return out


@pytest.fixture(scope="module")
def live(model_dir, root):  # noqa: F811 - the fixture
    """A server with runtime loads on, no adapter at start, one row (a second request waits), 2 adapters at most."""
    yield from runtime_lora_server(model_dir, root, max_lora_modules=2)


def metric(url: str, name: str) -> float:
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[1])


def streamed(url: str, model: str, prompt: list[int]) -> tuple[int, str, list[str | None]]:
    """A streamed completion: (status, its text, each chunk's finish_reason)."""
    text, reasons = "", []
    body = {"model": model, "prompt": prompt, "stream": True, **BODY}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[len("data: "):])["choices"][0]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
        return response.status_code, text, reasons


def at_rest(url: str, scheduler, count: int) -> None:
    """Nothing runs or waits, no unloaded adapter's layers are left, `count` adapters are served; /metrics says so."""
    # (a client has its answer just before the scheduler frees the row)
    wait_for(lambda: scheduler.running == 0, "a row was not freed")
    assert not scheduler.waiting and not scheduler.adapter_updates
    assert not scheduler.pending_unloads and not scheduler.adapters.retired
    for name, value in (("rdepth_running_sequences", 0), ("rdepth_queue_depth", 0), ("rdepth_lora_adapters", count)):
        assert metric(url, name) == value, name


def test_an_unload_drains_queued_requests_and_a_reload_serves_new_weights(live, root):
    scheduler = live.server.config.app.state.scheduler
    # what each request answers alone: on the sql weights, and on the chat ones (the reload's)
    assert load(live.url, "new", "chat").status_code == 200
    want_new = complete(live.url, "new", LATER).json()["choices"][0]["text"]
    assert unload(live.url, "new").status_code == 200
    assert load(live.url, "sql", "sql").status_code == 200
    want = {tuple(p): complete(live.url, "sql", p).json()["choices"][0]["text"] for p in (RUNNING, QUEUED, LATER)}
    assert want[tuple(LATER)] != want_new  # (else the reload's weights could not be told apart)
    results: dict = {}
    threads: list[threading.Thread] = []
    with Gates(scheduler, RUNNING, QUEUED) as gates:
        try:
            threads.append(run(results, "running", streamed, live.url, "sql", RUNNING))  # (a stream, mid-flight)
            assert gates.inside.wait(WAIT)
            threads.append(run(results, "queued", complete, live.url, "sql", QUEUED))
            wait_for(lambda: len(scheduler.waiting) == 1, "the second request did not queue")
            unloader = run(results, "unload", unload, live.url, "sql")
            threads.append(unloader)
            # accepted at once: the name is no longer served, a new request for it is the unknown model's 404
            wait_for(lambda: served(live.url) == ["tiny"], "the unload did not stop serving the name")
            gone = complete(live.url, "sql", LATER)
            assert gone.status_code == 404 and "'sql' does not exist" in gone.text, gone.text
            assert unloader.is_alive()  # (its layers wait for the two requests accepted before it)
            # the name is free: a load of it with other weights is accepted, and runs once nothing runs
            loader = run(results, "load", load, live.url, "sql", "chat")
            threads.append(loader)
            wait_for(lambda: scheduler.adapter_updates, "the reload was not queued")
            gates.open(RUNNING)  # the stream ends, the reload runs, then the queued request starts
            loader.join(WAIT)
            assert results["load"].status_code == 200, results["load"].text
            assert served(live.url) == ["tiny", "sql"]
            wait_for(lambda: [tuple(seq.tag.row.prompt) for seq in scheduler.batch.rows] == [tuple(QUEUED)],
                     "the queued request did not start")
            threads.append(run(results, "later", complete, live.url, "sql", LATER))  # (for the new weights)
            wait_for(lambda: len(scheduler.waiting) == 1, "the request after the reload did not queue")
            assert unloader.is_alive() and len(scheduler.adapters.retired) == 1
            # the old layers count against --max-lora-modules until they go (2: the new sql and the retired one)
            with pytest.raises(ValueError, match=r"holds 2 LoRA adapters, 1 of them unloaded and finishing"):
                scheduler.adapters.add("third", root / "chat")
            gates.open(QUEUED)
            unloader.join(WAIT)
            assert results["unload"].status_code == 200, results["unload"].text
        finally:
            gates.__exit__()
            for thread in threads:
                thread.join(60)
    # the stream ran to its end, on the weights it was accepted with
    status, text, reasons = results["running"]
    assert status == 200 and text == want[tuple(RUNNING)] and reasons[-1] == "length"
    assert results["queued"].json()["choices"][0]["text"] == want[tuple(QUEUED)]  # (the old weights)
    assert results["later"].json()["choices"][0]["text"] == want_new  # (the new ones)
    at_rest(live.url, scheduler, 1)
    assert list(scheduler.adapters.wrapper.peft_config) == [scheduler.adapters.peft_name("sql")]  # (the old: gone)
    assert complete(live.url, "sql", LATER).json()["choices"][0]["text"] == want_new
    assert unload(live.url, "sql").status_code == 200 and scheduler.adapters.wrapper is None


def test_a_queued_request_that_leaves_does_not_hold_the_unload(live):
    """A request accepted for the adapter whose client leaves while it waits: the drain does not wait for it."""
    scheduler = live.server.config.app.state.scheduler
    assert load(live.url, "sql", "sql").status_code == 200
    want = complete(live.url, "sql", RUNNING).json()["choices"][0]["text"]
    results: dict = {}
    threads: list[threading.Thread] = []
    with Gates(scheduler, RUNNING) as gates:
        try:
            threads.append(run(results, "running", complete, live.url, "sql", RUNNING))
            assert gates.inside.wait(WAIT)
            leaving = httpx.Client(timeout=0.5)  # (it leaves after half a second, while it waits)
            threads.append(run(results, "left", lambda: pytest.raises(httpx.ReadTimeout, leaving.post,
                                                                      live.url + "/v1/completions",
                                                                      json={"model": "sql", "prompt": QUEUED,
                                                                            **BODY})))
            wait_for(lambda: len(scheduler.waiting) == 1, "the second request did not queue")
            unloader = run(results, "unload", unload, live.url, "sql")
            threads.append(unloader)
            wait_for(lambda: served(live.url) == ["tiny"], "the unload did not stop serving the name")
            # (the scheduler's thread, held in the running request's step, drops it from the queue afterwards)
            wait_for(lambda: all(job.cancelled for job in scheduler.waiting), "the request that left was not cancelled")
            assert unloader.is_alive()  # (the running request is still to finish)
            gates.open(RUNNING)
            unloader.join(WAIT)
        finally:
            gates.__exit__()
            for thread in threads:
                thread.join(60)
            leaving.close()
    assert results["unload"].status_code == 200, results["unload"].text
    assert "left" in results  # (its client timed out: it left)
    assert results["running"].json()["choices"][0]["text"] == want
    at_rest(live.url, scheduler, 0)
    assert scheduler.adapters.wrapper is None


def test_an_update_queued_as_jobs_are_admitted_waits_for_them(live, monkeypatch):
    """The scheduler admits jobs under its lock and starts them after it: an update (a load, an unload's drop) queued
    in between ran first, with nothing running yet, and the admitted jobs were lost (their clients waited for ever;
    an unload also deleted the layers they were accepted for)."""
    scheduler = live.server.config.app.state.scheduler
    assert load(live.url, "sql", "sql").status_code == 200
    want = complete(live.url, "sql", RUNNING).json()["choices"][0]["text"]
    take, unloads = scheduler._take_admissible, []

    def take_then_unload():
        admitted = take()
        if any(job.served_adapter == "sql" for job in admitted) and not unloads:
            unloads.append(scheduler.unload_adapter("sql"))  # (its handler's call, at that moment)
        return admitted

    monkeypatch.setattr(scheduler, "_take_admissible", take_then_unload)
    answer = httpx.post(live.url + "/v1/completions", json={"model": "sql", "prompt": RUNNING, **BODY}, timeout=WAIT)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want
    assert unloads[0].result(WAIT) is None  # (the drop ran after it)
    at_rest(live.url, scheduler, 0)
    assert scheduler.adapters.wrapper is None


def test_a_request_queued_just_before_an_unload_answers_with_its_adapters_name(live, monkeypatch):
    """The handler read the served name for the answer's `model` again after queueing the jobs: an unload in
    between made it a 404, while the jobs ran on for nobody."""
    scheduler = live.server.config.app.state.scheduler
    assert load(live.url, "sql", "sql").status_code == 200
    want = complete(live.url, "sql", RUNNING).json()["choices"][0]["text"]
    submit, unloads = scheduler.submit, []

    def submit_then_unload(jobs):
        submit(jobs)
        unloads.append(scheduler.unload_adapter("sql"))  # (its handler's call, right after)

    monkeypatch.setattr(scheduler, "submit", submit_then_unload)
    answer = complete(live.url, "sql", RUNNING)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sql" and answer.json()["choices"][0]["text"] == want
    assert unloads[0].result(WAIT) is None
    at_rest(live.url, scheduler, 0)
