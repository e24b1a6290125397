"""What a long-running server keeps across requests stays bounded by what the operator sets (found by a soak of
`rdepth serve`: thousands of requests with distinct models, stops, seeds, users, exit thresholds, kv_quant specs,
streams left early). Counted in entries, not in RSS."""

from __future__ import annotations

import warnings

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.options import GenerationOptions, OptionWarning
from recurrent_depth.serving import protocol
from recurrent_depth.serving.batch import BatchDecoder, RowRequest

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(1234)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def test_exit_criteria_of_finished_rows_are_dropped(model):
    """Each (exit_criterion, exit_threshold) of a request got a `RowCriterion` with [max_rows, ...] tensors that stayed
    after its rows left: a client sending ever new thresholds grew the batch's criteria (and every core step's loop
    over them) without bound. They now leave with their last row, and a row still running keeps its own."""
    dec = BatchDecoder(model, max_rows=2)
    kept = GenerationOptions(max_new_tokens=64, num_steps=4, exit_criterion="kl", exit_threshold=0.5,
                             init_scale=0.0).validate(4)
    long_row, _, _ = dec.add(RowRequest([1, 2, 3], kept, 0))
    for i in range(20):
        opts = GenerationOptions(max_new_tokens=1, num_steps=4, exit_criterion="kl", exit_threshold=1e-3 * (i + 1),
                                 init_scale=0.0).validate(4)
        seq, _, _ = dec.add(RowRequest([4, 5, 6], opts, i))
        dec.step()
        dec.remove(seq)
        assert set(dec.criteria) == {("kl", 0.5)}
    before = long_row.length
    while long_row.length == before:  # the remaining row still exits by its own criterion
        dec.step()
    dec.remove(long_row)
    assert dec.criteria == {}


def test_option_warnings_naming_client_values_are_not_remembered_forever(monkeypatch):
    """Each option warning (`top_p=0.5 has no effect in greedy decoding`) names the client's value, and Python keeps
    every distinct message it logged in the module's `__warningregistry__`: one entry per request with a new value,
    for the server's life. The record now starts over past `MAX_REMEMBERED_WARNINGS`; a repeated message is still
    logged once."""
    monkeypatch.setattr(protocol, "MAX_REMEMBERED_WARNINGS", 8)
    limits = protocol.Limits(max_seq_len=64, mean_recurrence=4, max_num_steps=16, vocab_size=320)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default", OptionWarning)  # (the server's: once per message)
        for _ in range(3):
            protocol.validated({"temperature": 0.0, "top_p": 0.25}, {}, 4, limits)
        assert len(caught) == 1
        for i in range(40):
            protocol.validated({"temperature": 0.0, "top_p": 0.5 + i / 1000}, {}, 4, limits)
            assert len(vars(protocol).get("__warningregistry__", {})) <= 8 + 2  # (+ its version key)
    assert len(caught) == 41
