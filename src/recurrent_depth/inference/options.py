"""Every argument of `generate`, validated once, with errors that name the field and its range."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from recurrent_depth.inference.cache import CACHE_IMPLEMENTATIONS
from recurrent_depth.inference.criteria import CRITERIA, CriterionSpec, resolve_criterion
from recurrent_depth.inference.quant_cache import parse_kv_quant_option
from recurrent_depth.model.cache import KVPolicy, parse_kv_policy

SAMPLERS = ("autoregressive", "parallel")
PARALLEL_CRITERIA = ("latent-diff", "cosine")
DEFAULTS = ("official",)
MIN_STEPS_RULES = ("exit", "skip")
WARM_START_SOURCES = ("raw", "normed")
# The official code's hard-coded stops (begin_text, end_text, end_turn of Huginn's tokenizer).
OFFICIAL_STOP_IDS = (65504, 65505, 65508)
OFFICIAL_SPECULATIVE_STEPS = 32  # the official generate_speculative's num_steps default
OFFICIAL_KV_POLICY = "full"  # the official dynamic cache's default lookup strategy


class OptionError(ValueError):
    """A bad generation option: `field` is the option at fault, the message speaks of fields by
    their `GenerationOptions` names; `spelled` re-words it in a caller's terms (a CLI flag, a JSON
    field, an official kwarg) without parsing it."""

    def __init__(self, field: str, message: str, spelling: Any = None) -> None:
        self.field = field
        self.message = message
        super().__init__(message if spelling is None else spell(message, spelling))

    def spelled(self, spelling: Any) -> OptionError:
        """The same error with every option name `n` in the message written `spelling(n)`."""
        return OptionError(self.field, self.message, spelling)


def spell(message: str, spelling: Any) -> str:
    """`message` with option names re-spelled: names with an underscore wherever they stand as a
    word, one-word names (stop, seed, ...) only as `name=`, where they cannot be ordinary words."""
    names = sorted(GenerationOptions.names(), key=len, reverse=True)
    pattern = "|".join(rf"{n}(?![\w-])" if "_" in n else rf"{n}(?==)" for n in names)
    return re.sub(rf"(?<![\w\-.])(?:{pattern})", lambda m: spelling(m.group(0)), message)


@dataclass
class GenerationOptions:
    """Generation settings (see `recurrent_depth.inference.generate` for what each one does).

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

    max_new_tokens: int = 64
    num_steps: int | None = None
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    min_steps: int | None = None
    max_steps: int | None = None
    kv_budget: int | None = None
    kv_policy: str | None = None
    kv_quant: str | None = None
    warm_start: bool = False
    draft_steps: int | None = None
    lookahead: int = 8
    verification_threshold: float = 1.0
    sampler: str = "autoregressive"
    inner_steps: int = 4
    headway: int = 1
    wavefront: int = 4
    max_wavefront: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: Any = None
    stop: Any = None
    init_scale: float = 1.0
    cache_implementation: str = "static"
    fast: bool = True
    output_logits: bool = False
    teacher_tokens: Any = None
    defaults: str | None = None
    exit_in_prefill: bool | None = None
    min_steps_rule: str | None = None
    check_every: int = 1
    warm_start_source: str | None = None
    finish_round: bool | None = None
    eos_token_id: Any = None

    # resolved by `validate`
    criterion: CriterionSpec | None = None
    threshold: float | None = None
    policy: KVPolicy | None = None

    @classmethod
    def names(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"criterion", "threshold", "policy"}

    @property
    def mode(self) -> str:
        if self.sampler == "parallel":
            return "parallel"
        if self.draft_steps is not None:
            return "speculative"
        return "autoregressive"

    @property
    def deepest_step(self) -> int:
        """The most recurrence steps any position runs (sizes the full KV cache)."""
        return max(self.num_steps, self.max_steps or 0)

    def validate(self, mean_recurrence: int) -> GenerationOptions:
        """Check every field; fill defaults that depend on the model. Returns self."""

        def integer(name: str, low: int, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                extra = "None or " if allow_none else ""
                raise OptionError(name, f"{name}={value!r} is invalid: expected {extra}an integer >= {low}")

        def number(name: str, low: float, high: float, low_open: bool, high_open: bool = False,
                   allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            try:
                ok = ok and not math.isnan(value)
            except OverflowError:  # an int beyond float range
                ok = False
            if ok:
                ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
            if not ok:
                lo = "(" if low_open else "["
                hi = ")" if high_open else "]"
                extra = "None or " if allow_none else ""
                raise OptionError(
                    name, f"{name}={value!r} is invalid: expected {extra}a number in {lo}{low}, {high}{hi}"
                )

        asked_prefill_exit = self.exit_in_prefill is True
        self._resolve_defaults()
        if self.num_steps is None:
            self.num_steps = mean_recurrence
        integer("max_new_tokens", 0)
        integer("num_steps", 0)
        integer("min_steps", 0 if self.min_steps_rule == "skip" else 1)
        integer("check_every", 1)
        integer("max_steps", 1, allow_none=True)
        integer("kv_budget", 1, allow_none=True)
        integer("draft_steps", 0, allow_none=True)
        integer("lookahead", 1)
        integer("inner_steps", 1)
        integer("headway", 1)
        integer("wavefront", 1)
        integer("max_wavefront", 1)
        integer("top_k", 1, allow_none=True)
        # Greedy decoding ignores the temperature, so 0 (the OpenAI way to ask for greedy) is fine there.
        number("temperature", 0, math.inf, low_open=self.do_sample is not False, high_open=True)
        number("top_p", 0, 1, low_open=True, allow_none=True)
        number("min_p", 0, 1, low_open=False, allow_none=True)
        number("repetition_penalty", 0, math.inf, low_open=True, high_open=True)
        number("verification_threshold", 0, 1, low_open=True)
        number("init_scale", 0, math.inf, low_open=False, high_open=True)
        for name in ("warm_start", "do_sample", "fast", "output_logits", "exit_in_prefill", "finish_round"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"{name}={getattr(self, name)!r} is invalid: expected True or False")
        if self.sampler not in SAMPLERS:
            raise OptionError("sampler", f"sampler={self.sampler!r} is invalid: expected one of {SAMPLERS}")
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise OptionError(
                "cache_implementation",
                f"cache_implementation={self.cache_implementation!r} is invalid: expected one of "
                f"{CACHE_IMPLEMENTATIONS}"
            )
        try:
            self.criterion, self.threshold = resolve_criterion(
                self.exit_criterion, self.exit_threshold, official=self.defaults == "official"
            )
        except ValueError as exc:
            name_ok = self.exit_criterion is None or self.exit_criterion in CRITERIA
            raise OptionError("exit_threshold" if name_ok else "exit_criterion", str(exc)) from None
        try:
            self.policy = parse_kv_policy(self.kv_policy, self.kv_budget)
        except ValueError as exc:
            raise OptionError("kv_policy", str(exc)) from None
        try:
            parse_kv_quant_option(self.kv_quant)
        except ValueError as exc:
            raise OptionError("kv_quant", str(exc)) from None
        explicit_max_steps = self.max_steps is not None
        if self.max_steps is not None and self.criterion is None and self.sampler != "parallel":
            raise OptionError(
                "max_steps",
                f"max_steps={self.max_steps} only applies with an exit_criterion (fixed depth runs num_steps)"
            )
        if self.max_steps is None:
            self.max_steps = self.num_steps
        if self.criterion is not None and self.max_steps < 1:
            raise OptionError("max_steps" if explicit_max_steps else "num_steps",
                              "adaptive exit needs max_steps >= 1 (num_steps=0 runs no recurrence)")
        if self.criterion is not None and self.min_steps_rule == "exit" and self.min_steps > self.max_steps:
            raise OptionError(
                "min_steps", f"min_steps={self.min_steps} is invalid: expected <= max_steps={self.max_steps}"
            )

        mode = self.mode
        if asked_prefill_exit and (mode != "autoregressive" or self.criterion is None):
            raise OptionError(
                "exit_in_prefill",
                f"exit_in_prefill=True needs an exit_criterion in the autoregressive mode (got mode {mode!r}, "
                f"exit_criterion={self.exit_criterion!r})"
            )
        if self.teacher_tokens is not None and mode == "speculative":
            raise OptionError("teacher_tokens", "teacher_tokens (teacher forcing) does not combine with draft_steps")
        if mode == "speculative":
            if self.draft_steps >= self.num_steps:
                raise OptionError(
                    "draft_steps",
                    f"draft_steps={self.draft_steps} is invalid: the draft must be cheaper than the verifier, "
                    f"expected an integer in [0, num_steps={self.num_steps})"
                )
            conflicts = {"exit_criterion": self.exit_criterion is not None, "warm_start": self.warm_start,
                         "do_sample": self.do_sample, "repetition_penalty": self.repetition_penalty != 1.0}
            bad = [name for name, on in conflicts.items() if on]
            if bad:
                raise OptionError(
                    "draft_steps",
                    f"self-speculative decoding (draft_steps={self.draft_steps}) is greedy at a fixed depth; "
                    f"it does not combine with {', '.join(bad)}"
                )
        if mode == "parallel":
            if self.draft_steps is not None or self.warm_start or self.repetition_penalty != 1.0:
                raise OptionError(
                    "sampler",
                    "sampler='parallel' does not combine with draft_steps, warm_start or repetition_penalty"
                )
            if self.kv_budget not in (None, 1):
                raise OptionError(
                    "kv_budget",
                    f"kv_budget={self.kv_budget} is invalid for sampler='parallel': the wavefront keeps one KV "
                    "entry per core layer (the latest); expected None or 1"
                )
            if self.kv_policy not in (None, "last-step", "last-step+deepest", "deepest"):
                raise OptionError(
                    "kv_policy",
                    f"kv_policy={self.kv_policy!r} is invalid for sampler='parallel': the wavefront keeps one KV "
                    "entry per core layer (the latest); expected None or 'last-step'"
                )
            self.policy = parse_kv_policy("last-step")
            if self.criterion is not None and self.criterion.name not in PARALLEL_CRITERIA:
                raise OptionError(
                    "exit_criterion",
                    f"exit_criterion={self.exit_criterion!r} is invalid for sampler='parallel': positions freeze "
                    f"on a latent criterion, expected None (freeze at max_steps) or one of {PARALLEL_CRITERIA}"
                )
            if self.max_steps < 1:
                raise OptionError("sampler", "sampler='parallel' needs num_steps (or max_steps) >= 1")
        return self

    def _resolve_defaults(self) -> None:
        """Fill the profile-dependent fields left None (see the class docstring)."""
        if self.defaults is not None and self.defaults not in DEFAULTS:
            raise OptionError(
                "defaults", f"defaults={self.defaults!r} is invalid: expected None (ours) or one of {DEFAULTS}"
            )
        official = self.defaults == "official"
        for name, allowed in (("min_steps_rule", MIN_STEPS_RULES), ("warm_start_source", WARM_START_SOURCES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise OptionError(
                    name, f"{name}={value!r} is invalid: expected None (the profile's) or one of {allowed}"
                )
        if self.exit_in_prefill is None:
            self.exit_in_prefill = official
        if self.min_steps_rule is None:
            self.min_steps_rule = "skip" if official else "exit"
        if self.min_steps is None:
            self.min_steps = 0 if self.min_steps_rule == "skip" else 1
        if self.warm_start_source is None:
            self.warm_start_source = "normed" if official and self.exit_criterion is None else "raw"
        if self.finish_round is None:
            self.finish_round = official
        # The lookup only matters for tokens that exit early; at fixed depth every lookup reads the same.
        adaptive = self.exit_criterion not in (None, "none")
        if official and adaptive and self.kv_policy is None and self.kv_budget is None:
            self.kv_policy = OFFICIAL_KV_POLICY
        if official and self.num_steps is None and self.draft_steps is not None:
            self.num_steps = OFFICIAL_SPECULATIVE_STEPS

    def stop_ids(self, config_eos: Any, vocab_size: int) -> list[int]:
        """The ids that end a row besides `stop`: eos_token_id (or the config's), and under
        official defaults the official code's hard-coded stops that exist in the vocabulary."""
        eos = self.eos_token_id if self.eos_token_id is not None else config_eos
        ids = list(eos_ids(eos, "eos_token_id", vocab_size))
        if self.defaults == "official":
            ids += [t for t in OFFICIAL_STOP_IDS if t < vocab_size and t not in ids]
        return ids


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
