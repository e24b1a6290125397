"""LoRA adapters on int8 / int4 weights (QLoRA-style, unmerged: `train.lora.on_quantized_layers`, peft's LoRA layer
over `weight_quant`'s layers), as peft + bitsandbytes and vLLM serve them.

Reference: the same adapter on the model whose linear layers hold the dequantized weights (float), token for token
and to the quantized kernels' rounding in the logits, through the fused runner and the eager one; a mixed batch
equals each adapter alone; `rdepth generate` / `rdepth serve` (--lora, --lora-modules, --lora-updates-root) take
them with --weights. DoRA and merging into quantized weights are refused in one line."""

from __future__ import annotations

import copy
import json
import shutil
import socket
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import recurrent_depth as rd
from recurrent_depth.accel.runner import FastRunner
from recurrent_depth.cli import main
from recurrent_depth.data.tokenizer import load_tokenizer
from recurrent_depth.inference import generate
from recurrent_depth.inference.runner import make_runner
from recurrent_depth.serving.adapters import ServedAdapters
from recurrent_depth.train.lora import LoraSpec, add_lora, attach_adapter, load_lora, merge_lora, save_adapter
from recurrent_depth.weight_quant import Int4WeightLinear, Int8WeightLinear, dequantize_weights, quantize_weights
from tests.test_serve_mixed_lora import run as run_jobs
from tests.test_serving import model_dir  # noqa: F401 - fixtures

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[5, 17, 33, 2, 40]])
GEN = dict(max_new_tokens=6, num_steps=3, init_scale=0.0, output_logits=True)
LAYERS = {"int8": Int8WeightLinear, "int4": Int4WeightLinear}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):  # noqa: F811 - the fixture
    """Two adapters of the tiny float base that share layers (the core's, the recurrence adapter's), random A, B."""
    out = tmp_path_factory.mktemp("qlora_adapters")
    for i, (name, spec) in enumerate({"a": LoraSpec(rank=2, parts=("core", "adapter")),
                                      "b": LoraSpec(rank=4, alpha=4, parts=("adapter", "core", "coda"))}.items()):
        wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(model_dir), spec, base_dir=model_dir)
        g = torch.Generator().manual_seed(20 + i)
        with torch.no_grad():
            for param_name, param in wrapped.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.3)
        save_adapter(wrapped, out / name)
    return {"a": out / "a", "b": out / "b"}


def runner_logits(runner, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Logits `[B, T, V]` of `ids` after `steps` core steps from a zero state, through `runner` (no cache)."""
    with torch.no_grad():
        step = runner.context(ids, None, None)
        e = runner.embed(ids, step)
        return runner.predict(runner.core_steps(torch.zeros_like(e), runner.inject(e), e, range(steps), step), step)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_an_adapter_on_quantized_weights_generates_as_the_dequantized_model_with_it(model_dir, adapters, weights):  # noqa: F811
    with warnings.catch_warnings():  # the quantized copy has its float base's fingerprint: no AdapterBaseWarning
        warnings.simplefilter("error")
        model = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir, weights=weights), adapters["b"],
                               strict_base=True, model_dir=model_dir)
    layer = model.transformer.core_block[0].attn.Wqkv
    assert type(layer.base_layer) is LAYERS[weights] and type(layer.lora_A["default"]) is nn.Linear
    assert isinstance(make_runner(model), FastRunner)  # the fused runner adds the terms to the quantized products
    reference = copy.deepcopy(model)
    assert dequantize_weights(reference) > 0  # the same adapter over float layers holding the dequantized weights
    want = generate(reference, PROMPT, fast=False, **GEN)
    for fast in (True, False):
        got = generate(model, PROMPT, fast=fast, **GEN)
        assert torch.equal(got.sequences, want.sequences), fast
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    plain = generate(rd.RecurrentDepthLM.from_pretrained(model_dir, weights=weights), PROMPT, **GEN)
    assert (plain.logits - want.logits).abs().max() > 0.1  # the adapter changes what is computed


def test_quantizing_a_model_that_carries_an_adapter_quantizes_its_base_layers_only(model_dir, adapters):  # noqa: F811
    """`quantize_weights` after `attach_adapter` (the order a float model in hand takes) equals the other order:
    the adapters' lora_A / lora_B stay float (quantized, peft's forward failed reading their weight)."""
    later = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir), adapters["a"])
    assert quantize_weights(later, "int8") > 0
    pairs = [m for name, m in later.named_modules() if name.split(".")[-2:-1] in (["lora_A"], ["lora_B"])]
    assert pairs and all(type(m) is nn.Linear for m in pairs)
    first = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int8"), adapters["a"])
    for fast in (True, False):
        torch.testing.assert_close(runner_logits(make_runner(later, fast), PROMPT),
                                   runner_logits(make_runner(first, fast), PROMPT), rtol=0, atol=0)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_mixed_batch_on_quantized_weights_equals_each_adapter_alone(model_dir, adapters, weights):  # noqa: F811
    model = rd.RecurrentDepthLM.from_pretrained(model_dir, weights=weights)
    served = ServedAdapters(model, adapters, model_dir=model_dir)
    assert served.mixes
    ids = torch.tensor([[5, 17], [40, 41], [7, 9]])  # (6 rows a call: the C++ decode products)
    names = ["a", "b", None]
    for fast in (True, False):
        with served.rows.for_runner():
            runner = make_runner(model, fast)
        assert isinstance(runner, FastRunner) == fast
        with served.rows.use([served.peft_name(n) for n in names]):
            mixed = runner_logits(runner, ids)
        for row, name in enumerate(names):
            served.turn_on(served.peft_name(name))
            alone = runner_logits(make_runner(model, fast), ids[row:row + 1])
            torch.testing.assert_close(mixed[row:row + 1], alone, rtol=1e-4, atol=1e-5)
        served.turn_on(None)
    assert not torch.allclose(mixed[0], mixed[2], atol=1e-2)  # (the adapters change the rows they run on)


def test_runtime_loads_and_unloads_on_quantized_weights(model_dir, adapters, tmp_path):  # noqa: F811
    shutil.copytree(adapters["a"], tmp_path / "a")
    model = rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int4")
    base = runner_logits(make_runner(model), PROMPT)
    served = ServedAdapters(model, {}, model_dir=model_dir, updates_root=tmp_path)
    want = runner_logits(make_runner(attach_adapter(rd.RecurrentDepthLM.from_pretrained(
        model_dir, weights="int4"), adapters["a"])), PROMPT)
    for _ in range(2):  # (after the last unload the layers are the quantized ones again, and take the next load)
        served.add("x", "a")
        served.turn_on(served.peft_name("x"))
        torch.testing.assert_close(runner_logits(make_runner(model), PROMPT), want, rtol=0, atol=0)
        served.drop(served.retire("x"))
        assert type(model.transformer.core_block[0].attn.Wqkv) is Int4WeightLinear
        torch.testing.assert_close(runner_logits(make_runner(model), PROMPT), base, rtol=0, atol=0)


def test_rdepth_generate_takes_lora_with_weights(model_dir, adapters, capsys):  # noqa: F811
    assert main(["generate", "--model", str(model_dir), "--lora", str(adapters["a"]), "--weights", "int4", "--json",
                 "--prompt", "def alpha", "--max-new-tokens", "5", "--num-steps", "3", "--init-scale", "0"]) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    model = attach_adapter(rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int4"), adapters["a"])
    ids = torch.tensor([load_tokenizer(model_dir).encode("def alpha").ids])
    assert tokens == generate(model, ids, max_new_tokens=5, num_steps=3, init_scale=0.0).token_lists()


def test_rdepth_serve_takes_lora_modules_and_runtime_loads_with_weights(model_dir, adapters, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """The apps `rdepth serve --weights int8` builds with --lora-modules and --lora-updates-root, and with --lora:
    adapter a's requests (in a batch beside b's and the base's rows), and those of its runtime-loaded copy, answer
    as the --lora server's."""
    apps = []
    monkeypatch.setattr("recurrent_depth.serving.transport.make_server",
                        lambda app, **kw: apps.append(app) or SimpleNamespace(run=lambda: None))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    shutil.copytree(adapters["a"], tmp_path / "a")
    serve = ["serve", "--model", str(model_dir), "--port", port, "--weights", "int8"]
    assert main([*serve, "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
                 "--lora-updates-root", str(tmp_path)]) == 0
    assert main([*serve, "--lora", str(adapters["a"])]) == 0
    assert "with LoRA adapters 'a', 'b' on int8 weights" in apps[0].state.banner("")
    multi, single = (app.state.scheduler for app in apps)
    for scheduler in (multi, single):
        scheduler.start()
    try:
        assert multi.load_adapter("c", "a").result(timeout=60) is None  # (POST /v1/load_lora_adapter's load)
        want = run_jobs(single, [None, None], [0, 1])
        got = run_jobs(multi, ["a", "c", "b", None, "a"], [0, 0, 0, 0, 1])
    finally:
        for scheduler in (multi, single):
            scheduler.stop()
    assert got[0] == got[1] == want[0] and got[4] == want[1]
    assert got[2][0] != want[0][0] and got[3][0] != want[0][0]  # (b and the base answer otherwise)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_new_adapter_on_quantized_weights_gets_the_dequantized_models_gradients(weights):
    """`add_lora` on a quantized model (the Python API; `rdepth train/sft` take no --weights): the quantized layers
    pass input gradients (their reference product under autograd), so the adapter trains as on the float layers
    holding the dequantized weights."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    quantize_weights(model, weights)
    reference = copy.deepcopy(model)
    dequantize_weights(reference)
    grads = []
    for base in (model, reference):
        wrapped = add_lora(base, LoraSpec(rank=2, parts=("core", "coda")), seed=0)
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
        wrapped(PROMPT, num_steps=2, init_scale=0.0).logits.logsumexp(-1).mean().backward()
        grads.append({name: p.grad for name, p in wrapped.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6)


def test_dora_and_merging_are_refused_on_quantized_weights_in_one_line(model_dir, tmp_path):  # noqa: F811
    import peft

    dora = tmp_path / "dora"
    peft.get_peft_model(rd.RecurrentDepthLM.from_pretrained(model_dir), peft.LoraConfig(
        r=2, target_modules=["Wqkv"], use_dora=True)).save_pretrained(dora)
    quantized = rd.RecurrentDepthLM.from_pretrained(model_dir, weights="int8")
    with pytest.raises(ValueError, match="onto int8 weights: it is a DoRA adapter") as caught:
        attach_adapter(quantized, dora)
    assert "\n" not in str(caught.value)
    assert not any(hasattr(m, "lora_A") for m in quantized.modules())  # the model as it was given
    with pytest.raises(ValueError, match="cannot go under the DoRA adapter on transformer"):
        quantize_weights(load_lora(rd.RecurrentDepthLM.from_pretrained(model_dir), dora).get_base_model(), "int8")

    adapter = tmp_path / "plain"
    save_adapter(add_lora(rd.RecurrentDepthLM.from_pretrained(model_dir), LoraSpec(rank=2, parts=("coda",))), adapter)
    wrapped = load_lora(quantized, adapter)
    for merge in (lambda: merge_lora(wrapped), wrapped.merge_and_unload):  # ours and peft's own
        with pytest.raises(ValueError, match=r"cannot merge a LoRA adapter into int8 weights .* merge it on the "
                                             r"float model") as caught:
            merge()
        assert "\n" not in str(caught.value)
