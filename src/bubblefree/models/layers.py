"""The blocks every model here is built from: rotary embeddings, grouped-query attention, SwiGLU.

RMSNorm is PyTorch's own ``nn.RMSNorm`` (fused on CPU and CUDA), so it is not redefined here.
Conventions follow Hugging Face ``LlamaForCausalLM`` exactly (rotate-half RoPE, ``[out, in]`` weights), so
weights map one to one (``bubblefree.models.hf``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Attention", "SwiGLU", "apply_rope", "rope_cos_sin"]


def rope_cos_sin(seq_len: int, head_dim: int, *, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    r"""Rotary position embedding tables (Su et al. 2021, arXiv 2104.09864), float32 ``[seq_len, head_dim]``.

    .. math:: \omega_j = \theta^{-2j/d},\quad \phi_{t,j} = t\,\omega_j,\quad
              \cos = [\cos\phi, \cos\phi],\ \sin = [\sin\phi, \sin\phi]

    The two halves repeat (rather than interleave) because ``apply_rope`` rotates half against half, as
    Hugging Face Llama does. The tables are recomputed per forward instead of cached in buffers: it costs
    ``seq_len * head_dim`` sines, keeps no state on the meta device and needs nothing shared between
    pipeline stages.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    phase = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    phase = torch.cat((phase, phase), dim=-1)
    return phase.cos(), phase.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by position: ``x cos + rotate_half(x) sin``, in ``x``'s dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023, arXiv 2305.13245) with RoPE, no biases.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (``n_heads % n_kv_heads == 0``); the fused
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` does the rest without materialising
    repeated key/value heads (measured no slower than ``repeat_interleave`` on CPU, 8 x 256 tokens).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer 2020, arXiv 2002.05202): ``w2(silu(w1 x) * w3 x)``; w1 = gate, w3 = up, w2 = down."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
