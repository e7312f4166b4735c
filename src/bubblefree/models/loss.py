"""The training loss, defined once for the simulation and the distributed runtime.

A step's loss is the mean over its microbatches of :func:`token_loss`, the cross-entropy of the next-token
logits computed in float32. An MoE layer's load-balancing loss does not enter this sum: its gradient is
injected in the backward (:class:`~bubblefree.models.moe.AuxLossInjector`), and :func:`aux_loss_sum` only
reads the values of the last forward for logging.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from bubblefree.models.moe import MoE

__all__ = ["aux_loss_sum", "token_loss"]


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]``, in float32 whatever the autocast."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def aux_loss_sum(module: nn.Module) -> Tensor | float:
    """Sum over ``module``'s MoE layers of the balancing loss of their last forward, in float64.

    A tensor on the layers' device, so adding it up over microbatches waits for nothing; reading it (``float``)
    is the one device sync. ``0.0`` when ``module`` has no MoE layer or none has run.
    """
    total: Tensor | float = 0.0
    for layer in module.modules():
        if isinstance(layer, MoE) and layer.last_aux_loss is not None:
            total = total + layer.last_aux_loss.double()
    return total
