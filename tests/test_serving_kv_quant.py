"""Quantized KV entries in the server's continuous batch (`rdepth serve --kv-quant SPEC`).

Oracle: each request of a quantized batch equals `generate(..., kv_quant=SPEC)` on that request
alone (the quantized static cache, the same codecs and attention read): same tokens, steps and
exit reasons, log-probabilities within 1e-4 (two float32 computations at different batch shapes
differ by summation order; observed <= 1e-6), while they differ from the full-precision ones by
far more (so the pool really reads codes). The pool holds uint8 code rows only, and `nbytes` is
their bytes, smaller than the float pool's by the codec's ratio exactly.
"""

from __future__ import annotations

import concurrent.futures
import math

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main as cli_main
from recurrent_depth.inference import generate
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.inference.quant_cache import KVQuant, layer_codec
from recurrent_depth.serving import build_app
from recurrent_depth.serving.batch import BatchDecoder, RowRequest
from recurrent_depth.serving.engine import Engine
from recurrent_depth.serving.kv_pool import QuantizedSlotKVPool, SlotKVPool
from tests.test_quant_cache import _reachable_tensors
from tests.test_serving import LiveServer, model_dir, reference  # noqa: F401  (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
KV = "k=prod:3.5,v=mse:3.5"
MODES = {
    "fixed-per-step": dict(num_steps=5),
    "fixed-shared-2": dict(num_steps=5, kv_policy="shared-2"),
    "kl-per-step": dict(num_steps=6, exit_criterion="kl", exit_threshold=5e-2),
    "kl-skip": dict(num_steps=6, kv_policy="per-step+skip", exit_criterion="kl", exit_threshold=5e-2),
    "kl-shared-3": dict(num_steps=6, kv_policy="shared-3", exit_criterion="kl", exit_threshold=5e-2),
}


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def jobs_for(modes: list[str]) -> list[tuple[list[int], dict, int]]:
    """(prompt, options, seed) per mode: prompts of different lengths, different token counts."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 256, (3 + 4 * j,), generator=g).tolist(),
             dict(max_new_tokens=4 + j, init_scale=0.0, **MODES[mode]), 50 + j) for j, mode in enumerate(modes)]


def run_batch(model, jobs, kv_quant, max_rows: int = 3) -> tuple[dict[int, list], BatchDecoder]:
    """Every job through one BatchDecoder (a new row as soon as one is free); each job's results."""
    dec = BatchDecoder(model, max_rows, kv_quant=kv_quant)
    pending, out = list(range(len(jobs))), {}
    while pending or len(dec):
        while pending and len(dec) < max_rows:
            j = pending.pop(0)
            prompt, kw, seed = jobs[j]
            _, first, _ = dec.add(RowRequest(prompt, GenerationOptions(**kw).validate(4), seed, top_logprobs=0), tag=j)
            out[j] = [first]
        for seq, result in dec.step():
            out[seq.tag].append(result)
            if len(out[seq.tag]) >= jobs[seq.tag][1]["max_new_tokens"]:
                dec.remove(seq)
    return out, dec


def alone(model, prompt, kw, seed, kv_quant) -> tuple[list[int], list[int], list[str], torch.Tensor]:
    """(tokens, steps, exit reasons, log-softmax of each token's logits `[n, V]`) of `generate` alone."""
    out = generate(model, torch.tensor(prompt), seed=seed, output_logits=True, kv_quant=kv_quant, **kw)
    tokens = out.token_lists()[0]
    return tokens, out.steps[0, : len(tokens)].tolist(), out.exit_reasons[0], torch.log_softmax(out.logits[0], -1)


@pytest.mark.parametrize("initial_slots", [64, 1], ids=["sized", "growing-slots"])
@pytest.mark.parametrize("kv", [KV, "k=prod:2.5,v=mse:2.5,attn=dequantize", "k=qjl:2:out2,v=mse:3"])
def test_a_quantized_batch_equals_each_request_generated_alone_with_kv_quant(model, kv, initial_slots,
                                                                             monkeypatch):
    """3 rows at once, 5 requests of different lengths (rows leave and new ones move in), fixed
    depth and KL exit, per-step / shared-k / skip policies; `growing-slots`: the pool starts with one
    core slot, so code rows are settled into slots added after columns closed at mixed depths."""
    monkeypatch.setattr(SlotKVPool, "INITIAL_SLOTS", initial_slots)
    jobs = jobs_for(list(MODES))
    out, dec = run_batch(model, jobs, kv)
    assert isinstance(dec.pool, QuantizedSlotKVPool) and dec.core_rows / dec.iterations > 1.5  # rows shared steps
    far = 0.0
    for j, (prompt, kw, seed) in enumerate(jobs):
        tokens, steps, reasons, logp = alone(model, prompt, kw, seed, kv)
        mine = out[j]
        name = list(MODES)[j]
        assert [r.token for r in mine] == tokens, name
        assert [r.steps for r in mine] == steps, name
        assert [r.reason for r in mine] == reasons, name
        picked = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r.logprob for r in mine]), picked, rtol=0, atol=TOL)
        first_full = alone(model, prompt, kw, seed, None)[3][0]  # the prompt's logits, full precision
        far = max(far, (first_full - logp[0]).abs().max().item())
    assert far > 100 * TOL  # quantized entries change the logits: the pool does not read floats


def test_the_pool_holds_code_rows_only_and_nbytes_is_what_it_holds(model):
    jobs = jobs_for(["fixed-per-step", "kl-skip", "fixed-shared-2"])
    _, quant = run_batch(model, jobs, KV)
    _, plain = run_batch(model, jobs, None)
    pool = quant.pool
    fields = {name: value for name, value in vars(pool).items() if name not in ("codecs", "kv_quant")}
    tensors = _reachable_tensors(fields)
    assert {t.dtype for t in tensors} == {torch.uint8, torch.long}  # codes, and columns' depths and indices
    entries = [t for t in tensors if t.dtype == torch.uint8]  # no float copy of an entry is kept
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in entries}
    assert sum(storages.values()) == pool.nbytes() > 0
    # The same schedule allocates the same (slots, rows, columns): the ratio is the codec's exactly.
    cfg = model.config
    code_bytes = KVQuant.parse(KV).bytes_per_token(cfg.head_dim, cfg.num_kv_heads)  # one layer, k and v
    float_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert (pool.slots, pool.rows, pool.capacity) == (plain.pool.slots, plain.pool.rows, plain.pool.capacity)
    assert pool.nbytes() * float_bytes == plain.pool.nbytes() * code_bytes
    assert plain.pool.nbytes() > 4 * pool.nbytes()  # 3.5 bits + fp16 norms vs float32 (head dim 16)
    # Quantizer state, not per token: each row's calibrated channel order per (layer, side).
    probe = torch.randn(1, cfg.num_kv_heads, 3, cfg.head_dim)
    sides = sum(getattr(layer_codec(KV, role, cfg.head_dim, probe), "perm", None) is not None for role in "kv")
    assert sides and len(pool.orders) == sides * (2 + cfg.core_layers)  # prelude, coda and each core layer
    assert pool.state_nbytes() == len(pool.orders) * pool.rows * cfg.num_kv_heads * math.ceil(cfg.head_dim / 8)


def test_the_batch_takes_its_own_kv_quant_or_none_and_refuses_another(model):
    dec = BatchDecoder(model, 2, kv_quant=KV)
    assert dec.takes_kv_quant(None) and dec.takes_kv_quant("v=mse:3.5, k=prod:3.5")  # same spec, other order
    assert not dec.takes_kv_quant("k=prod:2.5,v=mse:2.5")
    other = GenerationOptions(max_new_tokens=2, num_steps=2, kv_quant="k=prod:2.5,v=mse:2.5").validate(4)
    with pytest.raises(ValueError, match="kv_quant"):
        dec.add(RowRequest([1, 2], other, 0))
    assert not BatchDecoder(model, 2).takes_kv_quant(KV)  # a full-precision pool
    assert BatchDecoder(model, 2).takes_kv_quant(None)


def test_a_bad_or_unusable_server_kv_quant_is_a_clear_error(model, model_dir, capsys):  # noqa: F811
    for bad in ("k=nope:3", "k=prod:0", "v=mse:3.5,attn=sideways"):
        with pytest.raises(ValueError, match="kv_quant"):
            Engine(model, kv_quant=bad)
        assert cli_main(["serve", "--model", str(model_dir), "--kv-quant", bad, "--threads", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("rdepth serve: error: --kv-quant ") and len(err[-1]) < 300
    torch.manual_seed(0)
    linear = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer="gla")).eval()
    with pytest.raises(ValueError, match="--kv-quant.*softmax-attention"):
        Engine(linear, kv_quant=KV)


def test_a_quantizing_server_batches_its_requests_and_runs_other_specs_alone(model_dir, reference):  # noqa: F811
    ref_model, tok = reference
    other = "k=prod:2.5,v=mse:2.5"
    with LiveServer(build_app(model_dir, model_name="tiny", kv_quant=KV)) as live:
        health = httpx.get(live.url + "/health").json()
        assert health["kv_quant"] == KVQuant.parse(KV).name and health["batching"] is True
        true_bits = KVQuant.parse(KV).bits_per_coordinate(ref_model.config.head_dim)
        assert health["kv_quant_bits_per_coordinate"] == true_bits
        prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3], [2, 6, 11, 9, 1], [3, 3, 8]]
        # unset: the server's; the server's own spelt out; another spec: alone; a policy the pool
        # does not take: alone, with the server's spec
        specs = [None, KV, other, None]
        extras = [{}, {}, {}, {"kv_policy": "per-step+always-last"}]
        client = httpx.Client(base_url=live.url, timeout=60)
        body = dict(model="tiny", max_tokens=5, num_steps=4, init_scale=0.0, temperature=0, ignore_eos=True,
                    logprobs=1)
        def send(prompt, spec, extra):
            return client.post("/v1/completions", json=dict(body, prompt=prompt, **extra, **(
                {"kv_quant": spec} if spec else {})))

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(send, prompts, specs, extras))
        for prompt, spec, extra, answer in zip(prompts, specs, extras, answers):
            assert answer.status_code == 200, answer.text
            tokens, _, _, logp = alone(ref_model, prompt, dict(max_new_tokens=5, num_steps=4, init_scale=0.0, **extra),
                                       None, spec or KV)
            choice = answer.json()["choices"][0]
            assert choice["text"] == tok.decode(tokens, skip_special_tokens=True)
            want = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]  # the quantized logits, not the float ones
            torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), want, rtol=0, atol=TOL)
        metrics = client.get("/metrics").text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line and not line.startswith("#")}
        assert values["rdepth_batch_rows_total"] > 0 and values["rdepth_kv_pool_bytes"] > 0
        for spec in ("k=prod:0", "k=qjl:2.03"):  # a bad spec; one this model's head dim (16) cannot take
            bad = client.post("/v1/completions", json=dict(body, prompt=[1, 2], kv_quant=spec))
            assert bad.status_code == 400 and "kv_quant" in bad.json()["error"]["message"], bad.text
        client.close()


@pytest.mark.parametrize("kv", [KV, "k=qjl:2,v=polar"])
def test_a_one_token_prompt_on_one_kv_head_reads_its_codes(kv):
    """One row, one KV head, one column: the storage's slice is 'contiguous' at an odd byte offset,
    where a view of the fp16 norms failed (quant/rows.py `bytes_as` copies it). The static cache
    and the batch equal the dequantized dynamic reference."""
    torch.manual_seed(0)
    mqa = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", num_kv_heads=1)).eval()
    kw = dict(max_new_tokens=3, num_steps=2, init_scale=0.0)
    static = generate(mqa, torch.tensor([5]), kv_quant=kv, **kw).token_lists()[0]
    assert static == generate(mqa, torch.tensor([5]), kv_quant=kv, cache_implementation="dynamic",
                              **kw).token_lists()[0]
    out, _ = run_batch(mqa, [([5], kw, 0)], kv, max_rows=1)
    assert [r.token for r in out[0]] == static


def test_in_a_wide_quantized_batch_tokens_and_fixed_depths_equal_alone(model):
    """Issue 33 item 20, seeded: a `minp-kl` request at depth 24 in a quantized batch of 6 with others
    (fixed depths, KL exits) against each run alone. Fixed-depth rows give the same tokens and steps,
    every row the same tokens. An adaptive row's steps may differ where its criterion sits at the
    threshold within the batch's rounding (docs/serving.md), so they are not asserted."""
    g = torch.Generator().manual_seed(5)
    jobs = []
    for j in range(6):
        prompt = torch.randint(0, 256, (3 + 2 * j,), generator=g).tolist()
        kw = (dict(num_steps=24, exit_criterion="minp-kl") if j == 0 else dict(num_steps=3 + j) if j % 2
              else dict(num_steps=6, exit_criterion="kl", exit_threshold=1e-3))
        jobs.append((prompt, dict(max_new_tokens=4, init_scale=0.0, **kw), 70 + j))
    out, _ = run_batch(model, jobs, KV, max_rows=6)
    for j, (prompt, kw, seed) in enumerate(jobs):
        tokens, steps, _, _ = alone(model, prompt, kw, seed, KV)
        assert [r.token for r in out[j]] == tokens, j
        if "exit_criterion" not in kw:
            assert [r.steps for r in out[j]] == steps, j


def test_a_solo_requests_echo_scores_read_its_prompt_from_codes_as_the_pool_does(model):
    """`echo` + `logprobs` of a request that runs alone (its own `kv_quant`, or speculative, on a
    quantizing server) scored its prompt with a full-precision forward, while the session's prefill
    (and the pool's) reads the prompt's KV back from code rows: the last prompt position's scores
    disagreed with the distribution that chose the first token."""
    from recurrent_depth.serving.solo import SoloRun

    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    options = GenerationOptions(num_steps=4, init_scale=0.0, max_new_tokens=2, kv_quant=KV).validate(4)
    row = RowRequest(prompt, options, 7, top_logprobs=0, prompt_logprobs=True)
    solo = SoloRun(model, row, dict(num_steps=4, init_scale=0.0, max_new_tokens=2, kv_quant=KV))
    pooled = BatchDecoder(model, 1, kv_quant=KV).add(RowRequest(prompt, options, 7, top_logprobs=0,
                                                                prompt_logprobs=True))[2]
    with torch.no_grad():
        plain = torch.log_softmax(model(torch.tensor([prompt]), num_steps=4, init_scale=0.0).logits[0], -1)
    full_precision = [plain[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    scores = solo.prompt_scores().logprobs[1:]
    assert scores == pytest.approx(pooled.logprobs[1:], abs=TOL)
    assert max(abs(a - b) for a, b in zip(scores, full_precision, strict=True)) > 10 * TOL  # codes really read
    solo.close()


def test_echo_scores_under_exit_kv_compute_equal_the_request_alone(model):
    """`echo` + `logprobs` of an exit_kv="compute" request under a criterion that reads logits: the batch
    scored the prompt from the KV its prefill wrote, whose coda quantizer calibrates on the criterion's
    first probe (the last position at step 1), while the same request alone (its own `kv_quant`) rescored
    the prompt with a plain forward calibrated on the full-depth prompt (scores ~6e-3 apart)."""
    from recurrent_depth.serving.solo import SoloRun

    prompt, other = [5, 17, 99, 3, 250, 42, 8], [7, 1, 2, 3, 9]
    kw = dict(num_steps=6, exit_criterion="kl", exit_threshold=0.1, exit_kv="compute", max_new_tokens=2)
    options = GenerationOptions(**kw, kv_quant=KV).validate(4)
    dec = BatchDecoder(model, 2, kv_quant=KV)
    dec.add(RowRequest(other, options, 1, top_logprobs=0))  # a row already there
    _, first, batched = dec.add(RowRequest(prompt, options, 0, top_logprobs=2, prompt_logprobs=True))
    solo = SoloRun(model, RowRequest(prompt, options, 0, top_logprobs=2, prompt_logprobs=True), dict(kw, kv_quant=KV))
    alone = solo.prompt_scores()
    assert first.steps < 6  # the prompt's last position exited early: its probes ran
    assert alone.logprobs[1:] == pytest.approx(batched.logprobs[1:], abs=TOL)
    assert [[t for t, _ in top] for top in alone.top[1:]] == [[t for t, _ in top] for top in batched.top[1:]]
    assert solo.next().token == first.token
    solo.close()


def test_solo_echo_scores_under_exit_in_prefill_calibrate_where_the_session_does(model):
    """Under `exit_in_prefill` the session's prefill writes the coda's KV first at its first check (step 1),
    so a quantized cache calibrates the coda there; the echo scores were a forward at the exit depth on a
    fresh cache, calibrated on the exit-depth states. Oracle: that forward on a cache whose codecs a
    one-step forward made."""
    from recurrent_depth.inference.cache import make_cache
    from recurrent_depth.serving.solo import SoloRun

    prompt, seed = [5, 17, 99, 3, 250, 42, 8], 3
    kw = dict(num_steps=8, exit_criterion="kl", exit_threshold=0.1, exit_in_prefill=True, max_new_tokens=1)
    options = GenerationOptions(**kw, kv_quant=KV).validate(4)
    solo = SoloRun(model, RowRequest(prompt, options, seed, top_logprobs=0, prompt_logprobs=True),
                   dict(kw, kv_quant=KV))
    scores = torch.tensor(solo.prompt_scores().logprobs[1:])
    depth = solo.next().steps
    assert 1 < depth < 8
    ids = torch.tensor([prompt])

    def cache():
        return make_cache("static", 1, 8, capacity=len(prompt), policy=options.policy,
                          core_layers=model.config.core_layers, kv_quant=KV)

    def forward(steps: int, into) -> torch.Tensor:
        with torch.no_grad():
            out = model(ids, num_steps=steps, generator=torch.Generator().manual_seed(seed), cache=into)
        logp = torch.log_softmax(out.logits[0], -1)
        return logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]

    at_first_check, replay = cache(), cache()
    forward(1, at_first_check)
    replay.codecs._layers.update(at_first_check.codecs._layers)  # each layer's codecs as the session made them
    torch.testing.assert_close(scores, forward(depth, replay), rtol=0, atol=TOL)
    assert (scores - forward(depth, cache())).abs().max() > 10 * TOL  # where the coda calibrates matters
    solo.close()
