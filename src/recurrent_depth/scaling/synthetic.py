"""Synthetic results tables drawn from a known law: for tests, the coverage benchmark and trying the CLI."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurrent_depth.scaling.forms import effective_params

# A Chinchilla-like truth at toy scale (E, A, alpha, B, beta, phi).
DEFAULT_TRUTH = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 120.0, "beta": 0.28, "phi": 0.46}


def synthetic_rows(truth: dict[str, float] | None = None, noise: float = 0.01, seed: int = 0,
                   widths: tuple[int, ...] = (64, 128, 256), recurrences: tuple[int, ...] = (2, 4, 8),
                   token_budgets: tuple[float, ...] = (2e6, 8e6), dense_cores: tuple[int, ...] = (1, 2, 4),
                   test_depths: tuple[int, ...] = (1, 4, 8)) -> list[dict[str, Any]]:
    """Rows in the sweep table's long format: recurrent runs (1/2/1 layers, each r̄) and non-recurrent runs
    (1/c/1, r̄ = 1) at each width and token budget. The loss at a row's depth r follows the iso-depth law
    (with phi = 0 for non-recurrent runs it is the joint law in N_eff = N) times exp(noise * normal).
    Noise is drawn once per run, shared by its rows, as run-to-run variation is in a real sweep."""
    t = {**DEFAULT_TRUTH, **(truth or {})}
    rng = np.random.default_rng(seed)
    shapes = [(1, 2, 1, r) for r in recurrences] + [(1, c, 1, 1) for c in dense_cores]
    rows = []
    for width in widths:
        for prelude, core, coda, mean_r in shapes:
            for tokens in token_budgets:
                layers = prelude + core + coda
                n_layer = 12.0 * width * width
                n = n_layer * layers
                run = f"h{width}-{prelude}.{core}.{coda}-r{mean_r}-t{tokens:g}"
                shift = float(np.exp(noise * rng.standard_normal()))
                depths = sorted(set(test_depths) | {mean_r}) if mean_r > 1 else [1]
                for r in depths:
                    data = {"params_non_embedding": np.array([n]), "prelude_layers": np.array([prelude]),
                            "core_layers": np.array([core]), "coda_layers": np.array([coda]),
                            "depth": np.array([float(r)])}
                    n_eff = float(effective_params(data, "params_non_embedding", t["phi"])[0])
                    loss = (t["E"] + t["A"] * n_eff ** -t["alpha"] + t["B"] * tokens ** -t["beta"]) * shift
                    flops_token = 6.0 * n_layer * (prelude + coda + core * mean_r)
                    rows.append({"run": run, "seed": 0, "hidden_size": width, "prelude_layers": prelude,
                                 "core_layers": core, "coda_layers": coda, "mean_recurrence": mean_r,
                                 "train_depth_mean": mean_r, "test_depth": r, "lr": 1e-3,
                                 "params": n + 2 * 4096 * width, "params_non_embedding": n, "tokens": tokens,
                                 "train_flops": flops_token * tokens,
                                 "flops_per_token_test": 2.0 * n_layer * (prelude + coda + core * r),
                                 "loss": loss, "status": "finished"})
    return rows
