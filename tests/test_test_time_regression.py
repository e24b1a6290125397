"""TTT-KVB and FALCON: fast forms against the step-by-step definitions, the reductions to linear
attention and the delta rule, a hand-worked FALCON step, and the mixers inside the model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.model.mixers import build_mixer
from recurrent_depth.ops import (
    FalconState,
    TTTKVBState,
    chunk_falcon,
    chunk_linear_attn,
    chunk_ttt_kvb,
    naive_recurrent_delta_rule,
    naive_recurrent_falcon,
    naive_recurrent_ttt_kvb,
)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64
F32_TOL = dict(rtol=2e-5, atol=2e-5)
F64_TOL = dict(rtol=1e-10, atol=1e-10)
CASES = {"ttt_kvb": ("ttt_kvb", {"mini_batch": 4}), "ttt_kvb-b1": ("ttt_kvb", {"mini_batch": 1}),
         "falcon": ("falcon", {"chunk_size": 4})}


def inputs(B=2, T=37, H=3, K=5, V=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, beta)]


def outputs_and_grads(op, args, **kw):
    o, state = op(*args, output_final_state=True, **kw)
    leaves = [state.current, state.start] if isinstance(state, TTTKVBState) else [state.S]
    weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
    loss = (o * weights).sum() + sum((s * s.new_tensor(0.3)).sum() for s in leaves)
    return o, state, torch.autograd.grad(loss, args)


@pytest.mark.parametrize("T", [37, 16, 5])
def test_chunked_ttt_kvb_equals_naive_outputs_states_gradients(T):
    args = inputs(T=T)
    a = outputs_and_grads(chunk_ttt_kvb, args, mini_batch=16)
    b = outputs_and_grads(naive_recurrent_ttt_kvb, args, mini_batch=16)
    torch.testing.assert_close(a[0], b[0], **F64_TOL)
    for x, y in zip(a[1][:2], b[1][:2]):
        torch.testing.assert_close(x, y, **F64_TOL)
    assert a[1].offset == b[1].offset == T % 16
    for x, y in zip(a[2], b[2]):
        torch.testing.assert_close(x, y, **F64_TOL)


def test_chunked_ttt_kvb_resumes_inside_a_mini_batch():
    q, k, v, beta = (t.detach() for t in inputs(T=37))
    full, _ = naive_recurrent_ttt_kvb(q, k, v, beta, mini_batch=16)
    o1, s = chunk_ttt_kvb(q[:, :21], k[:, :21], v[:, :21], beta[:, :21], output_final_state=True, mini_batch=16)
    o2, _ = chunk_ttt_kvb(q[:, 21:], k[:, 21:], v[:, 21:], beta[:, 21:], initial_state=s, mini_batch=16)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full, **F64_TOL)


def test_ttt_kvb_with_one_token_batches_is_the_delta_rule():
    q, k, v, beta = (t.detach() for t in inputs())
    o, s = chunk_ttt_kvb(q, k, v, beta, output_final_state=True, mini_batch=1)
    o_ref, S_ref = naive_recurrent_delta_rule(q, k, v, beta, output_final_state=True)
    torch.testing.assert_close(o, o_ref, **F64_TOL)
    torch.testing.assert_close(s.current, S_ref, **F64_TOL)


def test_ttt_kvb_with_one_batch_from_zero_is_unnormalised_linear_attention():
    """W_0 = 0 and every gradient taken at W_0 (b ≥ T): o_t = Σ_{s≤t} β_s v_s k_sᵀ q_t."""
    q, k, v, beta = (t.detach() for t in inputs())
    o, s = chunk_ttt_kvb(q, k, v, beta, output_final_state=True, mini_batch=64)
    o_ref, S_ref = chunk_linear_attn(q, k * beta[..., None], v, output_final_state=True, chunk_size=8)
    torch.testing.assert_close(o, o_ref, **F64_TOL)
    torch.testing.assert_close(s.current, S_ref, **F64_TOL)


@pytest.mark.parametrize("T", [37, 1])
def test_chunked_falcon_equals_naive_outputs_states_gradients(T):
    args = inputs(T=T)
    S0 = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    state = FalconState(S0, torch.randn(2, 3, 5, dtype=torch.float64))
    a = outputs_and_grads(chunk_falcon, args, chunk_size=16, initial_state=state)
    b = outputs_and_grads(naive_recurrent_falcon, args, initial_state=state)
    torch.testing.assert_close(a[0], b[0], **F64_TOL)
    torch.testing.assert_close(a[1].S, b[1].S, **F64_TOL)
    torch.testing.assert_close(a[1].last_key, b[1].last_key, **F64_TOL)
    for x, y in zip(a[2], b[2]):
        torch.testing.assert_close(x, y, **F64_TOL)


def test_falcon_step_on_a_hand_case():
    """S0 = [[1], [0]], previous key x = (1, 1), v = 3, β = 0.5, ε = 0:
    prediction S0ᵀx = 1, error 2, step 0.5 / ‖x‖² = 0.25, S1 = S0 + 0.25·2·x = [[1.5], [0.5]];
    query (2, 0) with scale 1 reads 2·1.5 = 3."""
    f = dict(dtype=torch.float64)
    state = FalconState(torch.tensor([[1.0], [0.0]], **f).view(1, 1, 2, 1), torch.tensor([1.0, 1.0], **f).view(1, 1, 2))
    q = torch.tensor([2.0, 0.0], **f).view(1, 1, 1, 2)
    k = torch.tensor([0.3, -0.4], **f).view(1, 1, 1, 2)  # this token's key only matters for the next step
    v = torch.tensor([3.0], **f).view(1, 1, 1, 1)
    beta = torch.tensor([0.5], **f).view(1, 1, 1)
    for op in (naive_recurrent_falcon, chunk_falcon):
        o, s = op(q, k, v, beta, scale=1.0, initial_state=state, output_final_state=True, eps=0.0)
        assert o.item() == pytest.approx(3.0, abs=1e-12)
        assert s.S.flatten().tolist() == pytest.approx([1.5, 0.5], abs=1e-12)
        assert s.last_key.flatten().tolist() == pytest.approx([0.3, -0.4])


def test_falcon_first_token_has_no_previous_key():
    q, k, v, beta = (t.detach() for t in inputs(T=1))
    o, s = naive_recurrent_falcon(q, k, v, beta, output_final_state=True)
    assert o.abs().max() == 0 and s.S.abs().max() == 0


def test_bad_state_and_options_raise_clear_errors():
    q, k, v, beta = (t.detach() for t in inputs(T=3))
    with pytest.raises(ValueError, match="mini_batch"):
        chunk_ttt_kvb(q, k, v, beta, mini_batch=0)
    with pytest.raises(ValueError, match="FalconState"):
        chunk_falcon(q, k, v, beta, initial_state=torch.zeros(2, 3, 5, 7))
    with pytest.raises(ValueError, match="offset"):
        zeros = torch.zeros(2, 3, 5, 7, dtype=torch.float64)
        naive_recurrent_ttt_kvb(q, k, v, beta, initial_state=TTTKVBState(zeros, zeros, 4), mini_batch=4)


@pytest.mark.parametrize("eps, message", [(0.0, "eps=0 needs an initial_state"), (-1.0, "eps must be a finite"),
                                           (float("nan"), "eps must be a finite"),
                                           (float("inf"), "eps must be a finite")])
def test_falcon_refuses_an_eps_that_makes_the_output_nan(eps, message):
    """Without a state x_0 = 0, so eps = 0 gave 0/0 = NaN outputs silently (a negative eps: a zero denominator)."""
    q, k, v, beta = (t.detach() for t in inputs(T=3))
    for op in (chunk_falcon, naive_recurrent_falcon):
        with pytest.raises(ValueError, match=message):
            op(q, k, v, beta, eps=eps)


# ------------------------------------------------------------------------------------- in the model
def small_config(mixer, options):
    return rd.ModelConfig.from_preset("tiny", hidden_size=32, num_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                      core_layers=1, max_seq_len=64, mixer={"core": mixer},
                                      mixer_options={mixer: options})


def core_model(case):
    name, options = CASES[case]
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(small_config(name, options)).eval()


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_equals_full_forward(case):
    model = core_model(case)
    x = tokens(2, 11)
    full = model(x, num_steps=2, init_scale=0.0).logits
    cache = rd.DynamicCache()
    outs = [model(x[:, :5], num_steps=2, init_scale=0.0, cache=cache).logits]
    for t in range(5, 11):
        outs.append(model(x[:, t : t + 1], num_steps=2, init_scale=0.0, cache=cache).logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, **F32_TOL)
    blocks = [*model.transformer.prelude, *model.transformer.coda]
    promised = sum(b.attn.state_nbytes(2, 11) for b in blocks)
    promised += 2 * sum(b.attn.state_nbytes(2, 11) for b in model.transformer.core_block)
    assert cache.nbytes() == promised


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_layer_equals_step_by_step_layer_with_gradients(case):
    name, options = CASES[case]
    cfg = small_config(name, options)
    torch.manual_seed(3)
    fast = build_mixer(name, cfg, "core", **options, mode="chunk").double()
    slow = build_mixer(name, cfg, "core", **options, mode="fused_recurrent").double()
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(2, 13, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    ctx = rd.RecurrentDepthLM.make_context(SimpleNamespace(config=cfg), torch.zeros(2, 13, dtype=torch.long),
                                           None, None, None)
    results = []
    for mixer in (fast, slow):
        out = mixer(x, ctx, ("core", 0, 0))
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        results.append((out, torch.autograd.grad((out * weights).sum(), [x, *mixer.parameters()])))
    torch.testing.assert_close(results[0][0], results[1][0], **F64_TOL)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["falcon", "ttt_kvb-b1"])
def test_left_padding_matches_running_alone(case):
    """(TTT-KVB with mini_batch > 1 counts padded positions in its mini-batches: see docs/mixers.md.)"""
    model = core_model(case)
    pad = 3
    a, b = tokens(1, 10, seed=1), tokens(1, 10 - pad, seed=2)
    alone = model(b, num_steps=2, init_scale=0.0).logits
    batch = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    out = model(batch, num_steps=2, init_scale=0.0, attention_mask=mask).logits
    torch.testing.assert_close(out[1, pad:], alone[0], **F32_TOL)


def test_padded_tokens_train_nothing_in_ttt_kvb():
    model = core_model("ttt_kvb")
    x = tokens(1, 8)
    mask = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1]])
    cache = rd.DynamicCache()
    model(x, num_steps=1, init_scale=0.0, attention_mask=mask, cache=cache)
    only_last = rd.DynamicCache()
    model(x[:, 7:], num_steps=1, init_scale=0.0, cache=only_last)
    # 7 pads then one real token: the same weight as the real token alone (offsets differ: 0 vs 1)
    state, alone = cache.get_state(("core", 0, 0))["recurrent"], only_last.get_state(("core", 0, 0))["recurrent"]
    torch.testing.assert_close(state.current, alone.current, **F32_TOL)


@pytest.mark.parametrize("part", ["prelude", "core", "coda"])
def test_a_tiny_model_with_each_mixer_trains_a_step(part):
    for name, options in (CASES["ttt_kvb"], CASES["falcon"]):
        torch.manual_seed(0)
        cfg = small_config(name, options)
        cfg.mixer = {part: name}
        model = rd.RecurrentDepthLM(cfg).train()
        x = tokens(2, 12)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model(x, num_steps=2, init_scale=0.0, labels=x).loss
        before.backward()
        opt.step()
        after = model(x, num_steps=2, init_scale=0.0, labels=x).loss
        assert torch.isfinite(after) and after < before


@pytest.mark.parametrize("case", ["ttt_kvb", "falcon"])
def test_cli_info_and_api_generate_with_the_mixer_in_the_core(case, tmp_path, capsys):
    import json

    from recurrent_depth.cli import main

    model = core_model(case)
    model.config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["unique_parameters"] == model.num_parameters()
    out = rd.generate(model, tokens(1, 6), max_new_tokens=4, num_steps=2, do_sample=False)
    ids = out.sequences if hasattr(out, "sequences") else out[0]
    assert ids.shape[-1] == 10


def test_unknown_option_names_the_mixer():
    with pytest.raises(ValueError, match="ttt_kvb"):
        build_mixer("ttt_kvb", small_config("ttt_kvb", {}), "core", chunk_size=4)
    with pytest.raises(ValueError, match="mini_batch"):
        build_mixer("ttt_kvb", small_config("ttt_kvb", {}), "core", mini_batch=0)


@pytest.mark.parametrize("case", ["ttt_kvb", "falcon"])
def test_bf16_autocast_training_step_is_finite(case):
    model = core_model(case).train()
    x = tokens(2, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, num_steps=2, init_scale=0.0, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
