"""docs/inference.md's model-card block (Huginn-0125's own calls) runs unchanged through transformers."""

import re
from pathlib import Path

import torch

from tests.test_hf import make_model_dir

DOC = Path(__file__).resolve().parents[1] / "docs" / "inference.md"


def model_card_block() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- model-card-snippet -->\n```python\n(.*?)```\n<!-- /model-card-snippet -->", text, re.S)
    assert match, "docs/inference.md lost its model-card block"
    return match.group(1)


def test_the_docs_model_card_code_runs(tmp_path, capsys, one_thread):
    make_model_dir(tmp_path, mean_recurrence=4)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = {name: tok.convert_tokens_to_ids(name) for name in ("<|begin_text|>", "<|end_text|>", "<|pad|>")}
    # Only what ties the block to the 3.5 B checkpoint changes: its name, its special-token ids, and
    # a shorter generation for a test.
    mapping = {
        '"tomg-group-umd/huginn-0125"': repr(str(tmp_path)),
        "max_length=256": "max_length=40",
        "65505": str(ids["<|end_text|>"]), "65504": str(ids["<|begin_text|>"]), "65509": str(ids["<|pad|>"]),
    }
    code = model_card_block()
    for old, new in mapping.items():
        assert old in code, old
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102  (our own documentation)
    outputs = scope["outputs"]
    assert outputs.sequences.shape[1] > scope["input_ids"].shape[1]
    assert outputs.steps.dtype == torch.long  # the last call ran in recurrent_depth.generate
    assert capsys.readouterr().out.strip()
