"""Mutation hunt, round 5: tests that kill surviving mutants of looping/ (config, loop, evaluate, structure),
model/depth.py, train/schedule.py, train/optim.py, train/batches.py, train/distributed.py's reductions and
data/shards.py, each against the documented rule or a plain reference computation (not the current output)."""

from __future__ import annotations

import pytest

from recurrent_depth.model.depth import DepthSampler


def test_curriculum_rounds_the_mean_to_the_nearest_integer_for_fixed_and_uniform():
    """On the ramp, `fixed` and `uniform` *round* the mean (module docstring): 1 + 7 * 1/4 = 2.75 is 3, not the
    2 a truncation gives; the fixed scheme then draws exactly that depth."""
    sampler = DepthSampler(mean_recurrence=8, backprop_depth=8, scheme="fixed", ramp_steps=4, ramp_start=1.0)
    for step in range(6):
        mean = 1 + (8 - 1) * min(step, 4) / 4
        assert sampler.mean_at(step) == float(max(1, round(mean)))
        assert sampler.total_steps(step) == max(1, round(mean))


# ---------------------------------------------------------------------------------------- looping
def test_a_loop_window_starting_below_layer_zero_is_refused():
    """The window rule is 0 <= start <= end (`check_window`): start -1 is refused in one line, start 0 taken."""
    from recurrent_depth.looping.config import LoopConfig, check_window

    with pytest.raises(ValueError, match="0 <= start <= end"):
        LoopConfig(-1, 2)
    with pytest.raises(ValueError, match="0 <= start <= end"):
        check_window(-1, 0, "--windows")
    assert LoopConfig(0, 0).width == 1


def test_rk_beta_zero_is_damped_euler_and_beta_one_the_base_model():
    """`beta` lies in [0, 1] with both ends allowed (LoopConfig docstring: 1 returns the base model, 0 is damped
    Euler); `combine` matches a plain damped-Euler loop at beta 0 and g(x0) at beta 1."""
    import torch

    from recurrent_depth.looping.config import LoopConfig
    from recurrent_depth.looping.loop import combine

    assert LoopConfig(0, 1, rule="rk", beta=0.0).beta == 0.0
    assert LoopConfig(0, 1, rule="rk", beta=1.0).beta == 1.0
    weight = torch.tensor([[0.5, -0.3], [0.2, 0.9]])

    def g(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight) + x

    x0, K = torch.tensor([[0.3, -1.2]]), 3
    damped = x0.clone()
    for _ in range(K):
        damped = damped + (g(damped) - damped) / K
    torch.testing.assert_close(combine("rk", K, 0.0, x0, g), damped)
    torch.testing.assert_close(combine("damped", K, 0.5, x0, g), damped)
    torch.testing.assert_close(combine("rk", K, 1.0, x0, g), g(x0))


def test_layer_call_helpers_keep_the_output_form_and_want_three_dim_hidden_states():
    """`with_output_hidden` keeps a tuple output's other items (the same form, other hidden states); `hidden_of`
    refuses hidden states that are not [B, T, h]."""
    import torch

    from recurrent_depth.looping.structure import hidden_of, with_output_hidden

    new, extra = torch.ones(1, 2, 3), object()
    out = with_output_hidden((torch.zeros(1, 2, 3), extra), new)
    assert out[0] is new and out[1] is extra and len(out) == 2
    with pytest.raises(ValueError, match=r"hidden states \[B, T, h\]"):
        hidden_of((torch.zeros(2, 3),), {}, "layer 0")


def test_a_layer_list_of_mixed_block_types_is_not_taken_for_the_decoder_layers():
    """Decoder layers are one `nn.ModuleList` of `num_hidden_layers` blocks *of one class*: a list mixing classes
    is not it, and a model with no other list is refused in one line."""
    from types import SimpleNamespace

    from torch import nn

    from recurrent_depth.looping.structure import find_decoder_layers

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=2, is_encoder_decoder=False)
            self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 2, 1)])

        def can_generate(self) -> bool:
            return True

    with pytest.raises(ValueError, match="found no module lists of 2 same-type decoder layers"):
        find_decoder_layers(Mixed())


def test_a_model_directory_with_zero_layers_is_refused_before_loading(tmp_path):
    """`check_loopable_dir` wants each size in config.json to be an integer in [1, limit]: 0 layers is refused."""
    import json

    from recurrent_depth.looping.config import check_loopable_dir

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 0, "hidden_size": 32}))
    with pytest.raises(ValueError, match=r"num_hidden_layers must be an integer in \[1, "):
        check_loopable_dir(tmp_path)


# ---------------------------------------------------------------------------------------- optimizer
def test_huginn_adam_atan2_update_scales_the_denominator_by_b():
    """The atan2 update is a * atan2(m, b * sqrt(v)) (HuginnAdam docstring): one step with running_init (m = g,
    v = g * g), no bias correction, clipping or decay moves p by lr * a * atan2(g, b * |g|)."""
    import torch

    from recurrent_depth.train.optim import HuginnAdam

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    start, grad = param.detach().clone(), torch.randn(5)
    opt = HuginnAdam([param], lr=0.1, atan2_a=1.5, atan2_b=2.0, update_clipping=False, bias_correction="none")
    param.grad = grad.clone()
    opt.step()
    torch.testing.assert_close(param.detach(), start - 0.1 * 1.5 * torch.atan2(grad, 2.0 * grad.abs()))


def test_huginn_adam_without_atan2_adds_eps_to_the_denominator():
    """Without atan2 the update is m / (sqrt(v) + eps) (HuginnAdam docstring): with m = g, v = g * g (running
    init) and a large eps the step is lr * g / (|g| + eps), and a zero gradient moves nothing (no 0 / 0)."""
    import torch

    from recurrent_depth.train.optim import HuginnAdam

    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    start, grad = param.detach().clone(), torch.tensor([0.3, 0.0, -1.2])
    opt = HuginnAdam([param], lr=0.1, eps=0.5, atan2=False, update_clipping=False, bias_correction="none")
    param.grad = grad.clone()
    opt.step()
    torch.testing.assert_close(param.detach(), start - 0.1 * grad / (grad.abs() + 0.5))


# ---------------------------------------------------------------------------------------- LR schedule
def test_cooldown_fraction_is_that_fraction_of_the_run_to_the_nearest_step():
    """`cooldown_fraction` of a run is a whole number of steps, the nearest one: 0.29 of 100 steps is 29 (the
    float product 28.999... must not truncate to 28), 0.9 of 3 steps is 3."""
    from recurrent_depth.train.optim import OptimConfig

    for fraction, total, steps in ((0.29, 100, 29), (0.9, 3, 3), (0.2, 1000, 200)):
        assert OptimConfig(cooldown_fraction=fraction).cooldown_for(total) == steps


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def test_remove_loop_takes_the_loop_out_of_the_config_too():
    """`remove_loop` returns the base model: the hooks go and so does `config.loop`, which `apply_loop` wrote
    (left there, `save_pretrained` would store a loop the model no longer runs and loading it would re-apply it)."""
    from recurrent_depth.looping import apply_loop, loop_of, remove_loop

    model = _tiny_llama()
    apply_loop(model, {"start": 1, "end": 2, "iterations": 3})
    assert model.config.loop["iterations"] == 3
    remove_loop(model)
    assert loop_of(model) is None
    assert getattr(model.config, "loop", None) is None


def test_held_out_windows_stop_once_max_tokens_targets_are_taken():
    """`held_out_windows` gives `max_tokens` targets in all and every window scores at least one: once the budget
    is spent no more (one-token, target-free) windows follow, from this text or the next."""
    from recurrent_depth.looping.evaluate import held_out_windows

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    texts = ["abcdefghij", "klmnop"]
    rows = held_out_windows(Tok(), texts, seq_len=4, max_tokens=3, bos_token_id=1)
    assert rows == [[1, *map(ord, "abc")]]  # the first window alone holds the 3 targets
    rows = held_out_windows(Tok(), texts, seq_len=4, max_tokens=5, bos_token_id=None)
    assert rows == [list(map(ord, "abcd")), list(map(ord, "def"))]


def test_windows_loss_of_a_padded_batch_scores_only_the_windows_own_targets():
    """`windows_loss` is the mean next-token loss over the windows' own targets, padding masked: a batch of
    windows of different lengths gives the mean of per-token losses computed on each window alone."""
    import torch
    import torch.nn.functional as F

    from recurrent_depth.looping.evaluate import windows_loss

    model = _tiny_llama().eval()
    windows = [[5, 9, 3, 7, 11, 2], [4, 8, 6], [13, 1]]
    losses = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            losses.append(F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none"))
    reference = float(torch.cat(losses).mean())
    assert windows_loss(model, windows, batch_size=3, pad_token_id=0) == pytest.approx(reference, rel=1e-5)


def test_a_window_as_wide_as_the_model_is_a_candidate():
    """`candidate_windows` lists every window of each width 1..num_layers that fits: width num_layers is the one
    window of all the layers; only a width outside 1..num_layers is refused."""
    from recurrent_depth.looping.evaluate import candidate_windows

    assert candidate_windows(3, [3]) == [(0, 2)]
    with pytest.raises(ValueError, match="outside 1..3"):
        candidate_windows(3, [4])


def test_windows_as_long_as_the_position_table_are_taken():
    """`check_seq_len` refuses windows *longer* than the model's positions; one exactly as long fits the table."""
    from types import SimpleNamespace

    from recurrent_depth.looping.evaluate import check_seq_len

    check_seq_len(SimpleNamespace(n_positions=8), 8)
    with pytest.raises(ValueError, match="longer than the model's 8 positions"):
        check_seq_len(SimpleNamespace(n_positions=8), 9)


def test_model_memory_check_counts_four_bytes_per_parameter(monkeypatch):
    """`check_model_memory` refuses a model whose float32 weights (4 bytes a parameter) exceed the machine's memory:
    embedding and head (2 * vocab * hidden) plus, per layer, attention (4 * hidden^2) and the gated MLP
    (3 * hidden * inner)."""
    import recurrent_depth.looping.config as loop_config

    layers, hidden, inner, vocab = 2, 8, 16, 10
    params = 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner)
    monkeypatch.setattr(loop_config, "_physical_memory", lambda: 4 * params)
    loop_config.check_model_memory(layers, hidden, inner, vocab, "this config describes")
    monkeypatch.setattr(loop_config, "_physical_memory", lambda: 4 * params - 1)
    with pytest.raises(ValueError, match="this config describes a model of about"):
        loop_config.check_model_memory(layers, hidden, inner, vocab, "this config describes")
