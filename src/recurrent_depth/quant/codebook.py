"""Lloyd–Max scalar codebooks (1-D continuous k-means) for fixed densities, solved once and cached.

- `sphere_codebook(d, b)`: 2^b centroids for one coordinate of a uniform point on S^{d−1}, whose
  density is f(x) = Γ(d/2) / (√π Γ((d−1)/2)) · (1 − x²)^{(d−3)/2} on [−1, 1] (TurboQuant_mse).
- `polar_angle_codebook(level, b)`: PolarQuant's angle codebooks. Level 1 angles are uniform on
  [0, 2π); a level-ℓ ≥ 2 angle (between two radii of 2^{ℓ−1} Gaussian coordinates each) has density
  ∝ sin^{2^{ℓ−1}−1}(2ψ) on [0, π/2].

The solver discretises the density on a fine midpoint grid (no endpoint is evaluated, so the
integrable singularity of d = 2 is harmless), then alternates the two Lloyd conditions (boundaries
at centroid midpoints; centroids at the conditional mean of their cell) from a companding start until
the centroids move by less than 1e-10 of the support.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

GRID_POINTS = 1 << 18
MAX_CODEBOOK_BITS = 8


def _lloyd_max(log_density: Callable[[np.ndarray], np.ndarray], lo: float, hi: float, levels: int) -> np.ndarray:
    h = (hi - lo) / GRID_POINTS
    x = lo + (np.arange(GRID_POINTS) + 0.5) * h
    logp = log_density(x)
    p = np.exp(logp - logp.max())
    p /= p.sum()
    cmass = np.concatenate(([0.0], np.cumsum(p)))
    cmoment = np.concatenate(([0.0], np.cumsum(p * x)))
    edges = lo + np.arange(GRID_POINTS + 1) * h

    def cumulative(t: np.ndarray, c: np.ndarray) -> np.ndarray:
        return np.interp(t, edges, c)

    # Companding start (Panter–Dite: optimal centroid density ∝ f^{1/3}), so that many levels converge fast.
    cube_root = p ** (1 / 3)
    ccube = np.concatenate(([0.0], np.cumsum(cube_root / cube_root.sum())))
    centroids = np.interp((np.arange(levels) + 0.5) / levels, ccube, edges)
    for _ in range(20000):
        bounds = np.concatenate(([lo], (centroids[1:] + centroids[:-1]) / 2, [hi]))
        mass = np.diff(cumulative(bounds, cmass))
        moment = np.diff(cumulative(bounds, cmoment))
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), centroids)
        done = np.max(np.abs(new - centroids)) < 1e-10 * (hi - lo)
        centroids = new
        if done:
            break
    return centroids


def _check_codebook_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_CODEBOOK_BITS:
        raise ValueError(f"codebook bits must be an int in [1, {MAX_CODEBOOK_BITS}], got {bits!r}")


def sphere_log_density(d: int) -> Callable[[np.ndarray], np.ndarray]:
    """log f(x) for one coordinate of a uniform point on S^{d−1} (normalised)."""
    const = math.lgamma(d / 2) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2)
    return lambda x: const + (d - 3) / 2 * np.log1p(-(x * x))


@functools.cache
def sphere_codebook(d: int, bits: int) -> tuple[float, ...]:
    """Sorted Lloyd–Max centroids (2^bits of them) for a sphere coordinate in dimension d ≥ 2."""
    if not isinstance(d, int) or d < 2:
        raise ValueError(f"the sphere codebook needs a dimension d >= 2, got {d!r}")
    _check_codebook_bits(bits)
    c = _lloyd_max(sphere_log_density(d), -1.0, 1.0, 1 << bits)
    c = (c - c[::-1]) / 2  # the density is even: make the codebook exactly symmetric
    return tuple(float(v) for v in c)


def polar_log_density(level: int) -> tuple[Callable[[np.ndarray], np.ndarray], float, float]:
    """(log density, lo, hi) of a PolarQuant level-`level` angle (unnormalised)."""
    if level == 1:
        return (lambda x: np.zeros_like(x)), 0.0, 2 * math.pi
    power = (1 << (level - 1)) - 1
    return (lambda x: power * np.log(np.sin(2 * x))), 0.0, math.pi / 2


@functools.cache
def polar_angle_codebook(level: int, bits: int) -> tuple[float, ...]:
    if not isinstance(level, int) or level < 1:
        raise ValueError(f"polar level must be an int >= 1, got {level!r}")
    _check_codebook_bits(bits)
    log_density, lo, hi = polar_log_density(level)
    return tuple(float(v) for v in _lloyd_max(log_density, lo, hi, 1 << bits))


def boundaries(centroids: tuple[float, ...]) -> tuple[float, ...]:
    """Decision thresholds between sorted centroids (their midpoints)."""
    return tuple((a + b) / 2 for a, b in zip(centroids[:-1], centroids[1:]))
