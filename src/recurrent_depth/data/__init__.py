"""Data: corpora (with the embedded `stdlib` default), BPE tokenizers, packing, token shards.

Typical use::

    from recurrent_depth.data import load_corpus, train_tokenizer, save_tokenizer, prepare_dataset
    corpus = load_corpus("stdlib")
    tok = train_tokenizer(corpus, vocab_size=4096)
    save_tokenizer(tok, "runs/tok")
    data = prepare_dataset(corpus, tok, seq_len=512, out_dir="runs/data", val_fraction=0.05)
    train = data.dataset("train", seed=0)
    batch = train.next_batch(8)        # int64 [8, 513]; inputs batch[:, :-1], labels batch[:, 1:]
"""

from recurrent_depth.data.corpus import (
    STDLIB_EXCLUDED_DIRS,
    Corpus,
    CorpusInfo,
    DirectoryCorpus,
    Document,
    DocumentListCorpus,
    DocumentSplit,
    JsonlCorpus,
    ParquetCorpus,
    SavedDatasetCorpus,
    StdlibCorpus,
    corpus_sha256,
    load_corpus,
)
from recurrent_depth.data.packing import PackingStats, RowPacker, pack_documents, tokenize_documents
from recurrent_depth.data.prepare import PreparedDataset, prepare_dataset
from recurrent_depth.data.shards import ShardDataset, ShardWriter, TokenizedDocs, token_dtype
from recurrent_depth.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    chat_template,
    load_tokenizer,
    save_tokenizer,
    special_token_ids,
    special_token_layout,
    tokenizer_sha256,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "MIN_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "STDLIB_EXCLUDED_DIRS",
    "Corpus",
    "CorpusInfo",
    "DirectoryCorpus",
    "Document",
    "DocumentListCorpus",
    "DocumentSplit",
    "JsonlCorpus",
    "PackingStats",
    "ParquetCorpus",
    "PreparedDataset",
    "RowPacker",
    "ShardDataset",
    "SavedDatasetCorpus",
    "ShardWriter",
    "StdlibCorpus",
    "TokenizedDocs",
    "build_tokenizer",
    "chat_template",
    "corpus_sha256",
    "load_corpus",
    "load_tokenizer",
    "pack_documents",
    "prepare_dataset",
    "save_tokenizer",
    "special_token_ids",
    "special_token_layout",
    "token_dtype",
    "tokenize_documents",
    "tokenizer_sha256",
    "train_tokenizer",
]
