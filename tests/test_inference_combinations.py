"""Generation modes in the combinations users give: a left-padded batch of very different lengths
(a one-token prompt among them) on models whose mixers differ from plain attention."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from tests.test_gradmem import left_padded

TOL = dict(rtol=1e-4, atol=1e-4)

pytestmark = pytest.mark.usefixtures("one_thread")


def model_with(mixer: str, **options) -> rd.RecurrentDepthLM:
    cfg = rd.ModelConfig.from_preset("tiny")
    cfg.mixer, cfg.mixer_options = mixer, options
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(cfg).eval()


g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(0, 256, (n,), generator=g) for n in (1, 9, 4)]


@pytest.mark.parametrize("mixer,options", [("log_linear_mamba2", {"chunk_size": 4}), ("ttt_kvb", {"mini_batch": 4})])
def test_a_left_padded_batch_of_a_position_counting_mixer_is_refused(mixer, options):
    """These mixers keep one position count for the batch: left padding shifted it for the shorter rows,
    whose logits then differed from the row alone (6e-2 for ttt_kvb) with no error."""
    model = model_with(mixer, **options)
    ids, mask = left_padded(PROMPTS)
    kw = dict(max_new_tokens=3, num_steps=3, init_scale=0.0, output_logits=True)
    with pytest.raises(ValueError, match="left-padded batch of 3 rows") as info:
        generate(model, ids, attention_mask=mask, **kw)
    assert "\n" not in str(info.value)
    # prompts of one length (no padding) stay exact: each row as alone
    same = torch.stack([torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    out = generate(model, same, attention_mask=torch.ones_like(same), **kw)
    for b in range(2):
        alone = generate(model, same[b], **kw)
        assert out.token_lists()[b] == alone.token_lists()[0]
        torch.testing.assert_close(out.logits[b], alone.logits[0], **TOL)


WINDOW_MODES = {
    "fixed": dict(),
    "kl+skip": dict(exit_criterion="kl", exit_threshold=1e-2, kv_policy="per-step+skip"),
    "kl+compute": dict(exit_criterion="kl", exit_threshold=1e-2, exit_kv="compute", kv_budget=2),
    "speculative": dict(draft_steps=2, lookahead=3),
    "parallel": dict(sampler="parallel", inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1),
    "warm+sampled": dict(warm_start=True, do_sample=True, init_scale=1.0),
}


@pytest.mark.parametrize("mode", list(WINDOW_MODES))
def test_sliding_window_batch_with_a_one_token_prompt_equals_each_row_alone(mode):
    model = model_with("attention", window=3)
    ids, mask = left_padded(PROMPTS)
    kw = dict(max_new_tokens=5, num_steps=4, init_scale=0.0, output_logits=True)
    kw.update(WINDOW_MODES[mode])
    batch = generate(model, ids, attention_mask=mask, seed=3, **kw)
    for b, prompt in enumerate(PROMPTS):
        alone = generate(model, prompt, seed=3 + b, **kw)
        assert batch.token_lists()[b] == alone.token_lists()[0], f"row {b}"
        n = int(alone.lengths[0])
        assert batch.steps[b, :n].tolist() == alone.steps[0, :n].tolist(), f"row {b}"
        torch.testing.assert_close(batch.logits[b, :n], alone.logits[0, :n], **TOL)
