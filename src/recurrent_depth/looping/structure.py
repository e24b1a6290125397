"""Find a causal LM's decoder layers by module structure, and read / rebuild one layer call.

A decoder-only transformers model keeps its blocks in one `nn.ModuleList` with
`config.num_hidden_layers` entries of one class (Llama's `model.layers`, GPT-2's `transformer.h`);
the module that owns the list calls each block with the hidden states first (positional or
`hidden_states=`) and gets back the new hidden states (a tensor, or a tuple whose first item is one).
Nothing here looks at class names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def num_decoder_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    count = getattr(text_config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"cannot loop {type(model).__name__}: its config has no num_hidden_layers")
    return count


def find_decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The module that runs the decoder layers and the `nn.ModuleList` holding them.

    Raises ValueError naming the reason for a model that is not a decoder-only causal LM with one
    such list (an encoder-decoder, an encoder without an LM head, a model without a layer list).
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"cannot loop {name}: it is not a transformers model (no .config)")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"cannot loop {name}: it is an encoder-decoder model; looping needs a decoder-only causal LM")
    from recurrent_depth.model.recurrent import RecurrentDepthLM

    # (this library's models, as transformers loads them: an Ouro directory's core list would otherwise be
    # found, and the loop's extra passes would write into the recurrence's own KV cache)
    if any(isinstance(m, RecurrentDepthLM) for m in (model, getattr(model, "_core", None))):
        raise ValueError(f"cannot loop {name}: it is a recurrent-depth model, which loops its core already "
                         f"(choose its depth with num_steps)")
    can_generate = getattr(model, "can_generate", None)
    if can_generate is None or not can_generate():
        raise ValueError(
            f"cannot loop {name}: it is not a causal LM that can generate (load it with AutoModelForCausalLM)"
        )
    count = num_decoder_layers(model)
    modules = dict(model.named_modules())
    found = []
    for path, module in modules.items():
        if not isinstance(module, nn.ModuleList) or len(module) != count:
            continue
        kinds = {type(block) for block in module}
        if len(kinds) == 1 and all(any(True for _ in block.parameters()) for block in module):
            found.append(path)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(found)})"
        raise ValueError(
            f"cannot loop {name}: found {what} module lists of {count} same-type decoder layers "
            f"(config.num_hidden_layers); looping needs exactly one"
        )
    path = found[0]
    owner = modules[path.rpartition(".")[0]] if "." in path else model
    return owner, modules[path]


def hidden_of(args: tuple, kwargs: dict[str, Any], where: str) -> torch.Tensor:
    """The hidden states a decoder layer was called with."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise ValueError(f"cannot loop {where}: it is not called with hidden states [B, T, h] first")
    return hidden


def with_hidden(args: tuple, kwargs: dict[str, Any], hidden: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
    """The same layer call with other hidden states."""
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def output_hidden(output: Any, where: str) -> torch.Tensor:
    """The new hidden states in a decoder layer's output (a tensor or a tuple led by one)."""
    hidden = output[0] if isinstance(output, tuple) and output else output
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3:
        raise ValueError(
            f"cannot loop {where}: it does not return hidden states [B, T, h] (got {type(output).__name__})"
        )
    return hidden


def with_output_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """A layer output of the same form carrying other hidden states."""
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    return hidden
