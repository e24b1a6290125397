"""The quantized KV cache (inference/quant_cache.py) against the plain caches, and its interfaces.

Oracles: the raw 16-bit codec run through the packed storage equals the unquantized static cache
exactly (bf16 model, the dequantize read: the same SDPA on the same bf16 values); a real codec
equals `DequantizedDynamicCache`, the plain per-column reference storing each entry's codec round
trip; the codes read equals the dequantize read. Tolerance 1e-4 on logits where two float32
computations differ only in summation order (observed <= 2e-6).
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.accel import runner as accel_runner
from recurrent_depth.accel.quant import CodeKernels, _encode_pair, _turbo_attention, code_kernels
from recurrent_depth.inference import generate
from recurrent_depth.inference.quant_cache import (
    DequantizedDynamicCache,
    KVQuant,
    QuantizedRecurrentCache,
    layer_codec,
    shared_codec,
)
from recurrent_depth.quant import build_quantizer, kv_bytes_per_token, parse_kv_quant
from recurrent_depth.quant.rows import RowCodec, TurboRows, row_codec
from tests.test_serving import LiveServer, model_dir, reference  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
POLICIES = ["per-step", "shared-3", "last-step", "per-step+skip", "shared-3+skip", "anchor-2+full",
            "per-step+always-last", "per-step+randomized", "latest-m4-compress-s4", "compress-r4"]
EXITS = {"fixed": {}, "kl-exit": dict(exit_criterion="kl", exit_threshold=5e-2)}
RUN = dict(max_new_tokens=6, num_steps=6, init_scale=0.0, output_logits=True)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def bf16_model(model) -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).to(torch.bfloat16).eval()


PROMPT = torch.tensor([[5, 9, 2, 7, 11, 3, 8], [0, 0, 4, 6, 1, 12, 10]])
MASK = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])


def logits_of(out) -> torch.Tensor:
    return out.logits if isinstance(out.logits, torch.Tensor) else torch.stack(list(out.logits))


@pytest.mark.parametrize("exit_", EXITS)
@pytest.mark.parametrize("spec", POLICIES)
def test_raw16_through_the_packed_storage_equals_the_plain_static_cache(bf16_model, spec, exit_):
    torch.manual_seed(0)  # the randomized lookup draws from the global RNG
    plain = generate(bf16_model, PROMPT, attention_mask=MASK, kv_policy=spec, **RUN, **EXITS[exit_])
    torch.manual_seed(0)
    raw = generate(bf16_model, PROMPT, attention_mask=MASK, kv_policy=spec, **RUN, **EXITS[exit_],
                   kv_quant="k=raw:16,v=raw:16,attn=dequantize")
    assert torch.equal(raw.sequences, plain.sequences)
    assert torch.equal(raw.steps, plain.steps)
    assert torch.equal(logits_of(raw), logits_of(plain))


@pytest.mark.parametrize("fast", [True, False], ids=["fast-runner", "reference-runner"])
@pytest.mark.parametrize("attn", ["codes", "dequantize"])
@pytest.mark.parametrize("exit_", EXITS)
@pytest.mark.parametrize("spec", [p for p in POLICIES if "randomized" not in p])  # (draws differ by storage)
def test_quantized_cache_equals_its_dequantized_dynamic_reference(model, spec, exit_, attn, fast):
    quant = f"k=prod:3.5,v=mse:3.5,attn={attn}"
    kwargs = dict(attention_mask=MASK, kv_policy=spec, kv_quant=quant, fast=fast, **RUN, **EXITS[exit_])
    static = generate(model, PROMPT, **kwargs)
    plain = generate(model, PROMPT, cache_implementation="dynamic", **kwargs)
    assert torch.equal(static.sequences, plain.sequences)
    assert torch.equal(static.steps, plain.steps)
    torch.testing.assert_close(logits_of(static), logits_of(plain), atol=TOL, rtol=0)
    assert torch.equal(static.cache_bytes, plain.cache_bytes)
    if exit_ == "kl-exit":
        assert bool((static.steps < 6).any())  # early exits happened: the lookup rules were exercised


def test_quantization_changes_the_entries_and_bits_order_the_error(model):
    """A real codec is not the identity, and more bits give logits closer to the full cache."""
    full = logits_of(generate(model, PROMPT, attention_mask=MASK, **RUN))
    errors = [(logits_of(generate(model, PROMPT, attention_mask=MASK, kv_quant=f"k=mse:{b},v=mse:{b}", **RUN))
               - full).abs().mean().item() for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2] > 0


@pytest.mark.parametrize("kv", ["k=prod:3.5,v=mse:3.5", "k=mse:2.5,v=mse:2", "k=qjl:2,v=polar", "k=prod:3"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_scoring_the_codes_equals_sdpa_over_the_decoded_entries(kv, heads):
    """`attend` (scores from codes, values summed in the rotated basis) vs decode + SDPA, with a
    padding mask, a skip lookup hiding columns, and grouped-query heads."""
    check_codes_attention_against_sdpa(kv, heads)


def check_codes_attention_against_sdpa(kv, heads, kernels=None, decode_tokens=1):
    """A prefill of 5 tokens, then `decode_tokens` single tokens, two steps each, through
    `attend(..., kernels)` vs decode + SDPA."""
    H, Hkv = heads
    B, P, D = 2, 5, 16
    g = torch.Generator().manual_seed(0)

    def caches():
        return [QuantizedRecurrentCache(B, 3, capacity=8, policy="per-step+skip", kv_quant=f"{kv},attn={a}")
                for a in ("codes", "dequantize")]

    codes_cache, plain_cache = caches()
    pad = torch.ones(B, 1, 1, P + decode_tokens, dtype=torch.bool)
    pad[1, ..., :2] = False
    for T, mask, causal in [(P, None, True)] + [(1, pad, False)] * decode_tokens:
        q = torch.randn(B, H, T, D, generator=g)
        k, v = torch.randn(B, Hkv, T, D, generator=g), torch.randn(B, Hkv, T, D, generator=g)
        if mask is None:  # the prefill calibrates: one channel order for both rows (the reference's encode
            k[1], v[1] = k[0], v[0]  # is eager; per-row rotations can round a code the other way compiled)
        if mask is not None:
            mask = mask[..., : codes_cache.seq_len + T]
        for step in range(2):
            key = ("core", 0, step)
            got = codes_cache.attend(key, q, k, v, mask, causal, kernels)
            K, V = plain_cache.update_heads(key, k, v)
            m, c = mask, causal
            key_mask = plain_cache.key_mask(key)
            if key_mask is not None:
                from recurrent_depth.model.cache import combine_key_mask

                m, c = combine_key_mask(m, key_mask, T), False
            want = F.scaled_dot_product_attention(q, K, V, attn_mask=m, is_causal=c, enable_gqa=Hkv != H)
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        depth = torch.tensor([[2] * T, [1] * T])
        for cache in (codes_cache, plain_cache):
            cache.close(depth)
            cache.advance(T)


class EagerKernels:
    """The kernels interface run by the eager functions (what `CodeKernels` compiles), counting calls."""

    def __init__(self):
        self.calls = {"encode": 0, "attend": 0}
        self.inner = CodeKernels()

    def fits(self, ck, cv, x):
        return self.inner.fits(ck, cv, x)

    def encode(self, ck, cv, k, v):
        self.calls["encode"] += 1
        rows_k, rows_v, _ = _encode_pair(k, v, ck.tables(k.device), cv.tables(v.device))
        return rows_k, rows_v

    def attend(self, ck, cv, q, rows_k, rows_v, mask, is_causal):
        self.calls["attend"] += 1
        return _turbo_attention(q, rows_k, rows_v, ck.tables(q.device), cv.tables(q.device), mask, is_causal)


@pytest.mark.parametrize("kv", ["k=prod:3.5,v=mse:3.5", "k=prod:1.5,v=mse:2.5", "k=qjl:2,v=mse:3"])
def test_the_fused_kernel_functions_equal_sdpa_over_the_decoded_entries(kv):
    """What the compiled kernels compute (their eager functions), in decode calls; other codecs
    (QJL) take the codecs' own path."""
    kernels = EagerKernels()
    with torch.no_grad():  # (the kernels serve inference only)
        check_codes_attention_against_sdpa(kv, (4, 2), kernels, decode_tokens=2)
    fused = "qjl" not in kv
    assert kernels.calls == ({"encode": 4, "attend": 4} if fused else {"encode": 0, "attend": 0})


def test_the_fast_runner_passes_the_kernels_to_quantized_caches(model, monkeypatch):
    """Decode calls of the fast runner go through the kernels; the result is the eager one."""
    kernels = EagerKernels()
    monkeypatch.setattr(accel_runner, "code_kernels", lambda: kernels)
    kwargs = dict(attention_mask=MASK, kv_policy="shared-3+skip", kv_quant="k=prod:3.5,v=mse:3.5", **RUN)
    fused = generate(model, PROMPT, **kwargs)
    monkeypatch.setattr(accel_runner, "code_kernels", lambda: None)
    eager = generate(model, PROMPT, **kwargs)
    assert kernels.calls["attend"] > 0 and kernels.calls["encode"] == kernels.calls["attend"]
    assert torch.equal(fused.sequences, eager.sequences)
    torch.testing.assert_close(logits_of(fused), logits_of(eager), atol=TOL, rtol=0)


def test_compiled_kernels_equal_sdpa_over_the_decoded_entries():
    """torch.compile'd encode and attention (one prefill, then decode tokens of a growing sequence,
    padding and skip masks, grouped-query heads) vs decode + SDPA; the one compiling test (~20-40 s
    here; skipped where compiling fails, e.g. without a C++ compiler)."""
    kernels = CodeKernels()
    with torch.no_grad():
        check_codes_attention_against_sdpa("k=prod:3.5,v=mse:3.5", (4, 2), kernels, decode_tokens=3)
    if kernels.failure is not None:
        pytest.skip(f"torch.compile is unavailable here: {kernels.failure}")


def test_the_compile_switch(monkeypatch):
    monkeypatch.setenv("RDEPTH_NO_CPP", "1")  # (the C++ kernels alone give kernels too: test_quant_cpp.py)
    monkeypatch.setenv("RDEPTH_NO_COMPILE", "1")
    assert code_kernels() is None
    monkeypatch.setenv("RDEPTH_NO_COMPILE", "0")
    assert isinstance(code_kernels(), CodeKernels) and code_kernels() is code_kernels()


def _reachable_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor held by the cache object, through dicts, lists, tuples (the codecs excluded:
    quantizer state is per cache, not per token, and counted as `state_nbytes`)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _reachable_tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _reachable_tensors(v)]
    return []


def filled_cache(model, kv: str, policy: str) -> QuantizedRecurrentCache:
    """A 2-row quantized cache holding a 9-token prompt's entries at depth 4 (closed and advanced)."""
    cache = QuantizedRecurrentCache(2, 4, capacity=9, policy=policy, kv_quant=kv)
    ids = torch.tensor([[5, 9, 2, 7, 11, 3, 8, 1, 4]])
    with torch.inference_mode():
        engine = rd.inference.engine.Recurrence(model)
        pass_ = engine.begin(ids.expand(2, -1), None, cache)
        state = engine.run(engine.initial_state(pass_.e, 0.0, None), pass_, 4)
        engine.readout(state, pass_)
        cache.close(4, ids.shape[1])
        cache.advance(ids.shape[1])
    return cache


@pytest.mark.parametrize("spec", ["per-step", "shared-2", "last-step+skip"])
@pytest.mark.parametrize("kv", ["k=prod:3.5,v=mse:3.5", "k=prod:2.5,v=mse:2.5", "k=raw:16,v=mse:4"])
def test_every_tensor_reachable_from_a_quantized_cache_is_the_reported_bytes(model, kv, spec):
    cfg = model.config
    cache = filled_cache(model, kv, spec)
    fields = {name: value for name, value in vars(cache).items() if name not in ("codecs", "kv_quant")}
    # The codecs hold quantizer state only: per calibrated layer (keys), a [Hkv, D] channel
    # permutation and its inverse, priced as one D-bit outlier mask per head, plus the seed.
    layer_codecs = [c for pair in cache.codecs._layers.values() for c in pair]
    calibrated = [c for c in layer_codecs if getattr(c, "perm", None) is not None]
    split_keys = not float(KVQuant.parse(kv).k.bits).is_integer()  # the default rule calibrates split keys
    assert len(calibrated) == split_keys * (2 + cfg.core_layers)  # prelude, coda and each core layer
    assert all(c.perm.shape == (cfg.num_kv_heads, cfg.head_dim) for c in calibrated)
    assert cache.codecs.state_nbytes() == 8 + len(calibrated) * cfg.num_kv_heads * math.ceil(cfg.head_dim / 8)
    tensors = _reachable_tensors(fields)
    bookkeeping = [t for t in tensors if t.dtype in (torch.long, torch.bool)]
    assert all(t is cache.depth or t is cache.write_mask for t in bookkeeping)  # per column depth, no entries
    entries = [t for t in tensors if t.dtype not in (torch.long, torch.bool)]
    assert entries and all(t.dtype == torch.uint8 for t in entries)  # codes only: no float copy survives
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in entries}
    assert sum(storages.values()) == cache.nbytes()
    # Capacity = the columns written and every slot filled: allocated = logical = the priced bytes.
    per_layer = kv_bytes_per_token(parse_kv_quant(kv), cfg.head_dim, cfg.num_kv_heads)
    assert per_layer == KVQuant.parse(kv).bytes_per_token(cfg.head_dim, cfg.num_kv_heads)
    entries_per_token = 2 + cfg.core_layers * cache.num_core_slots
    assert cache.nbytes() == 2 * 9 * entries_per_token * per_layer
    assert cache.logical_nbytes().tolist() == [9 * entries_per_token * per_layer] * 2


def test_generation_reports_the_quantized_bytes(model):
    cfg = model.config
    kv = "k=prod:3.5,v=mse:3.5"
    out = generate(model, PROMPT[:1], max_new_tokens=4, num_steps=4, init_scale=0.0, kv_quant=kv)
    plain = generate(model, PROMPT[:1], max_new_tokens=4, num_steps=4, init_scale=0.0)
    per_layer = kv_bytes_per_token(parse_kv_quant(kv), cfg.head_dim, cfg.num_kv_heads)
    float32_per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # the float32 model's plain entries
    assert torch.equal(out.cache_bytes * float32_per_layer, plain.cache_bytes * per_layer)


def test_row_codec_round_trips_the_quantizer_codes():
    q = build_quantizer("polar", 16, seed=3)
    codec = row_codec(q)
    assert isinstance(codec, RowCodec)
    x = torch.randn(3, 5, 16)
    rows = codec.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 5, q.bytes_per_vector)
    torch.testing.assert_close(codec.decode(rows, torch.float32), q.decode(q.encode(x)), atol=0, rtol=0)


@pytest.mark.parametrize("spec", ["mse:3", "mse:3.5", "prod:3.5", "prod:2.5", "prod:1", "prod:1.5",
                                  "mse:4:hadamard", "prod:3"])
@pytest.mark.parametrize("d", [16, 64])
def test_fused_turbo_rows_equal_the_quantizer(spec, d):
    """`TurboRows` (fused groups, one bit gather) decodes, scores and combines as the quantizer does,
    in the same number of bytes."""
    q = build_quantizer(spec, d, seed=5)
    codec = row_codec(q)
    assert isinstance(codec, TurboRows)
    g = torch.Generator().manual_seed(1)
    x, queries = torch.randn(3, 7, d, generator=g) * 3, torch.randn(3, 2, d, generator=g)
    weights = torch.softmax(torch.randn(3, 2, 7, generator=g), dim=-1)
    rows, codes = codec.encode(x), q.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 7, q.bytes_per_vector)
    torch.testing.assert_close(codec.decode(rows), q.decode(codes), atol=TOL, rtol=0)
    torch.testing.assert_close(codec.score(queries, rows), q.score(queries, codes), atol=TOL, rtol=0)
    torch.testing.assert_close(codec.combine(weights, rows), q.combine(weights, codes), atol=TOL, rtol=0)


def loud_heads(seed: int = 0) -> tuple[torch.Tensor, list[list[int]]]:
    """Keys [B=2, Hkv=3, T=40, D=16] whose heads each have 8 loud channels of their own."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 40, 16, generator=g)
    loud = [sorted(torch.randperm(16, generator=g)[:8].tolist()) for _ in range(3)]
    for h, channels in enumerate(loud):
        x[:, h, :, channels] *= 6
    return x, loud


@pytest.mark.parametrize("spec", ["k=prod:3.5", "k=mse:2.5"])
def test_calibrated_outliers_are_each_heads_loud_channels_and_code_better(spec):
    """`outliers=calibrated` picks each head's high-energy channels from the calibration data, codes
    them exactly as a ChannelSplit with those channels would, and beats the first-channels split on
    data with outlier channels (reconstruction error and score error)."""
    x, loud = loud_heads()
    calibrated = layer_codec(spec, "k", 16, x)
    first = layer_codec(spec + ",outliers=first", "k", 16, x)
    assert calibrated.perm[:, :8].tolist() == loud and first.perm is None  # 8 outliers of 16 channels
    rows = calibrated.encode(x)
    assert rows.shape == (*x.shape[:-1], calibrated.nbytes) and calibrated.nbytes == first.nbytes
    split = KVQuant.parse(spec).k
    for h, channels in enumerate(loud):  # head by head: the quantizer with that head's outlier channels
        want = split.build(16, 0, outlier_channels=channels)
        torch.testing.assert_close(calibrated.decode(rows)[:, h], want.decode(want.encode(x[:, h])), atol=TOL, rtol=0)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 3, 5, 16, generator=g)
    weights = torch.softmax(torch.randn(2, 3, 5, 40, generator=g), dim=-1)
    decoded = calibrated.decode(rows)
    torch.testing.assert_close(calibrated.score(q, rows), q @ decoded.mT, atol=TOL, rtol=0)
    torch.testing.assert_close(calibrated.combine(weights, rows), weights @ decoded, atol=TOL, rtol=0)

    def errors(codec) -> tuple[float, float]:
        rows = codec.encode(x)
        mse = ((codec.decode(rows) - x) ** 2).sum(-1).mean().item()
        return mse, ((codec.score(q, rows) - q @ x.mT) ** 2).mean().item()

    (mse_cal, score_cal), (mse_first, score_first) = errors(calibrated), errors(first)
    assert mse_cal < 0.8 * mse_first and score_cal < 0.8 * score_first


@pytest.mark.parametrize("rule,calibrated", [("", "k"), (",outliers=keys", "k"), (",outliers=calibrated", "kv"),
                                             (",outliers=first", "")])
def test_the_outlier_rule_chooses_which_sides_calibrate(rule, calibrated):
    x, _ = loud_heads()
    kv = KVQuant.parse("k=mse:2.5,v=prod:3.5" + rule)
    assert KVQuant.parse(kv.name) == kv
    for role in "kv":
        assert (layer_codec(kv, role, 16, x).perm is not None) == (role in calibrated)
    assert layer_codec("k=mse:3,v=mse:3" + rule, "k", 16, x).perm is None  # no split


def test_per_row_permutations_stack_into_one_codec():
    """A storage calibrating each batch row on its own stacks the rows' permutations `[B, Hkv, D]`:
    row b is coded, decoded and scored as its own calibrated codec would."""
    x = torch.cat([loud_heads(0)[0][:1], loud_heads(1)[0][:1]])  # two rows, different loud channels
    own = [layer_codec("k=prod:2.5", "k", 16, x[b : b + 1]) for b in range(2)]
    assert not torch.equal(own[0].perm, own[1].perm)
    stacked = shared_codec(KVQuant.parse("k=prod:2.5"), "k", 16).permuted(torch.stack([c.perm for c in own]))
    rows, q = stacked.encode(x), torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(3))
    for b, codec in enumerate(own):
        assert torch.equal(rows[b : b + 1], codec.encode(x[b : b + 1]))
        torch.testing.assert_close(stacked.decode(rows)[b : b + 1], codec.decode(rows[b : b + 1]), atol=0, rtol=0)
        torch.testing.assert_close(stacked.score(q, rows)[b : b + 1], codec.score(q[b : b + 1], rows[b : b + 1]),
                                   atol=TOL, rtol=0)
    assert stacked.state_nbytes == 2 * 3 * 2  # a 16-bit mask per (row, head)
    with pytest.raises(ValueError, match="permuted already"):  # its matrices are per head: no second fold
        stacked.permuted(stacked.perm)


def test_calibration_is_deterministic_and_reaches_generation(model):
    kv = "k=prod:2.5,v=mse:2.5"
    run = dict(attention_mask=MASK, max_new_tokens=5, num_steps=4, init_scale=0.0, output_logits=True)
    cal, again = (generate(model, PROMPT, kv_quant=kv, **run) for _ in range(2))
    first = generate(model, PROMPT, kv_quant=kv + ",outliers=first", **run)
    assert torch.equal(logits_of(cal), logits_of(again))
    assert not torch.allclose(logits_of(cal), logits_of(first))


@pytest.mark.parametrize("kv", ["k=prod:3.5,v=mse:3.5", "k=mse:2.5,v=mse:2.5,outliers=calibrated"])
@pytest.mark.parametrize("padded", [True, False])
def test_a_calibrating_batch_gives_each_row_what_it_gets_alone(model, kv, padded):
    """Outlier channels are each row's own, from its real tokens: neither the other rows nor the left
    padding move them (a batch of the same prompts and a padded batch both equal each row alone)."""
    run = dict(max_new_tokens=5, num_steps=4, init_scale=0.0, output_logits=True, kv_quant=kv)
    prompt, mask = (PROMPT, MASK) if padded else (PROMPT[:, 2:], None)
    batch = generate(model, prompt, attention_mask=mask, **run)
    for b in range(2):
        alone = generate(model, prompt[b : b + 1, mask[b].bool()] if padded else prompt[b : b + 1], **run)
        assert batch.sequences[b, -5:].tolist() == alone.sequences[0, -5:].tolist()
        torch.testing.assert_close(logits_of(batch)[b], logits_of(alone)[0], atol=TOL, rtol=0)


def test_calibration_is_per_layer_and_survives_growth_truncation_and_seeks():
    """One calibration per layer from its first write, shared by every step and slot: a storage
    that grows (capacity 2) equals one that does not and the dynamic reference, through a
    truncation and a seek, and the permutation never changes."""
    kv = "k=prod:2.5,v=mse:2.5,attn=dequantize"
    caches = [QuantizedRecurrentCache(2, 3, capacity=c, policy="shared-2", kv_quant=kv) for c in (2, 64)]
    caches.append(DequantizedDynamicCache(2, 3, policy="shared-2", kv_quant=kv))
    x, _ = loud_heads()
    calls = [(x[:, :, :5], 5), (x[:, :, 5:6], 1), ("truncate", 4), (x[:, :, 6:9], 3), ("seek", 6), (x[:, :, 9:10], 1)]
    perms = None
    for item, T in calls:
        if isinstance(item, str):
            for cache in caches:
                getattr(cache, item)(T)
            continue
        for step in range(3):
            key = ("core", 0, step)
            got = [cache.update_heads(key, item, item.flip(-1)) for cache in caches]
            for k, v in got[1:]:
                torch.testing.assert_close(k, got[0][0], atol=TOL, rtol=0)
                torch.testing.assert_close(v, got[0][1], atol=TOL, rtol=0)
        for cache in caches:
            cache.close(3, T)
            cache.advance(T)
        now = [c.codecs._layers[("core", 0)][0].perm for c in caches]
        perms = perms or now
        assert all(torch.equal(p, q) for p, q in zip(now, perms, strict=True))
    assert caches[0].capacity > 2 and len(caches[0].codecs._layers) == 1


@pytest.mark.parametrize("kv", ["k=prod:3,v=prod:1", "k=prod:3,v=mse:3,attn=dequantize"])
def test_odd_length_rows_of_one_kv_head_read_their_norms(kv):
    """prod rows can have an odd length (9 and 5 bytes at D = 16): one head's one-token rows are then
    slices whose strides fp16 cannot view; they are read through a copy, equal to the reference."""
    torch.manual_seed(3)
    one_head = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", num_kv_heads=1)).eval()
    assert build_quantizer("prod:3", 16).bytes_per_vector % 2 == 1
    run = dict(max_new_tokens=3, num_steps=3, init_scale=0.0, kv_quant=kv, output_logits=True)
    static = generate(one_head, PROMPT[:1, :1], **run)
    plain = generate(one_head, PROMPT[:1, :1], cache_implementation="dynamic", **run)
    assert torch.equal(static.sequences, plain.sequences)
    torch.testing.assert_close(logits_of(static), logits_of(plain), atol=TOL, rtol=0)


def test_kv_quant_composes_with_speculative_and_parallel_decoding(model):
    kv = "k=prod:3.5,v=mse:3.5"
    greedy = generate(model, PROMPT[:1], max_new_tokens=6, num_steps=6, init_scale=0.0, kv_quant=kv,
                      cache_implementation="dynamic")
    spec = generate(model, PROMPT[:1], max_new_tokens=6, num_steps=6, init_scale=0.0, kv_quant=kv, draft_steps=2)
    assert torch.equal(spec.sequences, greedy.sequences)  # exact mode: the verifier decides every token
    par = generate(model, PROMPT[:1], max_new_tokens=4, num_steps=4, init_scale=0.0, kv_quant=kv, sampler="parallel")
    assert par.sequences.shape == (1, PROMPT.shape[1] + 4)


# ---------------------------------------------------------------------------- interfaces
BAD = {
    "k=bogus:3": "unknown quantization method",
    "k=prod:0": "bits must be",
    "k=mse:3,attn=fast": "attn=",
    "q=mse:3": "k=... or v=",
    "": "k=",
    "k=mse:3,seed=x": "seed=",
    "k=mse:2.5,outliers=top": "outliers=",
}


@pytest.mark.parametrize("spec", BAD)
def test_bad_kv_quant_gets_a_clear_error_from_the_api(model, spec):
    with pytest.raises(ValueError, match="kv_quant") as err:
        generate(model, PROMPT[:1], max_new_tokens=2, kv_quant=spec)
    assert BAD[spec] in str(err.value)


def test_a_head_dim_the_quantizer_cannot_take_is_a_clear_error():
    odd = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", head_dim=12, hidden_size=48)).eval()
    with pytest.raises(ValueError, match="head dim 12"):
        generate(odd, PROMPT[:1], max_new_tokens=2, kv_quant="k=mse:3:hadamard")


def test_kv_quant_needs_an_attention_model():
    cfg = rd.ModelConfig.from_preset("tiny", mixer={"core": "gated_deltanet"})
    with pytest.raises(ValueError, match="kv_quant.*softmax-attention"):
        generate(rd.RecurrentDepthLM(cfg).eval(), PROMPT[:1], max_new_tokens=2, kv_quant="k=mse:3")


def test_cli_generate_and_info_take_kv_quant(model_dir, capsys):  # noqa: F811
    from recurrent_depth.cli import main

    assert main(["info", "--preset", "small", "--kv-quant", "k=prod:2.5,v=mse:2.5", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cfg = rd.ModelConfig.from_preset("small")
    per_layer = kv_bytes_per_token(parse_kv_quant("k=prod:2.5,v=mse:2.5"), cfg.head_dim, cfg.num_kv_heads)
    quantized = info["kv_cache_bytes_per_token_quantized_by_kv_policy"]
    assert quantized["per-step+deepest"] == (2 + 2 * cfg.mean_recurrence) * per_layer
    assert quantized["last-step+deepest"] == 4 * per_layer
    assert info["kv_cache_bytes_per_token_bf16_by_kv_policy"]["last-step+deepest"] == 4 * 2 * 2 * 64 * 4

    args = ["generate", "--model", str(model_dir), "--prompt", "ab", "--max-new-tokens", "3",
            "--num-steps", "3", "--init-scale", "0", "--json"]
    assert main(args + ["--kv-quant", "k=prod:3.5,v=mse:3.5"]) == 0
    assert main(args + ["--kv-quant", "k=prod:-1"]) != 0
    assert "--kv-quant='k=prod:-1' is invalid" in capsys.readouterr().err


def test_transformers_generate_takes_kv_quant(model):
    from recurrent_depth.integrations.hf import from_library_model

    hf = from_library_model(model)
    x = PROMPT[:1]
    kv = "k=prod:3.5,v=mse:3.5"
    routed = hf.generate(x, kv_quant=kv, max_new_tokens=4, num_steps=4, init_scale=0.0)
    assert torch.equal(routed, generate(model, x, kv_quant=kv, max_new_tokens=4, num_steps=4, init_scale=0.0).sequences)
    with pytest.raises(ValueError, match="kv_quant"):
        hf.generate(x, kv_quant="k=nope:3", max_new_tokens=2)


def test_http_kv_quant_runs_alone_and_bad_specs_get_400(model_dir, reference):  # noqa: F811
    from recurrent_depth.serving import build_app

    ref_model, tok = reference
    kv = "k=prod:3.5,v=mse:3.5"
    with LiveServer(build_app(model_dir, model_name="tiny")) as live:
        url = f"http://127.0.0.1:{live.port}/v1/completions"
        body = {"model": "tiny", "prompt": [5, 9, 2], "max_tokens": 4, "num_steps": 3, "init_scale": 0.0,
                "temperature": 0, "kv_quant": kv, "ignore_eos": True}
        ok = httpx.post(url, json=body, timeout=60)
        assert ok.status_code == 200, ok.text
        alone = generate(ref_model, torch.tensor([[5, 9, 2]]), max_new_tokens=4, num_steps=3, init_scale=0.0,
                         kv_quant=kv)
        assert ok.json()["choices"][0]["text"] == tok.decode(alone.sequences[0, 3:].tolist(),
                                                             skip_special_tokens=True)
        bad = httpx.post(url, json={**body, "kv_quant": "k=prod:0"}, timeout=60)
        assert bad.status_code == 400 and "kv_quant" in bad.text
        bad = httpx.post(url, json={**body, "kv_quant": 3.5}, timeout=60)
        assert bad.status_code == 400 and "kv_quant" in bad.text


def test_stepwise_scoring_takes_kv_quant(model):
    from recurrent_depth.evaluation.scoring import stepwise_logprobs

    requests = [([5, 9, 2, 7], [11, 3, 8]), ([4, 6], [1, 12])]
    plain = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0)
    fine = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0, kv_quant="k=mse:8,v=mse:8")
    coarse = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0, kv_quant="k=mse:1,v=mse:1")
    gaps = [max(abs(a.logprob - b.logprob) for a, b in zip(plain, other)) for other in (fine, coarse)]
    assert 0 < gaps[0] < 1e-2 < gaps[1]  # quantization reaches scoring, and 8 bits barely moves it
    with pytest.raises(ValueError, match="kv_quant"):
        stepwise_logprobs(model, requests, 3, 0, kv_quant="k=mse")
    # calibrated outlier channels: each request's from its own context, so a batch scores as alone
    requests = [([5, 9, 2, 7, 10], [11, 3, 8]), ([4, 6, 1], [1, 12])]
    together = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0, kv_quant="k=prod:2.5,v=mse:2.5")
    for request, scored in zip(requests, together):
        alone = stepwise_logprobs(model, [request], 3, 0, init_scale=0.0, kv_quant="k=prod:2.5,v=mse:2.5")[0]
        assert alone.logprob == pytest.approx(scored.logprob, abs=1e-4)


def test_lm_eval_backend_takes_kv_quant(tmp_path):
    from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
    from tests.test_hf import make_model_dir

    make_model_dir(tmp_path, max_seq_len=160)
    lm = RecurrentDepthEvalLM(pretrained=str(tmp_path), num_steps=2, init_scale=0.0, device="cpu",
                              kv_quant="k=prod:3.5;v=mse:3.5")
    assert lm.settings()["kv_quant"] == "k=prod:3.5,v=mse:3.5" and lm._stepwise
    with pytest.raises(ValueError, match="kv_quant"):
        RecurrentDepthEvalLM(pretrained=str(tmp_path), device="cpu", kv_quant="k=prod:0")


@pytest.mark.parametrize("spec", ["prod:3.5", "mse:2.5", "prod:1"])
def test_fused_turbo_rows_tables_do_not_take_torchs_default_dtype(spec):
    """`TurboRows` built under a bf16 (or float64) default dtype: its tables were made in that dtype, and
    encoding float32 vectors failed on the mix (a bf16 default is a common way to load a bf16 model)."""
    g = torch.Generator().manual_seed(1)
    x, queries = torch.randn(3, 7, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    float32_codec = row_codec(build_quantizer(spec, 16, seed=5))
    saved = torch.get_default_dtype()
    for default in (torch.bfloat16, torch.float64):
        torch.set_default_dtype(default)
        try:
            codec = row_codec(build_quantizer(spec, 16, seed=5))
            rows = codec.encode(x)
            scores = codec.score(queries, rows)
        finally:
            torch.set_default_dtype(saved)
        assert torch.equal(rows, float32_codec.encode(x)), default
        assert scores.dtype == torch.float32 and torch.equal(scores, float32_codec.score(queries, rows)), default
