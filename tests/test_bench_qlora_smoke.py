"""benchmarks/qlora_train.py --quick: the record's keys, and its byte counts exact per format (no timings checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")  # (main sets torch's threads: --threads 1; restored after)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import qlora_train as bench  # noqa: E402

ROW_KEYS = {"linear_bytes", "base_bytes", "build_peak_mib", "build_resident_mib", "adapter_parameters",
            "heldout_loss_before", "step_peak_mib", "step_ms", "heldout_loss"}
COMPARED = {f"{k}_vs_float" for k in ("linear_bytes", "base_bytes", "build_peak_mib", "step_peak_mib", "step_ms")}


def linear_shapes(hidden: int) -> list[tuple[int, int]]:
    """(out, in) of every transformer linear of the benchmark's model, from its config alone."""
    cfg = bench.model_config(hidden)
    h, i = cfg.hidden_size, cfg.intermediate_size
    block = [(3 * h, h), (h, h), (2 * i, h), (h, i)]  # Wqkv, attention out, MLP fc (gate + up), MLP proj
    return block * (cfg.prelude_layers + cfg.core_layers + cfg.coda_layers) + [(h, 2 * h)]  # + the adapter


def test_quick_record(capsys, monkeypatch):
    # (glibc's mmap threshold, which main sets for its memory figures, would stay set for the rest of this process)
    monkeypatch.setattr(bench.Memory, "mmap_threshold", lambda self, size: None)
    assert bench.main(["--quick", "--formats", "int8,int4"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["benchmark"] == "qlora_train" and record["quick"] and {"machine", "clock", "threads"} <= set(record)
    (shape,) = record["results"]
    rows = shape["dtypes"]["fp32"]
    assert list(rows) == ["float", "int8", "int4"]
    for fmt, row in rows.items():
        assert set(row) >= ROW_KEYS, fmt
        if fmt != "float":
            assert COMPARED | {"loss_relative_difference", "loss_within_tolerance"} <= set(row), fmt
        assert row["step_ms"] > 0 and row["adapter_parameters"] == rows["float"]["adapter_parameters"]
    shapes = linear_shapes(shape["hidden"])
    exact = {"float": sum(o * i * 4 for o, i in shapes),  # float32 weights
             "int8": sum(o * i + o * 4 for o, i in shapes),  # 1 byte a weight + a float32 scale per channel
             # half a byte a weight (in padded to whole groups of 32: the MLP's 176) + a bf16 (scale, zero) per
             # group and channel
             "int4": sum(o * (-(-i // 32) * 32) // 2 + o * -(-i // 32) * 2 * 2 for o, i in shapes)}
    assert {fmt: row["linear_bytes"] for fmt, row in rows.items()} == exact
    # the rest of the base (embedding, norms, head) is the same tensors in every format
    others = {row["base_bytes"] - row["linear_bytes"] for row in rows.values()}
    assert len(others) == 1 and others.pop() > 0
