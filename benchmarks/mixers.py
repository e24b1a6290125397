"""Token mixers on CPU: forward and forward+backward time, decode step time and decode state bytes.

One mixer layer at the `small` preset's width (h 256, 4 heads of 64), batch 1, float32, for
each sequence length T. For the linear family both the chunked and the step-by-step
(`fused_recurrent`) forms are timed (the recurrent form only up to `--max-recurrent-len`, it
is a Python loop over tokens). `state_bytes` is measured: the bytes in a `DynamicCache` after a
prefill of T tokens (one layer, one step), checked against the mixer's own `state_nbytes`.
`decode_ms` is one more token after that prefill. Hydra is bidirectional: no decode state.

    python benchmarks/mixers.py                          # T = 256, 1024, 2048 (a few minutes)
    python benchmarks/mixers.py --lengths 256 4096 --mixers gated_deltanet attention --threads 2

Prints one JSON line, then a table. Timings are medians of `--repeats` runs; on a shared machine
they move with its load, the state bytes do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from types import SimpleNamespace

import torch
from _args import positive_int

import recurrent_depth as rd
from recurrent_depth.model.mixers import build_mixer
from recurrent_depth.model.mixers.hydra import Hydra

# name -> (registered mixer, options, has a step-by-step form to compare)
CASES = {
    "attention": ("attention", {}, False),
    "attention-mqa": ("attention", {"num_kv_heads": 1}, False),
    "attention-window512": ("attention", {"window": 512}, False),
    "mla": ("mla", {}, False),
    "dsa-top256": ("dsa", {"topk": 256}, False),
    "nsa": ("nsa", {}, False),
    "linear_attention": ("linear_attention", {}, True),
    "deltanet": ("deltanet", {}, True),
    "gla": ("gla", {}, True),
    "gated_deltanet": ("gated_deltanet", {}, True),
    "log_linear_mamba2": ("log_linear_mamba2", {}, True),
    "log_linear_gated_deltanet": ("log_linear_gated_deltanet", {}, True),
    "hydra": ("hydra", {}, True),
    "ttt_kvb": ("ttt_kvb", {}, True),
    "falcon": ("falcon", {}, True),
}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, lazy tables)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def context(cfg: rd.ModelConfig, T: int, cache=None):
    return rd.RecurrentDepthLM.make_context(SimpleNamespace(config=cfg), torch.zeros(1, T, dtype=torch.long),
                                            cache=cache)


def build(case: str, cfg: rd.ModelConfig, mode: str | None):
    name, options, _ = CASES[case]
    options = dict(options)
    if mode is not None:
        options["mode"] = mode
    torch.manual_seed(0)
    if name == "hydra":
        return Hydra(cfg, **options)
    return build_mixer(name, cfg, "core", **options)


def measure(case: str, mode: str | None, T: int, cfg: rd.ModelConfig, repeats: int) -> dict:
    mixer = build(case, cfg, mode)
    x = torch.randn(1, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    key = ("core", 0, 0)

    def call(inp, cache=None):
        if isinstance(mixer, Hydra):
            return mixer(inp)
        return mixer(inp, context(cfg, inp.shape[1], cache), key)

    def fwd():
        with torch.no_grad():
            call(x)

    def fwd_bwd():
        call(x).square().mean().backward()

    row = {"mixer": case, "mode": mode or "-", "T": T}
    row["fwd_ms"] = 1e3 * median_time(fwd, repeats)
    row["fwd_bwd_ms"] = 1e3 * median_time(fwd_bwd, repeats)
    if isinstance(mixer, Hydra):
        row.update(decode_ms=None, state_bytes=None)
        return row
    with torch.no_grad():
        cache = rd.DynamicCache()
        call(x.detach(), cache)
        cache.advance(T)
        row["state_bytes"] = cache.nbytes()
        assert row["state_bytes"] == mixer.state_nbytes(1, T), (case, row["state_bytes"], mixer.state_nbytes(1, T))
        state = {k: v for k, v in cache.states.items()}
        kv = dict(cache.kv)
        token = x.detach()[:, -1:]

        def decode():
            cache.states, cache.kv, cache.seq_len = dict(state), dict(kv), T
            call(token, cache)

        row["decode_ms"] = 1e3 * median_time(decode, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 1024, 2048],
                        help="sequence lengths T (default: 256 1024 2048)")
    parser.add_argument("--mixers", nargs="+", default=list(CASES), choices=list(CASES),
                        help="mixers to run (default: all)")
    parser.add_argument("--max-recurrent-len", type=positive_int, default=1024,
                        help="time the step-by-step form only up to this T (default: 1024)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per measurement (default: 3)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = rd.ModelConfig.from_preset("small", max_seq_len=max(args.lengths) + 1)
    rows = []
    for case in args.mixers:
        has_recurrent = CASES[case][2]
        for length in args.lengths:
            modes = ["chunk"] if has_recurrent else [None]
            if has_recurrent and length <= args.max_recurrent_len:
                modes.append("fused_recurrent")
            for mode in modes:
                rows.append(measure(case, mode, length, cfg, args.repeats))
    meta = dict(benchmark="mixers", hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                batch=1, dtype="float32", threads=args.threads, torch=torch.__version__, machine=platform.machine())
    print(json.dumps({**meta, "rows": rows}))
    print(f"{'mixer':28s} {'mode':16s} {'T':>5s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'decode ms':>10s} "
          f"{'state bytes':>12s}")
    for r in rows:
        dec = "-" if r["decode_ms"] is None else f"{r['decode_ms']:.2f}"
        state = "-" if r["state_bytes"] is None else str(r["state_bytes"])
        print(f"{r['mixer']:28s} {r['mode']:16s} {r['T']:5d} {r['fwd_ms']:9.1f} {r['fwd_bwd_ms']:11.1f} {dec:>10s} "
              f"{state:>12s}")


if __name__ == "__main__":
    main()
