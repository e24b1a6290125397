"""transformers user paths found wrong in a hunt: routed generate's pad_token_id, `subfolder=` of a local path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

import recurrent_depth as rd
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
ROUTED = {"exit_criterion": "entropy-diff", "exit_threshold": 1e-12}  # routed to the library, never exits early


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-eco-hunt")
    make_model_dir(path, with_tokenizer=False)
    return path


def test_routed_generate_pads_finished_rows_with_pad_token_id_as_transformers_loop_does(model_dir):
    """transformers fills a row that stopped early with pad_token_id (the call's, else the generation config's);
    a call routed to recurrent_depth.generate filled it with the model config's pad id, whatever was asked."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.config.init_scale = 0.0
    x = torch.tensor([[256, 64, 28, 16, 26], [256, 67, 68, 69, 220]])
    plain = model.generate(x, max_new_tokens=6, do_sample=False)
    eos = int(plain[0, 7])  # row 0's third new token: it stops there, row 1 runs on
    assert eos not in plain[0, 5:7].tolist() and eos not in plain[1, 5:].tolist()
    for pad in (5, 7):
        want = model.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=pad)
        assert want[0, 8:].tolist() == [pad] * 3  # transformers' loop: the reference
        got = model.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=pad, **ROUTED)
        assert torch.equal(got, want)
        config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=pad, **ROUTED)
        assert torch.equal(model.generate(x, generation_config=config), want)
    model.generation_config.pad_token_id = 9  # the model's own generation config, as transformers' loop reads it
    out = model.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=eos, return_dict_in_generate=True,
                         **ROUTED)
    assert out.sequences[0, 8:].tolist() == [9] * 3 and out.pad_token_id == 9
    assert out.predictions[0, 3:].tolist() == [9] * 3 and out.token_lists()[0] == plain[0, 5:8].tolist()
    with pytest.raises(ValueError, match=r"pad_token_id=\[1, 2\] is invalid"):
        model.generate(x, max_new_tokens=2, pad_token_id=[1, 2], **ROUTED)


def test_subfolder_of_a_local_directory_loads_that_model_with_its_dtype(model_dir, tmp_path):
    """`from_pretrained(root, subfolder="sub")`: the directory checks and the stored dtype read root itself (no
    config.json there: FileNotFoundError; another model there: its dtype)."""
    library = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    library.to(torch.bfloat16).save_pretrained(tmp_path / "sub")  # the library's layout: no dtype in config.json
    x = torch.tensor([[256, 64, 28, 16, 26]])
    with torch.no_grad():
        want = library(x, init_scale=0.0).logits
    model = AutoModelForCausalLM.from_pretrained(tmp_path, subfolder="sub").eval()
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model(x, init_scale=0.0).logits, want)
    rd.RecurrentDepthLM.from_pretrained(model_dir).save_pretrained(tmp_path)  # a float32 model at the root
    assert AutoModelForCausalLM.from_pretrained(tmp_path, subfolder="sub").dtype == torch.bfloat16
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, subfolder="sub", num_labels=3)
    assert classifier.score.weight.dtype == torch.bfloat16


def test_a_routed_sampled_call_keeps_transformers_top_k_default_and_its_top_k_0(model_dir):
    """transformers samples with top_k=50 when nothing sets it (top_k=0: no filter); a sampled call routed to
    recurrent_depth.generate drew from the whole vocabulary, and refused top_k=0."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([[256, 64, 28, 16, 26]]).repeat(16, 1)
    kw = dict(max_new_tokens=3, do_sample=True, init_scale=0.0, num_steps=2)
    routed = model.generate(x, seed=0, **kw)
    assert torch.equal(routed, rd.generate(model.core, x, seed=0, top_k=50, **kw).sequences)
    assert not torch.equal(routed, rd.generate(model.core, x, seed=0, **kw).sequences)  # (the filter matters here)
    unfiltered = model.generate(x, seed=0, top_k=0, **kw)
    assert torch.equal(unfiltered, rd.generate(model.core, x, seed=0, **kw).sequences)
    top7 = rd.generate(model.core, x, seed=0, top_k=7, **kw).sequences
    assert torch.equal(model.generate(x, seed=0, top_k=7, **kw), top7)
    # transformers' own loop: every first new token is among the 50 most likely
    with torch.no_grad():
        top50 = set(model(x[:1], init_scale=0.0, num_steps=2).logits[0, -1].topk(50).indices.tolist())
    torch.manual_seed(0)
    assert set(model.generate(x, **kw)[:, 5].tolist()) <= top50
    assert set(routed[:, 5].tolist()) <= top50
