"""Text sources and their train/validation split: the embedded corpus, local text, Hugging Face datasets.

Each source becomes a :class:`TextCorpus`, two lists of documents. The split rule per source:

* ``embedded``: by book, as ``corpus/manifest.json`` says: Persuasion is validation, the five other Austen
  novels and the King James Bible are training (so validation measures generalisation to an unseen book).
* a folder of ``.txt`` files: the last file in sorted order is validation, the others training.
* a single text file: the last 10 % of its characters, starting at a line boundary, is validation.
* ``hf:NAME[:split]`` / ``hf:/local/path[:split]``: a ``DatasetDict`` without ``:split`` trains on ``train``
  and validates on the first of ``validation``, ``val``, ``test``; a single split holds out its last 10 %
  of rows (at least one). Documents are the ``text`` column. A hub that does not answer within
  :data:`HUB_TIMEOUT_S` is not retried (``datasets`` would retry for 26 s): the dataset is read from the local
  cache, or refused in one line saying how to set the hub offline.

Pre-tokenized ``.bin`` shards are not text; :mod:`bubblefree.data.shards` reads them.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bubblefree.errors import UserError

__all__ = ["CORPUS_DIR", "TextCorpus", "load_embedded", "load_hf", "load_text_path"]

CORPUS_DIR = Path(__file__).parent / "corpus"
"""The vendored corpus: ``<name>.txt.xz`` files, ``manifest.json`` and the provenance ``README.md``."""

VAL_FRACTION = 0.1
"""Share of a single text file (or a single dataset split) held out for validation."""

HUB_TIMEOUT_S = 5.0
"""How long the one request that checks the Hugging Face hub waits for an answer before the hub counts as
unreachable (an answering hub takes well under a second; a blocked network never answers)."""


@dataclass(frozen=True)
class TextCorpus:
    """Documents of one source, already split; ``source`` says where they came from."""

    train: list[str]
    val: list[str]
    source: str

    def digest(self, split: str) -> str:
        """sha256 identifying one split's documents (and their order and boundaries): a cache key part."""
        h = hashlib.sha256()
        for doc in getattr(self, split):
            h.update(hashlib.sha256(doc.encode("utf-8")).digest())
        return h.hexdigest()


def load_embedded(corpus_dir: Path = CORPUS_DIR) -> TextCorpus:
    """Decompress the vendored texts, verify each against the manifest's sha256 and split them by book."""
    manifest_path = corpus_dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        entries = manifest["texts"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"Unreadable corpus manifest {manifest_path}: {e}") from e
    splits: dict[str, list[str]] = {"train": [], "val": []}
    for entry in entries:
        path = corpus_dir / entry["file"]
        try:
            raw = lzma.decompress(path.read_bytes())
        except (OSError, lzma.LZMAError) as e:
            raise UserError(f"Corrupt corpus file {path}: {e}; reinstall bubblefree") from e
        digest = hashlib.sha256(raw).hexdigest()
        if digest != entry["sha256"]:
            raise UserError(
                f"Corrupt corpus file {path}: sha256 {digest} does not match the manifest's {entry['sha256']}; "
                "reinstall bubblefree"
            )
        splits[entry["split"]].append(raw.decode("utf-8"))
    assert splits["train"] and splits["val"], "the manifest names both splits"
    return TextCorpus(train=splits["train"], val=splits["val"], source="embedded")


def load_text_path(path: Path) -> TextCorpus:
    """A folder of ``.txt`` files (last one, sorted, is validation) or one text file (last 10 % is)."""
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if len(files) < 2:
            raise UserError(
                f"Data folder {path} holds {len(files)} .txt file(s); it needs at least 2 "
                "(the last in sorted order is validation) or .bin token shards"
            )
        docs = [_read_text(p) for p in files]
        return TextCorpus(train=docs[:-1], val=docs[-1:], source=str(path))
    text = _read_text(path)
    cut = _split_point(text)
    if cut <= 0 or cut >= len(text):
        raise UserError(f"Data file {path} is too short to split into training and validation ({len(text)} chars)")
    return TextCorpus(train=[text[:cut]], val=[text[cut:]], source=str(path))


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"Data file {path} is not UTF-8 text: {e}") from e
    except OSError as e:
        raise UserError(f"Cannot read data file {path}: {e}") from e


def _split_point(text: str) -> int:
    """Start of the validation part: the first line after 90 % of the characters (exactly 90 % if none)."""
    at = int(len(text) * (1 - VAL_FRACTION))
    newline = text.find("\n", at)
    return newline + 1 if 0 <= newline < len(text) - 1 else at


def load_hf(spec: str) -> TextCorpus:
    """``hf:NAME[:split]``: a hub dataset via ``datasets.load_dataset``, or a ``save_to_disk`` folder."""
    assert spec.startswith("hf:")
    name, split = _parse_hf(spec[3:])
    try:  # imported here: datasets is an optional extra (and takes seconds to import)
        import datasets
    except ImportError as e:
        raise UserError(
            f"data.source {spec!r} needs the optional 'datasets' package: pip install 'bubblefree[hf]'"
        ) from e
    try:
        if Path(name).exists():
            ds = datasets.load_from_disk(name)
            if split is not None:
                if not isinstance(ds, datasets.DatasetDict):
                    raise UserError(f"Dataset {name} has a single split; drop ':{split}' from {spec!r}")
                if split not in ds:
                    raise UserError(f"Dataset {name} has no split {split!r}; it has {sorted(ds)}")
                ds = ds[split]
        else:
            ds = _load_from_hub(datasets, name, split, spec)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (network, missing files, bad names)
        raise UserError(f"Cannot load dataset {spec!r}: {type(e).__name__}: {e}") from e

    if isinstance(ds, datasets.DatasetDict):
        val_name = next((s for s in ("validation", "val", "test") if s in ds), None)
        if "train" in ds and val_name is not None:
            return TextCorpus(train=_texts(ds["train"], spec), val=_texts(ds[val_name], spec), source=spec)
        if "train" not in ds:
            raise UserError(f"Dataset {spec!r} has splits {sorted(ds)}; name one as hf:NAME:SPLIT")
        ds = ds["train"]
    docs = _texts(ds, spec)
    if len(docs) < 2:
        raise UserError(f"Dataset {spec!r} has {len(docs)} row(s); at least 2 are needed to hold out validation")
    n_val = max(1, int(len(docs) * VAL_FRACTION))
    return TextCorpus(train=docs[:-n_val], val=docs[-n_val:], source=spec)


def _hub_unreachable(endpoint: str) -> str | None:
    """None when the hub at ``endpoint`` answers one HTTP request within :data:`HUB_TIMEOUT_S` (any status: it
    is there), else why not. The proxies of the environment apply, as they do to the hub's own client."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:  # no route, no name, a timeout, a bad endpoint
        return str(getattr(e, "reason", None) or e)
    return None


def _load_from_hub(datasets: Any, name: str, split: str | None, spec: str) -> Any:
    """``datasets.load_dataset(name, split=split)``, after checking once that the hub answers; an unreachable
    hub (or ``HF_HUB_OFFLINE=1``) reads the local cache only, and a dataset not there is a UserError in one line
    saying so, with what to do."""
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE)
    why = None if offline else _hub_unreachable(constants.ENDPOINT)
    if not offline and why is None:
        return datasets.load_dataset(name, split=split)
    # Both libraries read their offline flag at each call: set it for this load alone, as HF_HUB_OFFLINE=1 would.
    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # not in the cache: datasets says so with a ConnectionError or a FileNotFoundError
        if why is not None:
            state = f"the Hugging Face hub ({constants.ENDPOINT}) is unreachable ({why})"
            todo = ("download it once where the hub answers, or save it there with datasets' save_to_disk and "
                    "give data.source = hf:FOLDER; set HF_HUB_OFFLINE=1 to read the cache without asking the hub")
        else:
            state = "the hub is set offline (HF_HUB_OFFLINE=1)"
            todo = "unset HF_HUB_OFFLINE where the hub answers to download it, or give data.source = hf:FOLDER"
        raise UserError(f"Cannot load dataset {spec!r}: {state}, and the local cache "
                        f"({datasets.config.HF_DATASETS_CACHE}) could not provide it ({type(e).__name__}: {e}); "
                        f"{todo}") from e
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _parse_hf(rest: str) -> tuple[str, str | None]:
    """``NAME[:split]``; a split never contains '/', which keeps ``org/name`` and paths intact."""
    name, sep, split = rest.rpartition(":")
    if sep and name and split and "/" not in split:
        return name, split
    if not rest:
        raise UserError("Invalid data.source 'hf:': expected hf:NAME[:split]")
    return rest, None


def _texts(ds: object, spec: str) -> list[str]:
    columns = list(ds.column_names)  # type: ignore[attr-defined]
    if "text" not in columns:
        raise UserError(f"Dataset {spec!r} has no 'text' column; its columns are {columns}")
    return [t for t in ds["text"] if t]  # type: ignore[index]
