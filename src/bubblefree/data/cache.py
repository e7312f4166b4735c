"""The on-disk cache: where it lives, content keys, atomic writes and token-stream memmaps.

Layout under the cache directory (``DataConfig.cache_dir``, else ``$BUBBLEFREE_CACHE``, else
``~/.cache/bubblefree``)::

    tokenizers/bpe-v<vocab>-<key16>.json    a trained BPE, wrapped with the key it was trained for
    tokens/<key16>-<split>.npy              one token stream (uint16 or uint32), loaded as a read-only memmap

Every file is content-keyed (sha256 of everything that determines it), so a file is never rewritten with
different contents; a file that fails its checks is reported, never deleted or overwritten.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
from pathlib import Path

import numpy as np

from bubblefree.errors import UserError, naming

__all__ = ["atomic_write", "content_key", "load_stream", "resolve_cache_dir", "save_stream", "stream_dtype"]


def resolve_cache_dir(cache_dir: str = "") -> Path:
    """``cache_dir`` if given, else ``$BUBBLEFREE_CACHE``, else ``~/.cache/bubblefree`` (created on demand)."""
    chosen = cache_dir or os.environ.get("BUBBLEFREE_CACHE", "") or str(Path.home() / ".cache" / "bubblefree")
    return Path(chosen).expanduser()


def content_key(**parts: object) -> str:
    """sha256 of a canonical JSON of ``parts``: the one way every cache key is made."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file.

    A temporary file in the same directory is written, fsynced and renamed over ``path``. If another process
    (another pipeline rank) created ``path`` meanwhile, its file is kept and ours dropped: keys are content
    hashes, so both hold the same bytes, and an existing file is never replaced.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # os.open with 0o666 honours the umask, as a plain open() would (mkstemp would force 0o600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with naming(tmp), os.fdopen(fd, "wb") as f:  # a failed write names no file: it is the temporary one
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            return
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:  # make the rename itself durable
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def stream_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and page cache), uint32 above 65535."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 - 1 else np.dtype(np.uint32)


def save_stream(path: Path, tokens: np.ndarray) -> None:
    """Store a token stream as ``.npy`` (its header records dtype and length) atomically."""
    buf = io.BytesIO()
    np.save(buf, tokens, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def load_stream(path: Path, dtype: np.dtype) -> np.ndarray:
    """Open a cached token stream as a read-only memmap, checking its header against ``dtype``."""
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"Damaged token cache {path}: {e}; delete the file to rebuild it") from e
    if tokens.dtype != dtype or tokens.ndim != 1:
        raise UserError(
            f"Damaged token cache {path}: holds {tokens.dtype}{list(tokens.shape)}, expected a 1-D {dtype} "
            "stream; delete the file to rebuild it"
        )
    return tokens
