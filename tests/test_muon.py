"""recurrent_depth.train.muon.Muon: torch.optim.Muon's step in bf16, the same update in float32."""

import copy

import pytest
import torch

from recurrent_depth.train import muon as muon_module
from recurrent_depth.train.muon import Muon, adjusted_lr, newton_schulz


def matrices() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    # tall, wide and square, as the model's qkv / proj / adapter
    return [torch.nn.Parameter(torch.randn(*shape) * 0.1) for shape in ((48, 16), (16, 40), (24, 24))]


def run(optimizer_class, params, steps: int = 3, **kwargs) -> list[torch.Tensor]:
    params = copy.deepcopy(params)
    opt = optimizer_class(params, lr=0.02, weight_decay=0.01, **kwargs)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_bfloat16_is_torch_muon_exactly(adjust_lr_fn):
    params = matrices()
    ours = run(Muon, params, ns_dtype="bfloat16", adjust_lr_fn=adjust_lr_fn)
    theirs = run(torch.optim.Muon, params, adjust_lr_fn=adjust_lr_fn)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_float32_matches_torch_muon_up_to_bf16_rounding(nesterov, adjust_lr_fn):
    params = matrices()
    ours = run(Muon, params, ns_dtype="float32", nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    theirs = run(torch.optim.Muon, params, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    start = [p.detach() for p in params]
    for a, b, p0 in zip(ours, theirs, start):
        # The updates (not the weights) agree to what 5 iterations of bf16 rounding allow: 2% of the step.
        torch.testing.assert_close(a - p0, b - p0, atol=2e-2 * (b - p0).abs().max().item(), rtol=0)


def test_newton_schulz_in_float32_follows_the_float64_iteration():
    torch.manual_seed(1)
    update = torch.randn(30, 12)
    coefficients = (3.4445, -4.775, 2.0315)
    ours = newton_schulz(update, coefficients, 5, 1e-7, torch.float32)
    reference = newton_schulz(update.double(), coefficients, 5, 1e-7, torch.float64)
    assert ours.dtype == torch.float32 and ours.shape == update.shape
    torch.testing.assert_close(ours.double(), reference, atol=1e-5, rtol=1e-5)
    in_bf16 = newton_schulz(update, coefficients, 5, 1e-7, torch.bfloat16)  # torch.optim.Muon's precision
    assert (ours.double() - reference).abs().max() < (in_bf16.double() - reference).abs().max() / 50
    singular_values = torch.linalg.svdvals(reference)
    assert singular_values.min() > 0.5 and singular_values.max() < 1.5  # orthogonalised, as Muon's


def test_adjusted_lr_is_torch_muons():
    from torch.optim._muon import _adjust_lr  # what torch.optim.Muon itself uses

    for shape in (torch.Size([48, 16]), torch.Size([16, 40])):
        for fn in (None, "original", "match_rms_adamw"):
            assert adjusted_lr(0.02, fn, shape) == pytest.approx(_adjust_lr(0.02, fn, shape))


def test_auto_picks_float32_only_on_a_cpu_that_emulates_bf16(monkeypatch):
    monkeypatch.setattr(muon_module, "cpu_emulates_bf16", lambda: True)
    assert Muon(matrices()).ns_dtype == torch.float32
    monkeypatch.setattr(muon_module, "cpu_emulates_bf16", lambda: False)
    assert Muon(matrices()).ns_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(matrices(), ns_dtype="half")


def test_state_moves_between_torch_muon_and_ours():
    params = matrices()
    theirs = torch.optim.Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.ones_like(p)
    theirs.step()
    ours = Muon(params, lr=0.02, ns_dtype="float32")
    ours.load_state_dict(theirs.state_dict())
    buffers = [ours.state[p]["momentum_buffer"].clone() for p in params]
    ours.step()  # continues from torch's momentum
    for p, before in zip(params, buffers):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], before.lerp(p.grad, 1 - 0.95))
    assert set(ours.state_dict()["state"][0]) == {"momentum_buffer"}


NOTES_NS5 = (3.4445, -4.7750, 2.0315)  # research notes, "Muon: Implementation" (Keller Jordan's coefficients)


def test_torch_muon_uses_the_notes_ns5_coefficients_and_so_do_we():
    import inspect

    from recurrent_depth.train.optim import OptimConfig, build_optimizers

    assert inspect.signature(torch.optim.Muon).parameters["ns_coefficients"].default == NOTES_NS5
    assert inspect.signature(torch.optim.Muon).parameters["ns_steps"].default == 5
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    muon = next(o for o in build_optimizers(model, OptimConfig(name="muon")) if isinstance(o, Muon))
    assert muon.param_groups[0]["ns_coefficients"] == NOTES_NS5 and muon.param_groups[0]["ns_steps"] == 5


def ns5_polynomial(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """phi^steps(x) with phi(x) = a x + b x^3 + c x^5: what NS5 does to each normalised singular value."""
    a, b, c = NOTES_NS5
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize("impl", ["torch-bf16", "ours-fp32"])
@pytest.mark.parametrize("shape", [(64, 128), (128, 48)], ids=["wide", "tall"])
def test_ns5_keeps_singular_vectors_and_maps_singular_values_into_the_band(impl, shape):
    from torch.optim._muon import _zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(0)
    G = torch.randn(*shape, generator=gen, dtype=torch.float64)
    if impl == "torch-bf16":
        out = _zeropower_via_newtonschulz(G.float(), NOTES_NS5, 5, 1e-7).double()
        tol = 0.03  # five iterations of bf16 rounding
    else:
        out = newton_schulz(G.float(), NOTES_NS5, 5, 1e-7, torch.float32).double()
        tol = 1e-4
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    in_basis = U.T @ out @ Vh.T  # = diag(phi^5(S / ||G||_F)) when the singular vectors are kept
    diagonal = in_basis.diagonal()
    off = in_basis - torch.diag(diagonal)
    assert off.abs().max() < tol
    torch.testing.assert_close(diagonal, ns5_polynomial(S / G.norm()), atol=tol, rtol=0)
    singular_values = torch.linalg.svdvals(out)
    assert singular_values.min() >= 0.6 and singular_values.max() <= 1.2


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_row_blocks_orthogonalise_each_fused_block_as_its_own_matrix(ns_dtype):
    """Kimi K2's per-matrix Muon: the q, k, v rows of a fused weight each get NS(block) at their own lr."""
    torch.manual_seed(3)
    fused = torch.nn.Parameter(torch.randn(40, 16) * 0.1)  # q 16 rows, k 12, v 12
    blocks = (16, 12, 12)
    start = fused.detach().clone()
    opt = Muon([fused], lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype, row_blocks={id(fused): blocks},
               adjust_lr_fn="match_rms_adamw", nesterov=False, momentum=0.0)
    grad = torch.randn(40, 16)
    fused.grad = grad.clone()
    opt.step()
    group = opt.param_groups[0]
    dtype = getattr(torch, ns_dtype)
    want = []
    for rows, g in zip((start * (1 - 0.02 * 0.1)).split(blocks), grad.split(blocks)):
        ortho = newton_schulz(g, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
        want.append(rows - adjusted_lr(0.02, "match_rms_adamw", rows.shape) * ortho)
    # bf16: the same iteration, though its rounding depends on which kernel ran it
    torch.testing.assert_close(fused.detach(), torch.cat(want), rtol=0, atol=1e-6 if ns_dtype == "float32" else 1e-4)
    # ... which differs from orthogonalising the fused matrix whole
    whole = newton_schulz(grad, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
    assert not torch.allclose(fused.detach(), start * (1 - 0.002) - adjusted_lr(0.02, "match_rms_adamw",
                                                                                  start.shape) * whole, atol=1e-4)
    with pytest.raises(ValueError, match="do not add up"):
        other = torch.nn.Parameter(torch.zeros(8, 4))
        Muon([other], lr=0.02, row_blocks={id(other): blocks})


def test_k2_preset_splits_wqkv_and_the_mlp():
    import recurrent_depth as rd
    from recurrent_depth.train.optim import OptimConfig, build_optimizers

    model = rd.RecurrentDepthLM(rd.ModelConfig(vocab_size=32, hidden_size=32, num_heads=4, num_kv_heads=2,
                                               intermediate_size=48))
    recipe = OptimConfig.from_preset("k2-muon")
    assert recipe.muon_split_fused and recipe.muon_adjust_lr == "match_rms_adamw"
    muon = next(o for o in build_optimizers(model, recipe) if isinstance(o, Muon))
    attn = model.transformer.core_block[0].attn
    assert muon.row_blocks[id(attn.Wqkv.weight)] == (32, 16, 16)
    assert muon.row_blocks[id(model.transformer.core_block[0].mlp.fc.weight)] == (48, 48)
    assert not next(o for o in build_optimizers(model, OptimConfig(name="muon")) if isinstance(o, Muon)).row_blocks
