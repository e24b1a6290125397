"""Golden loss curve: the first 20 losses of a short tiny-preset CPU recipe, checked into tests/golden/.

The recipe trains its own tokenizer on the seeded synthetic corpus (tests/train_support.py), so it does
not depend on the Python version. Regenerate after an intended change with
`RDEPTH_UPDATE_GOLDEN=1 python -m pytest tests/test_train_golden.py` and explain the change in the commit.

Tolerance: 2e-4 absolute per step. The same code on the same machine reproduces the curve bitwise
(the resume tests rely on that); what may differ on another CPU is float32 rounding (summation order
inside matmuls, vector width, BLAS kernels). As a proxy, perturbing every initial weight by a relative
1e-6 (ten times float32 rounding) moves the curve by at most 1.4e-6 over the 20 steps (measured; the
second test below keeps that honest), so 2e-4 leaves >100x headroom. Real changes to the math are far
larger: a learning rate 10% higher moves step 2 by 0.018 and step 20 by 0.13; another seed moves
step 2 by 0.06.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from recurrent_depth.data import load_tokenizer, tokenizer_sha256
from recurrent_depth.train.optim import OptimConfig
from recurrent_depth.train.trainer import Trainer
from tests.train_support import OneThread, prepare_root, tiny_train_config

GOLDEN = Path(__file__).parent / "golden" / "train_tiny_losses.json"
TOLERANCE = 2e-4
STEPS = 20


def golden_recipe(root: Path, out: Path, **overrides):
    values = dict(max_steps=STEPS, eval_batches=1, eval_depths=[1],
                  optim=OptimConfig.from_preset("demo", lr=3e-3, warmup_steps=5, cooldown_fraction=0.25))
    return tiny_train_config(root, out, **{**values, **overrides})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("golden_root"))


def test_loss_curve_matches_the_golden_file(root, tmp_path):
    with OneThread():
        losses = Trainer(golden_recipe(root, tmp_path / "run")).run().losses
    tok_hash = tokenizer_sha256(load_tokenizer(root / "tokenizer"))
    if os.environ.get("RDEPTH_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({
            "recipe": "tests/test_train_golden.py::golden_recipe (tiny preset, synthetic corpus, 20 steps)",
            "torch": torch.__version__, "tokenizer_sha256": tok_hash, "losses": losses,
        }, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["tokenizer_sha256"] == tok_hash, (
        "the BPE trained on the synthetic corpus changed (a different `tokenizers` version or corpus), so the "
        "token ids and every loss differ; regenerate the golden file if that is intended"
    )
    assert len(losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, golden["losses"]))
    assert worst <= TOLERANCE, f"loss curve moved by {worst:.2e} (> {TOLERANCE}): {losses}"


def test_rounding_level_perturbations_move_the_curve_far_less_than_the_tolerance(root, tmp_path):
    curves = []
    for eps in (0.0, 1e-6):
        with OneThread():
            trainer = Trainer(golden_recipe(root, tmp_path / f"eps{eps}"), log=lambda message: None)
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for param in trainer.model.parameters():
                    param.mul_(1 + eps * torch.randn(param.shape, generator=gen))
            curves.append(trainer.run().losses)
    assert max(abs(a - b) for a, b in zip(*curves)) < TOLERANCE / 20
