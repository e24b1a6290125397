"""LoRA training on a float base vs QLoRA on int8 / int4 / nf4 bases (`LoraSpec(weights=...)`, `--lora --weights`).

    python benchmarks/qlora_train.py                          # hidden 256 and 1024, float32 and bf16
    python benchmarks/qlora_train.py --quick                  # smoke test (hidden 64, float32, 3 steps)
    python benchmarks/qlora_train.py --hidden 512 --formats int4,int4:g128,nf4 --dtypes fp32

For each hidden size (`--hidden`; a "small"-preset model: 1 prelude, 2 core, 1 coda layer, MLP 2.75 h,
byte vocabulary) and dtype (`--dtypes`), the same model (seeded random init) with a rank-`--rank` adapter on
every part, once per base format (float, then `--formats`), side by side:

* `linear_bytes`: the resident bytes of the base's transformer linear weights, counted exactly from the
  stored tensors (float: the weights; int8: 1 byte a weight + a float32 scale per output channel; int4:
  half a byte a weight, padded to whole groups, + a bf16 scale and zero point per group of each channel;
  nf4: half a byte a weight, padded to whole blocks, + a bf16 absmax per block of each channel),
  and `base_bytes`: every tensor of the base but the adapter's (embedding, norms and head included);
* `build_peak_mib`, `build_resident_mib`: the peak RSS, and the RSS once the build's garbage is freed, over
  the process's RSS before the build (random init in float32, cast to the dtype, quantize, add the adapter:
  the float weights exist before quantizing, as in `--init-from` + `--weights`);
* `step_peak_mib`: the peak RSS over the RSS before one training step (forward, backward, AdamW);
* `step_ms`: the median of `--repeats` optimizer steps after `--warmup` ones (batch `--batch` x
  `--seq` tokens, depth `--num-steps` n,k: n steps without gradients, k with);
* `heldout_loss`: the adapter's loss on a held-out batch after `--train-steps` steps (AdamW, lr `--lr`, the
  same batches for every format) on a learnable task (each row counts up from a random start, mod 256),
  and `loss_within_tolerance`: whether it is within `--loss-tolerance` (relative) of the float base's:
  the quantization error's effect on what the adapter learns. `heldout_loss_before` is the loss before
  training (the quantized base alone).
Each format's ratios to the float base at the same shape and dtype (`*_vs_float`) are the result; absolute
times and RSS depend on the machine and its load (recorded).

Memory: where glibc's `mallopt` is available the build and the memory step run with large allocations
mmapped (threshold 1 MiB) so that freed tensors leave the RSS; the timed steps with a 32 MiB threshold
(glibc's dynamic ceiling) so that reused buffers are not page-faulted again each step. Peaks are read
from VmHWM after resetting it (`/proc/self/clear_refs`); null where that is refused.

Prints one JSON line, then a table. The clock is CPU time (`time.process_time`) at one thread
(`--threads`, default 1: steadiest on a shared machine), wall time otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _args import weight_formats
from torch import nn

import recurrent_depth as rd
from recurrent_depth.train.lora import LoraSpec, add_lora
from recurrent_depth.weight_quant import QuantizedLinear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FLOAT = "float"  # the float base's row
VOCAB = 256
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_SMALL, MMAP_LARGE = 1 << 20, 32 << 20  # see the docstring: memory phases / timed steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="256,1024", help="comma-separated hidden sizes (default: %(default)s)")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {list(DTYPES)} (default: %(default)s)")
    p.add_argument("--formats", default="int8,int4,nf4", type=weight_formats,
                   help="comma-separated quantized base formats, each against the float base (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="rows per step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row (default: %(default)s)")
    p.add_argument("--num-steps", default="2,2", help="recurrence n,k: n steps without gradients, k with "
                                                       "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps, median kept (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=20,
                   help="steps before the held-out loss, the timed ones included (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--loss-tolerance", type=float, default=0.01,
                   help="relative held-out loss difference to the float base allowed (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model, adapter and data seed (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="smoke test: hidden 64, fp32, seq 16, 3 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.dtypes, args.seq, args.num_steps = "64", "fp32", 16, "1,1"
        args.warmup, args.repeats, args.train_steps = 1, 1, 3
    try:
        args.hidden = [int(h) for h in args.hidden.split(",") if h.strip()]
        n, k = (int(v) for v in args.num_steps.split(","))
    except ValueError:
        p.error(f"--hidden takes integers and --num-steps two (n,k), got {args.hidden!r} and {args.num_steps!r}")
    args.num_steps = (n, k)
    if not args.hidden or any(h < 64 or h % 64 for h in args.hidden):
        p.error(f"--hidden {args.hidden} is invalid: each must be a multiple of 64 (heads of 64)")
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not args.dtypes or any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtypes {args.dtypes} is invalid: expected some of {list(DTYPES)}")
    if min(args.rank, args.batch, args.seq, args.repeats, args.threads, k) < 1 or n < 0 or args.warmup < 1:
        p.error("--rank, --batch, --seq, --repeats, --threads, --warmup and k of --num-steps must be >= 1, n >= 0")
    if args.train_steps < args.warmup + args.repeats:
        p.error(f"--train-steps must be >= --warmup + --repeats ({args.warmup + args.repeats})")
    if not (math.isfinite(args.lr) and args.lr > 0) or not args.loss_tolerance >= 0:
        p.error("--lr must be > 0 and --loss-tolerance >= 0")
    return args


# ------------------------------------------------------------------------------ memory


class Memory:
    """RSS figures of this process: VmRSS, and VmHWM after a reset; large allocations' mmap threshold."""

    def __init__(self) -> None:
        try:
            self.libc: Any = ctypes.CDLL("libc.so.6")
            self.libc.mallopt  # noqa: B018 (glibc only)
        except (OSError, AttributeError):
            self.libc = None
        self.threshold: int | None = None

    def mmap_threshold(self, size: int) -> None:
        if self.libc is not None and self.libc.mallopt(M_MMAP_THRESHOLD, size) == 1:
            self.threshold = size

    def _status(self, key: str) -> int | None:
        try:
            with open("/proc/self/status") as f:
                return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), None)
        except OSError:
            return None

    def reset(self, collect: bool = True) -> int | None:
        """Free what can be freed (collect: unreachable cycles too, the costly part), reset the peak; returns the
        RSS now (None: not readable)."""
        if collect:
            gc.collect()
        if self.libc is not None:
            self.libc.malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.peak_resets = True
        except OSError:
            self.peak_resets = False
        return self._status("VmRSS:")

    def since(self, before: int | None, collect: bool = True) -> tuple[float | None, float | None]:
        """(peak, current) RSS over `before`, in MiB; current once garbage (collect) and the allocator's free pages
        are gone."""
        peak = self._status("VmHWM:")
        if collect:
            gc.collect()
        if self.libc is not None:
            self.libc.malloc_trim(0)
        now = self._status("VmRSS:")
        if before is None or now is None:
            return None, None
        return (round((peak - before) / 2**20, 1) if peak is not None and self.peak_resets else None,
                round((now - before) / 2**20, 1))


# ------------------------------------------------------------------------------ the model and the data


def model_config(hidden: int) -> rd.ModelConfig:
    intermediate = -(-int(hidden * 2.75) // 16) * 16
    return dataclasses.replace(rd.ModelConfig.from_preset("small"), vocab_size=VOCAB, hidden_size=hidden,
                               num_heads=hidden // 64, num_kv_heads=hidden // 64, intermediate_size=intermediate)


def build(cfg: rd.ModelConfig, dtype: torch.dtype, fmt: str | None, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # the same float weights for every format
    model = rd.RecurrentDepthLM(cfg).to(dtype)
    return add_lora(model, LoraSpec(rank=args.rank, weights=fmt), seed=args.seed)


def counting_rows(rows: int, length: int, seed: int) -> torch.Tensor:
    """Rows counting up from a random start, mod the vocabulary: learnable from the previous token."""
    start = torch.randint(0, VOCAB, (rows, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(length + 1)) % VOCAB


def loss_of(model: nn.Module, rows: torch.Tensor, num_steps: tuple[int, int]) -> torch.Tensor:
    logits = model(rows[:, :-1], num_steps=num_steps, init_scale=0.0).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten())


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Exact bytes of the stored tensors: the transformer's linear weights (float or quantized, without biases)
    and every tensor of the base but the adapter's."""
    base = model.get_base_model()
    linear = 0
    for name, m in base.transformer.named_modules():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue
        if isinstance(m, QuantizedLinear):
            linear += m.quantized_bytes()
        elif type(m) is nn.Linear:
            linear += m.weight.numel() * m.weight.element_size()
    seen: dict[int, int] = {}  # by storage: a tied head counts once
    for name, t in [*base.named_parameters(), *base.named_buffers()]:
        if "lora_" not in name and t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return dict(linear_bytes=linear, base_bytes=sum(seen.values()))


# ------------------------------------------------------------------------------ one format


def _clock():
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def measure(cfg: rd.ModelConfig, dtype: torch.dtype, fmt: str | None, args: argparse.Namespace,
            memory: Memory) -> dict[str, Any]:
    memory.mmap_threshold(MMAP_SMALL)
    before = memory.reset()
    model = build(cfg, dtype, fmt, args)
    build_peak, build_resident = memory.since(before)
    row: dict[str, Any] = dict(weight_bytes(model), build_peak_mib=build_peak, build_resident_mib=build_resident,
                               adapter_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
    heldout = counting_rows(args.batch, args.seq, seed=10_000 + args.seed)
    with torch.no_grad():
        row["heldout_loss_before"] = round(float(loss_of(model, heldout, args.num_steps)), 5)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    def step(i: int) -> None:
        loss_of(model, counting_rows(args.batch, args.seq, seed=args.seed + i), args.num_steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    before = memory.reset(collect=False)  # (nothing of this model is garbage yet)
    step(0)  # (the first: AdamW's state appears here)
    row["step_peak_mib"] = memory.since(before, collect=False)[0]
    memory.mmap_threshold(MMAP_LARGE)
    clock, times = _clock(), []
    for i in range(1, args.train_steps):
        start = clock()
        step(i)
        if args.warmup <= i < args.warmup + args.repeats:
            times.append(clock() - start)
    row["step_ms"] = round(statistics.median(times) * 1e3, 2)
    model.eval()
    with torch.no_grad():
        row["heldout_loss"] = round(float(loss_of(model, heldout, args.num_steps)), 5)
    return row


def compare(rows: dict[str, dict[str, Any]], tolerance: float) -> None:
    """Each quantized row's ratios to the float base's, and whether its held-out loss is within tolerance."""
    ref = rows[FLOAT]
    for fmt, row in rows.items():
        if fmt == FLOAT:
            continue
        for key in ("linear_bytes", "base_bytes", "build_peak_mib", "step_peak_mib", "step_ms"):
            num, den = row[key], ref[key]
            row[f"{key}_vs_float"] = round(num / den, 3) if num is not None and den else None
        diff = abs(row["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
        row["loss_relative_difference"] = round(diff, 5)
        row["loss_within_tolerance"] = diff <= tolerance


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def print_table(record: dict[str, Any]) -> None:
    print(f"\n{'hidden':>6} {'dtype':<5} {'base':<9}{'linear MB':>10}{'x float':>8}{'build peak MiB':>15}"
          f"{'x float':>8}{'step peak MiB':>14}{'x float':>8}{'step ms':>9}{'x float':>8}{'loss before':>12}"
          f"{'loss after':>11}{'rel diff':>9}{'within':>7}")
    fmt_cell = lambda v, w: f"{'-' if v is None else str(v):>{w}}"  # noqa: E731
    for shape in record["results"]:
        for dname, rows in shape["dtypes"].items():
            if "error" in rows:
                print(f"{shape['hidden']:>6} {dname:<5} {rows['error']}")
                continue
            for fmt, r in rows.items():
                print(f"{shape['hidden']:>6} {dname:<5} {fmt:<9}{r['linear_bytes'] / 1e6:>10.2f}"
                      f"{fmt_cell(r.get('linear_bytes_vs_float'), 8)}{fmt_cell(r['build_peak_mib'], 15)}"
                      f"{fmt_cell(r.get('build_peak_mib_vs_float'), 8)}{fmt_cell(r['step_peak_mib'], 14)}"
                      f"{fmt_cell(r.get('step_peak_mib_vs_float'), 8)}{r['step_ms']:>9}"
                      f"{fmt_cell(r.get('step_ms_vs_float'), 8)}{r['heldout_loss_before']:>12}{r['heldout_loss']:>11}"
                      f"{fmt_cell(r.get('loss_relative_difference'), 9)}{fmt_cell(r.get('loss_within_tolerance'), 7)}")
    print(f"tolerance: held-out loss within {record['loss_tolerance']:.0%} (relative) of the float base's after "
          f"{record['train_steps']} steps; {record['clock']}; {record['machine']}, load {record['load_average_before']}"
          f" -> {record['load_average_after']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    memory, load_before = Memory(), [round(x, 2) for x in os.getloadavg()]
    for fmt in [None, *args.formats]:  # first uses (peft's import, lazy inits) are no build's memory
        build(model_config(64), torch.float32, fmt, args)
    results = []
    for hidden in args.hidden:
        cfg = model_config(hidden)
        per_dtype: dict[str, Any] = {}
        for dname in args.dtypes:
            start = time.perf_counter()
            try:
                rows = {fmt or FLOAT: measure(cfg, DTYPES[dname], fmt, args, memory) for fmt in [None, *args.formats]}
            except RuntimeError as err:  # an op this dtype lacks on this machine
                per_dtype[dname] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
                continue
            compare(rows, args.loss_tolerance)
            per_dtype[dname] = rows
            log(f"[hidden {hidden} {dname}] {json.dumps(rows)} ({time.perf_counter() - start:.0f}s)")
        results.append(dict(hidden=hidden, intermediate=cfg.intermediate_size, layers=dict(
            prelude=cfg.prelude_layers, core=cfg.core_layers, coda=cfg.coda_layers), dtypes=per_dtype))
    record = dict(
        benchmark="qlora_train", rank=args.rank, batch=args.batch, seq=args.seq, num_steps=list(args.num_steps),
        warmup=args.warmup, repeats=args.repeats, train_steps=args.train_steps, lr=args.lr,
        loss_tolerance=args.loss_tolerance, seed=args.seed, quick=args.quick, results=results,
        clock="process_time" if torch.get_num_threads() == 1 else "perf_counter", threads=torch.get_num_threads(),
        mmap_threshold=dict(memory_phases=MMAP_SMALL, timed_steps=MMAP_LARGE) if memory.threshold else None,
        machine=machine(), torch=torch.__version__, python=platform.python_version(),
        script=Path(__file__).name, load_average_before=load_before,
        load_average_after=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(record))
    print_table(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
