"""FALCON (Falcon-1): NLMS online regression of v_t on the previous key k_{t−1}."""

from recurrent_depth.ops.falcon.chunk import chunk_falcon
from recurrent_depth.ops.falcon.naive import FalconState, naive_recurrent_falcon

__all__ = ["FalconState", "chunk_falcon", "naive_recurrent_falcon"]
