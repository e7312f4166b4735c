"""bubblefree.data: corpus integrity, the split, tokenizers, the cache, every source, and batches.

The BPE is trained once per session into a session-scoped cache (a few seconds); nothing touches
~/.cache. References are independent of the code under test: the sha256 table in the vendored README, the
raw UTF-8 bytes of the texts (byte tokenizer), arithmetic streams (``np.arange``) whose windows reveal their
own offsets, and shards written here with numpy.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import bubblefree.data.tokenizer as tokenizer_mod
import bubblefree.data.tokens as tokens_mod
from bubblefree.config import DataConfig
from bubblefree.data import (
    CORPUS_DIR,
    ByteTokenizer,
    eval_batches,
    get_batch,
    load_embedded,
    load_tokens,
)
from bubblefree.data.cache import atomic_write, resolve_cache_dir, stream_dtype
from bubblefree.data.shards import MAGIC
from bubblefree.errors import UserError

VOCAB = DataConfig().vocab_size  # the BPE users get by default


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bubblefree_cache")


@pytest.fixture(scope="session")
def corpus():
    return load_embedded()


@pytest.fixture(scope="session")
def bpe(cache):
    return load_tokens(DataConfig(cache_dir=str(cache)))


# --- the embedded corpus -------------------------------------------------------------------------------


def test_manifest_matches_the_provenance_readme():
    readme = (CORPUS_DIR / "README.md").read_text()
    table = dict(re.findall(r"\| (?:austen/)?(\w+\.txt) \|.*\| ([0-9a-f]{64}) \|", readme))
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())["texts"]
    assert len(table) == len(manifest) == 7
    for entry in manifest:
        assert table[entry["file"].removesuffix(".xz")] == entry["sha256"]
        assert entry["provenance"]


def test_split_is_by_book(corpus):
    manifest = {e["file"]: e for e in json.loads((CORPUS_DIR / "manifest.json").read_text())["texts"]}
    (persuasion,) = corpus.val
    assert hashlib.sha256(persuasion.encode()).hexdigest() == manifest["persuasion.txt.xz"]["sha256"]
    assert len(corpus.train) == 6
    for line in ("Sir Walter Elliot, of Kellynch Hall", "Anne Elliot", "Captain Wentworth"):
        assert line in persuasion
        assert not any(line in doc for doc in corpus.train)


@pytest.mark.parametrize("damage", ["tampered", "not xz"])
def test_corrupt_corpus_file_is_named(tmp_path, damage):
    copy = tmp_path / "corpus"
    shutil.copytree(CORPUS_DIR, copy)
    (copy / "emma.txt.xz").write_bytes(lzma.compress(b"Emma, tampered") if damage == "tampered" else b"junk")
    with pytest.raises(UserError, match=r"emma\.txt\.xz"):
        load_embedded(copy)


# --- tokenizers ----------------------------------------------------------------------------------------


def test_bpe_streams_decode_to_the_exact_texts(bpe, corpus):
    assert bpe.vocab_size == VOCAB and bpe.train.dtype == np.uint16
    assert int(bpe.train.max()) < VOCAB
    assert bpe.tokenizer.decode(bpe.val.tolist()) == corpus.val[0]
    assert bpe.tokenizer.decode(bpe.train.tolist()) == "".join(corpus.train)
    # encode() of a document is its slice of the cached stream
    assert bpe.tokenizer.encode(corpus.val[0]) == bpe.val.tolist()
    # a BPE must compress English well beyond bytes (the corpora README measured ~4 bytes/token)
    assert len(corpus.val[0].encode()) / len(bpe.val) > 3.0


tricky = ["", " ", "\n\n\n", "a  b\t\tc\r\n", "naïve café — “quotes” 中文 🚀", "  leading", "trailing  \n"]


@pytest.mark.parametrize("text", tricky)
def test_round_trip_tricky(bpe, text):
    assert bpe.tokenizer.decode(bpe.tokenizer.encode(text)) == text
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(bpe, text):
    assert bpe.tokenizer.decode(bpe.tokenizer.encode(text)) == text
    assert ByteTokenizer().encode(text) == list(text.encode("utf-8"))


def test_bpe_training_is_deterministic(bpe, corpus, tmp_path):
    again, _ = tokenizer_mod.cached_bpe(corpus.train, docs_digest=corpus.digest("train"), vocab_size=VOCAB,
                                        cache_dir=tmp_path)
    assert again.tokenizer.to_str() == bpe.tokenizer.tokenizer.to_str()
    assert again.encode(corpus.val[0]) == bpe.val.tolist()


def test_cache_hit_does_not_retrain_or_reencode(bpe, cache, monkeypatch):
    files = sorted(p for p in cache.rglob("*") if p.is_file())
    assert {p.parent.name for p in files} == {"tokenizers", "tokens"}
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    def boom(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(tokenizer_mod, "train_bpe", boom)
    monkeypatch.setattr(tokens_mod, "encode_stream", boom)
    again = load_tokens(DataConfig(cache_dir=str(cache)))
    np.testing.assert_array_equal(again.train, bpe.train)
    assert isinstance(again.train, np.memmap)
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes
    assert not list(cache.rglob("*.tmp"))


def test_byte_tokenizer_stream_is_utf8(cache, corpus):
    data = load_tokens(DataConfig(cache_dir=str(cache), tokenizer="byte"))
    assert data.vocab_size == 256 and data.train.dtype == np.uint16
    np.testing.assert_array_equal(data.train, np.frombuffer("".join(corpus.train).encode(), np.uint8))
    np.testing.assert_array_equal(data.val, np.frombuffer(corpus.val[0].encode(), np.uint8))


def test_stream_dtype():
    assert stream_dtype(256) == np.uint16 and stream_dtype(65535) == np.uint16
    assert stream_dtype(65536) == np.uint32


# --- damaged caches, bad input -------------------------------------------------------------------------


def _tokenizer_file(cache):
    (path,) = (cache / "tokenizers").glob(f"bpe-v{VOCAB}-*.json")
    return path


@pytest.mark.parametrize("damage", ["not json", "wrong key", "wrong sha256", "tampered body"])
def test_damaged_tokenizer_cache_is_reported_not_replaced(bpe, cache, tmp_path, damage):
    good = _tokenizer_file(cache)
    bad = tmp_path / "tokenizers" / good.name
    bad.parent.mkdir()
    record = json.loads(good.read_text())
    if damage == "not json":
        text = good.read_text()[:1000]
    else:
        if damage == "wrong key":
            record["key"] = "0" * 64
        elif damage == "wrong sha256":
            record["sha256"] = "0" * 64
        else:
            record["tokenizer"] = record["tokenizer"].replace('"the"', '"teh"')
        text = json.dumps(record)
    bad.write_text(text)
    with pytest.raises(UserError, match=re.escape(str(bad)) + ".*delete the file"):
        load_tokens(DataConfig(cache_dir=str(tmp_path)))
    assert bad.read_text() == text


def test_damaged_token_cache_is_reported(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("hello world\n" * 200)
    cfg = DataConfig(source=str(src), tokenizer="byte", cache_dir=str(tmp_path / "c"))
    load_tokens(cfg)
    (stream,) = (tmp_path / "c" / "tokens").glob("*-train.npy")
    stream.write_bytes(stream.read_bytes()[:200])
    with pytest.raises(UserError, match=re.escape(str(stream))):
        load_tokens(cfg)


def test_atomic_write_never_replaces_an_existing_file(tmp_path):
    path = tmp_path / "f"
    atomic_write(path, b"first")
    atomic_write(path, b"second")
    assert path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any file the user writes


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("BUBBLEFREE_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"
    assert resolve_cache_dir("") == tmp_path / "env"
    monkeypatch.delenv("BUBBLEFREE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_cache_dir("") == tmp_path / ".cache" / "bubblefree"


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(UserError, match=re.escape(str(missing))):
        load_tokens(DataConfig(source=str(missing), cache_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "kwargs, name",
    [({"vocab_size": 256}, "vocab_size"), ({"vocab_size": 0}, "vocab_size"), ({"tokenizer": "gpt2"}, "tokenizer")],
)
def test_bad_data_config(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid {name}: "):
        load_tokens(DataConfig(cache_dir=str(tmp_path), **kwargs))


def _utf8(stream):
    """Independent decoding of a byte-tokenizer stream."""
    assert stream.max() < 256
    return stream.astype(np.uint8).tobytes().decode("utf-8")


# --- text sources --------------------------------------------------------------------------------------


def test_single_text_file_holds_out_last_tenth_at_a_line(tmp_path):
    text = "".join(f"line {i:03d} of the file é\n" for i in range(100))
    src = tmp_path / "book.txt"
    src.write_text(text, encoding="utf-8")
    data = load_tokens(DataConfig(source=str(src), tokenizer="byte", cache_dir=str(tmp_path / "c")))
    train, val = _utf8(data.train), _utf8(data.val)
    assert train + val == text
    assert val.startswith("line ") and train.endswith("\n")
    assert len(val) / len(text) == pytest.approx(0.1, abs=0.03)
    assert data.source == str(src)


def test_text_folder_validates_on_last_file_and_trains_small_bpe(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    texts = {"b.txt": "the cat sat on the mat\n" * 50, "a.txt": "a dog ran far away\n" * 50, "c.txt": "the end\n"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    (folder / "notes.md").write_text("ignored")
    data = load_tokens(DataConfig(source=str(folder), vocab_size=300, cache_dir=str(tmp_path / "c")))
    assert 256 < data.vocab_size <= 300
    assert data.tokenizer.decode(data.train.tolist()) == texts["a.txt"] + texts["b.txt"]
    assert data.tokenizer.decode(data.val.tolist()) == texts["c.txt"]
    assert len(data.train) < len(texts["a.txt"] + texts["b.txt"])  # merges were learned


def test_text_folder_needs_two_files(tmp_path):
    (tmp_path / "only.txt").write_text("x\n" * 100)
    with pytest.raises(UserError, match="at least 2"):
        load_tokens(DataConfig(source=str(tmp_path), tokenizer="byte", cache_dir=str(tmp_path / "c")))


# --- pre-tokenized shards ------------------------------------------------------------------------------


def _modded_shard(path, tokens, *, magic=MAGIC, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, 1, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


def test_modded_nanogpt_shards(tmp_path):
    rng = np.random.default_rng(0)
    parts = {name: rng.integers(0, 50257, size=n) for name, n in
             [("fineweb_train_000001.bin", 3000), ("fineweb_train_000002.bin", 2000), ("fineweb_val_000000.bin", 1500)]}
    for name, tokens in parts.items():
        _modded_shard(tmp_path / name, tokens)
    data = load_tokens(DataConfig(source=str(tmp_path), cache_dir=str(tmp_path / "c")))
    expected_train = np.concatenate([parts["fineweb_train_000001.bin"], parts["fineweb_train_000002.bin"]])
    np.testing.assert_array_equal(data.train, expected_train)
    np.testing.assert_array_equal(data.val, parts["fineweb_val_000000.bin"])
    assert data.vocab_size == max(t.max() for t in parts.values()) + 1
    with pytest.raises(UserError, match="without their tokenizer"):
        data.tokenizer.decode([1, 2])
    x, y = get_batch(data.train, seed=1, step=2, microbatch=0, batch_size=2, seq_len=64)
    assert x.dtype == torch.int64 and x.shape == (2, 64)


def test_nanogpt_raw_shards(tmp_path):
    train, val = np.arange(1000, dtype=np.uint16), np.arange(500, 700, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    data = load_tokens(DataConfig(source=str(tmp_path), cache_dir=str(tmp_path / "c")))
    assert isinstance(data.train, np.memmap)
    np.testing.assert_array_equal(data.train, train)
    np.testing.assert_array_equal(data.val, val)
    assert data.vocab_size == 1000


def test_single_shard_file_is_refused(tmp_path):
    _modded_shard(tmp_path / "x_train_0.bin", np.arange(100))
    with pytest.raises(UserError, match="folder"):
        load_tokens(DataConfig(source=str(tmp_path / "x_train_0.bin"), cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("damage", ["truncated", "bad magic", "short header", "odd raw size", "no val"])
def test_bad_shards_are_named(tmp_path, damage):
    _modded_shard(tmp_path / "x_val_0.bin", np.arange(100))
    bad = tmp_path / "x_train_0.bin"
    if damage == "truncated":
        _modded_shard(bad, np.arange(100), count=150)
    elif damage == "bad magic":
        _modded_shard(bad, np.arange(100), magic=20240521)
    elif damage == "short header":
        bad.write_bytes(b"\x00" * 100)
    elif damage == "odd raw size":
        bad = tmp_path / "train.bin"
        bad.write_bytes(b"\x01" * 101)
    else:
        (tmp_path / "x_val_0.bin").rename(bad)
    with pytest.raises(UserError, match=re.escape(str(bad) if damage != "no val" else str(tmp_path))):
        load_tokens(DataConfig(source=str(tmp_path), cache_dir=str(tmp_path / "c")))


# --- Hugging Face datasets -----------------------------------------------------------------------------


def test_hf_single_split_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    rows = [f"Document number {i}.\nIt has two lines.\n" for i in range(20)]
    datasets.Dataset.from_dict({"text": rows, "id": list(range(20))}).save_to_disk(tmp_path / "ds")
    data = load_tokens(DataConfig(source=f"hf:{tmp_path / 'ds'}", tokenizer="byte", cache_dir=str(tmp_path / "c")))
    assert _utf8(data.train) == "".join(rows[:18])
    assert _utf8(data.val) == "".join(rows[18:])
    assert data.source == f"hf:{tmp_path / 'ds'}"


def test_hf_dataset_dict_and_named_split(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    train, valid = ["alpha beta gamma\n"] * 10, ["delta epsilon\n"] * 3
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": train}),
        "validation": datasets.Dataset.from_dict({"text": valid}),
    }).save_to_disk(tmp_path / "dd")
    data = load_tokens(DataConfig(source=f"hf:{tmp_path / 'dd'}", tokenizer="byte", cache_dir=str(tmp_path / "c")))
    assert _utf8(data.train) == "".join(train) and _utf8(data.val) == "".join(valid)
    data = load_tokens(DataConfig(source=f"hf:{tmp_path / 'dd'}:validation", tokenizer="byte",
                                  cache_dir=str(tmp_path / "c")))
    assert _utf8(data.train) == "".join(valid[:2]) and _utf8(data.val) == valid[2]
    with pytest.raises(UserError, match="no split 'test'"):
        load_tokens(DataConfig(source=f"hf:{tmp_path / 'dd'}:test", tokenizer="byte", cache_dir=str(tmp_path)))


def test_hf_needs_text_column(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional 'datasets' extra is not installed")
    datasets.Dataset.from_dict({"content": ["a", "b"]}).save_to_disk(tmp_path / "ds")
    with pytest.raises(UserError, match="no 'text' column.*content"):
        load_tokens(DataConfig(source=f"hf:{tmp_path / 'ds'}", tokenizer="byte", cache_dir=str(tmp_path)))


def test_hf_without_datasets_installed(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(UserError, match=r"pip install 'bubblefree\[hf\]'"):
        load_tokens(DataConfig(source="hf:some/dataset", cache_dir=str(tmp_path)))


# --- batches -------------------------------------------------------------------------------------------

STREAM = np.arange(60000, dtype=np.uint16)  # a window's first token is its offset


def test_get_batch_windows_are_contiguous_and_shifted():
    x, y = get_batch(STREAM, seed=3, step=7, microbatch=1, batch_size=8, seq_len=32)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    offsets = x[:, :1]
    torch.testing.assert_close(x, offsets + torch.arange(32), rtol=0, atol=0)
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)


def test_get_batch_is_a_pure_function_of_seed_step_microbatch():
    keys = [(seed, step, mb) for seed in (0, 1) for step in (0, 1, 2) for mb in (0, 1)]
    kw = dict(batch_size=4, seq_len=16)
    forward = {k: get_batch(STREAM, seed=k[0], step=k[1], microbatch=k[2], **kw)[0] for k in keys}
    backward = {k: get_batch(STREAM, seed=k[0], step=k[1], microbatch=k[2], **kw)[0] for k in reversed(keys)}
    starts = {k: tuple(forward[k][:, 0].tolist()) for k in keys}
    for k in keys:
        torch.testing.assert_close(forward[k], backward[k], rtol=0, atol=0)
    assert len(set(starts.values())) == len(keys)  # every (seed, step, microbatch) draws different windows


def test_get_batch_covers_exactly_the_valid_offsets():
    seq_len = 5
    tokens = np.arange(seq_len + 3, dtype=np.uint16)  # valid offsets: 0, 1, 2
    seen = set()
    for step in range(50):
        x, y = get_batch(tokens, seed=0, step=step, microbatch=0, batch_size=4, seq_len=seq_len)
        seen |= set(x[:, 0].tolist())
        assert int(y.max()) <= len(tokens) - 1
    assert seen == {0, 1, 2}


def test_get_batch_bad_sizes():
    with pytest.raises(UserError, match="too short"):
        get_batch(STREAM[:10], seed=0, step=0, microbatch=0, batch_size=1, seq_len=10)
    for kwargs, name in [({"seq_len": 0}, "seq_len"), ({"batch_size": -1}, "batch_size"), ({"step": -1}, "step")]:
        args = dict(seed=0, step=0, microbatch=0, batch_size=2, seq_len=8) | kwargs
        with pytest.raises(ValueError, match=f"Invalid {name}: "):
            get_batch(STREAM, **args)


def test_eval_batches_are_fixed_and_evenly_spaced():
    batches = eval_batches(STREAM, n_batches=3, batch_size=4, seq_len=100)
    assert len(batches) == 3
    starts = torch.cat([x[:, 0] for x, _ in batches])
    last = len(STREAM) - 101
    torch.testing.assert_close(starts, torch.round(torch.linspace(0, last, 12, dtype=torch.float64)).long(),
                               rtol=0, atol=0)
    for x, y in batches:
        torch.testing.assert_close(y, x + 1, rtol=0, atol=0)
    assert int(batches[-1][1][-1, -1]) == len(STREAM) - 1  # the last window ends at the stream's end
    again = eval_batches(STREAM, n_batches=3, batch_size=4, seq_len=100)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="Invalid n_batches: 0"):
        eval_batches(STREAM, n_batches=0, batch_size=4, seq_len=100)
