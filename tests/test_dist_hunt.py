"""Failures and equalities of the training path under several processes (2 CPU ranks, gloo, file store), found by a
hunt with torchrun: each test is the regression of one bug (the worker is tests/gloo_worker.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.test_gloo_ranks import run_ranks

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"),
]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One launch of the modes (process start-up dominates the time); peer-lost ends it."""
    return run_ranks(tmp_path_factory.mktemp("hunt"), "qk-warning+peer-lost")


def test_qk_clip_s_warning_is_said_once_not_by_every_rank(out):
    """`rdepth train --qk-clip` on a model with a shared QK-norm gain printed its warning once per rank (8 times on
    8 GPUs), where the other warnings of a run are said by rank 0 alone."""
    said = [torch.load(out / f"qk-warning-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    clip = "QK-clip with a QK-norm gain shared by the heads"
    assert [sum(clip in line for line in lines) for lines in said] == [1, 0]


def test_a_rank_that_fails_ends_the_others_with_one_line(out):
    """One rank's error (a bad data row, an out-of-range token, a missing --data on its node) ended it with its own
    line, and every other rank, waiting in a collective, with gloo's 30-line traceback ("Connection closed by peer
    ... GLHF!"). Now the others end with one line (an OSError: `rdepth train: error: ...`, exit 2) saying so."""
    from recurrent_depth.train.distributed import DistEnv, PeerLost, peer_lost

    failed = torch.load(out / "peer-lost-rank1.pt", weights_only=True)
    assert failed == ("ValueError", False, "a bad row on rank 1")  # (its own error, as it was)
    name, is_os_error, message = torch.load(out / "peer-lost-rank0.pt", weights_only=True)
    assert (name, is_os_error) == ("PeerLost", True)
    assert message.startswith("rank 0 stopped: another rank of this run failed") and "\n" not in message
    # only a failure of gloo's transport: any other error keeps its traceback, one process is never concerned
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
    assert isinstance(peer_lost(gloo, DistEnv(rank=1, world_size=2)), PeerLost)
    assert peer_lost(gloo, DistEnv()) is None
    assert peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), DistEnv(world_size=2)) is None


def test_cuda_without_an_index_is_each_rank_s_own_gpu_under_torchrun(monkeypatch):
    """`Trainer(cfg, device="cuda")` under torchrun set every rank's device to "cuda": GPU 0 for all of them (NCCL:
    "Duplicate GPU detected"), where device=None picks cuda:<local_rank>. (The group and the GPU are faked: this
    checks the choice only; one process keeps "cuda" as it was.)"""
    from recurrent_depth.train import distributed as ddist

    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = ddist.init_distributed("cuda")
    assert env.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
    assert (env.rank, env.local_rank, env.backend) == (3, 1, "nccl")
    assert ddist.init_distributed("cuda:0").device == torch.device("cuda", 0)  # (an index given is kept)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ddist.init_distributed("cuda").device == torch.device("cuda")
