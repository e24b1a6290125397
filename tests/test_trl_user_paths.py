"""What a trl / peft user does with our transformers model (docs/post-training.md, "trl's trainers on our model"):
the depth a training-mode forward runs (`config.depth_scheme`), DPO's reference at that depth, and an adapter
trained by trl used by the library's tools."""

from __future__ import annotations

import json
import math

import pytest
import torch

from recurrent_depth.integrations.hf import RecurrentDepthForCausalLM
from tests.test_hf import ids, make_model_dir

pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")
# What makes a training-mode forward the eval forward: a fixed depth (mean_recurrence) and s0 = 0.
SAME_AS_EVAL = {"init_scale": 0.0, "depth_scheme": "fixed"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path)
    return path


def test_depth_scheme_fixed_trains_at_the_eval_depth(model_dir):
    """trl's trainers call the model without num_steps, so in training mode every forward drew its depth and nothing
    on the model could fix it (DPO's first loss was not ln 2, GRPO's first kl not 0, even with init_scale 0).
    `config.depth_scheme="fixed"` runs mean_recurrence steps, gradients through the last mean_backprop_depth."""
    model = RecurrentDepthForCausalLM.from_pretrained(model_dir, **SAME_AS_EVAL)
    assert model.config.depth_scheme == "fixed"
    x = ids(batch=2, length=6)
    with torch.no_grad():
        expected = model.eval()(x).logits
    model.train()
    for seed in range(4):  # (the default scheme's draws differ from mean_recurrence for some of these)
        torch.manual_seed(seed)
        torch.testing.assert_close(model(x).logits, expected, atol=0, rtol=0)
    assert "depth_scheme" not in json.loads(model.config.to_json_string())  # a runtime setting, as documented
    model.config.depth_scheme = "paper"
    with pytest.raises(ValueError, match=r"^config.depth_scheme='paper' is invalid: expected one of poisson-lognormal"):
        model(x)
    with pytest.raises(ValueError, match=r"config.depth_scheme='nope' is invalid"):
        RecurrentDepthForCausalLM.from_pretrained(model_dir, depth_scheme="nope")


def test_dpos_first_loss_is_ln2_with_the_reference_at_the_policys_depth(model_dir, tmp_path):
    """The reference model DPOTrainer loads from the directory takes `model_init_kwargs`: with the policy passed by
    path, both run the same fixed depth from s0 = 0, so before any update the policy is its reference (loss ln 2)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                     save_strategy="no", bf16=False, logging_steps=1,
                     model_init_kwargs=dict(SAME_AS_EVAL))
    data = Dataset.from_list([{"prompt": "a=1;b=a;?b", "chosen": "=1", "rejected": "=2"}] * 2)
    trainer = DPOTrainer(model=str(model_dir), args=args, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    assert trainer.ref_model.config.depth_scheme == "fixed" and trainer.ref_model.config.init_scale == 0.0
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_an_adapter_trained_by_sfttrainer_runs_in_the_librarys_tools_as_trained(model_dir, tmp_path):
    """SFTTrainer + peft LoRA on a repeated batch at a fixed depth: the loss goes down, and the saved adapter, loaded
    by `load_adapter_model` (what `rdepth generate --lora` runs), gives the trained peft model's logits."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from recurrent_depth.train.lora import load_adapter_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, **SAME_AS_EVAL)
    # bf16=False: trl's default on CPU too is bf16 autocast, which the trained model's forward keeps (other logits)
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2, report_to=[],
                     use_cpu=True, save_strategy="no", bf16=False, learning_rate=1e-2, logging_steps=1)
    trainer = SFTTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
                         train_dataset=Dataset.from_list([{"text": "a=1;b=a;?b=1\n" * 2}] * 2),
                         peft_config=LoraConfig(target_modules="all-linear", r=4, lora_alpha=8))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "adapter"))
    x = ids(batch=2, length=7)
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=x, num_steps=3).logits
        got = load_adapter_model(tmp_path / "adapter", base=model_dir).eval()(x, num_steps=3, init_scale=0.0).logits
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
