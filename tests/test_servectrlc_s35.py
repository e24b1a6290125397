"""Ctrl-C / SIGTERM during `rdepth serve`'s start-up (s35): a terminal's signal reaches the whole process group, and it
killed the forkserver and tokenizer workers mid-start (a traceback ending in `EOFError: unexpected EOF`, then
"Application startup failed", exit 3). Now the workers start with those signals held, and the server says it was
interrupted in one line, exit 130 / 143."""

from __future__ import annotations

import asyncio
import multiprocessing.forkserver
import os
import signal
import socket
from pathlib import Path

import pytest

from recurrent_depth.cli import main
from recurrent_depth.serving.prep import PrepPool, PrepSpec, Worker
from recurrent_depth.serving.protocol import Limits
from tests.test_hf import make_model_dir


def signal_masks(pid: int) -> dict[str, int]:
    """The process's blocked (SigBlk) and ignored (SigIgn) signal sets, as bit masks."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigBlk", "SigIgn")}


def bit(sig: int) -> int:
    return 1 << (sig - 1)


def test_workers_and_their_forkserver_start_with_the_groups_signals_held() -> None:
    worker = Worker(PrepSpec(None, 64, Limits(32, 2, 64), None, None))
    try:
        server = signal_masks(multiprocessing.forkserver._forkserver._forkserver_pid)
        assert server["SigBlk"] & bit(signal.SIGINT) and server["SigBlk"] & bit(signal.SIGTERM)
        running = signal_masks(worker.process.pid)  # once ready: Ctrl-C ignored, SIGTERM ends it again
        assert not running["SigBlk"] & (bit(signal.SIGINT) | bit(signal.SIGTERM))
        assert running["SigIgn"] & bit(signal.SIGINT) and not running["SigIgn"] & bit(signal.SIGTERM)
        assert worker.call("completions", b'{"prompt": [1, 2], "max_tokens": 1}')[2] == [[1, 2]]  # (it works)
    finally:
        worker.close()
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}  # (ours restored)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("servectrlc") / "model"
    make_model_dir(path)
    return path


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_workers_start_is_one_line_and_128_plus_it(
        model_dir: Path, signum: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    start = PrepPool.start
    pools: list[PrepPool] = []

    async def signalled_start(pool: PrepPool) -> None:  # the signal lands while the workers start
        pools.append(pool)
        os.kill(os.getpid(), signum)
        await asyncio.sleep(0)  # (uvicorn's handler runs: a stop is asked for)
        await start(pool)

    monkeypatch.setattr(PrepPool, "start", signalled_start)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    status = main(["serve", "--model", str(model_dir), "--port", str(port), "--tokenizer-workers", "1",
                   "--threads", "1", "--log-level", "warning"])
    err = capsys.readouterr()
    assert status == 128 + signum
    assert err.err.strip().splitlines()[-1] == (f"rdepth serve: interrupted: {signal.Signals(signum).name} during "
                                                "start-up; nothing was served")
    assert "Traceback" not in err.err + err.out and "OpenAI API at" not in err.out  # (no banner)
    (pool,) = pools
    assert pool.closed and not pool.all  # the workers were stopped
