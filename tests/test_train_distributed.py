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
