"""The core model: the paper's forward pass, depth control, padding, gradients, bad input."""

import math
import re

import pytest
import torch

import recurrent_depth as rd


def ids(B=2, T=11, vocab=256, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_output_shapes_and_dtypes(tiny_model):
    out = tiny_model(ids(), num_steps=3, init_scale=0.0, output_all_states=True)
    assert out.logits.shape == (2, 11, 256) and out.logits.dtype == torch.float32
    assert out.latent_states.shape == (2, 11, 64)
    assert out.all_states.shape == (4, 2, 11, 64)  # s_0 .. s_3
    assert torch.equal(out.all_states[-1], out.final_state)
    # latent_states is ln_f(s_r): unit RMS with unit norm weights
    rms = out.latent_states.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)
    assert out.num_steps == (0, 3)


def test_causality(tiny_model):
    x = ids(B=1, T=16)
    base = tiny_model(x, num_steps=4, init_scale=0.0).logits
    x2 = x.clone()
    x2[0, 9] = (x2[0, 9] + 1) % 256
    changed = tiny_model(x2, num_steps=4, init_scale=0.0).logits
    torch.testing.assert_close(changed[:, :9], base[:, :9], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, 9:], base[:, 9:])


def test_pair_num_steps_equals_int(tiny_model):
    x = ids()
    a = tiny_model(x, num_steps=5, init_scale=0.0).logits
    b = tiny_model(x, num_steps=(3, 2), init_scale=0.0).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_steps_reads_normed_s0(tiny_model):
    out = tiny_model(ids(), num_steps=0, init_scale=0.0)
    assert torch.equal(out.final_state, torch.zeros_like(out.final_state))


def test_eval_mode_none_uses_mean_recurrence(tiny_model):
    out = tiny_model(ids(), num_steps=None, init_scale=0.0)
    assert out.num_steps == (0, tiny_model.config.mean_recurrence)


def test_train_mode_none_samples_a_depth_with_generator(tiny_config):
    model = rd.RecurrentDepthLM(tiny_config).train()
    draws = {model(ids(), generator=torch.Generator().manual_seed(s)).num_steps for s in range(6)}
    assert len(draws) > 1
    assert all(k == min(n + k, tiny_config.mean_backprop_depth) for n, k in draws)
    one = model(ids(), generator=torch.Generator().manual_seed(3)).num_steps
    assert one == model(ids(), generator=torch.Generator().manual_seed(3)).num_steps


def test_truncated_backprop_gradients(tiny_config):
    """Gradients reach the prelude (through e) and the core only through the last k steps."""
    model = rd.RecurrentDepthLM(tiny_config)
    backward_calls = []
    model.transformer.adapter.register_full_backward_hook(lambda *_: backward_calls.append(1))
    out = model(ids(), num_steps=(3, 2), init_scale=1.0, generator=torch.Generator().manual_seed(0))
    out.logits.sum().backward()
    assert len(backward_calls) == 2  # one per grad step, none for the 3 no-grad steps
    assert model.transformer.prelude[0].attn.Wqkv.weight.grad.abs().sum() > 0
    assert model.transformer.wte.weight.grad.abs().sum() > 0
    assert model.transformer.core_block[0].mlp.fc.weight.grad.abs().sum() > 0


def test_no_grad_steps_do_not_contribute_to_gradient(tiny_config):
    """(n, k) grads equal those of k steps started from the detached state after n steps."""
    model = rd.RecurrentDepthLM(tiny_config)
    x = ids()
    out = model(x, num_steps=(3, 2), init_scale=0.0)
    out.logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        s3 = model(x, num_steps=3, init_scale=0.0).final_state
    out2 = model(x, num_steps=2, input_states=s3)
    out2.logits.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7, msg=n)


def test_activation_checkpointing_gives_same_gradients(tiny_config):
    model = rd.RecurrentDepthLM(tiny_config)
    x = ids()
    model(x, num_steps=(1, 3), init_scale=0.0).logits.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    model(x, num_steps=(1, 3), init_scale=0.0).logits.square().mean().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)


def test_same_seed_same_s0_and_logits(tiny_model):
    x = ids()
    a = tiny_model(x, num_steps=3, generator=torch.Generator().manual_seed(7), output_all_states=True)
    b = tiny_model(x, num_steps=3, generator=torch.Generator().manual_seed(7), output_all_states=True)
    c = tiny_model(x, num_steps=3, generator=torch.Generator().manual_seed(8), output_all_states=True)
    assert torch.equal(a.all_states[0], b.all_states[0]) and torch.equal(a.logits, b.logits)
    assert not torch.equal(a.all_states[0], c.all_states[0])


def test_init_scale_zero_is_deterministic(tiny_model):
    x = ids()
    a = tiny_model(x, num_steps=3, init_scale=0.0).logits
    torch.manual_seed(99)
    b = tiny_model(x, num_steps=3, init_scale=0.0).logits
    assert torch.equal(a, b)


def test_initial_state_statistics(tiny_model):
    e = torch.zeros(4, 256, 64)
    s0 = tiny_model.initial_state(e, 1.0, torch.Generator().manual_seed(0))
    std = math.sqrt(2 / (5 * 64))
    assert s0.abs().max() <= 3 * std * math.sqrt(64) + 1e-5
    assert abs(s0.std().item() - 0.622) < 0.02  # sqrt(2/5) shrunk by the ±3 sigma truncation


def test_labels_follow_the_hf_shift_rule(tiny_model):
    x = ids()
    labels = x.clone()
    labels[0, :4] = -100
    out = tiny_model(x, num_steps=2, init_scale=0.0, labels=labels)
    logits = out.logits
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("pad", [0, 1, 5], ids=lambda p: f"pad{p}")
def test_left_padding_matches_running_alone(tiny_model, pad):
    a, b = ids(B=1, T=9, seed=1), ids(B=1, T=9 - pad, seed=2)
    alone_a = tiny_model(a, num_steps=3, init_scale=0.0).logits
    alone_b = tiny_model(b, num_steps=3, init_scale=0.0).logits
    batch = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    out = tiny_model(batch, num_steps=3, init_scale=0.0, attention_mask=mask).logits
    torch.testing.assert_close(out[0], alone_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, pad:], alone_b[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_prefill_then_decode_equals_full_forward(tiny_model):
    x = ids(B=2, T=12)
    full = tiny_model(x, num_steps=3, init_scale=0.0).logits
    cache = rd.DynamicCache()
    first = tiny_model(x[:, :7], num_steps=3, init_scale=0.0, cache=cache).logits
    steps = [first]
    for t in range(7, 12):
        steps.append(tiny_model(x[:, t : t + 1], num_steps=3, init_scale=0.0, cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    # a multi-token chunk after a prefill uses the bottom-right causal mask
    cache = rd.DynamicCache()
    tiny_model(x[:, :5], num_steps=3, init_scale=0.0, cache=cache)
    rest = tiny_model(x[:, 5:], num_steps=3, init_scale=0.0, cache=cache).logits
    torch.testing.assert_close(rest, full[:, 5:], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_model_runs_and_is_causal():
    cfg = rd.ModelConfig.from_preset("tiny", num_kv_heads=2)
    model = rd.RecurrentDepthLM(cfg).eval()
    names = dict(model.named_parameters())
    assert names["transformer.core_block.0.attn.k_bias"].shape == (2, 16)
    x = ids(B=1, T=8)
    a = model(x, num_steps=2, init_scale=0.0).logits
    x[0, 6] = (x[0, 6] + 1) % 256
    b = model(x, num_steps=2, init_scale=0.0).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)


def test_huginn_names_and_shapes_on_meta_device():
    cfg = rd.ModelConfig.from_preset("huginn-0125")
    with torch.device("meta"):
        model = rd.RecurrentDepthLM(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert model.num_parameters() == 3_564_976_800
    assert shapes["transformer.wte.weight"] == (65536, 5280)
    assert shapes["transformer.adapter.weight"] == (5280, 10560)
    assert shapes["transformer.ln_f.weight"] == (5280,)
    assert shapes["lm_head.weight"] == (65536, 5280)
    for part, count in (("prelude", 2), ("core_block", 4), ("coda", 2)):
        for i in range(count):
            p = f"transformer.{part}.{i}."
            assert shapes[p + "attn.qk_bias"] == (2, 1, 55, 96)
            assert shapes[p + "attn.Wqkv.weight"] == (15840, 5280)
            assert shapes[p + "attn.proj.weight"] == (5280, 5280)
            assert shapes[p + "mlp.fc.weight"] == (35840, 5280)
            assert shapes[p + "mlp.proj.weight"] == (5280, 17920)
            for k in range(1, 5):
                assert shapes[p + f"norm_{k}.weight"] == (5280,)
    assert len(shapes) == 1 + 8 * 9 + 1 + 1 + 1
    assert model.lm_head.weight is model.transformer.wte.weight


def test_takase_init_scales():
    cfg = rd.ModelConfig.from_preset("small")
    model = rd.RecurrentDepthLM(cfg)
    std = math.sqrt(2 / (5 * cfg.hidden_size))
    out_std = std / math.sqrt(2 * (cfg.prelude_layers + cfg.coda_layers + cfg.core_layers * cfg.mean_recurrence))
    w = model.transformer.core_block[0].attn.Wqkv.weight
    p = model.transformer.core_block[0].mlp.proj.weight
    assert abs(w.std().item() / std - 0.986) < 0.02  # ±3 sigma truncation keeps 98.6% of sigma
    assert abs(p.std().item() / out_std - 0.986) < 0.03
    assert torch.equal(model.transformer.ln_f.weight, torch.ones(cfg.hidden_size))


BAD_CALLS = {
    "float ids": (lambda m: m(torch.rand(1, 4))),
    "id above vocab": (lambda m: m(torch.tensor([[1, 2, 256]]))),
    "negative id": (lambda m: m(torch.tensor([[1, -1]]))),
    "too long": (lambda m: m(torch.zeros(1, 257, dtype=torch.long))),
    "1-d ids": (lambda m: m(torch.zeros(5, dtype=torch.long))),
    "negative steps": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), num_steps=-1)),
    "bad pair": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), num_steps=(1, -2))),
    "tensor steps": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), num_steps=torch.tensor(3))),
    "float steps": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), num_steps=2.5)),
    "mask shape": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))),
    "labels shape": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), labels=torch.zeros(1, 2, dtype=torch.long))),
    "states shape": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), input_states=torch.zeros(1, 3, 8))),
    "negative init_scale": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), init_scale=-1.0)),
    "nan init_scale": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), init_scale=float("nan"))),
    "inf init_scale": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), init_scale=float("inf"))),
    "int mask value 2": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 2, 1]]))),
    "int mask value -1": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[-1, 1, 1]]))),
    "list mask": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), attention_mask=[[1, 1, 1]])),
    "bool labels": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.bool))),
    "int states": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), input_states=torch.zeros(1, 3, 64).long())),
    "negative positions": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[-1, 0, 1]]))),
    "positions past max": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 256]]))),
    "1-d positions": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.arange(3))),
    "float positions": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.zeros(1, 3))),
    "generator not a Generator": (lambda m: m(torch.zeros(1, 3, dtype=torch.long), generator=0)),
}


@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_input_gets_a_clear_value_error(tiny_model, call):
    with pytest.raises(ValueError):
        call(tiny_model)


def test_any_integer_dtype_of_ids_and_labels_is_accepted(tiny_model):
    x = ids(T=7)
    base = tiny_model(x, num_steps=2, init_scale=0.0, labels=x)
    small = tiny_model(x.to(torch.uint8), num_steps=2, init_scale=0.0, labels=x.int())
    assert torch.equal(small.logits, base.logits)
    assert torch.equal(small.loss, base.loss)


def test_given_positions_in_range_are_used(tiny_model):
    x = ids(T=5)
    plain = tiny_model(x, num_steps=2, init_scale=0.0).logits
    same = tiny_model(x, num_steps=2, init_scale=0.0, position_ids=torch.arange(5)[None]).logits
    last = tiny_model(x, num_steps=2, init_scale=0.0, position_ids=torch.arange(251, 256).expand(2, 5)).logits
    assert torch.equal(same, plain)
    assert not torch.allclose(last, plain)


def test_model_without_prelude_coda_or_mean_depth_initialises():
    # L_eff = P + C + R * mean_recurrence = 0 would divide by zero in the Takase out-projection std.
    model = rd.RecurrentDepthLM(rd.ModelConfig(prelude_layers=0, coda_layers=0, mean_recurrence=0))
    assert torch.isfinite(model.transformer.core_block[0].attn.proj.weight).all()
    assert model(ids(T=3), num_steps=1).logits.shape == (2, 3, 256)


def test_cache_refuses_a_different_batch_size(tiny_model):
    from recurrent_depth.model.cache import DynamicCache

    cache = DynamicCache()
    tiny_model(ids(T=4), num_steps=2, init_scale=0.0, cache=cache)
    with pytest.raises(ValueError, match="batch size 1"):
        tiny_model(ids(B=1, T=1), num_steps=2, init_scale=0.0, cache=cache)


@pytest.mark.parametrize(
    "mixer, options, message",
    [
        ({"core": "nonexistent"}, {"nonexistent": {}}, "unknown mixer 'nonexistent' for the core"),
        ({"core": "attention"}, {"attention": {"window": True}}, "window=True is invalid"),
    ],
    ids=["misspelled-mixer-with-scoped-options", "bool-window"],
)
def test_bad_mixer_settings_name_what_is_wrong(mixer, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer=mixer, mixer_options=options))


def windowed_tiny(**overrides):
    """The tiny preset (prelude 1, core 2, coda 1) with a window on three of its four layers."""
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny", attention_windows=[None, 3, 2, 4], **overrides)
    return rd.RecurrentDepthLM(cfg).eval()


def test_per_layer_windows_act_on_every_path():
    """`attention_windows` gives each layer its own window (None: full): the eager output_attentions path and a
    prefill then one-token decodes past every window (KV cache) equal the full forward, whose logits differ
    from the same weights without windows; each layer's weights show its window."""
    from recurrent_depth.model.cache import DynamicCache

    model = windowed_tiny()
    assert [b.attn.window for b in rd.model.recurrent.blocks_of(model)] == [None, 3, 2, 4]
    x = ids(B=2, T=12)
    with torch.no_grad():
        full = model(x, num_steps=3, init_scale=0.0)
        eager = model(x, num_steps=3, init_scale=0.0, output_attentions=True)
        cache = DynamicCache()
        parts = [model(x[:, :5], num_steps=3, init_scale=0.0, cache=cache).logits]
        parts += [model(x[:, t:t + 1], num_steps=3, init_scale=0.0, cache=cache).logits for t in range(5, 12)]
        unwindowed = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
        unwindowed.load_state_dict(model.state_dict())
        plain = unwindowed(x, num_steps=3, init_scale=0.0).logits
    torch.testing.assert_close(eager.logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(parts, 1), full.logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, full.logits, atol=1e-3)
    probs = eager.attentions[("core", 1, 0)]  # [B, H, T, S]: core layer 1 (unique layer 2) has window 2
    assert probs[..., 5, :4].abs().max() == 0 and probs[..., 5, 4:6].sum(-1).allclose(torch.ones(()))
    assert eager.attentions[("prelude", 0)][..., 11, 0].min() > 0  # layer 0: full attention


@pytest.mark.parametrize("options", [{}, {"cache_implementation": "static"}, {"fast": True},
                                     {"kv_quant": "k=mse:4,v=mse:4,window=2"}],
                         ids=["dynamic", "static", "fast-requested", "kv-quant-window"])
def test_generation_with_per_layer_windows_equals_the_full_forward(options):
    from recurrent_depth.inference.generate import generate

    model = windowed_tiny()
    prompt = ids(B=2, T=4)
    out = generate(model, prompt, max_new_tokens=8, num_steps=2, init_scale=0.0, output_logits=True, **options)
    with torch.no_grad():
        want = model(out.sequences, num_steps=2, init_scale=0.0).logits[:, 3:-1]
    tol = 0.1 if "kv_quant" in options else 1e-5  # (4-bit keys and values: their codes' error)
    torch.testing.assert_close(out.logits, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_windows=[None, 3]),
     "ModelConfig.attention_windows=[None, 3] is invalid: expected [] or a list of 4"),
    (dict(attention_windows=[None, 0, None, None]), "an integer window in [1, 2147483647]"),
    (dict(attention_windows=[None, True, None, None]), "an integer window in [1, 2147483647]"),
    (dict(attention_windows=[None, 3, None, None], mixer_options={"core": {"window": 2}}),
     "attention_windows and mixer_options both set the window of layer 1"),
    (dict(attention_windows=[None, 3, None, None], mixer={"core": "gated_deltanet"}),
     "gives layer 1 a window of 3, but its mixer is not 'attention'"),
], ids=["length", "zero", "bool", "both-places", "not-attention"])
def test_bad_per_layer_windows_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", **overrides))
    assert "\n" not in str(info.value)


def test_a_window_counts_real_tokens_not_hidden_columns():
    """A column hidden inside a row (a batch's rejected speculative drafts stay in the cache, masked) was counted
    in the window: the row saw fewer than W real tokens, so batched speculative decoding differed from a row alone.
    The logits of the real tokens equal those of the row without the hidden columns."""
    model = windowed_tiny()
    x = ids(B=2, T=12)
    mask = torch.ones_like(x)
    mask[0, [4, 5]] = 0  # two hidden columns in row 0
    keep = mask[0].bool()
    with torch.no_grad():
        holes = model(x, attention_mask=mask, num_steps=2, init_scale=0.0).logits
        alone = model(x[:1, keep], num_steps=2, init_scale=0.0).logits
    torch.testing.assert_close(holes[:1, keep], alone, rtol=1e-5, atol=1e-5)
