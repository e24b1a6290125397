"""Five gaps: LoRA parts a family lacks, an absurd LoRA alpha, one `remove_tree`, and `rdepth info`'s KV cache
under autoregressive decoding of sliding-window layers."""

import json
import os
import re

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data import prepare
from recurrent_depth.files import remove_tree
from recurrent_depth.inference import cache as cache_module
from recurrent_depth.inference import generate
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns
from recurrent_depth.train import checkpointing
from recurrent_depth.train.lora import MAX_LORA_SCALE, LoraSpec, check_adapter_files, target_modules


def parcae() -> rd.RecurrentDepthLM:
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(
        "parcae-140m", hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128, prelude_layers=1,
        core_layers=1, coda_layers=1, mean_recurrence=4, mean_backprop_depth=2, max_seq_len=64, value_embeddings=()))


def ouro() -> rd.RecurrentDepthLM:
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro"))


# ------------------------------------------------------------------ 1. LoRA parts the family lacks
@pytest.mark.parametrize("family, parts, lacking, has", [
    ("Parcae", ("core", "adapter"), "adapter", "prelude, core, coda"),
    ("Ouro", ("core", "adapter"), "adapter", "core"),
    ("Ouro", ("prelude", "core"), "prelude", "core"),
    ("Parcae", ("prelude", "adapter", "core", "coda"), "adapter", "prelude, core, coda"),
])
def test_a_named_lora_part_the_family_lacks_is_refused_in_one_line(family, parts, lacking, has):
    """`--lora-parts core,adapter` on Parcae or Ouro trained the core alone: the adapter part, which those
    families lack (their injection is no linear layer), was dropped in silence; so was Ouro's prelude."""
    model = parcae() if family == "Parcae" else ouro()
    with pytest.raises(ValueError, match=re.escape(f"LoRA parts={list(parts)} select no linear layer of the {lacking} "
                                                   f"part: this {family} model has none; choose from the parts it "
                                                   f"has: {has} (")) as caught:
        target_modules(model, LoraSpec(parts=parts))
    assert "\n" not in str(caught.value)
    # the default is every part the model has: the same layers as naming those parts
    chosen = target_modules(model, LoraSpec())
    assert chosen == target_modules(model, LoraSpec(parts=tuple(has.split(", "))))
    assert "transformer.adapter" not in chosen


def test_the_lora_parts_flag_default_is_every_part_the_model_has(tiny_model):
    from argparse import ArgumentParser

    from recurrent_depth.train.lora import add_lora_arguments, lora_spec_from_args

    parser = ArgumentParser()
    add_lora_arguments(parser)
    spec = lora_spec_from_args(parser.parse_args(["--lora"]))
    assert spec is not None and spec.parts is None
    assert "transformer.adapter" in target_modules(tiny_model, spec)  # (Huginn's linear adapter)
    assert target_modules(parcae(), spec)  # (no adapter: the other parts, no refusal)
    named = lora_spec_from_args(parser.parse_args(["--lora", "--lora-parts", "core,adapter"]))
    with pytest.raises(ValueError, match="of the adapter part: this Parcae model has none"):
        target_modules(parcae(), named)


# ------------------------------------------------------------------ 2. an absurd LoRA alpha
@pytest.mark.parametrize("alpha", [1e308, 8 * MAX_LORA_SCALE * 1.01])
def test_a_lora_alpha_whose_scale_is_absurd_is_refused(alpha):
    """alpha=1e308 passed (finite) and made every output inf."""
    with pytest.raises(ValueError, match=re.escape(f"LoRA alpha={alpha!r} is invalid: it scales the adapter's update "
                                                   "by ")):
        LoraSpec(rank=8, alpha=alpha)
    assert LoraSpec(rank=8, alpha=8 * MAX_LORA_SCALE).alpha == 8 * MAX_LORA_SCALE  # (the bound itself passes)


def test_the_cli_refuses_an_absurd_lora_alpha_in_one_line(tmp_path, capsys):
    code = main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--lora", "--init-from",
                 str(tmp_path), "--lora-alpha", "1e308", "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("rdepth train: error: LoRA alpha=1e+308 is invalid: it scales"), err
    assert not any("Traceback" in line for line in err)


def _adapter_dir(tmp_path, **config):
    """An adapter directory whose config holds `config` over a valid one (the weights are not read first)."""
    from safetensors.torch import save_file

    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "target_modules": ["transformer.core_block.0.attn.Wqkv"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **config}))
    save_file({"base_model.model.transformer.core_block.0.attn.Wqkv.lora_A.weight": torch.zeros(4, 8)},
              tmp_path / "adapter_model.safetensors")
    return tmp_path


@pytest.mark.parametrize("config, field", [
    ({"lora_alpha": 1e308}, "lora_alpha"),
    ({"lora_alpha": 3e4, "use_rslora": True}, "lora_alpha"),  # 3e4 / sqrt(4) = 1.5e4
    ({"alpha_pattern": {"core_block.0": 1e300}}, "alpha_pattern"),
])
def test_an_adapter_config_with_an_absurd_alpha_is_refused(tmp_path, config, field):
    """A handed adapter_config.json went through the same finite check only: lora_alpha 1e308 loaded."""
    path = _adapter_dir(tmp_path, **config)
    with pytest.raises(ValueError, match=rf"adapter_config.json: {field}=.* is invalid: it scales"):
        check_adapter_files(path)
    check_adapter_files(_adapter_dir(tmp_path, lora_alpha=1.9e4, use_rslora=True))  # 9.5e3: within the bound


# ------------------------------------------------------------------ 3. one remove_tree
def test_remove_tree_is_the_one_both_writers_use(tmp_path):
    assert prepare.remove_tree is remove_tree and checkpointing.remove_tree is remove_tree
    assert not hasattr(prepare, "_remove_tree") and not hasattr(checkpointing, "_remove_tree")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("x")
    target = tmp_path / "target"
    target.mkdir()
    (target / "kept").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    for path in (tree, link, tmp_path / "file"):
        if path.name == "file":
            path.write_text("x")
        remove_tree(path)
        assert not os.path.lexists(path)
    assert (target / "kept").exists()  # a link loses only itself
    with pytest.raises(FileNotFoundError):
        remove_tree(tmp_path / "missing")
    remove_tree(tmp_path / "missing", ignore_errors=True)  # (data/prepare's tidying: a missing path is fine)


# ------------------------------------------------------------------ 4. info's KV cache under decoding
# A windowed store drops every W + 1 decoded columns; its allocation peaks (2W + REDUCED_WINDOW_ALIGN - 1 columns in
# bf16) at a drop on the last column of an alignment period: with W = 8 from a 4-token prompt, before column 112.
WINDOW, CONTEXT, PROMPT = 8, 112, 4


def windowed_config(windows: list) -> rd.ModelConfig:
    return rd.ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=96,
                          prelude_layers=1, core_layers=2, coda_layers=1, max_seq_len=CONTEXT, mean_recurrence=2,
                          attention_windows=windows)


def peak_store_bytes(monkeypatch, model, prompt, **options) -> dict[tuple, int]:
    """Each cache store's largest allocation (K and V bytes) over a greedy `generate` of `model` at its mean depth."""
    peak: dict[tuple, int] = {}
    write_rows = cache_module.StaticRecurrentCache.write_rows

    def recording(self, key, k, v):
        out = write_rows(self, key, k, v)
        for base, (K, V) in self.kv.items():
            peak[base] = max(peak.get(base, 0), K.nbytes + V.nbytes)
        return out

    monkeypatch.setattr(cache_module.StaticRecurrentCache, "write_rows", recording)
    generate(model, prompt, num_steps=model.config.mean_recurrence, init_scale=0.0, do_sample=False, **options)
    return peak


def test_info_prices_what_autoregressive_decoding_allocates(tmp_path, capsys, monkeypatch):
    """info priced a sliding-window layer's KV over the whole context, while autoregressive decoding holds
    O(W) columns of it: 4x the memory on this model. Its decode figure is the bytes a real bf16 cache allocates."""
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    config = windowed_config([WINDOW] * 4)
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config).to(torch.bfloat16).eval()

    prompt = torch.randint(0, 64, (1, PROMPT))
    peak = peak_store_bytes(monkeypatch, model, prompt, max_new_tokens=CONTEXT - PROMPT)
    assert set(peak) == {("prelude", 0), ("core", 0), ("core", 1), ("coda", 0)}
    assert info["cache_bytes_at_max_seq_len_bf16_autoregressive"] == sum(peak.values())
    bf16_columns = decoding_window_columns(WINDOW, torch.bfloat16)
    assert bf16_columns == 2 * WINDOW + cache_module.REDUCED_WINDOW_ALIGN - 1 < CONTEXT
    assert info["cache_bytes_at_max_seq_len_bf16"] == sum(peak.values()) * CONTEXT // bf16_columns


def test_info_keeps_the_full_context_figure_where_the_bound_is_off(tmp_path, capsys, monkeypatch):
    config = windowed_config([WINDOW, None, WINDOW, None])
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "2 layers: autoregressive decoding holds at most 2W+15 columns of each (2W+31 in bf16 / fp16" in text
    assert "; speculative and parallel decoding hold a round's drafts and 16 more" in text
    monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, "1")  # every column kept: the two figures agree, no window line
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cache_bytes_at_max_seq_len_bf16_autoregressive"] == info["cache_bytes_at_max_seq_len_bf16"]
    assert main(["info", "--model", str(tmp_path)]) == 0
    assert "sliding windows" not in capsys.readouterr().out
