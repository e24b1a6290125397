"""`AutoModelForSequenceClassification` for recurrent-depth models (integrations/hf_seq_cls.py): a score head on
each row's last token over the causal LM's backbone, its losses, save/load, peft LoRA and trl's RewardTrainer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import recurrent_depth as rd
from recurrent_depth.integrations.export import export_remote_code
from recurrent_depth.integrations.hf_seq_cls import RecurrentDepthForSequenceClassification
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = dict(num_steps=3, init_scale=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path)
    return path


def load(path, **kwargs):
    return AutoModelForSequenceClassification.from_pretrained(path, **kwargs).eval()


def test_a_causal_lm_directory_loads_with_a_fresh_score_on_the_last_token(model_dir):
    """AutoModelForSequenceClassification had no recurrent-depth class (ValueError: unrecognized configuration)."""
    model = load(model_dir, num_labels=1)
    assert isinstance(model, RecurrentDepthForSequenceClassification)
    assert model.score.weight.shape == (1, model.config.hidden_size) and not hasattr(model, "lm_head")
    lm = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = ids(batch=2, length=6)
    with torch.no_grad():
        for steps in (1, 3):
            hidden = lm.base_model(x, num_steps=steps, init_scale=0.0).last_hidden_state
            got = model(x, attention_mask=torch.ones_like(x), num_steps=steps, init_scale=0.0).logits
            torch.testing.assert_close(got, model.score(hidden[:, -1]))
        # num_steps is the backbone's: another depth, another score
        assert not torch.allclose(model(x, num_steps=1, init_scale=0.0).logits, got)


def test_left_and_right_padding_score_the_last_real_token(model_dir):
    model = load(model_dir, num_labels=2)
    pad = model.config.pad_token_id
    row = ids(batch=1, length=5, seed=3)
    fill = torch.full((1, 2), pad)
    left, right = torch.cat([fill, row], 1), torch.cat([row, fill], 1)
    mask_left = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(row, **STEPS).logits
        batch = model(torch.cat([left, right]), attention_mask=torch.cat([mask_left, mask_left.flip(1)]), **STEPS)
        torch.testing.assert_close(batch.logits, alone.expand(2, -1), atol=1e-5, rtol=1e-5)
        # without a mask: the last token that is not config.pad_token_id (transformers' rule)
        torch.testing.assert_close(model(right, **STEPS).logits, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs an attention_mask or config.pad_token_id"):
        model.config.pad_token_id = None
        model(torch.cat([row, row]), **STEPS)


def test_losses_follow_the_problem_type(model_dir):
    model = load(model_dir, num_labels=3)
    x = ids(batch=4, length=5)
    classes = torch.tensor([0, 2, 1, 2])
    out = model(x, labels=classes, **STEPS)  # integer labels, num_labels > 1: single-label classification
    assert model.config.problem_type == "single_label_classification"
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, classes))
    multi = torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]])
    model.config.problem_type = None
    out = model(x, labels=multi, **STEPS)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, multi))
    reg = load(model_dir, num_labels=1)
    target = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = reg(x, labels=target, **STEPS)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits[:, 0], target))
    out.loss.backward()
    assert reg.score.weight.grad is not None and reg.transformer.adapter.weight.grad.abs().sum() > 0
    assert reg.accepts_loss_kwargs is False  # the Trainer divides by gradient accumulation itself


@pytest.mark.parametrize("tied", [True, False])
def test_save_and_load_keep_the_labels_and_the_head(tmp_path, tied):
    """The config.json of a classifier kept only the library's fields: num_labels (id2label) was lost, and the
    saved score.weight was refused by the directory check (unexpected tensors)."""
    make_model_dir(tmp_path / "lm", with_tokenizer=False, tie_embeddings=tied)
    labels = {0: "neg", 1: "neu", 2: "pos"}
    model = load(tmp_path / "lm", num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})
    model.save_pretrained(tmp_path / "cls")
    saved = json.loads((tmp_path / "cls" / "config.json").read_text())
    assert saved["architectures"] == ["RecurrentDepthForSequenceClassification"]
    assert saved["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
    back = load(tmp_path / "cls")
    assert back.config.num_labels == 3 and back.config.id2label == labels
    x = ids(batch=2, length=5)
    with torch.no_grad():
        torch.testing.assert_close(back(x, **STEPS).logits, model(x, **STEPS).logits)
    with pytest.raises(ValueError, match="sequence classifier"):
        export_remote_code(tmp_path / "cls", tmp_path / "exported")


def test_peft_lora_seq_cls_trains_saves_and_loads(model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(task_type="SEQ_CLS", target_modules="all-linear", modules_to_save=["score"])
    model = peft.get_peft_model(load(model_dir, num_labels=1), config).train()
    x, mask = ids(batch=2, length=5), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    out = model(x, attention_mask=mask, labels=torch.tensor([1.0, -1.0]), **STEPS)
    out.loss.backward()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt.step()
    model.eval().save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = model(x, attention_mask=mask, **STEPS).logits
        back = peft.PeftModel.from_pretrained(load(model_dir, num_labels=1), tmp_path / "adapter").eval()
        torch.testing.assert_close(back(x, attention_mask=mask, **STEPS).logits, expected)


def test_trls_reward_trainer_trains_a_recurrent_depth_reward_model(model_dir, tmp_path):
    """RewardTrainer loads AutoModelForSequenceClassification(num_labels=1) from the directory, and hands the
    dataset's `margin` column to the model's forward with the batch (its own loss reads it)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    data = Dataset.from_dict({"chosen": ["a=1;b=a;?b=1", "def f(x): return x"], "rejected": ["a=1;?b=2", "def f"],
                              "margin": [1.0, 0.5]})
    args = RewardConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                        report_to="none", save_strategy="no", use_cpu=True, logging_steps=1)
    trainer = RewardTrainer(model=str(model_dir), args=args, train_dataset=data,
                            processing_class=AutoTokenizer.from_pretrained(model_dir))
    assert isinstance(trainer.model, RecurrentDepthForSequenceClassification)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)


def test_the_remote_code_export_has_the_same_classifier(model_dir, tmp_path):
    """`rdepth export --remote-code`: auto_map names the file's RecurrentDepthForSequenceClassification, which scores
    as the library's class (same head weights, left and right padding)."""
    out = export_remote_code(model_dir, tmp_path / "exported")
    auto_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForSequenceClassification"] == (
        "modeling_recurrent_depth.RecurrentDepthForSequenceClassification")
    exported = remote.RecurrentDepthForSequenceClassification.from_pretrained(out, num_labels=2).eval()
    model = load(model_dir, num_labels=2)
    with torch.no_grad():
        exported.score.weight.copy_(model.score.weight)
    x, mask = ids(batch=2, length=6), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(exported(x, attention_mask=mask, **STEPS).logits,
                                   model(x, attention_mask=mask, **STEPS).logits, atol=1e-5, rtol=1e-5)
    target = torch.tensor([1, 0])
    assert exported(x, attention_mask=mask, labels=target, margin=torch.ones(2), **STEPS).loss > 0


def test_a_classifier_saved_by_the_remote_file_loads_in_the_library(model_dir, tmp_path):
    """The remote file's config did not declare rope_scaling, so transformers saved it as `rope_parameters: null`,
    a key the library refused (unknown config keys): a model fine-tuned with remote code did not load back."""
    out = export_remote_code(model_dir, tmp_path / "exported")
    exported = remote.RecurrentDepthForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    exported.save_pretrained(tmp_path / "saved")
    assert "rope_parameters" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    back = load(tmp_path / "saved")
    assert isinstance(back, RecurrentDepthForSequenceClassification) and back.config.num_labels == 1
    x = ids(batch=2, length=5)
    with torch.no_grad():
        torch.testing.assert_close(back(x, **STEPS).logits, exported(x, **STEPS).logits, atol=1e-5, rtol=1e-5)
    # directories written before the fix carry `rope_parameters: null`: read as an unset rope_scaling
    values = rd.ModelConfig.from_json(tmp_path / "saved" / "config.json").to_dict()
    assert rd.ModelConfig.from_dict({**values, "rope_parameters": None}).rope_scaling is None
