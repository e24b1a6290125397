"""`rdepth generate`: text generation with every test-time compute control, streamed as it comes.

    rdepth generate --model DIR --prompt "def fib(n):" --num-steps 32 --exit-criterion kl --stream

Prints the completion (token by token with --stream, the default for one prompt) and then a
stats line on stderr: tokens, mean recurrence steps per token, tokens/s, cache size, exit reasons.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from recurrent_depth.cli.common import (
    add_device_args,
    add_max_depth_arg,
    add_model_arg,
    add_seed_arg,
    add_tokenizer_arg,
    load_cli_tokenizer,
)

CRITERIA = ("kl", "entropy-diff", "latent-diff", "cosine", "argmax-stability")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with adaptive depth, KV sharing, warm start, speculative or parallel decoding",
        description="Generate a continuation of --prompt with a recurrent-depth model. The prompt runs at "
        "full depth; each new token then runs --num-steps core steps, or fewer with --exit-criterion.",
    )
    add_model_arg(p)
    add_tokenizer_arg(p)
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="prompt text; repeat for a batch (left-padded; each row exits on its own)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    p.add_argument("--num-steps", type=int, default=None,
                   help="recurrence depth r (default: the model's mean_recurrence)")
    add_max_depth_arg(p)
    g = p.add_argument_group("adaptive depth")
    g.add_argument("--exit-criterion", choices=CRITERIA, default=None,
                   help="stop each token's recurrence when this statistic converges (default: fixed depth)")
    g.add_argument("--exit-threshold", type=float, default=None,
                   help="criterion threshold (default: the criterion's own, kl 5e-4)")
    g.add_argument("--min-steps", type=int, default=1, help="fewest steps before an exit (default: %(default)s)")
    g.add_argument("--max-steps", type=int, default=None, help="most steps with an exit criterion (default: r)")
    g.add_argument("--warm-start", action="store_true",
                   help="start each token from the previous token's final state (default: off)")
    g.add_argument("--init-scale", type=float, default=1.0,
                   help="scale of the random initial state; 0 = zeros, deterministic (default: %(default)s)")
    c = p.add_argument_group("KV cache")
    c.add_argument("--kv-budget", type=int, default=None,
                   help="KV entries per token and core layer; step i uses slot i mod k (default: one per step)")
    c.add_argument("--kv-policy", default=None, metavar="SLOTS[+LOOKUP]",
                   help="KV policy: slots per-step | last-step | shared-K | anchor-K, lookup for early-exited "
                        "tokens deepest | skip | full | always-last | randomized, e.g. 'shared-4+skip', or an "
                        "official cache_lookup_strategy such as 'latest-m4-compress-s16' (docs/inference.md; "
                        "default: per-step+deepest)")
    s = p.add_argument_group("speculative and parallel decoding")
    s.add_argument("--draft-steps", type=int, default=None,
                   help="self-speculative: draft with this many steps, verify with r (default: off)")
    s.add_argument("--lookahead", type=int, default=8, help="drafted tokens per round (default: %(default)s)")
    s.add_argument("--verification-threshold", type=float, default=1.0,
                   help="1 = exact (greedy at r); < 1 accepts p(draft) >= t * max p (default: %(default)s)")
    s.add_argument("--parallel", action="store_true",
                   help="diffusion-forcing style wavefront sampler (default: off)")
    s.add_argument("--inner-steps", type=int, default=4,
                   help="parallel: core steps per sweep (default: %(default)s)")
    s.add_argument("--headway", type=int, default=1, help="parallel: new positions per sweep (default: %(default)s)")
    s.add_argument("--wavefront", type=int, default=4,
                   help="parallel: new positions join while fewer than this many refine (default: %(default)s)")
    s.add_argument("--max-wavefront", type=int, default=128,
                   help="parallel: freeze the front when more positions than this refine (default: %(default)s)")
    t = p.add_argument_group("sampling")
    t.add_argument("--do-sample", action="store_true",
                   help="sample instead of greedy (implied by --temperature/--top-k/--top-p/--min-p; default: greedy)")
    t.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: 1.0)")
    t.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: all)")
    t.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    t.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p * max p (default: off)")
    t.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalise tokens already present, > 1 (default: %(default)s = off)")
    t.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when this text appears (repeatable; the model's eos always stops; default: none)")
    add_seed_arg(p)
    o = p.add_argument_group("output")
    o.add_argument("--stream", dest="stream", action="store_true", default=None,
                   help="print tokens as they are generated (default: on for one prompt)")
    o.add_argument("--no-stream", dest="stream", action="store_false",
                   help="print the completion at the end (default: stream tokens as they come)")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object (completions, per-token steps and reasons, stats) instead "
                        "(default: off)")
    add_device_args(p)
    p.set_defaults(func=run)


def check_depth_flags(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Each depth flag within the depth ceiling (--max-depth, default MAX_NUM_STEPS), before any work."""
    from recurrent_depth.config import check_depth

    if args.max_depth is not None and args.max_depth < 1:
        raise ValueError(f"--max-depth={args.max_depth} is invalid: expected an integer >= 1")
    for flag in flags:
        check_depth(getattr(args, flag), "--" + flag.replace("_", "-"), args.max_depth)


def _generation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
    do_sample = args.do_sample or any(v is not None for v in sampling.values())
    if args.temperature == 0:  # a common way to ask for greedy decoding
        do_sample, sampling["temperature"] = False, None
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, num_steps=args.num_steps, exit_criterion=args.exit_criterion,
        exit_threshold=args.exit_threshold, min_steps=args.min_steps, max_steps=args.max_steps,
        kv_budget=args.kv_budget, kv_policy=args.kv_policy, warm_start=args.warm_start, draft_steps=args.draft_steps,
        lookahead=args.lookahead, verification_threshold=args.verification_threshold,
        sampler="parallel" if args.parallel else "autoregressive", inner_steps=args.inner_steps,
        headway=args.headway, wavefront=args.wavefront, max_wavefront=args.max_wavefront, do_sample=do_sample,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop, init_scale=args.init_scale,
    )
    kwargs.update({k: v for k, v in sampling.items() if v is not None})
    return kwargs


def _stats_line(out: Any) -> str:
    reasons = Counter(r for row in out.exit_reasons for r in row)
    s = out.summary()
    extra = "".join(f" {k}={s[k]}" for k in ("acceptance_rate", "tokens_per_sweep") if k in s)
    return (
        f"[{s['mode']}] tokens={s['new_tokens']} mean_steps={s['mean_steps']} tokens/s={s['tokens_per_second']} "
        f"prefill={s['prefill_seconds']}s cache={s['cache_mb']}MB{extra} "
        f"exits: {', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    import recurrent_depth as rd
    from recurrent_depth.inference import generate, stream_generate

    check_depth_flags(args, ("num_steps", "max_steps", "draft_steps") + (("inner_steps",) if args.parallel else ()))
    tokenizer = load_cli_tokenizer(args)
    model = rd.RecurrentDepthLM.from_pretrained(args.model, dtype=args.dtype, device=args.device).eval()
    rows = [tokenizer.encode(text).ids for text in args.prompt]
    if any(len(r) == 0 for r in rows):
        raise ValueError("--prompt must not be empty (it encodes to no tokens)")
    width = max(len(r) for r in rows)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kwargs = _generation_kwargs(args)
    stream = args.stream if args.stream is not None else (len(rows) == 1 and not args.json)
    if stream and len(rows) > 1:
        raise ValueError("--stream prints one prompt's tokens as they come; use --no-stream for a batch")

    if stream:
        handle = stream_generate(model, ids, attention_mask=mask, tokenizer=tokenizer, **kwargs)
        print(args.prompt[0], end="", flush=True)
        shown = ""
        tokens: list[int] = []
        for event in handle:
            tokens.append(event.token)
            text = tokenizer.decode(tokens)
            # Byte-level tokens can end inside a UTF-8 character; print only completed text.
            if not text.endswith("\ufffd"):
                print(text[len(shown):], end="", flush=True)
                shown = text
        print(tokenizer.decode(tokens)[len(shown):], flush=True)  # whatever was held back
        out = handle.output
    else:
        out = generate(model, ids, attention_mask=mask, tokenizer=tokenizer, **kwargs)
    completions = [tokenizer.decode(t) for t in out.token_lists()]
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
