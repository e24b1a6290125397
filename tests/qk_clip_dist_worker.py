"""Worker for tests/test_qk_stability.py: QK-clip under torchrun with 2 CPU processes (gloo).

Each rank runs the training forward on its half of a fixed batch, then QK-clip reduces the
per-head maxima over ranks (all_reduce MAX) and rescales; rank 0 saves the clipped weights.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.test_qk_stability import clipped_weights

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state, record = clipped_weights(rows=slice(rank, None, world), qk_norm=sys.argv[2] == "qk_norm")
    if rank == 0:
        torch.save({"state": state, "record": record}, Path(sys.argv[1]))
    dist.destroy_process_group()
