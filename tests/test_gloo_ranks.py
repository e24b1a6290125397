"""Two CPU processes (gloo, file store in tmp_path), spawned by the test: QK-clip on FSDP2-sharded
weights equals one process; per-rank depth draws under real DDP, with gradients still all-reduced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.test_qk_stability import clipped_weights

REPO = Path(__file__).resolve().parent.parent
WORLD = 2

pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]


def run_ranks(tmp_path: Path, *args: str) -> Path:
    """Run tests/gloo_worker.py as WORLD processes; wait (generously) for all; return their output dir."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    store = tmp_path / "store"  # a fresh file store per run: no port to pick, nothing left behind
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    procs = [
        subprocess.Popen([sys.executable, str(REPO / "tests" / "gloo_worker.py"), str(rank), str(WORLD), str(store),
                          str(out), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{logs[rank][-4000:] if rank < len(logs) else ''}"
    return out


FSDP_CASES = {
    "gqa": dict(),
    "mha-bias": dict(num_kv_heads=4, qk_bias=True),
    "gqa-qk-norm": dict(qk_norm=True),
    "gqa-qk-norm-per-head": dict(qk_norm=True, qk_norm_per_head=True),
    # one key head: its per-head gain [1, 16] is split unevenly (rank 1's shard is empty)
    "mqa-qk-norm-per-head": dict(qk_norm=True, qk_norm_per_head=True, num_kv_heads=1),
}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict:
    out = run_ranks(tmp_path_factory.mktemp("fsdp"), "fsdp-clip", json.dumps(FSDP_CASES))
    return torch.load(out / "fsdp-clip.pt", weights_only=True)


@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_qk_clip_on_fsdp2_shards_equals_one_process(fsdp_runs, case):
    two = fsdp_runs[case]
    # The clip really met sharded parameters: DTensors split over the two ranks by rows.
    wqkv = two["shards"]["transformer.prelude.0.attn.Wqkv.weight"]
    assert wqkv[2] == ["S(0)"] and wqkv[0][0] * WORLD == wqkv[1][0]
    one_state, one_record = clipped_weights(**FSDP_CASES[case])
    assert one_record["qk_clipped_heads"] > 0 and two["record"] == one_record
    assert set(two["state"]) <= set(one_state)
    for name, value in two["state"].items():
        assert torch.equal(value, one_state[name]), name  # bit-identical


@pytest.fixture(scope="module")
def per_rank_out(tmp_path_factory) -> Path:
    """One launch for the modes whose ranks each save their own results (start-up dominates the time)."""
    return run_ranks(tmp_path_factory.mktemp("ranks"),
                     "ddp-depth+lr-time-budget+sft-heldout+rl-ranks+token-mean+reasoning-ranks")


@pytest.fixture(scope="module")
def depth_runs(per_rank_out) -> list[dict]:
    return [torch.load(per_rank_out / f"ddp-depth-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


@pytest.mark.parametrize("flag", ["lock-step", "per-rank"])
def test_ddp_all_reduces_gradients_whatever_depth_each_rank_draws(depth_runs, flag):
    ranks = [runs[flag] for runs in depth_runs]
    depths = [[tuple(step["depth"]) for step in rank] for rank in ranks]
    if flag == "lock-step":
        assert depths[0] == depths[1]
    else:
        assert any(a != b for a, b in zip(*depths, strict=True))  # the ranks ran different graphs
    for step in range(len(ranks[0])):
        r0, r1 = ranks[0][step], ranks[1][step]
        assert torch.equal(r0["ddp_grads"], r1["ddp_grads"])
        assert torch.equal(r0["weights"], r1["weights"])
        # the all-reduced gradient is the mean of what each rank computes alone on its own rows and depth
        local = r0["local_grads"]
        assert not torch.equal(local[0], local[1])
        torch.testing.assert_close(r0["ddp_grads"], (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-7)


def test_time_budgets_and_stop_hook_follow_rank_0_on_every_rank(per_rank_out):
    # --max-minutes projects the run's length (and so the cool-down) from the clock; each rank's clock differs,
    # and a rank that stepped at its own learning rate would drift from the others' weights under DDP.
    lrs = [torch.load(per_rank_out / f"lr-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    assert lrs[0] == lrs[1]
    assert lrs[0][1] < 1e-3  # rank 0's projection (60 steps): step 45 is in the cool-down
    assert lrs[0][2] is None  # a stop_when hook that differs by rank: rank 0's answer (else rank 0 hung alone)
    # --max-minutes cuts the final evaluation on several ranks too (rank 0's clock): 4 batches of 2 x 8 tokens in
    # all (eval_batches counts over the ranks), cut to one round: a batch on each rank
    assert lrs[0][3:5] == [4 * 2 * 8, 2 * 2 * 8]
    # eval_batches=3 on 2 ranks evaluates the rows of one process, at the same s0: the same tokens and loss
    (tokens, loss, corr), (alone_tokens, alone_loss, alone_corr) = lrs[0][5:]
    assert tokens == alone_tokens == 3 * 2 * 8
    assert loss == pytest.approx(alone_loss, rel=1e-12) and corr == pytest.approx(alone_corr, rel=1e-12)


def test_sft_heldout_loss_on_two_ranks_is_one_process_s_with_each_batch_once(per_rank_out):
    """`rdepth sft` under torchrun evaluated every held-out batch on every rank (the work repeated world_size times).
    Now rank r takes batches r, r + world_size, ... and the sums are all-reduced: the one-process result."""
    found = [torch.load(per_rank_out / f"sft-heldout-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    assert found[0][0] == 9  # rows: 5 batches of 2, the last one of 1
    # rows per batch this rank evaluated: batches 0, 2, 4 and 1, 3 of 5; then 0, 2 and 1 of 3
    assert [batches for _, batches, *_ in found] == [[2, 2, 1, 2, 2], [2, 2, 2]]
    assert found[0][2:] == found[1][2:]
    for shared, alone, wanted in ((found[0][2], found[0][3], 9), (found[0][4], found[0][5], 6)):
        assert shared[0] == alone[0] > 0
        assert alone[0] < wanted * 12  # (scored tokens only)
        for d in (1, 3):
            assert shared[1][d] == pytest.approx(alone[1][d], rel=1e-12)
            assert shared[2][d] == pytest.approx(alone[2][d], rel=1e-12)


def test_rl_ranks_make_their_own_rollouts_and_record_every_rank_s(per_rank_out):
    """`rdepth rl` under torchrun: every rank drew the same prompts and seeds (the work done twice, the tokens counted
    twice) and the step records held rank 0's rewards alone. Now rank r makes its share of the global batch (2
    prompts a rank: one process's 4) and the records hold every rank's (sums and means over the ranks)."""
    from tests.test_rl import rl_updates

    ranks = [torch.load(per_rank_out / f"rl-ranks-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    (records0, completions0, weights0, *cli0), (records1, completions1, weights1, *cli1) = ranks
    # the command's summary line: printed by rank 0 alone (each rank printed it)
    assert cli0[0] == cli1[0] == 0 and cli0[1].count("updates=1") == 1 and cli1[1] == ""
    assert (per_rank_out / "rl-cli" / "model" / "model.safetensors").is_file()
    assert torch.equal(weights0, weights1)  # (DDP: one update on both ranks)
    assert completions0[0] != completions1[0]
    alone_records, alone_completions, _ = rl_updates(4, updates=1)
    assert completions0[0] + completions1[0] == alone_completions[0]  # the first batch: the same start weights
    for key in ("reward_mean", "completion_tokens"):  # (every rank has 6 rollouts, all scored)
        assert records0[0][key] == records1[0][key] == pytest.approx(alone_records[0][key], rel=1e-12), key
    assert records0[0]["rollouts_left_out"] == records0[0]["reward_errors"] == 0
    for r0, r1 in zip(records0, records1, strict=True):
        for key in ("loss", "reward_mean", "mean_depth", "kl", "clip_fraction", "rollout_tokens_per_s"):
            assert r0[key] == r1[key], key


def test_ranks_with_unequal_answer_tokens_step_with_one_process_s_token_mean(per_rank_out):
    """Under DDP each rank took the mean over its own answer tokens and DDP averaged the ranks: a rank with fewer
    (here 7 against 14) weighed more per token. Now the step's gradient and loss are one process's token mean over
    all 8 rows (2 ranks x 2 micro-batches; transformers' `average_tokens_across_devices`)."""
    from tests.test_train_distributed import one_process_gradient

    (gradient0, loss0), (gradient1, loss1) = [
        torch.load(per_rank_out / f"token-mean-rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    wanted, wanted_loss = one_process_gradient(range(8))
    assert torch.equal(gradient0, gradient1) and loss0 == loss1
    torch.testing.assert_close(gradient0, wanted, rtol=1e-5, atol=1e-7)
    assert loss0 == pytest.approx(wanted_loss, rel=1e-6)


def test_reasoning_ranks_train_on_their_share_of_one_global_batch_with_one_curriculum(per_rank_out):
    """The reasoning recipe (`rdepth quickstart`) under torchrun drew the same problems on every rank, and each
    rank's curriculum learned from its own rows alone. Now rank r takes rows [3r, 3r + 3) of one process's global
    batch, and the curriculum (promotions, accuracy) is one process's over all of them, the same on every rank."""
    import types

    from recurrent_depth.evaluation.reasoning import train as recipe
    from tests.gloo_worker import fake_output

    ranks = [torch.load(per_rank_out / f"reasoning-ranks-rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    config = recipe.ReasoningRunConfig(task="chains", promote_at=0.5)
    curriculum = recipe.Curriculum(0, 6, True, promote_at=0.25, window=8)
    alone = recipe.ProblemStream(config, curriculum)
    for step in range(6):
        batch = alone.next_batch(6)
        right, wrong = fake_output(batch, right=True), fake_output(batch, right=False)
        mixed = types.SimpleNamespace(logits=torch.cat([right.logits[:3], wrong.logits[3:]]))
        seen = (alone.observe(batch, mixed), list(curriculum._hits))
        for rank, (batches, seens, *_) in enumerate(ranks):
            mine, rows = batches[step], slice(3 * rank, 3 * rank + 3)
            T = mine["input_ids"].shape[1]  # (a rank pads to its own longest row)
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(mine[key], batch[key][rows, :T]), (step, rank, key)
            assert (batch["labels"][rows, T:] == -100).all()
            assert seens[step] == seen, (step, rank)
    assert alone.promotions and ranks[0][2] == ranks[1][2] == alone.promotions
    # the recipe's `_train`: each rank its own rows, one curriculum, the same weights
    (*_, trained0, losses0, weights0, where0), (*_, trained1, losses1, weights1, where1) = ranks
    assert (where0, where1) == ((0, 2), (1, 2))
    assert len(trained0) == len(trained1) == 2 and losses0 == losses1 and torch.equal(weights0, weights1)
    assert not torch.equal(trained0[0]["input_ids"][:, :4], trained1[0]["input_ids"][:, :4])
