"""Generation with every test-time compute control of a recurrent-depth model.

    from recurrent_depth.inference import generate
    out = generate(model, input_ids, max_new_tokens=64, num_steps=32, exit_criterion="kl")
    out.sequences, out.steps, out.exit_reasons, out.cache_bytes

Modules: `engine` (the recurrence engine: prefill, step loop with per-row exits, readout at
depths; every interface iterates the core through it), `cache` (generation storages keyed by
(layer, step) under a `model.cache.KVPolicy`), `criteria` (adaptive exit), `sampling` (token
choice, per-row generators, stops), `runner` (the model pieces, plain and fused),
`autoregressive` / `speculative` / `parallel` (the decoding loops), `gradmem` (memory tokens
written by test-time gradient steps, read instead of the context), `ttt_e2e` (TTT-E2E: test-time
gradient steps on a copy of a weight subset) and `generate` (the entry points).
"""

from recurrent_depth.inference.cache import DynamicRecurrentCache, StaticRecurrentCache, make_cache
from recurrent_depth.inference.criteria import CRITERIA
from recurrent_depth.inference.engine import Recurrence, Stopped
from recurrent_depth.inference.generate import GenerationStream, generate, generate_from_memory, stream_generate
from recurrent_depth.inference.options import GenerationOptions, ResolvedOptions
from recurrent_depth.inference.output import EXIT_REASONS, GenerationOutput, TokenEvent

__all__ = [
    "CRITERIA",
    "EXIT_REASONS",
    "DynamicRecurrentCache",
    "GenerationOptions",
    "ResolvedOptions",
    "GenerationOutput",
    "GenerationStream",
    "Recurrence",
    "StaticRecurrentCache",
    "Stopped",
    "TokenEvent",
    "generate",
    "generate_from_memory",
    "make_cache",
    "stream_generate",
]
