"""Waiting for a request's answer on the event loop: the scheduler thread's events arrive through a
`Channel`; `collect` gathers them for a JSON response, `stream` turns them into server-sent events
ending in `data: [DONE]`. Both cancel the request's jobs when the client leaves or time runs out,
and take it off the server's `OpenRequests` (what /health's stall check watches)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from recurrent_depth.serving.engine import BatchScheduler, Done, Event, Failed, Job
from recurrent_depth.serving.protocol import APIError
from recurrent_depth.serving.responses import Choice, apply_event

POLL_SECONDS = 0.25  # how often a waiting non-streaming handler checks for a client that left
STREAM_POLL_SECONDS = 8 * POLL_SECONDS  # a stream only checks its deadline (a closed stream ends it at once)
LATE_SECONDS = 30.0  # past the request timeout, the handler gives up waiting (the scheduler enforces the real one)


class Channel:
    """Scheduler-thread events delivered into the handler's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class OpenRequests:
    """The requests being answered, by arrival time: /health's stall check, their cancellation, and
    ending them all at shutdown (`end_all`)."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler
        self._open: dict[int, tuple[float, list[Job]]] = {}  # id(jobs) -> (arrival, jobs)
        self._channels: dict[int, Channel] = {}

    def add(self, jobs: list[Job], arrival: float, channel: Channel | None = None) -> None:
        self._open[id(jobs)] = (arrival, jobs)
        if channel is not None:
            self._channels[id(jobs)] = channel

    def end_all(self, message: str) -> int:
        """Give every open request a 503 now, from the event loop (the scheduler thread may be inside a
        long prefill and reach its own 503s too late): its jobs are cancelled and its handler receives
        a `Failed` event (a stream sends it as an error event, then [DONE]). How many were open."""
        ended = 0
        for key, (_, jobs) in list(self._open.items()):
            channel = self._channels.get(key)
            if channel is None:
                continue
            self.scheduler.cancel(jobs)
            channel.queue.put_nowait(Failed(jobs[0].index if jobs else 0, 503, message, "service_unavailable",
                                            "shutting_down"))  # (a plain request's 503 says the same code)
            ended += 1
        return ended

    def close(self, jobs: list[Job], unfinished: bool) -> None:
        """The request is answered (or abandoned: `unfinished` cancels its jobs)."""
        self._open.pop(id(jobs), None)
        self._channels.pop(id(jobs), None)
        if unfinished:
            self.scheduler.cancel(jobs)

    def idle_seconds(self) -> float | None:
        """Seconds since the scheduler last made progress on open requests (None when there are none):
        since its last token, or since the oldest open request arrived if that is later."""
        open_since = [start for start, jobs in list(self._open.values()) if not all(j.finished for j in jobs)]
        if not open_since:
            return None
        since = min(open_since)
        last = getattr(self.scheduler, "last_progress", None)
        if last is not None:
            since = max(since, last)
        return time.monotonic() - since


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def collect(request: Request, jobs: list[Job], choices: list[Choice], channel: Channel,
                  open_requests: OpenRequests, timeout_at: float) -> None:
    """Wait for every job of a non-streaming request; cancel them if the client leaves."""
    remaining = len(jobs)
    hard_deadline = timeout_at + LATE_SECONDS
    checked = time.monotonic()
    try:
        while remaining:
            try:
                event = await asyncio.wait_for(channel.queue.get(), POLL_SECONDS)
            except TimeoutError:
                event = None
            # Check every POLL_SECONDS even while tokens keep arriving: a client that left must not
            # keep its rows generating to max_tokens.
            if event is None or time.monotonic() - checked >= POLL_SECONDS:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection") from None
                if checked > hard_deadline:
                    raise APIError(504, "the request timed out", type="timeout") from None
                if event is None:
                    continue
            if isinstance(event, Failed):
                raise APIError(event.status, event.message, type=event.error_type, code=event.code)
            apply_event(event, choices)
            if isinstance(event, Done):
                remaining -= 1
    finally:
        open_requests.close(jobs, unfinished=remaining > 0)


def stream(jobs: list[Job], choices: list[Choice], channel: Channel, open_requests: OpenRequests,
           timeout_at: float, to_chunks: Callable[[Event, Choice], list[dict]], final: Callable[[], dict | None],
           ended: Callable[[int], None], opening: Callable[[Choice], dict] | None = None) -> StreamingResponse:
    """The request's answer as server-sent events: `opening` per choice, `to_chunks` per event, `final`
    (usage) after the last one, then `[DONE]`; an error is an error event. `ended(status)` is called
    when the stream ends (499 when the client left)."""
    remaining = len(jobs)
    status = 200
    closed = False

    def end() -> None:
        """Take the request off the open ones (cancelling unfinished jobs) and count it, once."""
        nonlocal closed, status
        if closed:
            return
        closed = True
        open_requests.close(jobs, unfinished=remaining > 0)
        if remaining:  # the client left (the generator was closed) or an error ended the stream
            status = 499 if status == 200 else status
        ended(status)

    async def events() -> AsyncIterator[str]:
        nonlocal remaining, status
        hard_deadline = timeout_at + LATE_SECONDS
        try:
            if opening is not None:
                for c in choices:
                    yield sse(opening(c))
            while remaining:
                try:
                    event = await asyncio.wait_for(channel.queue.get(), STREAM_POLL_SECONDS)
                except TimeoutError:
                    if time.monotonic() > hard_deadline:
                        status = 504
                        yield sse(APIError(504, "the request timed out", type="timeout").body())
                        break
                    continue
                if isinstance(event, Failed):
                    status = event.status
                    yield sse(APIError(event.status, event.message, type=event.error_type, code=event.code).body())
                    break
                choice = apply_event(event, choices)
                if isinstance(event, Done):
                    remaining -= 1
                for chunk in to_chunks(event, choice):
                    yield sse(chunk)
            if status == 200:
                tail = final()
                if tail is not None:
                    yield sse(tail)
            yield "data: [DONE]\n\n"
        finally:
            end()

    return EventStream(events(), end, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(StreamingResponse):
    """A StreamingResponse that always ends its request: Starlette cancels the response when the client
    leaves, and a generator cancelled while a chunk was being sent (left at a `yield`), or before its
    first chunk (never started), ran its cleanup only when garbage-collected, or never: its jobs went on
    generating to max_tokens and the request was never counted."""

    def __init__(self, content: AsyncIterator[str], end: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # runs events()' cleanup now
            finally:
                self._end()  # a generator that never started has no cleanup of its own
