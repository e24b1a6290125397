"""Runtime LoRA loading (`rdepth serve --lora-updates-root DIR`: vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter`; serving/adapters.py, engine.BatchScheduler's switch point).

A loaded adapter answers exactly what it answers on a server started with `--lora-modules` of it; an unloaded
one is a 404; paths stay inside the root; the load waits for the running requests, which it leaves unharmed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import openai
import pytest
import torch

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


def test_a_path_the_file_system_refuses_is_a_400_without_the_servers_root(live, root):
    """The OSError's own text named the resolved path, the server's --lora-updates-root in it."""
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    for path, message in (("a" * 300, "File name too long"), ("loop1/model", "symlink loop")):
        response = load(live.url, "x", path)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert str(root) not in response.text
    assert served(live.url) == ["tiny"]


def test_names_are_checked_and_the_count_is_bounded(live):
    for name, message in (("tiny", "the base model's served name"), ("a b", "lora_name 'a b' is invalid"),
                          (None, "lora_name None is invalid")):
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


def test_the_load_checks_the_path_again_when_it_runs(model_dir, root):  # noqa: F811 - the fixture
    """The handler checks lora_path when the request comes, the scheduler loads once the running requests are done:
    a symlink in the root pointed out of it meanwhile was followed."""
    app = build_app(model_dir, model_name="tiny", tokenizer_workers=1, lora_updates_root=root)
    held = app.state.scheduler.adapters
    (root / "swapped").mkdir()
    shutil.copy(root / "sql" / "adapter_config.json", root / "swapped")
    (root / "swapped" / "adapter_model.safetensors").symlink_to(root.parent / "secret" / "adapter_model.safetensors")
    for directory in (root / "swapped", root.parent / "secret"):
        with pytest.raises(ValueError, match="leads outside the server's --lora-updates-root"):
            held.add("x", directory)
    assert held.names == () and held.wrapper is None


def test_runtime_loading_is_off_by_default(model_dir, root, capsys):  # noqa: F811
    with LiveServer(build_app(model_dir, model_name="tiny", tokenizer_workers=1)) as server:
        response = load(server.url, "sql", "sql")
        assert response.status_code == 404 and "start it with rdepth serve --lora-updates-root DIR" in response.text
        assert unload(server.url, "sql").status_code == 404
    for argv, message in (
        (["--lora", str(root / "sql"), "--lora-updates-root", str(root)], "--lora and --lora-updates-root cannot"),
        (["--max-lora-modules", "3"], "give --lora-updates-root DIR too"),
    ):
        assert main(["serve", "--model", str(model_dir), "--port", "1", *argv]) != 0
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors


def test_a_missing_updates_root_is_named_by_its_flag(model_dir, tmp_path, capsys):  # noqa: F811
    """rdepth serve said `lora_updates_root '...' is not a directory`, the Python name of the flag."""
    import socket

    with socket.socket() as probe:  # (a free port: the check comes after the port's)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    missing = tmp_path / "nothere"
    argv = ["serve", "--model", str(model_dir), "--port", str(port), "--lora-updates-root", str(missing)]
    assert main(argv) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"rdepth serve: error: --lora-updates-root {str(missing)!r} is not a directory"], errors


def broken_copy(root, name: str, break_it) -> str:
    """A copy of the sql adapter under `root` as `name`, changed by `break_it(directory)`."""
    shutil.rmtree(root / name, ignore_errors=True)
    shutil.copytree(root / "sql", root / name)
    break_it(root / name)
    return name


def test_a_failed_load_leaves_the_base_and_later_loads_as_they_were(live, root):
    """peft's first load on a base put its layers on the model before failing (a tensor of another shape, a
    modules_to_save the weights lack) and returned nothing to unload: the half-loaded adapter stayed on the model
    (its forward changed by logits of 3), and every later load failed on the leftover layers."""
    from safetensors.torch import load_file, save_file

    def other_shape(directory):
        tensors = load_file(directory / "adapter_model.safetensors")
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
        save_file(tensors, directory / "adapter_model.safetensors")

    def saves_the_head(directory):
        config = json.loads((directory / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))

    from recurrent_depth.inference.lora_layers import is_lora_layer

    model = live.server.config.app.state.scheduler.model
    base = answers(live.url, "tiny")
    for name, message in ((broken_copy(root, "shape", other_shape), "size mismatch"),
                          (broken_copy(root, "head", saves_the_head), "lacks tensor")):
        response = load(live.url, "x", name)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert str(root) not in response.text
        assert not any(is_lora_layer(m) for m in model.modules()), name  # (the model as it was: no peft layers)
    assert served(live.url) == ["tiny"]
    assert answers(live.url, "tiny") == base
    assert load(live.url, "sql", "sql").status_code == 200
    assert answers(live.url, "sql") != base
    assert unload(live.url, "sql").status_code == 200
    assert answers(live.url, "tiny") == base


def test_an_invalid_regex_that_peft_compiles_is_a_400_and_leaves_the_loaded_adapters(live, root):
    """An invalid regex in rank_pattern / alpha_pattern / exclude_modules was a 500 "internal error" (re.error)."""
    from recurrent_depth.inference.lora_layers import is_lora_layer

    held = live.server.config.app.state.scheduler.adapters
    assert load(live.url, "sql", "sql").status_code == 200
    for field, value in (("rank_pattern", {"([": 2}), ("alpha_pattern", {"([": 2}), ("exclude_modules", "([")):
        def bad_regex(directory):
            config = json.loads((directory / "adapter_config.json").read_text())
            (directory / "adapter_config.json").write_text(json.dumps({**config, field: value}))  # noqa: B023

        response = load(live.url, "x", broken_copy(root, "bad_regex", bad_regex))
        assert response.status_code == 400 and "unterminated character set" in response.text, (field, response.text)
        assert list(held.wrapper.peft_config) == [held._peft_names["sql"]], field
    assert unload(live.url, "sql").status_code == 200
    assert not any(is_lora_layer(m) for m in live.server.config.app.state.scheduler.model.modules())


def test_a_target_regex_that_backtracks_is_refused_and_the_server_answers_meanwhile(live, root):
    """A load runs on the scheduler's thread, where SIGALRM cannot time the regex check and the regex held the
    GIL for hours: every thread froze (this test then hangs); `train.lora` matches it in a child interpreter."""
    for field, value in (("target_modules", r"([\w.]+)+Z"), ("rank_pattern", {r"([\w.]+)+Z": 2})):
        def slow_regex(directory):
            config = json.loads((directory / "adapter_config.json").read_text())
            (directory / "adapter_config.json").write_text(json.dumps({**config, field: value}))  # noqa: B023

        response = load(live.url, "x", broken_copy(root, "slow", slow_regex))
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and "over 2 s to match" in message and field in message, message
        assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    assert served(live.url) == ["tiny"]


def test_a_name_of_thousands_of_characters_is_refused(live):
    response = load(live.url, "a" * 10_000, "sql")
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "expected at most 256 characters" in message and len(message) < 400
    assert served(live.url) == ["tiny"]
