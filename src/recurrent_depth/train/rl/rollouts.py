"""RL rollouts: G completions per prompt through the library's generation runtime, scored, as trainer batches.

`RolloutSource.next_batch(P)` draws P prompts, generates G completions of each with `generate`
(the exit criterion, KV policy and sampling of the user's choice), and records what the loss
needs: every position's depth, the rollout policy's log-probs of the sampled tokens (pi_old),
the reference policy's (pi_ref, when the objective has a KL term) and each rollout's reward.

The initial state: rollouts start every token from s_0 = 0 (`init_scale=0`), and the replay
does too. Generation draws a random s_0 and the sampled tokens from one generator per row,
interleaved, so replaying a random s_0 would mean replaying the sampler's use of that stream too;
a zero state makes the replay exact by construction and stores nothing per token.

Log-probs are those of the tempered policy, log softmax(logits / temperature), without the top-k
/ top-p / min-p cut: the cut decides which tokens are sampled (a tail token is never drawn, the
SWE-1.7 note's point), the ratio pi_theta / pi_old compares the same distribution on both sides.

Batch `n` draws its prompts from `random.Random(f"rl:{seed}:{n}")` and generates with seed
`stream_seed(seed, n)` (row b: + b), so the stream is fixed by the seed and the batch index: the
state a checkpoint keeps is that index, and a resumed run makes the same rollouts as an uninterrupted one.
Under torchrun batch n is one global batch of P x world_size prompts and rank r takes prompts
[r P, (r + 1) P) and rows [r P G, (r + 1) P G) of it (its seeds too): the ranks' rollouts are those of one
process with P x world_size prompts, not world_size copies of the same rollouts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from recurrent_depth.evaluation.reasoning.data import ProblemEncoder
from recurrent_depth.evaluation.reasoning.tasks import ReasoningTask
from recurrent_depth.files import clipped
from recurrent_depth.inference.generate import generate
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.model.depth import stream_seed
from recurrent_depth.model.replay import DepthReplay
from recurrent_depth.train.batches import BatchSource
from recurrent_depth.train.rl.rewards import ShapedReward

# Generation options a replay cannot follow, with the value rollouts need.
# (GradMem's memory and TTT-E2E's adapted weights change the policy per prompt; exit_kv="compute" keeps exited
# tokens computing the KV of steps their replay does not run.)
_REPLAYABLE = {"warm_start": False, "repetition_penalty": 1.0, "kv_quant": None, "mode": "autoregressive",
               "gradmem_tokens": 0, "ttt_params": None, "exit_kv": "lookup"}


@dataclass(frozen=True)
class RolloutSettings:
    """How rollouts are made and replayed (shared by `RolloutSource` and the objectives).

    group_size: G completions per prompt. generation: `generate` keyword arguments (our names:
    num_steps, exit_criterion, kv_policy, do_sample, temperature, top_k, ...; max_new_tokens).
    backprop_depth: the last k steps of each token get gradients (None: the model's mean_backprop_depth).
    seed: the run's rollout stream (see the module docstring)."""

    group_size: int = 4
    generation: dict[str, Any] = field(default_factory=dict)
    backprop_depth: int | None = None
    seed: int = 0

    def options(self, model: Any) -> GenerationOptions:
        """The rollouts' validated generation options; a one-line ValueError for what a replay cannot follow."""
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} is invalid: expected an integer >= 1")
        k = self.backprop_depth
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):  # (before any rollout)
            raise ValueError(f"backprop_depth={k!r} (--backprop-depth) is invalid: expected an integer >= 1")
        given = dict(self.generation)
        unknown = sorted(set(given) - GenerationOptions.names())
        if unknown:
            known = sorted(GenerationOptions.names())
            raise ValueError(f"unknown rollout generation option(s) {unknown}; known: {known}")
        for name in ("seed", "output_logits", "teacher_tokens"):
            if name in given:
                raise ValueError(f"rollout generation option {name!r} is set by the RL loop itself; leave it out")
        scale = given.pop("init_scale", 0.0)
        if scale != 0:
            raise ValueError(f"rollouts need init_scale=0 (s_0 = 0, replayed exactly), got init_scale={scale!r}")
        options = GenerationOptions(**given, init_scale=0.0, output_logits=True).validate(
            model.config.mean_recurrence, max_depth=model.max_depth)
        for name, wanted in _REPLAYABLE.items():
            if getattr(options, name) != wanted:
                raise ValueError(f"rollouts need {name}={wanted!r} (the replay recomputes plain token-by-token "
                                 f"decoding), got {getattr(options, name)!r}")
        if not options.do_sample:
            raise ValueError("rollouts need do_sample=True (--do-sample, a temperature > 0): greedy decoding from "
                             "s_0 = 0 gives every rollout of a prompt the same completion, so every advantage is 0")
        if options.max_new_tokens < 1:  # (generate returns no logits for no token: nothing to score or replay)
            raise ValueError(f"rollouts need max_new_tokens >= 1 (--max-new-tokens): a completion of no token has "
                             f"nothing to learn from, got max_new_tokens={options.max_new_tokens!r}")
        if options.num_steps < 1:  # (the prompt, or every token, ran 0 steps: the replay runs each position >= 1)
            raise ValueError(f"rollouts need num_steps >= 1 (--num-steps): positions generated at depth 0 cannot be "
                             f"replayed (a replay runs every position at least one core step), got "
                             f"num_steps={options.num_steps!r}")
        if options.min_steps_rule == "skip":
            raise ValueError("rollouts need min_steps_rule='exit': under 'skip' a token at max_steps keeps the logits "
                             "of its last check, not of the state its replay ends at")
        DepthReplay(torch.zeros(1, 1, dtype=torch.long), options.policy.name).policy(model.config.core_layers)
        return options

    def temperature(self, options: GenerationOptions) -> float:
        return float(options.temperature) if options.do_sample else 1.0

    def grad_steps(self, model: Any) -> int:
        return self.backprop_depth if self.backprop_depth is not None else max(1, model.config.mean_backprop_depth)


def policy_logprobs(model: nn.Module, batch: dict[str, Tensor], settings: RolloutSettings) -> Tensor:
    """log pi(y_t | x, y_<t) `[B, N]` of the batch's completion tokens, every position replayed at its
    recorded depth under the rollout's KV policy (`model/replay.py`), with s_0 = 0."""
    replay = DepthReplay(batch["token_depths"], batch["kv_policy"], int(batch["backprop_depth"]))
    out = model(batch["input_ids"], attention_mask=batch["attention_mask"], init_scale=0.0, replay=replay)
    completion = batch["completion_ids"]
    logits = out.logits[:, -completion.shape[1]:] / float(batch["temperature"])
    return logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0]


class PromptSource(Protocol):
    def draw(self, rng: random.Random, count: int) -> list[Any]: ...  # prompt texts, or `ChatPrompt`s


@dataclass(frozen=True)
class TaskPrompts:
    """Prompts of a reasoning task, each at a difficulty drawn from `difficulties`."""

    task: ReasoningTask
    difficulties: Sequence[int]

    def __post_init__(self) -> None:
        if not self.difficulties:
            raise ValueError("TaskPrompts needs at least one difficulty")
        for d in self.difficulties:
            self.task.check_difficulty(d)

    def draw(self, rng: random.Random, count: int) -> list[str]:
        return [self.task.sample(rng, rng.choice(list(self.difficulties))).prompt for _ in range(count)]


@dataclass(frozen=True)
class ListPrompts:
    """Prompts drawn (with replacement) from a fixed list, e.g. the lines of a file."""

    prompts: Sequence[str]

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"{type(self).__name__} needs at least one prompt")

    def draw(self, rng: random.Random, count: int) -> list[Any]:
        return [rng.choice(list(self.prompts)) for _ in range(count)]


@dataclass(frozen=True)
class ChatPrompt:
    """A chat prompt as the chat template renders it: its token ids (the template's own bos, no other) and their
    text (what the reward function gets as `prompt`); its record's other fields (`data.chat.prompt_fields`), which a
    reward function that takes keyword arguments gets (`rewards.RewardKeywords`), and the record's name in errors
    (FILE:LINE, or "prompt N")."""

    text: str
    ids: tuple[int, ...]
    fields: dict[str, Any] = field(default_factory=dict, hash=False)
    where: str = ""


@dataclass(frozen=True)
class ChatPrompts(ListPrompts):
    """Chat prompts drawn (with replacement) from a fixed list (`chat_prompts`); rollouts also stop at `stop_ids`,
    the chat's end-of-turn ids, where the server's chat route stops."""

    prompts: Sequence[ChatPrompt]
    stop_ids: Sequence[int] = ()


def prompt_name(names: Sequence[str] | None, i: int) -> str:
    """The `i`-th prompt as errors name it: its entry of `names` (FILE:LINE, as `rdepth rl --prompts` reads a
    file's records), else "prompt N"."""
    return names[i] if names is not None else f"prompt {i + 1}"


def _where(prompt: str | ChatPrompt, i: int) -> str:
    """The `i`-th prompt of a list as errors name it: a chat prompt's record (FILE:LINE), else "prompt N"."""
    return prompt.where if isinstance(prompt, ChatPrompt) and prompt.where else prompt_name(None, i)


def chat_prompts(records: Sequence[Any], tokenizer_dir: str | Path, config: Any,
                 names: Sequence[str] | None = None) -> ChatPrompts:
    """`records` (`data.chat.prompt_conversation`'s: `{"messages": [...]}` or trl's `{"prompt": [...]}`) rendered
    with the chat template and generation prompt and tokenized as the server's chat route does
    (`TextCodec.encode_chat`, which `rdepth sft` matches), each with its other fields, and the ids a chat turn ends
    at there (`TextCodec.chat_stop_ids`). A record that cannot be rendered is a one-line ValueError naming it: by
    its entry of `names` (FILE:LINE, as `rdepth rl --prompts` reads them), else as "prompt N"."""
    from recurrent_depth.data.chat import prompt_conversation, prompt_fields, template_errors
    from recurrent_depth.serving.text import TextCodec  # (here: the serving package is heavy)

    codec = TextCodec(tokenizer_dir, config.vocab_size, context=config.max_seq_len, required=True)
    if codec.chat is None:
        raise ValueError(f"chat prompts need a chat template in {tokenizer_dir}: {codec.chat_error}")
    if names is not None and len(names) != len(records):
        raise ValueError(f"chat_prompts: {len(names)} names for {len(records)} records; give one name per record")
    rendered = []
    for i, record in enumerate(records):
        where = prompt_name(names, i)
        chat = prompt_conversation(record, where)
        fields = prompt_fields(record, where)
        with template_errors(where):
            ids = codec.encode_chat(chat.messages, chat.tools, add_generation_prompt=True, variables=chat.variables)
        rendered.append(ChatPrompt(codec.decode(ids, skip_special_tokens=False), tuple(ids), fields, where))
    return ChatPrompts(rendered, sorted(codec.chat_stop_ids))


class RolloutSource(BatchSource):
    """The trainer's batches for RL: `next_batch(P)` is P prompts times G scored rollouts (module docstring).

    policy: the model being trained (the trainer's); reference: a frozen copy of the starting model
    (needed for a KL term, else None); encoder: tokenizes prompts as `<|begin_text|> prompt` and ends
    completions at its end token; rank / world_size: this process's share of each global batch (torchrun)."""

    def __init__(self, policy: nn.Module, prompts: PromptSource, reward: ShapedReward, settings: RolloutSettings, *,
                 encoder: ProblemEncoder | None = None, reference: nn.Module | None = None,
                 log: Callable[[str], None] = print, run: dict[str, Any] | None = None,
                 run_defaults: dict[str, Any] | None = None, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is invalid for world_size={world_size}: expected 0 <= rank < world_size")
        self.policy = policy
        self.rank, self.world_size = rank, world_size
        # What else makes the run's trajectory (prompts, reward, objective: `recipe.build_rl`), JSON-plain;
        # kept in checkpoints so a resume with other ones is refused like changed rollout settings.
        self.run = run
        # run keys added since checkpoints were first written, with the value a checkpoint without them ran with
        self.run_defaults = dict(run_defaults or {})
        self.prompts = prompts
        self.reward = reward
        self.settings = settings
        self.options = settings.options(policy)
        self.encoder = encoder if encoder is not None else ProblemEncoder()
        # (a chat rollout also ends at the turn's end, as the server's chat route stops it)
        self.end_ids = {self.encoder.eos, *(prompts.stop_ids if isinstance(prompts, ChatPrompts) else ())}
        if isinstance(prompts, ListPrompts):
            self._check_prompt_lengths(prompts.prompts)
            for i, prompt in enumerate(prompts.prompts):  # (a field the reward needs: said now, not when drawn)
                reward.keywords.check(prompt.fields if isinstance(prompt, ChatPrompt) else None, _where(prompt, i))
        else:
            reward.keywords.check(None, "task prompts")
        self.reference = reference
        if reference is not None:
            reference.requires_grad_(False).eval()
        self.log = log
        self.batches = 0
        self.last_rollout_s = 0.0

    def _check_prompt_lengths(self, prompts: Sequence[str | ChatPrompt]) -> None:
        """A one-line ValueError naming the first prompt whose rollouts would not fit the model's context (it failed
        only when drawn, maybe hours into the run, in a line naming no prompt)."""
        room = int(self.policy.config.max_seq_len) - self.options.max_new_tokens
        for i, prompt in enumerate(prompts):
            length = len(self._prompt_ids(prompt))
            if length > room:
                text = prompt.text if isinstance(prompt, ChatPrompt) else prompt
                raise ValueError(f"{_where(prompt, i)} ({clipped(text, 80)}) is {length} tokens: with max_new_tokens="
                                 f"{self.options.max_new_tokens} it exceeds the model's max_seq_len="
                                 f"{self.policy.config.max_seq_len}; shorten it or leave it out")

    # ------------------------------------------------------------------ rollouts
    def _prompt_ids(self, prompt: str | ChatPrompt) -> list[int]:
        """A prompt's ids: a chat prompt's as its template renders them (its bos included), a text after the bos."""
        if isinstance(prompt, ChatPrompt):
            return list(prompt.ids)
        return [self.encoder.bos, *self.encoder.encode_text(prompt)]

    def _prompt_batch(self, texts: list[str | ChatPrompt]) -> tuple[Tensor, Tensor]:
        """Left-padded ids `[P * G, T]` and mask, each prompt repeated G times in a row."""
        rows = [self._prompt_ids(t) for t in texts]
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.encoder.pad, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, T - len(row):] = torch.tensor(row)
            mask[b, T - len(row):] = 1
        G = self.settings.group_size
        return ids.repeat_interleave(G, dim=0), mask.repeat_interleave(G, dim=0)

    def next_batch(self, batch_size: int) -> dict[str, Any]:
        n = self.batches
        # the global batch's prompts, then this rank's share (every rank drew the same ones before: duplicate work)
        texts = self.prompts.draw(random.Random(f"rl:{self.settings.seed}:{n}"), batch_size * self.world_size)
        texts = texts[self.rank * batch_size : (self.rank + 1) * batch_size]
        first_row = self.rank * batch_size * self.settings.group_size  # (row b of the global batch draws seed + b)
        ids, mask = self._prompt_batch(texts)
        device = self.policy.device
        kwargs = {k: v for k, v in self.settings.generation.items() if k != "init_scale"}
        stop = kwargs.pop("stop", None)
        stops = ([stop] if isinstance(stop, int | str) else list(stop or [])) + sorted(self.end_ids)
        start = time.perf_counter()
        with torch.no_grad():
            out = generate(self.policy, ids.to(device), attention_mask=mask.to(device), init_scale=0.0,
                           output_logits=True, seed=stream_seed(self.settings.seed, n) % 2**62 + first_row,
                           stop=stops, tokenizer=self.encoder.tokenizer, **kwargs)  # (stop strings need it)
        self.last_rollout_s = time.perf_counter() - start
        batch = self._record(out, ids, mask)
        errors_before = self.reward.errors
        batch["rewards"], batch["reward_valid"] = self._score(texts, out)
        batch["reward_errors"] = self.reward.errors - errors_before  # this batch's, like rollouts_left_out
        if self.reference is not None:
            with torch.no_grad():
                batch["ref_logp"] = policy_logprobs(self.reference, batch, self.settings)
        self.batches += 1
        return batch

    def _record(self, out: Any, ids: Tensor, mask: Tensor) -> dict[str, Any]:
        """The replay's inputs: prompt + completion but its last token, the depth of every position
        (the prompt at the depth of its last position, which predicted the first token) and pi_old."""
        device = self.policy.device
        T = ids.shape[1]
        completion = out.new_tokens.clone().to(device)  # [B, N]
        N = completion.shape[1]
        steps = out.steps.clone().to(device)  # steps[b, i]: depth of the position that produced token i
        positions = torch.arange(T + N - 1, device=device)
        temperature = self.settings.temperature(self.options)
        logits = out.logits.clone().to(device) / temperature
        lengths = out.lengths.to(device)
        return {
            "input_ids": out.sequences[:, : T + N - 1].clone().to(device),
            "attention_mask": torch.cat([mask.to(device), mask.new_ones(mask.shape[0], N - 1).to(device)], dim=1),
            "token_depths": steps[:, (positions - T + 1).clamp(min=0)],
            "completion_ids": completion,
            "completion_mask": torch.arange(N, device=device)[None] < lengths[:, None],
            # cut by max_new_tokens before a stop (for mask_truncated); max_new_tokens: Dr. GRPO's constant
            "truncated": torch.tensor([reason == "length" for reason in out.finish_reasons], device=device),
            "max_new_tokens": self.options.max_new_tokens,
            "old_logp": logits.log_softmax(-1).gather(-1, completion[..., None])[..., 0],
            "temperature": temperature,
            "kv_policy": self.options.policy.name,
            "backprop_depth": self.settings.grad_steps(self.policy),
        }

    def _score(self, texts: list[str | ChatPrompt], out: Any) -> tuple[Tensor, Tensor]:
        G = self.settings.group_size
        rewards, valid = [], []
        for b, tokens in enumerate(out.token_lists()):
            end = next((i for i, token in enumerate(tokens) if token in self.end_ids), len(tokens))
            text = self.encoder.tokenizer.decode(tokens[:end], skip_special_tokens=False)
            prompt = texts[b // G]  # (each of the prompt's G completions gets its text and fields)
            fields = prompt.fields if isinstance(prompt, ChatPrompt) else None
            prompt = prompt.text if isinstance(prompt, ChatPrompt) else prompt
            value = self.reward(prompt, text, out.steps[b, : len(tokens)].tolist(), len(tokens), fields)
            rewards.append(0.0 if value is None else value)
            valid.append(value is not None)
        device = self.policy.device
        return torch.tensor(rewards, device=device), torch.tensor(valid, device=device)

    # ------------------------------------------------------------------ trainer hooks
    # under torchrun, summed over the ranks (a step has one micro-batch): the failures and rollouts left out of
    # every rank, and the tokens per second of all ranks' rollouts; the means are averaged over the ranks
    summed_metrics = ("reward_errors", "rollouts_left_out", "rollout_tokens_per_s")
    rank_mean_metrics = ("reward_mean", "completion_tokens", "mean_depth", "clip_fraction", "clip_ratio/low_mean",
                         "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")

    def observe(self, batch: dict[str, Any], output: Any) -> dict[str, Any]:
        mask = batch["completion_mask"]
        new = int(mask.sum())
        depths = batch["token_depths"][:, -mask.shape[1]:]
        valid = batch["reward_valid"]
        rewards = batch["rewards"][valid]
        return {
            "reward_mean": float(rewards.mean()) if rewards.numel() else None,
            "reward_errors": batch["reward_errors"],
            "rollouts_left_out": int((~valid).sum()),
            "completion_tokens": new / mask.shape[0],
            "mean_depth": float(depths[mask].float().mean()) if new else None,
            "rollout_tokens_per_s": new / self.last_rollout_s if self.last_rollout_s > 0 else None,
            **(output if isinstance(output, dict) else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "settings": self.describe()["settings"], "run": self.run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, now = state.get("settings"), self.describe()["settings"]
        if saved != now and not self._same_rollouts(saved):
            if isinstance(saved, dict):  # the fields that differ, the generation options among them by name
                saved = {**saved, **(saved.get("generation") or {})}
                now = {**now, **now["generation"]}
                saved.pop("generation", None), now.pop("generation")
            raise ValueError(f"cannot resume this RL run: its rollout settings changed ({changes(saved, now)})")
        saved_run, run = state.get("run"), self.run
        if isinstance(saved_run, dict):
            saved_run = {**self.run_defaults, **saved_run}
        if saved_run is not None and run is not None and saved_run != run:  # (checkpoints before it: not compared)
            raise ValueError(f"cannot resume this RL run: its prompts, reward or objective changed "
                             f"({changes(saved_run, run)})")
        self.batches = int(state["batches"])

    def _same_rollouts(self, saved: Any) -> bool:
        """Whether saved settings spelled otherwise make the same rollouts (an explicit default such as
        kv_policy='per-step+deepest' beside none): the same G, seed and backprop depth, equal resolved options."""
        try:
            other = RolloutSettings(**saved)
            if asdict(other) | {"generation": {}} != asdict(self.settings) | {"generation": {}}:
                return False
            theirs, ours = other.options(self.policy), self.options
        except (TypeError, ValueError):
            return False
        return replace(theirs, kv_policy=None, kv_budget=None) == replace(ours, kv_policy=None, kv_budget=None)

    def describe(self) -> dict[str, Any]:
        settings = asdict(self.settings)
        settings["generation"] = {k: settings["generation"][k] for k in sorted(settings["generation"])}
        return {"source": "rl-rollouts", "settings": settings, "prompts": repr(self.prompts)[:200],
                "reward": repr(self.reward.base)[:200]}


def changes(saved: Any, now: dict[str, Any]) -> str:
    """`key saved -> now` for each key whose value differs (the whole saved value when it is not a dict)."""
    if not isinstance(saved, dict):
        return f"saved {saved!r}"
    return ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                     if saved.get(k) != now.get(k))
