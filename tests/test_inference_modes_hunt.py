"""The parallel sampler's cosine freeze and its tokens_per_sweep, and the sampling filters against
plain references (transformers' warpers written out by hand)."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.sampling import apply_repetition_penalty, filter_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_parallel_cosine_never_freezes_on_a_step_from_a_zero_state(model):
    """At init_scale 0 a position's first step starts from s_0 = 0, which has no angle: the autoregressive
    cosine criterion never exits there, whatever the threshold (1 - cos lies in [0, 2], so a threshold above 1
    would otherwise hold at once). The wavefront of one position and one step per sweep is that loop with
    kv_budget=1; it froze every position after its first step (steps 1, other tokens)."""
    kw = dict(max_new_tokens=5, num_steps=6, init_scale=0.0, exit_criterion="cosine", exit_threshold=1.5)
    reference = generate(model, prompt(1, 6), kv_budget=1, **kw)
    wave = generate(model, prompt(1, 6), sampler="parallel", inner_steps=1, wavefront=1, **kw)
    assert bool((reference.steps[0, 1:] == 2).all())  # the first step with an angle converges
    assert wave.token_lists() == reference.token_lists()
    assert torch.equal(wave.steps, reference.steps)
    assert wave.exit_reasons == reference.exit_reasons


@pytest.mark.parametrize("new,sweeps,per_sweep", [(1, 0, 0.0), (3, 2, 1.0)])
def test_parallel_tokens_per_sweep_counts_the_tokens_the_sweeps_committed(model, new, sweeps, per_sweep):
    """inner_steps = max_steps and headway 1: every sweep commits exactly one token per row, and the first
    token comes from the prefill (it was counted too: 1.0 with no sweep, 1.5 for 2 tokens in 2 sweeps)."""
    out = generate(model, prompt(2, 5), max_new_tokens=new, num_steps=4, init_scale=0.0, sampler="parallel",
                   inner_steps=4)
    assert int(out.lengths[0]) == new
    assert out.stats["sweeps"] == sweeps and out.stats["tokens_per_sweep"] == per_sweep


def reference_filter(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                     min_p: float | None) -> torch.Tensor:
    """transformers' TemperatureLogitsWarper, TopK, TopP and MinP in that order, one row at a time."""
    rows = []
    for row in logits / temperature:
        row = row.clone()
        if top_k is not None:
            kth = row.topk(min(top_k, row.numel())).values[-1]
            row[row < kth] = float("-inf")
        if top_p is not None and top_p < 1:
            ascending, order = row.sort()
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[-1] = False
            row[order[drop]] = float("-inf")
        if min_p is not None:
            probs = row.softmax(-1)
            row[probs < min_p * probs.max()] = float("-inf")
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 3, None, None), (1.0, 300, None, None), (1.3, None, 0.6, None), (1.0, None, 1.0, None),
    (0.5, None, None, 0.2), (1.0, None, None, 1.0), (0.9, 5, 0.8, 0.05),
])
def test_filters_keep_what_the_plain_reference_keeps(temperature, top_k, top_p, min_p):
    """Ties on top and at the k-th value, which top-k and min-p keep whole; top-p gets distinct logits
    (which of two tied tokens crosses top_p is arbitrary, in transformers as here)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 40, generator=g) * 3
    if top_p is None:
        logits[0, :4] = logits[0].max() + 1  # four tokens tied on top
        logits[1, 7] = logits[1].topk(3).values[-1]  # a tie at the 3rd value
    ours = filter_logits(logits, temperature, top_k, top_p, min_p)
    theirs = reference_filter(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_repetition_penalty_is_transformers_ctrl_rule():
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0], [-0.5, 3.0, -1.0, 0.0]])
    seen = torch.tensor([[True, True, True, False], [True, False, False, True]])
    expected = torch.tensor([[2.0 / 1.5, -2.0 * 1.5, 0.0, 1.0], [-0.5 * 1.5, 3.0, -1.0, 0.0]])
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.5), expected)
