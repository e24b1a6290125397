"""Token mixers inside the model: cached decoding, causality, padding, state accounting, options.

Every causal mixer runs in the recurrent core of a small RecurrentDepthLM (attention in the
prelude and coda). Tolerances: float32 model comparisons of different summation orders (cached vs
full, chunked vs recurrent) agree to ~1e-6, so 2e-5 is used; float64 comparisons of one
algorithm written two ways use 1e-10.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.model.mixers import build_mixer
from recurrent_depth.model.mixers.dsa import indexer_parameters, pop_indexer_loss

VOCAB = 64
F32_TOL = dict(rtol=2e-5, atol=2e-5)
F64_TOL = dict(rtol=1e-10, atol=1e-10)

# name -> (registered mixer, options): small blocks/chunks so short sequences cross their boundaries.
MIXERS = {
    "attention": ("attention", {}),
    "attention-mqa": ("attention", {"num_kv_heads": 1}),
    "attention-window": ("attention", {"window": 3}),
    "mla": ("mla", {}),
    "mla-qlora": ("mla", {"q_lora_rank": 12}),
    "dsa": ("dsa", {"topk": 3}),
    "nsa": ("nsa", {"block_size": 2, "block_counts": 2, "window": 3}),
    "linear_attention": ("linear_attention", {"chunk_size": 4}),
    "linear_attention-nonorm": ("linear_attention", {"chunk_size": 4, "normalize": False}),
    "deltanet": ("deltanet", {"chunk_size": 4}),
    "gla": ("gla", {"chunk_size": 4}),
    "gated_deltanet": ("gated_deltanet", {"chunk_size": 4}),
    "log_linear_mamba2": ("log_linear_mamba2", {"chunk_size": 4}),
    "log_linear_gated_deltanet": ("log_linear_gated_deltanet", {"chunk_size": 4}),
}
RECURRENT = [n for n in MIXERS if MIXERS[n][0] in (
    "linear_attention", "deltanet", "gla", "gated_deltanet", "log_linear_mamba2", "log_linear_gated_deltanet")]
LOG_LINEAR = ["log_linear_mamba2", "log_linear_gated_deltanet"]


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def small_config(mixer: str = "attention", options: dict | None = None, **overrides) -> rd.ModelConfig:
    values = dict(hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=VOCAB, core_layers=1,
                  max_seq_len=64, mixer={"core": mixer}, mixer_options={mixer: options or {}})
    # (a scoped options dict: the prelude and coda keep plain attention)
    values.update(overrides)
    return rd.ModelConfig.from_preset("tiny", **values)


def core_model(case: str, **overrides) -> rd.RecurrentDepthLM:
    name, options = MIXERS[case]
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(small_config(name, options, **overrides)).eval()


def make_mixer(case: str, dtype=torch.float64, **extra):
    name, options = MIXERS[case]
    torch.manual_seed(3)
    cfg = small_config(name, options)
    return build_mixer(name, cfg, "core", **{**options, **extra}).to(dtype), cfg


def context(cfg, B, T, mask=None, cache=None):
    """The model's own MixerContext for a call (positions, masks, cache)."""
    ids = torch.zeros(B, T, dtype=torch.long)
    return rd.RecurrentDepthLM.make_context(SimpleNamespace(config=cfg), ids, mask, None, cache)


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(MIXERS))
def test_prefill_then_decode_equals_full_forward(case):
    model = core_model(case)
    x = tokens(2, 11)
    full = model(x, num_steps=2, init_scale=0.0).logits
    cache = rd.DynamicCache()
    steps = [model(x[:, :5], num_steps=2, init_scale=0.0, cache=cache).logits]
    for t in range(5, 11):
        steps.append(model(x[:, t : t + 1], num_steps=2, init_scale=0.0, cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, **F32_TOL)
    # the cache holds exactly what the mixers' state_nbytes promises (per layer, per step)
    blocks = [*model.transformer.prelude, *model.transformer.coda]
    promised = sum(b.attn.state_nbytes(2, 11) for b in blocks)
    promised += 2 * sum(b.attn.state_nbytes(2, 11) for b in model.transformer.core_block)
    assert cache.nbytes() == promised
    # a multi-token chunk after a short prefill (shorter than the short conv's window)
    cache = rd.DynamicCache()
    model(x[:, :2], num_steps=2, init_scale=0.0, cache=cache)
    rest = model(x[:, 2:], num_steps=2, init_scale=0.0, cache=cache).logits
    torch.testing.assert_close(rest, full[:, 2:], **F32_TOL)


@pytest.mark.parametrize("case", list(MIXERS))
def test_mixer_is_causal(case):
    mixer, cfg = make_mixer(case)
    x = torch.randn(1, 12, cfg.hidden_size, dtype=torch.float64)
    base = mixer(x, context(cfg, 1, 12), ("core", 0, 0))
    x2 = x.clone()
    x2[0, 8] += 1.0
    changed = mixer(x2, context(cfg, 1, 12), ("core", 0, 0))
    torch.testing.assert_close(changed[:, :8], base[:, :8], rtol=0, atol=1e-12)
    assert not torch.allclose(changed[:, 8:], base[:, 8:])


@pytest.mark.parametrize("case", [c for c in MIXERS if c not in LOG_LINEAR])
def test_left_padding_matches_running_alone(case):
    model = core_model(case)
    pad = 3
    a, b = tokens(1, 10, seed=1), tokens(1, 10 - pad, seed=2)
    alone_b = model(b, num_steps=2, init_scale=0.0).logits
    batch = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    out = model(batch, num_steps=2, init_scale=0.0, attention_mask=mask).logits
    torch.testing.assert_close(out[1, pad:], alone_b[0], **F32_TOL)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name,options", [("deltanet", {"chunk_size": 4}), ("gated_deltanet", {}),
                                          ("falcon", {"chunk_size": 4})])
def test_left_padded_row_with_a_shared_slot_matches_running_alone(name, options):
    # step 2 of the prompt continues step 0's state (kv_policy shared-2): the short conv's last inputs
    # and Falcon's last key must reach the row's first real token across its left padding (they read 0)
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(small_config(name, options)).eval()
    rows = [tokens(1, 8, seed=1), tokens(1, 3, seed=2), tokens(1, 6, seed=3)]  # padding 5 and 2 (< the conv's 3)
    batch = torch.cat([torch.cat([torch.zeros(1, 8 - r.shape[1], dtype=torch.long), r], 1) for r in rows])
    mask = torch.cat([torch.arange(8)[None] >= 8 - r.shape[1] for r in rows]).long()
    kw = dict(max_new_tokens=2, num_steps=3, init_scale=0.0, kv_policy="shared-2", output_logits=True)
    out = rd.generate(model, batch, attention_mask=mask, **kw)
    for b, row in enumerate(rows):
        alone = rd.generate(model, row, **kw)
        torch.testing.assert_close(out.logits[b], alone.logits[0], **F32_TOL)


@pytest.mark.parametrize("case", RECURRENT)
def test_padded_token_leaves_the_recurrent_state_untouched(case):
    """A padded token writes nothing (fla #1272: gates on padding corrupted later states)."""
    mixer, cfg = make_mixer(case)
    x = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    cache = rd.DynamicCache()
    mixer(x[:, :5], context(cfg, 2, 5, cache=cache), ("core", 0, 0))
    cache.advance(5)
    before = cache.get_state(("core", 0, 0))["recurrent"]
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 5] = 0
    mixer(x[:, 5:], context(cfg, 2, 1, mask=mask, cache=cache), ("core", 0, 0))
    after = cache.get_state(("core", 0, 0))["recurrent"]
    if case in LOG_LINEAR:  # levels regroup with the position, but the padded token adds nothing
        torch.testing.assert_close(after["levels"][1].sum(1), before["levels"][1].sum(1), rtol=0, atol=1e-12)
        assert not torch.allclose(after["levels"][0].sum(1), before["levels"][0].sum(1))
    else:
        state_after = after[0] if isinstance(after, tuple) else after
        state_before = before[0] if isinstance(before, tuple) else before
        assert torch.equal(state_after[1], state_before[1])
        assert not torch.equal(state_after[0], state_before[0])


@pytest.mark.parametrize("case", LOG_LINEAR)
def test_log_linear_leading_padding_writes_nothing(case):
    mixer, cfg = make_mixer(case)
    x = torch.randn(1, 5, cfg.hidden_size, dtype=torch.float64)
    cache = rd.DynamicCache()
    mask = torch.tensor([[0, 0, 0, 0, 1]])  # four pads, then one real token
    mixer(x, context(cfg, 1, 5, mask=mask, cache=cache), ("core", 0, 0))
    state = cache.get_state(("core", 0, 0))
    levels = state["recurrent"]["levels"]
    assert levels[:, :, 1:].abs().max() == 0  # the pads wrote nothing: only the real token, in level 0
    assert levels[:, :, 0].abs().max() > 0


@pytest.mark.parametrize("case", list(MIXERS))
def test_bf16_autocast_training_step_is_finite(case):
    """`rdepth train --dtype bfloat16` runs the model under autocast; the chunked linear ops raised there."""
    model = core_model(case).train()
    x = tokens(2, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, num_steps=2, init_scale=0.0, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------------
FAST_PATHS = ["linear_attention", "linear_attention-nonorm", "deltanet", "gla", "gated_deltanet",
              "log_linear_mamba2", "log_linear_gated_deltanet"]


@pytest.mark.parametrize("case", FAST_PATHS)
def test_chunked_layer_equals_recurrent_layer_with_gradients(case):
    """The layer's chunked path against its token-by-token path (float64), outputs and gradients."""
    chunked, cfg = make_mixer(case, mode="chunk")
    recurrent, _ = make_mixer(case, mode="fused_recurrent")
    recurrent.load_state_dict(chunked.state_dict())
    x = torch.randn(2, 13, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for mixer in (chunked, recurrent):
        out = mixer(x, context(cfg, 2, 13), ("core", 0, 0))
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        params = [p for p in mixer.parameters() if p.requires_grad]
        g = torch.autograd.grad((out * weights).sum(), [x, *params], allow_unused=True)
        outs.append(out)
        grads.append([torch.zeros(()) if t is None else t for t in g])
    torch.testing.assert_close(outs[0], outs[1], **F64_TOL)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_float64_gated_deltanet_layer_equals_a_float64_token_loop():
    """The layer computed from its parameters token by token in float64. Norms and gates used to be
    computed in float32 even in a float64 model (7e-8 off), so float64 oracles could not be tight."""
    import torch.nn.functional as F

    mixer, cfg = make_mixer("gated_deltanet")
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    B, T = 2, 9
    x = torch.randn(B, T, cfg.hidden_size, dtype=torch.float64)
    out = mixer(x, context(cfg, B, T), ("core", 0, 0))
    H, K, V, W = mixer.num_heads, mixer.key_dim, mixer.value_dim, mixer.conv_size
    qkv = F.pad(torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1), (0, 0, W - 1, 0))
    qkv = F.silu(sum(qkv[:, i : i + T] * mixer.conv.weight[:, i] for i in range(W)) + mixer.conv.bias)
    q, k, v = qkv.split([H * K, H * K, H * V], -1)
    unit = lambda t: t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k, v = unit(q.view(B, T, H, K)), unit(k.view(B, T, H, K)), v.view(B, T, H, V)
    beta = mixer.b_proj(x).sigmoid()
    alpha = torch.exp(-mixer.A_log.exp() * F.softplus(mixer.a_proj(x) + mixer.dt_bias))
    S = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    o = []
    for t in range(T):
        kt, bt = k[:, t, :, :, None], beta[:, t, :, None, None]
        S = alpha[:, t, :, None, None] * (eye - bt * kt * kt.mT) @ S + bt * kt * v[:, t, :, None, :]
        o.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K**-0.5))
    o = torch.stack(o, 1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * mixer.o_norm.weight
    o = o * F.silu(mixer.g_proj(x).view(B, T, H, V))
    torch.testing.assert_close(out, mixer.proj(o.reshape(B, T, H * V)), **F64_TOL)


@pytest.mark.parametrize("case", ["mla", "mla-qlora", "dsa"])
def test_mla_absorbed_equals_naive(case):
    naive, cfg = make_mixer(case, attn_impl="naive")
    absorbed, _ = make_mixer(case, attn_impl="absorb")
    absorbed.load_state_dict(naive.state_dict())
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    a = naive(x, context(cfg, 2, 9), ("core", 0, 0))
    b = absorbed(x, context(cfg, 2, 9), ("core", 0, 0))
    torch.testing.assert_close(a, b, **F64_TOL)
    ga = torch.autograd.grad(a.square().sum(), [x, naive.wkv_b.weight])
    gb = torch.autograd.grad(b.square().sum(), [x, absorbed.wkv_b.weight])
    for u, w in zip(ga, gb):
        torch.testing.assert_close(u, w, rtol=1e-9, atol=1e-9)
    # and decoding through the latent cache with either path
    for mixer in (naive, absorbed):
        cache = rd.DynamicCache()
        with torch.no_grad():
            steps = [mixer(x[:, :4], context(cfg, 2, 4, cache=cache), ("core", 0, 0))]
            cache.advance(4)
            for t in range(4, 9):
                steps.append(mixer(x[:, t : t + 1], context(cfg, 2, 1, cache=cache), ("core", 0, 0)))
                cache.advance(1)
        torch.testing.assert_close(torch.cat(steps, 1), a.detach(), **F64_TOL)


def test_mqa_and_gqa_equal_attention_with_repeated_kv_heads():
    import torch.nn.functional as F

    from recurrent_depth.model.layers import apply_rope

    cfg = small_config(num_heads=4)
    for kv_heads in (1, 2, 4):
        torch.manual_seed(0)
        mixer = build_mixer("attention", cfg, "core", num_kv_heads=kv_heads).double()
        with torch.no_grad():
            for name, p in mixer.named_parameters():
                if "bias" in name:
                    p.normal_()
        x = torch.randn(2, 7, cfg.hidden_size, dtype=torch.float64)
        ctx = context(cfg, 2, 7)
        out = mixer(x, ctx, ("core", 0, 0))
        D = cfg.hidden_size // 4
        q, k, v = mixer.Wqkv(x).split([4 * D, kv_heads * D, kv_heads * D], -1)
        q, k, v = q.view(2, 7, 4, D), k.view(2, 7, kv_heads, D), v.view(2, 7, kv_heads, D)
        qb, kb = (mixer.qk_bias[0], mixer.qk_bias[1]) if kv_heads == 4 else (mixer.q_bias, mixer.k_bias)
        cos, sin = ctx.rope(D)
        q, k = apply_rope(q + qb, cos, sin), apply_rope(k + kb, cos, sin)
        rep = 4 // kv_heads
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        ref = mixer.proj(ref.transpose(1, 2).reshape(2, 7, 4 * D))
        torch.testing.assert_close(out, ref, **F64_TOL)
        assert mixer.state_nbytes(2, 7) == 2 * 2 * 7 * kv_heads * D * 4


# ---------------------------------------------------------------------------------------------------
def test_dsa_with_topk_at_least_t_equals_dense_mla():
    sparse, cfg = make_mixer("dsa", topk=64)
    dense, _ = make_mixer("dsa", mode="dense")
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64)
    a = sparse(x, context(cfg, 2, 10), ("core", 0, 0))
    torch.testing.assert_close(a, dense(x, context(cfg, 2, 10), ("core", 0, 0)), **F64_TOL)
    small, _ = make_mixer("dsa", topk=2)
    small.load_state_dict(sparse.state_dict())
    assert not torch.allclose(small(x, context(cfg, 2, 10), ("core", 0, 0)), a)


def test_dsa_ties_in_the_indexer_scores_do_not_depend_on_cache_or_padding():
    """Equal index scores (exact zeros after the ReLU are common) used to be broken by `topk`'s
    memory order, so a cached decode or a left-padded row selected other keys than a full forward."""
    sparse, cfg = make_mixer("dsa", topk=3)
    with torch.no_grad():
        sparse.indexer["weights"].weight.zero_()  # every score 0: the selection is all ties
    B, T, pad = 2, 12, 3
    x = torch.randn(B, T, cfg.hidden_size, dtype=torch.float64)
    full = sparse(x, context(cfg, B, T), ("core", 0, 0))
    cache = rd.DynamicCache()
    steps = [sparse(x[:, :4], context(cfg, B, 4, cache=cache), ("core", 0, 0))]
    cache.advance(4)
    for t in range(4, T):
        steps.append(sparse(x[:, t : t + 1], context(cfg, B, 1, cache=cache), ("core", 0, 0)))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, 1), full, **F64_TOL)
    padded = torch.cat([torch.randn(B, pad, cfg.hidden_size, dtype=torch.float64), x], 1)
    mask = torch.ones(B, T + pad, dtype=torch.long)
    mask[:, :pad] = 0
    out = sparse(padded, context(cfg, B, T + pad, mask=mask), ("core", 0, 0))
    torch.testing.assert_close(out[:, pad:], full, **F64_TOL)


def test_dsa_indexer_loss_trains_only_the_indexer():
    model = core_model("dsa")
    for layer in model.modules():
        if hasattr(layer, "indexer_loss"):
            layer.indexer_loss = True
    model.train()
    out = model(tokens(2, 9), num_steps=3, init_scale=0.0, labels=tokens(2, 9))
    kl = pop_indexer_loss(model)
    assert kl is not None and kl.item() > 0 and pop_indexer_loss(model) is None
    indexer = {id(p) for p in indexer_parameters(model)}
    grads = torch.autograd.grad(kl, list(model.parameters()), allow_unused=True)
    for p, g in zip(model.parameters(), grads):
        touched = g is not None and g.abs().sum() > 0
        assert touched == (id(p) in indexer)
    with torch.no_grad():
        model(tokens(2, 9), num_steps=2, init_scale=0.0)
    assert pop_indexer_loss(model) is None  # nothing recorded without gradients
    model.gradient_checkpointing = True  # backward's recomputation must not record again
    model(tokens(2, 9), num_steps=2, init_scale=0.0, labels=tokens(2, 9)).loss.backward()
    recorded = [len(m.indexer_losses) for m in model.modules() if hasattr(m, "indexer_losses")]
    assert recorded == [2]
    assert out.loss is not None


# ---------------------------------------------------------------------------------------------------
class RecordingCache(rd.DynamicCache):
    def __init__(self) -> None:
        super().__init__()
        self.keys: set = set()

    def update_kv(self, key, k, v, ctx=None):
        self.keys.add(key)
        return super().update_kv(key, k, v, ctx)

    def get_state(self, key):
        self.keys.add(key)
        return super().get_state(key)

    def set_state(self, key, value):
        self.keys.add(key)
        super().set_state(key, value)


class BudgetCache(rd.DynamicCache):
    """A KV-sharing budget as a key mapping: ("core", j, step) -> ("core", j, step % k)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def map(self, key):
        return (*key[:2], key[2] % self.k) if key[0] == "core" else key

    def get_state(self, key):
        return super().get_state(self.map(key))

    def set_state(self, key, value):
        super().set_state(self.map(key), value)


@pytest.mark.parametrize("case", ["mla", "dsa", "nsa", "gated_deltanet", "log_linear_mamba2"])
def test_mixers_touch_the_cache_only_through_their_own_layer_key(case):
    model = core_model(case)
    cache = RecordingCache()
    model(tokens(1, 5), num_steps=3, init_scale=0.0, cache=cache)
    assert cache.keys == {("prelude", 0), ("coda", 0)} | {("core", 0, s) for s in range(3)}


def head_values(case: str, mixer, x):
    """Each query head's values [B, H, S, d] over the keys of inputs x [B, S, h] (MLA: W_UV,h c_kv)."""
    B, S, _ = x.shape
    if MIXERS[case][0] in ("mla", "dsa"):
        c_kv = mixer.kv_norm(mixer.wkv_a(x)[..., : mixer.kv_lora_rank])
        return mixer.wkv_b(c_kv).view(B, S, mixer.num_heads, -1)[..., mixer.qk_nope_dim :].transpose(1, 2)
    G = mixer.num_heads // mixer.num_kv_heads
    return mixer.v_proj(x).view(B, S, mixer.num_kv_heads, -1).transpose(1, 2).repeat_interleave(G, 1)


def weights_and_attended(mixer, x, ctx, key=("core", 0, 0)):
    """(output, output_attentions weights, the input of the output projection) of one flagged call."""
    seen = []
    handle = mixer.proj.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    ctx.attentions = {}
    try:
        out = mixer(x, ctx, key)
    finally:
        handle.remove()
    return out, ctx.attentions[key], seen[0]


@pytest.mark.parametrize("case,impl", [("mla", "naive"), ("mla", "absorb"), ("mla-qlora", "auto"),
                                       ("dsa", "naive"), ("dsa", "absorb"), ("nsa", None)])
def test_output_attentions_of_latent_and_sparse_attention_times_v_is_the_output(case, impl):
    """output_attentions gave None for MLA, DSA and NSA; now weights [B, H, T, S] with weights @ V equal to
    the layer's attention output (DSA: zero off the top-k keys; NSA: the gated sum of its three branches)."""
    mixer, cfg = make_mixer(case, **({} if impl is None else {"attn_impl": impl}))
    B, T = 2, 9
    x = torch.randn(B, T, cfg.hidden_size, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    fast = mixer(x, context(cfg, B, T, mask), ("core", 0, 0))
    out, probs, attended = weights_and_attended(mixer, x, context(cfg, B, T, mask))
    torch.testing.assert_close(out, fast, **F64_TOL)  # the flag changes nothing else
    assert probs.shape == (B, mixer.num_heads, T, T) and not probs.triu(1).any()
    assert not probs[0, :, 2:, :2].any()  # no real query reads a pad
    v = head_values(case, mixer, x)
    torch.testing.assert_close((probs @ v).transpose(1, 2).reshape(B, T, -1), attended, **F64_TOL)
    if case != "nsa":  # softmax rows; DSA's over at most topk = 3 keys
        torch.testing.assert_close(probs.sum(-1), torch.ones(B, mixer.num_heads, T, dtype=torch.float64))
    if case == "dsa":
        assert (probs[1] != 0).sum(-1).max() == 3 and (probs[1, :, 3:] != 0).sum(-1).min() == 3
    # decoding through the cache (MLA's "auto" absorbs there): the rows of the full call
    cache = rd.DynamicCache()
    with torch.no_grad():
        mixer(x[1:, :5], context(cfg, 1, 5, cache=cache), ("core", 0, 0))
        cache.advance(5)
        _, step, attended = weights_and_attended(mixer, x[1:, 5:6], context(cfg, 1, 1, cache=cache))
    torch.testing.assert_close(step, probs[1:, :, 5:6, :6], rtol=1e-6, atol=1e-8)  # (RoPE tables are fp32)


def test_output_attentions_of_a_float64_attention_layer_keeps_float64_logits():
    """The plain-math attention behind output_attentions took float32 logits even in a float64 model
    (outputs off by ~1e-8 from SDPA's); float64 stays float64."""
    mixer, cfg = make_mixer("attention")
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    fast = mixer(x, context(cfg, 2, 9), ("core", 0, 0))
    out, probs, _ = weights_and_attended(mixer, x, context(cfg, 2, 9))
    assert probs.dtype == torch.float64
    torch.testing.assert_close(out, fast, **F64_TOL)


@pytest.mark.parametrize("case", ["mla", "dsa", "nsa"])
def test_model_output_attentions_has_latent_and_sparse_layers_with_the_same_logits(case):
    model = core_model(case)
    x = tokens(2, 7)
    with torch.no_grad():
        fast = model(x, num_steps=2, init_scale=0.0)
        out = model(x, num_steps=2, init_scale=0.0, output_attentions=True)
    assert fast.attentions is None
    torch.testing.assert_close(out.logits, fast.logits, **F32_TOL)
    assert sorted(out.attentions) == sorted([("prelude", 0), ("core", 0, 0), ("core", 0, 1), ("coda", 0)])
    assert all(a.shape == (2, 2, 7, 7) for a in out.attentions.values())


@pytest.mark.parametrize("case", ["gated_deltanet", "log_linear_gated_deltanet"])
def test_recurrent_states_follow_a_budget_key_mapping(case):
    model = core_model(case)
    cache = BudgetCache(k=2)
    x = tokens(1, 6)
    model(x[:, :4], num_steps=5, init_scale=0.0, cache=cache)
    assert sorted(k for k in cache.states if k[0] == "core") == [("core", 0, 0), ("core", 0, 1)]
    out = model(x[:, 4:], num_steps=5, init_scale=0.0, cache=cache).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("scope", ["attention", "core", "prelude"])
def test_generate_with_a_mixer_option_num_kv_heads_equals_the_full_forward(scope):
    # the fused runner read every block's head counts from the config (a view error on MQA blocks)
    torch.manual_seed(7)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, core_layers=1, max_seq_len=64,
                                     mixer_options={scope: {"num_kv_heads": 1}})
    model = rd.RecurrentDepthLM(cfg).eval()
    out = rd.generate(model, tokens(2, 5), max_new_tokens=3, num_steps=2, init_scale=0.0, output_logits=True)
    full = model(out.sequences, num_steps=2, init_scale=0.0).logits[:, 4:-1]
    torch.testing.assert_close(out.logits, full, **F32_TOL)


def regression_model(name: str, options: dict, **overrides) -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(small_config(name, options, **overrides)).eval()


@pytest.mark.parametrize("name,options", [("falcon", {"chunk_size": 4}), ("ttt_kvb", {"mini_batch": 1})])
def test_exit_criterion_batch_rows_equal_alone_with_named_tuple_states(name, options):
    # rows that exit at different steps mask the state per row; FalconState / TTTKVBState are
    # NamedTuples, which the mask used to rebuild from one iterable (a TypeError)
    model = regression_model(name, options)
    x = torch.cat([tokens(1, 6, seed=1), tokens(1, 6, seed=2)])
    kw = dict(max_new_tokens=5, num_steps=6, init_scale=0.0, exit_criterion="kl", exit_threshold=3e-2)
    out = rd.generate(model, x, **kw)
    assert len(set(out.steps.flatten().tolist())) > 1  # the rows do exit at different steps
    for b in range(2):
        alone = rd.generate(model, x[b : b + 1], **kw)
        assert torch.equal(out.sequences[b], alone.sequences[0]) and torch.equal(out.steps[b], alone.steps[0])


@pytest.mark.parametrize("name,options", [("ttt_kvb", {"mini_batch": 4}), ("log_linear_mamba2", {"chunk_size": 4})])
def test_position_counting_states_refuse_a_batch_exit_and_shared_slots(name, options):
    # one position count for all rows: rows exiting at different steps would silently disagree on it
    model = regression_model(name, options)
    x = torch.cat([tokens(1, 6, seed=1), tokens(1, 6, seed=2)])
    kw = dict(max_new_tokens=2, num_steps=3, init_scale=0.0, exit_criterion="kl")
    with pytest.raises(ValueError, match=f"exit_criterion='kl' on a batch of 2 rows: the {name} mixer"):
        rd.generate(model, x, **kw)
    rd.generate(model, x[:1], **kw)  # one row, or every step computed, stays exact
    rd.generate(model, x, exit_kv="compute", **kw)
    if name.startswith("log_linear"):  # a shared slot advanced the absolute position once per step
        with pytest.raises(ValueError, match="shares a core cache slot among steps"):
            rd.generate(model, x, max_new_tokens=2, num_steps=3, kv_budget=1)
        rd.generate(model, x, max_new_tokens=2, num_steps=3, kv_budget=3)


@pytest.mark.parametrize("name,options", [("ttt_kvb", {"mini_batch": 4}), ("log_linear_mamba2", {"chunk_size": 4})])
def test_scoring_with_a_batch_exit_scores_position_counting_rows_alone(name, options):
    """lm-eval's scorer is handed batches: their rows are scored one by one (a batched exit was off by ~1e-2)."""
    from recurrent_depth.evaluation.scoring import stepwise_logprobs

    model = regression_model(name, options)
    x = tokens(4, 12, seed=1)
    requests = [(x[b, :3].tolist(), x[b, 3:].tolist()) for b in range(4)]
    kw = dict(exit_criterion="kl", exit_threshold=3e-2, init_scale=0.0)
    both = stepwise_logprobs(model, requests, 6, 0, **kw)
    assert len({s for r in both for s in r.steps}) > 1  # the rows do exit at different steps
    assert both == [stepwise_logprobs(model, [r], 6, 0, **kw)[0] for r in requests]
    if name.startswith("log_linear"):
        with pytest.raises(ValueError, match="shares a core cache slot among steps"):
            stepwise_logprobs(model, requests, 4, 0, kv_budget=2)


# ---------------------------------------------------------------------------------------------------
def test_options_can_be_scoped_per_mixer_and_part():
    cfg = small_config("gated_deltanet")
    cfg.mixer = {"core": "gated_deltanet", "prelude": "attention", "coda": "attention"}
    cfg.mixer_options = {"gated_deltanet": {"conv_size": 3}, "prelude": {"window": 2}}
    model = rd.RecurrentDepthLM(cfg)
    assert model.transformer.core_block[0].attn.conv_size == 3
    assert model.transformer.prelude[0].attn.window == 2
    assert model.transformer.coda[0].attn.window is None


BAD_OPTIONS = {
    "unknown option": ("gated_deltanet", {"windw": 3}),
    "option the mixer does not take": ("attention", {"conv_size": 3}),
    "zero heads": ("gla", {"num_heads": 0}),
    "chunk not power of two": ("deltanet", {"chunk_size": 12}),
    "bad mode": ("linear_attention", {"mode": "fast"}),
    "bad feature map": ("linear_attention", {"feature_map": "tanh"}),
    "identity map with normaliser": ("linear_attention", {"feature_map": "identity"}),
    "odd rope dim": ("mla", {"qk_rope_dim": 5}),
    "bad attn impl": ("mla", {"attn_impl": "flash"}),
    "dsa topk zero": ("dsa", {"topk": 0}),
    "dsa bad mode": ("dsa", {"mode": "half"}),
    "dsa index dim below rope": ("dsa", {"index_dim": 2}),
    "nsa kv heads": ("nsa", {"num_kv_heads": 3}),
    "nsa zero block": ("nsa", {"block_size": 0}),
    "mqa kv heads": ("attention", {"num_kv_heads": 3}),
    "gla expand_k": ("gla", {"expand_k": 0.01}),
    "gla expand_k infinite": ("gla", {"expand_k": float("inf")}),
    "gla expand_v nan": ("gla", {"expand_v": float("nan")}),
    "conv size": ("gated_deltanet", {"conv_size": 1}),
    "bool as int": ("deltanet", {"expand_v": True}),
    "hydra in a causal LM": ("hydra", {}),
}


@pytest.mark.parametrize("mixer,options", list(BAD_OPTIONS.values()), ids=list(BAD_OPTIONS))
def test_bad_mixer_options_raise_value_error(mixer, options):
    with pytest.raises(ValueError, match="mixer|option|hydra|num_kv_heads|window"):
        rd.RecurrentDepthLM(small_config(mixer, options))


def test_unknown_mixer_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown mixer"):
        rd.RecurrentDepthLM(small_config("flash_linear", mixer_options={}))


def test_mixer_options_include_those_passed_on_to_the_base_class():
    """A mixer names its own options and passes the rest (`**shared`) on; both kinds are accepted,
    and the error for an unknown one lists them all (ttt_kvb has no chunk_size: it is falcon's own)."""
    from recurrent_depth.model.mixers import build_mixer

    cfg = small_config("gla")
    gla = build_mixer("gla", cfg, "core", num_heads=4, head_dim=8, mode="chunk", expand_k=1.0, chunk_size=32)
    assert (gla.num_heads, gla.head_dim, gla.mode, gla.key_dim, gla.chunk_size) == (4, 8, "chunk", 8, 32)
    dsa = build_mixer("dsa", cfg, "core", kv_lora_rank=24, topk=8)
    assert (dsa.kv_lora_rank, dsa.topk) == (24, 8)
    with pytest.raises(ValueError, match=r"accepts \['head_dim', 'mini_batch', 'mode', 'num_heads'\]"):
        build_mixer("ttt_kvb", cfg, "core", chunk_size=32)
    with pytest.raises(ValueError, match=r"'attn_impl'.*'index_dim'.*'kv_lora_rank'"):
        build_mixer("dsa", cfg, "core", window=4)
