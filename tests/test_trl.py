"""trl's trainers on our transformers model (docs/post-training.md, "trl"): the fused LM head (SFT, GRPO, RLOO),
the reference model DPO loads from a directory, generation in training mode (GRPO's rollouts), padding-free rows."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.cli import main
from recurrent_depth.integrations.hf import RecurrentDepthForCausalLM
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import ids, make_model_dir

trl_utils = pytest.importorskip("trl.trainer.utils")
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = dict(num_steps=3, init_scale=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path, with_tokenizer=False)
    return path


@pytest.fixture(scope="module")
def remote_dir(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("remote") / "out"
    assert main(["export", "--model", str(model_dir), "--out", str(out), "--remote-code"]) == 0
    return out


def token_log_probs(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]


@pytest.mark.parametrize("kind", ["library", "remote-code"])
def test_trls_fused_lm_head_gives_the_models_own_log_probs(model_dir, remote_dir, kind):
    """SFTTrainer / GRPOTrainer call `model.base_model(...)` for the lm_head's input: the `transformer`
    ModuleDict was not callable (TypeError at the first training step)."""
    if kind == "library":
        model = RecurrentDepthForCausalLM.from_pretrained(model_dir).eval()
    else:
        model = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir).eval()
    x, mask = ids(batch=2, length=7), torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        expected = token_log_probs(model(x, attention_mask=mask, **STEPS).logits, x)
    trl_utils.add_fused_lm_head(model)
    labels = x.masked_fill(mask == 0, -100)
    out = model(x, attention_mask=mask, labels=labels, fused_lm_head=True, **STEPS)
    valid = labels[:, 1:] != -100
    torch.testing.assert_close(out.log_probs[valid], expected[valid], atol=1e-5, rtol=1e-5)
    out.loss.backward()  # gradients reach the recurrent core through the fused head
    core = [p.grad for name, p in model.named_parameters() if ".core_block." in name]
    assert core and all(g is not None and g.abs().sum() > 0 for g in core)
    with pytest.raises(ValueError, match="takes no labels"):
        model.base_model(x, labels=x)


def test_dpos_reference_model_loads_from_a_library_directory(model_dir):
    """DPOTrainer builds its reference model with trl's `create_model_from_path`, which indexes
    `config.architectures` (None in our config.json: TypeError) and then reads `config.auto_map`."""
    ref = trl_utils.create_model_from_path(str(model_dir))
    assert isinstance(ref, RecurrentDepthForCausalLM)
    assert "auto_map" not in ref.config.to_dict()  # no remote code named in the config.json it would save


def test_generate_in_training_mode_runs_at_the_eval_depth_and_keeps_the_mode(model_dir):
    """trl's GRPOTrainer generates its rollouts with the model in training mode: every decode step drew its own
    depth, so a token's cache entries stopped short of the next token's (RuntimeError)."""
    model = RecurrentDepthForCausalLM.from_pretrained(model_dir)
    model.config.init_scale = 0.0
    x = ids(batch=2, length=4)
    expected = model.eval().generate(x, max_new_tokens=5, do_sample=False)
    torch.manual_seed(0)
    got = model.train().generate(x, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)
    assert model.training and model.core.training


def test_padding_free_rows_keep_their_examples_apart(model_dir):
    """trl's padding_free / packing collator: one row, no attention mask, position_ids restarting at 0 at each
    example, plus the varlen kernels' boundaries. Examples attended to each other (silently), the kwargs were
    refused, and a row longer than max_seq_len (96 here) was refused though each example fits."""
    model = RecurrentDepthForCausalLM.from_pretrained(model_dir).eval()
    a, b = ids(batch=1, length=60, seed=1), ids(batch=1, length=50, seed=2)
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(60), torch.arange(50)])[None]
    bounds = torch.tensor([0, 60, 110], dtype=torch.int32)
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=60,
                    max_length_k=60, seq_idx=torch.cat([torch.zeros(60), torch.ones(50)]).int()[None], **STEPS)
        torch.testing.assert_close(out.logits[:, 60:], model(b, **STEPS).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits[:, :60], model(a, **STEPS).logits, atol=1e-5, rtol=1e-5)
    assert out.cache is None
    with pytest.raises(ValueError, match="pass their position_ids"):
        model(a, cu_seq_lens_q=bounds)


def test_the_remote_file_refuses_packed_rows_in_one_line(remote_dir):
    model = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir).eval()
    position_ids = torch.cat([torch.arange(4), torch.arange(3)])[None]
    with pytest.raises(ValueError, match="position_ids restart inside a row"):
        model(ids(batch=1, length=7), position_ids=position_ids)


def test_packed_rows_with_one_row_of_position_ids_keep_their_examples_apart(model_dir):
    """position_ids `[1, T]` for a batch of B packed rows (the core takes them for every row): the restarts were
    not read (only a `[B, T]` shape was), so each row's examples attended to each other, silently."""
    model = RecurrentDepthForCausalLM.from_pretrained(model_dir).eval()
    a, b = ids(batch=2, length=5, seed=1), ids(batch=2, length=4, seed=2)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)])[None]
    with torch.no_grad():
        out = model(torch.cat([a, b], dim=1), position_ids=position_ids, use_cache=False, **STEPS)
        torch.testing.assert_close(out.logits[:, 5:], model(b, **STEPS).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits[:, :5], model(a, **STEPS).logits, atol=1e-5, rtol=1e-5)


def test_packed_rows_with_an_empty_transformers_cache_keep_their_examples_apart(model_dir):
    """An empty `DynamicCache` (what transformers passes to a first forward) hid the restarts: the rows were read
    as one sequence each, their examples attending to each other (silently)."""
    from transformers import DynamicCache

    model = RecurrentDepthForCausalLM.from_pretrained(model_dir).eval()
    a, b = ids(batch=1, length=5, seed=1), ids(batch=1, length=4, seed=2)
    position_ids = torch.cat([torch.arange(5), torch.arange(4)])[None]
    with torch.no_grad():
        out = model(torch.cat([a, b], dim=1), position_ids=position_ids, cache=DynamicCache(), **STEPS)
        torch.testing.assert_close(out.logits[:, 5:], model(b, **STEPS).logits, atol=1e-5, rtol=1e-5)
    assert out.cache is None  # (packed rows are not continued from a cache)


CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "ünï?"},
     {"role": "assistant", "content": "  9 é "}],
    [{"role": "user", "content": "a=1;b=a;?b"}, {"role": "assistant", "content": "1"}],
]


def test_assistant_only_loss_learns_the_tokens_rdepth_sft_learns(tmp_path):
    """trl's `assistant_only_loss=True` needs `{% generation %}` in the chat template: ours had none, so trl refused
    it ("not training-compatible"). Its labels must cover exactly what `rdepth sft` scores: each answer and its
    end of turn, never the header that opens the turn."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from trl.chat_template_utils import is_chat_template_stop_token_trained

    from recurrent_depth import ModelConfig
    from recurrent_depth.data.chat import ExampleEncoder, conversation

    make_model_dir(tmp_path / "chat")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "chat")
    assert is_chat_template_stop_token_trained(tokenizer)
    model = RecurrentDepthForCausalLM.from_pretrained(tmp_path / "chat")
    args = SFTConfig(output_dir=str(tmp_path / "out"), assistant_only_loss=True, max_steps=1, report_to=[],
                     per_device_train_batch_size=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list([{"messages": m} for m in CHATS]))
    encoder = ExampleEncoder(tmp_path / "chat", ModelConfig.from_json(tmp_path / "chat" / "config.json"))
    for i, messages in enumerate(CHATS):
        row, ours = trainer.train_dataset[i], encoder.encode(conversation({"messages": messages}, "x"), "x")
        assert row["input_ids"] == ours.ids
        assert [label != -100 for label in row["labels"]] == ours.scored
    assert trainer.train().training_loss > 0


def test_the_remote_file_checkpoints_each_core_step_with_the_same_gradients(remote_dir):
    """trl's configs turn gradient_checkpointing on by default: the exported model refused it when the trainer
    started ("does not support activation checkpointing"). Now each core step is recomputed in the backward pass,
    and the gradients are the ones without it."""
    model = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir).train()
    x = ids(batch=2, length=9)

    def gradients():
        model.zero_grad()
        model(x, labels=x, **STEPS).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.activation_checkpointing_enable()
    calls = []
    run = model._gradient_checkpointing_func
    model._gradient_checkpointing_func = lambda *args: calls.append(args[-1]) or run(*args)
    checkpointed = gradients()
    assert calls == list(range(STEPS["num_steps"]))
    assert plain.keys() == checkpointed.keys() and any(".core_block." in name for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    model.activation_checkpointing_disable()
    assert not model.gradient_checkpointing


@pytest.mark.parametrize("kind", ["library", "remote-code"])
def test_the_fused_head_under_accelerates_autocast_leaves_autocast_off(model_dir, remote_dir, kind):
    """trl's configs train in bf16 by default (accelerate wraps `model.forward` in one torch.autocast object), and the
    fused head calls `base_model`, which called the wrapped forward again, nested: the inner exit put back the outer
    entry's state, so autocast stayed on after the step, for everything the process ran next (silently bf16)."""
    if kind == "library":
        model = RecurrentDepthForCausalLM.from_pretrained(model_dir)
    else:
        model = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir)
    trl_utils.add_fused_lm_head(model)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # (accelerate's bf16)
    x = ids(batch=2, length=7)
    try:
        out = model(x, labels=x, fused_lm_head=True, **STEPS)
        assert not torch.is_autocast_enabled("cpu")
    finally:
        torch.set_autocast_enabled("cpu", False)
    assert torch.isfinite(out.loss)
