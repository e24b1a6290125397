"""Pieces the experiments share: byte-level batches from a corpus and a plain training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from recurrent_depth import accel
from recurrent_depth.train.optim import OptimizerSet

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


def batches(tokens: torch.Tensor, batch: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless random windows [batch, seq_len + 1] of `tokens`, the same sequence for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])


def train(
    model: torch.nn.Module,
    optimizer: OptimizerSet,
    data: Iterator[torch.Tensor],
    steps: int,
    num_steps: int | tuple[int, int],
    after_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """`steps` optimizer steps of next-token loss at a fixed depth; `after_step(step, loss)` after each."""
    accel.apply(model)  # as the trainer does
    model.train()
    losses = []
    for step in range(steps):
        rows = next(data)
        out = model(rows[:, :-1], num_steps=num_steps, init_scale=0.0)
        loss = F.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(step, losses[-1])
    return losses
