"""Optimizers: HuginnAdam against the reference formula and against AdamW / adam-atan2-pytorch,
Huginn's parameter groups, Muon wiring, state round trips, gradient clipping and OptimConfig.

Tolerances: float64 comparisons with the same formula evaluated in another order agree to ~1e-15,
so they use 1e-12; float32 comparisons against other implementations use 1e-6 relative (a few ulps
accumulated over the steps).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recurrent_depth.train import (
    ELLISAdam,
    HuginnAdam,
    OptimConfig,
    OptimizerSet,
    build_optimizers,
    clip_and_check_grads,
    set_lr,
)
from recurrent_depth.train.optim import parameter_kind, split_parameters


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The toy shapes gain nothing from intra-op threads, and on a loaded 2-core machine OpenMP
    # spin-waiting made each step ~15x slower. Restored afterwards for the other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------
# The reference formula, written out literally from training-stack.md section 3 (with the in-place
# floor of v noted in huginn-0125.md section 5), one tensor at a time.


def reference_ellis_step(p, g, state, lr, lr_init, wd, betas=(0.9, 0.95), eps=1e-6):
    b1, b2 = betas
    if not state:  # running_init: m0 = g1, v0 = g1^2
        state["m"], state["v"], state["t"] = g.clone(), g * g, 0
    state["t"] += 1
    t = state["t"]
    state["m"] = b1 * state["m"] + (1 - b1) * g
    state["v"] = b2 * state["v"] + (1 - b2) * g * g
    state["v"] = torch.maximum(state["v"], torch.full_like(state["v"], eps**2))  # in place in the reference
    m, v = state["m"], state["v"]
    s = lr / max(1.0, math.sqrt(float(torch.mean(g**2 / torch.maximum(v, torch.full_like(v, eps**2)))))) / (1 - b1**t)
    p = p * (1 - (lr / lr_init) * wd)
    p = p - s * torch.atan2(m, torch.sqrt(v) / math.sqrt(1 - b2**t))
    return p


# Odd shapes, a 1-D gain, a 3-D tensor, and one tensor with gradients so small that v < eps^2
# (exercises the floor).
SHAPES = [(7, 5), (13,), (3, 4, 6), (1, 9)]
GRAD_SCALES = [1.0, 0.3, 2.0, 1e-8]


def make_grads(steps: int, dtype: torch.dtype, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        spike = 10.0 if step == 4 else 1.0  # a sudden gradient spike trips update clipping
        out.append(
            [torch.randn(s, generator=gen, dtype=dtype) * scale * spike for s, scale in zip(SHAPES, GRAD_SCALES)]
        )
    return out


def make_params(dtype: torch.dtype, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)], ids=["float64", "float32"])
def test_huginn_adam_matches_the_reference_formula(dtype: torch.dtype, tol: float) -> None:
    steps, lr0, wd = 9, 1e-2, 0.1
    lrs = [lr0 * f for f in (0.25, 0.5, 1.0, 1.0, 1.0, 1.0, 0.8, 0.5, 0.2)]  # a schedule: lr/initial_lr moves
    grads = make_grads(steps, dtype)
    params = [p.clone().requires_grad_(True) for p in make_params(dtype)]
    ref_params = [p.detach().clone() for p in params]
    ref_states: list[dict] = [{} for _ in params]
    opt = HuginnAdam(params, lr=lr0, weight_decay=wd)  # defaults = the paper's switches
    clipped_steps = 0
    for step in range(steps):
        set_lr(opt, lrs[step])
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads[step]):
            ref_params[i] = reference_ellis_step(ref_params[i], g, ref_states[i], lrs[step], lr0, wd)
            v = ref_states[i]["v"]
            clipped_steps += float(torch.mean(g**2 / v)) > 1
        for p, ref in zip(params, ref_params):
            torch.testing.assert_close(p.detach(), ref, rtol=tol, atol=tol)
    assert clipped_steps > 0, "the test data must exercise update clipping"
    assert ELLISAdam is HuginnAdam


def test_v_floor_is_stored_as_in_the_reference() -> None:
    p = torch.zeros(5, requires_grad=True)
    opt = HuginnAdam([p], lr=1e-3)
    p.grad = torch.full((5,), 1e-9)
    opt.step()
    assert torch.all(opt.state[p]["exp_avg_sq"] == 1e-12)


def test_running_init_sets_moments_to_the_first_gradient() -> None:
    p = torch.zeros(4, 3, requires_grad=True)
    g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    opt = HuginnAdam([p], lr=1e-3, update_clipping=False)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg"], g, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], g * g, rtol=1e-6, atol=0)
    zero_init = HuginnAdam([q := torch.zeros(4, 3, requires_grad=True)], lr=1e-3, running_init=False)
    q.grad = g.clone()
    zero_init.step()
    torch.testing.assert_close(zero_init.state[q]["exp_avg"], 0.1 * g)


def run_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("bias_correction", ["outside", "inside"], ids=["bc-outside", "bc-inside"])
@pytest.mark.parametrize("wd", [0.0, 0.05], ids=["no-wd", "wd"])
def test_switches_off_equals_torch_adamw(bias_correction: str, wd: float) -> None:
    grads = make_grads(6, torch.float32)
    grads = [[g for g, scale in zip(gs, GRAD_SCALES) if scale > 1e-3] for gs in grads]  # AdamW's eps regime
    ours = [p.clone().requires_grad_(True) for p in make_params(torch.float32)[:3]]
    theirs = [p.clone().requires_grad_(True) for p in make_params(torch.float32)[:3]]
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    run_steps(
        HuginnAdam(
            ours,
            **kwargs,
            atan2=False,
            update_clipping=False,
            running_init=False,
            fully_decoupled_wd=False,
            bias_correction=bias_correction,
        ),
        ours,
        grads,
    )
    run_steps(torch.optim.AdamW(theirs, **kwargs, foreach=False), theirs, grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("decoupled", [False, True], ids=["lr-times-wd", "fully-decoupled"])
def test_atan2_without_clipping_equals_adam_atan2_pytorch(decoupled: bool) -> None:
    adam_atan2 = pytest.importorskip("adam_atan2_pytorch", reason="adam-atan2-pytorch is an optional test oracle")
    grads = make_grads(6, torch.float32)
    ours = [p.clone().requires_grad_(True) for p in make_params(torch.float32)]
    theirs = [p.clone().requires_grad_(True) for p in make_params(torch.float32)]
    run_steps(
        HuginnAdam(
            ours,
            lr=3e-3,
            betas=(0.9, 0.99),
            weight_decay=0.1,
            atan2_a=1.27,
            update_clipping=False,
            running_init=False,
            bias_correction="inside",
            fully_decoupled_wd=decoupled,
        ),
        ours,
        grads,
    )
    run_steps(
        adam_atan2.AdamAtan2(theirs, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1, decoupled_wd=decoupled),
        theirs,
        grads,
    )
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bias_correction_placement_changes_the_atan2_update() -> None:
    results = {}
    for where in ("outside", "inside", "none"):
        p = torch.ones(6, requires_grad=True)
        opt = HuginnAdam([p], lr=0.1, update_clipping=False, running_init=False, bias_correction=where)
        p.grad = torch.linspace(-1, 1, 6)
        opt.step()
        results[where] = p.detach().clone()
    # step 1 from zero moments: m = 0.1 g, v = 0.05 g^2.
    g = torch.linspace(-1, 1, 6)
    expected = {
        "outside": 1 - 0.1 / 0.1 * torch.atan2(0.1 * g, (0.05 * g * g).sqrt() / math.sqrt(0.05)),
        "inside": 1 - 0.1 * torch.atan2(g, g.abs()),
        "none": 1 - 0.1 * torch.atan2(0.1 * g, (0.05 * g * g).sqrt()),
    }
    for where in results:
        torch.testing.assert_close(results[where], expected[where])
    assert not torch.allclose(results["outside"], results["inside"])


def test_step_bound_with_outside_bias_correction_is_as_documented() -> None:
    # docs/training-recipe.md once said every coordinate moves at most pi/2 * lr; with the defaults (running init,
    # bias correction outside the atan2) the first step moves atan(sqrt(1 - b2)) / (1 - b1) * lr = 2.2 lr.
    p = torch.zeros(64, requires_grad=True)
    opt = HuginnAdam([p], lr=1.0)
    p.grad = torch.randn(64)
    opt.step()
    first = math.atan(math.sqrt(1 - 0.95)) / (1 - 0.9)
    torch.testing.assert_close(p.detach().abs(), torch.full((64,), first))
    assert math.pi / 2 < first < math.pi / 2 / (1 - 0.9)


def test_atan2_update_is_invariant_to_gradient_scale() -> None:
    # Everett et al.: atan2 removes eps, so a 1e-10 gradient scale gives the same trajectory.
    grads = make_grads(5, torch.float64)
    finals = []
    for scale in (1.0, 1e-10):
        params = [p.clone().requires_grad_(True) for p in make_params(torch.float64)[:3]]
        opt = HuginnAdam(params, lr=1e-2, update_clipping=False)
        run_steps(opt, params, [[g * scale for g in gs[:3]] for gs in grads])
        finals.append([p.detach() for p in params])
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_update_clipping_scales_the_step_after_a_spike() -> None:
    grads = [torch.full((8,), 1.0)] * 5 + [torch.full((8,), 10.0)]
    moved = {}
    for clipping in (False, True):
        p = torch.zeros(8, requires_grad=True)
        opt = HuginnAdam([p], lr=0.01, update_clipping=clipping, running_init=True, bias_correction="none")
        for g in grads[:-1]:
            p.grad = g.clone()
            opt.step()
        before = p.detach().clone()
        p.grad = grads[-1].clone()
        opt.step()
        moved[clipping] = (p.detach() - before).abs().mean().item()
    # v after the spike: 0.95 * 1 + 0.05 * 100 = 5.95, so RMS = 10 / sqrt(5.95)
    assert moved[True] == pytest.approx(moved[False] / (10 / math.sqrt(5.95)), rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": 0.9}, "betas"),
        ({"eps": 0.0}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"bias_correction": "middle"}, "bias_correction"),
        ({"atan2_a": 0.0}, "atan2_a"),
        ({"lr": 0.0, "weight_decay": 0.1}, "initial_lr"),
        ({"atan2": "false"}, "atan2 must be True or False"),
    ],
    ids=["lr<0", "beta2=1", "one-beta", "scalar-betas", "eps0", "wd<0", "bad-bias-corr", "a0", "decay-without-lr",
         "atan2-str"],
)
def test_huginn_adam_rejects_bad_hyperparameters(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        HuginnAdam([torch.zeros(2, requires_grad=True)], **kwargs)


def test_group_added_later_steps_like_one_given_at_construction() -> None:
    # add_param_group used to skip initial_lr (KeyError in step with weight decay) and validation.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, generator=gen), torch.randn(2, 4, generator=gen)
    grads = [(torch.randn(3, generator=gen), torch.randn(2, 4, generator=gen)) for _ in range(3)]
    late = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    both = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    opt_late = HuginnAdam([late[0]], lr=1e-2, weight_decay=0.1)
    opt_late.add_param_group({"params": [late[1]], "lr": 1e-3, "betas": [0.8, 0.9]})
    opt_both = HuginnAdam(
        [{"params": [both[0]]}, {"params": [both[1]], "lr": 1e-3, "betas": (0.8, 0.9)}], lr=1e-2, weight_decay=0.1
    )
    for g in grads:
        for params, opt in ((late, opt_late), (both, opt_both)):
            params[0].grad, params[1].grad = g[0].clone(), g[1].clone()
            opt.step()
    assert opt_late.param_groups[1]["initial_lr"] == 1e-3
    for x, y in zip(late, both):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match=r"param group 2: betas\[1\]"):
        opt_late.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "betas": (0.9, 1.5)})
    assert len(opt_late.param_groups) == 2


# ------------------------------------------------------------------------------------------------
# A tiny model with Huginn-0125's parameter names (the real model lives in recurrent_depth.model).


class ToyAttention(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.Wqkv = nn.Linear(h, 3 * h, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, heads, h // heads))
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, h]
        b, t, h = x.shape
        q, k, v = self.Wqkv(x).view(b, t, 3, self.heads, h // self.heads).unbind(2)  # [B, T, H, D]
        q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class ToyBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.norm_1 = nn.RMSNorm(h)
        self.attn = ToyAttention(h, heads)
        self.norm_2 = nn.RMSNorm(h)
        self.norm_3 = nn.RMSNorm(h)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(h, 2 * h, bias=False), "proj": nn.Linear(h, h, bias=False)})
        self.norm_4 = nn.RMSNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x)))
        a, b = self.mlp["fc"](self.norm_3(x)).chunk(2, dim=-1)
        return self.norm_4(x + self.mlp["proj"](F.silu(a) * b))


class ToyHuginn(nn.Module):
    """prelude -> r x (adapter(concat[s, e]) -> core) -> coda, with Huginn's names and tied embeddings."""

    def __init__(self, vocab: int = 37, h: int = 24, heads: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, h),
                "prelude": nn.ModuleList([ToyBlock(h, heads)]),
                "adapter": nn.Linear(2 * h, h, bias=False),
                "core_block": nn.ModuleList([ToyBlock(h, heads), ToyBlock(h, heads)]),
                "coda": nn.ModuleList([ToyBlock(h, heads)]),
                "ln_f": nn.RMSNorm(h),
            }
        )
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, ids: torch.Tensor, num_steps: int = 2) -> torch.Tensor:
        tr = self.transformer
        e = tr["wte"](ids)
        for block in tr["prelude"]:
            e = block(e)
        s = torch.zeros_like(e)
        for _ in range(num_steps):
            s = tr["adapter"](torch.cat([s, e], dim=-1))
            for block in tr["core_block"]:
                s = block(s)
        for block in tr["coda"]:
            s = block(s)
        return self.lm_head(tr["ln_f"](s))


def toy_batch(seed: int = 0, vocab: int = 37) -> torch.Tensor:
    # a learnable pattern: an arithmetic sequence mod vocab with a random start per row
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (8, 1), generator=gen)
    stride = torch.randint(1, 4, (8, 1), generator=gen)
    return (start + stride * torch.arange(17)) % vocab


def toy_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_parameter_kinds_follow_huginn() -> None:
    model = ToyHuginn()
    kinds = {n: parameter_kind(n, p) for n, p in model.named_parameters()}
    assert kinds["transformer.wte.weight"] == "embedding"
    assert kinds["transformer.adapter.weight"] == "matrix"
    assert kinds["transformer.prelude.0.attn.Wqkv.weight"] == "matrix"
    assert kinds["transformer.core_block.1.mlp.proj.weight"] == "matrix"
    assert kinds["transformer.core_block.0.attn.qk_bias"] == "no_decay"  # 4-D, but a bias
    assert kinds["transformer.coda.0.norm_4.weight"] == "no_decay"
    assert kinds["transformer.ln_f.weight"] == "no_decay"
    assert parameter_kind("lm_head.weight", model.lm_head.weight) == "embedding"
    assert parameter_kind("x.proj.bias", torch.zeros(3)) == "no_decay"


def test_split_dedupes_tied_weights_and_skips_frozen() -> None:
    model = ToyHuginn()
    model.transformer["coda"][0].norm_4.weight.requires_grad_(False)
    parts = split_parameters(model.named_parameters(remove_duplicate=False))
    ids = [id(p) for items in parts.values() for _, p in items]
    assert len(ids) == len(set(ids))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(ids) == trainable
    assert [n for n, _ in parts["embedding"]] == ["transformer.wte.weight"]


def groups_by_name(opts: OptimizerSet) -> dict[str, tuple[str, dict]]:
    return {g["name"]: (type(o).__name__, g) for o in opts for g in o.param_groups}


@pytest.mark.parametrize("name", ["adamw", "ellis-adam", "muon"])
def test_build_optimizers_groups(name: str) -> None:
    model = ToyHuginn()
    recipe = OptimConfig(name=name, lr=1e-3, weight_decay=0.01, muon_lr=0.02, muon_weight_decay=0.001)
    opts = build_optimizers(model, recipe)
    groups = groups_by_name(opts)
    all_params = [id(p) for o in opts for g in o.param_groups for p in g["params"]]
    assert sorted(all_params) == sorted(id(p) for p in model.parameters())  # each exactly once, tie included

    kind, no_decay = groups["no_decay"]
    assert no_decay["weight_decay"] == 0.0
    names = model.named_parameters()
    assert all("norm" in n or "bias" in n or p.ndim < 2 for n, p in names if n in no_decay["param_names"])
    assert "transformer.ln_f.weight" in no_decay["param_names"]
    assert any(n.endswith("attn.qk_bias") for n in no_decay["param_names"])
    kind_m, matrices = groups["matrices"]
    assert "transformer.adapter.weight" in matrices["param_names"]
    assert all("wte" not in n and "lm_head" not in n and "norm" not in n for n in matrices["param_names"])
    assert all(p.ndim == 2 for p in matrices["params"])
    kind_e, embeddings = groups["embeddings"]
    assert embeddings["param_names"] == ["transformer.wte.weight"]
    assert embeddings["weight_decay"] == 0.01
    expected = {"adamw": "AdamW", "ellis-adam": "HuginnAdam", "muon": "AdamW"}[name]
    assert kind == kind_e == expected
    if name == "muon":
        assert kind_m == "Muon"
        assert len(opts) == 2
        assert matrices["lr"] == pytest.approx(0.02)
        assert matrices["lr_scale"] == pytest.approx(20.0)
        assert matrices["weight_decay"] == 0.001
        set_lr(opts, 5e-4)
        assert matrices["lr"] == pytest.approx(0.01)
        assert embeddings["lr"] == pytest.approx(5e-4)
    else:
        assert kind_m == expected
        assert matrices["weight_decay"] == 0.01
        assert len(opts) == 1


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_adamw_is_torchs_fused_kernel_on_cpu(name: str) -> None:
    opts = build_optimizers(ToyHuginn(), OptimConfig(name=name, lr=1e-3, muon_lr=0.02))
    assert [o.defaults["fused"] for o in opts if isinstance(o, torch.optim.AdamW)] == [True]


def test_fused_adamw_steps_as_the_per_op_loop() -> None:
    torch.manual_seed(0)
    model, reference = ToyHuginn(), ToyHuginn()
    reference.load_state_dict(model.state_dict())
    recipe = OptimConfig(name="adamw", lr=3e-3, weight_decay=0.0)
    fused = build_optimizers(model, recipe)
    loop = torch.optim.AdamW(reference.parameters(), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                             weight_decay=0.0)
    ids = toy_batch()
    for _ in range(5):
        for net, opt in ((model, fused), (reference, loop)):
            opt.zero_grad()
            toy_loss(net, ids).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_adamw_stays_unfused_for_parameters_torch_has_no_fused_kernel_for() -> None:
    """A parameter on a device without the kernel (here meta) leaves `fused` at torch's default."""
    from recurrent_depth.train.optim import adamw

    on_meta = nn.Parameter(torch.zeros(3, device="meta"))
    assert not adamw([{"params": [("w", on_meta)]}], OptimConfig(name="adamw")).defaults["fused"]


@pytest.mark.parametrize("name", ["adamw", "ellis-adam", "muon"])
def test_each_recipe_trains_the_toy_model(name: str) -> None:
    torch.manual_seed(0)
    model = ToyHuginn()
    lr = {"adamw": 3e-3, "ellis-adam": 3e-3, "muon": 3e-3}[name]
    opts = build_optimizers(model, OptimConfig(name=name, lr=lr, muon_lr=0.02, weight_decay=0.01))
    ids = toy_batch()
    first = toy_loss(model, ids).item()
    for _ in range(40):
        opts.zero_grad()
        toy_loss(model, ids).backward()
        norm, finite = clip_and_check_grads(model.parameters(), 1.0)
        assert finite and norm > 0
        opts.step()
    last = toy_loss(model, ids).item()
    assert last < 0.6 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
    assert model.lm_head.weight is model.transformer["wte"].weight


@pytest.mark.parametrize("name", ["adamw", "ellis-adam", "muon"])
def test_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    def train(model: nn.Module, opts: OptimizerSet, steps: range) -> list[float]:
        losses = []
        for step in steps:
            opts.zero_grad()
            loss = toy_loss(model, toy_batch(step))
            loss.backward()
            opts.step()
            losses.append(loss.item())
        return losses

    recipe = OptimConfig(name=name, lr=2e-3, weight_decay=0.01)
    torch.manual_seed(0)
    straight = ToyHuginn()
    straight_opts = build_optimizers(straight, recipe)
    expected = train(straight, straight_opts, range(6))

    torch.manual_seed(0)
    first = ToyHuginn()
    first_opts = build_optimizers(first, recipe)
    got = train(first, first_opts, range(3))
    buf_model, buf_opt = io.BytesIO(), io.BytesIO()
    torch.save(first.state_dict(), buf_model)
    torch.save(first_opts.state_dict(), buf_opt)
    buf_model.seek(0)
    buf_opt.seek(0)

    torch.manual_seed(123)  # a different init: everything must come from the saved state
    resumed = ToyHuginn()
    resumed.load_state_dict(torch.load(buf_model, weights_only=True))
    resumed_opts = build_optimizers(resumed, recipe)
    resumed_opts.load_state_dict(torch.load(buf_opt, weights_only=True))
    got += train(resumed, resumed_opts, range(3, 6))
    assert got == expected
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_another_recipe() -> None:
    model = ToyHuginn()
    state = build_optimizers(model, OptimConfig(name="adamw", lr=1e-3)).state_dict()
    with pytest.raises(ValueError, match="same optimizer recipe"):
        build_optimizers(model, OptimConfig(name="muon", lr=1e-3)).load_state_dict(state)


# ------------------------------------------------------------------------------------------------
# Gradient clipping


def params_with_grads(*grads: torch.Tensor | None) -> list[torch.Tensor]:
    params = []
    for g in grads:
        shape = g.shape if g is not None else (2,)
        p = torch.zeros(shape, requires_grad=True)
        p.grad = None if g is None else g.clone()
        params.append(p)
    return params


def test_clip_reports_the_pre_clip_norm_and_clips() -> None:
    params = params_with_grads(torch.full((3,), 2.0), torch.full((2, 2), 1.0), None)
    norm, finite = clip_and_check_grads(params, max_norm=1.0)
    assert finite
    assert norm == pytest.approx(math.sqrt(3 * 4 + 4))
    clipped = math.sqrt(sum(float((p.grad**2).sum()) for p in params if p.grad is not None))
    assert clipped == pytest.approx(1.0, rel=1e-5)


def test_clip_leaves_small_gradients_alone() -> None:
    params = params_with_grads(torch.tensor([0.3, -0.4]))
    norm, finite = clip_and_check_grads(params, max_norm=1.0)
    assert (norm, finite) == (pytest.approx(0.5), True)
    assert torch.equal(params[0].grad, torch.tensor([0.3, -0.4]))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_non_finite_gradient_is_reported_and_left_untouched(bad: float) -> None:
    params = params_with_grads(torch.tensor([1.0, bad]), torch.tensor([3.0]))
    norm, finite = clip_and_check_grads(params, max_norm=1.0)
    assert not finite
    assert not math.isfinite(norm)
    assert params[1].grad.item() == 3.0  # not scaled by 0 or nan


def test_clip_none_only_measures_and_validates() -> None:
    params = params_with_grads(torch.tensor([30.0, 40.0]))
    assert clip_and_check_grads(params, None) == (pytest.approx(50.0), True)
    assert torch.equal(params[0].grad, torch.tensor([30.0, 40.0]))
    assert clip_and_check_grads(params_with_grads(None), 1.0) == (0.0, True)
    with pytest.raises(ValueError, match="max_norm"):
        clip_and_check_grads(params, 0.0)


# ------------------------------------------------------------------------------------------------
# OptimConfig


def test_huginn_preset_has_the_papers_values() -> None:
    cfg = OptimConfig.from_preset("huginn-0125")
    assert (cfg.name, cfg.lr, cfg.weight_decay, cfg.betas) == ("ellis-adam", 4e-5, 4e-5, (0.9, 0.95))
    assert cfg.atan2 and cfg.update_clipping and cfg.running_init and cfg.fully_decoupled_wd
    assert cfg.bias_correction == "outside"
    assert (cfg.warmup_steps, cfg.cooldown_steps, cfg.min_lr, cfg.grad_clip) == (4096, 4096, 0.0, 1.0)
    assert cfg.skip_first_step and not OptimConfig.from_preset("demo").skip_first_step
    total = 100_000
    assert cfg.lr_at(0, total) == pytest.approx(4e-5 / 4096)
    assert cfg.lr_at(50_000, total) == 4e-5
    assert cfg.lr_at(total - 1, total) == pytest.approx(4e-5 / 4096)


def test_presets_build_and_overrides_apply() -> None:
    demo = OptimConfig.from_preset("demo", lr=1e-3)
    assert demo.lr == 1e-3
    build_optimizers(ToyHuginn(), demo)
    with pytest.raises(ValueError, match="preset"):
        OptimConfig.from_preset("nope")
    adamw = OptimConfig.from_preset("demo", name="adamw", lr=2e-3)  # the optimizer's own `name` field
    assert (adamw.name, adamw.lr, adamw.warmup_steps) == ("adamw", 2e-3, demo.warmup_steps)
    with pytest.raises(ValueError, match="unknown optim field.*learning_rate"):
        OptimConfig.from_preset("demo", learning_rate=1.0)


def test_config_round_trips_through_plain_data() -> None:
    cfg = OptimConfig(name="muon", lr=1e-3, betas=[0.8, 0.9], cooldown_fraction=0.25, muon_adjust_lr="original")
    assert cfg.betas == (0.8, 0.9)
    data = cfg.to_dict()
    assert OptimConfig.from_dict(data) == cfg
    with pytest.raises(ValueError, match="unknown optim field"):
        OptimConfig.from_dict({**data, "learning_rate": 1.0})


def test_cooldown_length() -> None:
    assert OptimConfig(cooldown_fraction=0.2).cooldown_for(1000) == 200
    assert OptimConfig(cooldown_steps=30).cooldown_for(1000) == 30
    assert OptimConfig().cooldown_for(1000) == 0
    assert OptimConfig(cooldown_fraction=0.2).cooldown_for(None) == 0
    with pytest.raises(ValueError, match="cooldown_steps"):
        OptimConfig(cooldown_steps=30).cooldown_for(None)


def test_overriding_one_cooldown_length_replaces_the_presets_other() -> None:
    # demo has cooldown_fraction 0.2 and huginn-0125 cooldown_steps 4096: setting the other length over them
    # (YAML `optim: {cooldown_steps: 100}`, `--optim-preset huginn-0125 --cooldown-fraction 0.2`) used to fail
    # with "exclusive", naming a value the user never wrote and no flag could clear.
    from recurrent_depth.train.config import optim_from_dict

    steps = OptimConfig.from_preset("demo", cooldown_steps=100)
    assert (steps.cooldown_steps, steps.cooldown_fraction) == (100, None)
    frac = optim_from_dict({"preset": "huginn-0125", "cooldown_fraction": 0.2})
    assert (frac.cooldown_steps, frac.cooldown_fraction) == (None, 0.2)
    assert optim_from_dict({"cooldown_steps": 0}).cooldown_for(1000) == 0  # the default preset is demo
    with pytest.raises(ValueError, match="exclusive"):  # both given: still refused
        OptimConfig.from_preset("demo", cooldown_steps=100, cooldown_fraction=0.1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "sgd"}, "optim.name"),
        ({"lr": 0.0}, "optim.lr"),
        ({"betas": (0.9, 1.5)}, r"optim.betas\[1\]"),
        ({"betas": 0.9}, "optim.betas"),
        ({"weight_decay": -1.0}, "optim.weight_decay"),
        ({"eps": -1e-8}, "optim.eps"),
        ({"bias_correction": "x"}, "optim.bias_correction"),
        ({"muon_lr": 0.0}, "optim.muon_lr"),
        ({"muon_momentum": 1.0}, "optim.muon_momentum"),
        ({"muon_ns_steps": 0}, "optim.muon_ns_steps"),
        ({"muon_adjust_lr": "rms"}, "optim.muon_adjust_lr"),
        ({"muon_ns_dtype": "float16"}, "optim.muon_ns_dtype"),
        ({"grad_clip": 0.0}, "optim.grad_clip"),
        ({"warmup_steps": -1}, "optim.warmup_steps"),
        ({"cooldown_steps": 10, "cooldown_fraction": 0.1}, "exclusive"),
        ({"cooldown_fraction": 1.5}, "optim.cooldown_fraction"),
        ({"min_lr": 1.0, "lr": 1e-3}, "optim.min_lr"),
        ({"skip_first_step": "yes"}, "optim.skip_first_step"),
        ({"atan2": "false"}, "optim.atan2 must be true or false"),  # (a truthy string turned atan2 on)
        ({"running_init": None}, "optim.running_init must be true or false"),
        ({"muon_nesterov": "false"}, "optim.muon_nesterov must be true or false"),
    ],
    ids=[
        "name",
        "lr0",
        "beta2>1",
        "scalar-betas",
        "wd<0",
        "eps<0",
        "bias-correction",
        "muon-lr0",
        "muon-momentum1",
        "ns-steps0",
        "adjust-lr",
        "ns-dtype",
        "clip0",
        "warmup<0",
        "cooldown-both",
        "cooldown-fraction>1",
        "min-lr>lr",
        "skip-first-step-str",
        "atan2-str",
        "running-init-none",
        "nesterov-str",
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OptimConfig(**kwargs)


def test_groups_on_the_real_model() -> None:
    rd = pytest.importorskip("recurrent_depth")
    if not hasattr(rd, "RecurrentDepthLM"):
        pytest.skip("recurrent_depth.RecurrentDepthLM is not available in this checkout")
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    groups = groups_by_name(build_optimizers(model, OptimConfig(name="muon", lr=1e-3, weight_decay=0.1)))
    params = dict(model.named_parameters())
    assert groups["matrices"][0] == "Muon"
    assert "transformer.adapter.weight" in groups["matrices"][1]["param_names"]
    assert groups["embeddings"][1]["param_names"] == ["transformer.wte.weight"]
    for name in groups["no_decay"][1]["param_names"]:
        assert "norm" in name or "bias" in name or params[name].ndim < 2
    assert any(n.endswith("qk_bias") for n in groups["no_decay"][1]["param_names"]) == model.config.qk_bias
    covered = sum(len(g["params"]) for _, g in groups.values())
    assert covered == len(params)


@pytest.mark.parametrize("mixer", ["gated_deltanet", "log_linear_mamba2"])
def test_muon_takes_linear_weights_only(mixer: str) -> None:
    """Depthwise convolution filters ([channels, taps]) and per-level weights are 2-D but not linear maps:
    Newton-Schulz would orthogonalise their taps across channels. They go to AdamW."""
    import recurrent_depth as rd

    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer=mixer))
    groups = groups_by_name(build_optimizers(model, OptimConfig(name="muon", lr=1e-3, weight_decay=0.1)))
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    muon_names = set(groups["matrices"][1]["param_names"])
    assert muon_names and muon_names <= linear
    adam_names = set(groups["embeddings"][1]["param_names"])
    assert any(n.endswith("conv.weight") for n in adam_names)
    assert all(n.endswith("weight") for n in adam_names)
    covered = sum(len(g["params"]) for _, g in groups.values())
    assert covered == len(dict(model.named_parameters()))


def test_update_clipping_survives_a_zero_gradient_in_float16() -> None:
    # eps^2 = 1e-12 underflows to 0 in float16, so the clipping RMS was 0/0 and every weight became NaN.
    grads = [torch.tensor([0.0, 1e-3, 1.0, -2.0]), torch.tensor([0.5, 0.0, -1.0, 3.0])]
    half = torch.ones(4, dtype=torch.float16, requires_grad=True)
    full = torch.ones(4, dtype=torch.float32, requires_grad=True)
    opt_half, opt_full = HuginnAdam([half], lr=1e-2), HuginnAdam([full], lr=1e-2)
    for g in grads:
        half.grad, full.grad = g.half(), g.clone()
        opt_half.step()
        opt_full.step()
    assert torch.isfinite(half).all()
    torch.testing.assert_close(half.float(), full.detach(), atol=2e-3, rtol=0)


def test_huginn_adams_step_count_does_not_take_torchs_default_dtype():
    """Under a bf16 default dtype the step counter was a bf16 tensor: it stuck at 256 (257 rounds back to
    256), and the bias correction with it. torch's Adam keeps it in float32 there too."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        p = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        opt = HuginnAdam([p], lr=1e-3)
        for _ in range(300):
            p.grad = torch.ones_like(p)
            opt.step()
    finally:
        torch.set_default_dtype(saved)
    assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 300
