"""`rdepth serve` decodes a Parcae model as `rd.generate` does, past the first token.

Parcae adds a value embedding of the current token to the values of some attention layers (`value_embeddings`, in the
core and the coda too; docs/looped-family.md "Parcae"). The batch's core and coda calls built their context from dummy
token ids (zeros), so every generated token after the first read token 0's value embedding there: the served tokens
and log-probs drifted from `rd.generate` (the first token, from the prompt's own prefill, was right).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth.serving import BatchDecoder, build_app
from tests.test_serving import LiveServer

PARCAE = Path(__file__).parent / "goldens" / "parcae" / "released-layout"
TOL = dict(rtol=1e-4, atol=1e-4)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_served_parcae_tokens_and_logprobs_equal_generate():
    """Two prompts of different lengths share the batch (rows at different columns); greedy, init_scale 0 and a fixed
    depth make every step deterministic, so each row's 5 tokens and log-probs equal `rd.generate` alone."""
    model = rd.RecurrentDepthLM.from_pretrained(PARCAE).eval()
    assert model.config.value_embeddings, "the golden model must exercise value embeddings"
    assert BatchDecoder.supports(model)  # the server takes the batch path, not the solo one
    ids = load_file(PARCAE / "goldens.safetensors")["input_ids"]  # [2, 7]
    prompts = [ids[0, :4].tolist(), ids[1, :6].tolist()]
    body = dict(prompt=prompts, max_tokens=5, temperature=0, logprobs=1, ignore_eos=True, init_scale=0, num_steps=3)
    with LiveServer(build_app(model, model_name="parcae", tokenizer_workers=1)) as live:
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        prompt = torch.tensor(prompts[choice["index"]])
        alone = rd.generate(model, prompt, max_new_tokens=5, num_steps=3, init_scale=0.0, output_logits=True)
        tokens = alone.token_lists()[0]
        logprobs = torch.log_softmax(alone.logits[0].float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in tokens]
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), logprobs, **TOL)
