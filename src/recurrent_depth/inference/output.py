"""What generation returns: sequences plus per-token statistics, and the streamed events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Why a token's recurrence stopped (index = code in `GenerationOutput.exit_codes`).
EXIT_REASONS: tuple[str, ...] = (
    "",            # 0: no token (the row had finished: padding)
    "prefill",     # 1: predicted by the prompt's last position (full depth; with exit_in_prefill or
                   #    exit_kv="compute" at the step its criterion held, which `steps` gives)
    "fixed",       # 2: fixed depth num_steps
    "converged",   # 3: the exit criterion was met
    "max-steps",   # 4: the criterion was never met within max_steps
    "accepted",    # 5: speculative: the draft token passed verification
    "corrected",   # 6: speculative: the verifier's token replaced a rejected draft
    "wavefront",   # 7: parallel: frozen because the wavefront was full
)
REASON_CODE = {name: i for i, name in enumerate(EXIT_REASONS)}


@dataclass
class TokenEvent:
    """One generated token of one row, as streamed.

    index: position among the row's new tokens (0-based). steps: recurrence steps of the latent
    that produced it. cache_bytes: the row's logical KV-cache bytes once the token is committed
    (None while unknown). text: the decoded token when a tokenizer was given.
    """

    row: int
    index: int
    token: int
    steps: int
    reason: str
    finished: bool
    cache_bytes: int | None = None
    text: str | None = None


@dataclass
class GenerationOutput:
    """Generated ids and statistics; rows that stopped early are padded with `pad_token_id`.

    sequences: [B, T + new] (prompt, left padding included, then the new tokens).
    steps: [B, new] recurrence steps used for each new token (0 after a row finished).
    exit_codes: [B, new] index into EXIT_REASONS; `exit_reasons` gives the names.
    cache_bytes: [B, new] the row's logical KV-cache bytes after each token.
    lengths: [B] new tokens per row; finish_reasons: "stop" (stop id/string or eos) or "length".
    logits: [B, new, V] float32 logits that chose each token when `output_logits=True`.
    predictions: [B, new] the model's own choice at each position; equals the new tokens except
    under teacher forcing (`teacher_tokens=`), where the given tokens are fed instead.
    """

    sequences: Tensor
    steps: Tensor
    exit_codes: Tensor
    cache_bytes: Tensor
    lengths: Tensor
    finish_reasons: list[str]
    prompt_length: int
    pad_token_id: int
    cache_allocated_bytes: int = 0
    core_cache_bytes: Tensor | None = None
    logits: Tensor | None = None
    predictions: Tensor | None = None
    mode: str = "autoregressive"
    kv_policy: str = "per-step+deepest"  # the cache's KVPolicy name (cache_bytes are counted under it)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def new_tokens(self) -> Tensor:
        """[B, new] the generated part of `sequences`."""
        return self.sequences[:, self.prompt_length :]

    @property
    def exit_reasons(self) -> list[list[str]]:
        return [[EXIT_REASONS[c] for c in row[: int(n)]] for row, n in zip(self.exit_codes.tolist(), self.lengths)]

    @property
    def mean_steps(self) -> float:
        """Mean recurrence steps per generated token (padding excluded)."""
        total = int(self.lengths.sum())
        return float(self.steps.sum()) / total if total else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed: tokens after each row's first (which the prefill produced), all rows
        together, per second from the first token to the end."""
        total = int(self.lengths.sum()) - int((self.lengths > 0).sum())
        return total / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def token_lists(self) -> list[list[int]]:
        """The new tokens of each row, without padding."""
        return [row[: int(n)] for row, n in zip(self.new_tokens.tolist(), self.lengths)]

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly dictionary of the headline statistics."""
        return {
            "mode": self.mode,
            "new_tokens": int(self.lengths.sum()),
            "mean_steps": round(self.mean_steps, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "cache_mb": round(float(self.cache_bytes[:, -1].max()) / 2**20, 3) if self.cache_bytes.numel() else 0.0,
            "cache_allocated_mb": round(self.cache_allocated_bytes / 2**20, 3),
            "kv_policy": self.kv_policy,
            "finish_reasons": self.finish_reasons,
            **self.stats,
        }


class Recorder:
    """Collects committed tokens row by row (rows may advance at different rates)."""

    def __init__(self, batch_size: int, max_new_tokens: int, keep_logits: bool) -> None:
        self.max_new = max_new_tokens
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.predictions: list[list[int]] = [[] for _ in range(batch_size)]
        self.steps: list[list[int]] = [[] for _ in range(batch_size)]
        self.codes: list[list[int]] = [[] for _ in range(batch_size)]
        self.bytes: list[list[int]] = [[] for _ in range(batch_size)]
        self.logits: list[list[Tensor]] | None = [[] for _ in range(batch_size)] if keep_logits else None
        self.finished = [max_new_tokens == 0] * batch_size
        self.finish_reasons = ["length"] * batch_size

    def count(self, row: int) -> int:
        return len(self.tokens[row])

    def add(self, row: int, token: int, steps: int, reason: str, logits: Tensor | None = None,
            prediction: int | None = None) -> int:
        """Append one token (and the model's own choice, when a teacher forced another); returns its index."""
        self.tokens[row].append(token)
        self.predictions[row].append(token if prediction is None else prediction)
        self.steps[row].append(steps)
        self.codes[row].append(REASON_CODE[reason])
        if self.logits is not None and logits is not None:
            self.logits[row].append(logits.detach().float().cpu())
        if len(self.tokens[row]) >= self.max_new:
            self.finished[row] = True
        return len(self.tokens[row]) - 1

    def finish(self, row: int, reason: str) -> None:
        self.finished[row] = True
        self.finish_reasons[row] = reason

    def set_bytes(self, row: int, nbytes: int) -> None:
        """Logical cache bytes of the row after its latest committed token."""
        while len(self.bytes[row]) < len(self.tokens[row]):
            self.bytes[row].append(nbytes)

    def build(self, input_ids: Tensor, pad_token_id: int, **extra: Any) -> GenerationOutput:
        B, T = input_ids.shape
        lengths = [len(t) for t in self.tokens]
        new = max(lengths, default=0)

        def table(rows: list[list[int]], fill: int, dtype: torch.dtype) -> Tensor:
            out = torch.full((B, new), fill, dtype=dtype)
            for b, row in enumerate(rows):
                if row:
                    out[b, : len(row)] = torch.tensor(row, dtype=dtype)
            return out

        bytes_rows = [(row + [row[-1]] * (n - len(row))) if row else [0] * n for row, n in zip(self.bytes, lengths)]
        sequences = torch.cat([input_ids.cpu(), table(self.tokens, pad_token_id, torch.long)], dim=1)
        logits = None
        if self.logits is not None and new:
            V = next(lg[0].shape[-1] for lg in self.logits if lg)
            logits = torch.zeros(B, new, V, dtype=torch.float32)  # (float32 whatever torch's default dtype)
            for b, row in enumerate(self.logits):
                if row:
                    logits[b, : len(row)] = torch.stack(row)
        return GenerationOutput(
            sequences=sequences,
            steps=table(self.steps, 0, torch.long),
            exit_codes=table(self.codes, 0, torch.long),
            cache_bytes=table(bytes_rows, 0, torch.long),
            lengths=torch.tensor(lengths, dtype=torch.long),
            finish_reasons=list(self.finish_reasons),
            prompt_length=T,
            pad_token_id=pad_token_id,
            logits=logits,
            predictions=table(self.predictions, pad_token_id, torch.long),
            **extra,
        )
