"""Mixer algorithms against plain references written from their definitions.

- log-linear Gated DeltaNet: recurrent form vs the O(T^2) definition; chunked vs recurrent
  (outputs, final state, gradients, state passing at unaligned offsets); lambda = 1 vs Gated DeltaNet;
- Hydra: two-scan fast path vs its explicit quasiseparable matrix; non-causal; padding; mirror symmetry;
- NSA: each branch vs per-query loops; every block selected = dense causal attention;
- DSA: indexer scores (ReLU before the head sum) and sparse attention vs per-query loops, and vs
  flash-linear-attention's `naive_dsa` when fla-core is installed.

All comparisons run in float64 with tolerance 1e-10 unless a comment says otherwise.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.model.mixers import build_mixer
from recurrent_depth.model.mixers.hydra import Hydra, quasiseparable_matrix, quasiseparable_mix
from recurrent_depth.model.mixers.log_linear_delta import (
    chunk_log_linear_gated_delta_rule,
    recurrent_log_linear_gated_delta_rule,
)
from recurrent_depth.model.mixers.nsa import nsa_branches
from recurrent_depth.ops.gated_delta_rule import chunk_gated_delta_rule
from recurrent_depth.ops.log_linear_attn import LogLinearState

TOL = dict(rtol=1e-10, atol=1e-10)


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------- log-linear Gated DeltaNet
def lldelta_inputs(B=2, T=21, H=2, K=6, V=5, L=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = rand(B, T, H, K, gen=gen)
    k = F.normalize(rand(B, T, H, K, gen=gen), dim=-1)
    v = rand(B, T, H, V, gen=gen)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    lam = torch.rand(B, T, H, L, generator=gen, dtype=torch.float64) * 2
    return q, k, v, g, beta, lam


def lldelta_definition(q, k, v, g, beta, lam):
    """o_t = sum_{s<=t} lam_t[bit_length(t^s)] q_t^T P_{t<-s} beta_s k_s v_s^T / sqrt(K), products spelled out."""
    B, T, H, K = q.shape
    o = torch.zeros(*v.shape, dtype=v.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                for s in range(t + 1):
                    S = beta[b, s, h] * torch.outer(k[b, s, h], v[b, s, h])
                    for r in range(s + 1, t + 1):
                        kr = k[b, r, h]
                        S = g[b, r, h].exp() * (S - beta[b, r, h] * torch.outer(kr, kr @ S))
                    o[b, t, h] += lam[b, t, h, (t ^ s).bit_length()] * (S.T @ q[b, t, h]) * K**-0.5
    return o


def test_log_linear_delta_recurrence_matches_its_definition():
    q, k, v, g, beta, lam = lldelta_inputs(B=1, T=10, H=1, L=5)
    o, _ = recurrent_log_linear_gated_delta_rule(q, k, v, g, beta, lam)
    torch.testing.assert_close(o, lldelta_definition(q, k, v, g, beta, lam), **TOL)


@pytest.mark.parametrize("T,C", [(21, 4), (37, 8), (9, 16)], ids=["T21-C4", "T37-C8", "T9-C16"])
def test_log_linear_delta_chunk_equals_recurrent_with_gradients(T, C):
    inputs = [t.requires_grad_() for t in lldelta_inputs(T=T, L=7, K=6)]
    o_r, s_r = recurrent_log_linear_gated_delta_rule(*inputs, output_final_state=True)
    o_c, s_c = chunk_log_linear_gated_delta_rule(*inputs, output_final_state=True, chunk_size=C)
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c.levels, s_r.levels, **TOL)
    assert s_c.offset == s_r.offset == T
    w = torch.linspace(-1, 1, o_r.numel(), dtype=o_r.dtype).view_as(o_r)
    g_r = torch.autograd.grad((o_r * w).sum() + s_r.levels.sum(), inputs)
    g_c = torch.autograd.grad((o_c * w).sum() + s_c.levels.sum(), inputs)
    for a, b in zip(g_c, g_r):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("split", [3, 8, 13], ids=lambda s: f"split{s}")
def test_log_linear_delta_state_passing_equals_one_pass(split):
    q, k, v, g, beta, lam = lldelta_inputs(T=21, L=6)
    full, final = chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam, output_final_state=True, chunk_size=4)
    a, state = chunk_log_linear_gated_delta_rule(
        *(t[:, :split] for t in (q, k, v, g, beta, lam)), output_final_state=True, chunk_size=4
    )
    b, state = chunk_log_linear_gated_delta_rule(
        *(t[:, split:] for t in (q, k, v, g, beta, lam)), initial_state=state, output_final_state=True, chunk_size=4
    )
    torch.testing.assert_close(torch.cat([a, b], 1), full, **TOL)
    torch.testing.assert_close(state.levels, final.levels, **TOL)


def test_log_linear_delta_with_unit_levels_is_gated_deltanet():
    q, k, v, g, beta, lam = lldelta_inputs(T=19)
    o, _ = chunk_log_linear_gated_delta_rule(q, k, v, g, beta, torch.ones_like(lam), chunk_size=4)
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(o, ref, **TOL)


def test_log_linear_delta_bad_inputs_raise_value_error():
    q, k, v, g, beta, lam = lldelta_inputs(T=9)
    with pytest.raises(ValueError, match="beta"):
        chunk_log_linear_gated_delta_rule(q, k, v, g, beta[:, :, :1], lam)
    with pytest.raises(ValueError, match="level_scales"):
        chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam[..., :3])  # 9 positions need 5 levels
    with pytest.raises(ValueError, match="offset"):
        levels = torch.zeros(2, 2, 6, 6, 5, dtype=torch.float64)
        recurrent_log_linear_gated_delta_rule(q, k, v, g, beta, lam, initial_state=LogLinearState(levels, 0))


# ---------------------------------------------------------------------------- Hydra
def hydra_inputs(B=2, T=11, H=3, P=4, N=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = rand(B, T, H, P, gen=gen)
    dt = F.softplus(rand(B, T, 2, H, gen=gen))
    A = -torch.rand(H, generator=gen, dtype=torch.float64) - 0.1
    Bf, Cf, Bb, Cb = (rand(B, T, N, gen=gen) for _ in range(4))
    diag = rand(B, T, H, gen=gen)
    return x, dt, A, Bf, Cf, Bb, Cb, diag


@pytest.mark.parametrize("chunk", [True, False], ids=["chunk", "recurrent"])
def test_hydra_scans_equal_the_explicit_quasiseparable_matrix(chunk):
    x, *params = (t.requires_grad_() for t in hydra_inputs())
    fast = quasiseparable_mix(x, *params, chunk=chunk)
    M = quasiseparable_matrix(*params)  # [B, H, T, T]
    ref = torch.einsum("bhij,bjhp->bihp", M, x)
    torch.testing.assert_close(fast, ref, **TOL)
    w = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).view_as(ref)
    grads_fast = torch.autograd.grad((fast * w).sum(), [x, *params])
    grads_ref = torch.autograd.grad((ref * w).sum(), [x, *params])
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_hydra_mirrored_parameters_give_the_mirrored_output():
    x, dt, A, Bf, Cf, Bb, Cb, diag = hydra_inputs()
    out = quasiseparable_mix(x, dt, A, Bf, Cf, Bb, Cb, diag)
    mirrored = quasiseparable_mix(x.flip(1), dt.flip(1).flip(2), A, Bb.flip(1), Cb.flip(1), Bf.flip(1), Cf.flip(1),
                                  diag.flip(1))
    torch.testing.assert_close(mirrored, out.flip(1), **TOL)


def hydra_layer():
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=16, num_heads=2)
    torch.manual_seed(0)
    return Hydra(cfg, state_dim=6, conv_size=5).double(), cfg


def test_hydra_layer_is_bidirectional_and_padding_invariant():
    layer, cfg = hydra_layer()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    base = layer(x)
    x2 = x.clone()
    x2[0, -1] += 1.0
    assert not torch.allclose(layer(x2)[0, 0], base[0, 0])  # the first output sees the last token
    padded = torch.cat([torch.randn(1, 3, 16, dtype=torch.float64), x], 1)
    mask = torch.tensor([[False] * 3 + [True] * 9])
    torch.testing.assert_close(layer(padded, mask=mask)[:, 3:], base, **TOL)
    recurrent = Hydra(cfg, state_dim=6, conv_size=5, mode="fused_recurrent").double()
    recurrent.load_state_dict(layer.state_dict())
    torch.testing.assert_close(recurrent(x), base, **TOL)


def test_hydra_refuses_a_cache_and_bad_options():
    layer, cfg = hydra_layer()
    ctx = rd.RecurrentDepthLM.make_context(SimpleNamespace(config=cfg), torch.zeros(1, 4, dtype=torch.long),
                                           cache=rd.DynamicCache())
    with pytest.raises(ValueError, match="bidirectional"):
        layer(torch.randn(1, 4, 16, dtype=torch.float64), ctx)
    with pytest.raises(ValueError, match="conv_size"):
        Hydra(cfg, conv_size=4)
    with pytest.raises(ValueError, match="head_dim"):
        Hydra(cfg, head_dim=7)
    with pytest.raises(ValueError, match="unknown mixer 'hydra'"):  # not a causal mixer: not registered
        build_mixer("hydra", cfg, "core")


# ---------------------------------------------------------------------------- NSA
def nsa_reference(q, k, v, block_size, block_counts, window):
    """Per-(batch, head, query) loops: compressed blocks, block choice by group score, window."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G, scale = H // Hkv, D**-0.5
    nb = -(-T // block_size)
    k_cmp = torch.stack([k[:, :, c * block_size : (c + 1) * block_size].mean(2) for c in range(nb)], 2)
    v_cmp = torch.stack([v[:, :, c * block_size : (c + 1) * block_size].mean(2) for c in range(nb)], 2)
    outs = [torch.zeros_like(q) for _ in range(3)]

    def attend(qv, keys, values):
        if keys.shape[0] == 0:
            return torch.zeros_like(qv)
        return ((keys @ qv) * scale).softmax(0) @ values

    for b in range(B):
        for t in range(T):
            visible = [c for c in range(nb) if (c + 1) * block_size - 1 <= t]
            probs = {}
            for h in range(H):
                kv = h // G
                outs[0][b, h, t] = attend(q[b, h, t], k_cmp[b, kv, visible], v_cmp[b, kv, visible])
                if visible:
                    probs[h] = ((k_cmp[b, kv, visible] @ q[b, h, t]) * scale).softmax(0)
            own = t // block_size
            for kv in range(Hkv):
                score = {c: 0.0 for c in range(own + 1)}
                for h in range(kv * G, (kv + 1) * G):
                    for i, c in enumerate(visible):
                        score[c] += float(probs[h][i])
                forced = {0, own, own - 1} & set(score)
                ranked = sorted(set(score) - forced, key=lambda c: -score[c])
                chosen = forced | set(ranked[: max(block_counts - len(forced), 0)])
                keys = [s for s in range(t + 1) if s // block_size in chosen]
                recent = [s for s in range(t + 1) if t - s < window]
                for h in range(kv * G, (kv + 1) * G):
                    outs[1][b, h, t] = attend(q[b, h, t], k[b, kv, keys], v[b, kv, keys])
                    outs[2][b, h, t] = attend(q[b, h, t], k[b, kv, recent], v[b, kv, recent])
    return outs


def nsa_inputs(T=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return rand(2, 4, T, 6, gen=gen), rand(2, 2, T, 6, gen=gen), rand(2, 2, T, 6, gen=gen)


@pytest.mark.parametrize("block_size,block_counts,window", [(2, 3, 3), (3, 1, 5), (4, 2, 1)],
                         ids=["bs2-n3-w3", "bs3-n1-w5", "bs4-n2-w1"])
def test_nsa_branches_equal_per_query_loops(block_size, block_counts, window):
    q, k, v = nsa_inputs()
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    got = nsa_branches(q, k, v, causal, torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool),
                       block_size, block_counts, window)
    for a, b in zip(got, nsa_reference(q, k, v, block_size, block_counts, window)):
        torch.testing.assert_close(a, b, **TOL)


def test_nsa_with_every_block_selected_is_dense_attention():
    q, k, v = nsa_inputs(T=13)
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    _, o_slc, o_win = nsa_branches(q, k, v, causal, torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool),
                                   block_size=3, block_counts=5, window=T)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(o_slc, dense, **TOL)
    torch.testing.assert_close(o_win, dense, **TOL)


# ---------------------------------------------------------------------------- DSA
def dsa_layer(topk):
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=32, num_heads=2, max_seq_len=64)
    torch.manual_seed(5)
    # 8 indexer heads: with few heads, ReLU zeroes whole scores often and ties make top-k ambiguous
    layer = build_mixer("dsa", cfg, "core", topk=topk, index_heads=8).double()
    ctx = rd.RecurrentDepthLM.make_context(SimpleNamespace(config=cfg), torch.zeros(2, 12, dtype=torch.long))
    return layer, ctx, torch.randn(2, 12, 32, dtype=torch.float64)


def dsa_parts(layer, ctx, x):
    """What the reference needs: per-head q, k, v (MLA in MHA mode) and the indexer's q, k, w."""
    B, T, _ = x.shape
    q_nope, q_rope, c_kv, k_rope = layer.project(x, ctx)
    kv = layer.wkv_b(c_kv).view(B, T, layer.num_heads, -1)
    k_nope, v = kv.split([layer.qk_nope_dim, layer.v_head_dim], -1)
    q = torch.cat([q_nope, q_rope], -1)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, layer.num_heads, -1)], -1)
    q_idx = layer._rope_prefix(layer.indexer["wq"](x).view(B, T, layer.index_heads, layer.index_dim), ctx)
    k_idx = layer.index_key(x, ctx)
    w = layer.indexer["weights"](x) * layer.index_heads**-0.5
    return q, k, v, q_idx, k_idx, w


def test_dsa_equals_per_query_loops_with_relu_before_the_head_sum():
    layer, ctx, x = dsa_layer(topk=4)
    with torch.no_grad():
        out = layer(x, ctx, ("core", 0, 0))
        q, k, v, q_idx, k_idx, w = dsa_parts(layer, ctx, x)
    B, T, H, _ = q.shape
    ref = torch.zeros(B, T, H, layer.v_head_dim, dtype=x.dtype)
    for b in range(B):
        for t in range(T):
            score = [sum(float(w[b, t, j]) * max(float(q_idx[b, t, j] @ k_idx[b, s]), 0.0)
                         for j in range(layer.index_heads)) * layer.index_dim**-0.5 for s in range(t + 1)]
            ranked = sorted(range(t + 1), key=lambda s: -score[s])
            keys = ranked[:4]
            assert t < 4 or score[ranked[3]] > score[ranked[4]], "a tie at the top-k boundary: change the seed"
            for h in range(H):
                p = ((k[b, keys, h] @ q[b, t, h]) * layer.scale).softmax(0)
                ref[b, t, h] = p @ v[b, keys, h]
    torch.testing.assert_close(out, layer.proj(ref.reshape(B, T, -1)), **TOL)


def load_fla_naive(op: str):
    """fla's pure-PyTorch reference, loaded by path: importing fla.ops needs triton."""
    fla = pytest.importorskip("fla")
    path = Path(fla.__file__).parent / "ops" / op / "naive.py"
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dsa_matches_flash_linear_attention_naive_dsa():
    naive = load_fla_naive("dsa")
    layer, ctx, x = dsa_layer(topk=5)
    out = layer(x, ctx, ("core", 0, 0))
    q, k, v, q_idx, k_idx, w = dsa_parts(layer, ctx, x)
    o = naive.naive_dsa(q, k, v, q_idx, k_idx, w, topk=5, scale=layer.scale)  # fla computes in float32
    ref = layer.proj(o.to(x.dtype).reshape(*x.shape[:2], -1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
