"""One pipeline stage of one replica: its module, its DelayedOptimizer and its in-flight weight versions.

The :class:`~bubblefree.delay.DelayedOptimizer` of the stage is the single owner of the update rule and of
the stash of old weights (docs/spec.md section 3): step ``t`` of stage ``s`` evaluates its gradient at
``x_{max(t-d_s, a)}`` (``a`` the start of the asynchronous phase). A pipeline runs the forwards of step
``t`` while the stage has applied only ``c <= t`` updates (``c = t-1`` for 2BW on all but the last stage,
``c = t-d_s`` for PipeDream), so the version is ``delayed.stale_tensors(ahead=t-c)``: the same tensor the
simulation swaps in with ``stale_params()`` when ``c = t``. The step's forwards run on leaf views of those
tensors (no copy: they keep ``x_{t-d}`` until the update of step ``t``, ``DelayedOptimizer.stale_until_used``;
with a plain torch optimizer, which steps the live weights in place, on a copy of those) through
``torch.func.functional_call``; gradients of all the step's microbatches accumulate on the views and move
to ``p.grad`` when the step's last backward at this stage completes, and only then the stage clips, steps
and drops the views. So the stage holds the weight versions of PipeDream-2BW's double buffering and no
more: the live weights and the stash (``d`` versions), whatever the number of steps in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from bubblefree.delay import DelayedOptimizer
from bubblefree.optim.schedule import clip_stage_grads, set_lr_scale

__all__ = ["StageRuntime"]


class StageRuntime:
    """The compute side of a stage: versioned forwards, backwards, and the stage-local update."""

    def __init__(self, module: nn.Module, delayed: DelayedOptimizer, *, n_stages: int, grad_clip: float,
                 dp_group: dist.ProcessGroup | None = None):
        self.module = module
        self.delayed = delayed
        self.n_stages = n_stages
        self.grad_clip = grad_clip
        self.dp_group = dp_group
        name_of = {id(p): n for n, p in module.named_parameters()}
        self.params: list[nn.Parameter] = [p for g in delayed.param_groups for p in g["params"]]
        if {id(p) for p in self.params} != set(name_of):
            raise ValueError("Invalid optimizer: it must hold exactly the stage module's parameters")
        self.names = [name_of[id(p)] for p in self.params]
        self._versions: dict[int, dict[str, Tensor]] = {}

    @property
    def updates_done(self) -> int:
        return self.delayed.step_count

    def enter(self, step: int) -> None:
        """Take the weight version of step ``step`` (before the first forward of its first microbatch)."""
        ahead = step - self.updates_done
        assert step not in self._versions and ahead >= 0, (step, self.updates_done)
        stale = self.delayed.stale_tensors(ahead)  # ValueError if the schedule ran too far ahead
        if not self.delayed.stale_until_used:  # the live weights will be stepped in place under this step
            stale = [t.clone() if t is p else t for t, p in zip(stale, self.params)]
        # detach(): a new leaf over the same storage (and version counter: autograd would refuse a backward
        # through weights written since the forward, so a broken aliasing rule cannot pass silently)
        self._versions[step] = {n: t.detach().requires_grad_(p.requires_grad)
                                for n, t, p in zip(self.names, stale, self.params)}

    def abandon(self, step: int) -> None:
        """Forget a step entered ahead of a drain; it is re-entered (same version) when the pipeline refills."""
        self._versions.pop(step, None)

    def entered(self) -> list[int]:
        return sorted(self._versions)

    def forward(self, step: int, x: Tensor) -> Tensor:
        return functional_call(self.module, self._versions[step], (x,))

    @torch.no_grad()
    def prepare_update(self, step: int, lr_scale: float, *, versioned: bool = True) -> float:
        """First half of ending step ``step`` here: gradients to ``p.grad``, all-reduce over replicas, clip, and
        the step's learning rate.

        With ``versioned`` the gradients are those accumulated on the step's version (the asynchronous
        loop); otherwise they are already in ``p.grad`` (the stock schedules run on the live weights).
        Returns the stage's gradient norm before clipping. Split from :meth:`update` so the step's statistics
        can go on towards stage 0 before this stage spends its time on the optimizer.
        """
        assert self.updates_done == step, (step, self.updates_done)
        if versioned:
            version = self._versions.pop(step)
            for n, p in zip(self.names, self.params):
                p.grad = version[n].grad
        if self.dp_group is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)  # each replica's loss is already scaled by 1/m
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        set_lr_scale(self.delayed.optimizer, lr_scale)
        return clip_stage_grads(self.params, self.grad_clip, n_stages=self.n_stages)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Second half: apply update ``step`` with the clipped gradients in ``p.grad``."""
        assert self.updates_done == step, (step, self.updates_done)
        self.delayed.step()
        self.delayed.zero_grad(set_to_none=True)
