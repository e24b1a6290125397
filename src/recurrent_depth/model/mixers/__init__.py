"""Token mixers: one interface (`base.py`), one file per mixer, a registry that builds them by name."""

# Importing a mixer module registers its names.
from recurrent_depth.model.mixers import (  # noqa: F401
    attention,
    deltanet,
    dsa,
    gla,
    linear_attention,
    log_linear,
    mla,
    nsa,
    test_time_regression,
)
from recurrent_depth.model.mixers.base import (
    LayerKey,
    MixerContext,
    available_mixers,
    build_mixer,
    check_mixer_name,
    register_mixer,
)

__all__ = ["LayerKey", "MixerContext", "available_mixers", "build_mixer", "check_mixer_name", "register_mixer"]
