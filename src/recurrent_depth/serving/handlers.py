"""The route handlers of the OpenAI-compatible app (`app.py` wires them to URLs): authorization,
reading and preparing a request, turning it into scheduler jobs (one per prompt and choice), and
answering it as JSON (`responses.py`) or a stream of server-sent events (`streaming.py`)."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from recurrent_depth.inference.gradmem import check_prompts
from recurrent_depth.inference.options import DEFAULT_TTT_MAX_COPY_MB, OptionError, ResolvedOptions, eos_ids
from recurrent_depth.inference.session import check_options_for_model
from recurrent_depth.inference.ttt_e2e import copy_bytes, copy_parts, inner_depth, select_parameters
from recurrent_depth.serving import responses
from recurrent_depth.serving.adapters import adapter_dir_inside, check_adapter_name
from recurrent_depth.serving.batch import BatchDecoder, RowRequest
from recurrent_depth.serving.engine import (
    BatchScheduler,
    EngineUnavailable,
    Job,
    QueueFull,
    UnknownAdapter,
)
from recurrent_depth.serving.kernels import KernelWarmup
from recurrent_depth.serving.kv_pool import SlotKVPool
from recurrent_depth.serving.prep import PrepPool, PrepSpec
from recurrent_depth.serving.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    Sampling,
    TokenizeRequest,
    option_error,
    parse_request_body,
    unknown_model,
)
from recurrent_depth.serving.streaming import Channel, OpenRequests, collect, stream
from recurrent_depth.serving.text import TextCodec, TextState
from recurrent_depth.serving.transport import BodyBudget, read_body, require_json
from recurrent_depth.weight_quant import QuantizedLinear

MAX_BODY_BYTES = 32 * 2**20
LORA_UPDATE_BODY_BYTES = 64 * 2**10  # a load / unload request's body: a name and a path
BODY_TOTAL_FACTOR = 4  # all bodies held at once, by default: 4 x the per-request limit (128 MiB)


@dataclass
class ServerSettings:
    """What `create_app` (serving/app.py) needs besides the scheduler and the tokenizer."""

    model_name: str  # the base's first served name: the `model` of its answers, the `root` of every card
    api_key: str | None = None
    request_timeout: float = 600.0
    limits: Limits | None = None
    aliases: tuple[str, ...] = ()  # the base's other served names (--served-model-name's after the first)
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = MAX_BODY_BYTES
    max_body_total: int | None = None  # bytes of all bodies being read or prepared at once (None: 4 x max_body_bytes)
    read_timeout: float = 30.0  # seconds for a request's head, and for its whole body
    stall_timeout: float = 60.0  # /health says "stalled" after this long without progress while busy
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (None: loopback; "*": any)
    tokenizer_workers: int = 2
    tokenize_timeout: float = 10.0
    worker_memory: int | None = 2 << 30  # address space a preparation worker may add after start-up
    default_num_steps: int | None = None  # for the banner
    ttt_max_copy_bytes: int = DEFAULT_TTT_MAX_COPY_MB << 20  # a TTT-E2E request's weight copy (--ttt-max-copy-mb)


def served_model_names(given: str | Sequence[str] | None, default: str) -> tuple[str, ...]:
    """The base's served names (`build_app`'s model_name, `rdepth serve --served-model-name`): one name or several,
    the first answering for all (as vLLM's); None or "" gives `default`. A one-line ValueError for a name that is
    not a non-blank string, an empty list, or a name given twice."""
    from recurrent_depth.files import clipped

    if given is None or given == "":
        return (default,)
    what = "model_name (--served-model-name)"
    names = tuple(given) if isinstance(given, list | tuple) else (given,)  # (anything else: refused below)
    if not names:
        raise ValueError(f"{what} is an empty list: give at least one served name, or None for the default")
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{what} {clipped(name)} is invalid: expected a non-blank string")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"{what} names {repeated} more than once: give each served name once")
    return names


class Handlers:
    """What the routes share (scheduler, tokenizer, settings, preparation workers, open requests) and
    the routes themselves. Generation handlers take `(request, start)`: `start` is the request's arrival."""

    def __init__(self, scheduler: BatchScheduler, codec: TextCodec, settings: ServerSettings) -> None:
        cfg = scheduler.model.config
        self.scheduler, self.codec, self.settings = scheduler, codec, settings
        limits = settings.limits or Limits(cfg.max_seq_len, cfg.mean_recurrence, cfg.vocab_size,
                                           gate_threshold=cfg.exit_gate_threshold)
        # s_0's scale is the served model's (Parcae's 1/sqrt(h), 0 for a zero-init model), whoever built the limits
        self.limits = replace(limits, init_scale=cfg.init_scale)
        self.base_names = (settings.model_name, *settings.aliases)  # the base's names (no adapter), in order
        self.names = set(self.base_names)
        self.metrics = scheduler.metrics
        self.base_stops = set(codec.eos_ids) | set(eos_ids(cfg.eos_token_id, "eos_token_id", cfg.vocab_size))
        for name in ("eos_token_id", "stop_token_ids"):  # generation_config.json's stop ids join the model's eos
            self.base_stops |= set(eos_ids(self.limits.defaults.get(name), f"generation_config.json: {name}",
                                           cfg.vocab_size))
        # The workers refuse an unknown `model` before tokenizing, unless runtime LoRA loading can change the
        # names while they run: then `adapter_of` alone checks it, against the names as they are
        adapters = scheduler.adapters
        runtime_updates = adapters is not None and adapters.updates_root is not None
        names = None if runtime_updates else frozenset(self.names | set(self.adapters))
        self.pool = PrepPool(PrepSpec(codec.source if codec.has_tokenizer else None, codec.vocab_size,
                                      self.limits, names, settings.worker_memory),
                             workers=settings.tokenizer_workers, timeout=settings.tokenize_timeout)
        self.open_requests = OpenRequests(scheduler)
        self.kernels = KernelWarmup(scheduler.model)  # app.py readies --kv-quant's at start-up
        if isinstance(settings.max_body_bytes, bool) or not isinstance(settings.max_body_bytes, int) \
                or settings.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={settings.max_body_bytes!r} is invalid: expected a number of bytes >= 1")
        total = settings.max_body_total
        if total is None:
            total = BODY_TOTAL_FACTOR * settings.max_body_bytes
        elif total < settings.max_body_bytes:
            raise ValueError(f"max_body_total={total} is below max_body_bytes={settings.max_body_bytes}: a body at "
                             "the limit could never be read")
        self.bodies = BodyBudget(total)
        self.api_key = settings.api_key.encode("utf-8") if settings.api_key is not None else None

    @property
    def adapters(self) -> tuple[str, ...]:
        """The served LoRA adapters' names as they are now: the scheduler's own list (a request names only what it
        runs), which runtime loads and unloads change."""
        return self.scheduler.adapter_names

    # ------------------------------------------------------------------ auth and body
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        # Header values arrive as bytes (Starlette shows them as latin-1); the key is compared as UTF-8.
        header = request.headers.get("authorization", "").encode("latin-1")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")

    async def prepare(self, request: Request, kind: str) -> tuple[Any, list[list[int]]]:
        """The validated request and its token-id prompts: the body is read here (bounded in size and
        time), parsed, checked, rendered and tokenized in a worker process (`prep.py`)."""
        require_json(request.headers.get("content-type"))
        with self.bodies.holding() as share:  # until the worker has the body (it returns token ids)
            raw = await read_body(request.receive, self.settings.max_body_bytes, self.settings.read_timeout,
                                  request.headers.get("content-length"), share)
            return await self.pool.prepare(kind, raw)

    # ------------------------------------------------------------------ simple routes
    async def health(self) -> JSONResponse:
        scheduler, settings = self.scheduler, self.settings
        status = "ok" if scheduler.healthy else "unavailable"
        body: dict[str, Any] = {"status": status, "model": settings.model_name, "running": scheduler.running,
                                "waiting": len(scheduler.waiting), "batching": scheduler.batches,
                                "kv_quant": scheduler.kv_quant.name if scheduler.kv_quant is not None else None,
                                "stall_timeout": settings.stall_timeout}
        if scheduler.kv_quant is not None:  # the true bits per coordinate, norms counted (a label is nominal)
            head_dim = scheduler.model.config.head_dim
            body["kv_quant_bits_per_coordinate"] = scheduler.kv_quant.bits_per_coordinate(head_dim)
        idle = self.open_requests.idle_seconds()
        if idle is not None:
            body["seconds_since_progress"] = round(idle, 3)
            if status == "ok" and idle > settings.stall_timeout:
                status = body["status"] = "stalled"
                body["error"] = (f"the engine has made no progress for {idle:.1f} s "
                                 f"(over {settings.stall_timeout:g} s) while requests are open")
        if scheduler.failure:
            body["error"] = scheduler.failure
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    def model_card(self, name: str) -> dict[str, Any]:
        """The card of a served name: one of the base's (each its own card, as vLLM's), or a served LoRA adapter's,
        whose `parent` names the base it runs on (as vLLM's); `root` is the base's first name (vLLM gives a path
        there: this server publishes none of its paths)."""
        base = self.settings.model_name
        return {"id": name, "object": "model", "created": self.settings.created,
                "owned_by": "recurrent-depth", "root": base, "parent": None if name in self.names else base,
                "max_model_len": self.limits.max_seq_len}

    async def list_models(self, request: Request) -> JSONResponse:
        self.authorize(request)
        cards = [self.model_card(name) for name in (*self.base_names, *self.adapters)]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, model_id: str, request: Request) -> JSONResponse:
        self.authorize(request)
        if model_id not in self.names and model_id not in self.adapters:
            raise unknown_model(model_id, self.names | set(self.adapters))
        return JSONResponse(self.model_card(model_id))

    def adapter_of(self, sampling: Sampling) -> str | None:
        """The LoRA adapter a request names in `model` (None: the base, also when `model` is left out); a 404 for
        a name not served now (one unloaded since its preparation worker checked it, or any unknown name where
        runtime LoRA loading is on: the workers leave the check to this)."""
        adapters = self.adapters  # (one snapshot: a runtime unload may change the names meanwhile)
        self.check_model(sampling.model, adapters)
        return sampling.model if sampling.model in adapters else None

    def check_model(self, model: str | None, adapters: tuple[str, ...] | None = None) -> None:
        """404 for a `model` this server does not serve now (None: the base); `adapters`: the names as read."""
        adapters = self.adapters if adapters is None else adapters
        if model is not None and model not in self.names and model not in adapters:
            raise unknown_model(model, self.names | set(adapters))

    def served_name(self, sampling: Sampling) -> str:
        """The `model` of the answer: the adapter's name for an adapter's request, else the base's first name (as
        vLLM's, whichever of the base's names the request gave)."""
        return self.adapter_of(sampling) or self.settings.model_name

    async def prometheus(self, request: Request) -> PlainTextResponse:
        self.authorize(request)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation plumbing
    def make_jobs(self, sampling: Sampling, prompts: list[list[int]], top: int | None, prompt_scores: bool,
                  extra_stops: set[int], channel: Channel,
                  start: float) -> tuple[list[Job], list[responses.Choice]]:
        codec, limits, scheduler = self.codec, self.limits, self.scheduler
        adapter = self.adapter_of(sampling)  # (first: an unknown model is a 404 whatever else the request asks)
        if sampling.stop and not codec.has_tokenizer:  # no text to search: they could never match
            raise APIError(400, "'stop' strings need the model directory's tokenizer.json, which this server does "
                                "not have; use 'stop_token_ids'", param="stop")
        base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        # the model's end of text (and, for chat, of turn): a stop there has no stop_reason, as vLLM's eos has none;
        # a stop at one of the request's other stop_token_ids reports that id
        eos = extra_stops | (set() if sampling.ignore_eos else self.base_stops)
        stops = set(sampling.stop_token_ids) | eos
        reported = frozenset(set(sampling.stop_token_ids) - eos)
        deadline = start + self.settings.request_timeout
        jobs, choices = [], []
        for p, prompt in enumerate(prompts):
            max_tokens = sampling.max_tokens
            if max_tokens is None:  # not sent: generation_config.json's max_new_tokens, else (chat) the rest of the
                room = limits.max_seq_len - len(prompt)  # context; either within the context left (as vLLM's)
                if room < 1:
                    raise APIError(400, f"the prompt has {len(prompt)} tokens, which fills the model's context of "
                                        f"{limits.max_seq_len} tokens", param=sampling.given_as.get("prompt", "prompt"),
                                   code="context_length_exceeded")
                max_tokens = min(room, limits.defaults.get("max_new_tokens", room))
            options = sampling.options(len(prompt), max_tokens, limits)
            try:  # an official compress-sN / compress-rN needs the model's layout
                options = options.bound(scheduler.model.config.core_layers)
            except ValueError as exc:
                raise APIError(400, str(exc), param="kv_policy") from None
            try:  # what this model cannot run (a lookup, mode, kv_quant or criterion): 400 now, not 500 later
                check_options_for_model(scheduler.model, options)
            except OptionError as exc:
                raise option_error(exc, sampling.given_as) from None
            if options.gradmem_tokens:  # GradMem: a prompt too short to split, or a model it cannot take
                self.check_gradmem(len(prompt), options, sampling.given_as, prompt_scores)
            if options.ttt_params is not None:  # TTT-E2E: a subset this model lacks, or over the copy limit
                self.check_ttt(len(prompt), options, sampling.given_as)
            # the slot pool takes most policies; the rest (always-last, randomized, compress-rN) run alone,
            # and so do speculative decoding, the official schedule and a kv_quant other than the pool's
            solo = (sampling.speculative or not scheduler.batches or not SlotKVPool.takes(options.policy)
                    or not BatchDecoder.runs(options) or not scheduler.batch.takes_kv_quant(options.kv_quant))
            # official defaults also stop at the official code's hard-coded ids, as `generate` does (the batch stops
            # at the job's ids only: it ran past them)
            row_stops = stops | set(options.stop_ids([], scheduler.model.config.vocab_size))
            # the job's stop ids are the whole rule: a solo session must not add the config's eos (it ended an
            # ignore_eos request there, as "length")
            generation = dict(sampling.generation, max_new_tokens=max_tokens, stop=sorted(row_stops) or None,
                              eos_token_id=[])
            if options.kv_quant is None and scheduler.kv_quant is not None:  # the server's memory setting
                generation["kv_quant"] = scheduler.kv_quant.name
            for j in range(sampling.n):
                index = p * sampling.n + j
                row = RowRequest(list(prompt), options, seed=base_seed + j, top_logprobs=top,
                                 prompt_logprobs=prompt_scores)
                jobs.append(Job(row=row, max_tokens=max_tokens, stop_ids=frozenset(row_stops),
                                text=TextState(codec, sampling.stop, sampling.skip_special_tokens,
                                               sampling.include_stop_str_in_output),
                                sink=channel.sink, deadline=deadline,
                                index=index, solo=solo, generation_kwargs=generation, arrival=start,
                                served_adapter=adapter, reported_stop_ids=reported))
                choices.append(responses.Choice(index, list(prompt)))
        return jobs, choices

    def check_gradmem(self, prompt_len: int, options: ResolvedOptions, given_as: dict[str, str],
                      prompt_scores: bool) -> None:
        """400 unless a GradMem request (gradmem_tokens > 0) can run: it reads its prompt through the
        written memory, so it has no prompt scores, and its prompt must split into context and query."""
        if prompt_scores:
            raise APIError(400, "'echo' with 'logprobs' scores the prompt as the model reads it, but a GradMem "
                                "request (gradmem_tokens > 0) reads it through its memory tokens; leave out echo "
                                "or logprobs", param="echo")
        try:
            check_prompts(self.scheduler.model, [prompt_len], options)
        except OptionError as exc:
            raise option_error(exc, given_as) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="gradmem_tokens") from None
    def check_ttt(self, prompt_len: int, options: ResolvedOptions, given_as: dict[str, str]) -> None:
        """400 unless a TTT-E2E request can run: its subset names parameters of this model, its copy
        fits `ttt_max_copy_bytes`, its inner depth takes its backprop depth, its prompt has 2 tokens."""
        param = given_as.get("ttt_params", "ttt_params")
        model = self.scheduler.model
        try:
            names = select_parameters(model, options.ttt_params)
            inner_depth(model, options)
            nbytes = copy_bytes(model, names, options.ttt_optimizer)
        except OptionError as exc:
            note = ""
            if any(isinstance(m, QuantizedLinear) for m in model.modules()):  # their weights are not parameters
                note = ("; this server's linear layers are weight-quantized (rdepth serve --weights), so TTT-E2E "
                        "can train only their float parameters (norms, embeddings): serve without --weights to "
                        "train them")
            raise option_error(exc, given_as, note) from None
        limit = self.settings.ttt_max_copy_bytes
        if nbytes > limit:
            held = copy_parts(model, names, options.ttt_optimizer)
            raise APIError(400, f"ttt_params={options.ttt_params!r} needs a weight copy of {nbytes / 2**20:.2f} MiB "
                                f"({held}), over this server's limit of {limit / 2**20:.2f} MiB (rdepth serve "
                                "--ttt-max-copy-mb); choose a smaller subset", param=param)
        if prompt_len < 2:
            raise APIError(400, "TTT-E2E (ttt_params) trains on the prompt's next-token loss, which needs a prompt of "
                                "at least 2 tokens", param=param)

    async def submit(self, jobs: list[Job], start: float, channel: Channel) -> None:
        """Queue a request's jobs, once the quantized-KV kernels their spec needs are loaded (a first
        build runs in a thread, not in the scheduler's decode call; `kernels.py`)."""
        await self.kernels.ready(jobs[0].row.options.kv_quant if jobs else None)
        try:
            self.scheduler.submit(jobs)
            self.open_requests.add(jobs, start, channel)
        except QueueFull as exc:
            self.metrics.reject("queue_full")
            # (Retry-After, as the body budget's 503: clients that honour it, the openai one included, wait it out)
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineUnavailable as exc:
            self.metrics.reject("unavailable")
            raise APIError(503, str(exc), type="service_unavailable", code="engine_unavailable") from None
        except UnknownAdapter as exc:  # unloaded between the check of its name and now
            raise unknown_model(exc.name, self.names | set(self.adapters)) from None

    def _stream(self, endpoint: str, jobs: list[Job], choices: list[responses.Choice], channel: Channel,
                start: float, **parts: Any) -> Response:
        """A streaming request's answer (see `streaming.stream` for `parts`); counted when the stream ends."""
        def ended(status: int) -> None:
            self.metrics.request_done(endpoint, status, time.monotonic() - start)

        return stream(jobs, choices, channel, self.open_requests, start + self.settings.request_timeout,
                      ended=ended, **parts)

    async def _collect(self, request: Request, jobs: list[Job], choices: list[responses.Choice],
                       channel: Channel, start: float) -> None:
        await collect(request, jobs, choices, channel, self.open_requests, start + self.settings.request_timeout)

    # ------------------------------------------------------------------ runtime LoRA updates
    async def load_lora_adapter(self, request: Request, start: float) -> PlainTextResponse:
        """`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} (vLLM's): serve one more adapter, its path
        relative to --lora-updates-root. It loads once the running requests have finished (the scheduler's
        switch point), checked as the start-up adapters are."""
        body = await self.lora_update_body(request)
        name, given = body.get("lora_name"), body.get("lora_path")
        try:
            check_adapter_name(name, "lora_name")
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        if name in self.names:
            raise APIError(400, f"lora_name {name!r} is the base model's served name: choose another",
                           param="lora_name")
        if name in self.adapters:  # (ServedAdapters.add checks again, in order with the other loads)
            raise APIError(400, f"a LoRA adapter named {name!r} is already loaded: unload it first, or choose "
                                "another lora_name", param="lora_name")
        root = self.scheduler.adapters.updates_root
        try:
            directory = await asyncio.to_thread(adapter_dir_inside, root, given)  # (the file system may be slow)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        await self.update_adapters("lora_path", self.scheduler.load_adapter, name, directory)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request, start: float) -> PlainTextResponse:
        """`POST /v1/unload_lora_adapter` {"lora_name"} (vLLM's): stop serving an adapter at once (a request
        naming it is then a 404, and the name may be loaded again); the requests accepted for it before finish with
        it. The answer comes once its layers are gone: after those requests (`BatchScheduler.unload_adapter`)."""
        name = (await self.lora_update_body(request)).get("lora_name")
        if name not in self.adapters:  # (ServedAdapters.retire checks again, in order with the loads)
            from recurrent_depth.files import clipped

            raise APIError(400, f"no LoRA adapter named {clipped(name)} is loaded; this server has "
                                f"{list(self.adapters)}", param="lora_name")
        await self.update_adapters("lora_name", self.scheduler.unload_adapter, name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def lora_update_body(self, request: Request) -> dict[str, Any]:
        """A load / unload request's JSON object, after the key; a 404 saying how to turn the routes on where
        they are off (no --lora-updates-root)."""
        self.authorize(request)
        adapters = self.scheduler.adapters
        if adapters is None or adapters.updates_root is None:
            raise APIError(404, f"{request.url.path}: runtime LoRA loading is off on this server (start it with "
                                "rdepth serve --lora-updates-root DIR)", type="not_found_error")
        require_json(request.headers.get("content-type"))
        raw = await read_body(request.receive, LORA_UPDATE_BODY_BYTES, self.settings.read_timeout,
                              request.headers.get("content-length"))
        return parse_request_body(raw)

    async def update_adapters(self, param: str, update: Any, *args: Any) -> None:
        """Run a scheduler's adapter update (`load_adapter` / `unload_adapter`) to its end, its errors as HTTP
        ones (400: the request's, naming `param`)."""
        try:
            # (a client that disconnects does not call it off: the update runs, and a retry answers 'already loaded')
            await asyncio.wrap_future(update(*args))
        except ValueError as exc:  # (the server's paths left out: the client gave one relative to the root)
            root = f"{self.scheduler.adapters.updates_root}/"
            raise APIError(400, str(exc).replace(root, ""), param=param) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="service_unavailable", code="engine_unavailable") from None

    # ------------------------------------------------------------------ generation routes
    async def completions(self, request: Request, start: float) -> Response:
        self.authorize(request)
        codec = self.codec
        req: CompletionRequest
        req, prompts = await self.prepare(request, "completions")
        channel = Channel()
        # (named before the jobs are queued: an unload once they are is a 404 for new requests, not for these)
        model = self.served_name(req.sampling)
        jobs, choices = self.make_jobs(req.sampling, prompts, req.logprobs, req.echo and req.logprobs is not None,
                                       set(), channel, start)
        await self.submit(jobs, start, channel)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model}
        # with include_usage every chunk carries "usage": null, the last one the counts (as OpenAI's)
        part = {**head, "usage": None} if req.sampling.include_usage else head
        opening = None
        if req.echo and req.logprobs is None:  # with logprobs the echo waits for the prompt scores
            opening = lambda c: {**part, "choices": [{"index": c.index, "text": responses.echoed_prompt(codec, req, c),  # noqa: E731
                                                      "logprobs": None, "finish_reason": None}]}
        if req.sampling.stream:
            return self._stream(
                "completions", jobs, choices, channel, start,
                to_chunks=lambda event, choice: responses.completion_chunks(codec, event, choice, req, part),
                final=lambda: {**head, "choices": [], "usage": responses.usage(choices, prompts)}
                if req.sampling.include_usage else None, opening=opening)
        await self._collect(request, jobs, choices, channel, start)
        return JSONResponse(responses.completion_body(codec, req, head, choices, prompts))

    async def chat(self, request: Request, start: float) -> Response:
        self.authorize(request)
        codec = self.codec
        req: ChatRequest
        req, (prompt,) = await self.prepare(request, "chat")  # the template writes its own bos
        top = (req.top_logprobs or 0) if req.logprobs else None
        channel = Channel()
        model = self.served_name(req.sampling)  # (before the jobs are queued, as for completions)
        jobs, choices = self.make_jobs(req.sampling, [prompt], top, False, set(codec.chat_stop_ids), channel, start)
        await self.submit(jobs, start, channel)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        part = {**head, "usage": None} if req.sampling.include_usage else head  # (as for completions)
        if req.sampling.stream:
            return self._stream(
                "chat", jobs, choices, channel, start,
                to_chunks=lambda event, choice: responses.chat_chunks(codec, event, choice, req, part),
                final=lambda: {**head, "choices": [], "usage": responses.usage(choices, [prompt])}
                if req.sampling.include_usage else None,
                opening=lambda c: {**part, "choices": [{"index": c.index, "delta": {
                    "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        await self._collect(request, jobs, choices, channel, start)
        return JSONResponse(responses.chat_body(codec, req, head, choices, prompt))

    # ------------------------------------------------------------------ vLLM's tokenizer routes
    async def tokenize(self, request: Request, start: float) -> JSONResponse:
        """`POST /tokenize` (vLLM's): the ids a completion of `prompt`, or a chat completion of `messages`, runs on;
        tokenized in a worker process as those are."""
        self.authorize(request)
        req: TokenizeRequest
        req, (ids,) = await self.prepare(request, "tokenize")
        self.check_model(req.model)
        return JSONResponse(responses.tokenize_body(req, ids, self.limits.max_seq_len))

    async def detokenize(self, request: Request, start: float) -> JSONResponse:
        """`POST /detokenize` (vLLM's): token ids back to text, special tokens kept."""
        self.authorize(request)
        req: DetokenizeRequest
        req, _ = await self.prepare(request, "detokenize")
        self.check_model(req.model)
        return JSONResponse({"prompt": req.prompt})
