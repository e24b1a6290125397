"""Mixed-adapter batches of the multi-adapter server (`rdepth serve --lora-modules`, serving/adapters.py): rows of
different LoRA adapters (and of the base) share one batch, each adding its own adapter in every model call
(`inference.lora_layers.RowAdapters`: peft's mixed-batch `adapter_names` in the model's own layers, per-row terms
in the fused runner, `accel/lora.py`).

Each request must equal what it computes alone on a server with `--lora` of its adapter (the base: none), through
the fused runner and the reference (eager) one; runtime unloads wait for the mixed batch and leave it exact."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.adapters import ServedAdapters
from recurrent_depth.serving.batch import RowRequest
from recurrent_depth.serving.engine import BatchScheduler, Done, Failed, Job, TokenOut, UnknownAdapter
from recurrent_depth.serving.text import TextCodec, TextState
from recurrent_depth.train.lora import LoraSpec, add_lora, attach_adapter, save_adapter
from tests.test_serving import model_dir  # noqa: F401 - fixtures

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [7], [9, 8, 7]]
TOKENS = 5


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):  # noqa: F811 - the fixture
    """Two adapters of the tiny base that share layers (the core's, the recurrence adapter's: a row must add its
    own of the two there), with random A and B (B = 0 would change nothing)."""
    out = tmp_path_factory.mktemp("mixed_adapters")
    for i, (name, spec) in enumerate({"sql": LoraSpec(rank=2, parts=("core", "adapter")),
                                      "chat": LoraSpec(rank=4, alpha=4, parts=("adapter", "core", "coda"))}.items()):
        wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(model_dir).eval(), spec, base_dir=model_dir)
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for param_name, param in wrapped.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        save_adapter(wrapped, out / name)
    return {"sql": out / "sql", "chat": out / "chat"}


def run(scheduler: BatchScheduler, names: list[str | None], prompts: list[int] | None = None,
        sink=None, solo: frozenset[int] = frozenset()) -> list[tuple[list[int], list[float]]]:
    """One job per name (an adapter, None: the base), of prompt `prompts[i]` (default: i % len(PROMPTS)), greedy,
    submitted at once: each one's (token ids, log-probabilities). sink: also sent every event; solo: the jobs
    that run alone (as speculative decoding does), outside the batch."""
    prompts = prompts or [i % len(PROMPTS) for i in range(len(names))]
    opts = GenerationOptions(max_new_tokens=TOKENS, num_steps=3, init_scale=0.0).validate(6)
    out: dict[int, tuple[list[int], list[float]]] = {i: ([], []) for i in range(len(names))}
    done, ended = threading.Event(), []

    def collect(event) -> None:
        if sink is not None:
            sink(event)
        if isinstance(event, TokenOut):
            out[event.index][0].append(event.token)
            out[event.index][1].append(event.logprob)
        elif isinstance(event, Done | Failed):
            assert isinstance(event, Done), event
            ended.append(event)
            if len(ended) == len(names):
                done.set()

    scheduler.submit([Job(RowRequest(PROMPTS[p], opts, 0, top_logprobs=2), TOKENS, frozenset(),
                          TextState(TextCodec(None, 320), []), collect, time.monotonic() + 120, index=i,
                          served_adapter=name, solo=i in solo,
                          generation_kwargs=dict(num_steps=3, init_scale=0.0, max_new_tokens=TOKENS))
                      for i, (name, p) in enumerate(zip(names, prompts))])
    assert done.wait(120)
    return [out[i] for i in range(len(names))]


def alone(model_dir, adapter_dir, prompts: list[int]) -> dict[int, tuple[list[int], list[float]]]:  # noqa: F811
    """Each prompt (an index of PROMPTS) run alone on a scheduler of the base with `--lora adapter_dir` (None:
    none), as `rdepth serve --lora` builds it."""
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    if adapter_dir is not None:
        model = attach_adapter(model, adapter_dir, model_dir=model_dir)
    scheduler = BatchScheduler(model, max_batch=8)
    scheduler.start()
    try:
        return {p: run(scheduler, [None], [p])[0] for p in sorted(set(prompts))}
    finally:
        scheduler.stop()


def watch_rows(scheduler: BatchScheduler) -> list[set]:
    """Records the adapters of the batch's rows at each decode step."""
    seen: list[set] = []
    step = scheduler.batch.step

    def recording():
        seen.append({seq.peft_adapter for seq in scheduler.batch.rows})
        return step()

    scheduler.batch.step = recording
    return seen


@pytest.mark.parametrize("runner", ["fast", "reference"])
def test_a_mixed_batch_equals_each_request_alone(model_dir, adapters, runner, monkeypatch):  # noqa: F811
    """Rows of the base and of both adapters in one batch, and beside them solo jobs of both adapters (one
    adapter on at a time: the second waits for the first), each equal to the request alone."""
    if runner == "reference":
        monkeypatch.setenv("RDEPTH_NO_ACCEL", "1")
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    served = ServedAdapters(model, adapters, model_dir=model_dir)
    scheduler = BatchScheduler(model, max_batch=8, adapters=served)
    assert served.mixes and scheduler.batch.runner.name == runner
    seen = watch_rows(scheduler)
    names = ["sql", None, "chat", "sql", "chat", None, "sql", "chat"]
    solo = frozenset({2, 6})
    scheduler.start()
    try:
        got = run(scheduler, names, solo=solo)
    finally:
        scheduler.stop()
    assert max(map(len, seen)) == 3  # (the base's and both adapters' rows in one batch)
    assert scheduler.metrics.adapter_switches == 2  # (the solo jobs': chat, then sql)
    want = {name: alone(model_dir, adapters.get(name), [i % len(PROMPTS) for i, n in enumerate(names) if n == name])
            for name in ("sql", "chat", None)}
    for i, name in enumerate(names):
        tokens, logprobs = want[name][i % len(PROMPTS)]
        assert got[i][0] == tokens, (i, name)
        assert got[i][1] == pytest.approx(logprobs, abs=1e-5), (i, name)
    adapted = {name: [got[i][0] for i, n in enumerate(names) if n == name][0] for name in ("sql", "chat", None)}
    assert len({tuple(t) for t in adapted.values()}) == 3  # (each adapter changes the answer)


def test_an_unload_during_a_mixed_batch_waits_for_it_and_later_batches_stay_exact(model_dir, adapters,  # noqa: F811
                                                                                  tmp_path):
    """An unload asked for while rows of both adapters and the base run answers once they have finished (their
    tokens as without it); afterwards the name is refused, the others' mixed batch is unchanged, and the adapter
    loaded again mixes with them again (the runner's per-row terms follow the layers)."""
    for name, path in adapters.items():
        shutil.copytree(path, tmp_path / name)
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    served = ServedAdapters(model, {n: tmp_path / n for n in adapters}, model_dir=model_dir, updates_root=tmp_path)
    scheduler = BatchScheduler(model, max_batch=8, adapters=served)
    seen = watch_rows(scheduler)
    names = ["sql", None, "chat", "sql", "chat", None]
    scheduler.start()
    try:
        before = run(scheduler, names)
        unloads, ended = [], []

        def unload_at_first_token(event) -> None:  # (on the scheduler's thread, while the mixed batch runs)
            if isinstance(event, TokenOut) and not unloads:
                unloads.append(scheduler.unload_adapter("chat"))
                unloads[0].add_done_callback(lambda _: ended.append("unload"))
            elif isinstance(event, Done):
                ended.append(event.index)

        during = run(scheduler, names, sink=unload_at_first_token)
        assert unloads[0].result(60) is None
        assert ended[-1] == "unload" and sorted(ended[:-1]) == list(range(len(names)))  # (after every row ended)
        assert during == before
        assert max(map(len, seen)) == 3
        with pytest.raises(UnknownAdapter):
            run(scheduler, ["chat"])
        rest = [i for i, n in enumerate(names) if n != "chat"]
        assert run(scheduler, [names[i] for i in rest], [i % len(PROMPTS) for i in rest]) == [before[i] for i in rest]
        assert scheduler.load_adapter("chat", "chat").result(60) is None
        seen.clear()
        assert run(scheduler, names) == before and max(map(len, seen)) == 3
    finally:
        scheduler.stop()


def test_adapters_that_cannot_mix_run_one_adapter_at_a_time(model_dir, adapters, monkeypatch):  # noqa: F811
    """Where some adapter is not a plain low-rank pair (DoRA, a LoRA bias: `plain_lora` false), rows do not mix:
    the scheduler switches adapters between phases, as before mixing, and each request is still exact."""
    from recurrent_depth.inference import lora_layers

    monkeypatch.setattr(lora_layers, "plain_lora", lambda layer, names=None: False)
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    served = ServedAdapters(model, adapters, model_dir=model_dir)
    scheduler = BatchScheduler(model, max_batch=8, adapters=served)
    assert not served.mixes and scheduler.batch.row_adapters is None
    seen = watch_rows(scheduler)
    names = ["sql", None, "chat", "sql"]
    scheduler.start()
    try:
        got = run(scheduler, names)
    finally:
        scheduler.stop()
    assert max(map(len, seen)) == 1 and scheduler.metrics.adapter_switches >= 2  # (one adapter's rows at a time)
    for name in ("sql", "chat", None):
        rows = [i for i, n in enumerate(names) if n == name]
        want = alone(model_dir, adapters.get(name), [i % len(PROMPTS) for i in rows])
        for i in rows:
            assert got[i][0] == want[i % len(PROMPTS)][0], (i, name)
