"""Training-free looping of pretrained transformers causal LMs (the research notes' "Reuse Middle Layers").

    from recurrent_depth.looping import LoopConfig, apply_loop, from_pretrained
    model = AutoModelForCausalLM.from_pretrained("runs/llama-demo/model")
    apply_loop(model, LoopConfig(start=2, end=3, iterations=3, rule="damped"))
    model.generate(...)                      # a normal transformers model, looped
    model.save_pretrained("runs/looped")     # config.json carries "loop": {...}
    model = from_pretrained("runs/looped")   # loads and re-applies the loop

See docs/looping.md for the method, the KV "stash" policies and their costs, and the demo's table.
"""

from recurrent_depth.looping.config import MODES, RULES, STASH_POLICIES, WHEN, LoopConfig
from recurrent_depth.looping.loop import Looper, apply_loop, combine, from_pretrained, loop_of, remove_loop
from recurrent_depth.looping.structure import find_decoder_layers

__all__ = [
    "MODES",
    "RULES",
    "STASH_POLICIES",
    "WHEN",
    "LoopConfig",
    "Looper",
    "apply_loop",
    "combine",
    "find_decoder_layers",
    "from_pretrained",
    "loop_of",
    "remove_loop",
]
