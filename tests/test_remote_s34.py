"""`rdepth export --remote-code` in place (no --out): the weights stay as stored, and the exported file's model must
compute the library's logits from them, or the export must refuse in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.integrations.export import REMOTE_CODE_FILE
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import ids, make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def rewrite_weights(path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda s: s.pop("transformer.adapter.weight"), r"missing tensors: \['transformer.adapter.weight'\]"),
    (lambda s: s.update({"lm_head.weight": torch.ones_like(s["transformer.wte.weight"])}),
     "lm_head.weight differs from transformer.wte.weight but the config ties them"),
    (lambda s: s["transformer.adapter.weight"].fill_(float("nan")), "hold NaN or inf"),
], ids=["missing-tensor", "tied-head-differs", "nan"])
def test_in_place_export_refuses_weights_the_library_refuses(tmp_path, capsys, damage, message):
    """In place the export read only config.json: it wrote the file and auto_map beside weights the library refuses,
    and transformers loaded them anyway (a missing adapter initialised at random, a differing head left untied, with
    a warning): the export computed another model than the directory's."""
    make_model_dir(tmp_path, with_tokenizer=False)
    rewrite_weights(tmp_path, damage)
    config = (tmp_path / "config.json").read_text()
    assert main(["export", "--model", str(tmp_path), "--remote-code"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rdepth export: error: cannot load"), err
    assert re.search(message, err), err
    assert not (tmp_path / REMOTE_CODE_FILE).exists() and (tmp_path / "config.json").read_text() == config


def test_in_place_export_of_mixed_dtype_weights_computes_in_the_librarys_dtype(tmp_path):
    """Weights stored in two dtypes (the embedding float32, the rest bfloat16): the library computes in the
    embedding's dtype; the exported config named none, so transformers took the first stored tensor's (bfloat16) and
    the export's logits were off by ~1e-2."""
    make_model_dir(tmp_path, with_tokenizer=False)
    rewrite_weights(tmp_path, lambda s: s.update({k: v.bfloat16() for k, v in s.items() if "wte" not in k}))
    library = rd.RecurrentDepthLM.from_pretrained(tmp_path).eval()
    assert main(["export", "--model", str(tmp_path), "--remote-code"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path).eval()
    x = ids(batch=2, length=6)
    with torch.no_grad():
        assert torch.equal(exported(x, num_steps=2, init_scale=0.0).logits,
                           library(x, num_steps=2, init_scale=0.0).logits)
    assert {p.dtype for p in exported.parameters()} == {torch.float32}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
