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
