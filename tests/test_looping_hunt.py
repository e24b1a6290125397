"""Looping bugs found by review: a deep copy's loop ran the original's layers, a failed `apply_loop` dropped the
loop applied before, and `rdepth loop search --top -1` silently cut the table."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.looping import LoopConfig, apply_loop, loop_of

CFG = LoopConfig(1, 2, iterations=3)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_a_deep_copy_of_a_looped_model_loops_its_own_layers():
    original = _model()
    apply_loop(original, CFG)
    clone = copy.deepcopy(original)
    for p in clone.model.layers[1].parameters():  # the copy diverges from the original
        p.add_(0.5)
    reference = _model()
    reference.load_state_dict(clone.state_dict())
    apply_loop(reference, CFG)
    torch.testing.assert_close(clone(_ids()).logits, reference(_ids()).logits, atol=1e-6, rtol=0)


@torch.no_grad()
def test_a_refused_apply_loop_keeps_the_loop_applied_before():
    model = _model()
    apply_loop(model, CFG)
    looped = model(_ids()).logits
    with pytest.raises(ValueError, match="does not fit a model with 4 decoder layers"):
        apply_loop(model, LoopConfig(1, 7))
    with pytest.raises(ValueError, match="apply_loop needs a LoopConfig or a dict of its fields, got list"):
        apply_loop(model, [1, 2])
    assert loop_of(model) == CFG and model.config.loop == CFG.to_dict()
    torch.testing.assert_close(model(_ids()).logits, looped, atol=0, rtol=0)


def test_search_with_a_negative_top_is_one_line_error(tmp_path, capsys):
    assert main(["loop", "search", "--model", str(tmp_path), "--top", "-1", "--out", str(tmp_path / "o")]) == 2
    assert "--top must be an integer >= 0, got -1" in capsys.readouterr().err
