"""`rdepth export` into a directory that held another model, with another tokenizer, and a remote-code export
interrupted: what the exported directory holds is the exported model's, whole."""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.integrations import export
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def logits(model: torch.nn.Module, steps: int) -> torch.Tensor:
    with torch.no_grad():
        return model(ids(), num_steps=steps, init_scale=0.0).logits


def test_export_over_another_model_keeps_none_of_its_files(tmp_path):
    """Its tokenizer (tokenizer.model too), generation_config.json (num_steps 1) and retrofit.json were left beside
    the new weights, read as the exported model's; files of no model (notes.txt) stay."""
    out = tmp_path / "out"
    make_model_dir(out, seed=3)
    (out / "generation_config.json").write_text(json.dumps({"num_steps": 1, "max_new_tokens": 3}))
    (out / "tokenizer.model").write_bytes(b"another model's sentencepiece")
    (out / "retrofit.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    model = make_model_dir(tmp_path / "src", with_tokenizer=False)
    for _ in range(2):  # (again over its own export: the same files)
        assert main(["export", "--model", str(tmp_path / "src"), "--out", str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    loaded = rd.RecurrentDepthLM.from_pretrained(out)
    for steps in (1, 3):
        assert torch.equal(logits(loaded, steps), logits(model, steps))


def test_export_over_its_own_export_keeps_what_it_writes(tmp_path):
    make_model_dir(tmp_path / "src")
    out = tmp_path / "out"
    for _ in range(2):
        assert main(["export", "--model", str(tmp_path / "src"), "--out", str(out), "--remote-code"]) == 0
        assert {"generation_config.json", "chat_template.jinja", "tokenizer.json",
                export.REMOTE_CODE_FILE} <= {p.name for p in out.iterdir()}


def test_export_tokenizer_replaces_the_models_chat_template(tmp_path):
    """--tokenizer DIR without a chat_template.jinja (its template in tokenizer_config.json, as transformers saves
    it): --model's chat_template.jinja was kept beside it, and transformers rendered --model's template."""
    from transformers import AutoTokenizer

    make_model_dir(tmp_path / "src")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((tmp_path / "src" / "tokenizer.json").read_bytes())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert main(["export", "--model", str(tmp_path / "src"), "--tokenizer", str(tok),
                 "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "chat_template.jinja").exists()
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == template


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary_before_writing(tmp_path, capsys):
    """It was written without a word; every `--model` command then refused the exported directory."""
    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    make_model_dir(tmp_path / "src", with_tokenizer=False)  # vocab_size 288
    big = train_tokenizer(["hello world " * 20 + "".join(chr(i) for i in range(300, 700))], vocab_size=500)
    save_tokenizer(big, tmp_path / "big")
    assert main(["export", "--model", str(tmp_path / "src"), "--tokenizer", str(tmp_path / "big"),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokens but the model's vocabulary has 288" in err[0]
    assert not (tmp_path / "out").exists()


def test_remote_code_failure_leaves_no_auto_map_without_its_file(tmp_path, monkeypatch):
    """config.json's auto_map was written before modeling_recurrent_depth.py: a failure between the two (here in
    place, in the source model's own directory) left a config transformers could not load."""
    make_model_dir(tmp_path / "src", with_tokenizer=False)

    def broken() -> str:
        raise OSError("disk full")

    monkeypatch.setattr(export, "remote_code_source", broken)
    with pytest.raises(OSError, match="disk full"):
        export.export_remote_code(tmp_path / "src")
    assert "auto_map" not in json.loads((tmp_path / "src" / "config.json").read_text())
    assert not (tmp_path / "src" / export.REMOTE_CODE_FILE).exists()


def test_a_cast_in_place_is_refused_and_the_weights_kept(tmp_path, capsys):
    """`rdepth export --model m --out m --dtype bf16` replaced the only copy of the float32 weights with bf16 ones."""
    src = tmp_path / "m"
    make_model_dir(src, with_tokenizer=False)
    before = (src / "model.safetensors").read_bytes()
    assert main(["export", "--model", str(src), "--out", str(src), "--dtype", "bf16"]) == 2
    assert "--dtype bfloat16 would replace its torch.float32 weights" in capsys.readouterr().err
    assert (src / "model.safetensors").read_bytes() == before
    assert main(["export", "--model", str(src), "--out", str(src), "--dtype", "float32"]) == 0  # (no cast: fine)
