"""Every generation option, declared once: a `GenerationOptions` field holds its default and, as
metadata, its `Option` (help, group, kind, range, and where it is offered: CLI flag, HTTP field,
transformers, lm-eval). `GenerationOptions.validate` checks every field against that metadata,
fills the defaults that depend on the profile and the model, and returns a frozen
`ResolvedOptions` that also holds what the fields parse to (exit criterion, KV policy, KV
quantization). `schema.py` derives every interface from `OPTIONS`."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from typing import Any

from recurrent_depth.config import FLOAT32_MAX, MAX_NUM_STEPS
from recurrent_depth.inference.cache import CACHE_IMPLEMENTATIONS
from recurrent_depth.inference.criteria import CRITERIA, CriterionSpec, resolve_criterion
from recurrent_depth.inference.quant_cache import KVQuant, parse_kv_quant_option
from recurrent_depth.model.cache import KVPolicy, parse_kv_policy
from recurrent_depth.model.recurrent import DEPTH_CEILING_HINT

SAMPLERS = ("autoregressive", "parallel")
PARALLEL_CRITERIA = ("latent-diff", "cosine")
DEFAULTS = ("official",)
MIN_STEPS_RULES = ("exit", "skip")
WARM_START_SOURCES = ("raw", "normed")
EXIT_KV = ("lookup", "compute")
GRADMEM_INITS = ("tail", "random")  # the memory's initial value (inference/gradmem.py)
TTT_OPTIMIZERS = ("sgd", "adam")  # TTT-E2E's inner optimizer (inference/ttt_e2e.py)
DEFAULT_TTT_MAX_COPY_MB = 1024  # the server's bound on a TTT-E2E request's weight copy (rdepth serve --ttt-max-copy-mb)
# The official code's hard-coded stops (begin_text, end_text, end_turn of Huginn's tokenizer).
OFFICIAL_STOP_IDS = (65504, 65505, 65508)
# The ceiling of ttt_steps and gradmem_steps, as MAX_NUM_STEPS is of depths: each step is a forward and backward pass
# over the prompt (the papers take a handful); unbounded, ttt_steps=10**9 ran forever (the server's cap is 64)
MAX_TEST_TIME_STEPS = 1024
OFFICIAL_SPECULATIVE_STEPS = 32  # the official generate_speculative's num_steps default
OFFICIAL_KV_POLICY = "full"  # the official dynamic cache's default lookup strategy
GROUPS = {
    "depth": "depth",
    "ttt-e2e": "TTT-E2E: test-time gradient steps on a subset of the weights (docs/test-time-training.md)",
    "exit": "adaptive depth (per-token exit, warm start)",
    "cache": "KV cache",
    "mode": "speculative and parallel decoding",
    "sampling": "sampling and stopping",
    "output": "output",
    "ttt": "test-time training (GradMem memory tokens; docs/test-time-training.md)",
}
KINDS = ("int", "float", "bool", "str", "seed", "stop", "any")


class OptionError(ValueError):
    """A bad generation option: `field` is the option at fault, the message speaks of fields by
    their `GenerationOptions` names; `spelled` re-words it in a caller's terms (a CLI flag, a JSON
    field, an official kwarg) without parsing it."""

    def __init__(self, field: str, message: str, spelling: Any = None, aliases: tuple[str, ...] = ()) -> None:
        self.field = field
        self.message = message
        self.aliases = aliases  # other names the message uses (the official aliases it quotes)
        super().__init__(message if spelling is None else spell(message, spelling, aliases))

    def spelled(self, spelling: Any) -> OptionError:
        """The same error with every option name `n` in the message written `spelling(n)`."""
        return OptionError(self.field, self.message, spelling, self.aliases)


def spell(message: str, spelling: Any, aliases: tuple[str, ...] = ()) -> str:
    """`message` with option names re-spelled: names with an underscore wherever they stand as a
    word, one-word names (stop, seed, ...) only as `name=`, where they cannot be ordinary words, and
    not after `,` or `'`: there `seed=` is a key inside a quoted value (a kv_quant spec's), not ours."""
    names = sorted(GenerationOptions.names() | set(aliases), key=len, reverse=True)
    pattern = "|".join(rf"{n}(?![\w-])" if "_" in n else rf"(?<![,']){n}(?==)" for n in names)
    negated = getattr(spelling, "negated", ())  # options spelled by an alias of the opposite meaning

    def respelled(m: re.Match) -> str:
        value = m.group(2) or ""
        if value and m.group(1) in negated:  # exit_in_prefill=True is do_not_exit_in_prefill=False
            value = "=False" if value == "=True" else "=True"
        return spelling(m.group(1)) + value

    return re.sub(rf"(?<![\w\-.])({pattern})(=(?:True|False)(?!\w))?", respelled, message)


@dataclass(frozen=True)
class Option:
    """How one `GenerationOptions` field is checked and offered (its metadata).

    kind: int | float | bool | str | seed (an int, or one per row) | stop (ids and strings) | any.
    choices: allowed values of a str option; a tuple is checked by `validate`, a callable (a
      registry, e.g. the exit criteria) only lists them: the option's own parser checks it.
    shown: the default as help text shows it (None: the field's default).
    low / high: the range `validate` checks (int: low, and high where set; float: both, open where low_open /
      high_open). `low` and `low_open` may be functions of the other values where the bound
      depends on them. optional: None stays valid after resolution (off, or not set).
      range_hint: said after the range where a value is the excluded bound `low` (e.g. how to get what 0 means
      elsewhere).
    unset: what None means for a str option with choices ("ours", "the profile's"), None where
      None is not allowed.
    cli: a `rdepth generate` flag; cli_default: the flag's default where the CLI differs; metavar:
      the flag's value as help shows it (None: N, X or NAME by kind).
    http: an extra body field of the OpenAI-compatible server; http_max: the server's upper bound
      for it (a number, or the name of a `serving.protocol.Limits` attribute).
    hf: "shared" (transformers' own loop understands it too) or "routed" (only
      `recurrent_depth.generate` does: transformers `generate` routes the call there).
    lm_eval: "model" (a model_arg, and a gen_kwargs override) or "gen" (gen_kwargs only).
    name, default: the field's (filled in `OPTIONS`).
    """

    group: str
    help: str
    kind: str
    choices: Any = None
    shown: str | None = None
    low: Any = None
    high: float | None = None
    low_open: Any = False
    high_open: bool = False
    range_hint: str = ""
    optional: bool = False
    unset: str | None = None
    cli: bool = True
    cli_default: Any = None
    metavar: str | None = None
    http: bool = False
    http_max: float | str | None = None
    hf: str | None = None
    lm_eval: str | None = None
    name: str = ""
    default: Any = None

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

    def check(self, values: dict[str, Any]) -> None:
        """OptionError unless this option's value in `values` (resolved) has its kind and range."""
        value = values[self.name]
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise OptionError(self.name, f"{self.name}={value!r} is invalid: expected True or False")
            return
        if self.low is None or (value is None and self.optional):
            return
        low = self.low(values) if callable(self.low) else self.low
        extra = "None or " if self.optional else ""
        if self.kind == "int":
            high = math.inf if self.high is None else self.high
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                bound = f">= {low}" if self.high is None else f"in [{low}, {high}]"
                raise OptionError(self.name, f"{self.name}={value!r} is invalid: expected {extra}an integer {bound}")
            return
        low_open = self.low_open(values) if callable(self.low_open) else self.low_open
        if not in_range(value, low, self.high, low_open, self.high_open):
            lo, hi = "(" if low_open else "[", ")" if self.high_open else "]"
            raise OptionError(
                self.name, f"{self.name}={value!r} is invalid: expected {extra}a number in {lo}{low}, {self.high}{hi}"
                + (f" ({self.range_hint})" if self.range_hint and low_open and value == low else "")
            )

    @property
    def counts_steps(self) -> bool:
        """A number of core steps: at most the depth ceiling (the server's bound is its max_num_steps)."""
        return self.http_max == "max_num_steps"

    def check_ceiling(self, values: dict[str, Any], ceiling: int) -> None:
        """OptionError if this option counts core steps and its value in `values` (checked by `check`) is
        past `ceiling`."""
        value = values[self.name]
        if self.counts_steps and value is not None and value > ceiling:
            extra = "None or " if self.optional else ""
            low = self.low(values) if callable(self.low) else self.low
            raise OptionError(self.name, f"{self.name}={value!r} is invalid: expected {extra}an integer in "
                              f"[{low}, {ceiling}] {DEPTH_CEILING_HINT}")

    def check_choice(self, value: Any) -> None:
        """OptionError unless `value` is one of a str option's fixed choices (or None where allowed)."""
        if not isinstance(self.choices, tuple) or (value is None and self.unset) or value in self.choices:
            return
        extra = f"None ({self.unset}) or " if self.unset else ""
        raise OptionError(self.name, f"{self.name}={value!r} is invalid: expected {extra}one of {self.choices}")


def in_range(value: Any, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    """`value` is a number (not a bool, not NaN) between low and high."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        if math.isnan(value):
            return False
    except OverflowError:  # an int beyond float range
        return False
    return (value > low if low_open else value >= low) and (value < high if high_open else value <= high)


def option(default: Any, group: str, help: str, kind: str, **metadata: Any) -> Any:
    """A `GenerationOptions` field: its default, and its `Option` as the field's metadata."""
    return field(default=default, metadata={"option": Option(group, help, kind, **metadata)})


def criterion_names() -> list[str]:
    return sorted(CRITERIA)


def min_steps_floor(values: dict[str, Any]) -> int:
    """Rule "skip" counts unchecked steps (0 allowed); rule "exit" counts steps run before an exit."""
    return 0 if values["min_steps_rule"] == "skip" else 1


def sampling_temperature(values: dict[str, Any]) -> bool:
    """Greedy decoding ignores the temperature, so 0 (the OpenAI way to ask for greedy) is fine there."""
    return values["do_sample"] is not False


@dataclass(frozen=True)
class GenerationOptions:
    """Generation settings: each field is one option, its metadata (`Option`) says how it is
    checked and offered (see `recurrent_depth.inference.generate` for what each one does).

    Fields whose default is None and that the official code (seal-rg/recurrent-pretraining,
    `raven_modeling_minimal.py` at 59e0b69) sets differently take the default of the `defaults`
    profile: None = ours (the paper's), "official" = the official code's, so that the same call
    gives the same tokens. A value the caller sets always wins. Those fields:

    defaults: None (ours) or "official".
    exit_in_prefill: the prompt may stop its recurrence early: its positions stop together when
      the criterion holds on the prompt (output criteria read the last position, latent ones
      average over the real positions). Ours False (the prompt runs at full depth); official True
      (its `do_not_exit_in_prefill=False`).
    min_steps / min_steps_rule: rule "exit" (ours): the criterion's statistic is updated from step
      1 and a row may exit once it has run `min_steps` (default 1) steps. Rule "skip" (the
      official loop's schedule): the first `min_steps` (default 0) steps run without the
      criterion, no check and no statistic update, so the first check follows step min_steps + 1
      and compares with the criterion's prior (uniform for kl, 100 for entropy-diff: those run
      >= min_steps + 2 steps; s_0 for the latent criteria, which can exit at min_steps + 1); and a
      token that reaches max_steps on an unchecked step keeps the logits of its last check, as the
      official loop does (rule "exit" reads its final state).
    check_every: evaluate the criterion (statistic and check) every n-th step only: after steps
      first, first + n, ... (first = 1, or min_steps + 1 under "skip"); the official
      `check_criterion_every_n_steps`.
    warm_start_source: what warm start reuses as the next token's s_0: "raw" (the previous
      token's raw final state; ours, and the official adaptive path) or "normed" (its ln_f output,
      the official fixed-depth `generate_minimal`). Official: "normed" without an exit_criterion.
    finish_round: self-speculative decoding commits the whole last round even past
      max_new_tokens (the official loop); ours stops at max_new_tokens.
    eos_token_id: an id or a list of ids that end a row, replacing the model config's ([]: none);
      None = the config's. Official defaults also stop at `OFFICIAL_STOP_IDS` (its hard-coded stops).
    """

    max_new_tokens: int = option(64, "depth", "tokens to generate", "int", hf="shared", low=0)
    num_steps: int | None = option(None, "depth", "recurrence depth r: core steps per token (the prompt runs at r)",
        "int", shown="the model's mean_recurrence", http=True, http_max="max_num_steps", hf="shared", lm_eval="model",
        low=0)
    init_scale: float | None = option(None, "depth", "scale of the random initial state s_0; 0 = zeros, "
        "deterministic", "float", shown="the model config's init_scale (Huginn's 1.0, Parcae's 1/sqrt(h) or 0)",
        http=True, http_max=100.0, hf="shared", lm_eval="model", low=0, high=math.inf, high_open=True)
    exit_criterion: str | None = option(None, "exit", "stop each token's recurrence when this statistic converges",
        "str", choices=criterion_names, shown="none, fixed depth", http=True, hf="routed", lm_eval="model")
    exit_threshold: float | None = option(None, "exit", "the criterion's threshold; 'auto' = the official code's "
        "threshold for the criterion (kl 1e-3, entropy-diff 1e-3, latent-diff 0.03, cosine 1e-3, argmax-stability 5, "
        "gate 1)", "float", shown="the criterion's own, kl 5e-4, gate 1", http=True, hf="routed", lm_eval="model")
    exit_kv: str = option("lookup", "exit", "KV of the steps an early-exited token skips: 'lookup' (it stops; the "
        "kv_policy's lookup rule serves them, deepest by default) or 'compute' (it runs on to max_steps for the KV, "
        "its output stays its exit step's: the Ouro reference)", "str", choices=EXIT_KV, http=True, hf="routed",
        lm_eval="model")
    min_steps: int | None = option(None, "exit", "fewest core steps before a token may exit (see min_steps_rule)",
        "int", shown="1; official: 0", http=True, http_max="max_num_steps", hf="routed", lm_eval="model",
        low=min_steps_floor)
    max_steps: int | None = option(None, "exit", "most core steps with an exit criterion", "int", shown="r", http=True,
        http_max="max_num_steps", hf="routed", low=1, optional=True)
    warm_start: bool = option(False, "exit", "start each token from the previous token's final state (continuous CoT)",
        "bool", http=True, hf="routed", lm_eval="model")
    warm_start_source: str | None = option(None, "exit", "what warm start reuses: the 'raw' final state or its ln_f "
        "output 'normed' (the official fixed-depth loop's)", "str", choices=WARM_START_SOURCES,
        shown="raw; official: normed without an exit criterion", http=True, hf="routed", lm_eval="model",
        unset="the profile's")
    exit_in_prefill: bool | None = option(None, "exit", "the prompt runs under the exit criterion too (its positions "
        "stop together); the official default", "bool", shown="off; official: on", http=True, hf="routed",
        lm_eval="model")
    min_steps_rule: str | None = option(None, "exit", "'exit': statistics from step 1, exit from min_steps; 'skip' "
        "(official): no check and no statistic before step min_steps + 1", "str", choices=MIN_STEPS_RULES,
        shown="exit; official: skip", http=True, hf="routed", lm_eval="model", unset="the profile's")
    check_every: int = option(1, "exit", "evaluate the exit criterion every n-th step only", "int", http=True,
        http_max="max_num_steps", hf="routed", lm_eval="model", low=1)
    kv_budget: int | None = option(None, "cache", "KV entries per token and core layer: step i uses slot i mod k",
        "int", shown="one per step", http=True, http_max="max_num_steps", hf="shared", lm_eval="model", low=1,
        optional=True)
    kv_policy: str | None = option(None, "cache", "KV policy '<slots>[+<lookup>]': slots per-step | last-step | "
        "shared-K | anchor-K, lookup for early-exited tokens deepest | skip | full | always-last | randomized, e.g. "
        "'shared-4+skip', or an official cache_lookup_strategy such as 'latest-m4-compress-s16' (docs/inference.md)",
        "str", shown="per-step+deepest", metavar="SLOTS[+LOOKUP]", http=True, hf="shared", lm_eval="model")
    kv_quant: str | None = option(None, "cache", "quantize the KV cache, e.g. 'k=prod:3.5,v=mse:3.5' (TurboQuant; "
        "methods mse, prod, qjl, polar, raw); ',attn=dequantize' decodes before attention instead of scoring the "
        "codes; a fractional split codes each head's highest-energy key channels in the prompt at the higher width, "
        "',outliers=calibrated' the values' too, ',outliers=first' channels 0..n_out-1; ',window=W' keeps the last W "
        "tokens of each sequence in bf16 (docs/quant.md)", "str",
        shown="off, full precision", metavar="SPEC", http=True, hf="routed", lm_eval="model")
    cache_implementation: str = option("static", "cache", "KV storage: preallocated 'static' or the plain 'dynamic' "
        "reference", "str", choices=CACHE_IMPLEMENTATIONS, hf="routed")
    draft_steps: int | None = option(None, "mode", "self-speculative decoding: draft with this many core steps, "
        "verify at r", "int", shown="off", http=True, hf="routed", low=0, optional=True)
    lookahead: int = option(8, "mode", "self-speculative: drafted tokens per round", "int", http=True,
        http_max="max_lookahead", hf="routed", low=1)
    verification_threshold: float = option(1.0, "mode", "self-speculative: 1 = exact (greedy at r); t < 1 accepts a "
        "draft whose verifier probability is >= t * the top probability", "float", http=True, hf="routed", low=0,
        high=1, low_open=True)
    sampler: str = option("autoregressive", "mode", "decoding loop: one token at a time, or the diffusion-forcing "
        "style wavefront", "str", choices=SAMPLERS, hf="routed")
    inner_steps: int = option(4, "mode", "parallel: core steps per sweep", "int", hf="routed", low=1)
    headway: int = option(1, "mode", "parallel: new positions per sweep", "int", hf="routed", low=1)
    wavefront: int = option(4, "mode", "parallel: new positions join while fewer than this many refine", "int",
        hf="routed", low=1)
    max_wavefront: int = option(128, "mode", "parallel: freeze the front when more positions than this refine", "int",
        hf="routed", low=1)
    do_sample: bool = option(False, "sampling", "sample instead of greedy decoding", "bool",
        shown="greedy; the CLI turns it on with --temperature/--top-k/--top-p/--min-p", hf="shared", lm_eval="gen")
    temperature: float = option(1.0, "sampling", "sampling temperature (0 asks for greedy)", "float", http=True,
        http_max=100.0, hf="shared", lm_eval="gen", low=0, high=math.inf, low_open=sampling_temperature,
        range_hint="when sampling; for greedy decoding leave do_sample off, where 0 means greedy",
        high_open=True)
    top_k: int | None = option(None, "sampling", "keep the k most likely tokens", "int", shown="all", http=True,
        hf="shared", lm_eval="gen", low=1, optional=True)
    top_p: float | None = option(None, "sampling", "nucleus sampling: keep the most likely tokens holding this mass",
        "float", shown="off", http=True, hf="shared", lm_eval="gen", low=0, high=1, low_open=True, optional=True)
    min_p: float | None = option(None, "sampling", "drop tokens below min_p * the top probability", "float",
        shown="off", http=True, hf="shared", lm_eval="gen", low=0, high=1, optional=True)
    repetition_penalty: float = option(1.0, "sampling", "penalise tokens already in the row, > 1 (CTRL rule; 1 = off)",
        "float", http=True, http_max=100.0, hf="shared", lm_eval="gen", low=0, high=math.inf, low_open=True,
        high_open=True)
    seed: Any = option(None, "sampling", "random seed: row b uses seed + b (or one seed per row)", "seed",
        cli_default=0, shown="none: fresh randomness; rdepth's --seed 0", hf="routed")
    stop: Any = option(None, "sampling", "stop when this text appears (repeatable); token ids: --stop-id N on "
        "the CLI, stop=[id, ...] in the API; the model's eos always stops", "stop", shown="none", hf="routed")
    fast: bool = option(True, "output", "the fused runner; --no-fast runs the model's own modules (the reference)",
        "bool", hf="routed")
    output_logits: bool = option(False, "output", "keep the logits of every chosen token", "bool", cli=False,
        hf="routed")
    ttt_params: str | None = option(None, "ttt-e2e", "TTT-E2E: train these weights on the prompt's next-token "
        "loss before generating: 'core-mlp' (the core's MLPs), 'core', 'prelude', 'coda', 'all' or comma-separated "
        "globs over parameter names; the base weights are never written", "str", shown="none, off", http=True,
        hf="routed", metavar="SUBSET")
    ttt_steps: int = option(4, "ttt-e2e", "TTT-E2E: optimizer steps on the prompt, each a forward and backward "
        "pass", "int", http=True, http_max=64, hf="routed", low=0, high=MAX_TEST_TIME_STEPS)
    ttt_lr: float = option(1e-3, "ttt-e2e", "TTT-E2E: the inner optimizer's learning rate", "float", http=True,
        http_max=100.0, hf="routed", low=0, high=FLOAT32_MAX, low_open=True,
        high_open=True)  # (torch's optimizers refuse an lr past float32's range: 1e308 was a RuntimeError)
    ttt_optimizer: str = option("sgd", "ttt-e2e", "TTT-E2E: the inner optimizer", "str", choices=TTT_OPTIMIZERS,
        http=True, hf="routed")
    ttt_depth: int | None = option(None, "ttt-e2e", "TTT-E2E: recurrence depth of the inner forward passes",
        "int", shown="num_steps", http=True, http_max="max_num_steps", hf="routed", low=1, optional=True)
    ttt_backprop: int | None = option(None, "ttt-e2e", "TTT-E2E: core steps under autograd (the last k of "
        "ttt_depth: truncated backprop as in training)", "int", shown="the model's mean_backprop_depth, at most "
        "the depth", http=True, http_max="max_num_steps", hf="routed", low=1, optional=True)
    finish_round: bool | None = option(None, "mode", "self-speculative: commit the whole last round, past "
        "max_new_tokens (the official loop)", "bool", shown="off; official: on", http=True, hf="routed")
    eos_token_id: Any = option(None, "sampling", "ids that end a row (an id or a list; [] = none), replacing the "
        "model config's; transformers generate's eos_token_id", "any", shown="the config's", cli=False)
    defaults: str | None = option(None, "depth", "whose defaults fill the options left unset: ours (the paper's) or "
        "'official' (the official Huginn code's, so its calls give its tokens)", "str", choices=DEFAULTS, shown="ours",
        http=True, lm_eval="model", unset="ours")
    teacher_tokens: Any = option(None, "output", "teacher forcing: the tokens to feed instead of the chosen ones",
        "any", cli=False)
    gradmem_tokens: int = option(0, "ttt", "GradMem: write the prompt's context into this many memory tokens by "
        "gradient steps on their embeddings (the model frozen), then generate from [memory; query] without the "
        "context; 0 = off", "int", shown="0, off", http=True, http_max=256, hf="routed", low=0)
    gradmem_steps: int = option(8, "ttt", "GradMem: SGD steps on the memory, each a forward and backward pass of "
        "the context's next-token loss given the memory", "int", http=True, http_max=64, hf="routed", low=0,
        high=MAX_TEST_TIME_STEPS)
    gradmem_lr: float = option(1.0, "ttt", "GradMem: the memory's SGD learning rate", "float", http=True,
        http_max=1e4, hf="routed", low=0, high=math.inf, low_open=True, high_open=True)
    gradmem_depth: int | None = option(None, "ttt", "GradMem: recurrence depth of the write passes, >= 1 (a "
        "random s_0 at depth 0 never reads the memory)", "int", shown="num_steps", http=True,
        http_max="max_num_steps", hf="routed", low=1, optional=True)
    gradmem_init: str = option("tail", "ttt", "GradMem: the initial memory: the embeddings of the context's last "
        "gradmem_tokens tokens ('tail') or random vectors at the embedding's scale from the seed ('random')", "str",
        choices=GRADMEM_INITS, http=True, hf="routed")
    gradmem_query_tokens: int = option(0, "ttt", "GradMem: the prompt's last n tokens are the query, read after "
        "the memory; the tokens before them are the context written into it", "int", http=True, hf="routed",
        low=0)


    @classmethod
    def names(cls) -> set[str]:
        return set(OPTIONS)

    @property
    def mode(self) -> str:
        if self.sampler == "parallel":
            return "parallel"
        if self.draft_steps is not None:
            return "speculative"
        return "autoregressive"

    def validate(self, mean_recurrence: int, gate_threshold: float | None = None,
                 init_scale: float = 1.0, max_depth: int = MAX_NUM_STEPS) -> ResolvedOptions:
        """Every field checked against its `Option`, the defaults that depend on the profile and on
        the model filled, the criterion, KV policy and KV quantization parsed. `gate_threshold` is the
        model's own q for `exit_criterion="gate"` (`ModelConfig.exit_gate_threshold`, Ouro's
        early_exit_threshold): the gate's default when `exit_threshold` is not given. `init_scale` is
        the model's s_0 scale (`ModelConfig.init_scale`, 1.0 unless set): the option's default, as in
        the model's forward, under both profiles (the official code's forward default is 1.0, every
        official checkpoint's). `max_depth` is the depth ceiling of every option that counts core steps
        (the model's `max_depth`)."""
        values = {name: getattr(self, name) for name in OPTIONS}
        given = dict(values)  # the caller's values (ignored_options compares them with the defaults)
        if values["exit_criterion"] == "gate" and values["exit_threshold"] is None and gate_threshold is not None:
            values["exit_threshold"] = gate_threshold
        asked_prefill_exit = values["exit_in_prefill"] is True
        for spec in OPTIONS.values():  # the profile's defaults read these, so they are checked first
            spec.check_choice(values[spec.name])
        _fill_profile_defaults(values)
        if values["num_steps"] is None:
            values["num_steps"] = mean_recurrence
        if values["init_scale"] is None:
            values["init_scale"] = init_scale
        for spec in OPTIONS.values():
            spec.check(values)
            spec.check_ceiling(values, max_depth)  # (10**30 steps overflowed a kernel, or never ended)
            if spec.kind == "float" and spec.low is not None and type(values[spec.name]) is int:  # (in range: a
                values[spec.name] = float(values[spec.name])  # float; torch refused temperature=10**30 past int64)
        official = values["defaults"] == "official"
        try:
            criterion, threshold = resolve_criterion(values["exit_criterion"], values["exit_threshold"],
                                                     official=official)
        except ValueError as exc:
            name_ok = values["exit_criterion"] is None or values["exit_criterion"] in CRITERIA
            raise OptionError("exit_threshold" if name_ok else "exit_criterion", str(exc)) from None
        try:
            policy = parse_kv_policy(values["kv_policy"], values["kv_budget"])
        except ValueError as exc:
            raise OptionError("kv_policy", str(exc)) from None
        try:
            quant = parse_kv_quant_option(values["kv_quant"])
        except ValueError as exc:
            raise OptionError("kv_quant", str(exc)) from None
        _fill_max_steps(values, criterion)
        resolved = ResolvedOptions(**values, criterion=criterion, threshold=threshold, policy=policy, quant=quant)
        resolved = _check_combinations(resolved, asked_prefill_exit)
        if not isinstance(self, ResolvedOptions):  # (resolved again: its values are no longer the caller's)
            spelling = _SPELLING.get()
            for name, message in ignored_options(given, resolved):
                warnings.warn(OptionWarning(name, message if spelling is None else spell(message, spelling)),
                              stacklevel=2)
        return resolved

    def stop_ids(self, config_eos: Any, vocab_size: int) -> list[int]:
        """The ids that end a row besides `stop`: eos_token_id (or the config's), and under
        official defaults the official code's hard-coded stops that exist in the vocabulary."""
        eos = self.eos_token_id if self.eos_token_id is not None else config_eos
        ids = list(eos_ids(eos, "eos_token_id", vocab_size))
        if self.defaults == "official":
            ids += [t for t in OFFICIAL_STOP_IDS if t < vocab_size and t not in ids]
        return ids


OPTIONS: dict[str, Option] = {
    f.name: replace(f.metadata["option"], name=f.name, default=f.default) for f in fields(GenerationOptions)
}


def _adaptive(o: ResolvedOptions) -> bool:
    return o.criterion is not None and o.criterion.name != "none"  # ("none": the adaptive path, no exit)


_NO_EXIT = "without an exit_criterion (or with 'none', which never exits)"


# Where an option matters, for the options some modes never read (every other option matters in every
# mode): option -> (test on the resolved options: the option is read; the warning's "has no effect ..."
# words; values that change nothing wherever they are set). `GenerationOptions.validate` warns once
# (`OptionWarning`) for each option the caller set, to another value than its default or the
# profile's, where its test is False. Ignored combinations that would change the result silently
# (max_steps or exit_threshold without an exit criterion, exit_in_prefill=True, ...) are errors instead.
MATTERS_ONLY: dict[str, tuple[Callable[[ResolvedOptions], bool], str, tuple]] = {
    "exit_threshold": (_adaptive, _NO_EXIT, ()),
    "min_steps": (_adaptive, _NO_EXIT, ()),
    "min_steps_rule": (lambda o: _adaptive(o) and o.mode == "autoregressive",
                       "without an exit_criterion in the autoregressive mode", ()),
    "check_every": (_adaptive, _NO_EXIT, ()),
    "exit_in_prefill": (lambda o: o.criterion is not None and o.mode == "autoregressive",
                        "without an exit_criterion in the autoregressive mode", ()),
    "warm_start_source": (lambda o: o.warm_start, "without warm_start=True", ()),
    "lookahead": (lambda o: o.mode == "speculative", "without speculative decoding (set draft_steps)", ()),
    "verification_threshold": (lambda o: o.mode == "speculative",
                               "without speculative decoding (set draft_steps)", ()),
    "finish_round": (lambda o: o.mode == "speculative", "without speculative decoding (set draft_steps)", ()),
    "inner_steps": (lambda o: o.mode == "parallel", "without sampler='parallel'", ()),
    "headway": (lambda o: o.mode == "parallel", "without sampler='parallel'", ()),
    "wavefront": (lambda o: o.mode == "parallel", "without sampler='parallel'", ()),
    "max_wavefront": (lambda o: o.mode == "parallel", "without sampler='parallel'", ()),
    "temperature": (lambda o: o.do_sample, "in greedy decoding", (0,)),
    "top_k": (lambda o: o.do_sample, "in greedy decoding", ()),
    "top_p": (lambda o: o.do_sample, "in greedy decoding", (1,)),
    "min_p": (lambda o: o.do_sample, "in greedy decoding", (0,)),
    **{name: (lambda o: o.ttt_params is not None, "without TTT-E2E (set ttt_params)", ())
       for name in ("ttt_steps", "ttt_lr", "ttt_optimizer", "ttt_depth", "ttt_backprop")},
    **{name: (lambda o: o.gradmem_tokens > 0, "without GradMem (set gradmem_tokens)", ())
       for name in ("gradmem_steps", "gradmem_lr", "gradmem_depth", "gradmem_init", "gradmem_query_tokens")},
}


class OptionWarning(UserWarning):
    """An option the caller set that the chosen mode ignores (`MATTERS_ONLY`); `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


_SPELLING: ContextVar[Any] = ContextVar("option_spelling", default=None)


@contextmanager
def spelled_warnings(spelling: Any) -> Iterator[None]:
    """`OptionWarning`s raised inside name options `spelling(name)` (a CLI flag, a JSON field), as the
    interface's errors do (`OptionError.spelled`)."""
    token = _SPELLING.set(spelling)
    try:
        yield
    finally:
        _SPELLING.reset(token)


def ignored_options(given: dict[str, Any], resolved: ResolvedOptions) -> list[tuple[str, str]]:
    """(option, message) for each option in `given` (the caller's values, before the profile's
    defaults) set to a value that changes nothing in `resolved`'s mode (see `MATTERS_ONLY`)."""
    found = []
    for name, (matters, why, neutral) in MATTERS_ONLY.items():
        value = given[name]
        if value is None or value == OPTIONS[name].default or value in neutral or matters(resolved):
            continue
        profile = dict(given, **{name: None})
        _fill_profile_defaults(profile)
        if value == profile[name]:  # what the profile gives anyway
            continue
        found.append((name, f"{name}={value!r} has no effect {why}"))
    lookup = _ignored_lookup(given["kv_policy"], resolved)
    if lookup is not None:
        found.append(("kv_policy", f"kv_policy={given['kv_policy']!r}: its {lookup!r} lookup has no effect without "
                                   "early exits (an exit_criterion, exit_kv='lookup', the autoregressive mode)"))
    return found


def _ignored_lookup(spec: Any, resolved: ResolvedOptions) -> str | None:
    """The lookup rule `spec` names (ours after '+', or an official lookup name) when no token exits
    early, the only case where a lookup is read (a bare official compress-<c> implies 'full': not named)."""
    if spec is None or (_adaptive(resolved) and resolved.mode == "autoregressive" and resolved.exit_kv == "lookup"):
        return None
    lookup = parse_kv_policy(spec).lookup.name
    return None if lookup == "deepest" or spec.startswith("compress-") else lookup


@dataclass(frozen=True)
class ResolvedOptions(GenerationOptions):
    """`GenerationOptions.validate`'s result: every field checked and filled, and what they parse to.
    Built once per request; the decoding loops read it and never change it."""

    criterion: CriterionSpec | None = None
    threshold: float | None = None
    policy: KVPolicy | None = None
    quant: KVQuant | None = None

    @property
    def deepest_step(self) -> int:
        """The most recurrence steps any position runs (sizes the full KV cache)."""
        return max(self.num_steps, self.max_steps or 0)

    def bound(self, core_layers: int) -> ResolvedOptions:
        """The same options with the KV policy bound to a model's layout (official compress-sN / -rN)."""
        policy = self.policy.bind(core_layers)
        return self if policy is self.policy else replace(self, policy=policy)


def _fill_profile_defaults(values: dict[str, Any]) -> None:
    """Fill the profile-dependent fields left None (see `GenerationOptions`)."""
    official = values["defaults"] == "official"
    if values["exit_in_prefill"] is None:
        values["exit_in_prefill"] = official
    if values["min_steps_rule"] is None:
        values["min_steps_rule"] = "skip" if official else "exit"
    if values["min_steps"] is None:
        values["min_steps"] = min_steps_floor(values)
    if values["warm_start_source"] is None:
        values["warm_start_source"] = "normed" if official and values["exit_criterion"] is None else "raw"
    if values["finish_round"] is None:
        values["finish_round"] = official
    # The lookup only matters for tokens that exit early; at fixed depth every lookup reads the same.
    adaptive = values["exit_criterion"] not in (None, "none")
    if official and adaptive and values["kv_policy"] is None and values["kv_budget"] is None:
        values["kv_policy"] = OFFICIAL_KV_POLICY
    if official and values["num_steps"] is None and values["draft_steps"] is not None:
        values["num_steps"] = OFFICIAL_SPECULATIVE_STEPS


def _fill_max_steps(values: dict[str, Any], criterion: CriterionSpec | None) -> None:
    """max_steps defaults to num_steps; it bounds an exit criterion (or the parallel sampler's freeze)."""
    max_steps = values["max_steps"]
    if max_steps is not None and criterion is None and values["sampler"] != "parallel":
        raise OptionError(
            "max_steps", f"max_steps={max_steps} only applies with an exit_criterion (fixed depth runs num_steps)"
        )
    if max_steps is None:
        values["max_steps"] = values["num_steps"]
    if criterion is not None and values["max_steps"] < 1:
        raise OptionError("max_steps" if max_steps is not None else "num_steps",
                          "adaptive exit needs max_steps >= 1 (num_steps=0 runs no recurrence)")
    if criterion is not None and values["min_steps_rule"] == "exit" and values["min_steps"] > values["max_steps"]:
        raise OptionError(
            "min_steps", f"min_steps={values['min_steps']} is invalid: expected <= max_steps={values['max_steps']}"
        )


def _check_combinations(o: ResolvedOptions, asked_prefill_exit: bool) -> ResolvedOptions:
    """The rules between options of each decoding mode; the parallel sampler's own KV policy."""
    mode = o.mode
    if asked_prefill_exit and (mode != "autoregressive" or o.criterion is None):
        raise OptionError(
            "exit_in_prefill",
            f"exit_in_prefill=True needs an exit_criterion in the autoregressive mode (got mode {mode!r}, "
            f"exit_criterion={o.exit_criterion!r})"
        )
    if o.teacher_tokens is not None and mode == "speculative":
        raise OptionError("teacher_tokens", "teacher_tokens (teacher forcing) does not combine with draft_steps")
    if mode == "speculative":
        if o.draft_steps >= o.num_steps:
            raise OptionError(
                "draft_steps",
                f"draft_steps={o.draft_steps} is invalid: the draft must be cheaper than the verifier, "
                f"expected an integer in [0, num_steps={o.num_steps})"
            )
        conflicts = {"exit_criterion": o.exit_criterion is not None, "warm_start": o.warm_start,
                     "do_sample": o.do_sample, "repetition_penalty": o.repetition_penalty != 1.0}
        bad = [name for name, on in conflicts.items() if on]
        if bad:
            raise OptionError(
                "draft_steps",
                f"self-speculative decoding (draft_steps={o.draft_steps}) is greedy at a fixed depth; "
                f"it does not combine with {', '.join(bad)}"
            )
    # Two alternative ways to compress a context (into weights, into memory tokens): together, TTT-E2E would
    # also train on GradMem's query and the write would run through the adapted weights, which neither paper defines.
    if o.gradmem_tokens > 0 and o.ttt_params is not None:
        raise OptionError("ttt_params", f"ttt_params={o.ttt_params!r} (TTT-E2E: the context into weights) does not "
                          f"combine with gradmem_tokens={o.gradmem_tokens} (GradMem: the context into memory tokens); "
                          "set one of them")
    if o.gradmem_tokens > 0 and o.gradmem_depth is None and o.num_steps == 0:
        raise OptionError("gradmem_depth", "gradmem_depth defaults to num_steps=0, but a GradMem write needs depth "
                          ">= 1 (a random s_0 at depth 0 never reads the memory); set gradmem_depth")
    gate = o.criterion is not None and o.criterion.reads_gate
    if gate and (o.check_every > 1 or (o.min_steps_rule == "skip" and o.min_steps > 0)):
        raise OptionError(
            "check_every" if o.check_every > 1 else "min_steps",
            f"exit_criterion={o.exit_criterion!r} multiplies the gate's survival over every step, so it is read at "
            f"every step: expected check_every=1 and no unchecked steps (got check_every={o.check_every}, "
            f"min_steps={o.min_steps} under min_steps_rule={o.min_steps_rule!r})"
        )
    if o.exit_kv == "compute":
        if mode != "autoregressive" or o.criterion is None:
            raise OptionError("exit_kv", f"exit_kv='compute' keeps early-exited tokens computing their KV, which "
                              f"needs an exit_criterion in the autoregressive mode (got mode {mode!r}, "
                              f"exit_criterion={o.exit_criterion!r})")
        if o.min_steps_rule == "skip" or o.exit_in_prefill:
            raise OptionError(
                "exit_kv" if o.min_steps_rule == "skip" else "exit_in_prefill",
                "exit_kv='compute' (the Ouro reference's loop: the prompt runs every step, its last position exits "
                f"on the criterion) takes min_steps_rule='exit' and exit_in_prefill=False (got "
                f"{o.min_steps_rule!r} and {o.exit_in_prefill}); set them, or use exit_kv='lookup'"
            )
    if mode == "parallel":
        if o.draft_steps is not None or o.warm_start or o.repetition_penalty != 1.0:
            raise OptionError(
                "sampler", "sampler='parallel' does not combine with draft_steps, warm_start or repetition_penalty"
            )
        if o.kv_budget not in (None, 1):
            raise OptionError(
                "kv_budget",
                f"kv_budget={o.kv_budget} is invalid for sampler='parallel': the wavefront keeps one KV "
                "entry per core layer (the latest); expected None or 1"
            )
        if o.kv_policy not in (None, "last-step", "last-step+deepest", "deepest"):
            raise OptionError(
                "kv_policy",
                f"kv_policy={o.kv_policy!r} is invalid for sampler='parallel': the wavefront keeps one KV "
                "entry per core layer (the latest); expected None or 'last-step'"
            )
        if o.criterion is not None and o.criterion.name not in PARALLEL_CRITERIA:
            raise OptionError(
                "exit_criterion",
                f"exit_criterion={o.exit_criterion!r} is invalid for sampler='parallel': positions freeze "
                f"on a latent criterion, expected None (freeze at max_steps) or one of {PARALLEL_CRITERIA}"
            )
        if o.max_steps < 1:
            raise OptionError("sampler", "sampler='parallel' needs num_steps (or max_steps) >= 1")
        if o.check_every != 1:  # (the wavefront never read it)
            raise OptionError(
                "check_every",
                f"check_every={o.check_every} is invalid for sampler='parallel': the wavefront checks its positions "
                "after every sweep of inner_steps core steps; expected 1 (set inner_steps instead)"
            )
        return replace(o, policy=parse_kv_policy("last-step"))
    return o


def eos_ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    """An eos setting (None, an id, or a list of ids) as a tuple of ids, validated."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise OptionError(
                name,
                f"{name}={value!r} is invalid: expected None, a token id or a list of token ids in [0, {vocab_size})"
            )
    return tuple(items)
