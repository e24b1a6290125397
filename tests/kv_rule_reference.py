"""The KV rules written plainly, for the storage tests (test_kv_policies, test_kv_pool_rules).

For a column that ran `depth` steps, read by a later token at core step `step`: the slot rule maps
steps to slots (per-step: its own; shared-K: step mod K; last-step: one; anchor-K: steps past K share
slot K); the column holds, in each slot, the latest step of that slot it ran; a slot it did not reach
holds its deepest step (lookup deepest), or hides the column (lookup full); lookup skip hides the
column from every step it did not reach.
"""

from __future__ import annotations

SLOT_OF = {"per-step": lambda s: s, "shared-3": lambda s: s % 3, "last-step": lambda s: 0,
           "anchor-2": lambda s: min(s, 2)}


def reference_read(spec: str, written: dict, depth: int, step: int, col: int, row: int) -> tuple[bool, object]:
    """(visible, key) the rule gives for an older column that ran `depth` steps, read at `step`."""
    slot_of = SLOT_OF[spec.split("+")[0]]
    if spec.endswith("+skip") and depth <= step:
        return False, None
    same = [s for s in range(depth) if slot_of(s) == slot_of(step)]
    if spec.endswith("+full") and not same:  # full: hidden where it did not write the slot
        return False, None
    held = max(same) if same else depth - 1  # the latest step of this slot it ran, else its deepest
    return True, written[(held, col, row)]
