"""Sliding-window KV cache benchmark: the bounded cache (O(W) columns per windowed layer) against the full one.

    python benchmarks/window_cache.py                         # layouts mistral, gemma2; W 64, 256; 256-2048 new tokens
    python benchmarks/window_cache.py --windows 128 --new-tokens 4096 --num-steps 8
    python benchmarks/window_cache.py --quick                 # smoke test (hidden 32, W 16, 64 new tokens)
    python benchmarks/window_cache.py --kv-quant k=prod:3.5,v=mse:3.5   # the same with a quantized KV cache
    python benchmarks/window_cache.py --mode serving          # the server's batch KV pool: 4 rows, W 64, 2048 tokens
    python benchmarks/window_cache.py --mode speculative      # self-speculative decoding: W 64, 1024 tokens
    python benchmarks/window_cache.py --mode parallel         # the parallel sampler: W 64, 1024 tokens

A seeded random model (hidden --hidden, 4 heads, 2 KV heads, 1 prelude, 2 core and 1 coda layer, vocab 256,
float32) with sliding-window attention in one of two layouts (--layouts): `mistral`, every layer windowed W,
or `gemma2`, windowed and full layers alternating (prelude W, core full / W, coda full). For each layout,
window W (--windows) and number of new tokens (--new-tokens, after a --prompt-len random prompt), greedy
autoregressive decoding at r = --num-steps in three variants, in one process, taking turns each round:
- `bounded`: the library's default, windowed layers drop the columns no query sees (inference/cache.py);
- `full`: every column kept (`RDEPTH_FULL_WINDOW_CACHE=1`), as the cache did before the bound;
- `full, no C++ decode`: the same with `RDEPTH_NO_CPP_DECODE=1`. A windowed cache runs the fused runner's
  Python decode path (the C++ decode of accel/decode_cpp.py writes column `seq_len` of each store, whose
  columns start at the first it holds in a windowed one: `decode_views` hands out none), so this is the
  speed baseline on the same path; `cpp_decode` in the JSON says whether `full` ran with the C++ decode.
With --kv-quant SPEC every variant runs with that quantized KV cache (`kv_quant=`; the bounded one drops code
rows, exact against the full quantized cache), and the bytes below are its code rows (and bf16 window, if any).
Per variant:
- `held_bytes`: the cache's KV bytes after the last token (`out.cache_bytes`, exact: the columns each layer
  holds), `peak_held_bytes` its largest value over the run, and `allocated_bytes`: the storage allocated at
  the end (`out.cache_allocated_bytes`, room for columns not written yet included), float32 entries;
- `peak_rss_delta_mib`: the process's peak RSS during the call over its RSS before it (VmHWM after a reset,
  large allocations mmapped so that freed tensors leave the RSS; null where that is refused), largest of
  the rounds;
- `tokens_per_s`: decode tokens per second (prefill excluded), best of --repeats rounds, and
  `cpu_tokens_per_s`: per second of this process's CPU time in the decode (the call's CPU time less a
  prefill-only call's: steadier on a shared machine; null where the difference is not positive);
- `agreement`: the fraction of new tokens equal to the `full` variant's (must be 1.0: the bound is exact),
  and `first_difference`: the index of the first differing token (null if none).
Per case, `x_held_bytes` / `x_allocated_bytes` / `x_peak_rss`: the full variant's figure over the bounded
one's (how many times smaller it is), `x_tokens_per_s` / `x_cpu_tokens_per_s`: the bounded one's speed over
the full one's, and `x_tokens_per_s_same_path`: over `full, no C++ decode`'s.

`--mode serving` measures the server's continuous batch instead (`serving.batch.BatchDecoder`, driven directly,
no HTTP): --rows requests (default 4, each its own --prompt-len random prompt) join one decoder and generate the
new tokens (default 2048, at W 64) together, greedy at r = --num-steps, in two variants taking turns each round:
`bounded` (the pool's windowed layers hold each row's recent columns, `serving/kv_pool.py`) and `full`
(`RDEPTH_FULL_WINDOW_CACHE=1`, read when the decoder is built). With --kv-quant the pool stores that codec's
code rows (whatever the pool then bounds is what the figures show). Per variant:
- `pool_bytes`: the pool's `nbytes()` after the last token (what /metrics' `rdepth_kv_pool_bytes` shows: the
  storage allocated, rows' room included), and `peak_pool_bytes` its largest value after any step;
- `peak_rss_delta_mib`: as above, over the decoder's building, the prefills and the decode;
- `tokens_per_s` / `cpu_tokens_per_s`: every row's decode tokens (each row's first one comes from its prefill)
  per second of the step loop, wall and this process's CPU time;
- `agreement` / `first_difference`: every row's tokens against the `full` pool's (the fraction equal, and the
  first token index where any row differs), and `agreement_alone` / `first_difference_alone`: row 0's
  against `rd.generate` of its prompt alone (the library's default cache, with --kv-quant if given).
Per case, `x_pool_bytes` / `x_peak_pool_bytes` / `x_peak_rss`: the full pool's figure over the bounded one's,
and `x_tokens_per_s` / `x_cpu_tokens_per_s`: the bounded one's speed over the full one's.

`--mode speculative` (draft at r // 2 steps, --lookahead drafts a round) and `--mode parallel` (the wavefront
sampler, --wavefront positions) measure those decoding loops of `rd.generate` as the default mode does (one
sequence, the same figures), in the `bounded` and `full` variants only (neither loop runs the C++ decode): their
windowed layers keep a round's drafts and rejected-draft holes (speculative) and 16 columns more than W
(inference/cache.py: `window_back`); --mode parallel also reports `buffer_bytes`, the most bytes the sampler's
per-column buffers (latent states, inputs, step counts) held, not in the KV bytes: bounded too, as they drop the
columns every row has frozen (inference/parallel.py), in both variants.
Prints one JSON line, then a table. Times depend on the machine and its load (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import recurrent_depth as rd
from recurrent_depth.accel import decode_cpp
from recurrent_depth.inference import generate
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV
from recurrent_depth.inference.kv_codec import parse_kv_quant_option
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, RowRequest

sys.path.insert(0, str(Path(__file__).parent))
from _args import positive_int  # noqa: E402
from qlora_train import MMAP_SMALL, Memory  # noqa: E402 (the RSS figures, one place)

VOCAB = 256
LAYOUTS = ("mistral", "gemma2")
# variant -> the environment it runs under (None: unset)
VARIANTS: dict[str, dict[str, str | None]] = {
    "bounded": {FULL_WINDOW_CACHE_ENV: None},
    "full": {FULL_WINDOW_CACHE_ENV: "1"},
    "full, no C++ decode": {FULL_WINDOW_CACHE_ENV: "1", decode_cpp.NO_DECODE_ENV: "1"},
}
# --mode serving, speculative, parallel: the C++ decode runs in neither (the pool's `decode_views` hands out none;
# the speculative and parallel loops do not decode a token at a time), so no same-path baseline
BOUNDED_AND_FULL: dict[str, dict[str, str | None]] = {name: VARIANTS[name] for name in ("bounded", "full")}
REFERENCE = "full"
MODES = ("generate", "serving", "speculative", "parallel")
SERVING_ROWS = 4  # --rows' default
# --windows' and --new-tokens' defaults per mode (serving: W 64 and the long decode only, --rows of each, so that
# both layouts take ~4 min on a loaded 2-core machine)
DEFAULTS = {"generate": dict(windows=[64, 256], new_tokens=[256, 1024, 2048]),
            "serving": dict(windows=[64], new_tokens=[2048]),
            "speculative": dict(windows=[64], new_tokens=[1024]),
            "parallel": dict(windows=[64], new_tokens=[1024])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="generate", choices=MODES,
                   help="generate: rd.generate's cache, one sequence; serving: the server's batch KV pool "
                        "(BatchDecoder, --rows requests at once); speculative, parallel: rd.generate's cache under "
                        "those decoding loops (default: %(default)s)")
    p.add_argument("--rows", type=positive_int, default=None,
                   help=f"--mode serving: concurrent requests (default: {SERVING_ROWS})")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                   help="which layers have windows (default: %(default)s)")
    p.add_argument("--windows", type=int, nargs="+", default=None,
                   help=f"window sizes W (default: {DEFAULTS['generate']['windows']}; --mode serving: "
                        f"{DEFAULTS['serving']['windows']})")
    p.add_argument("--new-tokens", type=int, nargs="+", default=None,
                   help=f"new tokens per run (default: {DEFAULTS['generate']['new_tokens']}; --mode serving: "
                        f"{DEFAULTS['serving']['new_tokens']} per row)")
    p.add_argument("--lookahead", type=positive_int, default=4,
                   help="--mode speculative: drafted tokens per round (default: %(default)s)")
    p.add_argument("--wavefront", type=positive_int, default=4,
                   help="--mode parallel: positions refining at once (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=4, help="recurrence depth r (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size, a multiple of 8 (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds, best speed kept (default: %(default)s: the full grid takes ~5 min on a loaded "
                        "2-core machine)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and prompt (default: %(default)s)")
    p.add_argument("--kv-quant", default=None, metavar="SPEC",
                   help="run every variant with this quantized KV cache, e.g. k=prod:3.5,v=mse:3.5 (default: float32)")
    p.add_argument("--quick", action="store_true", help="hidden 32, W 16, 64 new tokens, r = 2, 1 round")
    args = p.parse_args(argv)
    try:
        args.kv_quant = parse_kv_quant_option(args.kv_quant)
    except ValueError as exc:
        p.error(str(exc))
    if args.rows is not None and args.mode != "serving":
        p.error("--rows applies to --mode serving only")
    args.rows = args.rows or SERVING_ROWS
    for name, default in DEFAULTS[args.mode].items():
        setattr(args, name, getattr(args, name) or default)
    if args.quick:
        args.hidden, args.windows, args.new_tokens, args.prompt_len = 32, [16], [64], 16
        args.num_steps, args.repeats = 2, 1
    for name in ("prompt_len", "num_steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden < 8 or args.hidden % 8:  # (4 heads of an even size: rotary pairs)
        p.error(f"--hidden must be a positive multiple of 8, got {args.hidden}")
    if min(args.windows) < 1:
        p.error(f"--windows must be >= 1, got {min(args.windows)}")
    if min(args.new_tokens) < 2:  # (the decode speed counts the tokens after the first)
        p.error(f"--new-tokens must be >= 2, got {min(args.new_tokens)}")
    return args


def layer_windows_of(layout: str, window: int) -> list[int | None]:
    """`attention_windows` (prelude, core 0, core 1, coda) of a layout."""
    return [window] * 4 if layout == "mistral" else [window, None, window, None]


def make_model(args: argparse.Namespace, layout: str, window: int) -> rd.RecurrentDepthLM:
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_heads=4, num_kv_heads=2,
                         intermediate_size=-(-int(args.hidden * 2.75) // 16) * 16, prelude_layers=1, core_layers=2,
                         coda_layers=1, max_seq_len=args.prompt_len + max(args.new_tokens),
                         attention_windows=layer_windows_of(layout, window))
    torch.manual_seed(args.seed)
    return rd.RecurrentDepthLM(cfg).eval()


@contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """Run with these environment variables set (None: unset), restored after."""
    before = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mode_options(args: argparse.Namespace) -> dict[str, Any]:
    """`rd.generate`'s options for the decoding loop --mode names (token by token for generate)."""
    if args.mode == "speculative":
        return dict(draft_steps=max(1, args.num_steps // 2), lookahead=args.lookahead)
    if args.mode == "parallel":
        return dict(sampler="parallel", wavefront=args.wavefront)
    return {}


def run_once(model: rd.RecurrentDepthLM, prompt: torch.Tensor, new_tokens: int, args: argparse.Namespace,
             memory: Memory) -> dict[str, Any]:
    """One greedy decode: its tokens, exact cache bytes, peak RSS over the RSS before it, wall and CPU speed."""
    common = dict(num_steps=args.num_steps, init_scale=0.0, do_sample=False, kv_quant=args.kv_quant,
                  **mode_options(args))
    before = memory.reset()
    cpu0 = time.process_time()
    out = generate(model, prompt, max_new_tokens=new_tokens, **common)
    cpu1 = time.process_time()
    peak, _ = memory.since(before, collect=False)
    cpu2 = time.process_time()
    generate(model, prompt, max_new_tokens=1, **common)  # the prefill alone
    decode_cpu = (cpu1 - cpu0) - (time.process_time() - cpu2)
    return dict(
        tokens=out.sequences[0, prompt.shape[1]:],
        held_bytes=int(out.cache_bytes[0, -1]), peak_held_bytes=int(out.cache_bytes.max()),
        allocated_bytes=int(out.cache_allocated_bytes), peak_rss_delta_mib=peak,
        tokens_per_s=round(out.tokens_per_second, 1),
        cpu_tokens_per_s=round((new_tokens - 1) / decode_cpu, 1) if decode_cpu > 0 else None,
        **({"buffer_bytes": out.stats["buffer_bytes"]} if args.mode == "parallel" else {}),
    )


def best(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def rounds(variants: dict[str, dict[str, str | None]], run: Callable[[], dict[str, Any]], repeats: int
           ) -> tuple[dict[str, dict[str, Any]], dict[str, list[torch.Tensor]]]:
    """Every variant over `repeats` rounds, taking turns (a change in load hits all alike): each variant's figures,
    the largest of its rounds (the best speed and RSS; bytes are the same every round), with its tokens'
    `agreement` against the REFERENCE variant's; and every round's tokens."""
    runs: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, env in variants.items():
            with environment(env):
                r = run()
            tokens[name].append(r.pop("tokens"))
            kept = runs.setdefault(name, r)
            for key, value in r.items():
                kept[key] = best(kept[key], value)
    for name, run_ in runs.items():
        run_.update(agreement(tokens[name], tokens[REFERENCE][0]))
    return runs, tokens


def agreement(tokens: list[torch.Tensor], reference: torch.Tensor, suffix: str = "") -> dict[str, Any]:
    """`agreement`: the fraction of `tokens` (each round's `[(rows,) new]`) equal to `reference`'s, and
    `first_difference`: the first token index where any round (or row) differs (None: none), each name + suffix."""
    same = torch.stack([t == reference for t in tokens])  # [rounds, (rows,) new]
    differs = (~same).flatten(0, -2).any(dim=0).nonzero().flatten()
    return {f"agreement{suffix}": round(same.float().mean().item(), 6),
            f"first_difference{suffix}": int(differs[0]) if len(differs) else None}


def measure_case(model: rd.RecurrentDepthLM, prompt: torch.Tensor, new_tokens: int, args: argparse.Namespace,
                 memory: Memory) -> dict[str, Any]:
    """Every variant of `rd.generate`'s cache (VARIANTS; BOUNDED_AND_FULL under the speculative and parallel
    loops) over --repeats rounds."""
    variants = VARIANTS if args.mode == "generate" else BOUNDED_AND_FULL
    runs, _ = rounds(variants, lambda: run_once(model, prompt, new_tokens, args, memory), args.repeats)
    bounded, full, same_path = runs["bounded"], runs[REFERENCE], runs.get("full, no C++ decode")
    return dict(
        runs=runs,
        x_held_bytes=ratio(full["held_bytes"], bounded["held_bytes"]),
        x_allocated_bytes=ratio(full["allocated_bytes"], bounded["allocated_bytes"]),
        **shared_ratios(bounded, full),
        x_tokens_per_s_same_path=ratio(bounded["tokens_per_s"], same_path["tokens_per_s"]) if same_path else None,
    )


def serve_once(model: rd.RecurrentDepthLM, prompts: list[list[int]], new_tokens: int, args: argparse.Namespace,
               memory: Memory) -> dict[str, Any]:
    """The prompts as concurrent rows of one BatchDecoder (built here: the pool reads the window switch then),
    greedy, each to `new_tokens` tokens: their tokens `[rows, new]`, the pool's bytes, peak RSS over the RSS
    before, and the step loop's decode speed (wall and CPU)."""
    opts = GenerationOptions(max_new_tokens=new_tokens, num_steps=args.num_steps, init_scale=0.0,
                             do_sample=False).validate(model.config.mean_recurrence)
    before = memory.reset()
    decoder = BatchDecoder(model, max_rows=len(prompts), kv_quant=args.kv_quant)
    tokens: list[list[int]] = []
    for j, prompt in enumerate(prompts):
        _, first, _ = decoder.add(RowRequest(prompt, opts, seed=j), tag=j)
        tokens.append([first.token])
    peak_pool = decoder.pool.nbytes()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while len(decoder):
        for seq, result in decoder.step():
            tokens[seq.tag].append(result.token)
            if len(tokens[seq.tag]) == new_tokens:
                decoder.remove(seq)  # (the pool keeps its storage, as the server's does)
        peak_pool = max(peak_pool, decoder.pool.nbytes())
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    peak, _ = memory.since(before, collect=False)
    decoded = len(prompts) * (new_tokens - 1)
    return dict(
        tokens=torch.tensor(tokens), pool_bytes=decoder.pool.nbytes(), peak_pool_bytes=peak_pool,
        peak_rss_delta_mib=peak, tokens_per_s=round(decoded / wall, 1) if wall > 0 else None,
        cpu_tokens_per_s=round(decoded / cpu, 1) if cpu > 0 else None,
    )


def measure_serving_case(model: rd.RecurrentDepthLM, prompts: list[list[int]], new_tokens: int,
                         args: argparse.Namespace, memory: Memory) -> dict[str, Any]:
    """The bounded and full pools (BOUNDED_AND_FULL) over --repeats rounds; row 0 also against `rd.generate` alone."""
    runs, tokens = rounds(BOUNDED_AND_FULL, lambda: serve_once(model, prompts, new_tokens, args, memory),
                          args.repeats)
    alone = generate(model, torch.tensor([prompts[0]]), max_new_tokens=new_tokens, num_steps=args.num_steps,
                     init_scale=0.0, do_sample=False, kv_quant=args.kv_quant).sequences[0, len(prompts[0]):]
    for name, run in runs.items():
        run.update(agreement([t[0] for t in tokens[name]], alone, "_alone"))
    bounded, full = runs["bounded"], runs[REFERENCE]
    return dict(
        runs=runs,
        x_pool_bytes=ratio(full["pool_bytes"], bounded["pool_bytes"]),
        x_peak_pool_bytes=ratio(full["peak_pool_bytes"], bounded["peak_pool_bytes"]),
        **shared_ratios(bounded, full),
    )


def shared_ratios(bounded: dict[str, Any], full: dict[str, Any]) -> dict[str, float | None]:
    """The bounded run over the full one in what both modes measure: peak RSS (full / bounded) and speed."""
    return dict(
        x_peak_rss=ratio(full["peak_rss_delta_mib"], bounded["peak_rss_delta_mib"]),
        x_tokens_per_s=ratio(bounded["tokens_per_s"], full["tokens_per_s"]),
        x_cpu_tokens_per_s=ratio(bounded["cpu_tokens_per_s"], full["cpu_tokens_per_s"]),
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    memory = Memory()
    memory.mmap_threshold(MMAP_SMALL)  # freed tensors leave the RSS (see benchmarks/qlora_train.py)
    load_before = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    serving = args.mode == "serving"
    prompt = torch.randint(0, VOCAB, (args.rows if serving else 1, args.prompt_len),
                           generator=torch.Generator().manual_seed(args.seed))
    prompts = prompt.tolist()  # (serving: one row each)
    results = []
    for layout in args.layouts:
        for window in args.windows:
            model = make_model(args, layout, window)
            if serving:  # (first-call setup)
                serve_once(model, prompts[:1], 2, args, memory)
            else:
                generate(model, prompt, max_new_tokens=2, num_steps=args.num_steps, init_scale=0.0,
                         kv_quant=args.kv_quant, **mode_options(args))
            for new_tokens in args.new_tokens:
                case = (measure_serving_case(model, prompts, new_tokens, args, memory) if serving
                        else measure_case(model, prompt, new_tokens, args, memory))
                results.append(dict(layout=layout, window=window, attention_windows=layer_windows_of(layout, window),
                                    new_tokens=new_tokens, context=args.prompt_len + new_tokens, **case))
    report = dict(
        benchmark="window_cache", mode=args.mode, rows=args.rows if serving else None, quick=args.quick,
        mode_options=mode_options(args),
        model=dict(hidden_size=args.hidden, num_heads=4, num_kv_heads=2, layers="1 prelude, 2 core, 1 coda",
                   vocab_size=VOCAB, dtype="float32", seed=args.seed),
        kv_quant=args.kv_quant.name if args.kv_quant is not None else None,
        num_steps=args.num_steps, prompt_len=args.prompt_len, repeats=args.repeats, threads=args.threads,
        machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), load_average_before=load_before,
        load_average_after=[round(x, 2) for x in os.getloadavg()], torch=torch.__version__,
        python=platform.python_version(), cpp_decode=decode_cpp.load_decoder() is not None,
        cpp_decode_failure=decode_cpp.build_failure(), mmap_threshold=MMAP_SMALL if memory.threshold else None,
        seconds=round(time.perf_counter() - start, 1), results=results,
    )
    print(json.dumps(report))
    (print_serving_table if serving else print_table)(results, args)
    return 0


def figures(values: tuple[float | None, ...], width: int, digits: int) -> str:
    """Table cells of optional figures ('-': None)."""
    return "".join(f"{'-' if x is None else f'{x:.{digits}f}':>{width}}" for x in values)


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    loop = f"{args.mode} {mode_options(args)}, " if args.mode != "generate" else ""
    print(f"\n{loop}r = {args.num_steps}, hidden {args.hidden}, {args.prompt_len}-token prompt, best of "
          f"{args.repeats}; B = bounded, F = full (F-py: no C++ decode); KiB of "
          f"{'float32' if args.kv_quant is None else args.kv_quant.name} KV, RSS in MiB")
    print(f"{'layout':<9}{'W':>5}{'ctx':>6}{'held B':>9}{'held F':>9}{'x':>6}{'alloc B':>9}{'alloc F':>9}{'x':>6}"
          f"{'rss B':>7}{'rss F':>7}{'tok/s B':>9}{'F':>7}{'F-py':>7}{'cpu B':>7}{'cpu F':>7}{'agree':>7}")
    for r in results:
        b, f = r["runs"]["bounded"], r["runs"]["full"]
        py = r["runs"].get("full, no C++ decode", {})  # (only --mode generate runs it)
        rss = figures((b["peak_rss_delta_mib"], f["peak_rss_delta_mib"]), 7, 1)
        cpu = figures((b["cpu_tokens_per_s"], f["cpu_tokens_per_s"]), 7, 0)
        print(f"{r['layout']:<9}{r['window']:>5}{r['context']:>6}{b['held_bytes'] / 1024:>9.0f}"
              f"{f['held_bytes'] / 1024:>9.0f}{r['x_held_bytes']:>6.1f}{b['allocated_bytes'] / 1024:>9.0f}"
              f"{f['allocated_bytes'] / 1024:>9.0f}{r['x_allocated_bytes']:>6.1f}{rss}{b['tokens_per_s']:>9.0f}"
              f"{f['tokens_per_s']:>7.0f}{figures((py.get('tokens_per_s'),), 7, 0)}{cpu}"
              f"{min(b['agreement'], py.get('agreement', 1.0)):>7.3f}")


def print_serving_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nBatchDecoder, {args.rows} rows, r = {args.num_steps}, hidden {args.hidden}, {args.prompt_len}-token "
          f"prompts, best of {args.repeats}; B = bounded pool, F = full pool; pool: KiB of "
          f"{'float32' if args.kv_quant is None else args.kv_quant.name} KV (peak nbytes), RSS in MiB; agree: every "
          f"row B vs F, alone: row 0 vs rd.generate")
    print(f"{'layout':<9}{'W':>5}{'ctx':>6}{'pool B':>9}{'pool F':>9}{'x':>6}{'rss B':>7}{'rss F':>7}"
          f"{'tok/s B':>9}{'F':>7}{'cpu B':>7}{'cpu F':>7}{'x':>6}{'agree':>7}{'alone':>7}")
    for r in results:
        b, f = r["runs"]["bounded"], r["runs"]["full"]
        print(f"{r['layout']:<9}{r['window']:>5}{r['context']:>6}{b['peak_pool_bytes'] / 1024:>9.0f}"
              f"{f['peak_pool_bytes'] / 1024:>9.0f}{r['x_peak_pool_bytes']:>6.1f}"
              f"{figures((b['peak_rss_delta_mib'], f['peak_rss_delta_mib']), 7, 1)}"
              f"{figures((b['tokens_per_s'],), 9, 0)}{figures((f['tokens_per_s'],), 7, 0)}"
              f"{figures((b['cpu_tokens_per_s'], f['cpu_tokens_per_s']), 7, 0)}"
              f"{figures((r['x_cpu_tokens_per_s'],), 6, 2)}"
              f"{b['agreement']:>7.3f}{min(b['agreement_alone'], f['agreement_alone']):>7.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
