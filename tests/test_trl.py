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
