"""recurrent_depth.analysis: trajectories, convergence, PCA, shapes, path independence, correlation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.analysis.classify import (
    ClassifierThresholds,
    classify_tokens,
    classify_trajectory,
    count_kinds,
)
from recurrent_depth.analysis.convergence import distance_to_limit, limit_norms, steps_to_converge
from recurrent_depth.analysis.correlation import token_correlation, token_correlation_reference
from recurrent_depth.analysis.depth_view import change_points, report_steps, settling_step
from recurrent_depth.analysis.path_independence import path_independence, spread_and_separation
from recurrent_depth.analysis.pca import fit_pca, fit_pca_streaming, fit_trajectory_pca
from recurrent_depth.analysis.trajectory import Trajectory, collect_trajectory

# float32 model run vs the same run step by step: identical ops, so only summation order differs.
ATOL_RUN = 1e-5


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.tensor([[5, 17, 200, 3, 17, 99, 42]])


# ----------------------------------------------------------------------------- token correlation
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "left-padded"])
@pytest.mark.parametrize("shape", [(1, 2, 5), (3, 7, 13), (2, 11, 60)], ids=lambda s: "x".join(map(str, s)))
def test_token_correlation_matches_reference_values_and_gradients(shape, masked):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(shape, generator=g, dtype=torch.float64)
    hidden[:, :, 0] += 2.0  # a shared component so the correlation is far from 0
    mask = None
    if masked:
        mask = torch.ones(shape[:2], dtype=torch.long)
        mask[0, : shape[1] // 2] = 0
        if shape[1] // 2 >= shape[1] - 1:  # keep >= 2 real tokens in row 0
            mask[0] = 1
    a = hidden.clone().requires_grad_(True)
    b = hidden.clone().requires_grad_(True)
    fast = token_correlation(a, mask)
    ref = token_correlation_reference(b, mask)
    assert fast.shape == (shape[0],) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)
    fast.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    single = token_correlation(hidden[0], None if mask is None else mask[0])  # [T, h] -> scalar
    assert single.dim() == 0 and float(single) == pytest.approx(float(fast[0].detach()), abs=1e-6)


def test_token_correlation_extremes():
    v = torch.randn(1, 1, 8)
    torch.testing.assert_close(token_correlation(v.expand(2, 6, 8)), torch.ones(2))  # collapse
    eye = torch.eye(5)[None]
    assert float(token_correlation(eye)) == pytest.approx(0.0, abs=1e-7)
    opposite = torch.stack([v[0, 0], -v[0, 0]])[None]
    assert float(token_correlation(opposite)) == pytest.approx(-1.0, abs=1e-6)
    zeros = torch.zeros(1, 4, 8)  # s0 = 0 at init_scale 0: no direction, counted as 0, not NaN
    assert float(token_correlation(zeros)) == 0.0


def test_token_correlation_masks_and_errors():
    hidden = torch.randn(2, 4, 6)
    mask = torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]])
    rows = token_correlation(hidden, mask)
    assert torch.isnan(rows[0]) and not torch.isnan(rows[1])  # one real token: no pair
    torch.testing.assert_close(rows[1], token_correlation(hidden[1]))
    torch.testing.assert_close(token_correlation(hidden, mask.bool()), rows, equal_nan=True)
    assert torch.isnan(token_correlation(torch.randn(1, 1, 6))).all()
    with pytest.raises(ValueError, match=r"hidden must have shape \[batch, seq_len, hidden\]"):
        token_correlation(torch.randn(6))
    with pytest.raises(ValueError, match="mask must have shape"):
        token_correlation(hidden, torch.ones(2, 3))


# ----------------------------------------------------------------------------- trajectories
def test_trajectory_shapes_and_agreement_with_forward(model, ids):
    S = 6
    traj = collect_trajectory(model, ids, S, seed=7)
    B, T, h = 1, ids.shape[1], model.config.hidden_size
    assert traj.raw.shape == traj.normed.shape == (S + 1, B, T, h)
    assert traj.entropy.shape == traj.top_ids.shape == traj.top_probs.shape == (S + 1, B, T)
    assert traj.raw.dtype == np.float32 and traj.top_ids.dtype == np.int64
    out = model(ids, S, init_scale=1.0, generator=torch.Generator().manual_seed(7), output_all_states=True)
    np.testing.assert_allclose(traj.raw, out.all_states.detach().numpy(), atol=ATOL_RUN)
    np.testing.assert_allclose(traj.normed[-1], out.latent_states.detach().numpy(), atol=ATOL_RUN)
    logp = torch.log_softmax(out.logits.detach(), -1)
    np.testing.assert_array_equal(traj.top_ids[-1], logp.argmax(-1).numpy())
    np.testing.assert_allclose(traj.entropy[-1], -(logp.exp() * logp).sum(-1).numpy(), atol=1e-5)
    assert (traj.top_probs > 0).all() and (traj.top_probs <= 1).all()


@pytest.mark.parametrize("layout", [
    dict(block_layout="pre-norm", norm_before_coda=False),  # a retrofitted Llama/Qwen/Gemma: the coda reads s
    dict(block_layout="peri-norm", norm_before_coda=False, step_norm=True, final_norm=False, injection="none",
         state_init="embedding", prelude_layers=0, coda_layers=0),  # Ouro: ln_f after every step, no coda
    dict(injection="diagonal", coda_projection=True),  # Parcae: the coda reads C(ln_f(s))
], ids=["retrofit", "ouro", "parcae"])
def test_predictions_at_each_step_are_the_models_own_readout(layout):
    """The per-step predictions (depth view, report) are what `model(ids, i)` predicts, also where the coda
    does not read ln_f(s): reading ln_f(s) there normed twice or skipped Parcae's projection."""
    torch.manual_seed(0)
    config = rd.ModelConfig(**{**dict(vocab_size=64, hidden_size=32, num_heads=4, intermediate_size=48,
                                      prelude_layers=1, core_layers=1, coda_layers=1), **layout})
    model = rd.RecurrentDepthLM(config).eval()
    ids = torch.tensor([[5, 17, 20, 3, 17, 9]])
    traj = collect_trajectory(model, ids, 3, seed=7)
    for depth in range(4):
        with torch.no_grad():
            logits = model(ids, depth, generator=torch.Generator().manual_seed(7)).logits
        logp = torch.log_softmax(logits, -1)
        np.testing.assert_array_equal(traj.top_ids[depth], logp.argmax(-1).numpy())
        np.testing.assert_allclose(traj.entropy[depth], -(logp.exp() * logp).sum(-1).numpy(), atol=1e-5)


def test_trajectory_is_deterministic_with_a_seed(model, ids):
    a = collect_trajectory(model, ids, 4, seed=11)
    b = collect_trajectory(model, ids, 4, seed=11)
    c = collect_trajectory(model, ids, 4, seed=12)
    np.testing.assert_array_equal(a.raw, b.raw)
    np.testing.assert_array_equal(a.entropy, b.entropy)
    assert not np.allclose(a.raw[0], c.raw[0])
    zero = collect_trajectory(model, ids, 2, init_scale=0.0, seed=None)
    assert not zero.raw[0].any()


def test_trajectory_streams_to_disk_and_reloads(model, ids, tmp_path):
    mem = collect_trajectory(model, ids, 5, seed=3, limit_steps=9)
    disk = collect_trajectory(model, ids, 5, seed=3, limit_steps=9, out_dir=tmp_path / "states")
    assert isinstance(disk.raw, np.memmap)
    loaded = Trajectory.load(tmp_path / "states")
    for name in ("raw", "normed", "entropy", "top_ids", "top_probs", "limit"):
        np.testing.assert_array_equal(getattr(mem, name), getattr(loaded, name), err_msg=name)
    np.testing.assert_array_equal(loaded.input_ids, ids.numpy())
    assert loaded.limit_steps == 9 and loaded.seed == 3 and loaded.num_steps == 5


def test_trajectory_refuses_oversized_runs_in_memory(model, ids):
    with pytest.raises(ValueError, match="pass out_dir=... to stream it to disk"):
        collect_trajectory(model, ids, 4, max_in_memory_bytes=1000)


def test_trajectory_rejects_bad_inputs(model):
    too_long = torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"257 tokens but the model's max_seq_len is 256"):
        collect_trajectory(model, too_long, 2)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="limit_steps=2 is invalid"):
        collect_trajectory(model, ids, 4, limit_steps=2)
    with pytest.raises(ValueError, match="num_steps=-1 is invalid"):
        collect_trajectory(model, ids, -1)
    with pytest.raises(ValueError, match="left padding"):
        collect_trajectory(model, ids, 2, attention_mask=torch.tensor([[1, 0, 1]]))


def test_left_padded_row_matches_the_prompt_alone(model):
    prompt = torch.tensor([[9, 8, 7, 6]])
    batch = torch.tensor([[9, 8, 7, 6], [0, 0, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    alone = collect_trajectory(model, prompt, 5, init_scale=0.0, limit_steps=7)
    padded = collect_trajectory(model, batch, 5, init_scale=0.0, attention_mask=mask, limit_steps=7)
    np.testing.assert_array_equal(padded.positions(1), [2, 3])
    assert padded.states("normed", 1).shape == (6, 2, model.config.hidden_size)
    np.testing.assert_allclose(padded.states("normed", 0), alone.states("normed", 0), atol=ATOL_RUN)
    assert distance_to_limit(padded, row=1).shape == (2, 6)


# ----------------------------------------------------------------------------- convergence
def test_distance_is_zero_at_the_last_step_when_s_star_is_the_same_run(model, ids):
    traj = collect_trajectory(model, ids, 8, seed=5, limit_steps=8)
    d = distance_to_limit(traj)
    assert d.shape == (ids.shape[1], 9)
    assert (d[:, -1] == 0).all()
    assert (d[:, 0] > 0).all()
    longer = collect_trajectory(model, ids, 8, seed=5, limit_steps=12)
    np.testing.assert_array_equal(longer.raw, traj.raw)  # s* runs on from the very same s0
    reference = collect_trajectory(model, ids, 12, seed=5)
    np.testing.assert_allclose(longer.limit, reference.normed[-1], atol=0)
    np.testing.assert_allclose(limit_norms(longer), np.linalg.norm(reference.normed[-1, 0], axis=-1), rtol=1e-6)


def test_distance_needs_a_limit(model, ids):
    with pytest.raises(ValueError, match="limit_steps"):
        distance_to_limit(collect_trajectory(model, ids, 2))


@pytest.mark.parametrize(
    "row, expected",
    [
        ([4.0, 2.0, 0.5, 0.04, 0.0], 3),  # monotone: within 5% of 1.0 from step 3
        ([4.0, 0.01, 0.5, 0.02, 0.01], 3),  # dips early, leaves again: counts the final stay only
        ([4.0, 3.0, 2.0, 1.0, 0.5], -1),  # never within tolerance
        ([0.0, 0.0, 0.0, 0.0, 0.0], 0),
    ],
    ids=["monotone", "non-monotone", "never", "always"],
)
def test_steps_to_converge(row, expected):
    got = steps_to_converge(np.array([row]), np.array([1.0]), tol=0.05)
    assert got.tolist() == [expected]


def test_steps_to_converge_validates():
    with pytest.raises(ValueError, match=r"tol=1.5 is invalid"):
        steps_to_converge(np.zeros((2, 3)), np.ones(2), tol=1.5)
    with pytest.raises(ValueError, match=r"distance must be \[T, S\+1\]"):
        steps_to_converge(np.zeros((2, 3)), np.ones(3))


# ----------------------------------------------------------------------------- PCA
def _svd_reference(data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain PCA by SVD of the centred data: (components [k, h] with our sign rule, variances [k])."""
    _, sing, vt = np.linalg.svd(data - data.mean(0), full_matrices=False)
    comps = vt[:k]
    comps = comps * np.sign(comps[np.arange(k), np.abs(comps).argmax(1)])[:, None]
    return comps, sing[:k] ** 2 / (len(data) - 1)


@pytest.mark.parametrize("n, h", [(300, 13), (9, 40)], ids=["samples>dims", "samples<dims"])
def test_pca_matches_svd_and_is_reproducible(n, h):
    rng = np.random.default_rng(0)
    basis = np.linalg.qr(rng.normal(size=(h, h)))[0]
    data = (rng.normal(size=(n, h)) * np.geomspace(10, 0.1, h)) @ basis.T + 3.0
    k = min(6, n - 1)
    a, b = fit_pca(data, 6), fit_pca(data, 6)
    np.testing.assert_array_equal(a.components, b.components)
    ref_components, ref_variance = _svd_reference(data, k)
    np.testing.assert_allclose(a.components, ref_components, atol=1e-8)
    np.testing.assert_allclose(a.explained_variance, ref_variance, rtol=1e-9)
    stream = fit_pca_streaming(lambda: np.array_split(data, 4), 6)
    np.testing.assert_allclose(stream.components, ref_components, atol=1e-7)
    np.testing.assert_allclose(a.components @ a.components.T, np.eye(k), atol=1e-10)
    assert (np.diff(a.explained_ratio) <= 0).all() and a.explained_ratio.sum() <= 1 + 1e-12
    np.testing.assert_allclose(a.transform(a.mean[None]), 0.0, atol=1e-12)


def test_pca_recovers_a_planted_axis():
    rng = np.random.default_rng(1)
    axis = rng.normal(size=20)
    axis /= np.linalg.norm(axis)
    data = np.outer(rng.normal(size=500) * 10, axis) + rng.normal(size=(500, 20)) * 0.1
    pca = fit_pca(data, 3)
    assert abs(pca.components[0] @ axis) == pytest.approx(1.0, abs=1e-3)
    assert pca.explained_ratio[0] > 0.99


def test_trajectory_pca_streams_large_runs_and_skips_s0(model, ids):
    traj = collect_trajectory(model, ids, 10, seed=2)
    states = traj.states("normed")
    small = fit_trajectory_pca(states, 6)
    streamed = fit_trajectory_pca(states, 6, max_in_memory_bytes=1)
    np.testing.assert_allclose(streamed.components, small.components, atol=1e-6)
    assert small.num_samples == 10 * ids.shape[1]
    assert fit_trajectory_pca(states, 6, skip_initial=False).num_samples == 11 * ids.shape[1]
    with pytest.raises(ValueError, match="num_components=0 is invalid"):
        fit_pca(np.zeros((4, 3)), 0)


# ----------------------------------------------------------------------------- trajectory shapes
def _embed(points: np.ndarray, dims: int = 16, seed: int = 0) -> np.ndarray:
    """Place [n, k] points into a random k-dim subspace of R^dims, offset from the origin."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(dims, points.shape[1])))[0]
    return points @ basis.T + rng.normal(size=dims) * 3


def _synthetic(kind: str, steps: int = 64, noise: float = 1e-3, seed: int = 0) -> np.ndarray:
    i = np.arange(steps + 1, dtype=np.float64)
    rng = np.random.default_rng(seed + 100)
    if kind == "fixed point":  # geometric approach from far away
        x = _embed(np.outer(0.8**i, [4.0, -2.0, 1.0]), seed=seed)
    elif kind == "slow spiral":  # spirals in while braking: still a fixed point
        r = 3.0 * 0.93**i
        x = _embed(np.stack([r * np.cos(0.5 * i), r * np.sin(0.5 * i)], 1), seed=seed)
    elif kind == "orbit":  # a transient, then a circle of period 10 steps
        r = 1.0 + 2.0 * 0.5**i
        x = _embed(np.stack([r * np.cos(2 * np.pi * i / 10), r * np.sin(2 * np.pi * i / 10)], 1), seed=seed)
    elif kind == "multi-frequency orbit":  # a 4-d orbit (two frequencies), as in the paper's fig. 12
        t = 2 * np.pi * i
        x = _embed(np.stack([np.cos(t / 9), np.sin(t / 9), 0.5 * np.cos(t / 4), 0.5 * np.sin(t / 4)], 1), seed=seed)
    elif kind == "slider":  # constant drift along one direction, plus a little wobble
        x = _embed(np.stack([0.1 * i, 0.02 * np.sin(i)], 1), seed=seed)
    elif kind == "constant":
        x = _embed(np.zeros((steps + 1, 2)), seed=seed)
        noise = 0.0
    else:
        raise AssertionError(kind)
    return x + noise * rng.normal(size=x.shape)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("fixed point", "fixed point"),
        ("slow spiral", "fixed point"),
        ("constant", "fixed point"),
        ("orbit", "orbit"),
        ("multi-frequency orbit", "orbit"),
        ("slider", "slider"),
    ],
    ids=lambda v: v.replace(" ", "-"),
)
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_classifier_on_synthetic_trajectories(kind, expected, seed):
    shape = classify_trajectory(_synthetic(kind, seed=seed))
    assert shape.kind == expected, shape


def test_classifier_measures_match_their_definitions():
    circle = classify_trajectory(_synthetic("orbit", noise=0.0))
    line = classify_trajectory(_synthetic("slider", noise=0.0))
    assert line.straightness > 0.95 and circle.straightness < 0.2
    assert circle.extent * circle.scale == pytest.approx(1.0, abs=0.1)  # the tail's radius is the circle's
    assert 0.9 < line.speed_ratio < 1.1 and 0.9 < circle.speed_ratio < 1.1
    # a short arc (a sixth of a turn in the tail) is nearly straight: documented to read as a slider
    i = np.arange(33.0)
    arc = _embed(np.stack([np.cos(i * np.pi / 96), np.sin(i * np.pi / 96)], 1))
    assert classify_trajectory(arc).kind == "slider"


def test_classifier_over_tokens_and_counts():
    states = np.stack([_synthetic(k) for k in ("fixed point", "orbit", "slider", "orbit")], axis=1)
    shapes = classify_tokens(states)
    assert [s.kind for s in shapes] == ["fixed point", "orbit", "slider", "orbit"]
    assert count_kinds(shapes) == {"fixed point": 1, "orbit": 2, "slider": 1}
    assert count_kinds([]) == {"fixed point": 0, "orbit": 0, "slider": 0}


def test_classifier_validates():
    with pytest.raises(ValueError, match="steps\\+1 >= 9"):
        classify_trajectory(np.zeros((5, 3)))
    bad = _synthetic("orbit")
    bad[3, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        classify_trajectory(bad)
    with pytest.raises(ValueError, match="slider_straightness=1.5 is invalid"):
        ClassifierThresholds(slider_straightness=1.5)


# ----------------------------------------------------------------------------- path independence
def test_spread_and_separation_on_known_points():
    base = np.array([[0.0, 0.0], [3.0, 0.0], [3.0, 4.0]])  # tokens 0-1 at 3, 1-2 at 4, 0-2 at 5
    finals = np.stack([base + [0.1, 0.0], base - [0.1, 0.0]])  # every token: the 2 starts 0.2 apart
    spread, separation = spread_and_separation(finals)
    np.testing.assert_allclose(spread, [0.2, 0.2, 0.2])
    np.testing.assert_allclose(separation, [3.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="starts >= 2"):
        spread_and_separation(finals[:1])


def test_path_independence_on_a_model(model, ids):
    pi = path_independence(model, ids, 6, seeds=[1, 2, 3], positions=[0, 4])
    T, h = ids.shape[1], model.config.hidden_size
    assert pi.finals.shape == (3, T, h)
    assert sorted(pi.paths) == [0, 4] and pi.paths[4].shape == (3, 7, h)
    assert (pi.spread > 0).all() and (pi.separation > 0).all()
    np.testing.assert_allclose(pi.ratio, pi.spread / pi.separation)
    # each start's final states are the ones a plain trajectory from that seed reaches
    alone = collect_trajectory(model, ids, 6, seed=2, with_predictions=False)
    np.testing.assert_allclose(pi.finals[1], alone.normed[-1, 0], atol=0)
    np.testing.assert_allclose(pi.paths[4][1], alone.normed[:, 0, 4], atol=0)
    assert set(pi.summary()) >= {"median_ratio", "fraction_ratio_below_1", "seeds"}
    with pytest.raises(ValueError, match="at least 2 distinct seeds"):
        path_independence(model, ids, 2, seeds=[1, 1])
    with pytest.raises(ValueError, match="needs random starts"):
        path_independence(model, ids, 2, seeds=[1, 2], init_scale=0.0)
    with pytest.raises(ValueError, match="position 9 is out of range"):
        path_independence(model, ids, 2, seeds=[1, 2], positions=[9])


def test_path_independence_refuses_a_model_without_random_starts(ids):
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", state_init="embedding", injection="none")).eval()
    with pytest.raises(ValueError, match=r"^path independence needs random starts: this model starts every run "
                                         r"from its embedding \(state_init='embedding', as Ouro\)"):
        path_independence(model, ids, 2, seeds=[1, 2])


def test_package_exports_the_path_independence_function_not_its_module():
    # the submodule of the same name is imported (above, and by report.py); the package name must
    # still be the function, as docs/analysis.md imports it
    import recurrent_depth.analysis
    import recurrent_depth.analysis.report  # noqa: F401
    from recurrent_depth.analysis import path_independence as exported

    assert exported is path_independence
    assert recurrent_depth.analysis.path_independence is path_independence


# ----------------------------------------------------------------------------- depth view
def test_settling_step_and_change_points():
    top = np.array([[5, 5, 5, 5], [1, 2, 2, 2], [1, 2, 1, 3], [7, 8, 7, 7]])
    assert settling_step(top).tolist() == [0, 1, 3, 2]
    assert change_points(top) == [[], [1], [1, 2, 3], [1, 2]]
    assert report_steps(64) == [0, 1, 2, 4, 8, 16, 32, 64]
    assert report_steps(10) == [0, 1, 2, 4, 8, 10]
    with pytest.raises(ValueError, match="top_ids must be"):
        settling_step(np.zeros(3))


# ----------------------------------------------------------------------------- regressions
def test_reused_out_dir_does_not_keep_an_earlier_runs_files(model, ids, tmp_path):
    collect_trajectory(model, ids, 3, limit_steps=5, seed=1, out_dir=tmp_path)
    collect_trajectory(model, ids[:, :4], 2, seed=2, with_predictions=False, out_dir=tmp_path)
    loaded = Trajectory.load(tmp_path)
    assert loaded.raw.shape[:3] == (3, 1, 4)
    # the first run's s* and predictions (other tokens, other s0) must not come back with the second run
    assert loaded.limit is None and loaded.entropy is None and loaded.top_ids is None
    with pytest.raises(ValueError, match="has no limit point"):
        distance_to_limit(loaded)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_init_scale_is_refused(model, ids, scale):
    with pytest.raises(ValueError, match="init_scale=.* is invalid"):
        collect_trajectory(model, ids, 2, init_scale=scale)
    with pytest.raises(ValueError, match="init_scale=.* is invalid"):
        path_independence(model, ids, 2, seeds=[1, 2], init_scale=scale)


def test_path_independence_checks_the_row_and_repeated_positions(model, ids):
    with pytest.raises(ValueError, match="row=1 is out of range: input_ids has batch size 1"):
        path_independence(model, ids, 2, seeds=[1, 2], row=1)
    pi = path_independence(model, ids, 2, seeds=[1, 2], positions=[3, 3, 0])
    assert sorted(pi.paths) == [0, 3] and pi.paths[3].shape == (2, 3, model.config.hidden_size)


@pytest.mark.parametrize("bad", [[[5, 999]], [[-1, 5]], [[5.0, 6.0]]], ids=["above-vocab", "negative", "float"])
def test_trajectory_refuses_ids_the_model_cannot_embed(model, bad):
    with pytest.raises(ValueError, match="outside the vocabulary|integer token ids"):
        collect_trajectory(model, torch.tensor(bad), 2)


def test_left_padded_row_with_a_random_s0_matches_the_prompt_alone(model):
    # a row's s_0 (and so its states) is what its prompt gets alone, not a slice of the batch's draw
    batch = torch.tensor([[9, 8, 7, 6], [0, 0, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    padded = collect_trajectory(model, batch, 3, seed=4, attention_mask=mask)
    for row, prompt in ((0, batch[:1]), (1, batch[1:, 2:])):
        alone = collect_trajectory(model, prompt, 3, seed=4)
        np.testing.assert_allclose(padded.states("raw", row), alone.states("raw", 0), atol=ATOL_RUN)
        np.testing.assert_allclose(padded.states("normed", row), alone.states("normed", 0), atol=ATOL_RUN)
    pi = path_independence(model, batch, 3, seeds=[1, 2], attention_mask=mask, row=1)
    alone = path_independence(model, batch[1:, 2:], 3, seeds=[1, 2])
    np.testing.assert_allclose(pi.finals, alone.finals, atol=ATOL_RUN)
