"""The asynchronous steps of ``2bw`` and ``pipedream``: a persistent 1F1B loop across optimizer steps.

The loop keeps units in flight across optimizer steps: it fills once when an asynchronous phase starts (a
*segment* of units) and drains only when the run needs the weights whole (evaluation, checkpoint, the switch
to a synchronous phase, the end). The order is the schedule IR's (:func:`bubblefree.schedules.ir.
one_f_one_b_order`), the one the schedule simulator derives the delays from; the weight version each step
uses is the stage's :class:`~bubblefree.distributed.stage.StageRuntime`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from bubblefree.distributed.rank import Rank
from bubblefree.models import token_loss
from bubblefree.schedules.ir import one_f_one_b_order

__all__ = ["AsyncLoop", "forwards_done"]


def forwards_done(stage: int, n_stages: int, segment: tuple[int, int], last_backward: int) -> int:
    """Forwards ``one_f_one_b_order(stage, n_stages, range(*segment))`` has run when it finishes the backward of
    unit ``last_backward``: its ``P-1-s`` warm-up forwards plus one per backward so far, at most the segment's
    length (the closed form of that order; a test enumerates the order to check it)."""
    first, end = segment
    assert first <= last_backward < end, "unit outside the segment"
    return min(last_backward - first + n_stages - stage, end - first)


class AsyncLoop:
    """One rank's part of the persistent 1F1B loop (see module doc)."""

    def __init__(self, rank: Rank):
        self.rank = rank
        self._segment: tuple[int, int] | None = None  # units [first, end) of the running segment
        self._actions: Any = None  # iterator over the segment's order
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unit -> (input, output or loss)
        self._posted: tuple[int, Any] | None = None  # (unit, wait) of the activation receive posted ahead

    def _phase_end(self, step: int) -> int:
        """First step after ``step`` that is not asynchronous (where the segment must end)."""
        delayed, end = self.rank.stage.delayed, step
        while end < self.rank.train.steps and delayed.is_async(end):
            end += 1
        return end

    def step(self, step: int, lr_scale: float) -> None:
        """Run the loop until this stage has applied update ``step``."""
        U = self.rank.units_per_step
        if self._segment is None:
            self._segment = (step * U, self._phase_end(step) * U)
            self._actions = iter(one_f_one_b_order(self.rank.mesh.stage, self.rank.P, range(*self._segment)))
        assert self._segment[0] <= step * U < self._segment[1], "train_step called out of order"
        last_unit = (step + 1) * U - 1
        for action in self._actions:
            if action.kind == "F":
                self._forward(action.microbatch, last_unit)
            else:
                self._backward(action.microbatch, lr_scale)
                if action.microbatch == last_unit:
                    break
        if (step + 1) * U == self._segment[1]:
            self._close_segment()

    def _forward(self, unit: int, last_unit: int) -> None:
        rank, mesh, U = self.rank, self.rank.mesh, self.rank.units_per_step
        step, i = divmod(unit, U)
        if i == 0:
            rank.stage.enter(step)
        x, y = rank.unit_batch(step, i) if (mesh.is_first or mesh.is_last) else (None, None)
        if not mesh.is_first:
            x = self._receive_activation(unit, last_unit).requires_grad_()
        chunks = rank.local_m // U  # microbatches in the unit, computed one by one as the simulation does
        with rank.tracer.span("F", step=step, unit=unit), rank.autocast():
            outs = []
            for xc in x.chunk(chunks):
                outs.append(rank.stage.forward(step, xc))
                rank.add_aux(step)
            if mesh.is_last:
                loss = sum(token_loss(o, yc) for o, yc in zip(outs, y.chunk(chunks)))
                rank.relay.add_loss(step, loss.detach().double())
                out = loss / rank.m
            else:
                out = torch.cat(outs) if chunks > 1 else outs[0]
        if not mesh.is_last:
            rank.p2p.send_activation(out, rank.peer(mesh.stage + 1))
        self._saved[unit] = (x, out)

    def _receive_activation(self, unit: int, last_unit: int) -> torch.Tensor:
        """The previous stage's output for ``unit``, and the receive of the next unit's posted at once.

        A gloo (or NCCL) transfer moves when the receiver asks for it, and then needs the sender's transport
        thread, which on a busy CPU shares a core with the sender's compute, so an activation asked for late
        arrives late even when it was sent long before. Posted ahead, it moves as soon as it is sent. Only a
        unit the previous stage sends before this ``train_step`` can end is posted (it finishes the step's
        ``last_unit`` with ``forwards_done`` forwards run), so a drain never leaves a receive waiting.
        """
        rank = self.rank
        prev = rank.peer(rank.mesh.stage - 1)
        if self._posted is not None:
            posted, wait = self._posted
            assert posted == unit, (posted, unit)
            x, self._posted = wait(), None
        else:
            x = rank.p2p.recv_activation(prev)
        first = self._segment[0]
        if unit + 1 < first + forwards_done(rank.mesh.stage - 1, rank.P, self._segment, last_unit):
            self._posted = (unit + 1, rank.p2p.post_activation(x, prev))  # a segment's units share one shape
        return x

    def _backward(self, unit: int, lr_scale: float) -> None:
        rank, mesh, U = self.rank, self.rank.mesh, self.rank.units_per_step
        step = unit // U
        x, out = self._saved.pop(unit)
        grad = None if mesh.is_last else rank.p2p.recv(out.shape, out.dtype, rank.peer(mesh.stage + 1))
        with rank.tracer.span("B", step=step, unit=unit):
            torch.autograd.backward(out, grad)
        if not mesh.is_first:
            rank.p2p.send(x.grad, rank.peer(mesh.stage - 1))
        if (unit + 1) % U == 0:
            rank.finish(step, lr_scale)

    def drain(self) -> None:
        """End the running segment at the last completed step (nothing to do if none runs).

        Every rank has just finished the same step ``t``; forwards already run for later steps are
        dropped, and the activations the previous stage sent for them are received and discarded (their
        number follows from the two stages' orders), so the next segment refills from step ``t+1``.
        """
        if self._segment is None:
            return
        rank = self.rank
        first, end = self._segment
        done = rank.stage.updates_done * rank.units_per_step  # units whose steps have been applied
        if done < end and not rank.mesh.is_first:
            sent = forwards_done(rank.mesh.stage - 1, rank.P, self._segment, done - 1)
            taken = forwards_done(rank.mesh.stage, rank.P, self._segment, done - 1)
            if self._posted is not None:  # the first of them, already asked for
                self._posted[1]()
                self._posted, taken = None, taken + 1
            for _ in range(sent - taken):
                rank.p2p.recv_activation(rank.peer(rank.mesh.stage - 1))
        for step in rank.stage.entered():
            rank.stage.abandon(step)
        self._saved.clear()
        rank.relay.forget_from(rank.stage.updates_done)
        self._close_segment()

    def _close_segment(self) -> None:
        assert self._posted is None, "a receive was posted past the segment"
        self._segment, self._actions = None, None
        self.rank.p2p.flush()
        self.rank.tracer.flush()
