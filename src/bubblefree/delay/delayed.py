"""Delayed-gradient training (weight stashing), with a pluggable correction and synchronous start / cooldown.

One implementation of the update rules of docs/spec.md (sections 3, 5 and 6), shared by the single-process
simulation (one instance for the whole model, per-parameter delays) and the distributed runtime (one
instance per pipeline stage). Notation:
``x_t`` are the parameters after ``t`` steps, ``(u_t, s_{t+1}) = O(g, s_t, x_t)`` the inner optimizer's
whole step, ``d`` a parameter's delay (``schedules.stage_delays``), ``K_s``/``K_c`` the synchronous start
and cooldown, ``T`` the run length. Step ``t`` is *asynchronous* when ``K_s <= t < T - K_c``; elsewhere
``d = 0``. With ``a`` the step at which the current asynchronous phase began (``K_s``):

    u_t = O(grad f(x_{max(t-d, a)}; b_t), s_t, x_t),      x_{t+1} = x_t - u_t

(``a = 0`` gives ``x_j = x_0`` for ``j < 0``). A *correction* changes this rule at a few points (the stale
gradient, how ``u_t`` makes ``x_{t+1}``, the point the gradient is taken at); each is a
:class:`~bubblefree.delay.correction.Correction` in the table :data:`~bubblefree.delay.corrections.CORRECTIONS`
(``none``, ``ef``, ``taylor``, ``predict``, ``update-ema``, ``nesterov``), with its math in its own module.

**Switches.** *Start* (entering step ``K_s``): the pipeline begins to fill, nothing is in flight, so every
stash slot is set to ``x_{K_s}`` (and the correction fills: :meth:`~bubblefree.delay.correction.Correction.fill`).
*Cooldown* (entering step ``T - K_c``): the pipeline drains; the correction flushes what is in flight
(:meth:`~bubblefree.delay.correction.Correction.drain`; EF's pending corrections) and the stash is freed.
Switches run eagerly at the end of ``step()`` (and in ``__init__``), so the state between two steps, the one a
checkpoint captures, is always the one the next step starts from.

**Memory.** Per parameter with ``d > 0`` in an asynchronous phase: a ring of ``d`` stashed versions
(``x_j`` in slot ``j % d``); ``x_{t-d}`` sits in slot ``t % d``, which is exactly where ``x_t`` goes, so nothing
else is allocated. Storages rotate (:meth:`DelayedOptimizer.rotate`): ``x_{t+1}`` is written in place over a
tensor that dies at this step (``u_t``, or what the correction frees; the freed slot when layouts differ),
becomes the parameter's storage, ``x_t`` goes into the slot, and the storage of ``x_{t-d}`` is handed to the
optimizer (:meth:`~bubblefree.optim.base.UpdateOptimizer.recycle`) for its next updates. An in-place write
saves the read-for-ownership of a fresh destination, and recycling saves the page faults of new memory, so
delay alone costs nothing over the bare step (docs/delay.md). Parameters change storage (``p.data``) at every
step; ``p`` itself, its ``.grad`` and the inner optimizer's state keep their identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from bubblefree.delay.corrections import CORRECTIONS, HPARAMS
from bubblefree.errors import UserError
from bubblefree.optim.base import UpdateOptimizer
from bubblefree.optim.registry import own_momentum

__all__ = ["CORRECTIONS", "DelayedOptimizer", "build_delayed", "merge_named_states", "name_state",
           "relayout_refusal"]


def _check_int(name: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    return value


class DelayedOptimizer:
    """Wrap ``optimizer`` so each parameter's gradient is taken at its stale weights ``x_{t-d_p}`` (see module doc).

    Args:
        optimizer: an :class:`~bubblefree.optim.base.UpdateOptimizer` (any correction) or any plain
            ``torch.optim.Optimizer`` (the corrections that do not need ``u_t`` before it is applied:
            ``"none"``, ``"taylor"``, ``"predict"``; its ``step()`` runs on the current weights with the
            stale gradient).
        delays: one delay for every parameter, or one per parameter in the optimizer's flattened
            ``param_groups`` order (``schedules.parameter_delays``).
        correction: a name in :data:`~bubblefree.delay.corrections.CORRECTIONS`.
        sync_start_steps, sync_cooldown_steps: ``K_s``, ``K_c`` (``K_c > 0`` needs ``total_steps``).
        total_steps: ``T``, the run length.
        **hparams: the corrections' hyperparameters (:data:`~bubblefree.delay.corrections.HPARAMS`:
            ``ef_beta``, ``taylor_lambda``, ``taylor_adaptive``, ``ema_beta``, ``predict_scale``); every
            one is checked, the chosen correction's are used.

    A correction that is the method's momentum (``update-ema``) is refused around an optimizer that keeps one
    of its own (:func:`~bubblefree.optim.registry.own_momentum`), as the config refuses it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, delays: int | Sequence[int] = 0,
                 correction: str = "none", sync_start_steps: int = 0, sync_cooldown_steps: int = 0,
                 total_steps: int | None = None, **hparams: Any) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"Invalid optimizer: {type(optimizer).__name__} (expected a torch.optim.Optimizer)")
        if correction not in CORRECTIONS:
            raise ValueError(f"Invalid correction: {correction!r} (expected one of {', '.join(CORRECTIONS)})")
        kind = CORRECTIONS[correction]
        if kind.needs_updates and not isinstance(optimizer, UpdateOptimizer):
            raise ValueError(f"Invalid correction: {correction!r} needs an UpdateOptimizer (its update u_t before "
                             f"it is applied), got {type(optimizer).__name__}")
        if kind.owns_momentum:
            _refuse_own_momentum(optimizer, correction)
        unknown = sorted(set(hparams) - set(HPARAMS))
        if unknown:
            raise TypeError(f"DelayedOptimizer got unexpected keyword arguments: {', '.join(unknown)}")
        hparams = {**HPARAMS, **hparams}
        for cls in dict.fromkeys(CORRECTIONS.values()):
            cls.check(hparams)
        if total_steps is not None:
            _check_int("total_steps", total_steps)
        for name, k in (("sync_start_steps", sync_start_steps), ("sync_cooldown_steps", sync_cooldown_steps)):
            _check_int(name, k)
            if total_steps is not None and k > total_steps:
                raise ValueError(f"Invalid {name}: {k} (larger than total_steps = {total_steps})")
        if sync_cooldown_steps > 0 and total_steps is None:
            raise ValueError(f"Invalid sync_cooldown_steps: {sync_cooldown_steps} (needs total_steps)")
        self.optimizer = optimizer
        self.params: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        n = len(self.params)
        if isinstance(delays, int) and not isinstance(delays, bool):
            delays = [delays] * n
        if not isinstance(delays, Sequence):
            raise ValueError(f"Invalid delays: {delays!r} (expected an integer or one integer per parameter)")
        delays = list(delays)
        if len(delays) != n:
            raise ValueError(f"Invalid delays: {len(delays)} entries for {n} optimizer parameters")
        for i, d in enumerate(delays):
            _check_int(f"delays[{i}]", d)
        self.delays: list[int] = delays
        self.correction = correction
        for name, value in hparams.items():  # every hyperparameter readable as an attribute, as configured
            setattr(self, name, value)
        self.corrector = kind(self.params, delays, **{k: hparams[k] for k in kind.hparams})
        self.sync_start_steps = sync_start_steps
        self.sync_cooldown_steps = sync_cooldown_steps
        self.total_steps = total_steps
        self._t = 0
        self._filled = False  # stash allocated: an asynchronous phase is running
        self.stash: list[list[Tensor] | None] = [None] * n
        """Per parameter, the ring of ``d`` stashed versions (``x_j`` in slot ``j % d``) while filled."""
        self._switch_phase()

    # ----------------------------------------------------------------------------------------- phases
    @property
    def step_count(self) -> int:
        """``t``: the number of steps taken; the next ``step()`` computes ``x_{t+1}``."""
        return self._t

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (for learning-rate schedules)."""
        return self.optimizer.param_groups

    @property
    def _ef(self) -> list[list[Tensor | None] | None]:
        """The updates in flight of an EF run, per parameter (empty for another correction): read by a test."""
        return getattr(self.corrector, "rings", [])

    def is_async(self, step: int | None = None) -> bool:
        """Whether step ``step`` (default: the next one) runs with the configured delays."""
        step = self._t if step is None else step
        end = float("inf") if self.total_steps is None else self.total_steps - self.sync_cooldown_steps
        return self.sync_start_steps <= step < end

    def effective_delays(self) -> list[int]:
        """Each parameter's delay for the next step: the configured one, or 0 in a synchronous phase."""
        return list(self.delays) if self._filled else [0] * len(self.delays)

    @torch.no_grad()
    def _switch_phase(self) -> None:
        if self.is_async() and not self._filled:  # pipeline fills: every stashed version is x_t, no update in flight
            for i, (p, d) in enumerate(zip(self.params, self.delays)):
                if d > 0:
                    self.stash[i] = [p.detach().clone() for _ in range(d)]
                    self.corrector.fill(i, p, d)
            self._filled = True
        elif not self.is_async() and self._filled:  # pipeline drains: the correction flushes, the stash is freed
            for i, p in enumerate(self.params):
                self.corrector.drain(i, p)
                self.stash[i] = None
            self._filled = False

    # ------------------------------------------------------------------------------- stale versions
    def stale_tensors(self, ahead: int = 0) -> list[Tensor]:
        """The tensors holding ``x_{t+ahead-d_p}`` for every parameter (the live parameter where that is ``x_t``;
        with ``"predict"``, the predicted point ``x^_{t+ahead}`` instead).

        ``ahead`` lets a pipeline run forwards of a later step before this step's update (``0 <= ahead <=
        d_p`` for every parameter). Aliasing: the returned tensors are stash slots (or the parameters); do not
        modify them. How long they hold their values is :attr:`stale_until_used`. (A prediction from the live
        weights, ``ahead = d_p``, is a fresh tensor.)
        """
        out = []
        for i, (p, d) in enumerate(zip(self.params, self.effective_delays())):
            if not 0 <= ahead <= d:
                raise ValueError(f"Invalid ahead: {ahead} (parameter {i} has delay {d} at step {self._t})")
            if ahead < d:
                out.append(self.stash[i][(self._t + ahead) % d])
            else:
                predicted = self.corrector.predict_live(i, p, d) if d > 0 else None
                out.append(p if predicted is None else predicted)
        return out

    @property
    def stale_until_used(self) -> bool:
        """Whether the tensors :meth:`stale_tensors` gives for step ``s = t + ahead`` keep ``x_{s-d}`` until the
        update of step ``s`` itself, so a pipeline can compute step ``s`` on them without a copy.

        True with an :class:`~bubblefree.optim.base.UpdateOptimizer`: a step writes only the slot it frees (slot
        ``t % d``, which held ``x_{t-d}``, the version of step ``t``, whose forwards and backwards are done) and
        buffers of its own, and moves the parameter's storage into the stash instead of writing it (for
        ``ahead < d`` the slot is ``s % d``, which no update before ``s`` frees; for ``ahead = d`` the live
        storage, which the update of step ``t`` moves to that same slot). A parameter of delay 0 is updated in
        place, but its step is taken with ``ahead = 0`` and ends before that update. A plain torch optimizer
        steps the live weights in place while a step taken with ``ahead = d`` still reads them: False, copy those
        (its stash slots are written only when freed, as above).
        """
        return isinstance(self.optimizer, UpdateOptimizer)

    @contextmanager
    def stale_params(self, ahead: int = 0) -> Iterator[None]:
        """Inside, every parameter holds ``x_{t+ahead-d_p}`` (storage swapped in, no copy; restored on exit).

        Run the forward and backward inside: gradients land in ``p.grad`` as usual. Do not step inside.
        """
        swapped: list[tuple[Tensor, Tensor]] = []
        try:
            for p, s in zip(self.params, self.stale_tensors(ahead)):
                if s is not p:
                    swapped.append((p, p.data))
                    p.data = s
            yield
        finally:
            for p, live in swapped:
                p.data = live

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Apply ``u_t`` computed from the gradients in ``p.grad`` (taken at ``x_{t-d}``), with the correction.

        The correction may rewrite the gradients in place first (``"taylor"``).
        """
        t, delays = self._t, self.effective_delays()
        slot = [t % d if d else -1 for d in delays]
        delayed = [i for i, d in enumerate(delays) if d > 0]
        self.corrector.before_update(self, delayed, slot)
        if isinstance(self.optimizer, UpdateOptimizer):
            self.optimizer.recycle(self.corrector.apply(self, self.optimizer.compute_updates(), delays, slot))
        else:  # plain torch optimizer: x_t goes into the freed slot, then it steps the live weights
            for i in delayed:
                self.stash[i][slot[i]].copy_(self.params[i])
            self.optimizer.step()
        self.corrector.after_update(self, delayed, delays, slot)
        self._t += 1
        self._switch_phase()

    def rotate(self, i: int, slot: int, new: Tensor) -> None:
        """``x_t`` (the parameter's storage) goes into stash slot ``slot``, ``new`` (``x_{t+1}``) becomes it."""
        p = self.params[i]
        self.stash[i][slot] = p.data
        p.data = new

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ----------------------------------------------------------------------------------- bookkeeping
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the wrapper (not the model or the inner optimizer): the stash, and the buffers of each
        correction (under its ``memory_key``; 0 for those not running)."""
        out = {"stash": sum(x.numel() * x.element_size() for r in self.stash for x in r or [])}
        out.update(dict.fromkeys((c.memory_key for c in CORRECTIONS.values() if c.memory_key is not None), 0))
        if self.corrector.memory_key is not None:
            out[self.corrector.memory_key] = self.corrector.memory_bytes()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, counters, stash rings and the correction's buffers (by reference, like torch)."""
        return {"inner": self.optimizer.state_dict(), "step": self._t, "filled": self._filled,
                "delays": list(self.delays), "correction": self.correction,
                "stash": {i: list(r) for i, r in enumerate(self.stash) if r is not None},
                **self.corrector.state_dict()}

    def named_state_dict(self, names: Sequence[str]) -> dict[str, Any]:
        """:meth:`state_dict` keyed by parameter name instead of position (``names[i]`` names the ``i``-th
        optimizer parameter): the form checkpoints hold, which loads into any split of the model
        (:func:`name_state`, :meth:`load_named_state_dict`)."""
        return name_state(self.state_dict(), names)

    def load_named_state_dict(self, state: dict[str, Any], names: Sequence[str]) -> None:
        """Restore this optimizer's parameters from a :meth:`named_state_dict` of any split of the model (a
        whole model's, or one merged from the stages' with :func:`merge_named_states`): each parameter takes
        the inner optimizer's state, stash, EF ring and buffers saved under its name, each param group the
        hyperparameters of the saved group that held its first parameter.

        A parameter whose delay differs from the saved one is refused while an asynchronous phase runs
        (:func:`relayout_refusal`); in a synchronous phase nothing is in flight and it takes its own delay.
        """
        if len(names) != len(self.params):
            raise ValueError(f"Invalid names: {len(names)} for {len(self.params)} optimizer parameters")
        why = relayout_refusal(state, dict(zip(names, self.delays)))
        if why:
            raise UserError(f"Invalid checkpoint: {why}")
        missing = [n for n in names if n not in state["params"]]
        if missing:
            raise UserError(f"Invalid checkpoint: it holds no state for parameter {missing[0]} "
                            f"({len(missing)} of this optimizer's {len(names)} are missing)")
        saved = [state["params"][n] for n in names]
        group_of = {n: g for g in state["groups"] for n in g["params"]}
        position = {id(p): i for i, p in enumerate(self.params)}
        groups = []
        for group in self.optimizer.param_groups:
            mine = [position[id(p)] for p in group["params"]]
            hyper = {k: v for k, v in group_of[names[mine[0]]].items() if k != "params"}
            groups.append({**hyper, "params": mine})
        indexed = {"inner": {"state": {i: s["inner"] for i, s in enumerate(saved) if "inner" in s},
                             "param_groups": groups},
                   "step": state["step"], "filled": state["filled"], "delays": list(self.delays),
                   "correction": state["correction"]}
        for key in _BUFFERS:
            indexed[key] = {i: s[key] for i, s in enumerate(saved) if key in s}
        self.load_state_dict(indexed)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (copied, so ``state`` may be reused); the model weights load separately."""
        for key in ("delays", "correction"):
            if state[key] != getattr(self, key):
                raise UserError(f"checkpoint has {key} = {state[key]}, this run has {getattr(self, key)}")
        self.optimizer.load_state_dict(state["inner"])
        self._t, self._filled = int(state["step"]), bool(state["filled"])
        self.stash = [None] * len(self.params)
        for i, ring in state["stash"].items():
            p = self.params[int(i)]
            self.stash[int(i)] = [x.to(device=p.device, dtype=p.dtype, copy=True) for x in ring]
        self.corrector.load_state_dict(state)
        self._switch_phase()  # a run resumed with another total_steps may have to fill or drain now


_BUFFERS = ("stash", *dict.fromkeys(b.key for c in CORRECTIONS.values() for b in c.buffers))
"""The per-parameter entries of :meth:`DelayedOptimizer.state_dict` besides the inner optimizer's state: the
stash and the keys of every correction's :attr:`~bubblefree.delay.correction.Correction.buffers`."""


def _refuse_own_momentum(optimizer: torch.optim.Optimizer, correction: str) -> None:
    """The library's twin of ``config.validate``'s rule: a correction that is the method's momentum runs around
    an optimizer without one, or the two momenta compound (docs/delay.md)."""
    why = own_momentum(optimizer)
    if why is not None:
        raise ValueError(f"Invalid correction: {correction!r} is the method's momentum, moved outside the delay, so "
                         f"it needs an optimizer without one of its own, but {why}")


def name_state(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A :meth:`DelayedOptimizer.state_dict` keyed by parameter name: ``names[i]`` names the ``i``-th optimizer
    parameter (flattened ``param_groups``, torch's numbering of ``state["inner"]``).

    Returns ``{"step", "filled", "correction", "groups": [{hyperparameters..., "params": [names]}], "params":
    {name: {"delay", "inner"?, "stash"?, "ef"?, "momentum"?, "mean_square"?, "change"?}}}``: nothing in it
    depends on how the model is split into stages, so the state of one split loads into another
    (:meth:`DelayedOptimizer.load_named_state_dict`). Stash and EF rings keep their slots (``x_j`` and
    ``u_j`` in slot ``j % d``): a parameter's ring is portable wherever its delay ``d`` is the same.
    """
    if len(names) != len(state["delays"]):
        raise ValueError(f"Invalid names: {len(names)} for {len(state['delays'])} optimizer parameters")
    params: dict[str, dict[str, Any]] = {n: {"delay": d} for n, d in zip(names, state["delays"])}
    for i, inner in state["inner"]["state"].items():
        params[names[int(i)]]["inner"] = inner
    for key in _BUFFERS:
        for i, value in state.get(key, {}).items():  # checkpoints older than a buffer lack its key
            params[names[int(i)]][key] = value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[int(i)] for i in g["params"]]}
              for g in state["inner"]["param_groups"]]
    return {"step": state["step"], "filled": state["filled"], "correction": state["correction"], "groups": groups,
            "params": params}


def merge_named_states(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One :func:`name_state` of the whole model from those of its stages (disjoint parameters, one step).

    Groups with the same hyperparameters are merged (the stages' ``[matrix rule, AdamW]`` groups become the
    whole model's), so the result is the one a single optimizer over the whole model would give."""
    first = parts[0]
    for part in parts[1:]:
        for key in ("step", "filled", "correction"):
            assert part[key] == first[key], (key, part[key], first[key])  # the stages drained at one step
    groups: list[dict[str, Any]] = []
    for part in parts:
        for group in part["groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
            if same is None:
                groups.append({**hyper, "params": list(group["params"])})
            else:
                same["params"].extend(group["params"])
    params = {n: s for part in parts for n, s in part["params"].items()}
    assert len(params) == sum(len(part["params"]) for part in parts), "stages share a parameter"
    return {"step": first["step"], "filled": first["filled"], "correction": first["correction"], "groups": groups,
            "params": params}


def relayout_refusal(state: dict[str, Any], delays: dict[str, int]) -> str | None:
    """Why a :func:`name_state` cannot load where the parameters have ``delays`` (by name), or None.

    In an asynchronous phase (``filled``) a parameter with delay ``d`` holds ``d`` stashed weight versions (and
    ``d`` EF updates) in flight; another delay would need versions that were never kept, or change which
    gradient meets which weights, so the trajectory could not continue: refused. 2BW's delay is 1 on every
    stage, so its state moves to any number of stages; PipeDream's (``P-1-s``) and WPipe's depend on ``P``.
    In a synchronous phase nothing is in flight and every parameter takes its new delay when the next
    phase fills."""
    if not state["filled"]:
        return None
    moved = [(n, state["params"][n]["delay"], d) for n, d in delays.items()
             if n in state["params"] and state["params"][n]["delay"] != d]
    if not moved:
        return None
    name, old, new = moved[0]
    return (f"parameter {name} has delay {old} in the checkpoint and {new} here ({len(moved)} parameters change "
            f"delay), and its weight versions are in flight (asynchronous phase at step {state['step']})")


def build_delayed(optimizer: torch.optim.Optimizer, *, delays: int | Sequence[int], config: Any,
                  total_steps: int) -> DelayedOptimizer:
    """The one way both executors build a :class:`DelayedOptimizer` from a run's ``[delay]`` config section.

    ``config`` is a ``bubblefree.config.DelayConfig``: *every* one of its fields is passed as the keyword
    of the same name, so a key added to the section without a keyword here is a TypeError at the first run
    (and in the tests), never a setting silently ignored by one executor.
    """
    kwargs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return DelayedOptimizer(optimizer, delays=delays, total_steps=total_steps, **kwargs)
