"""A script that starts the server at module level, without an `if __name__ == '__main__':` guard.

Every request-preparation worker is a multiprocessing (forkserver) process, which imports the parent's main
script again; such a script then starts a server inside the worker, which fails. The server used to fail with a
bare EOFError from the worker's pipe (and "Application startup failed"); it now names the cause and the fix.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

FIX = "must do so under `if __name__ == '__main__':`"

# The pool alone, as the app's lifespan starts it (uvicorn.run at module level does the same, slower: it builds a
# model in each process). Each process prints what it raised, then exits as uvicorn does on a failed start-up.
SCRIPT = textwrap.dedent("""
    import asyncio
    import sys

    from recurrent_depth.serving.prep import PrepPool, PrepSpec
    from recurrent_depth.serving.protocol import Limits

    pool = PrepPool(PrepSpec(None, 64, Limits(32, 2, 64), None, None), workers=1)
    try:
        asyncio.run(pool.start())
    except Exception as exc:
        print(f"{__name__}: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    asyncio.run(pool.stop())
    print(f"{__name__}: started", flush=True)
""")


def test_a_server_started_without_a_main_guard_names_the_cause(tmp_path: Path):
    script = tmp_path / "serve_unguarded.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = run.stdout.splitlines()
    parent = [line for line in lines if line.startswith("__main__: ")]
    # the parent: a RuntimeError naming the script and the fix (was: EOFError from the worker's pipe)
    assert run.returncode == 3 and len(parent) == 1, (run.stdout, run.stderr[-3000:])
    assert parent[0].startswith("__main__: RuntimeError: a request-preparation worker exited while importing")
    assert str(script) in parent[0] and FIX in parent[0], parent[0]
    # the worker, importing the script as __mp_main__: the same words, not multiprocessing's freeze_support() text
    worker = [line for line in lines if line.startswith("__mp_main__: ")]
    assert len(worker) == 1 and FIX in worker[0], (run.stdout, run.stderr[-3000:])
