"""RL whose rollouts choose their own depth: the losses, the depth replay, rewards, resume (issue 27, item 4)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.model.replay import DepthReplay
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.rl import (
    GRPO,
    RewardError,
    RolloutSettings,
    RolloutSource,
    ShapedReward,
    TaskPrompts,
    group_advantages,
    grpo_loss,
    k2_loss,
    load_reward_function,
    policy_logprobs,
)
from recurrent_depth.train.rl.recipe import RLConfig, build_rl

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = {"max_new_tokens": 4, "do_sample": True, "num_steps": 6, "exit_criterion": "kl", "exit_threshold": 1e-2,
           "top_k": 40}


def count_ones(prompt: str, completion: str, depths: list[int]) -> float:
    """A reward that varies on an untrained model: the share of '1's in the completion."""
    return completion.count("1") / max(1, len(completion))


def fails_on_long(prompt: str, completion: str, depths: list[int]) -> float:
    if len(completion) > 1:
        raise KeyError("too long")
    return 1.0


@pytest.fixture
def byte_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))


def source(model, reward=count_ones, on_error="stop", log=print, **generation) -> RolloutSource:
    settings = RolloutSettings(group_size=3, generation={**ROLLOUT, **generation}, backprop_depth=2, seed=5)
    shaped = ShapedReward(reward, max_depth=6, max_new_tokens=4, on_error=on_error, log=log)
    return RolloutSource(model, TaskPrompts(rd.evaluation.reasoning.ShellGame(), [2, 3]), shaped, settings)


# ---------------------------------------------------------------------------- the losses by hand
def test_grpo_loss_equals_the_formula_on_a_hand_computed_case():
    A = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.0)
    assert A.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)])  # mean 0.5, sample std sqrt(0.5) (trl's)
    A = torch.tensor([1.0, -1.0])  # (the loss below is worked out at A = +-1)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ratio = torch.tensor([[1.5, 0.5], [1.1, 7.0]])  # the 7 is masked out
    logp = old + ratio.log()
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = grpo_loss(logp, old, A, mask, clip_eps=0.2)
    # row 0 (A = 1): min(1.5, 1.2) + min(0.5, 0.8) = 1.7; row 1 (A = -1): min(-1.1, -1.1) = -1.1; over 3 tokens
    assert loss.item() == pytest.approx(-(1.7 - 1.1) / 3, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    ref = logp + torch.tensor([[math.log(2.0), 0.0], [0.0, 0.0]])  # pi_ref / pi_theta = 2 at one token
    k3 = 2 - math.log(2) - 1
    loss, stats = grpo_loss(logp, old, A, mask, clip_eps=0.2, beta=0.5, ref_logp=ref)
    assert loss.item() == pytest.approx(-(1.7 - 1.1) / 3 + 0.5 * k3 / 3, abs=1e-6)
    assert stats["kl"] == pytest.approx(k3 / 3, abs=1e-6)
    loss, _ = grpo_loss(logp, old, A, mask, clip_eps=0.2, beta=0.5, ref_logp=ref, level="sequence")
    assert loss.item() == pytest.approx(((-1.7 + 0.5 * k3) / 2 + 1.1) / 2, abs=1e-6)


def test_k2_loss_equals_the_formula_on_a_hand_computed_case():
    A = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, normalize=False)
    assert A.tolist() == [0.5, -0.5]
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, -0.1], [0.3, 9.0]])  # sequence log-ratios 0.1 and 0.3 (9.0 masked)
    mask = torch.tensor([[True, True], [True, False]])
    loss = k2_loss(logp, old, A, mask, tau=0.5)
    assert loss.item() == pytest.approx(((0.5 - 0.05) ** 2 + (-0.5 - 0.15) ** 2) / 2, abs=1e-6)


def test_a_left_out_rollout_leaves_its_group_statistics():
    A = group_advantages(torch.tensor([1.0, 0.0, 5.0]), 3, valid=torch.tensor([True, True, False]), eps=0.0)
    assert A.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5), 0.0])  # (the sample std of 1, 0)


# ---------------------------------------------------------------------------- the depth replay
@pytest.mark.parametrize("policy, prefill_exits", [("per-step+deepest", False), ("per-step+skip", False),
                                                   ("per-step+deepest", True)])
def test_replayed_logprobs_equal_the_sampled_ones_with_adaptive_exit(one_thread, byte_model, policy, prefill_exits):
    rollouts = source(byte_model, kv_policy=policy, exit_in_prefill=prefill_exits)
    batch = rollouts.next_batch(3)
    depths = batch["token_depths"][:, -batch["completion_ids"].shape[1]:][batch["completion_mask"]]
    assert len(set(depths.tolist())) > 1  # the exit criterion chose different depths
    with torch.no_grad():
        replayed = policy_logprobs(byte_model, batch, rollouts.settings)
    mask = batch["completion_mask"]
    assert (replayed - batch["old_logp"])[mask].abs().max().item() < 1e-5
    # not vacuous: the other lookup, or every token at full depth, gives other log-probs
    other = "per-step+skip" if policy.endswith("deepest") else "per-step+deepest"
    with torch.no_grad():
        wrong = policy_logprobs(byte_model, {**batch, "kv_policy": other}, rollouts.settings)
        full = policy_logprobs(byte_model, {**batch, "token_depths": torch.full_like(batch["token_depths"], 6)},
                               rollouts.settings)
    assert (wrong - batch["old_logp"])[mask].abs().max().item() > 1e-4
    assert (full - batch["old_logp"])[mask].abs().max().item() > 1e-4


def test_a_uniform_replay_equals_the_plain_truncated_forward(one_thread, byte_model):
    ids = torch.randint(0, 288, (2, 7))
    byte_model.train()
    plain = byte_model(ids, num_steps=(3, 2), init_scale=0.0)
    plain.logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in byte_model.named_parameters()}
    byte_model.zero_grad()
    replay = byte_model(ids, init_scale=0.0, replay=DepthReplay(torch.full((2, 7), 5), "per-step+deepest", 2))
    replay.logits.square().mean().backward()
    assert torch.allclose(replay.logits, plain.logits, atol=1e-6)
    for name, p in byte_model.named_parameters():
        assert torch.allclose(p.grad, want[name], atol=1e-6), name


def test_a_shared_slot_policy_is_refused(byte_model):
    with pytest.raises(ValueError, match="cannot be replayed"):
        source(byte_model, kv_policy="shared-2")
    with pytest.raises(ValueError, match="init_scale=0"):
        source(byte_model, init_scale=1.0)
    with pytest.raises(ValueError, match="unknown rollout generation option"):
        source(byte_model, num_step=3)


@pytest.mark.parametrize("option", [{"gradmem_tokens": 1, "gradmem_steps": 1}, {"exit_kv": "compute"}],
                         ids=["gradmem", "exit-kv-compute"])
def test_rollouts_the_replay_cannot_follow_are_refused(byte_model, option):
    """A GradMem memory conditions the rollout on what the replay never sees (2.7 nats apart on a tiny model);
    exit_kv='compute' keeps exited tokens computing KV the replay does not (1e-3 apart): both were accepted."""
    name, value = next(iter(option.items()))
    with pytest.raises(ValueError, match=f"rollouts need {name}=.* got {value!r}"):
        source(byte_model, **option)


# ---------------------------------------------------------------------------- rewards
def test_a_raising_reward_is_reported_with_its_input(one_thread, byte_model):
    with pytest.raises(RewardError, match=r"fails_on_long failed \(KeyError.*prompt='\d>[a-d]+=' completion="):
        source(byte_model, reward=fails_on_long, max_new_tokens=3, stop=[]).next_batch(2)
    lines: list[str] = []
    for on_error in ("zero", "skip"):
        rollouts = source(byte_model, reward=fails_on_long, on_error=on_error, log=lines.append, max_new_tokens=3)
        batch = rollouts.next_batch(2)
        assert rollouts.reward.errors > 0 and len(lines) >= rollouts.reward.errors
        assert "prompt=" in lines[-1] and f"on_reward_error={on_error}" in lines[-1]
        assert batch["reward_valid"].all() if on_error == "zero" else not batch["reward_valid"].all()
        # the metrics count each batch's failures (per step, like rollouts_left_out), not a running total
        second = rollouts.next_batch(2)
        assert batch["reward_errors"] + second["reward_errors"] == rollouts.reward.errors
        assert rollouts.observe(second, None)["reward_errors"] == second["reward_errors"]


def test_rl_cli_refuses_what_a_replay_cannot_follow_in_one_line(byte_model, tmp_path, capsys):
    byte_model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save(str(tmp_path / "m" / "tokenizer.json"))
    base = ["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1"]
    for extra, message in ((["--kv-policy", "shared-2"], "cannot be replayed"), (["--init-scale", "1"], "init_scale=0"),
                           (["--reward", "nocolon"], "module:function"),
                           (["--backprop-depth", "0"], "backprop_depth=0 (--backprop-depth)")):
        assert main(base + extra) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()  # refused before the run directory (a depth of 0 failed after a rollout)


def test_a_setting_of_the_other_objective_is_refused_not_ignored(tmp_path, capsys):
    """K2 has no KL term and no clip, GRPO no tau: `--objective k2 --beta 0.1` trained without the KL it asked for.
    A group of one rollout has advantage 0 under both objectives: it trained nothing. --prompts replaced --task and
    --difficulty without a word."""
    base = ["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("2+2=\n")
    for extra, message in ((["--objective", "k2", "--beta", "0.1"], "beta=0.1 (--beta)"),
                           (["--objective", "k2", "--kl-level", "sequence"], "(--kl-level)"),
                           (["--objective", "k2", "--clip-eps", "0.3"], "(--clip-eps)"),
                           (["--tau", "0.5"], "tau=0.5 (--tau) is a setting of objective='k2'"),
                           (["--group-size", "1"], "group_size=1 (--group-size) is invalid"),
                           (["--prompts", str(prompts), "--reward", "tests.test_rl:count_ones", "--difficulty", "5"],
                            "--task and --difficulty choose a reasoning task's prompts, which --prompts replaces")):
        assert main(base + extra) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
    RLConfig(objective="k2", tau=0.5)
    RLConfig(objective="grpo", beta=0.1, clip_eps=0.3, level="sequence")


def test_rl_cli_writes_the_model_back_in_the_init_from_dtype(byte_model, tmp_path, capsys):
    """`train` / `sft --init-from` write model/ in DIR's stored dtype; `rl` wrote float32, so a bf16 model
    came back twice its size. Checkpoints keep the trained float32. The summary says the run's rewards (it
    printed none: they were only in metrics.jsonl)."""
    import json

    from safetensors.torch import load_file

    byte_model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    byte_tokenizer().save(str(tmp_path / "m" / "tokenizer.json"))
    assert main(["rl", "--init-from", str(tmp_path / "m"), "--out", str(tmp_path / "out"), "--threads", "1",
                 "--task", "shells", "--difficulty", "2", "--group-size", "2", "--prompts-per-step", "1",
                 "--updates", "1", "--max-new-tokens", "2", "--num-steps", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in logged if "reward_mean" in r]
    assert summary["reward_first"] == summary["reward_last"] == round(rewards[0], 4) and len(rewards) == 1

    def dtypes(path):
        return {t.dtype for t in load_file(path / "model.safetensors").values()}

    assert dtypes(tmp_path / "out" / "model") == {torch.bfloat16}
    assert dtypes(tmp_path / "out" / "checkpoints" / "step-00000001") == {torch.float32}


def test_reward_function_specs_fail_in_one_line():
    assert load_reward_function("tests.test_rl:count_ones") is count_ones
    for spec, message in (("nocolon", "module:function"), ("no_such_mod_xyz:f", "cannot import"),
                          ("tests.test_rl:missing", "no callable")):
        with pytest.raises(ValueError, match=message):
            load_reward_function(spec)


# ---------------------------------------------------------------------------- the loop and resume
def char_sum(prompt: str, completion: str, depths: list[int]) -> float:
    """A reward that sets distinct completions apart (almost surely), so a group's advantages are not all 0."""
    return float(sum(map(ord, completion)) % 7)


def rl_updates(prompts_per_step: int, updates: int = 2) -> tuple[list[dict], list[list[list[int]]], torch.Tensor]:
    """`updates` GRPO updates of the seeded byte model through `build_rl` (one rank of a torchrun group, or alone):
    each step's record, each batch's completions (token lists) and the final weights. (tests/gloo_worker.py runs
    it on 2 ranks.)"""
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))
    rl = RLConfig(task="shells", difficulties=[2, 5], reward="tests.test_rl:char_sum", group_size=3, beta=0.1,
                  backprop_depth=2, generation=ROLLOUT)
    train = TrainConfig(out=None, max_steps=updates, batch_size=prompts_per_step,
                        optim=OptimConfig(name="adamw", lr=1e-2), progress=False, tensorboard=False)
    records, completions = [], []
    trainer = build_rl(model, rl, train, log=lambda line: None, on_step=lambda t, r: records.append(r))
    next_batch = trainer.source.next_batch

    def recorded(batch_size: int) -> dict:
        batch = next_batch(batch_size)
        completions.append([row[m].tolist() for row, m in zip(batch["completion_ids"], batch["completion_mask"],
                                                                strict=True)])
        return batch

    trainer.source.next_batch = recorded
    trainer.run()
    return records, completions, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_each_rank_makes_its_share_of_the_global_rollout_batch(one_thread, byte_model):
    """Under torchrun every rank drew the same prompts and seeds: world_size copies of one batch (the work repeated,
    the tokens counted twice). Rank r now makes prompts [rP, (r+1)P) and rows [rPG, (r+1)PG) of the global batch."""
    settings = RolloutSettings(group_size=3, generation=ROLLOUT, backprop_depth=2, seed=5)
    reward = ShapedReward(char_sum, max_depth=6, max_new_tokens=4)
    prompts = TaskPrompts(rd.evaluation.reasoning.ShellGame(), [2, 5])  # (prompts of different lengths)

    def batch(rank: int, world_size: int, prompts_per_rank: int) -> dict:
        return RolloutSource(byte_model, prompts, reward, settings, rank=rank,
                             world_size=world_size).next_batch(prompts_per_rank)

    alone, ranks = batch(0, 1, 4), [batch(rank, 2, 2) for rank in (0, 1)]
    assert not torch.equal(ranks[0]["completion_ids"], ranks[1]["completion_ids"])
    for rank, part in enumerate(ranks):
        rows = slice(6 * rank, 6 * rank + 6)
        for key in ("completion_ids", "completion_mask", "rewards"):
            assert torch.equal(part[key], alone[key][rows]), key
        mask, new = part["completion_mask"], part["completion_ids"].shape[1]
        assert torch.equal(part["token_depths"][:, -new:], alone["token_depths"][rows, -new:])
        torch.testing.assert_close(part["old_logp"][mask], alone["old_logp"][rows][mask], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="^rank=2 is invalid for world_size=2"):
        RolloutSource(byte_model, prompts, reward, settings, rank=2, world_size=2)


def test_one_grpo_update_moves_the_policy(one_thread, byte_model):
    rl = RLConfig(task="shells", difficulties=[2], reward="tests.test_rl:char_sum", group_size=3, beta=0.1,
                  backprop_depth=2, generation=ROLLOUT)
    train = TrainConfig(out=None, max_steps=2, batch_size=2, optim=OptimConfig(name="adamw", lr=1e-2),
                        progress=False, tensorboard=False)
    before = {n: p.detach().clone() for n, p in byte_model.named_parameters()}
    records = []
    trainer = build_rl(byte_model, rl, train, log=lambda line: None, on_step=lambda t, r: records.append(r))
    assert isinstance(trainer.objective, GRPO)
    trainer.run()
    assert records[0]["loss"] != 0.0 and records[0]["mean_depth"] < 6
    assert records[1]["kl"] > 0  # the second batch's pi_ref differs from the updated policy
    assert any(not torch.equal(p, before[n]) for n, p in byte_model.named_parameters())


RL_ARGS = ["rl", "--reward", "tests.test_rl:count_ones", "--difficulty", "2", "--group-size", "3",
           "--prompts-per-step", "2", "--updates", "4", "--save-every", "1", "--lr", "1e-2", "--beta", "0.1",
           "--num-steps", "6", "--exit-criterion", "kl", "--exit-threshold", "0.01", "--top-k", "40",
           "--max-new-tokens", "4", "--backprop-depth", "2", "--threads", "1", "--seed", "3"]


@pytest.mark.slow
def test_kill_9_then_resume_continues_the_same_trajectory_bitwise(one_thread, byte_model, tmp_path):
    start = tmp_path / "start"
    byte_model.save_pretrained(start)
    byte_tokenizer().save(str(start / "tokenizer.json"))
    args = RL_ARGS + ["--init-from", str(start)]
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen([sys.executable, "-m", "recurrent_depth.cli", *args, "--out", str(killed)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert main(args + ["--out", str(tmp_path / "straight")]) == 0  # while the other process starts

    second = killed / "checkpoints" / "step-00000002"
    deadline = time.monotonic() + 120
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert second.exists() and not (killed / "model").exists(), "the run ended before it could be killed"
    assert main(args + ["--out", str(killed), "--resume"]) == 0

    runs = (tmp_path / "straight", killed)
    weights = [load_file(str(run / "model" / "model.safetensors")) for run in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    losses = [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_a_resume_with_other_prompts_reward_or_objective_is_refused(one_thread, byte_model, tmp_path, capsys):
    """Only the rollout settings were compared: a resume with another task, difficulty, objective or penalty went
    on as if it were the same run."""
    start = tmp_path / "start"
    byte_model.save_pretrained(start)
    byte_tokenizer().save(str(start / "tokenizer.json"))
    args = ["rl", "--init-from", str(start), "--out", str(tmp_path / "run"), "--difficulty", "2", "--group-size", "2",
            "--prompts-per-step", "1", "--updates", "1", "--save-every", "1", "--num-steps", "2",
            "--max-new-tokens", "2", "--threads", "1"]
    assert main(args) == 0
    resume = [*args, "--resume", "--updates", "2"]
    for extra, message in ((["--difficulty", "3"], "difficulties [2] -> [3]"),
                           (["--objective", "k2"], "objective 'grpo' -> 'k2'"),
                           (["--compute-penalty", "0.5"], "compute_penalty 0.0 -> 0.5")):
        assert main([*resume, *extra]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and "cannot resume this RL run" in errors[0] and message in errors[0], errors
        assert not (tmp_path / "run" / "checkpoints" / "step-00000002").exists()
    assert main(resume) == 0 and (tmp_path / "run" / "checkpoints" / "step-00000002").exists()


@pytest.mark.parametrize("other_config", [True, False])
def test_a_resume_from_another_init_from_model_is_refused_and_keeps_the_checkpoints(one_thread, byte_model, tmp_path,
                                                                                     capsys, other_config):
    """`rdepth rl --resume` with an --init-from of other shapes set every valid checkpoint aside as damaged and
    restarted the run from scratch on the other model (exit 0); one of the same config and other weights was taken
    as the run's start (its reference model and tokenizer then came from it). Both are refused now (the config
    field by field, then the start's identity), and the right model resumes."""
    start, other = tmp_path / "start", tmp_path / "other"
    byte_model.save_pretrained(start)
    torch.manual_seed(5)
    grow = 16 if other_config else 0
    config = dataclasses.replace(byte_model.config, intermediate_size=byte_model.config.intermediate_size + grow)
    rd.RecurrentDepthLM(config).save_pretrained(other)
    for directory in (start, other):
        byte_tokenizer().save(str(directory / "tokenizer.json"))
    args = ["rl", "--out", str(tmp_path / "run"), "--difficulty", "2", "--group-size", "2", "--prompts-per-step", "1",
            "--updates", "1", "--save-every", "1", "--num-steps", "2", "--max-new-tokens", "2", "--threads", "1"]
    assert main([*args, "--init-from", str(start)]) == 0
    capsys.readouterr()
    assert main([*args, "--init-from", str(other), "--resume", "--updates", "2"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    wanted = ("it holds another model than this run's (intermediate_size: " if other_config else
              f"the run started from {start.resolve()}, this run from {other.resolve()} (the model directories' "
              f"config.json or weights differ")
    assert len(errors) == 1 and wanted in errors[0], errors
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000001"]
    assert main([*args, "--init-from", str(start), "--resume", "--updates", "2"]) == 0


def test_a_resume_that_spells_out_a_default_rollout_option_is_accepted(byte_model):
    """`rdepth rl ... --kv-policy per-step+deepest` (the default) then `--resume` without it (or the other way
    round) was refused as changed rollout settings, though the rollouts are the same."""
    saved = source(byte_model, kv_policy="per-step+deepest").state_dict()
    resumed = source(byte_model)
    resumed.load_state_dict(saved)
    assert resumed.batches == saved["batches"]
    source(byte_model, kv_policy="per-step+deepest").load_state_dict(source(byte_model).state_dict())
    for other, change in ((source(byte_model, kv_policy="per-step+skip"), r"kv_policy 'per-step\+deepest' -> "
                                                                          r"'per-step\+skip'"),
                          (source(byte_model, num_steps=5), ".*num_steps 6 -> 5")):
        with pytest.raises(ValueError, match=rf"rollout settings changed \({change}\)$"):  # (only what changed)
            other.load_state_dict(saved)
