"""`rdepth scaling fit`: scaling-law fits on a sweep's results table (docs/scaling.md, "Fits").

    rdepth scaling fit sweeps/s1/results.csv --form all --bootstrap 200 --budget 1e18 --out sweeps/s1/fits
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recurrent_depth.scaling.forms import FORM_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scaling", help="fit scaling laws (Kaplan, joint, iso-depth) to a sweep's table",
                                   description="Scaling-law fits on a results table (`rdepth sweep collect`).")
    actions = parser.add_subparsers(dest="scaling_action", metavar="<action>", required=True)
    fit = actions.add_parser(
        "fit", help="fit the forms, print a table, write fits.json and plots",
        description="Robust (Huber) least squares on log loss from a grid of starts, percentile bootstrap "
                    "over runs, held-out error; writes DIR/fits.json and DIR/<form>.png.")
    fit.add_argument("table", metavar="TABLE", help="results table: CSV or JSON (one row per run and test depth)")
    fit.add_argument("--form", choices=(*FORM_NAMES, "all"), default="all", help="form to fit (default: all)")
    fit.add_argument("--bootstrap", type=int, default=200, metavar="B",
                     help="bootstrap resamples of the runs (default: %(default)s; 0: point estimates only)")
    fit.add_argument("--level", type=float, default=0.9, help="interval level (default: %(default)s)")
    fit.add_argument("--holdout", choices=("largest", "loo", "none"), default="largest",
                     help="held-out error: fit without the largest-compute fifth of runs and predict them, "
                          "leave-one-run-out, or none (default: %(default)s)")
    fit.add_argument("--depth", choices=("trained", "test"), default="trained",
                     help="r of a row: trained (one row per run, at its trained mean recurrence) or test "
                          "(every row, r = its test depth) (default: %(default)s)")
    fit.add_argument("--n-column", choices=("params_non_embedding", "params"), default="params_non_embedding",
                     help="the table column used as N (default: %(default)s, as Kaplan et al.)")
    fit.add_argument("--no-irreducible", action="store_true", help="drop the irreducible loss E from every form")
    fit.add_argument("--budget", type=float, default=None, metavar="C",
                     help="training FLOPs for the compute-optimal N and D (C = 6 N D; joint and iso-depth)")
    fit.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: %(default)s)")
    fit.add_argument("--out", metavar="DIR", default=None,
                     help="output directory for fits.json and plots (default: TABLE's directory / fits)")
    fit.set_defaults(func=run_fit)


def run_fit(args: argparse.Namespace) -> int:
    from recurrent_depth.files import check_out_dir, finite_or_null
    from recurrent_depth.scaling.fit import check_fit_settings, compute_optimal, fit_law, load_table
    from recurrent_depth.scaling.plots import plot_fit

    check_fit_settings(args.level, args.bootstrap, args.budget)  # (before minutes of fits, not after)
    if args.budget is not None and args.form not in ("all", "joint", "iso-depth"):  # (was ignored without a word)
        raise ValueError(f"--budget gives the compute-optimal N and D of the joint and iso-depth forms, not of "
                         f"--form {args.form}: choose one of those (or all), or leave --budget out")
    if args.seed < 0:  # (numpy's own refusal, after the first fit, named nothing: "expected non-negative integer")
        raise ValueError(f"--seed={args.seed} is invalid: expected an integer >= 0")
    table = load_table(args.table)
    print(f"{len(table.rows)} finished row(s) from {table.source}"
          + (f"; skipped {table.skipped} row(s) whose status is not finished" if table.skipped else ""))
    out = Path(args.out) if args.out else Path(args.table).parent / "fits"
    check_out_dir(out)  # (made at the first plot: a run that fits nothing leaves no empty directory)
    forms = FORM_NAMES if args.form == "all" else (args.form,)
    results, skipped = {}, {}
    print(f"{'form':10} {'runs':>4}  {'parameter':9} {'estimate':>11}  {int(args.level * 100)}% interval"
          f"{'':14} held-out log RMSE")
    for name in forms:
        try:
            fit = fit_law(table, name, bootstrap=args.bootstrap, level=args.level, holdout=args.holdout,
                          seed=args.seed, depth=args.depth, irreducible=not args.no_irreducible,
                          n_column=args.n_column)
        except ValueError as exc:
            if len(forms) == 1:
                raise
            # --form all: a form the table cannot support (too few runs, a missing column) is reported, and
            # the others are still fitted
            skipped[name] = str(exc)
            print(f"{name:10} skipped: {exc}")
            continue
        entry = fit.to_json()
        if args.budget is not None and name in ("joint", "iso-depth"):
            entry["compute_optimal"] = compute_optimal(fit, args.budget)
        out.mkdir(parents=True, exist_ok=True)
        entry["plot"] = str(plot_fit(fit, out / f"{name}.png"))
        results[name] = entry
        intervals = fit.intervals()
        held = fit.holdout.get("log_rmse")
        for i, (param, value) in enumerate((k, v) for k, v in fit.named().items() if not k.startswith("log_")):
            low_high = intervals.get(param)
            interval = f"[{low_high[0]:.4g}, {low_high[1]:.4g}]" if low_high else "-"
            print(f"{name if i == 0 else '':10} {entry['runs'] if i == 0 else '':>4}  {param:9} {value:11.4g}  "
                  f"{interval:26} {f'{held:.4f}' if i == 0 and held is not None else ''}")
        if "compute_optimal" in entry:
            opt = entry["compute_optimal"]
            print(f"{'':16}compute-optimal at C = {args.budget:.3g} ({opt['flop_convention']}): "
                  f"N = {opt['N']:.3g}, D = {opt['D']:.3g}, loss = {opt['loss']:.4g}")
    if not results:
        raise ValueError(f"no form could be fitted to {table.source}: "
                         + "; ".join(f"{name}: {why}" for name, why in skipped.items()))
    # strict JSON: a compute-optimal N that overflows (or is undefined at an exponent of 0) is null, not `NaN`
    summary = {"table": table.source, "skipped_rows": table.skipped, "depth": args.depth, "fits": results,
               "skipped_forms": skipped}
    (out / "fits.json").write_text(json.dumps(finite_or_null(summary), indent=2, allow_nan=False) + "\n")
    print(f"wrote {out / 'fits.json'} and {len(results)} plot(s) in {out}")
    return 0
