"""The architecture-family fields of ModelConfig (block layouts, RoPE forms, injections, norms, exit gate).

Each layout and option is checked against a plain re-statement of its formula written here, and the
incremental (cached) path against the full forward. Huginn's own outputs are pinned by the golden tests.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.config import HUGINN_ARCHITECTURE
from recurrent_depth.model.layers import apply_rope_half, rope_frequencies

BASE = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48,
            prelude_layers=1, core_layers=2, coda_layers=1, mean_recurrence=3, max_seq_len=64)


def randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter perturbed (norm gains away from 1, biases away from 0), so no term vanishes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_huginn_defaults_are_the_architecture_defaults():
    config = rd.ModelConfig()
    assert config.uses_huginn_layout
    assert all(getattr(config, k) == v for k, v in HUGINN_ARCHITECTURE.items())
    assert not rd.ModelConfig(block_layout="pre-norm").uses_huginn_layout


@pytest.mark.parametrize("layout", ["sandwich", "peri-norm", "pre-norm", "post-norm"])
def test_block_layouts_follow_their_formulas(layout):
    config = rd.ModelConfig(**BASE, block_layout=layout, qk_bias=False)
    model = randomised(rd.RecurrentDepthLM(config))
    block = model.transformer.core_block[0]
    x = torch.randn(2, 5, 32)
    ctx = model.make_context(torch.zeros(2, 5, dtype=torch.long))
    key = ("core", 0, 0)
    eps = config.norm_eps

    def mix(v):
        return block.attn(v, ctx, key)

    def n(i, v):
        return rms(v, getattr(block, f"norm_{i}").weight, eps)

    if layout == "sandwich":
        h = n(2, x + mix(n(1, x)))
        want = n(4, h + block.mlp(n(3, h)))
    elif layout == "peri-norm":
        h = x + n(2, mix(n(1, x)))
        want = h + n(4, block.mlp(n(3, h)))
    elif layout == "pre-norm":
        h = x + mix(n(1, x))
        want = h + block.mlp(n(3, h))
    else:
        h = x + n(2, mix(x))
        want = h + n(4, block.mlp(h))
    torch.testing.assert_close(block(x, ctx, key), want, rtol=1e-5, atol=1e-5)
    expected_norms = {"sandwich": 4, "peri-norm": 4, "pre-norm": 2, "post-norm": 2}[layout]
    assert sum(name.startswith("norm_") for name, _ in block.named_children()) == expected_norms
    assert config.num_parameters() == model.num_parameters()


def test_half_rotation_equals_rotate_half():
    x = torch.randn(2, 3, 4, 8)
    angles = torch.randn(2, 3, 1, 4)
    cos, sin = angles.cos(), angles.sin()
    cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotated = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(apply_rope_half(x, cos, sin), x * cos2 + rotated * sin2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_scaling_frequencies_equal_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from recurrent_depth.config import rope_scaling_key

    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                     rope_parameters={**scaling, "rope_theta": 500000.0})
    want, attention_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    assert attention_scale == 1.0
    got = rope_frequencies(128, 500000.0, rope_scaling_key(scaling))
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_bad_architecture_values_are_one_line_errors():
    for field, value, needle in [("block_layout", "sideways", "block_layout"), ("injection", "mul", "injection"),
                                 ("rope_style", "full", "rope_style"), ("mlp_activation", "tanh", "mlp_activation"),
                                 ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "yarn"),
                                 ("rope_scaling", {"rope_type": "linear"}, "factor"),
                                 ("qk_norm_full_width", True, "qk_norm_full_width")]:
        with pytest.raises(ValueError, match=needle) as info:
            rd.ModelConfig(**BASE, **{field: value})
        assert "\n" not in str(info.value)


def test_gemma_fields_are_checked_and_refused_where_not_implemented():
    """query_pre_attn_scalar, the soft-caps and layer_rope_bases: one-line errors for bad values and for layers
    whose mixer does not implement them; the fused runner and the remote-code export refuse them (the model then
    decodes with the reference runner); each changes the logits."""
    from recurrent_depth.accel.runner import FastRunner
    from recurrent_depth.integrations.export import check_exportable

    for field, value in [("query_pre_attn_scalar", 0), ("query_pre_attn_scalar", "256"),
                         ("attn_logit_softcapping", -1.0), ("final_logit_softcapping", True),
                         ("layer_rope_bases", [1e4]), ("layer_rope_bases", [1e4, None, 0.5, None])]:
        with pytest.raises(ValueError, match=rf"^ModelConfig.{field}=.* is invalid: expected") as info:
            rd.ModelConfig(**BASE, **{field: value})
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        rd.ModelConfig(**BASE, query_pre_attn_scalar=16.0, mup_base_width=16, tie_embeddings=False)
    for field, value in [("attn_logit_softcapping", 5.0), ("layer_rope_bases", [None, 1e4, None, None])]:
        with pytest.raises(ValueError, match=rf"^ModelConfig.{field} applies to layer 1, whose mixer is not"):
            rd.RecurrentDepthLM(rd.ModelConfig(**BASE, mixer={"core": "linear_attention"}, **{field: value}))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = randomised(rd.RecurrentDepthLM(rd.ModelConfig(**BASE)))
    assert FastRunner.supports(plain)
    for field, value in [("attn_logit_softcapping", 1.0), ("final_logit_softcapping", 2.0),
                         ("layer_rope_bases", [None, 3.0, None, None]), ("query_pre_attn_scalar", 2.0)]:
        config = rd.ModelConfig(**BASE, **{field: value})
        model = rd.RecurrentDepthLM(config).eval()
        model.load_state_dict(plain.state_dict())
        assert not FastRunner.supports(model), field
        with pytest.raises(ValueError, match="Huginn's architecture only"):
            check_exportable(config)
        with torch.no_grad():
            assert not torch.allclose(model(ids, num_steps=2, init_scale=0.0).logits,
                                      plain(ids, num_steps=2, init_scale=0.0).logits, atol=1e-3), field


@pytest.mark.parametrize("kv_quant", [None, "k=prod:3.5,v=mse:3.5"])
def test_gemma_fields_batch_in_the_serving_pool_as_generate_alone(kv_quant):
    """A model with soft-capped attention and head, windows and a RoPE base per layer (a retrofitted Gemma 2 / 3) in
    the serving batcher (the model's own modules: the fused runner refuses it), rows of different lengths: each row's
    tokens are generate's alone, with a float and a quantized KV cache (soft-capped layers read its decoded columns)."""
    from recurrent_depth.inference.options import GenerationOptions
    from recurrent_depth.serving.batch import BatchDecoder, RowRequest

    torch.manual_seed(3)
    config = rd.ModelConfig(**BASE, block_layout="peri-norm", rope_style="half", attn_logit_softcapping=1.5,
                            final_logit_softcapping=3.0, attention_windows=[3, None, 2, None],
                            layer_rope_bases=[100.0, None, 10.0, None])
    model = randomised(rd.RecurrentDepthLM(config))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (7, 3)]
    kw = dict(max_new_tokens=4, num_steps=2, init_scale=0.0)
    dec = BatchDecoder(model, max_rows=2, kv_quant=kv_quant)
    out = {}
    for j, prompt in enumerate(prompts):
        opts = GenerationOptions(**kw).validate(config.mean_recurrence)
        out[j] = [dec.add(RowRequest(prompt, opts, j, top_logprobs=0), tag=j)[1].token]
    while len(dec):
        for seq, result in dec.step():
            out[seq.tag].append(result.token)
            if len(out[seq.tag]) >= kw["max_new_tokens"]:
                dec.remove(seq)
    for j, prompt in enumerate(prompts):
        alone = rd.generate(model, torch.tensor(prompt), seed=j, kv_quant=kv_quant, **kw)
        assert out[j] == alone.token_lists()[0], j


def test_ouro_style_recurrence_and_exit_gate():
    """injection none, s_0 = e, ln_f after every step, no second norm, and the gate on each step's state."""
    config = rd.ModelConfig(**{**BASE, "prelude_layers": 0, "coda_layers": 0}, block_layout="peri-norm",
                            rope_style="half", injection="none", state_init="embedding", embedding_scale=False,
                            step_norm=True, norm_before_coda=False, final_norm=False, exit_gate=True,
                            qk_bias=False, tie_embeddings=False)
    model = randomised(rd.RecurrentDepthLM(config))
    assert "adapter" not in dict(model.transformer.named_children())
    ids = torch.randint(0, 64, (2, 6))
    out = model(ids, num_steps=3, output_all_states=True)
    ctx = model.make_context(ids)
    h = model.transformer.wte(ids)
    for step in range(3):
        for j, block in enumerate(model.transformer.core_block):
            h = block(h, ctx, ("core", j, step))
        h = rms(h, model.transformer.ln_f.weight, config.norm_eps)
        torch.testing.assert_close(out.all_states[step + 1], h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, model.lm_head(h), rtol=1e-5, atol=1e-5)
    gate = model.transformer.exit_gate
    torch.testing.assert_close(model.exit_probability(h), torch.sigmoid(gate(h)).squeeze(-1), rtol=1e-6, atol=1e-6)
    assert config.num_parameters() == model.num_parameters()


def test_additive_injection_and_unscaled_embedding():
    config = rd.ModelConfig(**BASE, injection="add", embedding_scale=False, block_layout="pre-norm",
                            rope_style="half", norm_before_coda=False, qkv_bias=True, mlp_activation="gelu_tanh")
    model = randomised(rd.RecurrentDepthLM(config))
    ids = torch.randint(0, 64, (1, 5))
    ctx = model.make_context(ids)
    e = model.embed(ids, ctx)
    x = model.transformer.wte(ids)
    torch.testing.assert_close(e, model.transformer.prelude[0](x, ctx, ("prelude", 0)))
    s = torch.randn(1, 5, 32)
    manual = s + e
    for j, block in enumerate(model.transformer.core_block):
        manual = block(manual, ctx, ("core", j, 0))
    torch.testing.assert_close(model.core_step(s, e, 0, ctx), manual)
    assert model.transformer.core_block[0].attn.Wqkv.bias is not None
    assert config.num_parameters() == model.num_parameters()
    assert model.transformer.core_block[0].mlp.act(torch.tensor(1.0)) == pytest.approx(
        F.gelu(torch.tensor(1.0), approximate="tanh").item())
    assert math.isclose(model.emb_scale, 1.0)


@pytest.mark.parametrize("layout,extra", [
    ("peri-norm", dict(injection="none", state_init="embedding", step_norm=True, norm_before_coda=False,
                       final_norm=False, exit_gate=True, prelude_layers=0, coda_layers=0)),
    ("post-norm", dict(qk_norm=True, qk_norm_full_width=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("pre-norm", dict(qk_norm=True, qkv_bias=True, norm_before_coda=False)),
    # Gemma 2 / 3: soft-capped attention (plain math) and head, the logit scale, a window and a RoPE base per layer
    ("peri-norm", dict(attn_logit_softcapping=1.5, final_logit_softcapping=3.0, query_pre_attn_scalar=3.0, qk_norm=True,
                       attention_windows=[3, None, 2, None], layer_rope_bases=[100.0, None, 10.0, None])),
])
def test_prefill_then_decode_equals_the_full_forward(layout, extra):
    config = rd.ModelConfig(**{**BASE, **extra}, block_layout=layout, rope_style="half", qk_bias=False,
                            embedding_scale=False, init_scale=0.0)
    model = randomised(rd.RecurrentDepthLM(config))
    ids = torch.randint(0, 64, (2, 9))
    full = model(ids, num_steps=3).logits
    for fast in (True, False):
        out = rd.generate(model, ids[:, :6], max_new_tokens=3, num_steps=3, teacher_tokens=ids[:, 6:9],
                          output_logits=True, fast=fast, init_scale=0.0)
        torch.testing.assert_close(out.logits[:, :3], full[:, 5:8], rtol=1e-4, atol=1e-4)


def test_remote_code_export_refuses_other_architectures(tmp_path):
    from recurrent_depth.integrations.export import check_exportable

    with pytest.raises(ValueError, match="Huginn's architecture only.*block_layout"):
        check_exportable(rd.ModelConfig(**BASE, block_layout="pre-norm"))
    check_exportable(rd.ModelConfig(**BASE))
