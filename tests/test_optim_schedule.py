"""Learning-rate schedule: warmup, constant, linear cool-down, and per-group lr_scale."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.train import OptimizerSet, lr_at, set_lr


def test_trapezoid_values() -> None:
    lrs = [lr_at(s, base_lr=1.0, warmup=4, total=12, cooldown=4, min_lr=0.2) for s in range(12)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:8] == [1.0] * 4
    # min_lr + 0.8 * (12 - step) / 4 for the last four steps
    assert lrs[8:] == pytest.approx([1.0, 0.8, 0.6, 0.4])


def test_monotone_ramps_and_plateau_on_a_long_run() -> None:
    total, warmup, cooldown = 1000, 100, 200
    lrs = [lr_at(s, 3e-3, warmup, total, cooldown, 1e-4) for s in range(total)]
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))
    assert set(lrs[warmup - 1 : total - cooldown]) == {3e-3}
    assert all(a > b for a, b in zip(lrs[total - cooldown :], lrs[total - cooldown + 1 :]))
    assert 1e-4 < lrs[-1] < 1e-4 + 3e-3 / cooldown + 1e-12
    assert lrs[0] > 0


@pytest.mark.parametrize(
    ("warmup", "cooldown", "expected"),
    [
        (0, 0, [1.0] * 5),
        (5, 0, [0.2, 0.4, 0.6, 0.8, 1.0]),
        (0, 5, [1.0, 0.8, 0.6, 0.4, 0.2]),
        (4, 4, [0.25, 0.5, 0.75, 0.5, 0.25]),
    ],
    ids=["constant", "warmup-only", "cooldown-only", "overlap-takes-the-minimum"],
)
def test_edge_shapes(warmup: int, cooldown: int, expected: list[float]) -> None:
    got = [lr_at(s, 1.0, warmup, 5, cooldown) for s in range(5)]
    assert got == pytest.approx(expected)


def test_ramps_longer_than_the_run_are_cut_not_rejected() -> None:
    # A time-capped run's projected length can fall below a fixed cool-down (or the huginn-0125 preset's
    # 4096 steps can meet a short run): every step then lies on the cool-down line; it used to raise.
    got = [lr_at(s, 1.0, warmup=0, total=4, cooldown=8) for s in range(4)]
    assert got == pytest.approx([0.5, 0.375, 0.25, 0.125])
    got = [lr_at(s, 1.0, warmup=8, total=4, cooldown=8, min_lr=0.2) for s in range(4)]
    assert got == pytest.approx([0.125, 0.25, 0.375, 0.2 + 0.8 / 8])


def test_open_ended_run_without_cooldown() -> None:
    assert lr_at(10**7, 1e-3, warmup=10, total=None) == 1e-3
    with pytest.raises(ValueError, match="total=None"):
        lr_at(0, 1e-3, warmup=10, total=None, cooldown=5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"step": -1}, "step"),
        ({"step": 10}, "step"),
        ({"base_lr": 0.0}, "base_lr"),
        ({"warmup": -1}, "warmup"),
        ({"cooldown": -1}, "cooldown"),
        ({"min_lr": 2.0}, "min_lr"),
        ({"total": 0}, "total"),
    ],
    ids=["negative-step", "step-past-total", "lr0", "warmup<0", "cooldown<0", "min>base", "total0"],
)
def test_bad_arguments(kwargs: dict, field: str) -> None:
    args = {"step": 0, "base_lr": 1.0, "warmup": 2, "total": 10, "cooldown": 2, "min_lr": 0.0, **kwargs}
    with pytest.raises(ValueError, match=field):
        lr_at(**args)


def test_set_lr_scales_each_group() -> None:
    a, b, c = (torch.zeros(2, requires_grad=True) for _ in range(3))
    sgd = torch.optim.SGD([{"params": [a], "lr_scale": 10.0}, {"params": [b]}], lr=1.0)
    adam = torch.optim.AdamW([c], lr=1.0)
    for target in ([sgd, adam], OptimizerSet([sgd, adam])):
        set_lr(target, 0.5)
        assert [g["lr"] for g in sgd.param_groups] == [5.0, 0.5]
        assert adam.param_groups[0]["lr"] == 0.5
        set_lr(target, 0.1)
    set_lr(adam, 0.25)
    assert adam.param_groups[0]["lr"] == 0.25
    with pytest.raises(ValueError, match="lr"):
        set_lr(adam, float("nan"))
