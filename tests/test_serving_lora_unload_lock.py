"""A runtime LoRA unload (`POST /v1/unload_lora_adapter`) retires the name under the scheduler's lock and deletes
peft's layers outside it (engine.BatchScheduler._unload, adapters.ServedAdapters.retire / drop).

The lock was held through the delete, and `submit` takes it on the HTTP event loop: every request arriving during
the delete (of any adapter) froze the server's event loop until it ended."""

from __future__ import annotations

import shutil
import threading
from types import SimpleNamespace

import httpx
import pytest

import recurrent_depth.train.lora as lora
from recurrent_depth.serving import build_app
from recurrent_depth.serving.engine import UnknownAdapter
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import adapters  # noqa: F401 - fixtures
from tests.test_serving_lora_updates import load, served, unload

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(adapters, tmp_path_factory):  # noqa: F811 - the fixture
    """A --lora-updates-root holding the sql adapter (not test_serving_lora_updates' `root`: its copy outside the
    root has one fixed path, which a second instance in the same session fails to create)."""
    out = tmp_path_factory.mktemp("unload_root")
    shutil.copytree(adapters["sql"], out / "sql")
    return out


WAIT = 10.0  # seconds a call made during the delete may take (it takes milliseconds unless it waits for the delete)


def held(monkeypatch, function: str) -> tuple[threading.Event, threading.Event]:
    """Make `train.lora.<function>` wait, once called, until the returned `release` is set: (started, release)."""
    started, release = threading.Event(), threading.Event()
    real = getattr(lora, function)

    def waiting(*args, **kwargs):
        started.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(lora, function, waiting)
    return started, release


def submit_in_time(scheduler, adapter: str) -> BaseException | None:
    """What `scheduler.submit` of a job naming `adapter` raises, called on another thread; fails if it takes over
    WAIT seconds (it waits for the lock)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            scheduler.submit([SimpleNamespace(served_adapter=adapter, cancelled=False)])
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert outcome, f"submit waited over {WAIT:g} s for the scheduler's lock"
    return outcome[0]


def test_requests_during_an_unloads_delete_are_answered_and_the_name_loads_again(model_dir, root,  # noqa: F811
                                                                                  monkeypatch):
    with LiveServer(build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root)) as live:
        scheduler = live.server.config.app.state.scheduler
        assert load(live.url, "sql", "sql").status_code == 200
        deleting, release_delete = held(monkeypatch, "remove_named_lora")
        loading, release_load = held(monkeypatch, "add_named_lora")
        results: dict[str, httpx.Response] = {}
        unloader = threading.Thread(target=lambda: results.update(unload=unload(live.url, "sql")), daemon=True)
        loader = threading.Thread(target=lambda: results.update(load=load(live.url, "sql", "sql")), daemon=True)
        try:
            unloader.start()
            assert deleting.wait(30)
            # the name is gone at once: a request for it is the 404 it gets after the unload, without waiting
            gone = httpx.post(live.url + "/v1/completions", json={"model": "sql", "prompt": [1], "max_tokens": 1},
                              timeout=WAIT)
            assert gone.status_code == 404 and "'sql' does not exist" in gone.text, gone.text
            assert isinstance(submit_in_time(scheduler, "sql"), UnknownAdapter)
            assert served(live.url) == ["tiny"]
            loader.start()  # (accepted: the name is free; it runs once the delete is done)
            release_delete.set()
            unloader.join(60)
            assert results["unload"].status_code == 200, results["unload"].text
            # the load does not hold the lock either, and publishes the name only once its layers are on
            assert loading.wait(30)
            assert isinstance(submit_in_time(scheduler, "sql"), UnknownAdapter)
            release_load.set()
            loader.join(60)
        finally:  # (a failure above must not leave the scheduler's thread waiting)
            release_delete.set()
            release_load.set()
        assert results["load"].status_code == 200, results["load"].text
        assert served(live.url) == ["tiny", "sql"]
        answer = httpx.post(live.url + "/v1/completions", json={"model": "sql", "prompt": [1], "max_tokens": 1},
                            timeout=60)
        assert answer.status_code == 200, answer.text
