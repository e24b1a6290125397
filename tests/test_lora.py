"""LoRA through peft (train/lora.py): module choice, exactness at B = 0, merging, reload in transformers,
unmerged adapters on both decode runners, training through the Trainer, the CLI."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.accel.runner import FastRunner
from recurrent_depth.inference import generate
from recurrent_depth.inference.runner import ModelRunner, make_runner
from recurrent_depth.train.lora import (
    FINGERPRINT_KEY,
    PARTS,
    AdapterBaseWarning,
    LoraSpec,
    add_lora,
    base_fingerprint,
    load_adapter_model,
    load_lora,
    merge_lora,
    read_adapter_config,
    recorded_base,
    save_adapter,
    target_modules,
)

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = dict(num_steps=3, init_scale=0.0)


def tiny_model(seed: int = 0, **overrides) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(rd.ModelConfig.from_preset("tiny"), **overrides)
    return rd.RecurrentDepthLM(cfg).eval()


def randomise_adapters(model, std: float = 0.1, seed: int = 1) -> None:
    """B = 0 after peft's init: give every B (and A) values, so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * std)


def ids(seed: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------- the spec
@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=0), "rank=0"), (dict(rank=2.5), "rank=2.5"), (dict(alpha=0), "alpha=0"),
    (dict(dropout=1.0), "dropout=1.0"), (dict(parts=("core", "middle")), r"parts \['middle'\] unknown"),
    (dict(kinds=("attn",)), r"kinds \['attn'\] unknown"), (dict(parts=()), "parts is empty"),
])
def test_bad_specs_fail_with_one_line_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**kwargs)


def test_target_modules_are_the_exact_names_of_the_chosen_parts_and_kinds():
    model = tiny_model()  # 1 prelude, 2 core, 1 coda layers
    assert target_modules(model, LoraSpec(parts=("core",), kinds=("mlp",))) == [
        f"transformer.core_block.{j}.mlp.{name}" for j in (0, 1) for name in ("fc", "proj")]
    assert target_modules(model, LoraSpec(parts=("adapter", "coda"), kinds=("attention",))) == [
        "transformer.adapter", "transformer.coda.0.attn.Wqkv", "transformer.coda.0.attn.proj"]
    assert len(target_modules(model, LoraSpec())) == 1 + 4 * 4  # the adapter + 4 linears in each of 4 blocks
    with pytest.raises(ValueError, match="select no linear layer"):
        target_modules(tiny_model(prelude_layers=0), LoraSpec(parts=("prelude",)))


def test_a_model_without_an_input_adapter_such_as_ouro_takes_lora_on_its_core():
    """Ouro has no prelude, coda or adapter: the default spec chose its core layers, not an error saying
    the model has no recurrent-depth modules (`rdepth sft --init-from OURO --lora` failed that way)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=256)).eval()
    names = target_modules(model, LoraSpec())
    assert names and all(name.startswith("transformer.core_block.") for name in names)
    expected = model(ids(), **STEPS).logits
    wrapped = add_lora(model, LoraSpec(rank=2))
    randomise_adapters(wrapped)
    got = wrapped(ids(), **STEPS).logits
    assert torch.allclose(merge_lora(wrapped)(ids(), **STEPS).logits, got, atol=1e-5)
    assert not torch.allclose(got, expected)


# ---------------------------------------------------------------------------------------- exactness
def test_zero_initialised_B_equals_the_base_exactly():
    base = tiny_model()
    expected = base(ids(), **STEPS).logits
    wrapped = add_lora(tiny_model(), LoraSpec(rank=4))
    assert torch.equal(wrapped(ids(), **STEPS).logits, expected)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_merged_model_equals_base_plus_adapter_also_after_a_reload_through_peft_in_transformers(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tiny_model().save_pretrained(tmp_path / "base")
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base").eval(), LoraSpec(rank=4, alpha=8),
                       base_dir=tmp_path / "base")
    randomise_adapters(wrapped)
    layer = wrapped.get_base_model().transformer.core_block[1].mlp.fc
    w, a, b = layer.base_layer.weight.clone(), layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected_fc = w + (8 / 4) * b @ a
    unmerged = wrapped(ids(), **STEPS).logits
    save_adapter(wrapped, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        tmp_path / "base")

    merged = merge_lora(wrapped)
    assert type(merged) is rd.RecurrentDepthLM and type(merged.transformer.core_block[1].mlp.fc) is torch.nn.Linear
    torch.testing.assert_close(merged.transformer.core_block[1].mlp.fc.weight, expected_fc, rtol=1e-6, atol=1e-6)
    merged_logits = merged(ids(), **STEPS).logits
    torch.testing.assert_close(merged_logits, unmerged, rtol=1e-5, atol=1e-5)
    base_logits = rd.RecurrentDepthLM.from_pretrained(tmp_path / "base")(ids(), **STEPS).logits
    assert (merged_logits - base_logits).abs().max() > 0.1  # the adapter matters

    reloaded = load_adapter_model(tmp_path / "adapter", merge=True)  # the base found from adapter_config.json
    torch.testing.assert_close(reloaded(ids(), **STEPS).logits, merged_logits, rtol=1e-5, atol=1e-5)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(hf(ids(), **STEPS).logits, merged_logits, rtol=1e-5, atol=1e-5)
    hf_merged = hf.merge_and_unload()
    torch.testing.assert_close(hf_merged(ids(), **STEPS).logits, merged_logits, rtol=1e-5, atol=1e-5)


def test_an_adapter_trained_on_the_transformers_model_loads_onto_the_library_model(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_model().save_pretrained(tmp_path / "base")
    hf = add_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval(), LoraSpec(rank=2, parts=("coda",)),
                  base_dir=tmp_path / "base")
    randomise_adapters(hf)
    save_adapter(hf, tmp_path / "adapter")
    ours = load_adapter_model(tmp_path / "adapter")  # unmerged, on a RecurrentDepthLM
    torch.testing.assert_close(ours(ids(), **STEPS).logits, hf(ids(), **STEPS).logits, rtol=1e-6, atol=1e-6)
    merged = generate(load_adapter_model(tmp_path / "adapter", merge=True), ids(), max_new_tokens=6, **STEPS)
    # transformers' own loop with the adapter unmerged
    assert torch.equal(hf.generate(ids(), max_new_tokens=6, do_sample=False, **STEPS), merged.sequences)


def test_an_adapter_of_another_model_is_refused_in_one_line(tmp_path):
    wrapped = add_lora(tiny_model(), LoraSpec(rank=2, parts=("coda",)))
    save_adapter(wrapped, tmp_path / "adapter")
    with pytest.raises(ValueError, match="cannot load the LoRA adapter"):
        load_lora(tiny_model(coda_layers=0), tmp_path / "adapter")
    with pytest.raises(ValueError, match="not a LoRA adapter directory"):
        load_lora(tiny_model(), tmp_path)
    # what differs, after torch's header
    with pytest.raises(ValueError, match="cannot load the LoRA adapter .*: Error.*PeftModel: size mismatch"):
        load_lora(tiny_model(hidden_size=128, intermediate_size=352), tmp_path / "adapter")


@pytest.mark.parametrize("change, message", [
    # peft: "Target modules .*\.q_proj not found in the base model. Please check the target modules and try again."
    ({"target_modules": r".*\.q_proj"}, r"target_modules='\.\*\\\\\.q_proj' \(a regular expression, matched against "
                                         r"whole module names\) matches no linear layer of this model; this model's "
                                         r"linear layers are \['lm_head', 'transformer.adapter', "
                                         r"'transformer.coda.\{i\}.attn.Wqkv'"),
    ({"target_modules": ["q_proj", "v_proj"]}, r"target_modules=\['q_proj', 'v_proj'\] matches no linear layer"),
    ({"target_modules": "("}, r"target_modules='\(' is not a valid regular expression"),  # re.error: a traceback
    # peft: a bare KeyError "'base_model.model.lm_head.weight'"
    ({"modules_to_save": ["lm_head", "embed_tokens"]}, r"modules_to_save names \['embed_tokens'\], which this "
                                                        r"model does not have .*its modules are \['lm_head', "),
    ({"modules_to_save": ["transformer.ln_f"]}, r"its weights file lacks tensor 'base_model.model.transformer.ln_f"
                                                r".weight' \(adapter_config.json's modules_to_save="
                                                r"\['transformer.ln_f'\]"),
])
def test_foreign_target_modules_and_modules_to_save_are_one_line_errors_naming_ours(tmp_path, change, message):
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2, parts=("core",))), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match="cannot load the LoRA adapter .* onto this model: .*" + message) as info:
        load_lora(tiny_model(), tmp_path / "adapter")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_an_invalid_pattern_regex_is_one_line_and_leaves_the_model_as_given(tmp_path, field):
    """peft compiles rank_pattern / alpha_pattern keys while it puts its layers on the model: "([" was a re.error
    traceback, and the layers added before it stayed on the caller's model."""
    from recurrent_depth.inference.lora_layers import is_lora_layer

    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2, parts=("core",))), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, field: {"([": 2}}))
    model = tiny_model()
    with torch.no_grad():
        before = model(ids(), **STEPS).logits
    with pytest.raises(ValueError, match="^cannot load the LoRA adapter .* onto this model: ") as info:
        load_lora(model, tmp_path / "adapter")
    assert "\n" not in str(info.value)
    assert not any(is_lora_layer(m) for m in model.modules()) and "peft_config" not in vars(model)
    with torch.no_grad():
        assert torch.equal(model(ids(), **STEPS).logits, before)


def test_a_target_modules_regex_that_backtracks_exponentially_is_a_one_line_error_not_a_hang(tmp_path, monkeypatch):
    """`([\\w.]+)+Z` takes hours on a 35-character module name (here, then in peft's own matching)."""
    import time

    from recurrent_depth.train import lora

    monkeypatch.setattr(lora, "TARGET_REGEX_SECONDS", 0.2)
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2, parts=("core",))), tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": r"([\w.]+)+Z"}))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"target_modules='\(\[.*takes over 0.2 s to match this model's \d+ module "
                                         r"names \(a regular expression that backtracks exponentially\?\)") as info:
        load_lora(tiny_model(), tmp_path / "adapter")
    assert "\n" not in str(info.value) and time.perf_counter() - start < 5
    names = ["transformer.core_block.0.attn.Wqkv", "transformer.coda.0.mlp.proj"]
    assert lora._timed_matches([(r".*\.attn\..*", "fullmatch")], names, 1.0) == [{names[0]}]  # an ordinary one


def test_an_adapter_config_saying_all_linear_loads_onto_every_linear_layer_but_the_head(tmp_path):
    """peft's "all-linear" shorthand (a hand-written or peft-made config): refused as a regular expression that
    matches nothing, and peft alone would also target the library model's lm_head, which the adapter lacks."""
    wrapped = add_lora(tiny_model(), LoraSpec(rank=2, parts=PARTS))
    torch.manual_seed(0)
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # (B = 0 at init: the adapter would change nothing)
    save_adapter(wrapped, tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    assert not any("lm_head" in t for t in config["target_modules"])
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = load_lora(tiny_model(), tmp_path / "adapter")(ids, **STEPS).logits
        config_path.write_text(json.dumps({**config, "target_modules": "all-linear"}))
        got = load_lora(tiny_model(), tmp_path / "adapter")(ids, **STEPS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_trained_head_copy_applies_in_transformers_and_merges_into_a_directory_that_loads(tmp_path):
    """peft's modules_to_save=["lm_head"] on the transformers class: the wrapper's logits ignored the trained head
    (the core kept the old module), and merged models saved a tied config beside two different head tensors, a
    directory every loader refused ("lm_head.weight differs from transformer.wte.weight but the config ties them")."""
    import peft
    from transformers import AutoModelForCausalLM

    tiny_model().save_pretrained(tmp_path / "base")
    hf = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval(), peft.LoraConfig(
        r=2, target_modules=["Wqkv"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        hf.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.05)  # the trained copy of the head
        unmerged = hf(ids(), **STEPS).logits
        with hf.disable_adapter():
            base = hf(ids(), **STEPS).logits
    assert (unmerged - base).abs().max() > 0.1
    hf.save_pretrained(tmp_path / "adapter")
    library = load_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base").eval(), tmp_path / "adapter")
    torch.testing.assert_close(library(ids(), **STEPS).logits, unmerged, rtol=1e-6, atol=1e-6)

    hf.merge_and_unload().save_pretrained(tmp_path / "hf-merged")
    merge_lora(library).save_pretrained(tmp_path / "merged")
    for directory in ("hf-merged", "merged"):
        for load in (rd.RecurrentDepthLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
            again = load(tmp_path / directory).eval()
            assert not again.config.tie_embeddings
            torch.testing.assert_close(again(ids(), **STEPS).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_the_remote_code_model_merges_a_trained_head_copy_into_a_directory_that_loads(tmp_path):
    import peft

    from recurrent_depth.cli import main
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    tiny_model().save_pretrained(tmp_path / "base")
    assert main(["export", "--model", str(tmp_path / "base"), "--out", str(tmp_path / "rc"), "--remote-code"]) == 0
    hf = peft.get_peft_model(remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "rc").eval(),
                             peft.LoraConfig(r=2, target_modules=["Wqkv"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        hf.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.05)
        unmerged = hf(ids(), **STEPS).logits
    hf.merge_and_unload().save_pretrained(tmp_path / "merged")
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path / "merged").eval()  # was: "... but the config ties them"
    torch.testing.assert_close(again(ids(), **STEPS).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_an_adapter_saved_here_loads_with_peft_auto_peft_model_for_causal_lm(tmp_path):
    """save_adapter wrote no task type, so peft recorded our class as `auto_mapping` and AutoPeftModelForCausalLM
    refused it ("... 'recurrent_depth.model.recurrent' which is not in the import allowlist")."""
    import peft

    tiny_model().save_pretrained(tmp_path / "base")
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base").eval(), LoraSpec(rank=2),
                       base_dir=tmp_path / "base", seed=0)
    randomise_adapters(wrapped)
    save_adapter(wrapped, tmp_path / "adapter")
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        want = load_adapter_model(tmp_path / "adapter")(ids(), **STEPS).logits
        torch.testing.assert_close(auto(ids(), **STEPS).logits, want, rtol=1e-6, atol=1e-6)
        assert (want - wrapped.get_base_model()(ids(), **STEPS).logits).abs().max() < 1e-5


@pytest.mark.parametrize("targets", [["lm_head", "Wqkv"], ["wte", "Wqkv"]])
def test_merging_an_adapter_of_the_tied_head_or_embedding_changes_only_that_module(tmp_path, targets):
    """The head shares the embedding's weight and peft merges in place: merging an adapter of lm_head (peft's
    "all-linear" on the library model takes it) also added B A to the embedding, so the merged model (and
    `rdepth export --merge-lora`) computed other logits than the unmerged adapter (by 2.5 here)."""
    import peft

    tiny_model().save_pretrained(tmp_path / "base")
    wrapped = peft.get_peft_model(rd.RecurrentDepthLM.from_pretrained(tmp_path / "base").eval(),
                                  peft.LoraConfig(r=2, target_modules=targets))
    randomise_adapters(wrapped)
    with torch.no_grad():
        unmerged = wrapped(ids(), **STEPS).logits
    wrapped.save_pretrained(tmp_path / "adapter")
    merged = load_adapter_model(tmp_path / "adapter", base=tmp_path / "base", merge=True)
    torch.testing.assert_close(merged(ids(), **STEPS).logits, unmerged, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(again(ids(), **STEPS).logits, unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, message", [("PromptTuningConfig", "prompt tuning"),
                                             ("PrefixTuningConfig", "prefix tuning")])
def test_peft_prompt_learning_is_refused_in_one_line_naming_it(tmp_path, method, message):
    """peft's prompt tuning passes inputs_embeds and prefix tuning a filled DynamicCache: both were refused with
    messages naming neither (prefix tuning: "cache must be a RecurrentDepthCache", whatever the user had done)."""
    import peft

    from recurrent_depth.integrations.hf import from_library_model
    from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

    tiny_model().save_pretrained(tmp_path)
    for model in (from_library_model(tiny_model()), remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path)):
        tuned = peft.get_peft_model(model, getattr(peft, method)(task_type="CAUSAL_LM", num_virtual_tokens=2))
        with pytest.raises(ValueError, match=f"peft's .*{message}.*use LoRA") as info:
            tuned(ids(), **STEPS)
        assert "\n" not in str(info.value)


def test_a_lora_runs_checkpoint_given_as_a_model_says_what_it_is(tmp_path):
    """A LoRA run's checkpoint holds config.json and the peft wrapper's whole state (base_model.model.* names):
    loading it as a model said the config's layers were missing from the weights."""
    from safetensors.torch import save_file

    base = tiny_model()
    base.save_pretrained(tmp_path / "ckpt")
    wrapped = add_lora(base, LoraSpec(rank=2, parts=("coda",)))
    save_adapter(wrapped, tmp_path / "ckpt")
    save_file({k: v.clone() for k, v in wrapped.state_dict().items()}, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ValueError, match=r"peft LoRA wrapper's .*--lora on the command line") as caught:
        rd.RecurrentDepthLM.from_pretrained(tmp_path / "ckpt")
    assert "\n" not in str(caught.value)


def test_a_seeded_adapter_repeats_and_leaves_the_global_generator_alone():
    spec = LoraSpec(rank=2, parts=("core",))
    adapters = []
    for global_seed in (1, 2):  # whatever state the global generator is in, the seeded init is the same
        model = tiny_model()
        torch.manual_seed(global_seed)
        adapters.append(add_lora(model, spec, seed=5))
    first, second = adapters
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    model = tiny_model()
    state = torch.get_rng_state()
    add_lora(model, spec, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator did not move
    other = add_lora(tiny_model(), spec, seed=6)
    assert not all(torch.equal(a, b) for (n, a), (_, b) in zip(first.named_parameters(), other.named_parameters())
                   if "lora_A" in n)


def test_a_relative_base_directory_is_recorded_so_the_adapter_loads_from_anywhere(tmp_path, monkeypatch):
    tiny_model().save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained("base"), LoraSpec(rank=2), base_dir="base")
    randomise_adapters(wrapped)
    save_adapter(wrapped, "adapter")
    monkeypatch.chdir(tmp_path / "adapter")
    loaded = load_adapter_model(tmp_path / "adapter")
    torch.testing.assert_close(loaded(ids(), **STEPS).logits, wrapped(ids(), **STEPS).logits, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------- which base
def test_an_adapter_warns_when_loaded_onto_other_weights_of_the_same_shapes_and_strict_refuses(tmp_path):
    """An adapter loaded onto another model of the same shapes (another fine-tune) ran without a word: it records
    a fingerprint of its base's weights, the same whatever dtype (float32 / bfloat16) either side loads."""
    base, other, adapter = tmp_path / "base", tmp_path / "other", tmp_path / "adapter"
    tiny_model().save_pretrained(base)
    tiny_model(seed=1).save_pretrained(other)  # the same config: only the weights differ
    wrapped = add_lora(rd.RecurrentDepthLM.from_pretrained(base, dtype=torch.bfloat16), LoraSpec(rank=2),
                       base_dir=base, seed=0)
    randomise_adapters(wrapped)
    save_adapter(wrapped, adapter)
    recorded = recorded_base(adapter)[FINGERPRINT_KEY]
    assert re.fullmatch(r"rd1:[0-9a-f]{16}", recorded)
    assert base_fingerprint(rd.RecurrentDepthLM.from_pretrained(base)) == recorded  # (float32, as stored)
    assert base_fingerprint(rd.RecurrentDepthLM.from_pretrained(other)) != recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterBaseWarning)
        load_adapter_model(adapter, strict_base=True)  # its own base: silent
        load_lora(rd.RecurrentDepthLM.from_pretrained(base, dtype=torch.bfloat16), adapter)

    expected = (rf"the LoRA adapter {re.escape(str(adapter))} was trained on {re.escape(str(base))} \(weights "
                rf"fingerprint {recorded}\), but this model {re.escape(str(other))} has weights fingerprint rd1:")
    with pytest.warns(AdapterBaseWarning, match=expected + r".*another model of the same shapes"):
        load_adapter_model(adapter, base=other)
    with pytest.warns(AdapterBaseWarning, match=expected):  # merging warns as well
        load_adapter_model(adapter, base=other, merge=True)
    model = rd.RecurrentDepthLM.from_pretrained(other)
    with pytest.raises(ValueError, match=r"\(weights fingerprint rd1:.*; refused by the strict base check$"):
        load_lora(model, adapter, strict_base=True)
    assert not any("lora_" in name for name, _ in model.named_parameters())  # left as it was given
    with pytest.warns(AdapterBaseWarning, match=r"float16 rounds even the same weights differently"):
        load_lora(rd.RecurrentDepthLM.from_pretrained(base, dtype=torch.float16), adapter)

    # loaded and saved again (e.g. trained further): it records the base it is on now, by path and fingerprint
    save_adapter(load_lora(rd.RecurrentDepthLM.from_pretrained(base), adapter, trainable=True), tmp_path / "again")
    assert recorded_base(tmp_path / "again")[FINGERPRINT_KEY] == recorded  # (now from a float32 load)
    assert read_adapter_config(tmp_path / "again")["base_model_name_or_path"] == str(base.resolve())
    with pytest.warns(AdapterBaseWarning):
        resaved = load_lora(rd.RecurrentDepthLM.from_pretrained(other), adapter, model_dir=other, trainable=True)
    save_adapter(resaved, tmp_path / "moved")
    assert recorded_base(tmp_path / "moved")[FINGERPRINT_KEY] == base_fingerprint(rd.RecurrentDepthLM.from_pretrained(
        other))
    assert read_adapter_config(tmp_path / "moved")["base_model_name_or_path"] == str(other.resolve())
    # without model_dir= the other model's path is unknown: the old base's path beside the new fingerprint named
    # a directory whose weights are not the recorded ones (every later load then warned about the wrong base)
    with pytest.warns(AdapterBaseWarning):
        save_adapter(load_lora(rd.RecurrentDepthLM.from_pretrained(other), adapter), tmp_path / "unplaced")
    assert recorded_base(tmp_path / "unplaced")[FINGERPRINT_KEY] == recorded_base(tmp_path / "moved")[FINGERPRINT_KEY]
    assert read_adapter_config(tmp_path / "unplaced").get("base_model_name_or_path") is None

    tiny_model(seed=2).save_pretrained(base)  # the base directory rewritten since
    with pytest.warns(AdapterBaseWarning, match=r"the weights in that directory changed since the adapter was saved"):
        load_adapter_model(adapter)


def test_an_adapter_without_a_base_fingerprint_loads_anywhere_without_a_warning(tmp_path):
    """Adapters saved before fingerprints were recorded, or by peft itself: nothing to compare."""
    import peft
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    tiny_model().save_pretrained(base)
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2), base_dir=base, seed=0), tmp_path / "old")
    weights = tmp_path / "old" / "adapter_model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt"})  # what peft writes
    peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["Wqkv"])).save_pretrained(tmp_path / "peft")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AdapterBaseWarning)
        for adapter in (tmp_path / "old", tmp_path / "peft"):
            assert recorded_base(adapter) == {}
            load_lora(tiny_model(seed=1), adapter, strict_base=True)


def test_export_merge_lora_onto_another_base_warns_in_one_line_and_strict_refuses(tmp_path, capsys):
    from recurrent_depth.cli import main

    base, other, adapter = tmp_path / "base", tmp_path / "other", tmp_path / "adapter"
    tiny_model().save_pretrained(base)
    tiny_model(seed=1).save_pretrained(other)
    save_adapter(add_lora(rd.RecurrentDepthLM.from_pretrained(base), LoraSpec(rank=2), base_dir=base, seed=0), adapter)
    export = ["export", "--merge-lora", str(adapter)]
    assert main([*export, "--model", str(base), "--out", str(tmp_path / "a"), "--strict-lora-base"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*export, "--model", str(other), "--out", str(tmp_path / "b")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and warned[0].startswith(f"rdepth export: warning: the LoRA adapter {adapter} was "
                                                     f"trained on {base} (weights fingerprint rd1:"), warned
    assert main([*export, "--model", str(other), "--out", str(tmp_path / "c"), "--strict-lora-base"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("refused by the strict base check"), err
    assert not (tmp_path / "c").exists()
    assert main(["export", "--model", str(base), "--out", str(tmp_path / "d"), "--strict-lora-base"]) == 2
    assert "--strict-lora-base checks the base of a --merge-lora adapter" in capsys.readouterr().err
    assert main(["generate", "--model", str(base), "--prompt", "x", "--strict-lora-base"]) == 2
    assert "--strict-lora-base checks the base of a --lora adapter: add --lora" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kv_heads", [None, 1], ids=["mha", "gqa"])
def test_an_unmerged_adapter_generates_the_merged_tokens_on_both_runners(kv_heads):
    overrides = {} if kv_heads is None else dict(num_kv_heads=kv_heads)
    wrapped = add_lora(tiny_model(**overrides), LoraSpec(rank=4, alpha=8))
    randomise_adapters(wrapped)
    unmerged = wrapped.get_base_model()
    assert isinstance(make_runner(unmerged), FastRunner)  # the fused runner takes the LoRA layers itself
    kw = dict(max_new_tokens=12, output_logits=True, **STEPS)
    fast, plain = generate(unmerged, ids(), **kw), generate(unmerged, ids(), fast=False, **kw)
    base = generate(tiny_model(**overrides), ids(), **kw)
    merged = merge_lora(wrapped)
    reference = generate(merged, ids(), fast=False, **kw)
    assert torch.equal(fast.sequences, reference.sequences) and torch.equal(plain.sequences, reference.sequences)
    assert not torch.equal(base.sequences, reference.sequences)  # the adapter changes what is generated
    torch.testing.assert_close(fast.logits, reference.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain.logits, reference.logits, rtol=1e-4, atol=1e-4)


def test_lora_the_fused_runner_cannot_apply_takes_the_reference_runner():
    from peft import LoraConfig, get_peft_model

    head = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["lm_head"])).get_base_model()
    dora = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["transformer.coda.0.mlp.fc"],
                                                   use_dora=True)).get_base_model()
    for model in (head, dora):
        assert type(make_runner(model)) is ModelRunner
        assert not FastRunner.supports(model)


# ---------------------------------------------------------------------------------------- training
def test_the_trainer_trains_only_the_adapter_saves_a_peft_adapter_and_resumes(tmp_path):
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.test_qlora_train import Counting  # (rows counting up: learnable from the previous token)

    tiny_model().save_pretrained(tmp_path / "base")

    core = LoraSpec(rank=2, parts=("core",))

    def run(out: str, stop_after: int = 4, resume: bool = False, spec: LoraSpec | None = core):
        model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "base")
        if spec is not None:
            model = add_lora(model, spec, base_dir=tmp_path / "base", seed=3)
        cfg = TrainConfig(batch_size=2, max_steps=4, save_every=2, out=str(tmp_path / out), progress=False,
                          tensorboard=False, resume=resume, mean_recurrence=2, backprop_depth=1,
                          optim=OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0, warmup_steps=1))
        return Trainer(cfg, model=model, data=Counting(), log=lambda _: None,
                       stop_when=lambda t: "stopped" if t.state.step >= stop_after else None).run()

    whole = run("whole")
    trained = whole.model
    base = rd.RecurrentDepthLM.from_pretrained(tmp_path / "base")
    frozen = {n.replace(".base_layer", ""): p
              for n, p in trained.get_base_model().named_parameters() if "lora_" not in n}
    assert frozen.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(frozen[n], p) for n, p in base.named_parameters())  # exactly the base's weights
    assert any(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)  # B moved from 0
    model_dir = whole.model_dir
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in model_dir.iterdir()}
    loaded = load_adapter_model(model_dir)
    torch.testing.assert_close(loaded(ids(), **STEPS).logits, trained(ids(), **STEPS).logits, rtol=1e-6, atol=1e-6)

    run("split", stop_after=2)
    # Another adapter, or none, is another run: refused in one line, and no checkpoint is set aside.
    for spec, change in [(LoraSpec(rank=2, alpha=4.0, parts=("core",)), "alpha 16 dropout 0 on 8 modules -> LoRA "
                          "rank 2 alpha 4"), (None, "-> no LoRA adapter"), (LoraSpec(rank=2, parts=("coda",)), "")]:
        with pytest.raises(ValueError, match=f"configuration changed \\(lora: .*{change}"):
            run("split", resume=True, spec=spec)
    assert [p.name for p in (tmp_path / "split" / "checkpoints").iterdir()] == ["step-00000002"]
    resumed = run("split", resume=True)
    assert resumed.losses == whole.losses[2:]
    for name, param in whole.model.named_parameters():
        assert torch.equal(param, resumed.model.get_parameter(name)), name


# ---------------------------------------------------------------------------------------- the CLI
def test_the_cli_trains_an_adapter_generates_with_it_and_merges_it(tmp_path, capsys, monkeypatch):
    from recurrent_depth.checkpoint import copy_tokenizer
    from recurrent_depth.cli import main
    from recurrent_depth.data import build_tokenizer
    from tests.train_support import VOCAB, write_corpus

    write_corpus(tmp_path / "corpus", num_docs=20)
    build_tokenizer(str(tmp_path / "corpus"), VOCAB, val_fraction=0.1, seed=0, out_dir=tmp_path / "tokenizer")
    base = tmp_path / "base"
    tiny_model(vocab_size=VOCAB).save_pretrained(base)
    copy_tokenizer(tmp_path / "tokenizer", base)
    train = ["train", "--data", str(tmp_path / "corpus"), "--max-steps", "3", "--seq-len", "16", "--batch-size", "2",
             "--no-progress", "--no-tensorboard", "--eval-batches", "1", "--eval-depths", "1,2", "--threads", "1"]
    assert main([*train, "--lora", "--out", str(tmp_path / "x")]) == 2
    assert "--lora needs --init-from" in capsys.readouterr().err
    assert main([*train, "--lora-rank", "4", "--out", str(tmp_path / "x")]) == 2
    assert "--lora-rank shape a LoRA adapter: add --lora" in capsys.readouterr().err
    assert main([*train, "--lora", "--init-from", str(base), "--lora-parts", "core,adapter", "--lora-rank", "2",
                 "--lora-alpha", "4", "--lora-dropout", "0.1", "--lora-kinds", "attention", "--out",
                 str(tmp_path / "run")]) == 0
    assert re.search(r"training [\d,]+ of [\d,]+ parameters", capsys.readouterr().out)  # the adapter of the whole
    adapter = tmp_path / "run" / "model"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (2, 4.0, 0.1)
    assert sorted(config["target_modules"]) == sorted(
        ["transformer.adapter"] + [f"transformer.core_block.{j}.attn.{n}" for j in (0, 1) for n in ("Wqkv", "proj")])
    assert config["base_model_name_or_path"] == str(base)
    assert recorded_base(adapter)[FINGERPRINT_KEY] == base_fingerprint(rd.RecurrentDepthLM.from_pretrained(base))

    assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    merged = rd.RecurrentDepthLM.from_pretrained(tmp_path / "merged")
    expected = load_adapter_model(adapter, merge=True)
    for name, param in expected.state_dict().items():
        assert torch.equal(merged.state_dict()[name], param), name

    prompt = ["--prompt", "def alpha", "--max-new-tokens", "6", "--num-steps", "2", "--init-scale", "0", "--json"]
    texts = []
    for model_flags in (["--model", str(base), "--lora", str(adapter)], ["--model", str(tmp_path / "merged")],
                        ["--model", str(base), "--lora", str(tmp_path / "run")]):  # (the run directory too)
        assert main(["generate", *model_flags, *prompt]) == 0
        texts.append(json.loads(capsys.readouterr().out)["completions"])
    assert texts[0] == texts[1] == texts[2]

    served = {}
    monkeypatch.setattr("recurrent_depth.serving.serve", lambda model, **kw: served.update(model=model, **kw))
    assert main(["serve", "--model", str(base), "--lora", str(adapter)]) == 0
    assert served["tokenizer_dir"] == str(base) and served["model_name"] == "base"
    assert isinstance(make_runner(served["model"]), FastRunner)
    assert sum("lora_A" in name for name, _ in served["model"].named_parameters()) == 5  # 4 core attention + adapter


def test_export_refuses_to_merge_over_the_base_or_into_the_adapter(tmp_path, capsys):
    """`--out` = the base replaced it with the merged weights (the adapter, recorded against that directory,
    then applied twice); `--out` = the adapter's directory mixed a full model into it."""
    from recurrent_depth.cli import main

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tiny_model().save_pretrained(base)
    save_adapter(add_lora(rd.RecurrentDepthLM.from_pretrained(base), LoraSpec(rank=2), base_dir=base, seed=0), adapter)
    before = {p.name: p.read_bytes() for d in (base, adapter) for p in d.iterdir()}
    for out, name in ((base, "--model"), (adapter, "--merge-lora")):
        assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"rdepth export: error: --out {out} is the {name} directory; write the merged model to a new "
                       f"directory"], err
    assert {p.name: p.read_bytes() for d in (base, adapter) for p in d.iterdir()} == before


def test_export_of_an_adapter_peft_cannot_merge_is_one_line(tmp_path, capsys):
    """A peft adapter with lora_bias=True on layers without a bias: `rdepth export --merge-lora` was peft's
    RuntimeError traceback ("Impossible to merge LoRA with `lora_bias=True` ...")."""
    import peft

    from recurrent_depth.cli import main

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tiny_model().save_pretrained(base)
    peft.get_peft_model(rd.RecurrentDepthLM.from_pretrained(base), peft.LoraConfig(
        r=2, target_modules=["Wqkv"], lora_bias=True)).save_pretrained(adapter)
    assert main(["export", "--model", str(base), "--merge-lora", str(adapter), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (after peft's own warnings)
    assert err[-1].startswith("rdepth export: error: cannot merge this LoRA adapter into the weights: Impossible "
                              "to merge LoRA with `lora_bias=True`"), err
    assert not (tmp_path / "out").exists()


def test_a_dora_adapter_on_quantized_weights_is_refused_before_loading_in_one_line(tmp_path, capsys):
    """A plain LoRA adapter goes on --weights layers (tests/test_lora_quantized.py); a DoRA one cannot (its forward
    reads the float base weight's norm), and is refused before the model loads (here: a model that is not there)."""
    from recurrent_depth.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "use_dora": True}))
    for command in (["generate", "--prompt", "x"], ["serve"]):
        flags = [*command, "--model", str(tmp_path / "none"), "--lora", str(adapter), "--weights", "int8"]
        assert main(flags) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and "onto int8 weights: it is a DoRA adapter" in errors[0], errors


def test_a_lora_run_with_dropout_repeats_whatever_ran_before_it():
    """The adapter's dropout drew from torch's global generator as the process had left it: the same run twice in
    one process gave other losses from step 2 on (docs: a LoRA run repeats exactly from its seed)."""
    from recurrent_depth.train.batches import BatchSource
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer

    class Fixed(BatchSource):
        def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
            rows = (torch.arange(batch_size)[:, None] * 7 + torch.arange(13)) % 256
            return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    def losses(before: int) -> list[float]:
        model = add_lora(tiny_model(), LoraSpec(rank=2, dropout=0.5, parts=("coda",)), seed=0)
        cfg = TrainConfig(batch_size=2, max_steps=3, out=None, progress=False, tensorboard=False,
                          depth_scheme="fixed", mean_recurrence=2, backprop_depth=1,
                          optim=OptimConfig(name="adamw", lr=1e-2))
        torch.manual_seed(before)  # whatever ran before in this process
        return Trainer(cfg, model=model, data=Fixed(), log=lambda _: None).run().losses

    first = losses(1)
    assert len(first) == 3 and first == losses(2)


def test_a_seeded_adapter_leaves_the_gpus_generators_alone(monkeypatch):
    """`add_lora(seed=...)` forks the CPU generator only (peft draws A on the CPU); `torch.manual_seed` inside
    the fork also reseeded every CUDA generator, for good, on a GPU machine: later GPU draws (dropout) then
    repeated the adapter's seed instead of following the run's RNG."""
    models, reseeded = [tiny_model(), tiny_model()], []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    before = torch.random.get_rng_state()
    a, b = (add_lora(model, LoraSpec(rank=4), seed=3) for model in models)
    assert reseeded == [] and torch.equal(torch.random.get_rng_state(), before)
    first = {n: p for n, p in a.named_parameters() if "lora_A" in n}
    assert first and all(torch.equal(p, dict(b.named_parameters())[n]) for n, p in first.items())
