"""Several LoRA adapters served on one base model (`rdepth serve --lora-modules NAME=DIR ...`), as vLLM's
`--lora-modules` serves them.

A request's `model` field picks its adapter by name; the base's served name (`--served-model-name`) runs the
base alone. The adapters are loaded once, unmerged, onto the one base (`train.lora.load_loras`: the same
checks as `--lora`, the base fingerprint included) and at most one is on at a time (`activate`).

The scheduler (`engine.BatchScheduler`) therefore runs the requests of one adapter at a time. While an
adapter's requests run, waiting requests of it join the batch in arrival order up to the first that names
another; that one, and every request behind it, waits until nothing runs. Then the model switches to the
oldest waiting request's adapter (`activate`, and the batch's runner is rebuilt from the switched model: the
fused runner reads the adapter's low-rank terms when it is built), and every request of that adapter waiting
then joins (as rows and the prefill budget allow), the others keeping their order behind. A request thus
computes exactly what it computes on a server started with `--lora` of its adapter alone (or with none, for
the base), whatever the other requests name; the cost is throughput when requests of different adapters
interleave (docs/serving.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recurrent_depth.inference.lora_layers import is_lora_layer

# What a served adapter name may hold: what a client types as `model`, without spaces or '=' (NAME=DIR).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules` values ("NAME=DIR", ...) as {name: dir}, in order; a one-line ValueError for a value
    without '=', an empty or malformed name, an empty directory or a name given twice."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, directory = (part.strip() for part in spec.partition("="))
        if not sep or not directory:
            raise ValueError(f"--lora-modules {spec!r} is invalid: expected NAME=ADAPTER_DIR, e.g. sql=runs/sql/model")
        check_adapter_name(name, "--lora-modules")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice: give each adapter its own name")
        modules[name] = directory
    return modules


def check_adapter_name(name: Any, what: str) -> None:
    """A one-line ValueError unless `name` can be a served adapter's name (`what`: where it was given)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{what} name {name!r} is invalid: expected letters, digits and . _ : / @ + - (starting "
                         "with a letter or digit)")


class ServedAdapters:
    """The named adapters of one served base model, and which one is on.

    `model` (a `RecurrentDepthLM`, modified in place: peft's layers go onto it) gets every adapter of `modules`
    ({served name: adapter directory}); strict_base, model_dir: as for `train.lora.load_lora`."""

    def __init__(self, model: Any, modules: Mapping[str, str | Path], strict_base: bool = False,
                 model_dir: str | Path | None = None) -> None:
        from recurrent_depth.train.lora import load_loras, several_adapter_name

        if not modules:
            raise ValueError("lora_modules is empty: name at least one adapter, or pass None")
        for name in modules:
            check_adapter_name(name, "lora_modules")
        if any(is_lora_layer(m) for m in model.modules()):  # (peft would stack the new adapters on top of it)
            raise ValueError("the model already carries a LoRA adapter (--lora / attach_adapter): give the plain base "
                             "model, with that adapter as one of lora_modules")
        self.names = tuple(modules)
        self.wrapper = load_loras(model, [modules[n] for n in self.names], strict_base=strict_base,
                                  model_dir=model_dir)
        self._peft_names = {name: several_adapter_name(i) for i, name in enumerate(self.names)}
        self.active: str | None = None  # load_loras leaves them all off

    def __contains__(self, name: object) -> bool:
        return name in self._peft_names

    def activate(self, name: str | None) -> None:
        """Turn adapter `name` on (None: none, the base alone). Only between requests: nothing may be running."""
        from recurrent_depth.train.lora import use_adapter

        if name is not None and name not in self._peft_names:
            raise ValueError(f"no adapter named {name!r}; this server has {list(self.names)}")
        use_adapter(self.wrapper, None if name is None else self._peft_names[name])
        self.active = name
