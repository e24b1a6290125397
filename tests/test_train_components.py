"""Pieces of the trainer: collapse monitor, state flattening, atomic checkpoint directories, depth evaluation."""

import os
import platform
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train.monitor import token_correlation, token_correlation_reference
from recurrent_depth.train.optim import OptimConfig, build_optimizers
from recurrent_depth.train.validation import depth_losses, validation_loss_by_depth
from tests.train_support import OneThread


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


@pytest.mark.parametrize("B, T, h", [(1, 2, 3), (3, 17, 60), (2, 33, 7)], ids=["B1-T2-h3", "B3-T17-h60", "B2-T33-h7"])
def test_token_correlation_matches_the_quadratic_definition(B, T, h):
    torch.manual_seed(0)
    hidden = torch.randn(B, T, h) + 0.3  # a shared offset makes the correlation clearly nonzero
    torch.testing.assert_close(token_correlation(hidden), token_correlation_reference(hidden), rtol=1e-5, atol=1e-6)


def test_token_correlation_extremes_and_mask():
    same = torch.randn(1, 1, 16).expand(2, 9, 16)
    torch.testing.assert_close(token_correlation(same), torch.ones(2))
    hidden = torch.randn(1, 12, 8)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, :5] = True
    torch.testing.assert_close(token_correlation(hidden, mask), token_correlation_reference(hidden[:, :5]))
    assert torch.isnan(token_correlation(torch.randn(1, 1, 8))).all()
    with pytest.raises(ValueError, match="shape"):
        token_correlation(torch.randn(8))


def _stepped_optimizer(name: str):
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    opt = build_optimizers(model, OptimConfig(name=name, lr=1e-3))
    out = model(torch.randint(0, 256, (2, 9)), num_steps=2)
    out.logits.square().mean().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("name", ["adamw", "ellis-adam", "muon"])
def test_optimizer_state_round_trips_exactly_through_safetensors_and_json(tmp_path, name):
    model, opt = _stepped_optimizer(name)
    ckpt.save_state_files(tmp_path, "optimizer", opt.state_dict())
    restored = ckpt.load_state_files(tmp_path, "optimizer")
    _, fresh = _stepped_optimizer(name)
    fresh.load_state_dict(restored)
    before, after = opt.state_dict(), fresh.state_dict()
    for a, b in zip(before["optimizers"], after["optimizers"]):
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            for field, value in a["state"][key].items():
                assert torch.equal(value, b["state"][key][field]) if torch.is_tensor(value) else value == b[
                    "state"][key][field]


def test_flatten_state_rejects_objects_it_cannot_store_without_pickle():
    with pytest.raises(ValueError, match="no pickling"):
        ckpt.flatten_state({"x": object()})


def _fake_checkpoint(root, step):
    tmp = ckpt.begin_checkpoint(root, step)
    for name in ckpt.REQUIRED_FILES:
        (tmp / name).write_text("{}")
    return tmp


def test_checkpoint_directories_appear_whole_and_prune(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        ckpt.commit_checkpoint(_fake_checkpoint(root, step), step, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [10, 15]
    # A save interrupted before its rename leaves only a hidden temporary directory: never listed.
    _fake_checkpoint(root, 20)
    (root / "step-00000025").mkdir()  # and a directory missing files is not a checkpoint either
    assert ckpt.latest_checkpoint(root).name == "step-00000015"
    assert not any(p.name.startswith(".trash") for p in root.iterdir())
    with monkeypatch.context() as patched:  # a valid checkpoint at that step is never overwritten
        patched.setattr(ckpt, "checkpoint_problem", lambda path: None)
        with pytest.raises(ValueError, match="already exists"):
            ckpt.commit_checkpoint(_fake_checkpoint(root, 15), 15)
    # these fake files hold no real state, so the one at step 15 is invalid: set aside, not overwritten
    ckpt.commit_checkpoint(_fake_checkpoint(root, 15), 15)
    assert any("invalid" in p.name for p in root.iterdir())


def test_a_save_removes_what_a_crashed_save_or_prune_left(tmp_path):
    """A kill during a save (any step) or a prune leaves hidden directories that would stay forever."""
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 20)  # killed before its rename
    (root / ".trash-step-00000005").mkdir()  # killed while deleting an old checkpoint
    (root / ".trash-step-00000005" / "model.safetensors").write_text("half deleted")
    (root / "notes").mkdir()  # not ours: kept
    ckpt.commit_checkpoint(_fake_checkpoint(root, 30), 30, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step-00000030"]


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(123)
    ckpt.write_tensors(tmp_path / "rng.safetensors", ckpt.rng_state_tensors())
    expected = torch.rand(4)
    torch.manual_seed(999)
    ckpt.restore_rng_state(ckpt.read_tensors(tmp_path / "rng.safetensors"))
    assert torch.equal(torch.rand(4), expected)
    assert os.path.getsize(tmp_path / "rng.safetensors") > 0


@pytest.mark.parametrize("depths", [[0, 1, 3], [2, 5]], ids=["with-zero", "odd"])
def test_one_pass_depth_losses_equal_separate_forwards(depths):
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    rows = torch.randint(0, 256, (3, 18))
    losses, corr = depth_losses(model, rows, depths, torch.Generator().manual_seed(7))
    for d in depths:
        out = model(rows[:, :-1], num_steps=d, generator=torch.Generator().manual_seed(7))
        expected = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        torch.testing.assert_close(losses[d], expected, rtol=0, atol=0)
        torch.testing.assert_close(corr[d], token_correlation(out.final_state).sum(), rtol=0, atol=0)


class _Rows:
    """The part of ShardDataset that validation_loss_by_depth uses: len() and iter_batches()."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def iter_batches(self, batch_size, drop_last=False):
        for start in range(0, len(self.rows) - batch_size + 1, batch_size):
            yield self.rows[start : start + batch_size]


def test_validation_loss_by_depth_budget_and_deadline():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    data = _Rows(torch.randint(0, 256, (12, 17)))
    full = validation_loss_by_depth(model, data, [1, 3], batch_size=4, max_batches=10)
    assert full.tokens == 12 * 16 and set(full.loss) == {1, 3}
    rushed = validation_loss_by_depth(model, data, [1, 3], batch_size=4, max_batches=10,
                                      deadline=time.perf_counter() - 1)
    assert rushed.tokens == 4 * 16  # a deadline in the past still evaluates one batch
    first = validation_loss_by_depth(model, data, [1, 3], batch_size=4, max_batches=1)
    assert rushed.loss == first.loss
    assert model.training is False


class _StoredRows:
    """len(), iter_batches() and rows(indices) by storage index."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def rows(self, indices):
        return self.data[list(indices)]

    def iter_batches(self, batch_size, drop_last=False):
        for start in range(0, len(self.data) - batch_size + 1, batch_size):
            yield self.data[start : start + batch_size]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-pass", "forward-per-depth"])
def test_validation_loss_does_not_depend_on_how_the_rows_are_batched(sharded):
    """One s0 draw per batch gave the same 8 rows (same model, same seed) a different loss at batch size 2, 4, 8."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    data = _StoredRows(torch.randint(0, 256, (8, 17)))
    runs = [validation_loss_by_depth(model, data, [1, 4], batch_size=size, max_batches=8 // size, seed=3,
                                     sharded=sharded) for size in (2, 4, 8)]
    for run in runs[1:]:
        for d in (1, 4):
            assert run.loss[d] == pytest.approx(runs[0].loss[d], rel=1e-6, abs=0)
            assert run.token_correlation[d] == pytest.approx(runs[0].token_correlation[d], rel=1e-5, abs=1e-7)
    other = validation_loss_by_depth(model, data, [1], batch_size=4, max_batches=2, seed=4, sharded=sharded)
    assert other.loss[1] != pytest.approx(runs[0].loss[1], rel=1e-6, abs=0)  # the seed still draws the starts


def test_validation_loss_by_depth_repeated_and_bad_depths():
    """A repeated depth is evaluated once (its losses were summed twice: double the loss)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    data = _Rows(torch.randint(0, 256, (4, 17)))
    once = validation_loss_by_depth(model, data, [1, 3], batch_size=2, max_batches=2)
    twice = validation_loss_by_depth(model, data, [3, 1, 3], batch_size=2, max_batches=2)
    assert twice.loss == once.loss and twice.token_correlation == once.token_correlation
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ValueError, match="depths"):
            validation_loss_by_depth(model, data, bad, batch_size=2, max_batches=1)


KEEP_FREED_MEMORY_PROBE = """
import resource, sys, torch
from recurrent_depth.accel.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() is True
def faults_of_one_allocation():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 << 20).fill_(1.0)  # 64 MiB written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_allocation()
print(min(faults_of_one_allocation() for _ in range(3)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_stops_page_faults_of_reallocated_tensors():
    """64 MiB freed and allocated again: 16k page faults (4 KiB pages) each time by default, about none once kept."""
    import subprocess
    import sys

    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", KEEP_FREED_MEMORY_PROBE, mode], capture_output=True, text=True,
                             check=True)
        return int(run.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default >= 32  # 16384 with 4 KiB pages, 32 with transparent huge pages
    assert kept * 10 < default
