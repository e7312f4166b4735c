"""Process groups of a data x pipeline mesh: which replica and stage each rank runs.

Ranks are laid out pipeline-major, ``rank = replica * P + stage``, so the ``P`` stages of one replica are
neighbours (on one node when a node holds a whole pipeline, which keeps the point-to-point traffic local)
and the ``R`` copies of one stage form the data-parallel group whose gradients are all-reduced.
The backend is ``nccl`` on CUDA (device ``cuda:LOCAL_RANK``) and ``gloo`` on the CPU.

:func:`agree` is the one collective a run makes at startup, after every rank has read its config, checkpoint
and data and built its model: it makes every rank fail, naming the cause, when one rank's setup failed (a data
file missing on that node's disk) or when the ranks were started with different configs. Without it the
healthy ranks would wait for the failed one until the process group's timeout, and different configs would
run a pipeline whose stages disagree on the model or the update rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bubblefree.errors import UserError

__all__ = ["Mesh", "agree", "backend_for", "init_backend", "init_mesh", "rank_coords"]


def rank_coords(rank: int, *, stages: int) -> tuple[int, int]:
    """``(replica, stage)`` of a global rank in the pipeline-major layout."""
    return divmod(rank, stages)


@dataclass(frozen=True)
class Mesh:
    """This process's place in the mesh and the groups it talks through."""

    rank: int
    world_size: int
    stages: int
    replicas: int
    replica: int
    stage: int
    device: torch.device
    pp_group: dist.ProcessGroup
    """The ``P`` ranks of this replica (the stock schedules need a group whose rank is the stage index)."""
    dp_group: dist.ProcessGroup | None
    """The ``R`` ranks holding this stage (None when ``R = 1``)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this replica: the peer of point-to-point messages."""
        return self.replica * self.stages + stage


def backend_for(device_type: str, *, local_rank: int, cuda_devices: int) -> tuple[str, torch.device]:
    """The process group backend and this rank's device: ``nccl`` on ``cuda:LOCAL_RANK`` for ``device_type =
    "cuda"``, else ``gloo`` on the CPU. NCCL needs a GPU of its own for every rank of a node (two ranks on one
    GPU fail inside NCCL, at the first collective), so a local rank without one is invalid input."""
    if device_type != "cuda":
        return "gloo", torch.device("cpu")
    if local_rank >= cuda_devices:
        raise UserError(f"Invalid launch: local rank {local_rank} has no GPU of its own ({cuda_devices} visible); "
                        f"NCCL needs one GPU per rank: start at most {cuda_devices} processes per node, or run the "
                        f"stages on the CPU (train.device=cpu, gloo) or in one process (pipeline.runtime=sim)")
    return "nccl", torch.device("cuda", local_rank)


def init_backend(*, timeout_s: float, device_type: str = "cpu") -> torch.device:
    """Join the default process group (once) and return this rank's device (:func:`backend_for`)."""
    cuda_devices = torch.cuda.device_count() if device_type == "cuda" else 0
    backend, device = backend_for(device_type, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                  cuda_devices=cuda_devices)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def _flat(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, table in config.items() for key, value in table.items()}


def agree(config: dict[str, dict[str, Any]], failure: BaseException | None) -> None:
    """All-gather every rank's config (``{section: {key: value}}``) and setup failure; raise on every rank
    that did not fail itself when any rank failed (naming the first) or when the configs differ (listing the
    keys). A rank whose own setup failed returns, to raise its own error. Invalid input (a failed rank's
    ``ValueError``, different configs) is a :class:`~bubblefree.errors.UserError`."""
    mine = (config, None if failure is None else (type(failure).__name__, str(failure),
                                                  isinstance(failure, ValueError)))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if failure is not None:
        return
    failed = [(rank, f) for rank, (_, f) in enumerate(gathered) if f is not None]
    if failed:
        rank, (kind, message, invalid_input) = failed[0]
        if invalid_input:
            raise UserError(f"rank {rank}: {message}")
        raise RuntimeError(f"rank {rank} failed while setting up: {kind}: {message}")
    reference = _flat(gathered[0][0])
    for rank, (other, _) in enumerate(gathered):
        differ = {k: (reference[k], v) for k, v in _flat(other).items() if reference.get(k) != v}
        if differ:
            listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(differ.items()))
            raise UserError(f"Invalid launch: the ranks were started with different configs; rank {rank} "
                            f"differs from rank 0 in {listed}")


def init_mesh(*, stages: int, timeout_s: float, device_type: str = "cpu") -> Mesh:
    """Join the process group described by the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_*``).

    ``device_type`` is ``cpu`` (gloo) or ``cuda`` (nccl, one GPU per local rank). ``timeout_s`` bounds every
    collective and point-to-point wait, so a vanished peer ends the run instead of hanging it.
    """
    device = init_backend(timeout_s=timeout_s, device_type=device_type)
    world, rank = dist.get_world_size(), dist.get_rank()
    if stages < 1 or world % stages:
        raise ValueError(f"Invalid pipeline.stages: {stages} (the {world} processes must be a multiple of it)")
    replicas = world // stages
    replica, stage = rank_coords(rank, stages=stages)
    # Every rank must create every group, in the same order.
    pp_groups = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(replicas)]
    dp_groups = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]
    return Mesh(rank=rank, world_size=world, stages=stages, replicas=replicas, replica=replica, stage=stage,
                device=device, pp_group=pp_groups[replica], dp_group=dp_groups[stage] if replicas > 1 else None)
