"""`rdepth serve`: an OpenAI-compatible HTTP server for a saved model directory.

    rdepth serve --model runs/quickstart/model --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "model", "prompt": "def add(a, b):", "max_tokens": 32, "num_steps": 16}'

Per-request test-time compute goes in the JSON body (`num_steps`, `exit_criterion`,
`exit_threshold`, `kv_budget`, `warm_start`, `draft_steps`, ...); see docs/serving.md.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from recurrent_depth.cli.common import (
    add_generation_config_arg,
    add_load_args,
    add_max_depth_arg,
    check_lora_with_weights,
    check_model_path,
    check_strict_lora_base,
)
from recurrent_depth.generation_config import SERVER_SETTINGS, server_generation_defaults
from recurrent_depth.inference.options import DEFAULT_TTT_MAX_COPY_MB
from recurrent_depth.inference.schema import add_option_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (continuous batching, per-request depth)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        "Requests join and leave the running batch between decode steps and each one runs at its own depth.",
    )
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; use 0.0.0.0 only behind a firewall (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id clients send, or several (as vLLM's): a request may give any of them as its "
                        "model, /v1/models lists each, and answers report the first; a --lora-modules or runtime "
                        "adapter may not take one of them (default: the model directory's name)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=ADAPTER_DIR",
                   help="serve peft LoRA adapters of --model beside it, as vLLM's --lora-modules: a request whose "
                        "'model' is NAME runs with that adapter (unmerged), one naming --served-model-name with "
                        "none; /v1/models lists them all. The requests of one adapter run at a time (docs/serving.md;"
                        " on --weights int8/int4 layers too, QLoRA-style, but for DoRA; --strict-lora-base applies "
                        "to each; needs recurrent-depth[lora]; default: none)")
    p.add_argument("--lora-updates-root", default=None, metavar="DIR",
                   help="turn on runtime LoRA loading, as vLLM's: POST /v1/load_lora_adapter {\"lora_name\": NAME, "
                        "\"lora_path\": PATH} serves the adapter in DIR/PATH (it must stay inside DIR, symlinks "
                        "resolved) as NAME, POST /v1/unload_lora_adapter {\"lora_name\": NAME} stops serving it; "
                        "each waits for the running requests to finish (docs/serving.md). With or without "
                        "--lora-modules and --weights; not with --lora; needs recurrent-depth[lora] (default: off, "
                        "the two routes answer 404)")
    p.add_argument("--max-lora-modules", type=int, default=None, metavar="N",
                   help="LoRA adapters served at most once --lora-updates-root is on, the --lora-modules ones "
                        "included: a load past it is refused (default: 32)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health; an empty key is refused "
                        "(default: the RDEPTH_API_KEY environment variable, else no key; a blank variable counts "
                        "as unset, with a warning)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names to answer (DNS-rebinding guard), '*' for any "
                        "(default: localhost, 127.0.0.1, ::1 and --host; any when --host is 0.0.0.0 or ::)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's head, and again its whole body; "
                        "slower ones get 408 (default: %(default)s)")
    p.add_argument("--stall-timeout", type=float, default=60.0,
                   help="seconds without a token while requests are open after which /health answers 503 "
                        "'stalled' (default: %(default)s)")
    p.add_argument("--tokenizer-workers", type=int, default=2,
                   help="processes that parse, render (chat template) and tokenize requests off the event loop "
                        "(default: %(default)s)")
    p.add_argument("--tokenize-timeout", type=float, default=10.0,
                   help="seconds a worker may spend on one request; past it the worker is killed and the request "
                        "gets 400 (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body; a larger one gets 413 as soon as it passes the limit "
                        "(default: 32 MiB)")
    p.add_argument("--max-body-total", type=int, default=None,
                   help="bytes of all request bodies held at once (being read or tokenized); a body that would "
                        "pass it gets 503 with Retry-After, so many bodies under --max-body-bytes cannot add up "
                        "(default: 4 x --max-body-bytes = 128 MiB)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="sequences decoded together at most (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a free row at most; more are refused with 429 (default: %(default)s)")
    p.add_argument("--prefill-tokens", type=int, default=4096,
                   help="prompt tokens admitted per scheduler iteration, so running rows keep decoding "
                        "(default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take from arrival to its last token (default: %(default)s)")
    p.add_argument("--ttt-max-copy-mb", type=float, default=DEFAULT_TTT_MAX_COPY_MB, metavar="MB",
                   help="largest weight copy a TTT-E2E request (ttt_params) may hold, its weights + gradients (+ "
                        "Adam moments), in MiB; such requests run one at a time, outside the continuous batch "
                        "(default: %(default)s)")
    add_option_flags(p, ("num_steps",), helps={
        "num_steps": "recurrence depth of requests that do not set num_steps, e.g. lm-eval's scoring requests "
                     "(default: the model's mean_recurrence)"})
    p.add_argument("--max-num-steps", type=int, default=None,
                   help="deepest recurrence a request may ask for (default: max(64, 4 x mean_recurrence), "
                        "at most --max-depth)")
    add_max_depth_arg(p)
    add_option_flags(p, ("kv_quant",), helps={
        "kv_quant": "quantize the server's KV memory, e.g. 'k=prod:3.5,v=mse:3.5' (TurboQuant; docs/quant.md): the "
                    "continuous batch stores code rows, and requests without a kv_quant field use it; a request "
                    "asking for another spec runs alone (default: full precision)"})
    add_generation_config_arg(p, "sets --num-steps and --kv-quant where those flags are not given (its num_steps, "
                                 "kv_quant), and the fields a request leaves out: temperature, top_p, top_k, min_p "
                                 "(where do_sample is true, as in transformers; do_sample false: greedy), "
                                 "repetition_penalty, max_tokens (its max_new_tokens), seed, stop (stop_strings) "
                                 "and our per-request options (exit_criterion, ...); its eos_token_id joins the stop "
                                 "ids. A request's own values win (as vLLM's --generation-config auto)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from recurrent_depth.serving import resolve_api_key
    from recurrent_depth.serving.adapters import parse_lora_modules
    from recurrent_depth.serving.text import tokenizer_file

    lora_modules = parse_lora_modules(args.lora_modules) if args.lora_modules is not None else None
    if lora_modules is not None and args.lora is not None:
        raise ValueError("--lora and --lora-modules cannot be combined: serve that adapter as one of --lora-modules "
                         "too (the base then answers under --served-model-name)")
    if args.lora_updates_root is not None and args.lora is not None:
        raise ValueError("--lora and --lora-updates-root cannot be combined: serve that adapter with --lora-modules "
                         "NAME=DIR (or load it at run time) beside the base")
    if args.max_lora_modules is not None and args.lora_updates_root is None:
        raise ValueError("--max-lora-modules bounds runtime LoRA loads: give --lora-updates-root DIR too")
    # (a DoRA adapter cannot go on --weights layers: refused before the model loads; runtime loads: when they come)
    check_lora_with_weights(args, None if lora_modules is None else list(lora_modules.values()))
    check_strict_lora_base(args, "--lora-modules" if lora_modules is not None else  # (each one's base checked)
                           "--lora-updates-root" if args.lora_updates_root is not None else "--lora")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is invalid: expected 1..65535")
    check_port_free(args.host, args.port)  # before the model loads (minutes for a large one), not after
    check_model_path(args.model)
    given = {name for name in SERVER_SETTINGS if getattr(args, name) is not None}
    request_defaults = apply_generation_defaults(args)
    # the file's values checked as flags' would name flags the user never gave: say where they came from
    from_file = [f"--{n.replace('_', '-')} " for n in SERVER_SETTINGS
                 if n not in given and getattr(args, n) is not None]
    dtype = getattr(torch, args.dtype) if args.dtype else None
    api_key = resolve_api_key(args.api_key)
    hosts = None if args.allowed_hosts is None else args.allowed_hosts.split(",")
    model: Any = args.model
    tokenizer_dir, model_name = args.tokenizer, args.served_model_name
    tokenizer_file(tokenizer_dir, required=tokenizer_dir is not None)  # before any model loads
    if args.lora is not None:  # the model loaded here, so the adapter goes onto it (unmerged)
        from recurrent_depth.model.recurrent import RecurrentDepthLM
        from recurrent_depth.train.lora import attach_adapter

        model = attach_adapter(RecurrentDepthLM.from_pretrained(args.model, dtype=dtype, device=args.device,
                                                                weights=args.weights), args.lora,
                               strict_base=args.strict_lora_base, model_dir=args.model)
        model_name = model_name or Path(args.model).resolve().name
        if tokenizer_dir is None and tokenizer_file(args.model) is not None:  # else token ids only, as without --lora
            tokenizer_dir = args.model
    try:
        _serve(args, model, tokenizer_dir, model_name, hosts, api_key, dtype, lora_modules, request_defaults)
    except ValueError as exc:  # `serve`'s checks name its keyword arguments: say the flags that set them
        message = flag_spelled(str(exc), vars(args))
        if any(message.startswith(flag) for flag in from_file):
            message += f" (set by {Path(args.model) / 'generation_config.json'}; --generation-config none ignores it)"
        raise ValueError(message) from None
    return 0


def apply_generation_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The model directory's generation_config.json (`--generation-config auto`) as --num-steps and --kv-quant where
    those flags are not given (the server's own settings: its KV pool, lm-eval's depth); the rest of it, the
    defaults of the fields a request leaves out (`build_app`'s generation_defaults)."""
    server, defaults = server_generation_defaults(args.model, args.generation_config, "rdepth serve", args.max_depth)
    for name, value in server.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return defaults


def flag_spelled(message: str, flags: dict[str, Any]) -> str:
    """`message` with each `name=` of a keyword argument that a flag sets written `--flag ` (max_batch=0 ->
    --max-batch 0); names inside quoted values (a kv_quant spec's `seed=`) are left alone."""
    names = sorted((n for n in flags if "_" in n), key=len, reverse=True)
    if not names:
        return message
    pattern = re.compile(rf"(?<![\w\-.',])({'|'.join(names)})=")
    return pattern.sub(lambda m: "--" + m.group(1).replace("_", "-") + " ", message)


def _serve(args: argparse.Namespace, model: Any, tokenizer_dir: Any, model_name: Any, hosts: Any, api_key: Any,
           dtype: Any, lora_modules: dict[str, str] | None = None,
           request_defaults: dict[str, Any] | None = None) -> None:
    from recurrent_depth.serving import serve

    serve(
        model, tokenizer_dir=tokenizer_dir, host=args.host, port=args.port, log_level=args.log_level,
        allowed_hosts=hosts, read_timeout=args.read_timeout, stall_timeout=args.stall_timeout,
        tokenizer_workers=args.tokenizer_workers, tokenize_timeout=args.tokenize_timeout,
        model_name=model_name, api_key=api_key, max_batch=args.max_batch, max_queue=args.max_queue,
        prefill_tokens=args.prefill_tokens, request_timeout=args.request_timeout,
        ttt_max_copy_mb=args.ttt_max_copy_mb, max_num_steps=args.max_num_steps, num_steps=args.num_steps,
        max_depth=args.max_depth, dtype=dtype,
        weights=None if args.lora is not None else args.weights, device=args.device, kv_quant=args.kv_quant,
        max_body_total=args.max_body_total, lora_modules=lora_modules, strict_lora_base=args.strict_lora_base,
        lora_updates_root=args.lora_updates_root, max_lora_modules=args.max_lora_modules,
        generation_defaults=request_defaults,
        **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}),
    )


def check_port_free(host: str, port: int) -> None:
    """A ValueError when --host:--port cannot be bound now (in use, or an address this machine lacks).

    uvicorn binds only after the model has loaded; this trial bind (with SO_REUSEADDR, as uvicorn's)
    finds the common mistake at once. Another process can still take the port in between."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address of this machine: {exc}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server on "
                             f"--port {port}? pick another --port)") from None
