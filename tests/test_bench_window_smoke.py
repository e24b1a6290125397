"""benchmarks/window_cache.py --quick (and --mode serving): the record's keys; the bounded cache (pool) holds fewer
bytes and agrees 100%."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns

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


SERVING_RUN_KEYS = {"pool_bytes", "peak_pool_bytes", "peak_rss_delta_mib", "tokens_per_s", "cpu_tokens_per_s",
                    "agreement", "first_difference", "agreement_alone", "first_difference_alone"}
SERVING_CASE_KEYS = {"layout", "window", "attention_windows", "new_tokens", "context", "runs", "x_pool_bytes",
                     "x_peak_pool_bytes", "x_peak_rss", "x_tokens_per_s", "x_cpu_tokens_per_s"}


def serving_record(capsys, monkeypatch, *flags: str) -> dict:
    monkeypatch.setattr(bench.Memory, "mmap_threshold", lambda self, size: None)
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    assert bench.main(["--quick", "--mode", "serving", "--rows", "2", *flags]) == 0
    assert FULL_WINDOW_CACHE_ENV not in os.environ
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["benchmark"] == "window_cache" and record["mode"] == "serving" and record["rows"] == 2
    for case in record["results"]:
        assert set(case) == SERVING_CASE_KEYS
        assert list(case["runs"]) == ["bounded", "full"]
        for name, run in case["runs"].items():
            assert set(run) == SERVING_RUN_KEYS, name
            # every row equals the full pool's, and row 0 equals rd.generate of its prompt alone
            assert run["agreement"] == run["agreement_alone"] == 1.0, name
            assert run["first_difference"] is None and run["first_difference_alone"] is None, name
            assert run["tokens_per_s"] > 0 and run["cpu_tokens_per_s"] > 0, name
            assert run["peak_pool_bytes"] >= run["pool_bytes"] > 0, name
    return record


def test_quick_serving_record(capsys, monkeypatch):
    """--mode serving: the batch pool's bytes, bounded vs full, are its storage shapes (what /metrics shows)."""
    record = serving_record(capsys, monkeypatch)
    assert [(r["layout"], r["window"]) for r in record["results"]] == [("mistral", 16), ("gemma2", 16)]
    # (--quick: hidden 32, 4 heads of 8, 2 KV heads, r = 2: core layers hold 2 slots; 16 + 64 columns per row)
    entry, held, context = 2 * 2 * 8 * 4, decoding_window_columns(16), 16 + 64  # K and V, float32
    expected = {"mistral": (6 * held, 6 * context), "gemma2": (3 * held + 3 * context, 6 * context)}
    for case in record["results"]:
        bounded, full = case["runs"]["bounded"], case["runs"]["full"]
        columns_b, columns_f = expected[case["layout"]]  # slot stores x columns, summed over the bases
        assert bounded["pool_bytes"] == 2 * columns_b * entry, case["layout"]
        assert full["pool_bytes"] == 2 * columns_f * entry, case["layout"]
        assert case["x_pool_bytes"] == round(full["pool_bytes"] / bounded["pool_bytes"], 2) > 1


def test_quick_serving_record_with_kv_quant(capsys, monkeypatch):
    """--kv-quant: the pool stores code rows (bounded or not, whatever the pool does), every row exact."""
    record = serving_record(capsys, monkeypatch, "--layouts", "mistral", "--kv-quant", "k=prod:3.5,v=mse:3.5")
    assert record["kv_quant"].startswith("k=prod:3.5,v=mse:3.5")
    (case,) = record["results"]
    bounded, full = case["runs"]["bounded"], case["runs"]["full"]
    assert bounded["pool_bytes"] <= full["pool_bytes"] < 6 * 2 * 80 * 2 * 2 * 8 * 4  # (fewer than float32's)


def test_rows_belongs_to_serving(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "2"])
    assert "--rows applies to --mode serving only" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["speculative", "parallel"])
def test_quick_seeking_modes_record(capsys, monkeypatch, mode):
    """--mode speculative / parallel: the bounded cache agrees 100% with the full one and holds fewer bytes."""
    monkeypatch.setattr(bench.Memory, "mmap_threshold", lambda self, size: None)
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    assert bench.main(["--quick", "--mode", mode, "--layouts", "mistral"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["mode"] == mode
    (case,) = record["results"]
    bounded, full = case["runs"]["bounded"], case["runs"]["full"]
    for run in (bounded, full):
        assert run["agreement"] == 1.0 and run["first_difference"] is None
    assert 0 < bounded["held_bytes"] < full["held_bytes"]
