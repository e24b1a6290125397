"""Golden outputs of the official Huginn code (seal-rg/recurrent-pretraining at 59e0b69) on a seeded model.

`tests/golden/official_59e0b69.json` was recorded by `tests/golden/record_official.py` (see its
docstring to re-record; it needs an official checkout and a scratch Python with transformers 4.56).
Each case is an official `model.generate(...)` call with its kwargs exactly as passed, the tokens
and, on the adaptive path, the steps per token; `ours_closest` names the `rd.generate` options
nearest to it under our own defaults. This file checks:

- the golden file is complete and the seeded model rebuilds bit for bit (state-dict checksum);
- with our defaults (`ours_closest`): fixed depth (plain transformers generate, `generate_minimal`,
  the adaptive path with criterion "none", the `compress-sN` caches as `kv_budget`) and the stop
  cases give the official tokens; adaptive exit gives the official tokens *and* steps where the
  official call sets its other defaults to ours (`cache_lookup_strategy="latest-m4"`,
  `do_not_exit_in_prefill=True`); speculative decoding equals them up to max_new_tokens;
- with `defaults="official"` and the official kwargs (issue 17): every recorded call gives the
  official tokens and steps exactly, exit in prefill, its min_steps rule, check every n steps,
  minp-kl, the normed warm start of generate_minimal and the speculative loop's last round
  included (these were the cases that differed before issue 17's options). Cases that read the
  cache with a lookup we do not have yet (the official default "full", available-m4, ...) wait for
  issue 17's lookup policies and are skipped with that reason.
"""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from tests.official_golden_support import build_golden_model, load_golden, state_dict_sha256

# A product's rounding depends on the threads sharing it, and a few adaptive-exit step counts here sit within
# rounding of their threshold. Under the suite's MKL mode (conftest: AVX2 kernels, STRICT) two threads give the
# recorded numbers (measured: with one thread, two entropy-diff cases exit one step off) on x86 CPUs with
# AVX-512. ATen's own kernels (softmax, log, the entropy's sum) follow the CPU's vector width, which MKL_CBWR
# does not pin: on an AVX2-only CPU (a 2-core AMD EPYC, measured) one token of one entropy-diff run has its
# criterion cross the threshold one step earlier, with every token unchanged. That position, and only it, may
# read either count.
pytestmark = pytest.mark.usefixtures("two_threads")

# (case, prompt) -> {token index: the step counts either vector width gives}
ROUNDING_TIES = {
    ("adaptive-entropy-diff-other-r16-latest-m4-no-exit-in-prefill", (11, 2000, 30000, 42, 7)): {11: {2, 3}},
}


def assert_official(name, run, tokens, steps):
    """Our tokens equal the recorded ones, and our steps too, except at a listed rounding tie."""
    assert tokens == run["tokens"], run["prompt"]
    ties = ROUNDING_TIES.get((name, tuple(run["prompt"])), {})
    expected = run.get("steps")
    if expected is None or steps is None:
        assert steps == expected, run["prompt"]
        return
    assert len(steps) == len(expected), run["prompt"]
    for i, (ours_i, official_i) in enumerate(zip(steps, expected, strict=True)):
        allowed = ties.get(i, {official_i})
        assert official_i in allowed and ours_i in allowed, (run["prompt"], i, steps, expected)

GOLDEN = load_golden()
CASES = {case["name"]: case for case in GOLDEN["cases"]}

# Cases whose semantics already agree (all prompts: the same tokens and, on the adaptive path, steps).
FIXED_DEPTH = [
    "hf-generate-fixed-r8", "hf-generate-fixed-r3", "hf-generate-fixed-r8-compress-s4",
    "hf-generate-fixed-r8-compress-s8", "generate-minimal-fixed-r8", "generate-minimal-fixed-r2",
    "adaptive-none-r2", "adaptive-none-r16",
    # the adaptive path's warm start (the raw state) is ours; generate_minimal's (ln_f-normed) is not
    "adaptive-none-continuous-r2", "adaptive-none-continuous-r16",
]
STOPS = [
    "stop-hf-generate-eos-list", "stop-generate-minimal-eos-list", "stop-generate-minimal-default-eos",
    "stop-hf-generate-default-eos", "stop-adaptive-none-eos-list", "stop-generate-minimal-end-turn-r3",
    "stop-adaptive-none-end-turn-r3",
]
ADAPTIVE_AS_OURS = [
    f"adaptive-{criterion}-{label}-r16-latest-m4-no-exit-in-prefill"
    for criterion in ("entropy-diff", "latent-diff", "kl", "argmax-stability", "cosine")
    for label in ("auto", "other")
] + [
    f"adaptive-{criterion}-auto-r16-continuous-latest-m4-no-exit-in-prefill"
    for criterion in ("entropy-diff", "latent-diff", "kl", "argmax-stability", "cosine")
] + [
    "adaptive-kl-lookup-latest-m4-no-exit-in-prefill",
    "adaptive-kl-lookup-compress-s4-no-exit-in-prefill", "adaptive-kl-lookup-compress-s8-no-exit-in-prefill",
    "adaptive-kl-lookup-latest-m4-compress-s4-no-exit-in-prefill",
    "adaptive-kl-lookup-latest-m4-compress-s16-no-exit-in-prefill",
]
SPECULATIVE = [name for name in CASES if name.startswith("speculative-")] + ["stop-speculative-eos-list"]


@pytest.fixture(scope="module")
def model():
    return build_golden_model(GOLDEN["model"])


def ours(model, case, run):
    out = rd.generate(model, torch.tensor([run["prompt"]]), **case["ours_closest"])
    length = int(out.lengths[0])
    return out.sequences[0, len(run["prompt"]):][:length].tolist(), out.steps[0, :length].tolist()


def test_golden_file_is_complete():
    official = GOLDEN["official"]
    assert official["revision"].startswith("59e0b69")
    assert official["transformers"].startswith("4.56.")
    assert official["torch"]
    assert GOLDEN["forward_check"]["max_abs_logit_diff"] == 0.0  # the official forward equals ours
    kinds = {"fixed": "hf-generate-fixed-r8", "generate_minimal": "generate-minimal-fixed-r8",
             "continuous": "generate-minimal-continuous-r8", "min_steps": "adaptive-kl-min-steps-3",
             "every_n": "adaptive-kl-check-every-2", "prefill": "adaptive-kl-no-exit-in-prefill",
             "speculative": "speculative-draft4-lookahead4-v1", "stop": "stop-generate-minimal-eos-list"}
    for name in kinds.values():
        assert name in CASES
    for criterion in ("entropy-diff", "latent-diff", "kl", "minp-kl", "argmax-stability", "cosine"):
        assert CASES[f"adaptive-{criterion}-auto-r16"]["kwargs"]["exit_threshold"] == "auto"
        assert isinstance(CASES[f"adaptive-{criterion}-other-r16"]["kwargs"]["exit_threshold"], int | float)
    for strategy in ("full", "latest-m4", "available-m4", "always-last-m4", "skip", "compress-s4", "compress-r4",
                     "compress-anchor", "latest-m4-compress-s16"):
        assert f"adaptive-kl-lookup-{strategy}" in CASES
    for case in GOLDEN["cases"]:
        assert len(case["runs"]) == len(GOLDEN["prompts"])
        for run in case["runs"]:
            assert ("error" in run) != ("tokens" in run)
            if "steps" in run:
                assert len(run["steps"]) == len(run["tokens"])
                assert all(1 <= s <= case["kwargs"]["num_steps"] for s in run["steps"])


def test_seeded_model_is_the_recorded_one(model):
    assert state_dict_sha256(model) == GOLDEN["model"]["state_dict_sha256"]
    assert model.config.vocab_size == 65536
    assert (model.config.prelude_layers, model.config.core_layers, model.config.coda_layers) == (2, 4, 2)


@pytest.mark.parametrize("name", FIXED_DEPTH + STOPS)
def test_fixed_depth_and_stops_match_official(model, name):
    case = CASES[name]
    for run in case["runs"]:
        tokens, steps = ours(model, case, run)
        assert tokens == run["tokens"], run["prompt"]
        expected_steps = run.get("steps") or [case["kwargs"]["num_steps"]] * len(tokens)
        assert steps == expected_steps


@pytest.mark.parametrize("name", ADAPTIVE_AS_OURS)
def test_adaptive_exit_matches_official_with_our_lookup_and_prefill(model, name):
    case = CASES[name]
    assert case["kwargs"].get("cache_lookup_strategy", "full") != "full" and case["kwargs"]["do_not_exit_in_prefill"]
    for run in case["runs"]:
        tokens, steps = ours(model, case, run)
        assert_official(name, run, tokens, steps)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_speculative_matches_official_up_to_max_new_tokens(model, name):
    case = CASES[name]
    for run in case["runs"]:
        tokens, _ = ours(model, case, run)
        assert tokens == run["tokens"][: len(tokens)], run["prompt"]
        assert len(tokens) == case["kwargs"]["max_new_tokens"] or tokens[-1] in case["ours_closest"]["stop"]


def test_our_defaults_differ_from_the_official_on_recorded_cases(model):
    """The golden data tells the two sets of defaults apart (so the equality under
    `defaults="official"` below is not trivially ours): exit in prefill and the official min_steps
    rule change the tokens or steps of these calls under our defaults."""
    for name in ("adaptive-kl-lookup-latest-m4", "adaptive-kl-min-steps-3", "adaptive-latent-diff-exit-in-prefill"):
        case = CASES[name]
        kwargs = {k: v for k, v in official_options(case).items() if k not in ("defaults", "do_not_exit_in_prefill")}
        assert any(run_ours(model, run, kwargs) != (run["tokens"], run.get("steps")) for run in case["runs"]), name


# ------------------------------------------------------------------------------ defaults="official"
def official_options(case) -> dict:
    """`rd.generate` options for an official call: its kwargs as written (the official names are
    aliases, "auto" thresholds included), defaults="official" and its generation config's eos."""
    return {"defaults": "official", "eos_token_id": case["generation_config"]["eos_token_id"], **case["kwargs"]}


def run_ours(model, run, options):
    out = rd.generate(model, torch.tensor([run["prompt"]]), **options)
    length = int(out.lengths[0])
    steps = out.steps[0, :length].tolist() if "steps" in run else None
    return out.sequences[0, len(run["prompt"]):][:length].tolist(), steps


# transformers' own loop (the official dispatcher's fallback) is checked through transformers below.
OFFICIAL_CALLS = [case["name"] for case in GOLDEN["cases"]
                  if not case["name"].startswith(("hf-generate", "stop-hf-generate"))
                  and not any("error" in run for run in case["runs"])]


@pytest.mark.parametrize("name", OFFICIAL_CALLS)
def test_official_defaults_give_the_official_tokens_and_steps(model, name):
    case = CASES[name]
    options = official_options(case)
    for run in case["runs"]:
        assert_official(name, run, *run_ours(model, run, options))


def test_official_defaults_leave_no_recorded_call_untested():
    """Every recorded call is checked above, or is refused by the official code itself
    (compress-rN / compress-anchor raise in its dynamic cache at 59e0b69)."""
    refused = {c["name"] for c in GOLDEN["cases"] if any("error" in r for r in c["runs"])}
    assert refused == {f"adaptive-kl-lookup-{s}{p}" for s in ("compress-r4", "compress-anchor")
                       for p in ("", "-no-exit-in-prefill")}
    assert set(OFFICIAL_CALLS) | refused | {n for n in CASES if n.startswith(("hf-generate", "stop-hf-generate"))} \
        == set(CASES)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("hf-generate", "stop-hf-generate"))])
def test_transformers_generate_with_official_defaults_gives_the_official_tokens(model, name):
    """The official `generate` hands a call without its own kwargs to transformers' loop, which stops
    only at the generation config's eos (an id or a list); ours does the same under defaults="official"."""
    from recurrent_depth.integrations.hf import from_library_model

    case = CASES[name]
    kwargs = dict(case["kwargs"])
    wrapped = from_library_model(model)
    for run in case["runs"]:
        out = wrapped.generate(torch.tensor([run["prompt"]]), defaults="official", do_sample=False,
                               eos_token_id=case["generation_config"]["eos_token_id"],
                               pad_token_id=case["generation_config"]["pad_token_id"], **kwargs)
        assert out[0, len(run["prompt"]):].tolist()[: len(run["tokens"])] == run["tokens"], run["prompt"]
        assert out.shape[1] - len(run["prompt"]) == len(run["tokens"])


def test_the_recorder_describes_the_recorded_cases():
    """`record_official.py` re-records exactly these calls (kwargs, generation config, our options)."""
    from tests.golden.record_official import cases

    fields = ("name", "kwargs", "generation_config", "ours_closest", "note")
    recorded = [{key: case[key] for key in fields} for case in GOLDEN["cases"]]
    assert cases(GOLDEN["stop_ids"]) == recorded
