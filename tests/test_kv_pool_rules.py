"""The server's slot pool (serving/kv_pool.py) against the KV rules, at the storage level.

`test_kv_policies.py` checks the generation caches against a reference of each rule; this drives
`SlotKVPool` the way the continuous batch does (each prompt prefilled alone, then token calls in
which rows sit at different core steps and close at different depths) and checks every column
each row reads against the same plain rules (`tests/kv_rule_reference.py`):
- slots: per-step keeps slot i for step i; shared-K (last-step = shared-1) keeps slot i mod K;
- lookup deepest: a slot the token did not reach holds its deepest step, d - 1;
- lookup skip: the column is hidden from steps i >= d (the row's own new column stays visible);
- lookup full: the column is hidden from slots it did not write (anchor-K: slot min(i, K)).
The quantized pool (`rdepth serve --kv-quant`) moves code rows by the same rules: `quantized`
reads each column back as the codec's round trip of what was written there (up to float rounding
of the decode at another batch shape).
"""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.inference.quant_cache import KVQuant, layer_codec
from recurrent_depth.model.cache import parse_kv_policy
from recurrent_depth.serving.kv_pool import SlotKVPool, make_pool
from tests.kv_rule_reference import reference_read

R = 5  # core steps of every request
PROMPTS = [2, 4, 3]  # prompt length of each row
TOKENS = [[5, 2, 3, 1], [1, 5, 4, 2], [3, 3, 1, 5]]  # depth of each generated token, per row
START = [0, 2, 1]  # idle calls before a row's first token, so rows in one call are at different steps


@pytest.mark.parametrize("spec", ["per-step", "shared-3", "last-step", "per-step+skip", "shared-3+skip",
                                  "per-step+full", "shared-3+full", "anchor-2", "anchor-2+skip", "anchor-2+full"])
@pytest.mark.parametrize("initial_slots", [64, 1], ids=["sized", "growing"])
@pytest.mark.parametrize("kv_quant", [None, "k=mse:4,v=mse:4,attn=dequantize"], ids=["float", "quantized"])
def test_the_pool_follows_the_rule_with_rows_at_different_steps(spec, initial_slots, kv_quant, monkeypatch):
    """`growing`: the pool starts from one core slot, so slots are added after columns closed at mixed depths."""
    monkeypatch.setattr(SlotKVPool, "INITIAL_SLOTS", initial_slots)
    policy = parse_kv_policy(spec)
    slots = policy.slots.num_slots(R)
    g = torch.Generator().manual_seed(0)
    pool = make_pool(None if kv_quant is None else KVQuant.parse(kv_quant))
    if kv_quant is None:
        stored, same = (lambda x: x), torch.equal
    else:
        codec = layer_codec(kv_quant, "k", 2)
        stored = lambda x: codec.decode(codec.encode(x))  # noqa: E731
        same = lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6)  # noqa: E731
    rows = range(len(PROMPTS))
    pool.reserve(slots, len(PROMPTS), max(PROMPTS) + len(TOKENS[0]), max_rows=4, max_capacity=64)
    written: dict = {}  # (step, col, row) -> key [2]
    depth_of: dict = {}  # (col, row) -> steps that column ran

    for b in rows:  # each prompt alone at full depth
        T = PROMPTS[b]
        pool.set_policy(b, policy)
        pool.bind_prefill(b, T, torch.tensor([[policy.slots.slot(i) for i in range(R)]]))
        for step in range(R):
            k = torch.randn(1, 1, T, 2, generator=g)
            keys, _ = pool.update_heads(("core", 0, step), k, torch.zeros_like(k))
            k = stored(k)
            assert same(keys[0, 0], k[0, 0])  # the prompt attends to itself at this step
            for c in range(T):
                written[(step, c, b)] = k[0, 0, c]
        pool.close_prefill(b, T, R, slots)
        for c in range(T):
            depth_of[(c, b)] = R

    length = list(PROMPTS)  # each row's next column
    token = [0] * len(PROMPTS)  # index of the token each row is working on
    step_of = [-start for start in START]  # core step each row runs next (negative: still idle)
    checked, mixed = 0, False
    while any(t < len(TOKENS[b]) for b, t in enumerate(token)):
        active = [b for b in rows if token[b] < len(TOKENS[b]) and step_of[b] >= 0]
        for b in rows:
            if step_of[b] < 0:
                step_of[b] += 1
        if not active:
            continue
        steps = [step_of[b] for b in active]
        mixed |= len(set(steps)) > 1
        cols = [length[b] for b in active]
        read_len = max(cols) + 1
        pool.bind_tokens(active, torch.tensor(active), torch.tensor(cols), read_len,
                         [policy.slots.slot(s) for s in steps], steps)
        key = ("core", 0, steps[0])  # the pool takes each row's step from bind_tokens
        k = torch.randn(len(active), 1, 1, 2, generator=g)
        keys, _ = pool.update_heads(key, k, torch.zeros_like(k))
        k = stored(k)
        mask = pool.key_mask(key)
        for i, b in enumerate(active):
            for c in range(cols[i]):
                visible, want = reference_read(spec, written, depth_of[(c, b)], steps[i], c, b)
                assert (mask is None or bool(mask[i, c])) == visible, (spec, b, c, steps[i])
                if visible:
                    assert same(keys[i, 0, c], want), (spec, b, c, steps[i])
                    checked += 1
            assert same(keys[i, 0, cols[i]], k[i, 0, 0])  # its own new column, this step
            assert mask is None or bool(mask[i, cols[i]])
            written[(steps[i], cols[i], b)] = k[i, 0, 0]
        done = [(i, b) for i, b in enumerate(active) if steps[i] + 1 == TOKENS[b][token[b]]]
        for b in active:
            step_of[b] += 1
        if done:
            pool.close_tokens([b for _, b in done], [cols[i] for i, _ in done],
                              [TOKENS[b][token[b]] for _, b in done], [slots] * len(done))
            for i, b in done:
                depth_of[(cols[i], b)] = TOKENS[b][token[b]]
                length[b] += 1
                token[b] += 1
                step_of[b] = 0
    assert checked > 50 and mixed  # many (row, column, step) reads, some in calls mixing steps
