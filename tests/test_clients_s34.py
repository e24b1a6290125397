"""Found by driving the server with the real `openai` client and the model with transformers' own tools (session 34):
a request for audio output was answered as text without a word, and a transformers streamer (`TextStreamer`, ...)
was refused by every `generate` call routed to the library (adaptive exit, speculative decoding, ...)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import recurrent_depth as rd
from recurrent_depth.inference.options import OptionError
from recurrent_depth.serving import build_app
from tests.test_hf import ids, make_model_dir
from tests.test_serving import LiveServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("clients")
    make_model_dir(path)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


class Recorder(BaseStreamer):
    """What transformers' loop gives a streamer: the prompt, then one tensor of new tokens per step, then end()."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1

    def sequences(self, rows: int) -> torch.Tensor:
        return torch.cat([self.puts[0].reshape(rows, -1), *(p.reshape(rows, 1) for p in self.puts[1:])], dim=1)


@pytest.mark.parametrize("routed", [{}, {"exit_criterion": "kl"}, {"draft_steps": 1}],
                         ids=["transformers-loop", "adaptive-exit", "speculative"])
def test_a_streamer_gets_the_sequences_step_by_step_on_every_generate_path(hf_model, routed):
    x = ids(batch=3, length=5, seed=2)
    base = dict(max_new_tokens=5, num_steps=2, init_scale=0.0, do_sample=False)
    free = hf_model.generate(x, **base)
    # an eos that ends row 0 after its second token while the other rows go on: their steps hold the pad id
    eos = int(free[0, x.shape[1] + 1])
    assert eos not in free[1:, x.shape[1]:].tolist()[0][:2]
    for extra in ({}, {"pad_token_id": 7}):
        recorder = Recorder()
        out = hf_model.generate(x, **base, **routed, eos_token_id=eos, streamer=recorder, **extra)
        assert recorder.ends == 1
        assert torch.equal(recorder.sequences(3), out)
        assert torch.equal(recorder.puts[0], x)
        assert int((out[0, x.shape[1]:] == eos).nonzero()[0]) == 1  # (row 0 did stop early)


def test_text_iterator_streamer_gives_the_text_of_a_routed_call(hf_model, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    x = tok("def f(x):", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = hf_model.generate(x, max_new_tokens=6, num_steps=2, init_scale=0.0, do_sample=False,
                            exit_criterion="kl", exit_threshold=0.0, streamer=streamer)
    assert "".join(streamer) == tok.decode(out[0, x.shape[1]:])


def test_a_refused_routed_call_puts_nothing_to_the_streamer(hf_model):
    recorder = Recorder()
    with pytest.raises(ValueError, match=r"\['num_return_sequences'\] cannot be combined"):
        hf_model.generate(ids(batch=1), max_new_tokens=2, exit_criterion="kl", num_return_sequences=2,
                          streamer=recorder)
    assert recorder.puts == [] and recorder.ends == 0


@pytest.mark.parametrize("bad", [{"exit_criterion": "kl", "exit_threshold": -1.0}, {"draft_steps": -2}],
                         ids=["exit_threshold", "draft_steps"])
def test_a_routed_call_the_library_refuses_puts_nothing_to_the_streamer(hf_model, bad):
    """(review) an OptionError from the library came after the prompt was put, and no `end()` followed: a
    `TextIteratorStreamer`'s reader waited for good (transformers checks its options before it puts anything)."""
    recorder = Recorder()
    with pytest.raises(OptionError):
        hf_model.generate(ids(batch=2, length=5), max_new_tokens=3, num_steps=2, streamer=recorder, **bad)
    assert recorder.puts == [] and recorder.ends == 0


@pytest.fixture(scope="module")
def client(model_dir):
    model = rd.RecurrentDepthLM.from_pretrained(model_dir)
    with LiveServer(build_app(model, tokenizer_dir=model_dir, model_name="m", tokenizer_workers=1)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_audio_output_is_a_400_naming_the_field_and_text_output_is_served(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, modalities=["text", "audio"],
                                       audio={"voice": "alloy", "format": "wav"})
    assert err.value.body["param"] == "modalities"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=messages, max_tokens=2, audio={"voice": "alloy",
                                                                                          "format": "wav"})
    assert err.value.body["param"] == "audio"
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=2, modalities=["text"])
    assert answer.usage.completion_tokens == 2
