"""Each generation option is declared once, as its `GenerationOptions` field (inference/options.py):
no command adds its flag by hand, `rd.generate` declares no option (nor a second default), the
HTTP, transformers and lm-eval lists are derived, and the validator is the fields' metadata."""

from __future__ import annotations

import ast
import functools
import inspect
import math
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest

import recurrent_depth as rd
from recurrent_depth.cli import build_parser
from recurrent_depth.inference.options import OPTIONS, GenerationOptions, OptionError, ResolvedOptions
from recurrent_depth.inference.quant_cache import KVQuant
from recurrent_depth.inference.schema import OFFICIAL_ALIASES
from recurrent_depth.model.cache import parse_kv_policy

SRC = Path(__file__).parents[1] / "src" / "recurrent_depth"
NAMES = set(OPTIONS) | set(OFFICIAL_ALIASES)
FLAGS = {"--" + name.replace("_", "-"): name for name in NAMES}
# Flags spelled like an option that mean something else where they appear (any command may use them).
HOMONYMS = {"--seed": "the seed of a run of its own (training, data, analysis)",
            "--max-steps": "a training run's optimizer steps"}
# Modules that offer the options to an interface: they must derive every list of names from the schema.
INTERFACES = ("serving/protocol.py", "integrations/hf.py", "evaluation/lm_eval_backend.py", "cli/generate.py",
              "cli/serve.py", "cli/info.py", "cli/evaluate.py", "inference/generate.py")
OPENAI_NAMES = "OPENAI_FIELDS"  # the OpenAI API's own fields (some share an option's name: stop, seed, ...)


@functools.cache
def trees() -> list[tuple[str, ast.AST]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def test_no_command_adds_an_option_flag_by_hand():
    by_hand = []
    for path, tree in trees():
        if path == "inference/schema.py":  # the schema-driven builder
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for arg in node.args:
                    flag = arg.value if isinstance(arg, ast.Constant) else None
                    if flag in FLAGS and flag not in HOMONYMS:
                        by_hand.append(f"{path}:{node.lineno} {flag}")
    assert not by_hand, f"option flags added by hand (use schema.add_option_flags): {by_hand}"


def option_literals(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """Literal tables of option names: a list, tuple, set or dict outside any function holding two
    or more (where interface tables live), and a dict anywhere keyed by three or more."""
    skip = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assign)
            and any(getattr(t, "id", "") == OPENAI_NAMES for t in a.targets) for n in ast.walk(a.value)}
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.Dict | ast.List | ast.Tuple | ast.Set):
            continue
        items = node.keys if isinstance(node, ast.Dict) else node.elts
        named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES]
        if len(named) >= (3 if id(node) in in_function else 2) and (isinstance(node, ast.Dict)
                                                                    or id(node) not in in_function):
            found.append((node.lineno, named))
    return found


def test_interfaces_derive_their_option_lists():
    written = [f"{path}:{line} {names}" for path, tree in trees() if path in INTERFACES
               for line, names in option_literals(tree)]
    assert not written, f"option names listed by hand (derive them with schema.names_for): {written}"
    planted = ast.parse('TABLE = ("num_steps", "kv_quant")\ndef f():\n    return {"top_k": 1, "top_p": 1, "seed": 0}')
    assert [line for line, _ in option_literals(planted)] == [1, 3]  # the scan sees both kinds


def test_rd_generate_declares_no_option_and_lists_every_field():
    tree = ast.parse((SRC / "inference" / "generate.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("generate", "stream_generate"):
            declared = {a.arg for a in (*node.args.args, *node.args.kwonlyargs)}
            assert not declared & NAMES, f"{node.name} declares {sorted(declared & NAMES)} (a second default)"
    parameters = inspect.signature(rd.generate).parameters
    assert [n for n in parameters if n in OPTIONS] == list(OPTIONS)
    assert all(parameters[n].default == OPTIONS[n].default for n in OPTIONS)
    assert all(f"      {n}: {OPTIONS[n].help}" in rd.generate.__doc__ for n in OPTIONS)
    assert {"attention_mask", "streamer", "tokenizer"} <= set(parameters)


def test_every_option_is_a_field_with_its_metadata():
    assert [f.name for f in fields(GenerationOptions)] == list(OPTIONS)
    for f in fields(GenerationOptions):
        assert f.metadata["option"].help == OPTIONS[f.name].help and OPTIONS[f.name].default == f.default


def outside(option) -> list:
    """Values just outside an option's declared range (and of the wrong kind)."""
    if option.kind == "bool":
        return ["yes", 1]
    low = option.low if not callable(option.low) else 1  # min_steps under the "exit" rule
    if option.kind == "int":
        return [low - 1, 1.5, True]
    values = ["x", math.nan, low - 1e-9]
    if option.high is not None and option.high != math.inf:
        values.append(option.high + 1e-9)
    return values


RANGED = [o for o in OPTIONS.values() if o.kind == "bool" or o.low is not None]


@pytest.mark.parametrize("option", RANGED, ids=[o.name for o in RANGED])
def test_the_validator_checks_each_field_by_its_metadata(option):
    base = dict(exit_criterion="kl") if option.name in ("min_steps", "max_steps") else {}
    for value in outside(option):
        with pytest.raises(OptionError) as info:
            GenerationOptions(**base, **{option.name: value}).validate(4)
        assert info.value.field == option.name and info.value.message.startswith(f"{option.name}={value!r} ")
    if option.kind != "bool" and option.low_open is not True:  # a closed bound itself is valid
        low = 1 if callable(option.low) else option.low
        GenerationOptions(**base, **{option.name: low}).validate(4)


def test_choices_are_checked_with_what_none_means():
    for option in OPTIONS.values():
        if isinstance(option.choices, tuple):
            with pytest.raises(OptionError, match=rf"^{option.name}='bogus' is invalid: expected "
                                                  + (rf"None \({option.unset}\) or " if option.unset else "")):
                GenerationOptions(**{option.name: "bogus"}).validate(4)


def test_resolved_options_are_frozen_and_carry_the_parsed_policy_and_quantization():
    given = GenerationOptions(kv_policy="shared-2+skip", kv_quant="k=prod:3.5,v=mse:3.5", exit_criterion="kl")
    resolved = given.validate(4)
    assert isinstance(resolved, ResolvedOptions) and resolved.num_steps == 4 and resolved.max_steps == 4
    assert resolved.policy == parse_kv_policy("shared-2+skip") and resolved.quant == KVQuant.parse(given.kv_quant)
    assert GenerationOptions().validate(4).quant is None
    with pytest.raises(FrozenInstanceError):
        resolved.policy = parse_kv_policy("last-step")  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        given.num_steps = 3  # type: ignore[misc]
    compress = GenerationOptions(kv_policy="compress-s4").validate(4)
    assert not compress.policy.bound and compress.bound(2).policy == parse_kv_policy("compress-s4").bind(2)


def subcommand(name: str):
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command, names", [("serve", ("num_steps", "kv_quant")), ("info", ("kv_policy", "kv_quant")),
                                            ("eval", ("init_scale",)), ("analyze", ("init_scale",))])
def test_other_commands_take_their_generation_flags_from_the_schema(command, names):
    actions = {a.dest: a for a in subcommand(command)._actions}
    for name in names:
        action = actions[name]
        assert action.option_strings == [OPTIONS[name].flag] and action.metavar == (OPTIONS[name].metavar or
                                                                                    {"int": "N", "float": "X"}.get(
                                                                                        OPTIONS[name].kind, "NAME"))
    assert subcommand("analyze").parse_args(["--model", "m", "--ids", "1"]).init_scale == OPTIONS["init_scale"].default
    assert subcommand("eval").parse_args(["--model", "m"]).init_scale is None  # the model config's
