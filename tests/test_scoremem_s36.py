"""Fixed-depth scoring runs the vocabulary head at the scored positions only, with the same scores bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.evaluation import scoring
from recurrent_depth.evaluation.scoring import Scored, batched_logprobs
from recurrent_depth.model.recurrent import HEAD_MIN_ROWS

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(dtype: torch.dtype = torch.float32) -> rd.RecurrentDepthLM:
    torch.manual_seed(3)
    # (hidden 256: MKL runs a GEMM of under ~10 rows by another kernel, whose last bits differ from a larger one's)
    config = rd.ModelConfig.from_preset("tiny", vocab_size=301, max_seq_len=160, hidden_size=256)
    return rd.RecurrentDepthLM(config).to(dtype).eval()


def scored_over_every_position(model, requests, num_steps: int, pad: int) -> list[Scored]:
    """What batched_logprobs computed before: log-softmax over the whole [B, T, V] forward, then each row's slice."""
    rows = [list(c) + list(x)[:-1] for c, x in requests]
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    with torch.no_grad():
        logp = F.log_softmax(model(ids, num_steps=num_steps, init_scale=0.0).logits, -1)
    out = []
    for b, (context, continuation) in enumerate(requests):
        picked = logp[b, len(context) - 1 : len(context) - 1 + len(continuation)]
        target = torch.tensor(list(continuation))
        out.append(Scored(float(picked.gather(-1, target[:, None]).sum()),
                          bool((picked.argmax(-1) == target).all()), [num_steps] * len(continuation)))
    return out


def greedy_continuation(model, context: list[int], n: int) -> list[int]:
    ids = list(context)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), num_steps=3, init_scale=0.0).logits[0, -1].argmax()))
    return ids[len(context):]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_scores_are_bitwise_those_of_the_whole_forward(dtype, monkeypatch):
    monkeypatch.setattr(scoring, "LOG_SOFTMAX_ELEMENTS", 3 * 301)  # 3-row blocks of log-softmax across requests
    model = make_model(dtype)
    context = random_tokens(7, 0)
    requests = [
        (context, greedy_continuation(model, context, 3)),  # is_greedy True
        (random_tokens(13, 1), random_tokens(5, 2)),  # odd lengths, padded beside the longest row
        ([9], [4]),  # one-token context and continuation: the most padding
        (random_tokens(2, 3), random_tokens(9, 4)),
        ([1], random_tokens(40, 5)),  # a rolling-loglikelihood window: the prefix token, then the whole window
    ]
    few = [(random_tokens(5 + b, 10 + b), random_tokens(1 + b % 2, 20 + b)) for b in range(5)]  # 7 rows scored
    for batch in (requests, requests[1:3], requests[2:3], requests[4:], few):  # fewer and more than HEAD_MIN_ROWS
        got = batched_logprobs(model, batch, 3, 0, init_scale=0.0)
        assert got == scored_over_every_position(model, batch, 3, 0)  # dataclass equality: the floats exactly
    rolling = batched_logprobs(model, requests[4:], 3, 0, init_scale=0.0)[0]
    assert rolling.logprob < 0 and len(rolling.steps) == 40
    assert batched_logprobs(model, requests[:1], 3, 0, init_scale=0.0)[0].is_greedy


def test_the_head_runs_over_the_scored_positions_only(monkeypatch):
    # batched_logprobs computed [B, T, V] float32 logits and a log-softmax copy of them, of which it read a few rows
    model = make_model()
    seen = []
    head = model.head
    monkeypatch.setattr(model, "head", lambda x: seen.append(x.shape[:-1]) or head(x))
    long = [([1], random_tokens(60, 6)), (random_tokens(100, 7), random_tokens(2, 8))]
    batched_logprobs(model, long, 2, 0, init_scale=0.0)
    assert seen == [(62,)]  # every continuation token's prediction, not 2 x 100 positions
    seen.clear()
    batched_logprobs(model, [(random_tokens(100, 9), [5])], 2, 0, init_scale=0.0)
    # a few rows: padded to HEAD_MIN_ROWS. MKL's default kernels multiply a few rows otherwise than many (last bits
    # apart, e.g. the 2-request batch of the test above at HEAD_MIN_ROWS = 1); the suite pins MKL_CBWR=AVX2,STRICT
    # (conftest), where a row's result does not depend on the rows beside it, so this checks the rule itself
    assert seen == [(HEAD_MIN_ROWS,)] and HEAD_MIN_ROWS >= 16  # (MKL float32: fewer than 16 rows differ)


def test_logits_at_is_checked():
    model = make_model()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"^logits_at must be a bool torch.Tensor \[batch, seq_len\], got torch.int64"):
        model(ids, num_steps=1, logits_at=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^logits_at has shape \(1, 2\), expected input_ids' \(1, 3\)"):
        model(ids, num_steps=1, logits_at=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="^logits_at takes no labels"):
        model(ids, num_steps=1, labels=ids, logits_at=torch.ones(1, 3, dtype=torch.bool))
    at = torch.tensor([[False, True, True]])
    with torch.no_grad():
        assert torch.equal(model(ids, num_steps=1, init_scale=0.0, logits_at=at).logits,
                           model(ids, num_steps=1, init_scale=0.0).logits[at])
