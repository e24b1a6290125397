"""Convergence to an approximate limit point s* (the paper's figure 11).

For each token t and step i: d[t, i] = ‖ln_f(s_i) − s*‖, where s* = ln_f(s_L) after L steps
(default 128) from the same s_0, as Huginn-0125's trajectory notebook does. A token has
converged at step i when its relative distance d / ‖s*‖ stays at or below `tol` from i onward;
the distance need not fall monotonically (the paper notes orbits), hence "stays".
"""

from __future__ import annotations

import numpy as np

from recurrent_depth.analysis.trajectory import Trajectory

DEFAULT_LIMIT_STEPS = 128
DEFAULT_CONVERGE_TOL = 0.05


def distance_to_limit(traj: Trajectory, row: int = 0) -> np.ndarray:
    """‖ln_f(s_i) − s*‖ for one row's real tokens: [T_row, S+1] float64 (tokens down, steps across).

    Computed one step at a time, so a memory-mapped trajectory is never loaded whole.
    """
    if traj.limit is None:
        raise ValueError("the trajectory has no limit point: collect it with limit_steps=... (e.g. 128)")
    pos = traj.positions(row)
    limit = np.asarray(traj.limit[row, pos], dtype=np.float64)  # [T_row, h]
    states = traj.states("normed", row)
    out = np.empty((len(pos), traj.num_steps + 1), dtype=np.float64)
    for i in range(traj.num_steps + 1):
        diff = np.asarray(states[i], dtype=np.float64) - limit
        out[:, i] = np.sqrt(np.einsum("th,th->t", diff, diff))
    return out


def limit_norms(traj: Trajectory, row: int = 0) -> np.ndarray:
    """‖s*‖ per real token of the row: [T_row]."""
    if traj.limit is None:
        raise ValueError("the trajectory has no limit point: collect it with limit_steps=... (e.g. 128)")
    limit = np.asarray(traj.limit[row, traj.positions(row)], dtype=np.float64)
    return np.sqrt(np.einsum("th,th->t", limit, limit))


def steps_to_converge(distance: np.ndarray, scale: np.ndarray, tol: float = DEFAULT_CONVERGE_TOL) -> np.ndarray:
    """First step from which distance / scale stays <= tol, per token; -1 if it never does.

    Args:
        distance: [T, S+1] distances to s* (from `distance_to_limit`).
        scale: [T] normaliser, usually ‖s*‖ (`limit_norms`); a zero scale compares the absolute distance.
        tol: relative tolerance in (0, 1).
    Returns:
        [T] int64 step indices in 0..S, or -1.
    """
    if not 0 < tol < 1:
        raise ValueError(f"tol={tol!r} is invalid: expected a relative tolerance in (0, 1)")
    distance = np.asarray(distance, dtype=np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    if distance.ndim != 2 or scale.shape != distance.shape[:1]:
        raise ValueError(f"distance must be [T, S+1] and scale [T]; got {distance.shape} and {scale.shape}")
    relative = distance / np.where(scale > 0, scale, 1.0)[:, None]
    within = relative <= tol  # [T, S+1]
    # "stays within from step i on" = every later step is within: a reversed cumulative AND.
    stays = np.flip(np.logical_and.accumulate(np.flip(within, axis=1), axis=1), axis=1)
    first = np.argmax(stays, axis=1)
    return np.where(stays.any(axis=1), first, -1).astype(np.int64)
