"""Named model sizes. Each preset is a function returning ``ModelArgs``; its name carries its total parameter
count (checked within 10 % by the tests at the preset's own vocabulary: the default BPE vocabulary of 8192 for
the CPU presets, 256 for the ``byte-*`` presets of the long-horizon scale).

- ``llama-1m`` / ``llama-5m`` / ``llama-20m``: CPU-sized dense models for the default corpus. Untied heads:
  at this size the embedding holds most of the parameters, and an untied head lets the model train well at
  a large learning rate.
- ``moe-20m``: a CPU-sized MoE (8 experts, top-2, one shared expert) to exercise routing under delay.
- ``smollm2-135m`` / ``smollm2-360m``: the paper's models, with SmolLM2's shapes (docs/spec.md section 8).
- ``llama-1b``: Llama 3.2 1B's shapes (16 layers, dim 2048, 32 query / 8 key-value heads, SwiGLU 8192, RoPE theta
  5e5, tied embeddings) at the SmolLM2 vocabulary like the other large presets: 1.07B parameters (1.24B at Llama
  3's 128256).
- ``moe-2b`` / ``moe-10b``: the paper's MoE scale (arXiv 2606.30634 does not publish its architecture; ours
  is fine-grained routed experts plus one shared expert in the DeepSeekMoE / OLMoE style, first block dense).
  moe-10b: 24 layers, dim 2048, 64 experts of width 1024, top-8 + 1 shared: 9.9B total, 1.8B active per token.
  moe-2b: 20 layers, dim 1024, 64 experts of width 512, top-8 + 1 shared: 2.1B total, 0.44B active.
  Active counts include the (untied) embedding and head.
  (``docs/models.md`` has the full table; ``Transformer.num_params(active=True)`` computes it.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bubblefree.config import ModelConfig
from bubblefree.errors import UserError
from bubblefree.models.hf import read_hf_args
from bubblefree.models.llama import ModelArgs, Transformer

__all__ = ["DEFAULT_VOCAB", "PRESETS", "build_model", "model_args"]

DEFAULT_VOCAB = 8192
"""The default BPE vocabulary (``DataConfig.vocab_size``) the CPU presets are sized at."""

SMOLLM2_VOCAB = 49152
"""SmolLM2's tokenizer size; the large presets are sized at it."""

BYTE_VOCAB = 256
"""The byte tokenizer's size; the ``byte-*`` presets of the long-horizon scale are sized at it."""


def llama_1m(vocab_size: int = DEFAULT_VOCAB) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, dim=48, n_layers=4, n_heads=2, n_kv_heads=2, mlp_hidden=192)


def llama_5m(vocab_size: int = DEFAULT_VOCAB) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, dim=192, n_layers=4, n_heads=3, n_kv_heads=3, mlp_hidden=512)


def llama_20m(vocab_size: int = DEFAULT_VOCAB) -> ModelArgs:
    return ModelArgs(vocab_size=vocab_size, dim=384, n_layers=8, n_heads=6, n_kv_heads=2, mlp_hidden=1024)


def moe_20m(vocab_size: int = DEFAULT_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=512,
        n_experts=8, top_k=2, n_shared_experts=1, expert_hidden=512,
    )  # fmt: skip


def smollm2_135m(vocab_size: int = SMOLLM2_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, mlp_hidden=1536,
        rope_theta=1e5, tie_embeddings=True,
    )  # fmt: skip


def smollm2_360m(vocab_size: int = SMOLLM2_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=960, n_layers=32, n_heads=15, n_kv_heads=5, mlp_hidden=2560,
        rope_theta=1e5, tie_embeddings=True,
    )  # fmt: skip


def llama_1b(vocab_size: int = SMOLLM2_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, mlp_hidden=8192,
        rope_theta=5e5, tie_embeddings=True,
    )  # fmt: skip


def moe_2b(vocab_size: int = SMOLLM2_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=1024, n_layers=20, n_heads=16, n_kv_heads=4, mlp_hidden=4096, rope_theta=1e5,
        n_experts=64, top_k=8, n_shared_experts=1, expert_hidden=512, n_dense_layers=1, max_seq_len=4096,
    )  # fmt: skip


def moe_10b(vocab_size: int = SMOLLM2_VOCAB) -> ModelArgs:
    return ModelArgs(
        vocab_size=vocab_size, dim=2048, n_layers=24, n_heads=16, n_kv_heads=4, mlp_hidden=8192, rope_theta=1e5,
        n_experts=64, top_k=8, n_shared_experts=1, expert_hidden=1024, n_dense_layers=1, max_seq_len=4096,
    )  # fmt: skip


def byte_0_5m(vocab_size: int = BYTE_VOCAB) -> ModelArgs:
    """The long-horizon scale's model (``experiments.scales``): 0.47M parameters at the byte vocabulary, 90 %
    of them outside the embedding and head. Every hidden dimension (96, 240) stays below the vocabulary, so
    SOAP can leave the vocabulary dimension alone and precondition the rest, as in the paper's regime."""
    return ModelArgs(vocab_size=vocab_size, dim=96, n_layers=4, n_heads=4, n_kv_heads=4, mlp_hidden=240)


def _deep(dim: int, heads: int, hidden: int, *, n_layers: int = 32,
          vocab: int = DEFAULT_VOCAB) -> Callable[..., ModelArgs]:
    def args(vocab_size: int = vocab) -> ModelArgs:
        return ModelArgs(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=heads,
                         mlp_hidden=hidden)
    return args


def _small_moe(dim: int, hidden: int, *, vocab: int = DEFAULT_VOCAB) -> Callable[..., ModelArgs]:
    def args(vocab_size: int = vocab) -> ModelArgs:
        return ModelArgs(vocab_size=vocab_size, dim=dim, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=hidden,
                         n_experts=8, top_k=2, n_shared_experts=1, expert_hidden=hidden)
    return args


PRESETS: dict[str, Callable[..., ModelArgs]] = {
    "llama-1m": llama_1m,
    "llama-5m": llama_5m,
    "llama-20m": llama_20m,
    "moe-20m": moe_20m,
    "smollm2-135m": smollm2_135m,
    "smollm2-360m": smollm2_360m,
    "llama-1b": llama_1b,
    "moe-2b": moe_2b,
    "moe-10b": moe_10b,
    # For the reproduction suites (bubblefree.experiments): 32-layer narrow models, since WPipe at depth 16 cuts
    # the model into 32 partitions, and moe-20m's routing at smoke / CPU-suite cost.
    "deep-1m": _deep(32, 2, 112),
    "deep-3m": _deep(64, 2, 240),
    "deep-30m": _deep(256, 4, 768),
    "moe-1m": _small_moe(40, 88),
    "moe-6m": _small_moe(128, 256),
    # The long-horizon scale: models small enough to train to 20-40 tokens per parameter on one CPU core.
    "byte-0.5m": byte_0_5m,
    "byte-deep-0.5m": _deep(48, 2, 128, n_layers=16, vocab=BYTE_VOCAB),
    "byte-moe-0.5m": _small_moe(64, 64, vocab=BYTE_VOCAB),
}
"""Preset name -> ``ModelArgs`` factory taking an optional ``vocab_size``."""


def model_args(cfg: ModelConfig, *, vocab_size: int | None = None) -> ModelArgs:
    """The shapes a run's ``[model]`` section names: the ``init_from`` folder's ``config.json``, else the
    preset's (``vocab_size`` replacing its own when given)."""
    if cfg.init_from:
        return read_hf_args(cfg.init_from)
    if cfg.preset not in PRESETS:
        raise UserError(f"Unknown model preset: {cfg.preset!r} (valid: {', '.join(PRESETS)})")
    return PRESETS[cfg.preset]() if vocab_size is None else PRESETS[cfg.preset](vocab_size)


def build_model(
    name: str, *, vocab_size: int | None = None, device: torch.device | str | None = None
) -> Transformer:
    """The preset ``name`` as a ``Transformer`` initialised from the global torch seed (``device="meta"``
    builds it without memory). ``vocab_size`` replaces the preset's (e.g. the tokenizer's)."""
    if name not in PRESETS:
        raise UserError(f"Unknown model preset: {name!r} (valid: {', '.join(PRESETS)})")
    args = PRESETS[name]() if vocab_size is None else PRESETS[name](vocab_size)
    return Transformer(args, device=device)
