"""Our LLaMA and Hugging Face's ``LlamaForCausalLM``: the one mapping between them, in both directions.

Out: :func:`to_hf_llama` (``bubblefree export``, and the reference model of the tests and benchmarks). In:
:func:`read_hf_folder` reads a local Hugging Face folder (``config.json``, ``model.safetensors`` or shards
with ``model.safetensors.index.json``, ``tokenizer.json``) and :func:`load_hf_model` builds a
:class:`~bubblefree.models.llama.Transformer` holding its weights (``model.init_from``, docs/huggingface.md).

Both sides store ``[out, in]`` matrices and rotate half of each head against the other half (models/layers.py),
so a tensor keeps its values and only its name changes (:data:`HF_NAMES`):

    embed.weight                      model.embed_tokens.weight
    layers.i.attn_norm.weight         model.layers.i.input_layernorm.weight
    layers.i.attn.w{q,k,v,o}.weight   model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers.i.mlp_norm.weight          model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.w{1,2,3}.weight      model.layers.i.mlp.{gate,down,up}_proj.weight
    norm.weight, lm_head.weight       model.norm.weight, lm_head.weight

A folder is read only where our model computes exactly what ``LlamaForCausalLM`` computes with its config: any
other ``model_type``, and every option our model lacks (biases, dropout, sliding windows, partial or scaled
RoPE, a head size other than ``hidden_size / num_attention_heads``, quantized weights) is refused in one line
naming the field (:data:`REFUSED`). Tied and untied embeddings are both ours (``tie_word_embeddings``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch

from bubblefree.errors import UserError
from bubblefree.models.llama import ModelArgs, Transformer

__all__ = ["HF_NAMES", "REFUSED", "HFFolder", "check_fingerprint", "fingerprint", "hf_name", "load_hf_model",
           "model_args_from_hf", "our_name", "read_hf_args", "read_hf_folder", "to_hf_llama"]

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
          **{f"attn.w{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkvo"},
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w2.weight": "mlp.down_proj.weight",
          "mlp.w3.weight": "mlp.up_proj.weight"}
HF_NAMES = {"top": _TOP, "block": _BLOCK}
"""Our tensor names -> ``LlamaForCausalLM``'s: whole-model names, and the names inside block ``i`` (``layers.i.``
on our side, ``model.layers.i.`` on theirs). The only table of names; both directions read it."""

_OURS_TOP = {theirs: ours for ours, theirs in _TOP.items()}
_OURS_BLOCK = {theirs: ours for ours, theirs in _BLOCK.items()}

SAFETENSORS, INDEX, CONFIG, TOKENIZER = ("model.safetensors", "model.safetensors.index.json", "config.json",
                                         "tokenizer.json")
"""The files of a Hugging Face model folder that are read."""

_IGNORED = ("rotary_emb.inv_freq",)
"""Tensors some older folders store that are a function of the config (the RoPE frequencies), not weights."""


def hf_name(ours: str) -> str:
    """``LlamaForCausalLM``'s name of our tensor ``ours`` (a KeyError for a name of no dense LLaMA)."""
    if ours in _TOP:
        return _TOP[ours]
    layers, index, rest = ours.split(".", 2)
    if layers != "layers" or not index.isdigit():
        raise KeyError(ours)
    return f"model.layers.{index}.{_BLOCK[rest]}"


def our_name(theirs: str) -> str | None:
    """Our name of ``LlamaForCausalLM``'s tensor ``theirs``, or None when our model has no such tensor."""
    if theirs in _OURS_TOP:
        return _OURS_TOP[theirs]
    parts = theirs.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _OURS_BLOCK:
        return f"layers.{parts[2]}.{_OURS_BLOCK[parts[3]]}"
    return None


def to_hf_llama(model: Transformer):  # -> transformers.LlamaForCausalLM
    """A Hugging Face ``LlamaForCausalLM`` (float32, SDPA attention) with this dense model's config and a copy
    of its weights; used as the independent reference in tests and benchmarks. Needs ``transformers``."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here: an optional extra, seconds to import

    args = model.args
    if args.n_experts:
        raise ValueError(f"Invalid model: an MoE model (n_experts={args.n_experts}) has no LlamaForCausalLM twin")
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.mlp_hidden,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=args.tie_embeddings,
        attn_implementation="sdpa",
    )
    hf = LlamaForCausalLM(config).float()
    missing, unexpected = hf.load_state_dict({hf_name(k): v for k, v in model.state_dict().items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


# ------------------------------------------------------------------------------------ config.json -> ModelArgs

REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_type": (lambda v: v == "llama", "bubblefree's model is LLaMA; other architectures are not read"),
    "architectures": (lambda v: v in (None, ["LlamaForCausalLM"]), "only LlamaForCausalLM folders are read"),
    "hidden_act": (lambda v: v in (None, "silu"), "bubblefree's SwiGLU gates with silu"),
    "attention_bias": (lambda v: not v, "bubblefree's attention has no biases"),
    "mlp_bias": (lambda v: not v, "bubblefree's MLP has no biases"),
    "attention_dropout": (lambda v: not v, "bubblefree's model has no dropout"),
    "sliding_window": (lambda v: v is None, "bubblefree's attention is full causal attention, no sliding window"),
    "use_sliding_window": (lambda v: not v, "bubblefree's attention is full causal attention, no sliding window"),
    "partial_rotary_factor": (lambda v: v in (None, 1, 1.0), "bubblefree rotates the whole head (RoPE)"),
    "quantization_config": (lambda v: v is None, "quantized weights are not read"),
}
"""Each config.json field whose value asks for something bubblefree's model does not compute: the test a value
must pass (a missing field is None, which is LlamaConfig's default but for ``model_type``) and why another is
refused. RoPE scaling and ``head_dim`` are checked in
:func:`model_args_from_hf` (they sit in nested tables or relate fields)."""

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _refusal(where: str, field: str, value: Any, why: str) -> UserError:
    return UserError(f"Invalid model.init_from: {where} has {field} = {json.dumps(value)} ({why})")


def _rope_theta(cfg: dict[str, Any], where: str) -> float:
    """RoPE's base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x), refusing any scaling."""
    for table in ("rope_parameters", "rope_scaling"):
        spec = cfg.get(table)
        if spec is None:
            continue
        kind = spec.get("rope_type", spec.get("type", "default")) if isinstance(spec, dict) else spec
        if kind != "default":
            raise _refusal(where, f"{table}.rope_type", kind, "bubblefree's RoPE is the default, unscaled one")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (theta > 0 and math.isfinite(theta)):
        raise _refusal(where, "rope_theta", theta, "must be a positive number")
    return float(theta)


def model_args_from_hf(cfg: dict[str, Any], *, where: str) -> ModelArgs:
    """The ``ModelArgs`` of a ``LlamaForCausalLM`` config (``config.json`` as a dict), or a one-line UserError
    naming the first field our model does not compute (:data:`REFUSED`); ``where`` names the file."""
    for field, (allowed, why) in REFUSED.items():
        if not allowed(cfg.get(field)):
            raise _refusal(where, field, cfg.get(field), why)
    for field in _REQUIRED:
        if field not in cfg:
            raise UserError(f"Invalid model.init_from: {where} has no {field}")
    sizes = {field: cfg[field] for field in (*_REQUIRED, "num_key_value_heads", "max_position_embeddings")
             if cfg.get(field) is not None}
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _refusal(where, field, value, "must be a positive integer")
    dim, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = sizes.get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise _refusal(where, "num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != dim:
        raise _refusal(where, "head_dim", head_dim, f"bubblefree's head size is hidden_size / num_attention_heads "
                                                    f"= {dim} / {heads}")
    eps = cfg.get("rms_norm_eps", 1e-6)  # LlamaConfig's default
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise _refusal(where, "rms_norm_eps", eps, "must be a positive number")
    try:
        return ModelArgs(vocab_size=sizes["vocab_size"], dim=dim, n_layers=sizes["num_hidden_layers"],
                         n_heads=heads, n_kv_heads=kv_heads,
                         mlp_hidden=sizes["intermediate_size"], rope_theta=_rope_theta(cfg, where),
                         norm_eps=float(eps), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                         max_seq_len=sizes.get("max_position_embeddings", 2048))
    except ValueError as e:  # ModelArgs' own checks: a width the heads do not split evenly, ...
        raise UserError(f"Invalid model.init_from: {where}: {e}") from None


# ---------------------------------------------------------------------------------------------- the folder

@dataclass(frozen=True)
class HFFolder:
    """A local Hugging Face LLaMA folder, read and checked (:func:`read_hf_folder`); weights not loaded yet."""

    path: Path
    """The folder, absolute (symbolic links followed)."""

    args: ModelArgs
    """The model's shapes and options, from ``config.json``."""

    tokenizer: tokenizers.Tokenizer
    """``tokenizer.json``, the folder's fast tokenizer."""

    weight_files: tuple[Path, ...]
    """``model.safetensors``, or the shards the index names, in name order."""


def read_hf_args(path: str | Path) -> ModelArgs:
    """The ``ModelArgs`` of the folder ``path``'s ``config.json`` (:func:`model_args_from_hf`), reading
    nothing else: what the memory plan and the length checks need."""
    folder = Path(path).expanduser()
    if not folder.exists():
        hub = str(path).startswith("hf:")  # data.source's hub form; a model is read from a folder only
        raise UserError(f"Invalid model.init_from: {path} does not exist" + (
            " (it is a local Hugging Face model folder, never fetched from the hub: download it where the hub "
            "answers, e.g. huggingface-cli download ORG/NAME --local-dir DIR, and give that DIR)" if hub else ""))
    if not folder.is_dir():
        raise UserError(f"Invalid model.init_from: {path} is not a folder (a Hugging Face model folder holds "
                        f"{CONFIG}, {SAFETENSORS} and {TOKENIZER})")
    cfg = _read_json(folder / CONFIG, f"{path}/{CONFIG}", "the model's config")
    if not isinstance(cfg, dict):
        raise UserError(f"Invalid model.init_from: {path}/{CONFIG} is not a JSON object")
    return model_args_from_hf(cfg, where=f"{path}/{CONFIG}")


def read_hf_folder(path: str | Path) -> HFFolder:
    """Read and check ``config.json``, the list of weight files and ``tokenizer.json`` of the folder ``path``;
    every problem is a one-line UserError naming the file and the field."""
    args = read_hf_args(path)
    folder = Path(path).expanduser()
    if (folder / INDEX).is_file():  # sharded: the index maps every tensor to its file
        index = _read_json(folder / INDEX, f"{path}/{INDEX}", "the weights' index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"Invalid model.init_from: {path}/{INDEX} has no weight_map of tensor -> file")
        names = sorted(set(weight_map.values()))
    elif (folder / SAFETENSORS).is_file():
        names = [SAFETENSORS]
    else:
        raise UserError(f"Invalid model.init_from: {path} holds neither {SAFETENSORS} nor {INDEX} (only "
                        f"safetensors weights are read)")
    files = tuple(folder / name for name in names)
    for file in files:
        if file.parent != folder or not file.is_file():
            raise UserError(f"Invalid model.init_from: {path}/{INDEX} names {file.name}, which is not in {path}")
    if not (folder / TOKENIZER).is_file():
        raise UserError(f"Invalid model.init_from: {path} has no {TOKENIZER} (the fast tokenizer; write it with "
                        f"AutoTokenizer.from_pretrained(...).save_pretrained(FOLDER))")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise UserError(f"Invalid model.init_from: {path}/{TOKENIZER} cannot be read ({e})") from None
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > args.vocab_size:
        raise UserError(f"Invalid model.init_from: {path}/{TOKENIZER} has {n_tokens} tokens, more than the "
                        f"vocab_size = {args.vocab_size} rows of the embedding in {CONFIG}")
    return HFFolder(path=folder.resolve(), args=args, tokenizer=tokenizer, weight_files=files)


def _read_json(file: Path, where: str, what: str) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"Invalid model.init_from: {where} does not exist ({what})") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"Invalid model.init_from: {where} is not readable JSON ({e})") from None


def fingerprint(folder: HFFolder) -> str:
    """sha256 of the model as read: the ``ModelArgs`` from ``config.json`` (as sorted JSON), then the bytes of
    every weight file in name order. What ``model.init_sha256`` records; ``tokenizer.json`` is not part of it
    (the tokens a run trains on are pinned with the data, docs/reliability.md)."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(folder.args), sort_keys=True).encode())
    for file in folder.weight_files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def check_fingerprint(folder: HFFolder, expected: str) -> str:
    """The folder's :func:`fingerprint`; a UserError when ``expected`` (a run's ``model.init_sha256``) is given
    and differs."""
    got = fingerprint(folder)
    if expected and got != expected:
        raise UserError(f"Invalid model.init_from: {folder.path} is not the model the run started from: its "
                        f"weights and config hash to sha256 {got[:12]}..., model.init_sha256 is {expected[:12]}... "
                        f"(restore that folder, or start a new run)")
    return got


def load_hf_model(folder: HFFolder, *, device: torch.device | str = "cpu") -> Transformer:
    """A float32 ``Transformer`` with ``folder.args`` holding the folder's weights (bfloat16 and float16 files
    are widened exactly). Every tensor the model needs must be there with its shape, and every tensor there
    must have a place in the model (:func:`our_name`): a bias or an expert is refused, not dropped. A tied
    model takes ``embed`` only and ignores a stored ``lm_head.weight``, as ``LlamaForCausalLM`` does."""
    try:
        from safetensors import SafetensorError, safe_open  # the hf extra, like transformers
    except ImportError:
        raise UserError("Invalid model.init_from: reading safetensors weights needs the safetensors package: "
                        "pip install 'bubblefree[hf]'") from None
    model = Transformer(folder.args, device="meta")
    model.to_empty(device=device)
    model.tie_weights()  # to_empty unties them
    params = model.state_dict(keep_vars=True)
    seen: set[str] = set()
    for file in folder.weight_files:
        where = f"{folder.path}/{file.name}"
        try:
            with safe_open(str(file), framework="pt") as f, torch.no_grad():
                for theirs in f.keys():  # a safe_open handle has keys(), it is not iterable
                    ours = our_name(theirs)
                    if theirs.endswith(_IGNORED) or (ours == "lm_head.weight" and folder.args.tie_embeddings):
                        continue
                    if ours is None:
                        raise UserError(f"Invalid model.init_from: {where} holds {theirs}, which bubblefree's "
                                        f"LLaMA has no place for")
                    tensor = f.get_tensor(theirs)
                    target = params[ours]
                    if not tensor.is_floating_point():
                        raise UserError(f"Invalid model.init_from: {where} stores {theirs} as {tensor.dtype} "
                                        f"(quantized weights are not read)")
                    if tensor.shape != target.shape:
                        raise UserError(f"Invalid model.init_from: {where} has {theirs} of shape "
                                        f"{list(tensor.shape)}, {CONFIG} makes it {list(target.shape)}")
                    target.copy_(tensor.to(torch.float32))
                    seen.add(ours)
        except (SafetensorError, OSError) as e:
            raise UserError(f"Invalid model.init_from: {where} is not a readable safetensors file ({e})") from None
    needed = [n for n in params if not (n == "lm_head.weight" and folder.args.tie_embeddings)]
    missing = [hf_name(n) for n in needed if n not in seen]
    if missing:
        raise UserError(f"Invalid model.init_from: {folder.path} has no {missing[0]} "
                        f"({len(missing)} tensor(s) of {CONFIG}'s model missing)")
    return model
