"""Mismatches a seeded differential fuzzer of `rd.generate`'s caches found (random tiny models of every mixer,
GQA, windows, value embeddings, qk_norm; KV policies, budgets, kv_quant, exit criteria, warm start, ragged
left-padded batches), each against a reference that recomputes without a cache: a full forward, a depth
replay, the same prompt alone."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd

pytestmark = pytest.mark.usefixtures("one_thread")


def recurrent_coda(coda: str) -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    mixer = {"prelude": "attention", "core": "attention", "coda": coda}
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=32, max_seq_len=64, mixer=mixer)).eval()


@pytest.mark.parametrize("coda", ["falcon", "deltanet"])
@pytest.mark.parametrize("mode", [dict(exit_criterion="kl"), dict(exit_criterion="entropy-diff", check_every=2),
                                  dict(exit_criterion="kl", exit_kv="compute")],
                         ids=["kl", "entropy-every-2", "compute"])
def test_exit_checks_feed_each_token_to_a_recurrent_coda_once(coda, mode):
    """An output criterion reads the logits after every checked step, running the coda on the new token each time;
    a coda with a recurrent state (falcon, DeltaNet, ...) absorbed the token once per check, so threshold 0 (which
    never exits) was off fixed depth by ~0.3 in the logits from the second token on. Every readout of the same
    columns now starts from the state before them, as a KV entry is rewritten in place."""
    model = recurrent_coda(coda)
    prompt = torch.tensor([[3, 9, 12]])
    kw = dict(max_new_tokens=5, num_steps=4, init_scale=0, output_logits=True)
    out = rd.generate(model, prompt, exit_threshold=0.0, **mode, **kw)
    assert out.steps.tolist() == [[4] * 5]
    with torch.no_grad():
        full = model(out.sequences, num_steps=4, init_scale=0).logits[0, 2:-1]
    torch.testing.assert_close(out.logits[0], full, rtol=0, atol=1e-5)
    assert out.token_lists() == rd.generate(model, prompt, **kw).token_lists()
