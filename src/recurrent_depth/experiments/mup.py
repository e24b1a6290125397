"""muP checks: the coordinate check and learning-rate transfer across widths, muP vs standard.

The models differ only in width n (hidden_size), untied embeddings, byte-level data, AdamW at a fixed
depth. `widen` says how attention grows with n:
* "heads" (the default): head_dim fixed at `head_dim`, the head count grows with n, so 1/sqrt(d) and
  muP's 1/d differ by a constant only;
* "head_dim": the head count fixed at base_width / head_dim and head_dim = n / heads grows with n (what
  `--model-set hidden_size=...` on a preset does). There Tensor Programs V's 1/d and 1/sqrt(d) differ.
Parametrizations (`parametrizations`): "standard" (no muP), "mup" (`ModelConfig.mup_base_width =
base_width`: init and per-layer learning rates of Tensor Programs V, see `train.optim.mup_lr_multiplier`,
and its attention scale 1/d, written sqrt(d_0)/d) and "mup-sqrt-d" (muP with `attn_scale: "1/sqrt(d)"`,
the pre-fix behaviour; not muP when head_dim grows). All are the same model at the base width.

* coordinate check: the RMS of each layer's output (every mixer and MLP output before the residual
  add, the adapter's output, the logits) and of each attention layer's pre-softmax logits (`.qk`) in
  the training forward after t = 0..steps updates, per width. Under muP it should not depend on the
  width: `max/min across widths` near 1.
* LR transfer: the final training loss (mean of the last 10 steps) for each (width, lr); the best
  lr per width, and whether it is the same at every width.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import recurrent_depth as rd
from recurrent_depth.config import MupShapeWarning
from recurrent_depth.experiments.common import BYTE_VOCAB, ByteWindows, byte_tokens, train_fixed_depth
from recurrent_depth.files import check_out_dir, finite_or_null
from recurrent_depth.train.optim import OptimConfig

PARAMETRIZATIONS = ("standard", "mup", "mup-sqrt-d")
WIDENINGS = ("heads", "head_dim")


@dataclass
class MupConfig:
    widths: tuple[int, ...] = (64, 128, 256)
    base_width: int = 64
    head_dim: int = 16  # at every width ("heads"), or at the base width ("head_dim")
    widen: str = "heads"  # what grows with the width: "heads" or "head_dim" (see the module docstring)
    parametrizations: tuple[str, ...] = ("standard", "mup")
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
        # first: the checks below divide by head_dim and base_width, and the runs average over seeds and the
        # last transfer steps (a 0 there was a ZeroDivisionError or IndexError deep in the run)
        # (recurrence 0 failed as "TrainConfig.backprop_depth=0", naming no flag of this experiment)
        for name, low in (("base_width", 1), ("head_dim", 1), ("seeds", 1), ("steps", 0), ("transfer_steps", 1),
                          ("recurrence", 1), ("batch_size", 1), ("seq_len", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {low}")
        if len(set(self.widths)) != len(self.widths) or min(self.widths, default=0) < 1:
            raise ValueError(f"widths {self.widths} must be distinct integers >= 1")
        if self.widen not in WIDENINGS:
            raise ValueError(f"widen={self.widen!r}: expected one of {WIDENINGS}")
        unknown = sorted(set(self.parametrizations) - set(PARAMETRIZATIONS))
        # (one twice: its runs ran twice, the results keeping one)
        if unknown or not self.parametrizations or len(set(self.parametrizations)) != len(self.parametrizations):
            raise ValueError(f"parametrizations {self.parametrizations}: expected some of {PARAMETRIZATIONS}, "
                             f"each once")
        if self.widen == "heads" and (len(self.widths) < 2 or any(w % self.head_dim for w in self.widths)):
            raise ValueError(f"widths {self.widths} must be >= 2 multiples of head_dim={self.head_dim}")
        heads = self.base_width // self.head_dim
        if self.widen == "head_dim" and (len(self.widths) < 2 or self.base_width % self.head_dim
                                         or any(w % (2 * heads) for w in self.widths)):
            raise ValueError(f"widen=head_dim: base_width={self.base_width} must be a multiple of head_dim="
                             f"{self.head_dim} and widths {self.widths} >= 2 multiples of 2 x {heads} heads")
        if len(self.lrs) > 5 or not self.lrs:
            raise ValueError(f"lrs {self.lrs}: give 1 to 5 learning rates")
        # the results key each lr by its `:g` label: two lrs with one label would overwrite each other
        if len({f"{lr:g}" for lr in self.lrs}) != len(self.lrs):
            raise ValueError(f"lrs {self.lrs}: give distinct learning rates")
        # (else a NaN or negative lr fails only when its run starts, after the coordinate check)
        for name, values in (("lr", (self.lr,)), ("lrs", self.lrs)):
            if not all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected finite learning rates > 0")


def width_model_config(cfg: MupConfig, width: int, parametrization: str) -> rd.ModelConfig:
    heads = width // cfg.head_dim if cfg.widen == "heads" else cfg.base_width // cfg.head_dim
    mup = parametrization != "standard"
    with warnings.catch_warnings():  # "mup-sqrt-d" with a growing head_dim is the non-muP case, on purpose
        warnings.simplefilter("ignore", MupShapeWarning)
        return rd.ModelConfig(
            vocab_size=BYTE_VOCAB, hidden_size=width, num_heads=heads, head_dim=width // heads,
            intermediate_size=int(width * 2.75), prelude_layers=1, core_layers=1, coda_layers=1,
            mean_recurrence=cfg.recurrence, mean_backprop_depth=cfg.recurrence, max_seq_len=cfg.seq_len,
            tie_embeddings=False, mup_base_width=cfg.base_width if mup else None,
            mup_base_head_dim=cfg.head_dim if mup else None,
            attn_scale="1/sqrt(d)" if parametrization == "mup-sqrt-d" else None,
            init_scale=0.0,  # s_0 = 0: the activations depend on the width and the weights alone
        )


def make_model(cfg: MupConfig, width: int, parametrization: str, seed: int) -> rd.RecurrentDepthLM:
    torch.manual_seed(seed)
    return rd.RecurrentDepthLM(width_model_config(cfg, width, parametrization))


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
        def hook(module, inputs, output, name=name):
            sums.setdefault(name, []).append(float(output.detach().float().pow(2).mean().sqrt()))
            if name.endswith(".mixer"):  # inputs: (x, ctx, layer_key)
                sums.setdefault(name.removesuffix("mixer") + "qk", []).append(logit_rms(module, *inputs[:2]))
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


@torch.no_grad()
def logit_rms(attn: torch.nn.Module, x: torch.Tensor, ctx: Any) -> float:
    """RMS over the causal triangle of an attention layer's pre-softmax logits q.k * scale on input x."""
    q, k, _ = attn.qkv(x, ctx)  # [B, T, H, D], plain attention (no GQA in these models)
    logits = torch.einsum("bthd,bshd->bhts", q, k) * attn.scale
    causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    return float(logits[..., causal].float().pow(2).mean().sqrt())


def coordinate_check(cfg: MupConfig, tokens: torch.Tensor | None = None) -> dict[str, Any]:
    tokens = byte_tokens(cfg.corpus, 500_000) if tokens is None else tokens
    result: dict[str, Any] = {}
    for parametrization in cfg.parametrizations:
        per_width = {}
        for width in cfg.widths:
            traces = [coordinate_trace(cfg, tokens, width, parametrization, seed) for seed in range(cfg.seeds)]
            per_width[str(width)] = {layer: [sum(t[layer][s] for t in traces) / len(traces)
                                             for s in range(cfg.steps + 1)] for layer in traces[0]}
        layers = list(per_width[str(cfg.widths[0])])
        ratio = {layer: max(per_width[str(w)][layer][-1] for w in cfg.widths)
                 / min(per_width[str(w)][layer][-1] for w in cfg.widths) for layer in layers}
        # max_ratio: the layers' outputs (the classic check); max_qk_ratio: the attention logits, where
        # 1/sqrt(d) and 1/d differ once head_dim grows
        result[parametrization] = {
            "rms": per_width, "ratio_after_last_step": ratio,
            "max_ratio": max(v for layer, v in ratio.items() if not layer.endswith(".qk")),
            "max_qk_ratio": max(v for layer, v in ratio.items() if layer.endswith(".qk"))}
    return result


def lr_transfer(cfg: MupConfig, tokens: torch.Tensor | None = None, log=print) -> dict[str, Any]:
    tokens = byte_tokens(cfg.corpus, 1_000_000) if tokens is None else tokens
    result: dict[str, Any] = {}
    for parametrization in cfg.parametrizations:
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
        # a diverged run's loss is NaN, which `min` would keep once it held it: it ranks last here
        best = {w: min(row, key=lambda k, row=row: row[k] if math.isfinite(row[k]) else math.inf)
                for w, row in table.items()}
        result[parametrization] = {"final_loss": table, "best_lr": best, "transfers": len(set(best.values())) == 1}
    return result


def plot(coords: dict[str, Any], transfer: dict[str, Any] | None, cfg: MupConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = cfg.parametrizations
    fig, axes = plt.subplots(1 + bool(transfer), len(names), figsize=(5 * len(names), 4.2 * (1 + bool(transfer))),
                             squeeze=False)
    for ax, parametrization in zip(axes[0], names, strict=True):
        rms = coords[parametrization]["rms"]
        for layer in rms[str(cfg.widths[0])]:
            ax.plot(cfg.widths, [rms[str(w)][layer][-1] for w in cfg.widths], marker="o", label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"width (growing: {cfg.widen})")
        ax.set_ylabel(f"activation RMS after {cfg.steps} updates")
        ax.set_title(f"{parametrization}: max/min across widths {coords[parametrization]['max_ratio']:.2f} "
                     f"(logits {coords[parametrization]['max_qk_ratio']:.2f})", fontsize=9)
        ax.legend(fontsize=6)
    if transfer:
        for ax, parametrization in zip(axes[1], names, strict=True):
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
    check_out_dir(out)  # (an existing file: one line naming it, not mkdir's bare errno)
    start = time.perf_counter()
    tokens = byte_tokens(cfg.corpus, 1_000_000)
    # before --out is made: a model shape refused or a corpus shorter than a window left an empty --out
    for width in cfg.widths:
        for parametrization in cfg.parametrizations:
            width_model_config(cfg, width, parametrization)
    ByteWindows(tokens, cfg.seq_len, 0)
    out.mkdir(parents=True, exist_ok=True)  # (after the corpus loads: a bad --corpus leaves no empty --out)
    coords = coordinate_check(cfg, tokens)
    for parametrization in cfg.parametrizations:
        log(f"coordinate check, {parametrization}: max/min across widths after {cfg.steps} steps of the "
            f"activation RMS {coords[parametrization]['max_ratio']:.3f}, of the attention logits' RMS "
            f"{coords[parametrization]['max_qk_ratio']:.3f}")
    lrs = lr_transfer(cfg, tokens, log) if transfer else None
    result = {"config": asdict(cfg), "coordinate_check": coords, "lr_transfer": lrs,
              "seconds": time.perf_counter() - start, "torch_threads": torch.get_num_threads()}
    name = "mup_lr_transfer" if transfer else "mup_coord_check"
    # strict JSON: a diverged run's NaN loss as null
    (out / f"{name}.json").write_text(json.dumps(finite_or_null(result), indent=1, allow_nan=False) + "\n")
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
