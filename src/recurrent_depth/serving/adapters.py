"""Several LoRA adapters served on one base model (`rdepth serve --lora-modules NAME=DIR ...`), as vLLM's
`--lora-modules` serves them.

A request's `model` field picks its adapter by name; the base's served name (`--served-model-name`) runs the
base alone. The adapters are loaded once, unmerged, onto the one base (`train.lora.load_loras`: the same
checks as `--lora`, the base fingerprint included); on a base of int8 / int4 weights (`--weights`) they go on the
quantized layers, QLoRA-style (`train.lora.on_quantized_layers`), and mix in batches as on float ones.

Rows of different adapters share the continuous batch (`mixes`, as vLLM's punica kernels and peft's
`adapter_names` batches do): each row adds its own adapter in every model call (`RowAdapters`,
inference/lora_layers.py: peft's own mixed-batch forward in the model's layers; the fused runner, built for the
batch, holds every adapter's low-rank terms and adds each row's, accel/lora.py), whichever adapter is turned
on, so the scheduler (`engine.BatchScheduler`) admits requests in arrival order whatever they name. A request
thus computes what it computes on a server started with `--lora` of its adapter alone (or with none, for the
base), to float rounding, as any batched row does. Solo requests (speculative decoding, TTT-E2E, ...) run with
the adapter turned on (`turn_on`, at most one at a time): the scheduler runs the solo requests of one adapter
at a time, the batch's rows going on meanwhile. Where some adapter is not a plain low-rank pair on a linear
layer (DoRA, a LoRA bias, ...: `plain_lora`), rows do not mix: the scheduler then runs the requests of one
adapter at a time, switching the adapter (and rebuilding the batch's runner) once nothing runs; the cost is
throughput when requests of different adapters interleave (docs/serving.md).

With `rdepth serve --lora-updates-root DIR` adapters also load and unload while the server runs (vLLM's
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`): `adapter_dir_inside` keeps a request's path inside
DIR. The scheduler (`engine.BatchScheduler`) calls `add` and `drop` at its switch point, while nothing runs, and
`retire` at once when an unload comes: the name is then free (a later load of it gets a new peft name), while the
retired adapter's layers stay (`retired`) for the requests already accepted for it, until `drop`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recurrent_depth.inference.lora_layers import RowAdapters, is_lora_layer

# What a served adapter name may hold: what a client types as `model`, without spaces or '=' (NAME=DIR).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
# ... of at most this many characters: a name goes into /v1/models and into messages listing the served names (a
# runtime load of a 10,000-character name made every later 404 and 400 carry it)
NAME_MAX_CHARS = 256
DEFAULT_MAX_LORA_MODULES = 32  # adapters one server holds at most once runtime loads are on (--max-lora-modules)


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
    """A one-line ValueError unless `name` can be a served adapter's name (`what`: where it was given: a field that
    is a name, such as lora_name, or one holding names, such as --lora-modules)."""
    from recurrent_depth.files import clipped

    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{_named(what)} {clipped(name)} is invalid: expected letters, digits and . _ : / @ + - "
                         "(starting with a letter or digit)")
    if len(name) > NAME_MAX_CHARS:
        raise ValueError(f"{_named(what)} {clipped(name)} is invalid: expected at most {NAME_MAX_CHARS} characters")


def _named(what: str) -> str:
    """How a message names the name given in `what`: lora_name itself, a name of --lora-modules."""
    return what if what.endswith("_name") else f"{what} name"


def adapter_dir_inside(root: str | Path, given: Any) -> Path:
    """The adapter directory a load request names (`lora_path`, relative to `root`, the server's
    --lora-updates-root), symlinks resolved; a one-line ValueError unless it and the files an adapter is read from
    stay inside `root` (a client's path is untrusted: `..`, an absolute path or a symlink must not reach out)."""
    from recurrent_depth.files import clipped
    from recurrent_depth.train.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter_dir

    if not isinstance(given, str) or not given.strip() or "\0" in given:
        raise ValueError(f"lora_path {clipped(given)} is invalid: expected a directory under the server's "
                         "--lora-updates-root, as a non-empty string")
    base = Path(root).resolve()
    outside = ValueError(f"lora_path {clipped(given)} leads outside the server's --lora-updates-root: give a path "
                         "relative to it (no '..', absolute paths or symlinks out of it)")
    try:
        path = (base / given).resolve()
        if not path.is_relative_to(base):
            raise outside
        try:
            found = check_adapter_dir(path)  # (itself, or the model/ of a LoRA run directory)
        except ValueError:  # (its message names the resolved path, which the client did not give)
            raise ValueError(f"lora_path {clipped(given)} is not a LoRA adapter directory under the server's "
                             f"--lora-updates-root: it holds no {ADAPTER_CONFIG}") from None
        if any(not (found / name).resolve().is_relative_to(base) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)):
            raise outside
    # (not the exception's own text: it names the resolved path, the server's --lora-updates-root in it)
    except OSError as exc:  # a name too long, ...
        raise ValueError(f"lora_path {clipped(given)} is invalid: {exc.strerror or type(exc).__name__}") from None
    except RuntimeError:  # (pathlib's symlink loop)
        raise ValueError(f"lora_path {clipped(given)} is invalid: it leads into a symlink loop") from None
    return found


def check_update_settings(updates_root: str | Path | None, max_count: int | None) -> None:
    """A one-line ValueError for runtime-loading settings that cannot work: a max_count (--max-lora-modules) that is
    not an integer >= 1, or an updates_root (--lora-updates-root) that is not a directory."""
    if max_count is not None and (isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1):
        raise ValueError(f"max_lora_modules={max_count!r} is invalid: expected an integer >= 1")
    if updates_root is not None and not Path(updates_root).is_dir():
        raise ValueError(f"lora_updates_root={str(updates_root)!r} is not a directory")  # (rdepth serve: the flag)


class ServedAdapters:
    """The named adapters of one served base model, which one is on (for solo requests, or for every request
    where rows do not mix), and `rows`, the per-row adapters of the batch (`mixes`: every adapter can mix).

    `model` (a `RecurrentDepthLM`, modified in place: peft's layers go onto it) gets every adapter of `modules`
    ({served name: adapter directory}); strict_base, model_dir: as for `train.lora.load_lora`.
    `updates_root` (None: off): the directory runtime loads (`add`) take adapters from, at most `max_count`
    adapters in all; `modules` may then be empty."""

    def __init__(self, model: Any, modules: Mapping[str, str | Path], strict_base: bool = False,
                 model_dir: str | Path | None = None, updates_root: str | Path | None = None,
                 max_count: int = DEFAULT_MAX_LORA_MODULES) -> None:
        from recurrent_depth.train.lora import load_loras, require_peft, several_adapter_name

        if not modules and updates_root is None:
            raise ValueError("lora_modules is empty: name at least one adapter, or pass None")
        check_update_settings(updates_root, max_count)
        for name in modules:
            check_adapter_name(name, "lora_modules")
        if any(is_lora_layer(m) for m in model.modules()):  # (peft would stack the new adapters on top of it)
            raise ValueError("the model already carries a LoRA adapter (--lora / attach_adapter): give the plain base "
                             "model, with that adapter as one of lora_modules")
        require_peft()  # (a server started without adapters fails now, not at its first load)
        self.model, self.strict_base, self.model_dir = model, strict_base, model_dir
        self.updates_root = None if updates_root is None else Path(updates_root).resolve()
        self.max_count = max_count
        self.names = tuple(modules)
        # the base's modules without peft's layers, which a later adapter's targets are read against (meta: no memory)
        self.layout = _meta_copy(model) if updates_root is not None else None
        self.wrapper = load_loras(model, [modules[n] for n in self.names], strict_base=strict_base,
                                  model_dir=model_dir) if modules else None
        self._peft_names = {name: several_adapter_name(i) for i, name in enumerate(self.names)}
        self._loaded = len(self.names)  # adapters loaded so far: the next one's peft name (never reused)
        # peft names of adapters unloaded (`retire`) whose layers stay until `drop`: accepted requests still use them,
        # and each holds one of the max_count slots until then
        self.retired: set[str] = set()
        # `retire` runs on the HTTP side, `add` on the scheduler's thread: each changes the names whole under it
        self._names_lock = threading.Lock()
        self.active: str | None = None  # the peft name of the adapter turned on (load_loras leaves them all off)
        # rows of different adapters share a batch (`mixes`) unless an adapter is not a plain low-rank pair
        self.rows = RowAdapters()
        self.mixes = self.rows.attach(model)

    def __contains__(self, name: object) -> bool:
        return name in self._peft_names

    def peft_name(self, name: str | None) -> str | None:
        """The peft adapter name of served adapter `name` (None: the base), as `RowAdapters.use` takes it."""
        if name is not None and name not in self._peft_names:
            raise ValueError(f"no adapter named {name!r}; this server has {list(self.names)}")
        return None if name is None else self._peft_names[name]

    def turn_on(self, peft_name: str | None) -> None:
        """Turn on the adapter peft knows as `peft_name` (None: the base alone), served or `retired`: a request
        runs with the adapter it was accepted for, also once that is unloaded. Only while nothing runs with
        another."""
        from recurrent_depth.train.lora import use_adapter

        with self._names_lock:  # (a `retire` between two unlocked reads hid it from both: the engine stopped)
            known = peft_name is None or peft_name in self.retired or peft_name in self._peft_names.values()
        if not known:
            raise ValueError(f"no LoRA adapter has the peft name {peft_name!r} (unloaded and dropped?)")
        if self.wrapper is not None:
            use_adapter(self.wrapper, peft_name)
        self.active = peft_name

    def add(self, name: str, directory: str | Path) -> None:
        """Serve the adapter in `directory` (inside `updates_root`: `adapter_dir_inside`) as `name` too, checked as
        the start-up ones are; all turned off. Only while nothing runs (the scheduler's switch point); a one-line
        ValueError leaves everything as it was."""
        from recurrent_depth.train.lora import add_named_lora, several_adapter_name

        if self.layout is None:
            raise ValueError("runtime LoRA loading is off: start the server with --lora-updates-root DIR")
        check_adapter_name(name, "lora_name")
        if name in self:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded: unload it first, or choose another "
                             "lora_name")
        if len(self.names) + len(self.retired) >= self.max_count:  # (a retired one holds its memory still)
            retired = (f", {len(self.retired)} of them unloaded and finishing the requests already accepted for "
                       "them" if self.retired else "")
            raise ValueError(f"this server already holds {len(self.names) + len(self.retired)} LoRA adapters"
                             f"{retired}, its limit (--max-lora-modules {self.max_count}): unload one first"
                             f"{', or retry once they have finished' if self.retired else ''}")
        # checked again here, on the scheduler thread just before the load: the handler checked the path when the
        # request came, and a symlink in the root could be pointed out of it while the load waited for the running
        # requests (the window is now the load's own)
        directory = adapter_dir_inside(self.updates_root, str(directory))
        peft_name = several_adapter_name(self._loaded)
        self.turn_on(None)
        self.wrapper = add_named_lora(self.model, self.wrapper, directory, peft_name, self.layout,
                                      strict_base=self.strict_base, model_dir=self.model_dir)
        self._loaded += 1
        with self._names_lock:
            self._peft_names[name] = peft_name
            self.names = (*self.names, name)
        self.mixes = self.rows.attach(self.model)  # (its new layers; one that is not plain stops the mixing)

    def retire(self, name: str) -> str:
        """Stop serving adapter `name`: it leaves `names` (a job naming it is then refused, and the name may be
        loaded again), its layers stay on the model (`retired`) until `drop` of the peft name returned. No peft
        work: the scheduler calls it under the lock `submit` takes, at once, whatever runs or waits (the jobs
        accepted for it keep its peft name, `engine.BatchScheduler.submit`)."""
        if name not in self:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded; this server has {list(self.names)}")
        with self._names_lock:
            self.names = tuple(n for n in self.names if n != name)
            peft_name = self._peft_names.pop(name)
            self.retired.add(peft_name)
        return peft_name

    def drop(self, peft_name: str) -> None:
        """Delete the layers of the adapter `retire` returned `peft_name` for; all others turned off. Only while
        nothing runs, and no job waits for it; peft's work, so the scheduler calls it outside its lock (`submit`
        does not wait for it)."""
        from recurrent_depth.train.lora import remove_named_lora

        self.turn_on(None)
        try:
            self.wrapper = remove_named_lora(self.wrapper, peft_name)
        except Exception as exc:
            # The adapter stays unloaded (its served name is gone already, maybe loaded again) and its slot is
            # freed: kept in `retired`, it held a --max-lora-modules slot for good, every later load refused as
            # over the limit. What peft left of its layers stays off (`turn_on` refuses its peft name now).
            raise RuntimeError(f"the LoRA adapter is unloaded, but deleting its layers failed ({type(exc).__name__}: "
                               f"{exc}); its --max-lora-modules slot is free again") from exc
        finally:
            self.retired.discard(peft_name)
            self.mixes = self.rows.attach(self.model)  # (its layers changed, also part-way)


def _meta_copy(model: Any) -> Any:
    """A model of `model`'s class and config on the meta device: its modules' names and types, no weights."""
    import torch

    with torch.device("meta"):
        return type(model)(model.config)
