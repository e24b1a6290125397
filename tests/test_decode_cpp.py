"""The C++ decode (accel/decode_cpp.py) against the Python paths it stands in for: `FastRunner`'s own
(C++ off) and the model's modules (`fast=False`), at fixed depth, on odd shapes (head_dim 6, grouped-query
heads, biases), padded batches, shared KV slots, prefill-then-decode against a full forward; and the
fallback wherever it does not apply.

It is not bit-identical to the Python path: its norms, softmax and attention sums are accumulated in
another order than ATen's kernels (the products are the same `addmm`), so logits and states agree to
float32 rounding (observed ~1e-6 here; allowed 1e-5) and tokens exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.accel import decode_cpp, quant_cpp
from recurrent_depth.accel.decode_cpp import DecodeKernel
from recurrent_depth.accel.runner import FastRunner
from recurrent_depth.inference import StaticRecurrentCache, generate

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def cpp(monkeypatch):
    """The C++ decode on (the suite's conftest turns C++ off), or a skip where it cannot build."""
    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    if decode_cpp.load_decoder() is None:
        pytest.skip(f"the C++ decode kernels cannot build here: {decode_cpp.build_failure()}")


@pytest.fixture
def calls(monkeypatch) -> dict[str, int]:
    """How many calls of each `DecodeKernel` piece ran in C++ (returned a result rather than None)."""
    counts = {"embed": 0, "core_steps": 0, "predict": 0}
    for name in counts:
        original = getattr(DecodeKernel, name)

        def counted(self, *args, _name=name, _original=original):
            out = _original(self, *args)
            counts[_name] += out is not None
            return out

        monkeypatch.setattr(DecodeKernel, name, counted)
    return counts


def odd_model(kv_heads: int, qk_bias: bool = False) -> rd.RecurrentDepthLM:
    """Hidden 36, 6 heads of dim 6 (not a multiple of 8), MLP 50, non-zero biases."""
    cfg = rd.ModelConfig(vocab_size=97, hidden_size=36, num_heads=6, num_kv_heads=kv_heads, intermediate_size=50,
                         prelude_layers=1, core_layers=2, coda_layers=1, bias=True, qk_bias=qk_bias, max_seq_len=64)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


MODELS = {"mha": lambda: odd_model(6), "gqa-qk-bias": lambda: odd_model(2, qk_bias=True),
          "tiny": lambda: rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()}


def padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # row 1: a 4-token prompt, left-padded
    return ids, mask


def run(model, ids, mask, monkeypatch, cpp_on: bool, **kw):
    monkeypatch.setenv("RDEPTH_NO_CPP", "0" if cpp_on else "1")
    return generate(model, ids, attention_mask=mask, max_new_tokens=6, num_steps=3, init_scale=0.0,
                    output_logits=True, **kw)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_cpp_decode_equals_the_python_paths_and_a_full_forward(cpp, calls, monkeypatch, name):
    model = MODELS[name]()
    ids, mask = padded_prompts(model.config.vocab_size)
    ours = run(model, ids, mask, monkeypatch, True)
    assert calls == {"embed": 5, "core_steps": 5, "predict": 5}  # every decoded token, none of the prefill
    python = run(model, ids, mask, monkeypatch, False)
    reference = run(model, ids, mask, monkeypatch, False, fast=False)
    assert calls["core_steps"] == 5  # (the runs with C++ off did not call it)
    for other in (python, reference):
        assert torch.equal(ours.sequences, other.sequences)
        torch.testing.assert_close(ours.logits, other.logits, **TOL)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    full = model(ours.sequences, num_steps=3, init_scale=0.0, attention_mask=full_mask).logits
    torch.testing.assert_close(ours.logits, full[:, 6:12], rtol=1e-4, atol=1e-4)  # (test_inference.py's tolerance)


def one_token_after_prefill(model, make_cache, fused: bool, monkeypatch, rows: int = 3) -> tuple:
    """A 5-token prefill, then one decoded token per row with the C++ decode on or off: the token's
    embedding, core state and logits, and a copy of every cache entry."""
    monkeypatch.setenv("RDEPTH_NO_CPP_DECODE", "0" if fused else "1")
    ids = torch.randint(0, 97, (rows, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        runner, cache = FastRunner(model), make_cache()
        step = runner.context(ids[:, :5], None, cache)
        e = runner.embed(ids[:, :5], step)
        runner.predict(runner.core_steps(torch.zeros_like(e), runner.inject(e), e, range(4), step), step)
        cache.close(4, 5)
        cache.advance(5)
        step = runner.context(ids[:, 5:], None, cache)
        e = runner.embed(ids[:, 5:], step)
        s = runner.core_steps(torch.randn(rows, 1, 36, generator=torch.Generator().manual_seed(4)),
                              runner.inject(e), e, range(4), step)
        logits = runner.predict(s, step)
        assert isinstance(runner._decode, DecodeKernel) == fused
        return e, s, logits, {k: (K.clone(), V.clone()) for k, (K, V) in cache.kv.items()}


@pytest.mark.parametrize("kv_heads", [6, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("budget", [None, 2], ids=["per-step", "shared-2"])
def test_states_and_cache_entries_equal_the_python_steps(cpp, monkeypatch, kv_heads, budget):
    """One decoded token per row after a prefill: the state after each piece, the logits, and every KV
    entry the C++ wrote, against `FastRunner`'s Python steps on an identical cache."""
    model = odd_model(kv_heads)
    (e0, s0, l0, kv0), (e1, s1, l1, kv1) = (
        one_token_after_prefill(model, lambda: StaticRecurrentCache(3, 4, kv_budget=budget, capacity=8), fused,
                                monkeypatch) for fused in (True, False))
    for ours, python in ((e0, e1), (s0, s1), (l0, l1)):
        torch.testing.assert_close(ours, python, **TOL)
    assert kv0.keys() == kv1.keys()
    for key in kv0:
        torch.testing.assert_close(kv0[key], kv1[key], **TOL, msg=str(key))


def simd_model(hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> rd.RecurrentDepthLM:
    """Hidden 64, 4 heads of dim 16 on 2 kv heads, MLP 96: the team's vector loops (register-resident heads,
    whole vectors of every product) rather than odd_model's tails."""
    cfg = rd.ModelConfig(vocab_size=97, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                         intermediate_size=96, prelude_layers=1, core_layers=2, coda_layers=1, qk_bias=True,
                         max_seq_len=64)
    torch.manual_seed(1)
    return rd.RecurrentDepthLM(cfg).eval()


class Threads:
    """torch's thread count set for a block, restored after it."""

    def __init__(self, n: int) -> None:
        self.n, self.previous = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.previous)


TEAM_MODELS = {"mha-odd": lambda: odd_model(6), "gqa-odd-qk-bias": lambda: odd_model(2, qk_bias=True),
               "gqa-vectors": simd_model, "mqa-head-dim-48": lambda: simd_model(96, 2, 1)}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", list(TEAM_MODELS))
def test_one_row_decodes_on_a_team_as_the_python_path(cpp, calls, monkeypatch, name, threads):
    """One row (left-padded, and not) decodes on a team of 1-3 threads (3 > 2 kv heads: a thread without
    heads) with the tokens and, to float32 rounding, the logits of the Python path, whatever the team's size."""
    model = TEAM_MODELS[name]()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(threads))
    padded = torch.tensor([[0, 0, 1, 1, 1, 1]])
    team_calls = decode_cpp.load_decoder().team_calls
    for mask in (None, padded):
        before = team_calls()
        with Threads(threads):
            ours = run(model, ids, mask, monkeypatch, True)
        assert team_calls() - before == 15  # prelude, core and coda of 5 decoded tokens
        python = run(model, ids, mask, monkeypatch, False)
        assert torch.equal(ours.sequences, python.sequences)
        torch.testing.assert_close(ours.logits, python.logits, **TOL)
        monkeypatch.setattr(decode_cpp, "TEAM_DECODE", False)  # the per-product C++ path, for one more witness
        products = run(model, ids, mask, monkeypatch, True)
        monkeypatch.setattr(decode_cpp, "TEAM_DECODE", True)
        torch.testing.assert_close(ours.logits, products.logits, **TOL)
    assert calls["core_steps"] == 20


@pytest.mark.parametrize("threads", [1, 2])
def test_a_team_writes_the_cache_entries_of_the_python_steps(cpp, monkeypatch, threads):
    """One row: the embedding, state, logits and every KV entry the team wrote, against the Python steps."""
    model = odd_model(2)
    with Threads(threads):
        (e0, s0, l0, kv0), (e1, s1, l1, kv1) = (
            one_token_after_prefill(model, lambda: StaticRecurrentCache(1, 4, kv_budget=2, capacity=8), fused,
                                    monkeypatch, rows=1) for fused in (True, False))
    for ours, python in ((e0, e1), (s0, s1), (l0, l1)):
        torch.testing.assert_close(ours, python, **TOL)
    assert kv0.keys() == kv1.keys()
    for key in kv0:
        torch.testing.assert_close(kv0[key], kv1[key], **TOL, msg=str(key))


UNCOVERED = {"kv-window": dict(kv_quant="k=prod:3.5,v=mse:3.5,window=2"),
             "kv-dequantize": dict(kv_quant="k=mse:3.5,v=mse:3.5,attn=dequantize"),
             "kv-not-turbo": dict(kv_quant="k=qjl:3,v=mse:3.5"), "dynamic-cache": dict(cache_implementation="dynamic"),
             "skip-lookup": dict(kv_policy="per-step+skip")}


@pytest.mark.parametrize("case", list(UNCOVERED))
def test_uncovered_cases_take_the_python_path(cpp, calls, monkeypatch, case):
    """Quantized entries with a bf16 window, a dequantizing read or a codec the C++ read does not take,
    the dynamic reference cache and a lookup that hides columns: no C++ call at all. The results are
    those of the Python path."""
    kw = UNCOVERED[case]
    model = odd_model(6)
    ids, mask = padded_prompts(97)
    ours = run(model, ids, mask, monkeypatch, True, **kw)
    assert calls == {"embed": 0, "core_steps": 0, "predict": 0}
    python = run(model, ids, mask, monkeypatch, False, **kw)
    assert torch.equal(ours.sequences, python.sequences) and torch.equal(ours.steps, python.steps)
    torch.testing.assert_close(ours.logits, python.logits, **TOL)


@pytest.mark.parametrize("rows", [1, 2])
def test_an_exit_criterion_steps_in_cpp_until_a_row_stops(cpp, calls, monkeypatch, rows):
    """KL exit: each core step is one C++ call while every row still runs (one row: the team), and the
    Python step, under the cache's write mask, once a row has stopped; the steps each token ran, the
    tokens and the logits are the Python path's."""
    model = odd_model(6)
    ids, mask = padded_prompts(97)
    ids, mask = ids[:rows], (mask[:rows] if rows > 1 else None)
    kw = dict(exit_criterion="kl", exit_threshold=1e-3, max_steps=8)
    ours = run(model, ids, mask, monkeypatch, True, **kw)
    python = run(model, ids, mask, monkeypatch, False, **kw)
    assert torch.equal(ours.sequences, python.sequences) and torch.equal(ours.steps, python.steps)
    torch.testing.assert_close(ours.logits, python.logits, **TOL)
    assert calls["embed"] == 5 and calls["core_steps"] >= 5  # (counts the C++ calls that ran)
    if rows == 1:  # one row never waits on another: every step it ran was a C++ call
        assert calls["core_steps"] == int(ours.steps[0, 1:].sum())


def test_hooks_between_steps_keep_the_step_loop(cpp, calls, monkeypatch):
    """`should_stop` / `on_step` run between core steps: with either set, the engine keeps its own loop, each
    decoded step one C++ call (the prompt's steps in Python)."""
    from recurrent_depth.inference.engine import Recurrence

    model = odd_model(6)
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(5))
    engine = Recurrence(model)
    ticks = []
    engine.on_step = lambda: ticks.append(1)
    with torch.no_grad():
        cache = StaticRecurrentCache(1, 3, capacity=8)
        pass_ = engine.begin(ids, None, cache)
        engine.run(torch.zeros_like(pass_.e), pass_, 3)
        cache.close(3, 4)
        cache.advance(4)
        pass_ = engine.begin(ids[:, :1], None, cache)
        engine.run(torch.zeros_like(pass_.e), pass_, 3)
    assert len(ticks) == 6 and calls["core_steps"] == 3 and calls["embed"] == 1


def test_a_failing_build_falls_back_with_one_message(monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'rdepth_decode'\nc++: not found")

    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    monkeypatch.setattr(quant_cpp, "kernel_cache", no_compiler)
    monkeypatch.setattr(decode_cpp, "_module", None)
    monkeypatch.setattr(decode_cpp, "_failure", None)
    model = odd_model(6)
    ids, mask = padded_prompts(97)
    with caplog.at_level(logging.WARNING, logger=decode_cpp.__name__):
        ours = generate(model, ids, attention_mask=mask, max_new_tokens=3, num_steps=2, init_scale=0.0)
        again = generate(model, ids, attention_mask=mask, max_new_tokens=3, num_steps=2, init_scale=0.0)
    assert decode_cpp.build_failure() == "RuntimeError: Error building extension 'rdepth_decode': c++: not found"
    assert caplog.text.count("the C++ decode kernels are unavailable (RuntimeError") == 1
    assert torch.equal(ours.sequences, again.sequences)


# Quantized KV read from codes inside the C++ decode: plain TurboQuant (prod keys, mse values), and a
# channel split calibrated per head (its per-head permutation folded into one shared read matrix).
KV_QUANT = {"tq3.5": "k=prod:3.5,v=mse:3.5", "mse2.5-calibrated": "k=mse:2.5,v=mse:2.5,outliers=calibrated"}


@pytest.mark.parametrize("spec", list(KV_QUANT))
@pytest.mark.parametrize("policy", [None, "shared-2"], ids=["per-step", "shared-2"])
def test_quantized_kv_decodes_in_cpp_as_the_python_path(cpp, calls, monkeypatch, spec, policy):
    """Every decoded token's attention read from codes in C++: the same tokens as the Python path (its
    C++ quantized read, `RDEPTH_NO_CPP_DECODE=1`) and the eager reference (`fast=False`), logits to
    float32 rounding of the same codes."""
    model = odd_model(2, qk_bias=True)
    ids, mask = padded_prompts(97)
    kw = dict(kv_quant=KV_QUANT[spec], kv_policy=policy)
    ours = run(model, ids, mask, monkeypatch, True, **kw)
    assert calls == {"embed": 5, "core_steps": 5, "predict": 5}
    monkeypatch.setenv("RDEPTH_NO_CPP_DECODE", "1")
    python = run(model, ids, mask, monkeypatch, True, **kw)
    reference = run(model, ids, mask, monkeypatch, True, fast=False, **kw)
    assert calls["core_steps"] == 5  # (RDEPTH_NO_CPP_DECODE kept the decode in Python)
    for other in (python, reference):
        assert torch.equal(ours.sequences, other.sequences)
        torch.testing.assert_close(ours.logits, other.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", list(KV_QUANT))
@pytest.mark.parametrize("policy", [None, "shared-2"], ids=["per-step", "shared-2"])
def test_one_row_with_quantized_kv_decodes_on_a_team_as_the_python_path(cpp, monkeypatch, spec, policy, threads):
    """One row on a team of 1-2 threads, its attention read from codes (by the team's first thread): the
    tokens and, to float32 rounding of the same codes, the logits of the Python path."""
    model = odd_model(2, qk_bias=True)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    kw = dict(kv_quant=KV_QUANT[spec], kv_policy=policy)
    team_calls = decode_cpp.load_decoder().team_calls
    before = team_calls()
    with Threads(threads):
        ours = run(model, ids, None, monkeypatch, True, **kw)
    assert team_calls() - before == 15
    monkeypatch.setenv("RDEPTH_NO_CPP_DECODE", "1")
    python = run(model, ids, None, monkeypatch, True, **kw)
    assert torch.equal(ours.sequences, python.sequences)
    torch.testing.assert_close(ours.logits, python.logits, rtol=1e-4, atol=1e-4)


def test_quantized_cache_rows_equal_the_python_steps(cpp, monkeypatch):
    """One decoded token after a prefill on a quantized shared-2 cache: states, logits and every code row
    the C++ wrote, against `FastRunner`'s Python steps (the C++ quantized read) on an identical cache."""
    model = odd_model(2)
    (e0, s0, l0, kv0), (e1, s1, l1, kv1) = (
        one_token_after_prefill(
            model, lambda: StaticRecurrentCache(3, 4, kv_budget=2, capacity=8, kv_quant=KV_QUANT["tq3.5"]), fused,
            monkeypatch) for fused in (True, False))
    for ours, python in ((e0, e1), (s0, s1), (l0, l1)):
        torch.testing.assert_close(ours, python, **TOL)
    assert kv0.keys() == kv1.keys()
    for key in kv0:
        assert kv0[key][0].dtype == torch.uint8
        for ours, python in zip(kv0[key], kv1[key]):
            assert torch.equal(ours, python), key  # (keys and rotations agree to rounding; here no code differs)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_norm_beyond_fp16_is_refused_in_one_line(cpp, rows, threads):
    """A decoded key whose norm fp16 cannot store: the codec's one-line ValueError, from inside the C++ step
    (one row: raised after its team of threads has finished)."""
    model = odd_model(6)
    ids = torch.randint(0, 97, (rows, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), Threads(threads):
        runner, cache = FastRunner(model), StaticRecurrentCache(rows, 2, capacity=8, kv_quant=KV_QUANT["tq3.5"])
        step = runner.context(ids[:, :4], None, cache)
        e = runner.embed(ids[:, :4], step)
        runner.core_steps(torch.zeros_like(e), runner.inject(e), e, range(2), step)
        cache.close(2, 4)
        cache.advance(4)
        runner.blocks["core"][0]["qkv"].mul_(1e5)  # (the C++ decoder shares the runner's weights,
        model.transformer.core_block[0].attn.Wqkv.weight.mul_(1e5)  # and a team reads the parameter's rows)
        step = runner.context(ids[:, 4:], None, cache)
        e = runner.embed(ids[:, 4:], step)
        with pytest.raises(ValueError, match=r"norm exceeds the fp16 range \(65504\): got .*; scale the input down"):
            runner.core_steps(torch.zeros_like(e), runner.inject(e), e, range(2), step)
    assert isinstance(runner._decode, DecodeKernel)


@pytest.mark.parametrize("rows", [1, 3, 9], ids=["1-row", "3-rows", "9-rows"])
def test_uncopied_weights_stream_rows_as_the_python_path(cpp, monkeypatch, rows):
    """A large model's layout (no [in, out] copies: every product against a parameter's own rows, which the
    decode streams at up to 8 rows and hands to addmm beyond), here forced on a small model; two threads
    split the weight rows."""
    from recurrent_depth.accel import runner as runner_module

    monkeypatch.setattr(runner_module, "COPY_LIMIT_BYTES", 0)
    model = odd_model(2, qk_bias=True)
    ids = torch.randint(0, 97, (rows, 5), generator=torch.Generator().manual_seed(rows))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours = run(model, ids, None, monkeypatch, True)
    finally:
        torch.set_num_threads(previous)
    assert not FastRunner(model).copy_weights
    python = run(model, ids, None, monkeypatch, False)
    assert torch.equal(ours.sequences, python.sequences)
    torch.testing.assert_close(ours.logits, python.logits, **TOL)


@pytest.mark.parametrize("rows", [1, 3, 8, 9], ids=["1-row", "3-rows", "8-rows", "9-rows"])
@pytest.mark.parametrize("terms", ["plain", "bias", "residual+bias", "residual+bias+lora", "strided"])
def test_bf16_rows_stream_the_weights_within_bf16_rounding(cpp, rows, terms, monkeypatch):
    """`FastRunner._linear` on bf16 decode rows against a parameter's own `[out, in]` rows (or a column slice
    of them, as the adapter's halves): the C++ stream (float32 sums, one rounding) for up to 8 rows, ATen
    beyond; within bf16 rounding of the float32 product (the usual forward-error bound, on the sums of
    |terms|), into a given buffer too; odd widths (37 in, 50 out: a last block of two rows)."""
    from recurrent_depth.accel import runner as runner_module

    monkeypatch.setattr(runner_module, "cpu_emulates_bf16", lambda: True)  # up to 8 rows stream on any CPU
    g = torch.Generator().manual_seed(rows)
    x, rows_ = torch.randn(rows, 37, generator=g).bfloat16(), torch.randn(50, 45, generator=g).bfloat16()
    weight = rows_[:, 3:40] if terms == "strided" else rows_[:, :37].contiguous()
    bias = torch.randn(50, generator=g).bfloat16() if terms not in ("plain", "strided") else None
    residual = torch.randn(rows, 50, generator=g).bfloat16() if "residual" in terms else None
    low_rank = ((torch.randn(37, 4, generator=g).bfloat16(), torch.randn(4, 50, generator=g).bfloat16())
                if "lora" in terms else None)
    reference, magnitude = x.float() @ weight.float().t(), x.float().abs() @ weight.float().abs().t()
    for term in (residual, bias):
        if term is not None:
            reference, magnitude = reference + term.float(), magnitude + term.float().abs()
    if low_rank is not None:
        a, b = (t.float() for t in low_rank)
        reference, magnitude = reference + (x.float() @ a) @ b, magnitude + (x.float() @ a).abs() @ b.abs()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            assert (runner_module._bf16_stream(x, weight.t()) is not None) == (rows <= 8)
            out = torch.empty(rows, 50, dtype=torch.bfloat16)
            y = FastRunner._linear(x, weight.t(), bias, residual, out=out, low_rank=low_rank)
            fresh = FastRunner._linear(x, weight.t(), bias, residual, low_rank=low_rank)
    finally:
        torch.set_num_threads(previous)
    assert y.data_ptr() == out.data_ptr() and y.dtype == torch.bfloat16 and torch.equal(y, fresh)
    # bf16 roundings: the stream's one, ATen's two (addmm, then the bias), the LoRA term's three
    roundings = (1 if rows <= 8 else 2) + (3 if low_rank is not None else 0)
    assert ((y.float() - reference).abs() <= roundings * 2**-8 * magnitude + 1e-6).all()
    with torch.enable_grad():
        assert runner_module._bf16_stream(x, weight.t()) is None  # (a graph: ATen's differentiable product)
    assert runner_module._bf16_stream(x, weight.t().contiguous()) is None  # ([in, out] copies: ATen's layout)


@pytest.mark.parametrize("emulated", [True, False], ids=["emulated-bf16", "native-bf16"])
def test_bf16_stream_takes_one_row_where_bf16_is_native(cpp, emulated, monkeypatch):
    """Where bf16 products are native ATen's product of two or more rows is faster than the stream: only
    single rows stream there; up to STREAM_ROWS where bf16 is emulated."""
    from recurrent_depth.accel import runner as runner_module

    monkeypatch.setattr(runner_module, "cpu_emulates_bf16", lambda: emulated)
    weight = torch.randn(50, 37).bfloat16()
    with torch.no_grad():
        taken = [runner_module._bf16_stream(torch.randn(rows, 37).bfloat16(), weight.t()) is not None
                 for rows in range(1, 10)]
    limit = runner_module.STREAM_ROWS if emulated else runner_module.NATIVE_BF16_STREAM_ROWS
    assert taken == [rows <= limit for rows in range(1, 10)] and limit == (8 if emulated else 1)


def test_a_bf16_model_decodes_with_the_stream_as_with_aten(cpp, monkeypatch):
    """A bf16 model in the large-model layout (no weight copies): every decode product streams in C++ (the
    blocks', the adapter's halves and the head), and each decoded token's logits are those of ATen's bf16
    products on the same tokens, to bf16 rounding."""
    from recurrent_depth.accel import runner as runner_module

    monkeypatch.setattr(runner_module, "COPY_LIMIT_BYTES", 0)
    monkeypatch.setattr(runner_module, "cpu_emulates_bf16", lambda: True)  # two rows stream on any CPU
    streamed = []
    original = runner_module._bf16_stream
    monkeypatch.setattr(runner_module, "_bf16_stream", lambda x, w: streamed.append(original(x, w)) or streamed[-1])
    model = odd_model(2, qk_bias=True).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    ours = run(model, ids, None, monkeypatch, True)
    steps, cfg = 3, model.config
    blocks = cfg.prelude_layers + steps * cfg.core_layers + cfg.coda_layers
    per_token = 4 * blocks + 1 + steps + 1  # four products a block, the adapter's halves, the head
    assert sum(s is not None for s in streamed) == 5 * per_token + 1  # 5 decode calls; the prompt's head
    # ATen's products on the same tokens (teacher-forced: a near-tie that rounding breaks the other way on
    # some CPU, as AMX's bf16 products did here, must not make the two runs' sequences differ from then on)
    with torch.no_grad():
        forced = model(ours.sequences, num_steps=3, init_scale=0.0).logits[:, ids.shape[1] - 1: -1].float()
    assert (ours.logits.float() - forced).abs().max() <= 0.02 * forced.abs().max()
    assert torch.equal(ours.sequences[:, ids.shape[1]:], ours.logits.argmax(-1))
