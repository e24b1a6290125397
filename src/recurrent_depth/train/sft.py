"""Supervised fine-tuning (`rdepth sft`): chat or prompt/completion examples on a model directory.

    result = sft(TrainConfig(init_from="runs/tiny", data="chats.jsonl", seq_len=256, max_steps=200,
                             out="runs/tiny-sft"))

The model comes from `cfg.init_from` (`train/init_from.py`, the same checks as `rdepth train --init-from`),
the examples from `cfg.data` (`data/chat.py`: loss on assistant / completion tokens only). The examples are
shuffled (seed `cfg.seed`), `val_fraction` of them held out (or `SFTOptions.val_data` used instead), cut to
`seq_len + 1` tokens, and packed: each row of `seq_len` positions holds whole examples one after the other
(next fit), `position_ids` restart at 0 with each example and `document_ids` give the model a block-diagonal
causal mask, so no token attends across examples; the row's tail is padding (`pad_token_id`, no loss).
`SFTOptions(packing=False)` puts one example per row instead (right padding: no mask needed, so every mixer
works). Training is the Trainer's own loop: the depth sampler (`depth_scheme`, `mean_recurrence`,
`backprop_depth`: the randomized-depth objective with truncated backprop, or `fixed`), the optimizer and
schedule, checkpoints and exact `--resume` (the batch source's position is in the checkpoint). The held-out
loss is measured at `eval_depths` on the same masked rows.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from recurrent_depth.data.chat import Example, ExampleEncoder, load_examples
from recurrent_depth.model.depth import stream_seed
from recurrent_depth.train import distributed as ddist
from recurrent_depth.train.batches import BatchSource
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.init_from import StartingPoint, load_for_training
from recurrent_depth.train.validation import (
    DepthEval,
    batch_losses,
    next_batch_late,
    rank0_late,
    rank_rounds,
    reduce_depth_eval,
    row_states,
)

if TYPE_CHECKING:
    from recurrent_depth.train.lora import LoraSpec

IGNORE = -100  # an unscored target


@dataclass
class SFTOptions:
    """What SFT adds to a TrainConfig: a held-out file (instead of `val_fraction` of `data`), packing, and
    a LoRA adapter to train instead of every weight (`train/lora.py`)."""

    val_data: str | None = None
    packing: bool = True
    lora: LoraSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"val_data": self.val_data, "packing": self.packing,
                "lora": None if self.lora is None else asdict(self.lora)}


@dataclass
class PackedRows:
    """Rows `[N, T]`: inputs, next-token targets (-100 unscored), per-example positions and document ids
    (-1 on padding, which is a document of its own: nothing attends to it)."""

    input_ids: Tensor
    targets: Tensor
    position_ids: Tensor
    document_ids: Tensor
    packed: bool

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, index: Tensor, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Rows `index` as a training batch; one example per row needs neither positions nor a mask."""
        keys = ("input_ids", "targets", "position_ids", "document_ids") if self.packed else ("input_ids", "targets")
        return {k: getattr(self, k)[index].to(device) for k in keys}

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for name in ("input_ids", "targets", "position_ids", "document_ids"):
            digest.update(getattr(self, name).numpy().tobytes())
        return digest.hexdigest()


def pack_examples(examples: list[Example], seq_len: int, pad_id: int, packing: bool = True) -> PackedRows:
    """Whole examples into rows of `seq_len` positions (see the module docstring), in the given order.

    An example of n tokens fills n - 1 positions (inputs ids[:-1], targets ids[1:]); longer than
    `seq_len + 1` tokens it is cut there (`cut_examples`). Examples must carry a scored target."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    used = seq_len  # positions taken in the open row (full: open a new one)
    for ex in examples:
        n = len(ex.ids) - 1
        if n > seq_len or n < 1:
            raise ValueError(f"an example of {len(ex.ids)} tokens does not fit rows of {seq_len} positions "
                             f"(cut_examples first)")
        inputs, targets = ex.ids[:-1], [t if s else IGNORE for t, s in zip(ex.ids[1:], ex.scored[1:], strict=True)]
        if not packing or used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((inputs, targets))
        used += n
    shape = (len(rows), seq_len)
    out = PackedRows(torch.full(shape, pad_id), torch.full(shape, IGNORE), torch.zeros(shape, dtype=torch.long),
                     torch.full(shape, -1), packed=packing)
    for r, row in enumerate(rows):
        start = 0
        for doc, (inputs, targets) in enumerate(row):
            end = start + len(inputs)
            out.input_ids[r, start:end] = torch.tensor(inputs)
            out.targets[r, start:end] = torch.tensor(targets)
            out.position_ids[r, start:end] = torch.arange(len(inputs))
            out.document_ids[r, start:end] = doc
            start = end
        out.position_ids[r, start:] = torch.arange(seq_len - start)
    return out


def cut_examples(examples: list[Example], seq_len: int) -> tuple[list[Example], dict[str, int]]:
    """Examples cut to `seq_len + 1` tokens; those left without a scored target are dropped (counted)."""
    kept, cut, dropped = [], 0, 0
    for ex in examples:
        if len(ex.ids) > seq_len + 1:
            ex = Example(ex.ids[: seq_len + 1], ex.scored[: seq_len + 1])
            cut += 1
        if any(ex.scored[1:]):
            kept.append(ex)
        else:
            dropped += 1
    return kept, {"examples": len(kept), "truncated": cut, "dropped": dropped}


class SFTBatches(BatchSource):
    """Rows of `PackedRows` in a seeded random order per epoch; this rank's share of each global batch.

    The position (epoch, cursor) is the checkpointed state, with a fingerprint of the rows, so a resume on
    other data or settings is refused instead of continuing somewhere else."""

    def __init__(self, rows: PackedRows, seed: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", metadata: dict[str, Any] | None = None) -> None:
        self.rows, self.seed, self.rank, self.world_size = rows, seed, rank, world_size
        self.device = torch.device(device)
        self.metadata = {**(metadata or {}), "rows": len(rows), "rows_sha256": rows.sha256()}
        self.epoch, self.cursor = 0, 0
        self._order: tuple[int, Tensor] | None = None

    def order(self, epoch: int) -> Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(stream_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.rows), generator=gen))
        return self._order[1]

    def next_batch(self, batch_size: int) -> dict[str, Tensor]:
        wanted, picked = batch_size * self.world_size, []
        while wanted:
            order = self.order(self.epoch)
            take = min(wanted, len(order) - self.cursor)
            picked.append(order[self.cursor : self.cursor + take])
            self.cursor, wanted = self.cursor + take, wanted - take
            if self.cursor == len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        index = torch.cat(picked)[self.rank * batch_size : (self.rank + 1) * batch_size]
        return self.rows.batch(index, self.device)

    summed_metrics = ("scored_tokens",)  # a step's answer tokens, over its micro-batches

    def observe(self, batch: dict[str, Tensor], output: Any) -> dict[str, Any]:
        return {"epoch": self.epoch + self.cursor / len(self.rows),
                "scored_tokens": int((batch["targets"] != IGNORE).sum())}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "rows_sha256": self.metadata["rows_sha256"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rows_sha256") != self.metadata["rows_sha256"]:
            raise ValueError("cannot resume: the SFT rows differ from the checkpoint's (the data file, the "
                             "tokenizer, seq_len, packing or the seed changed)")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def describe(self) -> dict[str, Any]:
        return {"source": "sft", **self.metadata}


@torch.no_grad()
def heldout_loss_by_depth(model: nn.Module, rows: PackedRows, depths: list[int], *, batch_size: int,
                          max_batches: int, dtype: str = "float32", seed: int = 0,
                          device: torch.device | str = "cpu", deadline: float | None = None,
                          world_size: int = 1, sharded: bool = False) -> DepthEval:
    """Mean loss per scored held-out token at each depth over the first `max_batches` batches of `rows`
    (the masks of training: packed examples apart); every depth of a batch starts from the same s0.
    With `world_size > 1` (a process group) rank r evaluates batches r, r + world_size, ... and the sums are
    all-reduced, so the result is one process's, whatever the number of ranks (as `rdepth train`'s
    validation); `sharded` (FSDP: a forward is collective) runs a discarded forward on a rank with no batch
    left in the last round.
    deadline: optional `time.perf_counter()` value; batches after the first stop when the next one would
    end past it (a run's `--max-minutes` cuts its final evaluation to fit, as `rdepth train`'s; rank 0's clock)."""
    depths = sorted(set(depths))  # (a repeated depth would add its batch losses twice)
    device = torch.device(device)
    num_batches = min(max_batches, math.ceil(len(rows) / batch_size))
    was_training = model.training
    model.eval()
    total = {d: 0.0 for d in depths}
    corr = {d: 0.0 for d in depths}
    tokens = sequences = 0
    started = time.perf_counter()
    try:
        for rnd, (i, read) in enumerate(rank_rounds(num_batches, world_size)):
            if rnd > 0 and rank0_late(next_batch_late(started, rnd, deadline), world_size, device):
                break
            if i >= num_batches and not sharded:
                continue
            start = read * batch_size
            batch = rows.batch(torch.arange(start, min(start + batch_size, len(rows))), device)
            # each row's s0 from its own stream (its row index), not one draw per batch: a row's loss does not
            # depend on the batch size, the number of batches or the ranks
            states = row_states(model, batch["input_ids"].shape[0], batch["input_ids"].shape[1], start, seed, device)
            if states is not None:
                batch["input_states"] = states
            losses, correlations = batch_losses(model, batch, depths, (seed * 1_000_003 + i) % (2**63), dtype)
            if i >= num_batches:  # (a sharded forward every rank runs; this rank has no batch left)
                continue
            for d in depths:
                total[d] += float(losses[d])
                corr[d] += float(correlations[d])
            tokens += int((batch["targets"] != IGNORE).sum())
            sequences += batch["input_ids"].shape[0]
    finally:
        model.train(was_training)
    return reduce_depth_eval(tokens, sequences, total, corr, world_size, device)


def heldout_evaluation(rows: PackedRows) -> Callable[[Any, bool], DepthEval]:
    """The Trainer's `evaluate` hook: held-out loss at the run's eval depths."""

    def evaluate(trainer: Any, final: bool) -> DepthEval:
        cfg = trainer.cfg
        depths = trainer.eval_depths or cfg.resolved_eval_depths(trainer.model_config.mean_recurrence)
        sharded = ddist.is_fsdp(trainer.wrapped)
        result = heldout_loss_by_depth(trainer.wrapped if sharded else trainer.model, rows, depths,
                                       batch_size=cfg.batch_size, max_batches=cfg.eval_batches, dtype=cfg.dtype,
                                       seed=cfg.seed, device=trainer.env.device,
                                       deadline=trainer.eval_deadline if final else None,
                                       world_size=trainer.env.world_size, sharded=sharded)
        table = "  ".join(f"{d}:{v:.3f}" for d, v in sorted(result.loss.items()))
        trainer.log(f"step {trainer.state.step} held-out loss by depth  {table}")
        return result

    return evaluate


def sft_rows(cfg: TrainConfig, options: SFTOptions, encoder: ExampleEncoder,
             pad_id: int) -> tuple[PackedRows, PackedRows, dict[str, Any]]:
    """(training rows, held-out rows, what was read) from `cfg.data` (and `options.val_data`)."""
    most = cfg.seq_len + 1  # (what `cut_examples` keeps: a long row's text past it is never tokenized)
    examples = load_examples(cfg.data, encoder, most)
    random.Random(cfg.seed).shuffle(examples)
    if options.val_data is not None:
        held_out = load_examples(options.val_data, encoder, most)
    else:
        if len(examples) < 2:
            raise ValueError(f"SFT data {cfg.data!r} holds {len(examples)} example(s): at least 2 are needed to "
                             f"hold one out (or pass a held-out file, --val-data)")
        count = min(len(examples) - 1, max(1, round(cfg.val_fraction * len(examples))))
        held_out, examples = examples[:count], examples[count:]
    train, train_counts = cut_examples(examples, cfg.seq_len)
    held_out, val_counts = cut_examples(held_out, cfg.seq_len)
    for name, kept in (("training", train), ("held-out", held_out)):
        if not kept:
            raise ValueError(f"no {name} example keeps a scored token within seq_len={cfg.seq_len}")
    stats = {"data": cfg.data, **options.to_dict(), "seq_len": cfg.seq_len,
             "train": train_counts, "validation": val_counts}
    return (pack_examples(train, cfg.seq_len, pad_id, options.packing),
            pack_examples(held_out, cfg.seq_len, pad_id, options.packing), stats)


def build_model(cfg: TrainConfig, device: torch.device | str = "cpu") -> StartingPoint:
    """The model SFT trains: `cfg.init_from` loaded for training. (The one place that builds it, so a
    wrapper such as LoRA applies here.)"""
    return load_for_training(cfg, device)


def sft_trainer(cfg: TrainConfig, options: SFTOptions | None = None, **trainer_kwargs: Any):
    """A `Trainer` set up for SFT (see the module docstring); `trainer_kwargs` go to the Trainer."""
    from recurrent_depth.train.init_from import resolved_config
    from recurrent_depth.train.trainer import Trainer

    options = options or SFTOptions()
    if cfg.init_from is None:
        raise ValueError("SFT needs a model to start from: TrainConfig.init_from (--init-from DIR)")
    cfg = resolved_config(cfg, lora=options.lora is not None)  # (an adapter's default optimizer is LoRA's)
    joined = not ddist.group_initialized()
    env = ddist.init_distributed(trainer_kwargs.get("device"))
    start = build_model(cfg, "cpu")  # the Trainer moves it
    config = start.model.config
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    train, held_out, stats = sft_rows(cfg, options, ExampleEncoder(start.tokenizer_dir, config), pad_id)
    source = SFTBatches(train, cfg.seed, env.rank, env.world_size, env.device, stats)
    trainer_kwargs.setdefault("evaluate", heldout_evaluation(held_out))
    trainer_kwargs.setdefault("save_dtype", start.dtype)
    model = start.model
    if options.lora is not None:
        from recurrent_depth.train.lora import add_lora

        model = add_lora(model, options.lora, base_dir=start.model_dir, seed=cfg.seed)
    trainer = Trainer(cfg, model=model, data=source, tokenizer_dir=start.tokenizer_dir, **trainer_kwargs)
    trainer.adopt_group(joined)  # (the group joined here is the trainer's to leave: close())
    return trainer


def sft(cfg: TrainConfig, options: SFTOptions | None = None, **trainer_kwargs: Any):
    """Run SFT; returns the Trainer's `TrainResult` (the model directory is `<out>/model`). The Trainer is closed
    after its run, as `rdepth sft` closes it (its logs, and a process group it joined under torchrun)."""
    with sft_trainer(cfg, options, **trainer_kwargs) as trainer:
        return trainer.run()

