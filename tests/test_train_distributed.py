"""Two CPU processes (torchrun, gloo): locked-step depths and identical weights under DDP and FSDP2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.train_support import prepare_root

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_ranks_draw_the_same_depths_and_keep_identical_weights(tmp_path):
    root = prepare_root(tmp_path / "root")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "train_dist_worker.py"), str(root), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for mode in ("ddp", "fsdp"):
        a, b = ranks[0][mode], ranks[1][mode]
        assert (a["world_size"], b["world_size"], a["backend"]) == (2, 2, "gloo")
        assert len(a["steps"]) == 3
        assert [s["num_steps"] for s in a["steps"]] == [s["num_steps"] for s in b["steps"]]
        assert [s["weights"] for s in a["steps"]] == [s["weights"] for s in b["steps"]]
        assert len({s["weights"] for s in a["steps"]}) == 3  # the weights did change every step
        assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]  # all-reduced mean
        assert a["final_val"] == b["final_val"]
        assert len(a["resumed_loss"]) == 1 and a["resumed_loss"] == b["resumed_loss"]
    # DDP and FSDP2 compute the same thing: the same losses, also after resuming (weights + optimizer state).
    ddp, fsdp = ranks[0]["ddp"], ranks[0]["fsdp"]
    assert [s["loss"] for s in ddp["steps"]] == pytest.approx([s["loss"] for s in fsdp["steps"]], rel=1e-5)
    assert ddp["resumed_loss"] == pytest.approx(fsdp["resumed_loss"], rel=1e-5)
    # Each rank wrote its RNG state into the shared checkpoint.
    assert (out / "ddp" / "checkpoints" / "step-00000003" / "rng-rank1.safetensors").is_file()


def test_shutdown_frees_the_ddp_wrapper_before_the_process_group(tmp_path, monkeypatch):
    # DDP's C++ reducer holds the group: freed after destroy_process_group it ran gloo's destructor with the GIL
    # held, joining a worker thread that waited for the GIL (`rdepth train` on 2 ranks hung at exit now and then).
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from recurrent_depth.train import distributed as ddist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(2, 2)
        owner = type("Owner", (), {})()
        owner.wrapped = torch.nn.parallel.DistributedDataParallel(model)
        owner.wrapped(torch.ones(1, 2)).sum().backward()
        ddp = weakref.ref(owner.wrapped)
        alive_at_destroy = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group", lambda: (alive_at_destroy.append(ddp() is not None),
                                                                     destroy()))
        ddist.shutdown(ddist.DistEnv(world_size=2), owner)  # (world_size 2: the env of a torchrun rank)
        assert alive_at_destroy == [False] and owner.wrapped is model
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def test_trainer_run_and_close_free_the_ddp_wrapper_while_the_group_lives(tmp_path):
    # The Python API under torchrun: `trainer.run(); dist.destroy_process_group()` hung at exit now and then (the
    # trainer's DDP wrapper, freed after the group, joined gloo's threads with the GIL held). run() now ends holding
    # the model itself; close() (the end of `with Trainer(...)`) frees it too, and leaves a caller's group alone.
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from recurrent_depth import ModelConfig, RecurrentDepthLM
    from recurrent_depth.train.trainer import Trainer
    from tests.test_trainer_recipes import VOCAB, CountingBatches, short_config

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = RecurrentDepthLM(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, intermediate_size=64,
                                             prelude_layers=1, core_layers=1, coda_layers=1, mean_recurrence=2,
                                             mean_backprop_depth=1, max_seq_len=16))
        cfg = short_config(tmp_path, steps=1).replace(out=None, batch_size=2)
        trainer = Trainer(cfg, model=model, data=CountingBatches("targets"), log=lambda _: None)
        trainer.wrapped = torch.nn.parallel.DistributedDataParallel(trainer.model)  # what a torchrun rank holds
        ddp = weakref.ref(trainer.wrapped)
        assert trainer.run().steps == 1
        assert trainer.wrapped is trainer.model and ddp() is None
        with trainer:
            trainer.wrapped = torch.nn.parallel.DistributedDataParallel(trainer.model)
            ddp = weakref.ref(trainer.wrapped)
        assert trainer.wrapped is trainer.model and ddp() is None
        assert dist.is_initialized()  # a group the caller initialised is the caller's to destroy
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def test_rank_0_prepares_the_data_while_the_others_wait_long_and_hear_of_its_failure(tmp_path, monkeypatch):
    # Rank 1 waited for rank 0's tokenizer and shards in a plain barrier: the group's 30-minute timeout ended a long
    # preparation, and a failure on rank 0 left the others waiting out that timeout (outside torchrun) with no reason.
    from datetime import timedelta

    import torch.distributed as dist

    from recurrent_depth.train import distributed as ddist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        timeouts, sent = [], []
        new_group, broadcast = dist.new_group, dist.broadcast_object_list
        monkeypatch.setattr(dist, "new_group", lambda **kw: timeouts.append(kw["timeout"]) or new_group(**kw))
        monkeypatch.setattr(dist, "broadcast_object_list",
                            lambda box, src, group: sent.append(list(box)) or broadcast(box, src=src, group=group))
        rank0 = ddist.DistEnv(rank=0, world_size=2)  # (the env of a torchrun rank; this test's group has one)
        assert ddist.run_on_main(rank0, "prepare the token shards", lambda: "shards") == "shards"
        assert timeouts == [ddist.PREPARE_TIMEOUT] and ddist.PREPARE_TIMEOUT.total_seconds() >= 12 * 3600

        def fails():
            raise OSError("disk full\nwhile writing shard 3")

        with pytest.raises(OSError, match="disk full"):
            ddist.run_on_main(rank0, "prepare the token shards", fails)
        assert sent == [[None, None], ["OSError: disk full while writing shard 3", None]]  # told, in one line
        # another rank hears of it at once: one line naming the work (not a wait until the timeout)
        rank1 = ddist.DistEnv(rank=1, world_size=2)
        monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, group: box.__setitem__(
            slice(None), ["OSError: disk full while writing shard 3", None]))
        with pytest.raises(ValueError, match="^rank 0 failed to prepare the token shards: OSError: disk full while"):
            ddist.run_on_main(rank1, "prepare the token shards", lambda: "never run")
        # share=True: rank 0's result on the others (the prepared shards' key: no second pass over the corpus)
        monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, group: box.__setitem__(
            slice(None), [None, "rank 0's shards"]))
        assert ddist.run_on_main(rank1, "prepare", lambda: "never run", share=True) == "rank 0's shards"
        assert dist.is_initialized()  # (each wait's own group is gone; the default group stays)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_step_metrics_of_a_batch_source_are_summed_or_averaged_over_the_ranks(monkeypatch):
    # The step records held rank 0's metrics alone: `rdepth sft`'s scored_tokens on 2 ranks were half the step's
    # answer tokens, `rdepth rl`'s reward_mean one rank's rewards. (A fake all-reduce adds the other rank's values.)
    import torch
    import torch.distributed as dist

    from recurrent_depth.train import distributed as ddist
    from recurrent_depth.train.rl.rollouts import RolloutSource
    from recurrent_depth.train.sft import SFTBatches

    other = {"scored_tokens": 45, "reward_mean": 0.25, "mean_depth": None, "rollouts_left_out": 1}
    monkeypatch.setattr(dist, "all_reduce", lambda t: t.add_(torch.tensor(
        [[float(other[k]), 1.0] if other.get(k) is not None else [0.0, 0.0] for k in sent], dtype=torch.float64)))
    env = ddist.DistEnv(rank=0, world_size=2)
    sent = [*SFTBatches.summed_metrics, *SFTBatches.rank_mean_metrics]
    mine = {"scored_tokens": 54, "epoch": 0.5}
    assert ddist.reduce_metrics(mine, SFTBatches.summed_metrics, SFTBatches.rank_mean_metrics, env) == \
        {"scored_tokens": 99, "epoch": 0.5}
    sent = [*RolloutSource.summed_metrics, *RolloutSource.rank_mean_metrics]
    mine = {"reward_mean": 0.75, "mean_depth": 3.0, "rollouts_left_out": 0, "clip_fraction": None, "kl": 0.5}
    found = ddist.reduce_metrics(mine, RolloutSource.summed_metrics, RolloutSource.rank_mean_metrics, env)
    # (a None is left out of a mean; a key no rank reports stays as it is)
    assert found == {"reward_mean": 0.5, "mean_depth": 3.0, "rollouts_left_out": 1, "clip_fraction": None, "kl": 0.5}
    assert isinstance(found["rollouts_left_out"], int)
    assert ddist.reduce_metrics(mine, ("reward_mean",), (), ddist.DistEnv()) is mine  # one process: as it is


def test_distill_cache_only_says_where_the_cache_is_once_under_torchrun(monkeypatch, capsys, tmp_path):
    # `rdepth train --distill-cache-only` under torchrun printed "distill cache: DIR" once per rank
    from recurrent_depth.cli import main
    from recurrent_depth.train import distributed as ddist
    from recurrent_depth.train import trainer as trainer_module

    for rank, lines in ((0, 1), (1, 0)):
        class SetUp:  # the Trainer (whose setup writes the cache) as rank `rank` of 2 has it
            env = ddist.DistEnv(rank=rank, world_size=2)

            def __init__(self, cfg) -> None:
                pass

            def close(self) -> None:
                pass

        monkeypatch.setattr(trainer_module, "Trainer", SetUp)
        assert main(["train", "--teacher", str(tmp_path), "--distill-top-k", "4", "--distill-cache",
                     str(tmp_path / "cache"), "--distill-cache-only", "--out", str(tmp_path / "out"),
                     "--threads", "1"]) == 0
        assert capsys.readouterr().out.count("distill cache: ") == lines, rank


# The token mean of a masked objective (SFT's answer tokens): rows of 6 tokens, each scoring its last k.
TOKEN_MEAN_VOCAB = 11
SCORED_PER_ROW = (1, 1, 6, 6, 2, 5, 3, 6)


def masked_rows(rows: range) -> dict:
    """Rows `rows` of a fixed set: next-token targets, -100 before each row's last `SCORED_PER_ROW` tokens."""
    import torch

    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TOKEN_MEAN_VOCAB, (len(SCORED_PER_ROW), 7), generator=generator)[list(rows)]
    targets = tokens[:, 1:].clone()
    for i, row in enumerate(rows):
        targets[i, : 6 - SCORED_PER_ROW[row]] = -100
    return {"input_ids": tokens[:, :-1], "targets": targets}


def bigram_model():
    """A model with `logits` and no randomness: a table of next-token logits."""
    import types

    import torch

    class Bigram(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(TOKEN_MEAN_VOCAB, TOKEN_MEAN_VOCAB)

        def forward(self, input_ids):
            return types.SimpleNamespace(logits=self.table(input_ids))

    torch.manual_seed(0)
    return Bigram()


def trainer_step_gradient(micro_batches: list[dict]) -> tuple:
    """One Trainer step of `bigram_model` over `micro_batches` (this rank's, as `grad_accum`): the gradient the
    optimizer stepped with (after any DDP all-reduce) and the step's reported loss."""
    from recurrent_depth.train.batches import BatchSource
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer

    class Served(BatchSource):
        def __init__(self) -> None:
            self.left = iter(micro_batches)

        def next_batch(self, batch_size: int) -> dict:
            return next(self.left)

    model = bigram_model()
    optim = OptimConfig(name="adamw", lr=1e-3, weight_decay=0.0, warmup_steps=0, grad_clip=None)
    cfg = TrainConfig(batch_size=2, grad_accum=len(micro_batches), max_steps=1, optim=optim, out=None,
                      progress=False, tensorboard=False)
    trainer = Trainer(cfg, model=model, data=Served(), log=lambda _: None)
    stepped = []
    trainer.optimizer.step = lambda: stepped.append(model.table.weight.grad.clone())
    losses = trainer.run().losses
    return stepped[0], losses[0]


def one_process_gradient(rows: range) -> tuple:
    """The gradient and loss of the token mean over every scored token of `rows`, in one forward."""
    import torch.nn.functional as F

    model, batch = bigram_model(), masked_rows(rows)
    loss = F.cross_entropy(model(batch["input_ids"]).logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    return model.table.weight.grad, float(loss.detach())


def test_accumulated_micro_batches_weigh_every_scored_token_alike():
    """grad_accum averaged the micro-batches' own token means: a micro-batch of 2 answer tokens weighed as much as
    one of 12, so each of its tokens counted 6 times more than in one process. Now the step is the token mean of
    one process over both micro-batches (transformers' `num_items_in_batch`)."""
    import torch

    gradient, loss = trainer_step_gradient([masked_rows(range(0, 2)), masked_rows(range(2, 4))])
    wanted, wanted_loss = one_process_gradient(range(0, 4))
    torch.testing.assert_close(gradient, wanted, rtol=1e-5, atol=1e-7)
    assert loss == pytest.approx(wanted_loss, rel=1e-6)
    # a micro-batch that scores nothing adds nothing (its own mean is 0/0: the step was NaN and skipped)
    empty = masked_rows(range(0, 2))
    empty["targets"][:] = -100
    gradient, loss = trainer_step_gradient([masked_rows(range(2, 4)), empty])
    wanted, wanted_loss = one_process_gradient(range(2, 4))
    torch.testing.assert_close(gradient, wanted, rtol=1e-5, atol=1e-7)
    assert loss == pytest.approx(wanted_loss, rel=1e-6)
