"""files.py's crash-safe writers: a target is replaced whole or left as it was."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from recurrent_depth.config import check_field_names
from recurrent_depth.files import TMP_SUFFIX, atomic_path, atomic_write_text
from recurrent_depth.train.optim import OptimConfig


def test_atomic_path_publishes_what_a_file_name_writer_wrote(tmp_path):
    target = tmp_path / "model.safetensors"
    with atomic_path(target) as tmp:
        assert tmp != target and not target.exists()  # nothing is visible under the name until the end
        save_file({"w": torch.arange(4.0)}, str(tmp))
    assert torch.equal(load_file(str(target))["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "run.json"
    atomic_write_text(target, "old\n")
    with pytest.raises(RuntimeError, match="disk gone"), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk gone")
    assert target.read_text() == "old\n"
    assert not (tmp_path / f"run.json{TMP_SUFFIX}").exists()


def test_check_field_names_names_the_unknown_keys_and_the_allowed_ones():
    check_field_names({"lr": 1.0}, OptimConfig, "optim field(s)")  # known: no error
    expected = r"^unknown optim key\(s\) \['lrx'\] \('lrx': did you mean 'lr'\?\); known: \[.*'preset'.*\]$"
    with pytest.raises(ValueError, match=expected):
        check_field_names({"lrx": 1.0}, OptimConfig, "optim key(s)", listed_as="known", extra=("preset",))
