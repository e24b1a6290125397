"""The true bits per coordinate of a KV spec (norms and residual bytes counted), as every interface shows it.

The table in docs/quant.md is the reference: for every spec it lists, at d = 64 and d = 128, the bits a
spec shows equal bytes x 8 / d from the quantizer itself, and equal the table's column.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recurrent_depth.inference.kv_codec import KVQuant
from recurrent_depth.quant import build_quantizer

DOC = Path(__file__).resolve().parent.parent / "docs" / "quant.md"
ROW = re.compile(r"^\| `([a-z]+(?::[0-9.]+)?)` \| (\d+)[^|]*\| ([0-9.]+) \|[^|]*\| (\d+)[^|]*\| ([0-9.]+) \|")


def table_rows() -> list[tuple[str, dict[int, float]]]:
    rows = []
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match and not match.group(1).startswith("raw"):
            spec, _, bits64, _, bits128 = match.groups()
            rows.append((spec, {64: float(bits64), 128: float(bits128)}))
    return rows


def test_the_docs_table_is_read():
    specs = [spec for spec, _ in table_rows()]
    assert {"mse:2.5", "prod:2.5", "prod:3.5", "qjl:2", "polar"} <= set(specs) and len(specs) >= 14


@pytest.mark.parametrize("spec,bits", table_rows(), ids=[spec for spec, _ in table_rows()])
def test_shown_bits_are_bytes_times_8_over_d_for_every_spec_in_the_docs(spec, bits):
    side = "k" if spec.startswith("qjl") else "v"  # QJL codes keys only
    kv_quant = KVQuant.parse(f"{side}={spec}")
    for dim, documented in bits.items():
        true = build_quantizer(spec, dim).bytes_per_vector * 8 / dim
        shown = kv_quant.bits_per_coordinate(dim)[side]
        assert shown == true == documented
        assert f"{side} {shown:g}" in kv_quant.label(dim)
        # with a recent-token window: its bf16 entries spread over a stated context, and named in the label
        windowed = KVQuant.parse(f"{side}={spec},window=4")
        for context in (3, 512):
            bits_at = windowed.bits_per_coordinate(dim, context)
            assert bits_at[side] == true + 16 * min(4, context) / context
            assert windowed.bytes_per_token(dim, 1, 1, context) * 8 / dim == bits_at["k"] + bits_at["v"]
        assert windowed.bits_per_coordinate(dim) == kv_quant.bits_per_coordinate(dim)
        assert f"{side} {shown:g}" in windowed.label(dim)
        assert f"; + a 4-token bf16 window, {4 * 2 * 2 * dim} B per layer, KV head and sequence" in windowed.label(dim)


def test_health_and_info_show_the_true_bits(tmp_path, capsys):
    import recurrent_depth as rd
    from recurrent_depth.cli import main

    model = rd.RecurrentDepthLM(rd.ModelConfig(head_dim=32, hidden_size=64, num_heads=2))
    model.save_pretrained(tmp_path / "m")
    assert main(["info", "--model", str(tmp_path / "m"), "--kv-quant", "k=prod:2.5,v=mse:2.5"]) == 0
    out = capsys.readouterr().out
    bits = KVQuant.parse("k=prod:2.5,v=mse:2.5").bits_per_coordinate(32)
    assert bits["k"] == build_quantizer("prod:2.5", 32).bytes_per_vector * 8 / 32 > 2.5
    assert f"k {bits['k']:g}, v {bits['v']:g}" in out
