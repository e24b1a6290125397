"""`rdepth info`: shape, parameter count and cache cost of a preset or a saved model directory; or, with
--build-kernels, the C++ kernels (quantized KV and int8, the decode step) built ahead of their first use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recurrent_depth.cli.common import check_model_path, human_bytes, human_count, model_dir
from recurrent_depth.inference.schema import add_option_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info", help="show a preset's or a model directory's configuration and size",
        description="Print the resolved ModelConfig, unique parameter count, and the bf16 cache at the mean "
        "recurrence (bytes per token, and in all at max_seq_len; each mixer's own cache: KV for attention, a "
        "fixed-size state for linear mixers), for a preset name or a saved model directory; and the same cache "
        "under each KV policy (per-step, shared-4, last-step, and --kv-policy when given), per token and in all; "
        "with --kv-quant, the same again with the KV entries quantized (every norm counted). With sliding-window "
        "layers, also what autoregressive decoding allocates at max_seq_len (a layer of window W holds about 2W "
        "columns, from a prompt of about W tokens or fewer; quantized, at least the few columns its codes decode "
        "exactly from at tiny head dims; the serving pool holds the same bound per row; speculative and parallel "
        "decoding a little more; the full-context figures are what RDEPTH_FULL_WINDOW_CACHE=1 holds).",
    )
    from recurrent_depth.config import PRESETS

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", help=f"a preset name: one of {', '.join(sorted(PRESETS))}")
    source.add_argument("--model", metavar="DIR", type=model_dir,
                        help="a saved model directory (ours, official Huginn or Ouro), or a run directory of "
                             "`rdepth train` / `quickstart`, whose model/ is used")
    source.add_argument("--build-kernels", action="store_true",
                        help="build the C++ kernels now (the quantized-KV and int8 kernels, then the float32 decode "
                             "step; once per machine, torch and Python version, 30-60 s each; otherwise their first "
                             "use builds them), or check and load the cached builds; print where they are "
                             "(default: off)")
    add_option_flags(parser, ("kv_policy", "kv_quant"), helps={
        "kv_policy": "also report the cache under this KV policy, e.g. shared-8 or an official strategy such as "
                     "latest-m4-compress-s16 (default: off)",
        "kv_quant": "also report each policy's cache with quantized KV entries, e.g. k=prod:3.5,v=mse:3.5 "
                    "(default: off)",
    })
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table (default: off)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.build_kernels:
        from recurrent_depth.accel import decode_cpp, quant_cpp

        try:
            print(quant_cpp.build_ahead())
            print(decode_cpp.build_decoder_ahead())
        except RuntimeError as exc:  # no compiler, a failing build: the other decode paths still run
            print(f"rdepth info: error: {exc}", file=sys.stderr)
            return 1
        return 0
    import torch

    from recurrent_depth.config import ModelConfig
    from recurrent_depth.inference.cache import (
        REDUCED_WINDOW_ALIGN,
        WINDOW_ALIGN,
        decoding_window_columns,
        layer_windows,
    )
    from recurrent_depth.inference.kv_codec import exact_decode_columns, shared_codec
    from recurrent_depth.inference.quant_cache import parse_kv_quant_option
    from recurrent_depth.model.cache import parse_kv_policy
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    if args.preset is not None:  # (`--preset ''` is an unknown preset, not "no preset": --model is then None)
        config = ModelConfig.from_preset(args.preset)
    else:
        check_model_path(args.model)  # (as generate/serve say it: a LoRA run's hint too)
        try:
            config = ModelConfig.from_json(args.model)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{Path(args.model) / 'config.json'} is not UTF-8 text: {exc}") from None
    # The real module tree, without memory: counts every mixer, bias and head exactly.
    with torch.device("meta"):
        model = RecurrentDepthLM(config)
    layers_at_mean = config.prelude_layers + config.coda_layers + config.core_layers * config.mean_recurrence
    # Each mixer reports its own cache (KV for attention, a fixed-size state for linear mixers);
    # a core layer holds one cache per step.
    # A core layer keeps one cache per slot of the KV policy's slot rule (one per step by default).
    policies = {name: parse_kv_policy(name) for name in ("per-step", "shared-4", "last-step")}
    if args.kv_policy is not None:
        policies[args.kv_policy] = parse_kv_policy(args.kv_policy, core_layers=config.core_layers)
    length = config.max_seq_len
    kv_quant = parse_kv_quant_option(args.kv_quant)
    # (every part with layers: a per-part dict naming 'attention' throughout is softmax attention too)
    counts = {"prelude": config.prelude_layers, "core": config.core_layers, "coda": config.coda_layers}
    if kv_quant is not None and any(config.mixer_for(part) != "attention" for part, n in counts.items() if n):
        raise ValueError(f"--kv-quant prices softmax-attention KV entries; this model's mixer is {config.mixer!r}")

    # Autoregressive decoding's cache drops the columns no sliding window reaches (inference/cache.py): a windowed
    # store (base key, as the cache keys them) allocates at most `decoding_window_columns` columns; {}: none does.
    windows = layer_windows(model)

    def cache_bytes(tokens: int, policy=policies["per-step"], decoding: bool = False, floor: int = 0,
                    aligned_as: torch.dtype | None = torch.bfloat16) -> int:
        """bf16 bytes of every store at `tokens` columns; decoding: windowed ones at what autoregressive decoding
        allocates, their reach at least `floor` columns (a quantized cache's: `StaticRecurrentCache._reach`), held
        from the alignment of a store of `aligned_as` (`window_align`; None: code rows, float32's)."""
        slots = policy.slots.num_slots(config.mean_recurrence)
        blocks = [(1, (part, i), b) for part, container in (("prelude", "prelude"), ("coda", "coda"))
                  for i, b in enumerate(model.transformer[container])]
        core = list(model.transformer.core_block)
        # compress-rN keeps one store for all core layers
        blocks += ([(slots, ("core", j), b) for j, b in enumerate(core)] if policy.slots.per_layer
                   else [(slots, ("core",), core[0])])
        def columns(base: tuple) -> int:
            if not decoding or base not in windows:
                return tokens
            return min(tokens, decoding_window_columns(max(windows[base], floor), aligned_as))

        return sum(n * block.attn.state_nbytes(1, columns(base), torch.bfloat16) for n, base, block in blocks)

    full, empty = cache_bytes(length), cache_bytes(0)
    info = {
        "config": config.to_dict(),
        "unique_parameters": model.num_parameters(),
        "layers_at_mean_recurrence": layers_at_mean,
        # Growth per token, averaged over a full context (0 for fixed-size states).
        "kv_cache_bytes_per_token_bf16": (full - empty) // length,
        "cache_bytes_at_max_seq_len_bf16": full,
        # Every token at the mean depth; a lookup rule changes what is read, not what is stored.
        "cache_bytes_at_max_seq_len_bf16_by_kv_policy": {
            policy.name: cache_bytes(length, policy) for policy in policies.values()
        },
        "kv_cache_bytes_per_token_bf16_by_kv_policy": {
            policy.name: (cache_bytes(length, policy) - cache_bytes(0, policy)) // length
            for policy in policies.values()
        },
        # What autoregressive decoding to max_seq_len allocates: sliding-window layers bounded (the figures above
        # price every layer over the whole context, as RDEPTH_FULL_WINDOW_CACHE=1 holds it); the same without windows.
        "cache_bytes_at_max_seq_len_bf16_autoregressive": cache_bytes(length, decoding=True),
        "cache_bytes_at_max_seq_len_bf16_autoregressive_by_kv_policy": {
            policy.name: cache_bytes(length, policy, decoding=True) for policy in policies.values()
        },
    }
    if kv_quant is not None:
        # Entries per token as counted above (bf16 bytes / one bf16 entry), each at the codes' bytes (and a
        # window's bf16 entries spread over the full context, as the bytes per token above are).
        per_layer = kv_quant.bytes_per_token(config.head_dim, config.num_kv_heads, context=length)
        bf16_entry = 2 * 2 * config.head_dim * config.num_kv_heads
        info["kv_quant"] = kv_quant.label(config.head_dim)
        info["kv_quant_bits_per_coordinate"] = kv_quant.bits_per_coordinate(config.head_dim, length)
        bf16 = info["kv_cache_bytes_per_token_bf16_by_kv_policy"]
        info["kv_cache_bytes_per_token_quantized_by_kv_policy"] = {
            # (a true quotient: with per-part num_kv_heads in mixer_options it is not a whole number of layers)
            name: round(per / bf16_entry * per_layer) for name, per in bf16.items()
        }
        # Autoregressive decoding to max_seq_len: a windowed store holds its bounded columns of codes, at least
        # the fewest its codes decode bitwise from (`exact_decode_columns`: more than W at tiny head dims), and
        # each store the spec's recent-token bf16 window
        codes = kv_quant.bytes_per_token(config.head_dim, config.num_kv_heads)
        floor = exact_decode_columns((shared_codec(kv_quant, "k", config.head_dim),
                                      shared_codec(kv_quant, "v", config.head_dim)))
        recent = min(kv_quant.window, length)
        info["cache_bytes_at_max_seq_len_quantized_autoregressive_by_kv_policy"] = {
            policy.name: round(cache_bytes(length, policy, decoding=True, floor=floor, aligned_as=None)
                               / bf16_entry * codes) + cache_bytes(recent, policy) for policy in policies.values()
        }
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return 0
    for key, value in sorted(info["config"].items()):
        print(f"{key:>22}  {value}")
    params = info["unique_parameters"]
    per_token = info["kv_cache_bytes_per_token_bf16"]
    print(f"{'unique parameters':>22}  {human_count(params)} ({params:,}; {human_bytes(2 * params)} in bf16)")
    print(f"{'layers at mean depth':>22}  {layers_at_mean}")
    print(f"{'KV cache/token (bf16)':>22}  {human_bytes(per_token)} ({per_token:,} bytes)")
    decoding = info["cache_bytes_at_max_seq_len_bf16_autoregressive_by_kv_policy"]

    def decode_note(nbytes: int) -> str:  # (with windows: what autoregressive decoding allocates instead)
        return f"; autoregressive decoding: {human_bytes(nbytes)}" if windows else ""

    if windows:
        align, bf16 = WINDOW_ALIGN - 1, REDUCED_WINDOW_ALIGN - 1  # (`window_align`: the figures above are bf16's)
        print(f"{'sliding windows':>22}  {len(set(windows) - {('core',)})} layers: autoregressive decoding holds at "
              f"most 2W+{align} columns of each (2W+{bf16} in bf16 / fp16, 2W+511 from W = 512 on; after a prompt of "
              f"W+{align} tokens or fewer, W+{bf16} in bf16), the serving pool as many a row (W its largest window); "
              "speculative and parallel decoding "
              "hold a round's drafts and 16 more (docs/inference.md)")
    print(f"{f'cache at {length} tokens':>22}  {human_bytes(full)} ({full:,} bytes"
          f"{decode_note(info['cache_bytes_at_max_seq_len_bf16_autoregressive'])})")
    for name, nbytes in info["cache_bytes_at_max_seq_len_bf16_by_kv_policy"].items():
        per = info["kv_cache_bytes_per_token_bf16_by_kv_policy"][name]
        print(f"{name:>22}  {human_bytes(nbytes)} ({nbytes:,} bytes; {per:,} bytes/token{decode_note(decoding[name])})")
    for name, per in info.get("kv_cache_bytes_per_token_quantized_by_kv_policy", {}).items():
        ratio = info["kv_cache_bytes_per_token_bf16_by_kv_policy"]["per-step+deepest"] / per
        quantized_decoding = info["cache_bytes_at_max_seq_len_quantized_autoregressive_by_kv_policy"][name]
        print(f"{name + ' quantized':>22}  {per:,} bytes/token ({info['kv_quant']}; {ratio:.1f}x smaller than "
              f"per-step bf16{decode_note(quantized_decoding)})")
    return 0
