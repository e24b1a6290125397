"""Shared helpers of the linear-attention ops: input validation, precision, chunk reshapes.

Shapes follow one notation everywhere in `recurrent_depth.ops`:

    B batch · T length · H heads · K key/query head dim · V value head dim
    C chunk size · N number of chunks (T padded up to N·C)

Every public op validates its inputs here, so a wrong shape fails with a `ValueError` that names
the argument, what was received and what was expected, never with a broadcasting error from deep
inside torch.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F

F_ = TypeVar("F_", bound=Callable)


def autocast_off(fn: F_) -> F_:
    """Run an op (or an autograd.Function's forward/backward) with autocast disabled.

    The ops choose their own precision (float32 accumulation, float64 for float64 inputs). Under
    `torch.autocast` every matmul inside would instead run in bf16, so the state would accumulate in
    bf16 and the in-place products of the chunked forms (`baddbmm_`, `out=`) would get mismatched
    dtypes and raise. The device is taken from the first tensor argument.
    """

    @functools.wraps(fn)
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = next((a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if t is None or not torch.is_autocast_enabled(t.device.type):
            return fn(*args, **kwargs)
        with torch.autocast(t.device.type, enabled=False):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def check_tensor(name: str, x: object) -> torch.Tensor:
    """Require a floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate `q, k: [B, T, H, K]` and `v: [B, T, H, V]`; return `(B, T, H, K, V)`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
        if x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, H, D], got shape {_shape(x)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = {B}, {T}, {H} as in q, got {_shape(v)}")
    V = v.shape[-1]
    if T < 1:
        raise ValueError(f"sequence length T (dim 1 of q) must be >= 1, got {T}")
    if min(B, H, K, V) < 1:
        raise ValueError(f"B, H, K and V must all be >= 1, got B={B}, H={H}, K={K}, V={V}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    return B, T, H, K, V


def check_like(name: str, x: object, expected: tuple[int, ...], layout: str, ref: torch.Tensor) -> torch.Tensor:
    """Require tensor `x` to have exactly shape `expected` (documented as `layout`)."""
    check_tensor(name, x)
    assert isinstance(x, torch.Tensor)
    if _shape(x) != expected:
        raise ValueError(f"{name} must have shape {layout} = {expected}, got {_shape(x)}")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like q, got {x.device}")
    return x


def check_state(state: object, B: int, H: int, K: int, V: int, ref: torch.Tensor) -> torch.Tensor:
    """Require an `initial_state` of shape `[B, H, K, V]`."""
    return check_like("initial_state", state, (B, H, K, V), "[B, H, K, V]", ref)


def resolve_scale(scale: float | None, K: int) -> float:
    """`None` means `K ** -0.5`; anything else must be a positive finite number."""
    if scale is None:
        return K**-0.5
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ValueError(f"scale must be a positive number or None (meaning K**-0.5), got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None (meaning K**-0.5), got {scale}")
    return float(scale)


def check_chunk_size(chunk_size: int) -> int:
    """Chunk sizes are powers of two (1, 2, 4, ..., 1024), as the Fenwick levels of log-linear need."""
    ok = isinstance(chunk_size, int) and not isinstance(chunk_size, bool)
    if not ok or chunk_size < 1 or chunk_size > 1024 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two in [1, 1024], got {chunk_size!r}")
    return chunk_size


def fit_chunk_size(chunk_size: int, T: int) -> int:
    """The chunk size a call of T tokens runs with: `chunk_size` (checked by `check_chunk_size`), or the
    smallest power of two >= T when that is smaller.

    Chunking is exact at every power of two, so a short call (a prompt of a few tokens, a multi-token
    verify step of speculative decoding) gives the same result without padding itself up to one whole
    long chunk: 3 tokens at chunk_size=1024 cost the gated delta rule 450 ms instead of 1 ms.
    """
    return min(check_chunk_size(chunk_size), 1 << (T - 1).bit_length())


def acc_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """Accumulation dtype: float64 when any input is float64 (tight oracles), else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def to_chunks(x: torch.Tensor, C: int, left: int = 0) -> torch.Tensor:
    """`[B, T, H, *D]` -> `[B, H, N, C, *D]`, zero-padding `left` steps before and up to N·C after.

    Zero padding is neutral for every op here: a zero key/value writes nothing, a zero log-gate
    decays nothing, a zero beta updates nothing and a padded query's output is thrown away.
    """
    T = x.shape[1]
    N = -(-(T + left) // C)
    right = N * C - T - left
    x = x.movedim(1, 2)  # [B, H, T, *D]
    if left or right:
        pad = [0, 0] * (x.dim() - 3) + [left, right]
        x = F.pad(x, pad)
    return x.reshape(*x.shape[:2], N, C, *x.shape[3:]).contiguous()


def from_chunks(x: torch.Tensor, T: int, left: int = 0) -> torch.Tensor:
    """`[B, H, N, C, D]` -> `[B, T, H, D]`, dropping the padding that `to_chunks` added."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, left : left + T].transpose(1, 2)


def heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, T, H, *D]` -> `[B, H, T, *D]` in the accumulation dtype (for the recurrent loops)."""
    return x.movedim(1, 2).to(dtype)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    initial_state: object = None,
    beta: object = None,
    g: object = None,
    g_per_key: bool = False,
) -> tuple[int, int, int, int, int, float]:
    """Validate the common arguments of an op; return `(B, T, H, K, V, scale)`.

    `beta` and a scalar gate `g` are `[B, T, H]`; a per-key gate (`g_per_key`) is `[B, T, H, K]`;
    `initial_state` is `[B, H, K, V]`. Arguments passed as `None` are not checked.
    """
    B, T, H, K, V = check_qkv(q, k, v)
    if beta is not None:
        check_like("beta", beta, (B, T, H), "[B, T, H]", q)
    if g is not None:
        if g_per_key:
            check_like("g", g, (B, T, H, K), "[B, T, H, K]", q)
        else:
            check_like("g", g, (B, T, H), "[B, T, H]", q)
    if initial_state is not None:
        check_state(initial_state, B, H, K, V, q)
    return B, T, H, K, V, resolve_scale(scale, K)


def steps(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """Split `x` into per-step (or per-chunk) slices along `dim` for a Python loop.

    Use this instead of `x[:, t]` in loops under autograd: each indexing op's backward writes a
    full-size zero gradient, which makes a T-step loop O(T²) in the backward pass; `unbind`
    gathers all the slice gradients with one `stack`.
    """
    return x.unbind(dim)


def matmul_add_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`out += a @ b` in place for batched `[*, M, K] @ [*, K, N]` (same batch dims, no broadcasting).

    One `baddbmm_` accumulates inside the GEMM instead of writing `a @ b` out and adding it in a
    second pass (measured ~15% faster for the 64x64 blocks of the chunked ops). `out` must be
    contiguous; `a` and `b` may be transposed views.
    """
    out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out


def entering_states(like: torch.Tensor, S0: torch.Tensor | None) -> torch.Tensor:
    """An empty `[BH, N, K, V]` buffer shaped like `like` whose `[:, 0]` is the initial state (`S0`, or
    zeros): the sequential loops then write the state entering chunk n + 1 into `[:, n + 1]` in place."""
    states = torch.empty_like(like)
    if S0 is None:
        states[:, 0].zero_()
    else:
        states[:, 0].copy_(S0)
    return states
