"""Depth sampling for training: the one sampler lives in `recurrent_depth.model.depth`.

Re-exported here because training is where it is configured (`TrainConfig.depth_*`) and where
`DepthSampler.sample(step, rank)` is called once per micro-batch; the model's `num_steps=None`
path draws through the same `DepthSampler.draw`. See that module for the distribution and for
which random stream each caller uses.
"""

from recurrent_depth.model.depth import SCHEMES, DepthSampler, stream_seed, truncate

__all__ = ["SCHEMES", "DepthSampler", "stream_seed", "truncate"]
