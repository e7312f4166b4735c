"""Point-to-point transfers between neighbouring stages, on public ``torch.distributed`` calls only.

Sends are asynchronous (``dist.isend``; the tensor is kept alive until the send completes); receives
block, with the process group's timeout. Activations carry a small header (rank and shape, dtype code)
before the payload so a stage needs no example shapes (training microbatches, whole-batch PipeDream
units and evaluation batches differ in shape); gradients have the shape of the activation they answer,
which the receiver knows. Any failure of a transfer is re-raised as :class:`PeerFailure` naming the peer,
so the error that reaches the launcher says which rank vanished.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_TIMEOUT_S", "P2P", "PeerFailure", "timeout_s"]

DEFAULT_TIMEOUT_S = 300.0

_MAX_DIMS = 6
_MAX_PENDING = 64
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def timeout_s() -> float:
    """Seconds a transfer (and the process group's collectives) may wait: ``$BUBBLEFREE_P2P_TIMEOUT``, else
    :data:`DEFAULT_TIMEOUT_S`."""
    return float(os.environ.get("BUBBLEFREE_P2P_TIMEOUT", DEFAULT_TIMEOUT_S))


class PeerFailure(RuntimeError):
    """A transfer with another rank failed or timed out: that rank most likely died or hung."""

    def __init__(self, peer: int, what: str, cause: BaseException):
        super().__init__(f"rank {peer} failed or vanished ({what}: {type(cause).__name__}: {cause})")
        self.peer = peer


class P2P:
    """Ordered tensor streams between this rank and its pipeline neighbours (global ranks)."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self._pending: list[tuple[dist.Work, Tensor, int]] = []

    def _wait(self, work: dist.Work, peer: int, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:  # gloo raises RuntimeError on a closed connection or a timeout
            raise PeerFailure(peer, what, e) from e

    def send(self, tensor: Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, peer), tensor, peer))
        if len(self._pending) > _MAX_PENDING:  # bound the memory of tensors held for sends in flight
            self._release()

    def _release(self) -> None:
        """Forget the sends that have completed, then wait for the oldest until at most ``_MAX_PENDING`` remain.

        Never a whole flush here: two neighbours that both waited for all their sends (activations one way,
        gradients the other) would each wait for a receive the other cannot post (seen with 2BW at P=4,
        M=16). Receivers take their messages in order, so the oldest send is the first to complete.
        """
        still = []
        for work, tensor, peer in self._pending:
            if work.is_completed():
                self._wait(work, peer, "send")  # returns at once; raises if the transfer failed
            else:
                still.append((work, tensor, peer))
        while len(still) > _MAX_PENDING:
            work, _, peer = still.pop(0)
            self._wait(work, peer, "send")
        self._pending = still

    def recv(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, peer: int) -> Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(buf, peer), peer, "recv")
        return buf

    @staticmethod
    def _header(tensor: Tensor) -> Tensor:
        assert tensor.dim() <= _MAX_DIMS
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header

    def send_activation(self, tensor: Tensor, peer: int) -> None:
        self.send(self._header(tensor).to(self.device), peer)
        self.send(tensor, peer)

    def post_activation(self, like: Tensor, peer: int) -> Callable[[], Tensor]:
        """Post the receives of ``peer``'s next activation, which must have ``like``'s shape and dtype, and
        return the function that waits for it (its header is checked against ``like``'s)."""
        header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        payload = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        works = (dist.irecv(header, peer), dist.irecv(payload, peer))  # matched in order, like the sends

        def wait() -> Tensor:
            for work in works:
                self._wait(work, peer, "recv")
            if not torch.equal(header.cpu(), self._header(like)):
                raise RuntimeError(f"rank {peer} sent an activation of header {header.tolist()}, "
                                   f"expected {self._header(like).tolist()}")
            return payload

        return wait

    def recv_activation(self, peer: int) -> Tensor:
        header = self.recv((_MAX_DIMS + 2,), torch.int64, peer).tolist()
        ndim, dtype = header[0], _DTYPES[header[1]]
        return self.recv(tuple(header[2:2 + ndim]), dtype, peer)

    def flush(self) -> None:
        """Wait until every send issued so far has completed."""
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            self._wait(work, peer, "send")
