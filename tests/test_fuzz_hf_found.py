"""Failures a seeded random fuzzer of transformers' `model.generate` found (GenerationConfig fields and kwargs mixed
with our routed options, on tiny models of several families and core mixers, left-padded batches): each is a result
that differed from transformers' own loop on the same model, or a refusal of a value transformers accepts."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import recurrent_depth as rd
from recurrent_depth.integrations.hf import from_library_model
from tests.test_hf import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def wrapped(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return from_library_model(rd.RecurrentDepthLM(tiny_config(**overrides)).eval())


def test_a_routed_call_masks_the_leading_pad_ids_of_a_batch_given_without_attention_mask():
    """transformers infers the attention mask from pad_token_id when none is passed; a call routed to
    recurrent_depth.generate (any library-only option: seed=, exit_criterion=, ...) took the pads as tokens, so a
    left-padded row's tokens differed from transformers' loop and from the row alone."""
    model = wrapped(1)
    pad = model.config.pad_token_id
    x = torch.tensor([[pad, pad, 49, 143], [193, 16, 235, 133]])
    kw = dict(max_new_tokens=12, num_steps=4, init_scale=0.0, do_sample=False, pad_token_id=pad)
    loop = model.generate(x, **kw)
    pads_as_tokens = model.generate(x, attention_mask=torch.ones_like(x), **kw)
    assert not torch.equal(loop, pads_as_tokens)  # (the case tells the two apart)
    assert torch.equal(model.generate(x, seed=0, **kw), loop)
    assert torch.equal(model.generate(x, cache_implementation="dynamic", **kw), loop)
    alone = model.generate(x[:1, 2:], seed=0, **kw)
    assert torch.equal(loop[0, 4:], alone[0, 2:])
    # an explicit mask still wins, and a pad id that is also an eos id says nothing about padding (transformers' rule)
    assert torch.equal(model.generate(x, seed=0, attention_mask=torch.ones_like(x), **kw), pads_as_tokens)
    same = dict(kw, eos_token_id=pad)
    assert torch.equal(model.generate(x, seed=0, **same), model.generate(x, **same))


def test_top_k_zero_in_a_greedy_routed_call_is_no_filter_as_in_transformers():
    """top_k=0 is transformers' "no top-k filter"; with do_sample unset a routed call refused it ("top_k=0 is
    invalid: expected None or an integer >= 1"), while transformers' loop decodes greedily."""
    model = wrapped(1)
    x = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=4, num_steps=2, init_scale=0.0, top_k=0)
    assert torch.equal(model.generate(x, cache_implementation="static", **kw), model.generate(x, **kw))


def test_kv_budget_shares_the_recurrent_states_of_a_gla_core_in_transformers_loop_as_in_the_library():
    """transformers' loop keyed a recurrent-state core's states by step, so kv_budget / a shared-K kv_policy changed
    nothing there while recurrent_depth.generate (a routed call) shares them by slot (docs/mixers.md): the same
    call's tokens depended on whether a library-only option was also given."""
    model = wrapped(2, mixer={"core": "gla"})
    x = torch.tensor([[9, 10, 11]])
    kw = dict(max_new_tokens=4, num_steps=4, init_scale=0.0, do_sample=False)
    unshared = model.generate(x, **kw)
    for budget in (dict(kv_budget=2), dict(kv_policy="shared-2"), dict(kv_budget=1)):
        loop = model.generate(x, **kw, **budget)
        assert not torch.equal(loop, unshared), budget  # (the budget changes this model's tokens)
        assert torch.equal(loop, rd.generate(model.core, x, **kw, **budget).sequences), budget
        assert torch.equal(loop, model.generate(x, seed=0, **kw, **budget)), budget


def test_a_kv_policy_with_use_cache_false_is_refused_naming_both():
    """use_cache=False with kv_budget / kv_policy: transformers' loop decoded without a cache, exactly, the policy
    silently unused, while the same call routed to recurrent_depth.generate (which always caches) applied it."""
    model = wrapped(1)
    x = torch.tensor([[117, 135, 134, 255]])
    kw = dict(max_new_tokens=6, num_steps=3, init_scale=0.0, do_sample=False)
    assert not torch.equal(model.generate(x, kv_policy="last-step", **kw), model.generate(x, **kw))  # (it matters)
    for asked in (dict(kv_policy="last-step"), dict(kv_budget=1, seed=0), dict(cache_lookup_strategy="latest-m4")):
        with pytest.raises(ValueError, match=r"^generate: use_cache=False decodes without a KV cache, so "
                                             rf"{next(iter(asked))} \(how the cache is kept\) would do nothing"):
            model.generate(x, use_cache=False, **asked, **kw)
    with pytest.raises(ValueError, match=r"so kv_budget \(how"):  # set on a GenerationConfig too
        model.generate(x, GenerationConfig(use_cache=False, kv_budget=2), **kw)
    assert model.generate(x, use_cache=False, kv_budget=None, **kw).shape == (1, 10)  # None asks for nothing
