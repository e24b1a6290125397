"""Generation draws s_0 at the model config's `init_scale` unless told otherwise, as the model's forward does.

Parcae stores its s_0 scale in the config (1/sqrt(h) for its "like-init", 0 for "zero"; families/parcae.py). The
option's default was a fixed 1.0, so `rd.generate`, `rdepth generate` and `rdepth serve` drew Parcae's s_0 sqrt(h)
times too large and gave a zero-init model a random one; Huginn's config says 1.0, so nothing changes there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth.inference.gradmem import write_memory
from recurrent_depth.inference.options import OPTIONS, GenerationOptions
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer

PARCAE = Path(__file__).parent / "goldens" / "parcae" / "released-layout"
TOL = dict(rtol=1e-4, atol=1e-4)

pytestmark = pytest.mark.usefixtures("one_thread")


def parcae(tmp_path: Path, state_init: str) -> rd.RecurrentDepthLM:
    """The Parcae golden model with its config's `state_init` set (like-init: init_scale 1/sqrt(h); zero: 0)."""
    directory = tmp_path / state_init
    shutil.copytree(PARCAE, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"state_init": state_init}))
    return rd.RecurrentDepthLM.from_pretrained(directory).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return load_file(PARCAE / "goldens.safetensors")["input_ids"]  # [2, 7]


@pytest.fixture(scope="module")
def zero_init(tmp_path_factory) -> rd.RecurrentDepthLM:
    return parcae(tmp_path_factory.mktemp("parcae"), "zero")


@pytest.fixture(scope="module")
def like_init(tmp_path_factory) -> rd.RecurrentDepthLM:
    return parcae(tmp_path_factory.mktemp("parcae"), "like-init")


def test_the_default_is_the_models_and_a_given_value_wins():
    assert OPTIONS["init_scale"].default is None and "model config" in OPTIONS["init_scale"].describe()
    assert GenerationOptions().validate(4, init_scale=0.125).init_scale == 0.125
    assert GenerationOptions().validate(4).init_scale == 1.0  # ModelConfig's default (Huginn's)
    assert GenerationOptions(init_scale=0.0).validate(4, init_scale=0.125).init_scale == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_zero_init_parcae_generates_its_forward(zero_init, ids, seed):
    """s_0 = 0 whatever the seed: the first generated token's logits are the forward's at the prompt's end."""
    assert zero_init.config.init_scale == 0.0
    full = zero_init(ids).logits[:, 3]
    for fast in (True, False):
        out = rd.generate(zero_init, ids[:, :4], max_new_tokens=1, seed=seed, output_logits=True, fast=fast)
        torch.testing.assert_close(out.logits[:, 0], full, **TOL)


def test_like_init_parcae_draws_s0_at_its_scale(like_init, ids):
    """generate's s_0 for a seeded row is the forward's draw from a generator with that seed, at 1/sqrt(h)."""
    assert like_init.config.init_scale == pytest.approx(like_init.config.hidden_size ** -0.5)
    prompt = ids[:1, :4]
    for seed in (0, 5):
        forward = like_init(prompt, generator=torch.Generator().manual_seed(seed)).logits[:, -1]
        out = rd.generate(like_init, prompt, max_new_tokens=1, seed=seed, output_logits=True)
        torch.testing.assert_close(out.logits[:, 0], forward, **TOL)


def test_gradmem_writes_at_the_models_scale():
    """write_memory's s_0 scale defaults to the config's too (GradMem cannot run Parcae's value embeddings: a tiny
    model whose config says s_0 = 0)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", init_scale=0.0)).eval()
    context = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    given = write_memory(model, context, tokens=2, steps=2, lr=1.0, depth=2, init_scale=0.0, seed=3)
    default = write_memory(model, context, tokens=2, steps=2, lr=1.0, depth=2, seed=3)
    torch.testing.assert_close(default.memory, given.memory, rtol=0, atol=0)


@pytest.mark.parametrize("state_init", ["zero", "like-init"])
def test_serving_draws_parcaes_s0_as_its_forward(tmp_path, ids, state_init):
    """A request that leaves init_scale out draws s_0 at the model's scale, as the forward (and `rd.generate`,
    above) does: the first token's log-prob reads the prompt's s_0 (token-id prompts: the golden directory has no
    tokenizer; a seeded request's row draws from a generator with its seed)."""
    model = parcae(tmp_path, state_init)
    prompts = ids[:, :4].tolist()
    body = dict(prompt=prompts, max_tokens=1, temperature=0, seed=11, logprobs=1, ignore_eos=True)
    with LiveServer(build_app(model, model_name="parcae", tokenizer_workers=1)) as live:
        r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        prompt = torch.tensor([prompts[choice["index"]]])
        logprobs = torch.log_softmax(model(prompt, generator=torch.Generator().manual_seed(11)).logits[0, -1], -1)
        token = int(logprobs.argmax())
        assert choice["logprobs"]["tokens"] == [f"token_id:{token}"]
        torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), logprobs[[token]], **TOL)
