"""What needs the whole pipeline at rest: the validation loss and the run's state for a checkpoint.

Both run after a drain (:meth:`~bubblefree.distributed.async_loop.AsyncLoop.drain`), with every rank calling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bubblefree.delay import merge_named_states
from bubblefree.distributed.rank import Rank
from bubblefree.models import token_loss
from bubblefree.train.build import validation_batches

__all__ = ["evaluate", "gather_state", "load_state"]


def _to_cpu(tree: Any) -> Any:
    """A copy of a state tree with every tensor on the CPU (a checkpoint must not name this rank's GPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


@torch.no_grad()
def evaluate(rank: Rank, split: str = "val") -> float | None:
    """Loss on the ``split`` windows (``build.validation_batches``) at the current weights on stage 0 of
    replica 0 (None elsewhere): replica 0 runs the evaluation batches through its pipeline and the last stage
    sends the mean back to stage 0."""
    mesh = rank.mesh
    if mesh.replica != 0:
        return None
    rank.module.eval()
    batches = validation_batches(rank.train, rank.data.val, rank.device, split)
    total = torch.zeros((), dtype=torch.float64, device=rank.device)
    for i, (x, y) in enumerate(batches):
        if not mesh.is_first:
            x = rank.p2p.recv_activation(rank.peer(mesh.stage - 1))
        with rank.tracer.span("E", step=rank.stage.updates_done, unit=i), rank.autocast():
            out = rank.module(x)
        if mesh.is_last:
            total += token_loss(out, y).double()
        else:
            rank.p2p.send_activation(out, rank.peer(mesh.stage + 1))
    rank.module.train()
    result = total / len(batches)
    if mesh.is_last and not mesh.is_first:
        rank.p2p.send(result, rank.peer(0))
    elif mesh.is_first and not mesh.is_last:
        result = rank.p2p.recv((), torch.float64, rank.peer(rank.P - 1))
    rank.p2p.flush()
    rank.tracer.flush()
    return float(result) if mesh.is_first else None


def gather_state(rank: Rank) -> dict[str, Any]:
    """The whole pipeline's state on global rank 0, in the layout-free form of ``train.checkpoint`` (the
    simulation's): ``{"layout": {...}, "model": the whole model's weights, "optimizer": the stages'
    ``DelayedOptimizer`` states keyed by parameter name and merged (inner optimizer, stash of weight versions,
    EF buffers, counters)}``, on the CPU. Every rank must call it; the others get an empty dict."""
    own = _to_cpu({"module": rank.module.state_dict(),
                   "optimizer": rank.stage.delayed.named_state_dict(rank.stage.names)})
    writer = rank.mesh.rank == 0
    gathered: list[Any] | None = [None] * rank.mesh.world_size if writer else None
    dist.gather_object(own, gathered, dst=0)
    if not writer:
        return {}
    stages = gathered[: rank.P]  # replicas hold identical copies
    return {"layout": {"runtime": "distributed", "stages": rank.P, "replicas": rank.mesh.replicas},
            "model": {name: t for stage in stages for name, t in stage["module"].items()},
            "optimizer": merge_named_states([stage["optimizer"] for stage in stages])}


def load_state(rank: Rank, state: dict[str, Any]) -> None:
    """Load this rank's stage from a layout-free state (written at any number of stages or replicas, or by the
    simulation): its weights and its parameters' optimizer state, by name. Every rank passes the whole state
    (each reads the checkpoint file itself); no communication."""
    weights = state["model"]
    rank.module.load_state_dict({name: weights[name] for name in rank.module.state_dict()})
    rank.stage.delayed.load_named_state_dict(state["optimizer"], rank.stage.names)
