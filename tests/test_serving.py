"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 with a tiny model
and tiny tokenizer, driven by the official `openai` client (and lm-eval's `local-completions`).

Exactness: every answer is compared with `recurrent_depth.inference.generate` run on that request
alone (init_scale=0 or a fixed seed), whatever else the batch held. Tolerance: log-probabilities
of the same computation at different batch shapes differ by float32 rounding only (observed
<= 1e-6); we allow 1e-4. Token ids, text, steps per token and finish reasons must match exactly.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer
from recurrent_depth.inference import generate
from recurrent_depth.serving import build_app

TOL = 1e-4
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "for i in range(10):\n    print(i * i)\n",
    "héllo wörld, ünïcode text 🙂 and more text.\n",
] * 4


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A saved tiny model (vocab 320, eos = <|end_text|>) with a tiny byte-level BPE tokenizer."""
    out = tmp_path_factory.mktemp("serve_model")
    tok = train_tokenizer(CORPUS, 320)
    save_tokenizer(tok, out)
    torch.manual_seed(1234)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=320, eos_token_id=special_token_ids(tok)["end_text"])
    rd.RecurrentDepthLM(cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """An independent copy of the model and the tokenizer, to compute expected answers."""
    return rd.RecurrentDepthLM.from_pretrained(model_dir).eval(), load_tokenizer(model_dir)


class LiveServer:
    """uvicorn on 127.0.0.1, an OS-chosen free port, in a background thread."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def server(model_dir):
    with LiveServer(build_app(model_dir, model_name="tiny")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def expected(reference, prompt_ids: list[int], max_tokens: int, stops=None, **kw):
    """(text, token ids, steps, finish_reason, log-probs) of `generate` on this request alone."""
    model, tok = reference
    kw.setdefault("num_steps", model.config.mean_recurrence)  # the server's default depth
    eos = model.config.eos_token_id
    stop_ids = [eos] if stops is None else stops
    out = generate(model, torch.tensor(prompt_ids), max_new_tokens=max_tokens, stop=stop_ids or None,
                   output_logits=True, **kw)
    tokens = out.token_lists()[0]
    steps = out.steps[0, : len(tokens)].tolist()
    finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
    shown = tokens[:-1] if finish == "stop" else tokens
    logprobs = torch.log_softmax(out.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return tok.decode(shown, skip_special_tokens=True), tokens, steps, finish, logprobs


def encode(reference, text: str) -> list[int]:
    return reference[1].encode(text).ids


# ---------------------------------------------------------------------------------------- basics
def test_health_models_and_metrics(server, client):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny" and health["batching"] is True
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].object == "model"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    client.completions.create(model="tiny", prompt="def add", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for series in ("rdepth_requests_total{endpoint=\"completions\",status=\"200\"}", "rdepth_generation_tokens_total",
                   "rdepth_queue_depth", "rdepth_mean_steps_per_token", "rdepth_request_latency_seconds_bucket",
                   "rdepth_time_to_first_token_seconds_count", "rdepth_running_sequences"):
        assert series in text, series


@pytest.mark.parametrize("extra", [
    dict(num_steps=3),
    dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-2),
    dict(num_steps=5, exit_criterion="latent-diff", exit_threshold=0.2, min_steps=2),
    dict(num_steps=5, kv_budget=2),
    dict(num_steps=5, warm_start=True, exit_criterion="cosine", exit_threshold=5e-3),
    dict(num_steps=5, draft_steps=2),
    dict(num_steps=0),
    dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-2, kv_policy="full"),
    dict(num_steps=10, exit_criterion="kl", exit_threshold=1e-2, kv_policy="latest-m4-compress-anchor"),
    dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-2, kv_policy="always-last-m4"),  # runs alone
    # the official schedule runs solo (the batch's loop is ours): the prompt exits at 5 of 8 steps here,
    # and the official min_steps rule with checks every 2nd step changes the tokens
    dict(num_steps=8, exit_criterion="kl", exit_threshold=3e-2, defaults="official"),
    dict(num_steps=8, exit_criterion="kl", exit_threshold=3e-2, min_steps=2, min_steps_rule="skip", check_every=2),
    dict(num_steps=3, gradmem_tokens=2, gradmem_steps=2, gradmem_query_tokens=2),  # runs alone
], ids=["fixed-3", "kl-exit", "latent-exit-min2", "kv-budget-2", "warm-start-cosine", "speculative", "zero-steps",
        "official-full", "official-anchor", "official-always-last", "official-kl", "official-schedule", "gradmem"])
def test_completion_equals_generate_alone(client, reference, extra):
    prompt = "def add(a, b):"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                  extra_body=dict(init_scale=0, return_steps=True, **extra))
    text, tokens, steps, finish, logprobs = expected(reference, encode(reference, prompt), 10, init_scale=0.0,
                                                     **extra)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == finish
    assert choice.model_extra["steps"] == steps
    assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, logprobs)) < TOL
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.model_extra["steps_per_token"] == pytest.approx(sum(steps) / len(steps), abs=1e-4)
    if "exit_criterion" not in extra and "draft_steps" not in extra:
        assert steps == [extra["num_steps"]] * len(steps)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_finish_round_lets_a_speculative_row_finish_its_round_as_generate_does(client, reference, stream):
    """finish_round commits the whole round that reaches max_tokens (the official loop): the server used
    to cut the row at max_tokens."""
    prompt, extra = "class Foo:\n    def", dict(num_steps=8, draft_steps=6, lookahead=4, finish_round=True,
                                              init_scale=0)
    text, tokens, steps, finish, _ = expected(reference, encode(reference, prompt), 6, **extra)
    assert len(tokens) > 6 and finish == "length"  # the round ran past max_tokens
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body=dict(return_steps=True, **extra))
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == len(tokens)
        return
    r = client.completions.create(**kw)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.choices[0].model_extra["steps"] == steps and r.usage.completion_tokens == len(tokens)


def test_a_seeded_randomized_kv_lookup_repeats_and_equals_generate(client, reference):
    """kv_policy "randomized" draws from the request's seed (it drew from torch's global RNG, so the same
    seeded request gave other steps on each call)."""
    prompt = "for i in range(10):"
    extra = dict(num_steps=8, exit_criterion="kl", exit_threshold=3e-2, kv_policy="per-step+randomized",
                 init_scale=0)
    answers = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, seed=11,
                                         logprobs=0, extra_body=dict(return_steps=True, **extra)).choices[0]
               for _ in range(2)]
    text, tokens, steps, finish, logprobs = expected(reference, encode(reference, prompt), 8, seed=11, **extra)
    assert len(set(steps[1:])) > 1  # tokens exited at different steps: the lookup drew
    for choice in answers:
        assert choice.text == text and choice.model_extra["steps"] == steps
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, logprobs)) < TOL


@pytest.mark.parametrize("body,param,message", [
    (dict(gradmem_tokens=2, gradmem_query_tokens=99), "gradmem_query_tokens",
     "gradmem_query_tokens=99 leaves row 0 no context to write"),
    (dict(gradmem_tokens=2, gradmem_steps=65), "gradmem_steps", "'gradmem_steps'=65 is out of range"),
    (dict(gradmem_tokens=2, echo=True, logprobs=0), "echo", "a GradMem request (gradmem_tokens > 0) reads it"),
    (dict(gradmem_tokens=2, gradmem_depth=0), "gradmem_depth", "gradmem_depth=0 is invalid"),
    (dict(gradmem_tokens=2, num_steps=0), "gradmem_depth", "gradmem_depth defaults to num_steps=0"),
], ids=["no-context", "too-many-steps", "prompt-scores", "depth-0", "num-steps-0"])
def test_gradmem_requests_that_cannot_run_are_400s_naming_the_field(server, body, param, message):
    r = httpx.post(server.url + "/v1/completions", json=dict(prompt="def add(a, b):", max_tokens=2, **body),
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_sampling_with_a_seed_is_reproducible_and_equals_generate(client, reference):
    kw = dict(model="tiny", prompt="The quick", max_tokens=8, temperature=0.9, top_p=0.95, seed=5)
    a = client.completions.create(**kw, extra_body=dict(top_k=50))
    b = client.completions.create(**kw, extra_body=dict(top_k=50))
    assert a.choices[0].text == b.choices[0].text
    text, *_ = expected(reference, encode(reference, "The quick"), 8, do_sample=True, temperature=0.9, top_p=0.95,
                        top_k=50, seed=5)
    assert a.choices[0].text == text


def test_chat_completion_and_stream(client, reference, model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body=dict(init_scale=0, num_steps=3))
    rendered = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    ids = reference[1].encode(rendered, add_special_tokens=False).ids
    stops = [reference[0].config.eos_token_id, reference[1].token_to_id("<|end_turn|>")]
    text, tokens, _, finish, logprobs = expected(reference, ids, 8, stops=stops, init_scale=0.0, num_steps=3)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens) and all(len(c.top_logprobs) == 2 for c in content)
    assert max(abs(c.logprob - lp) for c, lp in zip(content, logprobs)) < TOL
    assert r.usage.prompt_tokens == len(ids)

    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=dict(init_scale=0, num_steps=3)))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].usage.completion_tokens == len(tokens) and not chunks[-1].choices


def test_streamed_completion_equals_the_whole_one_and_ends_with_done(server, client):
    kw = dict(model="tiny", prompt=["def add", "for i in"], max_tokens=9, temperature=0, n=2,
              extra_body=dict(init_scale=0, ignore_eos=True))
    whole = client.completions.create(**kw)
    parts: dict[int, str] = {}
    finish = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert {c.index: c.text for c in whole.choices} == parts
    assert finish == {i: "length" for i in range(4)}
    assert whole.choices[0].text == whole.choices[1].text  # greedy: the n copies agree
    with httpx.stream("POST", server.url + "/v1/completions",
                      json=dict(prompt="def", max_tokens=3, temperature=0, stream=True)) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_streamed_echo_logprobs_have_the_text_offsets_of_the_whole_answer(server, client):
    """text_offset counts from the start of the returned text (echoed prompt + completion), streamed
    or not; the streamed completion tokens used to restart at 0 after the echoed prompt."""
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0, echo=True, logprobs=2,
              extra_body=dict(init_scale=0, ignore_eos=True))
    whole = client.completions.create(**kw).choices[0]
    offsets, tokens, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                offsets += c.logprobs.text_offset
                tokens += c.logprobs.tokens
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset
    prompt_len = len(whole.logprobs.tokens) - 6
    assert offsets[prompt_len] >= len("def add(a, b):")  # the first completion token starts after the prompt


@pytest.mark.parametrize("logprobs", [None, 2], ids=["text", "logprobs"])
def test_streamed_echo_with_n_choices_streams_each_choices_prompt_then_its_completion(server, client, logprobs):
    """echo + stream + n > 1 was a 400; as vLLM, each choice index streams the prompt, then its own
    completion, and the pieces add up to the non-streamed answer (text, tokens, logprobs, offsets)."""
    kw = dict(model="tiny", prompt=["def add(a, b):", "The quick"], n=2, max_tokens=4, temperature=1.0, seed=11,
              echo=True, logprobs=logprobs, extra_body=dict(ignore_eos=True))
    whole = {c.index: c for c in client.completions.create(**kw).choices}
    assert len(whole) == 4 and whole[0].text.startswith("def add(a, b):") and whole[2].text.startswith("The quick")
    assert whole[0].text != whole[1].text  # choice j of a prompt samples with seed + j
    pieces: dict[int, list] = {i: [] for i in range(4)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            pieces[c.index].append(c)
    for index, chunks in pieces.items():
        assert chunks[0].text == ("def add(a, b):" if index < 2 else "The quick")  # the prompt comes first
        assert "".join(c.text for c in chunks) == whole[index].text
        assert chunks[-1].finish_reason == whole[index].finish_reason
        if logprobs is not None:
            streamed = [c.logprobs for c in chunks if c.logprobs is not None]
            for field in ("tokens", "token_logprobs", "text_offset"):
                assert sum((getattr(lp, field) for lp in streamed), []) == getattr(whole[index].logprobs, field)
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(
            prompt="def", n=3, max_tokens=2, echo=True, stream=True, temperature=0)) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    firsts = {}
    for line in lines[:-1]:
        for c in json.loads(line[len("data: "):])["choices"]:
            firsts.setdefault(c["index"], c["text"])
    assert firsts == {0: "def", 1: "def", 2: "def"}


def test_echo_logprobs_score_token_prompts_like_a_full_forward(client, reference):
    """lm-eval's scoring request: token-id prompts, echo, logprobs=1, max_tokens=1, temperature 0."""
    model, _ = reference
    prompts = [[288, 70, 72, 79, 33, 65], [288, 84, 71, 68, 33], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    r = client.completions.create(model="tiny", prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  seed=1234, extra_body=dict(init_scale=0))
    for choice, ids in zip(sorted(r.choices, key=lambda c: c.index), prompts):
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + 1
        with torch.no_grad():
            logits = model(torch.tensor([ids]), num_steps=model.config.mean_recurrence, init_scale=0.0).logits[0]
        want = torch.log_softmax(logits, -1)
        scored = want[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1 : len(ids)], scored)) < TOL
        for t, top in enumerate(lp.top_logprobs[1 : len(ids)]):
            assert max(top.values()) == pytest.approx(float(want[t].max()), abs=TOL)


@pytest.mark.parametrize("top", [0, 1])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_legacy_top_logprobs_hold_the_chosen_token_as_openai_and_vllm(client, top, stream):
    """Completions' `top_logprobs` hold the N most likely tokens and the chosen one (sampled, or the echoed
    prompt's) when it is not among them: up to N + 1 entries, as OpenAI documents and vLLM answers. A sampled
    token outside the top N had no entry, and `logprobs: 0` gave `{}` at every position."""
    kw = dict(model="tiny", prompt="The quick", max_tokens=6, temperature=1.5, seed=3, echo=True, logprobs=top,
              extra_body=dict(ignore_eos=True))
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
                 if c.choices and c.choices[0].logprobs is not None]
        tokens, lps, tops = (sum((getattr(p, f) for p in parts), []) for f in ("tokens", "token_logprobs",
                                                                              "top_logprobs"))
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert tops[0] is None and len(tokens) == len(tops) > 6  # the first prompt token has no scores
    sampled_outside = 0
    for token, logprob, entries in zip(tokens[1:], lps[1:], tops[1:]):
        assert entries[token] == logprob and len(entries) <= top + 1
        sampled_outside += len(entries) == top + 1
    assert sampled_outside > 0  # (this seed samples tokens outside the top 1: the case that lost its entry)


def test_lm_eval_local_completions_scores_and_generates_through_the_server(server, reference, model_dir):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, tok = reference
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="tiny", tokenizer_backend="huggingface",
                             tokenizer=str(model_dir), max_length=256, num_concurrent=1, batch_size=2)
    pairs = [("def add(a, b):", " return"), ("The quick brown", " fox"), ("for i in", " range")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                           disable_tqdm=True)
    for (ctx, cont), (score, _) in zip(pairs, got):
        ctx_ids, cont_ids = lm.tok_encode(ctx), lm.tok_encode(cont)
        ids = torch.tensor([ctx_ids + cont_ids])
        generator = torch.Generator().manual_seed(1234)  # lm-eval's default seed, our s_0 draw
        with torch.no_grad():
            logits = model(ids, num_steps=model.config.mean_recurrence, generator=generator).logits[0]
        logp = torch.log_softmax(logits, -1)
        want = sum(float(logp[len(ctx_ids) - 1 + j, t]) for j, t in enumerate(cont_ids))
        assert score == pytest.approx(want, abs=1e-3)
    out = lm.generate_until([Instance("generate_until", {}, ("def add", {"until": ["\n"], "max_gen_toks": 5}), 0)],
                            disable_tqdm=True)
    assert isinstance(out[0], str) and "\n" not in out[0]


# ---------------------------------------------------------------------------------------- bad input
BAD = [
    # (id, path, body (dict, or raw bytes), status)
    ("malformed-json", "/v1/completions", b'{"prompt": "x", ', 400),
    ("body-not-object", "/v1/completions", b'["prompt"]', 400),
    ("not-utf8", "/v1/completions", b"\xff\xfe", 400),
    ("missing-prompt", "/v1/completions", {"model": "tiny"}, 400),
    ("prompt-wrong-type", "/v1/completions", {"prompt": 5}, 400),
    ("prompt-mixed-list", "/v1/completions", {"prompt": ["a", 3]}, 400),
    ("empty-token-prompt", "/v1/completions", {"prompt": [[]]}, 400),
    ("token-outside-vocab", "/v1/completions", {"prompt": [1, 2, 9999]}, 400),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404),
    ("model-not-string", "/v1/completions", {"model": 3, "prompt": "x"}, 400),
    ("prompt-longer-than-context", "/v1/completions", {"prompt": [5] * 300, "max_tokens": 1}, 400),
    ("prompt-plus-max-tokens", "/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, 400),
    ("max-tokens-string", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("max-tokens-negative", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("max-tokens-float", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400),
    ("temperature-string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("temperature-negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("top-p-zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400),
    ("seed-string", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400),
    ("stop-number", "/v1/completions", {"prompt": "x", "stop": 5}, 400),
    ("stop-empty-string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400),
    ("logprobs-too-many", "/v1/completions", {"prompt": "x", "logprobs": 1000}, 400),
    ("n-too-large", "/v1/completions", {"prompt": "x", "n": 1000}, 400),
    ("n-zero", "/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("logit-bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400),
    ("frequency-penalty", "/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400),
    ("best-of", "/v1/completions", {"prompt": "x", "best_of": 3}, 400),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "end"}, 400),
    ("num-steps-negative", "/v1/completions", {"prompt": "x", "num_steps": -1}, 400),
    ("num-steps-huge", "/v1/completions", {"prompt": "x", "num_steps": 100000}, 400),
    ("num-steps-string", "/v1/completions", {"prompt": "x", "num_steps": "8"}, 400),
    ("exit-criterion-unknown", "/v1/completions", {"prompt": "x", "exit_criterion": "nope"}, 400),
    ("exit-threshold-negative", "/v1/completions", {"prompt": "x", "exit_criterion": "kl", "exit_threshold": -1}, 400),
    ("exit-threshold-alone", "/v1/completions", {"prompt": "x", "exit_threshold": 0.1}, 400),
    ("min-over-max-steps", "/v1/completions",
     {"prompt": "x", "exit_criterion": "kl", "min_steps": 9, "max_steps": 3}, 400),
    ("kv-budget-zero", "/v1/completions", {"prompt": "x", "kv_budget": 0}, 400),
    ("kv-policy-unknown", "/v1/completions", {"prompt": "x", "kv_policy": "latest-m5"}, 400),
    ("kv-policy-mixes-core-layers", "/v1/completions", {"prompt": "x", "kv_policy": "compress-s3"}, 400),
    ("draft-steps-not-below-num-steps", "/v1/completions", {"prompt": "x", "num_steps": 4, "draft_steps": 4}, 400),
    ("draft-with-exit", "/v1/completions",
     {"prompt": "x", "num_steps": 4, "draft_steps": 2, "exit_criterion": "kl"}, 400),
    ("warm-start-string", "/v1/completions", {"prompt": "x", "warm_start": "yes"}, 400),
    ("init-scale-negative", "/v1/completions", {"prompt": "x", "init_scale": -1}, 400),
    ("messages-missing", "/v1/chat/completions", {"model": "tiny"}, 400),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, 400),
    ("message-bad-role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("message-image", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    ("chat-tools", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
    ("chat-json-mode", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, 400),
    ("chat-max-tokens-zero", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ("top-logprobs-without-logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("unknown-route", "/v1/engines", {"prompt": "x"}, 404),
    # a field of the other route was accepted and ignored (chat's echo, completions' max_completion_tokens, ...)
    ("completions-messages", "/v1/completions", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400),
    ("completions-max-completion-tokens", "/v1/completions", {"prompt": "x", "max_completion_tokens": 40}, 400),
    ("completions-top-logprobs", "/v1/completions", {"prompt": "x", "top_logprobs": 3}, 400),
    ("chat-prompt", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, 400),
    ("chat-echo", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400),
]


@pytest.mark.parametrize("path,body,status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, path, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "type" in error and "param" in error


NASTY = [
    # (id, path, raw body, the field the error names): bodies json.loads rejects with something other
    # than JSONDecodeError, and lone surrogates (valid JSON, not encodable text); each was a 500.
    ("nested-too-deep", "/v1/completions", b"[" * 100_000, None),
    ("int-over-digit-limit", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("surrogate-prompt", "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("surrogate-prompt-list", "/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
    ("surrogate-stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
    ("surrogate-message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}', "messages"),
]


@pytest.mark.parametrize("path,raw,param", [b[1:] for b in NASTY], ids=[b[0] for b in NASTY])
def test_unparseable_bodies_and_lone_surrogates_are_400s_naming_the_field(server, path, raw, param):
    r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param is None:
        assert "not valid JSON" in error["message"]
    else:
        assert "not valid Unicode" in error["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_an_oversized_body_is_refused_before_it_is_read(server):
    """The client announces 64 MiB and sends nothing more: the answer must not wait for them."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 67108864\r\n\r\n{}")
        answer = b""
        while b'"error"' not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b'"error"' in answer


def test_harmless_unsupported_fields_are_ignored_and_the_server_keeps_serving(server, client):
    r = client.completions.create(model="tiny", prompt="def", max_tokens=2, temperature=0, user="someone",
                                  presence_penalty=0, extra_body=dict(metadata={"a": 1}, best_of=1))
    assert r.choices[0].finish_reason in ("stop", "length")
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


# ---------------------------------------------------------------------------------------- load
SETTINGS = [
    dict(num_steps=4),
    dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-2),
    dict(num_steps=3, exit_criterion="latent-diff", exit_threshold=0.2),
    dict(num_steps=5, kv_budget=2),
    dict(num_steps=5, warm_start=True, exit_criterion="cosine", exit_threshold=5e-3),
    dict(num_steps=2),
    dict(num_steps=7, exit_criterion="argmax-stability", exit_threshold=2),
    dict(num_steps=4, draft_steps=1),
]


def test_32_concurrent_streams_complete_and_equal_single_requests(server, reference):
    """32 streaming clients at once, each with its own depth settings: every stream completes,
    nothing is lost, and each text equals `generate` on that request alone."""
    jobs = []
    for i in range(32):
        extra = dict(SETTINGS[i % len(SETTINGS)], init_scale=0, ignore_eos=i % 2 == 0, return_steps=True)
        jobs.append((f"client {i}: def f(x):", 6 + i % 9, extra))

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, extra: dict):
        text, steps, finish, usage = "", [], None, None
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                steps += (c.model_extra or {}).get("steps") or []
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return text, steps, finish, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, *job) for job in jobs))

    before = _metric(server, "rdepth_decode_steps_total"), _metric(server, "rdepth_batch_rows_total")
    results = asyncio.run(run_all())
    after = _metric(server, "rdepth_decode_steps_total"), _metric(server, "rdepth_batch_rows_total")
    for (prompt, max_tokens, extra), (text, steps, finish, usage) in zip(jobs, results):
        kw = {k: v for k, v in extra.items() if k not in ("ignore_eos", "return_steps", "init_scale")}
        stops = [] if extra["ignore_eos"] else None
        want_text, tokens, want_steps, want_finish, _ = expected(reference, encode(reference, prompt), max_tokens,
                                                                 stops=stops, init_scale=0.0, **kw)
        assert (text, steps, finish) == (want_text, want_steps, want_finish), prompt
        assert usage.completion_tokens == len(tokens)
    mean_rows = (after[1] - before[1]) / max(1, after[0] - before[0])
    assert mean_rows > 4, f"the batch held {mean_rows:.1f} rows per decode step on average"


def _metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_client_that_disconnects_frees_its_slot(server):
    body = dict(prompt="def", max_tokens=200, temperature=0, stream=True, ignore_eos=True, num_steps=8)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(server.url + "/health").json()["running"] == 1
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["running"] != 0:
        assert time.monotonic() < deadline, "the disconnected stream still holds its row"
        time.sleep(0.05)
    tokens = _metric(server, "rdepth_generation_tokens_total")
    time.sleep(0.2)
    assert _metric(server, "rdepth_generation_tokens_total") == tokens  # nothing runs for it any more


def test_overload_answers_429_and_timeouts_504(model_dir):
    app = build_app(model_dir, model_name="tiny", max_batch=1, max_queue=2, request_timeout=30.0)
    with LiveServer(app) as live:
        async def fire():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
                body = dict(prompt="def", max_tokens=40, temperature=0, ignore_eos=True, num_steps=8)
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(fire())
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        refused = next(r for r in responses if r.status_code == 429).json()["error"]
        assert refused["type"] == "rate_limit_error" and "capacity" in refused["message"]
        assert all(len(r.json()["choices"][0]["text"]) >= 0 for r in responses if r.status_code == 200)
        assert httpx.get(live.url + "/health").json()["status"] == "ok"

    app = build_app(model_dir, model_name="tiny", request_timeout=0.3)
    with LiveServer(app) as live:
        r = httpx.post(live.url + "/v1/completions", timeout=30,
                       json=dict(prompt="def", max_tokens=250, temperature=0, ignore_eos=True, num_steps=64))
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        deadline = time.monotonic() + 10
        while httpx.get(live.url + "/health").json()["running"]:
            assert time.monotonic() < deadline, "the timed-out request still holds its row"
            time.sleep(0.05)


def test_default_queue_admits_at_least_64_waiting_requests(server):
    from recurrent_depth.cli import build_parser

    args = build_parser("serve").parse_args(["serve", "--model", "m"])
    assert args.max_queue >= 64 and args.host == "127.0.0.1"


def test_a_model_without_tokenizer_refuses_stop_strings_it_could_never_match(reference):
    """Token-id-only serving: a stop string has no text to be found in, so it is a 400, not ignored."""
    model, _ = reference
    with LiveServer(build_app(model, model_name="ids")) as live:
        r = httpx.post(live.url + "/v1/completions", json=dict(prompt=[5, 6], max_tokens=2, stop=["a"]), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        r = httpx.post(live.url + "/v1/completions", timeout=30,
                       json=dict(prompt=[5, 6], max_tokens=2, stop_token_ids=[7], temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""


def test_a_kv_lookup_the_models_mixers_cannot_follow_is_a_400():
    """rd.generate refuses 'skip' / 'always-last' on a model without softmax attention in one line; the server
    answered the same request with a 500 "generation failed" from its solo run."""
    torch.manual_seed(3)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer={"core": "mla"})).eval()
    with LiveServer(build_app(model, model_name="ids", tokenizer_workers=1)) as live:
        for policy in ("per-step+skip", "always-last-m4"):
            r = httpx.post(live.url + "/v1/completions", timeout=30, json=dict(
                prompt=[5, 6], max_tokens=2, temperature=0, exit_criterion="kl", kv_policy=policy))
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_policy", r.text
            assert "softmax attention" in r.json()["error"]["message"]
    # a mode the model cannot run (self-speculative decoding re-runs cached positions, which a recurrent state
    # cannot undo): a 400 naming the field before the request runs, as rd.generate refuses it up front
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer={"core": "gated_deltanet"})).eval()
    with LiveServer(build_app(model, model_name="ids", tokenizer_workers=1)) as live:
        r = httpx.post(live.url + "/v1/completions", timeout=30, json=dict(
            prompt=[5, 6], max_tokens=2, temperature=0, num_steps=2, draft_steps=1))
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_steps", r.text


def test_build_app_refuses_a_nan_request_timeout(reference):
    model, _ = reference
    with pytest.raises(ValueError, match="request_timeout"):
        build_app(model, request_timeout=float("nan"))


def test_serve_bounds_the_wait_for_open_streams_on_shutdown(reference, monkeypatch):
    # uvicorn's default waits for every open stream on Ctrl-C / SIGTERM, up to the whole request timeout.
    # (Issue 19 item 5: serve() runs its own uvicorn Server, which ends open requests with a 503 after the
    # grace period, so this looks at that server's config instead of uvicorn.run's arguments.)
    from recurrent_depth import serving
    from recurrent_depth.serving.transport import Server

    calls = {}
    monkeypatch.setattr(Server, "run", lambda self: calls.update(port=self.config.port, grace=self.grace,
                                                                 limit=self.config.timeout_graceful_shutdown))
    serving.serve(reference[0], port=1234)
    assert calls["port"] == 1234 and calls["grace"] == serving.SHUTDOWN_GRACE_S and calls["limit"] <= 10


# ---------------------------------------------------------------------------------------- auth and CLI
def test_api_key_guards_every_route_but_health(model_dir):
    with LiveServer(build_app(model_dir, model_name="tiny", api_key="s3cret")) as live:
        assert httpx.get(live.url + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, live.url + path, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        good = live.client(api_key="s3cret")
        assert good.completions.create(model="tiny", prompt="def", max_tokens=2).choices[0].text is not None


def test_rdepth_serve_command_reads_the_api_key_from_the_environment(model_dir, monkeypatch):
    """`rdepth serve` builds the app from the directory; the server's run is replaced by a live server."""
    from recurrent_depth.cli import main
    from recurrent_depth.serving.transport import Server

    seen = {}

    def run(self):
        app, host, port = self.config.app, self.config.host, self.config.port
        seen.update(host=host, port=port)
        with LiveServer(app) as live:
            seen["no_key"] = httpx.get(live.url + "/v1/models").status_code
            seen["health"] = httpx.get(live.url + "/health").status_code
            auth = {"Authorization": "Bearer env-key"}
            r = httpx.get(live.url + "/v1/models", headers=auth)
            seen["models"] = [m["id"] for m in r.json()["data"]]
            r = httpx.post(live.url + "/v1/completions", headers=auth, timeout=30,
                           json=dict(prompt="def", max_tokens=3, temperature=0, ignore_eos=True, return_steps=True))
            seen["steps"] = r.json()["choices"][0]["steps"]  # --num-steps sets the default depth

    monkeypatch.setattr(Server, "run", run)
    monkeypatch.setenv("RDEPTH_API_KEY", "env-key")
    threads = torch.get_num_threads()
    assert main(["serve", "--model", str(model_dir), "--port", "8123", "--threads", "1", "--num-steps", "3"]) == 0
    torch.set_num_threads(threads)
    assert seen == dict(host="127.0.0.1", port=8123, no_key=401, health=200, models=[model_dir.name],
                        steps=[3, 3, 3])
    assert main(["serve", "--model", str(model_dir / "missing")]) == 2
    assert main(["serve", "--model", str(model_dir), "--port", "0"]) == 2


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "def add"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
                         ids=["completions", "chat"])
def test_with_include_usage_every_chunk_carries_usage_null_but_the_last(server, path, body):
    """OpenAI's stream_options.include_usage: "all other chunks will also include a usage field, but with a
    null value"; the chunks before the last had no usage key at all."""
    with httpx.stream("POST", server.url + path, timeout=60, json=dict(
            model="tiny", max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True},
            **body)) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == []


def test_a_bad_server_setting_from_generation_config_json_names_the_file(model_dir, tmp_path, capsys):
    """The file's num_steps / kv_quant become --num-steps / --kv-quant: a bad one was refused as a flag the user
    never gave. The error now names the file; the flag's own value is refused as before."""
    import shutil
    import socket

    from recurrent_depth.cli import main

    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    for setting, flag in (({"num_steps": 100}, "--num-steps 100"), ({"kv_quant": "k=zzz"}, "--kv-quant 'k=zzz'")):
        (directory / "generation_config.json").write_text(json.dumps(setting))
        assert main(["serve", "--model", str(directory), "--port", port, "--threads", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"rdepth serve: error: {flag} is invalid") and err.endswith(
            f"(set by {directory / 'generation_config.json'}; --generation-config none ignores it)"), err
    assert main(["serve", "--model", str(directory), "--port", port, "--threads", "1", "--kv-quant", "k=yyy"]) == 2
    assert "generation_config.json" not in capsys.readouterr().err


def test_rdepth_serve_takes_the_generation_config_json_as_request_defaults(model_dir, reference, tmp_path,
                                                                           monkeypatch):
    """As vLLM's --generation-config auto: the fields a request leaves out (temperature, top_k, max_tokens, seed, our
    init_scale) come from the model directory's generation_config.json on both endpoints, and its eos_token_id stops
    a row; a request's own values win; --generation-config none ignores the file. rdepth serve took only the file's
    num_steps: requests without temperature sampled at 1, for 16 tokens / the rest of the context."""
    import shutil

    from transformers import AutoTokenizer

    from recurrent_depth.cli import main
    from recurrent_depth.serving.transport import Server

    model, tok = reference
    eos = model.config.eos_token_id
    prompt = encode(reference, "The quick")
    greedy = generate(model, torch.tensor(prompt), max_new_tokens=6, num_steps=3, init_scale=0.0,
                      stop=[eos]).token_lists()[0]
    stop = next(t for i, t in enumerate(greedy) if i > 0 and t not in greedy[:i])  # the file's eos: ends row there
    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_k": 5, "max_new_tokens": 4, "seed": 5, "num_steps": 2,
        "init_scale": 0.0, "eos_token_id": stop}))
    messages = [{"role": "user", "content": "add two numbers"}]
    chat_ids = tok.encode(AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False).ids
    requests = {"completion": ("/v1/completions", dict(prompt=prompt)),
                "own": ("/v1/completions", dict(prompt=prompt, temperature=0, max_tokens=6, num_steps=3)),
                "chat": ("/v1/chat/completions", dict(messages=messages)),
                "chat_own": ("/v1/chat/completions", dict(messages=messages, temperature=0, max_tokens=1))}
    answers = {}

    def run(self):
        with LiveServer(self.config.app) as live:
            for name, (path, body) in requests.items():
                r = httpx.post(live.url + path, timeout=60, json=dict(return_steps=True, **body))
                answers[name] = r.json()["choices"][0]

    monkeypatch.setattr(Server, "run", run)
    threads = torch.get_num_threads()
    try:
        assert main(["serve", "--model", str(directory), "--port", "8124", "--threads", "1",
                     "--tokenizer-workers", "1"]) == 0
        file = dict(do_sample=True, temperature=0.7, top_k=5, seed=5, num_steps=2, init_scale=0.0)
        text, tokens, steps, finish, _ = expected(reference, prompt, 4, stops=[eos, stop], **file)
        assert answers["completion"]["text"] == text and answers["completion"]["finish_reason"] == finish
        assert answers["completion"]["steps"] == steps == [2] * len(tokens)
        own = answers["own"]  # greedy, 6 tokens at depth 3 asked; the file's init_scale and eos still apply
        assert own["steps"] == [3] * (greedy.index(stop) + 1) and own["finish_reason"] == "stop"
        chat_stops = [eos, tok.token_to_id("<|end_turn|>"), stop]
        text, tokens, *_ = expected(reference, chat_ids, 4, stops=chat_stops, **file)
        assert answers["chat"]["message"]["content"] == text and len(answers["chat"]["steps"]) == len(tokens)
        text, *_ = expected(reference, chat_ids, 1, stops=chat_stops, num_steps=2, init_scale=0.0)
        assert answers["chat_own"]["message"]["content"] == text and answers["chat_own"]["steps"] == [2]

        requests.clear()
        requests["none"] = ("/v1/completions", dict(prompt=prompt, temperature=0, ignore_eos=True))
        assert main(["serve", "--model", str(directory), "--port", "8124", "--threads", "1",
                     "--tokenizer-workers", "1", "--generation-config", "none"]) == 0
        r = model.config.mean_recurrence
        assert answers["none"]["steps"] == [r] * 16  # OpenAI's 16 tokens at the model's depth: the file unread
    finally:
        torch.set_num_threads(threads)


def test_generation_config_defaults_follow_do_sample_and_bad_ones_fail_at_start_up(reference, model_dir, capsys):
    """The file's do_sample decides as in transformers (vLLM would sample at the file's temperature whatever its
    do_sample); a request's temperature 0 or top_k -1 turns the file's sampling settings off; a value the server
    refuses, stop strings without a tokenizer or an eos outside the vocabulary fail at start-up naming the file."""
    from recurrent_depth.serving.protocol import Limits, generation_fields, request_defaults

    def fields(file: dict, body: dict) -> dict:
        return generation_fields(body, Limits(256, 4, 320, defaults=request_defaults(file)[0]))[0]

    assert fields({"do_sample": False, "temperature": 0.5}, {}) == {"do_sample": False}  # greedy
    assert fields({"temperature": 0.5, "top_p": 0.9}, {}) == {"do_sample": True, "temperature": 1.0}  # OpenAI's 1
    assert fields({"temperature": 0.5, "top_p": 0.9}, {"temperature": 0.3}) == {
        "do_sample": True, "temperature": 0.3, "top_p": 0.9}  # a request that samples: the file's top_p shapes it
    sampling = {"do_sample": True, "temperature": 0.5, "top_k": 5}
    assert fields(sampling, {}) == sampling
    assert fields(sampling, {"temperature": 0}) == {"do_sample": False}
    assert fields(sampling, {"top_k": -1}) == {"do_sample": True, "temperature": 0.5}
    # a request's exit_threshold "auto" is the official threshold of the file's exit_criterion (it was a 400
    # "needs an exit_criterion": resolved before the file joined), as in rdepth generate
    assert fields({"exit_criterion": "latent-diff"}, {"exit_threshold": "auto", "temperature": 0}) == {
        "do_sample": False, "exit_criterion": "latent-diff", "exit_threshold": 0.03}

    model = reference[0]
    for defaults, message in (
            ({"do_sample": True, "temperature": 500.0}, r": 'temperature'=500.0 is out of range: this server allows "
                                                        r"at most 100.0 \(rdepth serve --generation-config none"),
            # (a chat answer of 0 tokens was every chat request's default)
            ({"max_new_tokens": 0}, r": max_new_tokens=0 is invalid as the requests' default: expected an integer"),
            ({"stop": ["x"]}, r" sets stop strings \['x'\], which need the model directory's tokenizer.json"),
            ({"eos_token_id": 999}, r": eos_token_id=999 is invalid: expected None, a token id")):
        with pytest.raises(ValueError, match="^generation_config.json" + message):
            build_app(model, generation_defaults=defaults, tokenizer_workers=1)
    # more stop strings than a request may send (a 400) were the default of every request without 'stop'
    with pytest.raises(ValueError, match=r"^generation_config.json: 'stop' has 17 strings; at most 16 are allowed"):
        build_app(model, tokenizer_dir=model_dir, generation_defaults={"stop": [f"s{i}" for i in range(17)]},
                  tokenizer_workers=1)
    build_app(model, generation_defaults={"headway": 2}, tokenizer_workers=1)
    assert "generation_config.json sets ['headway'], which requests do not take" in capsys.readouterr().err


def test_build_app_reads_the_model_directorys_generation_config_and_its_stop_strings_stop_a_request(model_dir,
                                                                                                   reference,
                                                                                                   tmp_path):
    """`build_app(model_dir)` reads generation_config.json as `rdepth serve` does (it did not: a request sampled at
    temperature 1 for 16 tokens at the model's depth); the file's stop_strings are the default `stop` of a request
    without one, and a request's own `stop` replaces them; generation_config="none" ignores the file."""
    import shutil

    prompt = encode(reference, "The quick")
    text, tokens, *_ = expected(reference, prompt, 8, num_steps=2, do_sample=False, init_scale=0.0)
    mark = text[3:5]  # (its first occurrence ends the answer)
    assert len(text) > 5 and mark.strip(), text
    directory = tmp_path / "model"
    shutil.copytree(model_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "init_scale": 0.0, "max_new_tokens": 8, "num_steps": 2, "stop_strings": [mark]}))
    app = build_app(directory, tokenizer_workers=1)
    assert "default depth 2," in app.state.banner("")  # the file's num_steps, as rdepth serve's --num-steps
    with LiveServer(app) as live:
        answers = [httpx.post(live.url + "/v1/completions", timeout=60, json=dict(prompt=prompt, **body)).json()
                   for body in ({}, {"stop": "\x00"})]
    first, own = answers[0]["choices"][0], answers[1]["choices"][0]
    assert (first["text"], first["finish_reason"]) == (text[:text.index(mark)], "stop"), answers[0]
    assert own["text"] == text and answers[1]["usage"]["completion_tokens"] == len(tokens), answers[1]
    r = reference[0].config.mean_recurrence
    assert f"default depth {r}," in build_app(directory, tokenizer_workers=1, generation_config="none").state.banner("")
    with pytest.raises(ValueError, match=r"^generation_config='vllm' is invalid: expected one of \['auto', 'none'\]"):
        build_app(directory, generation_config="vllm")
