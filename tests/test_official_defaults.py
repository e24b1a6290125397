"""`defaults="official"` and the official code's behaviours as options (issue 17), on tiny models.

The recorded official outputs are checked in test_official_golden.py; here each behaviour is pinned
on its own: which fields the profile fills, the two min_steps rules and check_every (with
criteria whose first checks are predictable), exit in prefill (batch = alone), the readout of a
token that reaches max_steps between checks, the speculative loop's last round, minp-kl against
a reference written here, and the stop tokens (eos lists, end of turn with a chat template).
"""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.criteria import ExitCriterion, resolve_criterion
from recurrent_depth.inference.options import GenerationOptions
from tests import test_inference
from tests.test_inference import left_pad

model, prompts = test_inference.model, test_inference.prompts  # its tiny model and prompts (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- the profile
def test_official_defaults_fill_only_the_fields_left_unset():
    ours = GenerationOptions(exit_criterion="kl").validate(4)
    assert (ours.exit_in_prefill, ours.min_steps_rule, ours.min_steps, ours.threshold, ours.warm_start_source,
            ours.finish_round, ours.check_every) == (False, "exit", 1, 5e-4, "raw", False, 1)
    official = GenerationOptions(exit_criterion="kl", defaults="official").validate(4)
    assert (official.exit_in_prefill, official.min_steps_rule, official.min_steps, official.threshold,
            official.warm_start_source, official.finish_round) == (True, "skip", 0, 1e-3, "raw", True)
    # the official fixed-depth loop (generate_minimal) warm-starts from the normed latent
    assert GenerationOptions(defaults="official").validate(4).warm_start_source == "normed"
    assert GenerationOptions(defaults="official", exit_criterion="none").validate(4).warm_start_source == "raw"
    # the official speculative loop's own depth default
    assert GenerationOptions(defaults="official", draft_steps=4).validate(4).num_steps == 32
    explicit = GenerationOptions(exit_criterion="kl", defaults="official", exit_in_prefill=False, min_steps=2,
                                 min_steps_rule="exit", exit_threshold=5e-4, finish_round=False).validate(4)
    assert (explicit.exit_in_prefill, explicit.min_steps_rule, explicit.min_steps, explicit.threshold,
            explicit.finish_round) == (False, "exit", 2, 5e-4, False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(defaults="paper"), "defaults"),
    (dict(exit_criterion="kl", min_steps_rule="late"), "min_steps_rule"),
    (dict(warm_start=True, warm_start_source="ln_f"), "warm_start_source"),
    (dict(exit_criterion="kl", check_every=0), "check_every"),
    (dict(exit_criterion="kl", min_steps=0), "min_steps"),  # 0 is the "skip" rule's "no step skipped"
    (dict(exit_in_prefill=True), "exit_in_prefill"),  # needs a criterion
    (dict(exit_criterion="kl", exit_in_prefill="yes"), "exit_in_prefill"),
    (dict(finish_round=1), "finish_round"),
    (dict(eos_token_id=[1, 999]), "eos_token_id"),
    (dict(eos_token_id="eos"), "eos_token_id"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_official_behaviour_options_name_the_field(model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, num_steps=3, **kwargs)


# ---------------------------------------------------------------------------------------- the step schedule
def first_token_steps(model, prompt, **kwargs) -> int:
    """Steps the prompt runs under exit in prefill (the first token's entry in `steps`)."""
    out = generate(model, prompt[None], max_new_tokens=1, num_steps=12, init_scale=0.0, exit_in_prefill=True,
                   **kwargs)
    return int(out.steps[0, 0])


@pytest.mark.parametrize("m", [1, 3])
def test_min_steps_rules_and_check_every(model, prompts, m):
    """entropy-diff with threshold 50 fails its first check (|H - 100| > 90 for 256 tokens) and passes
    every later one (the entropy of a contracting recurrence moves by far less than 50);
    latent-diff with a huge threshold passes its first check."""
    p = prompts[0]
    entropy = dict(exit_criterion="entropy-diff", exit_threshold=50.0)
    latent = dict(exit_criterion="latent-diff", exit_threshold=1e9)
    # ours: statistics from step 1, an exit allowed from step m
    assert first_token_steps(model, p, min_steps=m, **entropy) == max(m, 2)
    assert first_token_steps(model, p, min_steps=m, **latent) == m
    # official: nothing before step m + 1, whose check compares with the prior (100 / s_0)
    assert first_token_steps(model, p, min_steps=m, min_steps_rule="skip", **entropy) == m + 2
    assert first_token_steps(model, p, min_steps=m, min_steps_rule="skip", **latent) == m + 1
    # check every 3rd step: checks at first, first + 3, ...
    assert first_token_steps(model, p, min_steps=m, min_steps_rule="skip", check_every=3, **entropy) == m + 4
    assert first_token_steps(model, p, min_steps=m, check_every=3, **entropy) == (4 if m <= 4 else 7)
    assert first_token_steps(model, p, min_steps=m, check_every=3, **latent) == (1 if m == 1 else 4)


def test_a_token_at_max_steps_between_checks_is_read_at_its_last_check_only_under_the_official_rule(model, prompts):
    """kl with threshold 0 never exits; 4 steps checked at 1 and 3. The official loop keeps the logits
    of its last check (step 3), ours reads the final state (step 4)."""
    p = prompts[0][None]
    common = dict(max_new_tokens=1, num_steps=4, init_scale=0.0, exit_criterion="kl", exit_threshold=0.0,
                  exit_in_prefill=True, check_every=2, output_logits=True)
    official = generate(model, p, min_steps_rule="skip", **common)
    ours = generate(model, p, **common)
    at = {r: generate(model, p, max_new_tokens=1, num_steps=r, init_scale=0.0, output_logits=True).logits
          for r in (3, 4)}
    assert official.steps[0, 0] == ours.steps[0, 0] == 4
    torch.testing.assert_close(official.logits, at[3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.logits, at[4], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(at[3], at[4], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------- exit in prefill
@pytest.mark.parametrize("criterion, threshold", [("latent-diff", 0.05), ("kl", 1e-2), ("cosine", 1e-2)])
def test_exit_in_prefill_batch_equals_each_row_alone(model, prompts, criterion, threshold):
    kwargs = dict(max_new_tokens=5, num_steps=12, init_scale=0.0, exit_criterion=criterion,
                  exit_threshold=threshold, exit_in_prefill=True)
    ids, mask = left_pad(prompts)
    batch = generate(model, ids, attention_mask=mask, **kwargs)
    alone = [generate(model, p[None], **kwargs) for p in prompts]
    for b, out in enumerate(alone):
        assert batch.token_lists()[b] == out.token_lists()[0]
        assert batch.steps[b].tolist() == out.steps[0].tolist()
    # the prompts stop early (else this would test nothing), and without the option they run 12 steps
    assert all(int(out.steps[0, 0]) < 12 for out in alone)
    full = generate(model, prompts[0][None], **{**kwargs, "exit_in_prefill": False})
    assert int(full.steps[0, 0]) == 12


def test_exit_in_prefill_leaves_the_cache_as_a_prompt_run_at_its_exit_depth(model, prompts):
    """A prompt that exits at step d is cached as if it had run d steps (fixed depth); a later
    token then reads it with the lookup rule, as any early-exited token."""
    p = prompts[2][None]
    adaptive = generate(model, p, max_new_tokens=4, num_steps=12, init_scale=0.0, exit_criterion="latent-diff",
                        exit_threshold=0.05, exit_in_prefill=True, output_logits=True)
    d = int(adaptive.steps[0, 0])
    fixed = generate(model, p, max_new_tokens=1, num_steps=d, init_scale=0.0, output_logits=True)
    assert d < 12
    torch.testing.assert_close(adaptive.logits[:, :1], fixed.logits, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------- warm start, speculative
def test_warm_start_sources_differ_only_in_the_state_they_reuse(model, prompts):
    p = prompts[1][None]
    kwargs = dict(max_new_tokens=6, num_steps=3, init_scale=0.0, warm_start=True, output_logits=True)
    raw = generate(model, p, **kwargs)
    normed = generate(model, p, warm_start_source="normed", **kwargs)
    torch.testing.assert_close(raw.logits[:, 0], normed.logits[:, 0])  # the prompt's own prediction
    assert not torch.allclose(raw.logits[:, 1:], normed.logits[:, 1:])
    assert torch.equal(generate(model, p, defaults="official", **kwargs).sequences, normed.sequences)


@pytest.mark.parametrize("lookahead", [3, 4])
def test_finish_round_commits_the_last_round_and_stays_greedy(model, prompts, lookahead):
    p = prompts[0][None]
    kwargs = dict(num_steps=4, draft_steps=1, lookahead=lookahead, max_new_tokens=7, init_scale=0.0)
    ours = generate(model, p, **kwargs)
    official = generate(model, p, finish_round=True, **kwargs)
    n = int(official.lengths[0])
    assert int(ours.lengths[0]) == 7 and 7 <= n < 7 + lookahead
    greedy = generate(model, p, num_steps=4, max_new_tokens=n, init_scale=0.0)
    assert official.token_lists() == greedy.token_lists()  # exact mode: greedy at num_steps, round included
    assert ours.token_lists()[0] == greedy.token_lists()[0][:7]


# ---------------------------------------------------------------------------------------- criteria
def test_minp_kl_is_kl_after_the_official_min_p_filter():
    torch.manual_seed(3)
    V = 50
    logits = [torch.randn(2, V) * 3 for _ in range(3)]

    def filtered(lg):  # the reference, written out: probs below 0.1 max -> 1/V, renormalised
        probs = lg.softmax(-1)
        out = probs.clone()
        for b in range(probs.shape[0]):
            for v in range(V):
                if probs[b, v] < 0.1 * probs[b].max():
                    out[b, v] = 1.0 / V
        return out / out.sum(-1, keepdim=True)

    crit = ExitCriterion(*resolve_criterion("minp-kl", 1e-5))
    crit.start(torch.zeros(2, 8), V)
    prev = torch.full((2, V), 1.0 / V)
    for lg in logits:
        crit.update(None, lg)
        cur = filtered(lg)
        expected = (prev * (prev.log() - cur.log())).sum(-1)
        torch.testing.assert_close(crit.last_statistic, expected, rtol=1e-5, atol=1e-6)
        prev = cur
    assert resolve_criterion("minp-kl", None)[1] == 1e-5


def test_criterion_none_never_exits(model, prompts):
    out = generate(model, prompts[0][None], max_new_tokens=4, num_steps=5, init_scale=0.0, exit_criterion="none")
    fixed = generate(model, prompts[0][None], max_new_tokens=4, num_steps=5, init_scale=0.0)
    assert out.token_lists() == fixed.token_lists() and out.steps.eq(5).all()


# ---------------------------------------------------------------------------------------- stop tokens
def test_eos_token_id_may_be_a_list_in_the_options_and_the_config(model, prompts):
    p = prompts[0][None]
    free = generate(model, p, max_new_tokens=8, num_steps=3, init_scale=0.0).token_lists()[0]
    first, third = free[0], free[2]
    if first in free[1:3] or third in free[:2]:
        pytest.fail("the seeded continuation must hold distinct tokens at 0 and 2")
    cut = generate(model, p, max_new_tokens=8, num_steps=3, init_scale=0.0, eos_token_id=[250, third])
    assert cut.token_lists()[0] == free[:3] and cut.finish_reasons == ["stop"]
    cfg = rd.ModelConfig.from_preset("tiny", eos_token_id=[250, third])
    assert cfg.eos_token_id == [250, third]
    listed = rd.RecurrentDepthLM(cfg).eval()
    listed.load_state_dict(model.state_dict())
    assert generate(listed, p, max_new_tokens=8, num_steps=3, init_scale=0.0).token_lists()[0] == free[:3]
    # the caller's eos replaces the config's
    assert generate(listed, p, max_new_tokens=8, num_steps=3, init_scale=0.0,
                    eos_token_id=first).token_lists()[0] == free[:1]
    with pytest.raises(ValueError, match="eos_token_id"):
        rd.ModelConfig.from_preset("tiny", eos_token_id=[3, 256])
    with pytest.raises(ValueError, match="eos_token_id"):
        rd.ModelConfig.from_preset("tiny", eos_token_id=[])


def test_official_defaults_stop_at_the_official_hard_coded_ids_in_its_vocabulary(model):
    opts = GenerationOptions(defaults="official")
    assert opts.stop_ids(None, 65536) == [65504, 65505, 65508]
    assert opts.stop_ids([7, 65505], 65536) == [7, 65505, 65504, 65508]
    assert opts.stop_ids(7, 256) == [7]  # a small vocabulary has none of them
    assert GenerationOptions().stop_ids([7, 9], 256) == [7, 9]


def test_a_chat_answer_stops_at_the_end_of_its_turn(tmp_path):
    """The tokenizer's special tokens set eos to end of text and end of turn (as the trainer does), so
    generation from a chat-template prompt stops at <|end_turn|>. The seeded model is made to emit
    end of turn where it would emit the third token of its answer (its embedding row, which is also
    its output row, becomes that token's, slightly scaled), as the golden model does."""
    from transformers import AutoTokenizer

    from recurrent_depth.data.tokenizer import eos_token_ids, save_tokenizer, special_token_ids, train_tokenizer

    corpus = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 4] * 4
    tok = train_tokenizer(corpus, 320)
    save_tokenizer(tok, tmp_path)
    specials = special_token_ids(tok)
    prompt = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "add two numbers"}], add_generation_prompt=True, tokenize=True)
    prompt = torch.tensor([prompt["input_ids"] if hasattr(prompt, "keys") else prompt])
    torch.manual_seed(5)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=320, eos_token_id=eos_token_ids(specials))
    model = rd.RecurrentDepthLM(cfg).eval()
    kwargs = dict(max_new_tokens=10, num_steps=4, init_scale=0.0)
    free = generate(model, prompt, eos_token_id=[], **kwargs).token_lists()[0]
    with torch.no_grad():
        model.transformer.wte.weight[specials["end_turn"]] = 1.05 * model.transformer.wte.weight[free[2]]
    answer = generate(model, prompt, **kwargs)
    tokens = answer.token_lists()[0]
    assert tokens[-1] == specials["end_turn"] and answer.finish_reasons == ["stop"]
    assert len(tokens) < 10
    # with only end of text as eos (the config before issue 17) the answer runs past the end of its turn
    past = generate(model, prompt, eos_token_id=specials["end_text"], **kwargs).token_lists()[0]
    assert past[: len(tokens)] == tokens and len(past) > len(tokens)


def test_the_serving_batch_hands_the_official_schedule_to_a_solo_run():
    """The continuous batch's step loop is ours; calls under the official schedule run alone
    (`stream_generate`, which implements it), so a server gives the same tokens as rd.generate."""
    from recurrent_depth.serving.batch import BatchDecoder

    def runs(**kwargs) -> bool:
        return BatchDecoder.runs(GenerationOptions(**kwargs).validate(4))

    assert runs(exit_criterion="kl") and runs() and runs(warm_start=True)
    assert runs(defaults="official")  # fixed depth without warm start: the same loop
    assert runs(exit_criterion="kl", min_steps_rule="skip", min_steps=0)  # = our min_steps=1
    assert not runs(exit_criterion="kl", defaults="official")  # exit in prefill
    assert not runs(exit_criterion="kl", check_every=2)
    assert not runs(exit_criterion="kl", min_steps_rule="skip", min_steps=2)
    assert not runs(warm_start=True, defaults="official")  # the normed warm start


@pytest.mark.parametrize("field, value", [("defaults", "paper"), ("min_steps_rule", "late"), ("check_every", 0),
                                          ("exit_in_prefill", "yes"), ("warm_start_source", 3)])
def test_http_official_fields_are_checked_with_the_field_named(field, value):
    from recurrent_depth.serving.protocol import APIError, Limits, parse_completion

    limits = Limits(max_seq_len=96, mean_recurrence=4, vocab_size=256, max_num_steps=16)
    body = {"prompt": "x", "exit_criterion": "kl", field: value}
    with pytest.raises(APIError) as info:
        parse_completion(body, limits, {"m"}).sampling.options(1, 4, limits)
    assert info.value.status == 400 and info.value.param == field
    ok = parse_completion({"prompt": "x", "exit_criterion": "kl", "defaults": "official", "check_every": 2}, limits,
                          {"m"}).sampling.options(1, 4, limits)
    assert (ok.exit_in_prefill, ok.min_steps_rule, ok.check_every, ok.threshold) == (True, "skip", 2, 1e-3)


def test_defaults_official_in_transformers_generate():
    """transformers `generate(defaults="official")` gives rd.generate's tokens and steps under
    defaults="official"; a call with no option of the library's own stays in transformers' loop,
    as the official `generate` hands it to transformers."""
    from recurrent_depth.integrations.hf import from_library_model

    torch.manual_seed(1234)
    library = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    options = dict(max_new_tokens=6, num_steps=8, init_scale=0.0, exit_criterion="kl", exit_threshold=3e-2)
    expected = generate(library, ids, defaults="official", **options)
    assert expected.steps.tolist() != generate(library, ids, **options).steps.tolist()  # the profiles differ here
    wrapped = from_library_model(library)
    out = wrapped.generate(ids, defaults="official", return_dict_in_generate=True, **options)
    assert out.token_lists() == expected.token_lists() and out.steps.tolist() == expected.steps.tolist()
    # the official kwargs, as the official model card writes them
    out = wrapped.generate(ids, criterion="kl", exit_threshold=3e-2, do_not_exit_in_prefill=True,
                           check_criterion_every_n_steps=2, min_steps=1, defaults="official", max_new_tokens=6,
                           num_steps=8, init_scale=0.0, return_dict_in_generate=True)
    same = generate(library, ids, defaults="official", exit_in_prefill=False, check_every=2, min_steps=1, **options)
    assert out.token_lists() == same.token_lists() and out.steps.tolist() == same.steps.tolist()
    assert same.steps.tolist() != expected.steps.tolist()
    plain = wrapped.generate(ids, max_new_tokens=4, num_steps=3, init_scale=0.0, do_sample=False, defaults="official")
    assert torch.equal(plain, wrapped.generate(ids, max_new_tokens=4, num_steps=3, init_scale=0.0, do_sample=False))
    with pytest.raises(ValueError, match="defaults"):
        wrapped.generate(ids, exit_criterion="kl", defaults="paper", max_new_tokens=2)


def test_defaults_official_on_the_cli(tmp_path, capsys):
    """`rdepth generate --defaults official` = the official options spelled out."""
    import json

    from recurrent_depth.cli import main
    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(["def add(a, b):\n    return a + b\n"] * 8, 300), tmp_path)
    torch.manual_seed(1234)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=300)).save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--prompt", "def add(a", "--max-new-tokens", "6", "--num-steps",
            "8", "--init-scale", "0", "--json", "--exit-criterion", "kl", "--exit-threshold", "0.03"]

    def run(*flags: str) -> tuple[list, list]:
        assert main([*base, *flags]) == 0
        record = json.loads(capsys.readouterr().out)
        return record["tokens"], record["steps"]

    official = run("--defaults", "official")
    assert official == run("--exit-in-prefill", "--min-steps-rule", "skip", "--min-steps", "0")
    assert official != run()
    assert run("--defaults", "official", "--no-exit-in-prefill") == run("--min-steps-rule", "skip", "--min-steps", "0")


def test_speculative_drafts_see_the_rounds_earlier_drafts_under_a_hiding_lookup():
    """A lookup that hides unreached steps (skip; the official full) must see a round's earlier drafts
    at the draft's N steps: the same drafts, acceptances and tokens as the deepest lookup (the golden
    model, where hiding them lost 4 of 16 acceptances)."""
    from tests.official_golden_support import build_golden_model, load_golden

    golden = load_golden()
    model = build_golden_model(golden["model"])
    p = torch.tensor([golden["prompts"][0]])
    kwargs = dict(num_steps=8, draft_steps=4, lookahead=4, max_new_tokens=14, init_scale=0.0)
    deepest = generate(model, p, **kwargs)
    skip = generate(model, p, kv_policy="per-step+skip", **kwargs)
    assert skip.token_lists() == deepest.token_lists() == generate(model, p, num_steps=8, max_new_tokens=14,
                                                                   init_scale=0.0).token_lists()
    assert skip.stats == deepest.stats and deepest.stats["accepted_drafts"] == 16
