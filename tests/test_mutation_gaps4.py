"""Mutation hunt, round 4: tests that kill surviving mutants of model/layers.py, train/muon.py, train/qk_clip.py,
train/flops.py, train/averaging.py, analysis/ (convergence, pca, path independence, exit gate), inference/kv_codec.py,
model/replay.py, families/ (ouro, parcae) and train/validation.py, each against the documented rule or a plain
reference computation (not the current output)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import recurrent_depth as rd
from recurrent_depth.model.layers import RMSNorm
from recurrent_depth.train.flops import attention_flops, training_step_flops


def test_reset_gain_under_unit_offset_gives_a_gain_of_one():
    """Gemma's norm stores the gain as 1 + weight: `reset_gain` puts weight back to 0 (a gain of one), so the
    output is x / rms(x) exactly; weight 1 would double it."""
    norm = RMSNorm(8, eps=1e-6, unit_offset=True)
    with torch.no_grad():
        norm.weight.normal_()
    norm.reset_gain()
    x = torch.randn(3, 8)
    reference = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), reference)


def test_ungated_mlp_flops_count_two_matrices():
    """`mlp_gated=False` (Parcae's, GPT-2's MLP) has two matrices, not three: the hand count matches torch's
    counter on the linear layers (attention, which SDPA does not count on CPU, taken out)."""
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=48, num_heads=4, intermediate_size=100, vocab_size=300,
                                     mlp_gated=False)
    model = rd.RecurrentDepthLM(cfg).train()
    B, T, num_steps = 2, 9, (1, 2)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, T)), num_steps=num_steps).logits.sum().backward()
    flops = training_step_flops(cfg, B, T, num_steps)
    attention_backward = 2 * B * T * attention_flops(cfg, T) * (cfg.prelude_layers + cfg.coda_layers
                                                                + num_steps[1] * cfg.core_layers)
    assert counter.get_total_flops() == flops.total - flops.attention_forward - attention_backward


def test_replay_hidden_mask_hides_unreached_columns_but_never_a_query_itself():
    """A replay step hides the columns that did not reach it; a query always sees itself (its row is never
    empty, which would make its softmax NaN), and the causal rule still holds."""
    from recurrent_depth.model.replay import hidden_mask

    reached = torch.tensor([[True, False, True, False]])
    mask = hidden_mask(None, reached)[0, 0]
    T = reached.shape[1]
    for q in range(T):
        for k in range(T):
            assert bool(mask[q, k]) == (k <= q and (bool(reached[0, k]) or k == q)), (q, k)
    assert bool(mask.any(-1).all())


def test_replay_depths_below_one_run_one_step():
    """`DepthReplay.depths` below 1 (padding) run one core step, as documented: the same logits as depth 1."""
    from recurrent_depth.model.replay import DepthReplay

    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=64)
    model = rd.RecurrentDepthLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        low = model(ids, init_scale=0.0, replay=DepthReplay(torch.tensor([[3, 0, 2, -1, 0]]))).logits
        one = model(ids, init_scale=0.0, replay=DepthReplay(torch.tensor([[3, 1, 2, 1, 1]]))).logits
    torch.testing.assert_close(low, one, rtol=0, atol=0)


def test_checkpoint_selection_counts_back_from_the_newest_with_an_even_count():
    """Every d-th checkpoint counting back from the newest: of 4 at dilation 2 that is [1, 3] (the newest in),
    not [0, 2] (counting from the oldest, which agrees only when the count is odd)."""
    from recurrent_depth.train.averaging import select_checkpoints

    paths = list(range(4))
    assert select_checkpoints(paths, 2, 2) == paths[::-1][::2][::-1] == [1, 3]


def test_ema_state_accumulates_in_float32_returns_stored_dtypes_and_takes_integers_from_the_newest(tmp_path):
    """bf16 checkpoints average in float32, rounded to bf16 once at the end (not at every checkpoint); an integer
    tensor is not averaged but taken from the newest checkpoint."""
    from safetensors.torch import load_file, save_file

    from recurrent_depth.train.averaging import ema_state

    paths, states = [], []
    for i in range(3):
        torch.manual_seed(i)
        path = tmp_path / f"step-{i}"
        rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=64)).to(torch.bfloat16).save_pretrained(path)
        weights = load_file(path / "model.safetensors")
        weights["extra.count"] = torch.tensor([10 * i + 1, 7], dtype=torch.int64)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        paths.append(path)
        states.append(weights)
    beta = 0.75  # (bf16 values times 3/4 and 1/4 add exactly in float32: the reference has no rounding of its own)
    got = ema_state(paths, beta)
    assert got["extra.count"].tolist() == [21, 7]
    for name, tensor in got.items():
        if name == "extra.count":
            continue
        assert tensor.dtype == torch.bfloat16, name
        want = states[0][name].float()
        for later in states[1:]:
            want = beta * want + (1 - beta) * later[name].float()
        torch.testing.assert_close(tensor, want.to(torch.bfloat16), rtol=0, atol=0)


def test_replay_gradients_flow_through_each_positions_last_steps_only():
    """Position 0 runs 4 steps with backprop depth 1 beside a depth-1 neighbour (whose gradient window covers
    every step, so gradients are on throughout): position 0's loss gets the gradient of its last step only, that
    of the plain truncated forward (3, 1) on it alone (a first token attends to itself only)."""
    from recurrent_depth.model.replay import DepthReplay

    torch.manual_seed(3)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=64)
    model = rd.RecurrentDepthLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (1, 2))
    model(ids[:, :1], num_steps=(3, 1), init_scale=0.0).logits[0, 0].square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    replay = DepthReplay(torch.tensor([[4, 1]]), "per-step+deepest", 1)
    model(ids, init_scale=0.0, replay=replay).logits[0, 0].square().sum().backward()
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)


def test_steps_to_converge_counts_a_distance_at_the_tolerance_and_a_zero_scale_as_absolute():
    """Converged from the first step whose relative distance stays at or below `tol` (equal counts); a zero
    scale (s* = 0) compares the absolute distance."""
    import numpy as np

    from recurrent_depth.analysis.convergence import steps_to_converge

    distance = np.array([[0.5, 0.05, 0.05], [1.0, 0.01, 0.0]])
    got = steps_to_converge(distance, np.array([1.0, 0.0]), tol=0.05)
    assert got.tolist() == [1, 1]
    for tol in (0.0, 1.0):  # a relative tolerance lies in (0, 1)
        with pytest.raises(ValueError, match="tol"):
            steps_to_converge(distance, np.array([1.0, 0.0]), tol=tol)


def test_rope_table_for_a_long_context_covers_the_positions_in_a_power_of_two():
    """Past the eager length a table grows by doubling: the smallest power of two >= the positions needed (never
    shorter, which would index past its end), at least the eager length, at most the context."""
    from recurrent_depth.model.layers import ROPE_EAGER_POSITIONS, rope_table_length

    context = 1 << 20
    for needed in (1, ROPE_EAGER_POSITIONS + 1, 8192, 8193, 12345, context):
        want = ROPE_EAGER_POSITIONS
        while want < needed:
            want *= 2
        assert rope_table_length(context, needed=needed) == min(context, want), needed
    positions = torch.tensor([[3, 8192]])  # position 8192 needs 8193 rows
    assert rope_table_length(context, positions) == 16384


def test_distance_to_limit_is_the_euclidean_norm():
    """d[t, i] = ||ln_f(s_i) - s*||, against numpy's norm."""
    import numpy as np

    from recurrent_depth.analysis.convergence import distance_to_limit
    from recurrent_depth.analysis.trajectory import Trajectory

    rng = np.random.default_rng(0)
    normed = rng.normal(size=(4, 1, 3, 5)).astype(np.float32)  # [S+1, B, T, h]
    limit = rng.normal(size=(1, 3, 5)).astype(np.float32)
    traj = Trajectory(raw=normed, normed=normed, input_ids=np.zeros((1, 3), dtype=np.int64), limit=limit)
    want = np.linalg.norm(normed[:, 0].astype(np.float64) - limit[0].astype(np.float64), axis=-1).T  # [T, S+1]
    np.testing.assert_allclose(distance_to_limit(traj), want, rtol=1e-12)


def test_ouro_config_defaults_are_the_references():
    """Keys an Ouro config.json may leave out take the reference's defaults: early_exit_threshold 1.0 (exit at the
    last step), max_position_embeddings 32768, num_key_value_heads = num_attention_heads."""
    from recurrent_depth.families.ouro import ouro_config_values

    values = ouro_config_values({"model_type": "ouro", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4})
    assert values["exit_gate_threshold"] == 1.0
    assert values["max_seq_len"] == 32768
    assert values["num_kv_heads"] == 4


def test_pca_keeps_at_most_n_minus_one_components():
    """k = min(num_components, h, N - 1): N centred samples span at most N - 1 directions."""
    import numpy as np

    from recurrent_depth.analysis.pca import fit_pca

    data = np.random.default_rng(1).normal(size=(3, 5))
    pca = fit_pca(data, num_components=6)
    assert pca.num_components == 2 == np.linalg.matrix_rank(data - data.mean(axis=0))


def test_pca_variance_is_the_unbiased_covariances_and_the_ratio_is_of_the_total():
    """Streamed or in memory, explained_variance is the top eigenvalues of the N - 1 covariance (np.cov), and
    explained_ratio divides them by the total variance over every direction, not by the kept ones' sum."""
    import numpy as np

    from recurrent_depth.analysis.pca import fit_pca, fit_pca_streaming

    data = np.random.default_rng(2).normal(size=(40, 6)) * np.arange(1, 7)
    eig = np.sort(np.linalg.eigvalsh(np.cov(data.T)))[::-1]
    for pca in (fit_pca(data, 3), fit_pca_streaming(lambda: iter(np.split(data, 4)), 3)):
        np.testing.assert_allclose(pca.explained_variance, eig[:3], rtol=1e-10)
        np.testing.assert_allclose(pca.explained_ratio, eig[:3] / eig.sum(), rtol=1e-10)


def test_real_positions_run_through_the_last_scored_target():
    """Without document ids a row's real tokens are those up to and including its last scored target; the tail
    after it is padding."""
    from recurrent_depth.train.validation import real_positions

    targets = torch.tensor([[4, 2, -100, 5, -100, -100], [-100, 3, -100, -100, -100, -100]])
    want = [[True, True, True, True, False, False], [True, True, False, False, False, False]]
    assert real_positions({"targets": targets}).tolist() == want


def test_a_row_with_one_real_position_counts_as_the_mean_of_the_others():
    """A row with one real position has no pair to correlate: the batch's summed correlation is the other rows'
    mean times the row count (finite), not NaN."""
    from recurrent_depth.analysis.correlation import token_correlation_reference
    from recurrent_depth.train.validation import batch_losses

    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=64)
    model = rd.RecurrentDepthLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    targets = ids.clone()
    targets[1, 1:] = -100  # row 1: one real position
    _, corr = batch_losses(model, {"input_ids": ids, "targets": targets}, [2], generator_seed=0)
    with torch.no_grad():
        out = model(ids, num_steps=2, generator=torch.Generator().manual_seed(0))
    first = token_correlation_reference(out.final_state[:1])
    torch.testing.assert_close(corr[2], 2 * first[0], rtol=1e-5, atol=1e-6)


def test_spread_and_separation_follow_their_definitions():
    """spread[t] = mean over pairs of starts of ||f_a[t] - f_b[t]||; separation[t] = min over t' != t of the
    distance between the tokens' mean final states; a token counts as identifiable when its ratio is below 1."""
    import itertools

    import numpy as np

    from recurrent_depth.analysis.path_independence import PathIndependence, spread_and_separation

    finals = np.random.default_rng(3).normal(size=(3, 4, 5))
    spread, separation = spread_and_separation(finals)
    centre = finals.mean(axis=0)
    for t in range(4):
        pairs = [np.linalg.norm(finals[a, t] - finals[b, t]) for a, b in itertools.combinations(range(3), 2)]
        assert spread[t] == pytest.approx(np.mean(pairs))
        others = [np.linalg.norm(centre[t] - centre[u]) for u in range(4) if u != t]
        assert separation[t] == pytest.approx(min(others))
    ratio = np.array([0.5, 1.0, 2.0])
    result = PathIndependence([0, 1], finals, ratio, ratio, ratio, {}, 1.0)
    assert result.summary()["fraction_ratio_below_1"] == pytest.approx(1 / 3)


def test_exit_step_is_the_first_step_whose_cumulative_mass_reaches_the_threshold():
    """1-based, and reaching counts (a mass equal to the threshold exits there); p_i is the step's own mass
    (c_i - c_{i-1}, c_0 = 0), the expected step sum_i i p_i, the summary's median the median exit step."""
    import numpy as np

    from recurrent_depth.analysis.exit_gate import ExitGate

    cumulative = np.array([[0.5, 0.75, 1.0], [0.25, 0.5, 1.0], [0.125, 0.25, 1.0], [0.75, 1.0, 1.0]],
                          dtype=np.float32)
    gate = ExitGate(probability=cumulative, cumulative=cumulative, threshold=0.5)
    assert gate.exit_step.tolist() == [1, 2, 3, 1]
    p = np.concatenate([cumulative[:, :1], np.diff(cumulative, axis=1)], axis=1)
    np.testing.assert_allclose(gate.distribution, p)
    np.testing.assert_allclose(gate.expected_step, (p * np.array([1, 2, 3])).sum(axis=1))
    assert gate.summary()["median_exit_step"] == 1.5  # of 1, 1, 2, 3 (their mean is 1.75)


def test_qk_clip_leaves_a_head_exactly_at_tau_untouched():
    """Only heads with S_max > tau are clipped: with tau set to the step's largest logit no head is, and every
    weight stays bit for bit."""
    from recurrent_depth.train.qk_clip import QKClip

    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=64)
    model = rd.RecurrentDepthLM(cfg).train()
    clip = QKClip(model, threshold=1.0)
    model(torch.randint(0, cfg.vocab_size, (1, 6)), num_steps=(0, 2))
    clip.threshold = float(torch.cat(clip.maxima()).max())
    assert 0 < clip.threshold < float("inf")  # (the forward recorded its logits)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert clip.step()["qk_clipped_heads"] == 0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_muon_refuses_momentum_one_and_zero_newton_schulz_steps():
    """check_group: ns_steps in [1, 99], momentum in [0, 1) (momentum 1 never moves the buffer from zero)."""
    from recurrent_depth.train.muon import check_group

    ok = {"ns_steps": 5, "momentum": 0.95, "ns_coefficients": (3.4445, -4.775, 2.0315)}
    check_group(ok)
    for bad, field in (({"momentum": 1.0}, "momentum"), ({"ns_steps": 0}, "ns_steps")):
        with pytest.raises(ValueError, match=field):
            check_group({**ok, **bad})


def test_next_batch_late_extrapolates_the_mean_pace():
    """A next batch is late when now + (time so far / batches done) passes the deadline, even if now does not."""
    import time

    from recurrent_depth.train.validation import next_batch_late

    now = time.perf_counter()
    assert next_batch_late(now - 100.0, 1, now + 50.0)  # one batch took 100 s: the next ends past the deadline
    assert not next_batch_late(now - 100.0, 10, now + 50.0)  # ten took 100 s: the next ends in ~10 s


def test_reduce_depth_eval_means_loss_per_token_and_correlation_per_sequence():
    from recurrent_depth.train.validation import reduce_depth_eval

    result = reduce_depth_eval(10, 4, {1: 20.0, 3: 5.0}, {1: 2.0, 3: 3.0}, 1, torch.device("cpu"))
    assert result.loss == {1: 2.0, 3: 0.5}
    assert result.token_correlation == {1: 0.5, 3: 0.75}


def test_scored_tokens_of_labels_leave_out_the_first_position():
    """`labels` are shifted inside the model: the first position is never scored, -100 never."""
    from recurrent_depth.train.objective import scored_tokens

    labels = torch.tensor([[5, 6, -100, 7], [8, -100, -100, -100]])
    assert scored_tokens({"labels": labels}) == 2
    assert scored_tokens({"targets": labels}) == 4


def test_kv_quant_window_takes_its_maximum():
    """window is an integer in [0, MAX_WINDOW], the maximum included (as the spec text's window=W)."""
    from recurrent_depth.inference.kv_codec import MAX_WINDOW, KVQuant

    assert KVQuant(window=MAX_WINDOW).window == MAX_WINDOW
    assert KVQuant.parse(f"k=mse:4,window={MAX_WINDOW}").window == MAX_WINDOW
    with pytest.raises(ValueError, match="window"):
        KVQuant(window=MAX_WINDOW + 1)
