"""The exported remote-code file in training mode (transformers' Trainer, trl: no num_steps) trains as the library's
transformers class does: the depth drawn by `config.depth_scheme` from the same generator, gradients through the last
`mean_backprop_depth` steps only. It ran `mean_recurrence` steps with gradients through all of them."""

from __future__ import annotations

import json

import pytest
import torch

from recurrent_depth.cli import main
from recurrent_depth.integrations.hf import RecurrentDepthForCausalLM
from recurrent_depth.integrations.hf_config import DEFAULT_DEPTH_SCHEME
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from recurrent_depth.model.depth import SCHEMES, DepthSampler
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
SEEDS = range(6)


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path / "src", with_tokenizer=False)  # mean_recurrence 4, mean_backprop_depth 2
    assert main(["export", "--model", str(path / "src"), "--out", str(path / "out"), "--remote-code"]) == 0
    return path / "out"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_remote_files_depth_draw_is_the_librarys(scheme):
    """The file restates `DepthSampler.sample_from` (it cannot import it): the same pair from the same generator."""
    config = remote.RecurrentDepthConfig(mean_recurrence=5, mean_backprop_depth=3, depth_scheme=scheme)
    sampler = DepthSampler(mean_recurrence=5, backprop_depth=3, scheme=scheme)
    assert remote.DEPTH_SCHEMES == SCHEMES and sampler.sigma == remote.DEPTH_SIGMA
    assert remote.DEFAULT_DEPTH_SCHEME == DEFAULT_DEPTH_SCHEME
    pairs = set()
    for seed in range(40):
        pair = remote.training_depth(config, torch.Generator().manual_seed(seed))
        assert pair == sampler.sample_from(torch.Generator().manual_seed(seed)), seed
        pairs.add(pair)
    assert (len(pairs) == 1) == (scheme == "fixed")  # (the random schemes draw several depths)


def step(model: torch.nn.Module, x: torch.Tensor, seed: int, global_rng: bool) -> tuple[torch.Tensor, dict]:
    """One training forward and backward as a trainer runs it (no num_steps): logits and parameter gradients."""
    model.zero_grad()
    if global_rng:
        torch.manual_seed(seed)
        out = model(x, labels=x)
    else:
        out = model(x, labels=x, generator=torch.Generator().manual_seed(seed))
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_remote_file_trains_as_the_librarys_transformers_class(remote_dir, scheme):
    """Same logits and same gradients for each seed, depth drawn from a generator or from the global RNG; at a fixed
    depth from s_0 = 0 the training logits are the eval logits (and the gradients still only the last steps')."""
    init = {"depth_scheme": scheme, "init_scale": 0.0 if scheme == "fixed" else 1.0}
    library = RecurrentDepthForCausalLM.from_pretrained(remote_dir, **init).train()
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir, **init).train()
    assert exported.config.depth_scheme == scheme
    x = ids(batch=2, length=7)
    for seed in SEEDS:
        for global_rng in (False, True):
            want_logits, want_grads = step(library, x, seed, global_rng)
            logits, grads = step(exported, x, seed, global_rng)
            torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
            assert grads.keys() == want_grads.keys() and any(".core_block." in n for n in grads)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    if scheme == "fixed":
        with torch.no_grad():
            expected = exported.eval()(x).logits
        exported.train()
        torch.testing.assert_close(step(exported, x, 0, True)[0], expected, atol=0, rtol=0)
        # truncated backprop: 2 of the 4 steps under autograd, not all 4 (their gradients differ)
        _, truncated = step(exported, x, 0, True)
        exported.zero_grad()
        exported(x, labels=x, num_steps=4).loss.backward()  # an explicit num_steps: every step, as before
        full = {n: p.grad for n, p in exported.named_parameters() if p.grad is not None}
        assert not torch.allclose(truncated["transformer.wte.weight"], full["transformer.wte.weight"])


def test_the_remote_files_depth_scheme_is_checked_and_not_saved(remote_dir):
    with pytest.raises(ValueError, match=r"^config.depth_scheme='nope' is invalid: expected one of poisson-lognormal"):
        remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir, depth_scheme="nope")
    model = remote.RecurrentDepthForCausalLM.from_pretrained(remote_dir, depth_scheme="uniform").train()
    assert "depth_scheme" not in json.loads(model.config.to_json_string())  # a runtime setting, as the library's
    model.config.depth_scheme = "paper"
    with pytest.raises(ValueError, match=r"^config.depth_scheme='paper' is invalid"):
        model(ids(batch=1, length=4))
    with torch.no_grad():  # eval mode and explicit num_steps read no depth_scheme
        model.eval()(ids(batch=1, length=4))
        model.train()(ids(batch=1, length=4), num_steps=2)
