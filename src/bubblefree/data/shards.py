"""Pre-tokenized ``.bin`` shards in the two common layouts, read as memmaps.

* modded-nanogpt / llm.c: a header of 256 little-endian int32 (``[0]`` magic 20240520, ``[1]`` version 1,
  ``[2]`` token count ``n``), then ``n`` uint16 tokens; the file is exactly ``1024 + 2 n`` bytes
  (modded-nanogpt ``data/cached_fineweb10B.py`` and ``_load_data_shard``; llm.c ``dev/data/data_common.py``).
* nanoGPT: headerless uint16 tokens in files named exactly ``train.bin`` and ``val.bin``
  (nanoGPT ``data/*/prepare.py``).

In a folder, every ``*.bin`` whose name contains ``val`` is validation and the rest training, each split
concatenated in sorted name order. The vocabulary size is the largest id seen plus one (50257 for the usual
GPT-2 shards, whose documents are separated by id 50256). The shards carry no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bubblefree.errors import UserError

__all__ = ["HEADER_BYTES", "MAGIC", "NANOGPT_NAMES", "VERSION", "load_shards", "read_shard"]

MAGIC = 20240520
VERSION = 1
HEADER_BYTES = 256 * 4
NANOGPT_NAMES = ("train.bin", "val.bin")


def read_shard(path: Path) -> np.ndarray:
    """One shard as a read-only uint16 memmap, after checking its header (if any) against its size."""
    size = path.stat().st_size
    if path.name in NANOGPT_NAMES:
        if size == 0 or size % 2:
            raise UserError(f"Bad nanoGPT shard {path}: {size} bytes is not a positive whole number of uint16 tokens")
        return np.memmap(path, dtype="<u2", mode="r")
    if size < HEADER_BYTES:
        raise UserError(f"Truncated shard {path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != MAGIC:
        raise UserError(
            f"Bad shard {path}: magic {header[0]}, expected {MAGIC} (modded-nanogpt/llm.c layout); "
            f"headerless nanoGPT shards must be named {' or '.join(NANOGPT_NAMES)}"
        )
    if header[1] != VERSION:
        raise UserError(f"Bad shard {path}: version {header[1]}, expected {VERSION} (uint16 tokens)")
    n = int(header[2])
    expected = HEADER_BYTES + 2 * n
    if n <= 0 or size != expected:
        raise UserError(
            f"Truncated or corrupt shard {path}: the header promises {n} tokens ({expected} bytes) "
            f"but the file has {size} bytes"
        )
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


def load_shards(folder: Path) -> tuple[np.ndarray, np.ndarray, int]:
    """(train tokens, val tokens, vocab size) from the ``*.bin`` shards in ``folder``.

    One shard per split stays a memmap; several are concatenated into memory.
    """
    files = sorted(p for p in folder.glob("*.bin") if p.is_file())
    val_files = [p for p in files if "val" in p.name]
    train_files = [p for p in files if "val" not in p.name]
    if not train_files or not val_files:
        raise UserError(
            f"Shard folder {folder} needs training and validation .bin files (validation ones have 'val' in "
            f"the name); found {[p.name for p in files]}"
        )
    train = _concat([read_shard(p) for p in train_files])
    val = _concat([read_shard(p) for p in val_files])
    vocab_size = int(max(train.max(), val.max())) + 1
    return train, val, vocab_size


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
