"""The `recurrent-depth` lm-eval backend as an lm-eval user drives it: the numbers of lm-eval's own `hf` backend
(request tokenization, left truncation, the prefix token, rolling windows, stop strings), other model kinds,
lm-eval's model args."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import recurrent_depth.integrations  # noqa: F401  (what `import recurrent_depth` installs)
from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 32  # short enough that a request below is left-truncated and a document takes several windows
LOGLIKELIHOOD = [
    ("a=1;b=a;?b=", "1"),
    ("def f(x):", "\n    return x"),
    ("", "a=1;b=a"),  # no context: the prefix (BOS) token stands for it
    ("a=1;b=a;?b=1\n" * 5, " def f(x):"),  # over MAX_LEN: the context is cut on the left; "\n" moves over
    ("a ", "b"),  # the context's trailing space belongs to the continuation
]
DOCUMENTS = ["a=1;b=a;?b=1\n" * 8, "x", "def f(x):\n    return x\n" * 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm-eval-user")
    make_model_dir(path, max_seq_len=MAX_LEN)
    return path


def hf_backend(path, depth: int, batch_size: int = 2):
    return get_model("hf").create_from_arg_string(f"pretrained={path},mean_recurrence={depth},init_scale=0.0,"
                                                  "dtype=float32", {"device": "cpu", "batch_size": batch_size})


def assert_same_scores(ours: list[tuple[float, bool]], theirs: list[tuple[float, bool]]) -> None:
    assert [flag for _, flag in ours] == [flag for _, flag in theirs]
    assert [score for score, _ in ours] == pytest.approx([score for score, _ in theirs], rel=1e-5)


def requests(kind: str, args: list) -> list[Instance]:
    return [Instance(kind, None, a if isinstance(a, tuple) else (a,), i) for i, a in enumerate(args)]


def test_scores_and_generations_are_lm_evals_hf_backends(model_dir):
    theirs = hf_backend(model_dir, depth=3)
    ll = theirs.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), disable_tqdm=True)
    rolling = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", DOCUMENTS), disable_tqdm=True)
    # stop strings spanning tokens ("!" is one token), one of several; the text returned ends before the stop
    gen_args = [(prompt, {"until": until, "max_gen_toks": 8})
                for prompt in ("a=1;", "def f(x):\n") for until in (["!!"], ["zz", "!!!"], [])]
    texts = theirs.generate_until(requests("generate_until", gen_args), disable_tqdm=True)
    assert texts[0] == texts[1] and texts[0] and texts[2].startswith(texts[0] + "!!!")  # the stops were reached
    for batch_size in (1, 3):
        ours = RecurrentDepthEvalLM(pretrained=str(model_dir), num_steps=3, init_scale=0.0, device="cpu",
                                    batch_size=batch_size)
        assert_same_scores(ours.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD), disable_tqdm=True), ll)
        assert ours.loglikelihood_rolling(requests("loglikelihood_rolling", DOCUMENTS),
                                          disable_tqdm=True) == pytest.approx(rolling, rel=1e-5)
        assert ours.generate_until(requests("generate_until", gen_args), disable_tqdm=True) == texts
    greedy = ours.tok_encode("a=1;b=")
    with torch.no_grad():
        for _ in range(3):
            greedy.append(int(ours._core(torch.tensor([greedy]), num_steps=3, init_scale=0.0).logits[0, -1].argmax()))
    context, continuation = greedy[:-3], greedy[-3:]
    flags = [flag for _, flag in ours._loglikelihood_tokens([(None, context, continuation),
                                                             (None, context, continuation[:-1] + [5])])]
    assert flags == [True, False]


def test_a_model_whose_state_starts_at_the_embedding_scores(tmp_path):
    """Ouro-style models (s_0 = e, nothing drawn): every fixed-depth loglikelihood failed with "generator must be
    a torch.Generator or None, got list" (the backend hands one generator per request)."""
    make_model_dir(tmp_path, max_seq_len=MAX_LEN, state_init="embedding")
    expected = hf_backend(tmp_path, depth=2).loglikelihood(requests("loglikelihood", LOGLIKELIHOOD[:3]),
                                                           disable_tqdm=True)
    ours = RecurrentDepthEvalLM(pretrained=str(tmp_path), num_steps=2, device="cpu", batch_size=2)
    assert_same_scores(ours.loglikelihood(requests("loglikelihood", LOGLIKELIHOOD[:3]), disable_tqdm=True), expected)


def test_dtype_model_arg_is_checked_in_one_line(model_dir):
    """lm-eval turns dtype=NAME into getattr(torch, NAME): a typo was an AttributeError traceback ("module
    'torch' has no attribute 'bfloat'") through `rdepth lm-eval` (whose one-line handler takes ValueError), and
    the library's short names were refused."""
    assert RecurrentDepthEvalLM(pretrained=str(model_dir), dtype="bf16", device="cpu").model.dtype == torch.bfloat16
    with pytest.raises(ValueError) as info:
        RecurrentDepthEvalLM(pretrained=str(model_dir), dtype="bfloat", device="cpu")
    assert str(info.value) == ("dtype='bfloat' is invalid: expected one of ['bf16', 'bfloat16', 'float16', 'float32', "
                               "'fp16', 'fp32'], or 'auto'")
