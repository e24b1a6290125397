"""The recent-token window of the quantized cache (`kv_quant="...,window=W"`, inference/kv_window.py).

Oracles: exact attention (SDPA) over the bf16-rounded keys and values when every token is in the
window; the same cache fed one call at a time (prefill then decode equals one forward of the whole
sequence); a row generated alone (the server's pool with rows of different lengths, moved rows);
the exact inner product (QJL with outliers: the estimate over older columns unbiased within 3
standard errors over sketch seeds, window columns exact up to bf16); and the storage of every tensor
a cache holds (its bytes, priced per token at a context by `KVQuant.bytes_per_token`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.cache import DynamicRecurrentCache, StaticRecurrentCache
from recurrent_depth.inference.kv_codec import KVQuant, layer_codec
from recurrent_depth.inference.kv_window import ExactWindow
from recurrent_depth.model.cache import parse_kv_policy
from recurrent_depth.ops.codes_attention import windowed_scores
from recurrent_depth.serving.kv_pool import QuantizedSlotKVPool
from tests.test_quant import bias_z
from tests.test_quant_cache import _reachable_tensors, filled_cache, logits_of

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HKV, D = 2, 4, 2, 32
SPECS = ["k=prod:2.5,v=mse:2.5", "k=qjl:2:out4,v=mse:2", "k=mse:3,v=mse:2,attn=dequantize"]


def qkv(T: int, g: torch.Generator, rows: int = B) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(rows, H, T, D, generator=g), torch.randn(rows, HKV, T, D, generator=g),
            torch.randn(rows, HKV, T, D, generator=g))


def run_calls(cache, lengths: list[int], g: torch.Generator, key=("prelude", 0)):
    """Feed causal calls of `lengths` tokens through `cache.attend`; the outputs and the inputs."""
    outs, qs, ks, vs = [], [], [], []
    for T in lengths:
        q, k, v = qkv(T, g)
        seen = cache.seq_len
        mask = (torch.arange(seen + T)[None] <= torch.arange(seen, seen + T)[:, None])[None, None]
        outs.append(cache.attend(key, q, k, v, None if seen == 0 else mask, seen == 0))
        cache.close(2, T)
        cache.advance(T)
        qs.append(q), ks.append(k), vs.append(v)
    return torch.cat(outs, 2), torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2)


@pytest.mark.parametrize("spec", SPECS)
def test_with_every_token_in_the_window_attention_is_exact_over_bf16_entries(spec):
    cache = StaticRecurrentCache(B, 2, capacity=4, kv_quant=f"{spec},window=16")
    out, q, k, v = run_calls(cache, [5, 1, 1, 1, 3], torch.Generator().manual_seed(0))
    want = F.scaled_dot_product_attention(q, k.bfloat16().float(), v.bfloat16().float(), is_causal=True,
                                          enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    bare = StaticRecurrentCache(B, 2, capacity=4, kv_quant=spec)
    assert not torch.allclose(run_calls(bare, [5, 1, 1, 1, 3], torch.Generator().manual_seed(0))[0], want,
                              atol=1e-2)  # without the window the codes are read


@pytest.mark.parametrize("spec", SPECS)
def test_prefill_then_decode_equals_one_forward_with_the_window(spec):
    spec += ",outliers=first"  # (calibrated outliers come from the first write, which differs between the two)
    full = StaticRecurrentCache(B, 2, capacity=4, kv_quant=f"{spec},window=3")
    one, *_ = run_calls(full, [11], torch.Generator().manual_seed(1))
    split = StaticRecurrentCache(B, 2, capacity=4, kv_quant=f"{spec},window=3")
    g = torch.Generator().manual_seed(1)
    q, k, v = qkv(11, g)
    outs = [split.attend(("prelude", 0), q[:, :, :4], k[:, :, :4], v[:, :, :4], None, True)]
    split.close(2, 4), split.advance(4)
    for t in range(4, 11):
        outs.append(split.attend(("prelude", 0), q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], None,
                                 False))
        split.close(2, 1), split.advance(1)
    torch.testing.assert_close(torch.cat(outs, 2), one, atol=1e-5, rtol=0)
    # and the window is read: no window, or another one, gives another function
    other = StaticRecurrentCache(B, 2, capacity=4, kv_quant=f"{spec},window=1")
    assert not torch.allclose(run_calls(other, [11], torch.Generator().manual_seed(1))[0], one, atol=1e-3)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def test_generation_prefill_then_decode_equals_the_whole_prompt_at_once(model):
    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 1, 4, 6]])
    run = dict(num_steps=4, init_scale=0.0, output_logits=True,
               kv_quant="k=prod:2.5,v=mse:2.5,window=3,outliers=first")  # (calibration: from the first write)
    forced = generate(model, ids[:, :6], max_new_tokens=4, teacher_tokens=ids[:, 6:], **run)
    for j in (1, 3):
        whole = generate(model, ids[:, :6 + j], max_new_tokens=1, **run)
        torch.testing.assert_close(logits_of(whole)[:, 0], logits_of(forced)[:, j], atol=1e-4, rtol=0)
    plain = generate(model, ids[:, :6], max_new_tokens=4, teacher_tokens=ids[:, 6:],
                     **{**run, "kv_quant": "k=prod:2.5,v=mse:2.5,outliers=first"})
    assert not torch.allclose(logits_of(plain), logits_of(forced), atol=1e-3)


def test_the_pool_reads_each_row_as_alone_with_rows_of_different_lengths_and_moved_rows():
    spec = "k=qjl:2:out4,v=mse:2.5,window=3"
    g = torch.Generator().manual_seed(2)
    prompts, steps = [2, 6, 4], 5
    data = [qkv(T + steps, g, rows=1) for T in prompts]  # each row's queries, keys, values
    alone = []
    for (q, k, v), T in zip(data, prompts):
        cache = StaticRecurrentCache(1, 1, capacity=4, kv_quant=spec)
        outs = [cache.attend(("prelude", 0), q[:, :, :T], k[:, :, :T], v[:, :, :T], None, True)]
        cache.advance(T)
        for t in range(T, T + steps):
            outs.append(cache.attend(("prelude", 0), *(x[:, :, t:t + 1] for x in (q, k, v)), None, False))
            cache.advance(1)
        alone.append(torch.cat(outs, 2))
    pool = QuantizedSlotKVPool(spec)
    pool.reserve(1, 4, 16, max_rows=4, max_capacity=16)
    got = [[] for _ in prompts]
    for b, T in enumerate(prompts):
        q, k, v = data[b]
        pool.set_policy(b, parse_kv_policy("per-step"))
        pool.bind_prefill(b, T, torch.zeros(1, 1, dtype=torch.long))
        got[b].append(pool.attend(("prelude", 0), q[:, :, :T], k[:, :, :T], v[:, :, :T], None, True))
    row_of = {0: 0, 1: 1, 2: 2}  # request -> pool row
    for i in range(steps):
        if i == 2:  # request 0 moves to row 1's place's neighbour: rows 2 -> 0 after request 0 is parked
            pool.move_row(0, 3, prompts[0] + i), pool.move_row(2, 0, prompts[2] + i), pool.move_row(3, 2,
                                                                                                     prompts[0] + i)
            row_of = {0: 2, 1: 1, 2: 0}
        reqs = sorted(row_of, key=row_of.get)
        rows = [row_of[r] for r in reqs]
        cols = [prompts[r] + i for r in reqs]
        L = max(cols) + 1
        pool.bind_tokens(rows, torch.tensor(rows), torch.tensor(cols), L, None)
        q, k, v = (torch.cat([data[r][j][:, :, c:c + 1] for r, c in zip(reqs, cols)]) for j in range(3))
        mask = (torch.arange(L)[None, :] <= torch.tensor(cols)[:, None])[:, None, None, :]
        out = pool.attend(("prelude", 0), q, k, v, mask, False)
        for j, r in enumerate(reqs):
            got[r].append(out[j:j + 1])
    for r in range(3):
        torch.testing.assert_close(torch.cat(got[r], 2), alone[r], atol=1e-5, rtol=0)
    lanes = pool.codes.window.lanes
    assert {lane[1] for lane in lanes} == {0, 1, 2}  # the parking row's lanes left with its move
    assert pool.nbytes() == sum(K.nbytes + V.nbytes for K, V in pool.kv.values()) + 3 * 2 * 3 * HKV * D * 2


def test_qjl_with_outliers_and_the_window_estimates_inner_products_without_bias():
    """Scores of one query over 16 keys (the last 4 in the window) across 200 sketch seeds: the older
    columns' estimates are unbiased (within 3 standard errors), the window's are ⟨q, bf16(k)⟩ exactly."""
    g = torch.Generator().manual_seed(7)
    S, W = 16, 4
    k = torch.randn(1, 1, S, D, generator=g)
    k[..., [3, 17]] *= 8  # two loud channels, the outliers
    q = torch.randn(1, 1, 1, D, generator=g)
    true = (q[0, 0, 0] * k[0, 0]).sum(-1) * D**-0.5
    window = ExactWindow(k[:, :, -W:].bfloat16(), k[:, :, -W:].bfloat16(), torch.arange(S - W, S)[None],
                         torch.tensor([[S - 1]]), W)
    errors = []
    for seed in range(200):
        codec = layer_codec(f"k=qjl:2:out2,seed={seed}", "k", D, k)
        assert codec.perm[0, :2].tolist() == [3, 17]
        scores = windowed_scores(q, codec.encode(k), codec.score, None, False, window)[0, 0, 0]
        assert torch.isinf(scores[S - W:S]).all()  # the window's columns are not read from the codes
        exact = (q[0, 0, 0] * k[0, 0, -W:].bfloat16().float()).sum(-1) * D**-0.5
        torch.testing.assert_close(scores[S:], exact, atol=1e-6, rtol=0)
        errors.append(scores[: S - W] - true[: S - W])
    assert abs(bias_z(torch.stack(errors).double())) < 3


@pytest.mark.parametrize("policy", ["per-step", "shared-2", "last-step+skip"])
@pytest.mark.parametrize("kv", ["k=qjl:2:out4,v=mse:3,window=4", "k=prod:2.5,v=mse:2.5,window=16"])
def test_every_tensor_reachable_from_a_window_cache_is_the_reported_bytes(model, kv, policy):
    cfg = model.config
    cache = filled_cache(model, kv, policy)  # 2 rows, 9 tokens at depth 4
    fields = {name: value for name, value in vars(cache).items() if name not in ("codecs", "kv_quant", "codes")}
    lanes = cache.codes.window.lanes
    tensors = _reachable_tensors(fields) + _reachable_tensors(lanes)
    tags = [t for _, _, t in lanes.values()]
    bookkeeping = [t for t in tensors if t.dtype in (torch.long, torch.bool)]
    assert all(t is cache.depth or t is cache.write_mask or any(t is tag for tag in tags) for t in bookkeeping)
    entries = [t for t in tensors if t.dtype not in (torch.long, torch.bool)]
    assert {t.dtype for t in entries} == {torch.uint8, torch.bfloat16}  # codes and the window's entries
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in entries}
    assert sum(storages.values()) == cache.nbytes()
    quant = KVQuant.parse(kv)
    W, T = quant.window, 9
    entries_per_token = 2 + cfg.core_layers * cache.num_core_slots  # the policy's slots, prelude and coda
    assert len(lanes) == 2 * entries_per_token
    per_token = quant.bytes_per_token(cfg.head_dim, cfg.num_kv_heads, entries_per_token, context=T)
    codes_only = quant.bytes_per_token(cfg.head_dim, cfg.num_kv_heads, entries_per_token)
    entry = cfg.num_kv_heads * 2 * cfg.head_dim * 2 * entries_per_token  # one token's k and v in bf16, every lane
    assert cache.logical_nbytes().tolist() == [round(T * per_token)] * 2 == [T * codes_only + min(W, T) * entry] * 2
    assert cache.nbytes() == 2 * (T * codes_only + W * entry)  # capacity 9 columns, W-token rings allocated
    cache.truncate(5)  # forgotten columns leave the window and the bytes
    assert cache.logical_nbytes().tolist() == [5 * codes_only + max(0, min(W, T) - (T - 5)) * entry] * 2


def test_a_window_is_refused_where_it_cannot_be_kept():
    with pytest.raises(ValueError, match="window"):
        DynamicRecurrentCache(1, 2, kv_quant="k=prod:2.5,window=4")
    with pytest.raises(ValueError, match="always-last"):
        StaticRecurrentCache(1, 2, policy="per-step+always-last", kv_quant="k=prod:2.5,window=4")
    for bad in ["window=-1", "window=x", "window=99999", "window=1.5"]:
        with pytest.raises(ValueError, match="window"):
            KVQuant.parse(f"k=prod:2.5,{bad}")
    assert KVQuant.parse("k=prod:2.5,window=0").window == 0
    assert KVQuant.parse("k=prod:2.5,v=mse:2.5,window=8").name == "k=prod:2.5,v=mse:2.5,attn=codes,window=8"


def test_info_prices_the_window_over_the_full_context(tmp_path, capsys):
    import json

    from recurrent_depth.cli import main

    cfg = rd.ModelConfig(head_dim=32, hidden_size=64, num_heads=2, max_seq_len=64)
    rd.RecurrentDepthLM(cfg).save_pretrained(tmp_path / "m")
    spec = "k=mse:2.5,v=mse:2.5,window=4"
    assert main(["info", "--model", str(tmp_path / "m"), "--kv-quant", spec, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    quant = KVQuant.parse(spec)
    assert info["kv_quant_bits_per_coordinate"] == quant.bits_per_coordinate(32, 64)
    bare = quant.bytes_per_token(32, cfg.num_kv_heads)
    entries = info["kv_cache_bytes_per_token_bf16_by_kv_policy"]["last-step+deepest"] // (2 * 2 * 32 * cfg.num_kv_heads)
    shared = info["kv_cache_bytes_per_token_quantized_by_kv_policy"]["last-step+deepest"]
    assert shared == round(entries * (bare + 4 * 2 * 2 * 32 * cfg.num_kv_heads / 64))  # 4 bf16 tokens of 64
    assert "4-token bf16 window" in info["kv_quant"]


def test_a_windowed_batch_equals_each_request_generated_alone(model):
    """The server's continuous batch (rows of different lengths joining and leaving, fixed depth and KL
    exit, per-step / shared-k / skip policies) with a window reads what `generate` alone reads."""
    from tests.test_serving_kv_quant import MODES, alone, jobs_for, run_batch

    spec = "k=prod:2.5,v=mse:2.5,window=3"
    jobs = jobs_for(list(MODES))
    out, dec = run_batch(model, jobs, spec)
    assert dec.pool.codes.window is not None
    for j, (prompt, kw, seed) in enumerate(jobs):
        tokens, steps, _, logp = alone(model, prompt, kw, seed, spec)
        assert [r.token for r in out[j]] == tokens and [r.steps for r in out[j]] == steps, list(MODES)[j]
        picked = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]), picked, rtol=0, atol=1e-4)
