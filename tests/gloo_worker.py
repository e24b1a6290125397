"""Worker for tests/test_gloo_ranks.py: one rank of a 2-process CPU group (gloo, file store).

    python tests/gloo_worker.py RANK WORLD STORE_FILE OUT_DIR MODE[+MODE...] [ARGS...]

Modes:
  fsdp-clip CASES_JSON    for each {case: config overrides}: FSDP2-shard the fixed model of
                          `tests.test_qk_stability.clipped_weights`, run its training forward +
                          backward on this rank's rows, QK-clip the sharded weights; rank 0 saves the
                          unsharded weights, the clip record and the shard shapes it met.
  ddp-depth               locked-step, then per-rank depth draws (`DepthSampler(per_rank=...)`): 4 DDP
                          steps of the tiny model each; saves per step this rank's depth, its DDP
                          gradients, the gradients every rank computes alone on its own rows with an
                          unwrapped copy, and the weights after the step.
  lr-time-budget          the learning rate of a time-budgeted run with a cool-down, each rank's clock
                          running at another speed, and the stop reason when a stop_when hook
                          says stop on rank 1 only, and validation tokens under a final-evaluation
                          deadline that only rank 0 has passed; saves them.
  sft-heldout             SFT's held-out loss by depth on both ranks and on each rank alone; saves them.
  rl-ranks                2 GRPO updates through `build_rl` (`tests.test_rl.rl_updates`, 2 prompts a rank),
                          then one `rdepth rl` update: saves this rank's step records, completions, final
                          weights, and the command's exit code and stdout.
  token-mean              one Trainer step (DDP, 2 micro-batches) over this rank's masked rows, whose answer
                          tokens differ by rank: saves the gradient it stepped with and the step's loss.
  reasoning-ranks         the reasoning recipe's ProblemStream as this rank's share (rows right on rank 0,
                          wrong on rank 1), then 2 steps of its `_train`: saves the batches, the curriculum
                          each observe left, the rows trained on, the losses and the final weights.
  qk-warning              a Trainer (DDP) set up with QK-clip on a model with a shared QK-norm gain: saves the
                          warnings this rank's setup printed.
  peer-lost               a Trainer run whose rank 1 fails at its second batch (its own error), then leaves
                          the process (a crash): saves the exception each rank's run() raised. Last in a launch.
  resume-ranks            a Trainer run (tiny model, 2 steps, a checkpoint each, --depth-per-rank); then it
                          resumes where rank 1 alone fails to read the newest checkpoint's rng-rank1.safetensors
                          (an I/O error on its node): saves the depths each rank drew, metrics.jsonl, where each
                          rank resumed (or the error it raised) and what the resume logged.
  quickstart-lost         `rdepth quickstart --task chains` whose rank 0 dies (leaves the process) while it
                          prepares the output directory: saves rank 1's exit code and stderr. Last in a launch.
One launch runs every case, and modes joined by "+" run in one launch (process start-up dominates the time).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from recurrent_depth.train.distributed import DistEnv, full_model_state, wrap_model


def fsdp_clip(env: DistEnv, overrides: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from tests.test_qk_stability import clipped_weights

    shards = {}

    def wrap(model):
        wrapped = wrap_model(model, env, fsdp=True)
        for name, p in model.named_parameters():
            if ".attn." in name and isinstance(p, DTensor):
                shards[name] = (tuple(p.to_local().shape), tuple(p.shape), [str(x) for x in p.placements])
        return wrapped

    state, record = clipped_weights(rows=slice(env.rank, None, env.world_size), wrap=wrap,
                                    full_state=lambda m: full_model_state(m, env), **overrides)
    return {"state": state, "record": record, "shards": shards}


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def gathered(value: torch.Tensor, env: DistEnv) -> list[torch.Tensor]:
    parts = [torch.empty_like(value) for _ in range(env.world_size)]
    dist.all_gather(parts, value)
    return parts


def ddp_depth(env: DistEnv, per_rank: bool) -> list[dict]:
    import recurrent_depth as rd
    from recurrent_depth.train.depth import DepthSampler

    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).train()
    alone = copy.deepcopy(model)  # the same weights, never wrapped: what this rank computes by itself
    wrapped = wrap_model(model, env)
    sampler = DepthSampler(mean_recurrence=4, backprop_depth=2, seed=3, per_rank=per_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step in range(4):
        depth = sampler.sample(step, env.rank)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 * step + env.rank))
        wrapped(ids, labels=ids, num_steps=depth, init_scale=0.0).loss.backward()
        alone.load_state_dict(model.state_dict())
        alone.zero_grad(set_to_none=True)
        alone(ids, labels=ids, num_steps=depth, init_scale=0.0).loss.backward()
        records.append({"depth": list(depth), "ddp_grads": flat_grads(model).clone(),
                        "local_grads": gathered(flat_grads(alone), env)})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records[-1]["weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    return records


def lr_time_budget(env: DistEnv) -> list[float]:
    """The learning rates `Trainer.lr_for_step` gives under --max-minutes with a cool-down when this rank's clock
    says it ran slower than rank 0 (a bare Trainer: only what the schedule reads is set)."""
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import LoopState, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = TrainConfig(max_steps=None, max_minutes=1.0, optim=OptimConfig(lr=1e-3, cooldown_fraction=0.5))
    trainer.env, trainer.deadline, trainer.final_reserve_s, trainer.tokens_per_step = env, None, 0.0, None
    trainer.session_start_elapsed, trainer.session_steps = 0.0, 40
    trainer.state = LoopState(step=40, elapsed_s=40.0 + 4.0 * env.rank)  # rank 1: 1.1 s a step, rank 0: 1 s
    return [trainer.lr_for_step(40), trainer.lr_for_step(45)]


def stop_hook(env: DistEnv) -> list:
    """`Trainer.stop_reason` when the `stop_when` hook says stop on rank 1 only (a per-rank CPU-time budget)."""
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.trainer import LoopState, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.env, trainer.deadline, trainer.state = TrainConfig(max_steps=10), env, None, LoopState()
    trainer.stop_when = lambda t: "cpu_budget" if t.env.rank == 1 else None
    return [trainer.stop_reason()]


def eval_deadline(env: DistEnv) -> list[int]:
    """Validation tokens under a final-evaluation deadline that rank 0 has passed and rank 1 has not."""
    import time

    import recurrent_depth as rd
    from recurrent_depth.train.validation import validation_loss_by_depth

    class Rows:  # 16 rows of 9 tokens (a ShardDataset's interface: rows by storage index, batches in order)
        data = torch.arange(16 * 9).reshape(16, 9) * 7 % 256

        def __len__(self) -> int:
            return 16

        def rows(self, indices):
            return self.data[list(indices)]

        def iter_batches(self, batch_size: int, drop_last: bool = False):
            yield from self.data.split(batch_size)

    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    deadline = time.perf_counter() + (-1.0 if env.rank == 0 else 600.0)
    runs = [validation_loss_by_depth(model, Rows(), [1, 2], batch_size=2, max_batches=4, world_size=env.world_size,
                                     deadline=limit) for limit in (None, deadline)]
    # max_batches counts batches in all ranks: 3 batches on 2 ranks are the rows, tokens and loss of one process
    shared = validation_loss_by_depth(model, Rows(), [1, 2], batch_size=2, max_batches=3, world_size=env.world_size)
    alone = validation_loss_by_depth(model, Rows(), [1, 2], batch_size=2, max_batches=3)
    return [run.tokens for run in runs] + [(shared.tokens, shared.loss, shared.token_correlation),
                                           (alone.tokens, alone.loss, alone.token_correlation)]


def sft_heldout(env: DistEnv) -> list:
    """SFT's held-out loss on 2 ranks (each its share of the batches, sums all-reduced) and alone: 9 packed rows in
    5 batches of 2 (an odd count: rank 1 has none in the last round; the last batch has one row), and the same
    rows cut to 3 batches (max_batches)."""
    import recurrent_depth as rd
    from recurrent_depth.data.chat import Example
    from recurrent_depth.train import sft

    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in range(17):  # 9 rows
        ids = torch.randint(0, 256, (3 + n % 7,), generator=gen).tolist()
        examples.append(Example(ids, [i >= len(ids) // 2 for i in range(len(ids))]))
    rows = sft.pack_examples(examples, 12, pad_id=0)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    batches, losses = [], sft.batch_losses
    sft.batch_losses = lambda *args: batches.append(args[1]["input_ids"].shape[0]) or losses(*args)
    runs = []
    for max_batches in (5, 3):
        shared = sft.heldout_loss_by_depth(model, rows, [1, 3], batch_size=2, max_batches=max_batches,
                                           world_size=env.world_size, seed=4)
        sft.batch_losses, wrapped = losses, sft.batch_losses
        alone = sft.heldout_loss_by_depth(model, rows, [1, 3], batch_size=2, max_batches=max_batches, seed=4)
        sft.batch_losses = wrapped
        runs += [(run.tokens, run.loss, run.token_correlation) for run in (shared, alone)]
    sft.batch_losses = losses
    return [len(rows), batches, *runs]


def rl_ranks(env: DistEnv, out: Path) -> tuple:
    """`rdepth rl`'s trainer on this rank (it reads the ranks from torchrun's environment, which is set here), then
    one update of the command itself: what it printed on stdout."""
    import dataclasses
    import io

    import recurrent_depth as rd
    from recurrent_depth.cli import main
    from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
    from tests.test_rl import rl_updates

    with torchrun_environment(env):
        found = rl_updates(2)
        start = out / f"rl-start-rank{env.rank}"  # (the same seeded model on each rank)
        torch.manual_seed(7)
        rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288)).save_pretrained(
            start)
        byte_tokenizer().save(str(start / "tokenizer.json"))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = main(["rl", "--init-from", str(start), "--out", str(out / "rl-cli"), "--threads", "1",
                         "--difficulty", "2", "--group-size", "2", "--prompts-per-step", "1", "--updates", "1",
                         "--max-new-tokens", "2", "--num-steps", "2"])
    return (*found, code, printed.getvalue())


@contextlib.contextmanager
def torchrun_environment(env: DistEnv) -> Iterator[None]:
    """torchrun's environment for this rank, which the trainer and the recipes read their ranks from; the worker's
    own environment again afterwards (for the next mode)."""
    torchrun = {"WORLD_SIZE": str(env.world_size), "RANK": str(env.rank), "LOCAL_RANK": str(env.rank)}
    saved = {k: os.environ.get(k) for k in torchrun}
    os.environ.update(torchrun)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def token_mean(env: DistEnv) -> tuple:
    """One Trainer step (DDP, 2 micro-batches a rank) of the bigram model over this rank's 4 of the 8 masked rows
    of `tests.test_train_distributed`, whose answer tokens differ by rank: its gradient and loss."""
    from tests.test_train_distributed import masked_rows, trainer_step_gradient

    first = 4 * env.rank
    with torchrun_environment(env):
        return trainer_step_gradient([masked_rows(range(first, first + 2)), masked_rows(range(first + 2, first + 4))])


def fake_output(batch: dict, right: bool) -> types.SimpleNamespace:
    """Logits whose argmax is every label (`right`), or never one."""
    from recurrent_depth.evaluation.reasoning.data import BYTE_VOCAB_SIZE

    labels = batch["labels"].clamp(min=0)
    wanted = labels[:, 1:] if right else (labels[:, 1:] + 1) % BYTE_VOCAB_SIZE
    logits = torch.zeros(*labels.shape, BYTE_VOCAB_SIZE)
    logits[:, :-1].scatter_(-1, wanted.unsqueeze(-1), 1.0)
    return types.SimpleNamespace(logits=logits)


def reasoning_ranks(env: DistEnv, out: Path) -> tuple:
    """The reasoning recipe's `ProblemStream` as this rank's (3 rows a micro-batch), its rows right on rank 0 and
    wrong on rank 1 for its curriculum; then 2 steps of the recipe's `_train` under torchrun."""
    from recurrent_depth.evaluation.reasoning import train as recipe

    config = recipe.ReasoningRunConfig(task="chains", promote_at=0.5)
    curriculum = recipe.Curriculum(0, 6, True, promote_at=0.25, window=8)
    stream = recipe.ProblemStream(config, curriculum, rank=env.rank, world_size=env.world_size)
    batches, seen = [], []
    for _ in range(6):
        batch = stream.next_batch(3)
        batches.append(batch)
        seen.append((stream.observe(batch, fake_output(batch, right=env.rank == 0)), list(curriculum._hits)))
    trained = []  # the rows each rank trained on in `_train`
    serve = recipe.ProblemStream.next_batch
    recipe.ProblemStream.next_batch = lambda self, size: trained.append(serve(self, size)) or trained[-1]
    small = recipe.ReasoningRunConfig(task="chains", hidden_size=16, num_heads=2, intermediate_size=32, batch_size=4,
                                      max_steps=2, mean_recurrence=2, backprop_depth=1, out=str(out / "reasoning"))
    try:
        with torchrun_environment(env):
            result, _, trained_stream = recipe._train(small, log=lambda _: None)
    finally:
        recipe.ProblemStream.next_batch = serve
    weights = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    return (batches, seen, stream.promotions, trained, result.losses, weights,
            (trained_stream.rank, trained_stream.world_size))


def qk_warning(env: DistEnv) -> list[str]:
    """The warnings a DDP Trainer's setup gives on this rank with QK-clip on a model whose QK-norm gain the heads
    share (`QKClip` warns that it clips whole layers)."""
    import warnings

    import recurrent_depth as rd
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.test_train_distributed import masked_rows

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=16, qk_norm=True))
    cfg = TrainConfig(batch_size=2, max_steps=1, out=None, progress=False, tensorboard=False, qk_clip=50.0)
    with torchrun_environment(env), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg, model=model, data=types.SimpleNamespace(next_batch=lambda size: masked_rows(range(2))),
                log=lambda _: None).close()
    return [str(w.message) for w in caught]


def peer_lost(env: DistEnv) -> tuple[str, bool, str]:
    """A DDP Trainer run (the bigram model, 3 steps) whose rank 1 fails at its second batch: what `run()` raised on
    this rank (its type, whether an OSError, its message)."""
    from recurrent_depth.train.batches import BatchSource
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.test_train_distributed import bigram_model, masked_rows

    class Rows(BatchSource):
        served = 0

        def next_batch(self, batch_size: int) -> dict:
            self.served += 1
            if env.rank == 1 and self.served == 2:
                raise ValueError("a bad row on rank 1")
            return masked_rows(range(2 * env.rank, 2 * env.rank + 2))

    cfg = TrainConfig(batch_size=2, max_steps=3, out=None, progress=False, tensorboard=False,
                      optim=OptimConfig(name="adamw", lr=1e-3, warmup_steps=0))
    with torchrun_environment(env):
        trainer = Trainer(cfg, model=bigram_model(), data=Rows(), log=lambda _: None)
    try:
        trainer.run()
    except Exception as exc:  # noqa: BLE001 (what it was is the result)
        return type(exc).__name__, isinstance(exc, OSError), str(exc)
    return "nothing", False, ""


class StepRows:
    """Seeded token rows of the tiny model's vocabulary, resumable (its position is its state)."""

    summed_metrics: tuple[str, ...] = ()
    rank_mean_metrics: tuple[str, ...] = ()

    def __init__(self, rank: int) -> None:
        self.rank, self.served = rank, 0

    def next_batch(self, batch_size: int) -> dict:
        gen = torch.Generator().manual_seed(100 * self.served + self.rank)
        self.served += 1
        tokens = torch.randint(0, 16, (batch_size, 9), generator=gen)
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}

    def observe(self, batch: dict, output: object) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = int(state["served"])

    def describe(self) -> dict:
        return {"source": "step rows"}


def resume_ranks(env: DistEnv, out: Path) -> dict:
    """See the module's docstring (resume-ranks)."""
    import recurrent_depth as rd
    from recurrent_depth.train import checkpointing as ckpt
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer

    logged: list[str] = []

    def trainer(**overrides: object) -> Trainer:
        torch.manual_seed(0)
        model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=16))
        cfg = TrainConfig(**{**dict(batch_size=2, grad_accum=2, max_steps=2, save_every=1, keep_last=2,
                                    depth_per_rank=True, mean_recurrence=4, out=str(out / "resume"), progress=False,
                                    tensorboard=False, optim=OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)),
                             **overrides})
        return Trainer(cfg, model=model, data=StepRows(env.rank), log=logged.append)

    drawn: list = []
    with torchrun_environment(env):
        first = trainer()
        first.on_step = lambda _, record: drawn.append(record["num_steps"])
        first.run()
        first.close()
        metrics = (out / "resume" / "metrics.jsonl").read_text()
        newest = sorted((out / "resume" / "checkpoints").glob("step-*"))[-1]
        read = ckpt.read_tensors

        def fails_on_rank_1(path: Path) -> dict:
            if env.rank == 1 and path == newest / "rng-rank1.safetensors":
                raise OSError(f"[Errno 5] Input/output error: '{path}'")
            return read(path)

        ckpt.read_tensors, logged[:] = fails_on_rank_1, []
        try:
            second = trainer(max_steps=3, resume=True)
            resumed: object = (second.resume_from.name if second.resume_from else None, second.state.step)
            second.close()
        except Exception as exc:  # noqa: BLE001 (what it was is the result)
            resumed = (type(exc).__name__, str(exc))
        finally:
            ckpt.read_tensors = read
    return {"drawn": drawn, "metrics": metrics, "resumed": resumed, "logged": logged}


def quickstart_lost(env: DistEnv, out: Path) -> tuple[int, str]:
    """See the module's docstring (quickstart-lost): rank 1's exit code and stderr."""
    import io

    from recurrent_depth.cli import main
    from recurrent_depth.evaluation.reasoning import train as recipe

    if env.rank == 0:
        recipe.save_tokenizer = lambda *args, **kwargs: os._exit(0)  # (killed while it writes: no word to the others)
    said = io.StringIO()
    with torchrun_environment(env), contextlib.redirect_stderr(said):
        code = main(["quickstart", "--task", "chains", "--out", str(out / "quickstart"), "--threads", "1"])
    return code, said.getvalue()


def main() -> None:
    rank, world, store, out, modes, *args = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world),
                            timeout=timedelta(seconds=120))
    env = DistEnv(rank=int(rank), world_size=int(world), backend="gloo")
    try:
        for mode in modes.split("+"):
            run_mode(env, mode, out, args)
    finally:
        dist.destroy_process_group()


def run_mode(env: DistEnv, mode: str, out: str, args: list[str]) -> None:
    """One mode on this rank; saves its results under `out`."""
    if mode == "fsdp-clip":
        found = {case: fsdp_clip(env, overrides) for case, overrides in json.loads(args[0]).items()}
        if env.rank == 0:
            torch.save(found, Path(out) / "fsdp-clip.pt")
    elif mode == "ddp-depth":
        found = {flag: ddp_depth(env, flag == "per-rank") for flag in ("lock-step", "per-rank")}
        torch.save(found, Path(out) / f"ddp-depth-rank{env.rank}.pt")
    elif mode == "lr-time-budget":
        torch.save(lr_time_budget(env) + stop_hook(env) + eval_deadline(env), Path(out) / f"lr-rank{env.rank}.pt")
    elif mode == "sft-heldout":
        torch.save(sft_heldout(env), Path(out) / f"sft-heldout-rank{env.rank}.pt")
    elif mode == "rl-ranks":
        torch.save(rl_ranks(env, Path(out)), Path(out) / f"rl-ranks-rank{env.rank}.pt")
    elif mode == "token-mean":
        torch.save(token_mean(env), Path(out) / f"token-mean-rank{env.rank}.pt")
    elif mode == "reasoning-ranks":
        torch.save(reasoning_ranks(env, Path(out)), Path(out) / f"reasoning-ranks-rank{env.rank}.pt")
    elif mode == "qk-warning":
        torch.save(qk_warning(env), Path(out) / f"qk-warning-rank{env.rank}.pt")
    elif mode == "peer-lost":
        torch.save(peer_lost(env), Path(out) / f"peer-lost-rank{env.rank}.pt")
        os._exit(0)  # (a crash: the group is left without a word; nothing after this mode runs)
    elif mode == "resume-ranks":
        torch.save(resume_ranks(env, Path(out)), Path(out) / f"resume-ranks-rank{env.rank}.pt")
    elif mode == "quickstart-lost":
        torch.save(quickstart_lost(env, Path(out)), Path(out) / f"quickstart-lost-rank{env.rank}.pt")
        os._exit(0)  # (the group is broken: nothing after this mode runs)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    dist.barrier()


if __name__ == "__main__":
    main()
