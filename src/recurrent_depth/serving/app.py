"""The HTTP layer: an OpenAI-compatible FastAPI app over a `BatchScheduler`.

Routes: `GET /health` (no key needed), `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/completions`, `POST /v1/chat/completions` (both with SSE streaming ending in
`data: [DONE]`), vLLM's `POST /tokenize` and `POST /detokenize`, `GET /metrics` (Prometheus text), `GET /version`
and, with `--lora-updates-root`, vLLM's
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`. This module wires the routes, errors and
request metrics; the handlers (`handlers.py`) validate the request (`protocol.py`), turn it into
scheduler jobs (one per prompt and choice), and turn the scheduler's events back into OpenAI JSON
(`responses.py`), whole or streamed (`streaming.py`). The event loop never runs the model: the
scheduler thread does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from recurrent_depth import __version__
from recurrent_depth.inference.lora_layers import active_unmerged, is_lora_layer
from recurrent_depth.serving.engine import BatchScheduler
from recurrent_depth.serving.handlers import MAX_BODY_BYTES, Handlers, ServerSettings  # noqa: F401 (MAX_BODY_BYTES: re-exported)
from recurrent_depth.serving.metrics import Metrics
from recurrent_depth.serving.protocol import APIError, Limits
from recurrent_depth.serving.text import TextCodec
from recurrent_depth.serving.transport import LOOPBACK_NAMES, HostGuard, allowed_host_names
from recurrent_depth.weight_quant import held_weights, logical_parameters


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type=type, code=code, param=param).body(), status_code=status)


SHUTTING_DOWN = "the server is shutting down"


async def unless_closing(work: Coroutine[Any, Any, Response], closing: asyncio.Event) -> Response:
    """`work`'s answer, or a 503 once the server starts shutting down (`closing`) before it has one:
    the work (reading the body, preparing, waiting for kernels or tokens) is cancelled, so no request
    is left for uvicorn to cut off with a plain-text 500 at its own deadline."""
    unavailable = APIError(503, SHUTTING_DOWN, type="service_unavailable", code="shutting_down")
    if closing.is_set():
        work.close()
        raise unavailable
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error after cancelling is not logged
    waiter = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        unfinished = not task.done()
        if unfinished:
            task.cancel()  # it ends at its next await (its cleanup runs: jobs cancelled, worker given back)
    if unfinished or task.cancelled():
        raise unavailable
    return task.result()


def timed(metrics: Metrics, endpoint: str, handler: Callable[[Request, float], Coroutine[Any, Any, Response]],
          closing: asyncio.Event) -> Callable[[Request], Awaitable[Response]]:
    """`handler(request, start)` as a route that counts every answer by status (streams count when they
    end) and answers 503 when the server shuts down first (`unless_closing`)."""

    async def run(request: Request) -> Response:
        start = time.monotonic()
        try:
            response = await unless_closing(handler(request, start), closing)
        except APIError as exc:
            metrics.request_done(endpoint, exc.status, None)
            raise
        except Exception:
            metrics.request_done(endpoint, 500, None)
            raise
        if not isinstance(response, StreamingResponse):
            metrics.request_done(endpoint, response.status_code, time.monotonic() - start)
        return response

    return run


def create_app(scheduler: BatchScheduler, codec: TextCodec, settings: ServerSettings) -> FastAPI:
    """The FastAPI application. Starting it starts the scheduler thread; stopping it stops the thread."""
    handlers = Handlers(scheduler, codec, settings)

    closing = asyncio.Event()

    async def drain() -> None:
        """End every open request now with a 503 (streams: an error event, [DONE]): those not yet
        submitted through `closing`, the submitted ones from here (`OpenRequests.end_all`), whatever the
        scheduler thread is doing; then stop the thread."""
        closing.set()
        handlers.open_requests.end_all(SHUTTING_DOWN)
        await asyncio.to_thread(scheduler.stop)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await handlers.pool.start()
        if codec.chat is not None:  # (rendered in a worker, under its memory limit: not in this process)
            codec.chat_stop_ids |= await handlers.pool.end_of_turn()
        await handlers.kernels.ready(scheduler.kv_quant)  # --kv-quant's kernels before the first request
        scheduler.start()
        try:
            yield
        finally:
            await drain()
            await handlers.pool.stop()

    app = FastAPI(title="recurrent-depth", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.drain = drain
    app.state.scheduler = scheduler
    app.state.codec = codec
    app.state.banner = lambda url: banner(scheduler, settings, handlers.limits, url)
    hosts = settings.allowed_hosts if settings.allowed_hosts is not None else LOOPBACK_NAMES
    app.add_middleware(HostGuard, names=allowed_host_names("127.0.0.1", hosts))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind)
        response.headers.update(exc.headers or {})  # a 405's `Allow` (RFC 9110 requires it) tells the client the method
        return response

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    app.get("/health")(handlers.health)
    app.get("/v1/models")(handlers.list_models)
    app.get("/v1/models/{model_id:path}")(handlers.get_model)
    app.get("/metrics")(handlers.prometheus)

    @app.get("/version")
    async def version(request: Request) -> JSONResponse:
        """The library's version, as vLLM's `GET /version` gives its own."""
        handlers.authorize(request)
        return JSONResponse({"version": __version__})

    app.post("/v1/completions")(timed(handlers.metrics, "completions", handlers.completions, closing))
    app.post("/v1/chat/completions")(timed(handlers.metrics, "chat", handlers.chat, closing))
    app.post("/tokenize")(timed(handlers.metrics, "tokenize", handlers.tokenize, closing))
    app.post("/detokenize")(timed(handlers.metrics, "detokenize", handlers.detokenize, closing))
    # runtime LoRA loading (vLLM's routes): a 404 saying how to turn it on unless --lora-updates-root is given
    app.post("/v1/load_lora_adapter")(timed(handlers.metrics, "load_lora_adapter", handlers.load_lora_adapter,
                                            closing))
    app.post("/v1/unload_lora_adapter")(timed(handlers.metrics, "unload_lora_adapter", handlers.unload_lora_adapter,
                                              closing))
    return app


def banner(scheduler: BatchScheduler, settings: ServerSettings, limits: Limits, url: str) -> str:
    """The start-up line: what is served, how deep by default, where."""
    params = logical_parameters(scheduler.model)  # int8 / int4 weights are buffers, not parameters
    depth = settings.default_num_steps if settings.default_num_steps is not None else limits.mean_recurrence
    key = "API key required" if settings.api_key is not None else "no API key"
    kv = f", KV cache {scheduler.kv_quant.name}" if scheduler.kv_quant is not None else ""
    names = scheduler.adapter_names
    loras = f" with LoRA adapters {', '.join(map(repr, names))}" if names else ""
    if scheduler.adapters is None and applies_lora(scheduler.model):  # `--lora`: every request runs with it
        loras = " with a LoRA adapter on every request"
    weights = held_weights(scheduler.model)  # (the adapters, if any, go on those layers unmerged)
    loras += f" on {weights} weights" if weights else ""
    aliases = f" (also as {', '.join(map(repr, settings.aliases))})" if settings.aliases else ""
    root = scheduler.adapters.updates_root if scheduler.adapters is not None else None
    runtime = f", runtime LoRA loading from {str(root)!r}" if root is not None else ""
    return (f"rdepth serve: model {settings.model_name!r}{aliases}{loras} ({params / 1e6:.2f}M parameters, context "
            f"{limits.max_seq_len}), default depth {depth}, max depth {limits.max_num_steps}{kv}{runtime}, {key}; "
            f"OpenAI API at {url}/v1")


def applies_lora(model: Any) -> bool:
    """Whether `model` holds a LoRA adapter that its forward adds (`rdepth serve --lora`: attached, unmerged)."""
    return any(is_lora_layer(m) and active_unmerged(m) for m in model.modules())
