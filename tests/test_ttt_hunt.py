"""TTT-E2E on the models users have: bf16 weights, tied heads, families without an adapter,
quantized weights (inference/ttt_e2e.py).

References: a plain inner loop written here (float32 masters for bf16 weights); the parameter
names `named_parameters(remove_duplicate=False)` lists.
"""

from __future__ import annotations

import copy

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import ttt_e2e
from recurrent_depth.inference.options import GenerationOptions, OptionError
from recurrent_depth.weight_quant import quantize_weights

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 17, 42, 99, 3, 77, 12, 17, 42, 8, 61]])


def resolved(model: rd.RecurrentDepthLM, **options) -> object:
    return GenerationOptions(**options).validate(model.config.mean_recurrence, None, model.config.init_scale)


def test_bf16_weights_take_every_sgd_step_through_a_float32_master(tiny_model):
    """A bf16 weight stepped in place loses the updates below its rounding step (at SGD lr 1e-3 most
    of them); the shadow must hold the float32 sum of the steps, rounded once."""
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    steps, lr = 3, 1e-3
    options = resolved(model, ttt_params="core-mlp", ttt_steps=steps, ttt_lr=lr, init_scale=0)
    adapted = ttt_e2e.adapt(model, PROMPT, options)
    depth = ttt_e2e.inner_depth(model, options)

    reference = copy.deepcopy(model)
    chosen = [p for n, p in reference.named_parameters() if n in adapted.parameters]
    for p in chosen:
        p.requires_grad_(True)
    masters = [p.detach().float() for p in chosen]
    for _ in range(steps):
        loss = reference(PROMPT, num_steps=depth, labels=PROMPT, init_scale=0).loss
        grads = torch.autograd.grad(loss, chosen)
        with torch.no_grad():
            for p, master, g in zip(chosen, masters, grads):
                master.add_(g.float(), alpha=-lr)
                p.copy_(master)
    shadow = dict(adapted.model.named_parameters())
    for name, p in zip(adapted.parameters, chosen):
        assert shadow[name].dtype == torch.bfloat16
        assert torch.equal(shadow[name], p), name
    # the copy's bytes count the masters: per weight 2 (bf16) + 2 (its gradient) + 4 + 4 (master, its gradient)
    numel = sum(p.numel() for p in chosen)
    assert ttt_e2e.copy_bytes(model, adapted.parameters, "sgd") == numel * 12
    assert ttt_e2e.copy_bytes(model, adapted.parameters, "adam") == numel * 20
    assert ttt_e2e.copy_bytes(tiny_model, adapted.parameters, "adam") == numel * 16  # float32: as before


def test_a_tied_head_answers_to_its_own_name(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.transformer.wte.weight
    assert ttt_e2e.select_parameters(tiny_model, "lm_head.weight") == ["transformer.wte.weight"]
    out = rd.generate(tiny_model, PROMPT, max_new_tokens=2, init_scale=0, ttt_params="lm_head.*", ttt_steps=1)
    assert out.stats["ttt_parameters"] == 1


def test_a_named_set_takes_the_parts_the_family_has():
    """Ouro has no adapter, prelude or coda: `core` is its core blocks; `prelude` names nothing."""
    torch.manual_seed(0)
    ouro = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro")).eval()
    names = ttt_e2e.select_parameters(ouro, "core")
    assert names == [n for n, _ in ouro.named_parameters() if n.startswith("transformer.core_block.")]
    with pytest.raises(OptionError, match="ttt_params='prelude' is invalid: this model has no such weights"):
        ttt_e2e.select_parameters(ouro, "prelude")
    with pytest.raises(OptionError, match="'nope.\\*' matches no parameter"):
        ttt_e2e.select_parameters(ouro, "transformer.core_block.*,nope.*")


@pytest.mark.parametrize("spec", ["core-mlp", "all"])
def test_quantized_weights_are_refused_not_silently_skipped(tiny_model, spec):
    """int8 linears hold their weights as buffers: `all` used to train only the norms and embedding,
    `core-mlp` to report that the model has no MLP weights."""
    model = copy.deepcopy(tiny_model)
    quantize_weights(model, "int8")
    with pytest.raises(OptionError, match=r"names weights held quantized \(int8\), e\.g\. 'transformer\."):
        rd.generate(model, PROMPT, max_new_tokens=2, ttt_params=spec, ttt_steps=1)
    assert ttt_e2e.select_parameters(model, "transformer.ln_f.weight") == ["transformer.ln_f.weight"]


def test_the_copy_limit_message_counts_the_float32_masters_of_bf16_weights(tiny_model):
    """A bf16 copy holds float32 masters too (copy_bytes counts them); the server's over-the-limit 400 says
    what the copy holds through copy_parts, which said only "weights and gradients"."""
    names = ttt_e2e.select_parameters(tiny_model, "core-mlp")
    assert ttt_e2e.copy_parts(tiny_model, names, "adam") == "weights and gradients, Adam moments"
    low = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert ttt_e2e.copy_parts(low, names, "sgd") == "weights and gradients, float32 masters of its bf16/fp16 weights"


def test_a_model_built_under_inference_mode_is_refused_in_one_line(tiny_config):
    """Its weights are inference tensors, which autograd cannot save: TTT-E2E and GradMem failed with torch's
    multi-line "Inference tensors cannot be saved for backward" deep in their first step."""
    with torch.inference_mode():
        model = rd.RecurrentDepthLM(tiny_config).eval()
    with pytest.raises(ValueError, match=r"^TTT-E2E \(ttt_params\) backpropagates .* created under "
                                         r"torch.inference_mode\(\)"):
        rd.generate(model, PROMPT, max_new_tokens=1, ttt_params="core-mlp", ttt_steps=1)
    with pytest.raises(ValueError, match=r"^GradMem \(gradmem_tokens\) backpropagates"):
        rd.generate(model, PROMPT, max_new_tokens=1, gradmem_tokens=2, gradmem_steps=1, gradmem_query_tokens=4)
