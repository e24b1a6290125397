"""transformers' own generation strategies on our model, through the library's Auto classes and through the
`rdepth export --remote-code` file: each must equal a hand-made reference (full forwards at the call's depth, no
cache) or be refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from recurrent_depth.cli import main
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import TINY_VOCAB, ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2  # the call's depth; the config's mean_recurrence (4) differs, so a forward that drops it is seen
GREEDY = dict(do_sample=False, num_steps=STEPS, init_scale=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"library": the Auto class's model, "remote": the exported file's model} of one saved tiny model."""
    path = tmp_path_factory.mktemp("hfgen")
    make_model_dir(path / "model", with_tokenizer=False)
    assert main(["export", "--model", str(path / "model"), "--out", str(path / "exported"), "--remote-code"]) == 0
    return {"library": AutoModelForCausalLM.from_pretrained(path / "model").eval(),
            "remote": remote.RecurrentDepthForCausalLM.from_pretrained(path / "exported").eval()}


def greedy_reference(model, x: torch.Tensor, new: int, process=None) -> torch.Tensor:
    """Greedy decoding by full forwards at STEPS (no cache); `process(seq, logits)` edits each step's logits."""
    seq = x
    with torch.no_grad():
        for _ in range(new):
            logits = model(seq, num_steps=STEPS, init_scale=0.0, use_cache=False).logits[:, -1]
            logits = logits if process is None else process(seq, logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("which", ["library", "remote"])
@pytest.mark.parametrize("negative", [False, True], ids=["last-prompt-token", "negative-prompt"])
def test_guidance_scale_runs_the_unconditional_forward_at_the_calls_depth(models, which, negative):
    """Classifier-free guidance (`guidance_scale`) calls the model itself for the unconditional logits, without the
    call's model kwargs: they ran at config.mean_recurrence (4, not num_steps=2) from a random s_0 (the config's
    init_scale, not 0), and the guided tokens silently differed from guidance at the call's depth."""
    model = models[which]
    x = ids(batch=2, length=6)
    neg = ids(batch=2, length=3, seed=11) if negative else None
    scale = 1.5

    def guided(seq, logits):
        # transformers' rule: the unconditional context is the negative prompt (else the prompt's last token),
        # followed by the generated tokens
        start = x[:, -1:] if neg is None else neg
        with torch.no_grad():
            uncond = model(torch.cat([start, seq[:, x.shape[1]:]], 1), num_steps=STEPS, init_scale=0.0,
                           use_cache=False).logits[:, -1]
        cond, uncond = logits.log_softmax(-1), uncond.log_softmax(-1)
        return scale * (cond - uncond) + uncond

    expected = greedy_reference(model, x, 5, guided)
    for use_cache in (True, False):
        out = model.generate(x, max_new_tokens=5, guidance_scale=scale, negative_prompt_ids=neg, use_cache=use_cache,
                             **GREEDY)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("which", ["library", "remote"])
def test_assistant_of_another_architecture_drafts_without_our_options(models, which):
    """transformers gives the assistant (`assistant_model=`) a copy of the call's model kwargs: a GPT-2 assistant
    failed with "model_kwargs are not used by the model: ['num_steps', 'init_scale']" (it is the assistant that takes
    none). The drafts only set the speed: the result is greedy decoding at the call's depth."""
    model = models[which]
    torch.manual_seed(0)
    assistant = GPT2LMHeadModel(GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                           eos_token_id=model.config.eos_token_id)).eval()
    x = ids(batch=1, length=6, seed=7)
    out = model.generate(x, max_new_tokens=6, assistant_model=assistant, generator=torch.Generator(), **GREEDY)
    assert torch.equal(out, greedy_reference(model, x, 6))


@pytest.mark.parametrize("which", ["library", "remote"])
def test_beam_search_scores_and_padding_equal_the_cache_free_reference(models, which):
    """Beam search reorders the per-(layer, step) cache: every step's logits, the beam indices and the final scores
    equal the cache-free run; a left-padded batch equals each row alone."""
    model = models[which]
    x = ids(batch=2, length=6, seed=3)
    kw = dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping=True,
              output_logits=True, output_scores=True, return_dict_in_generate=True, **GREEDY)
    cached, free = model.generate(x, **kw), model.generate(x, use_cache=False, **kw)
    assert torch.equal(cached.sequences, free.sequences) and torch.equal(cached.beam_indices, free.beam_indices)
    assert torch.allclose(cached.sequences_scores, free.sequences_scores, atol=1e-5)
    for a, b in zip(cached.logits, free.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    padded = model.generate(x.masked_fill(mask == 0, model.config.pad_token_id), attention_mask=mask,
                            max_new_tokens=4, num_beams=3, **GREEDY)
    for row, pad in enumerate((2, 0)):
        alone = model.generate(x[row:row + 1, pad:], max_new_tokens=4, num_beams=3, **GREEDY)
        assert torch.equal(padded[row, x.shape[1]:], alone[0, x.shape[1] - pad:])


@pytest.mark.parametrize("which", ["library", "remote"])
def test_dola_is_refused_in_one_line_before_transformers_fetches_it(models, which):
    """DoLa applies the lm_head to each entry of hidden_states as to an early layer's output: ours are the recurrent
    states s_0..s_r (read by the coda before the head), so its contrast would be meaningless. transformers only asked
    for trust_remote_code=True, and with it fetched the hub's DoLa code and ran it on them."""
    with pytest.raises(ValueError, match=r"^generate: dola_layers \(DoLa decoding\) contrasts the logits of early "
                                         r"layers, which a recurrent-depth model does not have") as err:
        models[which].generate(ids(batch=1, length=4), max_new_tokens=2, dola_layers="high", trust_remote_code=True,
                               **GREEDY)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("which", ["library", "remote"])
def test_a_beam_searchs_cache_does_not_continue_the_batch_and_says_why(models, which):
    model = models[which]
    x = ids(batch=1, length=3, seed=5)
    out = model.generate(x, max_new_tokens=2, num_beams=2, return_dict_in_generate=True, **GREEDY)
    more = torch.cat([out.sequences[:1], ids(batch=1, length=1, seed=9)], dim=1)
    with pytest.raises(ValueError, match=r"holds 2 rows but this call has 1: .*a beam search's holds batch x "
                                         r"num_beams rows"):
        model.generate(more, past_key_values=out.past_key_values, max_new_tokens=1, **GREEDY)
