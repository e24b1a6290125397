"""KV memory benchmark: sharing, early exit and TurboQuant, alone and compounded, side by side.

    python benchmarks/kv_memory.py --model runs/quickstart/model              # small preset, r = 32
    python benchmarks/kv_memory.py --model M --shells-model runs/quickstart-shells/model --games 1000
    python benchmarks/kv_memory.py --quick                                     # smoke test, seeded model

For each configuration (a KV policy, an exit criterion, a KV quantization; `--configs` lists them),
at r = --num-steps on held-out stdlib prompts of the model directory's tokenizer (a seeded `small`
model on random prompts without --model):
- `bytes_per_token`: the cache's logical KV bytes (every layer: prelude, coda and each core slot
  the policy keeps; every norm counted) after the teacher-forced run, per cached token (the prompt
  and the generated tokens but the last, which is chosen and never cached), and
  `decode_bytes_per_token` over the generated tokens only (early exit only changes those; the
  prompt runs at full depth). Unquantized caches are counted in bf16 (2 bytes per
  number; the model runs in float32, whose bytes are halved); quantized caches as stored.
  `x_vs_per_step_bf16`: the per-step bf16 cache's bytes divided by this one's.
- `agreement`: teacher-forced per-token agreement with full-cache fixed-depth greedy decoding
  (per-step, no exit, no quantization) over --agreement-tokens tokens of --prompts prompts, and
  `agreement_se`, its standard error from the per-prompt agreements (tokens of one prompt are not
  independent; the binomial one for a single prompt).
- `tokens_per_s`: decode speed of one prompt (best of --repeats rounds, the configurations taking
  turns), and `x_speed_vs_unquantized`: against the same policy and exit without quantization;
  `cpu_tokens_per_s` and `x_cpu_speed_vs_unquantized` the same from the decode's CPU time (steadier
  on a shared machine; null where no round's decode outcost its prefill-only call: too few
  tokens timed); `first_call_s` / `best_call_s`: the first and the fastest timed call (the
  first includes the quantized kernels' first-use compile when nothing ran before: --speed-only).
  Quantized decoding compiles its kernels unless RDEPTH_NO_COMPILE=1 (or RDEPTH_NO_ACCEL=1).
- with --shells-model: accuracy on --games shells games (--swaps swaps each, greedy answer at
  r), paired against the full cache: both right, only the full cache right, only this one right.
Prints one JSON line, then a table; writes --plot (bytes vs agreement) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _args import checked_model_dir, out_file

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.kv_codec import KVQuant

TQ35, TQ25 = "k=prod:3.5,v=mse:3.5", "k=prod:2.5,v=mse:2.5"
CONFIGS: dict[str, dict[str, Any]] = {
    "per-step bf16": {},
    "shared-4": {"kv_policy": "shared-4"},
    "kl exit": {"exit_criterion": "kl"},
    "tq3.5": {"kv_quant": TQ35},
    "tq2.5": {"kv_quant": TQ25},
    "tq3.5 dequantize": {"kv_quant": TQ35 + ",attn=dequantize"},
    "kl exit + tq3.5": {"exit_criterion": "kl", "kv_quant": TQ35},
    "shared-4 + tq3.5": {"kv_policy": "shared-4", "kv_quant": TQ35},
    "shared-4 + tq2.5": {"kv_policy": "shared-4", "kv_quant": TQ25},
    "shared-4 + mse3.5": {"kv_policy": "shared-4", "kv_quant": "k=mse:3.5,v=mse:3.5"},
    "shared-4 + mse2.5": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5"},
    # the channel split's outliers: keys calibrated per head (the default), keys and values, or the first channels
    "shared-4 + tq3.5 all": {"kv_policy": "shared-4", "kv_quant": TQ35 + ",outliers=calibrated"},
    "shared-4 + tq2.5 all": {"kv_policy": "shared-4", "kv_quant": TQ25 + ",outliers=calibrated"},
    "shared-4 + mse2.5 all": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5,outliers=calibrated"},
    "shared-4 + tq3.5 first": {"kv_policy": "shared-4", "kv_quant": TQ35 + ",outliers=first"},
    "shared-4 + tq2.5 first": {"kv_policy": "shared-4", "kv_quant": TQ25 + ",outliers=first"},
    "shared-4 + mse3.5 first": {"kv_policy": "shared-4", "kv_quant": "k=mse:3.5,v=mse:3.5,outliers=first"},
    "shared-4 + mse2.5 first": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5,outliers=first"},
    # 2.5 bits on average by giving one side more bits
    "shared-4 + k mse3 v mse2": {"kv_policy": "shared-4", "kv_quant": "k=mse:3,v=mse:2"},
    "shared-4 + k mse2 v mse3": {"kv_policy": "shared-4", "kv_quant": "k=mse:2,v=mse:3"},
    "shared-4 + k prod3 v mse2": {"kv_policy": "shared-4", "kv_quant": "k=prod:3,v=mse:2"},
    "shared-4 + k mse3 v mse2.5": {"kv_policy": "shared-4", "kv_quant": "k=mse:3,v=mse:2.5"},
    "shared-4 + k mse3.5 v mse2": {"kv_policy": "shared-4", "kv_quant": "k=mse:3.5,v=mse:2"},
    "shared-4 + k mse4 v mse2": {"kv_policy": "shared-4", "kv_quant": "k=mse:4,v=mse:2"},
    # QJL keys with bf16 outlier channels (qjl:b:outN) beside 2.5-bit values
    "shared-4 + k qjl2out2 v mse2.5": {"kv_policy": "shared-4", "kv_quant": "k=qjl:2:out2,v=mse:2.5"},
    "shared-4 + k qjl2out2 v mse2": {"kv_policy": "shared-4", "kv_quant": "k=qjl:2:out2,v=mse:2"},
    # the recent-token bf16 window (window=W): at 112 tokens W <= 2 keeps mse2.5 within 32x, at 512 W <= 9
    "shared-4 + mse2.5 w2": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5,window=2"},
    "shared-4 + mse2.5 w4": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5,window=4"},
    "shared-4 + mse2.5 w8": {"kv_policy": "shared-4", "kv_quant": "k=mse:2.5,v=mse:2.5,window=8"},
    "shared-4 + tq2.5 w1": {"kv_policy": "shared-4", "kv_quant": TQ25 + ",window=1"},
    "shared-4 + tq2.5 w4": {"kv_policy": "shared-4", "kv_quant": TQ25 + ",window=4"},
    "shared-4 + k mse3 v mse2 w3": {"kv_policy": "shared-4", "kv_quant": "k=mse:3,v=mse:2,window=3"},
    "shared-4 + k mse3 v mse2 w16": {"kv_policy": "shared-4", "kv_quant": "k=mse:3,v=mse:2,window=16"},
    "shared-4 + k mse2 v mse3 w3": {"kv_policy": "shared-4", "kv_quant": "k=mse:2,v=mse:3,window=3"},
    "shared-4 + k mse2 v mse3 w16": {"kv_policy": "shared-4", "kv_quant": "k=mse:2,v=mse:3,window=16"},
    "shared-4 + k qjl2out2 v mse2 w4": {"kv_policy": "shared-4", "kv_quant": "k=qjl:2:out2,v=mse:2,window=4"},
    "shared-4 + kl": {"kv_policy": "shared-4", "exit_criterion": "kl"},
    "shared-4 + kl + tq3.5": {"kv_policy": "shared-4", "exit_criterion": "kl", "kv_quant": TQ35},
    "shared-4 + kl + tq2.5": {"kv_policy": "shared-4", "exit_criterion": "kl", "kv_quant": TQ25},
}
REFERENCE = "per-step bf16"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: a seeded small model)")
    p.add_argument("--num-steps", type=int, default=32, help="recurrence depth r (default: %(default)s)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="configurations to measure (default: all)")
    p.add_argument("--prompts", type=int, default=2, help="agreement prompts (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=48, help="prompt tokens (default: %(default)s)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence, prompt and teacher-forced ones: sets --prompt-len to CONTEXT - "
                        "--agreement-tokens (default: --prompt-len + --agreement-tokens, 112 at the defaults "
                        "used in docs/quant.md)")
    p.add_argument("--no-speed", action="store_true", help="bytes and agreement only (no decode timing)")
    p.add_argument("--agreement-tokens", type=int, default=48, help="teacher-forced tokens (default: %(default)s)")
    p.add_argument("--speed-tokens", type=int, default=16, help="tokens timed per run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs, best kept (default: %(default)s)")
    p.add_argument("--shells-model", default=None, help="a shells model directory (default: no shells games)")
    p.add_argument("--games", type=int, default=1000, help="shells games with --shells-model (default: %(default)s)")
    p.add_argument("--swaps", type=int, default=8, help="swaps per shells game (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and prompts without --model")
    p.add_argument("--plot", default="kv_memory.png", type=out_file,
                   help="bytes vs agreement plot (default: %(default)s)")
    p.add_argument("--speed-only", action="store_true",
                   help="decode speeds only (no bytes, agreement or plot): the first call of each configuration "
                        "then includes any first-use compile")
    p.add_argument("--quick", action="store_true", help="r = 8, a few tokens, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.num_steps, args.prompts, args.prompt_len, args.agreement_tokens = 8, 1, 16, 8
        args.speed_tokens, args.repeats, args.games = 4, 1, min(args.games, 20)
    if args.context is not None:
        if args.context <= args.agreement_tokens:
            p.error(f"--context must exceed --agreement-tokens ({args.agreement_tokens}), got {args.context}")
        args.prompt_len = args.context - args.agreement_tokens
    for name in ("num_steps", "prompts", "prompt_len", "agreement_tokens", "speed_tokens", "repeats", "games",
                 "swaps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.model = checked_model_dir(p, args.model)
    args.shells_model = checked_model_dir(p, args.shells_model, "--shells-model")
    return args


def load(args: argparse.Namespace) -> tuple[rd.RecurrentDepthLM, list[list[int]], str]:
    if args.model:
        sys.path.insert(0, str(Path(__file__).parent))
        from generation import heldout_prompts

        model = rd.RecurrentDepthLM.from_pretrained(args.model, dtype=torch.float32).eval()
        return model, heldout_prompts(Path(args.model), args.prompts, args.prompt_len, None), args.model
    torch.manual_seed(args.seed)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("small")).eval()
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.config.vocab_size, (args.prompts, args.prompt_len), generator=g).tolist()
    return model, prompts, f"seeded small (seed {args.seed}, untrained)"


def bf16_factor(kwargs: dict[str, Any], model: rd.RecurrentDepthLM) -> float:
    """Unquantized entries are counted in bf16: the float32 model's bytes times 2 / element size."""
    return 1.0 if kwargs.get("kv_quant") else 2 / model.dtype.itemsize


def cached_tokens(prompt_len: int, generated: int) -> int:
    """Tokens in the cache when the last of `generated` tokens is chosen (`cache_bytes[:, -1]`): the
    prompt and every generated token but that last one, which is chosen, never fed back."""
    return prompt_len + generated - 1


def measure(model: rd.RecurrentDepthLM, prompts: torch.Tensor, reference: torch.Tensor, kwargs: dict[str, Any],
            args: argparse.Namespace) -> dict[str, Any]:
    common = dict(num_steps=args.num_steps, init_scale=0.0)
    n = reference.shape[1]
    forced = generate(model, prompts, max_new_tokens=n, teacher_tokens=reference, **common, **kwargs)
    per_prompt = (forced.predictions == reference).float().mean(dim=1)
    agreement = per_prompt.mean().item()
    se = (per_prompt.std().item() / math.sqrt(len(per_prompt)) if len(per_prompt) > 1
          else math.sqrt(agreement * (1 - agreement) / n))
    factor = bf16_factor(kwargs, model)
    final = forced.cache_bytes[:, -1].double() * factor
    first = forced.cache_bytes[:, 0].double() * factor
    tokens = cached_tokens(prompts.shape[1], n)
    return dict(
        kwargs=kwargs,
        bytes_per_token=round(final.mean().item() / tokens, 1),
        decode_bytes_per_token=round(((final - first) / max(1, n - 1)).mean().item(), 1),
        agreement=round(agreement, 4),
        agreement_se=round(se, 4),
        mean_steps=round(forced.steps.float().mean().item(), 2),
    )


def decode_speeds(model: rd.RecurrentDepthLM, prompt: torch.Tensor, configs: dict[str, dict[str, Any]],
                  args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per configuration on one prompt: best decode tokens/s (wall clock) and best tokens per CPU
    second of the decode (the call's process time minus a prefill-only call's, less sensitive to other
    processes on a shared machine), over --repeats rounds in which the configurations take turns, so
    that a change in machine load hits all alike; and the first call's seconds (with any first-use
    compile of the quantized kernels, recurrent_depth/accel/quant.py) next to the fastest call's."""
    out = {name: dict(tokens_per_s=0.0, cpu_tokens_per_s=None, first_call_s=None, best_call_s=math.inf)
           for name in configs}
    common = dict(num_steps=args.num_steps, init_scale=0.0)
    for _ in range(args.repeats):
        for name, kwargs in configs.items():
            cpu0, wall0 = time.process_time(), time.perf_counter()
            run = generate(model, prompt, max_new_tokens=args.speed_tokens, **common, **kwargs)
            cpu1, wall1 = time.process_time(), time.perf_counter()
            generate(model, prompt, max_new_tokens=1, **common, **kwargs)  # the prefill alone
            prefill_cpu = time.process_time() - cpu1
            r = out[name]
            r["tokens_per_s"] = max(r["tokens_per_s"], run.summary()["tokens_per_second"])
            decode_cpu = cpu1 - cpu0 - prefill_cpu
            if decode_cpu > 0:  # else the prefill alone cost more than it with the decode: noise, no measure
                r["cpu_tokens_per_s"] = max(r["cpu_tokens_per_s"] or 0.0,
                                            round((args.speed_tokens - 1) / decode_cpu, 2))
            if r["first_call_s"] is None:
                r["first_call_s"] = round(wall1 - wall0, 3)
            r["best_call_s"] = round(min(r["best_call_s"], wall1 - wall0), 3)
    return out


def shells_games(model_dir: str, configs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Greedy answers to `--games` shells games under each configuration, paired with the full cache."""
    from recurrent_depth.data.tokenizer import load_tokenizer
    from recurrent_depth.evaluation.reasoning import ProblemEncoder, get_task, make_problems

    model = rd.RecurrentDepthLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoder = ProblemEncoder(load_tokenizer(model_dir))
    problems = make_problems(get_task("shells"), args.games, [args.swaps], seed=args.seed)
    prompts = torch.tensor([encoder.row([(p.prompt, False)], end=False)[0] for p in problems])
    answers = torch.tensor([encoder.encode_text(p.answer) for p in problems])
    right = {}
    for name, kwargs in configs.items():
        hits = []
        for start in range(0, len(problems), 256):
            out = generate(model, prompts[start:start + 256], max_new_tokens=answers.shape[1],
                           num_steps=args.num_steps, init_scale=0.0, **kwargs)
            hits.append((out.sequences[:, prompts.shape[1]:] == answers[start:start + 256]).all(dim=1))
        right[name] = torch.cat(hits)
    full = right[REFERENCE]
    report = {}
    for name, hits in right.items():
        only_full, only_this = int((full & ~hits).sum()), int((hits & ~full).sum())
        diff = (hits.float() - full.float())
        report[name] = dict(accuracy=round(hits.float().mean().item(), 4), both=int((full & hits).sum()),
                            only_full=only_full, only_this=only_this,
                            paired_diff=round(diff.mean().item(), 4),
                            paired_se=round(diff.std().item() / math.sqrt(len(diff)), 4))
    return dict(model=model_dir, games=len(problems), swaps=args.swaps, by_config=report)


def plot(results: dict[str, dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(results.items()):
        ax.scatter(r["bytes_per_token"], r["agreement"])
        ax.annotate(name, (r["bytes_per_token"], r["agreement"]), fontsize=7, xytext=(3, 3 - 10 * (i % 2)),
                    textcoords="offset points")  # alternate above / below: equal points do not overprint
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes per token (all layers, norms counted)")
    ax.set_ylabel("teacher-forced agreement with the full cache")
    ax.set_title("KV memory vs agreement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def unquantized_twin(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k != "kv_quant"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, prompt_lists, source = load(args)
    prompts = torch.tensor(prompt_lists)
    configs = {name: CONFIGS[name] for name in dict.fromkeys([REFERENCE, *args.configs])}
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {name: {"kwargs": kwargs} for name, kwargs in configs.items()}
    context = args.prompt_len + args.agreement_tokens
    # a window's bf16 entries are spread over the tokens cached, as `bytes_per_token` counts them
    cached = cached_tokens(args.prompt_len, args.agreement_tokens)
    true_bits = {name: KVQuant.parse(kwargs["kv_quant"]).bits_per_coordinate(model.config.head_dim, cached)
                 for name, kwargs in configs.items() if kwargs.get("kv_quant")}
    if not args.speed_only:
        reference = generate(model, prompts, max_new_tokens=args.agreement_tokens, num_steps=args.num_steps,
                             init_scale=0.0).sequences[:, prompts.shape[1]:]
        results = {name: measure(model, prompts, reference, kwargs, args) for name, kwargs in configs.items()}
        base = results[REFERENCE]["bytes_per_token"]
        for r in results.values():
            r["x_vs_per_step_bf16"] = round(base / r["bytes_per_token"], 2)
    for name, bits in true_bits.items():  # what a spec stores per coordinate, norms counted (its label is nominal)
        results[name]["kv_quant_bits_per_coordinate"] = bits
    speeds = {} if args.no_speed else decode_speeds(model, prompts[:1], configs, args)
    for name, speed in speeds.items():
        results[name].update(speed)
    for key in () if args.no_speed else ("tokens_per_s", "cpu_tokens_per_s"):
        speed_of = {json.dumps(r["kwargs"], sort_keys=True): r[key] for r in results.values()}
        for r in results.values():
            twin = speed_of.get(json.dumps(unquantized_twin(r["kwargs"]), sort_keys=True))
            if r["kwargs"].get("kv_quant") and twin and r[key]:
                r["x_speed_vs_unquantized" if key == "tokens_per_s" else "x_cpu_speed_vs_unquantized"] = round(
                    r[key] / twin, 3)
    shells = shells_games(args.shells_model, configs, args) if args.shells_model else None
    report = {
        "benchmark": "kv_memory", "model": source, "num_steps": args.num_steps,
        "config": {k: v for k, v in model.config.to_dict().items()
                   if k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "prelude_layers", "core_layers",
                            "coda_layers")},
        "prompts": len(prompt_lists), "prompt_len": args.prompt_len, "agreement_tokens": args.agreement_tokens,
        "context": context,
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1), "results": results,
        "shells": shells if shells else "not run (give --shells-model DIR)",
    }
    report["plot"] = "not drawn (--speed-only)" if args.speed_only else plot(results, args.plot)
    print(json.dumps(report))
    print(f"\nmodel: {source}, r = {args.num_steps}, {len(prompt_lists)} x {args.agreement_tokens} teacher-forced "
          f"tokens after {args.prompt_len}-token prompts (context {context}), "
          + ("no timing" if args.no_speed else f"{args.speed_tokens} tokens timed, best of {args.repeats}"))
    head = (f"{'config':<33}{'B/token':>9}{'decode B/tok':>13}{'x bf16':>8}{'agree':>8}{'± se':>7}{'steps':>7}"
            + ("" if args.no_speed else f"{'tok/s':>8}{'x speed':>9}{'x cpu':>7}{'first s':>9}{'best s':>8}"))
    print(head)
    for name, r in results.items():
        speed, cpu = r.get("x_speed_vs_unquantized"), r.get("x_cpu_speed_vs_unquantized")
        memory = "".join(f"{'-':>{w}}" for w in (9, 13, 8, 8, 7, 7)) if args.speed_only else (
            f"{r['bytes_per_token']:>9.0f}{r['decode_bytes_per_token']:>13.0f}"
            f"{r['x_vs_per_step_bf16']:>8.2f}{r['agreement']:>8.3f}{r['agreement_se']:>7.3f}{r['mean_steps']:>7.1f}")
        timing = "" if args.no_speed else (
            f"{r['tokens_per_s']:>8.1f}{'' if speed is None else f'{speed:.2f}':>9}"
            f"{'' if cpu is None else f'{cpu:.2f}':>7}{r['first_call_s']:>9.2f}{r['best_call_s']:>8.2f}")
        print(f"{name:<33}{memory}{timing}")
    if shells:
        print(f"\nshells: {shells['games']} games of {shells['swaps']} swaps ({shells['model']})")
        for name, r in shells["by_config"].items():
            print(f"{name:<27} acc {r['accuracy']:.3f}  both {r['both']}  only full {r['only_full']}  "
                  f"only this {r['only_this']}  diff {r['paired_diff']:+.4f} ± {r['paired_se']:.4f}")
    print(f"\nplot: {report['plot']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
