"""How every generation option reaches each interface, derived from its one declaration.

Each option is a `GenerationOptions` field (options.py) whose metadata (`Option`) holds its help
text, group, kind, range and where it is exposed; `OPTIONS` lists them. `rdepth generate`'s flags
(and the generation flags of `serve`, `info`, `eval` and `analyze`), the HTTP body fields,
transformers `generate`'s kwargs and lm-eval's `model_args` / `gen_kwargs` come from it here,
defaults and help included, and a test fails when an interface declares an option by hand.

Interfaces spell an option their way: the CLI flag is ``--`` + the name with dashes, HTTP and
kwargs use the name itself. Errors come back in the caller's spelling through
`OptionError.spelled` (see `cli_spelling`, `kwarg_spelling`).

The official Huginn-0125 code's kwargs (`criterion`, `cache_lookup_strategy`,
`continuous_compute`, `lookahead_for_draft`, and `exit_threshold="auto"` as a value) are accepted
everywhere as `OFFICIAL_ALIASES` of our options.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recurrent_depth.inference.criteria import CRITERIA, resolve_criterion
from recurrent_depth.inference.options import (
    GROUPS,
    KINDS,  # noqa: F401  (the schema's vocabulary, with GROUPS and OPTIONS)
    OPTIONS,
    OptionError,
    criterion_names,
)

AUTO = "auto"  # exit_threshold="auto": the criterion's threshold in the official code


# ---------------------------------------------------------------------------------------- official aliases
def _negated(value: Any) -> Any:
    return not value if isinstance(value, bool) else value  # (a non-bool is refused by validation)


@dataclass(frozen=True)
class Alias:
    """An official kwarg that sets one of our options (`convert` maps its value)."""

    name: str
    field: str
    convert: Callable[[Any], Any] | None = None
    value_kind: str | None = None  # the alias's own kind where `convert` keeps it (else "str")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> str:
        if self.value_kind is not None:
            return self.value_kind
        return "str" if self.convert is not None else OPTIONS[self.field].kind

    def describe(self) -> str:
        return f"the official code's name of {OPTIONS[self.field].flag}"


OFFICIAL_ALIASES: dict[str, Alias] = {a.name: a for a in (
    Alias("criterion", "exit_criterion"),
    Alias("cache_lookup_strategy", "kv_policy"),  # kv_policy takes the official strategy names
    Alias("continuous_compute", "warm_start"),
    Alias("do_not_exit_in_prefill", "exit_in_prefill", _negated, value_kind="bool"),
    Alias("check_criterion_every_n_steps", "check_every"),
    Alias("lookahead_for_draft", "lookahead"),
)}


def names_for(where: str, value: Any = True) -> tuple[str, ...]:
    """The options one interface takes: `where` an `Option` attribute (cli, http, hf, lm_eval) and
    `value` what it must hold (e.g. hf="routed"), aliases included."""
    own = [o.name for o in OPTIONS.values() if (getattr(o, where) == value if value is not True
                                               else bool(getattr(o, where)))]
    return tuple(own + [a.name for a in OFFICIAL_ALIASES.values() if a.field in own])


def official_auto_threshold(criterion: Any) -> float:
    """exit_threshold="auto": the criterion's threshold in the official code (huginn-0125.md §4)."""
    if not isinstance(criterion, str) or criterion not in CRITERIA:
        raise OptionError("exit_threshold",
                          f"exit_threshold='auto' needs an exit_criterion, one of {criterion_names()}")
    return resolve_criterion(criterion, None, official=True)[1]  # differs from ours for kl only


def canonical(values: dict[str, Any], resolve_auto: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
    """Official names -> our options: (options by field name, {field: the alias the caller used}).

    None means "not given" (the option's default); one option given under two names with two
    different values is an OptionError. `resolve_auto=False` leaves exit_threshold="auto" as it is, for
    options that defaults (generation_config.json) complete first: "auto" means the threshold of the
    criterion the merged options name (`resolved_auto` of the merge)."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in values.items():
        alias = OFFICIAL_ALIASES.get(name)
        field = alias.field if alias else name
        if value is None:
            out.setdefault(field, None)
            continue
        if alias is not None and alias.convert is not None:
            try:
                value = alias.convert(value)
            except ValueError as exc:
                raise OptionError(field, str(exc)) from None
        if out.get(field) is not None and out[field] != value:
            first = given_as.get(field, field)
            raise OptionError(field, f"{first} and {name} set the same option ({field}); give one of them",
                              aliases=(first, name))
        out[field] = value
        if alias is not None:
            given_as[field] = name
        else:
            given_as.pop(field, None)
    return (resolved_auto(out) if resolve_auto else out), given_as


def resolved_auto(options: dict[str, Any]) -> dict[str, Any]:
    """`options` (by field name) with exit_threshold="auto" replaced by the official threshold of their
    exit_criterion (an OptionError without one)."""
    if isinstance(options.get("exit_threshold"), str) and options["exit_threshold"] == AUTO:
        return {**options, "exit_threshold": official_auto_threshold(options.get("exit_criterion"))}
    return options


def unknown_names(names: Any, known: Any) -> list[str]:
    return sorted(set(names) - set(known))


def negating(spelling: Callable[[str], str], given_as: dict[str, str]) -> Callable[[str], str]:
    """`spelling`, marked with the fields the caller gave by an alias of the opposite meaning
    (`do_not_exit_in_prefill`): `options.spell` flips their `=True` / `=False`."""
    spelling.negated = {f for f, name in given_as.items()  # type: ignore[attr-defined]
                        if name in OFFICIAL_ALIASES and OFFICIAL_ALIASES[name].convert is _negated}
    return spelling


def kwarg_spelling(given_as: dict[str, str]) -> Callable[[str], str]:
    """Fields by the names a kwargs caller used (an official alias where it used one)."""
    return negating(lambda name: given_as.get(name, name), given_as)


def cli_spelling(given_as: dict[str, str]) -> Callable[[str], str]:
    """Fields by their `rdepth generate` flags (the alias flag where the caller used one)."""
    def spelled(name: str) -> str:
        used = given_as.get(name, name)
        return "--" + used.replace("_", "-")
    return negating(spelled, given_as)


# ---------------------------------------------------------------------------------------- values
def type_error(kind: str, value: Any, choices: tuple | None = None) -> str | None:
    """What a value of this kind must be, or None when `value` is one (None is always allowed:
    it means "the default"). Ranges are `GenerationOptions.validate`'s job."""
    if value is None:
        return None
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return "an integer"
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "a number"
        try:
            if not math.isfinite(value):
                return "a finite number"
        except OverflowError:
            return "a finite number"
    if kind == "bool" and not isinstance(value, bool):
        return "true or false"
    if kind == "str":
        if not isinstance(value, str):
            return "a string"
        if choices is not None and value not in choices:
            return f"one of {list(choices)}"
    return None


def check_type(name: str, value: Any) -> None:
    """OptionError unless `value` has the type of option (or alias) `name`."""
    alias = OFFICIAL_ALIASES.get(name)
    option = OPTIONS[alias.field if alias else name]
    kind = alias.kind if alias else option.kind
    if name == "exit_threshold" and value == AUTO:
        return
    expected = type_error(kind, value, None if alias and alias.convert else option.allowed())
    if expected is not None:
        raise OptionError(option.name, f"{name}={value!r} is invalid: expected None or {expected}")


def from_text(name: str, value: Any) -> Any:
    """A value from a text source (lm-eval's `model_args`, already typed where lm-eval could tell)."""
    alias = OFFICIAL_ALIASES.get(name)
    kind = alias.kind if alias else OPTIONS[name].kind
    if isinstance(value, str):
        low = value.strip().lower()
        if low == "none":
            return None
        if kind == "bool" and low in ("true", "false", "yes", "no", "1", "0"):
            return low in ("true", "yes", "1")
        if kind == "float" and not (name == "exit_threshold" and low == AUTO):
            try:
                return float(value)
            except ValueError:
                pass
    if kind == "bool" and isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if kind == "int" and isinstance(value, float) and value.is_integer():
        # lm-eval types "8" as 8 but "-1" as -1.0 (str.isnumeric() is False for it): the range check
        # should then say "num_steps=-1 ... >= 0", not "-1.0 ... expected an integer".
        return int(value)
    check_type(name, value)
    return value


# ---------------------------------------------------------------------------------------- CLI
def _threshold(text: str) -> float | str:
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:  # argparse would name this function ("invalid _threshold value")
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def _argument(parser: Any, flag: str, dest: str, kind: str, help: str, choices: tuple | None,
              default: Any, metavar: str | None = None) -> None:
    if kind == "bool":
        parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help)
    elif kind == "stop":  # text from --stop, token ids from --stop-id: both add to the one list
        parser.add_argument(flag, dest=dest, action="append", default=default, metavar="TEXT", help=help)
        parser.add_argument(flag + "-id", dest=dest, action="append", type=int, metavar="N",
                            help="stop when this token id appears (repeatable; with --stop, any of them stops)")
    else:
        types = {"int": int, "seed": int, "float": _threshold if dest == "exit_threshold" else float, "str": str}
        if metavar is None and not choices:
            metavar = "N" if kind in ("int", "seed") else "X" if kind == "float" else "NAME"
        parser.add_argument(flag, dest=dest, type=types[kind], choices=choices, default=default, metavar=metavar,
                            help=help)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Every CLI option and official alias as a flag, in its group (flags not given stay None)."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for option in OPTIONS.values():
        if option.cli:
            _argument(groups[option.group], option.flag, option.name, option.kind, option.describe(),
                      option.allowed(), option.cli_default, option.metavar)
    groups["mode"].add_argument("--parallel", dest="sampler", action="store_const", const="parallel",
                                help="the same as --sampler parallel")
    for alias in OFFICIAL_ALIASES.values():
        field = OPTIONS[alias.field]
        choices = None if alias.convert else field.allowed()
        _argument(groups[field.group], alias.flag, alias.name, alias.kind, alias.describe(), choices, None)


def add_option_flags(parser: Any, names: tuple[str, ...], helps: dict[str, str] | None = None,
                     field_defaults: bool = False) -> None:
    """Some options as flags of a command other than `rdepth generate` (serve, info, eval,
    analyze), with the schema's flag, kind, choices and metavar. `helps` words an option the
    command's way where it means more there (serve's --kv-quant sets the server's KV memory), its
    default included. Flags not given stay None, or with `field_defaults` take the field's default."""
    for name in names:
        option = OPTIONS[name]
        default = option.default if field_defaults else None
        shown = option.shown_default() if field_defaults else option.shown_default(cli=True)
        help = (helps or {}).get(name, f"{option.help} (default: {shown})")
        _argument(parser, option.flag, name, option.kind, help, option.allowed(), default, option.metavar)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    """The options and aliases given on the command line (not None), by their names."""
    return {name: getattr(args, name) for name in names_for("cli") if getattr(args, name, None) is not None}


# ---------------------------------------------------------------------------------------- docs
def options_markdown() -> str:
    """The options table of docs/inference.md (a test keeps the two equal)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    aliases = {a.field: a.name for a in OFFICIAL_ALIASES.values()}
    rows = ["| option | group | default | CLI flag | HTTP | transformers | lm-eval | official name | what |",
            "|---|---|---|---|---|---|---|---|---|"]
    for o in OPTIONS.values():
        hf_use = {"shared": "both loops", "routed": "routed"}.get(o.hf or "", "")
        lm = {"model": "model_args, gen_kwargs", "gen": "gen_kwargs"}.get(o.lm_eval or "", "")
        official = f"`{aliases[o.name]}`" if o.name in aliases else ""
        rows.append(f"| `{o.name}` | {o.group} | {cell(o.shown_default())} | {f'`{o.flag}`' if o.cli else ''} | "
                    f"{'yes' if o.http else ''} | {hf_use} | {lm} | {official} | {cell(o.help)} |")
    return "\n".join(rows) + "\n"
