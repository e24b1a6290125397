"""Newer inputs a user hands us, under attack: LoRA adapter directories, and the other files below.
Each malformed or hostile file is a one-line error naming it (no traceback, no hang, no huge allocation,
no silent wrong result)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

import recurrent_depth as rd


def tiny_model(seed: int = 0) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"))).eval()


# ---------------------------------------------------------------------------------------- LoRA adapters
@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    pytest.importorskip("peft")
    from recurrent_depth.train.lora import LoraSpec, add_lora, save_adapter

    path = tmp_path_factory.mktemp("adapter") / "adapter"
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=4, parts=("core",)), seed=0), path)
    return path


def _config(**changes):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return edit


def _tensors(change):
    def edit(path):
        from safetensors.torch import load_file, save_file

        file = str(path / "adapter_model.safetensors")
        save_file(change(load_file(file)), file)
    return edit


def _replace_weights(make):
    def edit(path):
        (path / "adapter_model.safetensors").unlink()
        make(path / "adapter_model.safetensors")
    return edit


@pytest.mark.parametrize("damage, message", [
    (_config(r="4"), r"r='4' is invalid"),                          # was a TypeError traceback
    (_config(r=10**9), r"rank 1000000000 is larger than any lora_A"),  # was a 256 GB allocation
    (_config(lora_alpha="x"), r"lora_alpha='x' is invalid"),        # was a TypeError traceback
    (_config(lora_alpha=float("nan")), r"lora_alpha=nan is invalid"),  # generated garbage
    (_config(target_modules=5), r"target_modules=5 is invalid"),    # was a TypeError traceback
    (_config(peft_type="IA3"), r"peft_type='IA3' is invalid"),
    (lambda p: (p / "adapter_config.json").write_text("[1]"), "is not a JSON object"),  # was a TypeError
    (_replace_weights(lambda f: os.mkfifo(f)), "is not a regular file"),               # hung
    (_replace_weights(lambda f: os.symlink("/dev/zero", f)), "is not a regular file"),  # SafetensorError
    (_replace_weights(lambda f: None), "has no adapter_model.safetensors"),  # looked the path up on the Hub
    (_replace_weights(lambda f: torch.save({}, f.with_suffix(".bin"))), "a pickle"),  # was unpickled
    (_tensors(lambda t: dict(list(t.items())[:3])), r"lacks \d+ of the \d+ tensors"),  # ran as the base model
    (_tensors(lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()}), "holds NaN or inf"),
    (_tensors(lambda t: {**t, "base_model.model.transformer.wte.weight": torch.zeros(256, 64)}),
     "does not use"),                                                # silently ignored
    (_tensors(lambda t: {k: v.to(torch.int32) for k, v in t.items()}), "is I32, not floating point"),
])
def test_a_damaged_lora_adapter_is_one_line_naming_it(adapter_dir, tmp_path, damage, message):
    from recurrent_depth.train.lora import load_lora

    path = tmp_path / "adapter"
    shutil.copytree(adapter_dir, path)
    damage(path)
    with pytest.raises(ValueError, match=message) as info:
        load_lora(tiny_model(), path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_the_intact_adapter_still_loads(adapter_dir):
    from recurrent_depth.train.lora import load_lora

    assert load_lora(tiny_model(), adapter_dir) is not None


# ---------------------------------------------------------------------------------------- tokenizer files copied
def test_average_refuses_a_huge_tokenizer_file_instead_of_copying_it(tmp_path, capsys):
    # (a symlink to /dev/zero was copied until the disk was full: the same bounded read refuses it, but a
    # test of that would fill the disk wherever the fix is missing)
    from recurrent_depth.cli import main

    model = tiny_model()
    for name in ("a", "b"):
        model.save_pretrained(tmp_path / name)
    (tmp_path / "a" / "tokenizer_config.json").write_text("{}")
    with open(tmp_path / "huge", "wb") as handle:  # sparse: no disk used; the copy wrote 300 MB
        handle.truncate(300 << 20)
    os.symlink(tmp_path / "huge", tmp_path / "b" / "tokenizer_config.json")
    message = "more than the 268,435,456 allowed"
    code = main(["average", "--checkpoints", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "avg")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and "tokenizer_config.json" in err[-1]
    assert not (tmp_path / "avg" / "tokenizer_config.json").exists()
    assert not (tmp_path / "avg" / "model.safetensors").exists()  # no weights without their tokenizer


# ---------------------------------------------------------------------------------------- YAML configs
def _laughs(levels: int) -> str:
    """A YAML list of 9 ** levels values once its aliases are expanded, in a few hundred bytes."""
    defs = ["&a0 [x,x,x,x,x,x,x,x,x]"] + [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"[{', '.join(defs)}]"


def test_a_billion_laughs_training_config_is_refused_when_read(tmp_path):
    # 9 ** 10 values (3.5 billion): `rdepth train --config` never finished, growing in memory
    from recurrent_depth.train.config import read_yaml

    path = tmp_path / "train.yaml"
    path.write_text(f"seed: {_laughs(10)}\n")
    with pytest.raises(ValueError, match=r"train.yaml'.*more than 1,000,000 values once its aliases"):
        read_yaml(path)


def test_a_billion_laughs_sweep_file_is_refused_naming_it(tmp_path):
    from recurrent_depth.scaling.sweep import load_sweep

    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {{}}\ngrid:\n  seed: [{_laughs(7)}]\ntest_depths: [1]\n")  # (9 ** 7: finite before)
    with pytest.raises(ValueError, match=r"sweep config .*sweep.yaml'.*more than 1,000,000 values"):
        load_sweep(path)


def test_yaml_aliases_within_the_bound_still_load(tmp_path):
    from recurrent_depth.train.config import load_yaml

    assert load_yaml("a: &x [1, 2]\nb: *x\nc: &y [*y]\n")["b"] == [1, 2]


# ---------------------------------------------------------------------------------------- distillation caches
class _Rows:
    """What CachedTeacher reads of a ShardDataset: row_len, len() and rows(indices)."""

    row_len = 5

    def __init__(self):
        self.data = np.arange(3 * self.row_len, dtype=np.int64).reshape(3, self.row_len) % 7

    def __len__(self):
        return len(self.data)

    def rows(self, indices):
        return self.data[list(indices)]


def _cache(path, values=None, indices=None, **manifest_changes):
    from recurrent_depth.train.distill_cache import CACHE_FORMAT, CACHE_VERSION

    path.mkdir()
    np.save(path / "values_00000.npy", np.zeros((3, 4, 2), np.float16) if values is None else values)
    np.save(path / "indices_00000.npy", np.ones((3, 4, 2), np.int16) if indices is None else indices)
    manifest = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "data_key": "k", "num_rows": 3, "seq_len": 4,
                "top_k": 2, "vocab_size": 16, "index_dtype": "int16",
                "shards": [{"values": "values_00000.npy", "indices": "indices_00000.npy", "num_rows": 3}]}
    manifest.update(manifest_changes)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _batch(dataset):
    rows = torch.from_numpy(dataset.rows([0, 2]))
    return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}


@pytest.mark.parametrize("changes", [dict(shards=5), dict(shards=["x"]),
                                     dict(shards=[{"values": "v", "indices": "i", "num_rows": [3]}])])
def test_a_distill_cache_manifest_with_malformed_shards_is_one_line(tmp_path, changes):
    from recurrent_depth.train.distill_cache import CachedTeacher

    path = _cache(tmp_path / "cache", **changes)  # (KeyError / TypeError tracebacks)
    with pytest.raises(ValueError, match="'shards' must be a list of objects"):
        CachedTeacher(path, _Rows(), top_k=2, vocab_size=16, data_key="k")


def test_a_distill_cache_shard_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    from recurrent_depth.train.distill_cache import CachedTeacher

    path = _cache(tmp_path / "cache")
    (path / "values_00000.npy").unlink()
    os.mkfifo(path / "values_00000.npy")  # np.load waited for a writer forever
    with pytest.raises(ValueError, match="values_00000.npy is not a regular file"):
        CachedTeacher(path, _Rows(), top_k=2, vocab_size=16, data_key="k")


@pytest.mark.parametrize("values, indices, message", [
    (None, np.full((3, 4, 2), 300, np.int16), r"token ids in \[300, 300\], outside the vocabulary \[0, 16\)"),
    (None, np.full((3, 4, 2), -1, np.int16), "outside the vocabulary"),  # both were a RuntimeError from the loss
    (np.full((3, 4, 2), np.nan, np.float16), None, "NaN or inf teacher logits"),
])
def test_damaged_distill_cache_contents_are_one_line(tmp_path, values, indices, message):
    from recurrent_depth.train.distill_cache import CachedTeacher

    dataset = _Rows()
    cache = CachedTeacher(_cache(tmp_path / "cache", values, indices), dataset, top_k=2, vocab_size=16, data_key="k")
    with pytest.raises(ValueError, match=message):
        cache.top(_batch(dataset))


def test_an_intact_distill_cache_reads_its_rows(tmp_path):
    from recurrent_depth.train.distill_cache import CachedTeacher

    dataset = _Rows()
    cache = CachedTeacher(_cache(tmp_path / "cache"), dataset, top_k=2, vocab_size=16, data_key="k")
    values, indices = cache.top(_batch(dataset))
    assert values.shape == indices.shape == (2, 4, 2) and int(indices.max()) == 1


# ---------------------------------------------------------------------------------------- retrofit sources
def test_retrofit_refuses_a_source_with_nan_weights(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from recurrent_depth.cli import main

    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2))
    with torch.no_grad():
        source.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    source.save_pretrained(tmp_path / "src")
    code = main(["retrofit", "--model", str(tmp_path / "src"), "--prelude", "1", "--core", "1:3", "--coda", "1",
                 "--out", str(tmp_path / "out")])  # wrote a NaN model without a word
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "model.layers.1.mlp.up_proj.weight" in err[-1] and "NaN or inf" in err[-1]
    assert not (tmp_path / "out").exists()
