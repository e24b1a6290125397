"""Mutation hunt, round 6: tests that kill surviving mutants of generation_config.py, quant/spec.py, quant/split.py,
weight_quant.py, train/run_record.py and inference/speculative.py, each against the documented rule or a plain
reference computation (not the current output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recurrent_depth.generation_config import generation_defaults, with_generation_defaults, with_turn_end

pytestmark = pytest.mark.usefixtures("one_thread")  # (tiny matmuls: one torch thread, tests/conftest.py)


# ---------------------------------------------------------------------------------------- generation_config.json
def _defaults(tmp_path: Path, values: dict, max_depth: int | None = None) -> dict:
    (tmp_path / "generation_config.json").write_text(json.dumps(values))
    return generation_defaults(str(tmp_path), "auto", "generate", max_depth)


def test_an_eos_of_null_or_left_out_is_no_eos_and_stop_strings_join_the_files_stop(tmp_path):
    """docs/inference.md: eos_token_id is `[]` (no eos) where the file has none, absent or null, as in transformers;
    every one of the file's stop_strings is the default of --stop beside the file's own `stop`; id 0 is an id."""
    assert _defaults(tmp_path, {"eos_token_id": None})["eos_token_id"] == []
    assert _defaults(tmp_path, {"num_steps": 4}) == {"num_steps": 4, "eos_token_id": []}
    assert _defaults(tmp_path, {"eos_token_id": [0, 3]})["eos_token_id"] == [0, 3]
    assert _defaults(tmp_path, {"stop_strings": ["A", "B"]})["stop"] == ["A", "B"]
    assert _defaults(tmp_path, {"stop": "C", "stop_strings": ["A", "B"]})["stop"] == ["C", "A", "B"]
    with pytest.raises(ValueError, match="eos_token_id=True is invalid"):
        _defaults(tmp_path, {"eos_token_id": True})  # a JSON true is no token id


def test_every_depth_option_of_the_file_is_held_to_the_ceiling(tmp_path):
    """Options that run core steps (the draft depth too, not only num_steps) are held to --max-depth."""
    assert _defaults(tmp_path, {"draft_steps": 3}, max_depth=8)["draft_steps"] == 3
    with pytest.raises(ValueError, match="draft_steps=9 is invalid"):
        _defaults(tmp_path, {"draft_steps": 9}, max_depth=8)


def test_the_files_sampling_settings_apply_only_where_the_call_samples():
    """transformers' rule (`with_generation_defaults`): without do_sample the file's temperature, top_k, top_p and
    min_p are dropped, but a setting the call gives itself is kept; with do_sample all four stay."""
    file = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "num_steps": 4}
    assert with_generation_defaults({}, file) == {"num_steps": 4}
    assert with_generation_defaults({"min_p": 0.2}, file) == {"num_steps": 4, "min_p": 0.2}
    assert with_generation_defaults({"do_sample": True}, file) == {**file, "do_sample": True}


def test_turn_end_ids_join_after_the_eos_ones_once():
    """`with_turn_end`: the chat template's end-of-turn ids after the eos ids, none twice; `eos` itself (an id,
    not a list) where it holds them all."""
    assert with_turn_end([1, 2], [2, 3]) == [1, 2, 3]
    assert with_turn_end(None, [4]) == [4]
    assert with_turn_end(5, [5]) == 5


def test_a_dangling_generation_config_link_is_refused_before_exporting(tmp_path):
    """`check_generation_defaults`: a generation_config.json that is no regular file is refused in one line, a
    dangling link too (the copy left it out without a word); no file at all is fine."""
    import os

    from recurrent_depth.generation_config import check_generation_defaults

    check_generation_defaults(tmp_path)
    os.symlink(tmp_path / "nowhere.json", tmp_path / "generation_config.json")
    with pytest.raises(ValueError, match="is not a regular file"):
        check_generation_defaults(tmp_path, remote_code=False)


def test_a_library_only_option_set_to_a_false_value_is_still_refused_for_remote_code(tmp_path):
    """The remote-code model refuses every library-only option that is not None (`seed: 0`, `fast: false` too), so
    `check_generation_defaults` must refuse those before exporting, not only truthy ones."""
    from recurrent_depth.generation_config import check_generation_defaults

    for values in ({"seed": 0}, {"fast": False}):
        (tmp_path / "generation_config.json").write_text(json.dumps(values))
        check_generation_defaults(tmp_path, remote_code=False)
        with pytest.raises(ValueError, match=f"sets \\['{next(iter(values))}'\\]"):
            check_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"seed": None, "num_steps": 4}))
    check_generation_defaults(tmp_path)


# ---------------------------------------------------------------------------------------- quantizer specs
def test_spec_bit_ranges_include_both_ends():
    """quant/spec.py: mse bits are 1..8, prod 1..9 (b - 1 bits mse + 1 QJL), qjl at most MAX_QJL_BITS (16), both
    ends allowed; a hair past each end is refused in one line."""
    from recurrent_depth.quant.spec import QuantSpec

    for text in ("mse:1", "mse:8", "prod:1", "prod:9", "qjl:16"):
        assert str(QuantSpec.parse(text)) == text
    for text, match in (("mse:8.5", r"\[1, 8\]"), ("prod:9.5", r"\[1, 9\]"), ("prod:0.5", r"\[1, 9\]"),
                        ("qjl:16.5", r"\(0, 16\]")):
        with pytest.raises(ValueError, match=match):
            QuantSpec.parse(text)


def test_qjl_outlier_option_takes_1_to_max_and_a_spec_has_at_most_three_parts():
    """`outN` takes N in 1..MAX_QJL_OUTLIERS (both ends); "mse:3.0" is the spec mse:3; a spec is method:bits[:option]
    (a fourth part is an error); a spec of MAX_SPEC_CHARS characters is not refused for its length, one more is."""
    from recurrent_depth.quant.spec import MAX_QJL_OUTLIERS, MAX_SPEC_CHARS, QuantSpec, qjl_outlier_count

    assert qjl_outlier_count("out1") == 1 and qjl_outlier_count(f"out{MAX_QJL_OUTLIERS}") == MAX_QJL_OUTLIERS
    for bad in ("out0", f"out{MAX_QJL_OUTLIERS + 1}"):
        with pytest.raises(ValueError, match="outN"):
            qjl_outlier_count(bad)
    spec = QuantSpec.parse("mse:3.0")
    assert spec == QuantSpec("mse", 3) and str(spec) == "mse:3"
    with pytest.raises(ValueError, match="method:bits\\[:option\\]"):
        QuantSpec.parse("mse:3:qr:x")  # a fourth part is refused, not dropped
    padded = "mse:3".rjust(MAX_SPEC_CHARS)
    assert QuantSpec.parse(padded) == QuantSpec("mse", 3)
    with pytest.raises(ValueError, match=f"at most {MAX_SPEC_CHARS} characters"):
        QuantSpec.parse(" " + padded)


def test_a_split_spells_its_rotation_only_when_it_is_not_the_default():
    """A channel split's spec is the spec it was built from, with the default rotation qr left out (as `str` of the
    QuantSpec writes "mse:2.5", not "mse:2.5:qr"); hadamard is spelt."""
    from recurrent_depth.quant.spec import build_quantizer

    assert build_quantizer("mse:2.5:qr", 64).spec == "mse:2.5"
    assert build_quantizer("prod:3.5:hadamard", 64).spec == "prod:3.5:hadamard"


def test_qjl_takes_calibrated_outlier_channels_only_with_an_outn_option():
    """`QuantSpec.build(..., outlier_channels)`: qjl:b:outN keeps the N given channels in bf16; qjl:b (no outliers)
    given channels is a one-line error saying to name outN."""
    from recurrent_depth.quant.spec import build_quantizer

    assert build_quantizer("qjl:2:out2", 64, outlier_channels=[9, 5]).outlier_channels == [5, 9]
    with pytest.raises(ValueError, match="keeps no outlier channels: give qjl:2:outN"):
        build_quantizer("qjl:2", 64, outlier_channels=[5, 9])


# ---------------------------------------------------------------------------------------- channel splits
def test_split_sizes_floor_the_bits_and_need_two_channels_a_group():
    """quant/split.py: lo = floor(b), (b - lo)·D outlier channels at lo + 1 bits, the rest at lo; each group needs at
    least 2 channels."""
    from recurrent_depth.quant.split import split_sizes

    assert split_sizes(16, 2.75) == (12, 3, 2)  # floor, not round (which gives lo = 3)
    assert split_sizes(16, 1.125) == (2, 2, 1)
    with pytest.raises(ValueError, match="group of 1"):
        split_sizes(8, 1.125)


def test_outlier_channels_are_the_loudest_by_mean_square_ties_to_the_lower():
    """`select_outlier_channels`: the largest mean *square* (a channel of large negative values is loud), in
    increasing order, ties broken towards the lower channel; a chosen set must be `count` distinct channels < D."""
    import torch

    from recurrent_depth.quant.split import checked_outlier_channels, select_outlier_channels

    x = torch.full((10, 6), 0.1)
    x[:, 4] = -5.0  # loud, with the lowest mean
    x[:, 1] = x[:, 2] = 2.0  # a tie: channel 1 goes first
    assert select_outlier_channels(x, 2) == [1, 4]
    assert select_outlier_channels(x, 1) == [4]
    assert select_outlier_channels(torch.ones(2, 4096), 4) == [0, 1, 2, 3]  # all tied: the lowest (a stable order)
    with pytest.raises(ValueError, match=r"outlier count must be in \[1, 5\]"):
        select_outlier_channels(x, 6)  # every channel an outlier leaves no regular group
    assert checked_outlier_channels([3, 0], 2, 4, "t") == [0, 3]
    for channels in ([1, 1], [0, 4]):
        with pytest.raises(ValueError, match="2 distinct outlier channels in \\[0, 4\\)"):
            checked_outlier_channels(channels, 2, 4, "t")


def test_a_splits_state_is_a_seed_and_a_d_bit_mask_and_each_group_has_its_own_rotation():
    """State: 8 bytes of seed + ceil(D / 8) bytes of channel mask (D = 12: 10 bytes). Each group is its own quantizer
    with its own rotation: two groups of equal size must not share one."""
    import torch

    from recurrent_depth.quant.spec import build_quantizer

    assert build_quantizer("mse:2.5", 12).state_nbytes == 8 + 2
    split = build_quantizer("mse:2.5", 64)
    assert split.outlier.dim == split.regular.dim == 32
    assert not torch.allclose(split.outlier.rotation.matrix(), split.regular.rotation.matrix())


# ---------------------------------------------------------------------------------------- the run record
def test_a_resumed_log_keeps_the_lines_through_its_step_and_nothing_after_a_torn_line(tmp_path):
    """`JsonlLog(path, keep_through=k)`: lines of steps <= k stay (k itself too), later ones go; a torn line ends
    the reading (what follows it is newer, even with a small step); a line that is no JSON object is refused."""
    from recurrent_depth.train.run_record import JsonlLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo\n{"step": 1}\n')
    log = JsonlLog(path, keep_through=2)
    log.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert log.kept == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is not a record of this run"):
        JsonlLog(path, keep_through=5)


def test_set_aside_takes_previous_1_first_and_skips_what_records_nothing(tmp_path):
    """`set_aside_run_record`: the first free `previous-<k>` from k = 1; an empty file or directory records nothing
    (it stays); None when nothing records anything."""
    from recurrent_depth.train.run_record import set_aside_run_record

    names = ("run.json", "metrics.jsonl", "tensorboard")
    (tmp_path / "run.json").write_text("")
    (tmp_path / "tensorboard").mkdir()
    assert set_aside_run_record(tmp_path, names) is None
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert set_aside_run_record(tmp_path, names) == (tmp_path / "previous-1", ["metrics.jsonl"])
    assert (tmp_path / "run.json").exists() and (tmp_path / "tensorboard").is_dir()
    (tmp_path / "run.json").write_text("{}\n")
    assert set_aside_run_record(tmp_path, names) == (tmp_path / "previous-2", ["run.json"])


# ---------------------------------------------------------------------------------------- weight quantization
def test_spread_samples_take_the_nearest_evenly_spaced_positions():
    """`spread_samples`: `count` values spread evenly, first and last included: the nearest whole positions to
    i·(n - 1)/(count - 1) (11 values, 4 samples: 0, 3.33, 6.67, 10 -> 0, 3, 7, 10). Saved adapters carry the base
    fingerprint these samples make, so a shifted pick would refuse every adapter saved before."""
    import torch

    from recurrent_depth.weight_quant import spread_samples

    assert spread_samples(torch.arange(11.0), 4).tolist() == [0, 3, 7, 10]
    assert spread_samples(torch.arange(3.0), 64).tolist() == [0, 1, 2]  # a smaller tensor: all of it


def test_int8_takes_no_group_size():
    """WEIGHT_FORMATS: every format but int8 takes a group (block) size; "int8:g32" (or any other text after
    int8) is a one-line error, not int8."""
    from recurrent_depth.weight_quant import parse_weights

    assert parse_weights("int8") == ("int8", None)
    for text in ("int8:g32", "int8x"):
        with pytest.raises(ValueError, match=f"weights='{text}' is invalid"):
            parse_weights(text)


# ---------------------------------------------------------------------------------------- speculative decoding
def test_the_acceptance_rate_counts_the_drafts_of_every_row():
    """`out.stats` (docs/inference.md): `acceptance_rate` is the accepted drafts over the drafted ones, every row's
    drafts counted: a threshold that accepts every draft gives drafted = accepted = rounds x lookahead x rows and a
    rate of 1 on a batch of 2 (counting one row's drafts a round gave 2)."""
    import torch

    import recurrent_depth as rd
    from recurrent_depth.inference import generate

    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    rows, lookahead = 2, 4
    ids = torch.randint(0, 256, (rows, 8), generator=torch.Generator().manual_seed(1))
    stats = generate(model, ids, max_new_tokens=9, num_steps=6, init_scale=0.0, draft_steps=2, lookahead=lookahead,
                     verification_threshold=1e-6).stats
    assert stats["drafted_tokens"] == stats["rounds"] * lookahead * rows == stats["accepted_drafts"] > 0
    assert stats["acceptance_rate"] == 1.0
