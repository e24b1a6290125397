"""Knowledge distillation: a teacher's soft targets mixed into the student's next-token loss.

    loss = (1 - alpha) * CE(z_s, y) + alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T))

KL is summed over the vocabulary and averaged over the scored tokens (targets != -100, exactly the
positions CE scores); the T^2 keeps the soft term's gradient scale independent of T (Hinton et al.).

Top-k (`distill_top_k = k > 0`): the teacher distribution is restricted to its k largest logits and
renormalised there, q = softmax(top_k(z_t) / T); the student's log-probabilities are taken over the FULL
vocabulary, log softmax(z_s / T), and gathered at those k indices:

    KL_k = sum_{i in top-k} q_i * (log q_i - log p_s,i)

(the standard sparse-target distillation: the student still pays for mass it puts outside the top-k,
through the full-vocabulary normaliser). k = 0 uses the full vocabulary.

The teacher is any model directory `RecurrentDepthLM.from_pretrained` reads (ours, a run directory holding
model/, official Huginn-0125, Ouro, Parcae), or a transformers Llama / Mistral / Phi-3 / Qwen2 / Qwen3 /
OLMo-2 / Gemma directory (`families.retrofit.SUPPORTED_MODEL_TYPES`; sliding-window layers included), read
through `families.retrofit` with every layer kept, run at r = 1: exactly the source network. It runs in eval
mode, without gradients, in its stored dtype (autocast off, under --dtype bf16 too: a bf16 teacher is one stored in
bf16), at `teacher_depth` (default: its config's mean_recurrence), with its initial state drawn from its OWN
generator seeded from the run seed on a separate stream (`teacher_generator`), so the student's depth draws and
initial states are the same with and without a teacher. alpha = 0 never loads or runs the teacher (plain
training, bit for bit).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.checkpoint import lora_adapter_hint, model_dir_record, model_identity, stored_dtype
from recurrent_depth.config import is_int
from recurrent_depth.files import CONFIG_MAX_BYTES, read_json
from recurrent_depth.model.depth import stream_seed
from recurrent_depth.train.objective import NumSteps, scored_tokens

# The teacher's generator stream: far from the student's (seed + 1) and the data order's.
TEACHER_STREAM = 0x7EAC_4E55


def distillation_loss(student_logits: Tensor, targets: Tensor, teacher_logits: Tensor | None = None, *,
                      teacher_top: tuple[Tensor, Tensor] | None = None, alpha: float,
                      temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(total, ce, kl) for logits [B, T, V] and targets [B, T] (-100 = unscored).

    Give `teacher_logits` [B, T, V] (full vocabulary) or `teacher_top` = (values [B, T, k], indices [B, T, k])."""
    if (teacher_logits is None) == (teacher_top is None):
        raise ValueError("distillation_loss needs teacher_logits or teacher_top, not both")
    ce = F.cross_entropy(student_logits.flatten(0, 1).float(), targets.flatten())
    scored = targets.flatten() != -100
    log_p_s = F.log_softmax(student_logits.flatten(0, 1).float() / temperature, dim=-1)
    if teacher_logits is not None:
        if teacher_logits.shape[-1] != student_logits.shape[-1]:
            raise ValueError(f"teacher logits have {teacher_logits.shape[-1]} entries, the student's "
                             f"{student_logits.shape[-1]}: the vocabularies must match")
        log_q = F.log_softmax(teacher_logits.flatten(0, 1).float() / temperature, dim=-1)
    else:
        values, indices = teacher_top
        log_q = F.log_softmax(values.flatten(0, 1).float() / temperature, dim=-1)
        log_p_s = log_p_s.gather(-1, indices.flatten(0, 1).long())
    per_token = (log_q.exp() * (log_q - log_p_s)).sum(-1)
    count = scored.sum()
    kl = (per_token * scored).sum() / count.clamp(min=1)
    total = (1 - alpha) * ce + alpha * temperature**2 * kl
    return total, ce, kl


def teacher_generator(seed: int, position: int, device: torch.device | str) -> torch.Generator:
    """The teacher's generator for micro-batch `position` (micro_step * world_size + rank)."""
    return torch.Generator(device=device).manual_seed(stream_seed(stream_seed(seed, TEACHER_STREAM), position))


@dataclass
class Teacher:
    model: nn.Module
    depth: int  # 1 for a retrofitted non-recurrent source
    directory: Path
    vocab_size: int
    tokenizer_dir: Path | None


def find_teacher_dir(path: str | Path) -> Path:
    """DIR when it holds config.json, else DIR/model; a one-line ValueError otherwise."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"teacher={str(path)!r} is not a directory (expected a model directory)")
    for candidate in (p, p / "model"):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"teacher={str(path)!r} holds no config.json and no model/config.json: expected a model "
                     f"directory or a run directory holding model/"
                     + lora_adapter_hint(p, merged_for="use that as the teacher"))


def teacher_record(path: str | Path) -> dict[str, str]:
    """What a distilling run's checkpoints record about its teacher (`find_teacher_dir(path)`): its absolute path,
    `model_identity` and `model_content_sample`, so that a resume refuses a teacher retrained or replaced in place
    (`trainer_checkpoints.check_same_teacher`), as it refuses a changed --init-from directory."""
    return model_dir_record(find_teacher_dir(path))


def load_teacher(path: str | Path, depth: int | None = None, device: torch.device | str = "cpu") -> Teacher:
    """The teacher from `path` in eval mode, gradients off, in its stored dtype (see the module docstring)."""
    from recurrent_depth.families import retrofit
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    directory = find_teacher_dir(path)
    raw = read_json(directory / "config.json", CONFIG_MAX_BYTES, "teacher config")
    if not isinstance(raw, dict):
        raise ValueError(f"teacher: {directory / 'config.json'} is not a JSON object")
    dtype = stored_dtype(directory) or torch.float32
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in retrofit.SUPPORTED_MODEL_TYPES:  # a transformers model
        layers = raw.get("num_hidden_layers", 0)
        if not is_int(layers) or layers < 3:
            raise ValueError(f"teacher {directory} has num_hidden_layers={layers!r}: a non-recurrent teacher needs an "
                             f"integer of at least 3")
        if depth not in (None, 1):
            raise ValueError(f"teacher_depth={depth}: teacher {directory} is not recurrent (it runs at depth 1)")
        model = retrofit.retrofit(directory, prelude=1, core=(1, layers - 1), coda=1, mean_recurrence=1)
        run_depth = 1
    else:
        model = RecurrentDepthLM.from_pretrained(directory, dtype=dtype, device=device)
        run_depth = depth if depth is not None else max(1, round(model.config.mean_recurrence))
    model = model.to(device).eval()
    model.requires_grad_(False)
    tokenizer_dir = directory if (directory / "tokenizer.json").is_file() else None
    return Teacher(model, run_depth, directory, int(model.config.vocab_size), tokenizer_dir)


def check_vocabularies(teacher: Teacher, student_vocab: int, student_tokenizer: Path | None) -> None:
    """The same vocabulary size and, where both have a tokenizer, the same tokens; else a one-line error."""
    if teacher.vocab_size != student_vocab:
        raise ValueError(f"teacher {teacher.directory} has vocab_size {teacher.vocab_size}, the student "
                         f"{student_vocab}: distillation needs the same vocabulary")
    if teacher.tokenizer_dir is None or student_tokenizer is None:
        return
    if _vocabulary(teacher.tokenizer_dir) != _vocabulary(Path(student_tokenizer)):
        raise ValueError(f"teacher tokenizer {teacher.tokenizer_dir} differs from the student's "
                         f"{student_tokenizer}: distillation needs the same tokenizer")


def _vocabulary(directory: Path) -> dict[str, int]:
    from recurrent_depth.data.tokenizer import load_tokenizer

    return load_tokenizer(directory).get_vocab()


class Distillation:
    """The `Objective` of a distilled run: the student's forward at the trainer's depth draw, the teacher's
    at its own depth and generator, scored by `distillation_loss`."""

    def __init__(self, teacher: Teacher | None, *, alpha: float, temperature: float, top_k: int, seed: int,
                 position: Callable[[], int], cache: Any | None = None) -> None:
        if teacher is None and cache is None:
            raise ValueError("Distillation needs a teacher or a cache of its logits")
        self.teacher, self.alpha, self.temperature, self.top_k = teacher, alpha, temperature, top_k
        self.seed, self.position = seed, position
        self.cache = cache  # a distill_cache.CachedTeacher: the teacher's top-k read instead of computed
        self.last_ce: float | None = None
        self.last_kl: float | None = None

    def teacher_logits(self, input_ids: Tensor, position: int | None = None, **inputs: Any) -> Tensor:
        """The teacher's logits [B, T, V]; its generator is seeded by `position` (default: the trainer's).
        `inputs`: the batch's other model arguments (SFT's packed `position_ids`, `document_ids`)."""
        if self.teacher is None:
            raise ValueError("this distillation reads its teacher's logits from a cache")
        where = self.position() if position is None else position
        # the rows on the teacher's device: the cache writer reads them from CPU shards, the teacher may be on a GPU
        device = next(self.teacher.model.parameters()).device
        input_ids = input_ids.to(device)
        inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        generator = teacher_generator(self.seed, where, device)
        # In its stored dtype, as documented: not under the trainer's bf16 autocast (--dtype bf16), which the cache
        # writer runs outside of, so cached and on-the-fly targets differ only by the cache's fp16 rounding.
        # (a device without autocast, e.g. meta, has none to turn off)
        no_autocast = (torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type)
                       else contextlib.nullcontext())
        with torch.no_grad(), no_autocast:
            return self.teacher.model(input_ids, num_steps=self.teacher.depth, generator=generator, **inputs).logits

    def loss(self, model: nn.Module, batch: dict[str, Tensor], num_steps: NumSteps,
             generator: torch.Generator | None) -> tuple[Tensor, Any]:
        if "targets" not in batch:
            raise ValueError("distillation needs batches with `targets` (next-token ids)")
        inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "targets"}
        if num_steps is not None:
            inputs["num_steps"] = num_steps
            inputs["generator"] = generator
        output = model(**inputs)
        if self.cache is not None:
            values, indices = self.cache.top(batch)
            total, ce, kl = distillation_loss(output.logits, batch["targets"], teacher_top=(values, indices),
                                              alpha=self.alpha, temperature=self.temperature)
            self.last_ce, self.last_kl = float(ce.detach()), float(kl.detach())
            return total, output
        # the teacher reads the rows as the student does: packed SFT rows' positions and document mask too
        extra = {k: v for k, v in batch.items() if k not in ("input_ids", "targets")}
        teacher = self.teacher_logits(batch["input_ids"], **extra)
        if self.top_k:
            values, indices = teacher.float().topk(min(self.top_k, teacher.shape[-1]), dim=-1)
            total, ce, kl = distillation_loss(output.logits, batch["targets"], teacher_top=(values, indices),
                                              alpha=self.alpha, temperature=self.temperature)
        else:
            total, ce, kl = distillation_loss(output.logits, batch["targets"], teacher, alpha=self.alpha,
                                              temperature=self.temperature)
        self.last_ce, self.last_kl = float(ce.detach()), float(kl.detach())
        return total, output

    def scored_tokens(self, batch: dict[str, Tensor]) -> int | None:
        """Both terms of `distillation_loss` are means over the targets that are not -100."""
        return scored_tokens(batch)

    def loss_terms(self) -> dict[str, float]:
        """The last `loss` call's two terms, unmixed, for the trainer's metrics (`distill_ce`, `distill_kl`):
        loss = (1 - alpha) * distill_ce + alpha * T^2 * distill_kl."""
        if self.last_ce is None or self.last_kl is None:
            raise ValueError("Distillation.loss_terms: no loss was computed yet")
        return {"distill_ce": self.last_ce, "distill_kl": self.last_kl}



def teacher_summary(teacher: Teacher) -> dict[str, Any]:
    """What a cache records about the teacher that wrote it (`identity`: `checkpoint.model_identity`;
    `random_state`: its initial state is drawn at random, so the run seed and the rows drawn together fix its
    logits)."""
    return {"directory": str(teacher.directory), "depth": teacher.depth, "vocab_size": teacher.vocab_size,
            "identity": model_identity(teacher.directory),
            "random_state": getattr(teacher.model.config, "state_init", "random") == "random"}
