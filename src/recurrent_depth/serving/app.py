"""The HTTP layer: an OpenAI-compatible FastAPI app over an `Engine`.

Routes: `GET /health` (no key needed), `GET /v1/models`, `GET /v1/models/{id}`,
`POST /v1/completions`, `POST /v1/chat/completions` (both with SSE streaming ending in
`data: [DONE]`) and `GET /metrics` (Prometheus text). Handlers validate the request
(`protocol.py`), turn it into engine jobs (one per prompt and choice), and turn the engine's
events back into OpenAI JSON. The event loop never runs the model: the engine thread does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from recurrent_depth.inference.options import eos_ids
from recurrent_depth.inference.quant_cache import kv_quant_for_model
from recurrent_depth.serving.batch import BatchDecoder, PromptScores, RowRequest
from recurrent_depth.serving.engine import (
    Done,
    Engine,
    EngineUnavailable,
    Event,
    Failed,
    Job,
    PromptEvent,
    QueueFull,
    TokenOut,
)
from recurrent_depth.serving.kv_pool import SlotKVPool
from recurrent_depth.serving.prep import PrepPool, PrepSpec
from recurrent_depth.serving.protocol import APIError, ChatRequest, CompletionRequest, Limits, Sampling
from recurrent_depth.serving.text import IncrementalDecoder, TextCodec, TextState
from recurrent_depth.serving.transport import LOOPBACK_NAMES, HostGuard, allowed_host_names, read_body, require_json

MAX_BODY_BYTES = 32 * 2**20
POLL_SECONDS = 0.25  # how often a waiting non-streaming handler checks for a client that left
NEGATIVE_INFINITY_LOGPROB = -9999.0  # what JSON (no -Infinity) shows for a token of probability 0


@dataclass
class ServerSettings:
    """What `create_app` needs besides the engine and the tokenizer."""

    model_name: str
    api_key: str | None = None
    request_timeout: float = 600.0
    limits: Limits | None = None
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = 30.0  # seconds for a request's head, and for its whole body
    stall_timeout: float = 60.0  # /health says "stalled" after this long without progress while busy
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (None: loopback; "*": any)
    tokenizer_workers: int = 2
    tokenize_timeout: float = 10.0
    worker_memory: int | None = 2 << 30  # address space a preparation worker may add after start-up
    default_num_steps: int | None = None  # for the banner


def finite_logprob(value: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (probability 0) -> -9999.0, NaN / +inf (a broken
    model) -> null, rather than invalid JSON or a 500."""
    if value is None or math.isfinite(value):
        return value
    return NEGATIVE_INFINITY_LOGPROB if value < 0 else None


def finite_top(top: list[tuple[int, float]] | None) -> list[tuple[int, float | None]] | None:
    return None if top is None else [(i, finite_logprob(v)) for i, v in top]


# ---------------------------------------------------------------------------------------- per-choice state
@dataclass
class Choice:
    """What one job has produced so far (assembled into the response)."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_scores: PromptScores | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    core_steps: int = 0


class Channel:
    """Engine-thread events delivered into the handler's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, type=type, code=code, param=param).body(), status_code=status)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def create_app(engine: Engine, codec: TextCodec, settings: ServerSettings) -> FastAPI:
    """The FastAPI application. Starting it starts the engine thread; stopping it stops the thread."""
    cfg = engine.model.config
    limits = settings.limits or Limits(cfg.max_seq_len, cfg.mean_recurrence, cfg.vocab_size)
    names = {settings.model_name, *settings.aliases}
    metrics = engine.metrics
    eos_configured = cfg.eos_token_id is not None
    base_stops = set(codec.eos_ids) | set(eos_ids(cfg.eos_token_id, "eos_token_id", cfg.vocab_size))
    pool = PrepPool(PrepSpec(str(codec.model_dir) if codec.has_tokenizer else None, codec.vocab_size, limits,
                             frozenset(names), eos_configured, settings.worker_memory),
                    workers=settings.tokenizer_workers, timeout=settings.tokenize_timeout)
    inflight: dict[int, tuple[float, list[Job]]] = {}  # id(jobs) -> (arrival, jobs), for /health's stall check
    api_key = settings.api_key.encode("utf-8") if settings.api_key is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        engine.start()
        try:
            yield
        finally:
            await drain()
            await pool.stop()

    async def drain() -> None:
        """End every open request now: each gets the engine's 503 (streams: an error event, [DONE])."""
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="recurrent-depth", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.drain = drain
    app.state.banner = lambda url: banner(engine, settings, limits, url)
    hosts = settings.allowed_hosts if settings.allowed_hosts is not None else LOOPBACK_NAMES
    app.add_middleware(HostGuard, names=allowed_host_names("127.0.0.1", hosts))

    # ------------------------------------------------------------------ errors, auth, body
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(exc.status_code, message, type=kind)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        # Header values arrive as bytes (Starlette shows them as latin-1); the key is compared as UTF-8.
        header = request.headers.get("authorization", "").encode("latin-1")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def prepare(request: Request, kind: str) -> tuple[Any, list[list[int]]]:
        """The validated request and its token-id prompts: the body is read here (bounded in size and
        time), parsed, checked, rendered and tokenized in a worker process (`prep.py`)."""
        require_json(request.headers.get("content-type"))
        raw = await read_body(request.receive, settings.max_body_bytes, settings.read_timeout,
                              request.headers.get("content-length"))
        return await pool.prepare(kind, raw)

    def timed(endpoint: str) -> Callable:
        """Count every answer of an endpoint by status (streams count when they end)."""

        def wrap(handler: Callable) -> Callable:
            async def run(request: Request) -> Response:
                start = time.monotonic()
                try:
                    response = await handler(request, start)
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

        return wrap

    # ------------------------------------------------------------------ simple routes
    @app.get("/health")
    async def health() -> JSONResponse:
        status = "ok" if engine.healthy else "unavailable"
        body: dict[str, Any] = {"status": status, "model": settings.model_name, "running": engine.running,
                                "waiting": len(engine.waiting), "batching": engine.batches,
                                "kv_quant": engine.kv_quant.name if engine.kv_quant is not None else None,
                                "stall_timeout": settings.stall_timeout}
        idle = idle_seconds()
        if idle is not None:
            body["seconds_since_progress"] = round(idle, 3)
            if status == "ok" and idle > settings.stall_timeout:
                status = body["status"] = "stalled"
                body["error"] = (f"the engine has made no progress for {idle:.1f} s "
                                 f"(over {settings.stall_timeout:g} s) while requests are open")
        if engine.failure:
            body["error"] = engine.failure
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    def idle_seconds() -> float | None:
        """Seconds since the engine last made progress on open requests (None when there are none):
        since its last token, or since the oldest open request arrived if that is later."""
        open_since = [start for start, jobs in list(inflight.values()) if not all(j.finished for j in jobs)]
        if not open_since:
            return None
        since = min(open_since)
        last = getattr(engine, "last_progress", None)
        if last is not None:
            since = max(since, last)
        return time.monotonic() - since

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": settings.created, "owned_by": "recurrent-depth",
                "max_model_len": limits.max_seq_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(settings.model_name)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        authorize(request)
        if model_id not in names:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(settings.model_name))

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        authorize(request)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation plumbing
    def make_jobs(sampling: Sampling, prompts: list[list[int]], top: int | None, prompt_scores: bool,
                  extra_stops: set[int], channel: Channel, start: float) -> tuple[list[Job], list[Choice]]:
        if sampling.stop and not codec.has_tokenizer:  # no text to search: they could never match
            raise APIError(400, "'stop' strings need the model directory's tokenizer.json, which this server does "
                                "not have; use 'stop_token_ids'", param="stop")
        base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        stops = set(sampling.stop_token_ids) | extra_stops | (set() if sampling.ignore_eos else base_stops)
        deadline = start + settings.request_timeout
        jobs, choices = [], []
        for p, prompt in enumerate(prompts):
            max_tokens = sampling.max_tokens
            if max_tokens is None:  # chat default: the rest of the context
                max_tokens = limits.max_seq_len - len(prompt)
                if max_tokens < 1:
                    raise APIError(400, f"the prompt has {len(prompt)} tokens, which fills the model's context of "
                                        f"{limits.max_seq_len} tokens", param="messages",
                                   code="context_length_exceeded")
            options = sampling.options(len(prompt), max_tokens, limits)
            try:  # an official compress-sN / compress-rN needs the model's layout
                options = options.bound(cfg.core_layers)
            except ValueError as exc:
                raise APIError(400, str(exc), param="kv_policy") from None
            if options.kv_quant is not None:  # a spec this model cannot take: 400 now, not 500 in generation
                try:
                    kv_quant_for_model(engine.model, options.kv_quant)
                except ValueError as exc:
                    raise APIError(400, str(exc), param=sampling.given_as.get("kv_quant", "kv_quant")) from None
            # the slot pool takes most policies; the rest (always-last, randomized, compress-rN) run alone,
            # and so do speculative decoding, the official schedule and a kv_quant other than the pool's
            solo = (sampling.speculative or not engine.batches or not SlotKVPool.takes(options.policy)
                    or not BatchDecoder.runs(options) or not engine.batch.takes_kv_quant(options.kv_quant))
            generation = dict(sampling.generation, max_new_tokens=max_tokens, stop=sorted(stops) or None)
            if options.kv_quant is None and engine.kv_quant is not None:  # the server's memory setting
                generation["kv_quant"] = engine.kv_quant.name
            for j in range(sampling.n):
                index = p * sampling.n + j
                row = RowRequest(list(prompt), options, seed=base_seed + j, top_logprobs=top,
                                 prompt_logprobs=prompt_scores)
                jobs.append(Job(row=row, max_tokens=max_tokens, stop_ids=frozenset(stops),
                                text=TextState(codec, sampling.stop), sink=channel.sink, deadline=deadline,
                                index=index, solo=solo, generation_kwargs=generation, arrival=start))
                choices.append(Choice(index, list(prompt)))
        return jobs, choices

    def submit(jobs: list[Job], start: float) -> None:
        try:
            engine.submit(jobs)
            inflight[id(jobs)] = (start, jobs)
        except QueueFull as exc:
            metrics.reject("queue_full")
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except EngineUnavailable as exc:
            metrics.reject("unavailable")
            raise APIError(503, str(exc), type="service_unavailable", code="engine_unavailable") from None

    def apply(event: Event, choices: list[Choice]) -> Choice:
        choice = choices[event.index]
        if isinstance(event, PromptEvent):
            choice.prompt_scores = PromptScores([finite_logprob(v) for v in event.scores.logprobs],
                                                [finite_top(t) for t in event.scores.top])
        elif isinstance(event, TokenOut):
            choice.text += event.text
            choice.tokens.append(event.token)
            choice.steps.append(event.steps)
            choice.reasons.append(event.reason)
            choice.logprobs.append(finite_logprob(event.logprob))
            choice.tops.append(finite_top(event.top))
        elif isinstance(event, Done):
            choice.text += event.text
            choice.finish_reason = event.finish_reason
            choice.completion_tokens = event.completion_tokens
            choice.core_steps = event.core_steps
        return choice

    async def collect(request: Request, jobs: list[Job], choices: list[Choice], channel: Channel,
                      start: float) -> None:
        """Wait for every job of a non-streaming request; cancel them if the client leaves."""
        remaining = len(jobs)
        hard_deadline = start + settings.request_timeout + 30.0  # the engine enforces the real one
        try:
            while remaining:
                try:
                    event = await asyncio.wait_for(channel.queue.get(), POLL_SECONDS)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "the client closed the connection") from None
                    if time.monotonic() > hard_deadline:
                        raise APIError(504, "the request timed out", type="timeout") from None
                    continue
                if isinstance(event, Failed):
                    raise APIError(event.status, event.message, type=event.error_type)
                apply(event, choices)
                if isinstance(event, Done):
                    remaining -= 1
        finally:
            inflight.pop(id(jobs), None)
            if remaining:
                engine.cancel(jobs)

    def usage(choices: list[Choice], prompts: list[list[int]]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(c.completion_tokens for c in choices)
        steps = sum(c.core_steps for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion, "completion_steps": steps,
                "steps_per_token": round(steps / completion, 4) if completion else 0.0}

    # ------------------------------------------------------------------ completions
    def completion_logprobs(choice: Choice, echo: bool, first: int = 0) -> dict[str, Any]:
        """OpenAI legacy logprobs for tokens [first:] of (echoed prompt +) completion."""
        ids, lps, tops = [], [], []
        if echo:
            scores = choice.prompt_scores
            ids += choice.prompt_ids
            lps += scores.logprobs if scores else [None] * len(choice.prompt_ids)
            tops += scores.top if scores else [None] * len(choice.prompt_ids)
        ids += choice.tokens
        lps += choice.logprobs
        tops += choice.tops
        decoder = IncrementalDecoder(codec)
        offsets, length = [], 0
        for t in ids:  # offsets into the returned text (echoed prompt + completion)
            offsets.append(length)
            length += len(decoder.push(t))
        return {
            "tokens": [codec.token_string(t) for t in ids[first:]],
            "token_logprobs": lps[first:],
            "top_logprobs": [None if top is None else {codec.token_string(i): lp for i, lp in top}
                             for top in tops[first:]],
            "text_offset": offsets[first:],
        }

    @app.post("/v1/completions")
    @timed("completions")
    async def completions(request: Request, start: float) -> Response:
        authorize(request)
        req: CompletionRequest
        req, prompts = await prepare(request, "completions")
        channel = Channel()
        jobs, choices = make_jobs(req.sampling, prompts, req.logprobs, req.echo and req.logprobs is not None,
                                  set(), channel, start)
        submit(jobs, start)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": settings.model_name}
        if req.sampling.stream:
            opening = None
            if req.echo and req.logprobs is None:  # with logprobs the echo waits for the prompt scores
                opening = lambda c: {**head, "choices": [{"index": c.index, "text": codec.decode(c.prompt_ids),
                                                          "logprobs": None, "finish_reason": None}]}
            return stream(request, jobs, choices, channel, start, "completions",
                          lambda event, choice: completion_chunks(event, choice, req, head),
                          lambda: {**head, "choices": [], "usage": usage(choices, prompts)}
                          if req.sampling.include_usage else None, opening=opening)
        await collect(request, jobs, choices, channel, start)
        body_choices = []
        for c in choices:
            text = (codec.decode(c.prompt_ids) if req.echo else "") + c.text
            item: dict[str, Any] = {
                "index": c.index, "text": text,
                "logprobs": completion_logprobs(c, req.echo) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            if req.sampling.return_steps:
                item["steps"] = c.steps
            body_choices.append(item)
        return JSONResponse({**head, "choices": body_choices, "usage": usage(choices, prompts)})

    def completion_chunks(event: Event, choice: Choice, req: CompletionRequest, head: dict) -> list[dict]:
        out = []

        def chunk(text: str, finish: str | None, logprobs: dict | None, steps: list[int] | None = None) -> None:
            item: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if steps is not None and req.sampling.return_steps:
                item["steps"] = steps
            out.append({**head, "choices": [item]})

        if isinstance(event, PromptEvent) and req.echo:
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(choice, echo=True)
            chunk(codec.decode(choice.prompt_ids), None, lp)
        elif isinstance(event, TokenOut):
            lp = None
            if req.logprobs is not None:
                # text_offset counts from the start of the returned text, the echoed prompt included
                full = completion_logprobs(choice, echo=req.echo, first=len(choice.tokens) - 1 + (
                    len(choice.prompt_ids) if req.echo else 0))
                lp = {k: v[-1:] for k, v in full.items()}
            chunk(event.text, None, lp, [event.steps])
        elif isinstance(event, Done):
            chunk(event.text, event.finish_reason, None)
        return out

    # ------------------------------------------------------------------ chat
    def chat_logprobs(choice: Choice, first: int = 0) -> dict[str, Any]:
        content = []
        for t, lp, top in zip(choice.tokens[first:], choice.logprobs[first:], choice.tops[first:]):
            content.append({
                "token": codec.token_string(t), "logprob": lp, "bytes": list(codec.token_bytes(t)),
                "top_logprobs": [{"token": codec.token_string(i), "logprob": v, "bytes": list(codec.token_bytes(i))}
                                 for i, v in (top or [])],
            })
        return {"content": content, "refusal": None}

    @app.post("/v1/chat/completions")
    @timed("chat")
    async def chat(request: Request, start: float) -> Response:
        authorize(request)
        req: ChatRequest
        req, (prompt,) = await prepare(request, "chat")  # the template writes its own bos
        top = (req.top_logprobs or 0) if req.logprobs else None
        channel = Channel()
        jobs, choices = make_jobs(req.sampling, [prompt], top, False, set(codec.chat_stop_ids), channel, start)
        submit(jobs, start)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": settings.model_name}
        if req.sampling.stream:
            return stream(request, jobs, choices, channel, start, "chat",
                          lambda event, choice: chat_chunks(event, choice, req, head),
                          lambda: {**head, "choices": [], "usage": usage(choices, [prompt])}
                          if req.sampling.include_usage else None,
                          opening=lambda c: {**head, "choices": [{"index": c.index, "delta": {
                              "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        await collect(request, jobs, choices, channel, start)
        body_choices = []
        for c in choices:
            item: dict[str, Any] = {
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c) if req.logprobs else None, "finish_reason": c.finish_reason,
            }
            if req.sampling.return_steps:
                item["steps"] = c.steps
            body_choices.append(item)
        return JSONResponse({**head, "object": "chat.completion", "choices": body_choices,
                             "usage": usage(choices, [prompt])})

    def chat_chunks(event: Event, choice: Choice, req: ChatRequest, head: dict) -> list[dict]:
        if isinstance(event, TokenOut):
            item: dict[str, Any] = {"index": choice.index, "delta": {"content": event.text},
                                    "logprobs": chat_logprobs(choice, len(choice.tokens) - 1) if req.logprobs else None,
                                    "finish_reason": None}
            if req.sampling.return_steps:
                item["steps"] = [event.steps]
            return [{**head, "choices": [item]}]
        if isinstance(event, Done):
            out = []
            if event.text:
                out.append({**head, "choices": [{"index": choice.index, "delta": {"content": event.text},
                                                 "logprobs": None, "finish_reason": None}]})
            out.append({**head, "choices": [{"index": choice.index, "delta": {}, "logprobs": None,
                                             "finish_reason": event.finish_reason}]})
            return out
        return []

    # ------------------------------------------------------------------ streaming
    def stream(request: Request, jobs: list[Job], choices: list[Choice], channel: Channel, start: float,
               endpoint: str, to_chunks: Callable[[Event, Choice], list[dict]],
               final: Callable[[], dict | None], opening: Callable[[Choice], dict] | None = None) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            remaining = len(jobs)
            status = 200
            hard_deadline = start + settings.request_timeout + 30.0
            try:
                if opening is not None:
                    for c in choices:
                        yield _sse(opening(c))
                while remaining:
                    try:
                        event = await asyncio.wait_for(channel.queue.get(), POLL_SECONDS * 8)
                    except TimeoutError:
                        if time.monotonic() > hard_deadline:
                            status = 504
                            yield _sse(APIError(504, "the request timed out", type="timeout").body())
                            break
                        continue
                    if isinstance(event, Failed):
                        status = event.status
                        yield _sse(APIError(event.status, event.message, type=event.error_type).body())
                        break
                    choice = apply(event, choices)
                    if isinstance(event, Done):
                        remaining -= 1
                    for chunk in to_chunks(event, choice):
                        yield _sse(chunk)
                if status == 200:
                    tail = final()
                    if tail is not None:
                        yield _sse(tail)
                yield "data: [DONE]\n\n"
            finally:
                inflight.pop(id(jobs), None)
                if remaining:  # the client left (the generator was closed) or an error ended the stream
                    engine.cancel(jobs)
                    status = 499 if status == 200 else status
                metrics.request_done(endpoint, status, time.monotonic() - start)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def banner(engine: Engine, settings: ServerSettings, limits: Limits, url: str) -> str:
    """The start-up line: what is served, how deep by default, where."""
    params = sum(p.numel() for p in engine.model.parameters())
    depth = settings.default_num_steps if settings.default_num_steps is not None else limits.mean_recurrence
    key = "API key required" if settings.api_key is not None else "no API key"
    kv = f", KV cache {engine.kv_quant.name}" if engine.kv_quant is not None else ""
    return (f"rdepth serve: model {settings.model_name!r} ({params / 1e6:.2f}M parameters, context "
            f"{limits.max_seq_len}), default depth {depth}, max depth {limits.max_num_steps}{kv}, {key}; "
            f"OpenAI API at {url}/v1")
