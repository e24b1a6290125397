"""Failures a seeded random fuzzer of `rd.generate`'s options found (option combinations on tiny models of
several families and mixers, ragged left-padded batches): each is a crash or a refusal that named no option."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.options import OptionError

pytestmark = pytest.mark.usefixtures("one_thread")


def recurrent_core(mixer: str = "gla") -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=32, max_seq_len=64,
                                                          mixer={"core": mixer})).eval()


@pytest.mark.parametrize("mixer", ["gla", "deltanet"])
def test_tokens_deeper_than_the_prompt_on_a_recurrent_state_core_are_refused_naming_max_steps(mixer):
    """max_steps > num_steps: the prompt ran num_steps, so a token's deeper step found no recurrent state of the
    earlier positions and generation died mid-stream with "RuntimeError: cache has no gla state for
    ('core', 0, 2) at 3 cached positions"."""
    model = recurrent_core(mixer)
    with pytest.raises(OptionError, match=r"^max_steps=4 runs tokens deeper than the prompt's num_steps=2, but "
                                          rf"this model's core mixer .*'{mixer}'") as caught:
        rd.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, num_steps=2, exit_criterion="none",
                    max_steps=4, seed=1)
    assert caught.value.field == "max_steps" and "\n" not in str(caught.value)
    # at most the prompt's depth, the same model decodes adaptively, and a batch row still equals the row alone
    kw = dict(max_new_tokens=4, num_steps=4, exit_criterion="latent-diff", exit_threshold=0.5, init_scale=0)
    batch = rd.generate(model, torch.tensor([[5, 6, 7], [0, 9, 10]]), attention_mask=torch.tensor([[1, 1, 1],
                                                                                                  [0, 1, 1]]), **kw)
    assert batch.token_lists()[1] == rd.generate(model, [[9, 10]], **kw).token_lists()[0]


def test_a_prompt_exit_on_a_recurrent_state_core_is_refused_naming_exit_in_prefill():
    """exit_in_prefill stopped this prompt at step 1 and a later token ran step 2: alone it died with a
    RuntimeError, while in a batch beside a row whose prompt ran deeper it read the state that row wrote."""
    model = recurrent_core()
    kw = dict(max_new_tokens=4, num_steps=6, exit_criterion="kl", exit_threshold=0.1, exit_in_prefill=True,
              init_scale=0)
    with pytest.raises(OptionError, match=r"^exit_in_prefill=True lets the prompt stop before max_steps=6") as caught:
        rd.generate(model, [[5, 6, 7]], **kw)
    assert caught.value.field == "exit_in_prefill"
    with pytest.raises(ValueError, match=r"^do_not_exit_in_prefill=False lets the prompt stop"):  # the alias used
        rd.generate(model, [[5, 6, 7]], **dict(kw, exit_in_prefill=None), do_not_exit_in_prefill=False)


@pytest.mark.parametrize("mode, named", [(dict(draft_steps=1), "draft_steps=1"),
                                         (dict(sampler="parallel"), "sampler='parallel'")])
def test_a_mode_a_recurrent_state_model_cannot_run_is_refused_naming_its_option(mode, named):
    """The refusal said "self-speculative decoding re-runs positions ..." / "the parallel sampler re-runs ...":
    no option in it, so the CLI and the server could not re-spell it as the flag or field to change."""
    with pytest.raises(OptionError, match=rf"\({named}\) re-runs positions already in the cache"):
        rd.generate(recurrent_core("deltanet"), [[5, 6, 7]], max_new_tokens=2, num_steps=3, **mode)


@pytest.mark.parametrize("num_steps", [1, 3])
def test_the_parallel_sampler_never_runs_a_token_deeper_than_max_steps(num_steps):
    """Every sweep ran inner_steps (default 4) core steps, so at num_steps=1 each token ran 4 steps
    (out.steps [[1, 4, 4, 4, 4, 4]]) and got other tokens than decoding at depth 1. A sweep now runs at most
    max_steps, and the sampler with one refining position is greedy decoding with kv_budget=1 at that depth."""
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=32, max_seq_len=64)).eval()
    kw = dict(max_new_tokens=6, num_steps=num_steps, init_scale=0)
    parallel = rd.generate(model, [[5, 6, 7]], sampler="parallel", wavefront=1, **kw)
    greedy = rd.generate(model, [[5, 6, 7]], kv_budget=1, **kw)
    assert parallel.steps.tolist() == [[num_steps] * 6]
    assert parallel.token_lists() == greedy.token_lists()


def test_the_dynamic_cache_randomized_lookup_survives_a_row_that_stopped():
    """A row that stopped (eos) feeds padding its cache never writes; the reference cache's randomized lookup then
    drew among no written slots for those columns: "IndexError: list index out of range". It now reads them as
    hidden, and equals the static cache."""
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=32, max_seq_len=64)).eval()
    ids = torch.tensor([[19, 13, 27, 4], [16, 6, 25, 21]])
    kw = dict(max_new_tokens=8, exit_criterion="latent-diff", exit_threshold=0.3, kv_policy="per-step+randomized",
              eos_token_id=3, seed=3, output_logits=True)
    dynamic = rd.generate(model, ids, cache_implementation="dynamic", **kw)
    static = rd.generate(model, ids, cache_implementation="static", **kw)
    assert dynamic.finish_reasons == ["length", "stop"]  # row 1 stopped at its first token, row 0 ran on
    assert dynamic.token_lists() == static.token_lists()
    torch.testing.assert_close(dynamic.logits, static.logits)


@pytest.mark.parametrize("teacher", ["abc", [[1, 2], [3]]], ids=["string", "ragged"])
def test_teacher_tokens_that_are_no_tensor_are_a_one_line_value_error(teacher):
    """torch.as_tensor's TypeError / ValueError escaped ("TypeError: new(): invalid data type 'str'")."""
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=32, max_seq_len=64)).eval()
    with pytest.raises(ValueError, match=r"^teacher_tokens must be a tensor or a \(nested\) list of token ids: "):
        rd.generate(model, [[5, 6], [7, 8]], max_new_tokens=1, teacher_tokens=teacher)


def test_a_lookup_the_official_profile_picked_says_so():
    """On a gla core, `defaults="official"` with an exit criterion was refused naming kv_policy='full', which the
    caller never set (the profile picks it): the message now says where it came from."""
    with pytest.raises(OptionError, match=r"^kv_policy='full' \(defaults='official' picks it with an exit criterion\)"):
        rd.generate(recurrent_core(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, defaults="official",
                    exit_criterion="kl")
