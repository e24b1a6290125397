"""Training-free looping (recurrent_depth.looping) on tiny random transformers models, no downloads.

Tolerance: fp32 throughout; 2e-5 absolute on logits covers re-ordered sums (SDPA over a concatenated
past vs a cache, x0 + (g − x0)·1 against g).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from recurrent_depth.looping import LoopConfig, apply_loop, combine, find_decoder_layers, from_pretrained, remove_loop

ATOL = 2e-5
VOCAB = 61
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, attn_implementation="sdpa")


def _llama():
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


FAMILIES = {
    "llama": _llama,
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=8)),
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**SHAPE)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, bos_token_id=0,
                                               eos_token_id=0, attn_implementation="sdpa")),
}


def _model(family: str = "llama"):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def _ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rule", ["naive", "damped", "rk"])
@pytest.mark.parametrize("mode", ["block", "layer"])
@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_k1_through_the_loop_path_equals_the_base_model(family, mode, rule):
    model = _model(family)
    ids = _ids()
    base = model(ids).logits
    looper = apply_loop(model, LoopConfig(1, 2, iterations=1, mode=mode, rule=rule))
    looper.skip_identity = False
    calls = []
    handle = model.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    looped = model(ids).logits
    handle.remove()
    assert calls, "the forward ran"
    torch.testing.assert_close(looped, base, atol=ATOL, rtol=0)


@torch.no_grad()
def test_k1_short_circuit_is_the_base_model_exactly_and_runs_no_loop_pass():
    model = _model()
    ids = _ids()
    base = model(ids).logits
    apply_loop(model, LoopConfig(1, 2, iterations=1, rule="damped"))
    _, layers = find_decoder_layers(model)
    calls = []
    handle = layers[1].register_forward_pre_hook(lambda *a: calls.append(1))
    looped = model(ids).logits
    handle.remove()
    assert torch.equal(looped, base)
    assert len(calls) == 1
    # the same model at K = 2 calls the window layer twice per forward
    apply_loop(model, LoopConfig(1, 2, iterations=2))
    handle = layers[1].register_forward_pre_hook(lambda *a: calls.append(1))
    model(ids)
    handle.remove()
    assert len(calls) == 3


def _plain(model, index: int, x: torch.Tensor) -> torch.Tensor:
    """Llama decoder layer `index` on `x` [B, S, h], causal, positions 0..S-1, no cache."""
    positions = torch.arange(x.shape[1])[None]
    return model.model.layers[index](x, attention_mask=None,
                                     position_embeddings=model.model.rotary_emb(x, positions))


def _head(model, x: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(x))


@torch.no_grad()
def test_damped_euler_one_layer_window_k2_matches_the_formula():
    model = _model()
    ids = _ids()
    x = model.model.embed_tokens(ids)
    x0 = _plain(model, 0, x)
    x1 = x0 + 0.5 * (_plain(model, 1, x0) - x0)
    x2 = x1 + 0.5 * (_plain(model, 1, x1) - x1)
    expected = _head(model, _plain(model, 3, _plain(model, 2, x2)))
    for mode in ("block", "layer"):
        apply_loop(model, LoopConfig(1, 1, iterations=2, rule="damped", mode=mode))
        torch.testing.assert_close(model(ids).logits, expected, atol=ATOL, rtol=0)


def test_combine_rules():
    x0 = torch.tensor([1.0, -2.0])

    def g(x):
        return 0.5 * x + 1.0

    assert torch.allclose(combine("naive", 3, 0.5, x0, g), g(g(g(x0))))
    x = x0
    for _ in range(4):
        x = x + (g(x) - x) / 4
    assert torch.allclose(combine("damped", 4, 0.5, x0, g), x)
    assert torch.allclose(combine("rk", 4, 0.3, x0, g), 0.3 * g(x0) + 0.7 * x)
    assert torch.allclose(combine("rk", 4, 1.0, x0, g), g(x0))


def _reference(model, cfg: LoopConfig, stash: list[torch.Tensor | None], x: torch.Tensor, loop: bool):
    """Cache-free: one chunk `x` [B, C, h] of new tokens after the stashed layer inputs of earlier tokens.

    Each layer runs plainly over cat(stash input of earlier tokens, current input); the outputs of the
    current positions are kept. Window layers loop under cfg's rule; the state that feeds the window's
    stash is the first pass's (`first`) or an extra pass from the loop's output (`last`). Appends the
    chunk's inputs to `stash` in place; returns the logits of the chunk.
    """
    C = x.shape[1]

    def layer(i, h):
        past = stash[i]
        full = h if past is None else torch.cat([past, h], dim=1)
        return _plain(model, i, full)[:, -C:]

    def window(group, h, record=None):
        for i in group:
            if record is not None:
                record[i] = h
            h = layer(i, h)
        return h

    window_layers = list(range(cfg.start, cfg.end + 1))
    groups = [window_layers] if cfg.mode == "block" else [[i] for i in window_layers]
    new = {}
    i = 0
    while i < len(model.model.layers):
        group = next((g for g in groups if g[0] == i), None)
        if group is None:
            new[i] = x
            x = layer(i, x)
            i += 1
            continue
        first_inputs: dict[int, torch.Tensor] = {}
        y = window(group, x, record=first_inputs)
        if not loop:
            new.update(first_inputs)
            x = y
        else:
            k = cfg.iterations
            if cfg.rule == "naive":
                out = y
                for _ in range(k - 1):
                    out = window(group, out)
            else:
                out = x + (y - x) / k
                for _ in range(k - 1):
                    out = out + (window(group, out) - out) / k
                if cfg.rule == "rk":
                    out = cfg.beta * y + (1 - cfg.beta) * out
            if cfg.stash == "first":
                new.update(first_inputs)
            else:
                last_inputs: dict[int, torch.Tensor] = {}
                window(group, out, record=last_inputs)
                new.update(last_inputs)
            x = out
        i = group[-1] + 1
    for j, h in new.items():
        stash[j] = h if stash[j] is None else torch.cat([stash[j], h], dim=1)
    return _head(model, x)


@pytest.mark.parametrize("when", ["prefill", "always"])
@pytest.mark.parametrize("mode", ["block", "layer"])
@pytest.mark.parametrize("stash", ["first", "last"])
@torch.no_grad()
def test_prefill_then_decode_matches_a_cache_free_token_by_token_reference(stash, mode, when):
    model = _model()
    cfg = LoopConfig(1, 2, iterations=3, rule="rk" if mode == "layer" else "damped", beta=0.3, mode=mode,
                     stash=stash, when=when)
    prompt, new_tokens = _ids(2, 5, seed=2), _ids(2, 4, seed=3)
    ref_stash: list[torch.Tensor | None] = [None] * 4
    expected = [_reference(model, cfg, ref_stash, model.model.embed_tokens(prompt), loop=True)]
    for t in range(new_tokens.shape[1]):
        x = model.model.embed_tokens(new_tokens[:, t : t + 1])
        expected.append(_reference(model, cfg, ref_stash, x, loop=when == "always"))

    apply_loop(model, cfg)
    out = model(prompt, use_cache=True)
    got, cache = [out.logits], out.cache
    for t in range(new_tokens.shape[1]):
        out = model(new_tokens[:, t : t + 1], cache=cache, use_cache=True)
        got.append(out.logits)
        cache = out.cache
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    # the cache holds one KV entry per token and layer, the base model's size
    remove_loop(model)
    base_cache = model(torch.cat([prompt, new_tokens], dim=1), use_cache=True).cache
    assert cache.get_seq_length() == prompt.shape[1] + new_tokens.shape[1]
    for looped_layer, base_layer in zip(cache.layers, base_cache.layers, strict=True):
        assert looped_layer.keys.shape == base_layer.keys.shape
        assert looped_layer.values.shape == base_layer.values.shape


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@torch.no_grad()
def test_generate_batched_with_left_padding_matches_each_row_alone(family):
    model = _model(family)
    apply_loop(model, LoopConfig(1, 2, iterations=3, when="always", stash="last"))
    short, long = _ids(1, 3, seed=4), _ids(1, 6, seed=5)
    pad = 0
    batch = torch.cat([torch.cat([torch.full((1, 3), pad), short], dim=1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)], dim=1),
                      torch.ones(1, 6, dtype=torch.long)])
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    together = model.generate(batch, attention_mask=mask, **kw)
    for row, ids in enumerate((short, long)):
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(together.sequences[row, -4:], alone.sequences[0, -4:])
        for a, b in zip(together.logits, alone.logits, strict=True):
            torch.testing.assert_close(a[row], b[0], atol=1e-4, rtol=0)


@torch.no_grad()
def test_save_pretrained_records_the_loop_and_loading_reapplies_it(tmp_path):
    model = _model()
    cfg = LoopConfig(1, 2, iterations=3, rule="rk", beta=0.25, stash="last", when="always", mode="layer")
    apply_loop(model, cfg)
    ids = _ids()
    looped = model(ids).logits
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["loop"] == cfg.to_dict()
    loaded = from_pretrained(str(tmp_path)).eval()
    torch.testing.assert_close(loaded(ids).logits, looped, atol=0, rtol=0)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # transformers alone: the base model
    remove_loop(model)
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, atol=0, rtol=0)
    other = from_pretrained(str(tmp_path), loop={"start": 0, "end": 0, "iterations": 2}).eval()
    assert other.config.loop["start"] == 0


def test_models_it_cannot_loop_get_a_clear_error():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="encoder-decoder"):
        apply_loop(t5, LoopConfig(0, 0))
    bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(ValueError, match="not a causal LM"):
        apply_loop(bert, LoopConfig(0, 0))
    with pytest.raises(ValueError, match="not a transformers model"):
        apply_loop(torch.nn.Linear(2, 2), LoopConfig(0, 0))
    with pytest.raises(ValueError, match="does not fit a model with 4 decoder layers"):
        apply_loop(_model(), LoopConfig(2, 4))


def test_a_recurrent_depth_model_loaded_by_transformers_is_refused(tmp_path):
    """An Ouro-layout model of this library (all its layers in the core, so the core list has
    num_hidden_layers entries) was looped: its forward then died with a RuntimeError from its own KV cache."""
    import recurrent_depth as rd

    torch.manual_seed(0)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro", vocab_size=VOCAB, max_seq_len=64)).save_pretrained(
        tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"^cannot loop \w+: it is a recurrent-depth model, which loops its core"):
        apply_loop(model, LoopConfig(0, 1, iterations=2))
    model(_ids())  # untouched


@pytest.mark.parametrize("cache, layer", [
    ("static", "StaticLayer"),
    ("sliding", "DynamicSlidingWindowLayer"),
])
def test_looping_at_decode_on_a_non_dynamic_cache_is_refused_and_prefill_looping_still_runs(cache, layer):
    if cache == "sliding":
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=4,
                                             max_window_layers=0)).eval()
        kwargs = {}
    else:
        model, kwargs = _model(), {"cache_implementation": "static"}
    apply_loop(model, LoopConfig(1, 2, iterations=2, when="always"))
    with pytest.raises(ValueError, match=f"needs a full-attention dynamic KV cache; layer 1 holds a {layer}"):
        model.generate(_ids(1, 9), max_new_tokens=3, do_sample=False, **kwargs)
    apply_loop(model, LoopConfig(1, 2, iterations=2, when="prefill"))
    out = model.generate(_ids(1, 9), max_new_tokens=3, min_new_tokens=3, do_sample=False, **kwargs)
    assert out.shape == (1, 12)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"start": 2, "end": 1}, "start <= end"),
        ({"start": 0, "end": 1, "iterations": 0}, r"iterations must be in \[1, 256\], got 0"),
        ({"start": 0, "end": 1, "rule": "heun"}, "rule must be one of"),
        ({"start": 0, "end": 1, "beta": 1.5}, "beta must be a number in"),
        ({"start": 0, "end": 1, "stash": "none"}, "stash must be one of"),
        ({"start": 0, "end": 1, "when": "never"}, "when must be one of"),
        ({"start": 0, "end": 1, "mode": "moe"}, "mode must be one of"),
        ({"start": "1", "end": 1}, "start must be an integer"),
        ({"start": 0, "end": 1, "colour": 1}, "unknown loop config field"),
        ({"end": 1}, "missing"),
    ],
)
def test_loop_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        LoopConfig.from_dict(fields)


def test_flops_ratio_is_one_plus_k_minus_one_times_window_share():
    assert LoopConfig(2, 3, iterations=3).flops_ratio(8) == pytest.approx(1 + 2 * 2 / 8)
    assert LoopConfig(2, 3, iterations=1).flops_ratio(8) == 1.0


@pytest.mark.parametrize("run_base_first", [False, True])
@torch.no_grad()
def test_output_hidden_states_hold_one_entry_per_layer_and_the_combined_window_output(run_base_first):
    model = _model()
    ids = _ids()
    if run_base_first:  # transformers installs its recording hooks at the first forward that records
        model(ids, output_hidden_states=True)
    apply_loop(model, LoopConfig(1, 2, iterations=3))
    out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 4 + 1
    # entry 3 is the window's output (after layer 2): the input of layer 3 reproduces the logits
    expected = _head(model, _plain(model, 3, out.hidden_states[3]))
    torch.testing.assert_close(out.logits, expected, atol=ATOL, rtol=0)


def test_the_pretrain_demos_validation_rows_go_to_the_models_device():
    """`rdepth loop pretrain` scores its validation rows (read on the CPU) with the trained model, which the
    trainer put on its device (CUDA there): the rows follow the model, not the other way round."""
    from recurrent_depth.looping.pretrain import _rows_loss

    seen = []

    class Stop(Exception):
        pass

    class OnMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))

        def forward(self, ids):
            seen.append(ids.device)
            raise Stop  # (a meta forward has no numbers to score)

    with pytest.raises(Stop):
        _rows_loss(OnMeta(), torch.zeros(3, 5, dtype=torch.long), batch_size=2)
    assert seen == [torch.device("meta")]
