"""Shared pieces for the training tests: a small deterministic corpus and tiny-run configs.

The corpus is generated from a seed (not read from the running Python's stdlib), so runs on it,
including the golden loss curve, do not depend on the Python version.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig

NAMES = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda_", "zeta")
VOCAB = 384  # the synthetic corpus supports ~200 merges beyond the 256 bytes
OPS = ("+", "-", "*", "//", "%")


def synthetic_document(rng: random.Random, index: int) -> str:
    """A small Python-like module: regular enough to learn from, varied enough not to be trivial."""
    lines = [f'"""Module {index}: helpers for {rng.choice(NAMES)}."""', "", "import math", ""]
    for j in range(rng.randint(3, 7)):
        name, arg = rng.choice(NAMES), rng.choice(("x", "y", "value", "count"))
        op, n = rng.choice(OPS), rng.randint(1, 99)
        lines += [f"def {name}_{j}({arg}, scale={n}):", f'    """Return {arg} {op} scale."""']
        if rng.random() < 0.5:
            lines += [f"    if {arg} > {rng.randint(0, 50)}:", f"        return {arg} {op} scale"]
        lines += [f"    return math.floor({arg} {op} {n}) + {j}", ""]
    return "\n".join(lines) + "\n"


def write_corpus(directory: Path, num_docs: int = 60, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(num_docs):
        (directory / f"mod_{i:03d}.py").write_text(synthetic_document(rng, i))
    return directory


def tiny_train_config(root: Path, out: str | Path, **overrides) -> TrainConfig:
    """A seconds-long tiny-preset run on the synthetic corpus (tokenizer and shards cached under root)."""
    values = dict(
        preset="tiny", data=str(root / "corpus"), tokenizer=str(root / "tokenizer"), data_dir=str(root / "data"),
        vocab_size=VOCAB, val_fraction=0.1, keep_all=True, seq_len=32, batch_size=4, max_steps=6, eval_batches=2,
        eval_depths=[1, 2, 4], progress=False, tensorboard=False, out=str(out),
        optim=OptimConfig.from_preset("demo", lr=3e-3, warmup_steps=2, cooldown_fraction=0.25),
    )
    values.update(overrides)
    return TrainConfig(**values)


def prepare_root(root: Path) -> Path:
    """Corpus + tokenizer (+ shards on first use) under root."""
    from recurrent_depth.data import build_tokenizer

    write_corpus(root / "corpus")
    build_tokenizer(str(root / "corpus"), VOCAB, val_fraction=0.1, seed=0, out_dir=root / "tokenizer")
    return root


class OneThread:
    """Tiny models gain nothing from a second thread, and on a busy machine two threads can be 10x
    slower; test modules use this as an autouse fixture body."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.before)
