"""Hardware tuning applied from outside the model: thread choice (more to move here, issue 18)."""

from recurrent_depth.accel.threads import ThreadGuard, choose_threads, configure_threads

__all__ = ["ThreadGuard", "choose_threads", "configure_threads"]
