"""`rdepth sweep`: a grid of normal `rdepth train` runs from one YAML, resumable, collected into one table.

    rdepth sweep run examples/sweep_small.yaml --out runs/sweep --jobs 2   # run what is not finished
    rdepth sweep status runs/sweep                                          # done / partial / pending
    rdepth sweep collect runs/sweep                                         # results.csv + results.json
    rdepth sweep emit examples/sweep_small.yaml --out runs/sweep --slurm    # sweep.slurm + commands.txt

The sweep file and the table's columns are described in docs/scaling.md.
"""

from __future__ import annotations

import argparse

from recurrent_depth.cli.common import _positive_int

# --nproc's ceiling: processes on one node (torchrun's --nproc_per_node), past any machine's GPUs or useful CPU ranks;
# unbounded, a typo (--nproc 10000000) wrote a script asking Slurm for millions of CPUs per task
MAX_NPROC = 1024


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a grid of training runs (resumable, parallel), emit it for Slurm, collect a table",
        description=__doc__.splitlines()[0])
    inner = parser.add_subparsers(dest="sweep_action", metavar="<action>")
    run = inner.add_parser("run", help="run every unfinished run of a sweep file, --jobs at a time",
                           description="Each run is `rdepth train` in its own process, writing SWEEP_DIR/runs/NAME; "
                                       "a finished run is skipped, an unfinished one resumes from its checkpoint.")
    run.add_argument("config", metavar="CONFIG.yaml", help="sweep file: base, grid and/or runs, test_depths")
    run.add_argument("--out", required=True, metavar="SWEEP_DIR", help="the sweep's directory")
    run.add_argument("--jobs", type=int, default=None, metavar="N",
                     help="runs at a time (default: the CPUs this process may use // threads per run); "
                          "--threads T gives each run T torch threads (default: the file's threads_per_run, 1)")
    run.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                     help="torch CPU threads of each run (default: the sweep file's threads_per_run, 1)")
    run.set_defaults(func=_run)
    emit = inner.add_parser("emit", help="write the runs as commands.txt (one command a line) and a Slurm job array",
                            description="Writes SWEEP_DIR/commands.txt and, with --slurm, SWEEP_DIR/sweep.slurm "
                                        "(sbatch it); each array task runs one normal `rdepth train` run.")
    emit.add_argument("config", metavar="CONFIG.yaml", help="sweep file")
    emit.add_argument("--out", required=True, metavar="SWEEP_DIR", help="the sweep's directory")
    emit.add_argument("--slurm", action="store_true", help="also write sweep.slurm, a job array (default: off)")
    emit.add_argument("--nproc", type=int, default=1, metavar="N",
                      help=f"processes per run, at most {MAX_NPROC}: above 1 each command is a torchrun "
                           "--standalone run (default: 1)")
    emit.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                      help="an extra #SBATCH line, e.g. --sbatch=--time=01:00:00 (repeatable; default: none)")
    emit.set_defaults(func=_emit)
    collect = inner.add_parser("collect", help="evaluate the finished runs at the test depths, write results.csv/json",
                               description="Gathers whatever has finished: the loss at each test depth (the run's "
                                           "final evaluation, else evaluated now and cached), its FLOPs and size.")
    collect.add_argument("sweep_dir", metavar="SWEEP_DIR", help="the sweep's directory")
    collect.set_defaults(func=_collect)
    status = inner.add_parser("status", help="each run's state: done, partial (has a checkpoint) or pending")
    status.add_argument("sweep_dir", metavar="SWEEP_DIR", help="the sweep's directory")
    status.set_defaults(func=_status)
    parser.set_defaults(func=lambda args: parser.print_help() or 0)


def _run(args: argparse.Namespace) -> int:
    from recurrent_depth.files import check_out_dir
    from recurrent_depth.scaling.sweep import run_sweep

    if args.jobs is not None and args.jobs < 1:  # (as the flag, before the plan and shared data are written)
        raise ValueError(f"--jobs must be an integer >= 1, got {args.jobs}")
    check_out_dir(args.out)  # (an existing file: mkdir's bare "[Errno 17] File exists")
    # --threads (added to every command) is each run's torch thread count here, not this process's
    states = run_sweep(args.config, args.out, jobs=args.jobs, threads=getattr(args, "threads", None))
    left = [name for name, state in states.items() if state != "done"]
    print(f"sweep: {len(states) - len(left)} of {len(states)} runs finished"
          + (f"; not finished: {', '.join(left)}" if left else ""))
    return 1 if left else 0


def _emit(args: argparse.Namespace) -> int:
    from recurrent_depth.files import check_out_dir
    from recurrent_depth.scaling.sweep import emit_sweep

    if not 1 <= args.nproc <= MAX_NPROC:
        raise ValueError(f"--nproc must be an integer in [1, {MAX_NPROC}] (processes per node), got {args.nproc}")
    # each option is one #SBATCH line: a line break would make the rest a line of the script of its own
    broken = [option for option in args.sbatch if "\n" in option or "\r" in option]
    if broken:
        raise ValueError(f"--sbatch {broken[0]!r} holds a line break; give each option as its own --sbatch")
    check_out_dir(args.out)  # (an existing file: mkdir's bare "[Errno 17] File exists")
    for path in emit_sweep(args.config, args.out, nproc=args.nproc, slurm=args.slurm, slurm_options=args.sbatch):
        print(f"wrote {path}")
    return 0


def _collect(args: argparse.Namespace) -> int:
    from recurrent_depth.scaling.sweep import collect_sweep

    collect_sweep(args.sweep_dir)
    return 0


def _status(args: argparse.Namespace) -> int:
    from recurrent_depth.scaling.sweep import sweep_status

    states = sweep_status(args.sweep_dir)
    for name, state in states.items():
        print(f"{state:8s} {name}")
    counts = {s: list(states.values()).count(s) for s in ("done", "partial", "pending")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0
