"""Behaviour a mutation hunt found unpinned (recurrence, exit criteria, KV policies, depth sampling, the recent
window): each test states the documented rule with a plain reference, so a flipped comparison, an off-by-one or a
dropped statement in that code fails here."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.criteria import ExitCriterion, RowCriterion, resolve_criterion
from recurrent_depth.inference.kv_window import RecentWindow
from recurrent_depth.model.cache import (
    AlwaysLast,
    Anchor,
    Deepest,
    FlatGroups,
    Full,
    PerStep,
    Randomized,
    SharedBudget,
    Skip,
    combine_key_mask,
    grown_slot_count,
    parse_kv_policy,
)
from recurrent_depth.model.depth import truncate


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.double(), -1)
    return -(p * p.log()).sum(-1)


# ---------------------------------------------------------------------------------------- exit criteria
def test_entropy_diff_is_the_absolute_entropy_change_from_h0_100():
    """|H(p_t) - H(p_{t-1})| with H_0 = 100 (the criteria table); exits below the threshold."""
    torch.manual_seed(0)
    crit = ExitCriterion(*resolve_criterion("entropy-diff", 0.05))
    crit.start(torch.zeros(2, 3), 6)
    steps = [torch.randn(2, 6), torch.randn(2, 6)]
    steps.append(steps[1] + torch.tensor([[0.0] * 6, [0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]))  # row 0 unchanged
    previous = torch.full((2,), 100.0, dtype=torch.float64)
    for logits in steps:
        met = crit.update(None, logits)
        expected = (_entropy(logits) - previous).abs()
        torch.testing.assert_close(crit.last_statistic.double(), expected, rtol=1e-5, atol=1e-6)
        assert met.tolist() == (expected < 0.05).tolist()
        previous = _entropy(logits)
    assert met.tolist() == [True, False]


def test_latent_diff_is_the_relative_step_averaged_over_real_positions():
    """||s_t - s_{t-1}|| / ||s_t|| per position, a prompt's row averaging only its real positions."""
    torch.manual_seed(0)
    s0, s1 = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    valid = torch.tensor([[True, True, True], [False, False, True]])  # row 1 left-padded to one real position
    crit = ExitCriterion(*resolve_criterion("latent-diff", None))
    crit.start(s0, 8, valid)
    crit.update(s1, None)
    per_position = (s1 - s0).norm(dim=-1) / s1.norm(dim=-1)
    expected = torch.stack([per_position[0].mean(), per_position[1, 2]])
    torch.testing.assert_close(crit.last_statistic, expected)
    # a state that moved 1% of its norm exits at the default 0.03, one that moved 10% does not
    crit.start(s0[:, 0], 8)
    moved = s0[:, 0].clone()
    moved[0] *= 1.01
    moved[1] *= 1.1
    assert crit.update(moved, None).tolist() == [True, False]


def test_minp_kl_filters_both_distributions_before_the_kl():
    """Probabilities under 0.1 x the row's largest become 1/V and the row is renormalised, then KL(p_{t-1} || p_t)
    (p_0 uniform): only the kept tokens' changes count."""
    V = 5

    def filtered(probs: torch.Tensor) -> torch.Tensor:
        out = torch.where(probs < 0.1 * probs.max(-1, keepdim=True).values, torch.tensor(1.0 / V, dtype=probs.dtype),
                          probs)
        return out / out.sum(-1, keepdim=True)

    crit = ExitCriterion(*resolve_criterion("minp-kl", None))
    crit.start(torch.zeros(1, 2), V)
    first = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.04, 0.01]]))
    second = torch.log(torch.tensor([[0.6, 0.3, 0.01, 0.05, 0.04]]))  # only the filtered tail moved
    uniform = torch.full((1, V), 1.0 / V, dtype=torch.float64)
    q1 = filtered(first.double().exp())
    crit.update(None, first)
    torch.testing.assert_close(crit.last_statistic.double(), (uniform * (uniform / q1).log()).sum(-1), rtol=1e-5,
                               atol=1e-7)
    assert crit.update(None, second).item()  # the same filtered distribution: KL 0 < 1e-5
    assert crit.last_statistic.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", ["kl", "minp-kl", "entropy-diff", "latent-diff", "cosine"])
def test_threshold_zero_never_exits_even_when_nothing_changes(name):
    """The statistics are >= 0 and exit is `<` threshold: threshold 0 is fixed depth, even at a statistic of 0."""
    crit = ExitCriterion(*resolve_criterion(name, 0))
    state, logits = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    crit.start(state, 4)
    for _ in range(3):
        assert not crit.update(state, logits).any()
    assert crit.last_statistic.item() == 0.0


def test_row_criterion_keeps_each_rows_statistics_apart():
    """Rows that start their tokens at different steps (the serving batch) get what one criterion per row gives."""
    torch.manual_seed(0)
    spec, threshold = resolve_criterion("argmax-stability", 2)
    rows = RowCriterion(spec, threshold, capacity=3, vocab_size=4)
    alone = [ExitCriterion(spec, threshold) for _ in range(3)]
    logits = [torch.randn(3, 4) for _ in range(6)]
    for t, step in enumerate(logits):
        starting = [r for r in range(3) if t == r]  # row r starts its token at step r
        if starting:
            rows.start(torch.tensor(starting), torch.zeros(len(starting), 2))
            for r in starting:
                alone[r].start(torch.zeros(1, 2), 4)
        active = list(range(min(t + 1, 3)))
        met = rows.update(torch.tensor(active), torch.zeros(len(active), 2), step[active])
        expected = [bool(alone[r].update(None, step[r : r + 1])) for r in active]
        assert met.tolist() == expected
        assert rows.store["count"][active].tolist() == [int(alone[r].count) for r in active]


# ---------------------------------------------------------------------------------------- depth sampling
def test_truncate_refuses_a_negative_total_and_splits_a_short_one():
    """no_grad = max(r - k, 0), grad = min(r, k): a total under k runs every step under autograd."""
    assert truncate(3, 8) == (0, 3)
    assert truncate(0, 1) == (0, 0)
    for total in (-1, -2):
        with pytest.raises(ValueError, match="total_steps"):
            truncate(total, 4)
    assert truncate(40, 8) == (32, 8)


def test_row_criterion_move_carries_a_rows_statistics():
    """A row moved to another index (the serving pool compacting) keeps counting where it was."""
    spec, threshold = resolve_criterion("argmax-stability", 2)
    rows = RowCriterion(spec, threshold, capacity=3, vocab_size=4)
    rows.start(torch.tensor([0]), torch.zeros(1, 2))
    same = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert rows.update(torch.tensor([0]), torch.zeros(1, 2), same).tolist() == [False]  # count 0
    assert rows.update(torch.tensor([0]), torch.zeros(1, 2), same).tolist() == [False]  # count 1
    rows.move(0, 2)
    assert rows.update(torch.tensor([2]), torch.zeros(1, 2), same).tolist() == [True]  # count 2 at the new index


# ---------------------------------------------------------------------------------------- the recurrent model
def test_row_columns_context_reads_each_rows_own_columns(tiny_model):
    """One new token per row at column row_columns[b] (the serving pool): keys [0, max + 1) are read, and a row
    sees only the columns up to its own."""
    ids = torch.zeros(3, 1, dtype=torch.long)
    ctx = tiny_model.make_context(ids, row_columns=[2, 5, 4])
    assert ctx.past_len == 5
    assert ctx.positions.tolist() == [[2], [5], [4]]
    expected = torch.arange(6)[None] <= torch.tensor([2, 5, 4])[:, None]
    assert torch.equal(ctx.key_valid, expected)
    assert torch.equal(ctx.attn_mask, expected[:, None, None, :])
    even = tiny_model.make_context(ids, row_columns=[3, 3, 3])  # rows of one length: plain causal over [0, 4)
    assert even.past_len == 3 and even.key_valid is None and even.attn_mask is None



def test_a_depth_pair_may_reach_the_ceiling_but_not_pass_it(tiny_model):
    """num_steps=(n, k) runs n + k core steps: up to max_depth in all, as an int may."""
    top = tiny_model.max_depth
    assert tiny_model.resolve_num_steps((top - 3, 3)) == (top - 3, 3)
    assert tiny_model.resolve_num_steps(top) == (0, top)
    for too_deep in ((top - 2, 3), top + 1):
        with pytest.raises(ValueError, match="depth ceiling"):
            tiny_model.resolve_num_steps(too_deep)
    assert tiny_model.resolve_num_steps(0) == (0, 0)
    for negative in (-1, (-1, 2)):
        with pytest.raises(ValueError, match="is invalid"):
            tiny_model.resolve_num_steps(negative)


@pytest.mark.parametrize("injection", ["add", "none"])
def test_injection_add_and_none_feed_the_core_the_documented_input(injection):
    """add: x_i = s_{i-1} + e; none: x_i = s_{i-1} (Ouro), as config.INJECTIONS says."""
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", injection=injection)).eval()
    state, e = torch.randn(1, 2, model.config.hidden_size), torch.randn(1, 2, model.config.hidden_size)
    torch.testing.assert_close(model.inject(state, e), state + e if injection == "add" else state)


def test_soft_capped_logits_are_capped_in_float32_unless_transformers_rounding():
    """cap * tanh(logits / cap) in float32 from a bf16 model's lm_head output (transformers' rounding: in bf16)."""
    torch.manual_seed(0)
    for rounding in (False, True):
        config = rd.ModelConfig.from_preset("tiny", final_logit_softcapping=3.0, transformers_rounding=rounding,
                                            rope_style="half" if rounding else "interleaved")
        model = rd.RecurrentDepthLM(config).to(torch.bfloat16).eval()
        x = torch.randn(1, 4, config.hidden_size, dtype=torch.bfloat16) * 4
        raw = model.lm_head(model.transformer.ln_f(x))
        raw = raw if rounding else raw.float()
        expected = (torch.tanh(raw / 3.0) * 3.0).float()
        got = model.head(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------- the recent window
def _window_step(window: RecentWindow, col: int, lanes=((("core", 0), 0), 0)):
    k = torch.full((1, 1, 1, 2), float(col))
    return window.read_and_write([lanes], torch.tensor([[col]]), None, k, -k)  # value -col: told apart from the key


def test_recent_window_holds_exactly_the_last_w_columns():
    """A query at column c reads (c - W, c] exactly; the ring keeps the last W columns written, each at its tag."""
    window = RecentWindow(3)
    for col in range(6):
        exact = _window_step(window, col)
    read = exact.cols[0][exact.in_window()[0, 0]]
    assert sorted(read.tolist()) == [3, 4, 5]
    _, _, tags = window.lanes[((("core", 0), 0), 0)]
    assert sorted(tags.tolist()) == [3, 4, 5]
    held = {int(t): float(window.lanes[((("core", 0), 0), 0)][0][0, i, 0]) for i, t in enumerate(tags)}
    assert held == {3: 3.0, 4: 4.0, 5: 5.0}  # each entry is its own column's key
    # what the call read: each entry's own key and value (the ring's and the call's)
    read_k, read_v, cols = exact.k[0, 0, :, 0], exact.v[0, 0, :, 0], exact.cols[0]
    assert read_k[cols >= 0].tolist() == cols[cols >= 0].float().tolist()
    assert read_v[cols >= 0].tolist() == (-cols[cols >= 0].float()).tolist()
    # a call rewriting column 4 (after a seek back) leaves the old column-4 entry out of what it reads
    exact = _window_step(window, 4)
    assert exact.cols[0].tolist().count(4) == 1
    fresh = RecentWindow(3)  # early columns: a rewritten entry must not come back as any other column
    for col in (0, 1, 2, 1):
        exact = _window_step(fresh, col)
    read = exact.cols[0][exact.in_window()[0, 0]]
    assert sorted(read.tolist()) == [0, 1, 2]  # each once (column 2 is later: the causal mask hides it)
    window.forget_columns(4)  # a truncation to 4 columns: 4 and 5 are gone
    assert sorted(t for t in window.lanes[((("core", 0), 0), 0)][2].tolist() if t >= 0) == [3]


def test_recent_window_rows_and_bytes():
    """forget_row drops a row's lanes, move_row hands them over, logical_nbytes counts the held columns below end
    (real ones only) at one entry's bf16 k and v each."""
    window = RecentWindow(2)
    for row in (0, 1):
        for col in range(3):
            _window_step(window, col, ((("core", 0), 0), row))
    entry = 2 * 2 * 2  # k and v, 2 bf16 values each
    assert window.logical_nbytes(2, None, 3).tolist() == [2 * entry, 2 * entry]
    assert window.logical_nbytes(2, None, 2).tolist() == [entry, entry]  # column 2 is past end
    valid = torch.tensor([[True, False, True], [True, True, True]])
    assert window.logical_nbytes(2, valid, 3).tolist() == [entry, 2 * entry]
    window.move_row(1, 0)
    assert [lane[1] for lane in window.lanes] == [0]
    window.forget_row(0)
    assert window.lanes == {}


# ---------------------------------------------------------------------------------------- KV policies
@pytest.mark.parametrize("rule", [PerStep(), SharedBudget(1), SharedBudget(3), Anchor(2), FlatGroups(3, 2),
                                  FlatGroups(4, 2)], ids=lambda r: r.name)
def test_slot_rules_write_a_prefix_counted_by_entries_and_num_slots(rule):
    """A column that ran d steps wrote exactly the slots {slot(i) : i < d} (every core layer's, for a rule shared by
    the layers), which is the prefix [0, entries(d)); num_slots(d) allocates that many (at least one)."""
    for d in range(12):
        if rule.per_layer:
            written = {rule.slot(i) for i in range(d)}
        else:
            written = {rule.flat_slot(j, i) for i in range(d) for j in range(rule.core_layers)}
        assert written == set(range(int(rule.entries(torch.tensor(d))))), (rule, d)
        assert rule.num_slots(d) == max(1, len(written)), (rule, d)
    # shares_slots: some two steps of one core layer write one slot (what the transformers cache checks)
    layers = range(rule.core_layers) if not rule.per_layer else [0]
    slot_of = (lambda j, i: rule.flat_slot(j, i)) if not rule.per_layer else (lambda j, i: rule.slot(i))
    shared = any(len({slot_of(j, i) for i in range(12)}) < 12 for j in layers)
    assert rule.shares_slots == shared


def test_lookup_rules_pick_the_documented_slots():
    """deepest settles slot s of a column that ran d steps to min(s, d - 1); skip shows the columns that reached the
    step, full those that wrote its slot; always-last reads the highest slot written, randomized floor(u * n) of the
    n slots at or below this one that the column wrote."""
    depth = torch.tensor([[0, 1, 3, 5]])
    fill = Deepest.fill_index(depth, 4)
    assert fill[:, 0].tolist() == [[min(s, max(d - 1, 0)) for d in (0, 1, 3, 5)] for s in range(4)]
    shared = SharedBudget(2)
    assert Skip.visible(3, shared.slot(3), depth, shared).tolist() == [[False, False, False, True]]
    assert Full.visible(3, shared.slot(3), depth, shared).tolist() == [[False, False, True, True]]  # slot 1: d >= 2
    # a column of depth 1 lacks slot 2, so every column is re-picked (the new one reached step 2: 3 slots)
    assert AlwaysLast.read_slots(2, 2, torch.tensor([[1, 4]]), 1, PerStep()).tolist() == [[0, 3, 2]]
    uniform = torch.tensor([[0.99, 0.5, 0.0]])
    picked = Randomized.read_slots(2, 2, torch.tensor([[1, 4]]), 1, PerStep(), lambda rows, n: uniform)
    assert picked.tolist() == [[0, 1, 0]]  # floor(u * min(held, 3)): held 1 -> 0, 4 -> 3 slots, new 3 slots
    # nothing lacks the slot: every column at this step's own slot
    assert AlwaysLast.read_slots(1, 1, torch.tensor([[2, 4]]), 1, PerStep()).tolist() == [[1, 1, 1]]


def test_split_refuses_a_slot_past_the_cache_and_grown_counts_double():
    policy = parse_kv_policy("per-step")
    assert policy.split(("core", 1, 3), 4) == (("core", 1), 3)
    assert policy.split(("prelude", 0), 1) == (("prelude", 0), 0)
    with pytest.raises(RuntimeError, match="exceeds"):
        policy.split(("core", 1, 4), 4)
    assert grown_slot_count(2, 2) == 4 and grown_slot_count(2, 5) == 8 and grown_slot_count(2, 5, 6) == 6
    assert grown_slot_count(4, 3) == 4
    # an official compress-rN on two core layers: one store for both, no per-layer budget
    flat = parse_kv_policy("compress-r4", core_layers=2)
    assert flat.slots == FlatGroups(4, 2) and flat.budget is None and flat.name == "compress-r4+full"
    assert parse_kv_policy("compress-s4", core_layers=2).budget == 2


def test_combine_key_mask_is_causal_over_the_allowed_keys():
    keys = torch.tensor([[True, False, True, True]])
    mask = combine_key_mask(None, keys, 2)  # two queries at columns 2, 3
    assert mask[0, 0].tolist() == [[True, False, True, False], [True, False, True, True]]
    assert combine_key_mask("unchanged", None, 2) == "unchanged"
