"""Found by a review of session 34's changes: a transformers streamer on a routed `generate` call the library refused
(an OptionError: a bad option value) had the prompt put and no `end()`, so a `TextIteratorStreamer`'s reader waited
for good; transformers checks its options before it puts anything."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from recurrent_depth.inference.options import OptionError
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("review_s34")
    make_model_dir(path, with_tokenizer=False)
    return AutoModelForCausalLM.from_pretrained(path).eval()


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1


@pytest.mark.parametrize("bad", [{"exit_criterion": "kl", "exit_threshold": -1.0}, {"draft_steps": -2}],
                         ids=["exit_threshold", "draft_steps"])
def test_a_routed_call_the_library_refuses_puts_nothing_to_the_streamer(hf_model, bad):
    recorder = Recorder()
    with pytest.raises(OptionError):
        hf_model.generate(ids(batch=2, length=5), max_new_tokens=3, num_steps=2, streamer=recorder, **bad)
    assert recorder.puts == [] and recorder.ends == 0


def test_a_routed_call_puts_the_prompt_first_then_each_step_then_ends(hf_model):
    x = ids(batch=2, length=5, seed=1)
    recorder = Recorder()
    out = hf_model.generate(x, max_new_tokens=3, num_steps=2, init_scale=0.0, do_sample=False,
                            exit_criterion="kl", streamer=recorder)
    assert torch.equal(recorder.puts[0], x) and recorder.ends == 1
    assert torch.equal(torch.cat([recorder.puts[0], *(p.reshape(2, 1) for p in recorder.puts[1:])], 1), out)
