"""Validation loss at several test-time depths, and the collapse monitor, in one pass per batch.

For each batch the prelude runs once, the core is iterated up to the deepest requested depth,
and the coda reads the state out at every requested depth on the way. That costs
`max(depths)` core steps instead of `sum(depths)`, and every depth starts from the same s0
draw, so the differences between depths are paired (not blurred by different random starts).
The numbers equal `model(inputs, num_steps=d)` run separately with the same generator seed
(tests check this).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.data.shards import check_token_ids
from recurrent_depth.inference.engine import Recurrence
from recurrent_depth.inference.sampling import stream_generator
from recurrent_depth.model.recurrent import RecurrentDepthLM
from recurrent_depth.train.monitor import token_correlation


@dataclass
class DepthEval:
    """Mean next-token loss (nats) and mean token correlation per depth, over `tokens` targets."""

    loss: dict[int, float] = field(default_factory=dict)
    token_correlation: dict[int, float] = field(default_factory=dict)
    tokens: int = 0

    def best_depth(self) -> int:
        return min(self.loss, key=lambda d: (self.loss[d], d))

    def to_dict(self) -> dict:
        return {
            "val_loss_by_depth": {str(d): v for d, v in sorted(self.loss.items())},
            "token_correlation_by_depth": {str(d): v for d, v in sorted(self.token_correlation.items())},
            "val_tokens": self.tokens,
        }


def autocast_context(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for dtype "bfloat16", nothing for "float32"."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def depth_losses(
    model: RecurrentDepthLM,
    rows: Tensor,
    depths: list[int],
    generator: torch.Generator | None = None,
    dtype: str = "float32",
    input_states: Tensor | None = None,
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Summed loss and summed per-sequence token correlation per depth for one batch of rows.

    rows: [B, T + 1] token ids (inputs rows[:, :-1], targets rows[:, 1:]).
    input_states: s_0 [B, T, h] instead of a draw from `generator` (`row_states`).
    Returns ({depth: summed token loss}, {depth: summed correlation over the B sequences}).
    """
    inputs, targets = rows[:, :-1], rows[:, 1:]
    wanted = sorted(set(depths))
    losses: dict[int, Tensor] = {}
    corr: dict[int, Tensor] = {}
    with autocast_context(dtype, rows.device):
        engine = Recurrence(model, fast=False)  # the model's own modules (autocast applies to them)
        pass_ = engine.begin(inputs)
        if input_states is not None:
            s0 = input_states.to(pass_.e.dtype)
        else:
            s0 = engine.initial_state(pass_.e, model.config.init_scale, generator)
        for depth, state in engine.depths(s0, pass_, wanted):
            logits = engine.readout(state, pass_)
            losses[depth] = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            corr[depth] = token_correlation(state).sum()
    return losses, corr


def forward_losses(
    model: torch.nn.Module,
    rows: Tensor,
    depths: list[int],
    generator_seed: int,
    dtype: str = "float32",
    input_states: Tensor | None = None,
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Like `depth_losses`, but one full `model(...)` call per depth (needed when the model is
    FSDP-sharded: only its forward gathers the parameters). Same s0 draw for every depth."""
    batch = {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}
    if input_states is not None:
        batch["input_states"] = input_states
    return batch_losses(model, batch, depths, generator_seed, dtype)


def row_states(model: torch.nn.Module, num_rows: int, length: int, first_row: int, seed: int,
               device: torch.device) -> Tensor | None:
    """s_0 [num_rows, length, h] (float32) of storage rows first_row, first_row + 1, ...: each row's from a stream
    of its own, seeded by (seed, its storage index), so a row starts from the same state whatever batch it is in
    (the batch size, the number of batches, the ranks). None for a model whose s_0 is its embedding."""
    config = model.config
    if config.state_init != "random":
        return None
    like = torch.empty((1, length, config.hidden_size), device=device)
    states = []
    for row in range(first_row, first_row + num_rows):
        generator = stream_generator(seed, row, device)
        states.append(model.initial_state(like, config.init_scale, generator))
    return torch.cat(states)


@torch.no_grad()
def batch_losses(
    model: torch.nn.Module,
    batch: dict[str, Tensor],
    depths: list[int],
    generator_seed: int,
    dtype: str = "float32",
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """Summed loss (targets of -100 unscored) and summed per-sequence token correlation (over the rows' real
    positions, `real_positions`: padding left out) per depth of a training batch (`train/batches.py`: the
    model's keyword arguments + `targets`, e.g. SFT's packed rows with `position_ids` and `document_ids`); one
    `model(...)` call per depth, each from the same s0 draw."""
    inputs = {k: v for k, v in batch.items() if k != "targets"}
    targets = batch["targets"]
    device = targets.device
    real = real_positions(batch)
    paired = real.sum(dim=1) >= 2  # (a row with one real position has no pair to correlate)
    losses: dict[int, Tensor] = {}
    corr: dict[int, Tensor] = {}
    for depth in sorted(set(depths)):
        gen = torch.Generator(device=device).manual_seed(generator_seed)
        with autocast_context(dtype, device):
            out = model(**inputs, num_steps=depth, generator=gen)
        losses[depth] = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum")
        # the padding's states left out: its many near-equal states read as collapse. A row without a pair counts
        # as the mean of the batch's others (the sum stays one value per sequence)
        per_row = token_correlation(out.final_state, real)
        corr[depth] = per_row.sum() if bool(paired.all()) else per_row[paired].mean() * per_row.shape[0]
    return losses, corr


def real_positions(batch: dict[str, Tensor]) -> Tensor:
    """[B, T] true on a row's example tokens, false on its padding: packed rows' document id -1, otherwise the
    tail after the row's last scored target (an example ends on a scored target, its eos; -100 unscored)."""
    if "document_ids" in batch:
        return batch["document_ids"] >= 0
    targets = batch["targets"]
    positions = torch.arange(targets.shape[1], device=targets.device)
    last = torch.where(targets != -100, positions, -1).amax(dim=1, keepdim=True)
    return positions <= last


def next_batch_late(started: float, done: int, deadline: float | None) -> bool:
    """A batch after the first would end past `deadline` (a `time.perf_counter()` value), at the mean
    pace of the `done` batches since `started`: a run's time budget cuts its final evaluation there."""
    if deadline is None or done == 0:
        return False
    now = time.perf_counter()
    return now + (now - started) / done > deadline


def rank0_late(late: bool, world_size: int, device: torch.device) -> bool:
    """Rank 0's `late` on every rank (collective when `world_size > 1`)."""
    if world_size == 1:
        return late
    import torch.distributed as dist

    flag = torch.tensor([int(late)], device=device if device.type == "cuda" else "cpu")
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def rank_rounds(num_batches: int, world_size: int) -> Iterator[tuple[int, int]]:
    """(batch index, batch to read) of this rank, one per round: rank r takes batches r, r + world_size, ...
    In the last round a rank with no batch left gets an index >= num_batches and the round's first batch to
    read (an FSDP forward is collective: every rank runs it, then drops the result)."""
    rank = 0
    if world_size > 1:
        import torch.distributed as dist

        rank = dist.get_rank()
    for first in range(0, num_batches, world_size):
        i = first + rank
        yield i, (i if i < num_batches else first)


def _rank_batches(dataset, batch_size: int, num_batches: int, world_size: int):
    """(batch index, batch read, rows) of this rank per round (`rank_rounds`): batch i is storage rows
    [i * batch_size, (i + 1) * batch_size)."""
    if world_size == 1:
        for i, rows in zip(range(num_batches), dataset.iter_batches(batch_size, drop_last=True), strict=False):
            yield i, i, rows
        return
    for i, read in rank_rounds(num_batches, world_size):
        yield i, read, dataset.rows(range(read * batch_size, (read + 1) * batch_size))


def storage_row(dataset, first: int, offset: int) -> str:
    """Where storage row `first + offset` of `dataset` is: its shard file and row (`ShardDataset.where`), else its
    index."""
    where = getattr(dataset, "where", None)
    return where(first + offset) if where is not None else f"validation row {first + offset}"


def reduce_depth_eval(tokens: int, sequences: int, loss_sum: dict[int, float], corr_sum: dict[int, float],
                      world_size: int, device: torch.device) -> DepthEval:
    """The mean loss per token and correlation per sequence at each depth, from this rank's sums all-reduced
    over the process group (`world_size > 1`), so the result is one process's whatever the number of ranks."""
    depths = list(loss_sum)
    totals = torch.tensor([tokens, sequences] + [float(loss_sum[d]) for d in depths]
                          + [float(corr_sum[d]) for d in depths], dtype=torch.float64)
    if world_size > 1:
        import torch.distributed as dist

        totals = totals.to(device if device.type == "cuda" else torch.device("cpu"))
        dist.all_reduce(totals)
        totals = totals.cpu()
    tokens, sequences, n = int(totals[0]), int(totals[1]), len(depths)
    result = DepthEval(tokens=tokens)
    for j, d in enumerate(depths):
        result.loss[d] = float(totals[2 + j]) / tokens
        result.token_correlation[d] = float(totals[2 + n + j]) / sequences
    return result


@torch.no_grad()
def validation_loss_by_depth(
    model: torch.nn.Module,
    dataset,
    depths: list[int],
    *,
    batch_size: int,
    max_batches: int,
    dtype: str = "float32",
    seed: int = 0,
    device: torch.device | str = "cpu",
    sharded: bool = False,
    world_size: int = 1,
    deadline: float | None = None,
) -> DepthEval:
    """Validation loss and token correlation at each depth over the first `max_batches` batches.

    dataset: a `ShardDataset` (storage order; its training position is untouched). Batch i is rows
    [i * batch_size, (i + 1) * batch_size); each row's s0 is drawn from a stream seeded by (seed, its storage index)
    (`row_states`), so repeated evaluations see the same starts, and a row's loss does not depend on the batch
    size or the number of batches. `max_batches` counts batches in all: with `world_size > 1` (a process group)
    rank r evaluates batches r, r + world_size, ... (through `dataset.rows`) and the sums are all-reduced, so the
    rows, the tokens and the loss are those of one process, whatever the number of ranks.
    deadline: optional `time.perf_counter()` value; batches after the first stop early when the next one
    would end past it (by rank 0's clock on every rank: ranks run the same number of rounds).
    """
    if not depths:
        raise ValueError("depths must name at least one depth")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in depths):
        raise ValueError(f"depths={list(depths)!r} is invalid: expected integers >= 0")
    depths = sorted(set(depths))  # a repeated depth would add its batch losses twice
    for name, value in (("batch_size", batch_size), ("max_batches", max_batches)):  # (0 or less: clamped, or "too few")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
    device = torch.device(device)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    batch_size = max(1, min(batch_size, len(dataset)))  # (a split smaller than one batch is one batch)
    num_batches = min(max_batches, len(dataset) // batch_size)
    if num_batches < 1:
        raise ValueError(f"validation split has {len(dataset)} rows: too few to evaluate")
    was_training = model.training
    model.eval()
    loss_sum = {d: torch.zeros((), dtype=torch.float64) for d in depths}
    corr_sum = {d: torch.zeros((), dtype=torch.float64) for d in depths}
    tokens = 0
    sequences = 0
    try:
        started = time.perf_counter()
        for rnd, (i, read, rows) in enumerate(_rank_batches(dataset, batch_size, num_batches, world_size)):
            late = deadline is not None and rnd > 0
            if late and rank0_late(next_batch_late(started, rnd, deadline), world_size, device):
                break
            rows = torch.as_tensor(rows)
            if vocab_size is not None:  # (else torch's IndexError; on the host rows: no device sync a batch)
                check_token_ids(rows.cpu().numpy(), vocab_size, partial(storage_row, dataset, read * batch_size))
            rows = rows.to(device)
            batch_seed = (seed * 1_000_003 + i) % (2**63)
            # each row's s0 from its own stream (storage row i * batch_size + b), not one draw per batch
            states = row_states(model, rows.shape[0], rows.shape[1] - 1, i * batch_size, seed, device)
            if sharded:  # (an FSDP forward is collective: every rank runs it, with a batch or not)
                losses, corr = forward_losses(model, rows, depths, batch_seed, dtype, states)
            elif i < num_batches:
                gen = torch.Generator(device=device).manual_seed(batch_seed)
                losses, corr = depth_losses(model, rows, depths, gen, dtype, states)
            if i >= num_batches:  # this rank has no batch left this round
                continue
            for d in depths:
                loss_sum[d] += losses[d].double().cpu()
                corr_sum[d] += corr[d].double().cpu()
            tokens += rows[:, 1:].numel()
            sequences += rows.shape[0]
    finally:
        model.train(was_training)
    return reduce_depth_eval(tokens, sequences, loss_sum, corr_sum, world_size, device)
