"""The exported remote-code file (`rdepth export --remote-code`) refuses bad forward inputs in one line, in the
library's words, instead of a RuntimeError / IndexError / TypeError from deep inside torch, or a silently dropped
input."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.integrations.remote import modeling_recurrent_depth as remote

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> remote.RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    return remote.RecurrentDepthForCausalLM(remote.RecurrentDepthConfig()).eval()  # vocab 256, hidden 64


X = torch.arange(12).reshape(2, 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # a mask of another length: a broadcast RuntimeError, or (all ones) silently dropped
        (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5])),
         r"^attention_mask must have shape \[batch, cached \+ new\] = \(2, 6\), got \(2, 5\)$"),
        (dict(attention_mask=torch.ones(2, 7)), r"^attention_mask must have shape .* got \(2, 7\)$"),
        (dict(attention_mask=torch.ones(6)), r"^attention_mask must have shape .* got \(6,\)$"),
        # document ids (packing collators) attended across documents
        (dict(attention_mask=torch.tensor([[1, 1, 2, 2, 2, 2], [1] * 6])),
         r"^attention_mask must contain only 0 \(padding\) and 1 \(real token\)$"),
        # labels: the loss's "Expected input batch_size (10) to match target batch_size (6)", IndexError "Target 300"
        (dict(labels=X[:, :4]), r"^labels must have the shape of input_ids \(2, 6\), got \(2, 4\)$"),
        (dict(labels=X + 300), r"^labels must be token ids in \[0, 256\) or -100 \(ignored\)$"),
        (dict(labels=X.float()), r"^labels must hold integer token ids, got dtype torch.float32$"),
        # init_scale: nan / inf a RuntimeError from trunc_normal_, a string a TypeError, True accepted
        (dict(init_scale=float("nan")), r"^init_scale=nan is invalid: expected a finite number >= 0$"),
        (dict(init_scale=float("inf")), r"^init_scale=inf is invalid"),
        (dict(init_scale="1"), r"^init_scale='1' is invalid"),
        (dict(init_scale=True), r"^init_scale=True is invalid"),
    ],
    ids=["short-mask", "long-mask", "1d-mask", "document-id-mask", "label-shape", "label-range", "float-labels",
         "nan-scale", "inf-scale", "str-scale", "bool-scale"],
)
def test_bad_forward_inputs_are_one_line_errors(model, kwargs, message):
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(X, num_steps=1, **kwargs)


@pytest.mark.parametrize(
    "ids, message",
    [(X[0], r"^input_ids must have shape \[batch, seq_len>0\], got \(6,\)$"),  # was IndexError: tuple index
     (X.float(), r"^input_ids must hold integer token ids, got dtype torch.float32$"),  # the embedding's RuntimeError
     (X.tolist(), r"^input_ids must be a torch.Tensor, got list$")],  # AttributeError: no .shape
    ids=["1d", "float", "list"],
)
def test_bad_input_ids_are_one_line_errors(model, ids, message):
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(ids, num_steps=1)
    if isinstance(ids, torch.Tensor):  # generate checks them up front too
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=1, num_steps=1, do_sample=False)


def test_a_full_length_mask_still_decodes_from_the_cache(model):
    """The mask check counts the cached tokens: a cached step takes the whole row's mask, as generate passes it."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        out = model(X, attention_mask=mask, num_steps=1, init_scale=0.0, use_cache=True)
        step = model(X[:, :1], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                     cache=out.cache, num_steps=1, init_scale=0.0)
        full = model(torch.cat([X, X[:, :1]], 1), attention_mask=torch.cat([mask, torch.ones(2, 1)], 1),
                     num_steps=1, init_scale=0.0)
        with pytest.raises(ValueError, match=r"^attention_mask must have shape .* = \(2, 8\), got \(2, 1\)$"):
            model(X[:, :1], attention_mask=torch.ones(2, 1), cache=step.cache, num_steps=1, init_scale=0.0)
    torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-5)
