"""Behaviour a second mutation hunt found unpinned (document packing, SFT chat masks, the LR schedule and optimizer
groups, RL advantages and losses, bit packing): each test states the documented rule, against a plain reference
where there is one, so a flipped comparison, an off-by-one or a dropped statement in that code fails here."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_depth.data.packing import RowPacker, tokenize_documents
from recurrent_depth.data.tokenizer import train_tokenizer


# ---------------------------------------------------------------------------------------- document packing
def test_a_finished_packer_refuses_more_documents_and_finish_is_idempotent():
    """`add()` after `finish()` is a RuntimeError (its docstring), and a second `finish()` counts nothing twice."""
    packer = RowPacker(4, bos_id=0, eos_id=1)
    assert len(packer.add([5, 6, 7, 8, 9])) == 1  # 7 framed tokens: one row, 3 dropped by the paper's rule
    packer.add([5])  # 3 tokens left in the unfinished row
    first = packer.finish().to_dict()
    assert first["tokens_dropped"] == 3 + 3 and first["tokens_in"] == first["tokens_packed"] + first["tokens_dropped"]
    with pytest.raises(RuntimeError, match="after finish"):
        packer.add([5, 6])
    assert packer.finish().to_dict() == first


def test_tokenize_documents_takes_a_batch_of_one_and_a_document_of_exactly_piece_chars_whole(monkeypatch):
    """batch_size >= 1 is valid (1 too); only a document *longer* than piece_chars is encoded in pieces."""
    import recurrent_depth.data.packing as packing

    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(12)]
    tok = train_tokenizer(texts, vocab_size=300)
    expected = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert [ids.tolist() for ids in tokenize_documents(texts, tok, batch_size=1)] == expected
    with pytest.raises(ValueError, match="batch_size"):
        list(tokenize_documents(texts, tok, batch_size=0))

    def no_pieces(*args, **kwargs):
        raise AssertionError("a document of piece_chars characters was cut into pieces")

    monkeypatch.setattr(packing, "text_pieces", no_pieces)
    [ids] = tokenize_documents([texts[3]], tok, piece_chars=len(texts[3]))
    assert ids.tolist() == expected[3]
    assert np.asarray(ids).dtype == np.int64


# ---------------------------------------------------------------------------------------- SFT chat examples
def _encoder(directory, template: str):
    """An `ExampleEncoder` over a byte-level BPE tokenizer in which " the" is one token (and nothing merges
    across words), with `template` as its chat template."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    import recurrent_depth as rd
    from recurrent_depth.data.chat import ExampleEncoder

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    config = rd.ModelConfig.from_preset("tiny", vocab_size=tok.get_vocab_size(with_added_tokens=True),
                                        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    return ExampleEncoder(directory, config), tok


PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"  # no generation prompt


def test_an_example_cut_to_most_tokens_still_shows_the_cut_when_a_piece_tokenizes_exactly(tmp_path):
    """`encode(most=M)` gives the whole example's first tokens, more than M of them where it is longer (so the cut
    is seen): also when a piece's text yields exactly as many tokens as its prefix was sized for (4 characters a
    token, the size `_prefix` reads ahead by)."""
    from recurrent_depth.data.chat import conversation

    encoder, tok = _encoder(tmp_path, PLAIN_TEMPLATE)
    assert tok.encode(" the the", add_special_tokens=False).tokens == ["Ġthe", "Ġthe"]
    chat = conversation({"prompt": " the", "completion": " the" * 400}, "x:1")
    whole = encoder.encode(chat, "x:1")
    assert len(whole.ids) == 1 + 1 + 400 + 1  # bos, prompt, completion, eos
    for most in (10, 50, 200):
        part = encoder.encode(chat, "x:1", most)
        assert len(part.ids) > most
        assert part.ids == whole.ids[: len(part.ids)] and part.scored == whole.scored[: len(part.ids)]


def test_consecutive_answers_under_a_template_without_a_generation_prompt_are_both_learned(tmp_path):
    """Without generation blocks the chat is cut where each learned message starts (the render before it with the
    generation prompt) and ends: a template that writes no generation prompt starts the second of two answers
    exactly where the first ended, which is a prefix cut like any other, not a template to refuse."""
    from recurrent_depth.data.chat import conversation

    encoder, tok = _encoder(tmp_path, PLAIN_TEMPLATE)
    chat = conversation({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                      {"role": "assistant", "content": "b"}]}, "x:1")
    example = encoder.encode(chat, "x:1")
    assert tok.decode(example.ids) == "user: hi\nassistant: a\nassistant: b\n"
    learned = [i for i, s in zip(example.ids, example.scored, strict=True) if s]
    assert tok.decode(learned) == "assistant: a\nassistant: b\n"
    assert example.scored == sorted(example.scored)  # the context first, then only learned tokens


def test_generation_blocks_marking_only_a_weight_0_answer_are_refused_not_trained_on_nothing(tmp_path):
    """A block over an answer of weight 0 teaches nothing; when that is every block of the record, nothing would be
    learned, which is the one-line error (not an example with no scored token), even where the block starts exactly
    where the answer's text does."""
    from recurrent_depth.data.chat import conversation

    template = ("{% for m in messages %}{% if m.role == 'assistant' and loop.index0 == 1 %}"
                "{% generation %}A: {{ m.content }}\n{% endgeneration %}{% elif m.role == 'assistant' %}"
                "A: {{ m.content }}\n{% else %}U: {{ m.content }}\n{% endif %}{% endfor %}")
    encoder, _ = _encoder(tmp_path, template)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ValueError, match=r"x:1: .*mark no text"):
        encoder.encode(conversation({"messages": messages}, "x:1"), "x:1")
    messages[1]["weight"] = 1  # the same block over a learned answer: its text is learned
    example = encoder.encode(conversation({"messages": messages}, "x:1"), "x:1")
    learned = [i for i, s in zip(example.ids, example.scored, strict=True) if s]
    assert encoder.tokenizer.decode(learned) == "A: a\n"


def test_a_record_with_a_prompt_and_no_completion_is_told_which_keys_a_record_needs():
    """A prompt without its completion (or a null one) is no prompt/completion record: the one-line error names the
    keys a record needs and those it has, not a type mismatch between a prompt and a missing completion."""
    from recurrent_depth.data.chat import conversation

    for record in ({"prompt": "2+2?"}, {"prompt": "2+2?", "completion": None}, {"completion": "4"}):
        with pytest.raises(ValueError, match=r"^x:3: expected 'messages' \(a chat\) or 'prompt' and 'completion', "
                                             r"got keys \["):
            conversation(record, "x:3")


# ---------------------------------------------------------------------------------------- LR schedule
def test_set_lr_refuses_any_negative_rate():
    """`set_lr` takes a finite rate >= 0: -0.5 is refused as -1 is (not only rates below -1), 0 is allowed."""
    import torch

    from recurrent_depth.train.schedule import set_lr

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for bad in (-0.5, -1e-9):
        with pytest.raises(ValueError, match="lr must be"):
            set_lr(opt, bad)
    set_lr(opt, 0.0)
    assert opt.param_groups[0]["lr"] == 0.0


# ---------------------------------------------------------------------------------------- optimizer
def test_huginn_adam_applies_a_weight_decay_of_exactly_1():
    """Decoupled weight decay per the docstring: `p *= 1 - lr*wd` (AdamW's) or `1 - (lr/initial_lr)*wd` (fully
    decoupled), for any wd > 0, 1 included; a zero gradient leaves only the decay."""
    import torch

    from recurrent_depth.train.optim import HuginnAdam

    for fully, expected in ((False, 1 - 0.1 * 1.0), (True, 1 - (0.1 / 0.2) * 1.0)):
        p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
        opt = HuginnAdam([{"params": [p], "initial_lr": 0.2}], lr=0.1, weight_decay=1.0, fully_decoupled_wd=fully)
        p.grad = torch.zeros_like(p)
        opt.step()
        torch.testing.assert_close(p.detach(), torch.full((3,), expected, dtype=torch.float64))


# ---------------------------------------------------------------------------------------- RL objectives
def test_group_advantages_divide_by_the_std_plus_eps():
    """GRPO: A_i = (r_i - mean_j r_j) / (std_j r_j + eps), the sample std (trl's) of the group's (or the batch's)
    rewards; a large eps makes `+ eps` visible."""
    import torch

    from recurrent_depth.train.rl.losses import group_advantages

    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0, 1.0], dtype=torch.float64)
    eps = 0.5
    groups = rewards.view(2, 3)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    expected = ((groups - mean) / (std + eps)).view(-1)
    torch.testing.assert_close(group_advantages(rewards, 3, eps=eps), expected)
    batch = ((groups - mean) / (rewards.std() + eps)).view(-1)
    torch.testing.assert_close(group_advantages(rewards, 3, eps=eps, scale="batch"), batch)


def test_grpo_sequence_level_means_over_rows_with_a_scored_token_each_its_own_token_mean():
    """level="sequence": each rollout's token mean, then the mean over rollouts; with rows=None only the rows with a
    scored token count, and a row of one scored token is that token's loss (not halved)."""
    import torch

    from recurrent_depth.train.rl.losses import grpo_loss

    torch.manual_seed(0)
    logp, old = -torch.rand(3, 4, dtype=torch.float64), -torch.rand(3, 4, dtype=torch.float64)
    A = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    ratio = (logp - old).exp()
    per_token = -torch.minimum(ratio * A[:, None], ratio.clamp(0.8, 1.2) * A[:, None])
    expected = (per_token[0, :3].mean() + per_token[2, 1]) / 2  # row 1 has no scored token: left out
    loss, _ = grpo_loss(logp, old, A, mask, clip_eps=0.2, level="sequence")
    torch.testing.assert_close(loss, expected)
    mask[2] = False  # one row left: its own token mean
    loss, _ = grpo_loss(logp, old, A, mask, clip_eps=0.2, level="sequence")
    torch.testing.assert_close(loss, per_token[0, :3].mean())


def test_k2_loss_is_the_mean_over_the_given_rows():
    """K2: mean_i (A_i - tau log(pi/pi_old)(y_i))^2 over the valid rollouts (`rows`), not their sum."""
    import torch

    from recurrent_depth.train.rl.losses import k2_loss

    torch.manual_seed(1)
    logp, old = -torch.rand(4, 3, dtype=torch.float64), -torch.rand(4, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    A = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    rows = torch.tensor([True, True, False, True])
    err = (A - 0.7 * ((logp - old) * mask).sum(1)).square()
    torch.testing.assert_close(k2_loss(logp, old, A, mask, tau=0.7, rows=rows), err[rows].mean())


# ---------------------------------------------------------------------------------------- quantized codes
def test_codes_take_every_leading_axis_negative_or_not_and_refuse_the_vector_axis():
    """A leading axis of codes for a [..., D] tensor is any of -n..n-1 (n leading axes), as Python indexes: -n is
    the first; the vector axis (n, or -n-1 and beyond) is refused in one line."""
    import torch

    from recurrent_depth.quant.codes import Codes

    fields = {"idx": torch.arange(2 * 3 * 4, dtype=torch.uint8).view(2, 3, 4), "norm": torch.ones(2, 3, 1)}
    codes = Codes("test:1", 8, fields)
    assert codes.shape == (2, 3, 8)
    for axis, same in ((-2, 0), (-1, 1)):
        assert torch.equal(codes.narrow(axis, 1, 1).fields["idx"], codes.narrow(same, 1, 1).fields["idx"])
        joined = Codes.cat([codes, codes], axis)
        assert joined.shape == Codes.cat([codes, codes], same).shape and joined.shape[same] == 2 * codes.shape[same]
    for bad in (2, -3):
        with pytest.raises(ValueError, match=f"axis {bad} is not a leading axis"):
            codes.narrow(bad, 0, 1)
