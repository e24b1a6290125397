"""Scaling studies: resumable sweeps of `rdepth train` runs collected into one table (`sweep`)."""

from recurrent_depth.scaling.sweep import (
    TABLE_COLUMNS,
    SweepPlan,
    collect_sweep,
    emit_sweep,
    load_sweep,
    run_sweep,
    sweep_status,
)

__all__ = ["TABLE_COLUMNS", "SweepPlan", "collect_sweep", "emit_sweep", "load_sweep", "run_sweep", "sweep_status"]
