"""Data: corpora (stdlib by default), byte-level BPE tokenizer, packing into resumable batches."""

from k3.data.batches import StridedBatches
from k3.data.corpus import Corpus, is_validation, load_corpus, stdlib_corpus
from k3.data.packing import PackedBatches, build_token_stream, eval_batches, pack_documents
from k3.data.tokenizer import EOS_TOKEN, Tokenizer, get_tokenizer, train_tokenizer

__all__ = ["Corpus", "load_corpus", "stdlib_corpus", "is_validation", "Tokenizer",
           "train_tokenizer", "get_tokenizer", "EOS_TOKEN", "pack_documents",
           "build_token_stream", "PackedBatches", "StridedBatches", "eval_batches"]
