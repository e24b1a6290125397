"""Score loops on held-out text: validation loss per (window, K, mode, rule), and a window search.

Every configuration is scored on the same token windows (`held_out_windows`), so differences are the
loop's alone. The default held-out set is the validation side of the embedded `stdlib` corpus's
document split (the same split `prepare_dataset` trains on); a user's file, directory or .jsonl is
scored whole.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from recurrent_depth.looping.config import LoopConfig
from recurrent_depth.looping.loop import apply_loop, remove_loop
from recurrent_depth.looping.structure import find_decoder_layers

MAX_TEXT_FILE_BYTES = 64 * 1024 * 1024


def held_out_texts(data: str, val_fraction: float = 0.02, seed: int = 0, max_docs: int | None = None) -> Iterator[str]:
    """`"stdlib"`: its validation documents; a text file: its contents; a directory / .jsonl: every document."""
    from recurrent_depth.data.corpus import DocumentSplit, load_corpus

    path = Path(data).expanduser()
    if data != "stdlib" and path.is_file() and path.suffix.lower() != ".jsonl":
        if path.stat().st_size > MAX_TEXT_FILE_BYTES:
            raise ValueError(f"data: {data!r} is larger than {MAX_TEXT_FILE_BYTES} bytes")
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"data: {data!r} is not UTF-8 text") from None
        return
    corpus = load_corpus(data)
    docs: Iterable[Any] = corpus
    if data == "stdlib":
        docs = DocumentSplit.plan(corpus.ids(), val_fraction, seed=seed).select(corpus, "validation")
    for doc in itertools.islice(docs, max_docs):
        yield doc.text


def held_out_windows(tokenizer: Any, texts: Iterable[str], seq_len: int, max_tokens: int, bos_token_id: int | None
                     ) -> list[list[int]]:
    """Token windows of at most `seq_len` tokens, overlapping by one, `max_tokens` targets in all."""
    from recurrent_depth.evaluation.quality import PlainTokenizer, windows

    codec = PlainTokenizer(tokenizer)
    out: list[list[int]] = []
    targets = 0
    for text in texts:
        ids = ([bos_token_id] if bos_token_id is not None else []) + codec.encode(text)
        for window in windows(ids, seq_len):
            take = min(len(window), max_tokens - targets + 1)
            if take < 2:
                return out
            out.append(window[:take])
            targets += take - 1
    if not out:
        raise ValueError("no held-out text to score: the data gave no documents with at least two tokens")
    return out


def max_positions(config: Any) -> int | None:
    """The longest input the model's config declares (`max_position_embeddings`, GPT-2's `n_positions`), if any."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(config: Any, seq_len: int, what: str = "seq_len") -> None:
    """Refuse windows longer than the model's positions (a learned position table would fail with an IndexError)."""
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(f"{what} {seq_len} is longer than the model's {limit} positions "
                         f"(max_position_embeddings / n_positions in its config.json)")


@torch.no_grad()
def windows_loss(model: nn.Module, windows: Sequence[Sequence[int]], batch_size: int = 8, pad_token_id: int = 0
                 ) -> float:
    """Mean next-token loss (nats) over `windows` (right-padded batches, padding masked)."""
    device = next(model.parameters()).device
    check_seq_len(model.config, max((len(w) for w in windows), default=0), "held-out window length")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i : i + batch_size]
        T = max(len(w) for w in chunk)
        ids = torch.full((len(chunk), T), pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for b, w in enumerate(chunk):
            ids[b, : len(w)] = torch.tensor(list(w), device=device)
            mask[b, : len(w)] = 1
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        valid = mask[:, 1:].bool()
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        total += float(nll[valid].sum())
        count += int(valid.sum())
    return total / count


@dataclass
class LoopScore:
    config: LoopConfig | None  # None: the base model
    loss: float
    flops_ratio: float
    seconds: float

    def to_dict(self, base_loss: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "label": "base" if self.config is None else self.config.label(),
            "config": None if self.config is None else self.config.to_dict(),
            "loss": round(self.loss, 5),
            "flops_ratio": round(self.flops_ratio, 4),
            "seconds": round(self.seconds, 2),
        }
        if base_loss is not None:
            out["delta"] = round(self.loss - base_loss, 5)
        return out


def score_loops(model: nn.Module, windows: Sequence[Sequence[int]], configs: Iterable[LoopConfig | None],
                batch_size: int = 8, pad_token_id: int = 0, progress: Any = None) -> list[LoopScore]:
    """Validation loss of each configuration (None = the base model); the model is left unlooped."""
    num_layers = len(find_decoder_layers(model)[1])
    scores = []
    try:
        for cfg in configs:
            if cfg is None:
                remove_loop(model)
            else:
                apply_loop(model, cfg)
            start = time.perf_counter()
            loss = windows_loss(model, windows, batch_size, pad_token_id)
            ratio = 1.0 if cfg is None else cfg.flops_ratio(num_layers)
            scores.append(LoopScore(cfg, loss, ratio, time.perf_counter() - start))
            if progress is not None:
                progress(scores[-1])
    finally:
        remove_loop(model)
    return scores


def candidate_windows(num_layers: int, widths: Sequence[int]) -> list[tuple[int, int]]:
    """Every contiguous window [a, a + w − 1] of each width w that fits."""
    for w in widths:
        if w < 1 or w > num_layers:
            raise ValueError(f"window width {w} is outside 1..{num_layers} (the model's decoder layers)")
    # (each width once: `--widths 1,1` scored, and listed, every window twice)
    return [(a, a + w - 1) for w in dict.fromkeys(widths) for a in range(num_layers - w + 1)]


def loop_grid(windows: Sequence[tuple[int, int]], iterations: Sequence[int], rules: Sequence[str],
              modes: Sequence[str] = ("block",), beta: float = 0.5, stash: str = "first", when: str = "prefill"
              ) -> list[LoopConfig]:
    """Every (window, K, rule, mode); K = 1 is the base model and is left out.

    `stash` and `when` only matter for cached forwards (scoring runs without a cache), so they are carried
    as given: a saved loop keeps them.
    """
    out: dict[LoopConfig, None] = {}  # (each configuration once: `--iterations 2,2` scored and listed it twice)
    for (a, b), k, rule, mode in itertools.product(windows, iterations, rules, modes):
        if k < 1:
            raise ValueError(f"iterations must be >= 1, got {k}")
        if k > 1 and not (mode == "layer" and a == b and "block" in modes):  # one layer: the modes agree
            out[LoopConfig(a, b, iterations=k, rule=rule, mode=mode, beta=beta, stash=stash, when=when)] = None
    return list(out)
