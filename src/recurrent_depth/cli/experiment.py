"""`rdepth experiment <name>`: small training experiments that test the research notes' claims.

    rdepth experiment logit-growth --out runs/logit-growth        # Muon vs AdamW max-logit growth
"""

from __future__ import annotations

import argparse
from typing import Any


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.01,0.02, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(" ", "").split(",") if x)


def _add_fields(parser: argparse.ArgumentParser, defaults: Any, kinds: dict[str, tuple[Any, str]]) -> None:
    """One flag per experiment-config field: name -> (type, help); the default shown."""
    for name, (kind, text) in kinds.items():
        value = getattr(defaults, name)
        shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) if isinstance(value, tuple) \
            else value
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                            help=f"{text} (default: {shown})")


def register(subparsers: argparse._SubParsersAction) -> None:
    from recurrent_depth.experiments.logit_growth import LogitGrowthConfig

    parser = subparsers.add_parser("experiment", help="run a small experiment that tests a claim of the notes",
                                   description=__doc__.splitlines()[0])
    inner = parser.add_subparsers(dest="experiment", metavar="<experiment>")
    lg = inner.add_parser(
        "logit-growth",
        help="max attention logit vs step for Muon and AdamW at several lrs, plain / QK-norm / QK-clip; "
             "fits the growth exponent and T_sat vs lr (JSON + PNG)",
    )
    _add_fields(lg, LogitGrowthConfig(), {
        "muon_lrs": (_floats, "Muon learning rates of the block matrices (comma-separated)"),
        "adamw_lrs": (_floats, "AdamW learning rates (comma-separated)"),
        "variants": (_names, "which of plain, qk-norm, qk-clip to run"),
        "steps": (int, "optimizer steps per run"),
        "hidden_size": (int, "model width"),
        "num_heads": (int, "attention heads"),
        "recurrence": (int, "core steps per forward (all with gradients)"),
        "batch_size": (int, "sequences per step"),
        "seq_len": (int, "bytes per sequence"),
        "saturation": (float, "C: the max logit taken as saturation (T_sat = first step reaching it)"),
        "qk_clip_tau": (float, "tau of the qk-clip runs"),
        "fit_start": (int, "first step of the log-log fit window"),
        "corpus": (str, "training text: stdlib, a directory or a .jsonl file (read as bytes)"),
        "seed": (int, "seed of weights and batches"),
        "out": (str, "output directory for logit_growth.json and logit_growth.png"),
    })
    lg.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    lg.set_defaults(func=run_logit_growth_command)
    parser.set_defaults(func=lambda args: parser.print_help() or 0)


def _config(cls: type, args: argparse.Namespace) -> Any:
    from dataclasses import fields

    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})


def run_logit_growth_command(args: argparse.Namespace) -> int:
    import torch

    from recurrent_depth.experiments.logit_growth import LogitGrowthConfig, format_summary, run_logit_growth

    torch.set_num_threads(args.threads)
    cfg = _config(LogitGrowthConfig, args)
    result = run_logit_growth(cfg)
    print(format_summary(result["summary"]))
    print(f"wrote {cfg.out}/logit_growth.json and {cfg.out}/logit_growth.png ({result['seconds']:.0f}s)")
    return 0
