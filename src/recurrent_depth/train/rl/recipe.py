"""`rdepth rl` as a function: a start model, a prompt source, a reward and an objective, run by the one `Trainer`.

    model, tokenizer, _ = load_start_model("runs/sft/model")
    result = run_rl(model, RLConfig(task="shells", difficulties=[3], objective="grpo"),
                    TrainConfig(out="runs/rl", max_steps=100, batch_size=4), tokenizer=tokenizer)

`TrainConfig.batch_size` is the number of prompts per optimizer step and rank (each with `group_size`
rollouts; under torchrun rank r makes its own share of each global batch), one optimizer step per
rollout batch (grad_accum 1), so pi_old is the policy that made the rollouts. The reference policy
(for GRPO's KL term) is a frozen copy of the start model.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
from recurrent_depth.evaluation.reasoning.tasks import get_task
from recurrent_depth.inference.options import OptionWarning
from recurrent_depth.train.config import TrainConfig, default_optim_preset
from recurrent_depth.train.rl.losses import GRPO, K2, LEVELS, check_variants
from recurrent_depth.train.rl.rewards import ShapedReward, get_reward
from recurrent_depth.train.rl.rollouts import ListPrompts, RolloutSettings, RolloutSource, TaskPrompts, chat_prompts

OBJECTIVES = ("grpo", "k2")


@dataclass
class RLConfig:
    """What `run_rl` trains for (the optimizer, steps, checkpoints and seed are the `TrainConfig`'s).

    task / difficulties: prompts from a reasoning task (`evaluation/reasoning`); prompts: a list of
    prompt texts instead, or of chat records (`{"messages": [...]}` or trl's `{"prompt": [...]}`, rendered with the
    tokenizer directory's chat template: `rollouts.chat_prompts`; a reward function that takes keyword arguments gets
    a record's other fields, `rewards.RewardKeywords`); prompt_names: the records' names in errors (FILE:LINE, as
    `rdepth rl --prompts` gives them; None: "prompt N"). reward: "task" (the task's checker) or a trusted
    "module:function".
    objective: "grpo" (clip_eps, clip_eps_high, beta, level, scale_rewards) or "k2" (tau); mask_truncated
    (both): a rollout cut by max_new_tokens carries no loss. generation: the rollouts' `generate` options
    (see `RolloutSettings`)."""

    task: str | None = "shells"
    difficulties: Sequence[int] = (3,)
    prompts: Sequence[str] | Sequence[dict[str, Any]] | None = None
    reward: str = "task"
    objective: str = "grpo"
    group_size: int = 4
    clip_eps: float = 0.2
    beta: float = 0.0
    level: str = "token"
    clip_eps_high: float | None = None
    scale_rewards: str = "group"
    mask_truncated: bool = False
    tau: float = 1.0
    compute_penalty: float = 0.0
    length_penalty: float = 0.0
    on_reward_error: str = "stop"
    backprop_depth: int | None = None
    generation: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 4, "do_sample": True})
    prompt_names: Sequence[str] | None = None  # (last: a field added after the others, which may be given by place)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is invalid: expected one of {OBJECTIVES}")
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is invalid: expected one of {LEVELS}")
        check_variants(self.clip_eps_high, self.mask_truncated, self.scale_rewards)  # (before the start model loads)
        if isinstance(self.group_size, int) and not isinstance(self.group_size, bool) and self.group_size == 1:
            raise ValueError("group_size=1 (--group-size) is invalid: an advantage is a reward minus its group's mean, "
                             "so a group of one rollout has advantage 0 and learns nothing; expected >= 2")
        # A setting of the other objective would be ignored (K2 has no clip and no KL term, GRPO no tau): refuse it.
        unused = ((("clip_eps", "clip-eps", 0.2), ("beta", "beta", 0.0), ("level", "kl-level", "token"),
                   ("clip_eps_high", "clip-eps-high", None), ("scale_rewards", "scale-rewards", "group"))
                  if self.objective == "k2" else (("tau", "tau", 1.0),))
        for name, flag, default in unused:
            if getattr(self, name) != default:
                other = "grpo" if self.objective == "k2" else "k2"
                raise ValueError(f"{name}={getattr(self, name)!r} (--{flag}) is a setting of objective={other!r}: "
                                 f"objective={self.objective!r} does not use it (leave it out)")
        if self.task is None and self.prompts is None:
            raise ValueError("RLConfig needs prompts: a reasoning task (task=) or a list of prompts (prompts=)")
        if self.prompts is not None and len({isinstance(p, dict) for p in self.prompts}) > 1:
            raise ValueError("prompts= mixes texts and chat records: give prompt texts, or chat records only")


# Run settings added after checkpoints first recorded `run`: a checkpoint without one ran with its default.
ADDED_RUN_SETTINGS = ("clip_eps_high", "scale_rewards", "mask_truncated")


def load_start_model(directory: str | Path) -> tuple[Any, Any, Path]:
    """The model to start RL from, its tokenizer and the tokenizer's directory: `directory` read as
    `--init-from` reads it (a model directory, a run directory holding model/, or an official Huginn-0125
    directory; train/init_from.py), in float32."""
    from recurrent_depth.data.tokenizer import load_tokenizer
    from recurrent_depth.train.init_from import load_for_training, resolved_config

    start = load_for_training(resolved_config(TrainConfig(init_from=str(directory))))
    return start.model, load_tokenizer(start.tokenizer_dir), start.tokenizer_dir


class NoDepthDraw:
    """The trainer's depth draw for RL: none (each token replays the depth its rollout chose)."""

    def sample(self, step: int, rank: int = 0) -> None:
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": "rollout depths (replayed per token)"}


def build_rl(model: Any, rl: RLConfig, train: TrainConfig, *, tokenizer: Any = None,
             log: Callable[[str], None] | None = None, **trainer_kwargs: Any) -> Any:
    """The `Trainer` of an RL run (not started): rollout source, objective and reference wired up."""
    from recurrent_depth.train import distributed as ddist
    from recurrent_depth.train.lora import is_peft_model
    from recurrent_depth.train.trainer import Trainer

    log = log if log is not None else (lambda line: print(line, file=sys.stderr))
    # the ranks under torchrun, before the rollout source: each rank makes its own share of every batch
    joined = not ddist.group_initialized()
    env = ddist.init_distributed(trainer_kwargs.get("device"))
    task = get_task(rl.task) if rl.task is not None else None
    prompts = (TaskPrompts(task, list(rl.difficulties)) if rl.prompts is None
               else chat_prompts(rl.prompts, _tokenizer_dir(trainer_kwargs), model.config, rl.prompt_names)
               if rl.prompts and isinstance(rl.prompts[0], dict) else ListPrompts(list(rl.prompts)))
    settings = RolloutSettings(group_size=rl.group_size, generation=dict(rl.generation),
                               backprop_depth=rl.backprop_depth, seed=train.seed)
    with warnings.catch_warnings():  # (RolloutSource validates them again below and says each warning there once)
        warnings.simplefilter("ignore", OptionWarning)
        options = settings.options(model)
    # (env: under torchrun, --scale-rewards batch takes the std of every rank's rewards)
    objective = (GRPO(settings, clip_eps=rl.clip_eps, beta=rl.beta, level=rl.level, clip_eps_high=rl.clip_eps_high,
                      scale_rewards=rl.scale_rewards, mask_truncated=rl.mask_truncated, env=env)
                 if rl.objective == "grpo" else K2(settings, tau=rl.tau, mask_truncated=rl.mask_truncated))
    reward = ShapedReward(get_reward(rl.reward, task), max_depth=options.deepest_step,
                          max_new_tokens=options.max_new_tokens, compute_penalty=rl.compute_penalty,
                          length_penalty=rl.length_penalty, on_error=rl.on_reward_error, log=log)
    reference = copy.deepcopy(model) if objective.needs_reference else None
    run = {"task": rl.task if rl.prompts is None else None,
           "difficulties": [int(d) for d in rl.difficulties] if rl.prompts is None else None,
           "prompts_sha256": None if rl.prompts is None else hashlib.sha256(
               json.dumps(list(rl.prompts)).encode()).hexdigest(),
           "reward": rl.reward, "objective": rl.objective, "clip_eps": rl.clip_eps, "beta": rl.beta,
           "level": rl.level, "tau": rl.tau, "compute_penalty": rl.compute_penalty,
           "length_penalty": rl.length_penalty, "on_reward_error": rl.on_reward_error,
           # (an upper clip equal to the lower one is the symmetric clip: recorded as None, as when left out)
           "clip_eps_high": None if rl.clip_eps_high == rl.clip_eps else rl.clip_eps_high,
           "scale_rewards": rl.scale_rewards, "mask_truncated": rl.mask_truncated}
    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig) if f.name in ADDED_RUN_SETTINGS}
    source = RolloutSource(model, prompts, reward, settings, encoder=ProblemEncoder(tokenizer), reference=reference,
                           log=log, run=run, run_defaults=defaults, rank=env.rank, world_size=env.world_size)
    if train.grad_accum != 1:
        raise ValueError(f"RL takes one optimizer step per rollout batch: grad_accum must be 1, got {train.grad_accum}")
    train, preset = start_model_optim(train, lora=is_peft_model(model))
    if train.init_from is None:  # (with one, the Trainer settles its optimizer and says which)
        named = f"the {preset} preset (the run names no optimizer preset or lr), " if preset is not None else ""
        log(f"optimizer: {named}{train.optim.name}, lr {train.optim.lr:g}")
    trainer_kwargs.setdefault("budget_flags", "--updates (TrainConfig.max_steps)")  # (rl's --max-steps: the exit's)
    trainer = Trainer(train, model=model, data=source, objective=objective, depth=NoDepthDraw(), log=log,
                      **trainer_kwargs)
    trainer.adopt_group(joined)  # (the group joined here is the trainer's to leave: close())
    return trainer


def _tokenizer_dir(trainer_kwargs: dict[str, Any]) -> Path:
    """The tokenizer directory whose chat template renders chat prompts (`build_rl`'s `tokenizer_dir=`)."""
    directory = trainer_kwargs.get("tokenizer_dir")
    if directory is None:
        raise ValueError("chat prompts are rendered with a tokenizer directory's chat template: pass tokenizer_dir= "
                         "(load_start_model returns it)")
    return Path(directory)


def start_model_optim(train: TrainConfig, lora: bool) -> tuple[TrainConfig, str | None]:
    """`train` with the optimizer of a run from a model directory: RL always starts from a trained model, so a
    config that names no optimizer preset and no lr gets the fine-tuning preset (finetune-lora for a peft model)
    that `train/config.py` gives such runs, not the from-scratch demo's lr 3e-3 (its `init_from` is None here).
    Returns the config and the preset chosen (None: the config named its optimizer)."""
    if train.optim_default is None or train.init_from is not None:
        return train, None
    preset = default_optim_preset(from_model=True, lora=lora)
    return train.with_optim_preset(preset), preset


def run_rl(model: Any, rl: RLConfig, train: TrainConfig, **kwargs: Any) -> Any:
    """Build (`build_rl`) and run an RL training; returns the `TrainResult`. The Trainer is closed after its run, as
    `rdepth rl` closes it (its logs, and a process group it joined under torchrun)."""
    with build_rl(model, rl, train, **kwargs) as trainer:
        return trainer.run()
