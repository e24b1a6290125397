"""Small gaps, each closed where it belongs: GradMem's write and TTT-E2E's inner loop skipped when nothing is
generated, GradMem and TTT-E2E refused together, the sweep's training FLOPs under --depth-per-rank, and the
reasoning recipe leaving what its Trainer holds (`close()`)."""

from __future__ import annotations

import json

import pytest

import recurrent_depth as rd
from recurrent_depth.config import ModelConfig
from recurrent_depth.inference.options import OptionError
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.flops import training_step_flops

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 99, 3, 250, 17, 42, 99, 3, 77, 12, 17, 42]


@pytest.mark.parametrize("method, kwargs", [
    ("gradmem", {"gradmem_tokens": 2, "gradmem_steps": 3, "gradmem_query_tokens": 2}),
    ("ttt", {"ttt_params": "core-mlp", "ttt_steps": 3}),
])
def test_max_new_tokens_0_skips_the_test_time_steps_and_says_so(tiny_model, method, kwargs):
    """max_new_tokens=0 returned the prompt and no token, but ran GradMem's whole write / TTT-E2E's whole inner loop
    first (their losses and FLOPs in the stats), for a result nothing read. Now no step runs; the stats say why."""
    plain = rd.generate(tiny_model, PROMPT, max_new_tokens=0, num_steps=2)
    out = rd.generate(tiny_model, PROMPT, max_new_tokens=0, num_steps=2, **kwargs)
    assert out.sequences.tolist() == plain.sequences.tolist() == [PROMPT]
    assert out.token_lists() == plain.token_lists() == [[]]
    assert out.stats[f"{method}_losses"] == [] and out.stats[f"{method}_flops"] == 0.0
    assert out.stats[f"{method}_steps"] == 0
    assert out.stats[f"{method}_skipped"].startswith("max_new_tokens=0")
    # one token: the steps run (and no skip is reported)
    ran = rd.generate(tiny_model, PROMPT, max_new_tokens=1, num_steps=2, **kwargs)
    assert len(ran.stats[f"{method}_losses"]) == 3 and f"{method}_skipped" not in ran.stats


def test_max_new_tokens_0_still_checks_the_test_time_options(tiny_model):
    """Skipping the steps keeps their checks: a request that cannot run fails with or without tokens to generate."""
    with pytest.raises(OptionError, match="'transformer.nothing.*' matches no parameter"):
        rd.generate(tiny_model, PROMPT, max_new_tokens=0, ttt_params="transformer.nothing.*")
    with pytest.raises(OptionError, match="gradmem_query_tokens=14 leaves row 0 no context"):
        rd.generate(tiny_model, PROMPT, max_new_tokens=0, gradmem_tokens=2, gradmem_query_tokens=14)


def test_gradmem_and_ttt_e2e_together_are_refused_in_one_line(tiny_model):
    """gradmem_tokens with ttt_params ran both (TTT-E2E trained on the whole prompt, GradMem's query too, and the
    write ran through the adapted weights), which neither paper nor the docs define. Now a one-line error naming
    both, before any step."""
    with pytest.raises(OptionError) as caught:
        rd.generate(tiny_model, PROMPT, max_new_tokens=1, gradmem_tokens=2, ttt_params="core-mlp")
    message = str(caught.value)
    assert "ttt_params='core-mlp'" in message and "gradmem_tokens=2" in message and "\n" not in message
    assert caught.value.field == "ttt_params"


def test_sweep_counts_every_rank_s_depths_with_depth_per_rank(tmp_path):
    """Under --depth-per-rank metrics.jsonl's num_steps is rank 0's depths only; the sweep counted every rank's
    rows at rank 0's depths. Now each rank's batch is counted at its own depths (num_steps_by_rank)."""
    from recurrent_depth.scaling.sweep import PlannedRun, run_rows

    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(preset="tiny", seq_len=32, batch_size=4, max_steps=2, mean_recurrence=2)
    model_cfg = ModelConfig.from_preset("tiny")
    (out / "run.json").write_text(json.dumps({
        "config": cfg.to_dict(), "model_config": model_cfg.to_dict(), "seq_len": 32, "parameters": 1000,
        "tokens_per_step": 256, "world_size": 2, "finished": {"step": 2}}))
    (out / "eval.jsonl").write_text(json.dumps({"final": True, "val_loss_by_depth": {"2": 4.9}}) + "\n")
    records = [  # (rank 0 drew 2 then 3, rank 1 drew 6 then 1; one gradient step each)
        {"step": 1, "tokens": 256, "num_steps": [2], "grad_steps": [1],
         "num_steps_by_rank": [[2], [6]], "grad_steps_by_rank": [[1], [1]]},
        {"step": 2, "tokens": 512, "num_steps": [3], "grad_steps": [1],
         "num_steps_by_rank": [[3], [1]], "grad_steps_by_rank": [[1], [1]]},
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = run_rows(out, PlannedRun("r", {}, {}), [2])[0]
    each_rank = sum(training_step_flops(model_cfg, 4, 32, (d - 1, 1)).total for d in (2, 6, 3, 1))
    assert row["train_flops"] == pytest.approx(each_rank)
    assert row["train_depth_mean"] == pytest.approx(3.0)
    # a record without them (one depth for every rank) is counted as before: 8 rows at rank 0's depth
    for r in records:
        del r["num_steps_by_rank"], r["grad_steps_by_rank"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = run_rows(out, PlannedRun("r", {}, {}), [2])[0]
    assert row["train_flops"] == pytest.approx(sum(training_step_flops(model_cfg, 8, 32, (d - 1, 1)).total
                                                   for d in (2, 3)))
    assert row["train_depth_mean"] == pytest.approx(2.5)


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_the_reasoning_recipe_closes_its_trainer(tmp_path, monkeypatch, fails):
    """The reasoning recipe never called `trainer.close()`: a process group it joined under torchrun was never
    left (and its logs stayed open). Now it closes the trainer after its run, also one that fails."""
    from recurrent_depth.evaluation.reasoning import train as recipe
    from recurrent_depth.train.trainer import Trainer

    closed = []
    close = Trainer.close
    monkeypatch.setattr(Trainer, "close", lambda self: closed.append(self) or close(self))
    if fails:
        def broken(self):
            raise RuntimeError("a step failed")

        monkeypatch.setattr(Trainer, "_run", broken)
    config = recipe.ReasoningRunConfig(hidden_size=16, num_heads=2, intermediate_size=32, mean_recurrence=2,
                                       backprop_depth=1, batch_size=2, max_steps=1, warmup_steps=0, out=str(tmp_path),
                                       train_difficulties=(0, 1))
    if fails:
        with pytest.raises(RuntimeError, match="a step failed"):
            recipe.train_reasoning(config, log=lambda _: None)
    else:
        recipe.train_reasoning(config, log=lambda _: None)
    assert len(closed) == 1


@pytest.mark.parametrize("fails", [False, True])
def test_the_sft_and_rl_python_entry_points_close_their_trainer(monkeypatch, fails):
    """`train.sft.sft` and `train.rl.recipe.run_rl` ran a Trainer and never closed it (as `rdepth sft` / `rdepth rl`
    do): its logs stayed open and a process group it joined under torchrun was never left. Now closed after the run,
    also one that fails."""
    from recurrent_depth.train import sft as sft_module
    from recurrent_depth.train.rl import recipe

    class FakeTrainer:
        closed = 0

        def run(self):
            if fails:
                raise RuntimeError("the run failed")
            return "result"

        def close(self):
            FakeTrainer.closed += 1

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(sft_module, "sft_trainer", lambda *a, **k: FakeTrainer())
    monkeypatch.setattr(recipe, "build_rl", lambda *a, **k: FakeTrainer())
    for call in (lambda: sft_module.sft(None), lambda: recipe.run_rl(None, None, None)):
        if fails:
            with pytest.raises(RuntimeError, match="the run failed"):
                call()
        else:
            assert call() == "result"
    assert FakeTrainer.closed == 2
