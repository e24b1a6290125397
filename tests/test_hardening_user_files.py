"""Newer inputs a user hands us, under attack: LoRA adapter directories, and the other files below.
Each malformed or hostile file is a one-line error naming it (no traceback, no hang, no huge allocation,
no silent wrong result)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

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


def _metadata(metadata):
    """Set the weights file's safetensors __metadata__ to `metadata` (any JSON: safetensors writes only strings)."""
    def edit(path):
        file = path / "adapter_model.safetensors"
        raw = file.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = {**json.loads(raw[8:8 + length]), "__metadata__": metadata}
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        file.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length:])
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
    # the base fingerprint's metadata: were SafetensorError tracebacks naming no file, or (not strict) a warning
    # carrying the forged value whole (100 kB, a newline) instead of an error
    (_metadata({"base_model_fingerprint": 5}), r"__metadata__ is malformed \(expected an object of strings\)"),
    (_metadata(["rd1:0123456789abcdef"]), r"__metadata__ is malformed"),
    (_metadata({"base_model_fingerprint": "rd1:" + "a" * 100_000}),
     r"base_model_fingerprint='rd1:a+\.\.\. \(100,006 characters\) is invalid: expected rd1: and 16 hex"),
    (_metadata({"base_model_fingerprint": "rd1:0123456789abcdef\nforged"}), r"base_model_fingerprint=.* is invalid"),
    (_metadata({"base_model_fingerprint": "rd1:0123456789abcdef", "base_model_dtype": "float16" + "x" * 100_000}),
     r"base_model_dtype='float16x+\.\.\. \(100,009 characters\) is invalid: expected a dtype name"),
    # the recorded base directory: a NUL byte was a bare "embedded null byte" after the adapter loaded onto the
    # model, a list a TypeError, megabytes a warning of megabytes
    (_config(base_model_name_or_path="base\0dir"), r"base_model_name_or_path='base\\x00dir' is invalid"),
    (_config(base_model_name_or_path=["base"]), r"base_model_name_or_path=\['base'\] is invalid"),
    (_config(base_model_name_or_path="b" * 100_000), r"base_model_name_or_path='b+\.\.\. \(100,002 characters\)"),
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


def test_a_disk_full_while_recording_the_base_fingerprint_leaves_peft_s_weights_file(tmp_path, monkeypatch):
    # the fingerprint was added by rewriting adapter_model.safetensors in place: a failed write truncated it
    pytest.importorskip("peft.peft_model")  # (imported before the patch: it keeps its own save_file, and writes)
    import safetensors.torch

    from recurrent_depth.train.lora import LoraSpec, add_lora, load_lora, recorded_base, save_adapter

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device")

    real_write_bytes = Path.write_bytes

    def full_disk_bytes(self, data):  # (the rewrite with the fingerprint writes the bytes `save` made)
        if "adapter_model" not in self.name:
            return real_write_bytes(self, data)
        real_write_bytes(self, b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    monkeypatch.setattr(Path, "write_bytes", full_disk_bytes)
    with pytest.raises(OSError, match="No space left"):
        save_adapter(add_lora(tiny_model(), LoraSpec(rank=2), seed=0), tmp_path / "adapter")
    monkeypatch.undo()
    assert recorded_base(tmp_path / "adapter") == {} and load_lora(tiny_model(), tmp_path / "adapter") is not None
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def test_a_fingerprint_of_another_scheme_and_a_base_recorded_as_a_list_in_an_adapter(adapter_dir, tmp_path):
    import warnings

    from recurrent_depth.train.lora import AdapterBaseWarning, load_adapter_model, load_lora, recorded_base

    path = tmp_path / "adapter"
    shutil.copytree(adapter_dir, path)
    _metadata({"base_model_fingerprint": "rd2:" + "z" * 1000})(path)  # a later recipe's: not compared, not refused
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterBaseWarning)
        load_lora(tiny_model(seed=1), path, strict_base=True)
    assert recorded_base(path) == {"base_model_fingerprint": "rd2:" + "z" * 1000}
    _config(base_model_name_or_path=["base"])(path)  # was a TypeError traceback
    with pytest.raises(ValueError, match=r"adapter_config.json: base_model_name_or_path=\['base'\] is invalid"):
        load_adapter_model(path)
    model = tiny_model()
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        load_lora(model, path)
    assert not any("lora_" in name for name, _ in model.named_parameters())  # refused before it loaded


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


# ---------------------------------------------------------------------------------------- Gemma / window fields
# Values that passed validation and then broke the model: a window past int64 (an OverflowError traceback at the
# first forward), a soft-cap or scalar that rounds to inf or 0 in float32 (NaN or all-zero logits, generated from
# without a word).
@pytest.mark.parametrize("field, value", [
    ("attention_windows", [10**30, None, None, None]), ("attention_windows", [2**31, None, None, None]),
    ("attn_logit_softcapping", 1e300), ("attn_logit_softcapping", 1e-300), ("final_logit_softcapping", 1e39),
    ("final_logit_softcapping", 1e-300), ("query_pre_attn_scalar", 1e300), ("query_pre_attn_scalar", 1e-300),
    ("query_pre_attn_scalar", 0.5),
])
def test_gemma_and_window_fields_out_of_range_are_one_line(field, value):
    with pytest.raises(ValueError, match=rf"^ModelConfig\.{field}=.* is invalid: expected .*\[") as info:
        rd.ModelConfig.from_preset("tiny", **{field: value})
    assert "\n" not in str(info.value)


def test_gemma_and_window_fields_at_their_bounds_give_finite_logits():
    from recurrent_depth.config import FLOAT32_MAX, FLOAT32_TINY, MAX_SEQ_LEN, QUERY_PRE_ATTN_SCALAR_RANGE

    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    for values in (dict(attn_logit_softcapping=FLOAT32_MAX, final_logit_softcapping=FLOAT32_TINY,
                        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR_RANGE[0], attention_windows=[MAX_SEQ_LEN] * 4),
                   dict(attn_logit_softcapping=FLOAT32_TINY, final_logit_softcapping=FLOAT32_MAX,
                        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR_RANGE[1])):
        torch.manual_seed(0)
        model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", **values)).eval()
        with torch.no_grad():
            assert torch.isfinite(model(ids, num_steps=2).logits).all(), values


def test_a_huge_mixer_options_window_is_one_line():
    with pytest.raises(ValueError, match=r"^attention window=10{30} is invalid"):  # (an OverflowError at forward)
        rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer_options={"window": 10**30}))


def test_a_model_dir_with_a_huge_window_is_one_line_in_the_cli(tmp_path, capsys):
    from recurrent_depth.cli import main

    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_windows": [10**30, None, None, None]}))
    code = main(["info", "--model", str(tmp_path)])  # accepted; `generate` then died in a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "ModelConfig.attention_windows=" in err[0]


def test_the_remote_code_file_refuses_windows_past_the_longest_context():
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    with pytest.raises(ValueError, match=r"^attention_windows=\[2147483648, None, None, None\] is invalid"):
        remote.RecurrentDepthConfig(attention_windows=[2**31, None, None, None])
    for bad in (10**30, 0, "8"):  # (unchecked: an OverflowError or a TypeError at the first forward)
        with pytest.raises(ValueError, match=r"^mixer_options window=.* is invalid"):
            remote.RecurrentDepthConfig(mixer_options={"window": bad})
    assert remote.RecurrentDepthConfig(mixer_options={"window": 8}).mixer_options == {"window": 8}


OURO_SLIDING = dict(model_type="ouro", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                    num_attention_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=8)


@pytest.mark.parametrize("changes, key", [
    ({"max_window_layers": 2.0}, "max_window_layers"),  # read as "no sliding layers"
    ({"max_window_layers": None}, "max_window_layers"),
    ({"use_sliding_window": "false", "max_window_layers": 0}, "use_sliding_window"),  # every layer slid
    ({"max_window_layers": 0, "sliding_window": 2**31}, "sliding_window"),
])
def test_ouro_sliding_window_keys_are_one_line_naming_the_key(changes, key):
    with pytest.raises(ValueError, match=rf"^Ouro config.json {key}"):
        rd.ModelConfig.from_dict({**OURO_SLIDING, **changes})


def test_ouro_sliding_layers_from_max_window_layers_still_load():
    config = rd.ModelConfig.from_dict({**OURO_SLIDING, "max_window_layers": 2})
    assert config.attention_windows == [None, None, 8, 8]


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_retrofit_refuses_a_gemma_without_query_pre_attn_scalar(model_type):
    # transformers' Gemma 2 / 3 cannot run it (None ** -0.5); converted with head_dim's scale instead
    from recurrent_depth.families.retrofit import Surgery, model_config

    hf = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              query_pre_attn_scalar=None)
    with pytest.raises(ValueError, match=f"^retrofit: cannot convert {model_type} with query_pre_attn_scalar=null"):
        model_config(hf, Surgery(1, (1, 3), 1))
    assert model_config({**hf, "query_pre_attn_scalar": 16}, Surgery(1, (1, 3), 1)).query_pre_attn_scalar == 16


# ---------------------------------------------------------------------------------------- a checkpoint's start record
@pytest.mark.parametrize("recorded", ["x", [], {}, {"identity": 5, "content": None},
                                      {"directory": "d" * 1_000_000, "identity": "i", "content": "c"}])
def test_a_malformed_start_in_a_checkpoint_is_one_line_naming_it(tmp_path, recorded):
    # a non-object was taken for "none recorded" (the check skipped), a bad object refused as "started from None",
    # a huge directory came back whole in the message
    from recurrent_depth.train.trainer_checkpoints import check_same_start

    start = {"directory": str(tmp_path / "model"), "identity": "a" * 64, "content": "b" * 64}
    with pytest.raises(ValueError, match=r"trainer_state.json records start=.*the checkpoint is damaged$") as info:
        check_same_start(tmp_path / "checkpoint", recorded, start)
    assert str(tmp_path / "checkpoint") in str(info.value) and len(str(info.value)) < 500
    check_same_start(tmp_path / "checkpoint", None, start)  # none recorded (a run from scratch): nothing to check
    check_same_start(tmp_path / "checkpoint", {**start, "identity": "moved"}, start)  # the same content


@pytest.mark.parametrize("teacher, write_batch_size, said", [
    ({"identity": "other", "directory": "d" * 1_000_000}, 4, r"it is the cache of teacher 'd+\.\.\. \(1,000,002 char"),
    ({"identity": "same", "depth": [0] * 300_000}, 4, r"at depth \[0, 0.*\.\.\. \(900,000 characters\), this run"),
    ({"identity": "same", "depth": 8, "seed": "s" * 1_000_000}, 4, r"with seed 's+\.\.\. \(1,000,002 characters\)"),
    ({"identity": "same", "depth": 8, "seed": 1}, "4" * 1_000_000, r"per batch of '4+\.\.\. \(1,000,002 characters\)"),
])
def test_a_distill_cache_manifest_with_malformed_teacher_values_is_written_again_in_one_short_line(
        tmp_path, teacher, write_batch_size, said):
    # the recorded values came back whole in the line (megabytes of log)
    from recurrent_depth.train.distill_cache import MANIFEST, teacher_change

    (tmp_path / MANIFEST).write_text(json.dumps({"teacher": teacher, "write_batch_size": write_batch_size}))
    info = {"identity": "same", "directory": str(tmp_path / "teacher"), "depth": 8, "seed": 1, "random_state": True}
    line = teacher_change(tmp_path, info, 4)
    assert line is not None and len(line) < 500 and re.search(said, line), line


# ---------------------------------------------------------------------------------------- export --remote-code
@pytest.mark.parametrize("text, message", [("[1, 2]", "is not a JSON object"), ('{"num_steps": ', "is not valid JSON")])
def test_remote_code_export_refuses_a_generation_config_that_is_no_object_before_writing(tmp_path, capsys, text,
                                                                                          message):
    # a JSON list was copied as it was: the copy's every from_pretrained was a TypeError in transformers
    from recurrent_depth.cli import main

    tiny_model().save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "generation_config.json").write_text(text)
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generation_config.json" in err[0] and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [[], ["--remote-code"]], ids=["plain", "remote-code"])
@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("[1, 2]"), "is not a JSON object"),
    (os.mkfifo, "is not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "is not a regular file"),
], ids=["list", "fifo", "dev-zero"])
def test_every_export_refuses_a_generation_config_it_cannot_copy_before_writing(tmp_path, capsys, argv, make,
                                                                                message):
    # a plain export copied a JSON list as it was, and any export left out a FIFO or a /dev/zero link without a word
    from recurrent_depth.cli import main

    tiny_model().save_pretrained(tmp_path / "src")
    make(tmp_path / "src" / "generation_config.json")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generation_config.json" in err[0] and message in err[0], err
    assert not (tmp_path / "out").exists()
