"""Several served names for one model (`rdepth serve --served-model-name NAME [NAME ...]`, `build_app`'s
model_name as a list), as vLLM's: a request may give any name as its `model`, answers report the first,
/v1/models lists each as its own card, and no LoRA adapter may take one of them.

The app runs in-process (httpx's ASGITransport, its lifespan entered by hand): a token-ids-only tiny model."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.serving import build_app

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["tiny-v2", "tiny"]


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64)).eval()


async def ask(app, calls: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    """The answers to (method, path, JSON body) calls, in order, from `app` started and stopped around them."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=30) as client:
            return [await client.request(method, path, json=body) for method, path, body in calls]


def test_every_name_is_served_listed_and_answers_report_the_first(model):
    app = build_app(model, model_name=NAMES, tokenizer_workers=1)
    completion = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    listed, card, by_alias, by_first, unknown = asyncio.run(ask(app, [
        ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
        ("POST", "/v1/completions", {"model": "tiny", **completion}),
        ("POST", "/v1/completions", {"model": "tiny-v2", **completion}),
        ("POST", "/v1/completions", {"model": "nope", **completion})]))
    cards = listed.json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [("tiny-v2", "tiny-v2", None),
                                                                   ("tiny", "tiny-v2", None)]
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["parent"] is None
    assert by_alias.status_code == 200, by_alias.text
    assert by_alias.json()["model"] == by_first.json()["model"] == "tiny-v2"  # (vLLM's: the first name answers)
    assert by_alias.json()["choices"][0]["text"] == by_first.json()["choices"][0]["text"]
    assert unknown.status_code == 404 and "['tiny', 'tiny-v2']" in unknown.json()["error"]["message"]


def test_one_name_is_served_as_before(model):
    listed, health = asyncio.run(ask(build_app(model, model_name="solo", tokenizer_workers=1),
                                     [("GET", "/v1/models", None), ("GET", "/health", None)]))
    assert [c["id"] for c in listed.json()["data"]] == ["solo"] and health.json()["model"] == "solo"


@pytest.mark.parametrize("names, message", [
    ([], "is an empty list"), (["a", " "], "' ' is invalid: expected a non-blank string"),
    (["a", 5], "5 is invalid"), (["a", "b", "a"], r"names \['a'\] more than once"),
])
def test_bad_served_names_are_one_line_errors(model, names, message):
    with pytest.raises(ValueError, match=message) as caught:
        build_app(model, model_name=names)
    assert "\n" not in str(caught.value) and "--served-model-name" in str(caught.value)


def test_no_adapter_may_take_any_served_name(model, tmp_path):
    # at start-up: refused before any adapter loads (the directory does not exist)
    with pytest.raises(ValueError, match="names an adapter 'tiny', the base model's served name"):
        build_app(model, model_name=NAMES, lora_modules={"tiny": tmp_path / "nowhere"})
    pytest.importorskip("peft")  # runtime loads: the second name is refused as the first is
    app = build_app(model, model_name=NAMES, tokenizer_workers=1, lora_updates_root=tmp_path)
    refused = asyncio.run(ask(app, [("POST", "/v1/load_lora_adapter", {"lora_name": n, "lora_path": "x"})
                                    for n in NAMES]))
    for answer in refused:
        assert answer.status_code == 400 and "the base model's served name" in answer.json()["error"]["message"]


def test_rdepth_serve_takes_several_names(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "m")
    with socket.socket() as probe:  # a port free now (the server fails before it would listen)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    flags = ["--served-model-name", "tiny-v2", "tiny", "--lora-modules", f"tiny={tmp_path / 'nowhere'}"]
    assert main(["serve", "--model", str(tmp_path / "m"), "--port", port, *flags]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "threads" not in line and line.strip()]
    assert len(err) == 1 and "names an adapter 'tiny', the base model's served name" in err[0], err
