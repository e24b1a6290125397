"""Generation benchmark: speed, compute and agreement of every decoding mode, side by side.

    python benchmarks/generation.py                       # random model of the issue's shape
    python benchmarks/generation.py --model runs/quickstart/model --num-steps 32

Per mode (batch 1 unless noted): decode tokens/s (best of --repeats, prefill excluded; also per
second of this process's CPU time, which other jobs on a shared machine disturb less), mean
recurrence steps per generated token, logical KV-cache MB (and the core's share of it), and
agreement with fixed-depth greedy decoding at r = --num-steps over --agreement-tokens-long
continuations of held-out prompts: teacher-forced per-token agreement (the mode's choice at each
position when fed the fixed-depth continuation) and the free-running matching prefix.
Without --model, the model is random (h 256, 4 heads, 1/2/1 layers, MLP 704, vocab 2048) and the
prompts random ids; with --model, prompts are windows of held-out stdlib documents (the
validation side of the quickstart's document split) unless --prompts-file is given.
Baselines in the same rounds: the official implementation's loop shape (frozen in this file: plain
PyTorch over the model's parameters, token by token on a plain growing per-(layer, step) cache),
fixed and KL exit, our loop on the model's own modules (fast=False), fixed and KL, and the fused
runner's Python path at fixed depth (the C++ decode of accel/decode_cpp.py off; `cpp_decode` in the
JSON says whether the modes ran with it).
Also the fixed-depth decode's roofline: the bytes a token reads (the core's weights r times, the rest once,
the KV entries at the mean context) over the read bandwidth of a buffer the size of the core's weights at the
run's thread count (the cache level a step streams them from; `fixed_depth_roofline` in the JSON).
Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _args import checked_model_dir, positive_int

import recurrent_depth as rd
from recurrent_depth.accel import decode_cpp, quant_cpp
from recurrent_depth.inference import generate, stream_generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory (default: a random model of the issue's shape); its prompts are held-out text "
                        "through its tokenizer.json, or random ids where it has none")
    p.add_argument("--num-steps", type=positive_int, default=None,
                   help="recurrence depth r (default: 16 for the random model, else the config's mean_recurrence)")
    p.add_argument("--prompt-len", type=positive_int, default=64,
                   help="prompt tokens for the speed runs (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive_int, default=64,
                   help="new tokens per speed run (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="speed runs per mode, best kept (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=8, help="rows of the batched mode (default: %(default)s)")
    p.add_argument("--draft-steps", type=positive_int, default=None, help="speculative draft depth (default: r // 4)")
    p.add_argument("--lookahead", type=positive_int, default=8,
                   help="speculative drafts per round (default: %(default)s)")
    p.add_argument("--inner-steps", type=positive_int, default=4,
                   help="parallel sampler steps per sweep (default: %(default)s)")
    p.add_argument("--wavefront", type=positive_int, default=4,
                   help="parallel sampler positions refining at once (default: %(default)s)")
    p.add_argument("--agreement-prompts", type=positive_int, default=4,
                   help="held-out prompts for agreement (default: %(default)s)")
    p.add_argument("--agreement-tokens", type=positive_int, default=128,
                   help="continuation length for agreement (default: %(default)s)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line (needs --model with a tokenizer)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (default: %(default)s; one row's fixed-depth decode runs on a team of "
                        "them, streaming the core's weights once a step)")
    p.add_argument("--seed", type=int, default=0, help="seed for the random model and prompts (default: %(default)s)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the official-style loop and model-module baselines (default: run them)")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = p.parse_args(argv)
    args.model = checked_model_dir(p, args.model)
    if args.prompts_file is not None and args.model is None:
        p.error("--prompts-file needs --model (its tokenizer encodes the prompts; the random model has none)")
    if args.prompts_file is not None and not Path(args.prompts_file).is_file():
        p.error(f"--prompts-file {args.prompts_file}: no such file")
    if args.prompts_file is not None and not has_tokenizer(args.model):
        p.error(f"--prompts-file needs a tokenizer.json in --model {args.model} (it encodes the prompts)")
    return args


def has_tokenizer(model_dir: str) -> bool:
    """Whether a model directory holds its tokenizer (else its prompts are random ids, as the random model's)."""
    return (Path(model_dir) / "tokenizer.json").is_file()


def random_model(seed: int) -> rd.RecurrentDepthLM:
    cfg = rd.ModelConfig(vocab_size=2048, hidden_size=256, num_heads=4, intermediate_size=704, prelude_layers=1,
                         core_layers=2, coda_layers=1, mean_recurrence=16, max_seq_len=1024)
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(cfg).eval()


def heldout_prompts(model_dir: Path, count: int, length: int, prompts_file: str | None) -> list[list[int]]:
    """Token windows of held-out text: lines of --prompts-file, or validation documents of stdlib."""
    from recurrent_depth.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if prompts_file:
        texts = [line for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    else:
        from recurrent_depth.data.corpus import DocumentSplit, load_corpus

        corpus = load_corpus("stdlib")
        split = DocumentSplit.plan((d.id for d in corpus), val_fraction=0.02, seed=0)
        texts = [d.text for d in split.select(corpus, "validation")]
    prompts = []
    for text in texts:
        ids = tok.encode(text).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    if not prompts:
        raise SystemExit("no held-out text long enough for the requested prompt length")
    return prompts


def modes(r: int, draft: int, lookahead: int, inner: int, wavefront: int) -> dict[str, dict]:
    return {
        "fixed": {},
        "kl exit": dict(exit_criterion="kl"),
        "kv budget 4": dict(kv_budget=4),
        "warm start + kl": dict(warm_start=True, exit_criterion="kl"),
        "speculative exact": dict(draft_steps=draft, lookahead=lookahead),
        "parallel": dict(sampler="parallel", inner_steps=inner, wavefront=wavefront, exit_criterion="latent-diff"),
    }


# ------------------------------------------------------------------------------ frozen baselines
# The official implementation's decoding shape, written here in plain PyTorch over the model's
# parameters and frozen: it must not change when the library's runtime does. Per call: prelude,
# r steps of adapter + core (each layer at each step its own growing KV tensor), coda, head.
def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Interleaved-pair RoPE on x [B, T, H, D] at positions [T], angles in float32 (as the reference)."""
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None]  # [1, T, 1, D/2]
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def _official_block(block: Any, x: torch.Tensor, kv: dict, key: tuple, positions: torch.Tensor,
                    base: float) -> torch.Tensor:
    attn = block.attn
    B, T, _ = x.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.Wqkv(block.norm_1(x)).split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    if attn.has_qk_bias:
        q, k = (q + attn.qk_bias[0], k + attn.qk_bias[1]) if Hkv == H else (q + attn.q_bias, k + attn.k_bias)
    q, k = _rope(q, positions, base), _rope(k, positions, base)
    if key in kv:  # the plain growing cache: tokens that skipped this step are simply absent
        k, v = torch.cat([kv[key][0], k], 1), torch.cat([kv[key][1], v], 1)
    kv[key] = (k, v)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=T > 1, enable_gqa=Hkv != H)
    x = block.norm_2(x + attn.proj(out.transpose(1, 2).reshape(B, T, H * D)))
    return block.norm_4(x + block.mlp(block.norm_3(x)))


class _OfficialStyle:
    """embed / iterate_one_step / predict_from_latents, as the reference's entry points (s0 = 0)."""

    def __init__(self, model: rd.RecurrentDepthLM) -> None:
        self.model, self.t, self.base = model, model.transformer, model.config.rope_base
        self.kv: dict = {}
        self.seen = 0

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.seen, self.seen + ids.shape[1])
        self.seen += ids.shape[1]
        x = self.t.wte(ids) * self.model.emb_scale
        for i, b in enumerate(self.t.prelude):
            x = _official_block(b, x, self.kv, ("prelude", i), positions, self.base)
        return x, positions

    def iterate_one_step(self, s: torch.Tensor, e: torch.Tensor, step: int, positions: torch.Tensor) -> torch.Tensor:
        x = self.t.adapter(torch.cat([s, e], dim=-1))
        for j, b in enumerate(self.t.core_block):
            x = _official_block(b, x, self.kv, ("core", j, step), positions, self.base)
        return x

    def predict_from_latents(self, s: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.t.ln_f(s)
        for c, b in enumerate(self.t.coda):
            x = _official_block(b, x, self.kv, ("coda", c), positions, self.base)
        return self.model.lm_head(self.t.ln_f(x)).float()[:, -1]


def official_style_loop(model: rd.RecurrentDepthLM, ids: torch.Tensor, r: int, new_tokens: int,
                        kl_threshold: float | None = None) -> Any:
    """Greedy decoding in the official loop shape (frozen above), batch 1: fixed depth r, or with
    `kl_threshold` the reference's adaptive loop (coda and KL(p_{t-1} || p_t) via `F.kl_div` after
    every step, exit below the threshold; an exited token leaves no entries at deeper steps).
    Returns `tokens_per_second` (prefill excluded), its CPU-time version and `mean_steps`."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    V = model.config.vocab_size
    with torch.inference_mode():
        run = _OfficialStyle(model)
        e, pos = run.embed(ids)
        s = torch.zeros_like(e)
        for i in range(r):
            s = run.iterate_one_step(s, e, i, pos)
        token = run.predict_from_latents(s, pos).argmax(-1, keepdim=True)
        steps = 0
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(new_tokens - 1):
            e, pos = run.embed(token)
            s = torch.zeros_like(e)
            prev = torch.full((1, V), -math.log(V))
            for i in range(r):
                s = run.iterate_one_step(s, e, i, pos)
                steps += 1
                if kl_threshold is not None:
                    logp = F.log_softmax(run.predict_from_latents(s, pos), dim=-1)
                    kl = F.kl_div(logp, prev, reduction="none", log_target=True).sum(-1)
                    prev = logp
                    if float(kl) < kl_threshold:
                        break
            token = run.predict_from_latents(s, pos).argmax(-1, keepdim=True)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = new_tokens - 1
    return SimpleNamespace(tokens_per_second=n / seconds, cpu_tokens_per_second=n / cpu, mean_steps=steps / n)


def timed_generate(model: rd.RecurrentDepthLM, ids: torch.Tensor, **kwargs: Any) -> Any:
    """`generate`, plus `cpu_tokens_per_second`: tokens after each row's first per second of this
    process's CPU time from the first token to the end (less sensitive than wall time to other jobs
    taking the CPU away, though not to their contention for caches and memory)."""
    stream = stream_generate(model, ids, **kwargs)
    first = None
    for _ in stream:
        if first is None:
            first = time.process_time()
    cpu = time.process_time() - first if first is not None else 0.0
    out = stream.output
    total = int(out.lengths.sum()) - int((out.lengths > 0).sum())
    out.cpu_tokens_per_second = total / cpu if cpu > 0 else 0.0
    return out


def without_cpp(run: Callable[[], Any]) -> Callable[[], Any]:
    """`run` with the C++ kernels off (`RDEPTH_NO_CPP=1`, read at each generate call), then as before."""
    def wrapped() -> Any:
        before = os.environ.get(quant_cpp.NO_CPP_ENV)
        os.environ[quant_cpp.NO_CPP_ENV] = "1"
        try:
            return run()
        finally:
            if before is None:
                del os.environ[quant_cpp.NO_CPP_ENV]
            else:
                os.environ[quant_cpp.NO_CPP_ENV] = before
    return wrapped


def best_of(repeats: int, runs: dict[str, Callable[[], Any]]) -> dict[str, tuple[float, Any, float]]:
    """Best wall-clock tokens/s of each run (with its output) and best CPU-time tokens/s; the runs
    take turns, so a change in machine load hits all alike."""
    best: dict[str, tuple[float, Any, float]] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            result = fn()
            tps, cpu = result.tokens_per_second, result.cpu_tokens_per_second
            if name not in best:
                best[name] = (tps, result, cpu)
            elif tps > best[name][0]:
                best[name] = (tps, result, max(cpu, best[name][2]))
            else:
                best[name] = (*best[name][:2], max(cpu, best[name][2]))
    return best


def fixed_depth_bytes(model: rd.RecurrentDepthLM, r: int, context: float) -> dict[str, float]:
    """Bytes one decoded token reads at fixed depth r: the core's weights (its blocks and the adapter's state
    half) r times, the prelude, coda, adapter input half and head once, and every attention layer's keys and
    values over `context` columns (per core step, and once for prelude and coda)."""
    cfg, t = model.config, model.transformer

    def size(modules: Any) -> int:
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    element = next(model.parameters()).element_size()
    adapter = size([t.adapter]) if t.adapter is not None else 0  # ([h, 2h]: half of it a step, half once)
    step = size(t.core_block) + adapter // 2
    once = size([*t.prelude, *t.coda, model.lm_head]) + adapter - adapter // 2
    kv_per_layer = 2 * cfg.num_kv_heads * cfg.head_dim * element * context
    kv = kv_per_layer * (r * len(t.core_block) + len(t.prelude) + len(t.coda))
    return dict(core_step_bytes=step, token_bytes=r * step + once + kv)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """Best streaming read bandwidth, GB/s, of `torch.sum` over a float32 buffer of `nbytes`, at this process's
    thread count: a buffer far larger than the caches reads memory (benchmarks/decode_roofline.py); one the size
    of a small model's core reads the cache level its fixed-depth steps stream from (read ~2e8 bytes a round)."""
    buf = torch.ones(max(nbytes // 4, 1024))
    rounds = max(1, int(2e8 // buf.numel()))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            float(buf.sum())
        best = max(best, rounds * buf.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


TABLE_COLUMNS = ("tokens_per_s", "cpu_tokens_per_s", "speedup_vs_fixed", "cpu_speedup_vs_fixed", "mean_steps",
                 "cache_mb", "core_cache_mb", "agreement_teacher_forced", "free_running_prefix")


def mode_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The JSON's modes as table lines, '-' where a mode has no value; each column as wide as its longest entry,
    plus a space ("agreement_teacher_forced" ran into its neighbour at a fixed width of 22)."""
    rows = {name: ["-" if v is None else str(v) for v in
                   (row.get(c.replace("_vs_fixed", "_vs_single") if name.startswith("batch") else c)
                    for c in TABLE_COLUMNS)] for name, row in results.items()}
    widths = [max([len(c), *(len(cells[i]) for cells in rows.values())]) for i, c in enumerate(TABLE_COLUMNS)]
    name_width = max([20, *(len(name) for name in rows)])
    lines = [f"{'mode':<{name_width}}" + "".join(f" {c:>{w}}" for c, w in zip(TABLE_COLUMNS, widths))]
    for name, cells in rows.items():
        lines.append(f"{name:<{name_width}}" + "".join(f" {v:>{w}}" for v, w in zip(cells, widths)))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats = 16, 8, 1
        args.agreement_prompts, args.agreement_tokens, args.batch = 2, 8, 2
    torch.set_num_threads(args.threads)
    if args.model:
        model = rd.RecurrentDepthLM.from_pretrained(args.model, dtype=torch.float32).eval()
        r = args.num_steps or model.config.mean_recurrence
    else:
        model = random_model(args.seed)
        r = args.num_steps or 16
    n = max(args.agreement_prompts, args.batch)
    if args.model and has_tokenizer(args.model):
        prompts = heldout_prompts(Path(args.model), n, args.prompt_len, args.prompts_file)
    else:  # (the random model, or a model directory without a tokenizer: random ids, the speed is the same)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, model.config.vocab_size, (n, args.prompt_len), generator=g).tolist()
    draft = args.draft_steps if args.draft_steps is not None else max(1, r // 4)
    inner = args.inner_steps
    table = modes(r, draft, args.lookahead, inner, args.wavefront)
    common = dict(num_steps=r, init_scale=0.0)  # zero s_0: deterministic, comparable across modes

    single = torch.tensor([prompts[0]])
    generate(model, single, max_new_tokens=4, **common)  # warm-up
    batch_ids = torch.tensor(prompts[: args.batch])
    runs = {name: (lambda kw=kw: timed_generate(model, single, max_new_tokens=args.new_tokens, **common, **kw))
            for name, kw in table.items()}
    runs["batch"] = lambda: timed_generate(model, batch_ids, max_new_tokens=args.new_tokens, **common)
    # Baselines measured in the same rounds: the official implementation's loop shape, and our loop
    # on the model's own modules (fast=False), for fixed depth and KL exit.
    baselines = {
        "official-style loop": lambda: official_style_loop(model, single, r, args.new_tokens),
        "official-style kl loop": lambda: official_style_loop(model, single, r, args.new_tokens, kl_threshold=5e-4),
        "model modules, fixed": lambda: timed_generate(model, single, max_new_tokens=args.new_tokens, fast=False,
                                                       **common),
        "model modules, kl": lambda: timed_generate(model, single, max_new_tokens=args.new_tokens, fast=False,
                                              exit_criterion="kl", **common),
        # The fused runner's Python path (the C++ decode off): what `fixed` gains from one call per piece.
        "fused, no C++, fixed": without_cpp(lambda: timed_generate(model, single, max_new_tokens=args.new_tokens,
                                                                    **common)),
    }
    if not args.no_baselines:
        runs.update(baselines)
    timed = best_of(args.repeats, runs)
    results = {}
    for name in table:
        tps, out, cpu = timed[name]
        results[name] = dict(
            tokens_per_s=round(tps, 2), cpu_tokens_per_s=round(cpu, 2),
            mean_steps=round(float(out.steps[:, 1:].float().mean()), 3),
            cache_mb=round(float(out.cache_bytes[0, -1]) / 2**20, 3),
            core_cache_mb=round(float(out.core_cache_bytes[0]) / 2**20, 3),
            **{k: v for k, v in out.stats.items() if k in ("acceptance_rate", "tokens_per_sweep", "mean_wavefront")},
        )
    tps, out, cpu = timed["batch"]
    results[f"batch of {args.batch}"] = dict(
        tokens_per_s=round(tps, 2), cpu_tokens_per_s=round(cpu, 2),
        mean_steps=round(float(out.steps[:, 1:].float().mean()), 3),
        cache_mb=round(float(out.cache_bytes[:, -1].sum()) / 2**20, 3),
        core_cache_mb=round(float(out.core_cache_bytes.sum()) / 2**20, 3),
        speedup_vs_single=round(tps / results["fixed"]["tokens_per_s"], 2),
        cpu_speedup_vs_single=round(cpu / results["fixed"]["cpu_tokens_per_s"], 2),
    )

    # Agreement with fixed depth r: all prompts in one batch (rows are independent by construction).
    agree_ids = torch.tensor(prompts[: args.agreement_prompts])
    n_new = args.agreement_tokens
    reference = generate(model, agree_ids, max_new_tokens=n_new, **common).token_lists()
    teacher = torch.tensor(reference)
    for name, kw in [*table.items(), (f"batch of {args.batch}", {})]:
        free = generate(model, agree_ids, max_new_tokens=n_new, **common, **kw).token_lists()
        prefix = sum(prefix_length(a, b) for a, b in zip(free, reference)) / len(reference)
        forced = None
        if "draft_steps" not in kw:  # speculative exact mode equals greedy by construction
            tf = generate(model, agree_ids, max_new_tokens=n_new, teacher_tokens=teacher, **common, **kw)
            forced = round(float((tf.predictions == teacher).float().mean()), 4)
        results[name].update(agreement_teacher_forced=forced, free_running_prefix=round(prefix, 1))

    baseline_rows = {}
    for name in baselines:
        if name in timed:
            baseline_rows[name] = dict(tokens_per_s=round(timed[name][0], 2), cpu_tokens_per_s=round(timed[name][2], 2))
            if hasattr(timed[name][1], "mean_steps"):
                baseline_rows[name]["mean_steps"] = round(timed[name][1].mean_steps, 3)
    fixed = results["fixed"]["tokens_per_s"]
    for name, row in results.items():
        if not name.startswith("batch"):
            row["speedup_vs_fixed"] = round(row["tokens_per_s"] / fixed, 2)
            row["cpu_speedup_vs_fixed"] = round(row["cpu_tokens_per_s"] / results["fixed"]["cpu_tokens_per_s"], 2)
    # The fixed-depth decode's roofline: its bytes a token over the read bandwidth of a buffer the size of the
    # core's weights (measured after the runs, at this thread count): at batch 1 each core step streams them once.
    traffic = fixed_depth_bytes(model, r, args.prompt_len + args.new_tokens / 2)
    bandwidth = read_bandwidth(traffic["core_step_bytes"], repeats=20)
    roof = bandwidth * 1e9 / traffic["token_bytes"]
    roofline = dict(core_step_mb=round(traffic["core_step_bytes"] / 2**20, 3),
                    token_mb=round(traffic["token_bytes"] / 2**20, 2), read_gb_s=round(bandwidth, 1),
                    tokens_per_s=round(roof, 1), fixed_fraction=round(results["fixed"]["tokens_per_s"] / roof, 3))
    record = dict(
        benchmark="generation", model=args.model or "random(h256,4h,1/2/1,mlp704,V2048)", num_steps=r,
        draft_steps=draft, inner_steps=inner, wavefront=args.wavefront, prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        agreement_prompts=len(reference), agreement_tokens=n_new, threads=args.threads,
        torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
        load_average=[round(x, 2) for x in os.getloadavg()], cpus=os.cpu_count(),
        cpp_decode=decode_cpp.load_decoder() is not None, cpp_decode_failure=decode_cpp.build_failure(), modes=results,
        baselines_tokens_per_s=baseline_rows, fixed_depth_roofline=roofline,
    )
    print(json.dumps(record))
    print("\n" + "\n".join(mode_table(results)))
    if baseline_rows:
        print("\nbaselines, same rounds: tokens/s (CPU-time tokens/s); ours vs each, wall (CPU):")
        for name, base in baseline_rows.items():
            ratio = ", ".join(
                f"{mode} {results[mode]['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                f"({results[mode]['cpu_tokens_per_s'] / base['cpu_tokens_per_s']:.2f}x)"
                for mode in ("fixed", "kl exit")
            )
            print(f"  {name:<22}{base['tokens_per_s']:>8} ({base['cpu_tokens_per_s']})   {ratio}")
    official = baseline_rows.get("official-style loop")
    at_roof = f"; at it, {roof / official['tokens_per_s']:.2f}x the official-style loop" if official else ""
    print(f"\nfixed-depth roofline: {roofline['token_mb']} MB a token (the core's {roofline['core_step_mb']} MB "
          f"x {r}) at {roofline['read_gb_s']} GB/s (a {roofline['core_step_mb']} MB buffer's read, {args.threads} "
          f"thread(s)) = {roofline['tokens_per_s']} tokens/s; fixed reaches {roofline['fixed_fraction']} of it"
          f"{at_roof}")
    print(f"\nr = {r}, draft {draft}, inner {inner}, wavefront {args.wavefront}, batch rows {args.batch}; "
          f"free-running prefix in tokens of {n_new}; batch 'speedup' is vs one row at a time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
