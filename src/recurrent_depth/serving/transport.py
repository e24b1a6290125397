"""The HTTP transport around the app: read timeouts, the Host check, bounded bodies, shutdown, banner.

* `GuardedH11Protocol`: uvicorn's h11 protocol plus a header read timeout. A connection must
  deliver a complete request head within `read_timeout` seconds of opening (or of its previous
  response); otherwise it is answered 408 and closed. (uvicorn alone holds a silent or dripping
  connection forever.)
* `read_body`: reads a request body with a byte limit enforced *while* reading, whatever the
  transfer encoding (chunked bodies have no Content-Length to check up front), and a deadline for
  the whole body (a body shorter than its Content-Length is not waited for forever).
* `BodyBudget`: the bytes of all bodies held at once, bounded too (a 503 past it), since many bodies
  each under the limit add up.
* `HostGuard`: an ASGI wrapper refusing requests whose `Host` header is not an allowed name, so a
  web page cannot reach a loopback server through DNS rebinding.
* `Server`: uvicorn's server that, on Ctrl-C / SIGTERM, gives open requests a grace period, then
  ends them with a 503 error (streams: an error event and `[DONE]`) before uvicorn would cancel
  them, returns normally after such a shutdown (`rdepth serve` exits 0), and prints a start-up
  banner once the socket is bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from recurrent_depth.serving.protocol import APIError

log = logging.getLogger("recurrent_depth.serving")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CLOSE = {"Connection": "close"}  # an answer that leaves a body unread must end the connection


# ---------------------------------------------------------------------------------------- header timeout
def guarded_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a `read_timeout` on every request head."""

    class GuardedH11Protocol(H11Protocol):
        timeout = read_timeout

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._seen_cycle: Any = None
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._received = False
            self._head_timer = self.loop.call_later(self.timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def data_received(self, data: bytes) -> None:
            self._received = True
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a request head arrived
                self._seen_cycle = self.cycle
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has the same time

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            if not self._received or self.conn.our_state is not h11.IDLE:
                self.transport.close()  # a silent connection is just closed, as after a keep-alive
                return
            body = json.dumps(APIError(408, f"the request head did not arrive within {self.timeout:g} s",
                                       type="timeout", code="request_timeout").body()).encode()
            try:
                out = self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(body)).encode())]))
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
            except h11.LocalProtocolError:  # the connection is in no state to answer: just drop it
                pass
            self.transport.close()

    return GuardedH11Protocol


# ---------------------------------------------------------------------------------------- bodies
class BodyBudget:
    """The bytes of request bodies the server holds at once (read, or being read, and not yet handed
    to a preparation worker), at most `limit`: bodies under the per-request limit still add up.
    `holding()` is one request's share; growing it past the budget is a 503 (retry later). Used from
    the event loop only, so no lock."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_body_total={limit!r} is invalid: expected a number of bytes >= 1")
        self.limit = limit
        self.held = 0

    @contextlib.contextmanager
    def holding(self) -> Iterator[BodyShare]:
        share = BodyShare(self)
        try:
            yield share
        finally:
            self.held -= share.bytes


class BodyShare:
    """One request's bytes in a `BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def grow_to(self, size: int) -> None:
        extra = size - self.bytes
        if extra <= 0:
            return
        budget = self.budget
        if budget.held + extra > budget.limit:
            raise APIError(503, f"the server is holding {budget.held} bytes of request bodies and this one would "
                                f"pass its budget of {budget.limit} (--max-body-total); retry later",
                           type="service_unavailable", code="body_budget_exceeded",
                           headers={**CLOSE, "Retry-After": "1"})
        budget.held += extra
        self.bytes = size


async def read_body(receive: Callable[[], Awaitable[dict]], limit: int, timeout: float,
                    declared: str | None, share: BodyShare | None = None) -> bytes:
    """The request body, at most `limit` bytes, complete within `timeout` seconds, its bytes counted
    in `share` as they arrive.

    413 as soon as more than `limit` bytes have arrived (or are announced by Content-Length), 408
    when the body is still incomplete at the deadline, 503 when `share`'s budget is spent; all three
    answers close the connection.
    """
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; at most {limit} are accepted",
                       headers=CLOSE)
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(receive(), max(left, 0.0))
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s ({size} bytes came)",
                           type="timeout", code="request_timeout", headers=CLOSE) from None
        if message["type"] == "http.disconnect":
            raise APIError(499, "the client closed the connection while sending the body", headers=CLOSE)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes (stopped reading after {size}); at most "
                                f"{limit} are accepted", headers=CLOSE)
        if share is not None:
            share.grow_to(size)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def require_json(content_type: str | None) -> None:
    """415 unless the request says its body is JSON (a browser cannot send that cross-site without a
    CORS preflight, which this server never grants)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        shown = repr(content_type) if content_type else "none"
        raise APIError(415, f"Content-Type must be application/json, got {shown}", code="unsupported_media_type",
                       headers=CLOSE)


# ---------------------------------------------------------------------------------------- Host header
def allowed_host_names(host: str, allowed: Iterable[str] | None) -> frozenset[str] | None:
    """The Host names to accept (None: any). Default: loopback names plus the bound address, or any
    name when bound to all interfaces (0.0.0.0 / ::), where the name is the client's business."""
    if allowed is not None:
        names = frozenset(n.strip().lower() for n in allowed if n.strip())
        if not names:
            raise ValueError("allowed_hosts is empty: list host names, or '*' for any")
        return None if "*" in names else names
    if host in ("0.0.0.0", "::", ""):
        return None
    return frozenset({*LOOPBACK_NAMES, host.strip("[]").lower()})


# One host and an optional port, as RFC 9112 / 3986 allow in a Host header: a registered name or IPv4
# address, a bracketed IPv6 address, or (leniently) a bare IPv6 address without a port. Anything else,
# a list ("127.0.0.1:80, evil.com") included, names no host and is refused.
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._~-]+))(?::(?P<port>[0-9]{1,5}))?"
                   r"|(?P<bare>[0-9a-f]*:[0-9a-f:.]*)")


def host_name(header: str) -> str | None:
    """The host a Host header value names, without its port (`[::1]:8000` -> `::1`); None unless the
    value is exactly one host[:port]."""
    match = _HOST.fullmatch(header.strip().lower())
    if match is None:
        return None
    return match["v6"] or match["name"] or match["bare"]


class HostGuard:
    """ASGI wrapper: 421 for an HTTP request whose Host header names a host this server is not."""

    def __init__(self, app: Any, names: frozenset[str] | None) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.names is not None:
            given = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            header = given[0] if len(given) == 1 else ", ".join(given)  # several Host headers name no one host
            if host_name(header) not in self.names:
                body = json.dumps(APIError(
                    421, f"the Host header {header!r} is not one this server answers to "
                         f"({', '.join(sorted(self.names))}); start it with --allowed-hosts to add names",
                    code="host_not_allowed").body()).encode()
                await send({"type": "http.response.start", "status": 421, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------- server
class StartupInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM while the server started: it stopped before serving. `exit_status` (128 + the
    signal: 130, 143) is what `rdepth serve` exits with, as on an interrupt while the model loads."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} during start-up; nothing was served")
        self.signum = int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class Server(uvicorn.Server):
    """uvicorn's server with a bounded, clean shutdown and a start-up banner.

    On shutdown it stops accepting, waits up to `grace` seconds for open requests, then calls
    `drain()` (which ends every open request with a 503) and lets their answers go out before
    uvicorn's own limit (`grace` + `DRAIN_S`), so no handler is cancelled mid-answer. A connection
    still open `ABORT_S` before that limit has a client that does not read its answer (its send is
    blocked on a full socket): it is aborted, so its handler ends on the disconnect instead of being
    cancelled by uvicorn (an ERROR traceback per connection).

    After that graceful shutdown `run()` returns, whichever of SIGINT and SIGTERM asked for it: uvicorn
    raises the signal again, so `rdepth serve` exited 130 on Ctrl-C but was killed by SIGTERM (status
    -15 / 143, which systemd and Docker read as a failure). A forced shutdown (a second Ctrl-C) still
    raises it: KeyboardInterrupt, exit 130. A signal that comes while the app starts (its workers, kernels) stops
    the server as soon as it has started, and `run()` raises `StartupInterrupted` (exit 130 / 143), no banner.
    """

    DRAIN_S = 5.0
    ABORT_S = 1.0  # time the handlers of aborted connections get to end before uvicorn's limit

    def __init__(self, config: uvicorn.Config, *, grace: float, drain: Callable[[], Awaitable[None]],
                 banner: Callable[[str], str] | None = None) -> None:
        config.timeout_graceful_shutdown = grace + self.DRAIN_S
        super().__init__(config)
        self.grace = grace
        self.drain = drain
        self.banner = banner
        self.interrupted: int | None = None  # the signal that came while the app started, if one did

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        captured = getattr(self, "_captured_signals", None)  # (uvicorn's: the signals its handlers caught)
        if self.started and self.should_exit and captured:
            # Ctrl-C / SIGTERM while the app started (workers, kernels): uvicorn finished starting, then stops at
            # once; say so (capture_signals) rather than print the banner of a server that is not serving
            self.interrupted = captured[0]
            return
        if self.started and self.banner is not None and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(self.banner(f"http://{shown}:{port}"), flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)  # (what uvicorn raises again on leaving)
            if captured is not None and not self.force_exit:
                captured.clear()
            if self.interrupted is not None:
                raise StartupInterrupted(self.interrupted)

    async def shutdown(self, sockets: list | None = None) -> None:
        async def drain_after_grace() -> None:
            await asyncio.sleep(self.grace)
            await self.drain()

        async def abort_stalled() -> None:
            await asyncio.sleep(self.grace + self.DRAIN_S - self.ABORT_S)
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()  # (close() would wait for the unread bytes to be sent: forever)

        tasks = [asyncio.create_task(drain_after_grace()), asyncio.create_task(abort_stalled())]
        try:
            await super().shutdown(sockets)
        finally:
            for task in tasks:
                task.cancel()


def make_server(app: Any, *, host: str, port: int, log_level: str, read_timeout: float, grace: float,
                drain: Callable[[], Awaitable[None]], banner: Callable[[str], str] | None = None) -> Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=guarded_protocol(read_timeout),
                            lifespan="on")
    return Server(config, grace=grace, drain=drain, banner=banner)
