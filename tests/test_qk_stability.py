"""QK-norm (a model option) and QK-clip (after each optimizer step): bounds, exact rescaling, recording."""

from __future__ import annotations

import json
import math

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.model.mixers.logits import head_max_logits
from recurrent_depth.train.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("one_thread")


def config(**overrides) -> rd.ModelConfig:
    return rd.ModelConfig.from_preset("tiny", **overrides)


def attention(cfg: rd.ModelConfig, seed: int = 0, gain_scale: float = 3.0):
    """The first prelude attention of a fresh model, its weights and gains randomised (large logits)."""
    torch.manual_seed(seed)
    model = rd.RecurrentDepthLM(cfg).train()
    attn = model.transformer.prelude[0].attn
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.startswith(("Wqkv.", "wq.", "wkv_")) and p.ndim == 2:
                p.mul_(4.0)
            if name.endswith(("bias", "qk_bias")):
                p.normal_(0, 0.5)
            if name.endswith("norm.weight"):
                p.normal_(0, gain_scale)
    return model, attn


def context(model, B: int, T: int, attention_mask=None):
    ids = torch.zeros(B, T, dtype=torch.long)
    return model.make_context(ids, attention_mask)


def explicit_logits(attn, x, ctx) -> torch.Tensor:
    """Every scaled logit q_i . k_j / sqrt(D) the mixer feeds to SDPA, masked entries -inf: [B, H, T, S]."""
    q, k, _ = attn.qkv(x, ctx)
    group = attn.num_heads // attn.num_kv_heads
    k = k.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) / math.sqrt(attn.head_dim)
    T, S = q.shape[1], k.shape[1]
    allowed = ctx.attn_mask if ctx.attn_mask is not None else torch.ones(T, S, dtype=torch.bool).tril()[None, None]
    return scores.masked_fill(~allowed, float("-inf"))


CASES = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa-bias": dict(num_kv_heads=1, bias=True),
    "qk-norm": dict(qk_norm=True),
    "qk-norm-gqa": dict(qk_norm=True, num_kv_heads=2),
    "qk-norm-per-head": dict(qk_norm=True, qk_norm_per_head=True),
    "qk-norm-per-head-gqa": dict(qk_norm=True, qk_norm_per_head=True, num_kv_heads=2),
}


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
@pytest.mark.parametrize("case", ["mha", "gqa", "qk-norm"])
def test_recorded_max_logit_equals_the_explicit_maximum(case, padded):
    model, attn = attention(config(**CASES[case], max_seq_len=256))
    B, T = 2, 150  # more than one query block of head_max_logits
    mask = None
    if padded:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, :9] = 0
    ctx = context(model, B, T, mask)
    x = torch.randn(B, T, 64)
    q, k, _ = attn.qkv(x, ctx)
    found = head_max_logits(q, k, attn.head_dim**-0.5, ctx.attn_mask, ctx.is_causal)
    expected = explicit_logits(attn, x, ctx).amax(dim=(0, 2, 3))
    torch.testing.assert_close(found.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", ["qk-norm", "qk-norm-gqa", "qk-norm-per-head-gqa"])
def test_qk_norm_bounds_every_scaled_logit(case, seed):
    # Bound on the scaled pre-softmax logit l_ij = q_i . k_j / sqrt(D) (what SDPA exponentiates):
    # ||RMSNorm(x) * g|| <= max|g| sqrt(D), RoPE rotates pairs (norm kept), so |l_ij| <= max|g_q| max|g_k| sqrt(D).
    model, attn = attention(config(**CASES[case]), seed=seed, gain_scale=2.0 + seed)
    x = torch.randn(2, 40, 64) * 30
    logits = explicit_logits(attn, x, context(model, 2, 40))
    bound = attn.q_norm.weight.abs().max() * attn.k_norm.weight.abs().max() * math.sqrt(attn.head_dim)
    finite = logits[torch.isfinite(logits)]
    assert finite.abs().max() <= bound


def test_qk_norm_bound_is_attained_when_q_equals_k():
    model, attn = attention(config(qk_norm=True), gain_scale=0.0)
    D, H = attn.head_dim, attn.num_heads
    with torch.no_grad():
        attn.Wqkv.weight[H * D:2 * H * D] = attn.Wqkv.weight[:H * D]  # k = q, so l_ii = |q~_i|^2 / sqrt(D)
        attn.qk_bias[1] = attn.qk_bias[0]
        attn.q_norm.weight.fill_(1.5)
        attn.k_norm.weight.fill_(-2.0)
    logits = explicit_logits(attn, torch.randn(1, 12, 64) * 10, context(model, 1, 12))
    diagonal = logits[0].diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(diagonal, torch.full_like(diagonal, -3.0 * math.sqrt(D)), rtol=1e-5, atol=0)


def test_qk_norm_off_keeps_the_checkpoint_layout_and_on_adds_two_gains():
    off = rd.RecurrentDepthLM(config())
    on = rd.RecurrentDepthLM(config(qk_norm=True))
    assert not any("q_norm" in n or "k_norm" in n for n in off.state_dict())
    extra = sorted(set(on.state_dict()) - set(off.state_dict()))
    assert extra == sorted(f"transformer.{part}.attn.{g}_norm.weight" for part in
                           ("prelude.0", "core_block.0", "core_block.1", "coda.0") for g in "qk")
    assert on.num_parameters() == on.config.num_parameters()
    assert config().to_dict()["qk_norm"] is False


def test_qk_norm_per_head_gains_are_an_option_that_keeps_the_shared_layout_when_off(tmp_path):
    shared = rd.RecurrentDepthLM(config(qk_norm=True, num_kv_heads=2))
    torch.manual_seed(0)
    per_head = rd.RecurrentDepthLM(config(qk_norm=True, qk_norm_per_head=True, num_kv_heads=2)).eval()
    assert config(qk_norm=True).qk_norm_per_head is False  # off by default: one gain [head_dim] as Qwen3
    assert shared.state_dict().keys() == per_head.state_dict().keys()
    attn = per_head.transformer.core_block[0].attn
    assert attn.q_norm.weight.shape == (4, 16) and attn.k_norm.weight.shape == (2, 16)
    assert shared.transformer.core_block[0].attn.q_norm.weight.shape == (16,)
    assert per_head.num_parameters() == per_head.config.num_parameters()
    with torch.no_grad():
        attn.q_norm.weight.normal_()
    per_head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["qk_norm_per_head"] is True
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 256, (2, 9))
    assert torch.equal(loaded(x, num_steps=3, init_scale=0.0).logits, per_head(x, num_steps=3, init_scale=0.0).logits)
    with pytest.raises(ValueError, match="qk_norm_per_head"):
        config(qk_norm_per_head=True)


def test_qk_norm_is_saved_in_the_config_and_reloads(tmp_path):
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config(qk_norm=True)).eval()
    with torch.no_grad():
        model.transformer.core_block[0].attn.q_norm.weight.normal_()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["qk_norm"] is True
    loaded = rd.RecurrentDepthLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 256, (2, 9))
    assert torch.equal(loaded(x, num_steps=3, init_scale=0.0).logits, model(x, num_steps=3, init_scale=0.0).logits)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared-gain", "per-head-gains"])
def test_transformers_config_carries_qk_norm(tmp_path, per_head):
    from transformers import AutoModelForCausalLM

    from recurrent_depth.integrations import register_transformers
    from recurrent_depth.integrations.hf_config import RecurrentDepthConfig

    register_transformers()
    cfg = config(qk_norm=True, qk_norm_per_head=per_head)
    assert RecurrentDepthConfig.from_model_config(cfg).to_model_config().qk_norm is True
    assert RecurrentDepthConfig.from_model_config(cfg).to_model_config().qk_norm_per_head is per_head
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    with torch.no_grad():
        model.transformer.prelude[0].attn.k_norm.weight.normal_()
    model.save_pretrained(tmp_path / "lib")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "lib").eval()
    assert hf.config.qk_norm is True
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(hf(x, num_steps=2, init_scale=0.0).logits,
                                   model(x, num_steps=2, init_scale=0.0).logits, rtol=0, atol=0)
    hf.save_pretrained(tmp_path / "hf")
    assert rd.ModelConfig.from_json(tmp_path / "hf").qk_norm is True
    assert rd.ModelConfig.from_json(tmp_path / "hf").qk_norm_per_head is per_head


def test_qk_norm_prefill_then_decode_equals_full_forward():
    torch.manual_seed(3)
    model = rd.RecurrentDepthLM(config(qk_norm=True, num_kv_heads=2)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_norm.weight"):
                p.normal_(1.0, 0.5)
    x = torch.randint(0, 256, (2, 12))
    full = model(x, num_steps=3, init_scale=0.0).logits
    cache = rd.DynamicCache()
    steps = [model(x[:, :7], num_steps=3, init_scale=0.0, cache=cache).logits]
    for t in range(7, 12):
        steps.append(model(x[:, t : t + 1], num_steps=3, init_scale=0.0, cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    generated = rd.generate(model, x[:, :5], max_new_tokens=4, num_steps=3, init_scale=0.0)
    seq = x[:, :5]
    for _ in range(4):  # greedy by full forwards
        seq = torch.cat([seq, model(seq, num_steps=3, init_scale=0.0).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(generated.sequences, seq)


def test_qk_norm_is_refused_for_mixers_without_it():
    with pytest.raises(ValueError, match="qk_norm.*'attention' mixer only.*core.*gated_deltanet"):
        rd.RecurrentDepthLM(config(qk_norm=True, mixer={"core": "gated_deltanet"}))


# ---------------------------------------------------------------------------- QK-clip


def recorded(attn, x, ctx) -> torch.Tensor:
    attn.reset_max_logit()
    attn(x, ctx, ("prelude", 0))
    return attn.max_logit.clone()


@pytest.mark.parametrize("case", list(CASES))
def test_qk_clip_with_lr_zero_brings_offending_heads_to_tau(case):
    model, attn = attention(config(**CASES[case]))
    clip = QKClip(model, threshold=1.0)
    x = torch.randn(2, 24, 64)
    ctx = context(model, 2, 24)
    before = recorded(attn, x, ctx)
    tau = float(before.sort().values[1]) + 1e-3  # heads 0..1 (sorted) under tau, the rest over it
    clip.threshold = tau
    params = {n: p.detach().clone() for n, p in attn.named_parameters()}
    over = before > tau
    assert 0 < int(over.sum()) < attn.num_heads
    attn.max_logit = before  # as after a training forward; no optimizer step at all (lr = 0)
    assert clip.step()["qk_clipped_heads"] == int(over.sum())
    after = recorded(attn, x, ctx)
    per_head_gains = attn.q_norm is not None and attn.q_norm.weight.ndim == 2
    if attn.q_norm is None or per_head_gains:
        torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=0, atol=1e-5)
        assert torch.equal(after[~over], before[~over])  # heads under tau: bit-identical logits
    if per_head_gains:  # each head's own gains carry its gamma; the weights stay as they were
        assert torch.equal(attn.Wqkv.weight, params["Wqkv.weight"])
        g0, g1 = params["q_norm.weight"], attn.q_norm.weight.detach()
        assert [not torch.equal(g1[h], g0[h]) for h in range(attn.num_heads)] == over.tolist()
        if attn.num_kv_heads < attn.num_heads:  # GQA: the shared key heads' gains are left alone
            assert torch.equal(attn.k_norm.weight, params["k_norm.weight"])
    elif attn.q_norm is None:
        D, H, Hkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        w0, w1 = params["Wqkv.weight"], attn.Wqkv.weight.detach()
        for h in range(H):
            same = torch.equal(w1[h * D:(h + 1) * D], w0[h * D:(h + 1) * D])
            assert same == (not bool(over[h]))
        k_rows, v_rows = slice(H * D, (H + Hkv) * D), slice((H + Hkv) * D, None)
        assert torch.equal(w1[v_rows], w0[v_rows])
        if Hkv < H:  # GQA / MQA: the shared key heads are left alone, gamma goes on the query
            assert torch.equal(w1[k_rows], w0[k_rows])
    else:
        # One gain serves every head: the layer's logits scale by its smallest gamma, the worst head lands on tau.
        worst = int(before.argmax())
        torch.testing.assert_close(after[worst], torch.tensor(tau), rtol=0, atol=1e-5)
        torch.testing.assert_close(after, before * (tau / before.max()), rtol=1e-5, atol=1e-5)
        assert torch.equal(attn.Wqkv.weight, params["Wqkv.weight"])


@pytest.mark.parametrize("overrides", [dict(), dict(num_kv_heads=2), dict(qk_bias=False)],
                         ids=["bias", "gqa-bias", "no-bias"])
def test_qk_clip_with_full_width_qk_norm_clips_each_head_alone(overrides):
    # OLMo-2's full-width QK-norm has a gain per channel (so per head), and Huginn's q/k bias is added after it:
    # the clip scaled neither per head nor the bias, and offending heads stayed above tau.
    import warnings

    model, attn = attention(config(qk_norm=True, qk_norm_full_width=True, **overrides))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # per-channel gains: no "shared gain" warning
        clip = QKClip(model, threshold=1.0)
    x, ctx = torch.randn(2, 24, 64), context(model, 2, 24)
    before = recorded(attn, x, ctx)
    tau = float(before.sort().values[1]) + 1e-3
    over = before > tau
    assert 0 < int(over.sum()) < attn.num_heads
    clip.threshold = tau
    attn.max_logit = before
    clip.step()
    after = recorded(attn, x, ctx)
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=1e-5)
    assert torch.equal(after[~over], before[~over])


def test_qk_clip_leaves_a_layer_under_tau_bit_identical_and_reaches_tau_through_the_core():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config(num_kv_heads=2)).train()
    with torch.no_grad():
        model.transformer.prelude[0].attn.Wqkv.weight.mul_(6.0)
        for name, p in model.named_parameters():
            if name.endswith(("q_bias", "k_bias")):
                p.normal_(0, 0.3)
    clip = QKClip(model, threshold=1.0)
    x = torch.randint(0, 256, (2, 20))
    gen = torch.Generator().manual_seed(0)
    model(x, num_steps=3, generator=gen)
    maxima = dict(zip([n for n, _ in clip.layers], clip.maxima(), strict=True))
    tau = float(maxima["transformer.prelude.0.attn"].min()) - 1e-3
    assert all(float(m.max()) < tau for n, m in maxima.items() if "prelude" not in n)  # only the prelude is over
    clip.threshold = tau
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"transformer.prelude.0.attn.Wqkv.weight", "transformer.prelude.0.attn.q_bias"}
    model(x, num_steps=3, generator=torch.Generator().manual_seed(0))
    prelude = model.transformer.prelude[0].attn.max_logit  # its input does not depend on any clipped layer
    torch.testing.assert_close(prelude, torch.full_like(prelude, tau), rtol=0, atol=1e-5)


def test_qk_clip_takes_the_max_over_every_recurrence_step():
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config()).train()
    clip = QKClip(model, threshold=None)
    core = model.transformer.core_block[0].attn
    x = torch.randint(0, 256, (1, 16))
    per_step = []
    original = core.observe_logits

    def spy(q, k, scale, mask, is_causal):
        per_step.append(head_max_logits(q, k, scale, mask, is_causal))
        original(q, k, scale, mask, is_causal)

    core.observe_logits = spy
    model(x, num_steps=(2, 3))  # no-grad steps count too
    assert len(per_step) == 5
    assert torch.equal(core.max_logit, torch.stack(per_step).amax(0))
    expected = max(float(m.max()) for m in clip.maxima())
    record = clip.step()
    assert record == {"max_logit": expected, "qk_clipped_heads": 0} and core.max_logit is None


def test_qk_clip_mla_scales_only_head_specific_parts():
    model, _ = attention(config(mixer="mla"))
    attn = model.transformer.prelude[0].attn
    clip = QKClip(model, threshold=1.0)
    x = torch.randn(2, 16, 64)
    ctx = context(model, 2, 16)
    before = recorded(attn, x, ctx)
    tau = float(before.min()) - 1e-3
    clip.threshold = tau
    wkv_a = attn.wkv_a.weight.detach().clone()
    attn.max_logit = before
    for _, m in clip.layers:
        if m is not attn:
            m.reset_max_logit()
    clip.step()
    after = recorded(attn, x, ctx)
    # tau ~ 40 here; the rescaled weights pass through W_UK and RoPE in float32: a few ulps (1e-6 relative)
    torch.testing.assert_close(after, torch.full_like(after, tau), rtol=1e-6, atol=0)
    assert torch.equal(attn.wkv_a.weight, wkv_a)  # the shared latent and rotary key are untouched


@pytest.mark.parametrize("mixer", ["gated_deltanet", "dsa", "nsa"])
def test_qk_clip_refuses_mixers_without_per_head_softmax_logits(mixer):
    model = rd.RecurrentDepthLM(config(mixer={"core": mixer}))
    with pytest.raises(ValueError, match=f"the core uses '{mixer}'"):
        QKClip(model, threshold=5.0)
    with pytest.raises(ValueError, match="threshold"):
        QKClip(rd.RecurrentDepthLM(config()), threshold=0.0)


def test_qk_clip_step_skips_nan_and_unrun_heads_and_reports_a_nan_max_as_none():
    model, attn = attention(config())
    clip = QKClip(model, threshold=5.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    attn.max_logit = torch.tensor([float("nan"), 1.0, 2.0, 20.0])  # every other layer did not run (-inf)
    assert clip.step() == {"max_logit": None, "qk_clipped_heads": 1}
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"transformer.prelude.0.attn.Wqkv.weight", "transformer.prelude.0.attn.qk_bias"}
    D = attn.head_dim
    assert torch.equal(attn.Wqkv.weight[:3 * D], before["transformer.prelude.0.attn.Wqkv.weight"][:3 * D])
    attn.max_logit = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert clip.step() == {"max_logit": 4.0, "qk_clipped_heads": 0}


def test_eval_forwards_record_nothing():
    model = rd.RecurrentDepthLM(config()).eval()
    QKClip(model, threshold=1.0)
    model(torch.randint(0, 256, (1, 8)), num_steps=2)
    assert all(m.max_logit is None for m in model.modules() if hasattr(m, "max_logit"))


def clipped_weights(rows: slice = slice(None), qk_norm: bool = False, wrap=None, full_state=None,
                    **overrides) -> tuple[dict, dict]:
    """A fixed model's weights after one training forward + backward on rows `rows` of a fixed batch and one
    QK-clip (also run by the 2-rank workers). wrap: applied to the model before the forward (FSDP2 in a
    worker); full_state: how to read the unsharded weights back (default: the state dict)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config(**{"num_kv_heads": 2, "qk_norm": qk_norm, **overrides})).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "Wqkv" in name:
                p.mul_(5.0)
            if name.endswith("norm.weight") and "attn" in name:
                p.normal_(0, 3.0)
    wrapped = model if wrap is None else wrap(model)
    clip = QKClip(model, threshold=20.0)
    batch = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    wrapped(batch[rows], labels=batch[rows], num_steps=(1, 2), init_scale=0.0).loss.backward()
    record = clip.step()
    if full_state is not None:
        return full_state(model), record
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, record


@pytest.mark.slow
@pytest.mark.parametrize("qk_norm", [False, True], ids=["gqa", "gqa-qk-norm"])
def test_qk_clip_is_identical_under_one_and_two_ranks(tmp_path, qk_norm):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'src'}"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(repo / "tests" / "qk_clip_dist_worker.py"), str(tmp_path / "two.pt"), "qk_norm" if qk_norm else "plain"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    one_state, one_record = clipped_weights(qk_norm=qk_norm)
    assert one_record["qk_clipped_heads"] > 0 and two["record"] == one_record
    alone = [clipped_weights(rows=slice(r, None, 2), qk_norm=qk_norm)[0] for r in (0, 1)]
    # each rank alone would clip differently: the reduction over ranks matters
    assert all(any(not torch.equal(a[n], v) for n, v in one_state.items()) for a in alone)
    for name, value in one_state.items():
        assert torch.equal(two["state"][name], value), name


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    from tests.train_support import prepare_root

    return prepare_root(tmp_path_factory.mktemp("qk_root"))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_trainer_records_the_max_logit_and_clips_after_each_step(train_root, tmp_path, optimizer):
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.train_support import tiny_train_config

    optim = OptimConfig.from_preset("demo", name=optimizer, lr=3e-2, muon_lr=0.2, warmup_steps=0)
    seen = []
    cfg = tiny_train_config(train_root, tmp_path / "run", max_steps=4, qk_clip=2.0, optim=optim, tensorboard=True)
    Trainer(cfg, on_step=lambda t, r: seen.append(r)).run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["max_logit"] for r in lines] == [r["max_logit"] for r in seen]
    assert all(r["max_logit"] > 2.0 and r["qk_clipped_heads"] > 0 for r in lines)
    assert list((tmp_path / "run" / "tensorboard").iterdir())
    plain = tiny_train_config(train_root, tmp_path / "plain", max_steps=2, record_max_logit=True, optim=optim)
    records = []
    Trainer(plain, on_step=lambda t, r: records.append(r)).run()
    assert all(r["qk_clipped_heads"] == 0 and r["max_logit"] > 0 for r in records)


def test_qk_clip_flag_and_yaml(tmp_path):
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args
    from recurrent_depth.train.config import TrainConfig

    args = build_parser("train").parse_args(["train", "--qk-clip", "50", "--record-max-logit"])
    cfg = config_from_args(args)
    assert cfg.qk_clip == 50.0 and cfg.record_max_logit is True
    (tmp_path / "c.yaml").write_text("qk_clip: 100\nmodel: {qk_norm: true}\n")
    cfg = TrainConfig.from_yaml(tmp_path / "c.yaml")
    assert cfg.qk_clip == 100 and cfg.model_config().qk_norm is True
    assert cfg.model_config().qk_norm_per_head is False
    per_head = ["--model-set", "qk_norm=true", "--model-set", "qk_norm_per_head=true"]
    args = build_parser("train").parse_args(["train", *per_head])
    assert config_from_args(args).model_config().qk_norm_per_head is True
    with pytest.raises(ValueError, match="qk_clip"):
        TrainConfig(qk_clip=-1.0)
    train_parser = build_parser("train")._subparsers._group_actions[0].choices["train"]
    assert "--qk-clip TAU" in train_parser.format_help()


def test_qk_clip_warns_once_with_a_shared_qk_norm_gain():
    import warnings

    from recurrent_depth.train.qk_clip import QKClip

    shared = rd.RecurrentDepthLM(rd.ModelConfig(qk_norm=True))
    with pytest.warns(UserWarning, match="qk_norm_per_head=true"):
        QKClip(shared, 5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QKClip(rd.RecurrentDepthLM(rd.ModelConfig(qk_norm=True, qk_norm_per_head=True)), 5.0)
        QKClip(shared, None)  # recording only: nothing is clipped
