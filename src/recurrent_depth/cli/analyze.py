"""`rdepth analyze`: trajectories, convergence, PCA, path independence of one prompt -> a report.

    rdepth analyze --model runs/quickstart/model --prompt "def add(a, b):" --out runs/analysis

writes OUT/report.html (self-contained), OUT/*.png, OUT/analysis.json and OUT/states/*.npy.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from recurrent_depth.cli.common import (
    add_device_args,
    add_lora_adapter_arg,
    add_max_depth_arg,
    add_model_arg,
    add_out_arg,
    add_seed_arg,
    add_tokenizer_arg,
    add_weights_arg,
    check_depth_flags,
    check_lora_with_weights,
    check_model_path,
    check_strict_lora_base,
    tokenizer_source,
)
from recurrent_depth.inference.schema import add_option_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="see the latent reasoning of one prompt: convergence, trajectories, path independence",
        description="Run a prompt through the recurrence and write an HTML report with figures "
        "(distance to s*, PCA trajectories, path independence, token correlation, depth view) and "
        "a JSON file with the numbers.",
    )
    add_model_arg(p)
    add_lora_adapter_arg(p)
    add_tokenizer_arg(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to analyse (tokenized with the model's tokenizer.json)")
    source.add_argument("--prompt-file", metavar="FILE", help="read the prompt text from this UTF-8 file")
    source.add_argument("--ids", help="comma-separated token ids instead of text (no tokenizer needed)")
    add_out_arg(p, "runs/analysis")
    add_seed_arg(p)
    add_device_args(p)
    add_weights_arg(p)  # (the latent behaviour of the quantized model a user serves)
    p.add_argument("--steps", type=int, default=64,
                   help="recurrence steps recorded and plotted, at least 8 (default: %(default)s)")
    p.add_argument("--limit-steps", type=int, default=128,
                   help="steps from the same s0 to the limit point s* (default: %(default)s)")
    add_max_depth_arg(p)
    p.add_argument("--starts", type=int, default=4,
                   help="random initial states for path independence, at least 2 (default: %(default)s)")
    add_option_flags(p, ("init_scale",), helps={"init_scale": (
        "scale of the random initial state s_0; 0 = zeros, deterministic (default: the model config's init_scale, "
        "as its forward: 1 for Huginn, 1/sqrt(h) for Parcae's like-init)")})
    p.add_argument("--converge-tol", type=float, default=0.05,
                   help="relative distance to s* that counts as converged (default: %(default)s)")
    p.add_argument("--tokens", default=None,
                   help="comma-separated token positions to plot in PCA, at most 12, in the order given; the first 3 "
                        "also in path independence (default: chosen automatically)")
    p.add_argument("--max-plot-tokens", type=int, default=6,
                   help="tokens chosen automatically for the PCA figure, 1 to 12 (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="refuse prompts longer than this many tokens (default: %(default)s)")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="do not add the tokenizer's special tokens such as BOS (default: add them)")
    p.add_argument("--no-states", action="store_true",
                   help="do not keep the trajectory as .npy files in OUT/states (default: keep them)")
    p.set_defaults(func=run)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        # int() accepts spaces around a number but not inside one, so "1 2,3" is an error, not [12, 3].
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


# AnalysisConfig field -> the flag that sets it, so that errors name what the user typed.
FIELD_FLAGS = {
    "num_steps": "--steps", "limit_steps": "--limit-steps", "num_starts": "--starts", "init_scale": "--init-scale",
    "converge_tol": "--converge-tol", "max_plot_tokens": "--max-plot-tokens", "max_tokens": "--max-tokens",
    "tokens": "--tokens", "seed": "--seed",
}


def _in_flag_names(exc: ValueError) -> ValueError:
    pattern = r"\b(" + "|".join(sorted(FIELD_FLAGS, key=len, reverse=True)) + r")\b"
    return ValueError(re.sub(pattern, lambda m: FIELD_FLAGS[m.group(1)], str(exc)))


def run(args: argparse.Namespace) -> int:
    from recurrent_depth.analysis.path_independence import fixed_start_reason
    from recurrent_depth.analysis.report import (
        AnalysisConfig,
        analyze_to_dir,
        check_prompt,
        exit_gate_rows,
        states_dir_of,
        token_decoder,
    )
    from recurrent_depth.analysis.trajectory import resolve_init_scale
    from recurrent_depth.files import check_out_dir
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    check_lora_with_weights(args)
    check_strict_lora_base(args, "--lora")
    check_depth_flags(args, ("steps", "limit_steps"))  # the depth ceiling every command keeps (README)
    start = time.perf_counter()
    model_dir = Path(args.model)
    config = AnalysisConfig(
        num_steps=args.steps, limit_steps=args.limit_steps, num_starts=args.starts, init_scale=args.init_scale,
        seed=args.seed, converge_tol=args.converge_tol,
        tokens=_int_list(args.tokens, "--tokens") if args.tokens else None,
        max_plot_tokens=args.max_plot_tokens, max_tokens=args.max_tokens, save_states=not args.no_states,
    )
    try:
        config.validate()  # fail on bad flags before loading weights
    except ValueError as exc:
        raise _in_flag_names(exc) from None
    check_model_path(args.model)  # (the same one-line errors as the other commands, before anything loads)
    out = Path(args.out)
    check_out_dir(out)
    prompt = args.prompt
    if args.prompt_file is not None:
        from recurrent_depth.cli.generate import PROMPT_MAX_BYTES
        from recurrent_depth.files import read_text

        # Bounded, regular files only: /dev/zero or a FIFO would otherwise be read until memory runs out.
        prompt = read_text(args.prompt_file, PROMPT_MAX_BYTES, "--prompt-file")
    model = RecurrentDepthLM.from_pretrained(model_dir, dtype=args.dtype, device=args.device, weights=args.weights)
    if args.lora is not None:  # unmerged, checked as `rdepth generate --lora` checks it
        from recurrent_depth.train.lora import attach_adapter

        model = attach_adapter(model, args.lora, strict_base=args.strict_lora_base, model_dir=args.model)
    try:  # (a model whose s_0 is its embedding has no random s_0 for --init-scale to scale: refused, not ignored)
        resolve_init_scale(model, config.init_scale)
    except ValueError as exc:
        raise _in_flag_names(exc) from None

    codec = None
    if args.ids is not None:
        ids = _int_list(args.ids, "--ids")
    else:
        from recurrent_depth.serving.text import TextCodec

        # the codec knows each token's bytes: labels for tokens that are not whole UTF-8 on their own
        codec = TextCodec(tokenizer_source(args), model.config.vocab_size, required=True)
        ids = codec.encode(prompt, add_special_tokens=not args.no_special_tokens)
    if not ids:  # (--ids "," has nothing to tokenize: say which flag is empty)
        raise ValueError("--ids holds no token ids" if args.ids is not None
                         else "the prompt is empty after tokenization")
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")

    decode = str if codec is None else token_decoder(codec)
    texts = [decode(i) for i in ids]
    # every refusal before the progress line ("analysing 1 tokens ..." was printed above the one-token refusal)
    check_prompt(model, ids, config, in_memory=args.no_states, token_texts=texts)  # (its messages name the flags)
    states_dir_of(out)
    starts = "one start (s_0 = the embedding)" if fixed_start_reason(model) else f"{config.num_starts} starts"
    print(f"analysing {len(ids)} tokens, {config.num_steps} steps (s* at {config.limit_steps}), {starts}")
    result, files = analyze_to_dir(
        model, ids, args.out, token_texts=texts, decode=decode, config=config, prompt=prompt,
        model_name=str(model_dir) if args.lora is None else f"{model_dir} with LoRA {args.lora}", progress=True,
    )
    counts = ", ".join(f"{k}: {v}" for k, v in result.counts.items())
    print(f"trajectory shapes: {counts}")
    if result.path is None:
        print(f"path independence: skipped: {result.model_info['fixed_start']}")
    else:
        ratio = result.path.summary()["median_ratio"]
        print(f"path independence: median spread / nearest-token distance = {ratio:.3g}")
    if result.exit_gate is not None:  # a model with a learned exit gate (Ouro)
        for measure, value in exit_gate_rows(result.exit_gate):
            print(f"{measure}: {value}")
    print(f"report: {files['html']}  (numbers: {files['json']}, {len(files) - 2} PNGs)")
    print(f"done in {time.perf_counter() - start:.1f}s")
    return 0
