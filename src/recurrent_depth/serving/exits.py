"""Exit statistics for rows that start their tokens at different iterations.

`recurrent_depth.inference.criteria.ExitCriterion` keeps the statistics of one token's recurrence
for a whole batch, started together. In the serving batch every row starts a token whenever its
previous one ends, so `RowCriterion` keeps those statistics per pool row: its per-row state (the
criterion's batch-first tensors, e.g. the previous distribution for `kl`) lives in tensors with one
entry per row; `start` and `update` gather the rows concerned into a working `ExitCriterion`, run
it, and scatter the result back. The arithmetic is the criterion's own.
"""

from __future__ import annotations

from torch import Tensor

from recurrent_depth.inference.criteria import CriterionSpec, ExitCriterion


class RowCriterion:
    """One criterion and threshold, with per-row statistics for `capacity` rows."""

    def __init__(self, spec: CriterionSpec, threshold: float, capacity: int, vocab_size: int) -> None:
        self.spec = spec
        self.threshold = threshold
        self.capacity = capacity
        self.vocab_size = vocab_size
        self.store: dict[str, Tensor] = {}

    @property
    def needs_logits(self) -> bool:
        return self.spec.needs_logits

    def _working(self) -> ExitCriterion:
        return ExitCriterion(self.spec, self.threshold)

    def _scatter(self, crit: ExitCriterion, rows: Tensor) -> None:
        for name, value in vars(crit).items():
            if isinstance(value, Tensor) and value.dim() and value.shape[0] == rows.shape[0]:
                if name not in self.store:
                    self.store[name] = value.new_zeros(self.capacity, *value.shape[1:])
                self.store[name][rows] = value

    def start(self, rows: Tensor, state: Tensor) -> None:
        """Rows `[m]` begin a token whose initial state is `state` `[m, h]`."""
        crit = self._working()
        crit.start(state, self.vocab_size)
        self._scatter(crit, rows)

    def update(self, rows: Tensor, state: Tensor, logits: Tensor | None) -> Tensor:
        """One more step for rows `[m]` (raw state `[m, h]`, logits `[m, V]`); bool `[m]`: met."""
        crit = self._working()
        for name, stored in self.store.items():
            setattr(crit, name, stored[rows])
        met = crit.update(state, logits)
        self._scatter(crit, rows)
        return met

    def move(self, src: int, dst: int) -> None:
        for stored in self.store.values():
            stored[dst] = stored[src]
