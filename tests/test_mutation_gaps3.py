"""Mutation hunt, round 3: tests that kill surviving mutants of quant/, sampling, criteria, retrofit, distill, sft
and scaling, each against the documented formula or a plain reference computation (not the current output)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recurrent_depth.families.retrofit import adapter_weight
from recurrent_depth.inference.sampling import OFFICIAL_TOP_K, official_draw


def test_official_draw_defaults_to_top_k_50_when_unset():
    """Near-uniform probabilities over 60 tokens: the official default top-k = 50 never draws the 10 smallest."""
    vocab = OFFICIAL_TOP_K + 10
    logits = -torch.arange(vocab, dtype=torch.float32)[None].repeat(2000, 1) * 1e-3  # distinct, nearly flat
    torch.manual_seed(0)
    drawn = official_draw(logits, 1.0, None, None, None)
    assert int(drawn.max()) < OFFICIAL_TOP_K
    assert len(set(drawn.tolist())) > OFFICIAL_TOP_K // 2  # and it does sample, not take the argmax
    torch.manual_seed(0)
    assert set(official_draw(logits, 1.0, 5, None, None).tolist()) == set(range(5))  # a given top_k is used


def test_official_min_p_is_relative_to_the_top_probability():
    """min-p drops tokens below min_p x the row's top probability (0.3 x 0.6 = 0.18: only 0.15 goes), not below
    min_p itself (which would drop 0.25 too)."""
    logits = torch.tensor([[0.6, 0.25, 0.15]]).log().repeat(500, 1)
    torch.manual_seed(0)
    assert set(official_draw(logits, 1.0, None, None, 0.3).tolist()) == {0, 1}


def test_random_adapter_init_is_huginns_truncated_normal():
    """docs/looped-family.md: `random` is Huginn's init, a normal of std √(2/(5h)) truncated at ±3 std."""
    h = 48
    w = adapter_weight("random", h, torch.float32, seed=0)
    std = math.sqrt(2 / (5 * h))
    assert w.shape == (h, 2 * h)
    assert float(w.abs().max()) <= 3 * std
    assert float(w.abs().max()) > 2.7 * std  # 4608 draws: the tail up to 3 std is reached
    # The std of a normal truncated at ±3σ is 0.9866σ; 4608 draws estimate it within about 1%.
    assert abs(float(w.std()) / (0.9866 * std) - 1) < 0.04
    assert torch.equal(w, adapter_weight("random", h, torch.float32, seed=0))
    assert not torch.equal(w, adapter_weight("random", h, torch.float32, seed=1))


def test_law_forms_predict_the_documented_formulas():
    """scaling/forms.py: each form against its equation written out (E, A, B are stored as logs)."""
    from recurrent_depth.scaling.forms import law_form

    data = {"params_non_embedding": np.array([3e5, 4e6]), "tokens": np.array([2e6, 5e7]),
            "train_flops": np.array([1e13, 7e14]), "prelude_layers": np.array([1.0, 2.0]),
            "core_layers": np.array([2.0, 4.0]), "coda_layers": np.array([1.0, 1.0]), "depth": np.array([3.0, 8.0])}
    E, A, alpha, B, beta, phi = 1.7, 400.0, 0.34, 120.0, 0.28, 0.46
    N, D, C = data["params_non_embedding"], data["tokens"], data["train_flops"]
    real = data["prelude_layers"] + data["core_layers"] + data["coda_layers"]
    d_eff = data["prelude_layers"] + data["coda_layers"] + data["core_layers"] * (1 + phi * (data["depth"] - 1))
    n_eff = N / real * d_eff
    cases = {
        "kaplan-n": ([A, alpha], A * N**-alpha),
        "kaplan-d": ([B, beta], B * D**-beta),
        "kaplan-c": ([A, alpha], A * C**-alpha),
        "joint": ([A, alpha, B, beta], A * N**-alpha + B * D**-beta),
        "iso-depth": ([A, alpha, B, beta, phi], A * n_eff**-alpha + B * D**-beta),
    }
    for name, (values, powers) in cases.items():
        logs = [math.log(v) if p.startswith("log_") else v
                for v, p in zip(values, law_form(name, irreducible=False).parameters, strict=True)]
        np.testing.assert_allclose(law_form(name, irreducible=False).predict(np.array(logs), data), powers, rtol=1e-12)
        np.testing.assert_allclose(law_form(name).predict(np.array([math.log(E), *logs]), data), E + powers,
                                   rtol=1e-12)


def test_distillation_kl_is_the_mean_over_scored_tokens_even_for_one_or_none():
    """train/distill.py: KL(q_T || p_T) summed over the vocabulary, averaged over the scored tokens; one scored
    token gives exactly its own KL, none gives 0 (not NaN), and alpha mixes as (1 - alpha) CE + alpha T² KL."""
    from recurrent_depth.train.distill import distillation_loss

    gen = torch.Generator().manual_seed(0)
    student = torch.randn(1, 3, 5, generator=gen, dtype=torch.float64)
    teacher = torch.randn(1, 3, 5, generator=gen, dtype=torch.float64)
    T, alpha = 1.5, 0.25
    q, log_q = (teacher[0, 1] / T).softmax(-1), (teacher[0, 1] / T).log_softmax(-1)
    kl_one = float((q * (log_q - (student[0, 1] / T).log_softmax(-1))).sum())
    total, ce, kl = distillation_loss(student, torch.tensor([[-100, 2, -100]]), teacher, alpha=alpha, temperature=T)
    assert float(kl) == pytest.approx(kl_one, rel=1e-5)
    assert float(ce) == pytest.approx(-float(student[0, 1].log_softmax(-1)[2]), rel=1e-5)
    assert float(total) == pytest.approx((1 - alpha) * float(ce) + alpha * T**2 * kl_one, rel=1e-5)
    _, _, kl_none = distillation_loss(student, torch.full((1, 3), -100), teacher, alpha=alpha, temperature=T)
    assert float(kl_none) == 0.0


def _packed_reference(examples, seq_len: int, pad_id: int, packing: bool):
    """train/sft.py's layout written out: next-fit rows of seq_len positions; an example of n tokens takes n - 1
    (inputs ids[:-1], targets ids[1:] where scored, else -100), positions restart at 0, document ids count
    the row's examples from 0; the tail is padding (pad_id, -100, document -1, positions counting from 0)."""
    rows, open_row = [], None
    for ex in examples:
        n = len(ex.ids) - 1
        if open_row is None or not packing or sum(len(i) for i, _ in open_row) + n > seq_len:
            open_row = []
            rows.append(open_row)
        open_row.append((ex.ids[:-1], [t if s else -100 for t, s in zip(ex.ids[1:], ex.scored[1:])]))
    out = {"input_ids": [], "targets": [], "position_ids": [], "document_ids": []}
    for row in rows:
        ids, tgt, pos, doc = [], [], [], []
        for d, (inputs, targets) in enumerate(row):
            ids += inputs
            tgt += targets
            pos += list(range(len(inputs)))
            doc += [d] * len(inputs)
        pad = seq_len - len(ids)
        out["input_ids"].append(ids + [pad_id] * pad)
        out["targets"].append(tgt + [-100] * pad)
        out["position_ids"].append(pos + list(range(pad)))
        out["document_ids"].append(doc + [-1] * pad)
    return out


def test_sft_rows_are_the_documented_next_fit_layout():
    from recurrent_depth.data.chat import Example
    from recurrent_depth.train.sft import cut_examples, pack_examples

    examples = [Example([1, 2, 3, 4], [False, False, True, True]), Example([5, 6, 7], [False, True, True]),
                Example([8, 9, 10, 11, 12, 13, 14], [False] * 3 + [True] * 4),  # 7 tokens: exactly fills a row
                Example([15, 16], [False, True]), Example([17, 18, 19], [True, False, True])]
    for packing in (True, False):
        rows = pack_examples(examples, 6, pad_id=99, packing=packing)
        want = _packed_reference(examples, 6, 99, packing)
        for name, value in want.items():
            assert getattr(rows, name).tolist() == value, (packing, name)
    long = Example(list(range(1, 10)), [False] * 5 + [True] * 4)  # 9 tokens: cut to 7, two targets left
    bare = Example([1, 2, 3, 4, 5, 6, 7, 8], [False] * 7 + [True])  # its only target is past the cut: dropped
    kept, counts = cut_examples([long, examples[0], bare, examples[3]], 6)  # examples[3]: one target, token 1
    assert kept == [Example(long.ids[:7], long.scored[:7]), examples[0], examples[3]]
    assert counts == {"examples": 3, "truncated": 2, "dropped": 1}


def test_compute_optimal_minimises_the_fitted_law_at_fixed_compute():
    """scaling/fit.py: N_opt minimises E + A N^-alpha + B D^-beta on C = 6 N D, and `loss` is the law there."""
    from recurrent_depth.scaling.fit import ScalingFit, compute_optimal
    from recurrent_depth.scaling.forms import law_form

    E, A, alpha, B, beta, budget = 1.7, 400.0, 0.34, 120.0, 0.28, 1e15
    fit = ScalingFit(law_form("joint"), np.array([math.log(E), math.log(A), alpha, math.log(B), beta]), [], 0.9)
    opt = compute_optimal(fit, budget)

    def law(n: np.ndarray) -> np.ndarray:
        return E + A * n**-alpha + B * (budget / (6 * n)) ** -beta

    grid = np.exp(np.linspace(math.log(1e3), math.log(1e12), 20001))
    assert opt["N"] == pytest.approx(grid[np.argmin(law(grid))], rel=2e-3)
    assert opt["D"] == pytest.approx(budget / (6 * opt["N"]), rel=1e-12)
    assert opt["loss"] == pytest.approx(float(law(np.array(opt["N"]))), rel=1e-12)


@pytest.mark.parametrize("make", ["qjl", "qjl-out", "prod", "mse", "polar"])
def test_scoring_refuses_a_query_that_is_not_m_by_d(make):
    """quant/base.py: queries are [..., M, D]; a 1-D query or another width is a one-line ValueError, not a
    silently broadcast score (QJL's score once skipped the check)."""
    from recurrent_depth.quant.polar import PolarQuant
    from recurrent_depth.quant.qjl import QJL
    from recurrent_depth.quant.turboquant import TurboQuantMSE, TurboQuantProd

    dim = 16
    quantizer = {"qjl": lambda: QJL(dim, 32), "qjl-out": lambda: QJL(dim, 32, outliers=2),
                 "prod": lambda: TurboQuantProd(dim, 2), "mse": lambda: TurboQuantMSE(dim, 2),
                 "polar": lambda: PolarQuant(dim)}[make]()
    codes = quantizer.encode(torch.randn(3, dim, generator=torch.Generator().manual_seed(0)))
    assert quantizer.score(torch.ones(2, dim), codes).shape == (2, 3)
    for bad in (torch.ones(dim), torch.ones(2, dim + 1)):
        with pytest.raises(ValueError, match=r"queries must be \[\.\.\., M, 16\]"):
            quantizer.score(bad, codes)


def test_prod_residual_absorbs_the_fp16_rounding_of_the_norm():
    """quant/turboquant.py: the residual is Πx/n with n = fp16(‖x‖), so n·ρ (ρ the stochastically rounded ‖r‖)
    is unbiased for ‖x‖ itself. At b = 1, r = Πx/n: norms of 1000.24 all round to n = 1000 in fp16, a bias of
    2.4e-4 if the residual were taken against the unrounded norm; the mean over 4000 vectors resolves 5e-5."""
    from recurrent_depth.quant.turboquant import TurboQuantProd

    quantizer = TurboQuantProd(16, 1)
    x = torch.randn(4000, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = (x / x.norm(dim=-1, keepdim=True) * 1000.24).float()
    codes = quantizer.encode(x)
    assert set(codes.fields["norm"].float().flatten().tolist()) == {1000.0}
    estimate = codes.fields["norm"].double() * codes.fields["residual"].double() * quantizer.residual_step
    assert abs(float(estimate.mean()) / 1000.24 - 1) < 6e-5


def test_compute_optimal_intervals_and_log_rmse_are_the_documented_statistics():
    """The N/D/loss intervals are the central `level` percentile range of the per-sample optima; log_rmse is
    the root mean square of the log-loss residuals."""
    from recurrent_depth.scaling.fit import ScalingFit, compute_optimal
    from recurrent_depth.scaling.forms import law_form
    from recurrent_depth.scaling.synthetic import synthetic_rows

    rng = np.random.default_rng(0)
    truth = np.array([math.log(1.7), math.log(400.0), 0.34, math.log(120.0), 0.28])
    samples = truth + rng.normal(0, 0.02, size=(41, 5))
    fit = ScalingFit(law_form("joint"), truth, [], 0.8, samples=samples)
    opt = compute_optimal(fit, 1e15)
    each = np.array([[compute_optimal(ScalingFit(fit.form, s, [], 0.8), 1e15)[k] for k in ("N", "D", "loss")]
                     for s in samples])
    for i, key in enumerate(("N", "D", "loss")):
        np.testing.assert_allclose(opt[f"{key}_interval"], np.percentile(each[:, i], [10, 90]), rtol=1e-12)
    intervals = fit.intervals()
    for name, column in (("log_E", 0), ("log_A", 1), ("alpha", 2)):
        np.testing.assert_allclose(intervals[name], np.percentile(samples[:, column], [10, 90]), rtol=1e-12)
    np.testing.assert_allclose(intervals["A"], np.exp(intervals["log_A"]), rtol=1e-12)  # the plain scales too
    rows = synthetic_rows(noise=0.03, seed=1, widths=(64,), token_budgets=(1e6,))
    fit = ScalingFit(law_form("joint"), truth, rows, 0.8)
    logs = np.log([r["loss"] for r in rows]) - np.log(fit.predict(rows))
    assert fit.log_rmse() == pytest.approx(math.sqrt(np.mean(logs**2)), rel=1e-9)
