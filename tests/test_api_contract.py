"""The public API contract of DESIGN.md ("names other code and checks rely on; extend, do not rename").

Behaviour behind these names is tested where it lives (test_model, test_inference, test_checkpoint, ...);
here: every public name imports, says what it is, and keeps the keywords the contract documents.
"""

import dataclasses
import inspect

import pytest

import recurrent_depth as rd

PUBLIC = [name for name in rd.__all__ if name != "__version__"]
# The methods the contract's example calls, besides the names in __all__.
CONTRACT_METHODS = ["RecurrentDepthLM.forward", "RecurrentDepthLM.save_pretrained",
                    "RecurrentDepthLM.from_pretrained", "ModelConfig.from_preset"]


def resolve(dotted: str) -> object:
    value: object = rd
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("name", PUBLIC + CONTRACT_METHODS)
def test_public_name_has_its_own_docstring(name):
    # `__doc__`, not inspect.getdoc: a class without one would show nn.Module's.
    doc = resolve(name).__doc__
    assert doc and doc.strip(), f"rd.{name} has no docstring (help() and IDEs show nothing)"


def test_version_is_a_string():
    assert isinstance(rd.__version__, str) and rd.__version__


# keyword -> documented default (inspect.Parameter.empty: required or no default promised)
GENERATE_KEYWORDS = dict(
    max_new_tokens=64, num_steps=None, attention_mask=None, exit_criterion=None, exit_threshold=None,
    kv_budget=None, warm_start=False, draft_steps=None, verification_threshold=1.0, do_sample=False,
    temperature=1.0, top_k=None, top_p=None, min_p=None, seed=None, stop=None, defaults=None,
    init_scale=inspect.Parameter.empty,  # None there: the config's init_scale (1.0 unless set)
)


def test_generate_keeps_the_documented_keywords_and_defaults():
    params = inspect.signature(rd.generate).parameters
    assert list(params)[:2] == ["model", "input_ids"]
    for name, default in GENERATE_KEYWORDS.items():
        assert name in params, f"rd.generate lost the documented keyword {name!r}"
        if default is not inspect.Parameter.empty:
            assert params[name].default == default, f"rd.generate({name}=...) default changed"


def test_model_and_config_keep_the_documented_names():
    forward = inspect.signature(rd.RecurrentDepthLM.forward).parameters
    assert list(forward)[1:3] == ["input_ids", "num_steps"]  # model(input_ids, 32)
    assert {"labels", "init_scale", "generator", "attention_mask"} <= set(forward)
    assert "dtype" in inspect.signature(rd.RecurrentDepthLM.from_pretrained).parameters
    fields = {f.name for f in dataclasses.fields(rd.ModelConfig)}
    documented = {"vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "prelude_layers", "core_layers", "coda_layers", "mean_recurrence", "mean_backprop_depth",
                  "max_seq_len", "rope_base", "norm_eps", "qk_bias", "tie_embeddings", "init_scale",
                  "eos_token_id", "mixer"}
    assert documented <= fields, f"ModelConfig lost documented fields {sorted(documented - fields)}"
