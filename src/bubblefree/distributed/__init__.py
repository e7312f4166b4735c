"""The torch.distributed pipeline runtime: stock GPipe/1F1B, and a persistent 1F1B loop for 2BW and PipeDream.

See docs/runtime.md. :class:`DistributedExecutor` is one rank's executor; :func:`launch_local` runs a whole
pipeline on this machine; ``python -m bubblefree.distributed`` is the torchrun entry point.
"""

from bubblefree.distributed.executor import ASYNC_SCHEDULES, DistributedExecutor
from bubblefree.distributed.launch import PipelineFailure, launch_local, run_worker
from bubblefree.distributed.mesh import Mesh, init_mesh, rank_coords
from bubblefree.distributed.p2p import P2P, PeerFailure

__all__ = ["ASYNC_SCHEDULES", "P2P", "DistributedExecutor", "Mesh", "PeerFailure", "PipelineFailure",
           "init_mesh", "launch_local", "rank_coords", "run_worker"]
