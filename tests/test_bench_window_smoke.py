"""benchmarks/window_cache.py --quick: the record's keys; the bounded cache holds fewer bytes and agrees 100%."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV

pytestmark = pytest.mark.usefixtures("one_thread")  # (main sets torch's threads: --threads 1; restored after)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import window_cache as bench  # noqa: E402

RUN_KEYS = {"held_bytes", "peak_held_bytes", "allocated_bytes", "peak_rss_delta_mib", "tokens_per_s",
            "cpu_tokens_per_s", "agreement", "first_difference"}
CASE_KEYS = {"layout", "window", "attention_windows", "new_tokens", "context", "runs", "x_held_bytes",
             "x_allocated_bytes", "x_peak_rss", "x_tokens_per_s", "x_cpu_tokens_per_s", "x_tokens_per_s_same_path"}


def test_quick_record(capsys, monkeypatch):
    # (glibc's mmap threshold, which main sets for its RSS figures, would stay set for the rest of this process)
    monkeypatch.setattr(bench.Memory, "mmap_threshold", lambda self, size: None)
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    assert bench.main(["--quick"]) == 0
    assert FULL_WINDOW_CACHE_ENV not in os.environ  # (the full variants' switch is restored)
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["benchmark"] == "window_cache" and record["quick"]
    assert {"machine", "cpus", "load_average_before", "threads", "torch", "cpp_decode", "num_steps"} <= set(record)
    assert [(r["layout"], r["window"]) for r in record["results"]] == [("mistral", 16), ("gemma2", 16)]
    for case in record["results"]:
        assert set(case) == CASE_KEYS
        assert list(case["runs"]) == ["bounded", "full", "full, no C++ decode"]
        for name, run in case["runs"].items():
            assert set(run) == RUN_KEYS, name
            assert run["agreement"] == 1.0 and run["first_difference"] is None, name
            assert run["tokens_per_s"] > 0, name
        bounded, full = case["runs"]["bounded"], case["runs"]["full"]
        # the bound drops windowed layers' old columns: fewer bytes held and allocated than the full cache
        assert 0 < bounded["held_bytes"] < full["held_bytes"] == case["runs"]["full, no C++ decode"]["held_bytes"]
        assert bounded["allocated_bytes"] < full["allocated_bytes"]
        assert case["x_held_bytes"] == round(full["held_bytes"] / bounded["held_bytes"], 2) > 1
    mistral, gemma2 = record["results"]
    # every layer windowed drops more than every other one
    assert mistral["runs"]["bounded"]["held_bytes"] < gemma2["runs"]["bounded"]["held_bytes"]
