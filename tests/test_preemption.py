"""Preemption: SIGTERM / SIGUSR1 stop `rdepth train` after the step in progress, checkpointed, and the resume is
exact; under torchrun one rank's signal stops every rank after the same step. `save_pretrained` over an existing
model directory leaves the old model or the new one, whole, wherever a save is cut off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import recurrent_depth.checkpoint as checkpoint_module
from recurrent_depth.checkpoint import INDEX_NAME, WEIGHTS_NAME
from recurrent_depth.cli import main
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train.trainer import Trainer, TrainingInterrupted
from tests.train_support import VOCAB, prepare_root, tiny_train_config

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("train_root"))


def cli_flags(train_root, out, *extra):
    return ["train", "--preset", "tiny", "--data", str(train_root / "corpus"), "--tokenizer",
            str(train_root / "tokenizer"), "--data-dir", str(train_root / "data"), "--val-fraction", "0.1",
            "--vocab-size", str(VOCAB), "--keep-all", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
            "--eval-depths", "1", "--save-every", "2", "--no-tensorboard", "--no-progress", "--threads", "1",
            "--out", str(out), *extra]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# A `rdepth train` whose step 3 waits, once done, until the test has sent its signal: the signal then lands at a
# known step (the handler runs before the wait sees the test's mark), as a scheduler's would land at any.
CHILD = """
import sys, time
from pathlib import Path
from recurrent_depth.cli import main
from recurrent_depth.train.trainer import Trainer

mark, sent, flags = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
original = Trainer.train_step

def step_then_wait(self):
    record = original(self)
    if record["step"] == 3:
        mark.touch()
        end = time.monotonic() + 60
        while not sent.exists() and time.monotonic() < end:
            time.sleep(0.01)
    return record

Trainer.train_step = step_then_wait
sys.exit(main(flags))
"""


def test_sigterm_checkpoints_the_finished_step_exits_143_and_the_resume_is_bit_exact(train_root, tmp_path):
    straight = tmp_path / "straight"
    assert main(cli_flags(train_root, straight, "--max-steps", "5")) == 0  # (also packs the shards the child reads)
    out, mark, sent = tmp_path / "run", tmp_path / "step-3-done", tmp_path / "sent"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), str(sent), *cli_flags(train_root, out,
                              "--max-steps", "5")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not mark.exists() and child.poll() is None and time.monotonic() < end:
            time.sleep(0.01)
        assert mark.exists(), child.communicate()[1][-3000:]
        child.send_signal(signal.SIGTERM)  # as SLURM's preemption (and torchrun passing it on) sends
        sent.touch()
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 128 + signal.SIGTERM, err[-3000:]
    step_3 = out / "checkpoints" / "step-00000003"
    assert err.splitlines()[-1] == (f"rdepth train: interrupted: SIGTERM (preempted): stopped after step 3; "
                                    f"checkpoint {step_3} is saved: continue with --resume")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    assert len(losses(out)) == 3 and not (out / "model").exists()
    assert main(cli_flags(train_root, out, "--max-steps", "5", "--resume")) == 0
    assert losses(out) == losses(straight)
    mine, theirs = load_file(out / "model" / WEIGHTS_NAME), load_file(straight / "model" / WEIGHTS_NAME)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_sigusr1_and_a_repeated_sigterm_stop_after_the_step_and_the_handlers_come_back(train_root, tmp_path):
    def signal_at_2(trainer, record):
        if record["step"] == 2:
            signal.raise_signal(signal.SIGUSR1)  # SLURM's --signal=USR1@... notice
            signal.raise_signal(signal.SIGTERM)  # then SIGTERM, twice (SLURM's and torchrun's): no kill at once
            signal.raise_signal(signal.SIGTERM)

    def previous_sigterm(signum, frame):  # an embedding program's own handler
        raise AssertionError("the trainer's handler should have had SIGTERM")

    before = signal.signal(signal.SIGTERM, previous_sigterm)
    usr1 = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # (taken only while nobody else handles it)
    try:
        with pytest.raises(TrainingInterrupted, match=r"^SIGUSR1 \(preempted\): stopped after step 2; ") as caught:
            Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, save_every=3, eval_depths=[1]),
                    on_step=signal_at_2).run()
        assert caught.value.exit_status == 128 + signal.SIGUSR1
        assert signal.getsignal(signal.SIGTERM) is previous_sigterm
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGUSR1, usr1)
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir() and len(losses(tmp_path)) == 2


AGREE = """
import signal, sys
from datetime import timedelta
import torch.distributed as dist
from recurrent_depth.train.distributed import DistEnv
from recurrent_depth.train.trainer import _InterruptRequest

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
env = DistEnv(rank=rank, world_size=2, backend="gloo")
request = _InterruptRequest()
seen = [request.agreed(env)]
if rank == 1:
    request.signum = int(signal.SIGTERM)  # what the handler records: only rank 1 was signalled
seen.append(request.agreed(env))
print(seen)
dist.destroy_process_group()
"""


@pytest.mark.slow  # (two processes importing torch)
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'src'}"}
    ranks = [subprocess.Popen([sys.executable, "-c", AGREE, str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.communicate()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out in outputs] == [f"[0, {int(signal.SIGTERM)}]"] * 2


# ------------------------------------------------------------------ save_pretrained over an existing model
def seeded_model(tiny_config, seed):
    torch.manual_seed(seed)
    return RecurrentDepthLM(tiny_config).eval()


def weights_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model, weights):
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


LAYOUTS = {"single": None, "sharded": 64_000}


@pytest.mark.parametrize(("old", "new"), [("single", "single"), ("sharded", "sharded"), ("sharded", "single"),
                                          ("single", "sharded")])
def test_a_save_cut_off_after_its_first_file_leaves_the_old_model_whole(tiny_config, tmp_path, monkeypatch, old, new):
    seeded_model(tiny_config, 0).save_pretrained(tmp_path, max_shard_bytes=LAYOUTS[old])
    before = weights_of(RecurrentDepthLM.from_pretrained(tmp_path))
    files_before = sorted(p.name for p in tmp_path.iterdir())
    written = []
    real_save_file = checkpoint_module.save_file

    def write_one_then_die(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        written.append(filename)
        raise KeyboardInterrupt  # (Ctrl-C, or a kill's moment: the first new weight file is whole, nothing more)

    monkeypatch.setattr(checkpoint_module, "save_file", write_one_then_die)
    with pytest.raises(KeyboardInterrupt):
        seeded_model(tiny_config, 1).save_pretrained(tmp_path, max_shard_bytes=LAYOUTS[new])
    assert len(written) == 1
    assert same(RecurrentDepthLM.from_pretrained(tmp_path), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before  # (its temporary file is removed too)


@pytest.mark.parametrize(("old", "new"), [("sharded", "single"), ("single", "sharded")])
def test_a_save_cut_off_after_its_renames_loads_the_new_model_and_a_whole_save_leaves_no_stale_file(
        tiny_config, tmp_path, monkeypatch, old, new):
    seeded_model(tiny_config, 0).save_pretrained(tmp_path, max_shard_bytes=LAYOUTS[old])
    newer = seeded_model(tiny_config, 1)
    after = weights_of(newer)
    with monkeypatch.context() as patch:  # killed after the renames, before the old files are removed
        patch.setattr(checkpoint_module, "fsync_dir", lambda path: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            newer.save_pretrained(tmp_path, max_shard_bytes=LAYOUTS[new])
    assert same(RecurrentDepthLM.from_pretrained(tmp_path), after)  # the old files left behind are not what loads
    (tmp_path / "model-00001-of-00009.safetensors.tmp").write_bytes(b"a killed save's")
    newer.save_pretrained(tmp_path, max_shard_bytes=LAYOUTS[new])
    weights = sorted(p.name for p in tmp_path.iterdir() if "safetensors" in p.name)
    if new == "single":
        assert weights == [WEIGHTS_NAME]
    else:
        assert weights == sorted({*json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"].values(),
                                  INDEX_NAME})
    assert same(RecurrentDepthLM.from_pretrained(tmp_path), after)
