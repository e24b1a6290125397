"""Session 34's serving fixes: a failed adapter drop frees its --max-lora-modules slot; `ignore_eos` with
`draft_steps` (self-speculative decoding) is served as `rdepth generate --ignore-eos --draft-steps N` runs it."""

from __future__ import annotations

import httpx
import pytest
import torch

import recurrent_depth as rd
import recurrent_depth.train.lora as lora
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.inference import generate
from recurrent_depth.serving import build_app
from recurrent_depth.serving.text import TextCodec
from tests.test_serving import CORPUS, LiveServer, model_dir  # noqa: F401 - fixtures
from tests.test_serving_lora import adapters  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

WAIT = 60.0


def test_a_failed_drop_frees_the_adapters_slot(model_dir, adapters, monkeypatch):  # noqa: F811 - the fixtures
    """peft's delete failing part-way left the unloaded adapter in `retired` for good: it held its
    --max-lora-modules slot, and every later load was refused as over the limit."""
    pytest.importorskip("peft")
    from recurrent_depth.serving.adapters import ServedAdapters
    from recurrent_depth.serving.engine import BatchScheduler

    root = adapters["sql"].parent
    model = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    scheduler = BatchScheduler(model, adapters=ServedAdapters(model, {}, updates_root=root, max_count=1))
    scheduler.start()
    try:
        scheduler.load_adapter("sql", "sql").result(WAIT)
        real = lora.remove_named_lora

        def failing(wrapped, name):
            raise RuntimeError("peft failed while deleting layers")

        monkeypatch.setattr(lora, "remove_named_lora", failing)
        with pytest.raises(RuntimeError, match=r"^the LoRA adapter is unloaded, but deleting its layers failed "
                                               r"\(RuntimeError: peft failed while deleting layers\); its "
                                               r"--max-lora-modules slot is free again$"):
            scheduler.unload_adapter("sql").result(WAIT)
        monkeypatch.setattr(lora, "remove_named_lora", real)
        assert scheduler.adapter_names == () and not scheduler.adapters.retired
        scheduler.load_adapter("chat", "chat").result(WAIT)  # (was: "already holds 1 LoRA adapters, its limit")
        assert scheduler.adapter_names == ("chat",) and scheduler.healthy
        assert scheduler.adapters.active is None  # (the base is on after the updates, the failed one's too)
    finally:
        scheduler.stop()


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny model whose config's eos_token_id is the 3rd token its greedy continuation of PROMPT makes, and that
    continuation (without the eos)."""
    out = tmp_path_factory.mktemp("eos_model")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320)).eval()
    tokens = generate(model, torch.tensor(PROMPT), eos_token_id=[], **GREEDY).token_lists()[0]
    model.config.eos_token_id = tokens[2]
    model.save_pretrained(out)
    return out, tokens


PROMPT = [5, 17, 33, 2, 9]
GREEDY = dict(max_new_tokens=10, num_steps=4, init_scale=0.0, seed=0)


def test_ignore_eos_with_draft_steps_is_served_as_generate_runs_it(eos_model):
    """The server refused the pair for a model with an eos ("speculative sessions always stop there"), while
    `rdepth generate --ignore-eos --draft-steps N` ran it: a solo session now takes the job's stop ids alone."""
    eos_model_dir, greedy = eos_model
    model = rd.RecurrentDepthLM.from_pretrained(eos_model_dir).eval()
    eos = model.config.eos_token_id
    want = generate(model, torch.tensor(PROMPT), eos_token_id=[], draft_steps=2, **GREEDY).token_lists()[0]
    assert want == greedy and eos in want[:-1]  # (the speculative session goes past the eos, as greedy does)
    codec = TextCodec(eos_model_dir, 320)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0,
            "init_scale": 0, "num_steps": GREEDY["num_steps"], "draft_steps": 2, "logprobs": 0, "seed": 0}
    with LiveServer(build_app(eos_model_dir, model_name="tiny", tokenizer_workers=1)) as live:
        r = httpx.post(live.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=WAIT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [codec.token_string(t) for t in want]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == len(want)
        stopped = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT).json()  # (the eos ends it)
        assert stopped["usage"]["completion_tokens"] == want.index(eos) + 1
        assert stopped["choices"][0]["finish_reason"] == "stop"
