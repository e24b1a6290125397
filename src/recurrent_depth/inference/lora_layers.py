"""peft's LoRA layers, duck-typed on their attributes (nothing here imports peft): which layers they are and which
adapters their forward adds. Read by the fused runner (`accel/lora.py`), TTT-E2E's parameter choice and the
multi-adapter server, whose mixed batches (`RowAdapters`) add each row's own adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from recurrent_depth.weight_quant import QuantizedLinear


def is_lora_layer(module: Any) -> bool:
    """A peft LoRA layer (any kind: Linear, Embedding, ...)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def over_linear(layer: Any) -> bool:
    """Whether a LoRA layer wraps a linear product: an nn.Linear, or an int8 / int4 one (weight_quant.py), whose
    `base(x) + scale B A x` peft's forward and the fused runner compute alike."""
    return isinstance(getattr(layer, "base_layer", None), nn.Linear | QuantizedLinear)


def active_unmerged(layer: Any) -> list[str]:
    """The adapters peft's forward adds on top of the base layer (none when merged or disabled, as peft)."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def idle_adapter_parameters(model: nn.Module) -> set[str]:
    """Names of the parameters of LoRA adapters that peft's forward does not add (turned off, disabled or merged):
    they change no output, so nothing should train or copy them (e.g. the other adapters of a
    `--lora-modules` server)."""
    idle: set[str] = set()
    for prefix, module in model.named_modules():
        if not is_lora_layer(module):
            continue
        active = set(active_unmerged(module))
        for name, _ in module.named_parameters(prefix=prefix):
            tail = name[len(prefix):].split(".")
            # (peft's adapter tensors: lora_A.<adapter>.weight, lora_magnitude_vector.<adapter>.weight, ...)
            if len(tail) > 2 and tail[1].startswith("lora_") and tail[2] not in active:
                idle.add(name)
    return idle


# peft's name for "no adapter" in a mixed batch's `adapter_names`
BASE_ROW = "__base__"


def plain_lora(layer: Any, names: list[str] | None = None) -> bool:
    """Whether each adapter `names` of a LoRA layer (None: all it holds) is a plain low-rank pair on a linear layer
    (`over_linear`; no DoRA, LoRA bias, variant or fan_in_fan_out): what a row of a mixed batch can add by itself, in
    peft's `_mixed_batch_forward` and in the fused runner (`accel/lora.py`)."""
    if not over_linear(layer) or getattr(layer, "fan_in_fan_out", False):
        return False
    return all(not layer.use_dora.get(name, False) and not getattr(layer, "lora_bias", {}).get(name, False)
               and name not in getattr(layer, "lora_variant", {}) and isinstance(layer.lora_A[name], nn.Linear)
               for name in (layer.lora_A if names is None else names))


class RowAdapters:
    """Which LoRA adapter each row of a model call adds: one batch serving several adapters at once (the
    multi-adapter server's mixed batches, `serving/adapters.py`).

    `attach(model)` marks the model's LoRA layers: while `use(names)` is on (names: each row's peft adapter
    name, None for the base alone), each layer's forward gets peft's own mixed-batch argument
    `adapter_names=[...]` (peft's `_mixed_batch_forward`: each row adds its adapter's `B A x` only), whatever
    adapter is turned on; the fused runner built inside `for_runner()` reads every adapter of each layer and adds
    each row's (`accel/lora.py`). Outside `use` nothing changes: peft's forward adds the adapters turned on."""

    ATTR = "rdepth_row_adapters"  # (on each attached LoRA layer: this object)

    def __init__(self) -> None:
        self.names: list[str | None] | None = None
        self.building = False
        self._handles: list[Any] = []
        self._layers: list[nn.Module] = []
        self.per_call: dict[tuple, Any] = {}  # what the layers of one call share (cleared by `use`)

    def attach(self, model: nn.Module) -> bool:
        """Mark `model`'s LoRA layers (after any change of them: the previous marks go); False, marking none,
        when some adapter is not a plain low-rank pair on a linear layer (`plain_lora`): rows cannot mix."""
        self.detach()
        layers = [m for m in model.modules() if is_lora_layer(m)]
        # (`_before` turns peft's layer on through its flag behind `disable_adapters`)
        if not all(plain_lora(layer) and hasattr(layer, "_disable_adapters") for layer in layers):
            return False
        self._layers = layers
        for layer in layers:
            setattr(layer, self.ATTR, self)
            self._handles.append(layer.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._after, always_call=True))
        return True

    def detach(self) -> None:
        """Unmark the layers `attach` marked: their forward is peft's alone again."""
        for handle in self._handles:
            handle.remove()
        for layer in self._layers:
            layer.__dict__.pop(self.ATTR, None)
        self._handles, self._layers = [], []

    @contextmanager
    def use(self, names: list[str | None]) -> Iterator[None]:
        """Model calls of len(names) rows inside it add, row b, adapter names[b] (None: none)."""
        self.names = names
        self.per_call.clear()
        try:
            yield
        finally:
            self.names = None

    @contextmanager
    def for_runner(self) -> Iterator[None]:
        """A fused runner built inside it reads every adapter of each layer, to add each row's in `use`."""
        self.building = True
        try:
            yield
        finally:
            self.building = False

    def row_names(self, rows: int) -> list[str | None]:
        """The adapter of each row of an activation of `rows` rows: the names of `use`, each repeated when its
        row holds several positions (`[B * T, ...]`)."""
        if rows % len(self.names):
            raise ValueError(f"a model call of {rows} rows under adapters for {len(self.names)} rows")
        per = rows // len(self.names)
        return self.names if per == 1 else [name for name in self.names for _ in range(per)]

    def _before(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """peft's `adapter_names` for this call, with the layer on (its forward ignores them when off)."""
        if self.names is None:
            return None
        names = [name or BASE_ROW for name in self.row_names(len(args[0]))]
        layer.rdepth_was_off = layer._disable_adapters  # (peft's flag behind `disable_adapters`)
        layer._disable_adapters = False
        return args, {**kwargs, "adapter_names": names}

    def _after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        was_off = layer.__dict__.pop("rdepth_was_off", None)
        if was_off is not None:
            layer._disable_adapters = was_off
