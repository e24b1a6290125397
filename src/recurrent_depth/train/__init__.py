"""Training: depth sampling, optimizers and the learning-rate schedule; the trainer, checkpoints and
resume, data parallelism, weight averaging and the quickstart recipe."""

from recurrent_depth.train.averaging import average_checkpoints
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.depth import DepthSampler, truncate
from recurrent_depth.train.flops import training_step_flops
from recurrent_depth.train.monitor import token_correlation
from recurrent_depth.train.optim import (
    OPTIM_PRESETS,
    ELLISAdam,
    HuginnAdam,
    OptimConfig,
    OptimizerSet,
    build_optimizers,
    clip_and_check_grads,
)
from recurrent_depth.train.quickstart import QuickstartRecipe, quickstart
from recurrent_depth.train.schedule import lr_at, set_lr
from recurrent_depth.train.trainer import (
    StopTraining,
    TooManySkippedSteps,
    Trainer,
    TrainingInterrupted,
    TrainResult,
    train,
)
from recurrent_depth.train.validation import DepthEval, validation_loss_by_depth

__all__ = [
    "DepthEval",
    "DepthSampler",
    "ELLISAdam",
    "HuginnAdam",
    "OPTIM_PRESETS",
    "OptimConfig",
    "OptimizerSet",
    "QuickstartRecipe",
    "StopTraining",
    "TooManySkippedSteps",
    "TrainingInterrupted",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "average_checkpoints",
    "build_optimizers",
    "clip_and_check_grads",
    "validation_loss_by_depth",
    "lr_at",
    "quickstart",
    "set_lr",
    "token_correlation",
    "train",
    "training_step_flops",
    "truncate",
]
