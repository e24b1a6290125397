"""Issue 33 item 13: transformers' `from_pretrained` through our classes runs the library's bounded
checks of a model directory (`checkpoint.check_model_dir`) before transformers reads a tensor."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import recurrent_depth as rd
from recurrent_depth.integrations.hf import RecurrentDepthForCausalLM
from recurrent_depth.integrations.hf_config import RecurrentDepthConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clean_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("clean")
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).save_pretrained(path)
    return path


def hostile(clean_dir, tmp_path, case: str):
    d = tmp_path / case
    shutil.copytree(clean_dir, d)
    config = json.loads((d / "config.json").read_text())
    if case == "index-outside":  # (model.safetensors removed: beside it the index is not read, as in transformers)
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../outside.safetensors"}}))
    elif case == "config-too-large":
        (d / "config.json").write_text(json.dumps({**config, "pad": "x" * (17 << 20)}))
    elif case == "weights-to-dev-zero":
        (d / "model.safetensors").unlink()
        os.symlink("/dev/zero", d / "model.safetensors")
    elif case == "layers-differ-from-weights":
        (d / "config.json").write_text(json.dumps({**config, "core_layers": 3}))
    elif case == "deeply-nested-config":
        (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif case == "config-is-a-fifo":
        (d / "config.json").unlink()
        os.mkfifo(d / "config.json")
    return d


# Before: the first two loaded (the index and the size ignored), the third was transformers' "no file
# named model.safetensors", the fourth loaded with a randomly initialised third core layer.
AUTO_CASES = {
    "index-outside": "lies outside",
    "config-too-large": "more than the 16,777,216 allowed",
    "weights-to-dev-zero": r"\(a symlink to /dev/zero\) is not a regular file",
    "layers-differ-from-weights": "config.json core_layers=3 but the weights hold 2 core_block layers",
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_model_refuses_what_the_library_refuses(clean_dir, tmp_path, case):
    d = hostile(clean_dir, tmp_path, case)
    with pytest.raises(ValueError, match=AUTO_CASES[case]):
        rd.RecurrentDepthLM.from_pretrained(d)
    with pytest.raises(ValueError, match=AUTO_CASES[case]):
        AutoModelForCausalLM.from_pretrained(d)


# transformers' AutoConfig reads config.json itself to choose the class (documented in the README);
# our classes' own from_pretrained read it bounded first.
CONFIG_CASES = {"deeply-nested-config": "nested too deeply", "config-is-a-fifo": "is not a regular file"}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_our_classes_read_config_json_bounded(clean_dir, tmp_path, case):
    d = hostile(clean_dir, tmp_path, case)
    for load in (RecurrentDepthConfig.from_pretrained, RecurrentDepthForCausalLM.from_pretrained):
        with pytest.raises(ValueError, match=CONFIG_CASES[case]):
            load(d)


def test_a_clean_directory_still_loads(clean_dir):
    assert isinstance(AutoModelForCausalLM.from_pretrained(clean_dir), RecurrentDepthForCausalLM)


def test_transformers_route_refuses_a_parcae_directory_in_one_line():
    """A Parcae directory passes the library's checks (its names are mapped), but transformers would load its
    tensors under Parcae's names: refused, pointing to RecurrentDepthLM.from_pretrained (docs/looped-family.md)."""
    with pytest.raises(ValueError, match="Parcae directory") as info:
        RecurrentDepthForCausalLM.from_pretrained(Path(__file__).parent / "goldens" / "parcae" / "released-layout")
    assert "\n" not in str(info.value)
