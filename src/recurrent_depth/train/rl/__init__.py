"""Reinforcement learning whose rollouts choose their own depth (`rdepth rl`; docs/post-training.md, ## RL).

`RolloutSource` (rollouts through `generate`, scored) feeds the one `Trainer` with a `GRPO` or `K2`
objective; the training forward replays each token at its recorded depth (`model/replay.py`).
"""

from recurrent_depth.train.rl.losses import GRPO, K2, group_advantages, grpo_loss, k2_loss
from recurrent_depth.train.rl.rewards import (
    RewardError,
    RewardKeywords,
    ShapedReward,
    TaskReward,
    get_reward,
    load_reward_function,
)
from recurrent_depth.train.rl.rollouts import (
    ChatPrompts,
    ListPrompts,
    RolloutSettings,
    RolloutSource,
    TaskPrompts,
    chat_prompts,
    policy_logprobs,
)

__all__ = [
    "GRPO",
    "K2",
    "ChatPrompts",
    "ListPrompts",
    "RewardError",
    "RewardKeywords",
    "RolloutSettings",
    "RolloutSource",
    "ShapedReward",
    "TaskPrompts",
    "TaskReward",
    "chat_prompts",
    "get_reward",
    "group_advantages",
    "grpo_loss",
    "k2_loss",
    "load_reward_function",
    "policy_logprobs",
]
