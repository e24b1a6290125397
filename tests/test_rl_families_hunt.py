"""`rdepth rl` from the model families users start from: Ouro (rollouts that exit by the gate), Parcae, a LoRA
adapter; the optimizer a Python run gets when it names none; bad rollout lengths in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.rl.recipe import RLConfig, build_rl
from recurrent_depth.train.rl.rollouts import RolloutSettings, policy_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

GATE = {"max_new_tokens": 4, "do_sample": True, "num_steps": 4, "exit_criterion": "gate", "exit_threshold": 0.5}


def ouro() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=288))


def parcae() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(
        "parcae-140m", vocab_size=288, hidden_size=128, num_heads=1, num_kv_heads=1, intermediate_size=256,
        prelude_layers=1, core_layers=1, coda_layers=1, mean_recurrence=4, mean_backprop_depth=2, max_seq_len=256,
        value_embeddings=()))


def rl_trainer(model, tmp_path: Path, generation: dict, logs: list[str] | None = None, **train):
    rl = RLConfig(task="shells", difficulties=[2], reward="tests.test_rl:char_sum", group_size=4, beta=0.1,
                  generation=generation)
    log = logs.append if logs is not None else (lambda line: None)
    return build_rl(model, rl, TrainConfig(out=str(tmp_path / "run"), max_steps=1, batch_size=2, **train),
                    tokenizer=byte_tokenizer(), log=log)


@pytest.mark.parametrize("family, generation", [
    ("ouro", GATE), ("parcae", {**GATE, "exit_criterion": "kl", "exit_threshold": 1e-2})])
def test_the_first_update_replays_each_family_s_rollouts_exactly(tmp_path, family, generation):
    """Ratio 1 and KL 0 before the first update, with the depths the exit chose (Ouro: its gate)."""
    model = ouro() if family == "ouro" else parcae()
    trainer = rl_trainer(model, tmp_path, generation)
    batch = trainer.source.next_batch(2)
    mask = batch["completion_mask"]
    depths = batch["token_depths"][:, -mask.shape[1]:][mask]
    assert depths.min() < depths.max(), "the rollouts did not exit at different depths"
    with torch.no_grad():
        logp = policy_logprobs(model, batch, trainer.source.settings)
    torch.testing.assert_close(logp[mask], batch["old_logp"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["ref_logp"][mask], batch["old_logp"][mask], atol=1e-5, rtol=0)
    _, stats = trainer.objective.loss(model, batch, None, None)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6) and stats["clip_fraction"] == 0.0


def test_a_python_run_naming_no_optimizer_gets_the_fine_tuning_preset(tmp_path):
    """`run_rl(model, rl, TrainConfig(out=..., max_steps=..., batch_size=...))` as docs/post-training.md writes it
    trained at the demo's from-scratch lr 3e-3 (50 warmup steps), 300x `rdepth rl`'s 1e-5, and said nothing."""
    logs: list[str] = []
    trainer = rl_trainer(ouro(), tmp_path, GATE, logs)
    assert (trainer.cfg.optim.lr, trainer.cfg.optim.warmup_steps) == (1e-5, 10)
    assert any("the finetune preset" in line and "lr 1e-05" in line for line in logs), logs
    named = rl_trainer(ouro(), tmp_path / "named", GATE, optim={"lr": 2e-4})
    assert named.cfg.optim.lr == 2e-4


def test_rollouts_of_no_token_are_refused_in_one_line():
    """max_new_tokens=0 passed validation and ended in an AttributeError traceback at the first rollout."""
    settings = RolloutSettings(generation={"max_new_tokens": 0, "do_sample": True})
    with pytest.raises(ValueError, match=r"max_new_tokens >= 1 \(--max-new-tokens\)"):
        settings.options(ouro())


def test_rl_cli_trains_a_lora_adapter_at_the_lora_rate(tmp_path):
    """`rdepth rl` had no --lora (train and sft have it); with it, model/ is the adapter and the default lr is
    the finetune-lora preset's 1e-4, the log says so."""
    pytest.importorskip("peft")
    start = tmp_path / "ouro"
    ouro().save_pretrained(start)
    byte_tokenizer().save(str(start / "tokenizer.json"))
    out = tmp_path / "run"
    assert main(["rl", "--init-from", str(start), "--out", str(out), "--lora", "--lora-rank", "4", "--difficulty", "2",
                 "--group-size", "2", "--prompts-per-step", "1", "--updates", "1", "--max-new-tokens", "2",
                 "--num-steps", "2", "--threads", "1"]) == 0
    assert (out / "model" / "adapter_config.json").exists() and not (out / "model" / "model.safetensors").exists()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["lr"] == 1e-4
