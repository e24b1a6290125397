"""Training runs against broken checkpoints, full disks, crashes at the end, Ctrl-C, NaN and skipped steps
(issue 19, items 10-13). Full disks are simulated (shutil.disk_usage / a writer raising ENOSPC)."""

import errno
import json
import math
import os
import shutil
import signal
import types

import pytest
from safetensors import SafetensorError

from recurrent_depth.cli import main
from recurrent_depth.train import checkpointing as ckpt
from recurrent_depth.train import trainer as trainer_module
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.trainer import TooManySkippedSteps, Trainer, TrainingInterrupted
from tests.train_support import prepare_root, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread for the module


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("train_root"))


@pytest.fixture(scope="module")
def straight_losses(train_root, tmp_path_factory):
    """Losses of an uninterrupted 6-step run (save_every 2) to compare resumed runs with."""
    out = tmp_path_factory.mktemp("straight")
    return Trainer(tiny_train_config(train_root, out, max_steps=6, save_every=2)).run().losses


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def names(root):
    return sorted(p.name for p in root.iterdir())


def cli_flags(train_root, out, *extra):
    return ["train", "--preset", "tiny", "--data", str(train_root / "corpus"), "--tokenizer",
            str(train_root / "tokenizer"), "--data-dir", str(train_root / "data"), "--val-fraction", "0.1",
            "--keep-all", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--eval-depths", "1",
            "--no-tensorboard", "--no-progress", "--threads", "1", "--out", str(out), *extra]


def error_lines(capsys):
    """What `rdepth train` said on stderr, less the line naming its thread count."""
    return [line for line in capsys.readouterr().err.splitlines() if not line.startswith("rdepth train: using ")]


# ------------------------------------------------------------------ 10: broken newest checkpoint
def _run_to_4(train_root, out):
    Trainer(tiny_train_config(train_root, out, max_steps=4, save_every=2)).run()
    return out / "checkpoints"


def _remove_optimizer_json(path):
    (path / "optimizer.json").unlink()


def _flip_a_weight_byte(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF  # inside the tensor data: the file stays complete and parses
    (path / "model.safetensors").write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "reason"), [
    (_remove_optimizer_json, "missing optimizer.json"),
    (_flip_a_weight_byte, "model.safetensors does not match its sha256 in manifest.json"),
], ids=["missing-file", "corrupt-weights"])
def test_resume_falls_back_to_the_newest_valid_checkpoint_says_so_and_saves_that_step_again(
        train_root, tmp_path, straight_losses, damage, reason):
    root = _run_to_4(train_root, tmp_path)
    damage(root / "step-00000004")
    messages = []
    result = Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, save_every=2, resume=True),
                     log=messages.append).run()
    skip = [m for m in messages if m.startswith("skipping checkpoint")]
    assert skip == [f"skipping checkpoint {root / 'step-00000004'}: {reason}; moved it to "
                    f"step-00000004.invalid-1, resuming from step-00000002"]
    assert result.steps == 6 and losses(tmp_path) == straight_losses  # steps 3-6 redone exactly
    assert names(root) == ["step-00000002", "step-00000004", "step-00000004.invalid-1", "step-00000006"]
    # the set-aside copy is the user's data: kept as it was
    assert (root / "step-00000004.invalid-1" / "model.safetensors").is_file()


def test_a_checkpoint_without_a_manifest_is_set_aside_and_resume_falls_back(train_root, tmp_path, straight_losses):
    # Issue 33 item 18: deleting the manifest and flipping a data byte used to resume silently from it.
    root = _run_to_4(train_root, tmp_path)
    (root / "step-00000004" / "manifest.json").unlink()
    _flip_a_weight_byte(root / "step-00000004")
    assert ckpt.checkpoint_problem(root / "step-00000004").startswith("no manifest.json (its data cannot be checked")
    messages = []
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, save_every=2, resume=True),
            log=messages.append).run()
    assert f"resumed from {root / 'step-00000002'} at step 2" in messages
    assert losses(tmp_path) == straight_losses  # steps 3-6 from the valid step 2, not from the corrupt data

    weights = root / "step-00000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "model.safetensors has" in ckpt.checkpoint_problem(weights.parent)  # (its size in the manifest)


def _rewrite(path, name, edit):
    """Edit one file of a checkpoint and write a manifest that matches: what a forger would do."""
    edit(path / name)
    (path / "manifest.json").unlink()
    ckpt.write_manifest(path)


def _json_edit(**changes):
    def edit(file):
        state = json.loads(file.read_text())
        for key, value in changes.items():
            target = state
            *parents, last = key.split(".")
            for parent in parents:
                target = target[parent]
            target[last] = value
        file.write_text(json.dumps(state))
    return edit


def _rng_holding_only_torch(file):
    from safetensors.torch import save_file
    save_file({"torch": __import__("torch").get_rng_state()}, str(file))


@pytest.mark.parametrize(("name", "edit", "reason"), [
    ("trainer_state.json", _json_edit(step=10**12), "trainer_state.json says step 1000000000000, the directory is "
                                                    "step 4"),
    ("trainer_state.json", _json_edit(tokens=-5), "trainer_state.json: tokens must be a non-negative integer"),
    ("trainer_state.json", _json_edit(**{"data.position": 10**9}), "trainer_state.json: data.position 1000000000 is "
                                                                  "past the"),
    ("rng.safetensors", _rng_holding_only_torch, "rng.safetensors does not hold a CPU RNG state"),
    ("trainer_state.json", _json_edit(tokens_per_step=0), "trainer_state.json: tokens_per_step must be an integer"),
], ids=["forged-step", "negative-tokens", "data-position", "rng-without-torch_cpu", "tokens-per-step"])
def test_a_checkpoint_whose_files_contradict_each_other_is_invalid_even_with_a_matching_manifest(
        train_root, tmp_path, name, edit, reason):
    root = _run_to_4(train_root, tmp_path)
    _rewrite(root / "step-00000004", name, edit)
    assert ckpt.checkpoint_problem(root / "step-00000004").startswith(reason)
    assert ckpt.newest_valid_checkpoint(root)[0] == root / "step-00000002"


def _reshape_a_weight(file):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(file))
    key = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _reshape_a_moment(file):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(file))
    key = next(k for k, v in tensors.items() if v.dim() == 2)
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(file))


@pytest.mark.parametrize(("name", "edit", "reason"), [
    ("model.safetensors", _reshape_a_weight, "model.safetensors: "),
    ("optimizer.safetensors", _reshape_a_moment, "optimizer.safetensors: optimizer 0: "),
], ids=["weight-shape", "moment-shape"])
def test_a_checkpoint_that_does_not_load_into_the_model_is_set_aside_and_resume_falls_back(
        train_root, tmp_path, straight_losses, name, edit, reason):
    root = _run_to_4(train_root, tmp_path)
    _rewrite(root / "step-00000004", name, edit)
    assert ckpt.checkpoint_problem(root / "step-00000004") is None  # (headers and counters are consistent)
    messages = []
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, save_every=2, resume=True),
            log=messages.append).run()
    skip = [m for m in messages if m.startswith("skipping checkpoint")]
    assert len(skip) == 1 and f"{root / 'step-00000004'}: {reason}" in skip[0]
    assert skip[0].endswith("moved it to step-00000004.invalid-1, resuming from step-00000002")
    assert losses(tmp_path) == straight_losses


def test_unreadable_weights_make_a_checkpoint_invalid(train_root, tmp_path, monkeypatch):
    root = _run_to_4(train_root, tmp_path)
    original = ckpt.file_sha256

    def unreadable(path):
        if path.name == "model.safetensors" and path.parent.name == "step-00000004":
            raise PermissionError(13, "Permission denied", str(path))
        return original(path)

    monkeypatch.setattr(ckpt, "file_sha256", unreadable)
    found, [(skipped, problem)] = ckpt.newest_valid_checkpoint(root)
    assert found == root / "step-00000002" and skipped == root / "step-00000004"
    assert problem == f"[Errno 13] Permission denied: '{skipped / 'model.safetensors'}'"


def test_no_valid_checkpoint_left_starts_from_scratch_and_keeps_the_broken_one(train_root, tmp_path):
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, save_every=2)).run()
    root = tmp_path / "checkpoints"
    (root / "step-00000002" / "trainer_state.json").write_text("{not json")
    messages = []
    assert Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, resume=True),
                   log=messages.append).run().steps == 2
    assert any(m.startswith("skipping checkpoint") and "no valid checkpoint is left" in m for m in messages)
    assert names(root) == ["step-00000002", "step-00000002.invalid-1"]


def test_committing_over_an_invalid_checkpoint_sets_it_aside_but_a_valid_one_is_never_overwritten(train_root,
                                                                                                  tmp_path):
    root = _run_to_4(train_root, tmp_path)
    _remove_optimizer_json(root / "step-00000004")
    tmp = ckpt.begin_checkpoint(root, 4)
    for entry in (root / "step-00000002").iterdir():
        if entry.name != "manifest.json":
            shutil.copyfile(entry, tmp / entry.name)
    _json_edit(step=4)(tmp / "trainer_state.json")  # (a step-4 checkpoint says step 4)
    messages = []
    ckpt.commit_checkpoint(tmp, 4, log=messages.append)
    assert names(root) == ["step-00000002", "step-00000004", "step-00000004.invalid-1"]
    assert "moved it to step-00000004.invalid-1" in messages[0]
    assert ckpt.checkpoint_problem(root / "step-00000004") is None
    tmp = ckpt.begin_checkpoint(root, 4)
    (tmp / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already exists; refusing to overwrite it"):
        ckpt.commit_checkpoint(tmp, 4)


# ------------------------------------------------------------------ 11: full disk
def fake_disk(monkeypatch, free_bytes):
    """shutil.disk_usage reporting `free_bytes()` free (a callable: it may depend on what is on disk)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=free_bytes()))


def du(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_save_without_free_space_is_one_clean_error_and_leaves_no_temporary(train_root, tmp_path, monkeypatch,
                                                                              capsys):
    fake_disk(monkeypatch, lambda: 1000)
    out = tmp_path / "run"
    assert main(cli_flags(train_root, out, "--max-steps", "2", "--save-every", "1")) == 2
    [err] = error_lines(capsys)
    assert err.startswith(f"rdepth train: error: not enough disk space to write checkpoint "
                          f"{out / 'checkpoints' / 'step-00000001'}: it needs about ")
    assert err.endswith(f"0.0 MB free in {out / 'checkpoints'}")
    assert names(out / "checkpoints") == [] and not (out / "model").exists()


@pytest.mark.parametrize("raised", [
    OSError(errno.ENOSPC, "No space left on device"),
    SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                    'left on device" })'),
], ids=["oserror", "safetensors"])
def test_a_writer_hitting_a_full_disk_cleans_up_and_names_the_checkpoint(train_root, tmp_path, monkeypatch, raised):
    import recurrent_depth.checkpoint as model_checkpoint

    def full(*args, **kwargs):
        raise raised

    monkeypatch.setattr(model_checkpoint, "save_file", full)  # the weights' writer
    with pytest.raises(ckpt.CheckpointWriteError, match=r"could not write checkpoint \S+step-00000002: .*No "
                                                         r"space left on device") as info:
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, save_every=2)).run()
    assert "\n" not in str(info.value)
    assert names(tmp_path / "checkpoints") == []


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_resume_on_a_full_disk_prunes_before_it_saves(train_root, tmp_path, monkeypatch, keep_last):
    """Three checkpoints fill the disk; a resume with a smaller --keep-last prunes first. keep_last counts the
    checkpoint about to be written: with keep_last 2 the space is only there once the oldest kept one goes."""
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=3, save_every=1)).run()
    root = tmp_path / "checkpoints"
    one = du(root / "step-00000003")
    capacity = du(root) + ckpt._SPACE_MARGIN + (one // 2 if keep_last == 1 else -one // 2)
    fake_disk(monkeypatch, lambda: capacity - du(root))
    messages = []
    result = Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, save_every=1, resume=True,
                                       keep_last=keep_last), log=messages.append).run()
    assert result.steps == 4
    assert names(root) == ["step-00000003", "step-00000004"][-keep_last:]
    low = [m for m in messages if m.startswith("low disk space")]
    assert len(low) == (keep_last == 2) and all("keep_last=2 counts the new checkpoint" in m for m in low)


def test_when_pruning_cannot_make_room_nothing_beyond_keep_last_is_deleted(train_root, tmp_path, monkeypatch):
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, save_every=1)).run()
    fake_disk(monkeypatch, lambda: 10)
    with pytest.raises(ckpt.CheckpointWriteError, match="not enough disk space"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=3, save_every=1, resume=True)).run()
    assert names(tmp_path / "checkpoints") == ["step-00000001", "step-00000002"]


def test_a_failed_model_save_never_leaves_model_empty(train_root, tmp_path, monkeypatch):
    import recurrent_depth.checkpoint as model_checkpoint

    original = model_checkpoint.save_file

    def full_in_model_dir(state, path, *args, **kwargs):
        if ".model.tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(state, path, *args, **kwargs)

    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2)).run()
    before = (tmp_path / "model" / "model.safetensors").read_bytes()
    monkeypatch.setattr(model_checkpoint, "save_file", full_in_model_dir)
    with pytest.raises(ckpt.CheckpointWriteError, match=rf"could not write the model directory {tmp_path / 'model'}"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=3, resume=True)).run()
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == before  # the earlier model is intact
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model")]
    assert names(tmp_path / "checkpoints") == ["step-00000002", "step-00000003"]  # saved before the model

    fresh = tmp_path / "fresh"
    with pytest.raises(ckpt.CheckpointWriteError):
        Trainer(tiny_train_config(train_root, fresh, max_steps=1)).run()
    assert not (fresh / "model").exists()


def test_the_model_copies_a_killed_run_left_are_removed_by_the_resume(train_root, tmp_path):
    """kill -9 while `model/` was written left `.model.tmp-<pid>` (a whole copy of the weights) beside it for
    good: the resume wrote `model/` under its own pid and never looked at the dead process's."""
    import subprocess
    import sys

    Trainer(tiny_train_config(train_root, tmp_path, max_steps=1)).run()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getppid()  # (the first process is gone, the second alive)
    for name in (f".model.tmp-{dead_pid}", f".model.old-{dead_pid}", f".model.tmp-{live_pid}"):
        shutil.copytree(tmp_path / "model", tmp_path / name)
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, resume=True)).run()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model")] == [f".model.tmp-{live_pid}"]


def test_pruning_a_symlinked_checkpoint_removes_the_link_and_keeps_its_target(tmp_path):
    """A checkpoint moved to another disk and symlinked back made the prune's rmtree raise after the new checkpoint
    was published ("could not write checkpoint"), and the `.trash-` link it left failed every later save."""
    root, moved = tmp_path / "checkpoints", tmp_path / "elsewhere" / "step-00000001"
    for path in (moved, root / "step-00000002", root / "step-00000003"):
        path.mkdir(parents=True)
        for name in ckpt.REQUIRED_FILES:
            (path / name).write_text("{}")
    (root / "step-00000001").symlink_to(moved, target_is_directory=True)
    (root / ".trash-step-00000000").symlink_to(moved, target_is_directory=True)  # (what the failed prune left)
    ckpt.begin_checkpoint(root, 4).rmdir()
    ckpt.prune_checkpoints(root, 2)
    assert names(root) == ["step-00000002", "step-00000003"]
    assert names(moved) == sorted(ckpt.REQUIRED_FILES)  # the run deleted only its link

    (tmp_path / "model").symlink_to(moved, target_is_directory=True)  # a symlinked model/ is replaced the same way
    (tmp_path / ".model.tmp").mkdir()
    ckpt.publish_directory(tmp_path / ".model.tmp", tmp_path / "model")
    assert not (tmp_path / "model").is_symlink() and names(moved) == sorted(ckpt.REQUIRED_FILES)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model")]


# ------------------------------------------------------------------ 12: crash at the end, Ctrl-C
def test_a_crash_in_the_final_evaluation_keeps_the_run(train_root, tmp_path, monkeypatch):
    original = Trainer.evaluate

    def crashing(self, final=False):
        if final:
            raise RuntimeError("evaluation crashed")
        return original(self, final)

    monkeypatch.setattr(Trainer, "evaluate", crashing)
    with pytest.raises(RuntimeError, match="evaluation crashed"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=3)).run()  # save_every 0: only the final save
    assert names(tmp_path / "checkpoints") == ["step-00000003"] and (tmp_path / "model" / "config.json").is_file()
    monkeypatch.setattr(Trainer, "evaluate", original)
    again = Trainer(tiny_train_config(train_root, tmp_path, max_steps=3, resume=True)).run()
    assert again.steps == 3 and again.final_eval is not None and len(losses(tmp_path)) == 3


def test_ctrl_c_checkpoints_the_finished_step_and_the_resume_is_exact(train_root, tmp_path, straight_losses):
    def ctrl_c_at_3(trainer, record):
        if record["step"] == 3:
            signal.raise_signal(signal.SIGINT)  # handled at once: the loop stops after this step

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"stopped after step 3; checkpoint \S+step-00000003 is saved"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, save_every=2), on_step=ctrl_c_at_3).run()
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert names(tmp_path / "checkpoints") == ["step-00000002", "step-00000003"] and len(losses(tmp_path)) == 3
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=6, save_every=2, resume=True)).run()
    assert losses(tmp_path) == straight_losses


def test_ctrl_c_in_rdepth_train_exits_130_with_one_line(train_root, tmp_path, monkeypatch, capsys):
    original = Trainer.train_step

    def step_then_ctrl_c(self):
        record = original(self)
        if record["step"] == 2:
            signal.raise_signal(signal.SIGINT)
        return record

    monkeypatch.setattr(Trainer, "train_step", step_then_ctrl_c)
    out = tmp_path / "run"
    assert main(cli_flags(train_root, out, "--max-steps", "5")) == 130
    assert error_lines(capsys) == [f"rdepth train: interrupted: stopped after step 2; checkpoint "
                                   f"{out / 'checkpoints' / 'step-00000002'} is saved: continue with --resume"]
    monkeypatch.setattr(Trainer, "train_step", original)
    assert main(cli_flags(train_root, out, "--max-steps", "5", "--resume")) == 0
    assert len(losses(out)) == 5


# ------------------------------------------------------------------ 13: NaN in eval.jsonl, skipped steps
def _strict(line):
    def refuse(name):
        raise ValueError(f"bare {name} in a JSON line")

    return json.loads(line, parse_constant=refuse)


def test_a_nan_validation_loss_is_written_as_null(train_root, tmp_path):
    trainer = Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, eval_interval=1))
    trainer.model.transformer.ln_f.register_forward_hook(
        lambda module, args, output: output if module.training else output * float("nan"))
    result = trainer.run()
    assert all(math.isnan(v) for v in result.final_eval.loss.values())
    records = [_strict(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    # step 1, then the final evaluation at step 2 (the last step is not evaluated twice)
    assert [(r["step"], r["final"]) for r in records] == [(1, False), (2, True)]
    assert all(set(r["val_loss_by_depth"].values()) == {None} for r in records)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        _strict(line)


CLIP_AND_CHECK = trainer_module.clip_and_check_grads


def _skip_from_step(monkeypatch, first_skipped):
    """Steps from `first_skipped` on see a non-finite gradient norm (and are skipped)."""
    original = CLIP_AND_CHECK
    calls = {"n": 0}

    def check(params, clip):
        calls["n"] += 1
        norm, finite = original(params, clip)
        return (float("nan"), False) if calls["n"] >= first_skipped else (norm, finite)

    monkeypatch.setattr(trainer_module, "clip_and_check_grads", check)


def test_a_run_that_skipped_most_steps_fails_after_writing_everything(train_root, tmp_path, monkeypatch):
    _skip_from_step(monkeypatch, 2)  # 3 of 4 steps skipped
    with pytest.raises(TooManySkippedSteps, match=r"3 of 4 optimizer steps \(75%\) were skipped for a non-finite "
                                                  r"gradient, more than max_skipped_fraction 0.5") as info:
        Trainer(tiny_train_config(train_root, tmp_path / "a", max_steps=4)).run()
    assert info.value.result.skipped_steps == 3 and (tmp_path / "a" / "model" / "config.json").is_file()
    _skip_from_step(monkeypatch, 2)
    lenient = tiny_train_config(train_root, tmp_path / "b", max_steps=4, max_skipped_fraction=0.75)
    assert Trainer(lenient).run().steps == 4


def test_rdepth_train_exits_1_when_too_many_steps_were_skipped(train_root, tmp_path, monkeypatch, capsys):
    _skip_from_step(monkeypatch, 3)  # 2 of 4: not more than half
    assert main(cli_flags(train_root, tmp_path / "half", "--max-steps", "4")) == 0
    _skip_from_step(monkeypatch, 2)
    assert main(cli_flags(train_root, tmp_path / "most", "--max-steps", "4", "--max-skipped-fraction", "0.25")) == 1
    [err] = error_lines(capsys)
    assert err.startswith("rdepth train: error: 3 of 4 optimizer steps (75%)") and "--max-skipped-fraction" in err
    with pytest.raises(ValueError, match=r"max_skipped_fraction=1.5 is invalid: expected a number in \[0, 1\]"):
        TrainConfig(max_skipped_fraction=1.5)


def test_saving_a_checkpoint_writes_a_manifest_of_every_file(train_root, tmp_path):
    result = Trainer(tiny_train_config(train_root, tmp_path, max_steps=1)).run()
    manifest = json.loads((result.last_checkpoint / "manifest.json").read_text())
    files = {p.name for p in result.last_checkpoint.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files and set(ckpt.REQUIRED_FILES) <= files
    for name, entry in manifest["files"].items():
        assert entry == {"bytes": (result.last_checkpoint / name).stat().st_size,
                         "sha256": ckpt.file_sha256(result.last_checkpoint / name)}


# ------------------------------------------------------------------ issue 33 item 5: time budgets
def test_a_time_budget_covers_the_final_evaluation_and_says_how_it_was_spent(train_root, tmp_path, monkeypatch):
    import time as time_module

    from recurrent_depth.train import validation

    original = validation.depth_losses

    def slow_batch(*args, **kwargs):  # an evaluation batch of 0.4 s: 20 of them (8 s) would overrun the budget
        time_module.sleep(0.4)
        return original(*args, **kwargs)

    monkeypatch.setattr(validation, "depth_losses", slow_batch)
    messages = []
    started = time_module.perf_counter()
    trainer = Trainer(tiny_train_config(train_root, tmp_path, max_steps=None, max_minutes=2.0 / 60, eval_batches=20,
                                        eval_depths=[1]), log=messages.append)
    trainer.run()
    total = time_module.perf_counter() - started
    assert trainer.final_reserve_s >= 0.4  # one evaluation batch, measured, kept for the end
    assert total < 2.0 + 0.4 + 1.0  # (the evaluation's first batch always runs; setup takes well under 1 s)
    final = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert final["final"] and final["val_tokens"] < 20 * 4 * 32  # cut to fit, not all 20 batches
    budget = [m for m in messages if m.startswith("time budget max_minutes=")]
    assert len(budget) == 1 and "final evaluation" in budget[0] and "not counted" in budget[0]


@pytest.mark.parametrize("budget", [["--max-steps", "2"], ["--max-minutes", str(0.5 / 60)]], ids=["steps", "minutes"])
def test_resuming_a_finished_run_says_so_trains_nothing_and_exits_0(train_root, tmp_path, capsys, budget):
    assert main(cli_flags(train_root, tmp_path, "--save-every", "2", *budget)) == 0
    steps = len(losses(tmp_path))
    evals = (tmp_path / "eval.jsonl").read_text()
    capsys.readouterr()
    assert main(cli_flags(train_root, tmp_path, "--resume", "--save-every", "2", *budget)) == 0
    out = capsys.readouterr().out
    assert f"already finished at step {steps}" in out and "nothing to do" in out
    assert len(losses(tmp_path)) == steps and (tmp_path / "eval.jsonl").read_text() == evals
    assert "depth  val loss" in out  # (the final table, from the run's own evaluation)
    assert main(cli_flags(train_root, tmp_path, "--resume", "--max-steps", str(steps + 1))) == 0
    assert len(losses(tmp_path)) == steps + 1  # a raised budget trains on


# ------------------------------------------------------------------ one run per --out
def test_a_second_run_into_a_directory_in_use_is_refused_naming_it_and_its_holder(train_root, tmp_path, capsys):
    """Two processes training into one --out deleted each other's temporary checkpoints: the run holds an
    flock on the directory; another run is refused at once, in one line (here the holder is faked: an flock
    on another open file of the lock file, which conflicts as another process's would)."""
    import fcntl

    from recurrent_depth.files import DIR_LOCK_FILE

    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / DIR_LOCK_FILE, "w") as holder:
        holder.write("4242\n")
        holder.flush()
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=f"--out {tmp_path} is in use by process 4242"):
            Trainer(tiny_train_config(train_root, tmp_path, max_steps=1))
        assert main(cli_flags(train_root, tmp_path, "--max-steps", "1")) == 2
        assert error_lines(capsys) == [f"rdepth train: error: --out {tmp_path} is in use by process 4242 (it holds "
                                       f"{tmp_path / DIR_LOCK_FILE}); wait for it to finish or choose another "
                                       "directory"]
    assert not (tmp_path / "metrics.jsonl").exists()
    trainer = Trainer(tiny_train_config(train_root, tmp_path, max_steps=1))  # released by the holder: free
    with pytest.raises(ValueError, match="in use by another run in this process"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=1))
    trainer.run()  # (run() releases it when it returns)
    assert Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, resume=True)).run().steps == 2


def test_a_finished_run_without_checkpoints_is_not_overwritten_by_a_new_one(train_root, tmp_path, capsys):
    """A finished run whose checkpoints were removed was silently replaced (model/ overwritten, metrics.jsonl
    emptied) by a rerun into its --out, with or without --resume: refused in one line instead."""
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=1)).run()
    shutil.rmtree(tmp_path / "checkpoints")
    metrics, weights = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "model" / "model.safetensors").stat()
    for resume in ([], ["--resume"]):
        assert main(cli_flags(train_root, tmp_path, "--max-steps", "1", *resume)) == 2
        assert error_lines(capsys) == [f"rdepth train: error: {tmp_path} holds the model/ of an earlier run and no "
                                       f"checkpoint to resume from; choose a new --out, or delete "
                                       f"{tmp_path / 'model'} to train there from scratch"]
    assert (tmp_path / "metrics.jsonl").read_text() == metrics
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns
    shutil.rmtree(tmp_path / "model")  # what the message says
    assert Trainer(tiny_train_config(train_root, tmp_path, max_steps=1)).run().steps == 1


def test_a_file_system_without_locks_warns_and_runs_unlocked(tmp_path, monkeypatch, caplog):
    """flock fails with ENOLCK on some network file systems: a warning, not a run that cannot start."""
    import fcntl
    import logging

    from recurrent_depth.files import lock_directory

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        assert lock_directory(tmp_path, "--out") is None
    assert f"--out {tmp_path} cannot be locked (No locks available)" in caplog.text
