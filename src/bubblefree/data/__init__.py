"""Data: the embedded public-domain corpus, tokenizers, the token-stream cache and deterministic batches.

``load_tokens(cfg)`` turns ``DataConfig.source`` into train/validation token streams; ``get_batch`` makes a
batch from ``(seed, step, microbatch)`` alone; ``eval_batches`` gives fixed validation windows. docs/data.md
describes the sources, the split, the cache layout and measured tokenizer figures.
"""

from bubblefree.data.sources import CORPUS_DIR, TextCorpus, load_embedded
from bubblefree.data.tokenizer import BPETokenizer, ByteTokenizer, OpaqueTokenizer, Tokenizer, train_bpe
from bubblefree.data.tokens import TokenData, eval_batches, get_batch, load_tokens

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CORPUS_DIR",
    "OpaqueTokenizer",
    "TextCorpus",
    "TokenData",
    "Tokenizer",
    "eval_batches",
    "get_batch",
    "load_embedded",
    "load_tokens",
    "train_bpe",
]
