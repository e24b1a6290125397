"""Hardening gaps (session 33, second batch): adapter regexes timed in any thread and over every name peft
matches, `rdepth info --kv-quant` on windowed layers, torch's build warnings, a stale test docstring."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.train import lora
from recurrent_depth.train.lora import LoraSpec, add_lora, load_lora, load_loras, save_adapter
from tests.test_hostile_s32 import tiny_model, with_config

# Regexes whose matching time grows polynomially (degree k) with a name's length, not exponentially as
# `([\w.]+)+Z` does: the old code spent seconds on the tiny model's names instead of hours, so the tests below
# fail on it rather than hang (a regex in a thread holds the GIL: no timeout could have stopped it).
SLOW_TARGETS = r"(?:.*){7}Z"  # ~15 s over the tiny model's 52 module names, untimed
SLOW_LAYERS = r"(?:.*){7}Z"  # as layers_pattern, inside peft's `(?:^|.*?\.)PATTERN\.(?P<idx>\d+)\.`: ~10 s
# slow only on the names a modules_to_save wrapper adds (`lm_head.modules_to_save.<adapter>`): ~15 s on those
SLOW_ON_WRAPPERS = r"(?=.*(?:original_module|modules_to_save))(?:.*){9}Z"


@pytest.fixture(scope="module")
def coda_adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("gaps2_adapter") / "adapter"
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2, parts=("coda",))), out)
    return out


def test_a_slow_adapter_regex_is_refused_in_time_off_the_main_thread(coda_adapter, tmp_path, monkeypatch):
    """The server loads adapters on its scheduler's thread, where SIGALRM cannot reach: the match ran untimed
    (`([\\w.]+)+Z`: hours, every thread of the server frozen). Now it runs in a child process, killed in time."""
    monkeypatch.setattr(lora, "TARGET_REGEX_SECONDS", 0.2)
    hostile = with_config(coda_adapter, tmp_path / "hostile", target_modules=SLOW_TARGETS)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_lora(tiny_model(), hostile)
            outcome.append(None)
        except BaseException as exc:  # (handed to the main thread's asserts)
            outcome.append(exc)

    start = time.perf_counter()
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=20)
    elapsed = time.perf_counter() - start
    assert not worker.is_alive() and elapsed < 4, f"the load took {elapsed:.1f} s"
    assert isinstance(outcome[0], ValueError), outcome
    message = str(outcome[0])
    assert "\n" not in message and re.search(
        r"its adapter_config.json's target_modules='\(\?:\.\*\)\{7\}Z' takes over 0.2 s to match", message)
    # an ordinary regex, off the main thread too: the same matches as in the main thread
    names = ["transformer.core_block.0.attn.Wqkv", "transformer.coda.0.mlp.proj"]
    found: list = []
    worker = threading.Thread(target=lambda: found.append(lora._timed_matches(
        [(r".*\.attn\..*", "fullmatch"), (r"(.*\.)?(proj)$", "match")], names, 5.0)))
    worker.start()
    worker.join(timeout=20)
    assert found == [[{names[0]}, {names[1]}]] == [lora._timed_matches(
        [(r".*\.attn\..*", "fullmatch"), (r"(.*\.)?(proj)$", "match")], names, 5.0)]


def test_a_slow_layers_pattern_is_refused_before_peft_matches_it(coda_adapter, tmp_path, monkeypatch):
    """peft matches layers_pattern (with layers_to_transform and target_modules by suffix) around every targeted
    module's name as a regex: untimed, `([\\w.]+)+Z` hung `load_lora` for hours in peft."""
    monkeypatch.setattr(lora, "TARGET_REGEX_SECONDS", 0.2)
    fields = dict(target_modules=["Wqkv", "proj", "fc"], layers_to_transform=[0])
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"its adapter_config.json's layers_pattern='\(\?:\.\*\)\{7\}Z' takes over "
                                         r"0.2 s to match this model's \d+ module names") as caught:
        load_lora(tiny_model(), with_config(coda_adapter, tmp_path / "hostile", layers_pattern=SLOW_LAYERS, **fields))
    assert "\n" not in str(caught.value) and time.perf_counter() - start < 4
    with pytest.raises(ValueError, match=r"layers_pattern='\(\[' is not a valid regular expression"):
        load_lora(tiny_model(), with_config(coda_adapter, tmp_path / "invalid", layers_pattern="([", **fields))
    # an ordinary one still loads, on the layers it names
    wrapped = load_lora(tiny_model(), with_config(coda_adapter, tmp_path / "ok", layers_pattern="coda", **fields))
    assert wrapped is not None


def test_a_later_adapters_regex_is_timed_over_the_names_earlier_adapters_add(coda_adapter, tmp_path, monkeypatch):
    """An adapter with modules_to_save gives the model more module names (`lm_head.modules_to_save.<adapter>`),
    which peft matches the next adapter's regexes against: they were timed over the base's names alone."""
    import peft

    monkeypatch.setattr(lora, "TARGET_REGEX_SECONDS", 0.2)
    saved_head = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["Wqkv"],
                                                                   modules_to_save=["lm_head"]))
    saved_head.save_pretrained(tmp_path / "head")
    hostile = with_config(coda_adapter, tmp_path / "hostile", exclude_modules=SLOW_ON_WRAPPERS)
    model = tiny_model()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"its adapter_config.json's exclude_modules='.*takes over 0.2 s") as caught:
        load_loras(model, [tmp_path / "head", hostile])
    assert "\n" not in str(caught.value) and time.perf_counter() - start < 4
    assert not any("lora_" in name for name, _ in model.named_parameters())  # the model as it was given
    keys = lora.peft_module_keys(load_loras(tiny_model(), [tmp_path / "head"]).get_base_model())
    assert "lm_head.modules_to_save.lora0_" in keys and not any(".lora_A" in key for key in keys)


# ------------------------------------------------------------------ 2. info --kv-quant under decoding
def test_info_prices_a_quantized_windowed_cache_as_decoding_allocates_it(tmp_path, capsys, monkeypatch):
    """`info --kv-quant` spread a windowed layer's codes over the whole context, while a quantized cache holds
    O(W) columns in autoregressive decoding, and at head dim 8 more than W = 4: the 7 its codes decode bitwise
    from (`exact_decode_columns`). Its decode figure is the bytes a real quantized cache allocates."""
    from recurrent_depth.cli import main
    from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns
    from tests.test_gaps_s33 import CONTEXT, peak_store_bytes, windowed_config

    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    # a 6-token prompt reaches the bound (29 columns at reach 7) within 46 tokens: no need to decode to 112
    spec, window, prompt_tokens, new_tokens = "k=prod:3.5,v=mse:3.5", 4, 6, 40
    config = windowed_config([window] * 4)
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--kv-quant", spec, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config).to(torch.bfloat16).eval()

    prompt = torch.randint(0, 64, (1, prompt_tokens))
    peak = peak_store_bytes(monkeypatch, model, prompt, max_new_tokens=new_tokens, kv_quant=spec)
    assert set(peak) == {("prelude", 0), ("core", 0), ("core", 1), ("coda", 0)}
    decoding = info["cache_bytes_at_max_seq_len_quantized_autoregressive_by_kv_policy"]
    assert decoding["per-step+deepest"] == sum(peak.values())
    # (at W alone it was 23 columns of the 29 the cache holds; spread over the context, 112)
    per_token = info["kv_cache_bytes_per_token_quantized_by_kv_policy"]["per-step+deepest"]
    assert decoding_window_columns(window) < decoding_window_columns(7) < CONTEXT
    assert sum(peak.values()) == per_token * decoding_window_columns(7)
    assert main(["info", "--model", str(tmp_path), "--kv-quant", spec]) == 0
    text = capsys.readouterr().out
    assert re.search(r"per-step\+deepest quantized  [\d,]+ bytes/token \(.*x smaller than per-step bf16; "
                     r"autoregressive decoding: ", text)


# ------------------------------------------------------------------ 3. a failed C++ build says why in one line
TORCH_NOTE = ("\n!! WARNING !!\n\nYour compiler (/nonexistent/c++) is not compatible with the compiler Pytorch was\n"
              "built with for this platform, which is g++ on linux.\n!! WARNING !!\n")


def test_a_failed_kernel_build_shows_our_line_not_torchs_compiler_warning(tmp_path, monkeypatch, capfd, caplog):
    """With no usable compiler (CXX=/nonexistent/c++), torch printed its "Your compiler ... is not compatible"
    paragraph before the project's one-line note; now that paragraph is on the kernels' log at DEBUG."""
    import logging
    import warnings

    import torch.utils.cpp_extension as cpp_extension

    from recurrent_depth.accel import quant_cpp
    from recurrent_depth.cli import main

    def failing_build(name, **kwargs):
        logging.getLogger("torch.utils.cpp_extension").warning(TORCH_NOTE)  # (torch 2.x: its logger)
        warnings.warn_explicit(TORCH_NOTE, UserWarning, cpp_extension.__file__, 1)  # (older torch: a warning)
        raise RuntimeError(f"Error building extension '{name}': [1/2] /nonexistent/c++ -c main.cpp -o main.o\n"
                           "/bin/sh: 1: /nonexistent/c++: not found")

    monkeypatch.setattr(cpp_extension, "load_inline", failing_build)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in ("_module", "_failure", "_cache"):  # (a build tried before in this process: tried again)
        monkeypatch.setattr(quant_cpp, name, None)
    with caplog.at_level(logging.DEBUG, logger=quant_cpp.__name__):
        assert main(["info", "--build-kernels"]) == 1
    err = capfd.readouterr().err
    assert "WARNING" not in err and "not compatible" not in err
    assert err.strip().splitlines()[-1] == ("rdepth info: error: the C++ quantized-KV kernels cannot build here: "
                                            "RuntimeError: Error building extension 'rdepth_quant_"
                                            f"{quant_cpp.build_key()}': /bin/sh: 1: /nonexistent/c++: not found")
    notes = [record.getMessage() for record in caplog.records if record.name == quant_cpp.__name__]
    assert sum("are unavailable (RuntimeError: Error building extension" in note for note in notes) == 1
    assert sum(note == f"torch's extension build: {TORCH_NOTE}" for note in notes) == 2  # (kept, at DEBUG)
