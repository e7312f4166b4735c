"""``bubblefree export RUN_OR_CHECKPOINT --format hf --out DIR``: a trained model for the Hugging Face stack.

The folder holds ``config.json`` (a ``LlamaConfig``), ``model.safetensors`` (float32), the tokenizer as a
fast tokenizer (``tokenizer.json`` and its configs) and ``bubblefree.toml`` (the run's config), so
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it
offline, and tools built on them (lm-evaluation-harness, vLLM) take it as a LLaMA model. The weights are
mapped by :func:`bubblefree.models.hf.to_hf_llama`, the same mapping the model tests compare logits through;
the same module reads such a folder back (``model.init_from``, docs/huggingface.md).

Tokenizers: the byte-level BPE is its own ``tokenizers`` JSON; the byte tokenizer (token ``i`` is byte ``i``)
becomes a ``tokenizers`` BPE over the 256 byte symbols with no merges, which encodes and decodes every text
exactly as ``ByteTokenizer`` does. Neither adds special tokens (the runs train on raw streams without them).
A run started from a Hugging Face folder exports with that folder's ``tokenizer.json`` (its special-token
settings in ``tokenizer_config.json`` are not carried over).

Dense models only: the MoE presets (routed experts plus an ungated shared expert, first block dense) match no
Hugging Face architecture exactly (Mixtral has no shared expert, Qwen2-MoE gates it, DeepSeek-V2/V3 use
latent attention), and an export that computes something else would be worse than none.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models as tokenizer_models, pre_tokenizers

from bubblefree.config import config_from_dict, dump_toml
from bubblefree.data import load_tokens
from bubblefree.data.tokenizer import BPETokenizer, ByteTokenizer, OpaqueTokenizer
from bubblefree.errors import UserError
from bubblefree.models import Transformer, build_model
from bubblefree.models.hf import check_fingerprint, read_hf_folder, to_hf_llama
from bubblefree.train.checkpoint import latest_checkpoint, load_checkpoint
from bubblefree.train.folders import hold

__all__ = ["byte_tokenizer", "export_hf", "load_run_model", "write_hf"]


def _checkpoint_path(source: str | Path) -> Path:
    path = Path(source)
    if path.suffix == ".pt":
        return path  # load_checkpoint names it if it is missing or damaged
    if not (path / "config.toml").is_file():
        raise UserError(f"Invalid export source: {source} is neither a run folder nor a checkpoint file")
    newest = latest_checkpoint(path)
    if newest is None:
        raise UserError(f"Invalid export source: {source} holds no checkpoint")
    return newest


def _export_instead(path: Path) -> str:
    return f"export the previous one: bubblefree export {shlex.quote(str(path))} --out DIR"


def load_run_model(source: str | Path) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, config)`` of a run's newest checkpoint, or of checkpoint file ``source``; only a
    checkpoint its manifest vouches for (weights of unknown provenance are not handed on as a model)."""
    path = _checkpoint_path(source)
    ckpt = load_checkpoint(path, advice_for=_export_instead, verified=True)
    config = config_from_dict(ckpt["config"], origin=f"checkpoint {path}")
    if config.model.init_from:  # a run started from a Hugging Face folder: its shapes and tokenizer are that one's
        folder = read_hf_folder(config.model.init_from)
        check_fingerprint(folder, config.model.init_sha256)
        model, tokenizer = Transformer(folder.args), BPETokenizer(folder.tokenizer)
    else:
        data = load_tokens(config.data)
        model = build_model(config.model.preset, vocab_size=config.model.vocab_size or data.vocab_size)
        tokenizer = data.tokenizer
    state = ckpt["executor"]
    if state.get("runtime") == "distributed":  # stage modules hold the whole model's names (models.split)
        weights = {k: v for stage in state["stages"] for k, v in stage["module"].items()}
    else:
        weights = state["model"]
    model.load_state_dict(weights)
    return model.eval(), tokenizer, config


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose token ``i`` is byte ``i``, like ``ByteTokenizer`` (module docstring)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # GPT-2's printable stand-ins for the 256 bytes
    to_char = {b: c for c, b in _byte_chars().items()}
    assert sorted(alphabet) == sorted(to_char.values())
    tok = Tokenizer(tokenizer_models.BPE(vocab={to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the character ``tokenizers``' ByteLevel shows for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def export_hf(source: str | Path, out: str | Path) -> Path:
    """Write ``source``'s model and tokenizer to the new folder ``out`` (module docstring); return ``out``."""
    _transformers()
    out = Path(out)
    if out.exists():
        raise UserError(f"Invalid --out: {out} already exists (export writes a new folder)")
    run = Path(source).parent.parent if Path(source).suffix == ".pt" else Path(source)
    if not run.is_dir():
        raise UserError(f"Invalid export source: {source} is neither a run folder nor a checkpoint file")
    with hold(run, what="export source", shared=True):  # no run writes its checkpoints while they are read
        model, tokenizer, config = load_run_model(source)
    if model.args.n_experts:
        raise UserError(f"Invalid export: {config.model.preset} is a mixture of experts with an ungated shared "
                        f"expert, which no Hugging Face architecture computes exactly (Mixtral has no shared "
                        f"expert, Qwen2-MoE gates it, DeepSeek-V2/V3 use latent attention); only dense models "
                        f"are exported")
    if isinstance(tokenizer, OpaqueTokenizer):
        raise UserError(f"Invalid export: {config.data.source} is pre-tokenized shards without their tokenizer")
    return write_hf(model, tokenizer, out, config=config)


def _transformers():
    try:  # imported here: transformers is an optional extra (and takes seconds to import)
        import transformers
    except ImportError:
        raise UserError("Invalid export: --format hf needs transformers: pip install 'bubblefree[hf]'") from None
    return transformers


def write_hf(model: Any, tokenizer: BPETokenizer | ByteTokenizer, out: str | Path, *, config: Any = None) -> Path:
    """Write the dense ``model`` and ``tokenizer`` as the Hugging Face folder ``out`` (which must not exist),
    with ``config`` (the run's) as ``bubblefree.toml`` when given; return ``out``. The writer of
    :func:`export_hf`, also what a folder read back with ``bubblefree.models.hf`` is written again with."""
    transformers = _transformers()
    backend = tokenizer.tokenizer if isinstance(tokenizer, BPETokenizer) else byte_tokenizer()
    hf = to_hf_llama(model)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")  # written whole, then renamed: no half-written folder under DIR
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        if config is not None:
            (tmp / "bubblefree.toml").write_text(dump_toml(config), encoding="utf-8")  # the run that made it
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
