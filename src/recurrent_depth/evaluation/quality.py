"""Quality against test-time depth: loss, perplexity and bits per byte on held-out text.

Each document is tokenized with a leading ``<|begin_text|>`` (so its first token is predicted
too) and cut into windows of `seq_len` tokens that overlap by one token, so every text token is
predicted exactly once. Bits per byte = total negative log-likelihood / ln 2 / UTF-8 bytes of
the text, which compares models with different tokenizers. All depths come from one pass per
batch (`readout.logits_at_depths`), sharing the initial state; each window draws its own s_0 (from
`seed` and its index), so the scores do not depend on `batch_size`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from recurrent_depth.data.tokenizer import windowed_encoding
from recurrent_depth.evaluation.readout import check_depths, logits_at_depths
from recurrent_depth.inference.sampling import stream_generator
from recurrent_depth.model.recurrent import RecurrentDepthLM


class PlainTokenizer:
    """Text <-> token ids without special tokens, over a `tokenizers.Tokenizer` or a transformers tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        with windowed_encoding():  # a whole document: `windows` cuts it to the model's length
            out = self.tokenizer.encode(text, add_special_tokens=False)
        return list(out.ids) if hasattr(out, "ids") else list(out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclass
class TextQuality:
    """Per depth: mean loss (nats/token), perplexity and bits per byte over `tokens` tokens, `bytes` bytes."""

    depths: list[int]
    tokens: int
    bytes: int
    documents: int
    nll: dict[int, float] = field(default_factory=dict)  # summed nats

    def loss(self, depth: int) -> float:
        return self.nll[depth] / self.tokens

    def perplexity(self, depth: int) -> float:
        return math.exp(min(self.loss(depth), 700.0))

    def bits_per_byte(self, depth: int) -> float:
        return self.nll[depth] / math.log(2) / self.bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "bytes": self.bytes, "documents": self.documents,
            "by_depth": {
                str(d): {"loss": round(self.loss(d), 6), "perplexity": round(self.perplexity(d), 4),
                         "bits_per_byte": round(self.bits_per_byte(d), 6)}
                for d in self.depths
            },
        }


def check_scoring_window(seq_len: int | None) -> None:
    """A scoring window of at least two tokens (one context, one target); None: the model's max_seq_len."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2):
        raise ValueError(f"seq_len={seq_len!r} is invalid: expected an integer >= 2 (or none: the model's max_seq_len)")


def windows(token_ids: Sequence[int], seq_len: int) -> list[list[int]]:
    """Windows of at most `seq_len` tokens overlapping by one: each token after the first is a target once."""
    check_scoring_window(seq_len)
    out, start = [], 0
    while start < len(token_ids) - 1:
        out.append(list(token_ids[start : start + seq_len]))
        start += seq_len - 1
    return out


def _scored_prefix(codec: PlainTokenizer, ids: list[int], text: str) -> str:
    """The text of the kept tokens ``ids[1:]`` (after the bos), cut back to a whole character.

    A token cap can end inside a multibyte character, whose decoded form is a U+FFFD (3 bytes) rather
    than the 1-3 bytes scored: drop the (at most 3) tokens that hold part of it, in place, so the bytes
    counted are the UTF-8 bytes of exactly the scored tokens. A tokenizer whose decode does not give
    back a prefix of the text keeps its decode, as before."""
    for drop in range(4):
        kept = ids[: len(ids) - drop]
        decoded = codec.decode(kept[1:])
        if text.startswith(decoded):
            del ids[len(kept):]
            return decoded
    return codec.decode(ids[1:])


@torch.no_grad()
def text_quality(
    model: RecurrentDepthLM,
    texts: Iterable[str],
    codec: PlainTokenizer,
    depths: Sequence[int],
    bos_token_id: int,
    pad_token_id: int,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 8,
    init_scale: float | None = None,
    seed: int = 0,
    max_bytes: int | None = None,
) -> TextQuality:
    """Score `texts` (at most `max_tokens` predicted tokens, and `max_bytes` UTF-8 bytes, in all) at every
    depth. A byte cap scores the same text whatever the tokenizer: how a baseline with another
    tokenizer is compared on the text a model was scored on."""
    depths = check_depths(depths)
    check_scoring_window(seq_len)  # (0 was taken as "none" and scored whole windows)
    seq_len = min(model.config.max_seq_len if seq_len is None else seq_len, model.config.max_seq_len)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: expected an integer >= 1")
    result = TextQuality(depths, 0, 0, 0, dict.fromkeys(depths, 0.0))
    pending: list[list[int]] = []
    scale = model.config.init_scale if init_scale is None else init_scale
    drawn = [0]  # windows whose s_0 was drawn so far
    was_training = model.training
    model.eval()

    def flush() -> None:
        T = max(len(w) for w in pending)
        ids = torch.full((len(pending), T), pad_token_id, dtype=torch.long, device=model.device)
        for b, w in enumerate(pending):
            ids[b, : len(w)] = torch.tensor(w, device=model.device)
        targets = ids[:, 1:]
        valid = torch.zeros_like(targets, dtype=torch.bool)
        for b, w in enumerate(pending):
            valid[b, : len(w) - 1] = True
        states = None  # each window's s_0 from its own stream (a model whose s_0 is e draws nothing)
        if model.config.state_init == "random":
            states = torch.zeros((len(pending), T, model.config.hidden_size), device=model.device,
                                 dtype=model.transformer.wte.weight.dtype)
            for b, w in enumerate(pending):
                generator = stream_generator(seed, drawn[0], model.device)
                states[b, : len(w)] = model.initial_state(states[b : b + 1, : len(w)], scale, generator)[0]
                drawn[0] += 1
        for depth, logits in logits_at_depths(model, ids, depths, init_scale=init_scale, input_states=states):
            nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
            result.nll[depth] += float(nll[valid].sum())
        pending.clear()

    cut = False  # the token cap cut a document: the text scored ends there
    try:
        for text in texts:
            if cut or (max_tokens is not None and result.tokens >= max_tokens):
                break
            if max_bytes is not None:
                if result.bytes >= max_bytes:
                    break
                # the first bytes of the text, cut back to a whole character
                text = text.encode("utf-8")[: max_bytes - result.bytes].decode("utf-8", errors="ignore")
            ids = [bos_token_id, *codec.encode(text)]
            if len(ids) < 2:
                continue
            if max_tokens is not None and result.tokens + len(ids) - 1 > max_tokens:
                ids = ids[: max_tokens - result.tokens + 1]
                text = _scored_prefix(codec, ids, text)  # bytes of the part that is scored
                cut = True  # (tokens dropped with a cut character leave the cap unreached: stop anyway)
                if len(ids) < 2:
                    continue
            result.documents += 1
            result.tokens += len(ids) - 1
            result.bytes += len(text.encode("utf-8"))
            for w in windows(ids, seq_len):
                pending.append(w)
                if len(pending) == batch_size:
                    flush()
        if pending:
            flush()
    finally:
        model.train(was_training)
    if result.tokens == 0:
        raise ValueError("no text to score: the data gave no documents with at least one token")
    return result
