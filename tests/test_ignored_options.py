"""Options set where the chosen mode never reads them warn once (`options.MATTERS_ONLY`); the same
option in its mode, values the official profile fills, and neutral values do not."""

from __future__ import annotations

import warnings

import pytest

from recurrent_depth.inference.options import MATTERS_ONLY, GenerationOptions, OptionWarning

# option -> (a call where the mode ignores it, the same option in the mode that reads it)
CASES = {
    "lookahead": (dict(lookahead=4), dict(lookahead=4, draft_steps=1)),
    "verification_threshold": (dict(verification_threshold=0.5), dict(verification_threshold=0.5, draft_steps=1)),
    "finish_round": (dict(finish_round=True), dict(finish_round=True, draft_steps=1)),
    "inner_steps": (dict(inner_steps=2), dict(inner_steps=2, sampler="parallel")),
    "headway": (dict(headway=2), dict(headway=2, sampler="parallel")),
    "wavefront": (dict(wavefront=2), dict(wavefront=2, sampler="parallel")),
    "max_wavefront": (dict(max_wavefront=8), dict(max_wavefront=8, sampler="parallel")),
    "exit_threshold": (dict(exit_criterion="none", exit_threshold=0.1), dict(exit_criterion="kl", exit_threshold=0.1)),
    "min_steps": (dict(min_steps=2), dict(min_steps=2, exit_criterion="kl")),
    "min_steps_rule": (dict(min_steps_rule="skip"), dict(min_steps_rule="skip", exit_criterion="kl")),
    "check_every": (dict(check_every=2), dict(check_every=2, exit_criterion="kl")),
    "exit_in_prefill": (dict(exit_in_prefill=False, defaults="official"),
                        dict(exit_in_prefill=False, defaults="official", exit_criterion="kl")),
    "warm_start_source": (dict(warm_start_source="normed"), dict(warm_start_source="normed", warm_start=True)),
    "temperature": (dict(temperature=0.7), dict(temperature=0.7, do_sample=True)),
    "top_k": (dict(top_k=5), dict(top_k=5, do_sample=True)),
    "top_p": (dict(top_p=0.9), dict(top_p=0.9, do_sample=True)),
    "min_p": (dict(min_p=0.1), dict(min_p=0.1, do_sample=True)),
    "ttt_steps": (dict(ttt_steps=2), dict(ttt_steps=2, ttt_params="core-mlp")),
    "ttt_lr": (dict(ttt_lr=0.1), dict(ttt_lr=0.1, ttt_params="core-mlp")),
    "ttt_optimizer": (dict(ttt_optimizer="adam"), dict(ttt_optimizer="adam", ttt_params="core-mlp")),
    "ttt_depth": (dict(ttt_depth=2), dict(ttt_depth=2, ttt_params="core-mlp")),
    "ttt_backprop": (dict(ttt_backprop=1), dict(ttt_backprop=1, ttt_params="core-mlp")),
    "gradmem_steps": (dict(gradmem_steps=2), dict(gradmem_steps=2, gradmem_tokens=2)),
    "gradmem_lr": (dict(gradmem_lr=0.5), dict(gradmem_lr=0.5, gradmem_tokens=2)),
    "gradmem_depth": (dict(gradmem_depth=2), dict(gradmem_depth=2, gradmem_tokens=2)),
    "gradmem_init": (dict(gradmem_init="random"), dict(gradmem_init="random", gradmem_tokens=2)),
    "gradmem_query_tokens": (dict(gradmem_query_tokens=1), dict(gradmem_query_tokens=1, gradmem_tokens=2)),
}


def option_warnings(**kwargs) -> list[OptionWarning]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GenerationOptions(**kwargs).validate(4)
    return [w.message for w in caught if isinstance(w.message, OptionWarning)]


def test_every_option_with_a_mode_has_a_case():
    assert set(CASES) == set(MATTERS_ONLY)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_ignored_option_warns_once_naming_it_and_not_in_its_mode(name):
    ignored, used = CASES[name]
    found = option_warnings(**ignored)
    assert [w.field for w in found] == [name]
    message = str(found[0])
    assert message.startswith(f"{name}=") and "has no effect" in message and "\n" not in message
    assert option_warnings(**used) == []


@pytest.mark.parametrize("mode", [dict(), dict(draft_steps=1), dict(sampler="parallel"), dict(exit_criterion="kl"),
                                  dict(warm_start=True)])
def test_the_official_profile_and_defaults_do_not_warn(mode):
    assert option_warnings(defaults="official", **mode) == []
    assert option_warnings(**mode) == []


@pytest.mark.parametrize("kwargs", [dict(temperature=0), dict(top_p=1.0), dict(min_p=0.0), dict(min_steps=1),
                                    dict(finish_round=False), dict(defaults="official", finish_round=True),
                                    dict(lookahead=8), dict(min_steps_rule="exit")])
def test_values_that_change_nothing_do_not_warn(kwargs):
    assert option_warnings(**kwargs) == []


@pytest.mark.parametrize("kwargs", [dict(kv_policy="per-step+skip"), dict(kv_policy="shared-2+full", draft_steps=1),
                                    dict(kv_policy="skip-compress-s16"),
                                    dict(kv_policy="full", exit_criterion="kl", exit_kv="compute")])
def test_a_kv_lookup_without_early_exits_warns(kwargs):
    found = option_warnings(**kwargs)
    assert [w.field for w in found] == ["kv_policy"] and "lookup has no effect" in str(found[0])


@pytest.mark.parametrize("kwargs", [dict(kv_policy="per-step+skip", exit_criterion="kl"), dict(kv_policy="shared-2"),
                                    dict(kv_policy="compress-s16"), dict(kv_policy="latest-m4-compress-s16"),
                                    dict(kv_policy="deepest", sampler="parallel"), dict(kv_budget=2)])
def test_a_kv_policy_whose_lookup_is_read_or_implied_does_not_warn(kwargs):
    assert option_warnings(**kwargs) == []


def test_generate_names_the_option_as_the_caller_spelled_it():
    import torch

    import recurrent_depth as rd
    from recurrent_depth.inference import generate

    cfg = rd.ModelConfig.from_preset("tiny")
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, [1, 2, 3], max_new_tokens=1, num_steps=1, init_scale=0.0, lookahead_for_draft=3)
    assert [str(w.message) for w in caught if isinstance(w.message, OptionWarning)] == [
        "lookahead_for_draft=3 has no effect without speculative decoding (set draft_steps)"
    ]


def test_the_server_accepts_an_ignored_field_and_warns_in_its_json_name():
    from recurrent_depth.serving.protocol import Limits, validated

    limits = Limits(max_seq_len=64, mean_recurrence=4, vocab_size=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = validated({"lookahead": 3}, {"lookahead": "lookahead_for_draft"}, 2, limits)
    assert options.mode == "autoregressive"
    assert [str(w.message) for w in caught] == [
        "lookahead_for_draft=3 has no effect without speculative decoding (set draft_steps)"
    ]


def test_a_request_preparation_worker_does_not_print_the_servers_warning_again():
    """The server's tokenizer workers (`Preparer`, in their own processes) validate a request's options too:
    each ignored field was printed twice, once by the worker in Python's form; the server logs it once."""
    import json

    from recurrent_depth.serving.prep import Preparer, PrepSpec
    from recurrent_depth.serving.protocol import Limits

    spec = PrepSpec(None, 64, Limits(max_seq_len=64, mean_recurrence=4, vocab_size=64), frozenset({"m"}),
                    memory_headroom=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = Preparer(spec).prepare("completions", json.dumps(
            {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "lookahead": 3}).encode())
    assert result[0] == "ok", result
    assert [str(w.message) for w in caught if issubclass(w.category, OptionWarning)] == []


def test_docs_list_every_option_that_matters_in_one_mode_only():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
    section = text.split("<!-- ignored-options -->")[1].split("<!-- /ignored-options -->")[0]
    assert [name for name in MATTERS_ONLY if f"`{name}`" not in section] == []


def test_a_negated_official_alias_is_quoted_with_the_value_the_caller_gave():
    from recurrent_depth.inference.options import OptionError, spelled_warnings
    from recurrent_depth.inference.schema import canonical, cli_spelling, kwarg_spelling
    from recurrent_depth.serving.protocol import http_spelling

    values, given_as = canonical({"do_not_exit_in_prefill": False})  # = exit_in_prefill=True, without a criterion
    with pytest.raises(OptionError) as exc:
        GenerationOptions(**values).validate(4)
    assert str(exc.value.spelled(kwarg_spelling(given_as))).startswith("do_not_exit_in_prefill=False needs")
    assert str(exc.value.spelled(cli_spelling(given_as))).startswith("--do-not-exit-in-prefill=False needs")
    assert str(exc.value.spelled(http_spelling(given_as))).startswith("do_not_exit_in_prefill=False needs")
    values, given_as = canonical({"do_not_exit_in_prefill": True, "defaults": "official"})
    with warnings.catch_warnings(record=True) as caught, spelled_warnings(kwarg_spelling(given_as)):
        warnings.simplefilter("always")
        GenerationOptions(**values).validate(4)
    assert [str(w.message) for w in caught] == [
        "do_not_exit_in_prefill=True has no effect without an exit_criterion in the autoregressive mode"
    ]
