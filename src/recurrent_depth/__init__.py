"""recurrent-depth: recurrent-depth language models (the Huginn-0125 approach).

    import recurrent_depth as rd
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    out = model(input_ids, num_steps=32)

The public names are imported when first used (PEP 562), so `import recurrent_depth` and
`rdepth --version` do not import torch. `recurrent_depth.integrations` installs the import hooks
that register our classes with transformers and lm-eval, and the fused runner of `accel` with
`inference.runner`, the moment those modules load (see integrations/autoregister.py).
"""

from typing import Any

import recurrent_depth.integrations as _integrations  # noqa: F401  (installs the lazy registration hooks)

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "DynamicCache": "recurrent_depth.model",
    "ModelConfig": "recurrent_depth.config",
    "RecurrentDepthLM": "recurrent_depth.model",
    "RecurrentOutput": "recurrent_depth.model",
    "generate": "recurrent_depth.inference",
}

__all__ = ["DynamicCache", "ModelConfig", "RecurrentDepthLM", "RecurrentOutput", "__version__", "generate"]


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # `rd.inference`, `rd.evaluation`, ...
    else:
        raise AttributeError(f"module 'recurrent_depth' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
