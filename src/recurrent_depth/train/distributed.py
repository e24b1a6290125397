"""Data parallelism applied from outside the model: torchrun DDP, or FSDP2 (`fully_shard`).

    torchrun --standalone --nproc_per_node=2 -m recurrent_depth.cli train --preset tiny ...

`init_distributed` reads torchrun's environment (gloo on CPU, nccl on GPU); without it every
function here is a no-op for a single process. The model itself knows nothing of this module.
Depth is locked-step: every rank draws the same (no_grad, grad) steps for the same micro-batch
from `DepthSampler(seed).sample(step)`, so all ranks run the same graph and DDP's gradient
all-reduce matches up; each rank reads disjoint rows (`ShardDataset(rank, world_size)`).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits. `world_size == 1` means no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str | None = None) -> DistEnv:
    """Join torchrun's process group if its environment is set; pick the device.

    device: None = "cuda:<local_rank>" when CUDA is available, else "cpu"; under torchrun "cuda" without an index is
    this rank's GPU, "cuda:<local_rank>" too.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if world <= 1:
        return DistEnv(device=dev)
    if dev.type == "cuda" and dev.index is None:  # (set_device("cuda") would put every rank on GPU 0)
        dev = torch.device("cuda", local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def shutdown(env: DistEnv, owner: Any = None) -> None:
    """Leave the process group.

    owner: an object (a `Trainer`) whose `wrapped` attribute may be a DDP wrapper: it is replaced by the model
    inside and freed first. DDP's C++ reducer holds the process group; freed after `destroy_process_group`, it
    runs the gloo group's destructor with the GIL held, which joins gloo's worker threads while one of them may
    wait for the GIL to free the tensors of a finished collective: a hang at exit, now and then, on some rank.
    """
    if owner is not None:
        release_ddp(owner)
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()


def release_ddp(owner: Any) -> bool:
    """Replace `owner.wrapped`, if a DDP wrapper, by the model inside and free the wrapper now (see `shutdown`);
    whether there was one to free."""
    if not isinstance(getattr(owner, "wrapped", None), nn.parallel.DistributedDataParallel):
        return False
    owner.wrapped = unwrap(owner.wrapped)
    gc.collect()  # (a DDP wrapper caught in a reference cycle goes now, while the group is alive)
    return True


class PeerLost(ConnectionError):
    """A collective failed because another rank of the run failed or stopped answering: that rank prints its own
    error; this one ends with one line (an OSError: `rdepth CMD: error: ...`), not gloo's 30-line traceback."""


# In the message of every failure of gloo's transport (a connection closed or reset by a peer, a receive timed out):
# the collective failed for want of another rank, not for anything this rank did.
GLOO_TRANSPORT = "gloo/transport/"


def peer_lost(exc: BaseException, env: DistEnv) -> PeerLost | None:
    """`exc` as a one-line `PeerLost` when it is a collective's failure for want of another rank; None otherwise."""
    if not env.enabled or not isinstance(exc, RuntimeError) or GLOO_TRANSPORT not in str(exc):
        return None
    return PeerLost(f"rank {env.rank} stopped: another rank of this run failed or stopped answering and left the "
                    "process group (that rank's own error says why)")


@contextlib.contextmanager
def one_line_if_peer_lost(env: DistEnv) -> Iterator[None]:
    """The collectives inside end with `PeerLost` (one line) where they fail for want of another rank
    (`peer_lost`); any other error as it is."""
    try:
        yield
    except RuntimeError as exc:
        lost = peer_lost(exc, env)
        if lost is None:
            raise
        raise lost from exc


def group_initialized() -> bool:
    """Whether this process is in a default process group already."""
    return dist.is_available() and dist.is_initialized()


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


# How long the other ranks wait for rank 0's data preparation (a process group's own timeout, 30 minutes by default,
# would end them while rank 0 still tokenizes a large corpus).
PREPARE_TIMEOUT = timedelta(hours=24)


def run_on_main(env: DistEnv, what: str, fn: Callable[[], Any], timeout: timedelta = PREPARE_TIMEOUT,
                share: bool = False) -> Any:
    """`fn()` on rank 0 while the other ranks wait (up to `timeout`): its result on rank 0; elsewhere None, or with
    `share` a copy of rank 0's result (pickled).

    what: the work, named in the other ranks' error when `fn` raises on rank 0 ("prepare the token shards"): rank 0
    raises its own exception, the others a one-line ValueError at once (not a hang until the timeout). The wait is a
    broadcast on a gloo group made for it (CPU, with `timeout`), destroyed before returning.
    """
    if not env.enabled:
        return fn()
    with one_line_if_peer_lost(env):  # (a rank that died, e.g. rank 0 killed while it prepares: one line here)
        dist.barrier()  # every rank is here (a rank gone already fails this; the new group would wait its timeout)
        group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        if not env.is_main:
            box: list[Any] = [None, None]  # (rank 0's error, its result when shared)
            with one_line_if_peer_lost(env):
                dist.broadcast_object_list(box, src=0, group=group)
            if box[0] is not None:
                raise ValueError(f"rank 0 failed to {what}: {box[0]}")
            return box[1]
        try:
            result = fn()
        except BaseException as exc:
            message = " ".join(f"{type(exc).__name__}: {exc}".split())  # (one line)
            with contextlib.suppress(RuntimeError):  # (the others gone too: rank 0's own error still says why)
                dist.broadcast_object_list([message, None], src=0, group=group)
            raise
        with one_line_if_peer_lost(env):
            dist.broadcast_object_list([None, result if share else None], src=0, group=group)
        return result
    finally:
        dist.destroy_process_group(group)


def summed_over_ranks(values: Any, dtype: torch.dtype, env: DistEnv) -> torch.Tensor:
    """`values` (numbers, nested lists of them) as a CPU tensor of `dtype`, summed over the ranks (one all-reduce, on
    the device NCCL needs)."""
    t = torch.tensor(values, dtype=dtype, device=env.device if env.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.cpu()


def mean_across_ranks(value: float, env: DistEnv) -> float:
    """The mean of a Python float over ranks (float64 all-reduce)."""
    if not env.enabled:
        return value
    return float(summed_over_ranks([value], torch.float64, env)[0]) / env.world_size


def sum_across_ranks(value: int, env: DistEnv) -> int:
    """The sum of a Python int over ranks (int64 all-reduce)."""
    if not env.enabled:
        return value
    return int(summed_over_ranks([value], torch.int64, env)[0])


def max_across_ranks(value: int, env: DistEnv) -> int:
    """The largest of a Python int over ranks (int64 all-reduce): what any one rank saw reaches them all."""
    if not env.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=env.device if env.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.cpu()[0])


def reduce_metrics(values: dict[str, Any], summed: Sequence[str], averaged: Sequence[str],
                   env: DistEnv) -> dict[str, Any]:
    """`values` (this rank's metrics) with the `summed` keys summed and the `averaged` keys averaged over the ranks;
    a rank whose value is None (or absent) is left out of both, and a key no rank has stays as it is. Every rank
    must call it with the same keys (one float64 all-reduce); the other keys are this rank's."""
    keys = [*summed, *averaged]
    if not env.enabled or not keys:
        return values

    def number(key: str) -> bool:
        return isinstance(values.get(key), int | float) and not isinstance(values.get(key), bool)

    t = summed_over_ranks([[float(values[k]), 1.0] if number(k) else [0.0, 0.0] for k in keys], torch.float64, env)
    out = dict(values)
    for key, (total, count) in zip(keys, t.tolist(), strict=True):
        if count == 0:
            continue
        if key in summed:
            out[key] = int(total) if isinstance(values.get(key), int) else total
        else:
            out[key] = total / count
    return out


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's `obj` on every rank."""
    if not env.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every_rank(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's `obj` (picklable), by rank, on every rank (`all_gather_object`); `[obj]` for one process."""
    if not env.enabled:
        return [obj]
    found: list[Any] = [None] * env.world_size
    dist.all_gather_object(found, obj)
    return found


def wrap_model(model: nn.Module, env: DistEnv, fsdp: bool = False) -> nn.Module:
    """The module the training loop calls: `model` itself, DDP around it, or `model` FSDP2-sharded.

    FSDP2 shards each prelude/core/coda block, then the root (embedding, adapter, final norm);
    `fully_shard` modifies `model` in place and the core block stays one unit reused at every step.
    """
    if not env.enabled:
        if fsdp:
            raise ValueError("fsdp=True needs several processes: launch with torchrun --nproc_per_node=N")
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for part in ("prelude", "core_block", "coda"):
            for block in model.transformer[part]:
                fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [env.device.index] if env.device.type == "cuda" else None
    # (the search for unused parameters walks the autograd graph every step, and DDP warns where it finds none:
    # only for a model that needs it)
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=loss_may_skip_parameters(model))


def loss_may_skip_parameters(model: nn.Module) -> bool:
    """Whether a training forward of `model` may leave trainable parameters out of the loss. DDP must then look for
    them every step; otherwise it waits for their gradients and fails the next step ("Expected to have finished
    reduction in the prior iteration"). So it is with an exit gate (Ouro's, read at inference only), a DSA indexer
    without its own loss (its top-k choice passes no gradient), and an embedding and prelude that reach the
    recurrence only as s0 (`state_init="embedding"` without input injection), which a depth draw with
    no-gradient steps detaches. A LoRA (peft) wrapper's frozen base counts only where it trains."""
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    skipped: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, RecurrentDepthLM):
            config = module.config
            if config.exit_gate:
                skipped.append(module.transformer.exit_gate)
            if config.state_init == "embedding" and config.injection == "none":
                skipped += [module.transformer[k] for k in ("wte", "prelude", "ln_prelude") if k in module.transformer]
        elif getattr(module, "indexer_loss", None) is False:  # (a DSA mixer)
            skipped.append(module.indexer)
    return any(p.requires_grad for part in skipped for p in part.parameters())


@contextlib.contextmanager
def gradient_sync(wrapped: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce/reduce-scatter for accumulation micro-batches (`enabled=False`)."""
    if enabled:
        yield
        return
    if hasattr(wrapped, "no_sync"):  # DDP
        with wrapped.no_sync():
            yield
        return
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)
        return
    yield


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place, so its module is the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def full_model_state(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict (on every rank for DDP/single; on rank 0 for FSDP, empty elsewhere)."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Load an unsharded state dict (tied `lm_head.weight` may be absent) into `model`."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = dict(state)
        if "lm_head.weight" not in state and "transformer.wte.weight" in state:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def optimizer_state(model: nn.Module, optimizer: Any, env: DistEnv) -> dict[str, Any]:
    """The optimizer state to save: the OptimizerSet's own dict, or for FSDP the full FQN-keyed one."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            model, list(optimizer), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    return optimizer.state_dict()


def load_optimizer_state(model: nn.Module, optimizer: Any, state: dict[str, Any], env: DistEnv) -> None:
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            model, list(optimizer), state, options=StateDictOptions(full_state_dict=True)
        )
        return
    optimizer.load_state_dict(state)
