"""Small gaps, each closed where it belongs: the closing chunk of a streamed completion with logprobs, a stop string
holding U+FFFD met in the held-back tail, the eos of a model directory whose generation_config.json sets none, the
LoRA load error's wording, `rdepth sweep emit --nproc`'s bound, the bound on ttt_steps / gradmem_steps, and the
sweep's message for two runs whose names collide."""

from __future__ import annotations

import json
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.inference.options import GenerationOptions, OptionError, OptionWarning
from recurrent_depth.serving.batch import RowRequest, TokenResult
from recurrent_depth.serving.engine import BatchScheduler, Done, Job, TokenOut
from recurrent_depth.serving.protocol import Limits, parse_completion
from recurrent_depth.serving.responses import Choice, apply_event, completion_body, completion_chunks
from recurrent_depth.serving.text import TextCodec, TextState

pytestmark = pytest.mark.usefixtures("one_thread")

LIMITS = Limits(4096, 4, 300)


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(["héllo wörld def add(a, b): return a + b\n"] * 8, 300), out)
    return TextCodec(out, 300)


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_streamed_completions_closing_chunk_carries_empty_logprobs(codec, logprobs):
    """The closing chunk (finish_reason, no token) had "logprobs": null with logprobs asked for; vLLM sends the
    object with empty lists there, which the openai client parses as such (null only without logprobs)."""
    from openai.types import Completion

    body = {"prompt": "x", "max_tokens": 1, **({"logprobs": logprobs} if logprobs is not None else {})}
    req = parse_completion(body, LIMITS, {"m"})
    token = codec.encode("ab", add_special_tokens=False)[0]
    choices = [Choice(0, [token])]
    chunks = []
    for event in (TokenOut(0, token, "a", 1, "depth", -0.5, [(token, -0.5)]), Done(0, "length", "", 1, 1)):
        chunks += completion_chunks(codec, event, apply_event(event, choices), req, {"id": "c", "object":
                                    "text_completion", "created": 0, "model": "m"})
    token_chunk, closing = chunks[0]["choices"][0], Completion.model_validate(chunks[1]).choices[0]
    assert closing.finish_reason == "length"
    if logprobs is None:
        assert closing.logprobs is None and token_chunk["logprobs"] is None
    else:  # (the fields of every other chunk's)
        assert set(chunks[1]["choices"][0]["logprobs"]) == set(token_chunk["logprobs"])
        assert closing.logprobs.model_dump() == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                 "text_offset": []}
        assert token_chunk["logprobs"]["token_logprobs"] == [-0.5]


@pytest.mark.parametrize("stop", ["\ufffd", "b\ufffd"])
def test_a_stop_string_with_a_replacement_character_is_found_in_the_held_back_tail(codec, stop):
    """Generation ending inside a character (max_tokens) flushes its tail as U+FFFD; a stop string holding one was
    not searched there, so the text ran through it. It ends before the stop string now, streamed or not, and the
    choice reports it (finish_reason "stop", stop_reason the string)."""
    ids = codec.encode("ab🙂", add_special_tokens=False)
    tokens = ids[:-1]  # "a", "b" and the emoji's first bytes
    assert len(tokens) >= 3 and codec.decode(tokens).endswith("\ufffd")
    state = TextState(codec, [stop])
    parts = [state.push(t) for t in tokens]
    assert not any(hit for _, hit in parts)
    assert "".join(p for p, _ in parts) + state.flush() == "ab\ufffd".split(stop)[0] and state.matched == stop

    # the server: the scheduler's last delivery (max_tokens) flushes the tail and names the stop string
    torch.manual_seed(0)
    scheduler = BatchScheduler(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval(), max_batch=1)
    req = parse_completion({"prompt": "x", "max_tokens": len(tokens), "stop": [stop]}, LIMITS, {"m"})
    events: list = []
    options = GenerationOptions(max_new_tokens=len(tokens)).validate(4)
    job = Job(RowRequest([1], options, 0), len(tokens), frozenset(), TextState(codec, [stop]), events.append,
              time.monotonic() + 60)
    finished = [scheduler._deliver(job, TokenResult(t, 1, "depth")) for t in tokens]
    assert finished == [False] * (len(tokens) - 1) + [True]
    done = events[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.stop_reason) == ("stop", stop)
    choices = [Choice(0, [1])]
    streamed = ""
    for event in events:
        streamed += "".join(c["choices"][0]["text"] for c in completion_chunks(codec, event, apply_event(event,
                                                                                                         choices),
                                                                               req, {}))
    whole = completion_body(codec, req, {}, choices, [[1]])["choices"][0]
    assert streamed == whole["text"] == "ab\ufffd".split(stop)[0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", stop)


@pytest.mark.parametrize("file_eos", [False, True])
def test_a_generation_config_without_eos_stops_where_transformers_generate_stops(tmp_path, file_eos):
    """A retrofitted directory whose generation_config.json has no eos_token_id, beside a config.json that has one:
    transformers' generate reads the file alone (no eos: it runs on), ours stopped at config.json's eos."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from recurrent_depth.families.retrofit import retrofit_to_dir
    from recurrent_depth.generation_config import generation_defaults
    from recurrent_depth.inference.generate import generate

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(3, 90, (1, 5), generator=gen)
    with torch.no_grad():
        eos = int(hf.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)[0, -1])
    hf.config.eos_token_id = eos  # (the first greedy token: a row that stops at eos ends at once)
    src = tmp_path / "llama"
    hf.save_pretrained(src)
    (src / "generation_config.json").write_text(json.dumps({"do_sample": False, "pad_token_id": 0,
                                                            **({"eos_token_id": eos} if file_eos else {})}))
    assert json.loads((src / "config.json").read_text())["eos_token_id"] == eos
    theirs = AutoModelForCausalLM.from_pretrained(src).float().eval()
    with torch.no_grad():
        want = theirs.generate(ids, max_new_tokens=6)[0].tolist()
    assert want[5] == eos and len(want) == (6 if file_eos else 11)  # (the test's teeth)

    retrofit_to_dir(src, tmp_path / "rd", prelude=1, core=(1, 2), coda=0)
    model = rd.RecurrentDepthLM.from_pretrained(tmp_path / "rd").eval()
    defaults = generation_defaults(str(tmp_path / "rd"), "auto", "test")
    got = generate(model, ids, max_new_tokens=6, num_steps=1, init_scale=0.0, **defaults)
    assert got.sequences[0].tolist() == want


def test_the_lora_load_errors_header_and_detail_read_as_one_sentence(tmp_path):
    """torch's "Error(s) in loading state_dict for PeftModel:" header was joined to its first line with "; ",
    which read ":;"."""
    from recurrent_depth.train.lora import _load_error

    exc = RuntimeError("Error(s) in loading state_dict for PeftModel:\n\tsize mismatch for x.lora_A: copying a "
                       "param with shape [2, 64]\n\tsize mismatch for y")
    message = str(_load_error(exc, tmp_path))
    assert ":;" not in message
    assert message.endswith("onto this model: Error(s) in loading state_dict for PeftModel: size mismatch for "
                            "x.lora_A: copying a param with shape [2, 64]")


def test_sweep_emit_bounds_nproc(tmp_path, capsys, monkeypatch):
    """`--nproc 10**8` wrote a script asking for 10**8 processes per node (and that many CPUs per task)."""
    import recurrent_depth.scaling.sweep as sweep
    from tests.test_sweep import write_sweep

    path = write_sweep(tmp_path / "s.yaml")
    assert main(["sweep", "emit", str(path), "--out", str(tmp_path / "big"), "--nproc", str(10**8)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rdepth sweep: error: --nproc must be an integer in [1, 1024] (processes per node), got {10**8}"
    assert not (tmp_path / "big").exists()
    asked = []  # (the bound itself passes; a real emit prepares the sweep's data: half a minute)
    monkeypatch.setattr(sweep, "emit_sweep", lambda *args, nproc, **kwargs: asked.append(nproc) or [])
    assert main(["sweep", "emit", str(path), "--out", str(tmp_path / "ok"), "--nproc", "1024"]) == 0
    assert asked == [1024]


@pytest.mark.parametrize("name", ["ttt_steps", "gradmem_steps"])
def test_test_time_step_counts_are_bounded(name):
    """ttt_steps / gradmem_steps had no ceiling in the Python API (10**9 ran forever): bounded as depths are."""
    with pytest.warns(OptionWarning, match="has no effect"):  # (the bound itself is accepted)
        GenerationOptions(**{name: 1024}).validate(4)
    with pytest.raises(OptionError) as info:
        GenerationOptions(**{name: 10**9}).validate(4)
    assert str(info.value) == f"{name}=1000000000 is invalid: expected an integer in [0, 1024]"
    assert info.value.field == name


def test_runs_whose_names_collide_name_the_colliding_values(tmp_path):
    """lr 0.1 and 0.1000001 are different settings whose run names are alike ('lr0.1'): the message said "the same
    settings {'lr': 0.1000001}", naming one value the user did not write twice."""
    from recurrent_depth.scaling.sweep import load_sweep
    from tests.test_sweep import write_sweep

    with pytest.raises(ValueError) as info:
        load_sweep(write_sweep(tmp_path / "s.yaml", grid={"lr": [0.1, 0.1000001]}, runs=None))
    message = str(info.value)
    assert "same settings" not in message
    assert message.endswith("two runs get the same name 'lr0.1': lr=0.1 and lr=0.1000001 are spelled alike in a run "
                            "name (numbers to 6 significant digits, characters other than [A-Za-z0-9.+-] as '_'): "
                            "make them differ there")
    with pytest.raises(ValueError, match=r"two runs have the same settings \{'seed': 0\} \(run 's0'\)"):
        load_sweep(write_sweep(tmp_path / "t.yaml", runs=[{"seed": 0}, {"seed": 0}]))
