"""`rdepth loop pretrain|search|eval`: training-free looping of a transformers causal LM's middle layers.

    rdepth loop pretrain --out runs/loop-demo   # the demo's small Llama: --max-cpu-minutes 6 of CPU time
    rdepth loop search --model runs/loop-demo/model --widths 1,2,3 --iterations 2,3 --save runs/looped
    rdepth loop eval --model runs/loop-demo/model --windows 3-4 --iterations 1,2,3,4 --rules naive,damped,rk

`pretrain` stops at --max-steps or after --max-cpu-minutes of this process's CPU time in training
steps (the tokenizer and data preparation before them are not counted), whichever comes first; on
a shared machine the wall clock runs longer (about 20 minutes were seen for the 6 CPU minutes on a
busy 2-core machine). `search` scores every window of the given widths at each
K and rule on held-out text (validation loss of the embedded stdlib corpus by default, or --data
FILE|DIR|FILE.jsonl) and prints the best;
`--save DIR` writes the best looped model (its config.json carries the loop, which
`recurrent_depth.looping.from_pretrained` re-applies). `eval` prints loss against K per window.
See docs/looping.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from recurrent_depth.cli.common import add_model_arg, add_out_arg, int_list


def _choice_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return values
    return parse


def _window_list(text: str) -> list[tuple[int, int]]:
    from recurrent_depth.looping.config import check_window

    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        a, sep, b = part.partition("-")
        try:
            window = (int(a), int(b) if sep else int(a))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected windows like 2-3,4 (first-last layer), got {text!r}") from None
        try:  # (at parsing, before the model loads; argparse names --windows)
            check_window(*window, f"window {part!r}")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        out.append(window)
    if not out:
        raise argparse.ArgumentTypeError("expected at least one window")
    return out


def _add_scoring_args(parser: argparse.ArgumentParser, default_iterations: str) -> None:
    from recurrent_depth.looping.config import MAX_ITERATIONS, MODES, RULES

    add_model_arg(parser, help="a transformers decoder-only causal LM directory with a tokenizer (Llama-, Qwen-, "
                               "GPT-2-style, e.g. runs/loop-demo/model), or a run directory holding one in model/; "
                               "recurrent-depth and Huginn-0125 models recur already and are not looped")
    parser.add_argument("--data", default="stdlib", metavar="stdlib|FILE|DIR|FILE.jsonl",
                        help="held-out text: the validation documents of 'stdlib', or a user's text file, directory "
                             "or .jsonl scored whole (default: %(default)s)")
    # (None: the model's own pretraining split; `rdepth loop pretrain --seed N` splits the documents with seed N)
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="stdlib's validation share, as in training (default: the pretrain.json beside the "
                             "model's, else 0.02)")
    parser.add_argument("--split-seed", type=int, default=None,
                        help="seed of the document split (default: the --seed in the pretrain.json beside the "
                             "model, else 0)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens to score (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=128, help="scoring window in tokens (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward (default: %(default)s)")
    # (the caller's default: eval sets its own, and its --help said "2,3" while it scored 1,2,3,4)
    parser.add_argument("--iterations", type=int_list, default=[2, 3],
                        help=f"K values, each in 1..{MAX_ITERATIONS} (default: {default_iterations})")
    # (None: `eval` of a model's stored loop takes the stored rule, mode and β; otherwise damped, block, 0.5)
    parser.add_argument("--rules", type=_choice_list(RULES), default=None,
                        help=f"update rules, a subset of {','.join(RULES)} (default: damped)")
    parser.add_argument("--modes", type=_choice_list(MODES), default=None,
                        help=f"loop modes, a subset of {','.join(MODES)} (default: block)")
    parser.add_argument("--beta", type=float, default=None, help="β of the rk rule (default: 0.5)")
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "loop", help="loop the middle layers of a pretrained transformers causal LM, without training",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="<action>")

    pretrain = actions.add_parser("pretrain", help="train the demo's small Llama-style model on the stdlib corpus",
                                  description="Train the demo's small Llama-style model on the stdlib corpus. "
                                  "--max-cpu-minutes bounds this process's CPU time in training steps (not the "
                                  "tokenizer and data preparation before them), not the wall clock: on a busy machine "
                                  "the run takes longer than its CPU budget.")
    from recurrent_depth.looping.pretrain import PretrainRecipe

    defaults = PretrainRecipe()
    add_out_arg(pretrain, "runs/loop-demo")
    pretrain.add_argument("--data", default=defaults.data, metavar="stdlib|DIR|FILE.jsonl",
                          help="training corpus (default: %(default)s)")
    for flag, field, kind in (("--layers", "num_layers", int), ("--hidden-size", "hidden_size", int),
                              ("--max-steps", "max_steps", int), ("--max-cpu-minutes", "max_cpu_minutes", float),
                              ("--seq-len", "seq_len", int), ("--vocab-size", "vocab_size", int),
                              ("--seed", "seed", int)):
        pretrain.add_argument(flag, dest=field, type=kind, default=getattr(defaults, field),
                              help=f"(default: {getattr(defaults, field)})")
    pretrain.set_defaults(func=run)

    search = actions.add_parser("search", help="score candidate windows and K on held-out text; print the best")
    _add_scoring_args(search, "2,3")
    search.add_argument("--widths", type=int_list, default=[1, 2, 3], help="window widths in layers (default: 1,2,3)")
    search.add_argument("--top", type=int, default=10, help="rows of the table to print (default: %(default)s)")
    search.add_argument("--save", default=None, metavar="DIR",
                        help="save the best looped model here (weights, tokenizer, loop in config.json)")
    add_out_arg(search, "runs/loop-search")
    search.set_defaults(func=run)

    evaluate = actions.add_parser("eval", help="held-out loss against K for given windows")
    _add_scoring_args(evaluate, "1,2,3,4")
    evaluate.add_argument("--windows", type=_window_list, default=None,
                          help="windows as first-last layer, e.g. 2-3,4 (default: the loop in the model's config)")
    add_out_arg(evaluate, "runs/loop-eval")
    evaluate.set_defaults(func=run, iterations=None)
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    if args.action == "pretrain":
        return _pretrain(args)
    if args.action in ("search", "eval"):
        return _score(args)
    args._parser.print_help()
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    from recurrent_depth.looping.pretrain import PretrainRecipe, pretrain

    fields = ("data", "num_layers", "hidden_size", "max_steps", "max_cpu_minutes", "seq_len", "vocab_size", "seed")
    try:
        recipe = PretrainRecipe(**{name: getattr(args, name) for name in fields})
    except ValueError as exc:  # the recipe's field names, as the flags that set them (num_layers: --layers)
        flags = {name: "--layers" if name == "num_layers" else "--" + name.replace("_", "-") for name in fields}
        raise ValueError(re.sub(r"PretrainRecipe\.(\w+)", lambda m: flags.get(m.group(1), m.group(0)),
                                str(exc))) from None
    summary = pretrain(args.out, recipe)
    keys = ("steps", "train_seconds", "train_cpu_seconds", "validation_loss", "model_dir")
    print(json.dumps({k: summary[k] for k in keys}))
    return 0


def _load(args: argparse.Namespace):
    import torch
    from transformers import AutoTokenizer

    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {args.model!r} is not a model directory (no config.json)")
    from recurrent_depth.looping.config import check_loopable_dir

    check_loopable_dir(path)  # (a config.json describing a million layers: refused before anything is built)
    from recurrent_depth.checkpoint import usable_device
    from recurrent_depth.looping.loop import load_causal_lm

    device = usable_device(args.device)  # (one line, not a traceback from the first copy to a missing device)
    if device.type == "meta":  # (usable_device allows it for building shapes; scoring needs numbers)
        raise ValueError("--device meta holds no numbers: the loops cannot be scored there; choose cpu or cuda")
    model = load_causal_lm(path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _held_out_split(model: Path, val_fraction: float | None, seed: int | None) -> tuple[float, int]:
    """The stdlib document split to score on: the flags', else the split `rdepth loop pretrain` trained the model
    beside its pretrain.json on (its --seed seeds the split: with seed 0's split, a --seed 1 model was scored on
    its own training documents), else 0.02 and seed 0."""
    recipe: dict[str, Any] = {}
    summary = model.parent / "pretrain.json"
    if summary.is_file():
        from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

        raw = read_json(summary, CONFIG_MAX_BYTES, "pretrain.json")
        found = raw.get("recipe") if isinstance(raw, dict) else None
        recipe = found if isinstance(found, dict) else {}
    if val_fraction is None:
        stored = recipe.get("val_fraction")
        val_fraction = stored if isinstance(stored, float) and 0 < stored < 1 else 0.02
    if seed is None:
        stored = recipe.get("seed")
        seed = stored if isinstance(stored, int) and not isinstance(stored, bool) else 0
    return val_fraction, seed


def _stored_dtype(path: Path) -> Any:
    """The floating dtype `path/config.json` records (`dtype` or `torch_dtype`), or None."""
    import torch

    from recurrent_depth.files import CONFIG_MAX_BYTES, read_json

    raw = read_json(path / "config.json", CONFIG_MAX_BYTES, "config file")
    name = raw.get("dtype", raw.get("torch_dtype")) if isinstance(raw, dict) else None
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return dtypes.get(name) if isinstance(name, str) else None


def _score(args: argparse.Namespace) -> int:
    from recurrent_depth.files import check_out_dir, finite_or_null
    from recurrent_depth.looping import LoopConfig, apply_loop, find_decoder_layers, loop_of
    from recurrent_depth.looping.config import CONFIG_KEY, MAX_ITERATIONS
    from recurrent_depth.looping.evaluate import (
        candidate_windows,
        check_seq_len,
        held_out_texts,
        held_out_windows,
        loop_grid,
        score_loops,
    )

    for name, low in (("max_tokens", 1), ("seq_len", 2), ("batch_size", 1)):  # (a window needs a target token)
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {getattr(args, name)}")
    if getattr(args, "top", 0) < 0:  # (a negative slice silently dropped the worst rows from the table)
        raise ValueError(f"--top must be an integer >= 0, got {args.top}")
    # before the model loads (these were refused only after it, or --val-fraction 0 as "no held-out text")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.beta is not None and not 0 <= args.beta <= 1:
        raise ValueError(f"--beta must be in [0, 1], got {args.beta}")
    bad_k = [k for k in args.iterations or () if not 1 <= k <= MAX_ITERATIONS]
    if bad_k:
        raise ValueError(f"--iterations must each be in 1..{MAX_ITERATIONS}, got {','.join(map(str, bad_k))}")
    # before the scoring: an existing file there was mkdir's bare errno once every loop had been scored, and
    # transformers' save_pretrained onto a file only logs and returns (we printed "saved")
    check_out_dir(args.out)
    if getattr(args, "save", None):
        check_out_dir(args.save, "--save")
        if Path(args.save).resolve() == Path(args.model).resolve():  # (the source was overwritten by the loop)
            raise ValueError(f"--save {args.save} is the --model directory: saving there replaces the source "
                             f"model; choose another directory")
    model, tokenizer = _load(args)
    check_seq_len(model.config, args.seq_len, "--seq-len")
    stored = getattr(model.config, CONFIG_KEY, None)
    stored_cfg = None if stored is None else LoopConfig.from_dict(stored)
    num_layers = len(find_decoder_layers(model)[1])
    if args.action == "search":
        windows = candidate_windows(num_layers, args.widths)
        iterations = args.iterations
    else:
        if args.windows is None:
            if stored_cfg is None:
                raise ValueError("--windows is needed: the model's config.json holds no loop")
            args.windows = [(stored_cfg.start, stored_cfg.end)]
            # the stored loop, not a damped block loop over its window (unless the options say otherwise)
            args.rules = args.rules or [stored_cfg.rule]
            args.modes = args.modes or [stored_cfg.mode]
            args.beta = stored_cfg.beta if args.beta is None else args.beta
        windows = args.windows
        iterations = args.iterations or [1, 2, 3, 4]
    for a, b in windows:
        LoopConfig(a, b).check_depth(num_layers)
    rules, modes = args.rules or ["damped"], args.modes or ["block"]
    beta = 0.5 if args.beta is None else args.beta
    # no flag varies the decode-time settings: keep the source's stored ones (a saved loop went back to the defaults)
    kept = {} if stored_cfg is None else {"stash": stored_cfg.stash, "when": stored_cfg.when}
    configs: list[Any] = [None, *loop_grid(windows, iterations, rules, modes, beta=beta, **kept)]
    if args.action == "search" and len(configs) == 1:
        raise ValueError(f"--iterations {','.join(map(str, iterations))} gives nothing to search: K = 1 is the "
                         f"base model, give at least one K >= 2")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    val_fraction, split_seed = _held_out_split(Path(args.model), args.val_fraction, args.split_seed)
    texts = held_out_texts(args.data, val_fraction, split_seed)
    rows = held_out_windows(tokenizer, texts, args.seq_len, args.max_tokens, bos)
    targets = sum(len(r) - 1 for r in rows)
    split = f", validation share {val_fraction:g} split with seed {split_seed}" if args.data == "stdlib" else ""
    print(f"scoring {len(configs)} configurations on {targets} held-out tokens ({args.data}{split}), "
          f"{num_layers} layers")

    def check_base(score: Any) -> None:  # (scored first: refused before the loops are scored)
        if score.config is None and not math.isfinite(score.loss):
            raise ValueError(f"--model {args.model}: the base model's held-out loss is {score.loss} (its logits "
                             f"are not finite: damaged or overflowing weights), nothing to compare loops against")

    scores = score_loops(model, rows, configs, batch_size=args.batch_size, pad_token_id=pad, progress=check_base)
    base = scores[0].loss
    results = [s.to_dict(base) for s in scores]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"model": str(args.model), "data": args.data, "tokens": targets, "num_layers": num_layers,
               **({"val_fraction": val_fraction, "split_seed": split_seed} if args.data == "stdlib" else {}),
               "base_loss": round(base, 5), "results": results}
    if args.action == "search":
        # a loop whose loss is NaN or inf (it diverged) ranks last: NaN in the sort key left the order arbitrary
        ranked = sorted(scores[1:], key=lambda s: (not math.isfinite(s.loss), s.loss))
        best = ranked[0]
        if not math.isfinite(best.loss):
            raise ValueError(f"every looped configuration's held-out loss is NaN or inf (base {base:.4f}): "
                             f"the loops diverge, nothing to save or rank")
        summary["best"] = best.to_dict(base)
        print(_table([scores[0], *ranked[: args.top]], base))
        print(f"best: {best.config.label()} loss {best.loss:.4f} (base {base:.4f}, {best.loss - base:+.4f})")
        if args.save:
            apply_loop(model, best.config)
            stored_dtype = _stored_dtype(Path(args.model))
            if stored_dtype is not None:  # scored in float32, saved as the source stores it (a bf16 model stays bf16)
                model.to(stored_dtype)
            model.save_pretrained(args.save)
            tokenizer.save_pretrained(args.save)
            print(f"saved the looped model ({loop_of(model).label()}) to {args.save}")
    else:
        print(_k_table(scores, iterations, base))
    # a diverged loop's NaN / inf loss is null: strict JSON (json.dumps wrote a bare NaN)
    (out / "results.json").write_text(json.dumps(finite_or_null(summary), indent=2, allow_nan=False) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


def _table(scores: list[Any], base: float) -> str:
    lines = [f"{'configuration':<34} {'loss':>8} {'Δ base':>8} {'FLOPs×':>7}"]
    for s in scores:
        label = "base" if s.config is None else s.config.label()
        lines.append(f"{label:<34} {s.loss:>8.4f} {s.loss - base:>+8.4f} {s.flops_ratio:>7.3f}")
    return "\n".join(lines)


def _k_table(scores: list[Any], iterations: list[int], base: float) -> str:
    """Rows: window, mode, rule; columns: loss at each K (K = 1 is the base model)."""
    ks = sorted(set(iterations) | {1})
    rows: dict[tuple, dict[int, float]] = {}
    for s in scores[1:]:
        c = s.config
        rule = f"rk β={c.beta:g}" if c.rule == "rk" else c.rule
        rows.setdefault((f"[{c.start},{c.end}]", c.mode, rule), {1: base})[c.iterations] = s.loss
    header = f"{'window':<9} {'mode':<6} {'rule':<10}" + "".join(f" {'K=' + str(k):>8}" for k in ks)
    lines = [header]
    for (window, mode, rule), by_k in rows.items():
        cells = "".join(f" {by_k[k]:>8.4f}" if k in by_k else f" {'':>8}" for k in ks)
        lines.append(f"{window:<9} {mode:<6} {rule:<10}{cells}")
    return "\n".join(lines)
