"""muP checks: the coordinate check and learning-rate transfer across widths, muP vs standard.

The models differ only in width n (hidden_size; head_dim fixed at `head_dim`, so the head count
grows with n and the 1/sqrt(d) attention scale is the same at every width), untied embeddings,
byte-level data, AdamW at a fixed depth. muP = `ModelConfig.mup_base_width = base_width`
(init and per-layer learning rates of Tensor Programs V, see `train.optim.mup_lr_multiplier`);
standard = the same model without it (identical at the base width).

* coordinate check: the RMS of each layer's output (every mixer and MLP output before the residual
  add, the adapter's output, the logits) in the training forward after t = 0..steps updates, per
  width. Under muP it should not depend on the width: `max/min across widths` near 1.
* LR transfer: the final training loss (mean of the last 10 steps) for each (width, lr); the best
  lr per width, and whether it is the same at every width.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import recurrent_depth as rd
from recurrent_depth.experiments.common import BYTE_VOCAB, ByteWindows, byte_tokens, train_fixed_depth
from recurrent_depth.train.optim import OptimConfig

PARAMETRIZATIONS = ("standard", "mup")


@dataclass
class MupConfig:
    widths: tuple[int, ...] = (64, 128, 256)
    base_width: int = 64
    head_dim: int = 16
    lr: float = 3e-3  # coordinate check
    lrs: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # LR transfer
    steps: int = 5  # coordinate check
    transfer_steps: int = 100
    recurrence: int = 2
    batch_size: int = 8
    seq_len: int = 64
    seeds: int = 2
    corpus: str = "stdlib"
    out: str = "runs/mup"

    def __post_init__(self) -> None:
        if len(self.widths) < 2 or any(w % self.head_dim for w in self.widths):
            raise ValueError(f"widths {self.widths} must be >= 2 multiples of head_dim={self.head_dim}")
        if len(self.lrs) > 5 or not self.lrs:
            raise ValueError(f"lrs {self.lrs}: give 1 to 5 learning rates")


def make_model(cfg: MupConfig, width: int, parametrization: str, seed: int) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(rd.ModelConfig(
        vocab_size=BYTE_VOCAB, hidden_size=width, num_heads=width // cfg.head_dim, head_dim=cfg.head_dim,
        intermediate_size=int(width * 2.75), prelude_layers=1, core_layers=1, coda_layers=1,
        mean_recurrence=cfg.recurrence, mean_backprop_depth=cfg.recurrence, max_seq_len=cfg.seq_len,
        tie_embeddings=False, mup_base_width=cfg.base_width if parametrization == "mup" else None,
        init_scale=0.0,  # s_0 = 0: the activations depend on the width and the weights alone
    ))


def recorded_modules(model: rd.RecurrentDepthLM) -> dict[str, torch.nn.Module]:
    t = model.transformer
    named: dict[str, torch.nn.Module] = {"adapter": t.adapter, "logits": model.lm_head}
    for part, blocks in (("prelude", t.prelude), ("core", t.core_block), ("coda", t.coda)):
        for i, block in enumerate(blocks):
            named[f"{part}.{i}.mixer"] = block.attn
            named[f"{part}.{i}.mlp"] = block.mlp
    return named


def coordinate_trace(cfg: MupConfig, tokens: torch.Tensor, width: int, parametrization: str, seed: int) -> dict:
    """{layer: [RMS after 0..steps updates]} (a core layer: the mean over its r calls in a forward)."""
    model = make_model(cfg, width, parametrization, seed)
    sums: dict[str, list[float]] = {}
    hooks = []
    for name, module in recorded_modules(model).items():
        def hook(_module, _inputs, output, name=name):
            sums.setdefault(name, []).append(float(output.detach().float().pow(2).mean().sqrt()))
        hooks.append(module.register_forward_hook(hook))
    trace: dict[str, list[float]] = {}

    def collect(*_: Any) -> None:
        for name, values in sums.items():
            trace.setdefault(name, []).append(sum(values) / len(values))
        sums.clear()

    data = ByteWindows(tokens, cfg.seq_len, seed)
    train_fixed_depth(model, OptimConfig(name="adamw", lr=cfg.lr, grad_clip=None), data, cfg.steps, cfg.recurrence,
                      cfg.batch_size, on_step=collect)
    with torch.no_grad():  # the forward after the last update
        model(data.next_batch(cfg.batch_size)["input_ids"], num_steps=cfg.recurrence)
    collect()
    for h in hooks:
        h.remove()
    return trace


def coordinate_check(cfg: MupConfig, tokens: torch.Tensor | None = None) -> dict[str, Any]:
    tokens = byte_tokens(cfg.corpus, 500_000) if tokens is None else tokens
    result: dict[str, Any] = {}
    for parametrization in PARAMETRIZATIONS:
        per_width = {}
        for width in cfg.widths:
            traces = [coordinate_trace(cfg, tokens, width, parametrization, seed) for seed in range(cfg.seeds)]
            per_width[str(width)] = {layer: [sum(t[layer][s] for t in traces) / len(traces)
                                             for s in range(cfg.steps + 1)] for layer in traces[0]}
        layers = list(per_width[str(cfg.widths[0])])
        ratio = {layer: max(per_width[str(w)][layer][-1] for w in cfg.widths)
                 / min(per_width[str(w)][layer][-1] for w in cfg.widths) for layer in layers}
        result[parametrization] = {"rms": per_width, "ratio_after_last_step": ratio,
                                   "max_ratio": max(ratio.values())}
    return result


def lr_transfer(cfg: MupConfig, tokens: torch.Tensor | None = None, log=print) -> dict[str, Any]:
    tokens = byte_tokens(cfg.corpus, 1_000_000) if tokens is None else tokens
    result: dict[str, Any] = {}
    for parametrization in PARAMETRIZATIONS:
        table: dict[str, dict[str, float]] = {}
        for width in cfg.widths:
            table[str(width)] = {}
            for lr in cfg.lrs:
                run = train_fixed_depth(
                    make_model(cfg, width, parametrization, seed=0), OptimConfig(name="adamw", lr=lr, grad_clip=None),
                    ByteWindows(tokens, cfg.seq_len, 0), cfg.transfer_steps, cfg.recurrence, cfg.batch_size)
                tail = run.losses[-10:]
                table[str(width)][f"{lr:g}"] = sum(tail) / len(tail)
                log(f"{parametrization:<9} width {width:<4} lr {lr:<7g} loss {table[str(width)][f'{lr:g}']:.3f}")
        best = {w: min(row, key=lambda k, row=row: row[k]) for w, row in table.items()}
        result[parametrization] = {"final_loss": table, "best_lr": best, "transfers": len(set(best.values())) == 1}
    return result


def plot(coords: dict[str, Any], transfer: dict[str, Any] | None, cfg: MupConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + (2 if transfer else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    for ax, parametrization in zip(axes[:2], PARAMETRIZATIONS, strict=True):
        rms = coords[parametrization]["rms"]
        for layer in rms[str(cfg.widths[0])]:
            ax.plot(cfg.widths, [rms[str(w)][layer][-1] for w in cfg.widths], marker="o", label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width")
        ax.set_ylabel(f"activation RMS after {cfg.steps} updates")
        ax.set_title(f"{parametrization}: max/min across widths {coords[parametrization]['max_ratio']:.2f}",
                     fontsize=9)
        ax.legend(fontsize=6)
    if transfer:
        for ax, parametrization in zip(axes[2:], PARAMETRIZATIONS, strict=True):
            for width, row in transfer[parametrization]["final_loss"].items():
                ax.plot([float(k) for k in row], list(row.values()), marker="o", label=f"width {width}")
            ax.set_xscale("log")
            ax.set_xlabel("AdamW learning rate")
            ax.set_ylabel(f"training loss (mean of last 10 of {cfg.transfer_steps} steps)")
            ax.set_title(f"{parametrization}: best lr {transfer[parametrization]['best_lr']}", fontsize=8)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_mup(cfg: MupConfig, transfer: bool, log=print) -> dict[str, Any]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tokens = byte_tokens(cfg.corpus, 1_000_000)
    coords = coordinate_check(cfg, tokens)
    for parametrization in PARAMETRIZATIONS:
        log(f"coordinate check, {parametrization}: max/min activation RMS across widths after {cfg.steps} steps "
            f"= {coords[parametrization]['max_ratio']:.3f}")
    lrs = lr_transfer(cfg, tokens, log) if transfer else None
    result = {"config": asdict(cfg), "coordinate_check": coords, "lr_transfer": lrs,
              "seconds": time.perf_counter() - start, "torch_threads": torch.get_num_threads()}
    name = "mup_lr_transfer" if transfer else "mup_coord_check"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(coords, lrs, cfg, out / f"{name}.png")
    return result


def format_transfer(transfer: dict[str, Any]) -> str:
    lines = []
    for parametrization, r in transfer.items():
        lrs = list(next(iter(r["final_loss"].values())))
        lines.append(f"{parametrization}: final training loss by width (rows) and lr (columns)")
        lines.append(f"{'width':>7}" + "".join(f"{lr:>9}" for lr in lrs) + f"{'best':>9}")
        for width, row in r["final_loss"].items():
            lines.append(f"{width:>7}" + "".join(f"{row[lr]:>9.3f}" for lr in lrs) + f"{r['best_lr'][width]:>9}")
        lines.append(f"  best lr transfers across widths: {'yes' if r['transfers'] else 'no'}")
    return "\n".join(lines)
