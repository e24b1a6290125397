"""Two gaps closed in session 36.

1. The exported remote-code file took `num_steps` as an int only; the library takes a pair (n, k) too (n steps
   without gradients, then k with: the official checkpoint's truncated-backprop convention). It now takes the same
   forms with the same logits, tokens and gradients.
2. `rdepth train --init-from DIR --mean-recurrence R` trained at R but saved DIR's mean_recurrence, so a model
   healed at r=32 generated at its old depth by default. The saved config now records the depth the run trained
   at (as a run from scratch does); `--model-set` still wins.
"""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from tests.test_hf import greedy_reference, ids, make_model_dir
from tests.train_support import VOCAB, prepare_root

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- 1. remote num_steps pair
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(library transformers model, exported remote-code model) of one tiny saved model."""
    from transformers import AutoModelForCausalLM

    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    root = tmp_path_factory.mktemp("pair")
    make_model_dir(root / "src", with_tokenizer=False)
    assert main(["export", "--model", str(root / "src"), "--out", str(root / "out"), "--remote-code"]) == 0
    library = AutoModelForCausalLM.from_pretrained(root / "src").eval()
    remote_model = remote.RecurrentDepthForCausalLM.from_pretrained(root / "out").eval()
    assert type(library).__module__.startswith("recurrent_depth") and type(remote_model) is not type(library)
    return library, remote_model


@pytest.mark.parametrize("num_steps", [3, (2, 1), (0, 3), (3, 0), [1, 2]])
def test_the_exported_file_takes_the_librarys_num_steps_forms(exported, num_steps):
    library, remote_model = exported
    x = ids(batch=2, length=7)
    with torch.no_grad():
        want = library(x, num_steps=num_steps, init_scale=0.0).logits
        got = remote_model(x, num_steps=num_steps, init_scale=0.0).logits
    assert torch.equal(got, want)
    with torch.no_grad():  # a pair is n + k steps (official: "(3, 2) and 5 give identical logits")
        assert torch.equal(got, remote_model(x, num_steps=3, init_scale=0.0).logits)


def test_an_exported_pair_generates_and_backpropagates_as_the_library(exported):
    library, remote_model = exported
    x = ids(batch=2, length=6)
    out = remote_model.generate(x, max_new_tokens=4, num_steps=(2, 1), init_scale=0.0, do_sample=False)
    assert torch.equal(out, greedy_reference(library, x, 4, 3))
    assert torch.equal(out, library.generate(x, max_new_tokens=4, num_steps=(2, 1), init_scale=0.0, do_sample=False))
    # a GenerationConfig saved to JSON reads the pair back as a list
    remote_model.generation_config.num_steps = [2, 1]
    try:
        assert torch.equal(remote_model.generate(x, max_new_tokens=4, init_scale=0.0, do_sample=False), out)
    finally:
        del remote_model.generation_config.num_steps

    def grads(model, num_steps):
        model.train()
        model.zero_grad()
        try:
            model(x, labels=x, num_steps=num_steps, init_scale=0.0).loss.backward()
        finally:
            model.eval()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    for num_steps in ((2, 1), 3):
        want, got = grads(library, num_steps), grads(remote_model, num_steps)
        assert sorted(got) == sorted(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    # the first 2 steps ran without autograd: the adapter sees only the last step's gradient
    assert not torch.allclose(grads(remote_model, (2, 1))["transformer.adapter.weight"],
                              grads(remote_model, 3)["transformer.adapter.weight"])


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), (1, -1), (True, 1), (1.0, 2), "3", -1, 2.0])
def test_the_exported_file_refuses_other_num_steps_in_one_line(exported, bad):
    _, remote_model = exported
    with pytest.raises(ValueError, match=r"^num_steps=.* is invalid: expected None, an integer >= 0 or a pair of "
                                         r"integers >= 0 \(no_grad_steps, grad_steps\)$"):
        remote_model(ids(batch=1, length=3), num_steps=bad)


def test_the_exported_file_still_checks_the_configs_depth(exported):
    """num_steps=None runs config.mean_recurrence: a value that is no step count stays a one-line error."""
    _, remote_model = exported
    before = remote_model.config.mean_recurrence
    remote_model.config.mean_recurrence = 2.0
    try:
        with pytest.raises(ValueError, match=r"^config.mean_recurrence=2.0 \(the depth of num_steps=None\) is "
                                             r"invalid: expected an integer >= 0$"):
            remote_model(ids(batch=1, length=3))
    finally:
        remote_model.config.mean_recurrence = before


# ---------------------------------------------------------------------------- 2. --init-from saves the trained depth
@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    root = prepare_root(tmp_path_factory.mktemp("depth_root"))
    torch.manual_seed(7)
    source = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64,
                                                            mean_recurrence=4, mean_backprop_depth=2))
    source.save_pretrained(root / "source", tokenizer=root / "tokenizer")
    return root


def train(root, out, *extra, source=None):
    return main(["train", "--init-from", str(source or root / "source"), "--data", str(root / "corpus"), "--data-dir",
                 str(root / "data"), "--val-fraction", "0.1", "--keep-all", "--seq-len", "32", "--batch-size", "2",
                 "--eval-batches", "1", "--eval-depths", "1", "--no-tensorboard", "--no-progress", "--max-steps", "1",
                 "--depth-scheme", "fixed", "--threads", "1", "--out", str(out), *extra])


def saved_depth(run_dir):
    config = json.loads((run_dir / "model" / "config.json").read_text())
    return config["mean_recurrence"], config["mean_backprop_depth"]


def test_a_run_from_a_model_directory_saves_the_depth_it_trained_at(train_root, tmp_path, capsys):
    assert train(train_root, tmp_path / "deeper", "--mean-recurrence", "6", "--backprop-depth", "3") == 0
    assert saved_depth(tmp_path / "deeper") == (6, 3)
    out = capsys.readouterr().out
    assert ("model config: mean_backprop_depth 2 -> 3, mean_recurrence 4 -> 6 (the depth this run trains at; "
            "model/config.json records it: the default depth of generate, eval and serve)") in out
    run = json.loads((tmp_path / "deeper" / "run.json").read_text())
    assert run["config"]["model"]["mean_recurrence"] == 6 and run["model_config"]["mean_recurrence"] == 6
    # `rdepth generate` then runs at the trained depth by default
    assert main(["generate", "--model", str(tmp_path / "deeper" / "model"), "--prompt", "def f", "--max-new-tokens",
                 "2", "--json", "--ignore-eos", "--temperature", "0"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["steps"] == [[6, 6]]
    # --model-set names the saved value outright; without depth flags the directory's config is kept
    assert train(train_root, tmp_path / "set", "--mean-recurrence", "6", "--model-set", "mean_recurrence=5") == 0
    assert saved_depth(tmp_path / "set") == (5, 2)
    assert "model config: mean_recurrence 4 -> 5 (" in capsys.readouterr().out
    assert train(train_root, tmp_path / "same") == 0
    assert saved_depth(tmp_path / "same") == (4, 2)
    assert "model config:" not in capsys.readouterr().out


def test_the_depth_line_names_a_kept_generation_config_that_sets_num_steps(train_root, tmp_path, capsys):
    """DIR's generation_config.json is kept in model/, and its num_steps is what generate reads first: the line
    says so rather than promise the new default depth."""
    import shutil

    source = tmp_path / "with-defaults"
    shutil.copytree(train_root / "source", source)
    (source / "generation_config.json").write_text(json.dumps({"num_steps": 4}))
    assert train(train_root, tmp_path / "run", "--mean-recurrence", "6", source=source) == 0
    assert saved_depth(tmp_path / "run") == (6, 2)
    assert (f"model config: mean_recurrence 4 -> 6 (the depth this run trains at; model/config.json records it: the "
            f"default depth of generate, eval and serve, though the generation_config.json kept from {source} sets "
            f"generate's num_steps=4)") in capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path / "run" / "model"), "--prompt", "def f", "--max-new-tokens", "1",
                 "--json", "--ignore-eos", "--temperature", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == [[4]]
