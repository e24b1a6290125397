"""Generation exactness: cache = full forward, budget r = full, speculative = greedy, batch = alone,
threshold 0 = fixed depth, warm start = a different s_0 and nothing else.

Tolerances: logits of the same computation done with different shapes (one token vs a whole
sequence, a padded batch vs a single row) differ by float32 rounding only, observed <= 2e-6 on
these tiny models; we allow 1e-4. Token ids, step counts and exit reasons must match exactly.
"""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate, stream_generate

TOL = dict(rtol=1e-4, atol=1e-4)


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g) for n in (7, 4, 9)]


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :] = r
        mask[b, T - len(r) :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------- cache exactness
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("impl", ["static", "dynamic"])
def test_prefill_then_decode_equals_full_forward(model, prompts, fast, impl):
    ids, mask = left_pad(prompts[:2])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=6, num_steps=3, init_scale=0.0,
                   output_logits=True, fast=fast, cache_implementation=impl)
    full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    full = model(out.sequences, num_steps=3, init_scale=0.0, attention_mask=full_mask).logits
    T = ids.shape[1]
    # token n was chosen from the logits at position T - 1 + n
    torch.testing.assert_close(out.logits, full[:, T - 1 : T + 5], **TOL)
    assert torch.equal(out.new_tokens, full[:, T - 1 : T + 5].argmax(-1))


@pytest.mark.parametrize("budget", [6, 9], ids=["k=r", "k>r"])
def test_kv_budget_at_least_r_equals_full_cache(model, prompts, budget):
    kw = dict(max_new_tokens=6, num_steps=6, init_scale=0.0, output_logits=True)
    full = generate(model, prompts[0], **kw)
    shared = generate(model, prompts[0], kv_budget=budget, **kw)
    assert torch.equal(shared.sequences, full.sequences)
    torch.testing.assert_close(shared.logits, full.logits, rtol=0, atol=0)


def test_small_kv_budget_is_exact_in_prefill_and_saves_core_memory(model, prompts):
    kw = dict(max_new_tokens=6, num_steps=8, init_scale=0.0, output_logits=True)
    full = generate(model, prompts[0], **kw)
    shared = generate(model, prompts[0], kv_budget=2, **kw)
    torch.testing.assert_close(shared.logits[:, 0], full.logits[:, 0], rtol=0, atol=0)  # prefill: exact
    assert not torch.allclose(shared.logits[:, 1:], full.logits[:, 1:])  # decoding shares slots
    assert int(shared.core_cache_bytes[0]) * 4 == int(full.core_cache_bytes[0])  # 2 of 8 slots


@pytest.mark.parametrize("criterion", ["kl", "entropy-diff", "latent-diff", "cosine"])
def test_adaptive_exit_with_threshold_zero_equals_fixed_depth(model, prompts, criterion):
    kw = dict(max_new_tokens=6, num_steps=5, init_scale=0.0, output_logits=True)
    fixed = generate(model, prompts[1], **kw)
    adaptive = generate(model, prompts[1], exit_criterion=criterion, exit_threshold=0.0, **kw)
    assert torch.equal(adaptive.sequences, fixed.sequences)
    assert torch.equal(adaptive.steps, fixed.steps)
    torch.testing.assert_close(adaptive.logits, fixed.logits, **TOL)
    assert set(adaptive.exit_reasons[0][1:]) == {"max-steps"}


def test_argmax_stability_beyond_max_steps_equals_fixed_depth(model, prompts):
    kw = dict(max_new_tokens=6, num_steps=5, init_scale=0.0)
    fixed = generate(model, prompts[1], **kw)
    adaptive = generate(model, prompts[1], exit_criterion="argmax-stability", exit_threshold=6, **kw)
    assert torch.equal(adaptive.sequences, fixed.sequences)


def test_adaptive_exit_uses_fewer_steps_and_respects_bounds(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=10, num_steps=12, init_scale=0.0,
                   exit_criterion="kl", exit_threshold=1e-2, min_steps=3)
    steps = out.steps[0, 1:]  # token 0 comes from the prefill, always at full depth
    assert int(out.steps[0, 0]) == 12 and out.exit_reasons[0][0] == "prefill"
    assert bool((steps >= 3).all()) and bool((steps <= 12).all())
    assert float(steps.float().mean()) < 12
    assert "converged" in out.exit_reasons[0]
    capped = generate(model, prompts[0], max_new_tokens=10, num_steps=12, init_scale=0.0,
                      exit_criterion="kl", exit_threshold=0.0, max_steps=4)
    assert capped.steps[0, 1:].tolist() == [4] * 9


def test_early_exit_tokens_are_read_at_their_deepest_entry(model, prompts):
    """Static (fill at close) and dynamic (lookup at read) implement remark 6.1 the same way."""
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_steps=10, init_scale=0.0, output_logits=True,
              exit_criterion="latent-diff", exit_threshold=0.1)
    for budget in (None, 3):
        static = generate(model, ids, kv_budget=budget, cache_implementation="static", **kw)
        dynamic = generate(model, ids, kv_budget=budget, cache_implementation="dynamic", **kw)
        assert bool((static.steps[:, 1:] < 10).any())  # some tokens really exited early
        assert torch.equal(static.sequences, dynamic.sequences)
        assert torch.equal(static.steps, dynamic.steps)
        torch.testing.assert_close(static.logits, dynamic.logits, **TOL)


# ---------------------------------------------------------------------------------------- warm start
def test_warm_start_changes_the_initial_state_and_nothing_else(model, prompts):
    """Warm start == the model's own forward with input_states = the previous raw final state."""
    prompt = prompts[0][None]
    out = generate(model, prompt, max_new_tokens=6, num_steps=4, init_scale=0.0, warm_start=True,
                   output_logits=True, fast=False)
    cache = rd.DynamicCache()
    step = model(prompt, num_steps=4, init_scale=0.0, cache=cache)
    logits, tokens = [step.logits[:, -1]], [step.logits[:, -1].argmax(-1)]
    state = step.final_state[:, -1:]
    for _ in range(5):
        step = model(tokens[-1][:, None], num_steps=4, cache=cache, input_states=state)
        state = step.final_state
        logits.append(step.logits[:, -1])
        tokens.append(step.logits[:, -1].argmax(-1))
    assert out.new_tokens[0].tolist() == torch.cat(tokens).tolist()
    torch.testing.assert_close(out.logits[0], torch.cat(logits), **TOL)
    cold = generate(model, prompt, max_new_tokens=6, num_steps=4, init_scale=0.0, output_logits=True, fast=False)
    torch.testing.assert_close(cold.logits[:, 0], out.logits[:, 0], rtol=0, atol=0)  # same prefill
    assert not torch.allclose(cold.logits[:, 1:], out.logits[:, 1:])


# ---------------------------------------------------------------------------------------- speculative
@pytest.mark.parametrize("draft,lookahead,impl", [(0, 1, "static"), (1, 3, "static"), (3, 4, "static"),
                                                 (5, 8, "static"), (2, 3, "dynamic")], ids=lambda v: str(v))
def test_speculative_exact_mode_equals_greedy(model, prompts, draft, lookahead, impl):
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=9, num_steps=6, init_scale=0.0, output_logits=True)
    greedy = generate(model, ids, **kw)
    spec = generate(model, ids, draft_steps=draft, lookahead=lookahead, cache_implementation=impl, **kw)
    assert torch.equal(spec.sequences, greedy.sequences)
    torch.testing.assert_close(spec.logits, greedy.logits, **TOL)
    # the bytes the cache holds for the accepted tokens, as greedy decoding's (not the round's rejected drafts)
    assert spec.cache_bytes.tolist() == greedy.cache_bytes.tolist()
    assert spec.stats["rounds"] >= 1
    assert set(sum(spec.exit_reasons, [])) <= {"prefill", "accepted", "corrected"}


def test_speculative_probability_mode_accepts_by_threshold(model, prompts):
    kw = dict(max_new_tokens=12, num_steps=6, init_scale=0.0, output_logits=True, draft_steps=2, lookahead=4)
    strict = generate(model, prompts[0], **kw)
    loose = generate(model, prompts[0], verification_threshold=0.05, **kw)
    assert loose.stats["acceptance_rate"] >= strict.stats["acceptance_rate"]
    probs = loose.logits[0].softmax(-1)
    chosen = probs.gather(-1, loose.new_tokens[0][:, None])[:, 0]
    for reason, p, top in zip(loose.exit_reasons[0], chosen, probs.max(-1).values):
        if reason == "accepted":
            assert p >= 0.05 * top
        else:  # the verifier's own (top) choice
            assert p == top


@pytest.mark.parametrize("policy", ["always-last-m4", "randomized"])
def test_speculative_drafts_record_their_depth_for_lookups_that_read_it(model, prompts, policy):
    # Speculative decoding is fixed depth: no token lacks a step, so every lookup reads what 'deepest'
    # reads. The drafts' columns were not closed, so always-last / randomized read a stale depth (0 where
    # the cache's depth record had just grown) and re-picked slots: other tokens, a batch row != alone.
    ids, mask = left_pad(prompts)
    kw = dict(max_new_tokens=12, num_steps=6, init_scale=0.0, seed=3, output_logits=True, draft_steps=2,
              lookahead=3, verification_threshold=0.3)
    for given in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=prompts[0])):
        want = generate(model, kv_policy="latest-m4", **given, **kw)
        got = generate(model, kv_policy=policy, **given, **kw)
        assert got.token_lists() == want.token_lists()
        torch.testing.assert_close(got.logits, want.logits, **TOL)


@pytest.fixture(scope="module")
def short_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", max_seq_len=24)).eval()


def test_speculative_drafts_stop_at_max_seq_len(short_model):
    # prompt + new tokens fill the context exactly; a round must not draft past it
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=4, num_steps=4, init_scale=0.0)
    greedy = generate(short_model, ids, **kw)
    spec = generate(short_model, ids, draft_steps=3, lookahead=8, **kw)
    assert torch.equal(spec.sequences, greedy.sequences)


def test_speculative_batch_with_a_stopped_row_stays_within_max_seq_len(short_model):
    # A row that stops keeps feeding padding while the others (with rejected, hidden columns) go on:
    # its positions must not run past max_seq_len, and every row still equals its run alone.
    ids = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=16, num_steps=4, init_scale=0.0)
    greedy = generate(short_model, ids, **kw).token_lists()
    stop = greedy[0][1]
    assert all(stop not in row for row in greedy[1:])
    spec = generate(short_model, ids, draft_steps=3, lookahead=4, stop=[stop], **kw)
    assert spec.finish_reasons == ["stop", "length", "length"]
    alone = [generate(short_model, ids[b : b + 1], **kw, stop=[stop]).token_lists()[0] for b in range(3)]
    assert spec.token_lists() == alone


# ---------------------------------------------------------------------------------------- parallel sampler
def test_parallel_sampler_with_full_sweeps_equals_autoregressive_with_one_kv_slot(model, prompts):
    """inner_steps = max_steps and headway 1: the front runs all its steps on final inputs, reading
    the single latest KV entry of earlier positions, i.e. greedy decoding with kv_budget=1."""
    kw = dict(max_new_tokens=8, num_steps=4, init_scale=0.0, output_logits=True)
    reference = generate(model, prompts[0], kv_budget=1, **kw)
    wave = generate(model, prompts[0], sampler="parallel", inner_steps=4, **kw)
    assert torch.equal(wave.sequences, reference.sequences)
    torch.testing.assert_close(wave.logits, reference.logits, **TOL)


@pytest.mark.parametrize("criterion", ["latent-diff", "cosine"])
def test_parallel_sampler_with_a_wavefront_of_one_equals_autoregressive_exit_with_one_kv_slot(
    model, prompts, criterion
):
    """wavefront 1 and one step per sweep: each position runs alone on its final input until its latent
    converges, i.e. token-by-token decoding with the same latent exit and kv_budget=1."""
    kw = dict(max_new_tokens=8, num_steps=6, init_scale=0.0, output_logits=True, exit_criterion=criterion,
              exit_threshold=0.2 if criterion == "latent-diff" else 2e-2)  # some tokens converge, some do not
    reference = generate(model, prompts[0], kv_budget=1, **kw)
    wave = generate(model, prompts[0], sampler="parallel", inner_steps=1, wavefront=1, **kw)
    assert torch.equal(wave.sequences, reference.sequences)
    assert torch.equal(wave.steps, reference.steps)
    assert wave.exit_reasons == reference.exit_reasons
    assert {"converged", "max-steps"} <= set(reference.exit_reasons[0])
    torch.testing.assert_close(wave.logits, reference.logits, **TOL)


def test_parallel_sampler_reports_the_bytes_of_the_committed_positions(model, prompts):
    # one step a sweep keeps guesses in flight ahead of each committed token; their columns are not its bytes
    kw = dict(max_new_tokens=8, num_steps=4, init_scale=0.0, sampler="parallel")
    full_sweeps = generate(model, prompts[0], inner_steps=4, **kw)
    pipelined = generate(model, prompts[0], inner_steps=1, **kw)
    assert pipelined.stats["mean_wavefront"] > 1
    assert pipelined.cache_bytes.tolist() == full_sweeps.cache_bytes.tolist()
    steps = full_sweeps.cache_bytes[0].diff()
    assert steps.min() == steps.max() > 0  # one more column cached a token


@pytest.mark.parametrize("width", [1, 2, 3])
def test_parallel_sampler_wavefront_bounds_the_positions_in_flight(model, prompts, width):
    out = generate(model, prompts[0], max_new_tokens=10, num_steps=8, init_scale=0.0, sampler="parallel",
                   inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1, wavefront=width)
    assert int(out.lengths[0]) == 10
    assert 1 <= out.stats["mean_wavefront"] <= width
    if width > 1:
        assert out.stats["mean_wavefront"] > 1


def test_parallel_sampler_static_cache_equals_the_reference_cache(model, prompts):
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=7, num_steps=6, init_scale=0.0, output_logits=True,
              sampler="parallel", inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1)
    static = generate(model, ids, **kw)
    dynamic = generate(model, ids, cache_implementation="dynamic", **kw)
    assert torch.equal(static.sequences, dynamic.sequences) and torch.equal(static.steps, dynamic.steps)
    torch.testing.assert_close(static.logits, dynamic.logits, **TOL)


def test_parallel_sampler_pipelines_positions(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=12, num_steps=8, init_scale=0.0, sampler="parallel",
                   inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1)
    assert int(out.lengths[0]) == 12
    assert out.stats["sweeps"] < 12 * 8 / 2  # fewer sweeps than sequential decoding would need
    assert out.stats["mean_wavefront"] > 1
    assert bool((out.steps[0, 1:] >= 2).all())  # at least one sweep of 2 steps per position
    assert set(out.exit_reasons[0][1:]) <= {"converged", "max-steps"}


# ---------------------------------------------------------------------------------------- batch == alone
MODES = {
    "fixed": dict(),
    "kl": dict(exit_criterion="kl", exit_threshold=1e-2),
    "entropy-diff": dict(exit_criterion="entropy-diff"),
    "latent-diff": dict(exit_criterion="latent-diff", exit_threshold=0.1),
    "cosine": dict(exit_criterion="cosine", exit_threshold=5e-3),
    "argmax-stability": dict(exit_criterion="argmax-stability", exit_threshold=2),
    "kv-budget+kl": dict(kv_budget=2, exit_criterion="kl", exit_threshold=1e-2),
    "warm-start+latent": dict(warm_start=True, exit_criterion="latent-diff", exit_threshold=0.1),
    "speculative": dict(draft_steps=2, lookahead=3),
    "speculative-prob": dict(draft_steps=2, lookahead=3, verification_threshold=0.3),
    "parallel": dict(sampler="parallel", inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1),
    "parallel-sampled": dict(sampler="parallel", inner_steps=3, do_sample=True, init_scale=1.0),
    "sample+kl": dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01,
                      exit_criterion="kl", exit_threshold=1e-2),
    "random-s0": dict(init_scale=1.0),
    "repetition-penalty": dict(repetition_penalty=1.5),
    "dynamic-cache+kl": dict(cache_implementation="dynamic", exit_criterion="kl", exit_threshold=1e-2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_batch_equals_one_by_one(model, prompts, mode):
    kw = dict(max_new_tokens=7, num_steps=6, init_scale=0.0, output_logits=True)
    kw.update(MODES[mode])
    ids, mask = left_pad(prompts)
    batch = generate(model, ids, attention_mask=mask, seed=11, **kw)
    for b, prompt in enumerate(prompts):
        alone = generate(model, prompt, seed=11 + b, **kw)  # row b of a batch uses seed + b
        assert batch.token_lists()[b] == alone.token_lists()[0], f"row {b}"
        n = int(alone.lengths[0])
        assert batch.steps[b, :n].tolist() == alone.steps[0, :n].tolist(), f"row {b}"
        assert batch.exit_reasons[b] == alone.exit_reasons[0], f"row {b}"
        torch.testing.assert_close(batch.logits[b, :n], alone.logits[0, :n], **TOL)
        assert batch.cache_bytes[b, :n].tolist() == alone.cache_bytes[0, :n].tolist(), f"row {b}"


@pytest.mark.parametrize("mode", ["fixed", "speculative", "parallel"])
def test_finished_rows_are_padded_and_others_continue(model, prompts, mode):
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_steps=4, init_scale=0.0, **MODES[mode])
    free = generate(model, ids, **kw)
    stop_token = free.token_lists()[1][2]  # row 1's third token
    out = generate(model, ids, stop=stop_token, **kw)
    for b in range(3):
        full = free.token_lists()[b]
        cut = full.index(stop_token) + 1 if stop_token in full else len(full)
        assert out.token_lists()[b] == full[:cut]
        assert out.finish_reasons[b] == ("stop" if stop_token in full else "length")
        assert out.new_tokens[b, cut:].eq(out.pad_token_id).all()
        assert out.steps[b, cut:].eq(0).all()


def test_config_eos_stops_generation(prompts):
    torch.manual_seed(1234)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    free = generate(model, prompts[0], max_new_tokens=8, num_steps=4, init_scale=0.0)
    model.config.eos_token_id = free.token_lists()[0][3]
    out = generate(model, prompts[0], max_new_tokens=8, num_steps=4, init_scale=0.0)
    assert out.token_lists()[0] == free.token_lists()[0][: free.token_lists()[0].index(model.config.eos_token_id) + 1]
    assert out.finish_reasons == ["stop"]


# ---------------------------------------------------------------------------------------- randomness
def test_random_initial_states_are_reproducible_with_a_seed(model, prompts):
    kw = dict(max_new_tokens=6, num_steps=4, init_scale=1.0, do_sample=True, output_logits=True)
    a = generate(model, prompts[0], seed=5, **kw)
    b = generate(model, prompts[0], seed=5, **kw)
    c = generate(model, prompts[0], seed=6, **kw)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    assert not torch.allclose(a.logits, c.logits)
    torch.manual_seed(3)
    d = generate(model, prompts[0], **kw)
    torch.manual_seed(3)
    e = generate(model, prompts[0], **kw)
    assert torch.equal(d.sequences, e.sequences)  # unseeded: follows torch.manual_seed


def test_top_k_one_sampling_is_greedy(model, prompts):
    kw = dict(max_new_tokens=6, num_steps=4, init_scale=0.0)
    assert torch.equal(generate(model, prompts[0], do_sample=True, top_k=1, seed=0, **kw).sequences,
                       generate(model, prompts[0], **kw).sequences)


def test_repetition_penalty_discourages_repeats(model, prompts):
    kw = dict(max_new_tokens=24, num_steps=3, init_scale=0.0)
    plain = generate(model, prompts[0][:3], **kw).token_lists()[0]
    penalised = generate(model, prompts[0][:3], repetition_penalty=5.0, **kw).token_lists()[0]
    assert len(set(penalised)) > len(set(plain))


# ---------------------------------------------------------------------------------------- streaming and stats
@pytest.mark.parametrize("mode", ["fixed", "kl", "speculative", "parallel"])
def test_streamed_events_match_the_output(model, prompts, mode):
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=6, num_steps=4, init_scale=0.0, **MODES[mode])
    stream = stream_generate(model, ids, **kw)
    events = list(stream)
    out = stream.output
    for b in range(3):
        mine = sorted((e for e in events if e.row == b), key=lambda e: e.index)
        assert [e.token for e in mine] == out.token_lists()[b]
        assert [e.steps for e in mine] == out.steps[b, : len(mine)].tolist()
        assert [e.reason for e in mine] == out.exit_reasons[b]
        assert mine[-1].finished
    seen = []
    generate(model, ids, streamer=seen.append, **kw)
    assert [(e.row, e.token) for e in seen] == [(e.row, e.token) for e in events]


def test_finish_round_flags_only_the_rows_last_event_finished(model, prompts):
    # a speculative round that passes max_new_tokens under finish_round went on after an event said finished
    ids, mask = left_pad(prompts)
    stream = stream_generate(model, ids, attention_mask=mask, max_new_tokens=7, num_steps=6, init_scale=0.0,
                             draft_steps=2, lookahead=4, finish_round=True)
    events = list(stream)
    assert int(stream.output.lengths.max()) > 8  # a round did pass max_new_tokens by more than one token
    for b in range(3):
        assert [e.finished for e in events if e.row == b] == [False] * (int(stream.output.lengths[b]) - 1) + [True]


def test_per_token_statistics(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=6, num_steps=6, init_scale=0.0,
                   exit_criterion="kl", exit_threshold=1e-2)
    bytes_ = out.cache_bytes[0].tolist()
    assert all(b2 > b1 for b1, b2 in zip(bytes_, bytes_[1:]))  # one more token cached each time
    full = generate(model, prompts[0], max_new_tokens=6, num_steps=6, init_scale=0.0)
    assert bytes_[-1] < full.cache_bytes[0, -1]  # early exits store fewer core entries
    # bytes = columns x (prelude + coda + core x depth) x 2 x Hkv x D x 4 bytes
    cfg = model.config
    entry = 2 * cfg.num_kv_heads * cfg.head_dim * 4
    T = len(prompts[0])
    assert full.cache_bytes[0, 0] == T * entry * (cfg.prelude_layers + cfg.coda_layers + cfg.core_layers * 6)
    summary = out.summary()
    assert summary["new_tokens"] == 6 and summary["mean_steps"] == pytest.approx(out.mean_steps, abs=1e-3)
    assert out.mean_steps == pytest.approx(out.steps.float().mean().item())


def test_zero_new_tokens_returns_the_prompt(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=0, num_steps=2)
    assert torch.equal(out.sequences[0], prompts[0]) and out.steps.shape == (1, 0)


def test_top_level_generate_forwards(model, prompts):
    a = rd.generate(model, prompts[0], max_new_tokens=4, num_steps=3, init_scale=0.0)
    b = generate(model, prompts[0], max_new_tokens=4, num_steps=3, init_scale=0.0)
    assert torch.equal(a.sequences, b.sequences)


# ---------------------------------------------------------------------------------------- teacher forcing
def test_teacher_forcing_at_fixed_depth_equals_one_parallel_forward(model, prompts):
    ids, mask = left_pad(prompts)
    teacher = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(3))
    out = generate(model, ids, attention_mask=mask, max_new_tokens=6, num_steps=4, init_scale=0.0,
                   output_logits=True, teacher_tokens=teacher)
    assert torch.equal(out.new_tokens, teacher)
    full = model(torch.cat([ids, teacher], 1), num_steps=4, init_scale=0.0,
                 attention_mask=torch.cat([mask, torch.ones_like(teacher)], 1)).logits
    T = ids.shape[1]
    torch.testing.assert_close(out.logits, full[:, T - 1 : T + 5], **TOL)
    assert torch.equal(out.predictions, full[:, T - 1 : T + 5].argmax(-1))


def test_teacher_forcing_arguments_are_checked(model, prompts):
    with pytest.raises(ValueError, match="teacher_tokens must have shape"):
        generate(model, prompts[0], max_new_tokens=6, num_steps=2, teacher_tokens=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="does not combine with draft_steps"):
        generate(model, prompts[0], max_new_tokens=2, num_steps=2, draft_steps=1,
                 teacher_tokens=torch.zeros(1, 2, dtype=torch.long))


def test_rd_generate_is_the_documented_function():
    """`help(rd.generate)` / IDEs must show the real keywords, not `**kwargs`."""
    import inspect

    import recurrent_depth as rd
    from recurrent_depth.inference import generate as real

    assert rd.generate is real
    params = inspect.signature(rd.generate).parameters
    assert {"max_new_tokens", "num_steps", "exit_criterion", "kv_budget", "warm_start", "draft_steps"} <= set(params)
