"""lm-eval as its users drive it (session 34 hunt): `--batch_size`, `max_length` and `--gen_kwargs` values are
refused in one line before any request runs (before lm-eval starts, through `rdepth lm-eval`), and the scores
are the model's own log-probabilities under lm-eval's encoding."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

import recurrent_depth.integrations  # noqa: F401  (what `import recurrent_depth` installs)
from recurrent_depth.cli import main
from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lmeval-s34")
    make_model_dir(path, max_seq_len=MAX_LEN)
    return path


@pytest.fixture(scope="module")
def lm(model_dir):
    return RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=3, init_scale=0.0, device="cpu", batch_size=2)


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, None, a, i) for i, a in enumerate(args)]


@pytest.mark.parametrize("batch_size", [0, -2, "-2", "abc", 1.5])
def test_a_bad_batch_size_is_one_line(model_dir, batch_size):
    """batch_size=0 failed at the first request with "range() arg 3 must not be zero", a negative one scored nothing
    and ended in an AttributeError traceback ('NoneType' object has no attribute 'logprob')."""
    with pytest.raises(ValueError, match=rf"^batch_size={batch_size!r} is invalid: expected an integer >= 1, "
                                         r"or 'auto'$"):
        RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", batch_size=batch_size)


@pytest.mark.parametrize("max_length, shown", [("abc", "'abc'"), (-1.0, "-1"), (0, "0"), (MAX_LEN + 1, None)])
def test_a_bad_max_length_is_one_line(model_dir, max_length, shown):
    """max_length=abc was a TypeError traceback at the first request; -1 a confusing max_gen_toks error; one past the
    model's max_seq_len failed every request in the forward, after the tasks were built."""
    message = (rf"^max_length={shown} is invalid: expected an integer >= 1$" if shown else
               rf"^max_length={MAX_LEN + 1} is invalid: expected at most the model's max_seq_len={MAX_LEN}$")
    with pytest.raises(ValueError, match=message):
        RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", max_length=max_length)


@pytest.mark.parametrize(
    "gen_kwargs, message",
    [({"num_steps": -2}, r"^num_steps=-2 is invalid: expected an integer >= 0$"),
     ({"top_k": -1, "temperature": 1.0}, r"^top_k=-1 is invalid: expected None or an integer >= 1$"),
     ({"temperature": "abc"}, r"^temperature='abc' is invalid: expected None or a number$"),
     ({"max_gen_toks": "abc"}, r"^max_gen_toks='abc' is invalid: expected 0 <= max_gen_toks < max_length=32 ")],
    ids=["depth", "top-k", "temperature-type", "max-gen-toks-type"],
)
def test_bad_gen_kwargs_values_are_refused_before_any_generation(lm, gen_kwargs, message):
    """A bad value failed at its batch (after the requests before it ran), or as lm-eval's bare "could not convert
    string to float: 'abc'" / "invalid literal for int()"."""
    before = lm.steps_summary().get("generate_until", {}).get("tokens", 0)
    good = ("a", {"until": [], "max_gen_toks": 2})
    with pytest.raises(ValueError, match=message):
        lm.generate_until(instances("generate_until", [good, ("b", {"until": [], **gen_kwargs})]), disable_tqdm=True)
    assert lm.steps_summary().get("generate_until", {}).get("tokens", 0) == before  # nothing generated


def test_rdepth_lm_eval_refuses_bad_run_args_before_lm_eval_starts(model_dir, capsys, monkeypatch):
    """`--batch_size 0`, `--gen_kwargs num_steps=-2` and `max_length` past the model passed the pre-flight: lm-eval
    indexed its tasks, loaded the model and ran every loglikelihood request first."""
    import lm_eval.__main__

    reached: list[int] = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: reached.append(1))
    run = ["lm-eval", "run", "--model", "recurrent-depth", "--tasks", "rd_chains_mc",
           "--model_args", f"pretrained={model_dir}"]
    cases = [(["--batch_size", "0"], "batch_size='0' is invalid: expected an integer >= 1, or 'auto'"),
             (["--gen_kwargs", "num_steps=-2"], "num_steps=-2 is invalid: expected an integer >= 0"),
             (["--gen_kwargs", "temperature=abc"], "temperature='abc' is invalid: expected None or a number"),
             (["--gen_kwargs", "stop=x"], "generation arguments ['stop'] are not supported by the recurrent-depth "
                                          "backend; it takes ["),
             (["--model_args", f"pretrained={model_dir},max_length=99"],
              f"max_length=99 is invalid: expected at most the model's max_seq_len={MAX_LEN}")]
    for extra, message in cases:
        assert main([*run, *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"rdepth lm-eval: error: {message}")
    assert main([*run, "--batch_size", "auto:4", "--gen_kwargs", "num_steps=2,temperature=0"]) == 0
    assert reached == [1]


def test_scores_are_the_models_log_probabilities_under_lm_evals_encoding(lm):
    """The oracle of the hunt: each loglikelihood is the sum of the log-softmax of the model's own logits over
    the continuation tokens of lm-eval's split (trailing whitespace of the context moved to the continuation, the
    tokenizer's BOS on the context, the prefix token for an empty one, left truncation), greedy when every token
    is the argmax; a rolling loglikelihood is the document's NLL in max_length windows."""
    pairs = [("a=1;b=a;?b=", "1"), ("x=4;?y", " 4"), ("a ", "b"), ("", "a=1"), ("a=1;b=a;?b=1\n" * 4, " def f(x):")]
    docs = ["def f(x):\n    return x\n" * 4, " a"]
    scored = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    rolling = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)

    def logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(lm._core(torch.tensor([tokens]), num_steps=3, init_scale=0.0).logits[0], -1)

    for (context, continuation), (score, greedy) in zip(pairs, scored):
        moved = len(context) - len(context.rstrip())
        context, continuation = context[: len(context) - moved], context[len(context) - moved :] + continuation
        ctx = lm.tok_encode(context) if context else [lm.prefix_token_id]
        cont = lm.tok_encode(context + continuation)[len(ctx):] if context else \
            lm.tok_encode(continuation, add_special_tokens=False)
        fed = (ctx + cont)[-(MAX_LEN + 1) :][:-1]
        logp = logprobs(fed)[-len(cont) :]
        target = torch.tensor(cont)
        assert score == pytest.approx(float(logp.gather(-1, target[:, None]).sum()), abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == target).all())
    for doc, score in zip(docs, rolling):
        tokens = [lm.prefix_token_id, *lm.tok_encode(doc)]
        expected = 0.0
        for start in range(0, len(tokens) - 1, MAX_LEN):  # predict tokens[start+1 .. end] from <= MAX_LEN before
            end = min(start + MAX_LEN, len(tokens) - 1)
            first = max(0, end - MAX_LEN)
            logp = logprobs(tokens[first:end])
            expected += sum(float(logp[j - first, tokens[j + 1]]) for j in range(start, end))
        assert score == pytest.approx(expected, abs=1e-3)
    assert len(lm.tok_encode(docs[0])) > MAX_LEN  # (several windows)


def test_a_missing_tokenizer_directory_is_named(model_dir, tmp_path):
    """tokenizer=/missing was transformers' "Repo id must use alphanumeric chars ..." (as a hub id), after the
    model loaded."""
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=rf"^tokenizer={missing}: no such directory \(expected a tokenizer "
                                                r"directory\)$"):
        RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", tokenizer=str(missing))
    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", tokenizer=str(model_dir))  # a real one loads
    assert lm.tokenizer.bos_token_id is not None
