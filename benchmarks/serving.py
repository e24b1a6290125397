"""Serving throughput and latency: continuous batching vs one request at a time.

    python benchmarks/serving.py                       # tiny random model, ~2 minutes on 2 cores
    python benchmarks/serving.py --preset small --requests 64 --concurrency 1,8,32
    python benchmarks/serving.py --model runs/quickstart/model

Starts `rdepth serve` in a subprocess on 127.0.0.1, then for each depth mode (fixed depth and
adaptive exit) sends the same set of streaming requests (token-id prompts of varied length,
varied max_tokens, greedy, eos ignored so every request generates its full length) from 1, 8
and 32 concurrent clients (closed loop: each client sends its next request when the previous one
ends). Concurrency 1 is "one at a time". Reports aggregate tokens/s, request latency p50/p90/p99,
time to first token p50/p90, mean steps per token and the server's mean batch size, and the
speedup of each concurrency over one at a time. Then, in this process, `rd.generate` at batch 1 on
the first --single-requests of the same requests, fixed and adaptive, and how much of that
single-stream adaptive gain the continuous batch keeps at the highest concurrency:
(tokens/s adaptive / tokens/s fixed) of the batch divided by the same ratio of `rd.generate`.
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from _args import checked_model_dir, int_range, out_file, positive_int, positive_int_list, preset_name

import recurrent_depth as rd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a saved model directory (default: a random --preset model)")
    p.add_argument("--preset", default="tiny", type=preset_name,
                   help="preset of the random model (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=64,
                   help="requests per run (default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int_list, default="1,8,32",
                   help="concurrent clients per run (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int_range, default="8,48", help="prompt length range (default: %(default)s)")
    p.add_argument("--max-tokens", type=int_range, default="16,48",
                   help="max_tokens range per request (default: %(default)s)")
    p.add_argument("--num-steps", type=positive_int, default=32,
                   help="recurrence depth (default: %(default)s, the paper's)")
    p.add_argument("--exit-criterion", default="kl", help="criterion of the adaptive mode (default: %(default)s)")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="threshold of the adaptive mode (default: the criterion's)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="server --max-batch (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=1, help="server torch threads (default: %(default)s)")
    p.add_argument("--kv-quant", default=None, help="server --kv-quant (default: full precision; "
                   "benchmarks/serving_kv_quant.py compares specs side by side)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, prompts and lengths (default: %(default)s)")
    p.add_argument("--single-requests", type=positive_int, default=16,
                   help="requests run by rd.generate at batch 1 for the adaptive-gain ratio (default: %(default)s)")
    p.add_argument("--out", default=None, type=out_file, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    args.model = checked_model_dir(p, args.model)
    return args


def random_requests(rng: random.Random, vocab_size: int, prompt_tokens: tuple[int, int],
                    max_tokens: tuple[int, int], count: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request, lengths drawn from the (lo, hi) ranges (`_args.int_range`); the
    same requests for every run; ids below the special-token range."""
    p_lo, p_hi = prompt_tokens
    t_lo, t_hi = max_tokens
    vocab = max(2, vocab_size - 32)
    return [([rng.randrange(vocab) for _ in range(rng.randint(p_lo, p_hi))], rng.randint(t_lo, t_hi))
            for _ in range(count)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux /proc): the server's own
    work, which a loaded machine does not inflate the way it does wall time."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    first = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"latency": end - start, "ttft": (first or end) - start, "tokens": usage["completion_tokens"],
            "steps": usage["completion_steps"]}


async def run_load(url: str, bodies: list[dict], concurrency: int) -> dict:
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, body))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    return {
        "concurrency": concurrency, "requests": len(results), "tokens": tokens, "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "latency_p50": round(percentile(latencies, 0.5), 3), "latency_p90": round(percentile(latencies, 0.9), 3),
        "latency_p99": round(percentile(latencies, 0.99), 3),
        "ttft_p50": round(percentile(ttfts, 0.5), 4), "ttft_p90": round(percentile(ttfts, 0.9), 4),
        "steps_per_token": round(sum(r["steps"] for r in results) / max(1, tokens), 3),
    }


def main() -> int:
    args = parse_args()
    levels = args.concurrency
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            torch.manual_seed(args.seed)
            model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset(args.preset))
            model_dir = Path(tmp) / f"{args.preset}-random"
            model.save_pretrained(model_dir)
            cfg = model.config
            source = f"random {args.preset}"
        else:
            model_dir = Path(args.model)
            cfg = rd.ModelConfig.from_json(model_dir / "config.json")
            source = str(model_dir)
        num_steps = args.num_steps
        requests = random_requests(rng, cfg.vocab_size, args.prompt_tokens, args.max_tokens, args.requests)
        modes = {
            "fixed": dict(num_steps=num_steps),
            "adaptive": dict(num_steps=num_steps, exit_criterion=args.exit_criterion,
                             **({"exit_threshold": args.exit_threshold} if args.exit_threshold is not None else {})),
        }
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, RDEPTH_API_KEY="")
        server = subprocess.Popen(
            [sys.executable, "-m", "recurrent_depth.cli", "serve", "--model", str(model_dir), "--port", str(port),
             "--threads", str(args.threads), "--max-batch", str(args.max_batch), "--log-level", "warning",
             *(["--kv-quant", args.kv_quant] if args.kv_quant else [])],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {server.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
            runs = []
            for mode, extra in modes.items():
                bodies = [dict(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, seed=i, stream=True,
                               stream_options={"include_usage": True}, **extra)
                          for i, (prompt, n) in enumerate(requests)]
                asyncio.run(run_load(url, bodies[:2], 1))  # warm-up
                for c in levels:
                    steps0, rows0 = metric(url, "rdepth_decode_steps_total"), metric(url, "rdepth_batch_rows_total")
                    cpu0 = process_cpu_seconds(server.pid)
                    result = asyncio.run(run_load(url, bodies, c))
                    cpu = process_cpu_seconds(server.pid) - cpu0
                    steps1, rows1 = metric(url, "rdepth_decode_steps_total"), metric(url, "rdepth_batch_rows_total")
                    result["server_cpu_seconds"] = round(cpu, 3)
                    result["cpu_tokens_per_s"] = round(result["tokens"] / cpu, 2) if cpu > 0 else None
                    result["mode"] = mode
                    result["mean_batch_rows"] = round((rows1 - rows0) / max(1.0, steps1 - steps0), 2)
                    result["kv_pool_bytes"] = int(metric(url, "rdepth_kv_pool_bytes"))
                    runs.append(result)
                    print(f"  {mode:8s} c={c:<3d} {result['tokens_per_s']:9.1f} tok/s", file=sys.stderr)
        finally:
            server.terminate()
            server.wait(30)

        single = single_stream(model_dir, requests[: args.single_requests], modes, args.threads, args.kv_quant)

    top = max(levels)
    batch_tps = {r["mode"]: r["tokens_per_s"] for r in runs if r["concurrency"] == top}
    batch_gain = batch_tps["adaptive"] / batch_tps["fixed"]
    single_gain = single["adaptive"]["tokens_per_s"] / single["fixed"]["tokens_per_s"]
    for r in runs:
        base = next(b for b in runs if b["mode"] == r["mode"] and b["concurrency"] == min(levels))
        r["speedup_vs_one_at_a_time"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
    summary = {
        "benchmark": "serving", "model": source, "preset": None if args.model else args.preset,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "num_steps": num_steps,
        "exit_criterion": args.exit_criterion, "exit_threshold": args.exit_threshold,
        "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "max_batch": args.max_batch, "server_threads": args.threads, "kv_quant": args.kv_quant,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "platform": platform.platform(),
        "runs": runs, "single_stream": single,
        "adaptive_gain_batch": round(batch_gain, 3), "adaptive_gain_single_stream": round(single_gain, 3),
        "adaptive_gain_kept": round(batch_gain / single_gain, 3), "adaptive_gain_clients": top,
    }
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    header = (f"{'mode':8s} {'clients':>7s} {'tok/s':>8s} {'speedup':>7s} {'p50 lat':>8s} {'p90 lat':>8s} "
              f"{'p99 lat':>8s} {'p50 ttft':>9s} {'steps/tok':>9s} {'batch':>6s}")
    print(header)
    print("-" * len(header))
    for r in runs:
        print(f"{r['mode']:8s} {r['concurrency']:7d} {r['tokens_per_s']:8.1f} {r['speedup_vs_one_at_a_time']:6.2f}x "
              f"{r['latency_p50']:7.2f}s {r['latency_p90']:7.2f}s {r['latency_p99']:7.2f}s {r['ttft_p50']:8.3f}s "
              f"{r['steps_per_token']:9.2f} {r['mean_batch_rows']:6.1f}")
    print(f"\nrd.generate batch 1 ({len(requests[: args.single_requests])} requests): fixed "
          f"{single['fixed']['tokens_per_s']:.1f} tok/s, adaptive {single['adaptive']['tokens_per_s']:.1f} tok/s "
          f"(gain {single_gain:.2f}x); batch at {top} clients gain {batch_gain:.2f}x; "
          f"kept {batch_gain / single_gain:.2f}")
    return 0


def single_stream(model_dir: Path, requests: list[tuple[list[int], int]], modes: dict, threads: int,
                  kv_quant: str | None = None) -> dict:
    """tokens/s of `rd.generate` one request at a time (prefill included, as the server's figure), per mode
    (with the server's kv_quant)."""
    torch.set_num_threads(threads)
    model = rd.RecurrentDepthLM.from_pretrained(model_dir).eval()
    out = {}
    for mode, extra in modes.items():
        extra = dict(extra, kv_quant=kv_quant)
        rd.generate(model, torch.tensor(requests[0][0]), max_new_tokens=2, **extra)  # warm-up
        tokens, start, cpu_start = 0, time.perf_counter(), time.process_time()
        steps = 0
        for i, (prompt, n) in enumerate(requests):
            result = rd.generate(model, torch.tensor(prompt), max_new_tokens=n, seed=i, **extra)
            tokens += int(result.lengths[0])
            steps += int(result.steps[0].sum())
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        out[mode] = dict(tokens_per_s=round(tokens / seconds, 2), cpu_tokens_per_s=round(tokens / cpu, 2),
                         steps_per_token=round(steps / tokens, 2))
    return out


if __name__ == "__main__":
    sys.exit(main())
