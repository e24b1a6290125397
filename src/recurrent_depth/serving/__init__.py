"""An OpenAI-compatible server with per-request test-time compute and continuous batching.

    from recurrent_depth.serving import build_app
    app = build_app("runs/quickstart/model")          # a FastAPI app; run it with uvicorn
    # or from the shell:  rdepth serve --model runs/quickstart/model --port 8000

Modules: `kv_pool` (per-row, per-step KV storage), `batch` (the continuous batch: prefill,
one decode step with per-row depth and exit), `solo` (speculative / unsupported models through
`recurrent_depth.inference`), `engine` (the scheduler thread, bounded queue, timeouts),
`protocol` (request validation, OpenAI errors), `text` (tokenizer, chat template, stop strings),
`metrics` (Prometheus text) and `app` (the FastAPI routes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recurrent_depth.config import MAX_NUM_STEPS, check_depth, is_int
from recurrent_depth.serving.app import ServerSettings, create_app
from recurrent_depth.serving.batch import BatchDecoder, RowRequest, TokenResult
from recurrent_depth.serving.engine import Engine
from recurrent_depth.serving.metrics import Metrics
from recurrent_depth.serving.protocol import APIError, Limits
from recurrent_depth.serving.text import TextCodec

__all__ = [
    "APIError",
    "BatchDecoder",
    "Engine",
    "Limits",
    "Metrics",
    "RowRequest",
    "ServerSettings",
    "TextCodec",
    "TokenResult",
    "build_app",
    "create_app",
    "default_max_num_steps",
    "serve",
]


def default_max_num_steps(mean_recurrence: int, max_depth: int | None = None) -> int:
    """The deepest recurrence a request may ask for unless the server says otherwise: max(64, 4 r̄),
    never above the depth ceiling (`max_depth`, default MAX_NUM_STEPS)."""
    return min(max(64, 4 * mean_recurrence), MAX_NUM_STEPS if max_depth is None else max_depth)


def build_app(
    model: Any,
    *,
    model_name: str | None = None,
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
    device: str = "cpu",
) -> Any:
    """A ready FastAPI app for a model directory (or a loaded `RecurrentDepthLM` plus `tokenizer_dir`).

    `num_steps` is the depth of requests that do not set one (None: the model's mean_recurrence);
    `max_num_steps` bounds what a request may ask for, itself at most `max_depth` (the depth ceiling,
    default MAX_NUM_STEPS). The engine thread starts with the app (its
    lifespan) and stops with it.
    """
    if isinstance(model, str | Path):
        from recurrent_depth.checkpoint import load_pretrained

        directory = Path(model)
        if not directory.is_dir():
            raise ValueError(f"--model {str(model)!r} is not a directory (expected a saved model directory)")
        tokenizer_dir = tokenizer_dir if tokenizer_dir is not None else directory
        model_name = model_name or directory.resolve().name
        model = load_pretrained(directory, dtype=dtype, device=device)
    model_name = model_name or "recurrent-depth"
    if not request_timeout > 0:  # also refuses NaN, under which no request would ever time out
        raise ValueError(f"request_timeout={request_timeout} is invalid: expected a number of seconds > 0")
    cfg = model.config
    if max_depth is not None and (not is_int(max_depth) or max_depth < 1):
        raise ValueError(f"max_depth={max_depth!r} is invalid: expected an integer >= 1")
    ceiling = MAX_NUM_STEPS if max_depth is None else max_depth
    steps = max_num_steps if max_num_steps is not None else default_max_num_steps(cfg.mean_recurrence, ceiling)
    check_depth(steps, "max_num_steps", ceiling, low=1)
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int)
                                  or not 0 <= num_steps <= steps):
        raise ValueError(f"num_steps={num_steps!r} is invalid: expected an integer in [0, max_num_steps={steps}]")
    limits = Limits(cfg.max_seq_len, cfg.mean_recurrence, cfg.vocab_size, max_num_steps=steps,
                    max_sequences=min(max_queue, 256), default_num_steps=num_steps)
    engine = Engine(model, Metrics(), max_batch=max_batch, max_queue=max_queue, prefill_tokens=prefill_tokens)
    codec = TextCodec(tokenizer_dir, cfg.vocab_size)
    settings = ServerSettings(model_name=model_name, api_key=api_key, request_timeout=request_timeout,
                              limits=limits)
    return create_app(engine, codec, settings)


# Seconds a Ctrl-C / SIGTERM waits for open requests before closing them (uvicorn's default waits for every
# stream to finish, which can be the whole request timeout).
SHUTDOWN_GRACE_S = 5.0


def serve(model: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **kwargs: Any) -> None:
    """Build the app and run it with uvicorn until interrupted (open requests get `SHUTDOWN_GRACE_S`)."""
    import uvicorn

    app = build_app(model, **kwargs)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
