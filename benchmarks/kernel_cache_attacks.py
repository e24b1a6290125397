"""The C++ quantized-KV kernel cache (issue 33 items 4, 15, 16) under attack, with the real build.

    python benchmarks/kernel_cache_attacks.py                        # a fresh cache: one cold build first
    python benchmarks/kernel_cache_attacks.py --cache ~/.cache       # an existing cache (XDG_CACHE_HOME)
    python benchmarks/kernel_cache_attacks.py --rebuilds foreign,truncated,garbage   # each a build (~1 min)

Each case is one fresh Python process loading the kernels (`quant_cpp.load()`) with XDG_CACHE_HOME
set to the cache; reported: its exit code (or the signal that ended it), seconds, whether it built,
and the cache's warning lines. Cases:

* first: the first load on this cache (a cold build on a fresh one), after a process that held the
  build lock was killed (-9), leaving its lock file;
* warm: another process (another virtualenv loads the same build: the key holds no paths);
* (--rebuilds) foreign: a library whose constructor writes a marker file replaces the cached one
  (marker: whether the constructor ran); truncated: the library cut to half; garbage: zeros of
  its size.

Prints one JSON line, then a table. tests/test_kernel_cache.py checks the same cases with fake libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

LOAD = """
import json, logging, sys, time
lines = []
class Keep(logging.Handler):
    def emit(self, record): lines.append(record.getMessage())
logging.getLogger("recurrent_depth").addHandler(Keep())
from recurrent_depth.accel import quant_cpp
start = time.monotonic()
module = quant_cpp.load()
print(json.dumps({"seconds": round(time.monotonic() - start, 2), "loaded": module is not None,
                  "built": quant_cpp._cache.built_seconds is not None, "messages": lines}))
"""
EVIL = r"""
#include <stdio.h>
__attribute__((constructor)) static void mark(void) { FILE* f = fopen(MARK, "w"); if (f) fclose(f); }
"""


def run_load(cache: Path, timeout: float) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "wall_s": round(time.monotonic() - start, 1)}
    rc = done.returncode if done.returncode >= 0 else signal.Signals(-done.returncode).name
    out = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else {}
    return {"rc": rc, "wall_s": round(time.monotonic() - start, 1), **out}


def kernel_dir(cache: Path) -> Path:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    code = "from recurrent_depth.accel import quant_cpp; print(quant_cpp.kernel_cache().directory)"
    return Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                               check=True).stdout.strip())


def kill_a_lock_holder(lock: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()


REBUILDS = ("foreign", "truncated", "garbage")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=None, help="XDG_CACHE_HOME to use (default: a fresh temp dir)")
    parser.add_argument("--rebuilds", type=lambda text: [c for c in text.split(",") if c], default=[],
                        help="damaged-library cases, each a real build: foreign,truncated,garbage (default: none)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per case")
    args = parser.parse_args()
    unknown = [case for case in args.rebuilds if case not in REBUILDS]
    if unknown:  # an unknown case was taken for "garbage" after the first two real builds
        parser.error(f"--rebuilds: unknown {', '.join(unknown)}; choose from {', '.join(REBUILDS)}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    cache = args.cache or Path(tempfile.mkdtemp(prefix="rdepth-kernel-cache-"))
    directory = kernel_dir(cache)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    kill_a_lock_holder(directory / "lock")  # a builder killed mid-build left its lock file
    results: dict[str, dict] = {"first": run_load(cache, args.timeout), "warm": run_load(cache, args.timeout)}
    library = directory / f"{directory.name}.so"
    for case in args.rebuilds:
        if case == "foreign":
            marker = directory.parent / "constructor-ran"
            source = directory.parent / "evil.c"
            source.write_text(EVIL)
            subprocess.run(["cc", "-shared", "-fPIC", f'-DMARK="{marker}"', f"-I{sysconfig.get_paths()['include']}",
                            str(source), "-o", str(library)], check=True)
            results[case] = {**run_load(cache, args.timeout), "marker": marker.exists()}
            continue
        data = library.read_bytes()
        library.write_bytes(data[: len(data) // 2] if case == "truncated" else bytes(len(data)))
        results[case] = run_load(cache, args.timeout)
    print(json.dumps({"cache": str(directory), "results": results}))
    print(f"{'case':<12} {'rc':>8} {'wall s':>8} {'load s':>8} {'built':>6}  messages")
    for case, r in results.items():
        messages = " | ".join(r.get("messages", []))
        print(f"{case:<12} {r['rc']!s:>8} {r['wall_s']:>8} {r.get('seconds', '-')!s:>8} {r.get('built', '-')!s:>6}  "
              f"{messages[:160]}{' [marker written]' if r.get('marker') else ''}")


if __name__ == "__main__":
    main()
