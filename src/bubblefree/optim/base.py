"""The optimizer contract: compute the whole update ``u_t`` first, apply it separately.

Delayed-gradient training and Error Feedback (docs/spec.md) need each optimizer's update

    (u_t, s_{t+1}) = O(g, s_t, x_t),      x_{t+1} = x_t - u_t

as a tensor *before* it is applied, with ``u_t`` holding everything the step subtracts (learning rate,
shape scaling, decoupled weight decay). No library exposes that, so every optimizer of the project is an
:class:`UpdateOptimizer`: a standard ``torch.optim.Optimizer`` (param_groups, LR schedulers,
``state_dict`` with the standard key names) whose subclasses implement one method,
:meth:`UpdateOptimizer._group_updates`, that returns the updates of one param group and advances its state
without touching the parameters or their ``.grad``. ``step()`` is then just
``apply_updates(params, compute_updates())`` followed by :meth:`UpdateOptimizer.recycle`.

**Recycled update buffers.** On CPU, the first write to freshly allocated memory costs a page fault per
4 KiB page; for an elementwise optimizer that can cost more than the arithmetic of the whole step. So
updates that nobody reads any more can be handed back with :meth:`UpdateOptimizer.recycle` (``step()`` and
the delay wrapper do), and the next :meth:`UpdateOptimizer.compute_updates` writes into them
(:meth:`UpdateOptimizer._out_like`) instead of allocating. A recycled tensor is no longer visible to anyone, so the
contract "fresh update tensors" still holds. Cost: the pool holds at most one update per parameter between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["UpdateOptimizer", "apply_updates", "check_betas", "check_nonneg", "decayed_weights", "group_by_step",
           "use_foreach"]


def check_nonneg(name: str, value: float) -> None:
    """Raise the ValueError the project uses for a hyperparameter that must be >= 0."""
    if isinstance(value, Tensor):
        value = float(value)
    if not value >= 0.0:  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def check_betas(name: str, betas: Sequence[float]) -> None:
    """Raise a ValueError unless every coefficient lies in [0, 1)."""
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid {name}[{i}]: {beta} (must be in [0, 1))")


def use_foreach(flag: bool | None, tensors: Sequence[Tensor]) -> bool:
    """Resolve an optimizer's ``foreach`` option: True/False as given; None picks foreach except on CPU.

    On CPU a foreach op is a loop over the tensors anyway, and running all of one tensor's operations before
    moving to the next keeps it in cache (a 1-4 MB matrix fits the L3), where foreach streams the whole
    list through memory once per operation.
    """
    if flag is not None:
        return bool(flag)
    return not all(t.device.type == "cpu" for t in tensors)


def group_by_step(state: dict, params: Sequence[Tensor]) -> dict[float, list[int]]:
    """Indices of ``params`` keyed by their ``state[p]["step"]``: the params of a group step together, but one
    that missed steps (its grad was None) keeps its own count, and bias corrections depend on it."""
    by_step: dict[float, list[int]] = {}
    for i, p in enumerate(params):
        by_step.setdefault(state[p]["step"].item(), []).append(i)
    return by_step


def decayed_weights(params: Sequence[Tensor], out: Sequence[Tensor], *, lr: float,
                    weight_decay: float) -> Sequence[Tensor]:
    """Start each update at its decoupled weight decay: ``out <- lr wd x`` (zeros where ``wd = 0``), the buffers
    into which a rule then adds its step (AdamW's fused path, Adan, NAdamW). Written out of place into ``out``, so
    the parameters are only read and the step's own terms are added to an exact ``lr wd x``."""
    if weight_decay != 0:
        for p, u in zip(params, out, strict=True):
            torch.mul(p, lr * weight_decay, out=u)
    else:
        torch._foreach_zero_(list(out))
    return out


@torch.no_grad()
def apply_updates(params: Sequence[Tensor], updates: Sequence[Tensor | None], *, alpha: float = 1.0) -> None:
    """``x <- x - alpha * u`` for every parameter whose update is not None.

    Updates may be in a wider dtype than the parameters (Muon's are fp32 for bf16 weights); they are cast
    on the way in, so the rounding happens once, at the write.
    """
    pairs = [(p, u) for p, u in zip(params, updates, strict=True) if u is not None]
    if not pairs:
        return
    ps = [p for p, _ in pairs]
    us = [u if u.dtype == p.dtype else u.to(p.dtype) for p, u in pairs]
    torch._foreach_add_(ps, us, alpha=-alpha)


def _pool_key(x: Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, x.device)


class UpdateOptimizer(torch.optim.Optimizer):
    """Base class: an optimizer whose step is ``x <- x - u`` with ``u`` computable on its own.

    Subclasses validate hyperparameters in ``__init__`` (``ValueError`` naming the parameter and value),
    keep state under the standard torch names (``step`` as a 0-d float tensor, ``exp_avg``,
    ``exp_avg_sq``, ``momentum_buffer``, ...), and implement :meth:`_group_updates`.
    """

    def params(self) -> list[Tensor]:
        """All parameters, flattened over param_groups in order: the order of :meth:`compute_updates`."""
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def compute_updates(self) -> list[Tensor | None]:
        """Advance the state by one step and return ``u_t`` for every parameter (None where ``.grad`` is None).

        Reads ``p.grad`` and ``p``; writes neither. The list is aligned with :meth:`params`.
        """
        updates: list[Tensor | None] = []
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in live):
                raise ValueError("sparse gradients are not supported")
            group_updates = iter(self._group_updates(group, live, [p.grad for p in live]) if live else [])
            updates.extend(next(group_updates) if p.grad is not None else None for p in group["params"])
        return updates

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = self.compute_updates()
        apply_updates(self.params(), updates)
        self.recycle(updates)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.__dict__.pop("_recycled", None)  # the pool's buckets follow the parameters: rebuild them

    def recycle(self, updates: Iterable[Tensor | None]) -> None:
        """Hand back updates from :meth:`compute_updates` that nobody will read again (None entries skipped).

        A later :meth:`compute_updates` may overwrite them. Keeps at most as many tensors of each shape,
        strides, dtype and device as the optimizer has parameters of that kind; the rest are dropped. A
        tensor handed back twice is kept once (keyed by its memory address), so no two updates can alias.
        """
        pool = self._update_pool()
        for u in updates:
            if u is not None:
                bucket = pool.get(_pool_key(u))
                if bucket is not None and len(bucket[1]) < bucket[0]:
                    bucket[1].setdefault(u.data_ptr(), u)

    def _update_pool(self) -> dict[tuple, tuple[int, dict[int, Tensor]]]:
        # Not in __init__: torch's Optimizer pickles only defaults/state/param_groups, and subclasses' __init__
        # order varies; built lazily (and rebuilt after unpickling) from the current parameters.
        pool = self.__dict__.get("_recycled")
        if pool is None:
            counts: dict[tuple, int] = {}
            for p in self.params():
                counts[_pool_key(p)] = counts.get(_pool_key(p), 0) + 1
            pool = self.__dict__["_recycled"] = {k: (n, {}) for k, n in counts.items()}
        return pool

    def _out_like(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """An uninitialised buffer shaped like each tensor: a recycled update when one fits, else a new one."""
        pool = self._update_pool()
        out = []
        for x in tensors:
            bucket = pool.get(_pool_key(x))
            out.append(bucket[1].popitem()[1] if bucket and bucket[1]
                       else torch.empty_like(x, memory_format=torch.preserve_format))
        return out

    def _group_updates(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """Return the updates of one param group (same order as ``params``) and advance its state.

        ``params`` and ``grads`` are read-only here. The returned tensors must be fresh (not aliases of
        state that a later step mutates), because delay and Error Feedback wrappers keep them.
        """
        raise NotImplementedError
