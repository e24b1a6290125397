"""recurrent-depth: recurrent-depth language models (the Huginn-0125 approach).

    import recurrent_depth as rd
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    out = model(input_ids, num_steps=32)
"""

import recurrent_depth.integrations as _integrations  # noqa: F401  (installs lazy transformers / lm-eval hooks)
from recurrent_depth.accel.runner import fast_runner
from recurrent_depth.config import ModelConfig
from recurrent_depth.inference import generate
from recurrent_depth.inference.runner import register_fast_runner
from recurrent_depth.model import DynamicCache, RecurrentDepthLM, RecurrentOutput

register_fast_runner(fast_runner)  # hardware tuning applied from outside the runtime, as `accel.apply` is to the model

__version__ = "0.1.0"

__all__ = ["DynamicCache", "ModelConfig", "RecurrentDepthLM", "RecurrentOutput", "__version__", "generate"]
