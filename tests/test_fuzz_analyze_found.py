"""Bugs a seeded fuzzer of `rdepth analyze`, `info`, `average` and `scaling fit` found (odd flags, files and model
directories): each is now one `rdepth CMD: error:` line or a usage error, with nothing left in --out, or a result
that is no longer silently wrong (strict JSON, no path independence claimed for a collapsed model)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import recurrent_depth as rd
from recurrent_depth.cli import main
from tests.test_fuzz_cli_found import error_line

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--steps", "8", "--limit-steps", "8", "--starts", "2", "--no-states"]


def _save(path: Path, seed: int = 0, zero: str | None = None) -> Path:
    """A tiny model saved in `path`; parameters whose name holds `zero` are zeroed."""
    torch.manual_seed(seed)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    if zero is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if zero in name:
                    param.zero_()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("tiny"))


def strict_json(path: Path) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which strict JSON parsers refuse")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_info_empty_preset_is_an_unknown_preset(capsys):
    # `if args.preset:` took '' for "no preset" and read --model, None: TypeError from Path(None)
    assert main(["info", "--preset", ""]) == 2
    assert "unknown preset ''" in error_line(capsys)


def test_average_empty_run_is_one_line(tmp_path, capsys):
    # `--run ''` (an unset variable) fell through to --checkpoints, None: "'NoneType' object is not iterable"
    out = tmp_path / "out"
    assert main(["average", "--run", "", "--out", str(out)]) == 2
    assert "--run '' is empty" in error_line(capsys) and not out.exists()


def test_average_of_same_config_other_shapes_is_one_line(model_dir, tmp_path, capsys):
    # one config.json, a weights file of other shapes: lerp_'s RuntimeError "The size of tensor a (64) must match ..."
    other = _save(tmp_path / "other", seed=1)
    state = load_file(other / "model.safetensors")
    name = next(k for k, v in state.items() if v.dim() == 2)
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert main(["average", "--checkpoints", str(model_dir), str(other), "--out", str(out)]) == 2
    line = error_line(capsys)
    assert name in line and "shape" in line and not out.exists()


def test_average_refuses_a_checkpoint_holding_nan(model_dir, tmp_path, capsys):
    # a diverged checkpoint made the averaged weights NaN: exit 0, a model that generates nothing
    diverged = _save(tmp_path / "diverged", seed=1)
    state = load_file(diverged / "model.safetensors")
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, diverged / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    assert main(["average", "--checkpoints", str(model_dir), str(diverged), "--out", str(out)]) == 2
    line = error_line(capsys)
    assert "NaN or inf" in line and name in line and str(diverged) in line and not out.exists()


def test_analyze_on_the_meta_device_is_a_usage_error(model_dir, tmp_path, capsys):
    # the model loaded on meta and the first .item() raised torch's RuntimeError, a traceback
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--model", str(model_dir), "--ids", "5,77", *FAST, "--device", "meta", "--out", str(out)])
    assert exc.value.code == 2
    assert "argument --device: 'meta' holds no data" in error_line(capsys) and not out.exists()


def test_analyze_seed_beyond_64_bits_names_the_flag(model_dir, tmp_path, capsys):
    # torch's "Overflow when unpacking long long", naming no flag
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(model_dir), "--ids", "5,77", *FAST, "--seed", str(2**70),
                 "--out", str(out)]) == 2
    assert "--seed=1180591620717411303424 is invalid" in error_line(capsys) and not out.exists()


def test_analyze_of_a_diverging_model_leaves_no_empty_out(model_dir, tmp_path, capsys):
    # the NaN refusal came after OUT/states was made for the streamed states: OUT/states went, an empty OUT
    # stayed and passed for a result
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(model_dir), "--ids", "5,77", *FAST[:-1], "--init-scale", "1e308",
                 "--out", str(out)]) == 2
    assert "NaN or inf" in error_line(capsys) and not out.exists()


def test_collapsed_model_is_not_called_path_independent(tmp_path, capsys):
    # zero adapter weights: every token and start ends in one state (spread 0, separation 0); the ratio was
    # 0 / tiny = 0, and the report said every token's final state was identifiable (fraction below 1: 100%)
    collapsed = _save(tmp_path / "collapsed", zero="adapter")
    out = tmp_path / "out"
    assert main(["analyze", "--model", str(collapsed), "--ids", "5,77,9", *FAST, "--out", str(out)]) == 0
    assert "nearest-token distance = inf" in capsys.readouterr().out
    data = strict_json(out / "analysis.json")  # inf written as null, not the `Infinity` of json.dumps
    summary = data["path_independence"]
    assert summary["median_separation"] == 0.0 and summary["fraction_ratio_below_1"] == 0.0
    assert summary["median_ratio"] is None and all(token["path_ratio"] is None for token in data["tokens"])


def _table(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_scaling_fits_json_is_strict_when_the_optimum_overflows(tmp_path):
    # losses of 1e300: the compute-optimal N and loss overflowed to inf, written as `Infinity` in fits.json
    pytest.importorskip("scipy")
    from recurrent_depth.scaling import synthetic_rows

    table = _table(tmp_path / "results.csv", [{**r, "loss": r["loss"] * 1e300} for r in synthetic_rows()])
    out = tmp_path / "fits"
    assert main(["scaling", "fit", str(table), "--form", "joint", "--bootstrap", "0", "--holdout", "none",
                 "--budget", "1e20", "--out", str(out)]) == 0
    optimum = strict_json(out / "fits.json")["fits"]["joint"]["compute_optimal"]
    assert optimum["N"] is None and optimum["loss"] is None


def test_scaling_negative_seed_names_the_flag_and_leaves_no_out(tmp_path, capsys):
    # numpy's "expected non-negative integer", after the first fit and an empty --out made
    from recurrent_depth.scaling import synthetic_rows

    table = _table(tmp_path / "results.csv", synthetic_rows())
    out = tmp_path / "fits"
    assert main(["scaling", "fit", str(table), "--seed", "-1", "--out", str(out)]) == 2
    assert "--seed=-1 is invalid" in error_line(capsys) and not out.exists()


def test_scaling_json_table_true_is_not_a_loss(tmp_path, capsys):
    # float(True): a JSON `true` was fitted as a loss of 1.0
    from recurrent_depth.scaling import synthetic_rows

    table = tmp_path / "results.json"
    table.write_text(json.dumps([{**r, "loss": True} for r in synthetic_rows()]))
    assert main(["scaling", "fit", str(table), "--out", str(tmp_path / "fits")]) == 2
    assert "column 'loss' is True, not a number" in error_line(capsys)
