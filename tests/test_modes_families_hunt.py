"""Decoding modes across the model families a user starts from (Huginn layout, Ouro, Parcae, retrofitted, looped):
the invariants each mode promises, and one-line refusals where a family cannot run a mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import recurrent_depth as rd
from recurrent_depth.families.retrofit import retrofit
from recurrent_depth.inference import stream_generate
from recurrent_depth.looping import LoopConfig, apply_loop

GOLDENS = Path(__file__).parent / "goldens"
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)

pytestmark = pytest.mark.usefixtures("one_thread")


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()


def huginn() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64, max_seq_len=64)).eval()


def retrofitted() -> rd.RecurrentDepthLM:
    return retrofit(llama(), 1, (1, 3), 2, adapter_init="random", mean_recurrence=4).eval()


@pytest.mark.parametrize("family", [huginn, retrofitted], ids=["huginn", "retrofit"])
def test_speculative_exact_equals_greedy_with_a_random_s0(family):
    """The drafts of a round drew s_0 for columns that were then rejected, so every later column took another
    draw than greedy decoding's for it: other tokens at the models' own init_scale (1.0), the same seed."""
    model = family()
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=10, seed=5, eos_token_id=[], output_logits=True)
    assert model.config.init_scale == 1.0
    greedy = rd.generate(model, ids, **kw)
    spec = rd.generate(model, ids, draft_steps=1, lookahead=3, **kw)
    assert spec.stats["acceptance_rate"] < 1  # some drafts were rejected: the case that drew ahead
    assert spec.token_lists() == greedy.token_lists()
    torch.testing.assert_close(spec.logits, greedy.logits, atol=1e-4, rtol=0)


def test_warm_start_on_an_ouro_model_is_refused():
    """Ouro loops its embedding (no injection): s_0 = e is the only way a token enters, so warm start made
    every token's logits independent of the token fed (checked: equal to 0.0 for two different tokens)."""
    model = rd.RecurrentDepthLM.from_pretrained(GOLDENS / "ouro" / "config_a", dtype=torch.float32).eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    with pytest.raises(ValueError, match=r"^warm_start replaces s_0, but this model loops its embedding "
                                         r"\(injection='none', Ouro's layout\)"):
        rd.generate(model, ids, max_new_tokens=2, warm_start=True)
    with pytest.raises(ValueError, match=r"^continuous_compute replaces s_0"):  # the official alias, as spelled
        rd.generate(model, ids, max_new_tokens=2, continuous_compute=True)
    assert rd.generate(model, ids, max_new_tokens=2).token_lists()[0]  # without it, it decodes


def test_a_looped_transformers_model_is_refused_in_one_line():
    """A model looped by recurrent_depth.looping is a plain transformers model: generate died with
    "AttributeError: 'LlamaConfig' object has no attribute 'mean_recurrence'"."""
    model = llama()
    apply_loop(model, LoopConfig(1, 2, iterations=3))
    message = r"^generate takes a recurrent-depth model .*got LlamaForCausalLM: a transformers model looped by"
    with pytest.raises(ValueError, match=message):
        rd.generate(model, torch.tensor([[3, 5, 7]]), max_new_tokens=2, exit_criterion="kl")
    with pytest.raises(ValueError, match=message):
        stream_generate(model, torch.tensor([[3, 5, 7]]), max_new_tokens=2)
