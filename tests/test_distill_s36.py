"""RL loss masking found while checking distillation and RL against plain references (session 36)."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.train.rl import grpo_loss


@pytest.mark.parametrize("level", ["token", "sequence", "global-token", "constant"])
def test_an_unscored_position_whose_kl_overflows_leaves_the_grpo_loss_and_gradient_finite(level):
    """The padding after a rollout's stop is unscored, but its log-probs were multiplied by a mask of 0: at a low
    temperature the pad's policy and reference log-probs drifted ~214 nats apart in a real run (T = 0.02), exp(214)
    overflowed, inf * 0 = NaN, and 3 of 8 updates were skipped as non-finite. An unscored position now adds nothing."""
    old = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, -1.5, -5.0]])
    scored_logp = old + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.05, 0.0]])
    ref = scored_logp + torch.tensor([[0.2, -0.1, 0.0], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    A = torch.tensor([0.8, -0.8])
    options = dict(clip_eps=0.2, beta=0.1, level=level, max_new_tokens=3)
    # the last column unscored: a reference 300 nats above the policy there (exp overflows float32)
    logp = scored_logp.clone()
    logp[:, 2] = -400.0
    ref[:, 2] = -100.0
    logp.requires_grad_(True)
    loss, stats = grpo_loss(logp, old, A, mask, ref_logp=ref, **options)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and stats["kl"] == stats["kl"]
    assert logp.grad[:, 2].abs().max() == 0  # the unscored column gets no gradient
    # the same loss as with harmless values in that column
    plain, plain_stats = grpo_loss(scored_logp, old, A, mask, ref_logp=scored_logp + (ref - scored_logp) * mask,
                                   **options)
    assert loss.item() == pytest.approx(plain.item(), abs=1e-7)
    assert stats == pytest.approx(plain_stats)
