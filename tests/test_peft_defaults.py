"""peft's own default targets on our models: `LoraConfig(task_type="CAUSAL_LM")` without `target_modules` failed
("Please specify `target_modules` in `peft_config`": our model types were in none of peft's tables); it now
adapts what the LoRA trainer adapts by default (`target_modules(model, LoraSpec())`), on every mixer and type."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("peft")

import recurrent_depth as rd  # noqa: E402
from recurrent_depth.checkpoint import save_official_layout  # noqa: E402
from recurrent_depth.integrations.hf import from_library_model  # noqa: E402
from recurrent_depth.integrations.hf_peft import MODEL_TYPES, register_peft  # noqa: E402
from recurrent_depth.model.mixers import available_mixers  # noqa: E402
from recurrent_depth.train.lora import LoraSpec, default_target_suffixes, target_modules  # noqa: E402
from tests.test_hf import ids, make_model_dir, tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
OURO_CASE = Path(__file__).parent / "goldens" / "ouro" / "config_a"


def adapted(peft_model: torch.nn.Module) -> set[str]:
    """The names (as in the base model) of the layers peft gave an adapter."""
    prefix = "base_model.model."
    return {name.removeprefix(prefix) for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}


def test_lora_config_without_targets_adapts_the_trainers_defaults_and_trains(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    make_model_dir(tmp_path, with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    expected = set(target_modules(model, LoraSpec()))
    torch.manual_seed(0)
    wrapped = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    assert adapted(wrapped) == expected
    assert "transformer.adapter" in expected and not any(n.startswith("lm_head") for n in adapted(wrapped))
    trainable = {n: p.detach().clone() for n, p in wrapped.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in wrapped.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    x = ids()
    loss = wrapped(input_ids=x, labels=x, num_steps=2).loss
    loss.backward()
    optimizer.step()
    after = dict(wrapped.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in trainable.items() if "lora_B" in n)  # the adapter learnt
    assert all(torch.equal(after[n], v) for n, v in frozen.items())  # and nothing else moved


@pytest.mark.parametrize("overrides", [{"mixer": m} for m in available_mixers()] + [
    {"value_embeddings": [1]}, {"mixer": "mla", "mixer_options": {"q_lora_rank": 8}}])
def test_the_default_targets_are_the_trainers_on_every_mixer(overrides):
    """A mixer whose linear layers KIND_LINEAR_NAMES lacks (or names a non-linear one) fails here."""
    from peft import LoraConfig, get_peft_model

    model = from_library_model(rd.RecurrentDepthLM(dataclasses.replace(tiny_config(), **overrides)))
    expected = set(target_modules(model, LoraSpec()))
    assert adapted(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))) == expected


def test_the_official_layout_type_and_an_ouro_directory_get_the_defaults_too(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    save_official_layout(rd.RecurrentDepthLM(tiny_config()), tmp_path)
    for source in (tmp_path, OURO_CASE):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        expected = set(target_modules(model, LoraSpec()))
        assert adapted(get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))) == expected


def test_every_registered_model_type_is_in_every_lora_like_table_and_ia3():
    from peft.utils import constants

    from recurrent_depth.integrations.hf_config import HuginnRavenConfig, OuroConfig, RecurrentDepthConfig

    assert {c.model_type for c in (RecurrentDepthConfig, HuginnRavenConfig, OuroConfig)} <= set(MODEL_TYPES)
    for model_type in MODEL_TYPES:
        for table in ("LORA", "LOHA", "LOKR", "ADALORA", "OFT"):
            mapping = getattr(constants, f"TRANSFORMERS_MODELS_TO_{table}_TARGET_MODULES_MAPPING")
            assert mapping[model_type] == default_target_suffixes()
        assert constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING[model_type] == ["mlp.proj"]
        assert "transformer.adapter" not in constants.TRANSFORMERS_MODELS_TO_LNTUNING_TARGET_MODULES_MAPPING.get(
            model_type, [])  # (a table of layer norms is not LoRA's)


@pytest.mark.parametrize("method", ["IA3Config", "LoHaConfig", "LoKrConfig"])
def test_other_peft_methods_take_their_defaults(method):
    import peft

    model = from_library_model(rd.RecurrentDepthLM(tiny_config()))
    wrapped = peft.get_peft_model(model, getattr(peft, method)(task_type="CAUSAL_LM"))
    with torch.no_grad():
        assert torch.isfinite(wrapped(input_ids=ids(), num_steps=2).logits).all()
    assert any(p.requires_grad for p in wrapped.parameters())


def test_register_peft_fills_only_lora_like_tables_and_keeps_existing_entries():
    constants = ModuleType("fake_constants")
    constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING = {"llama": ["q_proj", "v_proj"],
                                                                    "recurrent_depth": ["mine"]}
    constants.TRANSFORMERS_MODELS_TO_LOHA_TARGET_MODULES_MAPPING = {"llama": ["q_proj", "v_proj"]}
    constants.TRANSFORMERS_MODELS_TO_LNTUNING_TARGET_MODULES_MAPPING = {"llama": ["input_layernorm"]}
    constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING = {"llama": ["k_proj", "v_proj", "down_proj"]}
    constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING = {"llama": ["down_proj"]}
    for _ in range(2):  # (idempotent)
        register_peft(constants)
    assert constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["recurrent_depth"] == ["mine"]
    assert constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["huginn_raven"] == default_target_suffixes()
    assert constants.TRANSFORMERS_MODELS_TO_LOHA_TARGET_MODULES_MAPPING["ouro"] == default_target_suffixes()
    assert set(constants.TRANSFORMERS_MODELS_TO_LNTUNING_TARGET_MODULES_MAPPING) == {"llama"}
    assert constants.TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING["huginn_raven"] == ["mlp.proj"]
