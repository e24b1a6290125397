"""Issue 33 item 19: bounds checked before anything is allocated, and one-line errors that stay one short line
(a loop of a million layers or a billion passes, a 20 MB tensor name, a full disk that names no file)."""

from __future__ import annotations

import errno
import json
import struct

import numpy as np
import pytest

from recurrent_depth.data.shards import ShardWriter, TokenizedDocs
from recurrent_depth.files import atomic_write_bytes, parse_safetensors_header
from recurrent_depth.looping.config import MAX_ITERATIONS, LoopConfig, check_loopable_dir
from recurrent_depth.train.run_record import JsonlLog


def _llama_dir(tmp_path, **config):
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
            "vocab_size": 256, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


@pytest.mark.parametrize(("config", "message"), [
    ({"num_hidden_layers": 1e6}, "num_hidden_layers must be an integer in [1, 1,024], got 1000000.0"),
    ({"num_hidden_layers": 10**6}, "num_hidden_layers must be an integer in [1, 1,024], got 1000000"),
    ({"hidden_size": 100_000, "vocab_size": 8_000_000}, "more than this machine's"),
    ({"loop": {"start": 0, "end": 1, "iterations": 10**9}}, "the stored loop is invalid: LoopConfig.iterations "
                                                             "must be in [1, 256]"),
], ids=["float-layers", "million-layers", "too-large", "stored-iterations"])
def test_a_model_dir_the_loop_cannot_use_is_refused_in_one_line_before_transformers_builds_it(
        tmp_path, monkeypatch, config, message):
    import transformers

    from recurrent_depth.looping import from_pretrained

    def never(*args, **kwargs):
        raise AssertionError("transformers was asked to build the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    directory = _llama_dir(tmp_path, **config)
    with pytest.raises(ValueError, match="config.json") as err:
        from_pretrained(str(directory))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_loop_iterations_are_bounded(tmp_path):
    assert LoopConfig(0, 1, iterations=MAX_ITERATIONS).iterations == MAX_ITERATIONS
    with pytest.raises(ValueError, match=r"LoopConfig.iterations must be in \[1, 256\], got 1000000000"):
        LoopConfig(0, 1, iterations=10**9)
    check_loopable_dir(_llama_dir(tmp_path))  # a model this machine holds: accepted
    check_loopable_dir(tmp_path / "not-a-dir")  # a hub name: left to transformers


def _safetensors(path, header):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    return path


@pytest.mark.parametrize("header", [
    {"n" * 5_000_000: {"dtype": "F32"}},
    {"w": {"dtype": "F" * 5_000_000, "shape": [1], "data_offsets": [0, 4]}},
    {"n" * 5_000_000: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
], ids=["malformed-long-name", "long-dtype", "truncated-long-name"])
def test_a_huge_safetensors_header_gives_a_short_error_line(tmp_path, header):
    with pytest.raises(ValueError) as err:
        parse_safetensors_header(_safetensors(tmp_path / "model.safetensors", header))
    assert len(str(err.value)) < 500 and "\n" not in str(err.value)


def test_many_unexpected_tensors_are_listed_in_a_short_line(tmp_path):
    import torch
    from safetensors.torch import save_file

    import recurrent_depth as rd

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state.update({f"extra.{'x' * 1000}.{i}": torch.zeros(1) for i in range(200)})
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors") as err:
        rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert "and 195 more" in str(err.value) and len(str(err.value)) < 2000


# ------------------------------------------------------------------ a full disk names the file
class _FullDisk:
    """A file handle whose writes fail as on a full disk: an OSError with an errno and no file name."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


def test_a_full_disk_while_writing_shards_and_logs_names_the_file(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open

    def full_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return _FullDisk(handle) if "w" in mode or "a" in mode else handle

    log = JsonlLog(tmp_path / "metrics.jsonl")
    log.handle = _FullDisk(log.handle)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*metrics.jsonl'"):
        log.write({"step": 1})
    monkeypatch.setattr(builtins, "open", full_open)
    with (pytest.raises(OSError, match=r"No space left on device: '.*train-00000.bin'"),
          ShardWriter(tmp_path, "train", 4, np.uint16) as writer):
        writer.write_rows([np.arange(4)] * 2)
    assert not list(tmp_path.glob("train-*"))  # (the temporary file is removed)
    with pytest.raises(OSError, match=r"No space left on device: '.*docs.tokens'"):
        TokenizedDocs.write(tmp_path / "docs", [np.arange(3)], np.uint16)
    with pytest.raises(OSError, match=r"No space left on device: '.*dataset.json'"):
        atomic_write_bytes(tmp_path / "dataset.json", b"{}")
