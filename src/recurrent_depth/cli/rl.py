"""`rdepth rl`: reinforcement learning whose rollouts choose their own depth (GRPO or Kimi K2's objective).

    rdepth rl --init-from runs/sft/model --out runs/rl --task shells --difficulty 3 \\
        --objective grpo --group-size 8 --prompts-per-step 4 --updates 200 \\
        --num-steps 16 --exit-criterion kl --kv-policy per-step+deepest --top-k 20 --max-new-tokens 4

Rollouts go through `generate` with every generation flag below (the same flags as `rdepth
generate`, from the options schema); each token's depth is recorded, handed to the reward and
replayed by the training forward. --seed seeds the whole run (prompts and rollouts). A checkpoint
every --save-every updates; --resume continues the run where its last checkpoint left it, making
the same rollouts an uninterrupted run would. docs/post-training.md (## RL) describes the method.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from recurrent_depth.cli.common import add_max_depth_arg, int_list

ROLLOUT_MAX_NEW_TOKENS = 8  # the reasoning tasks' answers are a few tokens; --max-new-tokens overrides


def register(subparsers: argparse._SubParsersAction) -> None:
    from recurrent_depth.evaluation.reasoning.tasks import TASKS
    from recurrent_depth.inference.schema import add_cli_arguments
    from recurrent_depth.train.lora import add_lora_arguments
    from recurrent_depth.train.optim import OPTIMIZERS
    from recurrent_depth.train.rl.losses import LEVELS, LOSS_TYPES, SCALES
    from recurrent_depth.train.rl.recipe import OBJECTIVES
    from recurrent_depth.train.rl.rewards import ON_ERROR

    p = subparsers.add_parser(
        "rl", help="RL (GRPO or K2) with rollouts that choose their own depth, replayed at those depths",
        description="Post-train a model with reinforcement learning: G rollouts per prompt through the generation "
        "runtime (exit criterion, KV policy and sampling as given), rewards from a reasoning task's checker or your "
        "own function, and a GRPO or Kimi K2 update that recomputes log-probs at each token's recorded depth.",
    )
    p.add_argument("--init-from", required=True, metavar="DIR",
                   help="the model directory to start from (tokenizer inside)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run directory: metrics, checkpoints, final model (one run at a time: a second one "
                        "started on it meanwhile is refused)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    d = p.add_argument_group("prompts and rewards")
    d.add_argument("--task", default="shells", choices=sorted(TASKS),
                   help="reasoning task of the prompts (default: %(default)s)")
    d.add_argument("--difficulty", type=int_list, default=[3], metavar="N[,N...]",
                   help="task difficulties, one drawn per prompt (default: 3)")
    d.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts instead of --task (then --reward must be a function): a text file, one per line, "
                        "or chat prompts in FILE.jsonl, one {\"messages\": [...]} (or trl's {\"prompt\": [...]}) "
                        "per line, rendered with the chat template and its generation prompt; a chat rollout "
                        "ends at the turn's end")
    d.add_argument("--reward", default="task", metavar="task|MODULE:FUNCTION",
                   help="'task' (the task's checker: 1 for the right answer) or your function "
                        "f(prompt: str, completion: str, depths: list[int]) -> float, imported and run in this "
                        "process as TRUSTED code; one that also takes keyword arguments (named ones, e.g. answer, "
                        "or **kwargs) gets a FILE.jsonl record's other fields, as trl's reward functions get a "
                        "row's other columns (default: %(default)s)")
    d.add_argument("--compute-penalty", type=float, default=0.0, metavar="W",
                   help="subtract W * mean token depth / max depth from each reward (default: 0)")
    d.add_argument("--length-penalty", type=float, default=0.0, metavar="W",
                   help="subtract W * completion tokens / max-new-tokens from each reward (default: 0)")
    d.add_argument("--on-reward-error", default="stop", choices=ON_ERROR,
                   help="when the reward function raises: stop the run, score the rollout 0, or leave it out "
                        "(default: %(default)s; each failure is reported with its input)")
    o = p.add_argument_group("objective")
    o.add_argument("--objective", default="grpo", choices=OBJECTIVES,
                   help="grpo (clipped ratio) or k2 (default: %(default)s)")
    o.add_argument("--group-size", type=int, default=4, metavar="G", help="rollouts per prompt (default: %(default)s)")
    o.add_argument("--prompts-per-step", type=int, default=4, metavar="P",
                   help="prompts per update and rank; the update sees P * G rollouts (under torchrun, each rank "
                        "its own P of the world size x P) (default: %(default)s)")
    o.add_argument("--clip-eps", type=float, default=0.2,
                   help="GRPO's ratio clip [1 - eps, 1 + eps] (trl's epsilon) (default: %(default)s)")
    o.add_argument("--clip-eps-high", type=float, default=None, metavar="EPS",
                   help="GRPO's upper clip 1 + EPS, DAPO's clip-higher, e.g. 0.28 (trl's epsilon_high) "
                        "(default: --clip-eps)")
    o.add_argument("--beta", type=float, default=0.0, help="GRPO's KL weight against the start model (default: 0)")
    o.add_argument("--kl-level", default=None, choices=LEVELS,
                   help="GRPO's normalisation: over all tokens (token), per rollout then over rollouts (sequence), "
                        "over every rank's tokens (global-token), or per rollouts x --max-new-tokens (constant, "
                        "Dr. GRPO) (default: token)")
    o.add_argument("--loss-type", default=None, choices=sorted(LOSS_TYPES),
                   help="the --kl-level by trl's loss_type name: "
                        + ", ".join(f"{name}={level}" for name, level in LOSS_TYPES.items())
                        + " (default: none, --kl-level decides)")
    o.add_argument("--scale-rewards", default="group", choices=SCALES,
                   help="GRPO's advantage divisor: the std of the group's rewards, of the batch's, or none "
                        "(Dr. GRPO) (trl's scale_rewards) (default: %(default)s)")
    o.add_argument("--mask-truncated", action="store_true",
                   help="rollouts cut by --max-new-tokens before a stop carry no loss (DAPO; trl's "
                        "mask_truncated_completions)")
    o.add_argument("--tau", type=float, default=1.0, help="K2's ratio weight (default: %(default)s)")
    o.add_argument("--backprop-depth", type=int, default=None, metavar="K",
                   help="gradients through each token's last K core steps (default: the model's mean_backprop_depth)")
    t = p.add_argument_group("optimisation")
    t.add_argument("--updates", type=int, default=100, metavar="N", help="optimizer steps (default: %(default)s)")
    t.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="(default: %(default)s)")
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: the finetune presets' 1e-5, 1e-4 with --lora)")
    t.add_argument("--save-every", type=int, default=10, metavar="N",
                   help="checkpoint every N updates (default: %(default)s)")
    t.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    t.add_argument("--json", action="store_true", help="print the run's summary as one JSON object")
    add_lora_arguments(p)  # (the adapter is trained on --init-from DIR)
    add_max_depth_arg(p)
    add_cli_arguments(p)  # the rollouts' generation options, as `rdepth generate` declares them
    p.set_defaults(func=run)


def rollout_generation(args: argparse.Namespace) -> tuple[dict, int]:
    """The rollouts' `generate` options from the generation flags, and the run seed (--seed, default 0)."""
    from recurrent_depth.cli.common import check_depth_flags
    from recurrent_depth.cli.generate import _generation_kwargs

    check_depth_flags(args, ("num_steps", "max_steps"))
    values, _ = _generation_kwargs(args)
    seed = values.pop("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed={seed!r} is invalid: the run seed is one integer >= 0")
    values.setdefault("max_new_tokens", ROLLOUT_MAX_NEW_TOKENS)
    values.setdefault("do_sample", True)
    return values, seed


MAX_PROMPTS_BYTES = 64 << 20


def read_prompts(path: str) -> tuple[list[str] | list[dict[str, Any]], list[str] | None]:
    """--prompts FILE: its lines, or for FILE.jsonl its chat records, checked (a bad one named FILE:LINE), and the
    records' FILE:LINE names (None for a text file), for the errors found once the chat template renders them."""
    from recurrent_depth.files import read_text

    if path.endswith(".jsonl"):
        from recurrent_depth.data.chat import check_records_path, prompt_conversation, read_records

        if check_records_path(path, "--prompts file").stat().st_size > MAX_PROMPTS_BYTES:
            raise ValueError(f"--prompts {path}: the file is over {MAX_PROMPTS_BYTES} bytes")
        records, names = [], []
        for where, record in read_records(path):
            prompt_conversation(record, where)  # (its other fields: `check_reward_fields`, which --prompts needs)
            records.append(record)
            names.append(where)
        if not records:
            raise ValueError(f"--prompts {path}: the file holds no chat record (one per line)")
        return records, names
    lines = [line for line in read_text(Path(path), MAX_PROMPTS_BYTES, "--prompts file").splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {path}: the file holds no prompt (one per line)")
    return lines, None


def check_reward_fields(keywords: Any, prompts: list[str] | list[dict[str, Any]] | None,
                        names: list[str] | None) -> None:
    """`RewardKeywords.check` of each prompt (`read_prompts`'): a record's fields by its FILE:LINE, a text line's or
    the task's (none)."""
    from recurrent_depth.data.chat import prompt_fields
    from recurrent_depth.train.rl.rollouts import prompt_name

    if prompts is None:
        keywords.check(None, "task prompts")
    for i, prompt in enumerate(prompts or []):
        where = prompt_name(names, i)
        keywords.check(prompt_fields(prompt, where) if isinstance(prompt, dict) else None, where)


def loss_level(args: argparse.Namespace) -> str:
    """GRPO's normalisation from --kl-level or its trl name --loss-type (one of them, or both agreeing)."""
    from recurrent_depth.train.rl.losses import LOSS_TYPES

    if args.loss_type is None:
        return args.kl_level or "token"
    if args.objective != "grpo":
        raise ValueError(f"--loss-type {args.loss_type} is a setting of objective='grpo': "
                         f"objective={args.objective!r} does not use it (leave it out)")
    level = LOSS_TYPES[args.loss_type]
    if args.kl_level is not None and args.kl_level != level:
        raise ValueError(f"--loss-type {args.loss_type} is --kl-level {level}, not --kl-level {args.kl_level}: "
                         "give one of them")
    return level


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.checkpoint import usable_device
    from recurrent_depth.train.config import TrainConfig, default_optim_preset
    from recurrent_depth.train.lora import lora_spec_from_args
    from recurrent_depth.train.optim import OPTIM_PRESETS, OptimConfig
    from recurrent_depth.train.rl.recipe import RLConfig, build_rl, load_start_model

    usable_device(args.device)  # before the model loads (--device nan was a traceback from model.to)
    generation, seed = rollout_generation(args)
    prompts, names = read_prompts(args.prompts) if args.prompts else (None, None)
    if prompts is not None and args.reward == "task":
        raise ValueError("--prompts has no task checker: give --reward MODULE:FUNCTION")
    if prompts is not None and (args.task != "shells" or args.difficulty != [3]):  # (else they were ignored)
        raise ValueError("--task and --difficulty choose a reasoning task's prompts, which --prompts replaces: "
                         "give one or the other")
    rl = RLConfig(task=None if prompts else args.task, difficulties=args.difficulty, prompts=prompts,
                  prompt_names=names,
                  reward=args.reward, objective=args.objective, group_size=args.group_size, clip_eps=args.clip_eps,
                  clip_eps_high=args.clip_eps_high, beta=args.beta, level=loss_level(args),
                  scale_rewards=args.scale_rewards, mask_truncated=args.mask_truncated, tau=args.tau,
                  compute_penalty=args.compute_penalty,
                  length_penalty=args.length_penalty, on_reward_error=args.on_reward_error,
                  backprop_depth=args.backprop_depth, generation=generation)
    lora = lora_spec_from_args(args)
    # (no --lr: the rate of the fine-tuning preset of a run from a model directory, for every weight or an adapter)
    lr = args.lr if args.lr is not None else OPTIM_PRESETS[default_optim_preset(True, lora is not None)].lr
    train = TrainConfig(out=args.out, max_steps=args.updates, batch_size=args.prompts_per_step, seed=seed,
                        optim=OptimConfig(name=args.optimizer, lr=lr), save_every=args.save_every,
                        resume=args.resume, progress=False, tensorboard=False)
    from recurrent_depth.checkpoint import stored_dtype
    from recurrent_depth.train.init_from import find_model_dir
    from recurrent_depth.train.trainer import check_out_state

    check_out_state(args.out, args.resume)  # (a wrong --out, or --reward module, named before the model loads)
    if args.reward != "task":  # (imported once: build_rl's import finds it loaded)
        from recurrent_depth.train.rl.rewards import RewardKeywords, load_reward_function

        keywords = RewardKeywords.of(load_reward_function(args.reward))
        # (a field it takes that a record lacks, also named before the model loads; RolloutSource checks it again)
        check_reward_fields(keywords, prompts, names)
    model, tokenizer, tokenizer_dir = load_start_model(args.init_from)
    if args.max_depth is not None:  # (the library's own ceiling, MAX_NUM_STEPS: --max-depth raises it)
        model.max_depth = args.max_depth
    start_dir = find_model_dir(args.init_from)
    if lora is not None:
        from recurrent_depth.train.lora import add_lora

        model = add_lora(model, lora, base_dir=start_dir, seed=seed)
    # trained in float32 and written back in --init-from's stored dtype, as `train` / `sft --init-from` do;
    # start_dir's identity is recorded, so that --resume from another model directory is refused
    # (closing the trainer leaves the process group it joined under torchrun; rank 0 prints the summary)
    rewards: list[float] = []  # (this session's updates' mean rewards: the summary says where they went)

    def note_reward(_: Any, record: dict[str, Any]) -> None:
        if record.get("reward_mean") is not None:
            rewards.append(float(record["reward_mean"]))

    with build_rl(model.to(args.device), rl, train, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                  device=args.device, save_dtype=stored_dtype(start_dir), start_dir=start_dir,
                  on_step=note_reward) as trainer:
        result = trainer.run()
        prints = trainer.env.is_main
    summary = {"out": str(result.out), "updates": result.steps, "model": str(result.model_dir),
               "last_checkpoint": str(result.last_checkpoint), "elapsed_s": round(result.elapsed_s, 2),
               "reward_first": round(rewards[0], 4) if rewards else None,
               "reward_last": round(rewards[-1], 4) if rewards else None}
    if prints:
        print(json.dumps(summary) if args.json else " ".join(f"{k}={v}" for k, v in summary.items()), file=sys.stdout)
    return 0
