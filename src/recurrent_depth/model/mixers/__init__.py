"""Token mixers: one interface (`base.py`), one file per mixer, a registry that builds them by name."""

from recurrent_depth.model.mixers import attention  # noqa: F401  (registers "attention")
from recurrent_depth.model.mixers.base import (
    LayerKey,
    MixerContext,
    available_mixers,
    build_mixer,
    register_mixer,
)

__all__ = ["LayerKey", "MixerContext", "available_mixers", "build_mixer", "register_mixer"]
