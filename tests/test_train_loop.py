"""The training loop end to end on the tiny preset: outputs, exact resume (also after kill -9), skips."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.schedule import lr_at
from recurrent_depth.train.trainer import StopTraining, Trainer
from tests.train_support import OneThread, prepare_root, tiny_train_config


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("train_root"))


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_writes_metrics_metadata_checkpoints_and_a_model_dir(train_root, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_train_config(train_root, out, max_steps=4, save_every=2, keep_last=1, eval_interval=2)
    result = Trainer(cfg).run()
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert {"step", "loss", "num_steps", "lr", "tokens_per_s", "grad_norm"} <= set(m)
        assert m["loss"] > 0 and m["tokens_per_s"] > 0 and len(m["num_steps"]) == 1
    assert result.losses == [m["loss"] for m in metrics]
    assert metrics[0]["lr"] < metrics[1]["lr"]  # warmup

    run = json.loads((out / "run.json").read_text())
    assert run["config"]["max_steps"] == 4 and run["data"]["corpus"]["num_documents"] == 60
    assert len(run["data"]["corpus"]["sha256"]) == 64 and run["versions"]["torch"]
    assert run["sampler"]["mean_recurrence"] == 4 and run["seeds"]["weights"] == 0

    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["final"]) for e in evals] == [(2, False), (4, True)]  # the last step once
    assert set(evals[-1]["val_loss_by_depth"]) == {"1", "2", "4"}
    assert 0 <= evals[-1]["token_correlation_by_depth"]["4"] <= 1

    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-00000004"]  # keep_last=1 removed step 2

    model = rd.RecurrentDepthLM.from_pretrained(out / "model")
    # eos: end of text and end of turn (issue 17: a chat answer stops at the end of its turn)
    assert model.config.vocab_size == 384 and model.config.eos_token_id == [384 - 31, 384 - 28]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, result.model.state_dict()[name]), name
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok.decode(tok("def alpha_0(x):").input_ids, skip_special_tokens=True) == "def alpha_0(x):"


# bf16 with 9 x 32 tokens per micro-batch: accel's blocked products (several blocks) and its cache of
# the cast weights must not make a resumed run differ from an uninterrupted one.
@pytest.mark.parametrize("options", [{}, {"dtype": "bf16", "batch_size": 9}, {"grad_accum": 2, "batch_size": 2}],
                         ids=["fp32", "bf16", "grad-accum-2"])
def test_resume_after_a_crash_repeats_the_uninterrupted_losses_bitwise(train_root, tmp_path, monkeypatch, options):
    from recurrent_depth.accel import linear

    monkeypatch.setattr(linear, "cpu_emulates_bf16", lambda: True)  # the emulated-bf16 layouts on any CPU
    blocked_calls = []
    original = linear.blocked_tn_mm
    monkeypatch.setattr(linear, "blocked_tn_mm", lambda a, b: blocked_calls.append(a.shape) or original(a, b))
    straight = Trainer(tiny_train_config(train_root, tmp_path / "a", max_steps=7, save_every=3, **options)).run()
    assert bool(blocked_calls) == ("dtype" in options)

    def crash_at_5(trainer, record):
        if record["step"] == 5:
            raise StopTraining

    with pytest.raises(StopTraining):
        Trainer(tiny_train_config(train_root, tmp_path / "b", max_steps=7, save_every=3, **options),
                on_step=crash_at_5).run()
    assert len(read_metrics(tmp_path / "b")) == 5
    resumed = Trainer(tiny_train_config(train_root, tmp_path / "b", max_steps=7, save_every=3, resume=True,
                                        **options)).run()
    losses_b = [m["loss"] for m in read_metrics(tmp_path / "b")]
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == list(range(1, 8))  # 4, 5 dropped and redone
    assert losses_b == straight.losses
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


@pytest.mark.parametrize("line", ['{"step": "1", "loss": 3.0}', "[1, 2]", '{"step": true}'],
                         ids=["string-step", "not-an-object", "bool-step"])
def test_an_edited_metrics_line_is_a_one_line_error_on_resume(tmp_path, line):
    """A metrics.jsonl line edited to a string step (or to a non-object) made `--resume` a TypeError / AttributeError
    traceback; it is a ValueError naming the file and line, and the file is left as it was."""
    from recurrent_depth.train.run_record import JsonlLog

    path = tmp_path / "metrics.jsonl"
    text = f'{{"step": 1}}\n{line}\n{{"step": 3}}\n'
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{path} line 2 is not a record of this run"):
        JsonlLog(path, keep_through=2)
    assert path.read_text() == text
    path.write_text('{"step": 1}\n{"loss": 2}\n{"step": 3}\n{"step": 4, "lo')  # (no step: kept; a torn end: dropped)
    JsonlLog(path, keep_through=2).close()
    assert path.read_text() == '{"step": 1}\n{"loss": 2}\n'


def test_resume_refuses_a_changed_config_and_a_fresh_run_refuses_old_checkpoints(train_root, tmp_path):
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=2, save_every=2)).run()
    with pytest.raises(ValueError, match="--resume"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=4))
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, batch_size=2, resume=True))
    # the same corpus under another spelling (relative, trailing slash) is no change
    relative = os.path.relpath(train_root / "corpus") + os.sep
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, resume=True, data=relative))
    with pytest.raises(ValueError, match="data"):
        Trainer(tiny_train_config(train_root, tmp_path, max_steps=4, resume=True, data=str(train_root / "tokenizer")))


def test_a_refused_resume_names_the_changes_and_leaves_the_run_untouched(train_root, tmp_path):
    """The config check comes before the data work: a changed seed must not re-pack the run's shards."""
    out, data_dir = tmp_path / "run", tmp_path / "data"
    Trainer(tiny_train_config(train_root, out, max_steps=2, save_every=2, data_dir=str(data_dir))).run()
    before = {p.name: p.read_bytes() for p in data_dir.iterdir() if p.is_file()}
    changed = tiny_train_config(train_root, out, max_steps=4, resume=True, data_dir=str(data_dir), seed=1,
                                optim=OptimConfig.from_preset("demo", lr=1e-2, warmup_steps=2, cooldown_fraction=0.25))
    with pytest.raises(ValueError, match=r"optim\.lr: 0\.003 -> 0\.01, seed: 0 -> 1\)") as info:
        Trainer(changed)
    assert "description" not in str(info.value)  # only the optim fields that changed
    assert {p.name: p.read_bytes() for p in data_dir.iterdir() if p.is_file()} == before


def test_a_checkpoint_written_before_a_config_field_existed_still_resumes(train_root, tmp_path):
    """A field added to TrainConfig/OptimConfig later (at its default: the old behaviour) is not a change."""
    out = tmp_path / "run"
    Trainer(tiny_train_config(train_root, out, max_steps=2, save_every=2)).run()
    state_file = next((out / "checkpoints").glob("step-*")) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["optim"]["skip_first_step"], state["config"]["keep_freed_memory"], state["config"]["seed"]
    state_file.write_text(json.dumps(state))
    assert Trainer(tiny_train_config(train_root, out, max_steps=3, resume=True)).run().steps == 3
    with pytest.raises(ValueError, match=r"optim\.skip_first_step: False -> True"):
        Trainer(tiny_train_config(train_root, out, max_steps=4, resume=True, optim=OptimConfig.from_preset(
            "demo", lr=3e-3, warmup_steps=2, cooldown_fraction=0.25, skip_first_step=True)))


def test_resuming_a_finished_run_logs_its_final_evaluation_once(train_root, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_train_config(train_root, out, max_steps=2, save_every=2)).run()
    again = Trainer(tiny_train_config(train_root, out, max_steps=2, resume=True)).run()
    assert again.steps == 2 and again.final_eval is not None
    finals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["final"]) for r in finals] == [(2, True)]


def test_a_fresh_run_retrains_a_tokenizer_left_for_other_settings(train_root, tmp_path):
    """`<out>/tokenizer` from an earlier run without checkpoints (say, one that failed) is reused only if
    it was trained for this data and vocabulary size; a resumed run keeps its own."""
    out = tmp_path / "run"
    first = tiny_train_config(train_root, out, tokenizer=None, data_dir=None, vocab_size=320, max_steps=1)
    assert Trainer(first).run().model.config.vocab_size == 320
    for name in ("checkpoints", "model"):  # (a failed run leaves neither; a finished run's model/ is not replaced)
        shutil.rmtree(out / name)
    second = tiny_train_config(train_root, out, tokenizer=None, data_dir=None, vocab_size=384, max_steps=1,
                               save_every=1)
    assert Trainer(second).run().model.config.vocab_size == 384
    tokenizer = (out / "tokenizer" / "tokenizer.json").read_bytes()
    resumed = Trainer(second.replace(resume=True, max_steps=2)).run()
    assert resumed.model.config.vocab_size == 384 and resumed.steps == 2
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer


@pytest.mark.slow
def test_resume_after_kill_9_is_exact(train_root, tmp_path):
    """A real `rdepth train` process killed with SIGKILL mid-run, then resumed, ends with the losses of
    the same command run straight through (here in-process, from the same parsed flags)."""
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args

    def flags(out, *extra):
        return ["train", "--preset", "tiny", "--data", str(train_root / "corpus"),
                "--tokenizer", str(train_root / "tokenizer"), "--data-dir", str(train_root / "data"),
                "--val-fraction", "0.1", "--keep-all", "--seq-len", "32", "--batch-size", "4", "--max-steps", "30",
                "--save-every", "4", "--eval-batches", "1", "--eval-depths", "1", "--no-tensorboard",
                "--out", str(out), *extra]

    straight = Trainer(config_from_args(build_parser("train").parse_args(flags(tmp_path / "straight")))).run()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same thread count as this process (one_thread)
    command = [sys.executable, "-m", "recurrent_depth.cli", *flags(tmp_path / "killed")]
    victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and victim.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert len(metrics.read_text().splitlines()) < 30, "the run finished before it could be killed"
    subprocess.run([*command, "--resume"], check=True, env=env, capture_output=True)
    assert [m["loss"] for m in read_metrics(tmp_path / "killed")] == straight.losses
    assert len(straight.losses) == 30


def test_non_finite_steps_are_skipped_counted_and_logged(train_root, tmp_path):
    # progress=True (the default): the bar's postfix must cope with the step's loss being None
    cfg = tiny_train_config(train_root, tmp_path, max_steps=4, progress=True)
    messages = []
    trainer = Trainer(cfg, log=messages.append)
    calls = {"n": 0}

    def poison(module, args, output):
        calls["n"] += 1
        return output * float("nan") if trainer.state.micro_step == 1 else output

    trainer.model.transformer.ln_f.register_forward_hook(poison)
    snapshots = []
    trainer.on_step = lambda t, record: snapshots.append(
        {k: v.clone() for k, v in t.model.state_dict().items()})
    trainer.run()
    metrics = read_metrics(tmp_path)
    assert [m["skipped"] for m in metrics] == [False, True, False, False]
    assert metrics[1]["loss"] is None and metrics[1]["grad_norm"] is None and metrics[-1]["skipped_total"] == 1
    for name in snapshots[0]:
        assert torch.equal(snapshots[0][name], snapshots[1][name]), name  # the poisoned step changed nothing
    assert all(m["loss"] is not None and m["loss"] < 10 for m in metrics[2:])
    assert any("non-finite" in m for m in messages)


def test_skip_first_step_measures_the_first_gradient_and_changes_nothing(train_root, tmp_path):
    optim = OptimConfig.from_preset("demo", lr=3e-3, warmup_steps=0, cooldown_fraction=None, skip_first_step=True)
    trainer = Trainer(tiny_train_config(train_root, tmp_path, optim=optim, max_steps=3))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    snapshots = []
    trainer.on_step = lambda t, record: snapshots.append(
        ({k: v.clone() for k, v in t.model.state_dict().items()}, sum(len(o.state) for o in t.optimizer)))
    trainer.run()
    metrics = read_metrics(tmp_path)
    assert [m["skip_reason"] for m in metrics] == ["first_step", None, None]
    assert [m["skipped"] for m in metrics] == [True, False, False]
    assert metrics[-1]["skipped_total"] == 0 and metrics[0]["grad_norm"] is not None
    after_first, moments_after_first = snapshots[0]
    assert moments_after_first == 0  # no optimizer state yet: running init happens on the first real step
    assert all(torch.equal(initial[k], after_first[k]) for k in initial)
    assert any(not torch.equal(after_first[k], snapshots[1][0][k]) for k in initial)


def test_time_capped_run_warms_up_before_its_length_is_known(train_root, tmp_path):
    # Before the first timed step a time-capped run's length is unknown: the first step must still be in
    # warmup (it ran at the full lr when a cool-down length was set).
    optim = OptimConfig.from_preset("demo", lr=3e-3, warmup_steps=2, cooldown_fraction=None, cooldown_steps=5000)
    Trainer(tiny_train_config(train_root, tmp_path, optim=optim, max_steps=None, max_minutes=0.02)).run()
    first = read_metrics(tmp_path)[0]
    assert first["step"] == 1
    assert first["lr"] == pytest.approx(lr_at(0, 3e-3, 2, None))
    assert first["lr"] < 3e-3


@pytest.mark.parametrize("options", [{"baseline": True}, {"grad_accum": 3, "batch_size": 2}],
                         ids=["baseline", "grad-accum-3"])
def test_depth_draws_per_micro_batch(train_root, tmp_path, options):
    Trainer(tiny_train_config(train_root, tmp_path, max_steps=3, **options)).run()
    metrics = read_metrics(tmp_path)
    if options.get("baseline"):
        assert all(m["num_steps"] == [1] and m["grad_steps"] == [1] for m in metrics)
        assert json.loads((tmp_path / "model" / "config.json").read_text())["mean_recurrence"] == 1
        # run.json said "poisson-lognormal" for a baseline, whose steps draw nothing
        assert json.loads((tmp_path / "run.json").read_text())["sampler"] == {"scheme": "baseline", "num_steps": [0, 1]}
    else:
        from recurrent_depth.train.depth import DepthSampler

        sampler = DepthSampler(4, 2, seed=0)
        drawn = [d for m in metrics for d in m["num_steps"]]
        assert drawn == [sum(sampler.sample(i)) for i in range(9)]
        assert metrics[-1]["tokens"] == 3 * 3 * 2 * 32


def test_activation_checkpointing_and_bf16_train(train_root, tmp_path):
    plain = Trainer(tiny_train_config(train_root, tmp_path / "plain", max_steps=2)).run()
    ac = Trainer(tiny_train_config(train_root, tmp_path / "ac", max_steps=2, activation_checkpointing=True)).run()
    assert ac.losses == plain.losses  # recomputation is exact on CPU
    bf16 = Trainer(tiny_train_config(train_root, tmp_path / "bf16", max_steps=2, dtype="bf16")).run()
    assert all(abs(a - b) < 0.05 for a, b in zip(bf16.losses, plain.losses))


def test_a_gated_deltanet_core_trains_through_rdepth_train(train_root, tmp_path):
    """`rdepth train --config` with `model: {mixer: {core: gated_deltanet}}`: the loss falls, the run
    saves a model directory that loads with that mixer, and the saved model decodes."""
    from recurrent_depth.cli import main

    out = tmp_path / "gdn"
    config = tmp_path / "run.yaml"
    config.write_text(
        "\n".join([
            "preset: tiny",
            f"data: {train_root / 'corpus'}",
            f"tokenizer: {train_root / 'tokenizer'}",
            f"data_dir: {train_root / 'data'}",
            "vocab_size: 384", "val_fraction: 0.1", "keep_all: true", "seq_len: 32", "batch_size: 4",
            "max_steps: 12", "eval_batches: 2", "eval_depths: [1, 4]", "progress: false", "tensorboard: false",
            "optim: {preset: demo, lr: 0.003, warmup_steps: 2}",
            "model:",
            "  mixer: {core: gated_deltanet}",
            "  mixer_options: {gated_deltanet: {chunk_size: 16}}",
            f"out: {out}",
        ]) + "\n"
    )
    assert main(["train", "--config", str(config)]) == 0
    losses = [m["loss"] for m in read_metrics(out)]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3  # it learns
    model = rd.RecurrentDepthLM.from_pretrained(out / "model")
    assert model.config.mixer["core"] == "gated_deltanet"
    assert type(model.transformer.core_block[0].attn).__name__ == "GatedDeltaNet"
    assert type(model.transformer.prelude[0].attn).__name__ == "Attention"
    generated = rd.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4, num_steps=2, init_scale=0.0)
    assert generated.sequences.shape == (1, 7)


def test_a_dsa_indexer_loss_is_trained_and_does_not_pile_up(train_root, tmp_path):
    """With `indexer_loss` on, the trainer adds each micro-step's indexer KL to the loss and pops it:
    the recorded terms (and the graphs they hold) never outlive a step, over 50 steps."""
    from recurrent_depth.model.mixers.dsa import indexer_parameters

    recorded: list[int] = []

    def count_recorded(trainer, record):
        recorded.append(sum(len(m.indexer_losses) for m in trainer.model.modules() if hasattr(m, "indexer_losses")))

    model = {"mixer": {"core": "dsa"}, "mixer_options": {"dsa": {"topk": 4, "indexer_loss": True}}}
    cfg = tiny_train_config(train_root, tmp_path / "dsa", max_steps=50, eval_depths=[1], eval_batches=1, model=model)
    trainer = Trainer(cfg, on_step=count_recorded)
    # In sparse mode the top-k choice passes no gradient: only the KL term can reach the indexer.
    indexer_grads: list[float] = []
    first = indexer_parameters(trainer.model)[0]
    first.register_hook(lambda g: indexer_grads.append(float(g.abs().sum())))
    trainer.run()
    assert recorded == [0] * 50
    kl = [m["indexer_kl"] for m in read_metrics(tmp_path / "dsa")]
    assert len(kl) == 50 and all(k > 0 for k in kl)
    assert len(indexer_grads) == 50 and all(g > 0 for g in indexer_grads)
