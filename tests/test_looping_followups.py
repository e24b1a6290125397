"""Follow-ups in the looping code: the looper frees a forward's arguments, `--windows` is checked at parsing,
and `rdepth loop search --save` keeps the source loop's decode-time settings."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer
from recurrent_depth.looping import LoopConfig, apply_loop

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 6


def _llama(vocab_size: int = 61, **extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, **extra)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("mode", ["block", "layer"])
def test_a_finished_forward_leaves_no_cache_or_activations_in_the_looper(mode):
    """The looper kept the last forward's layer arguments (hidden states, the KV cache) until the next forward."""
    model = _llama()
    looper = apply_loop(model, LoopConfig(1, 2, iterations=3, mode=mode, stash="last", when="always"))
    ids = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)  # looped prefill
        out = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # looped decode step
    assert cache.get_seq_length() == 6  # (one KV entry per token: the loop ran with the cache)
    cache_ref, logits_ref = weakref.ref(cache), weakref.ref(out.logits)
    del cache, out
    gc.collect()
    assert cache_ref() is None and logits_ref() is None
    assert not looper._calls


def test_a_bad_windows_value_is_refused_at_parsing_naming_the_flag(tmp_path, capsys):
    """`--windows 3-1` was refused only after the model had loaded, worded as "LoopConfig window ..."."""
    missing = tmp_path / "no-model"  # (loading it would fail: the check must come first)
    with pytest.raises(SystemExit) as exit_info:
        main(["loop", "eval", "--model", str(missing), "--windows", "1,3-1", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --windows: window '3-1' must satisfy 0 <= start <= end, got start=3 end=1" in err
    assert "LoopConfig" not in err and "not a model directory" not in err
    with pytest.raises(ValueError, match=r"^LoopConfig window must satisfy 0 <= start <= end, got start=3 end=1$"):
        LoopConfig(3, 1)


def test_search_save_keeps_the_source_loops_stash_and_when(tmp_path):
    """A source model whose stored loop had stash="last", when="always" was saved with the defaults."""
    source, saved = tmp_path / "source", tmp_path / "saved"
    tok = train_tokenizer([TEXT], vocab_size=300)
    specials = special_token_ids(tok)
    model = _llama(tok.get_vocab_size(), bos_token_id=specials["begin_text"], eos_token_id=specials["end_text"],
                   pad_token_id=specials["pad"])
    apply_loop(model, LoopConfig(1, 1, iterations=3, stash="last", when="always"))
    model.save_pretrained(source)
    save_tokenizer(tok, source)
    text = tmp_path / "held_out.py"
    text.write_text(TEXT)
    assert main(["loop", "search", "--model", str(source), "--data", str(text), "--widths", "1", "--iterations", "2",
                 "--max-tokens", "20", "--seq-len", "16", "--out", str(tmp_path / "s"), "--save", str(saved)]) == 0
    loop = json.loads((saved / "config.json").read_text())["loop"]
    assert (loop["stash"], loop["when"], loop["iterations"]) == ("last", "always", 2)
    assert loop == json.loads((tmp_path / "s" / "results.json").read_text())["best"]["config"]
