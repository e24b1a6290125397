"""Several LoRA adapters on one served base (`rdepth serve --lora-modules NAME=DIR ...`, serving/adapters.py).

Exactness: a request for adapter X answers exactly what a server with `--lora X` alone answers (the base's
requests what the base alone answers), token ids and log-probabilities, also while requests for the other
adapters run at the same time (in the same batches: each row adds its own adapter)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.serving import build_app
from recurrent_depth.serving.adapters import parse_lora_modules
from recurrent_depth.train.lora import LoraSpec, add_lora, attach_adapter, save_adapter
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixtures

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [7]]
BODY = dict(max_tokens=6, temperature=0, logprobs=2, extra_body=dict(init_scale=0, num_steps=3, ignore_eos=True))


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):  # noqa: F811 - the fixture
    """Two adapters of the tiny base on different parts, with random A and B (B = 0 would change nothing)."""
    out = tmp_path_factory.mktemp("adapters")
    for i, (name, spec) in enumerate({"sql": LoraSpec(rank=2, parts=("core",)),
                                      "chat": LoraSpec(rank=4, alpha=4, parts=("adapter", "coda"))}.items()):
        wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(model_dir).eval(), spec, base_dir=model_dir)
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for param_name, param in wrapped.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        save_adapter(wrapped, out / name)
    return {"sql": out / "sql", "chat": out / "chat"}


def answers(url: str, model: str) -> list[tuple[list[str], list[float], list]]:
    """Each of PROMPTS completed alone, in turn: (tokens, logprobs, top logprobs)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model=model, prompt=prompt, **BODY)
        lp = r.choices[0].logprobs
        assert r.model == model
        out.append((lp.tokens, lp.token_logprobs, lp.top_logprobs))
    return out


def single_server_answers(model_dir, adapter) -> list:  # noqa: F811 - the fixture
    """What a server with `--lora adapter` alone (None: no adapter) answers, as `rdepth serve --lora` builds it."""
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    if adapter is not None:
        model = attach_adapter(model, adapter, model_dir=model_dir)
    with LiveServer(build_app(model, tokenizer_dir=model_dir, model_name="tiny", tokenizer_workers=1)) as live:
        return answers(live.url, "tiny")


@pytest.fixture(scope="module")
def multi(model_dir, adapters):  # noqa: F811 - the fixture
    app = build_app(model_dir, model_name="tiny", lora_modules=adapters, tokenizer_workers=1)
    with LiveServer(app) as live:
        yield live


def test_each_adapter_and_the_base_answer_exactly_as_a_server_of_their_own(multi, model_dir, adapters):  # noqa: F811
    got = {name: answers(multi.url, name) for name in ("tiny", "sql", "chat")}
    want = {name: single_server_answers(model_dir, adapters.get(name)) for name in ("tiny", "sql", "chat")}
    for name in want:
        assert got[name] == want[name], name
    assert answers(multi.url, "tiny") == want["tiny"]  # (the base again, after the adapters)
    tokens = {name: [a[0] for a in got[name]] for name in want}
    assert tokens["sql"] != tokens["tiny"] and tokens["chat"] != tokens["tiny"] and tokens["sql"] != tokens["chat"]


def test_concurrent_requests_of_different_adapters_each_equal_their_own(multi):
    """Requests naming the base and both adapters, all at once and interleaved: each equals the same request
    alone (token ids exactly, log-probabilities to float rounding: the requests share mixed batches)."""
    alone = {name: answers(multi.url, name) for name in ("tiny", "sql", "chat")}
    jobs = [(name, p) for _ in range(3) for name in ("sql", "tiny", "chat") for p in range(len(PROMPTS))]
    before = float(next(line.split()[-1] for line in httpx.get(multi.url + "/metrics").text.splitlines()
                        if line.startswith("rdepth_adapter_switches_total")))

    async def run_all():
        async with openai.AsyncOpenAI(base_url=multi.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.completions.create(model=name, prompt=PROMPTS[p], **BODY)
                                          for name, p in jobs))

    for (name, p), r in zip(jobs, asyncio.run(run_all())):
        tokens, logprobs, _ = alone[name][p]
        assert r.model == name and r.choices[0].logprobs.tokens == tokens, (name, p)
        assert r.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4), (name, p)
    after = float(next(line.split()[-1] for line in httpx.get(multi.url + "/metrics").text.splitlines()
                       if line.startswith("rdepth_adapter_switches_total")))
    assert after == before  # (rows of different adapters shared batches: the model switched no adapter)


def test_models_lists_the_base_and_each_adapter_and_unknown_names_are_404s(multi):
    cards = httpx.get(multi.url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("tiny", "tiny", None), ("sql", "tiny", "tiny"), ("chat", "tiny", "tiny")]
    assert httpx.get(multi.url + "/v1/models/sql").json()["parent"] == "tiny"
    for response in (httpx.get(multi.url + "/v1/models/nope"),
                     httpx.post(multi.url + "/v1/completions", json={"model": "nope", "prompt": [1]})):
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert "'nope' does not exist" in message and all(n in message for n in ("tiny", "sql", "chat")), message
    huge = "m" * 1_000_000  # (came back whole in the 404, in the request's answer and the model route's)
    for response in (httpx.get(f"{multi.url}/v1/models/{huge[:8000]}"),
                     httpx.post(multi.url + "/v1/completions", json={"model": huge, "prompt": [1]})):
        assert response.status_code == 404 and len(response.text) < 1000, len(response.text)
        assert " characters) does not exist; this server serves ['chat', 'sql', 'tiny']" in response.text


@pytest.mark.parametrize("specs, message", [
    (["sql"], r"--lora-modules 'sql' is invalid: expected NAME=ADAPTER_DIR"),
    (["sql="], r"--lora-modules 'sql=' is invalid: expected NAME=ADAPTER_DIR"),
    (["=dir"], r"--lora-modules name '' is invalid"),
    (["a b=dir"], r"--lora-modules name 'a b' is invalid"),
    (["sql=a", "sql=b"], r"--lora-modules names 'sql' twice"),
])
def test_bad_lora_modules_are_one_line_errors(specs, message):
    with pytest.raises(ValueError, match=message) as caught:
        parse_lora_modules(specs)
    assert "\n" not in str(caught.value)


def test_rdepth_serve_refuses_bad_lora_modules_in_one_line(model_dir, adapters, capsys):  # noqa: F811
    cases = [(["--lora-modules", "sql"], "expected NAME=ADAPTER_DIR"),
             (["--lora-modules", f"sql={adapters['sql']}", "--lora", str(adapters["chat"])], "cannot be combined"),
             (["--lora-modules", f"tiny={adapters['sql']}", "--served-model-name", "tiny"], "base model's served name")]
    with socket.socket() as probe:  # a port free now (the last case fails after the model loads)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    for flags, message in cases:
        capsys.readouterr()
        assert main(["serve", "--model", str(model_dir), "--port", port, *flags]) == 2, flags
        err = [line for line in capsys.readouterr().err.splitlines() if "threads" not in line and line.strip()]
        assert len(err) == 1 and message in err[0], (flags, err)


def test_every_adapter_must_fit_the_base(model_dir, adapters, tmp_path):  # noqa: F811 - the fixture
    """An adapter of another base's weights warns (strict: refused), one of other shapes is refused, each in one
    line naming it; a model that already carries an adapter is refused."""
    from recurrent_depth.train.lora import AdapterBaseWarning

    torch.manual_seed(5)
    sibling = rd.RecurrentDepthLM(rd.RecurrentDepthLM.from_pretrained(model_dir).config)  # same shapes, other weights
    save_adapter(add_lora(sibling, LoraSpec(rank=2, parts=("core",))), tmp_path / "sibling")
    small = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=320, coda_layers=2))
    save_adapter(add_lora(small, LoraSpec(rank=2, parts=("coda",))), tmp_path / "other")
    modules = {**adapters, "sibling": tmp_path / "sibling"}
    with pytest.warns(AdapterBaseWarning):
        build_app(model_dir, lora_modules=modules, tokenizer_workers=1)
    for kwargs, message in [(dict(lora_modules=modules, strict_lora_base=True), "sibling"),
                            (dict(lora_modules={**adapters, "other": tmp_path / "other"}), "other")]:
        with pytest.raises(ValueError, match=message) as caught:
            build_app(model_dir, tokenizer_workers=1, **kwargs)
        assert "\n" not in str(caught.value)
    adapted = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir), adapters["sql"])
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        build_app(adapted, lora_modules={"chat": adapters["chat"]})


def test_the_scheduler_runs_one_adapter_at_a_time_and_no_adapter_starves(model_dir):  # noqa: F811 - the fixture
    from types import SimpleNamespace

    from recurrent_depth.serving.engine import BatchScheduler

    def job(name: str) -> SimpleNamespace:
        adapter = None if name.startswith("base") else name[0]
        # (peft_adapter: what `submit` binds, the scheduler's identity of the adapter)
        return SimpleNamespace(name=name, served_adapter=adapter, peft_adapter=adapter, trains=False,
                               row=SimpleNamespace(prompt=[1, 2]))

    scheduler = BatchScheduler(rd.RecurrentDepthLM.from_pretrained(model_dir), max_batch=8)
    scheduler.waiting.extend(map(job, ["a1", "b1", "a2", "base1", "a3"]))
    # nothing runs: the oldest waiting job's adapter goes next, with every waiting job of it
    assert [j.name for j in scheduler._take_admissible()] == ["a1", "a2", "a3"]
    assert [j.name for j in scheduler.waiting] == ["b1", "base1"]
    scheduler.adapters = SimpleNamespace(active="a")  # (as `_run`'s switch leaves it)
    scheduler.solos.append((job("a1"), None))  # while "a" runs, its jobs join only ahead of another adapter's
    scheduler.waiting.clear()
    scheduler.waiting.extend(map(job, ["a4", "b2", "a5"]))
    assert [j.name for j in scheduler._take_admissible()] == ["a4"]
    assert [j.name for j in scheduler.waiting] == ["b2", "a5"]
    scheduler.solos.clear()  # "a" drained: "b" goes next, though "a5" could have joined a running "a"
    assert [j.name for j in scheduler._take_admissible()] == ["b2"]


def test_every_job_of_an_adapter_waiting_when_its_phase_starts_joins_it(model_dir):  # noqa: F811 - the fixture
    """Jobs the prefill budget (or the free rows) leave for later iterations still join their adapter's phase:
    they were held behind the first job of another adapter, so prompts over half the budget ran one row per
    phase, with a switch between every two requests."""
    from types import SimpleNamespace

    from recurrent_depth.serving.engine import BatchScheduler

    def job(name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, served_adapter=name[0], peft_adapter=name[0], trains=False,
                               row=SimpleNamespace(prompt=[1] * 300))

    scheduler = BatchScheduler(rd.RecurrentDepthLM.from_pretrained(model_dir), max_batch=8, prefill_tokens=400)
    scheduler.waiting.extend(map(job, ["a1", "b1", "a2", "b2", "a3"]))
    assert [j.name for j in scheduler._take_admissible()] == ["a1"]  # (a2 is over this iteration's budget)
    assert [j.name for j in scheduler.waiting] == ["a2", "a3", "b1", "b2"]  # "a" ahead, the others in order
    scheduler.adapters = SimpleNamespace(active="a")  # (as `_run`'s switch leaves it)
    scheduler.solos.append((job("a1"), None))  # "a1" runs: the rest of its phase joins, one per iteration
    assert [j.name for j in scheduler._take_admissible()] == ["a2"]
    scheduler.waiting.append(job("a4"))  # one arriving now waits behind "b"
    assert [j.name for j in scheduler._take_admissible()] == ["a3"]
    assert [j.name for j in scheduler._take_admissible()] == []
    assert [j.name for j in scheduler.waiting] == ["b1", "b2", "a4"]


def test_the_adapters_a_server_serves_are_its_schedulers(model_dir, adapters):  # noqa: F811 - the fixture
    """The handlers take the adapters' names from the scheduler (create_app with a scheduler holding adapters
    listed none, and refused requests for them); the scheduler refuses a job naming an adapter it lacks, which
    stopped its engine for every client; an adapter it turns on stays frozen, as `--lora`'s."""
    from types import SimpleNamespace

    from recurrent_depth.serving.adapters import ServedAdapters
    from recurrent_depth.serving.app import create_app
    from recurrent_depth.serving.engine import BatchScheduler
    from recurrent_depth.serving.handlers import ServerSettings
    from recurrent_depth.serving.text import TextCodec

    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    scheduler = BatchScheduler(model, adapters=ServedAdapters(model, {"sql": adapters["sql"]}))
    app = create_app(scheduler, TextCodec(model_dir, 320), ServerSettings("tiny", tokenizer_workers=1))
    with LiveServer(app) as live:
        assert [c["id"] for c in httpx.get(live.url + "/v1/models").json()["data"]] == ["tiny", "sql"]
        with pytest.raises(ValueError, match=r"adapter 'chat', which this scheduler does not serve \(its adapters: "
                                             r"\['sql'\]\)"):
            scheduler.submit([SimpleNamespace(served_adapter="chat")])
        answers(live.url, "sql")
        assert scheduler.healthy and scheduler.adapters.active is None  # (the batch's rows add their own)
        # (as a solo job's switch does; nothing runs now)
        scheduler.adapters.turn_on(scheduler.adapters.peft_name("sql"))
        assert not [name for name, p in model.named_parameters() if p.requires_grad]
