"""Cost of QK-clip per training step: recording the per-head max logit in the training forward
plus the clip after the optimizer step, against the same step without it.

    OMP_NUM_THREADS=1 python benchmarks/qk_clip_cost.py --preset small --seq-len 512 --batch 4

One step = forward at a fixed depth (n no-grad + k grad steps), backward, AdamW step (and, with
QK-clip, `QKClip.step`). The two variants alternate, so drift on a shared machine hits both alike;
the medians are reported. Prints one JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _args import positive_int, preset_name

import recurrent_depth as rd
from recurrent_depth.model.mixers import logits
from recurrent_depth.train.qk_clip import QKClip

SPENT = {"record": 0.0}


def timed_head_max_logits(*args, **kwargs):
    start = time.perf_counter()
    out = logits_head_max_logits(*args, **kwargs)
    SPENT["record"] += time.perf_counter() - start
    return out


logits_head_max_logits = logits.head_max_logits
logits.head_max_logits = timed_head_max_logits  # observe_logits looks it up at call time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", type=preset_name)
    parser.add_argument("--seq-len", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--no-grad-steps", type=int, default=4)
    parser.add_argument("--grad-steps", type=positive_int, default=4)
    parser.add_argument("--repeats", type=positive_int, default=4)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset(args.preset, max_seq_len=max(args.seq_len, 8))
    model = rd.RecurrentDepthLM(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1))
    clip = QKClip(model, threshold=1e9)  # records every step; a tau this high never rescales
    steps = (args.no_grad_steps, args.grad_steps)

    def step(with_clip: bool) -> float:
        for _, module in clip.layers:
            module.record_max_logit = with_clip
        start = time.perf_counter()
        out = model(rows[:, :-1], num_steps=steps)
        F.cross_entropy(out.logits.flatten(0, 1), rows[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if with_clip:
            clip_start = time.perf_counter()
            clip.step()
            SPENT["clip"] = time.perf_counter() - clip_start
        return time.perf_counter() - start

    step(False), step(True)  # warm-up
    plain, clipped, shares, record_shares = [], [], [], []
    for _ in range(args.repeats):
        plain.append(step(False))
        SPENT["record"] = 0.0
        clipped.append(step(True))
        # Inside the same step: what the recording and the clip took, as a share of that step (robust to load).
        shares.append((SPENT["record"] + SPENT["clip"]) / clipped[-1])
        record_shares.append(SPENT["record"] / clipped[-1])
    p, c = statistics.median(plain), statistics.median(clipped)
    result = {
        "benchmark": "qk_clip_cost", "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch,
        "num_steps": list(steps), "threads": args.threads, "step_s": p, "step_with_qk_clip_s": c,
        "overhead": c / p - 1, "share_in_step": statistics.median(shares),
        "record_share_in_step": statistics.median(record_shares), "share_all": shares, "plain_all": plain,
        "qk_clip_all": clipped,
    }
    print(json.dumps(result))
    print(f"{'variant':<22}{'median step (s)':>16}")
    print(f"{'plain':<22}{p:>16.3f}")
    print(f"{'with QK-clip':<22}{c:>16.3f}")
    print(f"overhead: {100 * (c / p - 1):+.1f}% of step time (median vs median); recording + clip measured "
          f"inside the step: {100 * result['share_in_step']:.1f}% of it")


if __name__ == "__main__":
    main()
