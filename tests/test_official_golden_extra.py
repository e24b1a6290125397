"""Official outputs for calls the main golden file does not cover (`tests/golden/official_59e0b69_extra.json`,
recorded by `tests/golden/record_official_extra.py` from seal-rg/recurrent-pretraining at 59e0b69).

Each case is an official `model.generate(ids, GenerationConfig(...), **kwargs)`; ours is the same call on our
transformers class with `defaults="official"`:

- `length-*`: the official loops' run length from `max_new_tokens` / `max_length` (kwargs or the generation
  config; transformers 4.56's default max_length 20 when neither is given);
- `random-s0-*`: the official default init_scale 1.0 after `torch.manual_seed(seed)`: unseeded, official
  defaults draw s_0 from torch's global RNG as the official code does (one draw per forward for the whole
  batch, the speculative verify pass included), so the same seed gives the official tokens;
- `sample-*`: sampling (temperature / top_k / top_p / min_p) after `torch.manual_seed(seed)`: the official loops'
  own filters and one `torch.multinomial` per token from the global RNG, whose s_0 draw runs at init_scale 0 too;
- `cosine-above-2-*`: the cosine criterion does not exit on the first step after s_0 = 0 (the official 0/0).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from recurrent_depth.integrations.hf import from_library_model
from tests.official_golden_support import build_golden_model, state_dict_sha256

pytestmark = pytest.mark.usefixtures("two_threads")

GOLDEN = json.loads((Path(__file__).parent / "golden" / "official_59e0b69_extra.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}
OFFICIAL_STOPS = {65504, 65505, 65508}  # the official loops' hard-coded stops (65505 is also the eos here)


@pytest.fixture(scope="module")
def wrapped():
    model = build_golden_model(GOLDEN["model"])
    assert state_dict_sha256(model) == GOLDEN["model"]["state_dict_sha256"]
    assert model.config.init_scale == 1.0  # the official forward's default s_0 scale
    return from_library_model(model)


def run(wrapped, case, ids):
    if case["seed"] is not None:
        torch.manual_seed(case["seed"])
    ids = torch.tensor(ids)
    out = wrapped.generate(ids, GenerationConfig(**case["generation_config"]), defaults="official",
                           **case["kwargs"])
    return out[:, ids.shape[1]:].tolist()


def up_to_stop(rows):
    """Each row up to its first official stop id (the official generate_minimal / adaptive loops go on
    choosing tokens for a row that stopped while others run; ours pads it)."""
    return [row[: next((i + 1 for i, t in enumerate(row) if t in OFFICIAL_STOPS), len(row))] for row in rows]


@pytest.mark.parametrize("name", list(CASES))
def test_official_call_gives_the_official_tokens(wrapped, name):
    case = CASES[name]
    calls = [case["prompts"]] if case["batch"] else [[p] for p in case["prompts"]]
    for ids, expected in zip(calls, case["tokens"], strict=True):
        assert up_to_stop(run(wrapped, case, ids)) == up_to_stop(expected), ids


def test_the_recorder_describes_the_recorded_cases():
    from tests.golden.record_official_extra import cases

    fields = ("name", "prompts", "batch", "seed", "kwargs", "generation_config")
    assert cases() == [{k: case[k] for k in fields} for case in GOLDEN["cases"]]
    lengths = {name: [len(t[0]) for t in CASES[name]["tokens"]] for name in CASES if name.startswith("length-")}
    assert lengths["length-adaptive-none"] == [15, 8]  # 20 - prompt: transformers 4.56's max_length
    assert lengths["length-adaptive-kwarg-max-length-below-prompt"] == [0, 0]
    assert lengths["length-speculative-kwarg-max-length-below-prompt"] == [1, 1]  # its prefill token


def test_a_routed_call_without_any_length_runs_20_new_tokens_under_our_defaults(wrapped):
    """transformers 5 leaves GenerationConfig.max_length unset; ours then runs its 20 new tokens (was a
    TypeError)."""
    ids = torch.tensor([GOLDEN["cases"][0]["prompts"][0]])
    out = wrapped.generate(ids, num_steps=2, exit_criterion="kl", init_scale=0.0, eos_token_id=[])
    assert out.shape[1] - ids.shape[1] == 20
