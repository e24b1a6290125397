"""GradMem's write on one document: the context's reconstruction loss and the held-out loss of the
text after it, read from the memory alone, against write steps and their FLOPs.

    python benchmarks/gradmem_write.py --model DIR --tokens 8 --steps 0,4,16 --lr 1.0
    python benchmarks/gradmem_write.py --model DIR --file notes.txt --context 256 --continuation 64

The document (default: the source of Python's `json/decoder.py`, a stdlib file every machine has)
is tokenized with the model directory's tokenizer; its first --context tokens are written into the
memory (`inference.gradmem.write_memory`), and the next --continuation tokens are scored:

- write_loss: L_write of the final memory (one extra forward, not part of the cost);
- heldout_loss: mean next-token loss of the continuation given [memory; continuation] (the context
  dropped; `memory_loss`), its first token read at the memory's last position;
- the "full context" row: the continuation's loss given [context; continuation] (what the memory
  stands in for), at the same depth; steps 0 with the "tail" init is the truncated context.

Every pass uses the same seeded s_0 draws (`--seed`). Prints one JSON line, then a table.
It is a measurement: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _args import checked_model_dir, positive_int

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import load_tokenizer
from recurrent_depth.inference.gradmem import memory_loss, write_memory
from recurrent_depth.inference.sampling import RowGenerators


def default_document() -> str:
    import json.decoder

    return Path(json.decoder.__file__).read_text()


def full_context_loss(model: rd.RecurrentDepthLM, context: torch.Tensor, continuation: torch.Tensor, depth: int,
                      init_scale: float, seed: int) -> float:
    """The continuation's mean loss with the context in front of it (the model reads both)."""
    ids = torch.cat([context, continuation])[None]
    labels = torch.cat([torch.full_like(context, -100), continuation])[None]
    generator = RowGenerators(seed, 1, model.device)[0]
    with torch.no_grad():
        e = model.transformer.wte(ids)
        s0 = model.initial_state(e, init_scale, generator)
        return float(model(ids, num_steps=depth, labels=labels, input_states=s0).loss)


def measure(model: rd.RecurrentDepthLM, ids: torch.Tensor, context_len: int, continuation_len: int,
            tokens: list[int], steps: list[int], lr: float, depth: int, init: str, init_scale: float,
            seed: int) -> list[dict]:
    context, continuation = ids[:context_len], ids[context_len : context_len + continuation_len]
    rows = [dict(method="full context", tokens=context_len, steps=0, flops=0.0, seconds=0.0,
                 write_loss=None, heldout_loss=full_context_loss(model, context, continuation, depth, init_scale,
                                                                 seed))]
    for m in tokens:
        for n in steps:
            start = time.perf_counter()
            w = write_memory(model, context, tokens=m, steps=n, lr=lr, depth=depth, init=init,
                             init_scale=init_scale, seed=seed)
            seconds = time.perf_counter() - start
            with torch.no_grad():
                gens = RowGenerators(seed, 1, model.device)
                write = float(memory_loss(model, w.memory, context[None], depth, init_scale=init_scale,
                                          generators=gens)[0])
                gens = RowGenerators(seed, 1, model.device)
                heldout = float(memory_loss(model, w.memory, continuation[None], depth, init_scale=init_scale,
                                            generators=gens)[0])
            rows.append(dict(method="gradmem", tokens=m, steps=n, flops=w.flops, seconds=round(seconds, 3),
                             write_loss=round(write, 4), heldout_loss=round(heldout, 4)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model directory with its tokenizer")
    p.add_argument("--file", help="the document (default: the source of Python's json/decoder.py)")
    p.add_argument("--context", type=int, default=256, help="tokens written into the memory")
    p.add_argument("--continuation", type=int, default=64, help="tokens scored after them")
    p.add_argument("--tokens", default="8", help="memory sizes, comma-separated")
    p.add_argument("--steps", default="0,4,16", help="write steps, comma-separated")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--depth", type=int, help="recurrence depth of every pass (default: mean_recurrence)")
    p.add_argument("--init", default="tail", choices=("tail", "random"))
    p.add_argument("--init-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    args = p.parse_args()
    args.model = checked_model_dir(p, args.model)
    torch.set_num_threads(args.threads)
    model = rd.RecurrentDepthLM.from_pretrained(args.model).eval()
    tok = load_tokenizer(args.model)
    text = Path(args.file).read_text() if args.file else default_document()
    ids = torch.tensor(tok.encode(text).ids)
    if len(ids) < args.context + args.continuation:
        raise SystemExit(f"the document has {len(ids)} tokens, fewer than --context + --continuation")
    depth = model.config.mean_recurrence if args.depth is None else args.depth
    rows = measure(model, ids, args.context, args.continuation, [int(t) for t in args.tokens.split(",")],
                   [int(s) for s in args.steps.split(",")], args.lr, depth, args.init, args.init_scale, args.seed)
    print(json.dumps(dict(model=args.model, context=args.context, continuation=args.continuation, lr=args.lr,
                          depth=depth, init=args.init, rows=rows)))
    print(f"{'method':<13} {'tokens':>6} {'steps':>5} {'GFLOPs':>9} {'seconds':>8} {'write loss':>10} "
          f"{'held-out loss':>13}")
    for r in rows:
        flops = "n/a" if r["flops"] is None else f"{r['flops'] / 1e9:.2f}"
        write = "" if r["write_loss"] is None else f"{r['write_loss']:.4f}"
        print(f"{r['method']:<13} {r['tokens']:>6} {r['steps']:>5} {flops:>9} {r['seconds']:>8} {write:>10} "
              f"{r['heldout_loss']:>13.4f}")


if __name__ == "__main__":
    main()
