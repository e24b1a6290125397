"""TTT-KVB: test-time training of a linear key→value regressor by mini-batch gradient descent."""

from recurrent_depth.ops.ttt_kvb.chunk import chunk_ttt_kvb
from recurrent_depth.ops.ttt_kvb.naive import TTTKVBState, naive_recurrent_ttt_kvb

__all__ = ["TTTKVBState", "chunk_ttt_kvb", "naive_recurrent_ttt_kvb"]
