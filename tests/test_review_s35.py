"""Findings of the session-35 review: each test is the regression of one bug."""

from __future__ import annotations

from pathlib import Path

import pytest


class _Stop(Exception):
    """Raised where the demo's work would begin: what it cleared before is what the test reads."""


def test_loop_pretrain_clears_its_own_linked_record_entries(tmp_path: Path, monkeypatch):
    """`rdepth loop pretrain` rerun in its own --out clears its earlier record (`EARLIER_RUN_NAMES`). A `tensorboard`
    or `model` that is a link to a directory (logs kept on another disk) was handed to rmtree, which refuses a link
    and, told to ignore errors, left it: the trainer then found the old model/ and refused the rerun. The link is
    removed (not what it points to), as `files.remove_tree` removes one."""
    import recurrent_depth.data as data
    from recurrent_depth.looping.pretrain import PretrainRecipe, pretrain

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.py").write_text("def f(x):\n    return x\n" * 8)
    out = tmp_path / "run"
    out.mkdir()
    (out / "pretrain.json").write_text("{}")  # (its own earlier run)
    elsewhere = tmp_path / "elsewhere"
    for name in ("model", "tensorboard"):
        (elsewhere / name).mkdir(parents=True)
        (elsewhere / name / "kept.txt").write_text("not the demo's to delete\n")
        (out / name).symlink_to(elsewhere / name, target_is_directory=True)
    (out / "metrics.jsonl").write_text("{}\n")

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(data, "build_tokenizer", stop)
    with pytest.raises(_Stop):
        pretrain(out, PretrainRecipe(data=str(corpus)), log=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == [".rdepth.lock", "pretrain.json"]
    for name in ("model", "tensorboard"):  # what the links pointed to is left alone
        assert (elsewhere / name / "kept.txt").is_file()
