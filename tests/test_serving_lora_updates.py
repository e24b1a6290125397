"""Runtime LoRA loading (`rdepth serve --lora-updates-root DIR`: vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`; serving/adapters.py, engine.BatchScheduler's switch point).

A loaded adapter answers exactly what it answers on a server started with `--lora-modules` of it; an unloaded
one is a 404; paths stay inside the root; the load waits for the running requests, which it leaves unharmed."""

from __future__ import annotations

import asyncio
import os
import shutil

import httpx
import openai
import pytest

from recurrent_depth.cli import main
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import BODY, PROMPTS, adapters, answers  # noqa: F401 - fixtures

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(adapters, tmp_path_factory):  # noqa: F811 - the fixture
    """The --lora-updates-root: the two adapters under it, and a secret adapter outside it."""
    out = tmp_path_factory.mktemp("root")
    for name, path in adapters.items():
        shutil.copytree(path, out / name)
    shutil.copytree(adapters["sql"], out.parent / "secret")
    return out


@pytest.fixture(scope="module")
def live(model_dir, root):  # noqa: F811 - the fixture
    """A server started with no adapters, runtime loads on, at most 2 adapters."""
    app = build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root, max_lora_modules=2)
    with LiveServer(app) as server:
        yield server


def load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def unload(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def served(url: str) -> list[str]:
    return [card["id"] for card in httpx.get(url + "/v1/models").json()["data"]]


def test_a_loaded_adapter_answers_as_at_start_and_an_unloaded_one_is_a_404(live, model_dir, adapters):  # noqa: F811
    with LiveServer(build_app(model_dir, model_name="tiny", tokenizer_workers=1,
                              lora_modules={"sql": adapters["sql"]})) as started:
        want = answers(started.url, "sql")
    base = answers(live.url, "tiny")
    response = load(live.url, "sql", "sql")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'sql' added successfully."
    assert served(live.url) == ["tiny", "sql"]
    assert answers(live.url, "sql") == want != base
    response = unload(live.url, "sql")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'sql' removed successfully."
    assert served(live.url) == ["tiny"]
    gone = httpx.post(live.url + "/v1/completions", json={"model": "sql", "prompt": [1], "max_tokens": 1})
    assert gone.status_code == 404 and "'sql' does not exist; this server serves ['tiny']" in gone.text
    # (the preparation workers leave `model` to the handlers here: chat's unknown name is the same 404)
    never = httpx.post(live.url + "/v1/chat/completions", json={"model": "nope", "max_tokens": 1,
                                                                "messages": [{"role": "user", "content": "x"}]})
    assert never.status_code == 404 and never.json()["error"]["message"] == (
        "the model 'nope' does not exist; this server serves ['tiny']")
    assert answers(live.url, "tiny") == base  # (the base as it was: the adapter's layers are gone)
    assert load(live.url, "sql", "sql").status_code == 200  # (loads again, under a new peft name)
    assert answers(live.url, "sql") == want
    assert unload(live.url, "sql").status_code == 200


def test_paths_outside_the_root_are_refused(live, root, tmp_path):
    (root / "link_out").symlink_to(root.parent / "secret")
    for path in ("../secret", str(root.parent / "secret"), "link_out", "sql/../../secret"):
        response = load(live.url, "x", path)
        assert response.status_code == 400, (path, response.text)
        assert "leads outside the server's --lora-updates-root" in response.json()["error"]["message"], path
    # a directory inside whose weights file is a symlink out of the root
    (root / "sneaky").mkdir()
    shutil.copy(root / "sql" / "adapter_config.json", root / "sneaky")
    os.symlink(root.parent / "secret" / "adapter_model.safetensors", root / "sneaky" / "adapter_model.safetensors")
    assert "leads outside" in load(live.url, "x", "sneaky").text
    missing = load(live.url, "x", "nope")
    assert missing.status_code == 400 and "'nope' is not a LoRA adapter directory" in missing.text
    assert str(root) not in missing.text  # (the server's own paths stay unpublished)
    assert served(live.url) == ["tiny"]


def test_names_are_checked_and_the_count_is_bounded(live):
    for name, message in (("tiny", "the base model's served name"), ("a b", "lora_name name 'a b' is invalid"),
                          (None, "lora_name name None is invalid")):
        response = load(live.url, name, "sql")
        assert response.status_code == 400 and message in response.text, response.text
    assert load(live.url, "one", "sql").status_code == 200
    duplicate = load(live.url, "one", "chat")
    assert duplicate.status_code == 400 and "'one' is already loaded" in duplicate.text
    assert load(live.url, "two", "chat").status_code == 200
    over = load(live.url, "three", "chat")
    assert over.status_code == 400 and "(--max-lora-modules 2)" in over.text
    missing = unload(live.url, "three")
    assert missing.status_code == 400 and "no LoRA adapter named 'three' is loaded" in missing.text
    assert unload(live.url, "one").status_code == 200 and unload(live.url, "two").status_code == 200
    assert served(live.url) == ["tiny"]


def test_requests_running_during_a_load_are_unharmed(live):
    alone = answers(live.url, "tiny")
    jobs = [p for _ in range(4) for p in range(len(PROMPTS))]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            requests = [asyncio.create_task(c.completions.create(model="tiny", prompt=PROMPTS[p], **BODY))
                        for p in jobs]
            await asyncio.sleep(0.05)  # (some run now)
            async with httpx.AsyncClient(timeout=60) as h:
                loaded = await h.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "chat",
                                                                                 "lora_path": "chat"})
            return loaded, await asyncio.gather(*requests)

    loaded, results = asyncio.run(run_all())
    assert loaded.status_code == 200
    for p, r in zip(jobs, results):
        assert r.choices[0].logprobs.tokens == alone[p][0], p
    assert answers(live.url, "tiny") == alone
    assert unload(live.url, "chat").status_code == 200


def test_an_unload_is_refused_while_requests_wait_for_the_adapter(model_dir, root):  # noqa: F811
    """The scheduler's side (it unloads while nothing runs): a job waiting for the adapter makes it a 409."""
    from types import SimpleNamespace

    from recurrent_depth.serving.engine import AdapterBusy

    scheduler = build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root).state.scheduler
    scheduler.adapters.add("sql", root / "sql")  # (its thread is not started: the test is the switch point)
    scheduler.waiting.append(SimpleNamespace(adapter="sql", cancelled=False))
    with pytest.raises(AdapterBusy, match=r"'sql' has 1 requests waiting"):
        scheduler._unload("sql")
    assert scheduler.adapter_names == ("sql",)
    scheduler.waiting.clear()
    scheduler._unload("sql")
    assert scheduler.adapter_names == () and scheduler.adapters.wrapper is None


def test_runtime_loading_is_off_by_default(model_dir, root, capsys):  # noqa: F811
    with LiveServer(build_app(model_dir, model_name="tiny", tokenizer_workers=1)) as server:
        response = load(server.url, "sql", "sql")
        assert response.status_code == 404 and "start it with rdepth serve --lora-updates-root DIR" in response.text
        assert unload(server.url, "sql").status_code == 404
    for argv, message in (
        (["--lora", str(root / "sql"), "--lora-updates-root", str(root)], "--lora and --lora-updates-root cannot"),
        (["--weights", "int8", "--lora-updates-root", str(root)], "--lora-updates-root cannot go with --weights"),
        (["--max-lora-modules", "3"], "give --lora-updates-root DIR too"),
    ):
        assert main(["serve", "--model", str(model_dir), "--port", "1", *argv]) != 0
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
