"""KV quantizers benchmark: distortion, inner-product bias / variance, bytes and speed per method.

    python benchmarks/quant.py                 # d = 64 and 128, 4096 vectors, 1 thread
    python benchmarks/quant.py --quick         # smoke test (d = 64, 512 vectors)
    python benchmarks/quant.py --specs prod:3.5 mse:3.5 --dims 128

For every spec (method:bits[:option], see docs/quant.md) and head dim d, on random unit vectors
(seeded; one quantizer seed, 0):
- `mse`: E‖x − x̃‖² over --vectors unit vectors; next to it the Lloyd–Max value integrated from the
  sphere-coordinate density (integer-bit mse only) and Theorem 1's bound (√3π/2)·4^{−b};
- `ip_bias`, `ip_se`, `ip_var`: mean, standard error and variance of ⟨y, x̃⟩ − ⟨y, x⟩ over --vectors
  random unit pairs with ⟨x, y⟩ = 0.6 (y kept full precision, scored from the codes); for prod and
  QJL, the bound on the variance (Theorem 2, (√3π²/d)·4^{−b}; QJL's π/(2m));
- `bytes`: bytes per vector, every fp16 norm counted, and `x_16bit`: 2d / bytes (fp16 and bf16 both
  take 2 bytes per coordinate);
- encode and decode throughput (vectors/s, best of --repeats), and for one query against --keys
  keys: `score` (from the codes) and `decode+matmul` in microseconds.
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from recurrent_depth.quant import QJL, QuantSpec, build_quantizer, sphere_codebook
from recurrent_depth.quant.codebook import boundaries, sphere_log_density

SPECS = ["mse:1", "mse:2", "mse:2.5", "mse:3", "mse:3.5", "mse:4", "mse:3.5:hadamard", "prod:1", "prod:2",
         "prod:2.5", "prod:3", "prod:3.5", "prod:4", "prod:3.5:hadamard", "qjl:1", "qjl:2", "polar", "raw:16"]
RHO = 0.6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", nargs="+", default=SPECS, help="quantizer specs (default: a sweep of every method)")
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128], help="head dims (default: %(default)s)")
    p.add_argument("--vectors", type=int, default=4096, help="unit vectors / pairs measured (default: %(default)s)")
    p.add_argument("--keys", type=int, default=4096, help="keys scored by one query (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs, best kept (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="d = 64, 512 vectors and keys, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.vectors, args.keys, args.repeats = [64], 512, 512, 1
    for name in ("vectors", "keys", "repeats", "threads"):
        if getattr(args, name) < (2 if name in ("vectors", "keys") else 1):
            p.error(f"--{name} is too small: {getattr(args, name)}")
    try:
        for spec in args.specs:
            QuantSpec.parse(spec)
    except ValueError as exc:
        p.error(str(exc))
    return args


def best_time(fn: Callable[[], object], repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def lloyd_max_distortion(d: int, bits: int) -> float:
    """d · E(X − Q(X))² for the sphere-coordinate density, by the trapezoid rule on a fine grid."""
    centroids = np.array(sphere_codebook(d, bits))
    x = np.linspace(-1 + 1e-9, 1 - 1e-9, 400001)
    density = np.exp(sphere_log_density(d)(x))
    q = centroids[np.searchsorted(np.array(boundaries(tuple(centroids))), x)]
    f = (x - q) ** 2 * density
    return d * float(np.sum((f[1:] + f[:-1]) / 2 * np.diff(x)))  # trapezoid rule


def theory(spec: QuantSpec, quant, d: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mse_lloyd_max": None, "mse_bound": None, "ip_var_bound": None}
    integer = float(spec.bits).is_integer()
    if spec.method == "mse" and integer:
        out["mse_lloyd_max"] = lloyd_max_distortion(d, int(spec.bits))
    if spec.method in ("mse", "prod") and integer:
        b = int(spec.bits)
        out["mse_bound"] = math.sqrt(3) * math.pi / 2 * 4.0**-b if spec.method == "mse" else None
        out["ip_var_bound"] = math.sqrt(3) * math.pi**2 / d * 4.0**-b if spec.method == "prod" else None
    if isinstance(quant, QJL):
        out["ip_var_bound"] = math.pi / (2 * quant.sketch_size)
    return out


def measure(spec_text: str, d: int, args: argparse.Namespace) -> dict:
    spec = QuantSpec.parse(spec_text)
    quant = build_quantizer(spec, d, seed=0)
    gen = torch.Generator().manual_seed(args.seed)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, d, generator=gen), dim=-1)  # noqa: E731
    x = unit(args.vectors)
    z = unit(args.vectors)
    z = torch.nn.functional.normalize(z - (z * x).sum(-1, keepdim=True) * x, dim=-1)
    y = RHO * x + math.sqrt(1 - RHO**2) * z
    codes = quant.encode(x)
    mse = ((x - quant.decode(codes)) ** 2).sum(-1).mean().item()
    err = (quant.score(y.unsqueeze(1), quant.encode(x.unsqueeze(1))).flatten() - RHO).double()
    enc_s = best_time(lambda: quant.encode(x), args.repeats)
    dec_s = best_time(lambda: quant.decode(codes), args.repeats)
    keys = quant.encode(unit(args.keys))
    query = unit(1)
    score_s = best_time(lambda: quant.score(query, keys), args.repeats)
    dequant_s = best_time(lambda: query @ quant.decode(keys).mT, args.repeats)
    return {
        "spec": quant.spec, "dim": d, "bits": quant.bits, "bits_per_coordinate": quant.bits_per_coordinate,
        "bytes": quant.bytes_per_vector, "x_16bit": 2 * d / quant.bytes_per_vector,
        "mse": mse, **theory(spec, quant, d),
        "ip_bias": err.mean().item(), "ip_se": (err.std() / math.sqrt(len(err))).item(), "ip_var": err.var().item(),
        "encode_vec_per_s": args.vectors / enc_s, "decode_vec_per_s": args.vectors / dec_s,
        "score_us": 1e6 * score_s, "decode_matmul_us": 1e6 * dequant_s,
    }


def fmt(v: float | None, spec: str = "8.4f") -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}s}" if v is None else format(v, spec)


def print_table(report: dict) -> None:
    head = (f"{'spec':20s} {'d':>4s} {'bits/c':>7s} {'bytes':>6s} {'x16bit':>6s} {'mse':>8s} {'lloyd':>8s} "
            f"{'thm1':>8s} {'ip bias':>9s} {'±se':>8s} {'ip var':>9s} {'var bnd':>9s} {'enc k/s':>8s} "
            f"{'dec k/s':>8s} {'score us':>9s} {'deq+mm us':>9s}")
    print(head)
    print("-" * len(head))
    for r in report["rows"]:
        print(f"{r['spec']:20s} {r['dim']:4d} {r['bits_per_coordinate']:7.3f} {r['bytes']:6d} {r['x_16bit']:6.2f} "
              f"{r['mse']:8.4f} {fmt(r['mse_lloyd_max'])} {fmt(r['mse_bound'])} {r['ip_bias']:+9.5f} "
              f"{r['ip_se']:8.5f} {r['ip_var']:9.6f} {fmt(r['ip_var_bound'], '9.6f')} "
              f"{r['encode_vec_per_s'] / 1e3:8.1f} {r['decode_vec_per_s'] / 1e3:8.1f} {r['score_us']:9.0f} "
              f"{r['decode_matmul_us']:9.0f}")
    print(f"unit vectors, {report['vectors']} pairs with <x,y> = {RHO}; scores for 1 query x {report['keys']} keys; "
          f"bytes count every fp16 norm; x16bit = 2d / bytes (fp16 = bf16)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for d in args.dims:
        for spec in args.specs:
            try:
                rows.append(measure(spec, d, args))
            except ValueError as exc:  # e.g. a split that does not divide this d
                print(f"skip {spec} at d = {d}: {exc}", file=sys.stderr)
    report = {
        "benchmark": "quant", "vectors": args.vectors, "keys": args.keys, "repeats": args.repeats,
        "threads": args.threads, "seed": args.seed, "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "rows": rows,
    }
    print(json.dumps(report))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
