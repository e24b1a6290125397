"""transformers' `logits_to_keep` runs the vocabulary head at the kept positions only (our class, the exported file).

Both forwards computed every position's logits and sliced them afterwards; and since neither named the argument,
transformers' `generate` (which passes `logits_to_keep=1` to a forward that names it) made a [B, T, V] float32 tensor
in every prefill: vocab 32k, a 2048-token prompt: 260 MiB peak RSS per row (4 rows: 1051 MiB), now 3 / 65 MiB. The
kept logits must be bitwise the whole head's (the head is padded to HEAD_MIN_ROWS rows, as the library's `logits_at`).
An `eager_attention` model (retrofitted Gemma 2) reported `config._attn_implementation == "sdpa"`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

import recurrent_depth as rd
from recurrent_depth.integrations.hf import from_library_model
from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote
from recurrent_depth.model.recurrent import HEAD_MIN_ROWS
from tests.test_hf import ids, make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
RUN = dict(num_steps=2, init_scale=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Our transformers class and the exported remote-code class over the same tiny directory."""
    path = tmp_path_factory.mktemp("hflogits")
    make_model_dir(path, with_tokenizer=False)
    return {"ours": AutoModelForCausalLM.from_pretrained(path).eval(),
            "remote": remote.RecurrentDepthForCausalLM.from_pretrained(path).eval()}


def head_rows(model) -> tuple[list[int], Any]:
    """The number of rows of each lm_head call from now on, and the hook's handle (the caller removes it)."""
    rows: list[int] = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].reshape(
        -1, args[0].shape[-1]).shape[0]))
    return rows, handle


@pytest.mark.parametrize("name", ["ours", "remote"])
def test_kept_logits_are_the_whole_heads_bit_for_bit_from_a_head_at_those_rows(models, name):
    model = models[name]
    x = ids(batch=2, length=40)
    mask = torch.ones_like(x)
    mask[1, :9] = 0  # a left-padded row
    with torch.no_grad():
        full = model(x, attention_mask=mask, **RUN).logits
        cases = [(1, [39]), (3, [37, 38, 39]), (40, list(range(40))), (99, list(range(40))),
                 (torch.tensor([5, -1, 5, 0]), [5, 39, 5, 0]), (torch.arange(40) % 7 == 0, list(range(0, 40, 7))),
                 (torch.tensor([], dtype=torch.long), [])]
        for keep, columns in cases:
            rows, handle = head_rows(model)
            got = model(x, attention_mask=mask, logits_to_keep=keep, **RUN).logits
            handle.remove()
            assert torch.equal(got, full[:, columns]), (name, keep)
            # a few kept rows: the head ran over HEAD_MIN_ROWS rows (was every one of the 80 positions)
            assert rows == [max(HEAD_MIN_ROWS, 2 * len(set(columns))) if len(columns) < 40 else 80], keep
        # the library's forward at the same positions (the remote file's own head_at against the library's)
        core_at = torch.zeros_like(x, dtype=torch.bool)
        core_at[:, -3:] = True
        assert torch.equal(model(x, attention_mask=mask, logits_to_keep=3, **RUN).logits.reshape(6, -1),
                           models["ours"]._core(x, attention_mask=mask, logits_at=core_at, **RUN).logits)
        # a prompt of fewer than HEAD_MIN_ROWS positions in all: the head runs over all of them, as the whole head
        short = x[:, :5]
        assert torch.equal(model(short, logits_to_keep=1, **RUN).logits, model(short, **RUN).logits[:, -1:])
        # labels: the loss reads every position, the kept logits as before
        out, kept = model(x, labels=x, **RUN), model(x, labels=x, logits_to_keep=2, **RUN)
        assert torch.equal(kept.loss, out.loss) and torch.equal(kept.logits, out.logits[:, -2:])


@pytest.mark.parametrize("name", ["ours", "remote"])
def test_generate_keeps_one_position_in_the_prefill_with_the_same_tokens_and_scores(models, name):
    """transformers' generate passes logits_to_keep=1 now that forward names it; `logits_to_keep=0` in the call is
    the old full head: greedy and sampled tokens, scores and raw logits must be bitwise the same."""
    model = models[name]
    x = ids(batch=2, length=40, seed=3)
    mask = torch.ones_like(x)
    mask[0, :6] = 0
    x = x.masked_fill(mask == 0, 0)
    for sampled in (False, True):
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=sampled, pad_token_id=0, eos_token_id=None,
                  return_dict_in_generate=True, output_scores=True, output_logits=True, **RUN)
        if sampled:
            kw.update(top_k=20, temperature=0.9)
        outs, prefill_rows = [], []
        for extra in ({}, {"logits_to_keep": 0}):
            rows, handle = head_rows(model)
            torch.manual_seed(11)
            with torch.no_grad():
                outs.append(model.generate(x, **kw, **extra))
            handle.remove()
            prefill_rows.append(rows[0])
            assert prefill_rows == [HEAD_MIN_ROWS, 80][:len(prefill_rows)]  # (the whole head: 80 rows)
        new, old = outs
        assert torch.equal(new.sequences, old.sequences), sampled
        assert all(torch.equal(a, b) for a, b in zip(new.scores, old.scores, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(new.logits, old.logits, strict=True))


def test_logits_to_keep_errors_name_what_is_wrong(models):
    assert remote.HEAD_MIN_ROWS == HEAD_MIN_ROWS  # (the exported file's copy of the library's padding)
    x = ids(batch=1, length=6)
    for model in models.values():
        with pytest.raises(ValueError, match=r"^logits_to_keep lists positions outside \[-6, 6\) \(seq_len=6\)$"):
            model(x, logits_to_keep=torch.tensor([0, 6]), **RUN)
        with pytest.raises(ValueError, match=r"^logits_to_keep is a bool mask of 5 positions, expected seq_len=6$"):
            model(x, logits_to_keep=torch.ones(5, dtype=torch.bool), **RUN)
        with pytest.raises(ValueError, match=r"^logits_to_keep=tensor\(\[1.\]\) is invalid: expected an integer"):
            model(x, logits_to_keep=torch.tensor([1.0]), **RUN)


def test_an_eager_attention_model_reports_eager_attention(tmp_path):
    """Its layers attend as plain math whatever is asked (Gemma 2's transformers code has no SDPA either)."""
    torch.manual_seed(0)
    eager = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", eager_attention=True)).eval()
    assert from_library_model(eager).config._attn_implementation == "eager"
    assert from_library_model(rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))).config._attn_implementation \
        == "sdpa"
    eager.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert loaded.config._attn_implementation == "eager"
    x = ids(batch=1, length=9)
    with torch.no_grad():
        assert torch.equal(loaded(x, **RUN).logits, eager(x, **RUN).logits)  # what runs is unchanged
