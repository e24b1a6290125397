"""`rdepth experiment <name>`: small training experiments that test the research notes' claims.

The figures in docs/training.md were measured with one thread (`--threads 1`; tiny matmuls gain
nothing from more).

    rdepth experiment logit-growth --out runs/logit-growth        # Muon vs AdamW max-logit growth
    rdepth experiment coord-check --out runs/mup                   # muP coordinate check vs width
    rdepth experiment lr-transfer --out runs/mup                   # best AdamW lr per width, muP vs standard
    rdepth experiment lr-transfer --widen head_dim --parametrizations mup,mup-sqrt-d --out runs/mup-head-dim
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


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 64,128, got {text!r}") from exc


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
        "muon_recipe": (str, "torch (torch.optim.Muon) or k2 (Kimi K2's per-matrix, RMS-matched Muon; "
                             "AdamW-sized lrs)"),
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
        "corpus": (str, "training text: as rdepth train --data takes it (read as bytes)"),
        "seed": (int, "seed of weights and batches"),
        "out": (str, "output directory for logit_growth.json and logit_growth.png"),
    })
    lg.set_defaults(func=run_logit_growth_command)

    from recurrent_depth.experiments.mup import MupConfig

    mup_fields = {
        "widths": (_ints, "model widths (hidden_size)"),
        "base_width": (int, "muP base width (muP = standard there)"),
        "head_dim": (int, "head dimension at every width (--widen heads) or at the base width (--widen head_dim)"),
        "widen": (str, "what grows with the width: heads (head_dim fixed) or head_dim (heads fixed at "
                       "base_width / head_dim, as --model-set hidden_size=... widens a preset)"),
        "parametrizations": (_names, "which of standard, mup (attention 1/d), mup-sqrt-d (muP with attention "
                                     "1/sqrt(d), not muP when head_dim grows) to run"),
        "lr": (float, "AdamW lr of the coordinate check"),
        "lrs": (_floats, "AdamW lrs of the transfer sweep (at most 5)"),
        "steps": (int, "coordinate-check steps"),
        "transfer_steps": (int, "optimizer steps per transfer run"),
        "recurrence": (int, "core steps per forward"),
        "batch_size": (int, "sequences per step"),
        "seq_len": (int, "bytes per sequence"),
        "seeds": (int, "coordinate-check seeds averaged"),
        "corpus": (str, "training text: as rdepth train --data takes it (read as bytes)"),
    }
    for name, transfer, text in (
        ("coord-check", False, "muP coordinate check: activation RMS per layer vs width over the first steps, "
                               "muP and standard (JSON + PNG)"),
        ("lr-transfer", True, "the coordinate check plus final loss per (width, lr) under muP and standard: does "
                              "the best lr transfer across widths? (JSON + PNG)"),
    ):
        sub = inner.add_parser(name, help=text)
        written = "mup_lr_transfer" if transfer else "mup_coord_check"
        fields_here = {**mup_fields, "out": (str, f"output directory for {written}.json and {written}.png")}
        # the coordinate check runs no transfer sweep: it takes no flags it would ignore
        _add_fields(sub, MupConfig(), {k: v for k, v in fields_here.items()
                                       if transfer or k not in ("lrs", "transfer_steps")})
        sub.set_defaults(func=run_mup_command, transfer=transfer)
    parser.set_defaults(func=lambda args: parser.print_help() or 0)


def _config(cls: type, args: argparse.Namespace) -> Any:
    from dataclasses import fields

    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})


def run_logit_growth_command(args: argparse.Namespace) -> int:
    from recurrent_depth.experiments.logit_growth import LogitGrowthConfig, format_summary, run_logit_growth

    cfg = _config(LogitGrowthConfig, args)
    result = run_logit_growth(cfg)
    print(format_summary(result["summary"]))
    print(f"wrote {cfg.out}/logit_growth.json and {cfg.out}/logit_growth.png ({result['seconds']:.0f}s)")
    return 0


def run_mup_command(args: argparse.Namespace) -> int:
    from recurrent_depth.experiments.mup import MupConfig, format_transfer, run_mup

    cfg = _config(MupConfig, args)
    result = run_mup(cfg, transfer=args.transfer)
    for parametrization, check in result["coordinate_check"].items():
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in check["ratio_after_last_step"].items())
        print(f"{parametrization}: max/min activation RMS across widths {cfg.widths} after {cfg.steps} steps: "
              f"{check['max_ratio']:.3f}, attention logits (.qk) {check['max_qk_ratio']:.3f} ({ratios})")
    if result["lr_transfer"] is not None:
        print(format_transfer(result["lr_transfer"]))
    print(f"wrote {cfg.out} ({result['seconds']:.0f}s)")
    return 0
