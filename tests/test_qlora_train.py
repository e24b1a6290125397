"""QLoRA training: a LoRA adapter trained on int8 / int4 base weights (`LoraSpec(weights=...)`, `--lora --weights`).

The base is quantized before the adapter goes on and stays frozen; the adapters' gradients flow through the quantized
layers' input gradient and equal those of the same adapter over the dequantized float layers; the loss falls; the
adapter saved is an ordinary peft one (it loads onto the float model without AdapterBaseWarning, and onto a quantized
load); a run resumes exactly; `--weights` is refused without `--lora`."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth.train.batches import BatchSource
from recurrent_depth.train.lora import LoraSpec, add_lora, attach_adapter, lora_spec_from_args
from recurrent_depth.weight_quant import Int4WeightLinear, Int8WeightLinear, dequantize_weights

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = {"int8": Int8WeightLinear, "int4": Int4WeightLinear, "int4:g64": Int4WeightLinear}
STEPS = dict(num_steps=3, init_scale=0.0)


def tiny_model(seed: int = 0) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), hidden_size=64))


def batch(seed: int = 2, rows: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


class Counting(BatchSource):
    """Rows counting up from a random start (mod 256): learnable from the previous token."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = (torch.randint(0, 256, (batch_size, 1), generator=self.generator) + torch.arange(17)) % 256
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


@pytest.mark.parametrize("weights", ["int8", "int4:g64"])
def test_adapter_gradients_through_quantized_layers_equal_the_dequantized_float_ones(weights):
    spec = LoraSpec(rank=2, weights=weights)
    model = add_lora(tiny_model(), spec, seed=1)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    layer = model.get_base_model().transformer.core_block[0].attn.Wqkv
    assert type(layer.base_layer) is LAYERS[weights]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 after peft's init: values everywhere, so every A gets a gradient too
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    reference = copy.deepcopy(model)
    assert dequantize_weights(reference) > 0  # float layers holding the dequantized weights, the same adapter on them
    for name, param in reference.named_parameters():
        param.requires_grad_("lora_" in name)
    grads = []
    for m in (model, reference):
        ids = batch()
        logits = m(ids[:, :-1], **STEPS).logits
        F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if "lora_" in n})
    got, want = grads
    assert got.keys() == want.keys() and len(got) > 0
    # the prelude's adapters get theirs only through the core's and coda's quantized layers' input gradient
    prelude = [n for n in got if ".prelude." in n]
    assert prelude and all(want[n].abs().sum() > 0 for n in prelude)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5 * want[name].abs().max().item(),
                                   msg=name)


def train(tmp_path, out: str, weights: str | None, stop_after: int = 6, resume: bool = False, lr: float = 1e-2):
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer

    model = add_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base"), LoraSpec(rank=4, weights=weights),
                     base_dir=tmp_path / "base", seed=3)
    cfg = TrainConfig(batch_size=4, max_steps=6, save_every=3, out=str(tmp_path / out), progress=False,
                      tensorboard=False, resume=resume, mean_recurrence=2, backprop_depth=1, eval_interval=0,
                      optim=OptimConfig(name="adamw", lr=lr, weight_decay=0.0, warmup_steps=1))
    return Trainer(cfg, model=model, data=Counting(), log=lambda _: None,
                   stop_when=lambda t: "stopped" if t.state.step >= stop_after else None).run()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    tiny_model().save_pretrained(root / "base")
    return root


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_qlora_run_lowers_the_loss_saves_an_ordinary_adapter_and_resumes(base, weights):
    whole = train(base, f"whole-{weights}", weights)
    assert sum(whole.losses[-2:]) < sum(whole.losses[:2]) - 0.1, whole.losses
    trained = whole.model.get_base_model()
    assert type(trained.transformer.coda[0].mlp.fc.base_layer) is LAYERS[weights]  # trained on the quantized base
    ids = batch(rows=1)[:, :8]
    with torch.no_grad():
        want = trained.eval()(ids, **STEPS).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fingerprint of the float base: no AdapterBaseWarning
        on_float = attach_adapter(rd.RecurrentDepthLM.from_pretrained(base / "base"), whole.model_dir,
                                  strict_base=True)
        on_quantized = attach_adapter(rd.RecurrentDepthLM.from_pretrained(base / "base", weights=weights),
                                      whole.model_dir, strict_base=True)
    with torch.no_grad():
        torch.testing.assert_close(on_quantized.eval()(ids, **STEPS).logits, want, rtol=1e-5, atol=1e-5)
    adapter = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    assert adapter and all(torch.equal(on_float.get_parameter(n), p) for n, p in adapter.items())
    # the checkpoint's base is rebuilt (quantized again) from the base directory, and the run goes on exactly
    train(base, f"split-{weights}", weights, stop_after=3)
    saved = load_file(base / f"split-{weights}" / "checkpoints" / "step-00000003" / "model.safetensors")
    assert saved.keys() == {n for n, p in whole.model.named_parameters() if p.requires_grad}  # the adapter alone
    changed = rf"configuration changed \(lora: .* modules of {weights}\S* weights -> .* modules\)"
    with pytest.raises(ValueError, match=changed):  # (a float base instead of the quantized one)
        train(base, f"split-{weights}", None, resume=True)
    resumed = train(base, f"split-{weights}", weights, resume=True)
    assert resumed.losses == whole.losses[3:]
    for name, param in whole.model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, resumed.model.get_parameter(name)), name


def test_weights_is_refused_without_lora_and_when_invalid():
    from recurrent_depth.cli import build_parser

    parser = build_parser()
    for command in (["train"], ["sft"], ["rl", "--init-from", "m", "--out", "o"]):
        args = parser.parse_args([*command, "--weights", "int4"])
        with pytest.raises(ValueError, match=r"^--weights int4 trains a LoRA adapter on quantized base weights "
                                             r".*: add --lora \(or leave --weights out\)$"):
            lora_spec_from_args(args)
        assert lora_spec_from_args(parser.parse_args([*command, "--lora", "--weights", "int4:g64"])).weights == \
            "int4:g64"
    with pytest.raises(ValueError, match=r"^weights='int3' is invalid: expected 'int8', 'int4'"):
        lora_spec_from_args(parser.parse_args(["train", "--lora", "--weights", "int3"]))


def test_the_cli_trains_an_adapter_on_int8_weights_that_merges_into_the_float_model(tmp_path, capsys):
    from recurrent_depth.checkpoint import copy_tokenizer
    from recurrent_depth.cli import main
    from recurrent_depth.data import build_tokenizer
    from recurrent_depth.train.lora import WEIGHTS_KEY, load_adapter_model, recorded_base
    from tests.train_support import VOCAB, write_corpus

    write_corpus(tmp_path / "corpus", num_docs=20)
    build_tokenizer(str(tmp_path / "corpus"), VOCAB, val_fraction=0.1, seed=0, out_dir=tmp_path / "tokenizer")
    base = tmp_path / "base"
    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).save_pretrained(base)
    copy_tokenizer(tmp_path / "tokenizer", base)
    train = ["train", "--data", str(tmp_path / "corpus"), "--max-steps", "2", "--seq-len", "16", "--batch-size", "2",
             "--no-progress", "--no-tensorboard", "--eval-batches", "1", "--eval-depths", "1", "--threads", "1",
             "--init-from", str(base)]
    assert main([*train, "--weights", "int8", "--out", str(tmp_path / "x")]) == 2
    assert "--weights int8 trains a LoRA adapter on quantized base weights" in capsys.readouterr().err
    assert main([*train, "--lora", "--weights", "int8", "--lora-rank", "2", "--out", str(tmp_path / "run")]) == 0
    adapter = tmp_path / "run" / "model"
    assert recorded_base(adapter)[WEIGHTS_KEY] == "int8"  # what it was trained on, beside the float base's fingerprint
    assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    merged = rd.RecurrentDepthLM.from_pretrained(tmp_path / "merged")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = load_adapter_model(adapter, merge=True, strict_base=True)
    for name, param in expected.named_parameters():
        assert torch.equal(param, merged.get_parameter(name)), name
