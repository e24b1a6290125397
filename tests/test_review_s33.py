"""Bugs a review of session 33's changes found (adapter unload drains, the batch pool's window bound, NF4, the
LoRA regex child), each pinned here."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from tests.serving_fixtures import BODY, WAIT, Gates, complete, run, runtime_lora_server, wait_for
from tests.test_serve_unload_drain import RUNNING
from tests.test_serving import model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import adapters  # noqa: F401 - fixtures
from tests.test_serving_lora_updates import load, unload

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def live(model_dir, adapters, tmp_path_factory):  # noqa: F811 - the fixtures
    """Runtime loads on, one row (a second request waits)."""
    root = tmp_path_factory.mktemp("review_root")
    shutil.copytree(adapters["sql"], root / "sql")
    yield from runtime_lora_server(model_dir, root)


def test_an_unload_answers_when_its_last_request_ends_in_the_iteration_it_starts(live):
    """The drop of an unloaded adapter was queued only by an iteration that found its last waiting job gone: where
    that job started and finished in one iteration (max_tokens=1: its first token ends it), the scheduler then
    slept with nothing to do, the drop never queued, and the unload's client waited until some other request came."""
    scheduler = live.server.config.app.state.scheduler
    assert load(live.url, "sql", "sql").status_code == 200
    results: dict = {}
    threads: list[threading.Thread] = []
    with Gates(scheduler, RUNNING) as gates:
        try:
            threads.append(run(results, "running", complete, live.url, "sql", RUNNING))
            assert gates.inside.wait(WAIT)
            one_token = {"model": "sql", "prompt": [40, 41], **BODY, "max_tokens": 1}
            threads.append(run(results, "short", lambda: httpx.post(live.url + "/v1/completions",
                                                                            json=one_token, timeout=60)))
            wait_for(lambda: len(scheduler.waiting) == 1, "the second request did not queue")
            unloader = run(results, "unload", unload, live.url, "sql")
            threads.append(unloader)
            wait_for(lambda: scheduler.adapters.retired, "the unload was not accepted")
            gates.open(RUNNING)
            unloader.join(WAIT)
            assert not unloader.is_alive(), "the unload never answered (its drop was not queued)"
        finally:
            gates.__exit__()
            for thread in threads:
                thread.join(60)
    assert results["unload"].status_code == 200, results["unload"].text
    assert results["short"].status_code == 200 and results["running"].status_code == 200
    assert not scheduler.pending_unloads and not scheduler.adapters.retired and scheduler.adapters.wrapper is None


def test_an_unload_racing_an_adapter_switch_does_not_stop_the_engine(model_dir, adapters):  # noqa: F811
    """`turn_on` (the scheduler's thread, switching to a job's adapter) read `retired` and then the served names
    without the lock `retire` (the HTTP side, at once) changes them under: a retire between the two reads hid the
    adapter from both, and the ValueError stopped the engine for every client."""
    import recurrent_depth as rd
    from recurrent_depth.serving.adapters import ServedAdapters

    root = adapters["sql"].parent
    served = ServedAdapters(rd.RecurrentDepthLM.from_pretrained(model_dir).eval(), {}, updates_root=root)
    served.add("sql", root / "sql")
    peft_name = served.peft_name("sql")
    retiring: list[threading.Thread] = []

    class RetiredWhileRead(set):
        """`retired`, whose first read lets the HTTP side retire "sql" (as a thread switch there would)."""

        def __contains__(self, item: object) -> bool:
            found = super().__contains__(item)
            if not retiring:
                retiring.append(threading.Thread(target=served.retire, args=("sql",)))
                retiring[0].start()
                # (the retire runs to its end here, unless this read holds the lock it takes: then it waits)
                retiring[0].join(0.05 if served._names_lock.locked() else WAIT)
            return found

    served.retired = RetiredWhileRead(served.retired)
    served.turn_on(peft_name)  # (the job accepted for "sql" runs with it, retired or not)
    retiring[0].join(WAIT)
    assert served.active == peft_name and peft_name in served.retired and "sql" not in served
    served.drop(peft_name)
    assert served.wrapper is None and not served.retired


def test_regexes_off_the_main_thread_match_where_python_cannot_name_its_executable(monkeypatch):
    """sys.executable is None where Python cannot tell its own path (an embedding application): the child
    interpreter that times an adapter's regexes off the main thread was then a TypeError traceback, not the
    untimed matching `_timed_matches` falls back to where no child can start."""
    import sys

    from recurrent_depth.train.lora import _timed_matches

    monkeypatch.setattr(sys, "executable", None)
    out: list = []
    thread = threading.Thread(target=lambda: out.append(_timed_matches([(r".*\.attn", "fullmatch")],
                                                                       ["a.attn", "a.mlp"], 2.0)))
    thread.start()
    thread.join(WAIT)
    assert out == [[{"a.attn"}]]
