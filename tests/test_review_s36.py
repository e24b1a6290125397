"""Found by reviewing this session's changes: what a crash in the middle of replacing a saved model leaves."""

from __future__ import annotations

import json
import os

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth import checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class Killed(BaseException):
    """The process dying at that point (SIGKILL, power loss): nothing after it runs."""


def _model(seed: int) -> rd.RecurrentDepthLM:
    cfg = rd.ModelConfig(vocab_size=50, hidden_size=16, num_heads=2, intermediate_size=24, prelude_layers=1,
                         core_layers=1, coda_layers=1, max_seq_len=32)
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(cfg)


def test_a_sharded_save_killed_once_its_index_is_in_place_loads_the_new_weights(tmp_path, monkeypatch):
    """`weight_files` loads model.safetensors before an index (as transformers), so a sharded save over a single-file
    model removed the old model.safetensors only after renaming its index into place: killed between the two, the
    directory held the new index, shards and config.json but loaded the old weights. Now the old file goes first."""
    out = tmp_path / "m"
    checkpoint.save_pretrained(_model(0), out)  # one model.safetensors
    new = _model(1)
    replace = os.replace

    def killed_after_the_index(src, dst):
        replace(src, dst)
        if os.path.basename(dst) == checkpoint.INDEX_NAME:
            raise Killed

    monkeypatch.setattr(checkpoint.os, "replace", killed_after_the_index)
    with pytest.raises(Killed):
        checkpoint.save_pretrained(new, out, max_shard_bytes=8000)
    loaded = checkpoint.read_state_dict(out)
    assert (out / checkpoint.INDEX_NAME).is_file()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in new.state_dict().items() if name in loaded)
    assert set(loaded) >= {"transformer.wte.weight"}


def test_a_sharded_save_over_shards_of_the_same_names_killed_midway_loads_the_old_model_whole(tmp_path, monkeypatch):
    """A sharded save over a sharded model of as many shards renamed its shards over the old ones of the same names
    one by one: killed after the first, the old index loaded one new shard and the other old ones (neither model).
    Now such a save's shards take other names (the index names them), so the old model loads whole until the new
    index arrives; the next save takes the first names again."""
    out = tmp_path / "m"
    old = _model(0)
    checkpoint.save_pretrained(old, out, max_shard_bytes=8000)
    replace = os.replace

    def killed_after_the_first_shard(src, dst):
        replace(src, dst)
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.os, "replace", killed_after_the_first_shard)
        with pytest.raises(Killed):
            checkpoint.save_pretrained(_model(1), out, max_shard_bytes=8000)
    loaded = checkpoint.read_state_dict(out)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in old.state_dict().items() if name in loaded)
    for seed in (2, 3):  # whole saves: each loads, and leaves only the shards its index names
        new = _model(seed)
        checkpoint.save_pretrained(new, out, max_shard_bytes=8000)
        loaded = checkpoint.read_state_dict(out)
        assert all(torch.equal(loaded[name], tensor) for name, tensor in new.state_dict().items() if name in loaded)
        named = set(json.loads((out / checkpoint.INDEX_NAME).read_text())["weight_map"].values())
        assert {p.name for p in out.glob("*.safetensors")} == named
