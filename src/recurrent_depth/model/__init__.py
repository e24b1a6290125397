"""The model: layers, token mixers, caches, the depth sampler and the recurrent-depth LM itself."""

from recurrent_depth.model.cache import DynamicCache
from recurrent_depth.model.depth import DepthSampler
from recurrent_depth.model.recurrent import RecurrentDepthLM, RecurrentOutput

__all__ = ["DepthSampler", "DynamicCache", "RecurrentDepthLM", "RecurrentOutput"]
