"""An OpenAI-compatible server with per-request test-time compute and continuous batching.

    from recurrent_depth.serving import build_app
    app = build_app("runs/quickstart/model")          # a FastAPI app; run it with uvicorn
    # or from the shell:  rdepth serve --model runs/quickstart/model --port 8000

Modules: `kv_pool` (per-row, per-step KV storage), `batch` (the continuous batch: prefill,
one decode step with per-row depth and exit), `solo` (speculative / unsupported models through
`recurrent_depth.inference`), `engine` (`BatchScheduler`: the continuous-batching scheduler
thread, bounded queue, timeouts), `protocol` (request validation, OpenAI errors), `text`
(tokenizer, stop strings), `chat_template` (the sandboxed Jinja renderer), `prep` (worker
processes that parse, render and tokenize requests off the event loop), `transport` (timeouts,
body limit, Host check, shutdown, banner), `metrics` (Prometheus text), `handlers` (the routes:
jobs from requests), `responses` (the OpenAI JSON), `streaming` (waiting for the scheduler's
events; server-sent events) and `app` (the FastAPI app).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from recurrent_depth.config import MAX_NUM_STEPS, check_depth, is_int
from recurrent_depth.generation_config import GENERATION_CONFIG_MODES, server_generation_defaults
from recurrent_depth.inference.options import DEFAULT_TTT_MAX_COPY_MB
from recurrent_depth.inference.quant_cache import KVQuant
from recurrent_depth.serving.app import MAX_BODY_BYTES, ServerSettings, create_app
from recurrent_depth.serving.batch import BatchDecoder, RowRequest, TokenResult
from recurrent_depth.serving.engine import BatchScheduler, Engine
from recurrent_depth.serving.handlers import served_model_names
from recurrent_depth.serving.metrics import Metrics
from recurrent_depth.serving.protocol import (
    APIError,
    Limits,
    generation_fields,
    request_defaults,
    stop_strings,
    validated,
)
from recurrent_depth.serving.text import TextCodec, tokenizer_file
from recurrent_depth.weight_quant import check_weights, quantize_weights

__all__ = [
    "APIError",
    "BatchDecoder",
    "BatchScheduler",
    "Engine",  # the earlier name of BatchScheduler
    "Limits",
    "Metrics",
    "RowRequest",
    "ServerSettings",
    "TextCodec",
    "TokenResult",
    "build_app",
    "create_app",
    "default_max_num_steps",
    "resolve_api_key",
    "serve",
]


def default_max_num_steps(mean_recurrence: int, max_depth: int | None = None) -> int:
    """The deepest recurrence a request may ask for unless the server says otherwise: max(64, 4 r̄),
    never above the depth ceiling (`max_depth`, default MAX_NUM_STEPS)."""
    return min(max(64, 4 * mean_recurrence), MAX_NUM_STEPS if max_depth is None else max_depth)


def build_app(
    model: Any,
    *,
    model_name: str | Sequence[str] | None = None,
    tokenizer_dir: str | Path | None = None,
    api_key: str | None = None,
    max_batch: int = 32,
    max_queue: int = 256,
    prefill_tokens: int = 4096,
    request_timeout: float = 600.0,
    max_num_steps: int | None = None,
    num_steps: int | None = None,
    max_depth: int | None = None,
    dtype: Any = None,
    weights: str | None = None,
    device: str = "cpu",
    allowed_hosts: Iterable[str] | None = None,
    read_timeout: float = 30.0,
    stall_timeout: float = 60.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_body_total: int | None = None,
    tokenizer_workers: int = 2,
    tokenize_timeout: float = 10.0,
    worker_memory: int | None = 2 << 30,
    kv_quant: str | None = None,
    ttt_max_copy_mb: float = DEFAULT_TTT_MAX_COPY_MB,
    lora_modules: Mapping[str, str | Path] | None = None,
    strict_lora_base: bool = False,
    lora_updates_root: str | Path | None = None,
    max_lora_modules: int | None = None,
    generation_defaults: Mapping[str, Any] | None = None,
    generation_config: str = "auto",
) -> Any:
    """A ready FastAPI app for a model directory (or a loaded `RecurrentDepthLM` plus `tokenizer_dir`).

    `model_name`: the base's served name, or several (as vLLM's --served-model-name): a request may give any as its
    `model`, /v1/models lists each, and answers report the first (default: the model directory's name, else
    "recurrent-depth").
    `num_steps` is the depth of requests that do not set one (None: the model's mean_recurrence);
    `tokenizer_dir` (a directory or a tokenizer.json; default: the model directory's, where a directory
    without one is served for token ids only) must be a tokenizer when it is given.
    `max_num_steps` bounds what a request may ask for, itself at most `max_depth` (the depth ceiling,
    default MAX_NUM_STEPS). `api_key` must be a non-blank string or None
    (no key). `allowed_hosts`: the Host header names accepted (None: loopback names only; `["*"]`:
    any). `read_timeout`: seconds for a request's head and, separately, for its whole body.
    `stall_timeout`: seconds without progress while requests are open after which /health answers
    503 "stalled". `max_body_bytes`: the largest request body (413 past it); `max_body_total`: the bytes
    of all bodies held at once, being read or prepared (503 past it; None: 4 x max_body_bytes).
    Requests are parsed, rendered and tokenized by `tokenizer_workers` processes,
    each killed past `tokenize_timeout` seconds on one request or `worker_memory` bytes of growth.
    The engine thread and the workers start with the app (its lifespan) and stop with it.
    `kv_quant` (e.g. "k=prod:3.5,v=mse:3.5"; None: full precision) quantizes the server's KV
    memory: the continuous batch stores code rows, and requests that do not set `kv_quant` use it
    (a request asking for another spec runs alone; docs/serving.md).
    `ttt_max_copy_mb`: the largest weight copy (MiB) a TTT-E2E request may hold; such requests run
    one at a time outside the continuous batch (docs/serving.md).
    `weights` ("int8", "int4", "int4:g<group>"; None: as loaded) quantizes the model's linear layers
    (`recurrent_depth.weight_quant`), a loaded model's in place; LoRA adapters go on the quantized layers unmerged
    (QLoRA-style; a DoRA one is refused).
    `lora_modules` ({name: adapter directory}) serves LoRA adapters of the model, unmerged, beside it: a
    request whose `model` is one of the names runs with that adapter, one naming a `model_name` with none
    (`serving/adapters.py`; the requests of one adapter run at a time). A loaded model gets the adapters in place.
    `strict_lora_base`: refuse an adapter trained on other weights instead of warning (`train.lora.load_lora`).
    `lora_updates_root` (None: off) turns on runtime LoRA loading (vLLM's `POST /v1/load_lora_adapter` and
    `/v1/unload_lora_adapter`), of adapters under that directory only, up to `max_lora_modules` adapters in all
    (default 32; start-up ones count), with or without `lora_modules` and `weights`.
    `generation_config` ("auto" or "none", as `rdepth serve --generation-config`): with "auto" a model directory's
    generation_config.json sets `num_steps` and `kv_quant` where those are None, and the defaults of the fields a
    request leaves out (`serving.protocol.request_defaults`; docs/serving.md); its settings no request takes are
    named on stderr. `generation_defaults`, when given, replaces the file: such settings by our option names
    (`recurrent_depth.cli.common.generation_defaults`, which `rdepth serve` passes, having read the file itself).
    """
    check_weights(weights)
    if max_depth is not None and (not is_int(max_depth) or max_depth < 1):
        raise ValueError(f"max_depth={max_depth!r} is invalid: expected an integer >= 1")
    if generation_config not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config={generation_config!r} is invalid: expected one of "
                         f"{list(GENERATION_CONFIG_MODES)}")
    if generation_defaults is None and isinstance(model, str | Path):  # as rdepth serve reads it, before loading
        server, generation_defaults = server_generation_defaults(str(model), generation_config, "build_app",
                                                                 max_depth)
        num_steps = server["num_steps"] if num_steps is None else num_steps
        kv_quant = server["kv_quant"] if kv_quant is None else kv_quant
    from recurrent_depth.serving.adapters import check_update_settings

    check_update_settings(lora_updates_root, max_lora_modules)  # (before the model loads)
    if max_lora_modules is not None and lora_updates_root is None:
        raise ValueError("max_lora_modules bounds runtime LoRA loads, which are off: give lora_updates_root too")
    names = served_model_names(model_name, Path(model).resolve().name if isinstance(model, str | Path)
                               else "recurrent-depth")
    if lora_modules is not None:  # bad names fail before the model loads
        from recurrent_depth.serving.adapters import check_adapter_name

        for name in lora_modules:
            check_adapter_name(name, "lora_modules")
        clash = [name for name in names if name in lora_modules]
        if clash:
            raise ValueError(f"lora_modules (--lora-modules) names an adapter {clash[0]!r}, the base model's served "
                             "name: a request could not choose between them; rename the adapter (or "
                             "--served-model-name)")
    if kv_quant is not None:  # a bad spec fails before the model loads
        KVQuant.parse(kv_quant)
    tokenizer_named = tokenizer_dir is not None  # a tokenizer the caller named must be one (not token ids only)
    tokenizer_file(tokenizer_dir, required=tokenizer_named)  # and, like the spec, fails before the model loads
    source = model  # (a directory, named in an adapter's base warning)
    if isinstance(model, str | Path):
        from recurrent_depth.model.recurrent import RecurrentDepthLM

        directory = Path(model)
        if not directory.is_dir():
            raise ValueError(f"--model {str(model)!r} is not a directory (expected a saved model directory)")
        tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else directory
        model = RecurrentDepthLM.from_pretrained(directory, dtype=dtype, device=device, weights=weights)
    elif weights is not None:  # a model already holding these weights is kept; other ones are refused
        quantize_weights(model, weights)
    adapters = None
    if lora_modules is not None or lora_updates_root is not None:
        from recurrent_depth.serving.adapters import DEFAULT_MAX_LORA_MODULES, ServedAdapters

        lora_modules = lora_modules or {}
        adapters = ServedAdapters(model, lora_modules, strict_base=strict_lora_base,
                                  model_dir=Path(source) if isinstance(source, str | Path) else None,
                                  updates_root=lora_updates_root,
                                  max_count=DEFAULT_MAX_LORA_MODULES if max_lora_modules is None else max_lora_modules)
    for name, value in (("request_timeout", request_timeout), ("read_timeout", read_timeout),
                        ("stall_timeout", stall_timeout)):
        if not value > 0:  # also refuses NaN, under which nothing would ever time out
            raise ValueError(f"{name}={value} is invalid: expected a number of seconds > 0")
    # (inf or 1e308, inf in bytes, was OverflowError from int(ttt_max_copy_mb * 2**20) below)
    if isinstance(ttt_max_copy_mb, bool) or not isinstance(ttt_max_copy_mb, int | float) or \
            not 0 <= ttt_max_copy_mb * 2**20 < float("inf"):
        raise ValueError(f"ttt_max_copy_mb={ttt_max_copy_mb!r} is invalid: expected a finite number of MiB >= 0")
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is blank: pass a non-empty key, or None to serve without one")
    cfg = model.config
    ceiling = MAX_NUM_STEPS if max_depth is None else max_depth
    steps = max_num_steps if max_num_steps is not None else default_max_num_steps(cfg.mean_recurrence, ceiling)
    check_depth(steps, "max_num_steps", ceiling, low=1)
    model.max_depth = ceiling  # (the library's own ceiling, which the requests' steps run under: max_depth raises it)
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                  or not 0 <= num_steps <= steps):
        raise ValueError(f"num_steps={num_steps!r} is invalid: expected an integer in [0, max_num_steps={steps}]")
    if num_steps is None and cfg.mean_recurrence > steps:  # else requests without num_steps ran past the cap
        raise ValueError(f"the model's mean_recurrence={cfg.mean_recurrence} (the depth of requests that do not "
                         f"set num_steps) is above max_num_steps={steps}: give num_steps <= {steps} (--num-steps), "
                         "or a higher max_num_steps (--max-num-steps, --max-depth)")
    defaults, unused = request_defaults(dict(generation_defaults or {}))
    most = defaults.get("max_new_tokens")
    if most is not None and not (is_int(most) and most >= 1):  # (0: a chat answer needs a token, as in vLLM's
        # chat; transformers refuses 0 in the file too. A completion request may still send max_tokens 0)
        raise ValueError(f"generation_config.json: max_new_tokens={most!r} is invalid as the requests' default: "
                         "expected an integer >= 1 (rdepth serve --generation-config none ignores the file)")
    if unused:
        print(f"rdepth serve: generation_config.json sets {unused}, which requests do not take; they are ignored",
              file=sys.stderr)
    limits = Limits(cfg.max_seq_len, cfg.mean_recurrence, cfg.vocab_size, max_num_steps=steps,
                    max_sequences=min(max_queue, 256), default_num_steps=num_steps,
                    gate_threshold=cfg.exit_gate_threshold, defaults=defaults)
    try:  # a default no request could run with fails here, once, not as a 400 on every request that leaves it out
        validated(*generation_fields({}, limits), 1, limits)
        stop_strings(defaults.get("stop"), limits)  # (more than a request may send, an empty one)
    except APIError as exc:
        raise ValueError(f"generation_config.json: {exc.message} (rdepth serve --generation-config none ignores "
                         "the file)") from None
    scheduler = BatchScheduler(model, Metrics(), max_batch=max_batch, max_queue=max_queue,
                               prefill_tokens=prefill_tokens, kv_quant=kv_quant, adapters=adapters)
    if scheduler.kv_quant is not None:
        print(f"rdepth serve: KV cache quantized: {scheduler.kv_quant.label(cfg.head_dim)}", file=sys.stderr)
    # (its end-of-turn probe renders the template: the app's start-up runs it in a worker, under a memory limit)
    codec = TextCodec(tokenizer_dir, cfg.vocab_size, cfg.max_seq_len, required=tokenizer_named, probe_end_of_turn=False)
    if defaults.get("stop") and not codec.has_tokenizer:  # else every request without 'stop' were a 400
        raise ValueError(f"generation_config.json sets stop strings {defaults['stop']}, which need the model "
                         "directory's tokenizer.json (rdepth serve --generation-config none ignores the file)")
    if codec.has_tokenizer and codec.chat is None:
        print(f"rdepth serve: chat is off: {codec.chat_error}", file=sys.stderr)
    settings = ServerSettings(
        model_name=names[0], aliases=names[1:], api_key=api_key.strip() if api_key is not None else None,
        request_timeout=request_timeout, limits=limits, max_body_bytes=max_body_bytes, max_body_total=max_body_total,
        read_timeout=read_timeout,
        stall_timeout=stall_timeout, allowed_hosts=tuple(allowed_hosts) if allowed_hosts is not None else None,
        tokenizer_workers=tokenizer_workers, tokenize_timeout=tokenize_timeout, worker_memory=worker_memory,
        default_num_steps=num_steps, ttt_max_copy_bytes=int(ttt_max_copy_mb * 2**20))
    return create_app(scheduler, codec, settings)


def resolve_api_key(flag: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The key `rdepth serve` enforces: `--api-key` (a blank one is refused: an unset shell variable
    must not silently turn the key off), else `$RDEPTH_API_KEY` (blank means unset, with a warning)."""
    if flag is not None:
        if not flag.strip():
            raise ValueError("--api-key is empty: pass a key, or leave the flag out to serve without one")
        return flag.strip()
    value = (os.environ if environ is None else environ).get("RDEPTH_API_KEY")
    if value is not None and not value.strip():
        print("rdepth serve: warning: RDEPTH_API_KEY is set but blank; serving without an API key",
              file=sys.stderr)
        return None
    return value.strip() if value is not None else None


# Seconds a Ctrl-C / SIGTERM waits for open requests before ending them with a 503 (uvicorn's default
# waits for every stream to finish, which can be the whole request timeout).
SHUTDOWN_GRACE_S = 5.0


def serve(model: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          allowed_hosts: Iterable[str] | None = None, read_timeout: float = 30.0, **kwargs: Any) -> None:
    """Build the app and run it with uvicorn until interrupted: open requests get `SHUTDOWN_GRACE_S`,
    then a 503 (streams: an error event and [DONE]), and this returns (`rdepth serve` exits 0, SIGINT or
    SIGTERM alike); a second Ctrl-C forces the exit (KeyboardInterrupt). Host names accepted by default:
    loopback and `host` (any when `host` is 0.0.0.0 / ::)."""
    from recurrent_depth.serving.transport import allowed_host_names, make_server

    names = allowed_host_names(host, allowed_hosts)
    app = build_app(model, allowed_hosts=["*"] if names is None else sorted(names), read_timeout=read_timeout,
                    **kwargs)
    server = make_server(app, host=host, port=port, log_level=log_level, read_timeout=read_timeout,
                         grace=SHUTDOWN_GRACE_S, drain=app.state.drain, banner=app.state.banner)
    server.run()
