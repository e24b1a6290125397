"""`rdepth rl`'s GRPO variants beside trl 1.16.0's GRPOTrainer: the upper clip (DAPO's clip-higher, `epsilon_high`),
the reward scaling (`scale_rewards` group / batch / none), the normalisations (`loss_type` bnpo / grpo / dapo /
dr_grpo) and the truncated-completion mask (`mask_truncated_completions`); their flags, and resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.rl import GRPO, K2, RolloutSettings, group_advantages, grpo_loss, policy_logprobs
from recurrent_depth.train.rl.recipe import RLConfig, build_rl
from tests.test_rl import ROLLOUT, source
from tests.test_rl_user_paths import trl_grpo_loss


@pytest.fixture
def byte_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))


def loss_inputs() -> tuple[torch.Tensor, ...]:
    """Log-probs `[6, 5]` with ratios beyond the clip on both sides, pi_ref, ragged lengths, and two truncated rows."""
    g = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(6, 5, generator=g)
    old = logp + 0.3 * torch.randn(6, 5, generator=g)
    ref = logp + 0.5 * torch.randn(6, 5, generator=g)
    mask = torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    truncated = torch.tensor([True, False, False, False, False, True])
    return logp, old, ref, mask, truncated


# ---------------------------------------------------------------------------- the math beside trl's
@pytest.mark.parametrize("loss_type, level", [("bnpo", "token"), ("grpo", "sequence"), ("dapo", "global-token"),
                                              ("dr_grpo", "constant")])
@pytest.mark.parametrize("eps_high, beta, mask_truncated", [(0.28, 0.0, False), (0.28, 0.04, True),
                                                            (None, 0.04, True)])
def test_each_loss_type_equals_trls_with_clip_higher_and_truncated_rows_masked(loss_type, level, eps_high, beta,
                                                                               mask_truncated):
    """docs/post-training.md (### Objectives) maps --loss-type / --kl-level, --clip-eps-high and --mask-truncated onto
    trl's loss_type, epsilon_high and mask_truncated_completions (which zeroes a truncated row's mask, the row still
    counting in grpo's mean over rows and dr_grpo's B): given the same advantages, the same number."""
    logp, old, ref, mask, truncated = loss_inputs()
    if mask_truncated:
        mask = mask & ~truncated[:, None]
    A = group_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 7.0]), 3)
    ours, stats = grpo_loss(logp, old, A, mask, clip_eps=0.2, clip_eps_high=eps_high, beta=beta, ref_logp=ref,
                            level=level, rows=torch.ones(6, dtype=torch.bool), max_new_tokens=7)
    theirs = trl_grpo_loss(logp, old, ref, A, mask, loss_type, 0.2, beta, eps_high=eps_high, max_completion_length=7)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    high = 0.2 if eps_high is None else eps_high
    ratio = (logp - old).exp()
    outside = ((ratio < 0.8) | (ratio > 1 + high))[mask].float().mean()
    if level != "sequence":  # (the share of the scored tokens outside [1 - eps, 1 + eps_high])
        assert stats["clip_fraction"] == pytest.approx(float(outside))


def test_the_upper_clip_is_its_own_bound():
    """A ratio of 1.25 under a positive advantage is clipped at 1.2 by the symmetric clip, not by clip-higher 0.28."""
    logp, old = torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1)
    mask, A = torch.ones(1, 1, dtype=torch.bool), torch.tensor([1.0])
    assert float(grpo_loss(logp, old, A, mask)[0]) == pytest.approx(-1.2)
    assert float(grpo_loss(logp, old, A, mask, clip_eps_high=0.28)[0]) == pytest.approx(-1.25)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_equals_trls(scale):
    """trl's advantages (`_generate_and_score_completions`, sum_then_normalize, restated): the reward minus its group's
    mean, divided by the group's std ("group"), the whole batch's rewards' std ("batch"), or nothing ("none"); trl's
    std is the sample one (Bessel), and so is ours (eps 0)."""
    rewards, G = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 7.0, 4.0, 4.0, 4.0]), 3
    grouped = rewards.view(-1, G)
    centred = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(1).repeat_interleave(G)
    else:
        std = rewards.std().expand_as(rewards)
    trl = centred if scale == "none" else centred / (std + 1e-4)
    trl = torch.where(std > 0, centred / std, trl) if scale != "none" else trl  # (eps 1e-4 only where std is 0)
    ours = group_advantages(rewards, G, eps=0.0, scale=scale)
    torch.testing.assert_close(ours, trl)
    assert ours[6:].tolist() == [0.0, 0.0, 0.0]  # (an equal group stays 0 under every scale)


def test_batch_scale_leaves_an_invalid_reward_out_of_the_std():
    rewards, valid = torch.tensor([1.0, 0.0, 100.0, 2.0, 3.0, 5.0]), torch.tensor([True, True, False] + [True] * 3)
    ours = group_advantages(rewards, 3, valid, eps=0.0, scale="batch")
    kept = rewards[valid]
    std = kept.std()  # (the sample std, trl's)
    torch.testing.assert_close(ours, torch.tensor([0.5, -0.5, 0.0, -1.3333, -0.3333, 1.6667]) / std, rtol=1e-4,
                               atol=1e-5)


# ---------------------------------------------------------------------------- the objective on real rollouts
def test_mask_truncated_leaves_the_rollouts_cut_by_max_new_tokens_out(one_thread, byte_model):
    """A rollout is truncated when generation stopped at max_new_tokens rather than at a stop (finish "length");
    under mask_truncated its tokens carry no loss, and under "global-token" the trainer weighs by the tokens left."""
    first = int(source(byte_model, max_new_tokens=3).next_batch(2)["completion_ids"][0, 0])
    batch = source(byte_model, max_new_tokens=3, stop=[first]).next_batch(2)  # (the same draws, up to the stop)
    lengths = batch["completion_mask"].sum(1)
    stopped = batch["completion_ids"].gather(1, (lengths - 1)[:, None])[:, 0] == first
    assert torch.equal(batch["truncated"], ~stopped) and 0 < int(batch["truncated"].sum()) < 6, batch["truncated"]
    assert batch["max_new_tokens"] == 3
    settings = RolloutSettings(group_size=3, generation=ROLLOUT, backprop_depth=2, seed=5)
    kept = batch["completion_mask"] & ~batch["truncated"][:, None]
    for level in ("token", "sequence", "global-token", "constant"):
        with torch.no_grad():
            ours, _ = GRPO(settings, level=level, mask_truncated=True).loss(byte_model, batch, None, None)
            plain, _ = GRPO(settings, level=level).loss(byte_model, batch, None, None)
            logp = policy_logprobs(byte_model, batch, settings)
        A = group_advantages(batch["rewards"], 3)
        wanted, _ = grpo_loss(logp, batch["old_logp"], A, kept, level=level, max_new_tokens=3,
                              rows=torch.ones(6, dtype=torch.bool))
        torch.testing.assert_close(ours, wanted)
        assert float(ours) != float(plain)
    assert GRPO(settings, level="global-token", mask_truncated=True).scored_tokens(batch) == int(kept.sum())
    assert GRPO(settings, level="token").scored_tokens(batch) is None  # (each rank's own mean, as before)
    with torch.no_grad():
        k2 = K2(settings, mask_truncated=True).loss(byte_model, batch, None, None)[0]
    assert float(k2) != float(K2(settings).loss(byte_model, batch, None, None)[0].detach())


# ---------------------------------------------------------------------------- flags, validation, resume
def test_bad_variant_settings_are_refused_in_one_line(tmp_path, capsys):
    base = ["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1"]
    for extra, message in ((["--loss-type", "grpo", "--kl-level", "token"],
                            "--loss-type grpo is --kl-level sequence, not --kl-level token: give one of them"),
                           (["--objective", "k2", "--loss-type", "bnpo"], "--loss-type bnpo is a setting of "
                                                                          "objective='grpo'"),
                           (["--objective", "k2", "--clip-eps-high", "0.28"], "(--clip-eps-high) is a setting of"),
                           (["--objective", "k2", "--scale-rewards", "none"], "(--scale-rewards) is a setting of"),
                           (["--clip-eps-high", "nan"], "clip_eps_high=nan (--clip-eps-high) is invalid"),
                           (["--clip-eps-high", "0"], "clip_eps_high=0.0 (--clip-eps-high) is invalid")):
        assert main(base + extra) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"^scale_rewards='std' \(--scale-rewards\) is invalid"):
        RLConfig(scale_rewards="std")
    with pytest.raises(ValueError, match=r"^scale='std' is invalid"):
        group_advantages(torch.zeros(4), 2, scale="std")


def test_an_old_checkpoint_resumes_and_a_changed_variant_is_refused(one_thread, byte_model):
    """A checkpoint written before these settings has no key for them: it ran with their defaults, so it resumes
    under the defaults, and a resume that changes one of them is refused like the other objective settings."""
    def rl_source(**variant):
        rl = RLConfig(task="shells", difficulties=[2], reward="tests.test_rl:char_sum", group_size=3,
                      generation=ROLLOUT, **variant)
        train = TrainConfig(out=None, max_steps=1, batch_size=1, progress=False, tensorboard=False)
        return build_rl(byte_model, rl, train, log=lambda line: None).source

    saved = rl_source().state_dict()
    for key in ("clip_eps_high", "scale_rewards", "mask_truncated"):
        del saved["run"][key]  # (as the code before them wrote it)
    rl_source().load_state_dict(saved)
    rl_source(clip_eps_high=0.2).load_state_dict(saved)  # (the symmetric clip spelled out)
    for variant, change in (({"clip_eps_high": 0.28}, "clip_eps_high None -> 0.28"),
                            ({"scale_rewards": "batch"}, "scale_rewards 'group' -> 'batch'"),
                            ({"mask_truncated": True}, "mask_truncated False -> True"),
                            ({"level": "constant"}, "level 'token' -> 'constant'")):
        with pytest.raises(ValueError, match=rf"^cannot resume this RL run: .*\({change}\)$"):
            rl_source(**variant).load_state_dict(saved)


def test_the_variant_flags_train(one_thread, byte_model, tmp_path):
    byte_model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save(str(tmp_path / "m" / "tokenizer.json"))
    assert main(["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1",
                 "--difficulty", "2", "--group-size", "2", "--prompts-per-step", "1", "--updates", "1",
                 "--max-new-tokens", "2", "--num-steps", "2", "--loss-type", "dr_grpo", "--scale-rewards", "none",
                 "--clip-eps-high", "0.28", "--mask-truncated"]) == 0
    assert (tmp_path / "out" / "model").exists()
