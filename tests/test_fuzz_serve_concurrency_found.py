"""Found by a seeded concurrency fuzzer of `rdepth serve` (many asyncio clients at once: completions and chat,
streamed and whole, n > 1, depths, exit criteria, kv_quant, solo requests, two LoRA adapters and a third loaded and
unloaded at runtime while its requests run, stop strings, clients that leave mid-stream or mid-body, malformed
requests, /v1/models and /metrics polled; every answer compared with the same request sent alone).

An accepted unload (`POST /v1/unload_lora_adapter`) used to wait for the running requests with no new job
starting meanwhile, and a request naming the adapter that came during that wait was accepted, waited behind the
unload, then made it a 409 ("requests waiting"): under steady traffic for the adapter every retry met the same (the
fuzzer needed up to 157 tries for 2 unloads, each try draining the whole server). Now an unload drains the adapter,
as vLLM's (docs/serving.md): the name stops being served at once (a later request naming it is a 404), the requests
already accepted for it, running or queued, finish with it, and the unload answers once its layers are deleted;
it is never a 409."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import adapters  # noqa: F401 - fixtures
from tests.test_serving_lora_updates import load, served, unload

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

WAIT = 10.0  # seconds for what takes milliseconds unless it waits for the held request


@pytest.fixture(scope="module")
def root(adapters, tmp_path_factory):  # noqa: F811 - the fixture
    out = tmp_path_factory.mktemp("concurrency_root")
    shutil.copytree(adapters["sql"], out / "sql")
    return out


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_unload_under_traffic_for_its_adapter_succeeds_and_later_requests_are_404s(model_dir, root):  # noqa: F811
    body = {"model": "sql", "prompt": [5, 17, 33, 2], "max_tokens": 4, "temperature": 0, "init_scale": 0,
            "num_steps": 3, "ignore_eos": True}
    with LiveServer(build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root)) as live:
        scheduler = live.server.config.app.state.scheduler
        assert load(live.url, "sql", "sql").status_code == 200
        want = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        inside, release = threading.Event(), threading.Event()
        step = scheduler.batch.step

        def held_step():  # the running request stays in its decode until released
            inside.set()
            release.wait(60)
            return step()

        scheduler.batch.step = held_step
        results: dict[str, httpx.Response] = {}
        running = threading.Thread(target=lambda: results.update(
            running=httpx.post(live.url + "/v1/completions", json=body, timeout=60)), daemon=True)
        unloader = threading.Thread(target=lambda: results.update(unload=unload(live.url, "sql")), daemon=True)
        later = threading.Thread(target=lambda: results.update(
            later=httpx.post(live.url + "/v1/completions", json=body, timeout=60)), daemon=True)
        try:
            running.start()
            assert inside.wait(WAIT)
            unloader.start()
            wait_for(lambda: scheduler.adapter_updates, "the unload was not queued")
            assert served(live.url) == ["tiny"]  # (accepted: the name is no longer served)
            later.start()
            # it is answered at once (a 404), not queued behind the unload (where it made the unload a 409)
            wait_for(lambda: "later" in results or scheduler.waiting, "the later request neither ended nor waited")
            assert not scheduler.waiting, "a request naming the adapter being unloaded was queued"
            later.join(WAIT)
            assert unloader.is_alive()  # ... while the unload still waits for the running request
        finally:
            release.set()
            scheduler.batch.step = step
            for thread in (running, unloader, later):
                thread.join(60)
        assert results["later"].status_code == 404 and "'sql' does not exist" in results["later"].text
        assert results["unload"].status_code == 200, results["unload"].text
        answer = results["running"]  # (ran to its end with the adapter, as without the unload)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want
        assert served(live.url) == ["tiny"]
        again = unload(live.url, "sql")
        assert again.status_code == 400 and "no LoRA adapter named 'sql' is loaded" in again.text
        assert load(live.url, "sql", "sql").status_code == 200  # (the name is free again)
        assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
