"""The low-rank terms of unmerged peft LoRA layers, for runners that read weights directly.

peft's `lora.Linear` keeps the base `nn.Linear` as `base_layer` (its `weight` and `bias` are the base
layer's; over an int8 / int4 layer of weight_quant.py, the runner multiplies by that layer itself) and adds
`scale * B (A x)` per active adapter in its forward. The fused decode runner
(`accel/runner.py`) multiplies by the weights itself instead of calling the module, so it reads
that term here and adds it, exactly as peft's forward does (dropout is the identity in eval mode).
Duck-typed on peft's attributes, so nothing here imports peft.

A runner built for a mixed batch (`inference.lora_layers.RowAdapters.for_runner`: the multi-adapter server's)
reads every adapter of each layer (`RowLowRank`) and adds, to each row, its own adapter's term, as peft's
`_mixed_batch_forward` does: a call whose rows all name one adapter adds its term to the whole activation, as
a runner built with that adapter on does.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.inference.lora_layers import RowAdapters, active_unmerged, is_lora_layer, over_linear, plain_lora

LowRank = tuple[Tensor, Tensor]  # (A^T [in, r], (scale B)^T [r, out])


def unsupported_lora(layer: Any) -> str | None:
    """Why `low_rank_term` cannot reproduce this LoRA layer's forward (None: it can); for a mixed batch's runner,
    of every adapter the layer holds."""
    rows = getattr(layer, RowAdapters.ATTR, None)
    if rows is not None and rows.building and not plain_lora(layer):
        return "a mixed batch's adapter that is not a plain low-rank pair"
    if not over_linear(layer) or getattr(layer, "fan_in_fan_out", False):
        return f"{type(layer).__name__} over {type(getattr(layer, 'base_layer', None)).__name__}"
    for name in active_unmerged(layer):
        if layer.use_dora.get(name, False):
            return f"adapter {name!r} uses DoRA"
        if getattr(layer, "lora_bias", {}).get(name, False):
            return f"adapter {name!r} has a LoRA bias"
        if name in getattr(layer, "lora_variant", {}):
            return f"adapter {name!r} is a LoRA variant ({type(layer.lora_variant[name]).__name__})"
        if not isinstance(layer.lora_A[name], nn.Linear):
            return f"adapter {name!r} is not a plain low-rank pair"
    return None


def low_rank_term(layer: Any, dtype: torch.dtype | None = None) -> LowRank | RowLowRank | None:
    """`(A^T [in, r], (scale B)^T [r, out])`, the active unmerged adapters stacked along r, so that
    `layer(x) = base(x) + (x @ A^T) @ (scale B)^T`; None for a plain layer or nothing to add.
    dtype: the activations' (peft may keep the adapters of a bf16 model in float32).
    A layer of a mixed batch's runner (built in `RowAdapters.for_runner`): a `RowLowRank` of every adapter."""
    if not is_lora_layer(layer):
        return None
    rows: RowAdapters | None = getattr(layer, RowAdapters.ATTR, None)
    if rows is not None and rows.building:
        terms = {name: _stacked(layer, [name], dtype) for name in layer.lora_A}
        return RowLowRank(terms, rows)
    names = active_unmerged(layer)
    return _stacked(layer, names, dtype) if names else None


def _stacked(layer: Any, names: list[str], dtype: torch.dtype | None) -> LowRank:
    a = torch.cat([layer.lora_A[name].weight for name in names])  # [r, in]
    b = torch.cat([layer.lora_B[name].weight * layer.scaling[name] for name in names], dim=1)  # [out, r]
    return a.t().to(dtype), b.t().to(dtype).contiguous()


class RowLowRank:
    """Every adapter's term of one layer, stacked along r (`LowRank`, with each adapter's `[start, end)` of r in
    `spans`), of which `add_low_rank` adds each row's own, the rows' adapters as `rows.use` names them (outside
    `use`: none, as for the base alone)."""

    def __init__(self, terms: dict[str, LowRank], rows: RowAdapters) -> None:
        self.terms, self.rows = terms, rows
        ends = list(accumulate(a_t.shape[1] for a_t, _ in terms.values()))
        self.spans = tuple((name, end - a_t.shape[1], end) for (name, (a_t, _)), end in zip(terms.items(), ends))
        self.stacked: LowRank | None = None
        if terms:
            self.stacked = (torch.cat([a_t for a_t, _ in terms.values()], dim=1),
                            torch.cat([b_t for _, b_t in terms.values()]))

    def split(self, at: int) -> tuple[RowLowRank, RowLowRank]:
        """The terms of the inputs before and after `at` (the recurrence adapter's `[s; e]`)."""
        return (RowLowRank({n: (a[:at], b) for n, (a, b) in self.terms.items()}, self.rows),
                RowLowRank({n: (a[at:], b) for n, (a, b) in self.terms.items()}, self.rows))

    def mask(self, x: Tensor) -> Tensor | None:
        """`[N, r]`: 1 on the columns of each row's adapter, 0 elsewhere (None: all rows name one adapter, or
        none); once per call for every layer of the same adapters and ranks."""
        key = (x.shape[0], self.spans, x.device, x.dtype)
        found = self.rows.per_call.get(key, False)
        if found is False:
            names = self.rows.row_names(x.shape[0])
            found = None
            if len(set(names)) > 1:
                found = torch.zeros(len(names), self.spans[-1][2], dtype=x.dtype)
                for name, start, end in self.spans:
                    found[[b for b, n in enumerate(names) if n == name], start:end] = 1
                found = found.to(x.device)
            self.rows.per_call[key] = found
        return found


def split_low_rank(term: LowRank | RowLowRank, at: int) -> tuple[LowRank | RowLowRank, LowRank | RowLowRank]:
    """A term of `[x1, x2]` (x1 of `at` features) as the terms of x1 and of x2: A [x1; x2] = A_1 x1 + A_2 x2."""
    if isinstance(term, RowLowRank):
        return term.split(at)
    a_t, b_t = term
    return (a_t[:at], b_t), (a_t[at:], b_t)


def add_low_rank(y: Tensor, x: Tensor, term: LowRank | RowLowRank | None) -> Tensor:
    """`y + (x A^T) (s B)^T` for 2-D `x` `[N, in]`, `y` `[N, out]` (in place when no graph needs y). A
    `RowLowRank` adds each row's own adapter: all rows of one adapter, that adapter's term alone (as a runner
    built with it on adds it); rows of several, every adapter's `x A^T` at once with the other adapters' columns
    zeroed per row (`RowLowRank.mask`), in one product by the stacked `(s B)^T` (punica's batched LoRA: a few
    operations a layer however many adapters the rows name)."""
    if term is None:
        return y
    if not isinstance(term, RowLowRank):
        a_t, b_t = term
        return y.addmm(x @ a_t, b_t) if y.requires_grad else y.addmm_(x @ a_t, b_t)
    if term.rows.names is None or term.stacked is None:
        return y
    mask = term.mask(x)
    if mask is None:
        name = term.rows.names[0]
        return add_low_rank(y, x, term.terms.get(name) if name is not None else None)
    a_t, b_t = term.stacked
    low = (x @ a_t).mul_(mask)
    return y.addmm(low, b_t) if y.requires_grad else y.addmm_(low, b_t)
