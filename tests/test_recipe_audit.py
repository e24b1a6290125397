"""The training recipe against the paper's numbers (docs/training-recipe.md, "Checked against the paper").

Pins what other tests leave open: the Takase std of *every* matrix type (test_model checks two), the ±3σ
truncation of weights and of s_0, the Huginn-0125 shape's init constants, and which core steps of a
truncated-backprop forward carry a gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train.optim import OptimConfig, build_optimizers

TRUNC_STD = 0.98658  # std of a unit normal truncated at ±3


@pytest.fixture(scope="module")
def paper_layout() -> rd.RecurrentDepthLM:
    """The paper's (2, 4, 2) layout at r̄ = 32, k = 8 (l = 2 + 32·4 + 2 = 132), at width 128."""
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=128, num_heads=2, intermediate_size=256, vocab_size=512,
                                     prelude_layers=2, core_layers=4, coda_layers=2, mean_recurrence=32,
                                     mean_backprop_depth=8)
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(cfg)


def test_huginn_shape_gives_the_papers_init_constants() -> None:
    """§4.1: sigma_h^2 = 2/(5h), sigma_out^2 = 1/(5hl), l = 132; embedding output scaled by sqrt(h)."""
    cfg = rd.ModelConfig.from_preset("huginn-0125")
    h, l_eff = cfg.hidden_size, cfg.effective_expected_depth
    assert l_eff == 132
    std = math.sqrt(2 / (5 * h))
    assert std == pytest.approx(0.0087039, rel=1e-5)  # the reference's init_values
    assert std / math.sqrt(2 * l_eff) == pytest.approx(math.sqrt(1 / (5 * h * l_eff)))
    assert std / math.sqrt(2 * l_eff) == pytest.approx(5.357e-4, rel=1e-3)
    assert cfg.embedding_scale and math.sqrt(h) == pytest.approx(72.6636, rel=1e-6)


def test_every_matrix_type_has_its_takase_std(paper_layout: rd.RecurrentDepthLM) -> None:
    """Out-projections (attn.proj, mlp.proj) at sigma_out, every other matrix (Wqkv, both halves of the
    gated fc, the adapter, the tied embedding) at sigma_h; all truncated at ±3 sigma; gains one, qk_bias zero."""
    model = paper_layout
    h = model.config.hidden_size
    std = math.sqrt(2 / (5 * h))
    out_std = math.sqrt(1 / (5 * h * 132))
    assert model.emb_scale == math.sqrt(h)
    assert model.lm_head.weight is model.transformer.wte.weight
    seen = set()
    for name, param in model.named_parameters():
        w = param.detach()
        if name.endswith(("norm_1.weight", "norm_2.weight", "norm_3.weight", "norm_4.weight", "ln_f.weight")):
            assert torch.equal(w, torch.ones_like(w)), name
            continue
        if name.endswith("qk_bias"):
            assert not w.any(), name
            continue
        target = out_std if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else std
        halves = w.chunk(2) if name.endswith("mlp.fc.weight") else (w,)  # gate | up: both at sigma_h
        for half in halves:
            assert half.std().item() / target == pytest.approx(TRUNC_STD, abs=0.03), name
            assert half.abs().max().item() <= 3 * target * (1 + 1e-6), name
        seen.add(name.split(".")[-2] if "." in name else name)
    assert {"wte", "Wqkv", "proj", "fc", "adapter"} <= seen


def test_initial_state_is_truncated_normal_with_variance_two_fifths(paper_layout: rd.RecurrentDepthLM) -> None:
    """§4.1: "the state s_0 is also sampled from a truncated normal distribution, here with variance 2/5"."""
    e = torch.zeros(8, 64, paper_layout.config.hidden_size)
    s0 = paper_layout.initial_state(e, 1.0, torch.Generator().manual_seed(0))
    sigma_s = math.sqrt(2 / 5)
    assert s0.std().item() == pytest.approx(sigma_s * TRUNC_STD, abs=0.01)
    assert s0.abs().max().item() <= 3 * sigma_s * (1 + 1e-6)


def test_only_the_last_k_core_steps_carry_gradient(paper_layout: rd.RecurrentDepthLM) -> None:
    """§3: "we backpropagate through only the last k iterations"; the prelude still learns through e."""
    model = paper_layout
    model.zero_grad()
    outputs: list[torch.Tensor] = []
    hook = model.transformer.core_block[-1].register_forward_hook(lambda _m, _i, out: outputs.append(out))
    try:
        ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
        out = model(ids, num_steps=(3, 2), labels=ids, generator=torch.Generator().manual_seed(2))
        for state in outputs:
            if state.requires_grad:
                state.retain_grad()
        out.loss.backward()
    finally:
        hook.remove()
    assert [state.requires_grad for state in outputs] == [False, False, False, True, True]
    assert all(state.grad is not None and state.grad.abs().sum() > 0 for state in outputs[3:])
    assert model.transformer.prelude[0].attn.Wqkv.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_huginn_recipe_groups_decay_as_the_official_code(paper_layout: rd.RecurrentDepthLM) -> None:
    """Weight decay on matrices, the adapter and the tied embedding; none on norms and qk_bias."""
    recipe = OptimConfig.from_preset("huginn-0125")
    groups = {g["name"]: g for g in build_optimizers(paper_layout, recipe).param_groups}
    assert groups["matrices"]["weight_decay"] == groups["embeddings"]["weight_decay"] == 4e-5
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert "transformer.adapter.weight" in groups["matrices"]["param_names"]
    assert groups["embeddings"]["param_names"] == ["transformer.wte.weight"]
    gains_and_biases = {n for n, p in paper_layout.named_parameters() if "norm" in n or n.startswith("transformer.ln_f")
                        or n.endswith("qk_bias")}
    assert set(groups["no_decay"]["param_names"]) == gains_and_biases
