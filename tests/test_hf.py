"""transformers 5 integration: Auto classes, forward/generate parity with the library, cache, tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerFast

import recurrent_depth as rd
from recurrent_depth.integrations import register_transformers
from recurrent_depth.integrations.hf import (
    RavenForCausalLM,
    RecurrentDepthCache,
    RecurrentDepthForCausalLM,
    from_library_model,
)
from tests.test_checkpoint import write_official_layout

register_transformers()
TINY_VOCAB = 288  # 256 byte symbols + 32 special tokens: the smallest tokenizer the data module trains


def tiny_config(**overrides) -> rd.ModelConfig:
    values = dict(vocab_size=TINY_VOCAB, max_seq_len=96, bos_token_id=TINY_VOCAB - 32, eos_token_id=TINY_VOCAB - 31,
                  pad_token_id=TINY_VOCAB - 27)
    values.update(overrides)
    return rd.ModelConfig.from_preset("tiny", **values)


def make_model_dir(path: Path, seed: int = 0, with_tokenizer: bool = True, **overrides) -> rd.RecurrentDepthLM:
    """A saved tiny model (+ a byte-level tokenizer with the chat template) in `path`."""
    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    torch.manual_seed(seed)
    model = rd.RecurrentDepthLM(tiny_config(**overrides)).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        tok = train_tokenizer(["a=1;b=a;?b=1\n", "def f(x):\n    return x\n"], vocab_size=TINY_VOCAB)
        save_tokenizer(tok, path, model_max_length=model.config.max_seq_len)
    return model


def ids(batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_reference(model: rd.RecurrentDepthLM, x: torch.Tensor, new: int, num_steps: int) -> torch.Tensor:
    """Greedy decoding by full forwards, no cache: the oracle for every cached path."""
    seq = x
    with torch.no_grad():
        for _ in range(new):
            nxt = model(seq, num_steps=num_steps, init_scale=0.0).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path)
    return path


@pytest.fixture(scope="module")
def library_model(model_dir):
    return rd.RecurrentDepthLM.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.mark.parametrize("num_steps", [0, 3, (2, 1)], ids=["r0", "r3", "pair-2-1"])
def test_auto_model_gives_the_library_logits(hf_model, library_model, num_steps):
    assert isinstance(hf_model, RecurrentDepthForCausalLM)
    x = ids()
    with torch.no_grad():
        ours = library_model(x, num_steps=num_steps, init_scale=0.0).logits
        theirs = hf_model(x, num_steps=num_steps, init_scale=0.0).logits
    assert torch.equal(ours, theirs)
    torch.manual_seed(7)
    random_ours = library_model(x, num_steps=2).logits
    torch.manual_seed(7)
    random_theirs = hf_model(x, num_steps=2).logits
    assert torch.equal(random_ours, random_theirs)  # same s0 stream from the same seed


def test_config_fields_set_the_defaults(model_dir, library_model):
    config = AutoConfig.from_pretrained(model_dir, mean_recurrence=2, init_scale=0.0)
    assert config.max_position_embeddings == library_model.config.max_seq_len
    assert config.num_hidden_layers == 4 and config.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(model_dir, mean_recurrence=2, init_scale=0.0).eval()
    x = ids()
    with torch.no_grad():
        expected = library_model(x, num_steps=2, init_scale=0.0).logits
        assert torch.equal(model(x).logits, expected)  # depth and init_scale from the config
        model.config.mean_recurrence = 3  # changed after loading, as lm-eval scripts do
        assert torch.equal(model(x).logits, library_model(x, num_steps=3, init_scale=0.0).logits)


def test_transformers_save_reads_back_in_the_library(hf_model, library_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "recurrent_depth" and "tie_word_embeddings" not in saved
    again = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        assert torch.equal(again(x, num_steps=2, init_scale=0.0).logits,
                           library_model(x, num_steps=2, init_scale=0.0).logits)


@pytest.mark.parametrize("trust_remote_code", [False, True], ids=["plain", "trust-remote-code"])
def test_official_huginn_directory_loads_without_remote_code(tmp_path, trust_remote_code):
    torch.manual_seed(3)
    reference = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    write_official_layout(reference, tmp_path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, trust_remote_code=trust_remote_code, mean_recurrence=3
    ).eval()
    assert isinstance(model, RavenForCausalLM)  # our class even when remote code is allowed
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, init_scale=0.0).logits, reference(x, num_steps=3, init_scale=0.0).logits)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16], ids=["fp32-files", "bf16-files"])
def test_auto_model_keeps_the_stored_dtype_of_an_official_directory(tmp_path, stored):
    # The official config says torch_dtype=bfloat16 whatever the files hold; transformers' "auto"
    # would follow the config, the library keeps the stored dtype (and so must the Auto classes).
    torch.manual_seed(3)
    reference = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    write_official_layout(reference, tmp_path, dtype=stored)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    library = rd.RecurrentDepthLM.from_pretrained(tmp_path)
    assert model.dtype == library.dtype == stored
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x, num_steps=2, init_scale=0.0).logits, library(x, num_steps=2, init_scale=0.0).logits)
    assert AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).dtype == torch.float16


@pytest.mark.parametrize("padded", [False, True], ids=["same-length", "left-padded"])
def test_generate_cached_equals_uncached_and_library(hf_model, library_model, padded):
    x = ids(batch=3, length=6, seed=1)
    mask = None
    if padded:
        mask = torch.ones_like(x)
        mask[0, :2] = 0
        mask[2, :1] = 0
    kw = dict(max_new_tokens=6, num_steps=3, init_scale=0.0, do_sample=False, attention_mask=mask)
    cached = hf_model.generate(x, **kw)
    uncached = hf_model.generate(x, use_cache=False, **kw)
    library = rd.generate(library_model, x, max_new_tokens=6, num_steps=3, init_scale=0.0,
                          attention_mask=mask).sequences
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, library)
    if not padded:
        assert torch.equal(cached, greedy_reference(library_model, x, 6, 3))
    else:  # each row as if alone
        for b in range(x.shape[0]):
            alone = x[b : b + 1, int((mask[b] == 0).sum()) :]
            expected = greedy_reference(library_model, alone, 6, 3)[0, alone.shape[1] :]
            assert torch.equal(cached[b, x.shape[1] :], expected)


def decode_logits(model, x: torch.Tensor, num_steps: int, kv_budget: int | None) -> torch.Tensor:
    """Prefill all but the last token, then decode it with the cache: the last position's logits."""
    with torch.no_grad():
        out = model(x[:, :-1], num_steps=num_steps, init_scale=0.0, use_cache=True, kv_budget=kv_budget)
        return model(x[:, -1:], cache=out.cache, num_steps=num_steps, init_scale=0.0).logits[:, -1]


def test_kv_budget_shares_slots(hf_model, library_model):
    x = ids(length=9, seed=2)
    with torch.no_grad():
        full = library_model(x, num_steps=4, init_scale=0.0).logits[:, -1]
    assert torch.allclose(decode_logits(hf_model, x, 4, None), full, atol=1e-5)
    assert torch.allclose(decode_logits(hf_model, x, 4, 4), full, atol=1e-5)  # budget = depth: exact
    shared = decode_logits(hf_model, x, 4, 1)
    assert not torch.allclose(shared, full, atol=1e-5)  # one slot: approximate (the paper's sharing)
    with torch.no_grad():
        out = hf_model(x, num_steps=4, init_scale=0.0, use_cache=True, kv_budget=1)
        prefill = library_model(x, num_steps=4, init_scale=0.0).logits
    assert torch.allclose(out.logits, prefill, atol=1e-5)  # the prompt itself is exact with any budget
    core_layers = hf_model.config.core_layers
    full_cache = hf_model(x, num_steps=4, init_scale=0.0, use_cache=True).cache
    assert len(out.cache.layers) == 2 + core_layers and len(full_cache.layers) == 2 + 4 * core_layers
    assert out.cache.nbytes() < full_cache.nbytes()
    tokens = hf_model.generate(x, max_new_tokens=4, num_steps=4, init_scale=0.0, kv_budget=2, do_sample=False)
    library = rd.generate(library_model, x, max_new_tokens=4, num_steps=4, init_scale=0.0, kv_budget=2)
    assert torch.equal(tokens, library.sequences)


def test_beam_search_cached_equals_uncached(hf_model):
    x = ids(batch=2, length=5, seed=3)
    kw = dict(max_new_tokens=5, num_steps=2, init_scale=0.0, num_beams=3, do_sample=False)
    assert torch.equal(hf_model.generate(x, **kw), hf_model.generate(x, use_cache=False, **kw))


@pytest.mark.parametrize("mixer", ["falcon", "ttt_kvb"])
def test_beam_search_reorders_named_tuple_mixer_states(mixer):
    # FalconState / TTTKVBState are NamedTuples: reordering the beams rebuilt them from one iterable
    torch.manual_seed(0)
    cfg = tiny_config(mixer={"core": mixer}, mixer_options={mixer: {}})
    model = from_library_model(rd.RecurrentDepthLM(cfg).eval())
    x = ids(batch=2, length=5, seed=3)
    kw = dict(max_new_tokens=3, num_steps=2, init_scale=0.0, num_beams=2, do_sample=False)
    assert torch.equal(model.generate(x, **kw), model.generate(x, use_cache=False, **kw))


def test_stop_strings_in_transformers_own_loop(hf_model, model_dir):
    # generate() hands `tokenizer` on to forward with the model kwargs; it must not be refused there.
    tok = AutoTokenizer.from_pretrained(model_dir)
    x = ids(batch=1, length=5, seed=4)
    kw = dict(max_new_tokens=8, num_steps=2, init_scale=0.0, do_sample=False)
    full = hf_model.generate(x, **kw)
    new = full[0, 5:].tolist()
    texts = [tok.decode([t]) for t in new]
    cut = next(i for i in range(1, len(new))
               if texts[i].isascii() and texts[i].isalpha() and texts[i] not in "".join(texts[:i]))
    stopped = hf_model.generate(x, stop_strings=[texts[cut]], tokenizer=tok, **kw)
    assert torch.equal(stopped, full[:, : 5 + cut + 1])


def test_generate_routes_library_only_options(hf_model, library_model):
    x = ids(batch=2, length=5, seed=4)
    out = hf_model.generate(x, max_new_tokens=5, num_steps=4, init_scale=0.0, exit_criterion="kl",
                            exit_threshold=0.0, return_dict_in_generate=True)
    assert torch.equal(out.steps, torch.full_like(out.steps, 4))  # threshold 0 never exits early
    fixed = hf_model.generate(x, max_new_tokens=5, num_steps=4, init_scale=0.0, do_sample=False)
    assert torch.equal(out.sequences, fixed)
    adaptive = hf_model.generate(x, max_new_tokens=5, num_steps=4, init_scale=0.0, exit_criterion="kl",
                                 exit_threshold=10.0, return_dict_in_generate=True)
    assert int(adaptive.steps[:, 1:].max()) < 4  # the first token comes from the full-depth prefill
    with pytest.raises(ValueError, match="num_beams"):
        hf_model.generate(x, max_new_tokens=2, exit_criterion="kl", num_beams=2)


def test_routed_generate_accepts_the_values_that_ask_for_nothing(hf_model):
    """num_beams=1 and num_return_sequences=1 (a pipeline's or trainer's explicit defaults) change nothing: a call
    routed to the library runs as without them; other values are still refused by name."""
    x = ids(batch=2, length=5, seed=4)
    for routed in (dict(exit_criterion="kl", exit_threshold=0.0), dict(cache_implementation="static")):
        want = hf_model.generate(x, max_new_tokens=3, num_steps=2, init_scale=0.0, **routed)
        got = hf_model.generate(x, max_new_tokens=3, num_steps=2, init_scale=0.0, num_beams=1,
                                num_return_sequences=1, output_attentions=False, **routed)
        assert torch.equal(got, want)
        # (and the other defaults a caller may spell out: they were refused as if they asked for something)
        got = hf_model.generate(x, max_new_tokens=3, num_steps=2, init_scale=0.0, output_scores=False,
                                output_logits=False, min_new_tokens=0, min_length=0, length_penalty=1.0,
                                early_stopping=False, no_repeat_ngram_size=0, num_beam_groups=1, **routed)
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"\['num_return_sequences'\] cannot be combined"):
        hf_model.generate(x, max_new_tokens=2, cache_implementation="static", num_return_sequences=2)
    with pytest.raises(ValueError, match=r"\['length_penalty', 'min_new_tokens'\] cannot be combined"):
        hf_model.generate(x, max_new_tokens=2, cache_implementation="static", min_new_tokens=1, length_penalty=0.5)


def test_exit_threshold_auto_takes_the_criterion_of_the_models_generation_config(model_dir):
    """exit_threshold="auto" was resolved before the model's generation_config (exit_criterion="kl") was merged in:
    "needs an exit_criterion". It is the official threshold of the criterion in force now."""
    from recurrent_depth.inference.schema import official_auto_threshold

    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    model.generation_config.exit_criterion = "kl"
    x = ids(batch=1, length=5, seed=4)
    auto = model.generate(x, max_new_tokens=3, num_steps=3, exit_threshold="auto")
    spelled = model.generate(x, max_new_tokens=3, num_steps=3, exit_threshold=official_auto_threshold("kl"))
    assert torch.equal(auto, spelled)


@pytest.mark.parametrize("routed", [{}, {"exit_criterion": "kl"}], ids=["transformers-loop", "library"])
def test_generate_refuses_input_states_up_front(hf_model, routed):
    """input_states are one forward's s_0: transformers' loop took them for the prompt, then failed on the first
    new token with a shape error; both paths now say in one line what to use instead."""
    x = ids(batch=2, length=5, seed=4)
    with pytest.raises(ValueError, match=r"^generate: input_states is a forward\(\) argument .* init_scale="):
        hf_model.generate(x, max_new_tokens=2, num_steps=2, input_states=torch.zeros(2, 5, 64), **routed)


def test_routed_generate_takes_the_config_init_scale_and_output_logits_stays_in_transformers(model_dir):
    """A routed call (exit_criterion, seed, ...) drew a random s0 at scale 1.0 whatever
    `from_pretrained(dir, init_scale=0.0)` set, so threshold 0 no longer equalled greedy; and
    `output_logits=True`, transformers' own flag, was routed too (other tokens, a tensor not a tuple)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, init_scale=0.0).eval()
    x = ids(batch=1, length=5, seed=4)
    greedy = model.generate(x, max_new_tokens=5, num_steps=4, do_sample=False)
    for routed in (dict(exit_criterion="kl", exit_threshold=0.0), dict(seed=3)):
        assert torch.equal(model.generate(x, max_new_tokens=5, num_steps=4, do_sample=False, **routed), greedy)
    out = model.generate(x, max_new_tokens=5, num_steps=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy) and isinstance(out.logits, tuple) and len(out.logits) == 5
    with torch.no_grad():
        full = model(greedy, num_steps=4).logits[0]
    for i, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits[0], full[x.shape[1] - 1 + i], atol=1e-5, rtol=1e-5)


def test_generate_routes_gradmem_to_the_library(hf_model, library_model):
    x = ids(batch=1, length=12, seed=6)
    kw = dict(max_new_tokens=4, num_steps=2, init_scale=0.0, gradmem_tokens=3, gradmem_steps=2,
              gradmem_query_tokens=2, output_logits=True)
    out = hf_model.generate(x, return_dict_in_generate=True, **kw)
    ref = rd.generate(library_model, x, **kw)
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(out.logits, ref.logits)
    assert out.stats["gradmem_flops"] == ref.stats["gradmem_flops"] > 0


def test_generate_takes_a_generation_config_with_kwargs_on_top(hf_model, library_model):
    from transformers import GenerationConfig

    x = ids(batch=1, length=5, seed=4)
    common = dict(num_steps=6, init_scale=0.0)
    kl = rd.generate(library_model, x, max_new_tokens=4, exit_criterion="kl", exit_threshold=1e-2, **common)
    warm = rd.generate(library_model, x, max_new_tokens=4, warm_start=True, **common)
    config = GenerationConfig(max_length=9, do_sample=False, return_dict_in_generate=True)
    # positional (the model card's form) and by keyword; routed options as kwargs or on the config
    got = hf_model.generate(x, config, criterion="kl", exit_threshold=1e-2, **common)
    assert torch.equal(got.sequences, kl.sequences) and torch.equal(got.steps, kl.steps)
    on_config = GenerationConfig(max_new_tokens=4, criterion="kl", exit_threshold=1e-2, return_dict_in_generate=True)
    assert torch.equal(hf_model.generate(x, generation_config=on_config, **common).steps, kl.steps)
    # a keyword replaces the config's value (transformers' rule); two names inside one config conflict
    warm_config = GenerationConfig(max_new_tokens=4, continuous_compute=True, return_dict_in_generate=True)
    assert torch.equal(hf_model.generate(x, warm_config, **common).sequences, warm.sequences)
    plain = hf_model.generate(x, warm_config, warm_start=False, **common)
    assert torch.equal(plain.sequences, rd.generate(library_model, x, max_new_tokens=4, **common).sequences)
    with pytest.raises(ValueError, match="warm_start and continuous_compute set the same option"):
        hf_model.generate(x, GenerationConfig(max_new_tokens=2, warm_start=True, continuous_compute=False))
    with pytest.raises(ValueError, match="kv_policy and cache_lookup_strategy set the same option"):
        hf_model.generate(x, max_new_tokens=2, kv_policy="per-step", cache_lookup_strategy="latest-m4")
    # the official cache_kwargs, and shared options on a config that stays in transformers' loop
    lookup = hf_model.generate(x, config, criterion="kl", exit_threshold=1e-2, cache_kwargs={"lookup_strategy": "skip"},
                               **common)
    assert torch.equal(lookup.steps, rd.generate(library_model, x, max_new_tokens=4, exit_criterion="kl",
                                                 exit_threshold=1e-2, kv_policy="skip", **common).steps)
    fixed = hf_model.generate(x, GenerationConfig(max_new_tokens=4, num_steps=6, do_sample=False), init_scale=0.0)
    assert torch.equal(fixed, rd.generate(library_model, x, max_new_tokens=4, **common).sequences)
    with pytest.raises(ValueError, match="generation_config must be a transformers GenerationConfig"):
        hf_model.generate(x, {"max_new_tokens": 2}, criterion="kl")


def test_training_loss_and_gradients_match_the_library(model_dir):
    library = rd.RecurrentDepthLM.from_pretrained(model_dir).train()
    wrapped = AutoModelForCausalLM.from_pretrained(model_dir).train()
    x = ids(length=8)
    labels = x.clone()
    labels[:, :3] = -100
    ours = library(x, num_steps=(1, 2), labels=labels, init_scale=0.0).loss
    theirs = wrapped(input_ids=x, num_steps=(1, 2), labels=labels, init_scale=0.0).loss
    assert torch.equal(ours, theirs)
    ours.backward()
    theirs.backward()
    for (name, a), (_, b) in zip(library.named_parameters(), wrapped.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    summed = wrapped(input_ids=x, num_steps=(1, 2), labels=labels, init_scale=0.0, num_items_in_batch=10).loss
    count = int((labels[:, 1:] != -100).sum())
    assert torch.allclose(summed * 10 / count, theirs.detach(), atol=1e-6)


def test_int32_labels_give_the_loss_of_int64_labels(hf_model, library_model):
    # The library casts labels to long; the transformers forward handed int32 ones to cross_entropy (a RuntimeError).
    x = ids(length=6)
    loss = hf_model(input_ids=x, labels=x.int(), num_steps=2, init_scale=0.0).loss
    assert torch.equal(loss, hf_model(input_ids=x, labels=x, num_steps=2, init_scale=0.0).loss)
    assert torch.equal(loss, library_model(x, num_steps=2, labels=x.int(), init_scale=0.0).loss)


def test_wrapping_an_in_memory_model_shares_parameters(library_model):
    wrapped = from_library_model(library_model)
    assert wrapped.transformer.wte.weight is library_model.transformer.wte.weight
    x = ids()
    with torch.no_grad():
        assert torch.equal(wrapped(x, num_steps=2, init_scale=0.0).logits,
                           library_model(x, num_steps=2, init_scale=0.0).logits)


def test_cache_protocols(hf_model):
    x = ids(length=6)
    out = hf_model(x, num_steps=2, init_scale=0.0, cache=DynamicCache())  # an empty transformers cache is replaced
    cache = out.cache
    assert isinstance(cache, RecurrentDepthCache) and cache.get_seq_length() == 6 == cache.seq_len
    cache.crop(-2)
    assert cache.get_seq_length() == 4 and all(layer.keys.shape[2] == 4 for layer in cache.layers)
    with torch.no_grad():
        again = hf_model(x[:, 4:], cache=cache, num_steps=2, init_scale=0.0).logits
        full = hf_model(x, num_steps=2, init_scale=0.0, use_cache=False).logits[:, 4:]
    assert torch.allclose(again, full, atol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x: m(x, kv_budget=0), "kv_budget=0"),
        (lambda m, x: m(x, num_step=3), "num_step"),
        (lambda m, x: m(x, num_steps=-1), "num_steps=-1"),
        (lambda m, x: m(x, init_scale=-1.0), "init_scale"),
        (lambda m, x: m(x, inputs_embeds=torch.zeros(2, 7, 64)), "inputs_embeds"),
        (lambda m, x: m(x[:, :3], cache=m(x, kv_budget=2).cache, kv_budget=3), "kv_budget=3"),
        (lambda m, x: m(torch.full((1, 97), 1)), "max_seq_len=96"),
    ],
    ids=["budget-0", "typo", "negative-depth", "negative-init", "embeds", "budget-mismatch", "too-long"],
)
def test_bad_arguments_raise_clear_errors(hf_model, call, message):
    with pytest.raises(ValueError, match=message):
        call(hf_model, ids())


def test_bad_config_values_name_the_field(model_dir):
    with pytest.raises(ValueError, match="mean_recurrence"):
        AutoConfig.from_pretrained(model_dir, mean_recurrence=-1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.mean_recurrence = -2
    with pytest.raises(ValueError, match="config.mean_recurrence=-2"):
        model(ids())


def test_tokenizer_is_fast_with_a_chat_template(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|begin_text|>", "<|end_text|>", "<|pad|>")
    assert tok.bos_token_id == TINY_VOCAB - 32 and tok.eos_token_id == TINY_VOCAB - 31
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\nhi<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n"
    )
    assert tok.decode(tok("a=1;?a=")["input_ids"], skip_special_tokens=True) == "a=1;?a="


def test_import_registers_lazily_in_a_fresh_process(model_dir):
    """`import recurrent_depth` must not import transformers, yet AutoModelForCausalLM must know our types."""
    script = textwrap.dedent(f"""
        import sys
        import recurrent_depth  # and nothing else: the package installs the hooks itself
        assert "transformers" not in sys.modules, "importing recurrent_depth imported transformers"
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r})
        assert type(model).__name__ == "RecurrentDepthForCausalLM", type(model)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def attention_outputs(model, call):
    """Run `call()` recording every softmax-attention application's v (the Wqkv output's last part) and
    its attention output (the input of attn.proj), in call order."""
    records, handles = [], []
    for name, module in model.named_modules():
        if name.endswith("attn.Wqkv"):
            handles.append(module.register_forward_hook(lambda m, a, out: records.append(["v", out])))
        if name.endswith("attn.proj"):
            handles.append(module.register_forward_hook(lambda m, a, out: records.append(["o", a[0]])))
    try:
        result = call()
    finally:
        for handle in handles:
            handle.remove()
    return result, [(v[1], o[1]) for v, o in zip(records[::2], records[1::2], strict=True)]


def check_attentions(model, x, mask, num_steps, core_layers):
    """output_attentions=True: the logits of the fast path, P + R r + C weights [B, H, T, T], each a causal
    softmax over the real keys whose product with V is the layer's attention output."""
    cfg = model.config
    with torch.no_grad():
        fast = model(x, attention_mask=mask, num_steps=num_steps, init_scale=0.0, use_cache=False)
        out, applied = attention_outputs(model, lambda: model(x, attention_mask=mask, num_steps=num_steps,
                                                              init_scale=0.0, use_cache=False,
                                                              output_attentions=True))
    assert fast.attentions is None
    torch.testing.assert_close(out.logits, fast.logits, atol=1e-5, rtol=1e-5)
    B, T = x.shape
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    assert len(out.attentions) == 1 + core_layers * num_steps + 1 == len(applied)
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
    for probs, (qkv, attended) in zip(out.attentions, applied, strict=True):
        assert probs.shape == (B, H, T, T)
        torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T))
        assert not probs.triu(1).any()  # causal
        assert not probs[0, :, real[0].nonzero()[0, 0]:][..., ~real[0]].any()  # no real query reads a pad
        v = qkv[..., -Hkv * D:].view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        torch.testing.assert_close((probs @ v).transpose(1, 2).reshape(B, T, H * D), attended)


@pytest.mark.parametrize("overrides", [{}, dict(num_kv_heads=2, qk_norm=True, mixer_options={"window": 3})],
                         ids=["mha", "gqa-qknorm-window"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_output_attentions_returns_the_weights_the_model_uses(tmp_path, overrides, padded):
    """output_attentions=True returned None (attention runs in SDPA); now every layer application's weights."""
    make_model_dir(tmp_path, with_tokenizer=False, **overrides)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = ids(batch=2, length=6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]) if padded else None
    check_attentions(model, x, mask, num_steps=2, core_layers=model.config.core_layers)


def test_output_attentions_while_decoding_with_a_cache_and_in_generate(hf_model):
    x = ids(batch=2, length=6)
    with torch.no_grad():
        full = hf_model(x, num_steps=2, init_scale=0.0, use_cache=False, output_attentions=True).attentions
        first = hf_model(x[:, :5], num_steps=2, init_scale=0.0, use_cache=True)
        step = hf_model(x[:, 5:], cache=first.cache, num_steps=2, init_scale=0.0, output_attentions=True)
    assert len(step.attentions) == len(full) == 6
    for one, whole in zip(step.attentions, full, strict=True):
        assert one.shape == (2, 4, 1, 6)
        torch.testing.assert_close(one, whole[:, :, 5:], atol=1e-5, rtol=1e-5)
    out = hf_model.generate(x, max_new_tokens=2, num_steps=2, init_scale=0.0, do_sample=False,
                            output_attentions=True, return_dict_in_generate=True)
    assert [len(a) for a in out.attentions] == [6, 6]
    assert out.attentions[0][0].shape == (2, 4, 6, 6) and out.attentions[1][0].shape == (2, 4, 1, 7)
    # recurrent_depth.generate (routed) has no attention weights: refused when asked, no conflict when not
    routed = dict(max_new_tokens=2, num_steps=2, exit_criterion="kl", exit_threshold=1e-3, init_scale=0.0)
    hf_model.generate(x, output_attentions=False, **routed)
    with pytest.raises(ValueError, match=r"\['output_attentions'\] cannot be combined"):
        hf_model.generate(x, output_attentions=True, **routed)


@pytest.mark.parametrize("mixer", ["mla", "dsa", "nsa"])
def test_output_attentions_has_the_weights_of_latent_and_sparse_attention(tmp_path, mixer):
    """The core's MLA / DSA / NSA layers gave None; now their weights, with the logits of the fast path."""
    make_model_dir(tmp_path, with_tokenizer=False, mixer={"core": mixer})
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        out = model(ids(), num_steps=2, init_scale=0.0, output_attentions=True)
        fast = model(ids(), num_steps=2, init_scale=0.0)
    torch.testing.assert_close(out.logits, fast.logits, atol=1e-5, rtol=1e-5)
    assert [tuple(a.shape) for a in out.attentions] == [(2, 4, 7, 7)] * 6


def test_output_attentions_gives_none_for_other_mixers(tmp_path):
    make_model_dir(tmp_path, with_tokenizer=False, mixer={"core": "gated_deltanet"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        out = model(ids(), num_steps=2, init_scale=0.0, output_attentions=True)
        fast = model(ids(), num_steps=2, init_scale=0.0)
    torch.testing.assert_close(out.logits, fast.logits, atol=1e-5, rtol=1e-5)
    kinds = [None if a is None else tuple(a.shape) for a in out.attentions]
    assert kinds == [(2, 4, 7, 7), None, None, None, None, (2, 4, 7, 7)]
