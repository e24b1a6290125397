"""Found by a families x post-training matrix hunt (Huginn, Ouro, Parcae, a retrofitted Llama x train --init-from,
sft, --lora, --lora --weights int8 / int4, rl with and without --lora): what each family's special parts do under
post-training, and the refusals that name them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.train.lora import LoraSpec, target_modules

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = dict(vocab_size=288, bos_token_id=256, eos_token_id=257, pad_token_id=261)


def ouro() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", **IDS))


def parcae() -> rd.RecurrentDepthLM:
    torch.manual_seed(7)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset(
        "parcae-140m", hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128, prelude_layers=1,
        core_layers=1, coda_layers=1, mean_recurrence=4, mean_backprop_depth=2, max_seq_len=256, value_embeddings=(),
        **IDS))


@pytest.mark.parametrize("family, injection", [("ouro", "none"), ("parcae", "DiagonalInjection")])
def test_an_adapter_only_lora_says_the_family_has_no_linear_injection(family, injection):
    """`--lora-parts adapter` on Parcae (diagonal injection) or Ouro (no injection) was refused as selecting "no
    linear layer of this model (it has 1 prelude, 1 core and 1 coda layers)": true, but it named no reason, and the
    docs' own example `--lora-parts core,adapter` trains the adapter on Huginn."""
    model = ouro() if family == "ouro" else parcae()
    with pytest.raises(ValueError, match=rf"its input injection is {injection}, no linear layer, so the adapter "
                                         r"part is empty\)$"):
        target_modules(model, LoraSpec(parts=("adapter",)))
    # the default spec still adapts every block's linear layers (the injection has none to add)
    assert target_modules(model, LoraSpec()) and "transformer.adapter" not in target_modules(model, LoraSpec())


def test_rdepth_sft_refuses_an_adapter_only_lora_on_parcae_in_one_line(tmp_path, capsys):
    pytest.importorskip("peft")
    start = tmp_path / "parcae"
    parcae().save_pretrained(start)
    byte_tokenizer().save(str(start / "tokenizer.json"))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    code = main(["sft", "--init-from", str(start), "--data", str(data), "--out", str(tmp_path / "run"), "--lora",
                 "--lora-parts", "adapter", "--max-steps", "1", "--batch-size", "2", "--seq-len", "16",
                 "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("rdepth sft: error: ") and "DiagonalInjection, no linear layer" in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not (Path(tmp_path / "run") / "model").exists()
