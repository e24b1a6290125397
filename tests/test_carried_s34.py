"""Carried items: stop strings against special tokens (transformers' rule), trl's GRPO std and clip metrics, int4
kernel-layout input gradients read back once, a float64 model with a quantized KV cache."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from torch import nn

import recurrent_depth as rd
import recurrent_depth.weight_quant as wq
from recurrent_depth.inference import generate
from recurrent_depth.inference.sampling import StopChecker
from recurrent_depth.train.rl.losses import batch_std, group_advantages, grpo_loss
from recurrent_depth.train.rl.rollouts import RolloutSource

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- (a) stop strings, special tokens
def _letters_with_a_special() -> tuple[Tokenizer, int]:
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate("abcdef")}}  # (transformers probes with "abcdef")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    return tok, tok.token_to_id("<|end|>")


@pytest.mark.parametrize("stop", ["<|end|>", "end", "b<|end|>", "bc"])
def test_a_stop_string_matches_a_special_tokens_text_as_transformers_stop_strings(stop):
    """`generate(stop=...)` (and transformers' `stop_strings`, routed to it) matches the text with special tokens
    kept: transformers' StopStringCriteria on the same tokenizer agrees at every step of a row that generates a, b,
    <|end|>, c (the server's rule, vLLM's, skips them: tests/test_serving_stop_reason.py)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.generation.stopping_criteria import StopStringCriteria

    tok, end = _letters_with_a_special()
    theirs = StopStringCriteria(PreTrainedTokenizerFast(tokenizer_object=tok), [stop])
    ours = StopChecker([stop], (), tok.get_vocab_size(), tok)
    row, first = [1, 2, end, 3], {}
    for n in range(1, len(row) + 1):
        if bool(theirs(torch.tensor([row[:n]]), None)[0]):
            first.setdefault("theirs", n)
        if ours.hits_string(row[:n]):
            first.setdefault("ours", n)
    expected = {"<|end|>": 3, "end": 3, "b<|end|>": 3, "bc": None}[stop]  # ("bc" only with the special skipped)
    assert first.get("theirs") == first.get("ours") == expected


# ---------------------------------------------------------------------------- (b) trl's std and clip metrics
def test_advantages_divide_by_the_sample_std_as_trl():
    # rewards 1, 2, 4: mean 7/3, deviations -4/3, -1/3, 5/3, squares 42/9, sample variance (42/9) / 2 = 7/3
    A = group_advantages(torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0]), 3, eps=0.0)
    std = math.sqrt(7 / 3)
    # second group 0, 0, 3: mean 1, deviations -1, -1, 2, sample variance 6 / 2 = 3
    expected = [-4 / 3 / std, -1 / 3 / std, 5 / 3 / std, -1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)]
    assert A.tolist() == pytest.approx(expected, rel=1e-6)
    # batch: the six rewards' sample std (mean 5/3; squares 4/9 + 1/9 + 49/9 + 25/9 + 25/9 + 16/9 = 120/9, / 5)
    assert batch_std(torch.tensor([1.0, 2.0, 4.0, 0.0, 0.0, 3.0])) == pytest.approx(math.sqrt(120 / 45))
    assert batch_std(torch.tensor([5.0])) == 0.0 and batch_std(torch.tensor([])) == 0.0  # (no n - 1 = 0 division)


def test_clip_ratio_metrics_are_trls_where_the_clip_binds():
    """trl's clip_ratio/low_mean: ratio < 1 - eps with A < 0; high_mean: ratio > 1 + eps_high with A > 0;
    region_mean: either; token means. clip_fraction (PPO's) counts any ratio outside the band."""
    old = torch.zeros(2, 3)
    ratio = torch.tensor([[1.5, 0.5, 1.0], [0.7, 1.3, 9.0]])  # the 9 is masked out
    mask = torch.tensor([[True, True, True], [True, True, False]])
    A = torch.tensor([1.0, -1.0])
    for level in ("token", "sequence", "constant"):
        _, stats = grpo_loss(ratio.log(), old, A, mask, clip_eps=0.2, clip_eps_high=0.25, level=level)
        # row 0 (A > 0): 1.5 is high-clipped, 0.5 is outside but the clip does not bind; row 1 (A < 0): 0.7 is
        # low-clipped, 1.3 outside but not binding: one low and one high of 5 scored tokens
        assert stats["clip_ratio/low_mean"] == pytest.approx(1 / 5)
        assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 5)
        assert stats["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert stats["clip_fraction"] == pytest.approx(4 / 5)
    assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(
        RolloutSource.rank_mean_metrics)  # (averaged over the ranks under torchrun, not dropped)


# ---------------------------------------------------------------------------- (c) int4 kernel layout, autograd
def test_int4_kernel_layout_gradients_read_the_codes_back_once(monkeypatch):
    """With C++ off an int4 layer keeps torch's kernel layout; an autograd call dequantizes in its forward and its
    backward, and each read the 4-bit values back through the kernel (in x in x out products: 0.9 s a call at
    1024 x 2816, 15x the plain layout's). Now once a layer, the gradients those of the dequantized reference."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = wq.Int4WeightLinear.from_linear(linear, 32, kernel_layout=True)
    reads = []
    real = wq.unpack_kernel_layout
    monkeypatch.setattr(wq, "unpack_kernel_layout", lambda *a, **k: reads.append(1) or real(*a, **k))
    reference = layer.dequantized()
    reads.clear()
    x = torch.randn(3, 5, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    for _ in range(2):
        x.grad = x_ref.grad = None
        out, out_ref = layer(x), reference(x_ref)
        grad = torch.randn_like(out)
        out.backward(grad), out_ref.backward(grad)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert len(reads) == 0  # (`dequantized` above read them: the cache serves both calls' forwards and backwards)
    codes = layer.unpacked().clone()
    with torch.no_grad():  # an in-place load (load_state_dict's copy_) of other codes reads them back again
        layer.qweight.copy_(wq.Int4WeightLinear.from_linear(nn.Linear(64, 32), 32, kernel_layout=True).qweight)
    assert not torch.equal(layer.unpacked(), codes) and len(reads) == 1


# ---------------------------------------------------------------------------- (d) float64 + quantized KV
@pytest.mark.parametrize("kv_quant", ["k=prod:3.5,v=mse:3.5", "k=mse:4,v=mse:4,attn=dequantize"])
def test_a_float64_model_decodes_from_a_quantized_cache(kv_quant, caplog):
    """A float64 model takes the reference runner (no compiled or C++ code kernels, no fallback warning): the same
    tokens as with fast=False and as its float32 twin, logits float32 as the contract says."""
    torch.manual_seed(0)
    m32 = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    m64 = rd.RecurrentDepthLM(m32.config).eval()
    m64.load_state_dict(m32.state_dict())
    m64 = m64.double()
    ids = torch.randint(0, m32.config.vocab_size, (2, 5))
    run = dict(max_new_tokens=3, num_steps=2, kv_quant=kv_quant, init_scale=0.0, output_logits=True)
    fast, ref, single = generate(m64, ids, **run), generate(m64, ids, fast=False, **run), generate(m32, ids, **run)
    assert fast.logits.dtype == torch.float32
    torch.testing.assert_close(fast.logits, ref.logits, rtol=0, atol=0)
    assert fast.token_lists() == single.token_lists()
    assert "unavailable" not in caplog.text
