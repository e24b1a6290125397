"""Worker for tests/test_train_distributed.py, launched by torchrun with 2 CPU processes (gloo).

Trains the tiny preset with DDP and then with FSDP2 and writes, per rank, the depth drawn at
every micro-batch and a hash of the full (unsharded) weights after every optimizer step; then
resumes each run from its step-3 checkpoint for one more step.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

from recurrent_depth.train.trainer import Trainer
from tests.train_support import tiny_train_config


def weights_hash(trainer) -> str:
    if trainer.cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.wrapped, options=StateDictOptions(full_state_dict=True))
    else:
        state = trainer.model.state_dict()
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(root: Path, out: Path) -> None:
    torch.set_num_threads(1)
    report = {}
    for mode in ("ddp", "fsdp"):
        records = []
        cfg = tiny_train_config(root, out / mode, max_steps=3, grad_accum=2, batch_size=2, fsdp=mode == "fsdp",
                                save_every=3)
        trainer = Trainer(cfg, on_step=lambda t, rec, records=records: records.append(
            {"num_steps": rec["num_steps"], "loss": rec["loss"], "weights": weights_hash(t)}))
        result = trainer.run()
        resumed = []
        cfg = cfg.replace(max_steps=4, resume=True)
        Trainer(cfg, on_step=lambda t, rec, resumed=resumed: resumed.append(rec["loss"])).run()
        report[mode] = {"rank": trainer.env.rank, "world_size": trainer.env.world_size, "steps": records,
                        "final_val": {str(k): v for k, v in result.final_eval.loss.items()},
                        "backend": trainer.env.backend, "resumed_loss": resumed}
    (out / f"rank{trainer.env.rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
