r"""Mixture-of-experts feed-forward layer: top-k routed SwiGLU experts, optional shared experts, and a
load-balancing loss that reaches the router through the backward pass alone.

Routing (per token :math:`x`, router :math:`W_r \in \mathbb{R}^{E \times D}`):

.. math:: p = \mathrm{softmax}(W_r x),\quad \mathcal{K} = \mathrm{topk}(p, k),\quad
          y = \sum_{i \in \mathcal{K}} w_i\, \mathrm{SwiGLU}_i(x) + \sum_j \mathrm{Shared}_j(x)

with :math:`w_i = p_i / \sum_{j \in \mathcal{K}} p_j` when :math:`k > 1`. The softmax comes *before* the
top-k because the balancing loss needs the full distribution :math:`p` anyway; renormalising the kept
probabilities is then identical to Mixtral's softmax over the top-k logits. With :math:`k = 1` the weight
stays :math:`p_i` unnormalised (Switch Transformer), otherwise it would be the constant 1 and the router would
get no gradient from the language-model loss.

Load balancing (Switch, Fedus et al. 2021, arXiv 2101.03961; Megatron's normalisation for top-k):

.. math:: \mathcal{L}_{aux} = E \sum_{i=1}^{E} f_i P_i,\quad
          f_i = \frac{\#\{(t, j): \mathcal{K}_{t,j} = i\}}{N k},\quad P_i = \frac{1}{N}\sum_t p_{t,i}

over the ``N`` tokens of one forward; it equals 1 for perfectly uniform routing. :math:`f` is a count and
carries no gradient; :math:`P` does.

The training loss stays plain cross-entropy: ``AuxLossInjector`` returns the layer's output unchanged and, in
the backward pass, hands ``aux_loss_coef * scale`` to :math:`\mathcal{L}_{aux}` as its incoming gradient
(Megatron-LM's ``MoEAuxLossAutoScaler`` idea). The total gradient is that of
``CE + aux_loss_coef * scale * sum(aux over layers)``, and it works unchanged when the model is cut into
pipeline stages on different processes, since each stage's MoE layers inject their own term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bubblefree.models.layers import SwiGLU

__all__ = ["AuxLossInjector", "MoE", "load_balancing_loss"]


class AuxLossInjector(torch.autograd.Function):
    """Identity on ``hidden`` whose backward also sends gradient ``coef`` into the scalar ``aux_loss``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, aux_loss: Tensor, coef: float) -> Tensor:  # type: ignore[override]
        ctx.coef = coef
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return hidden

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        aux_grad = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad, None


def load_balancing_loss(probs: Tensor, experts: Tensor, n_experts: int) -> Tensor:
    """``E * sum_i f_i P_i`` from router probabilities ``[N, E]`` and chosen experts ``[N, k]`` (see module doc)."""
    counts = (torch.bincount(experts.flatten(), minlength=n_experts) if not experts.is_meta
              else experts.new_empty(n_experts))  # a memory plan's forward (below)
    fraction = counts.to(probs.dtype) / experts.numel()
    return n_experts * (fraction * probs.mean(dim=0)).sum()


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with stacked 3-D weights, plus ``n_shared`` always-on experts.

    Expert ``e`` computes ``w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``; ``w1, w3: [E, hidden, dim]`` and
    ``w2: [E, dim, hidden]`` are ``[out, in]`` matrices stacked along the first axis, which matrix optimizers
    (Muon) treat as a batch of matrices. Tokens are grouped by expert (one stable sort) so each expert runs one
    dense matmul over exactly its tokens. Every expert runs, possibly on zero tokens, so every weight always has
    a gradient (zeros when unused) and optimizers see the same parameter set each step.
    """

    def __init__(
        self, dim: int, *, n_experts: int, top_k: int, hidden: int, n_shared: int, aux_loss_coef: float
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss_coef = n_experts, top_k, aux_loss_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.shared = SwiGLU(dim, hidden * n_shared) if n_shared > 0 else None
        self.aux_loss_scale = 1.0
        """Extra factor on the injected gradient: set it to 1/M when each of M microbatch losses is divided by M,
        so the balancing term is averaged like the cross-entropy (``Transformer.set_aux_loss_scale``)."""
        self.last_aux_loss: Tensor | None = None
        """The balancing loss of the last forward, detached (for logging)."""
        self.last_experts: Tensor | None = None
        """The experts chosen in the last forward, ``[N, k]`` (for tests and routing statistics)."""

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router probabilities ``[N, E]`` (float32 or wider), chosen experts ``[N, k]``, their weights ``[N, k]``."""
        logits = self.router(x)  # the softmax and top-k run in at least float32, also under bf16 autocast
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, experts, weights

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, experts, weights = self.route(x)
        aux = load_balancing_loss(probs, experts, self.n_experts)
        self.last_aux_loss, self.last_experts = aux.detach(), experts.detach()

        # Group the N*k (token, expert) assignments by expert; a stable sort keeps the result deterministic.
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        if flat.is_meta:  # the memory plan (train.memory) runs forwards on the meta device, where the routing is
            # unknown; the bytes a forward keeps do not depend on it (the chunks always hold N*k rows): split evenly
            counts = [flat.numel() // self.n_experts + (e < flat.numel() % self.n_experts)
                      for e in range(self.n_experts)]
        else:
            counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        chunks = x[token].split(counts)
        outs = [
            (F.silu(xe @ self.w1[e].T) * (xe @ self.w3[e].T)) @ self.w2[e].T for e, xe in enumerate(chunks)
        ]
        y = torch.cat(outs) * weights.flatten()[order, None].to(outs[0].dtype)
        out = torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, token, y)
        if self.shared is not None:
            out = out + self.shared(x)
        coef = self.aux_loss_coef * self.aux_loss_scale
        if coef != 0 and torch.is_grad_enabled() and aux.requires_grad:
            out = AuxLossInjector.apply(out, aux, coef)
        return out.view(shape)

    def active_params(self) -> int:
        """Parameters one token uses: router, ``top_k`` of the routed experts, the shared experts."""
        per_expert = (self.w1.numel() + self.w2.numel() + self.w3.numel()) // self.n_experts
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared is not None else 0
        return self.router.weight.numel() + self.top_k * per_expert + shared

    def extra_repr(self) -> str:
        e, hidden, dim = self.w1.shape
        return f"dim={dim}, experts={e}, top_k={self.top_k}, hidden={hidden}, aux_loss_coef={self.aux_loss_coef}"

