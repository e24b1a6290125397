"""The quantized-KV kernels, made ready off the event loop and the scheduler thread.

The first quantized decode of a machine builds the C++ kernels (`accel.quant_cpp`, 30-60 s; later
processes load the cached build in milliseconds). Built from inside a decode call, that time would
be spent on the scheduler thread, and every request, quantized or not, would wait for it. So the
server makes them ready before a quantized job reaches the scheduler: at start-up for `--kv-quant`
(before the socket opens), and for a request's own `kv_quant` in a worker thread that the request
awaits while the scheduler keeps serving the others. Later requests find them ready.

Where the kernels cannot build (no compiler, `RDEPTH_NO_CPP=1`), decoding falls back to the
`torch.compile`d path, which compiles inside the first such decode call (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from recurrent_depth.accel.quant import code_kernels
from recurrent_depth.inference.quant_cache import KVQuant, shared_codec
from recurrent_depth.quant.rows import TurboRows


def load_kernels() -> None:
    """Load (building once per machine) the C++ kernels the process's quantized decode calls use;
    nothing where they are off. Blocking: call it from a worker thread."""
    kernels = code_kernels()
    if kernels is not None:
        kernels.cpp_kernel()


class KernelWarmup:
    """`await warmup.ready(spec)`: the kernels a spec's decode calls need are loaded (one load for
    every request that waits, run in a thread)."""

    def __init__(self, model: Any) -> None:
        self.head_dim = model.config.head_dim
        self.on_cpu = next(model.parameters()).device.type == "cpu"
        self._load: asyncio.Future[None] | None = None

    def needs(self, kv_quant: KVQuant | str | None) -> bool:
        """Whether decoding with `kv_quant` calls the C++ kernels (TurboQuant codes on both sides, on CPU)
        and they are not loaded yet."""
        if kv_quant is None or not self.on_cpu or (self._load is not None and self._load.done()):
            return False
        spec = KVQuant.parse(kv_quant)
        return all(isinstance(shared_codec(spec, role, self.head_dim), TurboRows) for role in ("k", "v"))

    async def ready(self, kv_quant: KVQuant | str | None) -> None:
        if not self.needs(kv_quant):
            return
        if self._load is None:
            self._load = in_daemon_thread(load_kernels)
        # shielded: a waiter that gives up (its client left, the server stops) leaves the load running
        await asyncio.shield(self._load)


def in_daemon_thread(work: Callable[[], None]) -> asyncio.Future[None]:
    """`work()` on a daemon thread, as a future of the running loop. Not `asyncio.to_thread`: the
    interpreter joins executor threads at exit, so a server stopped during a build would wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(None)

    def run() -> None:
        error: BaseException | None = None
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting requests
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="rdepth-kernels", daemon=True).start()
    return done
