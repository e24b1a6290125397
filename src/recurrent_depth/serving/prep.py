"""Request preparation in worker processes: JSON parsing, validation, chat templates, tokenization.

This is the CPU-heavy part of answering a request, and much of it holds the GIL (json.loads,
the field checks, Jinja, `Tokenizer.encode`), so a thread would still stall the event loop and
with it every client, `/health` included. A small pool of processes does it instead: the event
loop only moves the raw body to a worker and gets back the validated request with token ids.
Processes also bound what a hostile input can cost: each worker has an address-space limit
(`memory_headroom` bytes above what it uses after start-up) and every task a wall-clock limit
past which its worker is killed and replaced. Workers fork from a forkserver that has imported
this module, so a new one starts in milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from recurrent_depth.inference.options import OptionWarning
from recurrent_depth.serving.chat_template import RenderedTooLong, TemplateLimit
from recurrent_depth.serving.protocol import (
    APIError,
    ChatRequest,
    Limits,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_request_body,
    parse_tokenize,
)
from recurrent_depth.serving.text import ContextTooLong, TextCodec

log = logging.getLogger("recurrent_depth.serving")


@dataclass
class PrepSpec:
    """What a worker needs to prepare requests like the server would."""

    tokenizer_dir: str | None
    vocab_size: int
    limits: Limits
    names: frozenset[str] | None  # the served models' names; None: any `model` passes here, the server checks it
    memory_headroom: int | None = 2 << 30


# ---------------------------------------------------------------------------------------- worker side
class Preparer:
    """Turns a raw body into `("ok", request, token-id prompts)` or `("error", status, message, type,
    param, code)` (plain tuples: exceptions with keyword arguments do not survive pickling)."""

    def __init__(self, spec: PrepSpec) -> None:
        self.spec = spec
        # (the template's start-up render waits for the memory limit: `end_of_turn`)
        self.codec = TextCodec(spec.tokenizer_dir, spec.vocab_size, spec.limits.max_seq_len, probe_end_of_turn=False)

    def prepare(self, kind: str, raw: bytes) -> tuple:
        if kind == "end_of_turn":  # the server's start-up render of the chat template (`PrepPool.end_of_turn`)
            ids = self.codec.template_end_of_turn() if self.codec.chat is not None else set()
            return ("ok", sorted(ids), [])
        try:
            with warnings.catch_warnings():  # the server validates the options again and logs each OptionWarning
                warnings.simplefilter("ignore", OptionWarning)  # once in its own form (this process printed a copy)
                return ("ok", *self._prepare(kind, raw))
        except APIError as exc:
            return ("error", exc.status, exc.message, exc.type, exc.param, exc.code)
        except MemoryError:
            return ("error", 400, "preparing this request ran out of memory (the worker's limit is "
                    f"{self.spec.memory_headroom} bytes above its start-up size)", "invalid_request_error",
                    "messages" if kind == "chat" else "prompt", None)

    def _prepare(self, kind: str, raw: bytes) -> tuple[Any, list[list[int]]]:
        spec, codec, limits = self.spec, self.codec, self.spec.limits
        names = set(spec.names) if spec.names is not None else None
        body = parse_request_body(raw)
        if kind == "completions":
            req = parse_completion(body, limits, names)
            prompts = []
            for p in req.prompts:
                if isinstance(p, str):
                    ids = self.text_ids(p, req.add_special_tokens)
                    if not ids:
                        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
                    prompts.append(ids)
                elif len(p) > limits.max_seq_len:
                    raise context_error(f"the prompt has {len(p)} tokens: more than the model's context of "
                                        f"{limits.max_seq_len} tokens", "prompt")
                else:
                    prompts.append(p)
            if not req.echo:  # the texts stay here, the ids go back; `echo` returns a text prompt as it was sent
                req.prompts = []
            return req, prompts
        if kind == "tokenize":  # vLLM's /tokenize: the ids a completion or chat completion of the same runs on
            tok = parse_tokenize(body, limits, names)
            ids = self.text_ids(tok.prompt, tok.add_special_tokens) if tok.chat is None else self.chat_ids(tok.chat)
            tok.prompt = tok.chat = None  # (only the ids go back)
            if tok.return_token_strs:  # the vocabulary's pieces, as vLLM's (the tokenizer's convert_ids_to_tokens)
                tok.token_strs = [codec.tokenizer.id_to_token(t) for t in ids]
            return tok, [ids]
        if kind == "detokenize":
            detok = parse_detokenize(body, limits, names)
            if not codec.has_tokenizer:
                raise APIError(400, "this model directory has no tokenizer.json: token ids have no text here",
                               param="tokens")
            detok.prompt = codec.decode(detok.tokens, skip_special_tokens=False)  # special tokens kept, as vLLM's
            return detok, []
        req = parse_chat(body, limits, names)
        prompt = self.chat_ids(req)
        req.messages, req.tools, req.template_kwargs = [], None, {}  # (rendered: only the ids go back)
        return req, [prompt]

    def text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """A text prompt's ids, a codec error as the request's 400 naming `prompt`."""
        try:
            return self.codec.encode(text, add_special_tokens=add_special_tokens)
        except ContextTooLong as exc:
            raise context_error(str(exc), "prompt") from None
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from None

    def chat_ids(self, req: ChatRequest) -> list[int]:
        """A chat request's prompt ids (its messages through the chat template), an error as a 400 naming `messages`."""
        try:
            return self.codec.encode_chat(req.messages, req.tools, req.add_generation_prompt,
                                          req.continue_final_message, req.template_kwargs)
        except (ContextTooLong, RenderedTooLong) as exc:
            raise context_error(str(exc), "messages") from None
        except (TemplateLimit, ValueError) as exc:
            raise APIError(400, str(exc), param="messages") from None
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise APIError(400, f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                           param="messages") from None


def context_error(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(conn: Any, spec: PrepSpec) -> None:
    """A worker's loop: one (kind, raw body) in, one result tuple out, until EOF or None."""
    conn.send(("started",))  # past the re-import of the parent's __main__ module (see `Worker`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle, not ours
    # A SIGTERM to the group before now (held by the mask `Worker` started us with) is dropped: the server is
    # stopping and ends us. A later one ends us, and multiprocessing's exit-time terminate() does too.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, START_SIGNALS)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A tokenizer panic is the request's 400 (TextCodec); Rust would still print a backtrace of its
    # internals to the log for each one (the environment may ask for RUST_BACKTRACE=1): its line is enough.
    os.environ["RUST_BACKTRACE"] = "0"
    preparer = Preparer(spec)
    if spec.memory_headroom is not None:
        import resource

        limit = _address_space() + spec.memory_headroom
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, raw = message
        conn.send(preparer.prepare(kind, raw))


# ---------------------------------------------------------------------------------------- server side
def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


# A terminal's Ctrl-C, or a SIGTERM sent to the process group, reaches the forkserver and the workers too; during
# their start-up (the forkserver's preload import, a worker's before `worker_main`) it killed them with a traceback
# each and failed the server's start-up. Those signals are the server's to handle (it ends the workers): they start
# with them blocked, a mask the forkserver keeps and its children inherit; `worker_main` lets SIGTERM in again.
START_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """`START_SIGNALS` blocked in this thread (a new process inherits the mask); a pending one is delivered after."""
    # (the resource tracker's start, on a forkserver's, unblocks these two in this thread: start it before)
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, START_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


START_TIMEOUT = 120.0  # seconds for a worker to start and load the tokenizer
MAX_WORKERS = 256  # tokenizer worker processes at most (each starts at once and holds its own tokenizer)


def main_guard_message(main: str = "__main__") -> str:
    """Why a worker died before running `worker_main`: multiprocessing imports the parent's main script again in
    every new process (standard Python behaviour, as module `__mp_main__`), and a script that starts the server
    on import fails there."""
    script = getattr(sys.modules.get(main), "__file__", None)
    if script is None:  # nothing is imported again (an interactive session, python -c)
        return "a request-preparation worker exited before it started"
    return (f"a request-preparation worker exited while importing the main script {script} again, as every new "
            "Python multiprocessing process does: a script that starts the server must do so under "
            "`if __name__ == '__main__':`")


class Worker:
    """One worker process and the pipe to it. The worker says "started" once it runs `worker_main`, after
    multiprocessing has imported the parent's __main__ module again in it, and "ready" once its tokenizer is
    loaded: a worker that dies before the first failed in that import (most often a script without a
    `__main__` guard), so the error can say so."""

    def __init__(self, spec: PrepSpec) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # We are such a worker, importing a script that starts a server: multiprocessing would refuse the
            # next process with a message about freeze_support(); say what to change instead
            raise RuntimeError(main_guard_message("__mp_main__"))
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, spec), name="rdepth-prep", daemon=True)
        with _signals_blocked():
            self.process.start()
        child.close()
        deadline = time.monotonic() + START_TIMEOUT
        self._expect("started", deadline, main_guard_message())
        self._expect("ready", deadline, "a request-preparation worker failed while loading the tokenizer")

    def _expect(self, stage: str, deadline: float, failure: str) -> None:
        """Wait for the worker's `(stage,)`; a worker that hangs or exits first is killed, and the error says why
        (`failure`, the worker's exit code; its traceback is on stderr above)."""
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            self.kill()
            raise RuntimeError(f"a request-preparation worker did not start within {START_TIMEOUT:g} s")
        try:
            message = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"{failure} (the worker exited with code {self.process.exitcode})") from None
        if message != (stage,):
            self.kill()
            raise RuntimeError(f"a request-preparation worker failed to start: {message!r}")

    def call(self, kind: str, raw: bytes) -> tuple:
        self.conn.send((kind, raw))
        return self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(2)
        self.kill()


class PrepPool:
    """`await pool.prepare(kind, raw)`: a worker prepares the request; the event loop stays free."""

    def __init__(self, spec: PrepSpec, workers: int = 2, timeout: float = 10.0) -> None:
        # (each is a process started at once: an unbounded count was a fork bomb)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"tokenizer_workers={workers!r} is invalid: expected an integer in [1, {MAX_WORKERS}]")
        if not timeout > 0:
            raise ValueError(f"tokenize_timeout={timeout!r} is invalid: expected a number of seconds > 0")
        self.spec = spec
        self.size = workers
        self.timeout = timeout
        self.idle: asyncio.Queue[Worker] | None = None
        self.all: set[Worker] = set()
        self.respawns: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks
        self.closed = False

    async def start(self) -> None:
        self.idle = asyncio.Queue()
        workers = await asyncio.gather(*(asyncio.to_thread(Worker, self.spec) for _ in range(self.size)))
        for w in workers:
            self.all.add(w)
            self.idle.put_nowait(w)

    async def stop(self) -> None:
        self.closed = True
        workers, self.all = list(self.all), set()
        await asyncio.gather(*(asyncio.to_thread(w.close) for w in workers))

    def _replace(self, worker: Worker) -> None:
        """Kill a worker (hung, dead or over its limit) and start another in the background."""
        self.all.discard(worker)
        worker.kill()

        async def respawn() -> None:
            if self.closed:
                return
            try:
                fresh = await asyncio.to_thread(Worker, self.spec)
            except Exception:  # noqa: BLE001 - keep serving with fewer workers
                log.exception("could not replace a request-preparation worker")
                return
            if self.closed:
                fresh.close()
                return
            self.all.add(fresh)
            self.idle.put_nowait(fresh)

        task = asyncio.get_running_loop().create_task(respawn())
        self.respawns.add(task)
        task.add_done_callback(self.respawns.discard)

    async def prepare(self, kind: str, raw: bytes) -> tuple[Any, list[list[int]]]:
        """(validated request, token-id prompts), or APIError."""
        if self.idle is None:
            raise APIError(503, "the server is not started", type="service_unavailable")
        worker = await self.idle.get()
        call = asyncio.ensure_future(asyncio.to_thread(worker.call, kind, raw))
        try:
            result = await asyncio.wait_for(asyncio.shield(call), self.timeout)
        except TimeoutError:
            call.add_done_callback(_consume)  # it ends with EOFError once the worker is killed
            self._replace(worker)
            param = "messages" if kind == "chat" else "prompt"
            raise APIError(400, f"preparing this request (JSON, chat template, tokenizer) took more than "
                                f"{self.timeout:g} s; it was stopped", param=param,
                           code="preparation_timeout") from None
        except asyncio.CancelledError:  # the client left: give the worker back once it is done
            call.add_done_callback(lambda f: self._release(worker, f))
            raise
        except (EOFError, OSError) as exc:
            self._replace(worker)
            raise APIError(503, f"a request-preparation worker died ({type(exc).__name__}); retry",
                           type="service_unavailable", code="worker_died") from None
        self.idle.put_nowait(worker)
        if result[0] == "error":
            _, status, message, type_, param, code = result
            raise APIError(status, message, type=type_, param=param, code=code)
        return result[1], result[2]

    async def end_of_turn(self) -> set[int]:
        """The chat template's end-of-turn token (`TextCodec.template_end_of_turn`), rendered by a worker: the
        render runs a file someone handed us, and one step of it can build a huge value before any cap sees it
        (`" " | center(10**11)`), so it runs under the worker's memory limit and `timeout`, not in the server.
        A render that fails, runs out of memory or time: no such token (chat then stops at the named ones)."""
        try:
            ids, _ = await self.prepare("end_of_turn", b"")
        except APIError as exc:
            log.warning("the chat template's end-of-turn probe failed (%s); chat stops at the named end tokens only",
                        exc.message)
            return set()
        return set(ids)

    def _release(self, worker: Worker, call: asyncio.Future) -> None:
        _consume(call)
        if call.cancelled() or call.exception() is not None:
            self._replace(worker)
        else:
            self.idle.put_nowait(worker)


def _consume(call: asyncio.Future) -> None:
    """Retrieve a finished call's outcome (asyncio logs exceptions nobody retrieved)."""
    if not call.cancelled():
        call.exception()
