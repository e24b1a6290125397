"""Packing documents into rows: the paper's drop rule, keep_all, framing, shuffling."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_depth.data.corpus import Document
from recurrent_depth.data.packing import PackingStats, RowPacker, pack_documents, tokenize_documents
from recurrent_depth.data.tokenizer import special_token_ids, train_tokenizer

BOS, EOS = 900, 901


def reference_pack(docs: list[list[int]], row_len: int, bos: int, eos: int | None, keep_all: bool) -> list[list[int]]:
    """The rule in plain Python: concatenate framed documents; a full row ends the current
    document unless keep_all; an unfinished last row is dropped."""
    rows: list[list[int]] = []
    current: list[int] = []
    for doc in docs:
        if not doc:
            continue
        framed = [bos, *doc] + ([eos] if eos is not None else [])
        for token in framed:
            current.append(token)
            if len(current) == row_len:
                rows.append(current)
                current = []
                if not keep_all:
                    break
    return rows


def test_drop_rule_by_hand() -> None:
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    rows = [r.tolist() for r in pack_documents(docs, seq_len=4, bos_id=BOS)]
    # Row 1 takes doc 1 and the head of doc 2, whose rest (7, 8, 9) is dropped; doc 3 alone
    # does not fill a row, so it is dropped as the unfinished last row.
    assert rows == [[BOS, 1, 2, 3, BOS]]
    rows = [r.tolist() for r in pack_documents(docs, seq_len=2, bos_id=BOS)]
    assert rows == [[BOS, 1, 2], [BOS, 4, 5], [BOS, 10, 11]]


def test_keep_all_by_hand() -> None:
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11]]
    stats = PackingStats()
    rows = [r.tolist() for r in pack_documents(docs, seq_len=4, bos_id=BOS, keep_all=True, stats=stats)]
    # The rest of doc 2 flows into row 2; [9, BOS, 10, 11] is one token short of a row.
    assert rows == [[BOS, 1, 2, 3, BOS], [4, 5, 6, 7, 8]]
    assert stats.tokens_in == 14 and stats.tokens_packed == 10 and stats.tokens_dropped == 4


def test_eos_framing_and_bos_at_every_document_start() -> None:
    docs = [[1, 2], [3], [4, 5, 6]]
    rows = [r.tolist() for r in pack_documents(docs, seq_len=5, bos_id=BOS, eos_id=EOS, keep_all=True)]
    assert rows == [[BOS, 1, 2, EOS, BOS, 3], [EOS, BOS, 4, 5, 6, EOS]]


def test_empty_documents_are_skipped() -> None:
    stats = PackingStats()
    rows = list(pack_documents([[], [1, 2, 3], []], seq_len=3, bos_id=BOS, stats=stats))
    assert [r.tolist() for r in rows] == [[BOS, 1, 2, 3]]
    assert (stats.documents, stats.empty_documents, stats.rows) == (1, 2, 1)


@pytest.mark.parametrize("keep_all", [False, True], ids=["drop-rest", "keep-all"])
@pytest.mark.parametrize("eos", [None, EOS], ids=["no-eos", "eos"])
@pytest.mark.parametrize("row_len", [2, 7, 33], ids=lambda n: f"row{n}")
def test_matches_reference_on_random_documents(keep_all: bool, eos: int | None, row_len: int) -> None:
    rng = np.random.default_rng(row_len)
    docs = [rng.integers(0, 800, size=int(n)).tolist() for n in rng.integers(0, 60, size=50)]
    stats = PackingStats()
    got = [r.tolist() for r in pack_documents(docs, row_len - 1, BOS, eos, keep_all=keep_all, stats=stats)]
    assert got == reference_pack(docs, row_len, BOS, eos, keep_all)
    assert stats.tokens_in == stats.tokens_packed + stats.tokens_dropped
    assert stats.tokens_packed == len(got) * row_len
    if keep_all:
        assert stats.tokens_dropped < row_len  # only the unfinished last row


def test_drop_rule_caps_each_document_contribution() -> None:
    long_docs = [list(range(100)) for _ in range(3)]
    rows = list(pack_documents(long_docs, seq_len=9, bos_id=BOS))
    assert len(rows) == 3 and all(r[0] == BOS and r.tolist() == [BOS, *range(9)] for r in rows)
    assert len(list(pack_documents(long_docs, seq_len=9, bos_id=BOS, keep_all=True))) == (3 * 101) // 10


def test_shuffle_is_seeded_permutation() -> None:
    docs = [[i] * 3 for i in range(1, 30)]
    first = [r.tolist() for r in pack_documents(docs, 3, BOS, shuffle_seed=5)]
    again = [r.tolist() for r in pack_documents(docs, 3, BOS, shuffle_seed=5)]
    other = [r.tolist() for r in pack_documents(docs, 3, BOS, shuffle_seed=6)]
    plain = [r.tolist() for r in pack_documents(docs, 3, BOS)]
    assert first == again and first != other and first != plain
    assert sorted(first) == sorted(plain)  # each row is one whole document: same rows, new order
    order = np.random.default_rng(5).permutation(len(docs))
    assert first == [[BOS, *docs[i]] for i in order]
    with pytest.raises(ValueError, match="needs docs with len"):
        list(pack_documents(iter(docs), 3, BOS, shuffle_seed=1))


def test_row_len_validation() -> None:
    with pytest.raises(ValueError, match="row_len"):
        RowPacker(1, BOS)
    with pytest.raises(ValueError, match="row_len"):
        list(pack_documents([[1]], seq_len=0, bos_id=BOS))


def test_tokenize_documents_encodes_literal_specials_as_text() -> None:
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(30)] + ["# marker <|end_text|> <|begin_text|>\n"]
    tok = train_tokenizer(texts, vocab_size=300)
    specials = set(special_token_ids(tok).values())
    docs = [Document(str(i), t) for i, t in enumerate(texts)]
    encoded = list(tokenize_documents(docs, tok, batch_size=4))
    assert len(encoded) == len(texts)
    for ids, text in zip(encoded, texts):
        assert not specials & set(ids.tolist())  # no forged document boundaries
        assert tok.decode(ids.tolist()) == text
    assert tok.encode(texts[-1], add_special_tokens=False).ids != encoded[-1].tolist()  # default would split


# ------------------------------------------------------------------ long documents in pieces (issue 19.13)
def _literal_ids(tok, text: str) -> list[int]:
    from tokenizers import Tokenizer

    literal = Tokenizer.from_str(tok.to_str())
    literal.encode_special_tokens = True
    return literal.encode(text, add_special_tokens=False).ids


def _code_tokenizer():
    import random

    from tests.train_support import synthetic_document

    rng = random.Random(0)
    docs = [synthetic_document(rng, i) for i in range(40)]
    return docs, train_tokenizer(docs, vocab_size=400)


def test_a_document_below_the_piece_size_is_one_piece_and_encoded_as_before() -> None:
    from recurrent_depth.data.tokenizer import PIECE_CHARS, text_pieces

    docs, tok = _code_tokenizer()
    assert list(text_pieces(docs[0], len(docs[0]))) == [docs[0]]
    assert list(text_pieces("x" * PIECE_CHARS)) == ["x" * PIECE_CHARS]
    encoded = list(tokenize_documents(docs, tok, batch_size=7))
    assert [ids.tolist() for ids in encoded] == [_literal_ids(tok, d) for d in docs]


@pytest.mark.parametrize("piece_chars", [64, 257, 1000])
def test_a_long_document_is_encoded_in_pieces_to_the_same_ids(piece_chars: int) -> None:
    from recurrent_depth.data.tokenizer import text_pieces

    docs, tok = _code_tokenizer()
    long_doc = "\n\n  \n".join(docs) + " trailing words   \r\n\tend"
    one_line = " ".join(d.replace("\n", " ") for d in docs[:10])  # no newline: cuts between words
    for text in (long_doc, one_line):
        pieces = list(text_pieces(text, piece_chars))
        assert len(pieces) > 3 and "".join(pieces) == text and max(map(len, pieces)) <= piece_chars
        [ids] = tokenize_documents([text], tok, piece_chars=piece_chars)
        assert ids.tolist() == _literal_ids(tok, text)
    # the batch around a long document keeps its order
    encoded = list(tokenize_documents([docs[0], long_doc, docs[1]], tok, batch_size=2, piece_chars=piece_chars))
    assert [e.tolist() for e in encoded] == [_literal_ids(tok, t) for t in (docs[0], long_doc, docs[1])]


def test_piece_cuts_never_change_ids_on_random_text() -> None:
    """Random text over the characters the split pattern treats specially (Unicode spaces, \\x1c, \\x85,
    CRLF, contractions, digit runs): whenever every cut is a rule cut (newline before non-space, or
    letter|space letter), the ids equal the whole text's. A window with neither gets a plain cut, which
    still round-trips."""
    import random

    from recurrent_depth.data.tokenizer import text_pieces

    _, tok = _code_tokenizer()
    alphabet = list(" \n\t\r\u00a0\u3000\x1c\x85") * 3 + list("abcXYZ019éü中,.:'()-_\"#") + [
        "'s", "'ll", "<|end_text|>", "  ", "\n\n", "\r\n", "123456", "word", "Zeta"]
    checked = 0
    for seed in range(600):
        rng = random.Random(seed)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(10, 300)))
        piece_chars = rng.randint(2, 40)
        pieces = list(text_pieces(text, piece_chars))
        [ids] = tokenize_documents([text], tok, piece_chars=piece_chars)
        assert tok.decode(ids.tolist()) == text
        cuts = np.cumsum([len(p) for p in pieces[:-1]]).tolist()
        if cuts and all((text[c - 1] == "\n" and not text[c].isspace())
                        or (text[c] == " " and text[c - 1].isalpha() and text[c + 1].isalpha()) for c in cuts):
            checked += 1
            assert ids.tolist() == _literal_ids(tok, text), (seed, pieces)
    assert checked >= 30


def test_the_bpe_trainer_sees_a_long_document_in_pieces_and_learns_the_same_tokenizer(monkeypatch) -> None:
    from recurrent_depth.data import tokenizer as tokenizer_module

    docs, _ = _code_tokenizer()
    corpus = docs[:5] + ["\n".join(docs[5:])]  # one long document
    whole = train_tokenizer(corpus, vocab_size=400).to_str()
    pieces = []
    original = tokenizer_module.text_pieces
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 300)
    monkeypatch.setattr(tokenizer_module, "text_pieces", lambda text, n: pieces.extend(original(text, n)) or
                        original(text, n))
    assert train_tokenizer(corpus, vocab_size=400).to_str() == whole
    assert len(pieces) > 100 and max(map(len, pieces)) <= 300
