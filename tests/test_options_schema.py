"""The options schema (inference/schema.py): every interface's generation options come from it, each
refuses an unknown option by name, official kwargs are aliases that give the same tokens, and errors
speak the caller's terms (a CLI flag, a JSON field, a kwarg)."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from dataclasses import fields

import pytest
import torch
from lm_eval.utils import handle_arg_string

import recurrent_depth as rd
from recurrent_depth.cli import build_parser, main
from recurrent_depth.cli.generate import CLI_DEFAULTS
from recurrent_depth.evaluation import lm_eval_backend
from recurrent_depth.evaluation.lm_eval_backend import RecurrentDepthEvalLM
from recurrent_depth.inference.options import GenerationOptions, OptionError
from recurrent_depth.inference.schema import (
    GROUPS,
    KINDS,
    OFFICIAL_ALIASES,
    OPTIONS,
    canonical,
    cli_spelling,
    from_text,
    names_for,
)
from recurrent_depth.integrations import hf
from recurrent_depth.serving import protocol
from recurrent_depth.serving.protocol import APIError, Limits, parse_completion
from tests import test_hf

pytestmark = pytest.mark.usefixtures("one_thread")
model_dir, library_model, hf_model = test_hf.model_dir, test_hf.library_model, test_hf.hf_model  # its fixtures

LIMITS = Limits(max_seq_len=96, mean_recurrence=4, vocab_size=256, max_num_steps=16)
# `rdepth generate` flags that are not generation options (input, printing, device).
CLI_OWN = {"help", "model", "tokenizer", "prompt", "prompt_file", "max_depth", "stream", "json", "device", "dtype",
           "threads", "lora", "strict_lora_base", "weights", "generation_config", "ignore_eos"}  # (lora, weights: an
#  adapter and int8 weights applied as the model loads, not generation options; generation_config: where the
#  defaults of those options come from; ignore_eos: eos_token_id=[] over the config's, as the server's own field)


@pytest.fixture(scope="module")
def model(library_model):
    return library_model.eval()


def prompt() -> torch.Tensor:
    return torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------- one schema
def test_the_schema_covers_every_option_once():
    assert set(OPTIONS) == GenerationOptions.names()
    for option in OPTIONS.values():
        assert option.group in GROUPS and option.kind in KINDS and option.help, option
        assert option.hf in (None, "shared", "routed") and option.lm_eval in (None, "model", "gen"), option
    for alias in OFFICIAL_ALIASES.values():
        assert alias.field in OPTIONS and alias.name not in OPTIONS, alias
    defaults = {f.name: f.default for f in fields(GenerationOptions)}
    assert all(OPTIONS[name].default == defaults[name] for name in OPTIONS)


def generate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def test_cli_flags_are_the_schema():
    """Every generation flag of `rdepth generate` is a schema option or alias, with its help and default."""
    actions = [a for a in generate_parser()._actions if a.dest not in CLI_OWN]
    dests = {a.dest for a in actions}
    assert dests == set(names_for("cli"))
    for action in actions:
        if action.option_strings == ["--parallel"]:
            continue  # the shorthand of --sampler parallel
        if action.option_strings == ["--stop-id"]:  # --stop's token ids, added to the same list
            assert action.dest == "stop" and action.type is int and action.default is None
            continue
        if action.dest in OPTIONS:
            option = OPTIONS[action.dest]
            assert action.option_strings[0] == option.flag and action.help == option.describe()
            # a flag not given is None; its CLI default (--seed 0) applies under generation_config.json
            assert action.default is None and CLI_DEFAULTS.get(action.dest) == option.cli_default
        else:
            assert action.option_strings[0] == OFFICIAL_ALIASES[action.dest].flag and action.default is None


def test_http_fields_are_the_schema():
    assert set(protocol.HTTP_OPTIONS) == set(names_for("http"))
    assert not (protocol.OPENAI_FIELDS | protocol.SERVER_FIELDS) & set(OPTIONS) - {"temperature", "top_p", "seed",
                                                                                    "stop"}
    for name in OPTIONS:  # an option the schema does not offer over HTTP is an unknown field there
        body = {"prompt": "x", name: 1}
        if name in protocol.HTTP_OPTIONS or name in protocol.OPENAI_FIELDS:
            continue
        with pytest.raises(APIError) as info:
            parse_completion(body, LIMITS, {"m"})
        assert info.value.param == name


def test_transformers_and_lm_eval_options_are_the_schema():
    assert set(hf.ROUTED_GENERATE_OPTIONS) == set(names_for("hf", "routed"))
    assert set(hf.SHARED_GENERATE_OPTIONS) == set(names_for("hf", "shared")) | {"attention_mask"}
    assert set(lm_eval_backend.GEN_KWARGS) == set(names_for("lm_eval"))
    # `seed` is the backend's own: it seeds the stream from which each request's generate seed is drawn
    own = set(inspect.signature(RecurrentDepthEvalLM.__init__).parameters) - {"seed"}
    assert not own & (set(OPTIONS) | set(OFFICIAL_ALIASES)), "an lm-eval model arg is declared by hand"


# ---------------------------------------------------------------------------------------- unknown options
def test_rd_generate_rejects_an_unknown_option_by_name(model):
    with pytest.raises(ValueError, match=r"unknown generation argument\(s\) \['num_step'\]"):
        rd.generate(model, prompt(), max_new_tokens=2, num_step=3)


def test_cli_rejects_an_unknown_flag_by_name(model_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model_dir), "--prompt", "a", "--bogus-knob", "3"])
    assert info.value.code == 2 and "--bogus-knob" in capsys.readouterr().err


def test_http_rejects_an_unknown_field_by_name():
    with pytest.raises(APIError) as info:
        parse_completion({"prompt": "x", "num_step": 3}, LIMITS, {"m"})
    assert info.value.status == 400 and info.value.param == "num_step" and "'num_step'" in info.value.message


def test_transformers_generate_rejects_an_unknown_kwarg_by_name(hf_model):
    with pytest.raises(ValueError, match="bogus_knob"):  # transformers' own loop
        hf_model.generate(prompt(), max_new_tokens=2, bogus_knob=1)
    with pytest.raises(ValueError, match="bogus_knob"):  # routed to recurrent_depth.generate
        hf_model.generate(prompt(), max_new_tokens=2, criterion="kl", bogus_knob=1)


def test_lm_eval_rejects_an_unknown_arg_by_name(model_dir):
    lm = RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", num_steps=2)
    with pytest.raises(ValueError, match="bogus_knob"):
        lm._model_generate(prompt()[:1], 9, [], bogus_knob=1)
    with pytest.raises(ValueError, match="num_stepz=2 is not an argument"):  # a model_arg neither we nor HFLM take
        RecurrentDepthEvalLM(pretrained=str(model_dir), device="cpu", num_stepz=2)


# ---------------------------------------------------------------------------------------- errors in the caller's terms
def test_errors_name_the_option_as_the_caller_spelled_it(model, hf_model, model_dir, capsys):
    with pytest.raises(OptionError, match=r"^lookahead_for_draft=0 is invalid") as info:
        rd.generate(model, prompt(), max_new_tokens=2, num_steps=4, draft_steps=1, lookahead_for_draft=0)
    assert info.value.field == "lookahead"
    with pytest.raises(ValueError, match=r"criterion='nope'"):
        rd.generate(model, prompt(), max_new_tokens=2, criterion="nope")

    assert main(["generate", "--model", str(model_dir), "--prompt", "a", "--num-steps", "4", "--draft-steps", "1",
                 "--lookahead-for-draft", "0"]) == 2
    assert "--lookahead-for-draft=0 is invalid" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir), "--prompt", "a", "--exit-criterion", "kl",
                 "--min-steps", "9", "--num-steps", "4"]) == 2
    assert "--min-steps=9 is invalid: expected <= --max-steps=4" in capsys.readouterr().err

    with pytest.raises(APIError) as http:
        parse_completion({"prompt": "x", "num_steps": 4, "draft_steps": 1, "temperature": 0,
                          "lookahead_for_draft": 0}, LIMITS, {"m"}).sampling.options(2, 4, LIMITS)
    assert http.value.param == "lookahead_for_draft" and "lookahead_for_draft=0" in http.value.message
    with pytest.raises(APIError) as http:
        parse_completion({"prompt": "x", "criterion": "nope"}, LIMITS, {"m"})
    assert http.value.param == "criterion"

    with pytest.raises(ValueError, match=r"continuous_compute='yes'"):
        hf_model.generate(prompt(), max_new_tokens=2, continuous_compute="yes")
    with pytest.raises(ValueError, match=r"^--exit-threshold=-1 "):
        raise OptionError("exit_threshold", "exit_threshold=-1 is invalid").spelled(cli_spelling({}))


def test_a_kv_quant_specs_own_seed_is_not_respelled_as_the_seed_option(model_dir, capsys):
    """`seed=` inside a kv_quant spec is the spec's key, not `--seed` (the sampling seed): the CLI
    quoted the user's spec back as 'k=mse:3,--seed=-1'."""
    assert main(["generate", "--model", str(model_dir), "--prompt", "a", "--kv-quant", "k=mse:3,seed=-1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-quant='k=mse:3,seed=-1' is invalid" in err and "--seed" not in err
    with pytest.raises(ValueError, match=r"^--kv-quant='seed=x,k=mse:3' is invalid: the spec's seed 'x'"):
        raise OptionError("kv_quant", "kv_quant='seed=x,k=mse:3' is invalid: the spec's seed 'x' is invalid"
                          ).spelled(cli_spelling({}))
    assert "'seed=x'" in str(OptionError("stop", "stop='seed=x' is odd").spelled(cli_spelling({})))
    assert str(OptionError("seed", "seed=-1 and stop=[] clash").spelled(cli_spelling({}))) == \
        "--seed=-1 and --stop=[] clash"  # the options themselves are still re-spelled


def test_an_option_given_twice_under_two_names_is_refused(model):
    with pytest.raises(ValueError, match="exit_criterion and criterion set the same option"):
        rd.generate(model, prompt(), max_new_tokens=2, exit_criterion="kl", criterion="cosine")
    with pytest.raises(APIError) as info:
        parse_completion({"prompt": "x", "lookahead": 3, "lookahead_for_draft": 5}, LIMITS, {"m"})
    assert info.value.param == "lookahead" and "lookahead and lookahead_for_draft" in info.value.message


@pytest.mark.parametrize("values", [dict(warm_start=False, continuous_compute=True),
                                    dict(continuous_compute=False, warm_start=True)], ids=["off-on", "on-off"])
def test_warm_start_and_continuous_compute_disagreeing_are_refused_everywhere(model, hf_model, model_dir, capsys,
                                                                            values):
    """Issue 33 item 19: the pair is refused with one line, like every alias pair, on each interface."""
    message = "set the same option (warm_start); give one of them"
    with pytest.raises(ValueError, match=re.escape(message)):
        rd.generate(model, prompt(), max_new_tokens=2, **values)
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_model.generate(prompt(), max_new_tokens=2, **values)
    with pytest.raises(APIError) as http:
        parse_completion({"prompt": "x", **values}, LIMITS, {"m"})
    assert http.value.param == "warm_start" and message in http.value.message
    with pytest.raises(ValueError, match=re.escape(message)):
        lm_eval_backend._typed({k: str(v) for k, v in values.items()})
    flags = [("--" if v else "--no-") + k.replace("_", "-") for k, v in values.items()]
    assert main(["generate", "--model", str(model_dir), "--prompt", "a", *flags]) == 2
    err = capsys.readouterr().err
    assert "--warm-start and --continuous-compute" in err or "--continuous-compute and --warm-start" in err


def test_unknown_official_lookup_strategies_are_refused_by_their_kwarg(model):
    with pytest.raises(ValueError, match=r"^cache_lookup_strategy='latest-m5' is invalid"):
        rd.generate(model, prompt(), max_new_tokens=2, cache_lookup_strategy="latest-m5")


# ---------------------------------------------------------------------------------------- aliases = same tokens
# official kwargs, our names for the same, and a neighbour whose tokens or steps differ (so a dropped
# alias would be seen); depth 12 on the tiny model, where these thresholds exit at varied steps.
KL = dict(exit_criterion="kl", exit_threshold=1e-2)
ALIASES = {
    "criterion": (dict(criterion="kl", exit_threshold=1e-2), KL, dict()),
    "auto-kl": (dict(criterion="kl", exit_threshold="auto"), dict(exit_criterion="kl", exit_threshold=1e-3),
                dict(exit_criterion="kl")),  # ours: 5e-4
    "auto-latent": (dict(exit_criterion="latent-diff", exit_threshold="auto"),
                    dict(exit_criterion="latent-diff", exit_threshold=0.03), dict()),
    "lookup-skip": (dict(KL, cache_lookup_strategy="skip"), dict(KL, kv_policy="per-step+skip"), KL),
    "lookup-latest-m4": (dict(KL, cache_lookup_strategy="latest-m4"), dict(KL, kv_policy="per-step+deepest"),
                         dict(KL, kv_policy="per-step+skip")),
    "lookup-full": (dict(KL, cache_lookup_strategy="full"), dict(KL, kv_policy="full"), KL),
    "continuous-compute": (dict(continuous_compute=True), dict(warm_start=True), dict()),
    "lookahead-for-draft": (dict(draft_steps=1, lookahead_for_draft=3), dict(draft_steps=1, lookahead=3),
                            dict(draft_steps=1)),
}
COMMON = dict(max_new_tokens=6, num_steps=12, init_scale=0.0)


def same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and torch.equal(a.steps, b.steps) and a.stats == b.stats


@pytest.mark.parametrize("case", list(ALIASES))
def test_official_aliases_give_our_tokens(model, hf_model, case):
    official, ours, neighbour = ALIASES[case]
    want = rd.generate(model, prompt(), **COMMON, **ours)
    got = rd.generate(model, prompt(), **COMMON, **official)
    assert same(got, want) and not same(got, rd.generate(model, prompt(), **COMMON, **neighbour))

    assert same(hf_model.generate(prompt(), **COMMON, **official, return_dict_in_generate=True), want)

    # HTTP and lm-eval hand the same options to generate
    body = {"prompt": "x", "temperature": 0, "init_scale": 0, "num_steps": 12, **official}
    http = parse_completion(body, LIMITS, {"m"}).sampling.generation
    assert resolved(http) == resolved({**http, **canonical(ours)[0]})
    lm_eval_values = canonical({k: from_text(k, handle_arg_string(str(v))) for k, v in official.items()})[0]
    assert resolved(lm_eval_values) == resolved(canonical(ours)[0])


def resolved(values: dict) -> dict:
    """Validated options, the KV policy by its rules (two names may spell one policy)."""
    options = vars(GenerationOptions(**values).validate(12)).copy()
    options.pop("kv_policy")
    return options


def test_cli_aliases_give_our_tokens(model_dir, capsys):
    base = ["generate", "--model", str(model_dir), "--prompt", "a=1", "--max-new-tokens", "5", "--num-steps", "12",
            "--init-scale", "0", "--json"]

    def tokens(*flags: str) -> tuple[list, list]:
        assert main([*base, *flags]) == 0
        record = json.loads(capsys.readouterr().out)
        return record["tokens"], record["steps"]

    assert tokens("--criterion", "kl", "--exit-threshold", "auto") == tokens(
        "--exit-criterion", "kl", "--exit-threshold", "1e-3")
    assert tokens("--continuous-compute") == tokens("--warm-start")
    assert tokens("--exit-criterion", "kl", "--exit-threshold", "0.01", "--cache-lookup-strategy", "skip") == tokens(
        "--exit-criterion", "kl", "--exit-threshold", "0.01", "--kv-policy", "per-step+skip")


def test_cache_lookup_strategy_alone_stays_in_transformers_loop(hf_model):
    common = dict(max_new_tokens=4, num_steps=3, init_scale=0.0, do_sample=False)
    want = hf_model.generate(prompt(), **common, kv_policy="per-step+deepest")
    assert torch.equal(hf_model.generate(prompt(), **common, cache_lookup_strategy="latest-m4"), want)


def test_transformers_generate_honours_a_callers_eos_token_id(hf_model, model_dir, model):
    common = dict(max_new_tokens=6, num_steps=4, init_scale=0.0)
    free = rd.generate(model, prompt()[:1], **common).token_lists()[0]
    assert len(set(free)) > 1
    eos = free[2]
    out = hf_model.generate(prompt()[:1], criterion="kl", exit_threshold=0.0, eos_token_id=[eos], **common,
                           return_dict_in_generate=True)
    assert out.token_lists()[0] == free[: free.index(eos) + 1] and out.finish_reasons == ["stop"]


def test_the_docs_options_table_is_the_schemas():
    from pathlib import Path

    from recurrent_depth.inference.schema import options_markdown

    text = (Path(__file__).parents[1] / "docs" / "inference.md").read_text()
    start = text.index("<!-- options-table:")
    table = text[text.index("\n", start) + 1 : text.index("<!-- /options-table -->")]
    assert table == options_markdown(), "regenerate the table with schema.options_markdown()"


@pytest.mark.parametrize("doc,names", [("serving.md", names_for("http")),
                                       ("evaluation.md", names_for("lm_eval", "model"))],
                         ids=["http-fields", "lm-eval-model-args"])
def test_the_interface_docs_list_the_schemas_options(doc, names):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / doc).read_text()
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/{doc} does not mention {missing}"
