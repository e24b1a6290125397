"""`rdepth export` carries the source directory's model card (README.md), as it carries the tokenizer and
generation_config.json: the exported copy, the one people publish, lost it. A card that is a link leading out of
the directory (or no regular file, or too large) is refused before anything is written."""

from __future__ import annotations

import os

import pytest

from recurrent_depth.cli import main
from recurrent_depth.integrations import export
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
CARD = b"---\nlicense: apache-2.0\n---\n# A tiny recurrent-depth model\n\nTrained for tests.\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "model"
    make_model_dir(path, with_tokenizer=False)
    return path


def source(tmp_path, model_dir, card: bytes | None = CARD):
    """A copy of the model directory (its files linked), with `card` as README.md."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for entry in model_dir.iterdir():
        (src / entry.name).symlink_to(entry)
    if card is not None:
        (src / "README.md").write_bytes(card)
    return src


@pytest.mark.parametrize("flags", [[], ["--remote-code"], ["--official-layout"]])
def test_export_carries_the_model_card(tmp_path, model_dir, flags):
    src = source(tmp_path, model_dir)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out), *flags]) == 0
    assert (out / "README.md").read_bytes() == CARD
    assert not (out / "README.md").is_symlink()


def test_a_card_linked_inside_the_directory_or_into_a_hub_blob_store_is_carried(tmp_path, model_dir):
    src = source(tmp_path, model_dir, card=None)
    (src / "docs").mkdir()
    (src / "docs" / "card.md").write_bytes(CARD)
    (src / "README.md").symlink_to("docs/card.md")
    assert main(["export", "--model", str(src), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "README.md").read_bytes() == CARD
    # A hub snapshot: models--org--name/snapshots/REV/README.md -> ../../blobs/HASH
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0123abcd").write_bytes(CARD)
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for entry in model_dir.iterdir():
        (snapshot / entry.name).symlink_to(entry)
    (snapshot / "README.md").symlink_to(os.path.join("..", "..", "blobs", "0123abcd"))
    assert main(["export", "--model", str(snapshot), "--out", str(tmp_path / "out2")]) == 0
    assert (tmp_path / "out2" / "README.md").read_bytes() == CARD


def test_a_card_that_leads_out_or_is_no_regular_file_is_refused_before_writing(tmp_path, model_dir, capsys,
                                                                               monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for publishing")
    cases = {"outside": lambda card: card.symlink_to(secret), "fifo": lambda card: os.mkfifo(card),
             "directory": lambda card: card.mkdir(), "dangling": lambda card: card.symlink_to("missing.md")}
    for name, make in cases.items():
        src = source(tmp_path / name, model_dir, card=None)
        make(src / "README.md")
        out = tmp_path / name / "out"
        assert main(["export", "--model", str(src), "--out", str(out)]) != 0, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "README.md" in err and "Traceback" not in err, (name, err)
        assert not out.exists(), name  # refused before anything was written
    monkeypatch.setattr(export, "CONFIG_MAX_BYTES", len(CARD) - 1)  # (the bound on the read)
    src = source(tmp_path / "large", model_dir)
    with pytest.raises(ValueError, match="model card .*README.md has .* bytes, more than"):
        export.copy_companions(src, tmp_path / "large" / "out")
    assert not (tmp_path / "large" / "out").exists()


def test_without_a_card_none_is_made_and_one_already_in_out_stays(tmp_path, model_dir):
    """Nothing is generated; a README.md in --out (perhaps the user's own) is left, as notes.txt is."""
    src = source(tmp_path, model_dir, card=None)
    out = tmp_path / "out"
    assert main(["export", "--model", str(src), "--out", str(out)]) == 0
    assert not (out / "README.md").exists()
    (out / "README.md").write_text("mine")
    assert main(["export", "--model", str(src), "--out", str(out)]) == 0
    assert (out / "README.md").read_text() == "mine"
