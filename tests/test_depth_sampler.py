"""DepthSampler: the paper's log-normal Poisson depth distribution, truncation and determinism.

The distribution checks compare many draws against the exact distribution of
r = Poisson(exp(tau)) + 1, tau ~ N(log r_bar - sigma^2/2, sigma), computed here by numerical
integration over tau (a plain reference independent of torch's samplers). Tolerances are
4 standard errors of the estimate, so a correct sampler fails with probability < 1e-4 per check,
and the draws are seeded, so the outcome is fixed anyway.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recurrent_depth.train.depth import DepthSampler, stream_seed, truncate

NUM_DRAWS = 20_000


def exact_pmf(mean: float, sigma: float, max_r: int) -> np.ndarray:
    """P(r = j) for j = 0 .. max_r (entry 0 is 0), by integrating the Poisson pmf over the normal tau."""
    j = np.arange(max_r)  # Poisson count; r = j + 1
    log_fact = np.array([math.lgamma(x + 1.0) for x in j])
    mu = math.log(mean) - 0.5 * sigma**2
    if sigma == 0:
        lam = np.array([math.exp(mu)])
        weights = np.array([1.0])
    else:
        tau = np.linspace(mu - 9 * sigma, mu + 9 * sigma, 6001)
        weights = np.exp(-0.5 * ((tau - mu) / sigma) ** 2)
        weights /= weights.sum()  # a fine uniform grid: Riemann sum of the normal density
        lam = np.exp(tau)
    log_pois = j[None, :] * np.log(lam)[:, None] - lam[:, None] - log_fact[None, :]
    pmf = np.concatenate([[0.0], weights @ np.exp(log_pois)])
    return pmf


def draws(sampler: DepthSampler, count: int = NUM_DRAWS) -> np.ndarray:
    return np.array([sampler.total_steps(step) for step in range(count)])


def test_exact_reference_reproduces_the_papers_simulated_figures() -> None:
    # huginn-0125.md section 5 (simulated by the authors): E[r] = 33.0, median 29, P(r > 64) ~ 5.8%,
    # P(r < 8) ~ 0.9%. The integration above is the oracle for the sampler tests, so check it first.
    pmf = exact_pmf(32, 0.5, 2000)
    r = np.arange(len(pmf))
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert (pmf * r).sum() == pytest.approx(33.0, abs=1e-6)  # E[r] = r_bar + 1 exactly
    assert int(np.searchsorted(np.cumsum(pmf), 0.5)) == 29
    assert pmf[65:].sum() == pytest.approx(0.058, abs=0.001)
    assert pmf[:8].sum() == pytest.approx(0.009, abs=0.001)


@pytest.mark.parametrize(
    ("mean", "sigma"),
    [(32, 0.5), (8, 0.5), (4.5, 1.0), (6, 0.0)],
    ids=["huginn-r32", "small-r8", "fractional-wide", "plain-poisson"],
)
def test_lognormal_poisson_matches_exact_distribution(mean: float, sigma: float) -> None:
    r = draws(DepthSampler(mean, backprop_depth=4, sigma=sigma, seed=3))
    pmf = exact_pmf(mean, sigma, 4000)
    values = np.arange(len(pmf))
    exact_mean = float((pmf * values).sum())
    exact_var = float((pmf * values**2).sum()) - exact_mean**2
    assert exact_mean == pytest.approx(mean + 1, rel=1e-6)

    assert r.min() >= 1
    assert abs(r.mean() - exact_mean) < 4 * math.sqrt(exact_var / NUM_DRAWS)

    cdf = np.cumsum(pmf)
    exact_median = int(np.searchsorted(cdf, 0.5))
    # the empirical median lands on the exact one unless the cdf is within a few SE of 0.5 there
    assert abs(np.median(r) - exact_median) <= 1

    tail_at = 2 * int(mean)
    p_tail = float(pmf[tail_at + 1 :].sum())
    se_tail = math.sqrt(max(p_tail * (1 - p_tail), 1e-12) / NUM_DRAWS)
    assert abs((r > tail_at).mean() - p_tail) < 4 * se_tail + 1e-4

    # the whole shape: total-variation distance over the bulk of the support
    counts = np.bincount(r, minlength=len(pmf))[: len(pmf)] / NUM_DRAWS
    assert 0.5 * np.abs(counts - pmf).sum() < 0.03


def test_sigma_widens_the_distribution() -> None:
    narrow = draws(DepthSampler(16, 4, sigma=0.0), 4000)
    wide = draws(DepthSampler(16, 4, sigma=1.0), 4000)
    assert wide.std() > 2 * narrow.std()


@pytest.mark.parametrize(
    ("total", "k", "expected"),
    [(1, 8, (0, 1)), (7, 8, (0, 7)), (8, 8, (0, 8)), (9, 8, (1, 8)), (40, 8, (32, 8)), (0, 2, (0, 0))],
    ids=["r1", "r-below-k", "r-equals-k", "r-just-above", "r-deep", "r0"],
)
def test_truncation_rule(total: int, k: int, expected: tuple[int, int]) -> None:
    assert truncate(total, k) == expected


def test_sample_applies_truncation_to_each_draw() -> None:
    sampler = DepthSampler(8, backprop_depth=3, seed=11)
    for step in range(300):
        r = sampler.total_steps(step)
        n, k = sampler.sample(step)
        assert (n, k) == (max(r - 3, 0), min(r, 3))
        assert n + k == r


def test_same_seed_and_step_give_the_same_draw_in_any_order() -> None:
    a = DepthSampler(32, 8, seed=5)
    b = DepthSampler(32, 8, seed=5)  # e.g. another rank, or the sampler rebuilt after a resume
    forward = [a.sample(step) for step in range(200)]
    backward = [b.sample(step) for step in reversed(range(200))][::-1]
    assert forward == backward
    assert a.sample(123_456_789) == b.sample(123_456_789)


def test_draws_neither_read_nor_advance_the_global_rng() -> None:
    sampler = DepthSampler(32, 8, seed=1)
    torch.manual_seed(0)
    first = [sampler.sample(step) for step in range(50)]
    state = torch.get_rng_state()
    torch.manual_seed(999)
    second = [sampler.sample(step) for step in range(50)]
    assert first == second
    torch.manual_seed(0)
    torch.set_rng_state(state)
    [sampler.sample(step) for step in range(5)]
    assert torch.equal(torch.get_rng_state(), state)


def test_different_seeds_and_steps_give_different_streams() -> None:
    seq0 = [DepthSampler(32, 8, seed=0).total_steps(s) for s in range(100)]
    seq1 = [DepthSampler(32, 8, seed=1).total_steps(s) for s in range(100)]
    shifted = [DepthSampler(32, 8, seed=0).total_steps(s) for s in range(1, 101)]
    assert seq0 != seq1
    # mixing, not addition: seed 1 must not replay seed 0 one step later
    assert seq1 != shifted
    assert len({stream_seed(seed, step) for seed in range(20) for step in range(20)}) == 400


def test_fixed_scheme_always_returns_the_mean() -> None:
    sampler = DepthSampler(6, backprop_depth=4, scheme="fixed")
    assert {sampler.sample(step) for step in range(50)} == {(2, 4)}


def test_uniform_scheme_covers_one_to_twice_mean_minus_one() -> None:
    r = draws(DepthSampler(5, backprop_depth=2, scheme="uniform", seed=2), 6000)
    assert set(np.unique(r)) == set(range(1, 10))
    # uniform on 1..9: mean 5, sd sqrt((9^2 - 1) / 12)
    assert abs(r.mean() - 5) < 4 * math.sqrt(80 / 12 / len(r))
    counts = np.bincount(r)[1:] / len(r)
    assert np.abs(counts - 1 / 9).max() < 0.02


def test_max_steps_caps_the_total_depth() -> None:
    capped = DepthSampler(32, 8, seed=4, max_steps=40)
    free = DepthSampler(32, 8, seed=4)
    r_capped = draws(capped, 2000)
    r_free = draws(free, 2000)
    assert r_capped.max() == 40
    assert np.array_equal(r_capped, np.minimum(r_free, 40))
    assert capped.sample(0)[1] <= 8


def test_mean_below_backprop_depth_follows_the_paper_not_the_reference() -> None:
    # r_bar = 2 < k = 8: the paper's formula centres on 2, so E[r] = 3 (the reference code would
    # centre on max(r_bar, k) = 8 and average 9 steps).
    sampler = DepthSampler(2, backprop_depth=8, seed=0)
    r = draws(sampler, 4000)
    pmf = exact_pmf(2, 0.5, 200)
    sd = math.sqrt(float((pmf * np.arange(len(pmf)) ** 2).sum()) - 9.0)
    assert abs(r.mean() - 3.0) < 4 * sd / math.sqrt(len(r))
    # a no-grad prefix appears only when r > k
    with_prefix = np.mean([sampler.sample(step)[0] > 0 for step in range(4000)])
    p_prefix = float(pmf[9:].sum())
    assert abs(with_prefix - p_prefix) < 4 * math.sqrt(p_prefix * (1 - p_prefix) / 4000)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mean_recurrence": 0.5, "backprop_depth": 1}, "mean_recurrence"),
        ({"mean_recurrence": float("nan"), "backprop_depth": 1}, "mean_recurrence"),
        ({"mean_recurrence": True, "backprop_depth": 1}, "mean_recurrence"),
        ({"mean_recurrence": 4.5, "backprop_depth": 1, "scheme": "fixed"}, "mean_recurrence"),
        ({"mean_recurrence": 4, "backprop_depth": 0}, "backprop_depth"),
        ({"mean_recurrence": 4, "backprop_depth": 2.0}, "backprop_depth"),
        ({"mean_recurrence": 4, "backprop_depth": 2, "sigma": -0.1}, "sigma"),
        ({"mean_recurrence": 4, "backprop_depth": 2, "seed": -1}, "seed"),
        ({"mean_recurrence": 4, "backprop_depth": 2, "scheme": "geometric"}, "scheme"),
        ({"mean_recurrence": 4, "backprop_depth": 2, "max_steps": 0}, "max_steps"),
    ],
    ids=[
        "mean<1",
        "mean-nan",
        "mean-bool",
        "fixed-fractional",
        "k0",
        "k-float",
        "sigma<0",
        "seed<0",
        "unknown-scheme",
        "max-steps0",
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DepthSampler(**kwargs)


@pytest.mark.parametrize("step", [-1, 1.5, True], ids=["negative", "float", "bool"])
def test_bad_step_raises(step: object) -> None:
    with pytest.raises(ValueError, match="step"):
        DepthSampler(4, 2).sample(step)  # type: ignore[arg-type]


def test_numpy_integer_scalars_are_steps() -> None:
    import numpy as np

    sampler = DepthSampler(8, 4, seed=3)
    assert sampler.sample(np.int64(17)) == sampler.sample(np.int32(17)) == sampler.sample(17)
    with pytest.raises(ValueError, match="step"):
        sampler.sample(np.int64(-1))


def test_to_dict_round_trips() -> None:
    sampler = DepthSampler(8, 4, sigma=0.3, seed=9, scheme="uniform", max_steps=12)
    assert DepthSampler(**sampler.to_dict()) == sampler


# ---------------------------------------------------------------------------- curriculum and per-rank draws


def test_curriculum_ramps_the_mean_linearly_then_holds_it() -> None:
    sampler = DepthSampler(mean_recurrence=16, backprop_depth=4, seed=0, ramp_steps=100, ramp_start=2.0)
    assert [sampler.mean_at(s) for s in (0, 25, 50, 100, 5000)] == [2.0, 5.5, 9.0, 16.0, 16.0]
    early = sum(sampler.total_steps(s) for s in range(0, 20)) / 20
    late = sum(sampler.total_steps(s) for s in range(1000, 1400)) / 400
    assert early < 6 and 15 < late < 19  # E[r] = mean + 1 on the plateau
    fixed = DepthSampler(mean_recurrence=8, backprop_depth=2, scheme="fixed", ramp_steps=10)
    assert [fixed.total_steps(s) for s in (0, 5, 10)] == [1, 4, 8]  # integer means for fixed/uniform
    plain = DepthSampler(mean_recurrence=16, backprop_depth=4, seed=0)
    assert [sampler.total_steps(s) for s in range(100, 140)] == [plain.total_steps(s) for s in range(100, 140)]


def test_per_rank_draws_differ_between_ranks_and_locked_step_does_not() -> None:
    locked = DepthSampler(mean_recurrence=8, backprop_depth=2, seed=3)
    assert all(locked.sample(s, 0) == locked.sample(s, 1) for s in range(50))
    free = DepthSampler(mean_recurrence=8, backprop_depth=2, seed=3, per_rank=True)
    rank0, rank1 = [free.total_steps(s, 0) for s in range(200)], [free.total_steps(s, 1) for s in range(200)]
    assert sum(a != b for a, b in zip(rank0, rank1)) > 150
    assert rank0 == [free.total_steps(s, 0) for s in range(200)]  # still deterministic per (seed, step, rank)
    assert 7 < sum(rank1) / 200 < 11


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"ramp_steps": -1}, "ramp_steps"), ({"ramp_start": 0.5}, "ramp_start"), ({"per_rank": 1}, "per_rank")],
)
def test_schedule_options_are_checked(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        DepthSampler(mean_recurrence=8, backprop_depth=2, **kwargs)


def test_train_config_turns_the_curriculum_share_into_micro_steps() -> None:
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args
    from recurrent_depth.train.config import TrainConfig

    cfg = TrainConfig(max_steps=200, grad_accum=2, depth_curriculum=0.25)
    assert cfg.curriculum_micro_steps(seq_len=64, world_size=1) == 100
    tokens = TrainConfig(max_steps=None, max_tokens=8 * 64 * 40, depth_curriculum=0.5)
    assert tokens.curriculum_micro_steps(seq_len=64, world_size=2) == 10  # 20 optimizer steps on two ranks
    assert TrainConfig().curriculum_micro_steps(64, 1) == 0
    with pytest.raises(ValueError, match="depth_curriculum"):
        TrainConfig(max_steps=None, max_minutes=5.0, depth_curriculum=0.1)
    with pytest.raises(ValueError, match="depth_curriculum"):
        TrainConfig(depth_curriculum=1.5)
    args = build_parser("train").parse_args(
        ["train", "--depth-curriculum", "0.3", "--depth-curriculum-start", "2", "--depth-per-rank"])
    cfg = config_from_args(args)
    assert (cfg.depth_curriculum, cfg.depth_curriculum_start, cfg.depth_per_rank) == (0.3, 2.0, True)


# ---------------------------------------------------------------------------- one sampler for the model and the trainer


def test_train_depth_re_exports_the_models_sampler() -> None:
    import recurrent_depth.model.depth as model_depth
    import recurrent_depth.train as train
    import recurrent_depth.train.depth as train_depth

    for name in ("DepthSampler", "stream_seed", "truncate", "SCHEMES"):
        assert getattr(train_depth, name) is getattr(model_depth, name)
    assert train.DepthSampler is model_depth.DepthSampler


def test_models_none_draw_and_trainers_draw_agree_given_the_same_generator_state() -> None:
    import recurrent_depth as rd

    config = rd.ModelConfig.from_preset("tiny")
    config.mean_recurrence, config.mean_backprop_depth = 32, 8
    model = rd.RecurrentDepthLM(config).train()
    trainer_sampler = DepthSampler(32, 8, seed=5)  # what the trainer builds from the same config
    # the trainer's per-micro-step stream handed to the model as its forward generator
    model_draws = [model.resolve_num_steps(None, trainer_sampler.generator_for(step)) for step in range(300)]
    assert model_draws == [trainer_sampler.sample(step) for step in range(300)]
    assert len(set(model_draws)) > 20  # a real distribution, not a constant
    # a whole forward: the depth comes first from the generator, then s_0 from the same stream
    ids = torch.randint(0, config.vocab_size, (1, 4))
    assert model(ids, generator=trainer_sampler.generator_for(7)).num_steps == trainer_sampler.sample(7)
    # without a generator both draw from the global torch RNG, the same way
    torch.manual_seed(11)
    from_model = [model.resolve_num_steps(None) for _ in range(50)]
    torch.manual_seed(11)
    assert from_model == [model.depth_sampler().sample_from() for _ in range(50)]
    assert model.depth_sampler() == DepthSampler(mean_recurrence=32, backprop_depth=8)


def test_models_none_draw_needs_a_depth_to_sample_around() -> None:
    import recurrent_depth as rd

    model = rd.RecurrentDepthLM(rd.ModelConfig(prelude_layers=0, coda_layers=0, mean_recurrence=0))
    assert model.eval().resolve_num_steps(None) == (0, 0)  # eval mode runs mean_recurrence steps
    with pytest.raises(ValueError, match="mean_recurrence=0"):
        model.train().resolve_num_steps(None)


def test_expected_total_steps_is_the_mean_of_the_draws() -> None:
    assert DepthSampler(32, 8).expected_total_steps() == 33.0
    assert DepthSampler(6, 2, scheme="uniform").expected_total_steps() == 6.0
    r = draws(DepthSampler(8, 4, seed=2), 4000)
    pmf = exact_pmf(8, 0.5, 400)
    sd = math.sqrt(float((pmf * np.arange(len(pmf)) ** 2).sum()) - 81.0)
    assert abs(r.mean() - DepthSampler(8, 4).expected_total_steps()) < 4 * sd / math.sqrt(len(r))


def test_the_depth_distribution_is_written_once() -> None:
    """No second implementation of the log-normal Poisson draw (or any Poisson / log-normal sampler) in the library;
    the exported remote-code file restates it because it must run without the library, and
    tests/test_remote_training.py checks its draws equal `DepthSampler.sample_from`'s."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    samplers = {"poisson", "Poisson", "lognormal", "LogNormal", "log_normal_", "sample_lognormal_poisson_depth"}
    files = [*(repo / "src" / "recurrent_depth").rglob("*.py"), *(repo / "benchmarks").rglob("*.py")]
    assert len(files) > 50
    where = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "name", None)
            if name in samplers:
                where.add(path.relative_to(repo).as_posix())
    assert where == {"src/recurrent_depth/model/depth.py",
                     "src/recurrent_depth/integrations/remote/modeling_recurrent_depth.py"}
