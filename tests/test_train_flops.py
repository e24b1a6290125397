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
