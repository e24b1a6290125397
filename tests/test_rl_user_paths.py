"""`rdepth rl` as a user meets it: GRPO's numbers beside trl's GRPOTrainer, equal-reward groups, settings that
cannot train, and reward functions (a module beside the run, 0-d tensors, None / NaN)."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.train.rl import (
    GRPO,
    K2,
    RewardError,
    RolloutSettings,
    ShapedReward,
    group_advantages,
    grpo_loss,
    load_reward_function,
)


@pytest.fixture
def byte_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))


# ---------------------------------------------------------------------------- the math beside trl's
def trl_grpo_loss(logp, old, ref, A, mask, loss_type: str, eps_c: float, beta: float, eps_high: float | None = None,
                  max_completion_length: int | None = None) -> torch.Tensor:
    """trl 1.16.0's `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py) for importance_sampling_level="token",
    one process, no gradient accumulation: the lines that make the loss, restated (epsilon_high None: epsilon)."""
    eps_high = eps_c if eps_high is None else eps_high
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_c, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * A[:, None], coef_2 * A[:, None])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    mask = mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    assert loss_type in ("bnpo", "dapo")  # (dapo divides by num_items_in_batch: the batch's tokens here)
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("level, loss_type", [("token", "bnpo"), ("token", "dapo"), ("sequence", "grpo")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_equals_trls_loss_type_of_the_same_normalisation(level, loss_type, beta):
    """docs/post-training.md (### Objectives) maps --kl-level onto trl's loss_type; given the same advantages the
    two losses are the same number."""
    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(6, 5, generator=g)
    old = logp + 0.3 * torch.randn(6, 5, generator=g)  # ratios beyond the clip on both sides
    ref = logp + 0.5 * torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    A = group_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 7.0]), 3)
    ours, _ = grpo_loss(logp, old, A, mask, clip_eps=0.2, beta=beta, ref_logp=ref, level=level)
    torch.testing.assert_close(ours, trl_grpo_loss(logp, old, ref, A, mask, loss_type, 0.2, beta), rtol=1e-6,
                               atol=1e-7)


def test_group_advantages_are_trls():
    """trl's scale_rewards="group" divides by the sample std (Bessel's n - 1), as ours does (eps 0)."""
    rewards, G = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 7.0]), 3
    grouped = rewards.view(-1, G)
    trl = ((grouped - grouped.mean(1, keepdim=True)) / grouped.std(1, keepdim=True)).view(-1)
    torch.testing.assert_close(group_advantages(rewards, G, eps=0.0), trl)


def test_a_group_of_equal_rewards_has_zero_advantage_even_at_eps_0():
    """A group whose rewards are all equal (every rollout right, or every one wrong) got 0 / 0 = NaN advantages
    at eps=0 (`GRPO(eps=0.0)`), or +-1 where its mean rounds: NaN losses, or a push from nothing."""
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 2.0, 2.0, 9.0])
    valid = torch.tensor([True, True, True, True, True, True, True, True, False])  # (equal among the valid)
    for normalize, varied in ((True, [1.0, -1.0, 0.0]), (False, [0.5, -0.5, 0.0])):  # (sample std: 0.5)
        A = group_advantages(rewards, 3, valid, normalize=normalize, eps=0.0)
        assert A[:3].tolist() == [0.0, 0.0, 0.0] and A[6:].tolist() == [0.0, 0.0, 0.0], A
        assert A[3:6].tolist() == pytest.approx(varied)


@pytest.mark.parametrize("objective, setting, message", [
    (GRPO, {"beta": math.nan}, "beta=nan"), (GRPO, {"beta": math.inf}, "beta=inf"),
    (GRPO, {"eps": -1e-4}, "eps=-0.0001"), (K2, {"tau": math.inf}, "tau=inf")])
def test_non_finite_objective_settings_are_refused_in_one_line(objective, setting, message):
    """`--beta nan` passed `beta < 0`, kept no reference model (beta > 0 is False) and then failed in the loss
    ("grpo_loss with beta > 0 needs ref_logp"); `--tau inf` trained on infinite losses."""
    with pytest.raises(ValueError, match=message):
        objective(RolloutSettings(), **setting)


# ---------------------------------------------------------------------------- rollouts that cannot train
@pytest.mark.filterwarnings("ignore:temperature=0.7 has no effect")
def test_greedy_rollouts_are_refused(byte_model, tmp_path, capsys):
    """Greedy decoding from s_0 = 0 makes G identical rollouts of a prompt: every advantage 0, nothing learned,
    silently (`--temperature 0`, `--no-do-sample`, or a Python `generation` without do_sample=True)."""
    for generation in ({"do_sample": False}, {"temperature": 0.7, "max_new_tokens": 4}):
        with pytest.raises(ValueError, match=r"^rollouts need do_sample=True"):
            RolloutSettings(generation=generation).options(byte_model)
    byte_model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save(str(tmp_path / "m" / "tokenizer.json"))
    assert main(["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1",
                 "--temperature", "0"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "rollouts need do_sample=True" in errors[0], errors
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- reward functions
def test_a_reward_module_beside_the_run_is_found(tmp_path, monkeypatch):
    """The docs' `rdepth rl --reward my_rewards:score` failed with "No module named 'my_rewards'" when run from
    my_rewards.py's directory: the installed `rdepth` script (unlike `python -m`) has no current directory on
    sys.path. A file path gets a one-line hint instead of an import error."""
    (tmp_path / "rl_user_rewards_beside.py").write_text("def score(prompt, completion, depths):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "rl_user_rewards_beside", raising=False)
    assert load_reward_function("rl_user_rewards_beside:score")("p", "c", [1]) == 1.0
    with pytest.raises(ValueError, match="is a file path; expected a module name"):
        load_reward_function("./rl_user_rewards_beside.py:score")


def test_reward_values_torch_and_numpy_numbers_count_none_and_nan_fail_in_one_line():
    """A reward of `torch.tensor(0.5)` (a 0-d tensor, what a torch-based checker returns) was refused as
    "returned tensor(0.5000), not a finite number"."""
    import numpy as np

    for value in (torch.tensor(0.5), np.float32(0.5), np.array(0.5)):
        assert ShapedReward(lambda p, c, d, v=value: v, max_depth=4, max_new_tokens=4)("p", "c", [1], 1) == 0.5
    for value, shown in ((None, "None"), (math.nan, "nan"), ([1.0], r"\[1.0\]"), (torch.tensor([0.5, 1.0]),
                                                                                    "tensor")):
        with pytest.raises(RewardError, match=rf"failed \(TypeError: returned {shown}.*not a finite number"):
            ShapedReward(lambda p, c, d, v=value: v, max_depth=4, max_new_tokens=4)("p", "c", [1], 1)
