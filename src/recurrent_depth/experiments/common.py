"""Pieces the experiments share: byte-level batches from a corpus and their recipe of the `Trainer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train.batches import BatchSource
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.trainer import Trainer, TrainResult

BYTE_VOCAB = 256


def byte_tokens(corpus: str = "stdlib", max_bytes: int = 2_000_000) -> torch.Tensor:
    """The first `max_bytes` UTF-8 bytes of a corpus (documents in the corpus' order) as token ids [N]."""
    from recurrent_depth.data import load_corpus

    chunks, total = [], 0
    for doc in load_corpus(corpus):
        data = doc.text.encode("utf-8")[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1024:
        raise ValueError(f"corpus {corpus!r} holds only {total} bytes; the experiments need at least 1024")
    return torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64))


class ByteWindows(BatchSource):
    """Random windows of `tokens` as next-token batches (`input_ids`, `targets`: [B, seq_len]); the same
    windows in the same order for the same seed."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 2:  # (else torch.randint's bare "from >= to" deep in the first step)
            raise ValueError(f"seq_len={seq_len} needs a corpus of at least {seq_len + 2} bytes; it holds "
                             f"{len(tokens)}")
        self.tokens, self.seq_len = tokens, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (batch_size,), generator=self.generator)
        rows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])  # [B, T + 1]
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}


def train_fixed_depth(
    model: RecurrentDepthLM,
    optim: OptimConfig,
    data: ByteWindows,
    steps: int,
    recurrence: int,
    batch_size: int,
    on_step: Callable[[Trainer, dict[str, Any]], None] | None = None,
    **settings: Any,
) -> TrainResult:
    """`steps` optimizer steps of the `Trainer` at a fixed depth (`recurrence` core steps, all with gradients;
    s_0 as the model config's `init_scale` says), on CPU, writing nothing. The lr follows `optim` (constant
    without warmup and cool-down, muP's per-group multipliers kept). `on_step(trainer, record)` after each
    step; `settings`: more `TrainConfig` fields (`qk_clip`, `record_max_logit`, ...).

    A diverged run is a result here, not an error: its non-finite steps are skipped and counted, never fatal.
    """
    cfg = TrainConfig(batch_size=batch_size, max_steps=steps, optim=optim, depth_scheme="fixed",
                      mean_recurrence=recurrence, backprop_depth=recurrence, max_skipped_fraction=1.0,
                      out=None, progress=False, tensorboard=False, **settings)
    return Trainer(cfg, model=model, data=data, on_step=on_step, log=lambda _: None, device="cpu").run()
