"""Tokenizers: a byte-level BPE trained on the training split (cached), and plain bytes.

The interface is three members: ``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and
``vocab_size``. Both tokenizers are lossless: ``decode(encode(s)) == s`` for every string.

The BPE is GPT-2's recipe (byte-level alphabet of 256 symbols, GPT-2 pre-tokenizer regex, merges learned by
``tokenizers.trainers.BpeTrainer``) trained on the training split only, so validation text is unseen.
Training is deterministic across runs and thread counts (a test trains twice), which is what makes a
content-keyed cache sound.

Text is always cut into lines (each keeping its ``\\n``) before BPE sees it, for training and encoding
alike: ``tokenizers`` encodes a multi-megabyte string in one call slowly and with gigabytes of memory, but
a batch of lines in about a second (``encode_batch`` runs in parallel). Pre-tokens never span a line end
then, so ``encode`` of a document equals its slice of the cached token stream.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from bubblefree.data.cache import atomic_write, content_key
from bubblefree.errors import UserError

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "OpaqueTokenizer",
    "Tokenizer",
    "cached_bpe",
    "encode_stream",
    "lines",
    "train_bpe",
]

MIN_BPE_VOCAB = 257
"""256 byte symbols plus at least one merge."""

ENCODE_BATCH_LINES = 16384
"""Lines per ``encode_batch`` call: large enough to keep every thread busy, small enough to bound memory."""

_RECIPE = 1
"""Bump when the training recipe below changes, so cached tokenizers from the old recipe are not reused."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of bubblefree needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def lines(text: str) -> list[str]:
    """``text`` cut after every ``\\n`` (kept), so that ``"".join(lines(text)) == text``."""
    parts = text.split("\n")
    out = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): needs no training and no files."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A window cut mid-character is not valid UTF-8; show U+FFFD rather than fail.
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` behind the three-member interface: our trained byte-level BPE, or a model
    folder's ``tokenizer.json`` (``model.init_from``). It adds no special tokens (a folder's post-processor may
    add a beginning-of-text token; the runs train on raw streams), and a folder's tokenizer is lossless only if
    its normalizer is (NFKC, lowercasing and the like are not)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(itertools.chain.from_iterable(self.encode_batch(lines(text))))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]


class OpaqueTokenizer:
    """Stands in for the unknown tokenizer of pre-tokenized shards: it knows the vocabulary size only."""

    def __init__(self, vocab_size: int, source: str) -> None:
        self.vocab_size = vocab_size
        self.source = source

    def encode(self, text: str) -> list[int]:
        raise UserError(f"The token shards in {self.source} come without their tokenizer; cannot encode text")

    def decode(self, ids: Sequence[int]) -> str:
        raise UserError(f"The token shards in {self.source} come without their tokenizer; cannot decode tokens")


def _check_bpe_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"Invalid vocab_size: {vocab_size} (a byte-level BPE needs at least {MIN_BPE_VOCAB})")


def train_bpe(docs: Iterable[str], *, vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE of (at most) ``vocab_size`` tokens on ``docs``; fewer if the text runs out of merges."""
    _check_bpe_vocab(vocab_size)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        special_tokens=[],
    )
    tok.train_from_iterator(_all_lines(docs), trainer=trainer)
    return BPETokenizer(tok)


def _all_lines(docs: Iterable[str]) -> Iterator[str]:
    for doc in docs:
        yield from lines(doc)


def cached_bpe(docs: Sequence[str], *, docs_digest: str, vocab_size: int, cache_dir: Path) -> tuple[BPETokenizer, str]:
    """The BPE for these training documents: read from the cache, or trained once and written there.

    The file is keyed by (training-text digest, vocab size, ``tokenizers`` version, recipe) and stores that
    key and the sha256 of the tokenizer JSON, both checked on load. Returns the tokenizer and its key.
    """
    _check_bpe_vocab(vocab_size)
    key = content_key(kind="bpe", text=docs_digest, vocab_size=vocab_size, tokenizers=tokenizers.__version__,
                      recipe=_RECIPE)
    path = cache_dir / "tokenizers" / f"bpe-v{vocab_size}-{key[:16]}.json"
    if not path.exists():
        bpe = train_bpe(docs, vocab_size=vocab_size)
        body = bpe.tokenizer.to_str()
        record = {"bubblefree_tokenizer": 1, "key": key, "kind": "bpe", "vocab_size": vocab_size,
                  "tokenizers_version": tokenizers.__version__, "sha256": _sha(body), "tokenizer": body}
        atomic_write(path, json.dumps(record).encode("utf-8"))
    return _read_cached(path, key), key


def _read_cached(path: Path, key: str) -> BPETokenizer:
    def damaged(why: str) -> UserError:
        return UserError(f"Damaged tokenizer cache {path}: {why}; delete the file and it will be retrained")

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        body = record["tokenizer"]
        stored_key, stored_sha = record["key"], record["sha256"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise damaged(f"not a bubblefree tokenizer file ({type(e).__name__}: {e})") from e
    if stored_key != key:
        raise damaged(f"it was trained for key {stored_key}, expected {key}")
    if not isinstance(body, str) or _sha(body) != stored_sha:
        raise damaged("the tokenizer does not match its recorded sha256")
    try:
        return BPETokenizer(tokenizers.Tokenizer.from_str(body))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise damaged(f"tokenizers cannot parse it ({e})") from e


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode_stream(tokenizer: ByteTokenizer | BPETokenizer, docs: Iterable[str], dtype: np.dtype) -> np.ndarray:
    """All documents' tokens, back to back (no separator token), as one array of ``dtype``."""
    chunks: list[np.ndarray] = []
    batch: list[str] = []
    for line in _all_lines(docs):
        batch.append(line)
        if len(batch) == ENCODE_BATCH_LINES:
            chunks.append(_flat(tokenizer.encode_batch(batch), dtype))
            batch = []
    if batch:
        chunks.append(_flat(tokenizer.encode_batch(batch), dtype))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype)


def _flat(ids: list[list[int]], dtype: np.dtype) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))
