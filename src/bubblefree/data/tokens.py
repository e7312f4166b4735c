"""Token streams for training: ``load_tokens(cfg)``, and batches as a pure function of (seed, step, microbatch).

``get_batch`` draws ``batch_size`` random windows of ``seq_len + 1`` tokens from a stream, with a numpy
``Generator`` seeded by ``SeedSequence([seed, step, microbatch])``. Nothing else enters, so the
single-process simulation, every pipeline rank and a resumed run all see exactly the same batches
(docs/architecture.md, "Data"), whatever order they ask in. ``eval_batches`` takes fixed, evenly spaced
windows, the same for every seed, so validation losses of different runs are comparable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch

from bubblefree.config import CHOICES, DataConfig
from bubblefree.data.cache import content_key, load_stream, resolve_cache_dir, save_stream, stream_dtype
from bubblefree.data.shards import load_shards
from bubblefree.data.sources import TextCorpus, load_embedded, load_hf, load_text_path
from bubblefree.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    OpaqueTokenizer,
    Tokenizer,
    _check_bpe_vocab,
    cached_bpe,
    encode_stream,
)
from bubblefree.errors import UserError

__all__ = ["TokenData", "eval_batches", "fingerprint", "get_batch", "load_tokens", "resolved_source"]

TOKENIZERS = CHOICES["data.tokenizer"]


@dataclass
class TokenData:
    """Both splits of a source as 1-D token arrays (read-only memmaps when cached on disk)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer
    source: str


def load_tokens(cfg: DataConfig, *, tokenizer: tokenizers.Tokenizer | None = None) -> TokenData:
    """Tokenize ``cfg.source`` with ``cfg.tokenizer`` (training the BPE on first use), through the cache.

    ``.bin`` shard folders are used as they are (``cfg.tokenizer`` and ``cfg.vocab_size`` do not apply).
    ``tokenizer``, a model folder's own (``model.init_from``), encodes text sources instead of ``cfg.tokenizer``
    (then ``cfg.vocab_size`` does not apply either); its streams are cached under the sha256 of its JSON.
    """
    if cfg.tokenizer not in TOKENIZERS:
        raise ValueError(f"Invalid tokenizer: {cfg.tokenizer!r} (expected one of {', '.join(TOKENIZERS)})")
    source = cfg.source
    if source != "embedded" and not source.startswith("hf:"):
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(f"Data path not found: {path}")
        if not (path.is_dir() or path.is_file()):  # /dev/zero would be read without end
            raise UserError(f"Invalid data.source: {path} is not a file or folder (a device, pipe or socket)")
        if path.is_dir() and any(path.glob("*.bin")):
            train, val, vocab_size = load_shards(path)
            return TokenData(train, val, vocab_size, OpaqueTokenizer(vocab_size, str(path)), str(path))
        if path.suffix == ".bin":
            raise UserError(f"Data source {path} is a single .bin shard; point data.source at its folder")
    if cfg.tokenizer == "bpe" and tokenizer is None:
        _check_bpe_vocab(cfg.vocab_size)

    corpus = _load_corpus(source)
    cache = resolve_cache_dir(cfg.cache_dir)
    encoder: ByteTokenizer | BPETokenizer
    if tokenizer is not None:
        encoder = BPETokenizer(tokenizer)
        tok_key = content_key(kind="tokenizer.json", sha256=hashlib.sha256(tokenizer.to_str().encode()).hexdigest())
    elif cfg.tokenizer == "byte":
        encoder, tok_key = ByteTokenizer(), "byte"
    else:
        encoder, tok_key = cached_bpe(corpus.train, docs_digest=corpus.digest("train"),
                                      vocab_size=cfg.vocab_size, cache_dir=cache)
    dtype = stream_dtype(encoder.vocab_size)
    streams = {}
    for split in ("train", "val"):
        key = content_key(tokenizer=tok_key, text=corpus.digest(split), dtype=dtype.name)
        stream_path = cache / "tokens" / f"{key[:16]}-{split}.npy"
        if not stream_path.exists():
            save_stream(stream_path, encode_stream(encoder, getattr(corpus, split), dtype))
        streams[split] = load_stream(stream_path, dtype)
    return TokenData(streams["train"], streams["val"], encoder.vocab_size, encoder, corpus.source)


def resolved_source(source: str) -> str:
    """``data.source`` as a run records it: a path made absolute (symbolic links followed), so the same words
    in another working directory are seen to name other data; ``embedded`` and ``hf:NAME`` as they are."""
    if source == "embedded" or source.startswith("hf:"):
        return source
    return str(Path(source).expanduser().resolve())


def fingerprint(data: TokenData) -> dict[str, object]:
    """What a run trains on, cheaply: the token count of each split and the sha256 of both token streams.

    The hash reads the streams once (about 1 GiB per CPU second, docs/reliability.md: the memmapped arrays
    are hashed in place, no copy), which is less than tokenizing or the first steps cost. It identifies the
    tokens, not the files, so moved or re-tokenized-alike data matches while any changed token does not."""
    digest = hashlib.sha256()
    for split in (data.train, data.val):
        digest.update(np.ascontiguousarray(split).data)
    return {"train_tokens": int(len(data.train)), "val_tokens": int(len(data.val)), "sha256": digest.hexdigest()}


def _load_corpus(source: str) -> TextCorpus:
    if source == "embedded":
        return load_embedded()
    if source.startswith("hf:"):
        return load_hf(source)
    return load_text_path(Path(source).expanduser())


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "positive" if minimum > 0 else "non-negative"
        raise ValueError(f"Invalid {name}: {value} (must be a {kind} integer)")


def _check_sizes(tokens: np.ndarray, *, batch_size: int, seq_len: int) -> None:
    _check_int("batch_size", batch_size, 1)
    _check_int("seq_len", seq_len, 1)
    if tokens.ndim != 1:
        raise ValueError(f"Invalid tokens: shape {tuple(tokens.shape)} (expected a 1-D stream)")
    if len(tokens) < seq_len + 1:
        raise UserError(
            f"Token stream too short: {len(tokens)} tokens, a sequence of seq_len={seq_len} needs {seq_len + 1}"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int, device: str | torch.device):
    # One fancy-index gather reads only the needed pages of a memmap.
    idx = starts[:, None] + np.arange(seq_len + 1)
    w = torch.from_numpy(tokens[idx].astype(np.int64))
    x, y = w[:, :-1], w[:, 1:]
    return x.to(device), y.to(device)


def get_batch(
    tokens: np.ndarray,
    *,
    seed: int,
    step: int,
    microbatch: int,
    batch_size: int,
    seq_len: int,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``, int64 ``[batch_size, seq_len]``, with ``y[:, i] = x[:, i + 1]`` in the stream (next token).

    Window starts are uniform on ``[0, len(tokens) - seq_len - 1]``, drawn from
    ``default_rng(SeedSequence([seed, step, microbatch]))``: a pure function of its arguments.
    """
    _check_sizes(tokens, batch_size=batch_size, seq_len=seq_len)
    for name, value in (("seed", seed), ("step", step), ("microbatch", microbatch)):
        _check_int(name, value, 0)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(step), int(microbatch)]))
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return _windows(tokens, starts, seq_len, device)


def eval_batches(
    tokens: np.ndarray, *, n_batches: int, batch_size: int, seq_len: int, device: str | torch.device = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` batches of windows evenly spaced over the whole stream, first at 0, last at the end.

    Deterministic and seed-independent; windows overlap when the stream is shorter than they are together.
    """
    _check_sizes(tokens, batch_size=batch_size, seq_len=seq_len)
    _check_int("n_batches", n_batches, 1)
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_batches * batch_size).round().astype(np.int64)
    return [_windows(tokens, s, seq_len, device) for s in starts.reshape(n_batches, batch_size)]
