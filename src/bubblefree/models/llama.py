"""LLaMA-style decoder (dense or mixture-of-experts), the model every experiment trains.

Pre-norm blocks ``x + attn(norm(x))``, ``x + mlp(norm(x))`` with RMSNorm, RoPE, grouped-query attention and
SwiGLU (Touvron et al. 2023, arXiv 2302.13971); the SmolLM2 models the paper trains (arXiv 2606.30634) are
this architecture. Submodule names are a contract (docs/architecture.md): ``embed``, ``layers``, ``norm``,
``lm_head``; optimizer routing and the pipeline split (``bubblefree.models.split``) rely on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bubblefree.models.layers import Attention, SwiGLU, rope_cos_sin
from bubblefree.models.loss import aux_loss_sum
from bubblefree.models.moe import MoE

__all__ = ["Block", "ModelArgs", "Transformer", "forward_span"]

INIT_STD = 0.02
"""Std of every weight matrix at init (GPT-2, Radford et al. 2019; Hugging Face ``initializer_range``)."""


@dataclass(kw_only=True)
class ModelArgs:
    vocab_size: int
    """Tokens in the vocabulary (rows of ``embed``)."""

    dim: int
    """Width of the residual stream."""

    n_layers: int
    """Transformer blocks."""

    n_heads: int
    """Query heads; the head size is ``dim // n_heads``."""

    n_kv_heads: int
    """Key/value heads (grouped-query attention); must divide ``n_heads``; equal means multi-head attention."""

    mlp_hidden: int
    """Hidden width of the dense SwiGLU feed-forward."""

    rope_theta: float = 10000.0
    """RoPE base period (SmolLM2 uses 1e5)."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    tie_embeddings: bool = False
    """Use ``embed.weight`` as the output projection too (``lm_head.weight is embed.weight``)."""

    max_seq_len: int = 2048
    """Longest sequence ``forward`` accepts (RoPE itself has no limit; this catches data bugs)."""

    n_experts: int = 0
    """Routed experts per MoE layer; 0 means a dense model."""

    top_k: int = 2
    """Routed experts each token uses (MoE only)."""

    n_shared_experts: int = 0
    """Always-on experts of width ``expert_hidden`` added to every MoE layer (DeepSeekMoE, arXiv 2401.06066)."""

    expert_hidden: int = 0
    """Hidden width of one expert's SwiGLU; 0 takes ``mlp_hidden``."""

    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer uses 0.01)."""

    n_dense_layers: int = 0
    """The first this many blocks keep a dense feed-forward in an MoE model (DeepSeek-V2 style: routing in the
    first layers is the least stable and cheapest to make dense)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"Invalid {name}: {getattr(self, name)} (must be >= 1)")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"Invalid dim: {self.dim} (must split into {self.n_heads} heads of even size)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Invalid n_kv_heads: {self.n_kv_heads} (must divide n_heads = {self.n_heads})")
        if self.n_experts < 0 or self.n_shared_experts < 0 or self.expert_hidden < 0 or self.n_dense_layers < 0:
            raise ValueError(
                f"Invalid MoE sizes: n_experts={self.n_experts}, n_shared_experts={self.n_shared_experts}, "
                f"expert_hidden={self.expert_hidden}, n_dense_layers={self.n_dense_layers} (must be >= 0)"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"Invalid top_k: {self.top_k} (must be in [1, n_experts = {self.n_experts}])")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.n_dense_layers


class Block(nn.Module):
    """Pre-norm transformer block; ``mlp`` is a dense ``SwiGLU`` or an ``MoE``."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.mlp_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp: nn.Module
        if args.is_moe_layer(layer):
            self.mlp = MoE(
                args.dim,
                n_experts=args.n_experts,
                top_k=args.top_k,
                hidden=args.expert_hidden or args.mlp_hidden,
                n_shared=args.n_shared_experts,
                aux_loss_coef=args.aux_loss_coef,
            )
        else:
            self.mlp = SwiGLU(args.dim, args.mlp_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def forward_span(
    x: Tensor,
    *,
    args: ModelArgs,
    embed: nn.Module | None,
    layers: list[nn.Module],
    norm: nn.Module | None,
    lm_head: nn.Module | None,
) -> Tensor:
    """Run a contiguous span of the model: the whole model, or one pipeline stage (``models.split``).

    ``x`` is tokens ``[B, T]`` when ``embed`` is given, else hidden states ``[B, T, dim]``; the result is
    float32 logits when ``lm_head`` is given, else hidden states. One function for both keeps the staged and
    whole-model computations bit-identical.
    """
    if x.shape[1] > args.max_seq_len:
        raise ValueError(f"Invalid sequence length: {x.shape[1]} (max_seq_len is {args.max_seq_len})")
    if embed is not None:
        x = embed(x)
    cos, sin = rope_cos_sin(x.shape[1], args.head_dim, theta=args.rope_theta, device=x.device)
    for layer in layers:
        x = layer(x, cos, sin)
    if lm_head is not None:
        assert norm is not None
        x = lm_head(norm(x)).float()
    return x


class Transformer(nn.Module):
    """Decoder-only language model: ``forward(tokens [B, T]) -> logits float32 [B, T, vocab]``.

    Init (``init_weights``), drawn from the global torch generator in ``named_parameters()`` order, so a seed
    fixes the model: every matrix (embedding, projections, router, experts, untied head) ~ N(0, 0.02²); the
    projections that write into the residual stream (``attn.wo``, ``mlp.w2``) ~ N(0, (0.02 / sqrt(2 L))²)
    so the residual variance does not grow with depth (GPT-2); RMSNorm gains = 1.

    The modules are built on the meta device and materialised once, so no default init is wasted and
    ``with torch.device("meta"): Transformer(args)`` costs nothing; later ``model.to_empty(device=d)`` then
    ``torch.manual_seed(s); model.init_weights()`` gives the same weights as ``torch.manual_seed(s);
    Transformer(args, device=d)``.
    """

    def __init__(self, args: ModelArgs, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.args = args
        target = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            self.embed = nn.Embedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
            self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the same Parameter as ``embed.weight`` when ``tie_embeddings`` (``to_empty``
        unties them, so ``init_weights`` calls this again)."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place as the class docstring states."""
        self.tie_weights()
        residual_std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        for name, p in self.named_parameters():
            leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if p.ndim == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=residual_std if leaf in ("wo", "w2") else INIT_STD)

    def forward(self, tokens: Tensor) -> Tensor:
        return forward_span(
            tokens, args=self.args, embed=self.embed, layers=list(self.layers), norm=self.norm, lm_head=self.lm_head
        )

    def compile_blocks(self) -> int:
        """``torch.compile`` each dense block in place (torchtitan's per-block recipe) and return how many.
        A pipeline stage built from the blocks afterwards runs them compiled. Compiling the whole model gained
        nothing here (the loss, embedding and head add no fusible work). MoE blocks stay eager: their expert
        routing gives every batch new shapes, and recompiling made a ``byte-moe-0.5m`` step 20x slower."""
        dense = [block for block in self.layers if not isinstance(block.mlp, MoE)]
        for block in dense:
            block.compile()
        return len(dense)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> float:
        """Sum over MoE layers of the last forward's load-balancing loss (0.0 for a dense model), for logging."""
        return float(aux_loss_sum(self))

    def set_aux_loss_scale(self, scale: float) -> None:
        """Scale the injected balancing gradient, e.g. ``1 / M`` when the M microbatch losses are each divided
        by M, so the balancing term is averaged exactly like the cross-entropy."""
        for m in self.moe_layers():
            m.aux_loss_scale = scale

    def num_params(self, *, active: bool = False, embedding: bool = True) -> int:
        """Parameters (a tied weight counted once); ``active=True`` counts only what one token uses, i.e.
        ``top_k`` routed experts per MoE layer instead of all of them; ``embedding=False`` leaves out the
        vocabulary matrices (the embedding and an untied head), the "non-embedding" count of scaling laws."""
        total = sum(p.numel() for p in self.parameters())
        if not embedding:
            total -= self.embed.weight.numel()
            if self.lm_head.weight is not self.embed.weight:
                total -= self.lm_head.weight.numel()
        if active:
            for m in self.moe_layers():
                total -= sum(p.numel() for p in m.parameters()) - m.active_params()
        return total

