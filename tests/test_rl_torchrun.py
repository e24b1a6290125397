"""`rdepth rl`'s GRPO variants under torchrun (2 CPU ranks, gloo) against one process with the same global batch:
`--scale-rewards batch` (trl's std over every process's rewards) and `--loss-type dapo` (`global-token`: the mean
over every rank's completion tokens). One launch runs both; this file is also its worker:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/test_rl_torchrun.py OUT
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__":  # (the worker: run as a script by torchrun)
    sys.path[:0] = [str(REPO), str(REPO / "src")]

from tests.test_rl import ROLLOUT  # noqa: E402
from tests.train_support import OneThread  # noqa: E402

G = 3
# Rewards of 2 x 2 groups a rank, one missing: rank 0's spread (std 0.49) is not rank 1's (1.7) nor the batch's (2.3).
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 9.0, 2.0, 6.0, 3.0, 5.0, 7.0, 4.0])
VALID = torch.tensor([True] * 5 + [False] + [True] * 6)
# Stops at tokens that end four of rank 0's six rollouts early and one of rank 1's: the ranks score 15 and 22
# completion tokens, so a mean over each rank's own tokens would weigh rank 0's tokens more.
STOPS = [8, 99, 75, 107]


def dapo_update(prompts_per_step: int) -> dict:
    """One GRPO update (`--loss-type dapo --scale-rewards batch`) of the seeded byte model through `build_rl`, on this
    rank of a torchrun group or alone: the rollout batch, the gradient it stepped with, its record and the weights
    after it. No gradient clipping: a clip would hide a gradient scaled by another std."""
    import recurrent_depth as rd
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.rl.recipe import RLConfig, build_rl

    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288))
    rl = RLConfig(task="shells", difficulties=[2, 5], reward="tests.test_rl:char_sum", group_size=G,
                  level="global-token", scale_rewards="batch", backprop_depth=2,
                  generation={**ROLLOUT, "stop": STOPS})
    train = TrainConfig(out=None, max_steps=1, batch_size=prompts_per_step, progress=False, tensorboard=False,
                        optim=OptimConfig(name="adamw", lr=1e-2, grad_clip=None))
    found: dict = {}
    trainer = build_rl(model, rl, train, log=lambda line: None, on_step=lambda t, r: found.update(record=r))
    next_batch, step = trainer.source.next_batch, trainer.optimizer.step

    def recorded_batch(batch_size: int) -> dict:
        batch = found["batch"] = next_batch(batch_size)
        return batch

    def recorded_step() -> None:  # (the gradient DDP averaged over the ranks, before the update)
        found["gradient"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        step()

    trainer.source.next_batch, trainer.optimizer.step = recorded_batch, recorded_step
    trainer.run()
    found["weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    batch = found.pop("batch")
    found.update(rewards=batch["rewards"], valid=batch["reward_valid"],
                 tokens=int(batch["completion_mask"].sum()), completions=batch["completion_ids"])
    return found


def worker(out: Path) -> None:
    """This rank's batch-scaled advantages of its share of `REWARDS`, then its `dapo_update` (2 prompts a rank)."""
    import torch.distributed as dist

    from recurrent_depth.train.distributed import init_distributed
    from recurrent_depth.train.rl import group_advantages

    dist.init_process_group("gloo")
    env = init_distributed("cpu")
    rows = slice(env.rank * 6, env.rank * 6 + 6)
    advantages = group_advantages(REWARDS[rows], G, VALID[rows], scale="batch", env=env)
    found = {"advantages": advantages, **dapo_update(2)}
    torch.save(found, out / f"rank{env.rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rl_torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


@pytest.mark.slow
def test_batch_scaled_advantages_divide_by_every_rank_s_rewards_std(ranks):
    """Under torchrun `--scale-rewards batch` divided by the std of this rank's rewards (0.49 on rank 0, 1.7 on rank 1);
    trl's is the std of every process's rewards (gathered): now the two ranks give one process's advantages."""
    from recurrent_depth.train.rl import group_advantages

    alone = group_advantages(REWARDS, G, VALID, scale="batch")
    torch.testing.assert_close(torch.cat([rank["advantages"] for rank in ranks]), alone)


@pytest.mark.slow
def test_a_dapo_update_with_batch_scaled_rewards_on_two_ranks_equals_one_process(ranks):
    """`--loss-type dapo --scale-rewards batch` on 2 ranks of 2 prompts: the gradient, loss and weights of one process
    with the 4 prompts (the same rollouts), whose ranks score different numbers of tokens and rewards of another
    spread than the global batch's."""
    alone = dapo_update(4)
    # the same rollouts, shared out; rank 0 scores fewer tokens, and each rank's rewards spread otherwise than the
    # batch's (by 2 to 3 %: a gradient divided by a rank's std would miss the tolerance below by far)
    torch.testing.assert_close(torch.cat([rank["completions"] for rank in ranks]), alone["completions"])
    torch.testing.assert_close(torch.cat([rank["rewards"] for rank in ranks]), alone["rewards"])
    for rank in ranks:
        assert float(rank["rewards"].std()) != pytest.approx(float(alone["rewards"].std()), rel=0.01)
    assert ranks[0]["tokens"] < ranks[1]["tokens"] and ranks[0]["tokens"] + ranks[1]["tokens"] == alone["tokens"]
    for rank in ranks:
        torch.testing.assert_close(rank["gradient"], alone["gradient"], rtol=1e-4, atol=1e-7)
        assert rank["record"]["loss"] == pytest.approx(alone["record"]["loss"], rel=1e-5)
        # (AdamW's first step is about lr x sign(gradient): a gradient entry near its eps moves by rounding alone)
        torch.testing.assert_close(rank["weights"], alone["weights"], rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(Path(sys.argv[1]))
