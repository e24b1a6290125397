"""`rdepth analyze` for the models users have: labels for byte-level tokens and padding ids, and Ouro's exit gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.analysis.plots import drawable
from recurrent_depth.analysis.report import (
    FIGURES,
    AnalysisConfig,
    analyze,
    build_figures,
    bytes_text,
    render_html,
    token_decoder,
)
from recurrent_depth.cli import main
from recurrent_depth.serving.text import TextCodec

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 320  # the model's rows; the tokenizer has fewer, so the rest are padding rows
PROMPT = "héllo 世界 🙂"
FAST = dict(num_steps=8, limit_steps=8, num_starts=2, max_plot_tokens=2)


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory) -> Path:
    """tiny-ouro with a byte-level BPE that has no merges for the prompt's non-ASCII bytes, a gate whose
    lambdas spread over (0, 1) and padding rows the head likes (so they are predicted)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello there, hello world"] * 10, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.get_vocab_size() < VOCAB
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=VOCAB))
    with torch.no_grad():
        model.transformer.exit_gate.weight.mul_(20)
        model.lm_head.weight[tok.get_vocab_size():] += 0.5
    out = tmp_path_factory.mktemp("ouro")
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_labels_tell_bytes_and_padding_ids_apart(ouro_dir):
    codec = TextCodec(ouro_dir, VOCAB)
    text = token_decoder(codec)
    ids = codec.encode(PROMPT)
    labels = [text(i) for i in ids]
    assert "".join(labels) == "h<0xC3><0xA9>llo <0xE4><0xB8><0x96><0xE7><0x95><0x8C> <0xF0><0x9F><0x99><0x82>"
    assert all("\ufffd" not in label for label in labels)
    assert text(codec.tokenizer.token_to_id("hello")) == "hello"  # whole tokens: their decoded text
    assert text(VOCAB - 1) == f"<id {VOCAB - 1}>"  # a padding row, which decodes to ''
    assert bytes_text(b" \xe4\xb8\x96\xe7") == " 世<0xE7>"  # whole characters kept
    assert bytes_text(b"a\xff\xfeb") == "a<0xFF><0xFE>b"
    # a character the plots' font cannot draw is escaped, so that "世" and "界" are not the same empty box
    assert drawable("0: '世界'") == "0: '\\u4e16\\u754c'" and drawable("1: 'é <0xE4>'") == "1: 'é <0xE4>'"


def reference_exit(lambdas: torch.Tensor, q: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ouro's rule in float64 from per-step lambdas [T, S]: cumulative exit distribution (the last step
    takes the mass left), expected exit step and the first step whose cumulative reaches q (1-based)."""
    lam = lambdas.double().numpy()
    survive, pdf = np.ones(lam.shape[0]), []
    for t in range(lam.shape[1]):
        pdf.append(survive if t == lam.shape[1] - 1 else lam[:, t] * survive)
        survive = survive * (1 - lam[:, t])
    pdf = np.stack(pdf, axis=-1)
    cumulative = pdf.cumsum(-1)
    return cumulative, pdf @ np.arange(1, lam.shape[1] + 1), np.argmax(cumulative >= q - 1e-9, axis=-1) + 1


def test_cli_reports_the_exit_gate_with_readable_labels(ouro_dir, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["analyze", "--model", str(ouro_dir), "--prompt", PROMPT, "--out", str(out), "--steps", "8",
                 "--limit-steps", "8", "--max-plot-tokens", "1", "--no-states", "--threads", "1"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "exit gate: expected exit step (of 8): mean " in printed and "exit gate: exit step at q=1: " in printed
    data = json.loads((out / "analysis.json").read_text())
    labels = [t["label"] for t in data["tokens"]]
    assert labels[1] == "1: '<0xC3>'" and len(set(labels)) == len(labels)
    predicted = {v for t in data["tokens"] for v in t["top_prediction_at"].values()}
    assert all("\ufffd" not in v and v != "" for v in predicted)
    assert any(v.startswith("<id ") for v in predicted)  # the padding rows, by id

    # The numbers are the model's own gate on its own forward's states, and Ouro's exit rule on them.
    model = rd.RecurrentDepthLM.from_pretrained(ouro_dir).eval()
    ids = torch.tensor([[t["id"] for t in data["tokens"]]])
    with torch.no_grad():
        states = model(ids, num_steps=8, output_all_states=True).all_states
        lambdas = torch.stack([model.exit_probability(states[i + 1])[0] for i in range(8)], dim=-1)  # [T, 8]
    assert ((lambdas > 0.05) & (lambdas < 0.95)).any()  # the gate is not saturated everywhere
    gate = [t["exit_gate"] for t in data["tokens"]]
    torch.testing.assert_close(torch.tensor([g["probability"] for g in gate]), lambdas, rtol=0, atol=1e-5)
    cumulative, expected, _ = reference_exit(lambdas, 1.0)
    np.testing.assert_allclose([g["cumulative"] for g in gate], cumulative, rtol=0, atol=1e-5)
    np.testing.assert_allclose([g["expected_exit_step"] for g in gate], expected, rtol=0, atol=1e-4)
    exits = [g["exit_step"] for g in gate]
    assert data["exit_gate"]["threshold"] == 1.0 and data["exit_gate"]["steps"] == 8
    assert sum(data["exit_gate"]["exit_step_counts"].values()) == len(exits)
    assert all(e == 8 or c[e - 1] >= 1 - 1e-6 for e, c in zip(exits, cumulative))  # q = 1: when the mass is all out
    assert (out / FIGURES["exit_gate"][0]).read_bytes().startswith(b"\x89PNG")
    page = (out / "report.html").read_text(encoding="utf-8")
    assert 'id="fig-exit_gate"' in page and "expected exit step" in page and "&lt;0xC3&gt;" in page


def test_the_exit_step_at_a_threshold_is_ouros_rule(ouro_dir):
    model = rd.RecurrentDepthLM.from_pretrained(ouro_dir).eval()
    model.config.exit_gate_threshold = 0.6
    ids = [71, 72, 75, 75, 78, 220, 160, 116]
    gate = analyze(model, ids, config=AnalysisConfig(**FAST)).exit_gate
    _, _, exits = reference_exit(torch.from_numpy(gate.probability), 0.6)
    assert gate.threshold == 0.6 and np.array_equal(gate.exit_step, exits)
    assert len(set(exits.tolist())) > 1  # tokens leave at different steps


def test_a_model_without_a_gate_reports_none():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).eval()
    result = analyze(model, [5, 77, 120, 9], config=AnalysisConfig(**FAST))
    data = result.to_json_dict()
    assert result.exit_gate is None and "exit_gate" not in data and "exit_gate" not in data["tokens"][0]
    assert "exit_gate" not in build_figures(result) and "exit gate" not in render_html(result, {})
