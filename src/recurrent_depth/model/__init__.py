"""The model: layers, token mixers, caches and the recurrent-depth LM itself."""

from recurrent_depth.model.cache import DynamicCache
from recurrent_depth.model.recurrent import RecurrentDepthLM, RecurrentOutput, sample_lognormal_poisson_depth

__all__ = ["DynamicCache", "RecurrentDepthLM", "RecurrentOutput", "sample_lognormal_poisson_depth"]
