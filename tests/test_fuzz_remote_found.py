"""What the differential fuzzer of `rdepth export --remote-code` against the library found: the exported file's
model computed other logits than the library's for the same weights and inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from tests.test_hf import ids, make_model_dir

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def export(tmp_path, *argv: str, **overrides) -> tuple[rd.RecurrentDepthLM, remote.RecurrentDepthForCausalLM]:
    """A tiny library model and its remote-code export, loaded through the exported file's classes."""
    model = make_model_dir(tmp_path / "src", with_tokenizer=False, **overrides)
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code",
                 *argv]) == 0
    return model, remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()


@pytest.mark.parametrize("windows", [dict(mixer_options={"window": 2}), dict(attention_windows=[2, None, 3, 1])],
                         ids=["window-for-all", "per-layer-windows"])
def test_a_window_counts_real_tokens_around_a_masked_column(tmp_path, windows):
    """A mask with a 0 inside a row (transformers' generate infers one where a prompt holds the pad id): the library
    windows the last W real tokens, the exported file counted columns, the masked one included (logits off by
    ~0.3, and greedy generate took other tokens)."""
    model, exported = export(tmp_path, num_kv_heads=2, **windows)
    x = ids(batch=2, length=8, seed=1)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(exported(x, attention_mask=mask, num_steps=2, init_scale=0.0).logits,
                                   model(x, attention_mask=mask, num_steps=2, init_scale=0.0).logits,
                                   atol=1e-5, rtol=1e-5)
    # generate without a mask: transformers masks the pad id inside the prompt, for both models alike
    library = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    pad = int(x[0, 3])
    kwargs = dict(max_new_tokens=4, num_steps=2, init_scale=0.0, do_sample=False, pad_token_id=pad, eos_token_id=None)
    assert torch.equal(exported.generate(x, **kwargs), library.generate(x, **kwargs))


def test_generate_passes_the_exported_model_the_positions_it_passes_the_library(tmp_path):
    """transformers' generate gives `position_ids` to a forward that names them (the library's): a prompt whose last
    token is masked (its pad id) stands at position 0, and the new tokens count on from there. The exported file took
    them through **kwargs, so it was given none and counted its own: the first token's logits and the rest of the
    decoding differed from the library's."""
    _, exported = export(tmp_path)
    library = AutoModelForCausalLM.from_pretrained(tmp_path / "src").eval()
    x = ids(batch=1, length=7, seed=2)
    kwargs = dict(max_new_tokens=3, num_steps=2, init_scale=0.0, do_sample=False, pad_token_id=int(x[0, -1]),
                  eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    got, want = exported.generate(x, **kwargs), library.generate(x, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for ours, theirs in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_half_precision_export_computes_the_librarys_logits_bit_for_bit(tmp_path):
    """The exported file rotated q and k by real arithmetic, the library by one complex product per pair: equal in
    float32 up to a rounding, which a float16 model's q and k kept (its logits off by a unit in the last place)."""
    from recurrent_depth.model.layers import apply_rope

    qkv = torch.randn(2, 7, 3 * 4 * 8, generator=torch.Generator().manual_seed(0))
    q = qkv[..., :32].view(2, 7, 4, 8)  # (a view of the projection, as in the model)
    cos, sin = remote.rope_table(8, 7, 10_000.0, q.device)[None, :, None].expand(2, -1, -1, -1, -1).unbind(-1)
    assert torch.equal(remote.apply_rope(q, cos, sin), apply_rope(q, cos, sin))
    # the model the fuzzer found it with
    torch.manual_seed(5)
    model = rd.RecurrentDepthLM(rd.ModelConfig(vocab_size=300, hidden_size=32, num_heads=4, intermediate_size=48,
                                               prelude_layers=0, core_layers=2, coda_layers=0, mean_recurrence=1,
                                               mean_backprop_depth=1, max_seq_len=24, rope_base=10_000.0,
                                               norm_eps=1e-5, tie_embeddings=False, qk_norm=True,
                                               qk_norm_per_head=True))
    model.save_pretrained(tmp_path / "src")
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code",
                 "--dtype", "float16"]) == 0
    exported = remote.RecurrentDepthForCausalLM.from_pretrained(tmp_path / "out").eval()
    library = rd.RecurrentDepthLM.from_pretrained(tmp_path / "out").eval()
    assert exported.dtype == library.transformer.wte.weight.dtype == torch.float16
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        for steps in (1, 2):
            assert torch.equal(exported(x, attention_mask=mask, num_steps=steps, init_scale=0.0).logits,
                               library(x, attention_mask=mask, num_steps=steps, init_scale=0.0).logits)
