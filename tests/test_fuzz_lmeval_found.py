"""What a seeded differential fuzz of the lm-eval backend found (requests as lm-eval builds them, every score
against one plain forward per request, every generation against `recurrent_depth.generate`), minimised."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

import recurrent_depth.integrations  # noqa: F401  (what `import recurrent_depth` installs)
from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval-fuzz")
    make_model_dir(path, max_seq_len=MAX_LEN)
    return path


def backend(path, batch_size: int = 2, **kwargs) -> RecurrentDepthEvalLM:
    return RecurrentDepthEvalLM(pretrained=str(path), num_steps=3, device="cpu", batch_size=batch_size, **kwargs)


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, None, a, i) for i, a in enumerate(args)]


@torch.no_grad()
def plain_score(core, context: list[int], continuation: list[int], depth: int) -> tuple[float, bool]:
    """One forward of lm-eval's causal input (context + continuation, left-truncated to max_length + 1, the
    last token dropped): the continuation's summed log-probability and whether each token is the argmax."""
    ids = (context + continuation)[-(MAX_LEN + 1) :][:-1]
    logp = F.log_softmax(core(torch.tensor([ids]), num_steps=depth, init_scale=0.0).logits[0, -len(continuation) :], -1)
    target = torch.tensor(continuation)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("args", [{}, {"exit_criterion": "kl", "exit_threshold": 0.0}], ids=["batched", "stepwise"])
def test_scores_are_one_plain_forward_per_request(model_dir, args):
    """The fuzz's oracle, kept as a guard: mixed lengths, duplicates, contexts past max_length (left-truncated)
    and a continuation of max_length tokens, in batches; threshold 0 never exits, so the stepwise scorer is the
    plain forward too."""
    rng = random.Random(0)
    requests = [([256] + [rng.randrange(256) for _ in range(n - 1)], [rng.randrange(256) for _ in range(m)])
                for n, m in ((1, 1), (40, 3), (5, 32), (2, 7), (31, 2), (60, 20))]
    requests += requests[1:3]
    lm = backend(model_dir, batch_size=3, init_scale=0.0, **args)
    got = lm._loglikelihood_tokens([(None, c, x) for c, x in requests], disable_tqdm=True)
    for (context, continuation), (score, greedy) in zip(requests, got):
        expected, expected_greedy = plain_score(lm._core, context, continuation, 3)
        assert score == pytest.approx(expected, rel=1e-4, abs=1e-4) and greedy == expected_greedy


@pytest.mark.parametrize("args", [{}, {"exit_criterion": "kl", "exit_threshold": 1e-2}], ids=["batched", "stepwise"])
def test_an_empty_continuation_is_certain(model_dir, args):
    """A continuation that encodes to no tokens (a choice "") ended the whole run: the scorers refused it ("each
    request needs a non-empty continuation"), and after an empty context lm-eval's encoding failed on it with an
    IndexError. Its probability is 1: log 0, greedy; the requests beside it score as they would alone."""
    lm = backend(model_dir, **args)
    pairs = [("a=1;", ""), ("", ""), ("def f(x):", "\n    return x"), ("", "a=1")]
    got = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    assert got[:2] == [(0.0, True), (0.0, True)]
    assert got[2:] == lm.loglikelihood(instances("loglikelihood", pairs[2:]), disable_tqdm=True)
    assert lm._loglikelihood_tokens([(None, [256, 65], [])]) == [(0.0, True)]
    assert lm.steps_summary()["loglikelihood"]["tokens"] == 2 * (len(lm.tok_encode("\n    return x")) - 1 + 3)


def test_an_empty_stop_string_stops_nothing(model_dir):
    """until=[""] (lm-eval's post-processing skips an empty stop) failed every request: generate refuses an
    empty stop string."""
    lm = backend(model_dir, init_scale=0.0)
    prompts = ["a=1;", "def f(x):\n"]
    plain = lm.generate_until(instances("generate_until", [(p, {"until": [], "max_gen_toks": 5}) for p in prompts]),
                              disable_tqdm=True)
    for until in ([""], ["", "\n"]):
        texts = lm.generate_until(instances("generate_until", [(p, {"until": until, "max_gen_toks": 5})
                                                                for p in prompts]), disable_tqdm=True)
        assert texts == [t.split(until[-1])[0] if until[-1] else t for t in plain]


def test_do_sample_without_a_temperature_samples_at_the_default(model_dir):
    """gen_kwargs do_sample=True with no temperature (lm-eval's hf backend samples at the model's) was refused:
    the backend passed temperature=0.0 on, which sampling refuses."""
    texts = [backend(model_dir, seed=3).generate_until(
        instances("generate_until", [("a=1;", {"until": [], "max_gen_toks": 6, **kwargs})]), disable_tqdm=True)
        for kwargs in ({"do_sample": True}, {"do_sample": True, "temperature": 1.0}, {})]
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize(
    "gen_kwargs, message",
    [({"until": [], "stop": ["x"]}, r"generation arguments \['stop'\] are not supported"),
     ({"until": None}, r"^until=None is invalid: expected a string or a list of strings$"),
     ({"until": [], "max_gen_toks": MAX_LEN}, rf"^max_gen_toks={MAX_LEN} is invalid: expected 0 <= max_gen_toks < "
                                              rf"max_length={MAX_LEN}"),
     ({"until": [], "max_gen_toks": -1}, r"^max_gen_toks=-1 is invalid")],
    ids=["stop", "until-none", "no-room", "negative"],
)
def test_bad_gen_kwargs_are_one_line_before_any_generation(model_dir, gen_kwargs, message):
    """lm-eval's loop failed mid-run with a TypeError (`stop=` twice), an AssertionError (max_gen_toks >=
    max_length), or a ValueError about generate's stop list; a negative max_gen_toks reached generate."""
    lm = backend(model_dir)
    good = ("a", {"until": [], "max_gen_toks": 2})
    with pytest.raises(ValueError, match=message):
        lm.generate_until(instances("generate_until", [good, ("b", gen_kwargs)]), disable_tqdm=True)
    assert "generate_until" not in lm.steps_summary()  # refused before the good request ran
