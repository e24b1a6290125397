"""`rdepth generate`: text generation with every test-time compute control, streamed as it comes.

    rdepth generate --model DIR --prompt "def fib(n):" --num-steps 32 --exit-criterion kl --stream
    cat prompt.txt | rdepth generate --model DIR --prompt-file -

Prints the completion (token by token with --stream, the default for one prompt) and then a
stats line on stderr: tokens, mean recurrence steps per token, tokens/s, cache size, exit reasons.
The completion's text is `rdepth serve`'s: it ends just before the first --stop string (the --json
tokens keep the token that held it), special tokens left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from recurrent_depth.cli.common import (
    GENERATION_CONFIG_KEYS,
    add_generation_config_arg,
    add_load_args,
    add_max_depth_arg,
    check_depth_flags,
    check_lora_with_weights,
    check_strict_lora_base,
    load_cli_tokenizer,
    tokenizer_source,
)
from recurrent_depth.generation_config import generation_defaults, with_generation_defaults
from recurrent_depth.inference.options import OPTIONS, OptionError, spelled_warnings
from recurrent_depth.inference.schema import add_cli_arguments, canonical, cli_spelling, cli_values

# the options whose `rdepth generate` default differs from the library's (--seed 0): under the flags and the
# directory's generation_config.json
CLI_DEFAULTS = {name: option.cli_default for name, option in OPTIONS.items()
                if option.cli and option.cli_default is not None}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with adaptive depth, KV sharing, warm start, speculative or parallel decoding",
        description="Generate a continuation of --prompt with a recurrent-depth model. The prompt runs at "
        "full depth; each new token then runs --num-steps core steps, or fewer with --exit-criterion.",
    )
    add_load_args(p)
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="prompt text; repeat for a batch (left-padded; each row exits on its own)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="FILE",
                   help=f"read a prompt, as is, from a UTF-8 text file ('-' = standard input, at most "
                        f"{PROMPT_MAX_BYTES >> 20} MiB); repeat for a batch, after any --prompt")
    add_max_depth_arg(p)
    add_cli_arguments(p)  # every generation option, derived from the schema (inference/schema.py)
    # a flag's own default (--seed 0) applies after generation_config.json, in run: a flag not given stays None
    p.set_defaults(**{name: None for name in CLI_DEFAULTS})
    add_generation_config_arg(p, f"sets the options no flag sets, as our transformers classes read it: "
                                 f"{GENERATION_CONFIG_KEYS} (as vLLM's --generation-config auto)")
    # (the server's `ignore_eos` field: without it no CLI run could reproduce such a request's tokens)
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's eos ids (config.json's and generation_config.json's), as the "
                        "server's ignore_eos; --stop and --stop-id still stop (default: off)")
    o = p.add_argument_group("printing")
    o.add_argument("--stream", dest="stream", action="store_true", default=None,
                   help="print tokens as they are generated (default: on for one prompt)")
    o.add_argument("--no-stream", dest="stream", action="store_false",
                   help="print the completion at the end (default: stream tokens as they come)")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object (completions, per-token steps and reasons, stats) instead "
                        "(default: off)")
    p.set_defaults(func=run)


PROMPT_MAX_BYTES = 16 << 20  # longer than any context; a bound on what a pipe can make us hold


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt texts, then each --prompt-file (`-` = stdin), read bounded; at least one prompt."""
    from recurrent_depth.files import read_bytes

    prompts = list(args.prompt)
    for name in args.prompt_file:
        if name == "-":
            data = sys.stdin.buffer.read(PROMPT_MAX_BYTES + 1)
            if len(data) > PROMPT_MAX_BYTES:
                raise ValueError(f"--prompt-file -: standard input holds more than {PROMPT_MAX_BYTES:,} bytes")
        else:
            data = read_bytes(name, PROMPT_MAX_BYTES, "--prompt-file")
        try:
            prompts.append(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompt-file {name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT or --prompt-file FILE ('-' reads standard input)")
    return prompts


def _generation_kwargs(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The `generate` options given on the command line (and the flags they came from).

    CLI convention: a sampling flag (--temperature, --top-k, --top-p, --min-p) turns on sampling
    unless --do-sample/--no-do-sample says otherwise; --temperature 0 asks for greedy decoding."""
    values = cli_values(args)
    if "do_sample" not in values and any(k in values for k in ("temperature", "top_k", "top_p", "min_p")):
        values["do_sample"] = True
    if values.get("temperature") == 0:
        values["do_sample"] = False
        del values["temperature"]
    # (--exit-threshold auto stays "auto": generate resolves it after generation_config.json's exit_criterion joins)
    return canonical(values, resolve_auto=False)


def completion_text(codec: Any, stop: list[str], tokens: list[int]) -> str:
    """A finished completion's text as `rdepth serve` gives it (`TextState`: decoded after an anchor, so a
    SentencePiece decoder keeps the first token's leading space; cut just before the first stop string)."""
    from recurrent_depth.serving.text import TextState

    state, parts = TextState(codec, stop), []
    for token in tokens:
        part, hit = state.push(token)
        parts.append(part)
        if hit:
            return "".join(parts)
    return "".join(parts) + state.flush()


def _stats_line(out: Any) -> str:
    reasons = Counter(r for row in out.exit_reasons for r in row)
    s = out.summary()
    extra = "".join(f" {k}={s[k]}" for k in ("acceptance_rate", "tokens_per_sweep", "gradmem_flops", "ttt_flops")
                    if k in s)
    return (
        f"[{s['mode']}] tokens={s['new_tokens']} mean_steps={s['mean_steps']} tokens/s={s['tokens_per_second']} "
        f"prefill={s['prefill_seconds']}s cache={s['cache_mb']}MB{extra} "
        f"exits: {', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    import recurrent_depth as rd
    from recurrent_depth.config import MAX_NUM_STEPS
    from recurrent_depth.data.tokenizer import check_fits_vocab, tokenizer_failures_as_errors
    from recurrent_depth.inference import generate, stream_generate
    from recurrent_depth.serving.text import TextCodec, TextState

    check_lora_with_weights(args)
    check_strict_lora_base(args, "--lora")
    args.prompt = read_prompts(args)
    parallel = args.sampler == "parallel"
    check_depth_flags(args, ("num_steps", "max_steps", "draft_steps", "gradmem_depth", "ttt_depth", "ttt_backprop")
                      + (("inner_steps",) if parallel else ()))
    tokenizer = load_cli_tokenizer(args)
    model = rd.RecurrentDepthLM.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                             weights=args.weights).eval()
    check_fits_vocab(tokenizer, model.config.vocab_size, tokenizer_source(args))
    # the completion's text as the server writes it (`TextState`: anchor, UTF-8 tails, stop strings cut)
    codec = TextCodec(tokenizer_source(args), model.config.vocab_size, model.config.max_seq_len, required=True)
    ceiling = MAX_NUM_STEPS if args.max_depth is None else args.max_depth
    if args.num_steps is None and model.config.mean_recurrence > ceiling:  # the default depth, past --max-depth
        raise ValueError(f"the model's mean_recurrence={model.config.mean_recurrence} (the default --num-steps) is "
                         f"above the depth ceiling {ceiling}: give --num-steps <= {ceiling}, or raise --max-depth")
    model.max_depth = ceiling  # (the library's own ceiling: --max-depth raises it)
    if args.lora is not None:
        from recurrent_depth.train.lora import attach_adapter

        model = attach_adapter(model, args.lora, strict_base=args.strict_lora_base, model_dir=args.model)
    # each prompt named by its flag: `--prompt-file notes.txt` of an empty file was reported as an empty --prompt
    names = ["--prompt"] * (len(args.prompt) - len(args.prompt_file)) + [f"--prompt-file {f}" for f in args.prompt_file]
    for name, text in zip(names, args.prompt):  # (a text that cannot fit the context is not tokenized: a 4 MB
        codec.check_fits(text, name)            # file took 1.2 GB and 19 s before the length error)
    with tokenizer_failures_as_errors():
        rows = [tokenizer.encode(text).ids for text in args.prompt]
    for name, row in zip(names, rows):
        if not row:
            raise ValueError(f"{name} must not be empty (it encodes to no tokens)")
    width = max(len(r) for r in rows)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    try:
        kwargs, given_as = _generation_kwargs(args)
    except OptionError as exc:
        raise exc.spelled(cli_spelling({})) from None
    # (the directory's generation_config.json under the flags, as our transformers classes and vLLM read it)
    kwargs = with_generation_defaults(kwargs, generation_defaults(args.model, args.generation_config,
                                                                  "rdepth generate", args.max_depth))
    kwargs = {**CLI_DEFAULTS, **kwargs}
    if args.ignore_eos:
        kwargs["eos_token_id"] = []  # (replaces the config's and the file's ids; --stop / --stop-id are apart)
    stream = args.stream if args.stream is not None else (len(rows) == 1 and not args.json)
    if stream and len(rows) > 1:
        raise ValueError("--stream prints one prompt's tokens as they come; use --no-stream for a batch")
    if stream and args.json:  # the streamed text would precede the JSON object on stdout
        raise ValueError("--json prints one JSON object at the end; it does not combine with --stream")
    stop = kwargs.get("stop")
    stop_strings = [s for s in ([stop] if isinstance(stop, str | int) else stop or []) if isinstance(s, str)]

    if stream:
        try:
            with spelled_warnings(cli_spelling(given_as)):
                handle = stream_generate(model, ids, attention_mask=mask, tokenizer=tokenizer, **kwargs)
        except OptionError as exc:
            raise exc.spelled(cli_spelling(given_as)) from None
        print(args.prompt[0], end="", flush=True)
        state, hit = TextState(codec, stop_strings), False
        for event in handle:
            if not hit:  # (the text ends at the stop string; the library may stop a token later)
                part, hit = state.push(event.token)
                print(part, end="", flush=True)
        print("" if hit else state.flush(), flush=True)  # whatever was held back
        out = handle.output
    else:
        try:
            with spelled_warnings(cli_spelling(given_as)):
                out = generate(model, ids, attention_mask=mask, tokenizer=tokenizer, **kwargs)
        except OptionError as exc:
            raise exc.spelled(cli_spelling(given_as)) from None
    completions = [completion_text(codec, stop_strings, t) for t in out.token_lists()]
    if args.json:
        record = {
            "prompts": args.prompt, "completions": completions, "tokens": out.token_lists(),
            "steps": [out.steps[b, : len(t)].tolist() for b, t in enumerate(out.token_lists())],
            "exit_reasons": out.exit_reasons, "finish_reasons": out.finish_reasons, "stats": out.summary(),
        }
        print(json.dumps(record))
    elif not stream:
        for prompt, completion in zip(args.prompt, completions):
            print(prompt + completion)
    print(_stats_line(out), file=sys.stderr)
    return 0
