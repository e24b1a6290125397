"""The analysis report (HTML + PNGs + JSON) and `rdepth analyze` on a tiny saved model."""

from __future__ import annotations

import base64
import html
import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.analysis.classify import TrajectoryShape
from recurrent_depth.analysis.report import (
    FIGURES,
    AnalysisConfig,
    analyze,
    analyze_to_dir,
    choose_tokens,
    token_label,
)
from recurrent_depth.analysis.trajectory import Trajectory
from recurrent_depth.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = dict(num_steps=8, limit_steps=12, num_starts=2, max_plot_tokens=2)


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model saved with a byte-level BPE tokenizer.json trained on a few lines."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def add(a, b):\n    return a + b\n", "The cat sat on the mat. Three dots...\n"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=tok.get_vocab_size()))
    out = tmp_path_factory.mktemp("model")
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def report(model_dir, tmp_path_factory):
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    ids = [5, 77, 120, 77, 31, 250, 9, 14, 200, 3]
    texts = [f"t{i}" for i in ids]
    out = tmp_path_factory.mktemp("report")
    result, files = analyze_to_dir(
        model, ids, out, token_texts=texts, decode=lambda i: f"<{i}>", config=AnalysisConfig(**FAST),
        prompt="a <b> & c",
    )
    return result, files, out


class _ImgCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def test_html_report_is_self_contained_and_holds_every_figure(report):
    result, files, out = report
    page = files["html"].read_text(encoding="utf-8")
    parser = _ImgCollector()
    parser.feed(page)
    drawn = {key: figure for key, figure in FIGURES.items() if key != "exit_gate"}  # this model has no exit gate
    assert len(parser.srcs) == len(drawn)
    for src in parser.srcs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    for key, (name, caption) in drawn.items():
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
        assert f'id="fig-{key}"' in page and html.escape(caption) in page
    assert "a &lt;b&gt; &amp; c" in page  # the prompt, escaped
    assert not re.search(r'(src|href)="(https?:|/)', page)  # nothing external
    for label in result.labels:
        assert label.replace("'", "&#x27;") in page


def test_json_holds_the_numbers(report):
    result, files, _ = report
    data = json.loads(files["json"].read_text())
    T, S = len(result.labels), FAST["num_steps"]
    assert data["num_tokens"] == T == 10
    assert data["config"]["num_steps"] == S and data["config"]["limit_steps"] == FAST["limit_steps"]
    assert sum(data["trajectory_counts"].values()) == T
    assert len(data["token_correlation"]["ln_f states"]) == S + 1
    token = data["tokens"][3]
    assert token["id"] == 77 and len(token["distance_to_limit"]) == S + 1
    assert token["shape"]["kind"] in ("fixed point", "orbit", "slider")
    assert token["top_prediction_at"]["8"] == f"<{result.top_ids[3, S]}>"
    np.testing.assert_allclose(token["distance_to_limit"], result.distance[3])
    assert data["path_independence"]["num_starts"] == 2


def test_states_are_kept_and_reload(report):
    result, _, out = report
    traj = Trajectory.load(out / "states")
    assert traj.raw.shape == (FAST["num_steps"] + 1, 1, 10, 64)
    np.testing.assert_array_equal(traj.normed, result.trajectory.normed)


def test_analysis_is_deterministic_with_a_seed(model_dir):
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    ids = [4, 8, 15, 16, 23, 42]
    a = analyze(model, ids, config=AnalysisConfig(**FAST, seed=3))
    b = analyze(model, ids, config=AnalysisConfig(**FAST, seed=3))
    np.testing.assert_array_equal(a.distance, b.distance)
    np.testing.assert_array_equal(a.pca.components, b.pca.components)
    np.testing.assert_array_equal(a.path.spread, b.path.spread)
    assert [s.kind for s in a.shapes] == [s.kind for s in b.shapes]
    c = analyze(model, ids, config=AnalysisConfig(**FAST, seed=4))
    assert not np.array_equal(a.distance, c.distance)


def test_a_model_that_starts_from_its_embedding_has_no_path_independence(tmp_path, capsys):
    """Ouro's s_0 is the embedding: every "random start" is the same run, so the measure would be 0 by
    construction and read as perfect path independence. The report says it was skipped instead."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig(
        vocab_size=300, hidden_size=32, num_heads=4, intermediate_size=48, prelude_layers=0, core_layers=1,
        coda_layers=0, block_layout="peri-norm", norm_before_coda=False, step_norm=True, final_norm=False,
        injection="none", state_init="embedding"))
    model.save_pretrained(tmp_path / "ouro")
    out = tmp_path / "report"
    out.mkdir()
    (out / FIGURES["path_independence"][0]).write_bytes(PNG_MAGIC)  # an earlier run's figure
    code = main(["analyze", "--model", str(tmp_path / "ouro"), "--ids", "5,77,120,77,31", "--steps", "8",
                 "--limit-steps", "8", "--out", str(out), "--no-states", "--threads", "1"])
    stdout = capsys.readouterr().out
    assert code == 0 and "path independence: skipped: this model starts every run from its embedding" in stdout
    data = json.loads((out / "analysis.json").read_text())
    assert data["path_independence"]["skipped"].startswith("this model starts every run from its embedding")
    assert all(token["path_ratio"] is None for token in data["tokens"])
    assert not (out / FIGURES["path_independence"][0]).exists()
    assert "skipped: this model starts every run" in (out / "report.html").read_text()


def test_long_and_short_prompts_are_refused_with_a_clear_message(model_dir):
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"the prompt has 40 tokens, more than max_tokens=32 \(--max-tokens\)"):
        analyze(model, list(range(40)), config=AnalysisConfig(**FAST, max_tokens=32))
    with pytest.raises(ValueError, match="needs at least 2"):
        analyze(model, [5], config=AnalysisConfig(**FAST))
    with pytest.raises(ValueError, match="num_steps=4 is invalid"):
        analyze(model, [5, 6], config=AnalysisConfig(num_steps=4, limit_steps=8))
    with pytest.raises(ValueError, match=r"positions \[7\] outside the prompt's 0..2"):
        analyze(model, [5, 6, 7], config=AnalysisConfig(**FAST, tokens=[7]))
    with pytest.raises(ValueError, match="integer token ids, got dtype torch.float32"):
        analyze(model, [5.5, 6.0], config=AnalysisConfig(**FAST))  # was cast to [5, 6]


def test_a_diverging_model_is_reported_with_the_step_not_classify_internals(model_dir):
    # It failed with classify's "x contains NaN or inf", which names no step, token or dtype.
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.transformer.core_block[0].mlp.proj.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"the model's state is NaN or inf at step 1 \(token 0, 3 of 3 tokens\) "
                                         r"in torch.float32"):
        analyze(model, [5, 6, 7], config=AnalysisConfig(**FAST))


def test_token_labels_and_choice():
    assert token_label(3, " dots") == "3: ' dots'"
    assert token_label(0, "\n") == "0: '\\n'"
    assert len(token_label(12, "a very long token text")) <= len("12: ") + 14
    shapes = [TrajectoryShape(kind, 1.0, extent, 1.0, 0.5) for kind, extent in [
        ("fixed point", 0.01), ("orbit", 0.3), ("orbit", 0.5), ("slider", 0.2), ("fixed point", 0.02)]]
    assert choose_tokens(shapes, 3) == [2, 3, 4]  # best orbit, the slider, the most-moving fixed point
    assert choose_tokens(shapes, 10) == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------- CLI
def test_cli_analyze_writes_the_report(model_dir, tmp_path, capsys):
    out = tmp_path / "analysis"
    rc = main(["analyze", "--model", str(model_dir), "--prompt", "def add(a, b): return a + b",
               "--out", str(out), "--steps", "8", "--limit-steps", "16", "--starts", "2", "--seed", "1",
               "--max-plot-tokens", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "report:" in printed and "trajectory shapes:" in printed
    data = json.loads((out / "analysis.json").read_text())
    assert data["prompt"] == "def add(a, b): return a + b"
    assert data["model"]["name"] == str(model_dir)
    assert data["tokens"][0]["label"].startswith("0: 'def")
    assert (out / "report.html").is_file() and (out / "states" / "normed_states.npy").is_file()


def test_cli_analyze_with_ids_and_without_states(model_dir, tmp_path):
    out = tmp_path / "ids"
    rc = main(["analyze", "--model", str(model_dir), "--ids", "3,9,27,81", "--out", str(out), "--steps", "8",
               "--limit-steps", "8", "--starts", "2", "--tokens", "1,2", "--no-states"])
    assert rc == 0
    data = json.loads((out / "analysis.json").read_text())
    assert data["chosen_tokens"] == [1, 2]
    assert all(t["distance_to_limit"][-1] == 0.0 for t in data["tokens"])  # s* is this very run
    assert not (out / "states").exists()


def test_cli_analyze_errors(model_dir, tmp_path, capsys):
    long_prompt = "word " * 300
    rc = main(["analyze", "--model", str(model_dir), "--prompt", long_prompt, "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "more than max_tokens=256 (--max-tokens)" in capsys.readouterr().err
    rc = main(["analyze", "--model", str(model_dir), "--ids", "1,2,9999", "--out", str(tmp_path / "y")])
    assert rc == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err
    rc = main(["analyze", "--model", str(model_dir), "--ids", "1,2", "--steps", "3", "--out", str(tmp_path / "z")])
    assert rc == 2
    assert "--steps=3 is invalid" in capsys.readouterr().err  # issue 19: errors name the flag
    bare = tmp_path / "bare"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).save_pretrained(bare)
    rc = main(["analyze", "--model", str(bare), "--prompt", "hi there", "--out", str(tmp_path / "w")])
    assert rc == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_cli_analyze_refuses_unclear_inputs_with_a_reason(model_dir, tmp_path, capsys):
    base = ["analyze", "--model", str(model_dir), "--steps", "8", "--limit-steps", "8", "--starts", "2"]
    # "1 2,3" used to become the ids [12, 3]
    assert main([*base, "--ids", "1 2,3", "--out", str(tmp_path / "a")]) == 2
    assert "--ids must be comma-separated integers, got '1 2,3'" in capsys.readouterr().err
    assert main([*base, "--prompt-file", str(tmp_path), "--out", str(tmp_path / "b")]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main([*base, "--ids", "1,2", "--out", str(tmp_path / "file")]) == 2
    assert "is an existing file, not a directory" in capsys.readouterr().err
    assert main([*base, "--ids", "1,2", "--init-scale", "inf", "--out", str(tmp_path / "c")]) == 2
    assert "--init-scale=inf is invalid" in capsys.readouterr().err  # issue 19: errors name the flag
    assert main([*base, "--ids", " 1, 2 ,3 ", "--out", str(tmp_path / "d"), "--no-states"]) == 0
    assert [t["id"] for t in json.loads((tmp_path / "d" / "analysis.json").read_text())["tokens"]] == [1, 2, 3]


def test_cli_analyze_prompt_file_is_read_bounded(model_dir, tmp_path, capsys, monkeypatch):
    # It was read whole with read_text: /dev/zero ran until memory ran out, a FIFO waited for a writer.
    import recurrent_depth.cli.generate as generate_cli

    monkeypatch.setattr(generate_cli, "PROMPT_MAX_BYTES", 16)
    base = ["analyze", "--model", str(model_dir), "--steps", "8", "--limit-steps", "8", "--starts", "2"]
    big = tmp_path / "big.txt"
    big.write_text("x" * 17)
    assert main([*base, "--prompt-file", str(big), "--out", str(tmp_path / "a")]) == 2
    assert "has 17 bytes, more than the 16 allowed" in capsys.readouterr().err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert main([*base, "--prompt-file", str(fifo), "--out", str(tmp_path / "b")]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in ("(default: 64)", "(default: 128)", "(default: 4)", "(default: runs/analysis)"):
        assert default in text


def test_a_failed_run_leaves_no_states_and_no_states_leaves_no_older_ones(model_dir, tmp_path):
    """A diverging run left its half-written memory maps in OUT/states; with save_states off a rerun
    wrote its report beside an older run's states/, which `Trajectory.load` read as this run's."""
    out = tmp_path / "out"
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST))
    assert Trajectory.load(out / "states").num_steps == FAST["num_steps"]
    (out / "states" / "notes.txt").write_text("the user's own file")
    analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST, save_states=False))
    assert sorted(p.name for p in (out / "states").iterdir()) == ["notes.txt"]  # ours gone, theirs kept
    (out / "states" / "notes.txt").unlink()
    with torch.no_grad():
        model.transformer.core_block[0].mlp.proj.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN or inf"):
        analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST))
    assert not (out / "states").exists()
