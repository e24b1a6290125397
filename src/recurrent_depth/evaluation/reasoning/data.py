"""Turning reasoning problems into token batches (and JSONL corpora for the general trainer).

Problems are encoded byte by byte with a tokenizer that has no merges (vocabulary 288: 256 byte
symbols + the 32 special tokens of `recurrent_depth.data.tokenizer`), so every character is one
token and digits never merge into multi-digit tokens. A training row is

    <|begin_text|> prompt answer <|end_text|>

with labels only on the answer(s) and the end token (the model is not asked to predict the random
variable names or digits of the prompt). A task may put several queries in one training row
(`ReasoningTask.training_segments`); evaluation rows hold one query and score its answer only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.data.tokenizer import (
    MIN_VOCAB_SIZE,
    document_token_ids,
    special_token_layout,
    train_tokenizer,
)
from recurrent_depth.evaluation.reasoning.tasks import Problem, ReasoningTask, make_problems
from recurrent_depth.files import atomic_write_text

BYTE_VOCAB_SIZE = MIN_VOCAB_SIZE  # no merges: one token per byte


def byte_tokenizer():
    """A merge-free byte-level tokenizer with the library's special tokens (a `tokenizers.Tokenizer`)."""
    return train_tokenizer(["0123456789"], vocab_size=BYTE_VOCAB_SIZE)


def special_ids() -> dict[str, int]:
    return special_token_layout(BYTE_VOCAB_SIZE)


class ProblemEncoder:
    """Problems or training segments -> right-padded `input_ids [B, T]` and `labels [B, T]` (-100 = unscored)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
        # by the tokens' texts: a retrofitted model's tokenizer (`rdepth rl` from it) has its own <s> / </s>, and the
        # ids at our layout's positions were ordinary tokens (every prompt began with one, a rollout stopped at one)
        ids = document_token_ids(self.tokenizer)
        self.bos, self.eos, self.pad = ids["begin_text"], ids["end_text"], ids["pad"]

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def row(self, segments: Sequence[tuple[str, bool | str]], end: bool) -> tuple[list[int], list[int]]:
        """bos + segments (+ eos, supervised, when `end`): the tokens and their labels.

        A segment's label is False (unscored), True (its own tokens) or a string whose tokens are
        the labels instead (the position before predicts them; see `training_segments`).
        """
        tokens, labels = [self.bos], [-100]
        for text, label in segments:
            ids = self.encode_text(text)
            tokens += ids
            if isinstance(label, str):
                target = self.encode_text(label)
                if len(target) != len(ids):
                    raise ValueError(f"label {label!r} must have as many tokens as its text {text!r}")
                labels += target
            else:
                labels += ids if label else [-100] * len(ids)
        if end:
            tokens.append(self.eos)
            labels.append(self.eos)
        return tokens, labels

    def pad_rows(self, rows: Sequence[tuple[list[int], list[int]]]) -> dict[str, Tensor]:
        T = max(len(tokens) for tokens, _ in rows)
        input_ids = torch.full((len(rows), T), self.pad, dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        for b, (tokens, row_labels) in enumerate(rows):
            input_ids[b, : len(tokens)] = torch.tensor(tokens)
            labels[b, : len(row_labels)] = torch.tensor(row_labels)
        return {"input_ids": input_ids, "labels": labels}

    def batch(self, problems: Sequence[Problem]) -> dict[str, Tensor]:
        """Evaluation rows: the answer is scored, the end token is not (a row may be followed by more)."""
        return self.pad_rows([self.row([(p.prompt, False), (p.answer, True)], end=False) for p in problems])

    def training_batch(self, rows: Sequence[Sequence[tuple[str, bool | str]]], end: bool = True) -> dict[str, Tensor]:
        return self.pad_rows([self.row(segments, end) for segments in rows])


def write_jsonl(
    path: str | Path, task: ReasoningTask, count: int, difficulties: Sequence[int], seed: int = 0
) -> Path:
    """A JSONL corpus (`text` = prompt + answer, plus the fields) that `rdepth train --data FILE.jsonl` reads."""
    problems = make_problems(task, count, list(difficulties), seed=seed)
    lines = [json.dumps(p.to_dict(), sort_keys=True) for p in problems]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
    return Path(path)
