"""PCA of latent trajectories (the paper's figure 12).

The components are fitted on every token's state at every step of a run (optionally leaving out
s_0, which is random noise), then individual tokens' trajectories are projected onto component
pairs (1-2, 3-4, 5-6). The fit is exact: an eigendecomposition of the smaller of the covariance
[h, h] and the Gram matrix [N, N] of the centred data (the tests compare it with an SVD, which
is many times slower), and for runs too large for memory the covariance is accumulated step by
step from a memory map. Signs are fixed (each component's largest-magnitude loading is
positive), so the same data always gives the same picture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

# Fit from the centred [N, h] float64 matrix in memory up to this size; above it, stream.
DEFAULT_MAX_IN_MEMORY_BYTES = 256 << 20


@dataclass
class PCA:
    """mean [h], components [k, h] (orthonormal rows), explained_variance [k], explained_ratio [k]."""

    mean: np.ndarray
    components: np.ndarray
    explained_variance: np.ndarray
    explained_ratio: np.ndarray
    num_samples: int

    @property
    def num_components(self) -> int:
        return self.components.shape[0]

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Project [..., h] onto the components: [..., k] float64."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"x must end in hidden size {self.mean.shape[0]}, got shape {x.shape}")
        return (x - self.mean) @ self.components.T


def _fix_signs(components: np.ndarray) -> np.ndarray:
    idx = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(len(components)), idx])
    signs[signs == 0] = 1.0
    return components * signs[:, None]


def _check_k(num_components: int, num_samples: int, hidden: int) -> int:
    if isinstance(num_components, bool) or not isinstance(num_components, int) or num_components < 1:
        raise ValueError(f"num_components={num_components!r} is invalid: expected an integer >= 1")
    if num_samples < 2:
        raise ValueError(f"PCA needs at least 2 samples, got {num_samples}")
    return min(num_components, hidden, num_samples - 1)


def _from_covariance(mean: np.ndarray, cov: np.ndarray, k: int, count: int) -> PCA:
    """PCA from the [h, h] covariance: its top-k eigenvectors, sorted, signs fixed."""
    variance, vectors = np.linalg.eigh(cov)  # ascending
    order = np.argsort(variance)[::-1]
    variance = np.clip(variance[order], 0.0, None)
    vectors = vectors[:, order].T
    total = variance.sum()
    return PCA(
        mean=mean, components=_fix_signs(vectors[:k]), explained_variance=variance[:k],
        explained_ratio=variance[:k] / total if total > 0 else np.zeros(k), num_samples=count,
    )


def fit_pca(data: np.ndarray, num_components: int = 6) -> PCA:
    """Exact PCA of `data` [N, h] (k = min(num_components, h, N-1)).

    Eigendecomposition of the smaller of the covariance [h, h] and the Gram matrix [N, N] of the
    centred data: the same components as an SVD (the tests compare), many times cheaper.
    """
    data = np.asarray(data, dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(f"data must be [num_samples, hidden], got shape {data.shape}")
    n, h = data.shape
    k = _check_k(num_components, n, h)
    mean = data.mean(axis=0)
    centred = data - mean
    if n >= h:
        return _from_covariance(mean, centred.T @ centred / (n - 1), k, n)
    # Fewer samples than dimensions: eigenvectors u of X X^T give components X^T u / sqrt(lambda).
    gram_values, gram_vectors = np.linalg.eigh(centred @ centred.T)
    order = np.argsort(gram_values)[::-1]
    gram_values = np.clip(gram_values[order], 0.0, None)
    gram_vectors = gram_vectors[:, order[:k]]
    keep = gram_values[:k] > gram_values[0] * 1e-12 if gram_values[0] > 0 else np.zeros(k, dtype=bool)
    components = np.zeros((k, h))
    components[keep] = (centred.T @ gram_vectors[:, keep] / np.sqrt(gram_values[:k][keep])).T
    variance = gram_values / (n - 1)
    total = variance.sum()
    return PCA(
        mean=mean, components=_fix_signs(components), explained_variance=variance[:k],
        explained_ratio=variance[:k] / total if total > 0 else np.zeros(k), num_samples=n,
    )


def fit_pca_streaming(chunks: Callable[[], Iterable[np.ndarray]], num_components: int = 6) -> PCA:
    """Exact PCA from chunks [n_i, h] that are never all in memory at once.

    `chunks` is called twice (mean, then the centred covariance; two passes keep the covariance
    accurate when the mean is large against the spread). Memory: O(h^2).
    """
    total = None
    count = 0
    for chunk in chunks():
        c = np.asarray(chunk, dtype=np.float64)
        total = c.sum(axis=0) if total is None else total + c.sum(axis=0)
        count += len(c)
    if total is None:
        raise ValueError("chunks yielded no data")
    k = _check_k(num_components, count, len(total))
    mean = total / count
    cov = np.zeros((len(mean), len(mean)))
    for chunk in chunks():
        c = np.asarray(chunk, dtype=np.float64) - mean
        cov += c.T @ c
    return _from_covariance(mean, cov / (count - 1), k, count)


def fit_trajectory_pca(
    states: np.ndarray,
    num_components: int = 6,
    *,
    skip_initial: bool = True,
    max_in_memory_bytes: int = DEFAULT_MAX_IN_MEMORY_BYTES,
) -> PCA:
    """PCA over all tokens at all steps of `states` [S+1, T, h] (a memory map is fine).

    skip_initial: leave s_0 out of the fit (a random draw that would add isotropic noise).
    """
    if states.ndim != 3:
        raise ValueError(f"states must be [steps+1, tokens, hidden], got shape {states.shape}")
    first = 1 if skip_initial and states.shape[0] > 1 else 0
    steps, tokens, hidden = states.shape[0] - first, states.shape[1], states.shape[2]
    if steps * tokens * hidden * 8 <= max_in_memory_bytes:
        return fit_pca(np.asarray(states[first:]).reshape(-1, hidden), num_components)
    return fit_pca_streaming(lambda: (states[i] for i in range(first, states.shape[0])), num_components)
