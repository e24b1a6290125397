"""LoRA through `peft`: low-rank adapters on chosen parts of a recurrent-depth model.

    spec = LoraSpec(rank=8, alpha=16, parts=("core",), kinds=("attention", "mlp"))
    peft_model = add_lora(model, spec, base_dir="runs/base/model")   # a peft `PeftModel`
    Trainer(cfg, model=peft_model, data=...).run()                   # trains the adapter only
    save_adapter(peft_model, "adapter")                              # adapter_config.json + adapter_model.safetensors
    merged = merge_lora(load_lora(RecurrentDepthLM.from_pretrained(base), "adapter"))

A spec chooses modules by part (prelude, adapter, core, coda) and kind (attention: every linear layer
of a block's token mixer, e.g. `attn.Wqkv` and `attn.proj`; mlp: `mlp.fc` and `mlp.proj`); the input
adapter `transformer.adapter` is one linear layer, chosen by its part alone. The target modules are
the exact module names, which the library model, its transformers wrapper (`integrations/hf.py`) and
the standalone remote-code model share, so an adapter saved from one loads onto the others, e.g. with
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`.

peft changes the wrapped model in place (its chosen `nn.Linear` layers become `lora.Linear`), so the
library model under the wrapper (`base_model_of`) runs with the adapter everywhere a `RecurrentDepthLM`
goes: generation's reference runner calls its modules, and the fused decode runner adds the low-rank
terms itself (`accel/lora.py`). peft is the optional extra `recurrent-depth[lora]`.

On int8 / int4 weights (`weight_quant`, `--weights`) adapters go on the quantized layers unmerged, QLoRA-style:
every load and `add_lora` registers those layers with peft's custom-module dispatch (`on_quantized_layers`), whose
LoRA layer (`quantized_lora_layer`) is peft's own over the quantized product; DoRA and merging are refused.
Training one there (QLoRA: `LoraSpec(weights="int4")`, `--lora --weights`): `add_lora` quantizes the base first,
frozen; the adapter saved is an ordinary one, which loads onto the float base too.

An adapter saved from `add_lora` records a fingerprint of its base model's weights (`base_fingerprint`);
loading it onto a model whose weights differ (another fine-tune of the same shapes) warns with
`AdapterBaseWarning`, or with `strict_base=True` fails in one line.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recurrent_depth.weight_quant import (
    QuantizedLinear,
    check_weights,
    held_weights,
    quantize_weights,
    quantized_weights,
    register_after_quantize,
    spread_samples,
)

PARTS = ("prelude", "adapter", "core", "coda")
KINDS = ("attention", "mlp")
# The families whose input injection (ModelConfig.injection) is no linear layer: they have no `adapter` part.
INJECTION_FAMILIES = {"diagonal": "Parcae", "none": "Ouro"}
# The ModuleDict entry of each part's blocks (`transformer.<name>.<i>`), as in the official checkpoint.
BLOCK_CONTAINERS = {"prelude": "prelude", "core": "core_block", "coda": "coda"}
KIND_MODULES = {"attention": "attn", "mlp": "mlp"}
# The names, inside a block's `attn` / `mlp`, of the linear layers of every registered mixer and MLP (the mixers'
# own names: Wqkv/proj of softmax attention, q/k/v/..._proj of the linear-attention family, MLA's and DSA's).
KIND_LINEAR_NAMES = {
    "attention": ("Wqkv", "proj", "ve_gate", "q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj",
                  "gk_proj.0", "gk_proj.1", "z_proj", "xbc_proj", "dt_proj", "levels.l_proj", "wq", "wq_a", "wq_b",
                  "wkv_a", "wkv_b", "indexer.wq", "indexer.wk", "indexer.weights"),
    "mlp": ("fc", "proj"),
}
ADAPTER_CONFIG = "adapter_config.json"
# adapter_config.json's fields peft holds as sets (lists of module names); `save_adapter` writes them sorted
SET_FIELDS = ("target_modules", "exclude_modules")
ALL_LINEAR = "all-linear"  # peft's target_modules shorthand: every linear layer but the output head
OUTPUT_HEAD = "lm_head"
# The layers an adapter goes on: float linear layers, and int8 / int4 ones (weight_quant.py; `quantized_lora_layer`)
LINEAR_TYPES = (nn.Linear, QuantizedLinear)
# The largest LoRA scale (alpha / r; alpha / sqrt(r) with rsLoRA) accepted. Published recipes use 0.5 to 4 (up to
# ~64 with rsLoRA); a scale of 1e308 was accepted and made every output inf. 1e4 is far beyond any recipe, yet
# keeps an update of unit size times it inside float16 (max 65504) and bfloat16.
MAX_LORA_SCALE = 1e4


def require_peft() -> Any:
    """The peft package, or a one-line error saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ModuleNotFoundError("LoRA needs the peft package: pip install 'recurrent-depth[lora]' (or peft>=0.13)",
                                  name="peft") from None
    return peft


def check_lora_scale(alpha: float, rank: int, rslora: bool, field: str) -> None:
    """A one-line ValueError naming `field` when the LoRA update's scale, alpha / rank (alpha / sqrt(rank) with
    rsLoRA), is above MAX_LORA_SCALE (`alpha` finite and > 0, `rank` >= 1: checked by the caller first)."""
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    if not scale <= MAX_LORA_SCALE:  # (written so: a NaN fails it too)
        raise ValueError(f"{field} is invalid: it scales the adapter's update by {scale:.3g} "
                         f"(alpha / {'sqrt(r)' if rslora else 'r'}, r={rank}), more than the {MAX_LORA_SCALE:g} "
                         "allowed (usual: 0.5 to 4)")


@dataclass(frozen=True)
class LoraSpec:
    """Which modules get a LoRA adapter and its shape: `B A` of rank `rank`, scaled by `alpha / rank`.
    weights: "int8" / "int4" / "int4:g<group>" / "nf4" / "nf4:g<block>" trains the adapter on the base quantized to
    that format (QLoRA: `add_lora` quantizes it, frozen, before the adapter goes on); None keeps the base's float
    weights.
    parts: None (the default) is every part the model has (Parcae's and Ouro's injection is no linear layer, Ouro
    has no prelude or coda); a part named here that the model lacks is refused by `target_modules`."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    parts: tuple[str, ...] | None = None
    kinds: tuple[str, ...] = KINDS
    weights: str | None = None

    def __post_init__(self) -> None:
        check_weights(self.weights)  # (a one-line ValueError naming the formats)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} is invalid: expected an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha={self.alpha!r} is invalid: expected a finite number > 0")
        check_lora_scale(self.alpha, self.rank, rslora=False, field=f"LoRA alpha={self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, int | float) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout={self.dropout!r} is invalid: expected a number in [0, 1)")
        for field, allowed in (("parts", PARTS), ("kinds", KINDS)):
            value = getattr(self, field)
            if value is None and field == "parts":
                continue
            chosen = (value,) if isinstance(value, str) else tuple(value)
            unknown = [v for v in chosen if v not in allowed]
            if unknown:
                raise ValueError(f"LoRA {field} {unknown} unknown: choose from {', '.join(allowed)}")
            if not chosen:
                raise ValueError(f"LoRA {field} is empty: choose at least one of {', '.join(allowed)}")
            object.__setattr__(self, field, tuple(dict.fromkeys(chosen)))  # (deduplicated, in the given order)


def target_modules(model: nn.Module, spec: LoraSpec) -> list[str]:
    """The exact names of the `nn.Linear` layers `spec` chooses in `model` (a `RecurrentDepthLM` or a
    transformers wrapper: both hold `transformer.*`)."""
    transformer = getattr(model, "transformer", None)
    if not isinstance(transformer, nn.ModuleDict) or "core_block" not in transformer:  # (Ouro has no adapter)
        raise ValueError(f"LoRA targets a recurrent-depth model (transformer.prelude/adapter/core_block/coda); "
                         f"{type(model).__name__} has no such modules")
    adapter = transformer["adapter"] if "adapter" in transformer else None  # noqa: SIM401 (ModuleDict: no .get)
    has = [part for part in PARTS if (isinstance(adapter, LINEAR_TYPES) if part == "adapter"
                                      else len(transformer[BLOCK_CONTAINERS[part]]) > 0)]
    parts = spec.parts if spec.parts is not None else tuple(has)
    lacking = [part for part in parts if part not in has]
    if lacking:
        # (an explicit choice the model cannot honour is refused, not silently narrowed to the parts it has)
        reasons = [f"it has 0 {part} layers" for part in lacking if part != "adapter"]
        if "adapter" in lacking:  # (say why: a family whose injection is no linear layer)
            reasons.append(f"its input injection is {type(adapter).__name__ if adapter is not None else 'none'}, "
                           "no linear layer, so the adapter part is empty")
        injection = getattr(getattr(model, "config", None), "injection", None)  # (a transformers config: any)
        family = INJECTION_FAMILIES.get(injection) if isinstance(injection, str) else None
        named = " or ".join([", ".join(lacking[:-1]), lacking[-1]] if len(lacking) > 1 else lacking)
        raise ValueError(f"LoRA parts={list(parts)} select no linear layer of the {named} part: this "
                         f"{f'{family} ' if family else ''}model has none; choose from the parts it has: "
                         f"{', '.join(has)} ({'; '.join(reasons)})")
    names = []
    for part in parts:
        if part == "adapter":
            names.append("transformer.adapter")
            continue
        container = BLOCK_CONTAINERS[part]
        for i, block in enumerate(transformer[container]):
            for kind in spec.kinds:
                owner = getattr(block, KIND_MODULES[kind])
                prefix = f"transformer.{container}.{i}.{KIND_MODULES[kind]}"
                names += [f"{prefix}.{name}" for name, module in owner.named_modules()
                          if name and isinstance(module, LINEAR_TYPES)]
    if not names:
        raise ValueError(f"LoRA parts={list(parts)} kinds={list(spec.kinds)} select no linear layer of this "
                         f"model (it has {len(transformer['prelude'])} prelude, {len(transformer['core_block'])} core "
                         f"and {len(transformer['coda'])} coda layers)")
    return names


def default_target_suffixes() -> list[str]:
    """`LoraSpec()`'s choice (the trainers' default: every part, both kinds) as module-name suffixes, for tables
    keyed by model type that cannot look at a model (peft's default `target_modules`): on any model, peft's suffix
    match of them picks what `target_modules(model, LoraSpec())` lists, whatever its mixers."""
    return ["transformer.adapter",
            *(f"{KIND_MODULES[kind]}.{name}" for kind in KINDS for name in KIND_LINEAR_NAMES[kind])]


def lora_config(model: nn.Module, spec: LoraSpec) -> Any:
    """The peft `LoraConfig` of `spec` for `model`: the chosen modules by their exact names (int8 / int4 ones too:
    `on_quantized_layers`)."""
    peft = require_peft()
    return on_quantized_layers(peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                                               bias="none", target_modules=target_modules(model, spec)), model)


# ------------------------------------------------------------------------ LoRA on int8 / int4 weights (QLoRA-style)
def _merge_refusal(model: nn.Module) -> ValueError:
    return ValueError(f"cannot merge a LoRA adapter into {held_weights(model)} weights (quantized: the merged "
                      "weight would need quantizing again): merge it on the float model (rdepth export --model M "
                      "--merge-lora ADAPTER --out MERGED, or merge_lora on a model loaded without weights=), then "
                      "load MERGED with --weights / weights=")


@functools.cache
def quantized_lora_layer() -> type:
    """peft's LoRA layer (`peft.tuners.lora.Linear`) over an int8 / int4 layer of weight_quant.py, which peft's
    custom-module dispatch makes (`on_quantized_layers`). Its forward is peft's own, `base(x) + scale B A x` with
    the quantized layer's product as `base` (mixed batches' `adapter_names` too), and the fused runner reads it as
    it reads peft's (accel/lora.py). A DoRA adapter (its forward reads the base weight's norm) and merging into the
    quantized weights are refused in one line."""
    require_peft()
    from peft.tuners.lora import Linear

    class QuantizedLoraLinear(Linear):
        def __init__(self, base_layer: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            with warnings.catch_warnings():  # (peft's "Unsupported layer type" for any base layer it does not know)
                warnings.filterwarnings("ignore", "Unsupported layer type", UserWarning)
                super().__init__(base_layer, adapter_name, *args, **kwargs)

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            if (kwargs.get("use_dora") or getattr(kwargs.get("config"), "use_dora", False)) and \
                    quantized_weights(self.get_base_layer()):  # (not after dequantize_weights: float again)
                raise ValueError(f"a DoRA adapter cannot go on {held_weights(self)} weights: its forward reads the "
                                 "float base weight's norm")
            super().update_layer(adapter_name, *args, **kwargs)

        def merge(self, *args: Any, **kwargs: Any) -> None:
            if quantized_weights(self.get_base_layer()):
                raise _merge_refusal(self)
            super().merge(*args, **kwargs)

    return QuantizedLoraLinear


def as_quantized_lora_layers(model: nn.Module) -> None:
    """peft's own LoRA layers (`peft.tuners.lora.Linear`, an adapter attached to the float model) over layers just
    quantized become `quantized_lora_layer()`'s subclass, as an adapter loaded onto quantized layers is: the same
    layers in either order, so that peft's `merge_and_unload` refuses in one line (peft's own merge read
    `base_layer.weight`: an AttributeError) and so does a DoRA adapter added later. Run by every
    `weight_quant.quantize_weights` (registered below)."""
    from recurrent_depth.inference.lora_layers import is_lora_layer

    layers = [m for m in model.modules() if is_lora_layer(m) and isinstance(m.base_layer, QuantizedLinear)]
    if not layers:
        return
    quantized = quantized_lora_layer()  # (peft is there: it made the layers)
    for layer in layers:
        if type(layer) is quantized.__base__:  # (not another peft layer kind, nor ours already)
            layer.__class__ = quantized


register_after_quantize(as_quantized_lora_layers)


def refuse_dora_on_quantized(adapter_dir: Path, weights: str) -> None:
    """A one-line ValueError when the adapter in `adapter_dir` is a DoRA one, which cannot go on `weights` (int8 /
    int4) layers: its forward reads the float base weight's norm. (`rdepth generate --lora --weights` asks before
    the model loads.)"""
    if read_adapter_config(adapter_dir).get("use_dora"):
        raise ValueError(f"cannot load the LoRA adapter {adapter_dir} onto {weights} weights: it is a DoRA adapter "
                         "(use_dora), whose forward reads the float base weight's norm; load the model without "
                         "--weights, or merge the adapter into the float model (rdepth export --merge-lora) and "
                         "quantize that")


def on_quantized_layers(config: Any, model: nn.Module) -> Any:
    """`config` (a peft LoraConfig) able to put its adapter on `model`'s int8 / int4 layers where `model` holds some:
    peft wraps only the layer types it knows (torch's, bitsandbytes', ...), so these are registered with its
    custom-module dispatch (`LoraConfig._register_custom_module`, peft's experimental API for layer types of a
    library's own) to `quantized_lora_layer`. Not saved with the adapter: the adapter is the same on float weights."""
    if quantized_weights(model):
        if not hasattr(config, "_register_custom_module"):
            raise ValueError("LoRA on int8 / int4 weights needs a peft with custom-module dispatch (peft's "
                             "LoraConfig._register_custom_module): pip install -U peft")
        config._register_custom_module({QuantizedLinear: quantized_lora_layer()})
    return config


def add_lora(model: nn.Module, spec: LoraSpec, base_dir: str | Path | None = None, seed: int | None = None) -> Any:
    """`model` wrapped by peft with a fresh adapter (B = 0: the wrapper computes what `model` did); only
    the adapter is trainable. base_dir: the base model's directory, which `save_adapter` records in
    `adapter_config.json` (`base_model_name_or_path`, made absolute) so `load_adapter_model` finds the
    base from anywhere. seed: the A matrices' random init draws from it (the trainers pass their
    `seed`, so a LoRA run repeats exactly) without touching torch's global RNG; None: from that RNG.
    The wrapper also keeps `base_record(model)` (the base's fingerprint), which `save_adapter` records.
    spec.weights: `model`'s linear layers are quantized first, in place (QLoRA; the saved adapter is an ordinary
    one: the quantized layers keep the float base's fingerprint, so it loads onto the float model too)."""
    peft = require_peft()
    if spec.weights is not None:
        # plain int4 layout (kernel_layout=False): the training products take the reference, which reads it directly
        quantize_weights(model, spec.weights, kernel_layout=False)
    record = base_record(model)  # (before peft wraps it: the base's weights alone)
    with torch.random.fork_rng(devices=[]):  # (restores the CPU generator only: peft draws A on the CPU)
        if seed is not None:
            torch.default_generator.manual_seed(seed)  # not torch.manual_seed, which reseeds every GPU's for good
        wrapped = peft.get_peft_model(model, lora_config(model, spec))
    wrapped.lora_base_record = record  # what save_adapter records in the weights file
    # Not in peft's own config: peft's save_pretrained would then read it with `config.from_pretrained`,
    # which a transformers config has and our ModelConfig has not.
    wrapped.lora_base_dir = str(Path(base_dir).resolve()) if base_dir is not None else None
    return wrapped


def adapter_settings(model: Any) -> dict[str, Any] | None:
    """What resuming a LoRA run must keep: rank, alpha, dropout and the target modules (None: no adapter)."""
    if not is_peft_model(model):
        return None
    config = next(iter(model.peft_config.values()))
    return _settings(config.r, config.lora_alpha, config.lora_dropout, config.target_modules,
                     held_weights(base_model_of(model)))


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """`directory`'s adapter_config.json (a bounded read; a one-line ValueError unless a JSON object)."""
    from recurrent_depth.files import read_json

    path = Path(directory) / ADAPTER_CONFIG
    config = read_json(path, what="adapter config")
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def recorded_base_dir(directory: Path) -> str | None:
    """The base model directory the adapter in `directory` records (`base_model_name_or_path`; None: none), as
    written; a one-line ValueError unless it can be a path (a NUL byte was a bare "embedded null byte" after the
    adapter loaded, megabytes a warning of megabytes)."""
    from recurrent_depth.files import PATH_MAX_CHARS, clipped

    base = read_adapter_config(directory).get("base_model_name_or_path")
    if base is None or base == "":
        return None
    if not isinstance(base, str) or len(base) > PATH_MAX_CHARS or "\0" in base:
        raise ValueError(f"{directory / ADAPTER_CONFIG}: base_model_name_or_path={clipped(base)} is invalid: "
                         "expected the base model's directory")
    return base


def saved_adapter_settings(directory: str | Path) -> dict[str, Any] | None:
    """`adapter_settings` of the adapter saved in `directory` (a LoRA run's checkpoint), None without one."""
    if not (Path(directory) / ADAPTER_CONFIG).is_file():
        return None
    config = read_adapter_config(directory)
    return _settings(config.get("r"), config.get("lora_alpha"), config.get("lora_dropout"),
                     config.get("target_modules"), recorded_base(directory).get(WEIGHTS_KEY))


def _settings(rank: Any, alpha: Any, dropout: Any, targets: Any, weights: str | None) -> dict[str, Any]:
    """weights: the int8 / int4 format of the base the adapter trains on (QLoRA), None for float weights."""
    targets = [targets] if isinstance(targets, str) else sorted(targets or ())
    return {"rank": rank, "alpha": float(alpha) if alpha is not None else None,
            "dropout": float(dropout) if dropout is not None else None, "targets": targets, "weights": weights}


def describe_adapter(settings: dict[str, Any] | None) -> str:
    if settings is None:
        return "no LoRA adapter"
    weights = settings.get("weights")
    return (f"LoRA rank {settings['rank']} alpha {settings['alpha']:g} dropout {settings['dropout']:g} on "
            f"{len(settings['targets'])} modules" + (f" of {weights} weights" if weights else ""))


# ------------------------------------------------------------------------ which base an adapter belongs to
# Recorded in adapter_model.safetensors' metadata: an extra adapter_config.json key made peft warn that the file
# "was saved using a higher version of the library" on every load. peft and transformers ignore the metadata.
FINGERPRINT_KEY = "base_model_fingerprint"
DTYPE_KEY = "base_model_dtype"  # the dtype of the weights fingerprinted (a float16 copy rounds them differently)
# The int8 / int4 format of a quantized base (`held_weights`; absent for float weights): what a QLoRA run trained on,
# which its resume must rebuild (`adapter_settings`)
WEIGHTS_KEY = "base_model_weights"
FINGERPRINT_SCHEME = "rd1"  # the recipe below; a recorded fingerprint of another scheme is not compared
_RECORDED_FINGERPRINT = re.compile(rf"{FINGERPRINT_SCHEME}:[0-9a-f]{{16}}")  # what base_fingerprint gives
_RECORDED_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # a torch dtype's name ("float32"), or "none"
# `held_weights`' (a mix: "+")
_RECORDED_WEIGHTS = re.compile(r"(int8|(int4|nf4|nf4:dq):g\d{1,4})(\+(int8|(int4|nf4|nf4:dq):g\d{1,4})){0,4}")
# (FINGERPRINT_SAMPLES, from weight_quant: values read from each parameter, spread evenly over it)
FLOAT16_SMALLEST_NORMAL = 2.0**-14  # smaller magnitudes hash as 0: a float16 load keeps them only approximately
# peft's names for a wrapped layer's own weight (`Wqkv.base_layer.weight`, `lm_head.original_module.weight`),
# and for the tensors it adds (lora_A/B/..., a trained copy in modules_to_save): the base's names are without them.
_PEFT_WRAPPER_NAME = re.compile(r"\.(base_layer|original_module)(?=\.)")
_PEFT_ADDED_NAME = re.compile(r"\.(lora_\w+|modules_to_save)\.")


class AdapterBaseWarning(UserWarning):
    """A LoRA adapter was loaded onto a model whose weights differ from the base it was trained on."""


def _base_weights(model: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor | None]]:
    """`model`'s floating-point weights by their names without an adapter (a peft wrapper: the base's), each as
    (dtype, shape, its `spread_samples`): its parameters, and the weight of each int8 / int4 layer as the float one
    it was quantized from (`QuantizedLinear.source_samples`; None where not known), so that a quantized copy of a
    base has the base's fingerprint."""
    base = base_model_of(model)
    weights = {_PEFT_WRAPPER_NAME.sub("", name): (p.dtype, tuple(p.shape), spread_samples(p))
               for name, p in base.named_parameters() if not _PEFT_ADDED_NAME.search(name) and p.is_floating_point()}
    for name, m in base.named_modules():
        if isinstance(m, QuantizedLinear) and not _PEFT_ADDED_NAME.search(f"{name}."):
            weights[_PEFT_WRAPPER_NAME.sub("", f"{name}.weight")] = (m.weight_dtype, (m.out_features, m.in_features),
                                                                      m.source_samples)
    return weights


def base_fingerprint(model: nn.Module) -> str:
    """A short fingerprint of `model`'s weights ("rd1:" + 16 hex digits; a peft wrapper: of the base under it).

    SHA-256 over each floating-point parameter's name, shape and FINGERPRINT_SAMPLES values spread over it, so
    it costs O(parameters), not O(weights), and any fine-tune or merged adapter changes it. The values are
    rounded to bfloat16 first, so a float32 and a bfloat16 load of the same weights (and a float16 load of
    bfloat16 ones) give the same fingerprint; a float16 load of float32 weights rounds differently and does not."""
    digest = hashlib.sha256()
    weights = _base_weights(model)
    for name in sorted(weights):
        _, shape, samples = weights[name]
        digest.update(f"{name} {shape}\n".encode())
        if samples is None:  # (a quantized layer not made from a float one: its name and shape alone)
            continue
        values = samples.to(torch.bfloat16).cpu()
        values = torch.where(values.abs() < FLOAT16_SMALLEST_NORMAL, torch.zeros_like(values), values)  # (-0 too)
        digest.update(values.view(torch.int16).numpy().astype("<i2").tobytes())
    return f"{FINGERPRINT_SCHEME}:{digest.hexdigest()[:16]}"


def base_record(model: nn.Module) -> dict[str, str]:
    """What an adapter saved from a wrapper of `model` records of it: its fingerprint and the dtype of most of its
    weights ("float32")."""
    sizes: dict[str, int] = {}
    for dtype, shape, _ in _base_weights(model).values():
        name = str(dtype).removeprefix("torch.")
        sizes[name] = sizes.get(name, 0) + math.prod(shape)
    record = {FINGERPRINT_KEY: base_fingerprint(model), DTYPE_KEY: max(sizes, key=sizes.__getitem__, default="none")}
    weights = held_weights(model)
    return record if weights is None else {**record, WEIGHTS_KEY: weights}


def _add_weights_metadata(weights: Path, entries: dict[str, str]) -> None:
    """Add `entries` to the metadata of the adapter weights file peft wrote (rewritten whole: it is small; through
    a temporary file, so that an interrupted rewrite leaves peft's file, not a truncated one)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save

    from recurrent_depth.files import atomic_path

    with safe_open(str(weights), "pt") as handle:
        metadata = dict(handle.metadata() or {})
    tensors = load_file(str(weights))
    with atomic_path(weights) as tmp:
        tmp.write_bytes(_sorted_metadata(save(tensors, metadata={**metadata, **entries})))


def _sorted_metadata(data: bytes) -> bytes:
    """`data` (a safetensors file) with its header's `__metadata__` keys sorted: safetensors writes them in the order
    of a Rust HashMap, seeded anew for each map, so the same adapter was saved as different bytes each time. Only
    the order changes (same length, same offsets); a header that compact JSON does not reproduce is left as is."""
    length = int.from_bytes(data[:8], "little")
    text = data[8:8 + length].decode("utf-8").rstrip(" ")  # (padded with spaces to 8-byte alignment)
    header = json.loads(text)
    if json.dumps(header, separators=(",", ":"), ensure_ascii=False) != text or "__metadata__" not in header:
        return data
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    ordered = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return data[:8] + ordered.ljust(length) + data[8 + length:]


def recorded_base(adapter_dir: str | Path) -> dict[str, str]:
    """`base_record` of the base the adapter in `adapter_dir` was saved from; {} for one saved without
    (an adapter from peft itself, or from before fingerprints were recorded)."""
    from safetensors import safe_open

    path = check_adapter_dir(adapter_dir)
    check_adapter_files(path)  # (a regular, well-formed safetensors file before safetensors maps it)
    from recurrent_depth.files import clipped

    with safe_open(str(path / ADAPTER_WEIGHTS), "pt") as handle:
        metadata = handle.metadata() or {}
    recorded = {key: metadata[key] for key in (FINGERPRINT_KEY, DTYPE_KEY, WEIGHTS_KEY) if metadata.get(key)}

    def bad(key: str, expected: str) -> ValueError:
        return ValueError(f"weights file {path / ADAPTER_WEIGHTS}: metadata {key}={clipped(recorded[key])} is "
                          f"invalid: expected {expected}")

    # Both go into check_adapter_base's message: a forged value (megabytes, a newline) is refused here.
    fingerprint = recorded.get(FINGERPRINT_KEY, "")
    if fingerprint.startswith(f"{FINGERPRINT_SCHEME}:") and not _RECORDED_FINGERPRINT.fullmatch(fingerprint):
        raise bad(FINGERPRINT_KEY, f"{FINGERPRINT_SCHEME}: and 16 hex digits")  # (another scheme is not compared)
    if DTYPE_KEY in recorded and not _RECORDED_DTYPE.fullmatch(recorded[DTYPE_KEY]):
        raise bad(DTYPE_KEY, "a dtype name such as float32")
    if WEIGHTS_KEY in recorded and not _RECORDED_WEIGHTS.fullmatch(recorded[WEIGHTS_KEY]):
        raise bad(WEIGHTS_KEY, "a weights format such as int8 or int4:g32")
    return recorded


def check_adapter_base(model: nn.Module, adapter_dir: str | Path, strict: bool = False,
                       model_dir: str | Path | None = None) -> None:
    """Warn (AdapterBaseWarning; strict: a one-line ValueError) when the adapter in `adapter_dir` records a base
    fingerprint and `model`'s weights (a peft wrapper: its base's) give another: the adapter then runs on weights
    it was not trained on, which the shapes alone do not show. Intended for a sibling fine-tune, so not refused by
    default.
    model_dir: where `model` was loaded from, named in the message."""
    path = check_adapter_dir(adapter_dir)
    recorded = recorded_base(path)
    fingerprint = recorded.get(FINGERPRINT_KEY, "")
    if not fingerprint.startswith(f"{FINGERPRINT_SCHEME}:"):
        return  # saved without one, or by a later recipe this one cannot reproduce
    actual = base_record(model)
    if actual[FINGERPRINT_KEY] == fingerprint:
        return
    base_dir = recorded_base_dir(path)
    here = f"this model {model_dir}" if model_dir is not None else "this model"
    message = (f"the LoRA adapter {path} was trained on {base_dir or 'an unrecorded base'} (weights fingerprint "
               f"{fingerprint}), but {here} has weights fingerprint {actual[FINGERPRINT_KEY]}")
    dtypes = (recorded.get(DTYPE_KEY, "of an unrecorded dtype"), actual[DTYPE_KEY])
    if "float16" in dtypes and dtypes[0] != dtypes[1]:
        message += (f" (it is {dtypes[1]}, the adapter's base was {dtypes[0]}: float16 rounds even the same weights "
                    f"differently, so load it in float32 or bfloat16 to compare)")
    elif (base_dir is not None and model_dir is not None
          and adapter_base_dir(path).resolve() == Path(model_dir).resolve()):
        message += " (the weights in that directory changed since the adapter was saved)"
    else:
        message += " (another model of the same shapes: fine for an intended sibling fine-tune, else load its base)"
    if strict:
        raise ValueError(f"{message}; refused by the strict base check")
    warnings.warn(message, AdapterBaseWarning, stacklevel=3)  # (the line that called load_lora)


def save_adapter(model: Any, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write `model`'s adapter as a peft adapter directory (adapter_config.json + adapter_model.safetensors),
    with the base model directory `add_lora` was given as `base_model_name_or_path` and the fingerprint of the
    base's weights it took (`base_fingerprint`) in the weights file's metadata.
    state_dict: the wrapper's full state (e.g. gathered by the trainer); default its own."""
    directory = Path(directory)
    # save_embedding_layers=False: no embedding is ever a target here, and "auto" asks the base's config class.
    model.save_pretrained(str(directory), state_dict=state_dict, save_embedding_layers=False)
    base = getattr(model, "lora_base_dir", None)
    config = read_adapter_config(directory)
    if base is not None:
        config["base_model_name_or_path"] = base
    if config.get("task_type") is None:
        # What peft writes for a causal LM it wraps itself: peft.AutoPeftModelForCausalLM then loads the adapter
        # (on the transformers class); without a task type it took our class from `auto_mapping` and refused to
        # import it ("not in the import allowlist"). load_lora drops it again on a RecurrentDepthLM.
        config["task_type"] = "CAUSAL_LM"
        config.pop("auto_mapping", None)
    for key in SET_FIELDS:  # (peft keeps them as sets: written in another order by each process)
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key], key=str)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    record = getattr(model, "lora_base_record", None)
    if record:
        _add_weights_metadata(directory / ADAPTER_WEIGHTS, record)
    return directory


def is_peft_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model_of(model: Any) -> Any:
    """The model under a peft wrapper (its layers carry the adapter), or `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """The adapter directory `adapter_dir` names: itself, or the model/ of a LoRA run directory."""
    path = Path(adapter_dir)
    if not (path / ADAPTER_CONFIG).is_file() and (path / "model" / ADAPTER_CONFIG).is_file():
        path = path / "model"  # `rdepth train/sft --lora --out DIR` writes its adapter as DIR/model
    if not (path / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{path} is not a LoRA adapter directory: no {ADAPTER_CONFIG} (save one with "
                         f"PeftModel.save_pretrained or rdepth train --lora)")
    return path


ADAPTER_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json's true / false fields that change what the adapter computes
BOOL_FIELDS = ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "use_qalora", "inference_mode")
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


def check_adapter_files(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The safetensors header of the adapter in `path`, after checking what peft would otherwise trust:
    adapter_config.json's fields (a string rank was a TypeError, a rank of 10**9 a 256 GB allocation, a NaN
    alpha garbage), and a weight file that is a regular safetensors file of floating-point LoRA tensors
    (a FIFO hung, /dev/zero was a traceback, a missing file a Hub lookup, adapter_model.bin a pickle)."""
    from recurrent_depth.files import clipped, parse_safetensors_header

    config = read_adapter_config(path)
    source = path / ADAPTER_CONFIG
    recorded_base_dir(path)  # (read after the adapter loads: a bad one fails here, before)

    def bad(field: str, expected: str) -> ValueError:
        return ValueError(f"{source}: {field}={clipped(config.get(field))} is invalid: expected {expected}")

    if config.get("peft_type") != "LORA":
        raise bad("peft_type", '"LORA" (only LoRA adapters load here)')
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise bad("r", "an integer >= 1")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not (math.isfinite(alpha) and alpha > 0):
        raise bad("lora_alpha", "a finite number > 0")
    dropout = config.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise bad("lora_dropout", "a number in [0, 1)")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        raise bad("target_modules", "a module name pattern or a non-empty list of module names")
    # peft tests these by truth: use_rslora="false" scaled the adapter by alpha/sqrt(r), not alpha/r, silently
    for field in BOOL_FIELDS:
        if config.get(field) is not None and not isinstance(config[field], bool):
            raise bad(field, "true or false")
    if config.get("megatron_config") is not None:  # (peft then imports the module `megatron_core` names)
        raise bad("megatron_config", "null (Megatron-parallel LoRA layers are not supported here)")
    for field, number in (("rank_pattern", "an integer >= 1"), ("alpha_pattern", "a finite number > 0")):
        pattern = config.get(field) or {}
        values = list(pattern.values()) if isinstance(pattern, dict) else [None]
        if not all(not isinstance(v, bool) and isinstance(v, int if field == "rank_pattern" else int | float)
                   and math.isfinite(v) and v > 0 for v in values):
            raise bad(field, f"an object of module names to {number}")
    # The largest scale any module gets (a pattern's alpha may pair with a pattern's rank: the extremes bound it)
    all_alphas = [alpha, *(config.get("alpha_pattern") or {}).values()]
    all_ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    field = "lora_alpha" if max(all_alphas) == alpha else "alpha_pattern"
    check_lora_scale(max(all_alphas), min(all_ranks), rslora=bool(config.get("use_rslora")),
                     field=f"{source}: {field}={clipped(config.get(field))}")
    weights = path / ADAPTER_WEIGHTS
    if not weights.exists() and not weights.is_symlink():
        other = " (it holds adapter_model.bin, a pickle, which this library does not unpickle: convert it " \
                "to safetensors where you trust it)" if (path / "adapter_model.bin").exists() else ""
        raise ValueError(f"LoRA adapter {path} has no {ADAPTER_WEIGHTS}{other}")
    header = parse_safetensors_header(weights)
    ranks = [shape[0] for name, (_, shape) in header.items() if ".lora_A." in f".{name}" and len(shape) == 2]
    if not ranks:
        raise ValueError(f"weights file {weights} holds no LoRA tensors (lora_A / lora_B)")
    floats = [name for name, (dtype, _) in header.items() if dtype not in FLOAT_DTYPES]
    if floats:
        raise ValueError(f"weights file {weights}: tensor {clipped(floats[0])} is {header[floats[0]][0]}, "
                         "not floating point")
    largest = max([rank, *(config.get("rank_pattern") or {}).values()])
    if largest > max(ranks):
        raise ValueError(f"{source}: rank {largest} is larger than any lora_A tensor of {weights} "
                         f"(at most {max(ranks)}): the config is not this adapter's")
    return header


def check_adapter_loaded(wrapped: Any, path: Path, header: dict[str, tuple[str, tuple[int, ...]]],
                         adapter_name: str = "default") -> None:
    """A one-line error when the loaded adapter (`adapter_name` of the wrapper) lacks tensors its config asks for
    (peft only warns, and the missing B matrices stay zero: the base model ran as if adapted), holds tensors it
    does not use (peft ignores them) or holds NaN / inf."""
    peft = require_peft()
    from recurrent_depth.files import clipped_names

    expected = peft.get_peft_model_state_dict(wrapped, adapter_name=adapter_name, save_embedding_layers=False)
    missing = [name for name in expected if name not in header]
    if missing:
        raise ValueError(f"weights file {path / ADAPTER_WEIGHTS} lacks {len(missing)} of the {len(expected)} "
                         f"tensors its adapter_config.json asks for, e.g. {clipped_names(missing, 3)}")
    unused = [name for name in header if name not in expected]
    if unused:
        raise ValueError(f"weights file {path / ADAPTER_WEIGHTS} holds {len(unused)} tensors its adapter_config.json "
                         f"does not use (they would be ignored), e.g. {clipped_names(unused, 3)}")
    broken = [name for name, tensor in expected.items() if not bool(torch.isfinite(tensor).all())]
    if broken:
        raise ValueError(f"weights file {path / ADAPTER_WEIGHTS} holds NaN or inf in {len(broken)} tensors, "
                         f"e.g. {clipped_names(broken, 3)}")


def module_name_patterns(model: nn.Module) -> list[str]:
    """`model`'s linear layer names with block indices as {i} (transformer.core_block.{i}.attn.Wqkv, ...)."""
    return sorted({re.sub(r"\.\d+(?=\.|$)", ".{i}", name) for name, module in model.named_modules()
                   if isinstance(module, LINEAR_TYPES)})


TARGET_REGEX_SECONDS = 2.0  # the longest all of an adapter's regexes may take over the module names peft matches
# The extra time a child interpreter (`_matches_in_child`) gets to start: its own timer counts the matching alone
REGEX_CHILD_START_SECONDS = 5.0


class _SlowRegex(Exception):
    """Regex `index` (of those `_timed_matches` was given) was still matching when the time was up."""

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.index = index


def adapter_regexes(config: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The regular expressions peft matches adapter_config.json's fields with against module names, each as (field,
    its text as written, the regex peft matches, "fullmatch" or "match": how it calls it), as peft 0.17-0.21 builds
    them (tuners_utils.check_target_module_exists, utils.other.get_pattern_key): target_modules and exclude_modules
    as strings (a list: names matched by suffix, no regex), each rank_pattern / alpha_pattern key, and
    layers_pattern (with layers_to_transform and a list of target_modules: around each module's layer index)."""
    regexes = [(field, value, value, "fullmatch") for field in SET_FIELDS
               if isinstance(value := config.get(field), str) and value.lower() != ALL_LINEAR]
    for field in ("rank_pattern", "alpha_pattern"):
        keys = config.get(field)
        regexes += [(field, key, rf"(.*\.)?({key})$", "match") for key in (keys if isinstance(keys, dict) else {})]
    layers = config.get("layers_pattern")
    layers = [layers] if isinstance(layers, str) else layers if isinstance(layers, list) else []
    regexes += [("layers_pattern", text, rf"(?:^|.*?\.){text}\.(?P<idx>\d+)\.", "match") for text in layers
                if isinstance(text, str) and text]
    return regexes


def _match_each(regexes: list[tuple[re.Pattern[str], str]], names: list[str], running: list[int]) -> list[set[str]]:
    """The `names` each of `regexes` matches (pattern, "fullmatch" or "match"); running[0]: the one matching now."""
    found = []
    for index, (pattern, how) in enumerate(regexes):
        running[0] = index
        match = getattr(pattern, how)
        found.append({name for name in names if match(name)})
    return found


def _matches_under_alarm(regexes: list[tuple[re.Pattern[str], str]], names: list[str],
                         seconds: float) -> list[set[str]]:
    """`_match_each`, stopped by SIGALRM after `seconds` (the regex engine checks for signals): main thread only."""
    running = [0]

    def expire(signum: int, frame: Any) -> None:
        raise _SlowRegex

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return _match_each(regexes, names, running)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    except _SlowRegex:  # (also an alarm firing between the last match and the timer's reset: caught here)
        raise _SlowRegex(running[0]) from None
    finally:
        signal.signal(signal.SIGALRM, previous)


# `_matches_in_child`'s child: the standard library alone (no torch: it starts in ~50 ms), its own SIGALRM timer
# (exit 3 when it fires), the index of each regex as it starts, then the indices of the names each one matched
_REGEX_CHILD = """
import json, re, signal, sys
regexes, names, seconds = json.load(sys.stdin)
def expire(signum, frame):
    sys.exit(3)
if hasattr(signal, "setitimer"):
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
found = []
for index, (regex, how) in enumerate(regexes):
    print(index, flush=True)
    match = getattr(re.compile(regex), how)
    found.append([i for i, name in enumerate(names) if match(name)])
if hasattr(signal, "setitimer"):
    signal.setitimer(signal.ITIMER_REAL, 0.0)
print(json.dumps(found), flush=True)
"""


def _matches_in_child(regexes: list[tuple[re.Pattern[str], str]], names: list[str],
                      seconds: float) -> list[set[str]] | None:
    """`_match_each` in a child interpreter, killed when over time; None where no child interpreter can start. Off
    the main thread (the server loads adapters on its scheduler's thread) no timer can stop a regex, and a thread's
    regex holds the GIL: every thread of the process froze while it ran. The child costs ~50-70 ms."""
    if not sys.executable:  # (None or "" where Python cannot tell its own path: subprocess raised a TypeError)
        return None
    command = [sys.executable, "-I", "-S", "-c", _REGEX_CHILD]
    given = json.dumps([[[p.pattern, how] for p, how in regexes], names, seconds])
    try:
        done = subprocess.run(command, input=given, capture_output=True, text=True, check=False,
                              timeout=seconds + REGEX_CHILD_START_SECONDS)
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:  # (run kills the child)
        output, code = exc.stdout, None
    except OSError:  # (no interpreter at sys.executable: an embedding application)
        return None
    output = output.decode(errors="replace") if isinstance(output, bytes) else output or ""
    lines = output.splitlines()
    if code == 0 and lines:
        return [{names[i] for i in found} for found in json.loads(lines[-1])]
    if code in (3, None):
        raise _SlowRegex(int(lines[-1]) if lines and lines[-1].isdigit() else 0)
    detail = (done.stderr.strip().splitlines() or [f"exit status {code}"])[-1]
    raise RuntimeError(f"matching the regular expressions in a child interpreter failed: {detail}")


def _timed_matches(regexes: list[tuple[str, str]], names: list[str], seconds: float) -> list[set[str]]:
    """The `names` each of `regexes` ((regex, "fullmatch" or "match"), valid) matches; _SlowRegex(i) when regex i
    was still matching `seconds` after the first began: a regex that backtracks exponentially (`([\\w.]+)+Z`) took
    hours on a 35-character module name, here and then in peft, which matches the same names the same way. Timed in
    any thread: by SIGALRM in the main thread when no other timer runs, else in a child process."""
    compiled = [(re.compile(regex), how) for regex, how in regexes]
    if not compiled:
        return []
    if (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)):
        return _matches_under_alarm(compiled, names, seconds)
    found = _matches_in_child(compiled, names, seconds)
    return found if found is not None else _match_each(compiled, names, [0])  # (untimed: no child could start)


def _config_source(path: Path) -> str:
    """The start of a one-line error about a field of the adapter config in `path`."""
    return f"cannot load the LoRA adapter {path} onto this model: its {ADAPTER_CONFIG}'s"


def check_adapter_regexes(path: Path, config: dict[str, Any], names: list[str]) -> list[tuple[str, set[str]]]:
    """(field, the `names` it matches) for each of `adapter_regexes(config)` (the adapter in `path`'s), matched as
    peft matches them; a one-line error naming the field for an invalid regex, or for the one still matching when
    all have taken TARGET_REGEX_SECONDS (in all: many pattern keys cannot add up to hours). peft then matches the
    same regexes against `names` (the caller's to make sure), so its own matching ends in about that time too."""
    from recurrent_depth.files import clipped

    regexes = adapter_regexes(config)
    for field, given, regex, _ in regexes:
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"{_config_source(path)} {field}={clipped(given)} is not a valid regular expression "
                             f"({exc})") from None
    try:
        found = _timed_matches([(regex, how) for _, _, regex, how in regexes], names, TARGET_REGEX_SECONDS)
    except _SlowRegex as slow:
        field, given = regexes[slow.index][:2]
        raise ValueError(f"{_config_source(path)} {field}={clipped(given)} takes over {TARGET_REGEX_SECONDS:g} s "
                         f"to match this model's {len(names)} module names (a regular expression that backtracks "
                         f"exponentially?): simplify it, or list the module names") from None
    return [(field, matched) for (field, *_), matched in zip(regexes, found)]


def peft_module_keys(model: nn.Module) -> list[str]:
    """The module names peft matches an adapter's regexes against when it adds one to `model`: every one but the
    insides of its LoRA layers (which it skips), those of its modules_to_save wrappers included
    (`X.original_module`, `X.modules_to_save.<adapter>`), which the base model lacks."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, BaseTunerLayer))
    return [name for name, _ in model.named_modules() if name and not name.startswith(inside)]


def check_adapter_targets(model: nn.Module, path: Path) -> None:
    """A one-line error naming the option when adapter_config.json's `target_modules` (a regex, or names peft
    matches by suffix) or `modules_to_save` names no module of `model`: peft's own messages name neither our
    modules ("Target modules ... not found in the base model") nor, for modules_to_save, the option (a bare
    KeyError of a tensor name); an invalid regex was a traceback (re.error), one that backtracks exponentially a
    hang (`check_adapter_regexes`: all of them, matched against `model`'s module names as peft matches them)."""
    from recurrent_depth.files import clipped, clipped_names

    config = read_adapter_config(path)
    source = _config_source(path)
    names = [name for name, _ in model.named_modules() if name]
    linear = [name for name, module in model.named_modules() if isinstance(module, LINEAR_TYPES)]
    ours = f"this model's linear layers are {clipped_names(module_name_patterns(model), 20)}"
    targets = config.get("target_modules")
    matches = dict(check_adapter_regexes(path, config, names))  # (target_modules: one regex at most)
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        pass  # peft's shorthand, not a regular expression (load_lora expands it)
    elif isinstance(targets, str):
        if not matches["target_modules"].intersection(linear):
            raise ValueError(f"{source} target_modules={clipped(targets)} (a regular expression, matched against "
                             f"whole module names) matches no linear layer of this model; {ours}")
    elif isinstance(targets, list):
        unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in linear)]
        if len(unmatched) == len(targets):
            raise ValueError(f"{source} target_modules={clipped_names(targets)} matches no linear layer of this "
                             f"model (another architecture's names?); {ours}")
    # peft matches each entry as a regex too (`(^|.*\.)ENTRY($|\..*)`): one naming a module (or a dotted suffix of
    # one), as checked here, holds only the characters of module names, no repetition to backtrack over
    saved = config.get("modules_to_save")
    if saved is not None:
        if not (isinstance(saved, list) and all(isinstance(t, str) and t for t in saved)):
            raise ValueError(f"{source} modules_to_save={clipped(saved)} is invalid: expected a list of module "
                             f"names")
        unmatched = [t for t in saved if not any(n == t or n.endswith(f".{t}") for n in names)]
        if unmatched:
            top = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ValueError(f"{source} modules_to_save names {clipped_names(unmatched)}, which this model does not "
                             f"have (another architecture's names?); its modules are {clipped_names(top, 10)}")


def _saved_peft_config(path: Path) -> Any:
    """peft's config of the adapter in `path`; a one-line error where peft cannot build it from the file's fields (a
    wrong-typed sub-config such as eva_config={"rho": "x"} was a TypeError traceback, a task_type peft does not
    know named no file)."""
    peft = require_peft()
    try:
        return peft.PeftConfig.from_pretrained(str(path))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _load_error(exc, path) from None


def _peft_config(model: nn.Module, path: Path, layout: nn.Module | None = None) -> Any:
    """The peft config to load the adapter in `path` onto `model` with, where the saved one needs changing; None:
    the saved one as it is. layout: `model`'s modules without peft's layers (default: `model`), which "all-linear"
    expands over. On int8 / int4 layers: registered for them (`on_quantized_layers`), DoRA refused."""
    layout = model if layout is None else layout
    config = None
    if not hasattr(model, "prepare_inputs_for_generation"):
        # An adapter made with peft on the transformers class says task_type="CAUSAL_LM", whose peft wrapper needs
        # transformers' generation hooks; the layers are the same, so load it as a plain adapter.
        config = _saved_peft_config(path)
        config.task_type = None
    targets = getattr(config, "target_modules", None) if config is not None else read_adapter_config(path).get(
        "target_modules")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        # peft leaves the output head out of "all-linear" only on a transformers model (it asks for its output
        # embeddings): on the library's it took the lm_head too, which the adapter (made on either) does not hold
        config = config if config is not None else _saved_peft_config(path)
        config.target_modules = sorted(name for name, module in layout.named_modules()
                                       if isinstance(module, LINEAR_TYPES) and name.split(".")[-1] != OUTPUT_HEAD)
    if quantized_weights(model):
        refuse_dora_on_quantized(path, held_weights(model))
        config = on_quantized_layers(config if config is not None else _saved_peft_config(path),
                                     model)
    return config


def _load_error(exc: Exception, path: Path) -> ValueError:
    """The one-line error for peft failing to load the adapter in `path` (module names or shapes of another
    model, a tensor the weights file lacks)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # torch's "Error(s) in loading state_dict for PeftModel:" is a header: the first mismatch, after it, says what
    detail = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    if isinstance(exc, KeyError):  # (peft's lookup of a tensor the weights file lacks: a bare tensor name)
        from recurrent_depth.files import clipped

        saved = read_adapter_config(path).get("modules_to_save")
        detail = (f"its weights file lacks tensor {detail}" + (
            f" (adapter_config.json's modules_to_save={clipped(saved)} asks for a trained copy of those modules)"
            if saved else ""))
    return ValueError(f"cannot load the LoRA adapter {path} onto this model: {detail or type(exc).__name__}")


def load_lora(model: nn.Module, adapter_dir: str | Path, trainable: bool = False, strict_base: bool = False,
              model_dir: str | Path | None = None) -> Any:
    """The peft wrapper of `model` with the adapter saved in `adapter_dir` (unmerged). An adapter that records
    another base's fingerprint warns (AdapterBaseWarning), or with strict_base fails (`check_adapter_base`;
    model_dir: where `model` came from, named in that message and recorded by `save_adapter`)."""
    peft = require_peft()
    path = check_adapter_dir(adapter_dir)
    header = check_adapter_files(path)
    check_adapter_targets(model, path)
    config = _peft_config(model, path)
    try:
        wrapped = peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable, config=config)
    # e.g. module names or shapes of another model; re.error: an invalid regex in rank_pattern, alpha_pattern or
    # exclude_modules, which peft compiles (a traceback); TypeError, AttributeError: a field of the wrong type that
    # peft reads as it builds the config (eva_config={"rho": "x"}, arrow_config={...}), a traceback too
    except (KeyError, RuntimeError, ValueError, re.error, TypeError, AttributeError) as exc:
        _strip_peft_layers(model)  # (peft put its layers on `model` before the load failed: `model` as given)
        raise _load_error(exc, path) from None
    check_adapter_loaded(wrapped, path, header)
    try:  # (after the load: an adapter of other shapes fails above, naming what differs, without this warning)
        check_adapter_base(wrapped, path, strict=strict_base, model_dir=model_dir)
    except ValueError:
        wrapped.unload()  # `model` as it was given: peft added the adapter's layers to it in place
        raise
    # saved again (`save_adapter`, e.g. after training it further): the base it is on now, by path and fingerprint
    wrapped.lora_base_record = base_record(wrapped)
    base_dir = model_dir if model_dir is not None else recorded_base_dir(path)
    if model_dir is None and recorded_base(path).get(FINGERPRINT_KEY) not in (None, wrapped.lora_base_record[
            FINGERPRINT_KEY]):
        # on other weights than the recorded base's, from a directory not given: record no path rather than the
        # old base's beside this model's fingerprint (the peft config holds the old one too)
        base_dir = None
        for config in wrapped.peft_config.values():
            config.base_model_name_or_path = None
    wrapped.lora_base_dir = str(Path(base_dir).resolve()) if base_dir is not None else None
    return wrapped


def _untie_adapted_head(model: nn.Module) -> None:
    """Give a tied lm_head its own copy of the embedding's weight when an adapter is on either of them: peft merges
    into the base weight in place, so merging an adapter of the head also changed the embedding (and one of the
    embedding the head), and the merged model computed something else than the unmerged one."""
    head, transformer = getattr(model, "lm_head", None), getattr(model, "transformer", None)
    if head is None or not isinstance(transformer, nn.ModuleDict) or "wte" not in transformer:
        return
    head_layer = getattr(head, "base_layer", head)
    embedding = getattr(transformer["wte"], "base_layer", transformer["wte"])
    adapted = head_layer is not head or embedding is not transformer["wte"]
    weight = getattr(head_layer, "weight", None)
    if adapted and isinstance(weight, nn.Parameter) and weight is getattr(embedding, "weight", None):
        head_layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)


def merge_lora(model: Any) -> nn.Module:
    """The base model with every adapter added into its weights (W + scale B A), peft's layers removed; refused on
    int8 / int4 weights (merge on the float model, then quantize)."""
    if not is_peft_model(model):
        raise ValueError(f"merge_lora takes a peft model (add_lora / load_lora), got {type(model).__name__}")
    if quantized_weights(model):
        raise _merge_refusal(model)
    _untie_adapted_head(model.get_base_model())
    try:
        return model.merge_and_unload()
    except (RuntimeError, ValueError) as exc:  # e.g. lora_bias=True on layers without a bias: peft cannot merge it
        detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ValueError(f"cannot merge this LoRA adapter into the weights: {detail} (use it unmerged: "
                         f"rdepth generate/serve/eval/analyze --lora)") from None


def attach_adapter(model: nn.Module, adapter_dir: str | Path, strict_base: bool = False,
                   model_dir: str | Path | None = None) -> nn.Module:
    """`model` itself with the saved adapter on its layers, unmerged (generation applies it on every path);
    strict_base, model_dir: as for `load_lora`."""
    return load_lora(model, adapter_dir, strict_base=strict_base, model_dir=model_dir).get_base_model()


def several_adapter_name(index: int) -> str:
    """The peft name of adapter `index` of `load_loras`. peft picks an adapter's tensors by substring ("name in
    key"), so no name may be part of another's or of a module's: the trailing "_" keeps "lora1_" out of "lora10_"."""
    return f"lora{index}_"


def load_loras(model: nn.Module, adapter_dirs: list[str | Path], strict_base: bool = False,
               model_dir: str | Path | None = None) -> Any:
    """The peft wrapper of `model` holding several saved adapters at once, unmerged, adapter i under
    `several_adapter_name(i)`, all turned off (`use_adapter` turns one on): one base serving several
    fine-tunes. Each adapter is checked as `load_lora` checks one (files, targets, shapes, loaded tensors,
    the base fingerprint; strict_base, model_dir: as there), the files and targets of all before any loads."""
    require_peft()  # (a clear error before anything is read)
    if not adapter_dirs:
        raise ValueError("load_loras needs at least one adapter directory")
    paths = [check_adapter_dir(d) for d in adapter_dirs]
    headers = [check_adapter_files(p) for p in paths]
    for path in paths:
        check_adapter_targets(model, path)
    configs = [_peft_config(model, p) for p in paths]  # (before peft adds its layers, which all-linear would take)
    wrapped: Any = None
    try:
        for i, (path, config) in enumerate(zip(paths, configs)):
            wrapped = _load_named(model, wrapped, path, several_adapter_name(i), config, headers[i], strict_base,
                                  model_dir)
    except ValueError:
        if wrapped is not None:
            wrapped.unload()  # `model` as it was given
        raise
    use_adapter(wrapped, None)
    return wrapped


def _load_named(model: nn.Module, wrapped: Any, path: Path, name: str, config: Any,
                header: dict[str, tuple[str, tuple[int, ...]]], strict_base: bool,
                model_dir: str | Path | None) -> Any:
    """`wrapped` (None: a new peft wrapper of `model`) with the adapter in `path` loaded as peft adapter `name`
    (config: `_peft_config`'s; header: `check_adapter_files`'), checked as `load_lora` checks one. All or nothing:
    on a ValueError the adapter is gone again (a new wrapper unloaded: `model` as it was given)."""
    peft = require_peft()
    fresh = wrapped is None
    try:
        try:
            if fresh:
                wrapped = peft.PeftModel.from_pretrained(model, str(path), adapter_name=name, config=config)
            else:
                # peft matches the regexes against the names `model` has now: the modules_to_save wrappers of the
                # adapters already on it add some (`check_adapter_targets` timed them over the base's alone)
                check_adapter_regexes(path, read_adapter_config(path), peft_module_keys(model))
                if config is not None:  # (load_adapter then loads only the weights, under this config)
                    config.inference_mode = True
                    wrapped.add_adapter(name, config)
                wrapped.load_adapter(str(path), adapter_name=name)
        # (re.error: an invalid regex in rank_pattern, alpha_pattern or exclude_modules, which peft compiles: it
        # was a 500 "internal error" of the server, and left a half-added adapter on the wrapper; TypeError,
        # AttributeError: a wrong-typed sub-config, as in load_lora)
        except (KeyError, RuntimeError, ValueError, re.error, TypeError, AttributeError) as exc:
            raise _load_error(exc, path) from None
        check_adapter_loaded(wrapped, path, header, adapter_name=name)
        check_adapter_base(wrapped, path, strict=strict_base, model_dir=model_dir)
    except ValueError:
        if fresh and wrapped is not None:
            wrapped.unload()
        elif fresh:
            # peft's from_pretrained put its layers on `model` before its load failed (e.g. a tensor of another
            # shape), and returned no wrapper to unload: left there, they ran a half-loaded adapter on every request
            # to the base, and each later load (a new wrapper on top) failed
            _strip_peft_layers(model)
        elif name in wrapped.peft_config:
            wrapped.delete_adapter(name)
        raise
    return wrapped


def _strip_peft_layers(model: nn.Module) -> None:
    """`model` without the layers (and `peft_config`) a failed peft load left on it: each peft layer replaced by
    the layer it wraps. (A helper of `_load_named`.)"""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    replaced: list[str] = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(f"{prefix}.") for prefix in replaced):  # (inside a layer already replaced)
            continue
        if isinstance(module, ModulesToSaveWrapper):
            inner = module.original_module
        elif isinstance(module, BaseTunerLayer):
            inner = module.get_base_layer()
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, inner)
        replaced.append(name)
    if "peft_config" in vars(model):
        del model.peft_config


def add_named_lora(model: nn.Module, wrapped: Any, adapter_dir: str | Path, name: str, layout: nn.Module,
                   strict_base: bool = False, model_dir: str | Path | None = None) -> Any:
    """One more adapter on a served base (`rdepth serve --lora-updates-root`): the peft wrapper `wrapped` of
    `model` (None: `model` has none yet) with the adapter in `adapter_dir` loaded as peft adapter `name` (one
    `several_adapter_name` gives, never reused), off, after `load_loras`' checks. `layout`: a model of the base's
    modules without peft's layers (e.g. built on the meta device), which the adapter's targets are read against.
    Nothing changes on a ValueError."""
    path = check_adapter_dir(adapter_dir)
    header = check_adapter_files(path)
    check_adapter_targets(layout, path)
    wrapped = _load_named(model, wrapped, path, name, _peft_config(model, path, layout), header, strict_base,
                          model_dir)
    use_adapter(wrapped, None)
    return wrapped


def remove_named_lora(wrapped: Any, name: str) -> Any:
    """`wrapped` without its peft adapter `name`, the others off; None once none is left (its model as it was
    given: peft's layers removed)."""
    if set(wrapped.peft_config) == {name}:
        wrapped.unload()
        return None
    with warnings.catch_warnings():  # ("Adapter ... was active which is now deleted": all go off below)
        warnings.simplefilter("ignore", UserWarning)
        wrapped.delete_adapter(name)
    for param_name, param in wrapped.named_parameters():  # (peft's delete turns another adapter on, trainable)
        if "lora_" in param_name:
            param.requires_grad_(False)
    use_adapter(wrapped, None)
    return wrapped


def use_adapter(wrapped: Any, name: str | None) -> None:
    """Turn on adapter `name` of a peft wrapper holding several (`load_loras`) and turn the others off; None: all
    off, the wrapped model computes exactly what the base model alone does. The adapters stay frozen, as
    `load_lora`'s are (peft's set_adapter makes the one it turns on trainable: the autograd graphs of TTT-E2E's and
    GradMem's passes on a served model then also held that adapter's branch, unlike under `--lora`)."""
    if name is None:
        wrapped.base_model.disable_adapter_layers()
        return
    wrapped.base_model.enable_adapter_layers()
    wrapped.set_adapter(name)
    for param_name, param in wrapped.named_parameters():
        if name in param_name:  # (peft's own test for an adapter's tensors: `several_adapter_name` keeps it exact)
            param.requires_grad_(False)


def adapter_base_dir(adapter_dir: str | Path) -> Path:
    """The base model directory an adapter records (`base_model_name_or_path`), relative ones from the adapter."""
    path = check_adapter_dir(adapter_dir)
    base = recorded_base_dir(path)
    if base is None:
        raise ValueError(f"{path / ADAPTER_CONFIG} names no base model (base_model_name_or_path): pass the base "
                         "model directory explicitly")
    if Path(base).is_absolute():
        return Path(base)
    # Relative: from the adapter (an adapter moved with its base), else from the working directory
    # (adapters saved before paths were recorded absolute took it from there).
    return path / base if (path / base).exists() or not Path(base).exists() else Path(base)


def load_adapter_model(adapter_dir: str | Path, base: str | Path | None = None, merge: bool = False,
                       strict_base: bool = False, **load_kwargs: Any) -> nn.Module:
    """A `RecurrentDepthLM` from `base` (default: the adapter's recorded base) with the adapter on it:
    unmerged (its layers carry the adapter) or, with merge, added into the weights. Weights other than the
    ones the adapter was trained on warn, or with strict_base fail (`check_adapter_base`)."""
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    base = base if base is not None else adapter_base_dir(adapter_dir)
    model = RecurrentDepthLM.from_pretrained(base, **load_kwargs)
    wrapped = load_lora(model, adapter_dir, strict_base=strict_base, model_dir=base)
    return merge_lora(wrapped) if merge else wrapped.get_base_model()


# ---------------------------------------------------------------------------------------------- CLI
def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """`--lora` and the spec's flags, for commands that train (`rdepth train`, `rdepth sft`, `rdepth rl`)."""
    group = parser.add_argument_group("LoRA (peft; needs recurrent-depth[lora])")
    group.add_argument("--lora", action="store_true",
                       help="train a LoRA adapter instead of every weight; the run's model/ directory then holds a "
                            "peft adapter (adapter_config.json + adapter_model.safetensors) for the --init-from model")
    group.add_argument("--lora-rank", type=int, default=LoraSpec.rank, help="LoRA rank r (default %(default)s)")
    group.add_argument("--lora-alpha", type=float, default=LoraSpec.alpha,
                       help=f"LoRA alpha: the update is scaled by alpha / r (a scale above {MAX_LORA_SCALE:g} is "
                            "refused; default %(default)s)")
    group.add_argument("--lora-dropout", type=float, default=LoraSpec.dropout,
                       help="dropout on the adapter's input in training (default %(default)s)")
    group.add_argument("--lora-parts", default=None,
                       help=f"comma-separated parts that get adapters, of {','.join(PARTS)} (default: every part the "
                            "model has; one named that it lacks, e.g. Parcae's or Ouro's adapter, is refused)")
    group.add_argument("--lora-kinds", default=",".join(KINDS),
                       help=f"comma-separated layer kinds inside blocks, of {','.join(KINDS)} (default: both)")
    # (the flag here, not cli.common's add_weights_arg, whose meaning is a load's: cli/ imports train/, not back)
    group.add_argument("--weights", default=None, metavar="FORMAT",
                       help="QLoRA: train the adapter on the base's transformer linear layers quantized to 'int8', "
                            "'int4' (group 32), 'int4:g64' / 'int4:g128' / 'int4:g256', or QLoRA's 'nf4' (blocks "
                            "of 64; 'nf4:g32' ... 'nf4:g256'), frozen (needs --lora); the "
                            "adapter saved is an ordinary one, for the float model as for a --weights load of it "
                            "(docs/post-training.md). Default: the float weights")


def lora_spec_from_args(args: argparse.Namespace) -> LoraSpec | None:
    """The `LoraSpec` that `add_lora_arguments`' flags describe, or None without `--lora`."""
    if not args.lora:
        defaults = {"lora_rank": LoraSpec.rank, "lora_alpha": LoraSpec.alpha, "lora_dropout": LoraSpec.dropout,
                    "lora_parts": None, "lora_kinds": ",".join(KINDS), "weights": None}
        given = ["--" + name.replace("_", "-") for name, value in defaults.items() if getattr(args, name) != value]
        if given:
            if given == ["--weights"]:
                raise ValueError(f"--weights {args.weights} trains a LoRA adapter on quantized base weights (QLoRA: "
                                 "int8 / int4 weights are frozen, only an adapter trains on them): add --lora (or "
                                 "leave --weights out)")
            raise ValueError(f"{', '.join(given)} shape a LoRA adapter: add --lora (or leave them out)")
        return None

    def names(text: str) -> tuple[str, ...]:
        return tuple(name.strip() for name in text.split(",") if name.strip())

    return LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                    parts=None if args.lora_parts is None else names(args.lora_parts),
                    kinds=names(args.lora_kinds), weights=args.weights)
