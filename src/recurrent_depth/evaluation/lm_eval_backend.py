"""lm-evaluation-harness backend ``recurrent-depth``: every test-time compute control as a model arg.

    rdepth lm-eval run --model recurrent-depth \\
        --model_args pretrained=DIR,num_steps=32,exit_criterion=kl,exit_threshold=5e-4,kv_budget=16 \\
        --tasks rd_chains_mc --include_path $(python -m recurrent_depth.evaluation.tasks) --device cpu

Model args (besides lm-eval's usual ``hf`` ones: ``pretrained``, ``tokenizer``, ``dtype``,
``batch_size``, ``max_length``, ...), the options the schema (`recurrent_depth.inference.schema`,
``lm_eval="model"``) marks, with the official aliases (``criterion``, ``cache_lookup_strategy``,
``continuous_compute``, ``exit_threshold=auto``):

- ``num_steps``: recurrence depth (default: the model's ``mean_recurrence``);
- ``exit_criterion`` / ``exit_threshold`` / ``min_steps``: per-token early exit (`kl`,
  `entropy-diff`, `latent-diff`, `cosine`, `argmax-stability`, and `gate`, the learned exit of
  Ouro-style models with q in (0, 1]; threshold None = its default);
- ``exit_kv``: ``compute`` keeps an early-exited token computing every step's KV (the Ouro
  reference), ``lookup`` (default) lets the KV policy's lookup rule serve the steps it skipped;
- ``kv_budget``: KV-cache sharing, step i reads and writes slot i mod k;
- ``kv_policy``: the KV policy by name (`recurrent_depth.model.cache.parse_kv_policy`), e.g.
  ``shared-4+skip`` (early-exited tokens left out at steps they did not reach);
- ``kv_quant``: a quantized KV cache, e.g. ``k=prod:3.5;v=mse:3.5`` (``;`` for ``,``, which lm-eval's
  model_args use between args; see docs/quant.md);
- ``warm_start``: each token starts from the previous token's final state;
- ``init_scale``: scale of the random initial state (0 = deterministic zeros; default the config's);
- ``seed`` (this backend's: it seeds the initial-state draws; each scored request draws from a stream
  seeded by it and the request's tokens, so a score does not depend on the batch; each generated
  request gets a seed of its own, drawn in request order) and ``steps_log``
  (a JSON file to which the steps-per-token statistics are written).

``--gen_kwargs`` take lm-eval's ``until`` / ``max_gen_toks`` / ``do_sample`` / ``temperature``
(greedy unless temperature > 0 or do_sample; do_sample alone samples at temperature 1.0), the
sampling options ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` (``lm_eval="gen"``) and
per-request overrides of the model args above; any other name is refused with the list, before
any request runs. Empty stop strings in ``until`` stop nothing, as in lm-eval's post-processing.
An empty continuation scores log 1 = 0 (greedy), where lm-eval's ``hf`` backend fails.

Scoring requests (`loglikelihood`, `loglikelihood_rolling`) use one batched forward at fixed depth
with a full cache, else teacher-forced token-by-token recurrence (`evaluation/scoring.py`);
generation (`generate_until`) uses `recurrent_depth.generate`. Steps per token are recorded for
both and reported under ``config.recurrent_depth`` in lm-eval's results.

This class extends lm-eval's `HFLM` (tokenization, batching, chat templates, rolling windows) and
loads the model through transformers' Auto classes, which `import recurrent_depth` taught our
model types.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from recurrent_depth.checkpoint import dtype_from_name
from recurrent_depth.data.tokenizer import windowed_encoding
from recurrent_depth.evaluation.scoring import Scored, batched_logprobs, stepwise_logprobs
from recurrent_depth.inference.options import OPTIONS, GenerationOptions, OptionError, spelled_warnings
from recurrent_depth.inference.schema import canonical, from_text, kwarg_spelling, names_for, unknown_names
from recurrent_depth.inference.session import check_options_for_model
from recurrent_depth.integrations import register_transformers
from recurrent_depth.integrations.autoregister import LM_EVAL_BACKEND_NAME

log = logging.getLogger(__name__)
DEFAULT_AUTO_BATCH = 16  # "batch_size=auto" probes GPU memory; on CPU a fixed size is as good


# From the options schema (inference/schema.py), official aliases included.
MODEL_ARGS = names_for("lm_eval", "model")  # model_args, and per-request gen_kwargs overrides
GEN_KWARGS = (*MODEL_ARGS, *names_for("lm_eval", "gen"))
MODEL_OPTIONS = tuple(name for name in MODEL_ARGS if name in OPTIONS)  # the settings a run reports
# The gen_kwargs lm-eval's generate_until takes for itself (the stops and the length) before it calls _model_generate.
# lm-eval's spellings of the generation budget (normalize_gen_kwargs reads the first given, in this order)
LM_EVAL_GEN_BUDGET_KWARGS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
LM_EVAL_OWN_GEN_KWARGS = ("until", *LM_EVAL_GEN_BUDGET_KWARGS, "max_length")


def _refuse_unknown_gen_kwargs(names: Any) -> None:
    unknown = unknown_names(names, GEN_KWARGS)
    if unknown:
        raise ValueError(f"generation arguments {unknown} are not supported by the recurrent-depth backend; "
                         f"it takes {sorted(GEN_KWARGS)}")


def _typed(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """lm-eval's text values (already typed where it could tell) as options by field name."""
    try:
        return canonical({k: from_text(k, v) for k, v in values.items()})
    except OptionError as exc:
        raise ValueError(str(exc)) from None


def _resolve_device(device: str | None) -> str:
    """lm-eval's CLI defaults to cuda:0; fall back to the CPU (with a warning) when CUDA is absent."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s requested but CUDA is not available; evaluating on cpu", device)
        return "cpu"
    return str(device)


def _positive_int(name: str, value: Any) -> int:
    """lm-eval's text value of an integer argument (``4``, or ``"4"`` from its CLI's ``--batch_size``) as an int >= 1,
    else a one-line error: HFLM takes any value and fails later (``range() arg 3 must not be zero``, a TypeError
    traceback, or an AttributeError when a negative batch size scored nothing)."""
    number = value
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            number = None
    elif isinstance(value, float) and value.is_integer():  # lm-eval types "-1" as -1.0
        number = value = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
    return number


def check_max_length(max_length: int | None, config: Any) -> None:
    """max_length within the model's `max_seq_len` (`ModelConfig`): past it every request fails in the forward,
    once the tasks are built."""
    if max_length is not None and max_length > config.max_seq_len:
        raise ValueError(f"max_length={max_length} is invalid: expected at most the model's "
                         f"max_seq_len={config.max_seq_len}")


def check_batch_size(batch_size: Any) -> int | str:
    """lm-eval's batch size: ``auto`` / ``auto:N`` as given, else an integer >= 1 (see `_positive_int`)."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        return batch_size
    try:
        return _positive_int("batch_size", batch_size)
    except ValueError as exc:
        raise ValueError(f"{exc}, or 'auto'") from None


def check_model_args(pretrained: Any, seed: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The model_args checks that need no model loaded, as one-line errors (`RecurrentDepthEvalLM.__init__`
    and `rdepth lm-eval`'s pre-flight run them): our options are taken out of `kwargs` (lm-eval's HF
    model's args stay, a dtype name made a torch dtype) and returned by field name, with how each was spelled."""
    # transformers reports a missing local directory as a malformed hub repo id ("Repo id must use
    # alphanumeric chars ..."): name it. Hub ids ("org/name") never start like a path.
    if isinstance(pretrained, str) and pretrained.startswith(("/", "./", "../", "~")) and \
            not Path(pretrained).expanduser().is_dir():
        raise FileNotFoundError(f"pretrained={pretrained}: no such directory (expected a saved model directory)")
    tokenizer = kwargs.get("tokenizer")  # (the same for lm-eval's tokenizer=DIR)
    if isinstance(tokenizer, str) and tokenizer.startswith(("/", "./", "../", "~")) and \
            not Path(tokenizer).expanduser().exists():
        raise FileNotFoundError(f"tokenizer={tokenizer}: no such directory (expected a tokenizer directory)")
    values, given_as = _typed({k: kwargs.pop(k) for k in list(kwargs) if k in MODEL_ARGS})
    if isinstance(values.get("kv_quant"), str):  # model_args are split at commas: k=...;v=...
        values["kv_quant"] = values["kv_quant"].replace(";", ",")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} is invalid: expected an integer")
    if kwargs.get("max_length") is not None:  # (None: the model's)
        kwargs["max_length"] = _positive_int("max_length", kwargs["max_length"])
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":  # lm-eval's getattr(torch, dtype)
        try:  # fails with "module 'torch' has no attribute ...", a traceback through `rdepth lm-eval`
            kwargs["dtype"] = dtype_from_name(kwargs["dtype"])
        except ValueError as exc:
            raise ValueError(f"{exc}, or 'auto'") from None
    return values, given_as


def generation_options(model_args: dict[str, Any], gen_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The options of `generate` for one request: `model_args` (by field name) with the request's gen_kwargs (lm-eval's
    own taken out) over them, and how each gen_kwarg was spelled."""
    values, given_as = _typed(gen_kwargs)
    # lm-eval's convention: greedy unless a temperature > 0 (or do_sample) asks for sampling; do_sample without
    # a temperature samples at generate's default (1.0), as lm-eval's hf backend does at the model's.
    temperature = values.pop("temperature", None)
    if values.get("do_sample") is None:
        values["do_sample"] = (temperature or 0.0) > 0
    if values["do_sample"] and temperature is not None:
        values["temperature"] = float(temperature)
    return model_args | values, given_as  # per-request overrides of the model args (--gen_kwargs num_steps=8)


def resolve_options(values: dict[str, Any], given_as: dict[str, str], config: Any) -> Any:
    """`check_model_args`' options checked against the model's `ModelConfig` (num_steps >= 0, the
    criterion and its threshold, ...), errors and warnings in the spelling the user gave."""
    try:
        with spelled_warnings(kwarg_spelling(given_as)):
            # (init_scale None, as `rdepth eval` passes it unset: the config's)
            return GenerationOptions(**values).validate(config.mean_recurrence, config.exit_gate_threshold,
                                                        config.init_scale)
    except OptionError as exc:
        raise exc.spelled(kwarg_spelling(given_as)) from None


def preflight(model_args: dict[str, Any], gen_kwargs: dict[str, Any] | None = None, batch_size: Any = None) -> None:
    """The checks of `__init__` (and of `generate_until` for lm-eval's ``--gen_kwargs``, ``--batch_size``) that
    need no weights, for `rdepth lm-eval` to run before lm-eval indexes its task configs (10+ s): a typo is refused
    at once, not after the model loaded or every loglikelihood request ran. Raises what those would; what it cannot
    tell without loading the model (a config that does not load, an argument neither transformers nor the model
    takes) it leaves to them. Warnings are left to them too, so that they come once."""
    if batch_size is not None:
        check_batch_size(batch_size)
    ours = {k: v for k, v in (gen_kwargs or {}).items() if k not in LM_EVAL_OWN_GEN_KWARGS}
    _refuse_unknown_gen_kwargs(ours)
    if "pretrained" not in model_args:
        return  # lm-eval's own error, from __init__'s signature
    kwargs = dict(model_args)
    pretrained = kwargs.pop("pretrained")
    values, given_as = check_model_args(pretrained, kwargs.pop("seed", 0), kwargs)
    generation, gen_given_as = generation_options(values, ours)  # (the types now: temperature=abc)
    if not (isinstance(pretrained, str) and Path(pretrained).expanduser().is_dir()):
        return  # a hub id: its config is not fetched here
    register_transformers()
    from transformers import AutoConfig

    # What the HF model hands on to from_pretrained (mean_recurrence=... overrides the config there).
    own = {*inspect.signature(HFLM.__init__).parameters, *inspect.signature(RecurrentDepthEvalLM.__init__).parameters}
    hf_args = {k: v for k, v in kwargs.items() if k not in own or k in ("revision", "subfolder")}
    try:
        config = AutoConfig.from_pretrained(str(Path(pretrained).expanduser()), **hf_args)
        model_config = config.to_model_config()
    except Exception:  # noqa: BLE001  (whatever it is, loading the model reports it, as without the pre-flight)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolve_options(values, given_as, model_config)
        resolve_options(generation, given_as | gen_given_as, model_config)
    check_max_length(kwargs.get("max_length"), model_config)


@register_model(LM_EVAL_BACKEND_NAME)
class RecurrentDepthEvalLM(HFLM):
    """lm-eval `LM` for recurrent-depth models (ours and official Huginn-0125 directories)."""

    def __init__(
        self,
        pretrained: Any,
        seed: int = 0,
        steps_log: str | None = None,
        device: str | None = None,
        batch_size: int | str = 1,
        **kwargs: Any,
    ) -> None:
        register_transformers()
        values, given_as = check_model_args(pretrained, seed, kwargs)
        self.seed = seed
        self.steps_log = Path(steps_log) if steps_log else None
        batch_size = check_batch_size(batch_size)
        if isinstance(batch_size, str):  # auto, auto:N
            log.warning("batch_size=%s: using %d (no memory probing on this backend)", batch_size,
                        DEFAULT_AUTO_BATCH)
            batch_size = DEFAULT_AUTO_BATCH
        kwargs.setdefault("backend", "causal")
        try:
            super().__init__(pretrained=pretrained, device=_resolve_device(device), batch_size=batch_size, **kwargs)
        except TypeError as exc:  # an unknown model_arg reaches the model's __init__ through from_pretrained
            unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
            if unknown is None:
                raise
            raise ValueError(f"model_args: {unknown.group(1)}={kwargs.get(unknown.group(1))!r} is not an argument of "
                             f"lm-eval's HF model or of ours ({', '.join(sorted(MODEL_ARGS))})") from None
        except OSError as exc:  # not a local directory, so transformers tried it as a hub id (a multi-line message)
            if not isinstance(pretrained, str) or Path(pretrained).expanduser().is_dir():
                raise
            raise OSError(f"pretrained={pretrained}: no such directory, and as a hub id: "
                          f"{' '.join(str(exc).split())}") from None
        self._core = self.model.core
        check_max_length(self.max_length, self._core.config)
        self.options = resolve_options(values, given_as, self._core.config)
        try:  # every refusal that depends on the model (a gate criterion without a gate, warm start or an
            # init_scale on an Ouro-layout model, ...) now: loglikelihood requests do not pass through `generate`
            check_options_for_model(self._core, self.options)
        except OptionError as exc:
            raise exc.spelled(kwarg_spelling(given_as)) from None
        self.model_args = values  # the options given, by field name: every generate request starts from them
        self._given_as = given_as  # (how they were spelled)
        self.depth = self.options.num_steps
        self.init_scale = values.get("init_scale")  # None: the config's
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self.step_counts: dict[str, Counter] = {"loglikelihood": Counter(), "generate_until": Counter()}

    def _create_model(self, pretrained: Any, *args: Any, peft: str | None = None, revision: str | None = "main",
                      **kwargs: Any) -> None:
        """HFLM's, but a `peft=` adapter on `weights=int8 / int4` layers goes on through
        `train.lora.on_quantized_layers`: HFLM's `PeftModel.from_pretrained(model, peft)` knows no quantized layer
        of ours ("Target module Int4WeightLinear ... is not supported"). (HFLM's resizing of the embedding to the
        tokenizer's length, for adapters that add tokens, is left out: our trainers add none.)"""
        if not (peft and kwargs.get("weights")):
            super()._create_model(pretrained, *args, peft=peft, revision=revision, **kwargs)
            return
        from peft import LoraConfig, PeftConfig, PeftModel

        from recurrent_depth.train.lora import on_quantized_layers, refuse_dora_on_quantized
        from recurrent_depth.weight_quant import check_weights

        check_weights(kwargs["weights"])  # (an invalid format first, not named as the DoRA refusal's)
        if Path(peft).is_dir():  # (a hub id: peft's own refusal, from the layer)
            refuse_dora_on_quantized(Path(peft), kwargs["weights"])  # before the model loads
        super()._create_model(pretrained, *args, peft=None, revision=revision, **kwargs)
        config = PeftConfig.from_pretrained(peft, revision=revision)
        if isinstance(config, LoraConfig):  # (another kind, IA3, ...: peft's own error)
            config = on_quantized_layers(config, self._model)
        self._model = PeftModel.from_pretrained(self._model, peft, revision=revision, config=config)

    # ------------------------------------------------------------------ statistics
    def _record(self, kind: str, steps: list[int]) -> None:
        self.step_counts[kind].update(steps)

    def steps_summary(self) -> dict[str, Any]:
        """Per request type: tokens, mean steps per token, and the histogram of steps."""
        out: dict[str, Any] = {}
        for kind, counts in self.step_counts.items():
            tokens = sum(counts.values())
            if tokens:
                out[kind] = {
                    "tokens": tokens,
                    "mean_steps": round(sum(s * n for s, n in counts.items()) / tokens, 4),
                    "histogram": {str(s): n for s, n in sorted(counts.items())},
                }
        return out

    def _write_steps_log(self) -> None:
        if self.steps_log is not None:
            self.steps_log.parent.mkdir(parents=True, exist_ok=True)
            self.steps_log.write_text(json.dumps(self.settings() | {"steps": self.steps_summary()}, indent=2) + "\n")

    def settings(self) -> dict[str, Any]:
        resolved = {name: getattr(self.options, name) for name in MODEL_OPTIONS}
        return resolved | {"seed": self.seed}

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["recurrent_depth"] = self.settings() | {"steps": self.steps_summary()}
        return info

    # ------------------------------------------------------------------ scoring
    def tok_encode(self, string: str, *args: Any, **kwargs: Any) -> list[int]:
        """lm-eval's, without transformers' warning about a text longer than the model: lm-eval encodes whole
        documents (rolling loglikelihood) and contexts on purpose, and windows or truncates them itself."""
        with windowed_encoding():
            return super().tok_encode(string, *args, **kwargs)

    @property
    def _stepwise(self) -> bool:
        o = self.options
        return (o.exit_criterion is not None or o.kv_budget is not None or o.kv_policy is not None
                or o.kv_quant is not None or o.warm_start)

    def _model_call(self, inps: torch.Tensor, attn_mask: Any = None, labels: Any = None) -> torch.Tensor:
        with torch.no_grad():
            return self.model(inps, num_steps=self.depth, init_scale=self.init_scale, generator=self._generator,
                              use_cache=False).logits

    def _request_generator(self, context: list[int], continuation: list[int]) -> torch.Generator:
        """The s_0 stream of one scored request: seeded by `seed` and the request's tokens, so that its score
        depends neither on batch_size nor on the requests scored beside it or before it."""
        digest = hashlib.sha256(json.dumps([self.seed, context, continuation]).encode()).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") % 2**63)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's, but a continuation that encodes to no tokens after an empty context is scored as
        `_loglikelihood_tokens` scores an empty continuation (log 1 = 0, greedy): lm-eval's encoding compares
        its first token with the prefix token and fails there with an IndexError."""
        empty = {i for i, r in enumerate(requests)
                 if r.args[0] == "" and not self.tok_encode(r.args[1], add_special_tokens=False)}
        if not empty:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        for i in sorted(empty):
            self.cache_hook.add_partial("loglikelihood", requests[i].args, (0.0, True))
        rest = iter(super().loglikelihood([r for i, r in enumerate(requests) if i not in empty],
                                          disable_tqdm=disable_tqdm))
        return [(0.0, True) if i in empty else next(rest) for i in range(len(requests))]

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """Score (context, continuation) token lists; longest first, in batches of `batch_size`. An empty
        continuation (a choice "" after its context) is certain: log 1 = 0 and greedy, with no model call (the
        scorers, and lm-eval's `hf` backend, refuse it, which ended the whole run)."""
        results: list[Scored | None] = [None if continuation else Scored(0.0, True, [])
                                        for _, _, continuation in requests]
        order = sorted((i for i, r in enumerate(results) if r is None),
                       key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        batch_size = int(override_bs or self.batch_size)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        limit = self.max_length + 1  # the last continuation token is never fed
        hidden = True if disable_tqdm or self.rank != 0 else None  # None: tqdm shows the bar on a terminal only
        with tqdm(total=len(requests), disable=hidden, desc="Scoring (recurrent-depth)") as bar:
            for i, item in enumerate(results):
                if item is not None and requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (item.logprob, item.is_greedy))
            bar.update(len(requests) - len(order))
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                batch = []
                for i in chunk:
                    context, continuation = list(requests[i][1]), list(requests[i][2])
                    if len(continuation) >= limit:
                        raise ValueError(f"a continuation of {len(continuation)} tokens exceeds "
                                         f"max_length={self.max_length}")
                    keep = limit - len(continuation)
                    batch.append((context[-keep:], continuation))  # left-truncate the context, as HFLM does
                generators = [self._request_generator(*request) for request in batch]
                if self._stepwise:
                    o = self.options
                    scored = stepwise_logprobs(
                        self._core, batch, self.depth, pad, o.exit_criterion, o.threshold, o.min_steps,
                        o.kv_budget, o.warm_start, self.init_scale, generators, kv_policy=o.kv_policy,
                        kv_quant=o.kv_quant, exit_kv=o.exit_kv, min_steps_rule=o.min_steps_rule,
                        check_every=o.check_every, warm_start_source=o.warm_start_source,
                        exit_in_prefill=o.exit_in_prefill and o.criterion is not None,
                    )
                else:
                    scored = batched_logprobs(self._core, batch, self.depth, pad, self.init_scale, generators)
                for i, item in zip(chunk, scored):
                    results[i] = item
                    self._record("loglikelihood", item.steps)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], (item.logprob, item.is_greedy))
                bar.update(len(chunk))
        self._write_steps_log()
        return [(r.logprob, r.is_greedy) for r in results]  # type: ignore[union-attr]

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """lm-eval's, with its requests' gen_kwargs checked first, in one line: lm-eval's loop fails mid-run with a
        TypeError on a name it passes on itself (`stop=`) or on a stop that is not a string (`until: null`), and an
        AssertionError when max_gen_toks leaves no room; a bad option value (``num_steps=-2``, ``top_k=-1``,
        ``temperature=abc``) failed at the first batch of its task, or as a bare ``could not convert string to
        float``."""
        from lm_eval.models.utils import normalize_gen_kwargs

        checked: set[str] = set()
        for request in requests:
            gen_kwargs = request.args[1]
            if not isinstance(gen_kwargs, dict):
                continue  # lm-eval's own assertion names it
            key = json.dumps(gen_kwargs, sort_keys=True, default=repr)
            if key in checked:  # (a task's requests share their gen_kwargs: each set is checked once)
                continue
            checked.add(key)
            ours = {k: v for k, v in gen_kwargs.items() if k not in LM_EVAL_OWN_GEN_KWARGS}
            _refuse_unknown_gen_kwargs(ours)
            options, given_as = self._generation_options(ours)  # (types first: normalize_gen_kwargs float()s)
            spelling = kwarg_spelling(self._given_as | given_as)
            try:
                with warnings.catch_warnings():  # generate warns, once per batch, as without this check
                    warnings.simplefilter("ignore")
                    check_options_for_model(self._core, resolve_options(options, self._given_as | given_as,
                                                                        self._core.config))
            except OptionError as exc:
                raise exc.spelled(spelling) from None
            until = gen_kwargs.get("until", [])
            if not (isinstance(until, str) or isinstance(until, list) and all(isinstance(s, str) for s in until)):
                raise ValueError(f"until={until!r} is invalid: expected a string or a list of strings")
            try:
                max_gen_toks = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)["max_gen_toks"]
            except ValueError:  # lm-eval's int(): "invalid literal for int() with base 10: 'abc'"
                max_gen_toks = next(gen_kwargs[k] for k in LM_EVAL_GEN_BUDGET_KWARGS if gen_kwargs.get(k) is not None)
            if not isinstance(max_gen_toks, int) or not 0 <= max_gen_toks < self.max_length:
                raise ValueError(f"max_gen_toks={max_gen_toks!r} is invalid: expected 0 <= max_gen_toks < "
                                 f"max_length={self.max_length} (the prompt keeps the rest of max_length)")
        return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def _generation_options(self, gen_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """`generation_options` of this backend's model args at its depth (`rdepth eval` sets `depth` per sweep)."""
        return generation_options(self.model_args | {"num_steps": self.depth}, gen_kwargs)

    def _model_generate(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        from recurrent_depth.inference import generate as rd_generate

        kwargs = dict(generation_kwargs)
        attention_mask = kwargs.pop("attention_mask", None)
        _refuse_unknown_gen_kwargs(kwargs)
        options, given_as = self._generation_options(kwargs)
        # lm-eval's post-processing ignores an empty stop string; generate refuses one: it stops nothing.
        stop = [s for s in stop if s] if stop else []
        # One seed per row, drawn in request order (lm-eval's order does not depend on batch_size), so a request
        # is generated as it would be alone, in a batch of any size (drawn on the generator's device: a CUDA
        # generator refuses a CPU draw).
        seed = [int(torch.randint(0, 2**31 - 1, (1,), generator=self._generator, device=self._generator.device))
                for _ in range(context.shape[0])]
        try:
            out = rd_generate(
                self._core, context, max_new_tokens=max_length - context.shape[1], attention_mask=attention_mask,
                stop=stop or None, tokenizer=self.tokenizer, seed=seed, **options,
            )
        except OptionError as exc:
            raise exc.spelled(kwarg_spelling(given_as)) from None
        for row, n in zip(out.steps.tolist(), out.lengths.tolist()):
            self._record("generate_until", row[:n])
        self._write_steps_log()
        return out.sequences
