"""Torch thread count for the machine as it is right now: one function every command uses.

Several threads only pay off on an otherwise idle machine. When other processes keep a core busy,
threads that wait for each other at every parallel region can make a step 10x slower than one
thread (measured on a shared 2-core box: decode 153 tokens/s with 1 thread, 3 with torch's default).
`choose_threads` measures what other processes use now and picks; `ThreadGuard` re-checks during a
long run; `configure_threads` is what the CLI calls once per command (`--threads N` overrides).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch


def choose_threads(candidates: tuple[int, ...] | None = None) -> int:
    """The torch thread count for this machine right now, and set it.

    Several threads only pay off on an otherwise idle machine: when other processes keep a core busy,
    threads that wait for each other at every parallel region can make a step 10x slower than one
    thread (measured on a shared 2-core box), so 1 it is. What counts is the CPU time other processes
    use over half a second now (`OtherProcessesLoad`), not the 1-minute load average, which still
    remembers a job that just ended (say the `pip install` before the quickstart). Otherwise the
    candidates (default: 1 and torch's default) are timed on a few fp32 matmuls of the model's size (~1 s).
    """
    current = torch.get_num_threads()
    if candidates is None:
        busy = others_busy_cores(0.5)
        candidates = (1,) if cores_too_busy(current, busy) else tuple(sorted({1, current}))
    if len(candidates) == 1:
        torch.set_num_threads(candidates[0])
        return candidates[0]
    a, b = torch.randn(1024, 256), torch.randn(256, 1024)
    best, best_time = current, float("inf")
    for n in candidates:
        torch.set_num_threads(n)
        a @ b  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(8):
                a @ b
            times.append(time.perf_counter() - start)
        if min(times) < best_time:
            best, best_time = n, min(times)
    torch.set_num_threads(best)
    return best


class ThreadGuard:
    """An `on_step` callback that drops to one thread when other processes start competing for the cores.

    Every `every` steps it reads how many cores other processes kept busy since the last check
    (`OtherProcessesLoad`); when the cores left idle cannot hold our threads (`cores_too_busy`),
    multi-threaded steps stall (see `choose_threads`), so it continues with one.
    """

    def __init__(self, log: Callable[[str], None], every: int = 5) -> None:
        self.log = log
        self.every = every
        self.changes: list[dict[str, Any]] = []
        self.load = OtherProcessesLoad()

    def __call__(self, trainer, record: dict[str, Any]) -> None:
        threads = torch.get_num_threads()
        if threads == 1 or record["step"] % self.every:
            return
        busy = self.load.read()
        if cores_too_busy(threads, busy):
            torch.set_num_threads(1)
            self.changes.append({"step": record["step"], "others_busy_cores": round(busy, 2), "threads": 1})
            self.log(f"other processes are using {busy:.1f} cores: continuing with 1 thread")


# How much of a core our threads may share with other processes before one thread beats several.
SHARED_CORE_LIMIT = 0.5


def cores_too_busy(threads: int, others_busy: float, cpus: int | None = None) -> bool:
    """Whether other processes leave fewer idle cores than `threads` need (less `SHARED_CORE_LIMIT`).

    `cpus` defaults to the CPUs `/proc/stat` counts (os.cpu_count()): on a 2-core machine, others
    using half a core or more means one thread; on a large shared host (where `/proc/stat` covers the
    whole host, as in most containers) others may keep many cores busy while enough stay idle.
    """
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return cpus - others_busy < threads - SHARED_CORE_LIMIT + 1e-9


class OtherProcessesLoad:
    """Cores kept busy by other processes between two readings.

    The machine's busy CPU time (Linux `/proc/stat`: user, nice, system, irq, softirq; not steal,
    which the hypervisor takes whoever runs) minus this process's own CPU time, over the wall time
    between readings. Where `/proc/stat` does not exist, the 1-minute load average minus the cores
    this process used meanwhile stands in.
    """

    def __init__(self) -> None:
        self._mark()

    def _mark(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _machine_busy_seconds(), time.process_time()

    def read(self) -> float:
        before = (self.wall, self.busy, self.own)
        self._mark()
        elapsed = max(self.wall - before[0], 1e-6)
        own_cores = (self.own - before[2]) / elapsed
        if self.busy is None or before[1] is None:
            return max(0.0, _load_average() - own_cores)
        return max(0.0, (self.busy - before[1]) / elapsed - own_cores)


def others_busy_cores(window_s: float) -> float:
    """Cores other processes keep busy over the next `window_s` seconds (this process sleeps meanwhile)."""
    load = OtherProcessesLoad()
    time.sleep(window_s)
    return load.read()


def _machine_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine since boot, summed over cores; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 0.0


# The measured choice, made once per process: a command (or a test calling several) pays ~1.5 s once.
_measured: int | None = None


def configure_threads(requested: int | None, log: Callable[[str], None] | None = None) -> int:
    """Set torch's thread count for a command: `requested` if given, else `choose_threads()`'s pick.

    `log` (e.g. a print to stderr) gets one line saying what was chosen and why.
    """
    global _measured
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"--threads={requested!r} is invalid: expected an integer >= 1")
        torch.set_num_threads(requested)
        threads, reason = requested, "--threads"
    else:
        if _measured is None:
            _measured = choose_threads()
        torch.set_num_threads(_measured)
        threads, reason = _measured, "measured on the free cores; override with --threads N"
    if log is not None:
        log(f"using {threads} torch thread(s) ({reason})")
    return threads
