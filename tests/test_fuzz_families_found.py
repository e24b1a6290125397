"""Bugs a differential fuzzer across model families found (Huginn layout, Ouro, Parcae, Llama / Qwen2 / Mistral
retrofits; greedy at init_scale 0): `rd.generate` against the served completions and chats (whole and streamed,
n > 1, stops, logprobs), against transformers' generate on an `rdepth export` (the library's classes, and the
remote-code file for Huginn's layout), over depths, exit criteria (Ouro's gate too), KV sharing, kv_quant and int8
weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurrent_depth as rd
from tests.test_hf import ids, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_routed_transformers_generate_with_eos_token_id_none_runs_past_the_eos(tmp_path):
    """transformers' rule: `generate(..., eos_token_id=None)` decodes to the length, past the model's eos (its own
    loop does, here too). A call routed to the library (an exit criterion) read None as "not given" and stopped at
    the model's eos: 2 tokens where the loop and `rd.generate(eos_token_id=[])` gave 6."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(tiny_config()).eval()
    x = ids(batch=1, length=5, seed=3)
    routed = dict(num_steps=3, init_scale=0.0, exit_criterion="kl", exit_threshold=1e-9)
    want = rd.generate(model, x, max_new_tokens=6, eos_token_id=[], **routed).sequences
    eos = int(want[0, 6])  # the 2nd new token becomes the model's eos
    assert eos not in want[0, :6].tolist()
    model.config.eos_token_id = eos
    model.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.generate(x, max_new_tokens=6, do_sample=False, **routed).shape[1] == 7  # (stops at the eos)
    fixed = dict(num_steps=3, init_scale=0.0, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert hf.generate(x, **fixed).shape[1] == 11  # transformers' loop runs on
    assert torch.equal(hf.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=None, **routed), want)
