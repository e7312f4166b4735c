"""The :class:`Correction` interface: what a delay correction adds to the weight stash of
:mod:`~bubblefree.delay.delayed`.

The stash core (versions, rotation, delays per parameter, synchronous start and cooldown) is one piece, in
:class:`~bubblefree.delay.delayed.DelayedOptimizer`. A correction changes it at a few points of a step, each
a method here whose default is the plain delay (``correction = "none"``):

* :meth:`Correction.before_update`: the stale gradients in ``p.grad`` (Taylor rewrites them);
* :meth:`Correction.apply` / :meth:`Correction.write`: how the update ``u_t`` makes ``x_{t+1}`` (Error
  Feedback adds back the update of ``d`` steps ago, the update EMA applies a running mean of updates);
* :meth:`Correction.after_update` and :meth:`Correction.predict_live`: the point the next stale gradients
  are taken at (weight prediction);
* :meth:`Correction.fill` / :meth:`Correction.drain`: the synchronous -> asynchronous switch (the pipeline
  fills, nothing is in flight) and back (it drains: flush what is in flight);
* its own state: the buffers it declares in :attr:`Correction.buffers` (one :class:`Buffer` each), which the base
  class sizes for the memory plan (:meth:`Correction.copies`), measures (:meth:`Correction.memory_bytes`), saves
  and loads (:meth:`Correction.state_dict`, :meth:`Correction.load_state_dict`).

Its hyperparameters are :attr:`Correction.hparams` (name -> default), checked by :meth:`Correction.check`
whatever the chosen correction (a bad value is an error even where it would not act), and passed to its
constructor. A new correction is one module with a subclass and one line in
:data:`bubblefree.delay.corrections.CORRECTIONS`; the generic tests (tests/test_corrections.py) then cover it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor

from bubblefree.optim.base import apply_updates

__all__ = ["Buffer", "Correction", "Stash", "can_hold", "nbytes", "own"]


class Stash(Protocol):
    """What a correction sees of the wrapper (:class:`~bubblefree.delay.delayed.DelayedOptimizer`)."""

    params: list[Tensor]
    """The wrapped parameters, in the optimizer's order."""

    stash: list[list[Tensor] | None]
    """Per parameter with ``d > 0`` in an asynchronous phase, the ring of stashed versions (``x_j`` in slot
    ``j % d``; at step ``t``'s start ``x_{t-d}`` in slot ``t % d``); None otherwise."""

    def rotate(self, i: int, slot: int, new: Tensor) -> None:
        """``x_t`` (parameter ``i``'s storage) goes into its stash slot ``slot``, ``new`` (``x_{t+1}``) becomes it."""


def can_hold(buf: Tensor, p: Tensor) -> bool:
    """Whether ``buf`` can become ``p``'s storage: same layout, and a whole storage of its own."""
    return (buf.shape == p.shape and buf.stride() == p.stride() and buf.dtype == p.dtype and buf.device == p.device
            and buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == buf.numel() * buf.element_size())


def nbytes(tensors: Sequence[Tensor | None] | None) -> int:
    """Bytes of the tensors in a list (None entries and a None list count 0)."""
    return sum(x.numel() * x.element_size() for x in tensors or [] if x is not None)


def own(x: Tensor | None, p: Tensor) -> Tensor | None:
    """A copy of a checkpointed buffer on ``p``'s device (so the loaded state may be reused)."""
    return None if x is None else x.to(device=p.device, copy=True)


@dataclass(frozen=True)
class Buffer:
    """One per-parameter buffer of a correction (:attr:`Correction.buffers`): the base class keeps it, sizes it,
    saves it and loads it.

    The correction holds it as the list attribute :attr:`name`, one entry per parameter in the optimizer's order,
    :attr:`empty` where the parameter holds none; a checkpoint holds it under :attr:`key` as ``{parameter index:
    entry}``, for the parameters that hold one (every parameter for a count). Tensors are kept by reference in a
    state dict and copied onto their parameter's device (not cast: an update may be wider than its parameter)
    when loaded.
    """

    name: str
    """The correction's attribute."""

    key: str
    """Its key in :meth:`Correction.state_dict`: checkpoints are keyed by it, so it never changes."""

    kind: Literal["tensor", "ring", "count"] = "tensor"
    """``"tensor"``: a parameter-sized tensor; ``"ring"``: a list of ``d`` of them (slots None until written: the
    updates in flight); ``"count"``: an int (0 when empty), no memory."""

    held: Literal["delayed", "every"] = "delayed"
    """Which parameters hold it in an asynchronous phase: those with a delay ``d > 0``, or every one."""

    only_with: str = ""
    """A boolean hyperparameter without which it is never held (empty: always held)."""

    @property
    def empty(self) -> Any:
        """The entry of a parameter that holds none."""
        return 0 if self.kind == "count" else None

    def copies(self, delay: int, hparams: dict[str, Any]) -> int:
        """Parameter-sized tensors it holds for one parameter of delay ``delay`` in an asynchronous phase."""
        if self.kind == "count" or (self.only_with and not hparams.get(self.only_with, False)):
            return 0
        if self.kind == "ring":
            return delay
        return int(self.held == "every" or delay > 0)

    def tensors(self, entry: Any) -> list[Tensor]:
        """The tensors of one entry."""
        if self.kind == "count" or entry is None:
            return []
        return [u for u in entry if u is not None] if self.kind == "ring" else [entry]

    def saved(self, entry: Any) -> Any:
        """One entry as a state dict holds it (a ring as a new list of the same tensors)."""
        return list(entry) if self.kind == "ring" else entry

    def loaded(self, value: Any, p: Tensor) -> Any:
        """One entry restored from a state dict, for parameter ``p``."""
        if self.kind == "count":
            return int(value)
        return [own(u, p) for u in value] if self.kind == "ring" else own(value, p)


class Correction:
    """The plain delay (``"none"``) and the interface every correction implements (module docstring).

    One instance per :class:`~bubblefree.delay.delayed.DelayedOptimizer`, built with the wrapped parameters
    (in the optimizer's order) and their configured delays; the methods get the wrapper as a :class:`Stash`
    (``core``).
    """

    hparams: ClassVar[dict[str, Any]] = {}
    """The keyword arguments the correction takes, with their defaults (the ``delay.*`` config keys)."""

    needs_updates: ClassVar[bool] = False
    """Whether it needs the update ``u_t`` before it is applied (an ``UpdateOptimizer``)."""

    buffers: ClassVar[tuple[Buffer, ...]] = ()
    """Its per-parameter buffers. The base class creates them empty, sizes them for the memory plan
    (:meth:`copies`), measures them (:meth:`memory_bytes`), saves and loads them; a checkpoint keyed by parameter
    name moves each with its parameter (:func:`~bubblefree.delay.delayed.name_state`)."""

    memory_key: ClassVar[str | None] = None
    """The name of its buffers in :meth:`~bubblefree.delay.delayed.DelayedOptimizer.memory_bytes` (None: it
    holds none)."""

    owns_momentum: ClassVar[bool] = False
    """Whether the correction is the method's momentum, so that the inner optimizer must run without its own
    (``optim.momentum = 0``; ``config.MOMENTUM_CORRECTIONS`` lists these names, which a test checks)."""

    def __init__(self, params: list[Tensor], delays: list[int], **hparams: Any) -> None:
        self.params, self.delays = params, delays
        for b in self.buffers:
            setattr(self, b.name, [b.empty] * len(params))

    @classmethod
    def copies(cls, delay: int, **hparams: Any) -> int:
        """Parameter-sized tensors its :attr:`buffers` hold for one parameter of delay ``delay`` in an asynchronous
        phase, beside the ``delay`` stashed versions: what the memory plan counts and :meth:`memory_bytes`
        measures (a test checks the two agree)."""
        return sum(b.copies(delay, hparams) for b in cls.buffers)

    @classmethod
    def check(cls, hparams: dict[str, Any]) -> None:
        """Raise ``ValueError("Invalid <name>: ...")`` for a bad value of one of :attr:`hparams`."""

    # ----------------------------------------------------------------------------------------- switches
    def fill(self, i: int, p: Tensor, d: int) -> None:
        """The pipeline fills (entering the asynchronous phase): parameter ``i`` has delay ``d > 0`` and every
        stash slot holds ``x_t``; nothing is in flight."""

    def drain(self, i: int, p: Tensor) -> None:
        """The pipeline drains (leaving it): flush what is in flight into ``p`` and free what was filled."""

    # --------------------------------------------------------------------------------------------- step
    def before_update(self, core: Stash, delayed: list[int], slot: list[int]) -> None:
        """Before the update of step ``t``: ``p.grad`` holds the gradient at ``x_{t-d}``; ``delayed`` are the
        parameters with ``d > 0`` now, ``slot[i] = t % d``."""

    def apply(self, core: Stash, updates: list[Tensor | None], delays: list[int],
              slot: list[int]) -> list[Tensor]:
        """Make ``x_{t+1}`` from the updates ``u_t`` (None: no gradient) and return the tensors nobody reads
        any more (recycled by the optimizer). Default: ``x_{t+1} = x_t - u_t`` in one batch where ``d = 0``,
        :meth:`write` and ``core.rotate`` where ``d > 0``."""
        fresh = [(p, u) for p, u, d in zip(core.params, updates, delays) if d == 0]
        apply_updates([p for p, _ in fresh], [u for _, u in fresh])
        dead = [u for _, u in fresh if u is not None]
        for i, (p, u, d) in enumerate(zip(core.params, updates, delays)):
            if d > 0:
                stale = core.stash[i][slot[i]]  # x_{t-d}: its forward and backward are done
                new, unused = self.write(i, p, u, stale, slot[i])
                dead.extend(x for x in unused if x is not None and x is not new)
                core.rotate(i, slot[i], new)
        return dead

    def write(self, i: int, p: Tensor, u: Tensor | None, stale: Tensor, slot: int) -> tuple[Tensor, list]:
        """``x_{t+1}`` of a parameter with ``d > 0``, written over a tensor that dies at this step (in place
        where it can be: an in-place write skips the read-for-ownership of a fresh destination), and the
        tensors that are then unused. Default: ``x_t - u_t`` over ``u_t``, else over ``x_{t-d}``."""
        if u is None:
            return stale.copy_(p), [stale]
        if can_hold(u, p):
            return torch.add(p, u, alpha=-1.0, out=u), [stale, u]
        return torch.add(p, u.to(p.dtype), alpha=-1.0, out=stale), [stale, u]

    def after_update(self, core: Stash, delayed: list[int], delays: list[int], slot: list[int]) -> None:
        """After the update: ``core.stash[i][slot[i]]`` holds ``x_t`` (the version the gradient of step
        ``t + d`` is taken at), ``p`` holds ``x_{t+1}``."""

    def predict_live(self, i: int, p: Tensor, d: int) -> Tensor | None:
        """The point a gradient is taken at instead of the live weights ``x_t`` when ``ahead = d > 0`` (None:
        the live weights themselves)."""
        return None

    # ------------------------------------------------------------------------------------------ state
    def memory_bytes(self) -> int:
        """Bytes of the correction's own buffers."""
        return sum(nbytes(b.tensors(entry)) for b in self.buffers for entry in getattr(self, b.name))

    def state_dict(self) -> dict[str, Any]:
        """Its buffers, by reference: ``{Buffer.key: {parameter index: entry}}`` (they sit beside the wrapper's
        in a checkpoint)."""
        return {b.key: {i: b.saved(entry) for i, entry in enumerate(getattr(self, b.name))
                        if b.kind == "count" or entry is not None} for b in self.buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` from the wrapper's whole state (copied); a missing key is empty (a
        checkpoint older than the buffer)."""
        for b in self.buffers:
            entries = [b.empty] * len(self.params)
            for i, value in state.get(b.key, {}).items():
                entries[int(i)] = b.loaded(value, self.params[int(i)])
            setattr(self, b.name, entries)
