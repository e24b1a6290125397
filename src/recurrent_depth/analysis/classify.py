"""Classify a latent trajectory as a fixed point, an orbit or a slider (the paper's section 7).

The paper names three behaviours seen in PCA plots: tokens that settle (fixed point), tokens
whose state keeps circling (orbit) and tokens whose state drifts steadily in one direction
(slider). The heuristic below measures them on the *tail* of a trajectory x_0..x_S (its last
`tail_fraction` of steps, where the transient from the random s_0 is over):

    scale       = max_i ‖x_i − x_S‖ over the whole trajectory (its overall size)
    extent      = max_{i in tail} ‖x_i − mean(tail)‖ / scale   (how far the tail still moves)
    speed_ratio = mean step length in the tail's last quarter / in its first quarter
    straightness= ‖x_S − x_tail_start‖ / path length of the tail   (1 for a straight line)

    1. extent <= fixed_extent                  -> "fixed point" (the tail has stopped moving)
    2. speed_ratio <= converging_speed_ratio   -> "fixed point" (still moving, but braking hard:
                                                  approaching a point, possibly spiralling in)
    3. straightness >= slider_straightness     -> "slider" (steady drift in one direction)
    4. otherwise                               -> "orbit" (keeps moving and keeps turning)

Limits, by construction: an orbit is recognised once the tail covers about half a revolution or
more (a shorter arc is nearly straight and reads as a slider), so use enough steps (64+); a
trajectory that is both drifting and circling (a helix) is an orbit when the circling dominates
the path length. It works in any space: full states (the default in the report) or PCA
projections.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

KINDS = ("fixed point", "orbit", "slider")
MIN_STEPS = 8  # the tail needs >= 4 steps so that each quarter has a step to measure


@dataclass(frozen=True)
class ClassifierThresholds:
    """Knobs of the heuristic (see the module docstring); defaults tuned on synthetic shapes."""

    tail_fraction: float = 0.5
    fixed_extent: float = 0.05
    converging_speed_ratio: float = 0.5
    slider_straightness: float = 0.7

    def __post_init__(self) -> None:
        for name in ("tail_fraction", "fixed_extent", "converging_speed_ratio", "slider_straightness"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected a number in (0, 1)")


@dataclass(frozen=True)
class TrajectoryShape:
    """The measured quantities and the resulting kind of one trajectory."""

    kind: str
    scale: float
    extent: float
    speed_ratio: float
    straightness: float

    def to_dict(self) -> dict:
        return asdict(self)


def classify_trajectory(x: np.ndarray, thresholds: ClassifierThresholds | None = None) -> TrajectoryShape:
    """Classify one trajectory x [S+1, D] (S >= 8 steps) as "fixed point", "orbit" or "slider"."""
    t = thresholds or ClassifierThresholds()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < MIN_STEPS + 1:
        raise ValueError(f"x must be a trajectory [steps+1 >= {MIN_STEPS + 1}, dims], got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or inf: the run diverged, there is no shape to classify")
    scale = float(np.linalg.norm(x - x[-1], axis=1).max())
    if scale == 0.0:
        return TrajectoryShape("fixed point", 0.0, 0.0, 0.0, 0.0)
    start = min(int(round(x.shape[0] * (1 - t.tail_fraction))), x.shape[0] - 5)
    tail = x[start:]
    extent = float(np.linalg.norm(tail - tail.mean(axis=0), axis=1).max()) / scale
    steps = np.linalg.norm(np.diff(tail, axis=0), axis=1)  # [n] step lengths
    quarter = max(1, len(steps) // 4)
    early = float(steps[:quarter].mean())
    late = float(steps[-quarter:].mean())
    speed_ratio = late / early if early > 0 else 0.0
    path = float(steps.sum())
    straightness = float(np.linalg.norm(tail[-1] - tail[0])) / path if path > 0 else 0.0
    if extent <= t.fixed_extent or speed_ratio <= t.converging_speed_ratio:
        kind = "fixed point"
    elif straightness >= t.slider_straightness:
        kind = "slider"
    else:
        kind = "orbit"
    return TrajectoryShape(kind, scale, extent, speed_ratio, straightness)


def classify_tokens(
    states: np.ndarray, thresholds: ClassifierThresholds | None = None
) -> list[TrajectoryShape]:
    """Classify every token of states [S+1, T, D] (a memory map is fine): a list of T shapes."""
    if states.ndim != 3:
        raise ValueError(f"states must be [steps+1, tokens, dims], got shape {states.shape}")
    return [classify_trajectory(np.asarray(states[:, t]), thresholds) for t in range(states.shape[1])]


def count_kinds(shapes: list[TrajectoryShape]) -> dict[str, int]:
    """{"fixed point": n, "orbit": n, "slider": n}, every kind present (0 when absent)."""
    counts = Counter(s.kind for s in shapes)
    return {kind: counts.get(kind, 0) for kind in KINDS}
