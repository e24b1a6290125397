"""Failures a seeded fuzzer of the Python API's generation options found (/tmp/hunt_depth/fuzz.py: every option
through `rd.generate` on a tiny model, huge / negative / NaN / bool / numpy / tensor values), each minimised: a
traceback or a run without end where a one-line ValueError belongs."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.config import MAX_NUM_STEPS
from recurrent_depth.inference import stream_generate
from recurrent_depth.inference.options import GenerationOptions

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(60)]

IDS = torch.tensor([[1, 2, 3]])


@pytest.fixture
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kwargs", [
    dict(num_steps=10**30),  # OverflowError "Python int too large to convert to C ssize_t" in the fused runner
    dict(num_steps=2**31),  # ran until interrupted
    dict(num_steps=MAX_NUM_STEPS + 1),
    dict(exit_criterion="kl", max_steps=10**30),  # OverflowError in the cache's byte count
    dict(kv_budget=10**30),  # OverflowError building the KV policy's slots
    dict(ttt_params="core-mlp", ttt_depth=10**30),  # ran until interrupted
    dict(gradmem_tokens=1, gradmem_depth=10**30),  # ran until interrupted
])
def test_a_depth_past_the_ceiling_is_one_line_in_generate(model, kwargs):
    name, value = list(kwargs.items())[-1]
    with pytest.raises(ValueError, match=rf"^{name}={value} is invalid: .*, {MAX_NUM_STEPS}\] \(the depth ceiling") \
            as info:
        rd.generate(model, IDS, max_new_tokens=1, **kwargs)
    one_line(info)
    with pytest.raises(ValueError, match=rf"^{name}={value} is invalid"):  # the stream entry validates alike
        stream_generate(model, IDS, max_new_tokens=1, **kwargs)


@pytest.mark.parametrize("num_steps", [10**30, MAX_NUM_STEPS + 1, (10**30, 1), (MAX_NUM_STEPS, 1)])
def test_forward_refuses_a_depth_past_the_ceiling(model, num_steps):
    """`model(ids, num_steps=10**30)` ran until interrupted."""
    with pytest.raises(ValueError, match=r"is invalid: .*the depth ceiling") as info:
        model(IDS, num_steps=num_steps)
    one_line(info)


def test_the_ceiling_is_the_models_and_can_be_raised(model):
    """`model.max_depth` (what `--max-depth` sets) is the one bound of forward and generate."""
    model.max_depth = 2
    with pytest.raises(ValueError, match=r"num_steps=3 is invalid: expected an integer in \[0, 2\]"):
        model(IDS, num_steps=3)
    with pytest.raises(ValueError, match=r"num_steps=3 is invalid: expected an integer in \[0, 2\]"):
        rd.generate(model, IDS, max_new_tokens=1, num_steps=3)
    assert rd.generate(model, IDS, max_new_tokens=1, num_steps=2).steps.tolist() == [[2]]
    model.max_depth = MAX_NUM_STEPS + 2  # deliberately deep: the ceiling raised runs past MAX_NUM_STEPS
    assert model.resolve_num_steps((1, MAX_NUM_STEPS)) == (1, MAX_NUM_STEPS)
    out = rd.generate(model, IDS[:, :1], max_new_tokens=1, num_steps=MAX_NUM_STEPS + 1, init_scale=0.0)
    assert out.steps.tolist() == [[MAX_NUM_STEPS + 1]]


def test_validate_takes_the_servers_ceiling():
    """The server validates a request under its own max_num_steps: `rdepth serve --max-depth 2048
    --max-num-steps 2000` still serves num_steps=2000, and a lower one bounds it."""
    assert GenerationOptions(num_steps=2000).validate(4, max_depth=2000).num_steps == 2000
    with pytest.raises(ValueError, match=r"num_steps=9 is invalid: expected an integer in \[0, 8\]"):
        GenerationOptions(num_steps=9).validate(4, max_depth=8)


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=True, temperature=10**30),  # OverflowError "int too big to convert" dividing the logits
    dict(repetition_penalty=10**30),  # the same in the penalty
    dict(gradmem_tokens=1, gradmem_steps=1, gradmem_lr=10**30),  # the same in the memory's SGD step
])
def test_a_huge_int_for_a_float_option_runs_as_its_float(model, kwargs):
    name, value = list(kwargs.items())[-1]
    as_float = dict(kwargs, **{name: float(value)})
    a = rd.generate(model, IDS, max_new_tokens=2, seed=0, **kwargs)
    b = rd.generate(model, IDS, max_new_tokens=2, seed=0, **as_float)
    assert a.sequences.tolist() == b.sequences.tolist()


def test_a_ttt_learning_rate_past_float32_is_one_line(model):
    """ttt_lr=1e308 passed validation; torch's SGD step raised RuntimeError "value cannot be converted to type
    float without overflow" (the weights are float32)."""
    with pytest.raises(ValueError, match=r"^ttt_lr=1e\+308 is invalid: expected a number in \(0, ") as info:
        rd.generate(model, IDS, max_new_tokens=1, ttt_params="core-mlp", ttt_steps=1, ttt_lr=1e308)
    one_line(info)
