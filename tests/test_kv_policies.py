"""KV policies (model/cache.py): each storage against a plain reference of each rule, written here.

The rules, per core layer, for a column that ran d steps, read by a later token at step i:
- slots: per-step keeps slot i for step i; shared-K (kv_budget=K, last-step = shared-1) keeps
  slot i mod K, holding the latest step of that residue that the token ran;
- lookup deepest: a slot the token did not reach holds its deepest step, d - 1;
- lookup skip: the column is left out of the attention at steps i >= d.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import DynamicRecurrentCache, StaticRecurrentCache, generate
from recurrent_depth.model.cache import Deepest, KVPolicy, PerStep, SharedBudget, Skip, parse_kv_policy
from tests.batch_support import serve_in_one_batch
from tests.kv_rule_reference import reference_read

pytestmark = pytest.mark.usefixtures("one_thread")

POLICIES = ["per-step", "shared-3", "last-step", "per-step+skip", "shared-3+skip"]


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


class GrowingStaticCache(StaticRecurrentCache):
    """The static storage starting from one core slot, so it grows while columns of mixed depth are closed."""

    INITIAL_SLOTS = 1


SCHEDULES = {  # depth per (column, row): a prompt of 4 columns, then one token at a time
    "deep-prompt": [[5] * 3] * 4 + [[5, 2, 3], [1, 5, 4], [3, 3, 1], [2, 4, 5]],
    "shallow-prompt": [[1] * 3] * 4 + [[2, 1, 1], [1, 3, 2], [5, 2, 3], [1, 5, 4], [3, 3, 1], [2, 4, 5]],
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("storage", [StaticRecurrentCache, GrowingStaticCache, DynamicRecurrentCache],
                         ids=["static", "static-growing", "dynamic"])
@pytest.mark.parametrize("spec", POLICIES)
def test_storage_follows_the_rule_after_prefill_and_early_exits(storage, spec, schedule):
    """A prompt, then tokens whose rows exit at different steps (write masks)."""
    B, r, P = 3, 5, 4
    cache = storage(B, r, capacity=2, policy=spec)
    g = torch.Generator().manual_seed(0)
    written: dict = {}
    depths: list[list[int]] = []  # [col][row]
    schedule = SCHEDULES[schedule]
    col = 0
    for T in [P] + [1] * (len(schedule) - P):
        d = torch.tensor(schedule[col : col + T]).t()  # [B, T]
        for step in range(r):
            running = d > step  # [B, T]
            k = torch.randn(B, T, 1, 2, generator=g)
            if not bool(running.any()):
                continue  # the engine runs no step that no row needs (so storage grows after closes)
            cache.write_mask = None if bool(running.all()) else running
            keys, _ = cache.update_kv(("core", 0, step), k, torch.zeros_like(k))
            mask = cache.key_mask(("core", 0, step))
            cache.write_mask = None
            for b in range(B):
                for c in range(col):
                    visible, want = reference_read(spec, written, depths[c][b], step, c, b)
                    assert (mask is None or bool(mask[b, c])) == visible, (b, c, step)
                    if visible:
                        assert torch.equal(keys[b, c], want), (b, c, step)
                for j in range(T):
                    if running[b, j]:
                        written[(step, col + j, b)] = k[b, j]
                        assert torch.equal(keys[b, col + j], k[b, j])
                        assert mask is None or bool(mask[b, col + j])
        cache.close(d)
        cache.advance(T)
        depths += d.t().tolist()
        col += T
    slots = cache.num_core_slots
    want_bytes = [sum(min(depths[c][b], slots) for c in range(col)) * 2 * 2 * 4 for b in range(B)]
    assert cache.logical_nbytes(core_only=True).tolist() == want_bytes


def test_policy_names_parse_and_alias():
    assert parse_kv_policy(None) == KVPolicy(PerStep(), Deepest()) == parse_kv_policy("per-step+deepest")
    assert parse_kv_policy("last-step") == parse_kv_policy(None, kv_budget=1) == KVPolicy(SharedBudget(1), Deepest())
    assert parse_kv_policy("skip") == KVPolicy(PerStep(), Skip())
    assert parse_kv_policy("shared-4+skip", kv_budget=4).name == "shared-4+skip"
    for bad in ("shared-0", "m4-latest", "skip+skip", "", "per-step+last-step", 3):
        with pytest.raises(ValueError, match="kv_policy"):
            parse_kv_policy(bad)
    with pytest.raises(ValueError, match="contradicts"):
        parse_kv_policy("shared-2", kv_budget=3)


ADAPTIVE = dict(max_new_tokens=6, num_steps=6, exit_criterion="kl", exit_threshold=5e-2, init_scale=0.0)


def test_kv_budget_1_and_last_step_are_one_rule(model):
    ids = torch.tensor([[5, 9, 2, 7], [0, 3, 3, 1]])
    a = generate(model, ids, kv_budget=1, output_logits=True, **ADAPTIVE)
    b = generate(model, ids, kv_policy="last-step", output_logits=True, **ADAPTIVE)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.steps, b.steps)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.cache_bytes, b.cache_bytes)
    assert a.kv_policy == b.kv_policy == "last-step+deepest"


@pytest.mark.parametrize("spec", ["per-step+skip", "shared-2+skip"])
def test_skip_static_equals_the_plain_reference_and_batch_equals_alone(model, spec):
    ids = torch.tensor([[5, 9, 2, 7], [0, 3, 3, 1], [8, 8, 1, 4]])
    static = generate(model, ids, kv_policy=spec, output_logits=True, **ADAPTIVE)
    plain = generate(model, ids, kv_policy=spec, cache_implementation="dynamic", fast=False, output_logits=True,
                     **ADAPTIVE)
    assert len(set(static.steps[:, 1:].flatten().tolist())) > 1  # rows exited at different steps
    assert torch.equal(static.sequences, plain.sequences) and torch.equal(static.steps, plain.steps)
    torch.testing.assert_close(static.logits, plain.logits, rtol=0, atol=1e-5)
    for b in range(3):
        alone = generate(model, ids[b], kv_policy=spec, output_logits=True, **ADAPTIVE)
        assert alone.token_lists()[0] == static.token_lists()[b]
        torch.testing.assert_close(alone.logits[0], static.logits[b], rtol=0, atol=1e-5)


def test_skip_changes_what_early_exited_tokens_contribute(model):
    """Same exits, different lookup: logits differ once a later token reads a step an earlier one skipped."""
    ids = torch.tensor([[5, 9, 2, 7]])
    deepest = generate(model, ids, teacher_tokens=[[1, 2, 3, 4, 5, 6]], output_logits=True, **ADAPTIVE)
    skip = generate(model, ids, teacher_tokens=[[1, 2, 3, 4, 5, 6]], kv_policy="skip", output_logits=True,
                    **ADAPTIVE)
    assert bool((deepest.steps[0, 1:] < 6).any())
    assert not torch.allclose(deepest.logits, skip.logits)
    fixed = dict(ADAPTIVE, exit_criterion=None, exit_threshold=None)
    a = generate(model, ids, output_logits=True, **fixed)
    b = generate(model, ids, kv_policy="skip", output_logits=True, **fixed)
    assert torch.equal(a.logits, b.logits)  # at fixed depth no token is left out


def test_serving_batch_under_skip_equals_generate_alone(model):
    jobs = [([5, 9, 2, 7], dict(ADAPTIVE, kv_policy="skip")),
            ([1, 2], dict(ADAPTIVE, kv_policy="shared-2+skip", max_new_tokens=4)),
            ([3, 3, 3], dict(ADAPTIVE))]
    out = serve_in_one_batch(model, jobs)
    for j, (prompt, kw) in enumerate(jobs):
        alone = generate(model, torch.tensor(prompt), seed=0, **kw)
        assert [r.token for r in out[j]] == alone.token_lists()[0]
        assert [r.steps for r in out[j]] == alone.steps[0].tolist()


def test_skip_needs_an_attention_model():
    cfg = rd.ModelConfig.from_preset("tiny")
    cfg.mixer = "linear_attention"
    lin = rd.RecurrentDepthLM(cfg).eval()
    with pytest.raises(ValueError, match=r"softmax attention; .*\(use the 'deepest' lookup\)$"):
        generate(lin, torch.tensor([[1, 2]]), kv_policy="skip", **ADAPTIVE)
    # compress-rN takes no 'deepest' lookup: the way out is another slot rule, not a lookup it refuses
    with pytest.raises(ValueError, match=r"\(compress-r4 takes only the 'full' and 'skip' lookups: use another slot "
                                         r"rule\)$"):
        generate(lin, torch.tensor([[1, 2]]), kv_policy="compress-r4", max_new_tokens=1)


def test_policies_from_transformers_http_and_info(model, capsys):
    from recurrent_depth.cli import main
    from recurrent_depth.integrations.hf import from_library_model
    from recurrent_depth.serving.protocol import APIError, Limits, parse_completion

    x = torch.tensor([[5, 9, 2, 7]])
    hf = from_library_model(model)
    fixed = dict(max_new_tokens=4, num_steps=4, init_scale=0.0)
    own_loop = hf.generate(x, kv_policy="last-step", do_sample=False, **fixed)  # transformers' loop
    assert torch.equal(own_loop, generate(model, x, kv_budget=1, **fixed).sequences)
    routed = hf.generate(x, exit_criterion="kl", exit_threshold=5e-2, kv_policy="skip", max_new_tokens=6,
                         num_steps=6, init_scale=0.0)
    assert torch.equal(routed, generate(model, x, kv_policy="skip", **ADAPTIVE).sequences)

    limits = Limits(max_seq_len=256, mean_recurrence=4, vocab_size=300, max_num_steps=64)
    req = parse_completion({"prompt": [1, 2], "kv_policy": "shared-2+skip"}, limits, {"m"})
    assert req.sampling.generation["kv_policy"] == "shared-2+skip"
    with pytest.raises(APIError, match="kv_policy"):
        parse_completion({"prompt": [1, 2], "kv_policy": "bogus"}, limits, {"m"})

    assert main(["info", "--preset", "tiny", "--kv-policy", "shared-2", "--json"]) == 0
    by_policy = json.loads(capsys.readouterr().out)["cache_bytes_at_max_seq_len_bf16_by_kv_policy"]
    layer = by_policy["last-step+deepest"] // 4  # tiny: prelude, coda and 2 core layers, r̄ = 4
    assert by_policy == {"per-step+deepest": 10 * layer, "shared-4+deepest": 10 * layer,
                         "last-step+deepest": 4 * layer, "shared-2+deepest": 6 * layer}


def test_only_model_and_inference_iterate_the_core():
    """The recurrence runs in `RecurrentDepthLM.forward` and the engine; every other module calls the engine."""
    root = pathlib.Path(rd.__file__).parent
    # (model/replay.py: the model's own forward with per-position depths, `model(ids, replay=...)`, for RL)
    allowed = {"model/recurrent.py", "model/replay.py", "inference/runner.py", "accel/runner.py", "inference/engine.py"}
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bcore_step\(", line):
                offenders.append(f"{rel}:{n}")
    assert not offenders, f"core_step called outside model/ and the engine: {offenders}"


@pytest.mark.parametrize("spec", ["per-step", "per-step+skip"])
def test_a_cache_that_grows_its_slots_generates_as_one_sized_up_front(model, spec, monkeypatch):
    """Core slots are allocated as steps are reached; growing them mid-generation changes nothing."""
    ids = torch.tensor([[5, 9, 2, 7], [0, 3, 3, 1]])
    kwargs = dict(max_new_tokens=5, num_steps=12, exit_criterion="kl", exit_threshold=5e-2, init_scale=0.0,
                  kv_policy=spec, output_logits=True)
    monkeypatch.setattr(StaticRecurrentCache, "INITIAL_SLOTS", 64)
    whole = generate(model, ids, **kwargs)
    monkeypatch.setattr(StaticRecurrentCache, "INITIAL_SLOTS", 1)
    grown = generate(model, ids, **kwargs)
    assert len(set(whole.steps[:, 1:].flatten().tolist())) > 1  # tokens exited at different steps
    assert torch.equal(whole.sequences, grown.sequences) and torch.equal(whole.steps, grown.steps)
    assert torch.equal(whole.logits, grown.logits)
