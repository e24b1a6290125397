"""The depth sampler: how many core steps a training forward runs, and how many of them get gradients.

This module is the one place the depth distribution is written. Huginn-0125 trains with a random
number of recurrences per micro-batch so that the model learns to use any test-time depth. The
paper's sampler ("poisson-lognormal") draws

    tau ~ Normal(log(r_bar) - sigma**2 / 2, sigma)        # so that E[exp(tau)] = r_bar
    r   = Poisson(exp(tau)) + 1                            # total core steps, r >= 1

and truncates backpropagation to the last ``k`` steps:

    no_grad_steps = max(r - k, 0)        grad_steps = min(r, k)

The pair ``(no_grad_steps, grad_steps)`` is exactly what ``RecurrentDepthLM.forward(num_steps=(n, k))``
takes. Note the ``+ 1``: the mean *total* depth is ``r_bar + 1`` (33 for the paper's r_bar = 32).

Two callers, one function (`DepthSampler.draw`), two random streams:

* **The model** (``RecurrentDepthLM.forward(num_steps=None)`` in training mode) calls
  ``DepthSampler(config.mean_recurrence, config.mean_backprop_depth).sample_from(generator)`` with the
  forward's own ``generator`` (the global torch RNG when it is None), the same stream that then draws
  the initial state s_0. A plain ``model(ids, labels=ids)`` training loop thus behaves like any
  PyTorch module with randomness (seed torch, get the same run), and one seeded generator
  reproduces a whole forward, depth included.
* **The trainer** (``train/``, which re-exports this module as ``recurrent_depth.train.depth``)
  calls ``DepthSampler.sample(step, rank)``, which draws from a fresh generator seeded from
  ``(seed, step)`` alone (``generator_for``), ``step`` being the global micro-batch index. So every
  data-parallel rank draws the same depth for the same step ("locked-step", as in the Huginn run), a
  resumed run draws the same depths as an uninterrupted one, and neither the global torch RNG nor
  the forward's generator (which the trainer seeds separately for s_0) is read or advanced. The
  trainer passes the pair to the model as an explicit ``num_steps``.

Given the same generator state both callers draw the same depth.

Schedules beside the paper's (trainer only, they need the step): a **curriculum**
(``ramp_steps > 0``) moves the mean depth linearly from ``ramp_start`` to ``r_bar`` over the first
``ramp_steps`` micro-batches and keeps ``r_bar`` after (any scheme; ``fixed`` and ``uniform`` round
the mean to an integer), so early training, when deep unrolls cost most and teach least, runs
shallow. **Per-rank draws** (``per_rank=True``) give each data-parallel rank its own depth stream
(seeded by ``(seed, step, rank)``) instead of the locked step: the ranks' micro-batches then cover
more depths per optimizer step, at the cost of the fastest rank waiting for the deepest at the
gradient all-reduce.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

import torch

from recurrent_depth.config import is_int, is_real

SCHEMES: tuple[str, ...] = ("poisson-lognormal", "fixed", "uniform")

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of the SplitMix64 finaliser: a bijective 64-bit mix with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, step: int) -> int:
    """The 64-bit generator seed for draw ``step`` of a sampler seeded with ``seed``.

    Mixing (rather than ``seed + step``) keeps the streams of neighbouring seeds unrelated:
    with plain addition, seed 1 at step 0 would replay seed 0 at step 1.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


def truncate(total_steps: int, backprop_depth: int) -> tuple[int, int]:
    """Split ``total_steps`` into ``(no_grad_steps, grad_steps)``; the last ``backprop_depth`` get gradients.

    ``no_grad_steps = max(r - k, 0)`` and ``grad_steps = min(r, k)``; they always sum to ``r``.
    """
    if total_steps < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    if backprop_depth < 1:
        raise ValueError(f"backprop_depth must be >= 1, got {backprop_depth}")
    return max(total_steps - backprop_depth, 0), min(total_steps, backprop_depth)



@dataclass(frozen=True)
class DepthSampler:
    """Draws the per-micro-batch recurrence depth and its truncated-backprop split.

    Args:
        mean_recurrence: r_bar, the centre of the distribution (>= 1). For ``poisson-lognormal`` it may be
            fractional; ``fixed`` and ``uniform`` need an integer.
        backprop_depth: k, the number of final steps that receive gradients (>= 1).
        sigma: spread of the log-normal (>= 0; the paper uses 0.5). ``sigma = 0`` gives
            ``Poisson(r_bar) + 1``. Only used by ``poisson-lognormal``.
        seed: base seed (>= 0). Together with ``step`` it fixes each of the trainer's draws (``sample``);
            the model's draws (``sample_from``) come from the generator they are given instead.
        scheme: ``"poisson-lognormal"`` (the paper's), ``"fixed"`` (always ``r = r_bar``) or ``"uniform"``
            (``r`` uniform on the integers ``1 .. 2*r_bar - 1``, mean ``r_bar``).
        max_steps: optional cap on the total depth ``r`` (>= 1), to bound the cost of the log-normal's long
            tail (P(r > 2*r_bar) is about 6% at sigma 0.5). ``None`` = no cap.
        ramp_steps: curriculum length in micro-batches (>= 0; 0 = no curriculum): the mean depth goes
            linearly from ``ramp_start`` at step 0 to ``mean_recurrence`` at ``ramp_steps``.
        ramp_start: the curriculum's first mean depth (>= 1).
        per_rank: draw a separate depth per data-parallel rank (``sample(step, rank)``) instead of one
            locked-step depth for all ranks.

    Difference from the reference code: when ``mean_recurrence < backprop_depth``, the official training
    code centres the log-normal on ``max(r_bar, k)`` (it uses ``ln(t + s)`` with
    ``t = max(r_bar - k, 0)``, ``s = k``), so small-r_bar runs still average about ``k`` steps. This class
    follows the paper's formula and centres on ``r_bar`` in every case. For ``r_bar >= k`` (the Huginn run:
    r_bar 32, k 8) the two are identical. To reproduce the reference's behaviour for ``r_bar < k``, pass
    ``mean_recurrence=max(r_bar, k)``.

    Example:
        >>> sampler = DepthSampler(mean_recurrence=32, backprop_depth=8, seed=0)
        >>> n, k = sampler.sample(step=0)      # model(input_ids, num_steps=(n, k))
    """

    mean_recurrence: float
    backprop_depth: int
    sigma: float = 0.5
    seed: int = 0
    scheme: str = "poisson-lognormal"
    max_steps: int | None = None
    ramp_steps: int = 0
    ramp_start: float = 1.0
    per_rank: bool = False

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        mean = self.mean_recurrence
        if not is_real(mean) or mean < 1:
            raise ValueError(f"mean_recurrence must be a finite number >= 1, got {mean!r}")
        if self.scheme in ("fixed", "uniform") and float(mean) != int(mean):
            raise ValueError(f"mean_recurrence must be an integer for scheme {self.scheme!r}, got {mean!r}")
        if not is_int(self.backprop_depth) or self.backprop_depth < 1:
            raise ValueError(f"backprop_depth must be an integer >= 1, got {self.backprop_depth!r}")
        if not is_real(self.sigma) or self.sigma < 0:
            raise ValueError(f"sigma must be a finite number >= 0, got {self.sigma!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.max_steps is not None and (not is_int(self.max_steps) or self.max_steps < 1):
            raise ValueError(f"max_steps must be None or an integer >= 1, got {self.max_steps!r}")
        if not is_int(self.ramp_steps) or self.ramp_steps < 0:
            raise ValueError(f"ramp_steps must be an integer >= 0 (0 = no curriculum), got {self.ramp_steps!r}")
        if not is_real(self.ramp_start) or self.ramp_start < 1:
            raise ValueError(f"ramp_start must be a finite number >= 1, got {self.ramp_start!r}")
        if not isinstance(self.per_rank, bool):
            raise ValueError(f"per_rank must be True or False, got {self.per_rank!r}")

    def mean_at(self, step: int) -> float:
        """The mean depth at micro-batch ``step``: ``mean_recurrence``, or on the curriculum's ramp."""
        if self.ramp_steps == 0 or step >= self.ramp_steps:
            mean = float(self.mean_recurrence)
        else:
            mean = self.ramp_start + (self.mean_recurrence - self.ramp_start) * step / self.ramp_steps
        return mean if self.scheme == "poisson-lognormal" else float(max(1, round(mean)))

    def expected_total_steps(self) -> float:
        """E[r] on the plateau, without the ``max_steps`` cap: r_bar + 1 for the log-normal Poisson, r_bar otherwise."""
        return float(self.mean_recurrence) + (1.0 if self.scheme == "poisson-lognormal" else 0.0)

    def generator_for(self, step: int, rank: int = 0) -> torch.Generator:
        """The trainer's stream for micro-batch ``step``: a fresh CPU generator seeded from ``(seed, step)``.

        With ``per_rank`` the seed also mixes in ``rank``; otherwise every rank gets the same stream."""
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            step = int(step)  # numpy integer scalars are fine
        if not is_int(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0 (the global micro-batch index), got {step!r}")
        if not is_int(rank) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        seed = stream_seed(self.seed, step)
        if self.per_rank:
            seed = stream_seed(seed, rank + 1)
        return torch.Generator(device="cpu").manual_seed(seed)

    def draw(self, generator: torch.Generator | None = None, mean: float | None = None) -> int:
        """Total depth ``r`` (>= 1) drawn from ``generator``, after the ``max_steps`` cap.

        The one implementation of the schemes. ``generator`` may live on any device; None draws from
        the global torch RNG. ``mean`` is the centre to draw around (default ``mean_recurrence``; the
        curriculum passes ``mean_at(step)``)."""
        mean = float(self.mean_recurrence) if mean is None else mean
        device = generator.device if generator is not None else torch.device("cpu")
        if self.scheme == "fixed":
            r = int(mean)
        elif self.scheme == "uniform":
            r = int(torch.randint(1, 2 * int(mean), (), generator=generator, device=device))
        else:
            # mu = log(r_bar) - sigma^2/2 makes E[exp(tau)] = r_bar, hence E[r] = r_bar + 1.
            mu = math.log(mean) - 0.5 * self.sigma**2
            tau = mu + self.sigma * torch.randn((), generator=generator, dtype=torch.float64, device=device)
            r = int(torch.poisson(tau.exp(), generator=generator)) + 1
        if self.max_steps is not None:
            r = min(r, self.max_steps)
        return r

    def total_steps(self, step: int, rank: int = 0) -> int:
        """Total depth ``r`` (>= 1) for global micro-batch ``step`` (>= 0), from the trainer's stream.

        ``rank`` matters only with ``per_rank`` (otherwise every rank draws the same depth)."""
        generator = self.generator_for(step, rank)  # checks step and rank
        return self.draw(generator, self.mean_at(int(step)))

    def sample(self, step: int, rank: int = 0) -> tuple[int, int]:
        """``(no_grad_steps, grad_steps)`` for global micro-batch ``step`` (on ``rank``); pass it as ``num_steps``."""
        return truncate(self.total_steps(step, rank), self.backprop_depth)

    def sample_from(self, generator: torch.Generator | None = None) -> tuple[int, int]:
        """``(no_grad_steps, grad_steps)`` drawn from a caller's ``generator`` (None: the global torch RNG).

        The model's ``num_steps=None`` path; no step, so no curriculum."""
        return truncate(self.draw(generator), self.backprop_depth)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data description (for run metadata and checkpoints)."""
        return asdict(self)
