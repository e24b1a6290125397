"""Training health monitors.

`token_correlation` is the paper's collapse monitor: a failed recurrent-depth run shows its hidden
states becoming the same vector at every position ("token correlation" rising towards 1). The trainer
and `rdepth analyze` share one implementation, which lives in `recurrent_depth.analysis.correlation`
(plain torch, no plotting imports).
"""

from recurrent_depth.analysis.correlation import token_correlation, token_correlation_reference

__all__ = ["token_correlation", "token_correlation_reference"]
