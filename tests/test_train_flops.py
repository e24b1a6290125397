"""Hand-counted training FLOPs (the AFU numerator) against torch's FLOP counter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import recurrent_depth as rd
from recurrent_depth.train.flops import attention_flops, training_step_flops


@pytest.fixture
def model():
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=48, num_heads=4, intermediate_size=100, vocab_size=300)
    return rd.RecurrentDepthLM(cfg).train()


@pytest.mark.parametrize("num_steps", [(0, 1), (3, 2), (0, 3)], ids=["baseline", "n3-k2", "k3"])
def test_matmul_flops_match_the_counter(model, num_steps):
    """torch counts the linear layers (fwd + bwd) exactly; SDPA counts 0 on CPU, so attention is left out."""
    cfg, B, T = model.config, 3, 17
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, T)), num_steps=num_steps).logits.sum().backward()
    flops = training_step_flops(cfg, B, T, num_steps)
    attn_layers_with_grad = cfg.prelude_layers + cfg.coda_layers + num_steps[1] * cfg.core_layers
    attention_backward = 2 * B * T * attention_flops(cfg, T) * attn_layers_with_grad
    assert counter.get_total_flops() == flops.total - flops.attention_forward - attention_backward


def test_attention_is_half_of_the_full_square(model):
    """The math SDPA kernel computes the full T x T scores (masked afterwards); causal work is half of it."""
    cfg, B, T = model.config, 2, 16
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, T)), num_steps=2)
    flops = training_step_flops(cfg, B, T, (0, 2))
    linear = flops.forward - flops.attention_forward
    assert counter.get_total_flops() - linear == 2 * flops.attention_forward


@pytest.mark.parametrize(
    ("mixer", "options"),
    [
        ("attention", {"core": {"num_kv_heads": 1}}),
        ({"prelude": "attention", "core": "attention", "coda": "attention"}, {"attention": {"num_kv_heads": 2}}),
    ],
    ids=["core-mqa", "per-part-dict-gqa"],
)
def test_per_part_attention_options_are_counted(mixer, options):
    """Options the model builds from (GQA per part, a per-part mixer dict) change the count; they were ignored
    (or the dict rejected)."""
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=48, num_heads=4, intermediate_size=100, vocab_size=300,
                                     mixer=mixer, mixer_options=options)
    model = rd.RecurrentDepthLM(cfg).train()
    B, T, num_steps = 2, 9, (2, 1)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, T)), num_steps=num_steps).logits.sum().backward()
    flops = training_step_flops(cfg, B, T, num_steps)
    attention_backward = 2 * B * T * attention_flops(cfg, T) * (cfg.prelude_layers + cfg.coda_layers + cfg.core_layers)
    assert counter.get_total_flops() == flops.total - flops.attention_forward - attention_backward



@pytest.mark.parametrize(
    ("changes", "num_steps", "prelude_grad"),
    [
        ({"injection": "add"}, (2, 1), True),
        ({"injection": "diagonal"}, (2, 1), True),
        ({"injection": "none", "state_init": "embedding"}, (0, 2), True),
        ({"injection": "none", "state_init": "embedding"}, (2, 1), False),  # truncation detaches e's only path
        ({"injection": "none"}, (0, 2), False),  # s_0 random and e never injected: the prelude gets no gradient
        ({"coda_projection": True}, (2, 1), True),
        ({"value_embeddings": [0, 1, 3]}, (2, 1), True),  # prelude, core (every step) and coda gates
        ({"injection": "diagonal", "coda_projection": True, "value_embeddings": [1]}, (1, 2), True),  # Parcae's
    ],
    ids=["add", "diagonal", "none-embedding", "none-embedding-truncated", "none-random", "coda-projection",
         "value-embeddings", "parcae"],
)
def test_injection_coda_projection_and_value_gates_are_counted(changes, num_steps, prelude_grad):
    """Every step was charged concat's 2h -> h adapter whatever the injection (add and none have no matmul,
    diagonal an h x h one), Parcae's coda projection and value-embedding gates were left out, and the prelude's
    backward was counted where no gradient reaches it."""
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=48, num_heads=4, intermediate_size=100, vocab_size=300,
                                     **changes)
    model = rd.RecurrentDepthLM(cfg).train()
    B, T = 2, 9
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, T)), num_steps=num_steps).logits.sum().backward()
    flops = training_step_flops(cfg, B, T, num_steps)
    with_grad = cfg.prelude_layers * prelude_grad + cfg.coda_layers + num_steps[1] * cfg.core_layers
    attention_backward = 2 * B * T * attention_flops(cfg, T) * with_grad
    assert counter.get_total_flops() == flops.total - flops.attention_forward - attention_backward

def test_sliding_window_counts_only_the_band():
    cfg = rd.ModelConfig.from_preset("tiny", mixer_options={"core": {"window": 4}})
    full = rd.ModelConfig.from_preset("tiny")
    T, H, D = 16, cfg.num_heads, cfg.head_dim
    # pairs in the band: the causal triangle T^2/2 less the triangle beyond the window (T-W)^2/2
    band = 4 * H * D * (T**2 / 2 - (T - 4) ** 2 / 2)
    got = training_step_flops(cfg, 1, T, (3, 0)).attention_forward
    assert got == training_step_flops(full, 1, T, (0, 0)).attention_forward + 3 * cfg.core_layers * band
    assert attention_flops(cfg, T, window=T) == attention_flops(cfg, T, window=None) == 2 * H * D * T


def test_per_layer_windows_are_counted_layer_by_layer():
    """`attention_windows` (a retrofitted Qwen2's sliding layers) was not counted: every layer read as full."""
    windowed = rd.ModelConfig.from_preset("tiny", attention_windows=[None, 4, None, None])  # one of the 2 core layers
    same_core = rd.ModelConfig.from_preset("tiny", mixer_options={"core": {"window": 4}})
    full = rd.ModelConfig.from_preset("tiny")
    T, steps = 16, (3, 0)
    got = training_step_flops(windowed, 1, T, steps).attention_forward
    want = (training_step_flops(full, 1, T, steps).attention_forward
            + training_step_flops(same_core, 1, T, steps).attention_forward) / 2  # half the core windowed
    assert got == pytest.approx(want) and got < training_step_flops(full, 1, T, steps).attention_forward


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 8, (0, 1)), "batch"), ((1, 0, (0, 1)), "seq_len"), ((1, 8, (-1, 1)), "num_steps"), ((1, 8, 3), "num_steps")],
    ids=["batch0", "seq0", "negative-steps", "int-steps"],
)
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        training_step_flops(rd.ModelConfig.from_preset("tiny"), *args)
