"""Quality against depth: one-pass readout, text scores, teacher-forced scoring, accuracy grids, `rdepth eval`."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.quality import text_quality, windows
from recurrent_depth.evaluation.readout import logits_at_depths
from recurrent_depth.evaluation.reasoning import VariableChains, accuracy_grid
from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid
from recurrent_depth.evaluation.reasoning.train import (
    Curriculum,
    ReasoningRunConfig,
    run_reasoning,
    task_preset,
    train_reasoning,
)
from recurrent_depth.evaluation.scoring import batched_logprobs, stepwise_logprobs
from tests.test_hf import make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(11)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=288, max_seq_len=128)).eval()


@pytest.mark.parametrize("init_scale", [0.0, 1.0], ids=["zero-s0", "random-s0"])
def test_one_pass_readout_equals_separate_forwards(model, init_scale):
    x = torch.randint(0, 288, (3, 13), generator=torch.Generator().manual_seed(0))
    depths = [0, 1, 3, 4, 7]
    got = dict(logits_at_depths(model, x, depths, init_scale=init_scale,
                                generator=torch.Generator().manual_seed(5)))
    assert sorted(got) == depths
    for depth in depths:
        with torch.no_grad():
            expected = model(x, num_steps=depth, init_scale=init_scale,
                             generator=torch.Generator().manual_seed(5)).logits
        assert torch.allclose(got[depth], expected, atol=1e-6), depth


def test_windows_predict_every_token_once():
    ids = list(range(23))
    chunks = windows(ids, 8)
    targets = [t for w in chunks for t in w[1:]]
    assert targets == ids[1:]
    assert all(len(w) <= 8 for w in chunks)
    with pytest.raises(ValueError, match="seq_len=1"):
        windows(ids, 1)


class ByteCodec:
    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_quality_matches_a_direct_computation(model):
    texts = ["def f(x):\n    return x + 1\n" * 3, "héllo wörld"]
    result = text_quality(model, texts, ByteCodec(), [2, 3], bos_token_id=256, pad_token_id=0, seq_len=17,
                          batch_size=3, init_scale=0.0)
    total, tokens, nbytes = 0.0, 0, 0
    for text in texts:
        ids = torch.tensor([[256, *text.encode("utf-8")]])
        with torch.no_grad():
            logits = model(ids, num_steps=3, init_scale=0.0).logits
        total += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
        tokens += ids.shape[1] - 1
        nbytes += len(text.encode("utf-8"))
    # Windows of 17 tokens see less context than one long forward; compare with the same windows.
    windowed = 0.0
    for text in texts:
        for w in windows([256, *text.encode("utf-8")], 17):
            ids = torch.tensor([w])
            with torch.no_grad():
                logits = model(ids, num_steps=3, init_scale=0.0).logits
            windowed += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
    assert result.tokens == tokens and result.bytes == nbytes and result.documents == 2
    assert math.isclose(result.nll[3], windowed, rel_tol=1e-5)
    assert math.isclose(result.bits_per_byte(3), windowed / math.log(2) / nbytes, rel_tol=1e-5)
    assert math.isclose(result.loss(3), windowed / tokens, rel_tol=1e-5)
    capped = text_quality(model, texts, ByteCodec(), [1], 256, 0, max_tokens=20, init_scale=0.0)
    assert capped.tokens == 20 and capped.bytes == 20


def test_a_token_cap_inside_a_multibyte_character_counts_the_scored_bytes(model):
    # The cap kept "h" and the first byte of "é", whose decode "h\ufffd" was counted as 4 bytes, not 2.
    for cap, tokens in [(2, 1), (3, 3), (4, 3), (5, 3), (6, 6), (7, 7)]:
        result = text_quality(model, ["hé€llo"], ByteCodec(), [1], 256, 0, max_tokens=cap, init_scale=0.0)
        assert result.tokens == tokens and result.bytes == tokens, (cap, result)
        assert result.tokens <= cap


def test_a_token_cap_that_cuts_a_character_stops_reading_the_texts(model):
    # The tokens dropped with the cut "€" left the cap unreached: every later text (each cut to nothing) was
    # read and tokenized, to the end of the corpus.
    read = []

    def texts():
        yield "ab€"
        for i in range(1000):
            read.append(i)
            yield "€€"

    result = text_quality(model, texts(), ByteCodec(), [1], 256, 0, max_tokens=4, init_scale=0.0)
    assert (result.documents, result.tokens, result.bytes) == (1, 2, 2)
    assert len(read) <= 1


def test_encoding_a_whole_document_does_not_warn_that_it_is_longer_than_the_model(tmp_path):
    # `rdepth eval --data stdlib` printed transformers' "Token indices sequence length is longer than the
    # specified maximum ..." for documents that `windows` cuts to the model's length anyway
    import logging

    from transformers import AutoTokenizer

    from recurrent_depth.data.tokenizer import LONG_TEXT_WARNING, save_tokenizer, train_tokenizer, windowed_encoding
    from recurrent_depth.evaluation.quality import PlainTokenizer

    save_tokenizer(train_tokenizer(["abc def ghi"], vocab_size=290), tmp_path, model_max_length=4)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers.tokenization_utils_base")  # (transformers' loggers do not propagate)
    logger.addHandler(handler)
    try:
        assert len(PlainTokenizer(AutoTokenizer.from_pretrained(tmp_path)).encode("abc def ghi " * 4)) > 4
        with windowed_encoding():
            logger.warning("another warning")  # only the long-text warning is dropped
        AutoTokenizer.from_pretrained(tmp_path).encode("abc def ghi " * 4)  # a plain encode still warns
    finally:
        logger.removeHandler(handler)
    assert [m.startswith(LONG_TEXT_WARNING) for m in seen] == [False, True]


def test_text_quality_with_a_random_s0_does_not_depend_on_the_batch_size(model):
    # One generator drew the s_0 of a whole batch: the windows' draws, and so the scores, moved with batch_size.
    texts = ["def f(x):\n    return x + 1\n" * 3, "héllo wörld", "abc" * 10]
    nll = [text_quality(model, texts, ByteCodec(), [1, 3], 256, 0, seq_len=17, batch_size=size, init_scale=1.0,
                        seed=4).nll for size in (1, 3, 8)]
    for depth in (1, 3):
        assert all(math.isclose(n[depth], nll[0][depth], rel_tol=1e-6) for n in nll), nll
    other = text_quality(model, texts, ByteCodec(), [1], 256, 0, seq_len=17, init_scale=1.0, seed=5).nll
    assert not math.isclose(other[1], nll[0][1], rel_tol=1e-6)  # the seed still draws them


@pytest.fixture(scope="module")
def requests():
    return [([1, 2, 3, 4, 5], [6, 7, 8]), ([9], [10, 11]), ([3, 3, 3], [4]), ([7, 7], [1, 2, 3, 4])]


def test_stepwise_scoring_matches_the_batched_forward(model, requests):
    plain = batched_logprobs(model, requests, 3, 0, init_scale=0.0)
    for kwargs in ({}, {"exit_criterion": "kl", "exit_threshold": 0.0}, {"kv_budget": 3}):
        stepped = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0, **kwargs)
        for a, b in zip(plain, stepped):
            assert math.isclose(a.logprob, b.logprob, rel_tol=1e-5, abs_tol=1e-5), kwargs
            assert a.is_greedy == b.is_greedy and b.steps == [3] * len(b.steps)


def test_fixed_depth_scoring_with_a_generator_per_request_is_a_seeded_teacher_forced_generate(model, requests):
    # A random s_0 came from one stream for the batch, so a row's score depended on the rows beside it; with
    # one generator per request each row draws as generate draws it alone.
    from recurrent_depth.inference import generate

    scored = batched_logprobs(model, requests, 3, 0, init_scale=1.0,
                              generator=[torch.Generator().manual_seed(7 + b) for b in range(len(requests))])
    for b, ((context, continuation), batched) in enumerate(zip(requests, scored)):
        out = generate(model, [context], max_new_tokens=len(continuation), num_steps=3, init_scale=1.0, seed=7 + b,
                       teacher_tokens=[continuation], output_logits=True)
        logprob = sum(float(F.log_softmax(out.logits[0, j].float(), -1)[t]) for j, t in enumerate(continuation))
        assert math.isclose(batched.logprob, logprob, rel_tol=1e-5, abs_tol=1e-5)
    with pytest.raises(ValueError, match="one per request \\(4\\), got 1"):
        batched_logprobs(model, requests, 3, 0, generator=[torch.Generator()])


def test_adaptive_scoring_is_per_row_and_records_steps(model, requests):
    together = stepwise_logprobs(model, requests, 6, 0, exit_criterion="kl", exit_threshold=1e-2, init_scale=0.0)
    assert any(s < 6 for r in together for s in r.steps)
    for request, batched in zip(requests, together):
        alone = stepwise_logprobs(model, [request], 6, 0, exit_criterion="kl", exit_threshold=1e-2,
                                  init_scale=0.0)[0]
        assert alone.steps == batched.steps
        assert math.isclose(alone.logprob, batched.logprob, rel_tol=1e-5, abs_tol=1e-5)
    shared = stepwise_logprobs(model, requests, 4, 0, kv_budget=1, init_scale=0.0)
    warm = stepwise_logprobs(model, requests, 4, 0, warm_start=True, init_scale=0.0)
    full = batched_logprobs(model, requests, 4, 0, init_scale=0.0)
    assert any(not math.isclose(a.logprob, b.logprob, rel_tol=1e-6) for a, b in zip(shared, full))
    assert any(not math.isclose(a.logprob, b.logprob, rel_tol=1e-6) for a, b in zip(warm, full))


@pytest.mark.parametrize("kwargs", [
    dict(exit_criterion="kl", exit_threshold=0.1, min_steps_rule="skip", min_steps=0),  # defaults="official"'s
    dict(exit_criterion="kl", exit_threshold=0.1, min_steps_rule="skip", min_steps=2),
    dict(exit_criterion="kl", exit_threshold=0.1, check_every=2),
    dict(exit_criterion="kl", exit_threshold=1e-2, warm_start=True, warm_start_source="normed"),
])
def test_stepwise_scoring_follows_the_exit_schedule_of_generate(model, kwargs):
    # lm-eval's scorer ran min_steps_rule="exit" with check_every=1 and a raw warm start whatever the
    # model_args said (and refused the official profile's min_steps=0): scoring and generate_until disagreed.
    from recurrent_depth.inference import generate

    context, continuation = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    scored = stepwise_logprobs(model, [(context, continuation)], 6, 0, init_scale=0.0, **kwargs)[0]
    out = generate(model, [context[:-1]], max_new_tokens=len(continuation) + 1, num_steps=6, init_scale=0.0,
                   teacher_tokens=[context[-1:] + continuation], output_logits=True, **kwargs)
    assert scored.steps == out.steps[0, 1:].tolist()
    logprob = sum(float(F.log_softmax(out.logits[0, j + 1].float(), -1)[t]) for j, t in enumerate(continuation))
    assert math.isclose(scored.logprob, logprob, rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("kwargs", [
    dict(exit_criterion="kl", exit_threshold=0.1, min_steps_rule="skip", min_steps=0, kv_policy="full",
         exit_in_prefill=True),
    dict(exit_criterion="latent-diff", exit_threshold=0.5, exit_in_prefill=True),
    dict(exit_criterion="entropy-diff", exit_threshold=1e-2, warm_start=True, check_every=2, exit_in_prefill=True),
    dict(exit_criterion="kl", exit_threshold=0.05, kv_policy="per-step+randomized", exit_in_prefill=True),
    dict(exit_criterion="kl", exit_threshold=0.05, exit_kv="compute", kv_policy="shared-2"),
], ids=["official", "latent", "warm", "randomized-lookup", "compute-shared"])
def test_stepwise_scoring_of_a_whole_prefill_is_a_teacher_forced_generate(model, requests, kwargs):
    # exit_in_prefill (the official profile's default with a criterion) stops a prompt's positions together
    # at the criterion's step; the scorer ran the context at full depth, so it scored what generate never reads.
    # exit_kv="compute" runs the prompt under run_computing in generate, which the scorer did for the last
    # context token alone (under a shared KV slot it then read its context's final steps, not its own step's).
    # With one generator per request, each row's random s_0 (and randomized lookup) is what generate draws
    # for it alone.
    from recurrent_depth.inference import generate

    generators = [torch.Generator().manual_seed(100 + b) for b in range(len(requests))]
    scored = stepwise_logprobs(model, requests, 6, 0, init_scale=1.0, generator=generators, **kwargs)
    for b, ((context, continuation), batched) in enumerate(zip(requests, scored)):
        out = generate(model, [context], max_new_tokens=len(continuation), num_steps=6, init_scale=1.0, seed=100 + b,
                       teacher_tokens=[continuation], output_logits=True, **kwargs)
        assert batched.steps == out.steps[0].tolist()
        logprob = sum(float(F.log_softmax(out.logits[0, j].float(), -1)[t]) for j, t in enumerate(continuation))
        assert math.isclose(batched.logprob, logprob, rel_tol=1e-4, abs_tol=1e-4)
    with pytest.raises(ValueError, match="exit_in_prefill=True needs an exit_criterion"):
        stepwise_logprobs(model, requests, 3, 0, exit_in_prefill=True)


def test_quantized_scoring_of_a_one_token_context_beside_longer_ones_is_its_score_alone(model, requests):
    # A quantized cache calibrates outlier channels on each row's first write, the prefill of the context but
    # its last token: a one-token context had none in a batch, so its score moved with the rows beside it.
    together = stepwise_logprobs(model, requests, 3, 0, init_scale=0.0, kv_quant="k=prod:3.5,v=mse:3.5")
    for request, batched in zip(requests, together):
        alone = stepwise_logprobs(model, [request], 3, 0, init_scale=0.0, kv_quant="k=prod:3.5,v=mse:3.5")[0]
        assert math.isclose(alone.logprob, batched.logprob, rel_tol=1e-5, abs_tol=1e-5), request


def test_stepwise_scoring_of_rows_that_fit_alone_but_not_aligned():
    # Rows are aligned at the longest context's column, so a long context beside a long continuation
    # (each row 60 of 64 tokens) needed 76 columns and the batch was refused, though each row fits alone.
    torch.manual_seed(0)
    small = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=288, max_seq_len=64)).eval()
    rows = [(list(range(1, 41)), list(range(50, 70))), (list(range(1, 58)), [5, 6, 7])]
    for kwargs in ({"exit_criterion": "kl"}, {"kv_budget": 2}):
        together = stepwise_logprobs(small, rows, 3, 0, init_scale=0.0, **kwargs)
        for row, batched in zip(rows, together):
            alone = stepwise_logprobs(small, [row], 3, 0, init_scale=0.0, **kwargs)[0]
            assert alone.steps == batched.steps and alone.logprob == batched.logprob, kwargs
    with pytest.raises(ValueError, match="context \\+ continuation of 65 tokens exceeds max_seq_len=64"):
        stepwise_logprobs(small, [(list(range(1, 60)), list(range(1, 8)))], 3, 0, exit_criterion="kl")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"exit_criterion": "bogus"}, "bogus"), ({"kv_budget": 0}, "kv_budget=0"), ({"min_steps": 0}, "min_steps=0"),
     ({"exit_threshold": 0.1}, "without an exit_criterion")],
    ids=["criterion", "budget", "min-steps", "threshold-alone"],
)
def test_scoring_rejects_bad_arguments(model, requests, kwargs, message):
    with pytest.raises(ValueError, match=message):
        stepwise_logprobs(model, requests, 3, 0, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_policy": "per-step+skip", "exit_criterion": "kl"}, "kv_policy='per-step\\+skip' hides or picks"),
    ({"kv_quant": "k=prod:3.5,v=mse:3.5"}, "kv_quant='k=prod:3.5,v=mse:3.5' quantizes softmax-attention keys"),
], ids=["lookup", "kv-quant"])
def test_scoring_refuses_what_generate_refuses_for_the_model(requests, kwargs, message):
    # The scorer ran a hiding lookup or a KV quantization on a model without softmax attention, which ignored
    # them (or quantized another cache), while generate refuses both for such a model.
    torch.manual_seed(0)
    gla = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=288, max_seq_len=64, mixer="gla")).eval()
    with pytest.raises(ValueError, match=message):
        stepwise_logprobs(gla, requests, 3, 0, init_scale=0.0, **kwargs)


def test_accuracy_grid_is_seeded_and_summarised(model):
    task = VariableChains()
    grid = accuracy_grid(model, task, [0, 1], [1, 2], count=6, seed=3)
    again = accuracy_grid(model, task, [0, 1], [1, 2], count=6, seed=3)
    assert grid.accuracy == again.accuracy
    assert all(0 <= a <= 1 for row in grid.accuracy.values() for a in row.values())
    synthetic = AccuracyGrid("chains", "hops", [1, 2, 3], [1, 2, 4], 10,
                             {1: {1: 0.9, 2: 1.0, 4: 1.0}, 2: {1: 0.2, 2: 0.95, 4: 0.96}, 3: {1: 0.1, 2: 0.3, 4: 0.6}},
                             chance=0.25, trained_difficulties=[1, 2])
    assert synthetic.best(2) == (4, 0.96) and synthetic.saturation_depth(2) == 2
    assert synthetic.solved_up_to(0.9) == 2 and synthetic.solved_up_to(0.5) == 3
    assert "* harder than any training problem" in synthetic.table()


def test_curriculum_promotes_when_the_hardest_level_is_mastered():
    curriculum = Curriculum(0, 3, enabled=True, promote_at=0.8, window=10)
    assert curriculum.current == 1
    assert not curriculum.observe([1] * 4, [True] * 4)  # too few observations yet
    assert curriculum.observe([1] * 2 + [0] * 3, [True] * 5)
    assert curriculum.current == 2
    assert not curriculum.observe([2] * 10, [False] * 10)
    assert Curriculum(0, 3, enabled=False, promote_at=0.8).current == 3


def test_reasoning_training_runs_and_writes_metrics(tmp_path):
    config = ReasoningRunConfig(hidden_size=32, num_heads=2, intermediate_size=64, mean_recurrence=2,
                                backprop_depth=1, batch_size=4, max_steps=3, log_every=1, out=str(tmp_path),
                                train_difficulties=(0, 2))
    model, stats = train_reasoning(config, log=lambda _: None)
    assert stats["steps"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    with pytest.raises(ValueError, match="train_difficulties"):
        ReasoningRunConfig(train_difficulties=(5, 2)).validate()


def test_run_reasoning_writes_model_grid_plot_and_extrapolation(tmp_path):
    config = task_preset("shells", hidden_size=32, num_heads=2, intermediate_size=64, mean_recurrence=2,
                         backprop_depth=1, batch_size=4, max_steps=4, log_every=2, eval_count=4,
                         test_difficulties=[1, 2, 6], depths=[1, 2], train_difficulties=(1, 5), out=str(tmp_path))
    summary = run_reasoning(config, log=lambda _: None)
    # Four steps cannot master one swap: the curriculum stays at 2, so "beyond training" starts at 3.
    assert summary["train"]["curriculum_reached"] == 2
    assert summary["extrapolation"]["trained_up_to"] == 2
    grid = json.loads((tmp_path / "accuracy.json").read_text())
    assert grid["trained_difficulties"] == [1, 2] and grid["chance"] == 0.2
    assert set(grid["accuracy"]) == {"1", "2", "6"} and set(grid["accuracy"]["6"]) == {"1", "2"}
    assert all(0 <= a <= 1 for row in grid["accuracy"].values() for a in row.values())
    assert json.loads((tmp_path / "summary.json").read_text())["depth_gain"].keys() == {"1", "2", "6"}
    assert (tmp_path / "accuracy_vs_depth.png").read_bytes()[:4] == b"\x89PNG"
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "model")
    assert model.config.hidden_size == 32


def test_rdepth_eval_writes_results_and_figures(tmp_path):
    make_model_dir(tmp_path / "model", max_seq_len=128)
    make_model_dir(tmp_path / "base", seed=1, mean_recurrence=1, max_seq_len=128)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def f(x):\n    return x * 2\n" * 8)
    (data / "b.py").write_text("class A:\n    pass\n" * 8)
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "1,2,4", "--data", str(data),
            "--val-fraction", "0.5", "--max-docs", "2", "--reasoning", "chains", "--difficulties", "0,1",
            "--count", "4", "--baseline", str(tmp_path / "base"), "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["text"]["by_depth"]) == ["1", "2", "4"]
    assert results["baseline"]["depth"] == 1 and "text" in results["baseline"]
    assert results["reasoning"]["chains"]["difficulties"] == [0, 1]
    for name in ("bits_per_byte_vs_depth.png", "chains_accuracy_vs_depth.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.parametrize(
    "argv, message",
    [(["--depths", "1,-2"], "--depths=-2 is invalid: expected an integer in [0, 1024]"),
     (["--data", "none"], "nothing to evaluate"),
     (["--max-docs", "0"], "max_docs=0"), (["--val-fraction", "1.5"], "expected a number in (0, 1]"),
     (["--lm-eval-tasks", "rd_chains_mc", "--limit", "0"], "limit=0 is invalid"),  # was lm-eval's "did not find
     (["--lm-eval-tasks", "rd_chains_mc", "--limit", "-3"], "limit=-3 is invalid"),  # any docs!" / islice's
     # a misspelt task was named only after the text scoring, whose results were then lost
     (["--data", "/nonexistent", "--reasoning", "chainz"], "unknown reasoning task(s) ['chainz']"),
     (["--data", "none", "--reasoning", "none"], "nothing to evaluate")],  # 'none', as --help's default says
    ids=["negative-depth", "nothing", "max-docs", "val-fraction", "limit-0", "limit-negative", "unknown-task",
         "reasoning-none"],
)
def test_rdepth_eval_bad_arguments(tmp_path, capsys, argv, message):
    make_model_dir(tmp_path / "model", with_tokenizer=False)
    assert main(["eval", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_rdepth_eval_on_one_document_says_the_split_held_none_out_and_val_fraction_1_scores_it(tmp_path, capsys):
    make_model_dir(tmp_path / "model", max_seq_len=128)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def f(x):\n    return x * 2\n" * 4)
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "1,2", "--data", str(data),
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"no held-out text: --data {str(data)!r} holds 1 document(s) and --val-fraction 0.02 held out none of them; "
        "give more documents, or --val-fraction 1 to score them all")
    assert main([*argv, "--val-fraction", "1"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["text"]["documents"] == 1 and sorted(results["text"]["by_depth"]) == ["1", "2"]


def test_rdepth_eval_reads_the_text_field_training_read(tmp_path, capsys):
    """`rdepth eval --data FILE.jsonl` read only the field 'text': held-out documents of a corpus trained with
    --text-field body could not be scored (every record was refused as missing 'text')."""
    make_model_dir(tmp_path / "model", max_seq_len=128)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(3)))
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--data", str(data), "--val-fraction", "1",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2 and "missing field 'text'" in capsys.readouterr().err
    assert main([*argv, "--text-field", "body"]) == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["text"]["documents"] == 3


@pytest.mark.parametrize("case,message", [("no-tokenizer", "has no tokenizer.json: text measurements need"),
                                          ("no-data", "data: '/nonexistent' does not exist")],
                         ids=["no-tokenizer", "no-data"])
def test_rdepth_eval_names_what_the_text_lacks_before_it_starts_the_text(tmp_path, capsys, case, message):
    # "text: scoring ... held-out documents ..." was printed first, and then the problem named
    make_model_dir(tmp_path / "model", with_tokenizer=case != "no-tokenizer")
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--out", str(tmp_path / "o")]
    assert main([*argv, *(["--data", "/nonexistent"] if case == "no-data" else [])]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_rdepth_eval_baseline_problems_are_named_before_any_scoring(tmp_path, capsys):
    # A baseline without tokenizer.json was reported as the *model's* missing tokenizer, after the model's
    # text had been scored; a negative --baseline-depth also surfaced only then, as "depths contains -1".
    make_model_dir(tmp_path / "model", max_seq_len=128)
    make_model_dir(tmp_path / "base", with_tokenizer=False)
    base = ["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--out", str(tmp_path / "out")]
    assert main([*base, "--baseline", str(tmp_path / "base"), "--data", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert f"--baseline {tmp_path / 'base'} has no tokenizer.json" in err and "does not exist" not in err
    assert main([*base, "--baseline", str(tmp_path / "model"), "--baseline-depth", "-1",
                 "--data", "/nonexistent"]) == 2
    assert "--baseline-depth=-1 is invalid" in capsys.readouterr().err
    (tmp_path / "file").write_text("keep")
    assert main([*base[:-1], str(tmp_path / "file")]) == 2
    assert f"--out {tmp_path / 'file'} is an existing file, not a directory" in capsys.readouterr().err


def test_rdepth_eval_takes_a_tokenizer_json_file_as_its_help_says(tmp_path):
    # "--tokenizer DIR: tokenizer directory (or tokenizer.json)", but a file was refused with
    # "no tokenizer.json in that directory".
    make_model_dir(tmp_path / "model", with_tokenizer=False, max_seq_len=128)
    make_model_dir(tmp_path / "tok")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 4}) + "\n")
    argv = ["eval", "--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "tok" / "tokenizer.json"),
            "--depths", "1", "--data", str(data), "--val-fraction", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["text"]["tokens"] > 0


def test_rdepth_eval_scores_text_of_a_model_whose_tokenizer_frames_documents_with_endoftext(tmp_path):
    """A retrofitted Qwen has no bos token; training frames its documents with <|endoftext|>, but `rdepth eval`
    refused to score text ("the tokenizer has no bos token")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)} | {"[UNK]": len(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    config = rd.ModelConfig.from_preset("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=64, bos_token_id=None,
                                        eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    rd.RecurrentDepthLM(config).save_pretrained(tmp_path / "model", tokenizer=tok)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 2}) + "\n")
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--data", str(data), "--val-fraction", "1",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["text"]["tokens"] > 0


def test_rdepth_eval_of_a_diverging_model_writes_strict_json(tmp_path):
    """NaN losses were written as `NaN`, which strict JSON readers (jq, JSON.parse) refuse."""
    make_model_dir(tmp_path / "model", max_seq_len=128)
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        # finite weights (NaN ones are refused at load) whose first core step overflows to NaN
        model.transformer.core_block[0].mlp.fc.weight.fill_(1e30)
    model.save_pretrained(tmp_path / "model", tokenizer=tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 4}) + "\n")
    argv = ["eval", "--model", str(tmp_path / "model"), "--depths", "0,1", "--data", str(data),
            "--val-fraction", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    text = (tmp_path / "out" / "results.json").read_text()
    results = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    by_depth = results["text"]["by_depth"]
    assert by_depth["1"]["bits_per_byte"] is None and by_depth["0"]["bits_per_byte"] is not None


def test_accuracy_grid_gives_each_problem_its_own_s0_whatever_the_batch(model, monkeypatch):
    # A problem's logits (its s_0) are what it gets alone: not the batch size, the padding or the neighbours.
    import recurrent_depth.evaluation.reasoning.evaluate as evaluate

    seen: list[torch.Tensor] = []

    def recording(model, input_ids, depths, **kwargs):
        for depth, logits in logits_at_depths(model, input_ids, depths, **kwargs):
            seen.extend(logits)
            yield depth, logits

    monkeypatch.setattr(evaluate, "logits_at_depths", recording)
    task = VariableChains()
    per_item = []
    for batch_size in (1, 3):
        seen.clear()
        grid = accuracy_grid(model, task, [1, 2], [2], count=4, seed=5, batch_size=batch_size)
        per_item.append((grid.accuracy, list(seen)))
    (alone_acc, alone), (batched_acc, batched) = per_item
    assert alone_acc == batched_acc and len(alone) == len(batched) == 8
    for a, b in zip(alone, batched):
        assert len(a) <= len(b)  # alone, a row has its own columns; in a batch it is padded on the right
        assert torch.allclose(a, b[: len(a)], atol=1e-5)


def test_eval_reasoning_takes_the_batch_size(model, monkeypatch):
    # --batch-size (sequences per forward) bounds the reasoning problems per forward too
    import recurrent_depth.evaluation.reasoning.evaluate as evaluate
    from recurrent_depth.evaluation.depth_eval import EvalConfig, _reasoning

    sizes: list[int] = []
    real = evaluate.answer_correct_at_depths

    def recording(model, batch, *args, **kwargs):
        sizes.append(batch["input_ids"].shape[0])
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(evaluate, "answer_correct_at_depths", recording)
    config = EvalConfig(model="unused", data=None, reasoning_tasks=["chains"], difficulties=[0], count=5,
                        batch_size=2).validate()
    grid = _reasoning(model, config, "chains", [1])
    assert sizes == [2, 2, 1] and grid["count"] == 5


@pytest.mark.parametrize("args", [{}, {"exit_criterion": "kl", "exit_threshold": 1e-2}], ids=["fixed", "adaptive"])
def test_a_one_token_context_under_warm_start_scores_as_it_does_alone(model, args):
    # In a batch with longer contexts its first token warm-started from a padding column's state
    requests = [([1, 2, 3, 4, 5], [6, 7]), ([9], [10, 11])]

    def streams(rows):
        return [torch.Generator().manual_seed(40 + b) for b in rows]

    together = stepwise_logprobs(model, requests, 3, 0, warm_start=True, generator=streams([0, 1]), **args)
    for b, request in enumerate(requests):
        alone = stepwise_logprobs(model, [request], 3, 0, warm_start=True, generator=streams([b]), **args)[0]
        assert math.isclose(together[b].logprob, alone.logprob, rel_tol=1e-5, abs_tol=1e-5), b
        assert together[b].steps == alone.steps
