"""The one declaration of how every generation option reaches each interface.

`GenerationOptions` (options.py) holds each option's name, type and default and checks values;
this table adds what the interfaces need: help text, group, the kind of value, and where the
option is exposed. `rdepth generate`'s flags, the HTTP body fields, transformers `generate`'s
kwargs and lm-eval's `model_args` / `gen_kwargs` are derived from it, defaults and help included,
and a test fails when a field is missing here or an interface declares an option by hand.

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
from dataclasses import MISSING, dataclass, fields
from typing import Any

from recurrent_depth.inference.cache import CACHE_IMPLEMENTATIONS
from recurrent_depth.inference.criteria import CRITERIA, resolve_criterion
from recurrent_depth.inference.options import (
    DEFAULTS,
    MIN_STEPS_RULES,
    SAMPLERS,
    WARM_START_SOURCES,
    GenerationOptions,
    OptionError,
)

GROUPS = {
    "depth": "depth",
    "exit": "adaptive depth (per-token exit, warm start)",
    "cache": "KV cache",
    "mode": "speculative and parallel decoding",
    "sampling": "sampling and stopping",
    "output": "output",
}
KINDS = ("int", "float", "bool", "str", "seed", "stop", "any")
AUTO = "auto"  # exit_threshold="auto": the criterion's threshold in the official code


@dataclass(frozen=True)
class Option:
    """How one `GenerationOptions` field is offered.

    kind: int | float | bool | str | seed (an int, or one per row) | stop (ids and strings) | any.
    choices: allowed values of a str option (a callable when the list is a registry).
    shown: the default as help text shows it (None: the field's default).
    cli: a `rdepth generate` flag; cli_default: the flag's default where the CLI differs.
    http: an extra body field of the OpenAI-compatible server; http_max: the server's upper bound
      for it (a number, or the name of a `serving.protocol.Limits` attribute).
    hf: "shared" (transformers' own loop understands it too) or "routed" (only
      `recurrent_depth.generate` does: transformers `generate` routes the call there).
    lm_eval: "model" (a model_arg, and a gen_kwargs override) or "gen" (gen_kwargs only).
    """

    name: str
    group: str
    help: str
    kind: str
    choices: Any = None
    shown: str | None = None
    cli: bool = True
    cli_default: Any = None
    http: bool = False
    http_max: float | str | None = None
    hf: str | None = None
    lm_eval: str | None = None

    @property
    def default(self) -> Any:
        f = next(f for f in fields(GenerationOptions) if f.name == self.name)
        return None if f.default is MISSING else f.default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def allowed(self) -> tuple | None:
        return tuple(self.choices()) if callable(self.choices) else self.choices

    def shown_default(self, cli: bool = False) -> str:
        """The default as help text shows it (`cli`: the flag's, where the CLI has its own)."""
        if cli and self.cli_default is not None:
            value = self.cli_default
        elif self.shown is not None:
            return self.shown
        else:
            value = self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        return "none" if value is None else str(value)

    def describe(self) -> str:
        """The help text with its default, as every interface shows it."""
        return f"{self.help} (default: {self.shown_default(cli=True)})"


def _criteria() -> list[str]:
    return sorted(CRITERIA)


OPTIONS: dict[str, Option] = {o.name: o for o in (
    Option("max_new_tokens", "depth", "tokens to generate", "int", hf="shared"),
    Option("num_steps", "depth", "recurrence depth r: core steps per token (the prompt runs at r)", "int",
           shown="the model's mean_recurrence", http=True, http_max="max_num_steps", hf="shared", lm_eval="model"),
    Option("init_scale", "depth", "scale of the random initial state s_0; 0 = zeros, deterministic", "float",
           http=True, http_max=100.0, hf="shared", lm_eval="model"),
    Option("exit_criterion", "exit", "stop each token's recurrence when this statistic converges", "str",
           choices=_criteria, shown="none, fixed depth", http=True, hf="routed", lm_eval="model"),
    Option("exit_threshold", "exit", "the criterion's threshold; 'auto' = the official code's threshold for the "
           "criterion (kl 1e-3, entropy-diff 1e-3, latent-diff 0.03, cosine 1e-3, argmax-stability 5)", "float",
           shown="the criterion's own, kl 5e-4", http=True, hf="routed", lm_eval="model"),
    Option("min_steps", "exit", "fewest core steps before a token may exit (see min_steps_rule)", "int",
           shown="1; official: 0", http=True,
           http_max="max_num_steps", hf="routed", lm_eval="model"),
    Option("max_steps", "exit", "most core steps with an exit criterion", "int", shown="r", http=True,
           http_max="max_num_steps", hf="routed"),
    Option("warm_start", "exit", "start each token from the previous token's final state (continuous CoT)",
           "bool", http=True, hf="routed", lm_eval="model"),
    Option("warm_start_source", "exit", "what warm start reuses: the 'raw' final state or its ln_f output "
           "'normed' (the official fixed-depth loop's)", "str", choices=WARM_START_SOURCES,
           shown="raw; official: normed without an exit criterion", http=True, hf="routed", lm_eval="model"),
    Option("exit_in_prefill", "exit", "the prompt runs under the exit criterion too (its positions stop "
           "together); the official default", "bool", shown="off; official: on", http=True, hf="routed",
           lm_eval="model"),
    Option("min_steps_rule", "exit", "'exit': statistics from step 1, exit from min_steps; 'skip' (official): "
           "no check and no statistic before step min_steps + 1", "str", choices=MIN_STEPS_RULES,
           shown="exit; official: skip", http=True, hf="routed", lm_eval="model"),
    Option("check_every", "exit", "evaluate the exit criterion every n-th step only", "int", http=True,
           http_max="max_num_steps", hf="routed", lm_eval="model"),
    Option("kv_budget", "cache", "KV entries per token and core layer: step i uses slot i mod k", "int",
           shown="one per step", http=True, http_max="max_num_steps", hf="shared", lm_eval="model"),
    Option("kv_policy", "cache", "KV policy '<slots>[+<lookup>]': slots per-step | last-step | shared-K | anchor-K, "
           "lookup for early-exited tokens deepest | skip | full | always-last | randomized, e.g. 'shared-4+skip', "
           "or an official cache_lookup_strategy such as 'latest-m4-compress-s16' (docs/inference.md)", "str",
           shown="per-step+deepest",
           http=True, hf="shared", lm_eval="model"),
    Option("kv_quant", "cache", "quantize the KV cache, e.g. 'k=prod:3.5,v=mse:3.5' (TurboQuant; methods mse, prod, "
           "qjl, polar, raw); ',attn=dequantize' decodes before attention instead of scoring the codes; "
           "a fractional split codes each head's highest-energy key channels in the prompt at the higher width, "
           "',outliers=calibrated' the values' too, ',outliers=first' channels 0..n_out-1 (docs/quant.md)", "str",
           shown="off, full precision",
           http=True, hf="routed", lm_eval="model"),
    Option("cache_implementation", "cache", "KV storage: preallocated 'static' or the plain 'dynamic' reference",
           "str", choices=CACHE_IMPLEMENTATIONS, hf="routed"),
    Option("draft_steps", "mode", "self-speculative decoding: draft with this many core steps, verify at r",
           "int", shown="off", http=True, hf="routed"),
    Option("lookahead", "mode", "self-speculative: drafted tokens per round", "int", http=True,
           http_max="max_lookahead", hf="routed"),
    Option("verification_threshold", "mode", "self-speculative: 1 = exact (greedy at r); t < 1 accepts a draft "
           "whose verifier probability is >= t * the top probability", "float", http=True, hf="routed"),
    Option("sampler", "mode", "decoding loop: one token at a time, or the diffusion-forcing style wavefront",
           "str", choices=SAMPLERS, hf="routed"),
    Option("inner_steps", "mode", "parallel: core steps per sweep", "int", hf="routed"),
    Option("headway", "mode", "parallel: new positions per sweep", "int", hf="routed"),
    Option("wavefront", "mode", "parallel: new positions join while fewer than this many refine", "int",
           hf="routed"),
    Option("max_wavefront", "mode", "parallel: freeze the front when more positions than this refine", "int",
           hf="routed"),
    Option("do_sample", "sampling", "sample instead of greedy decoding", "bool", shown="greedy; the CLI turns it "
           "on with --temperature/--top-k/--top-p/--min-p", hf="shared", lm_eval="gen"),
    Option("temperature", "sampling", "sampling temperature (0 asks for greedy)", "float", http=True,
           http_max=100.0, hf="shared", lm_eval="gen"),
    Option("top_k", "sampling", "keep the k most likely tokens", "int", shown="all", http=True, hf="shared",
           lm_eval="gen"),
    Option("top_p", "sampling", "nucleus sampling: keep the most likely tokens holding this mass", "float",
           shown="off", http=True, hf="shared", lm_eval="gen"),
    Option("min_p", "sampling", "drop tokens below min_p * the top probability", "float", shown="off",
           http=True, hf="shared", lm_eval="gen"),
    Option("repetition_penalty", "sampling", "penalise tokens already in the row, > 1 (CTRL rule; 1 = off)",
           "float", http=True, http_max=100.0, hf="shared", lm_eval="gen"),
    Option("seed", "sampling", "random seed: row b uses seed + b (or one seed per row)", "seed", cli_default=0,
           shown="none: fresh randomness; rdepth's --seed 0", hf="routed"),
    Option("stop", "sampling", "stop when this text (or token id) appears; the model's eos always stops",
           "stop", shown="none", hf="routed"),
    Option("fast", "output", "the fused runner; --no-fast runs the model's own modules (the reference)", "bool",
           hf="routed"),
    Option("output_logits", "output", "keep the logits of every chosen token", "bool", cli=False, hf="routed"),
    Option("finish_round", "mode", "self-speculative: commit the whole last round, past max_new_tokens (the "
           "official loop)", "bool", shown="off; official: on", http=True, hf="routed"),
    Option("eos_token_id", "sampling", "ids that end a row (an id or a list; [] = none), replacing the model "
           "config's; transformers generate's eos_token_id", "any", shown="the config's", cli=False),
    Option("defaults", "depth", "whose defaults fill the options left unset: ours (the paper's) or 'official' "
           "(the official Huginn code's, so its calls give its tokens)", "str", choices=DEFAULTS, shown="ours",
           http=True, lm_eval="model"),
    Option("teacher_tokens", "output", "teacher forcing: the tokens to feed instead of the chosen ones", "any",
           cli=False),
)}


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


def _is_set(value: Any, default: Any) -> bool:
    scalar = isinstance(value, bool | int | float | str)
    return not (value is default or (scalar and type(value) is type(default) and value == default))


def official_auto_threshold(criterion: Any) -> float:
    """exit_threshold="auto": the criterion's threshold in the official code (huginn-0125.md §4)."""
    if not isinstance(criterion, str) or criterion not in CRITERIA:
        raise OptionError("exit_threshold", f"exit_threshold='auto' needs an exit_criterion, one of {_criteria()}")
    return resolve_criterion(criterion, None, official=True)[1]  # differs from ours for kl only


def canonical(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Official names -> our options: (options by field name, {field: the alias the caller used}).

    A value equal to the option's default counts as not given, so `rd.generate`'s flat keyword
    defaults never clash with an alias; two different values for one option are an OptionError."""
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for name, value in values.items():
        alias = OFFICIAL_ALIASES.get(name)
        field = alias.field if alias else name
        if alias is not None and alias.convert is not None and value is not None:
            try:
                value = alias.convert(value)
            except ValueError as exc:
                raise OptionError(field, str(exc)) from None
        default = OPTIONS[field].default if field in OPTIONS else None
        if field in out and _is_set(value, default) and _is_set(out[field], default) and out[field] != value:
            first = given_as.get(field, field)
            raise OptionError(field, f"{first} and {name} set the same option ({field}); give one of them")
        if field not in out or _is_set(value, default):
            out[field] = value
            if alias is not None:
                given_as[field] = name
            else:
                given_as.pop(field, None)
    if isinstance(out.get("exit_threshold"), str) and out["exit_threshold"] == AUTO:
        out["exit_threshold"] = official_auto_threshold(out.get("exit_criterion"))
    return out, given_as


def unknown_names(names: Any, known: Any) -> list[str]:
    return sorted(set(names) - set(known))


def kwarg_spelling(given_as: dict[str, str]) -> Callable[[str], str]:
    """Fields by the names a kwargs caller used (an official alias where it used one)."""
    return lambda name: given_as.get(name, name)


def cli_spelling(given_as: dict[str, str]) -> Callable[[str], str]:
    """Fields by their `rdepth generate` flags (the alias flag where the caller used one)."""
    def spelled(name: str) -> str:
        used = given_as.get(name, name)
        return "--" + used.replace("_", "-")
    return spelled


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
    check_type(name, value)
    return value


# ---------------------------------------------------------------------------------------- CLI
def _threshold(text: str) -> float | str:
    return AUTO if text == AUTO else float(text)


def _argument(parser: Any, flag: str, dest: str, kind: str, help: str, choices: tuple | None,
              default: Any) -> None:
    if kind == "bool":
        parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help)
    elif kind == "stop":
        parser.add_argument(flag, dest=dest, action="append", default=default, metavar="TEXT", help=help)
    else:
        types = {"int": int, "seed": int, "float": _threshold if dest == "exit_threshold" else float, "str": str}
        parser.add_argument(flag, dest=dest, type=types[kind], choices=choices, default=default,
                            metavar=None if choices else ("N" if kind in ("int", "seed") else
                                                          "X" if kind == "float" else "NAME"),
                            help=help)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Every CLI option and official alias as a flag, in its group (flags not given stay None)."""
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for option in OPTIONS.values():
        if option.cli:
            _argument(groups[option.group], option.flag, option.name, option.kind, option.describe(),
                      option.allowed(), option.cli_default)
    groups["mode"].add_argument("--parallel", dest="sampler", action="store_const", const="parallel",
                                help="the same as --sampler parallel")
    for alias in OFFICIAL_ALIASES.values():
        field = OPTIONS[alias.field]
        choices = None if alias.convert else field.allowed()
        _argument(groups[field.group], alias.flag, alias.name, alias.kind, alias.describe(), choices, None)


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
