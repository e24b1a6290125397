"""What a transformers user does with a model directory, through the library's registered classes and the exported
remote-code file."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.integrations.export import REMOTE_CODE_FILE, remote_code_source
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import ids, make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def test_saving_an_exported_model_loaded_by_the_library_keeps_its_remote_code(tmp_path):
    """An exported directory loaded with the library imported (its class takes precedence) and saved again kept the
    config's auto_map but not the file it names: the copy failed to load without the library (OSError: no file named
    modeling_recurrent_depth.py). The file is written beside the map, and the copy runs as the original."""
    make_model_dir(tmp_path / "src", with_tokenizer=False)
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model).__module__ == "recurrent_depth.integrations.hf"
    model.save_pretrained(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["auto_map"]
    assert (tmp_path / "copy" / REMOTE_CODE_FILE).read_text() == remote_code_source()
    copy = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "copy").eval()
    x = ids(batch=2, length=6)
    with torch.no_grad():
        torch.testing.assert_close(copy(x, num_steps=2, init_scale=0.0).logits,
                                   model(x, num_steps=2, init_scale=0.0).logits, atol=1e-5, rtol=1e-5)
    # a directory that names no remote code gets none
    AutoModelForCausalLM.from_pretrained(tmp_path / "src").save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / REMOTE_CODE_FILE).exists()


def test_library_functions_take_a_model_loaded_through_transformers(tmp_path):
    """`rd.generate(AutoModelForCausalLM.from_pretrained(dir), ...)` failed deep inside with "'RecurrentDepthConfig'
    object has no attribute 'uses_huginn_layout'" (and `accuracy_grid` on 'initial_state'): the functions run the
    library model the wrapper holds, sharing its weights."""
    import recurrent_depth as rd
    from recurrent_depth.evaluation.reasoning import accuracy_grid, get_task

    make_model_dir(tmp_path / "m", with_tokenizer=False)
    wrapped = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    library = rd.RecurrentDepthLM.from_pretrained(tmp_path / "m").eval()
    x = ids(batch=2, length=5)
    kwargs = {"max_new_tokens": 4, "num_steps": 2, "init_scale": 0.0, "output_logits": True}
    got, want = rd.generate(wrapped, x, **kwargs), rd.generate(library, x, **kwargs)
    assert torch.equal(got.sequences, want.sequences) and torch.equal(got.logits, want.logits)
    task = get_task("chains")
    grid = {"difficulties": [1], "depths": [1, 2], "count": 4, "seed": 3}
    assert accuracy_grid(wrapped, task, **grid).accuracy == accuracy_grid(library, task, **grid).accuracy
