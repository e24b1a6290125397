"""`rdepth experiment`: the logit-growth fit on known curves, tiny end-to-end runs of each experiment, and
their training through the `Trainer` against the plain loop it replaced."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recurrent_depth import accel
from recurrent_depth.cli import main
from recurrent_depth.experiments.logit_growth import LogitGrowthConfig, growth_fit, saturation_step

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.train_support import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=20)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_growth_fit_recovers_a_known_exponent_before_saturation(power):
    t = np.arange(0, 200)  # updates done
    noise = np.exp(np.random.default_rng(0).normal(0, 0.02, len(t)))  # 2% multiplicative noise on the growth
    series = list(1.5 + 0.002 * t**power * noise)
    threshold = 1.5 + 0.002 * 150**power  # reached near t = 150
    cfg = LogitGrowthConfig(saturation=threshold, fit_start=5)
    fit = growth_fit(series, cfg)
    assert fit["slope"] == pytest.approx(power, abs=0.02)
    assert fit["ci95"][0] <= power <= fit["ci95"][1]
    assert fit["t_sat"] == saturation_step(series, threshold) == int(np.argmax(np.array(series) >= threshold))
    assert 140 < fit["t_sat"] < 160
    assert fit["window"] == [5, fit["t_sat"] - 1]
    assert saturation_step([1.0, 2.0], 5.0) is None


def test_logit_growth_command_writes_json_and_plot(corpus, tmp_path, capsys):
    out = tmp_path / "lg"
    code = main(["experiment", "logit-growth", "--steps", "12", "--muon-lrs", "0.02,0.05", "--adamw-lrs",
                 "0.003,0.01", "--hidden-size", "32", "--batch-size", "2", "--seq-len", "16", "--saturation", "2.5",
                 "--qk-clip-tau", "2.2", "--fit-start", "2", "--corpus", str(corpus), "--out", str(out)])
    assert code == 0
    result = json.loads((out / "logit_growth.json").read_text())
    assert (out / "logit_growth.png").stat().st_size > 10_000
    assert len(result["runs"]) == 2 * 2 * 3 and all(len(r["max_logit"]) == 12 for r in result["runs"])
    for r in result["runs"]:  # only the qk-clip runs rescale, and only heads over tau
        assert (sum(r["clipped_heads"]) > 0) == (r["variant"] == "qk-clip" and max(r["max_logit"]) > 2.2)
    for optimizer in ("muon", "adamw"):
        assert set(result["summary"][optimizer]) >= {"exponent_mean", "t_sat", "theory_exponent", "exponent_matches"}
    assert "theory" in capsys.readouterr().out


def test_logit_growth_gives_no_verdict_without_a_fit():
    """Runs whose max logit never grows give no fit and no interval: the summary said 'NOT consistent'."""
    from recurrent_depth.experiments.logit_growth import format_summary, summarise

    cfg = LogitGrowthConfig(variants=("plain",))
    runs = [dict(optimizer=name, variant="plain", lr=lr, max_logit=[2.0] * 20)
            for name, lrs in (("muon", cfg.muon_lrs), ("adamw", cfg.adamw_lrs)) for lr in lrs]
    text = format_summary(summarise(runs, cfg))
    assert "NOT consistent" not in text and text.count("no verdict") == 2


def test_logit_growth_plot_without_saturation_warns_nothing(tmp_path, monkeypatch):
    """No run reached T_sat: the third panel's empty legend printed matplotlib's 'No artists with labels'."""
    import warnings

    from matplotlib.figure import Figure

    from recurrent_depth.experiments.logit_growth import plot, summarise

    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: path.write_bytes(b"png"))  # (the slow part)

    cfg = LogitGrowthConfig(variants=("plain",))
    runs = [dict(optimizer=name, variant="plain", lr=lr, max_logit=[2.0 + 0.01 * t for t in range(20)])
            for name, lrs in (("muon", cfg.muon_lrs), ("adamw", cfg.adamw_lrs)) for lr in lrs]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(runs, summarise(runs, cfg), cfg, tmp_path / "lg.png")
    assert (tmp_path / "lg.png").is_file()


def test_logit_growth_rejects_bad_settings():
    with pytest.raises(ValueError, match="variants"):
        LogitGrowthConfig(variants=("plain", "weird"))
    with pytest.raises(ValueError, match="variants"):  # none: nothing ran and an empty result was written
        LogitGrowthConfig(variants=())
    with pytest.raises(ValueError, match="2 learning rates"):
        LogitGrowthConfig(muon_lrs=(0.02,))


# --------------------------------------------------------------------------------------------------------
# The experiments train through the Trainer; these pin that it changed nothing against the plain loop they
# had before (kept below, verbatim but for its name, as the reference). Both paths run the same float32
# operations in the same order on the CPU, so the results are compared for exact equality: any tolerance
# would let a changed step (another lr, a clipped gradient, a different s_0 or batch) pass.


def reference_batches(tokens, batch, seq_len, seed):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def reference_loop(model, optimizer, data, steps, num_steps, after_step=None):
    accel.apply(model)  # as the trainer does
    model.train()
    losses = []
    for step in range(steps):
        rows = next(data)
        out = model(rows[:, :-1], num_steps=num_steps, init_scale=0.0)
        loss = F.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(step, losses[-1])
    return losses


@pytest.fixture(scope="module")
def tokens(corpus):
    from recurrent_depth.experiments.common import byte_tokens

    return byte_tokens(str(corpus), 50_000)


@pytest.mark.parametrize(("optimizer", "lr", "variant"), [("muon", 0.05, "qk-clip"), ("adamw", 0.01, "qk-norm")])
def test_a_logit_growth_run_matches_the_plain_loop_it_replaced(tokens, optimizer, lr, variant):
    from recurrent_depth.experiments.logit_growth import growth_model, growth_optimizer, run_one
    from recurrent_depth.train.optim import build_optimizers
    from recurrent_depth.train.qk_clip import QKClip

    cfg = LogitGrowthConfig(steps=8, hidden_size=32, batch_size=2, seq_len=16, qk_clip_tau=1.5, fit_start=2)
    run = run_one(cfg, tokens, optimizer, lr, variant)

    model = growth_model(cfg, variant)
    clip = QKClip(model, cfg.qk_clip_tau if variant == "qk-clip" else None)
    records = []
    losses = reference_loop(model, build_optimizers(model, growth_optimizer(cfg, optimizer, lr)),
                            reference_batches(tokens, cfg.batch_size, cfg.seq_len, cfg.seed), cfg.steps,
                            cfg.recurrence, after_step=lambda *_: records.append(clip.step()))
    assert run["loss"] == losses
    assert run["max_logit"] == [r["max_logit"] for r in records]
    assert run["clipped_heads"] == [r["qk_clipped_heads"] for r in records]
    assert (sum(run["clipped_heads"]) > 0) == (variant == "qk-clip")  # the clipping path was exercised


def test_mup_training_matches_the_plain_loop_with_its_lr_multipliers(tokens):
    from recurrent_depth.experiments.common import ByteWindows, train_fixed_depth
    from recurrent_depth.experiments.mup import MupConfig, make_model
    from recurrent_depth.train.optim import OptimConfig, build_optimizers

    cfg = MupConfig(widths=(32, 64), base_width=32, head_dim=16, seq_len=16, batch_size=2)
    recipe = OptimConfig(name="adamw", lr=0.01, grad_clip=None)
    group_lrs = []

    def record_lrs(trainer, _record):
        group_lrs.append([g["lr"] for g in trainer.optimizer.param_groups])

    run = train_fixed_depth(make_model(cfg, 64, "mup", seed=0), recipe, ByteWindows(tokens, cfg.seq_len, 0), 6,
                            cfg.recurrence, cfg.batch_size, on_step=record_lrs)

    model = make_model(cfg, 64, "mup", seed=0)
    optimizer = build_optimizers(model, recipe)
    losses = reference_loop(model, optimizer, reference_batches(tokens, cfg.batch_size, cfg.seq_len, 0), 6,
                            cfg.recurrence)
    assert run.losses == losses and run.out is None
    reference_state = model.state_dict()
    assert all(torch.equal(v, reference_state[k]) for k, v in run.model.state_dict().items())
    expected = [g["lr"] for g in optimizer.param_groups]
    assert len(set(expected)) > 1  # muP's per-group multipliers (1/m for matrices, 1/sqrt(m) for the embedding)
    assert group_lrs == [expected] * 6  # the schedule kept them at every step
