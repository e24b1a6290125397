"""Pretrain a small, non-recurrent Llama-style transformers model on the embedded corpus (the looping demo).

No causal LM with weights ships in a package (reference/ecosystem.md §5), so the demo trains one:
the project's BPE tokenizer and token shards (`recurrent_depth.data`), a `transformers.LlamaConfig`
model, trained by the project's `Trainer` (the ``"demo"`` optimizer preset and schedule, one forward
per step: no depth sampler for a plain causal LM). The result is a normal transformers directory
(config.json, model.safetensors, tokenizer.json) that `AutoModelForCausalLM` loads, ready to be looped.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from recurrent_depth.config import is_int, is_real

MODEL_DIR = "model"


@dataclass
class PretrainRecipe:
    """The demo's shape and budget (defaults: 700 steps, about 5 CPU minutes on one thread)."""

    data: str = "stdlib"
    vocab_size: int = 2048
    tokenizer_max_bytes: int = 4_000_000
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seq_len: int = 128
    batch_size: int = 16
    max_steps: int = 700
    max_cpu_minutes: float = 6.0  # this process's CPU time in training steps (a busy machine does not shorten the run)
    lr: float = 4e-3
    warmup_steps: int = 30
    val_fraction: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "seq_len", "batch_size", "max_steps", "tokenizer_max_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"PretrainRecipe.{name} must be an integer >= 1, got {value!r}")
        from recurrent_depth.data.tokenizer import check_trainable_vocab_size
        from recurrent_depth.looping.config import MAX_DECODER_LAYERS, MAX_WIDTH, check_model_memory

        # before --out is made and the tokenizer trained (a vocab_size of 5 was refused by the tokenizer trainer
        # after --out was made; --hidden-size 1e9 was torch's allocation error, a traceback, after the data)
        check_trainable_vocab_size(self.vocab_size)
        for name, upper in (("num_layers", MAX_DECODER_LAYERS), ("hidden_size", MAX_WIDTH),
                            ("intermediate_size", MAX_WIDTH)):
            if getattr(self, name) > upper:
                raise ValueError(f"PretrainRecipe.{name} must be at most {upper:,}, got {getattr(self, name)}")
        check_model_memory(self.num_layers, self.hidden_size, self.intermediate_size, self.vocab_size,
                           "PretrainRecipe describes")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("PretrainRecipe: hidden_size must divide by num_heads and num_heads by num_kv_heads")
        if (self.hidden_size // self.num_heads) % 2:  # (transformers refuses it only once the model is built)
            raise ValueError(f"PretrainRecipe: hidden_size / num_heads = {self.hidden_size // self.num_heads} must be "
                             f"even (RoPE rotates pairs of dimensions); hidden_size={self.hidden_size}, "
                             f"num_heads={self.num_heads}")
        for name in ("max_cpu_minutes", "lr"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise ValueError(f"PretrainRecipe.{name} must be a number > 0, got {value!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"PretrainRecipe.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        # (TrainConfig's range; 1e23 overflowed torch.manual_seed after the tokenizer and shards were written)
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"PretrainRecipe.seed must be an integer in [0, 2**63), got {self.seed!r}")


def llama_config(recipe: PretrainRecipe, vocab_size: int, specials: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=max(2048, recipe.seq_len),
        tie_word_embeddings=True,
        bos_token_id=specials["begin_text"],
        eos_token_id=specials["end_text"],
        pad_token_id=specials["pad"],
    )


@torch.no_grad()
def _rows_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int) -> float:
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i : i + batch_size].to(next(model.parameters()).device)  # (the trainer's device)
        logits = model(batch[:, :-1]).logits
        total += float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    return total / count


def pretrain(out: str | Path, recipe: PretrainRecipe | None = None,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the demo model; write `<out>/model/` and `<out>/pretrain.json`; return the summary."""
    from transformers import LlamaForCausalLM

    from recurrent_depth.data import build_tokenizer, load_corpus, prepare_dataset
    from recurrent_depth.data.prepare import corpus_would_read
    from recurrent_depth.files import check_out_dir, locked_directory, remove_tree
    from recurrent_depth.train.batches import RowBatches
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import EARLIER_RUN_NAMES, Trainer

    recipe = recipe or PretrainRecipe()
    out = Path(out)
    check_out_dir(out)  # (an existing file: mkdir's bare "[Errno 17] File exists")
    # The demo trains from scratch and clears its own earlier checkpoints, but never another run's
    # (`--out` naming an `rdepth train` run by mistake deleted that run's checkpoints).
    if (out / "checkpoints").exists() and not (out / "pretrain.json").is_file():
        raise ValueError(f"{out} holds checkpoints that no finished `rdepth loop pretrain` wrote (no pretrain.json): "
                         f"choose a new --out, or delete {out / 'checkpoints'}")
    corpus = load_corpus(recipe.data)  # (a bad --data: named before --out is made)
    if corpus_would_read(corpus, out / "data"):  # (refused by prepare_dataset after the tokenizer was written there)
        raise ValueError(f"--out {out} lies inside --data {corpus.name}, a directory whose every file is read: the "
                         f"run's tokenizer and shards would become documents; choose an --out outside it")
    out.mkdir(parents=True, exist_ok=True)
    # The demo always trains from scratch; a run training there now is refused, not cleared away.
    with locked_directory(out, "--out"):
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        if (out / "pretrain.json").is_file():  # its own earlier model/ and record (the trainer keeps any other's)
            for name in EARLIER_RUN_NAMES:  # (a link loses only the link: rmtree refused one, in silence)
                remove_tree(out / name, ignore_errors=True)
    start = time.perf_counter()
    tok, tok_meta = build_tokenizer(corpus, recipe.vocab_size, val_fraction=recipe.val_fraction, seed=recipe.seed,
                                    max_bytes=recipe.tokenizer_max_bytes, out_dir=out / "tokenizer")
    log(f"tokenizer: {tok.get_vocab_size()} tokens in {time.perf_counter() - start:.0f}s")
    data = prepare_dataset(corpus, out / "tokenizer", recipe.seq_len, out / "data",
                           val_fraction=recipe.val_fraction, seed=recipe.seed, keep_all=True)
    log(f"data: {data.metadata['splits']['train']['rows']} training rows of {recipe.seq_len + 1} tokens "
        f"({time.perf_counter() - start:.0f}s)")
    specials = tok_meta["special_token_ids"]
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(llama_config(recipe, tok.get_vocab_size(), specials))
    # (the model's vocabulary: an id outside it is refused as its row is read, naming the shard file and row)
    vocab = model.config.vocab_size
    val = data.dataset("validation", shuffle=False, vocab_size=vocab)
    val_rows = val.next_batch(min(32, val.num_rows))

    def validation(trainer: Trainer, final: bool) -> dict[str, float] | None:
        if not final:
            return None
        trainer.model.eval()
        return {"validation_loss": _rows_loss(trainer.model, val_rows, recipe.batch_size)}

    cpu_start = time.process_time()

    def cpu_budget(trainer: Trainer) -> str | None:
        spent = time.process_time() - cpu_start > 60.0 * recipe.max_cpu_minutes
        return "cpu_time" if spent else None

    def progress(trainer: Trainer, record: dict[str, Any]) -> None:
        if (record["step"] - 1) % 50 == 0:
            log(f"step {record['step'] - 1}: loss {record['loss']:.3f} ({record['elapsed_s']:.0f}s)")

    cfg = TrainConfig(
        batch_size=recipe.batch_size, max_steps=recipe.max_steps, seed=recipe.seed, out=str(out),
        # a run shorter than the warmup reaches the peak rate at its last step (else the trainer warns about a
        # warmup the command has no flag to change, and the rate never reaches lr)
        optim=OptimConfig.from_preset("demo", lr=recipe.lr, warmup_steps=min(recipe.warmup_steps, recipe.max_steps)),
        eval_interval=0, save_every=0, progress=False, tensorboard=False,
    )
    trainer = Trainer(cfg, model=model, data=RowBatches(data.dataset("train", seed=recipe.seed, vocab_size=vocab)),
                      tokenizer_dir=out / "tokenizer", evaluate=validation, stop_when=cpu_budget,
                      on_step=progress, log=lambda _: None)
    result = trainer.run()
    train_cpu_s = time.process_time() - cpu_start
    val_loss = result.final_eval["validation_loss"]
    summary = {
        "recipe": asdict(recipe),
        "steps": result.steps,
        "train_seconds": round(result.elapsed_s, 1),
        "train_cpu_seconds": round(train_cpu_s, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss": round(sum(result.losses[-20:]) / max(1, len(result.losses[-20:])), 4),
        "validation_loss": round(val_loss, 4),
        "validation_tokens": int(val_rows[:, 1:].numel()),
        "model_dir": str(result.model_dir),
    }
    (out / "pretrain.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"trained {summary['steps']} steps in {result.elapsed_s:.0f}s ({train_cpu_s:.0f} CPU s): "
        f"validation loss {val_loss:.3f} -> {result.model_dir}")
    return summary
