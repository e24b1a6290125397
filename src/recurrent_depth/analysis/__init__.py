"""See what the recurrence computes: trajectories, convergence, PCA, path independence, reports.

    from recurrent_depth.analysis import AnalysisConfig, analyze_to_dir, collect_trajectory
    traj = collect_trajectory(model, input_ids, num_steps=64, limit_steps=128, seed=0)
    result, files = analyze_to_dir(model, input_ids, "runs/analysis", token_texts=texts, decode=decode)

`token_correlation` (the representation-collapse signal) is also what the trainer monitors; this
package imports nothing from `recurrent_depth.train`, and names are loaded lazily so that
`from recurrent_depth.analysis.correlation import token_correlation` pulls in torch only (no
matplotlib).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ["KINDS", "ClassifierThresholds", "TrajectoryShape", "classify_tokens", "classify_trajectory",
         "count_kinds"], "classify"),
    **dict.fromkeys(["distance_to_limit", "limit_norms", "steps_to_converge"], "convergence"),
    **dict.fromkeys(["token_correlation", "token_correlation_reference"], "correlation"),
    **dict.fromkeys(["change_points", "prediction_arrays", "settling_step"], "depth_view"),
    **dict.fromkeys(["ExitGate", "exit_gate_along", "has_exit_gate"], "exit_gate"),
    **dict.fromkeys(["PathIndependence", "path_independence"], "path_independence"),
    **dict.fromkeys(["PCA", "fit_pca", "fit_pca_streaming", "fit_trajectory_pca"], "pca"),
    **dict.fromkeys(["AnalysisConfig", "AnalysisResult", "analyze", "analyze_to_dir", "token_decoder", "write_report"],
                    "report"),
    **dict.fromkeys(["Trajectory", "collect_trajectory", "iterate_states"], "trajectory"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recurrent_depth.analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(f"recurrent_depth.analysis.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """Keeps a function bound under its name when its same-named submodule is imported.

    Importing `recurrent_depth.analysis.path_independence` (the submodule) makes the import system
    set the package attribute `path_independence` to that module, which would hide the function
    `path_independence` from `from recurrent_depth.analysis import path_independence`.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
