"""Delayed-gradient training (weight stashing) with Error Feedback, Taylor, Nesterov and weight prediction.

One implementation of the update rules of docs/spec.md (sections 3, 5 and 6), shared by the single-process
simulation (one instance for the whole model, per-parameter delays) and the distributed runtime (one
instance per pipeline stage). Notation:
``x_t`` are the parameters after ``t`` steps, ``(u_t, s_{t+1}) = O(g, s_t, x_t)`` the inner optimizer's
whole step, ``d`` a parameter's delay (``schedules.stage_delays``), ``K_s``/``K_c`` the synchronous start
and cooldown, ``T`` the run length. Step ``t`` is *asynchronous* when ``K_s <= t < T - K_c``; elsewhere
``d = 0``. With ``a`` the step at which the current asynchronous phase began (``K_s``):

* delay:     ``u_t = O(grad f(x_{max(t-d, a)}; b_t), s_t, x_t)``,  ``x_{t+1} = x_t - u_t``
  (``a = 0`` gives ``x_j = x_0`` for ``j < 0``);
* ``"ef"``:  ``x_{t+1} = x_t - u_t - beta (u_t - u_{t-d})`` with ``u_j = 0`` for ``j < a``
  (arXiv 2606.30634). Invariant: ``z_t = x_t + beta * sum_{j=t-d}^{t-1} u_j`` obeys ``z_{t+1} = z_t - u_t``;
* ``"taylor"`` (DC-ASGD, Zheng et al. 2017): the optimizer sees ``g + lambda * g * g * (x_t - x_{t-d})``
  (elementwise, ``lambda > 0``). Adaptive (their DC-ASGD-a): ``lambda_t = lambda / sqrt(v_t + eps)`` with the
  running mean square ``v_t = 0.95 v_{t-1} + 0.05 g * g`` of the stale gradient (``v = 0`` before the first
  asynchronous step, ``eps = 1e-7``; the paper's constants);
* ``"predict"`` (weight prediction, PipeMare-style linear extrapolation): the gradient of step ``t`` is taken at
  ``x^_t = x_j + alpha * d * (x_j - x_{j-1})`` with ``j = max(t-d, a)`` and ``x_{a-1} := x_a`` (no history at
  the fill), instead of at ``x_j``: the newest weights the stage holds, moved ``d`` steps further along their
  last change, the point they will have reached when the gradient is applied. ``alpha`` scales the step
  (0 would be the plain delay). ``x_{t+1} = x_t - u_t``;
* ``"nesterov"`` (Ajanthan et al. 2025, arXiv 2505.01099): ``w_{t+1} = w_t + m_t - (1-gamma) u_t`` with
  ``m_t = gamma (w_t - w_{t-1})`` and the gradient taken at the look-ahead ``w_{t-d} + m_{t-d}``. The live
  parameters hold the look-ahead ``y_t = w_t + m_t`` (as NAdam does), so plain weight stashing yields exactly
  that point, and the rule becomes update-level: ``b_{t+1} = gamma b_t + (1-gamma) u_t``,
  ``y_{t+1} = y_t - (1-gamma) u_t - gamma b_{t+1}``, ``b_0 = 0``. With SGD inside (``u = lr * g``) this is
  the paper's formula; one buffer ``b`` per parameter. (The authors' code runs torch NAdamW with
  ``beta1 = 0.99`` and no wrapper: that is ``correction="none"`` around ``torch.optim.NAdam``.)

**Switches.** *Start* (entering step ``K_s``): the pipeline begins to fill, nothing is in flight, so every
stash slot is set to ``x_{K_s}`` and the EF buffers and the prediction's last change to 0. *Cooldown* (entering step ``T - K_c``): the
pipeline drains; the stash is freed and EF's pending corrections are **flushed**,
``x <- x + beta * sum_{j=t-d}^{t-1} u_j`` (i.e. ``x <- z``): every update then counts exactly once
(``x_T = x_0 - sum_t u_t`` for ``beta = 1``) instead of leaving ``beta`` times the last ``d`` updates applied
twice; it is local to each stage, so a real pipeline does the same. Nesterov's ``b`` and DC-ASGD-a's mean
square are not in-flight state and carry over; the prediction's last change is dropped. Switches run eagerly at the end of ``step()`` (and in ``__init__``), so the state between
two steps, the one a checkpoint captures, is always the one the next step starts from.

**Memory.** Per parameter with ``d > 0`` in an asynchronous phase: a ring of ``d`` stashed versions
(``x_j`` in slot ``j % d``) and, for EF, a ring of ``d`` updates (``u_j`` in slot ``j % d``, the optimizer's
fresh update tensors kept by reference). ``x_{t-d}`` and ``u_{t-d}`` sit in slot ``t % d``, which is exactly
where ``x_t`` and ``u_t`` go, so nothing else is allocated. Storages rotate: ``x_{t+1}`` is written in place
over a tensor that dies at this step (``u_t`` without EF, ``u_{t-d}`` with EF; the freed slot when layouts
differ), becomes the parameter's storage, ``x_t`` goes into the slot, and the storage of ``x_{t-d}`` is handed
to the optimizer (:meth:`~bubblefree.optim.base.UpdateOptimizer.recycle`) for its next updates. An in-place
write saves the read-for-ownership of a fresh destination, and recycling saves the page faults of new memory,
so delay alone costs nothing over the bare step and EF one extra read of ``u_{t-d}`` (docs/delay.md).
Parameters change storage (``p.data``) at every step; ``p`` itself, its ``.grad`` and the inner optimizer's
state keep their identity. With ``"predict"`` each slot holds the predicted point ``x^`` instead of ``x_j``
(written when ``x_j`` enters the slot), plus one buffer per parameter for the last change ``x_j - x_{j-1}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from bubblefree.errors import UserError
from bubblefree.optim.base import UpdateOptimizer, apply_updates

__all__ = ["CORRECTIONS", "DelayedOptimizer", "build_delayed", "merge_named_states", "name_state",
           "relayout_refusal"]

CORRECTIONS: tuple[str, ...] = ("none", "ef", "taylor", "nesterov", "predict")
"""Values of ``delay.correction``."""

# DC-ASGD-a's mean-square decay and epsilon (Zheng et al. 2017, "Asynchronous Stochastic Gradient Descent with
# Delay Compensation", section 4: MeanSquare(t) = m MeanSquare(t-1) + (1-m) g^2, m = 0.95, epsilon = 1e-7).
DC_ASGD_A_DECAY = 0.95
DC_ASGD_A_EPS = 1e-7


def _check_int(name: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    return value


def _can_hold(buf: Tensor, p: Tensor) -> bool:
    """Whether ``buf`` can become ``p``'s storage: same layout, and a whole storage of its own."""
    return (buf.shape == p.shape and buf.stride() == p.stride() and buf.dtype == p.dtype and buf.device == p.device
            and buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == buf.numel() * buf.element_size())


class DelayedOptimizer:
    """Wrap ``optimizer`` so each parameter's gradient is taken at its stale weights ``x_{t-d_p}`` (see module doc).

    Args:
        optimizer: an :class:`~bubblefree.optim.base.UpdateOptimizer` (any correction) or any plain
            ``torch.optim.Optimizer`` (``"none"`` and ``"taylor"`` only: its ``step()`` runs on the current
            weights with the stale gradient).
        delays: one delay for every parameter, or one per parameter in the optimizer's flattened
            ``param_groups`` order (``schedules.parameter_delays``).
        correction: one of :data:`CORRECTIONS`.
        ef_beta: EF coefficient in ``[0, 1]``: 1 is the paper's rule, 0 the plain delay; above 1 the
            weights would run ahead of the virtual iterate by more than the updates in flight.
        taylor_lambda: DC-ASGD coefficient (``> 0`` with ``"taylor"``: 0 would be the plain delay).
        taylor_adaptive: DC-ASGD-a: divide ``taylor_lambda`` by the root of the gradient's running mean square.
        nesterov_gamma: Nesterov momentum in ``[0, 1)`` (0.99 in Ajanthan et al.).
        predict_scale: ``alpha`` of ``"predict"`` (``> 0``; 1 extrapolates the last change linearly).
        sync_start_steps, sync_cooldown_steps: ``K_s``, ``K_c`` (``K_c > 0`` needs ``total_steps``).
        total_steps: ``T``, the run length.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, delays: int | Sequence[int] = 0,
                 correction: str = "none", ef_beta: float = 1.0, taylor_lambda: float = 0.0,
                 taylor_adaptive: bool = False, nesterov_gamma: float = 0.99, predict_scale: float = 1.0,
                 sync_start_steps: int = 0, sync_cooldown_steps: int = 0, total_steps: int | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"Invalid optimizer: {type(optimizer).__name__} (expected a torch.optim.Optimizer)")
        if correction not in CORRECTIONS:
            raise ValueError(f"Invalid correction: {correction!r} (expected one of {', '.join(CORRECTIONS)})")
        if correction in ("ef", "nesterov") and not isinstance(optimizer, UpdateOptimizer):
            raise ValueError(f"Invalid correction: {correction!r} needs an UpdateOptimizer (its update u_t before "
                             f"it is applied), got {type(optimizer).__name__}")
        if not 0.0 <= ef_beta <= 1.0:
            raise ValueError(f"Invalid ef_beta: {ef_beta} (must be in [0, 1])")
        if not 0.0 <= taylor_lambda < float("inf"):
            raise ValueError(f"Invalid taylor_lambda: {taylor_lambda} (must be >= 0)")
        if correction == "taylor" and taylor_lambda == 0:
            raise ValueError("Invalid taylor_lambda: 0.0 (correction 'taylor' needs lambda > 0; lambda 0 is the plain "
                             "delay, correction 'none')")
        if not isinstance(taylor_adaptive, bool):
            raise ValueError(f"Invalid taylor_adaptive: {taylor_adaptive!r} (must be a bool)")
        if not 0.0 <= nesterov_gamma < 1.0:
            raise ValueError(f"Invalid nesterov_gamma: {nesterov_gamma} (must be in [0, 1))")
        if not 0.0 < predict_scale < float("inf"):
            raise ValueError(f"Invalid predict_scale: {predict_scale} (must be > 0; 0 is the plain delay)")
        if total_steps is not None:
            _check_int("total_steps", total_steps)
        for name, k in (("sync_start_steps", sync_start_steps), ("sync_cooldown_steps", sync_cooldown_steps)):
            _check_int(name, k)
            if total_steps is not None and k > total_steps:
                raise ValueError(f"Invalid {name}: {k} (larger than total_steps = {total_steps})")
        if sync_cooldown_steps > 0 and total_steps is None:
            raise ValueError(f"Invalid sync_cooldown_steps: {sync_cooldown_steps} (needs total_steps)")
        self.optimizer = optimizer
        self._params: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        n = len(self._params)
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
        self.ef_beta = float(ef_beta)
        self.taylor_lambda = float(taylor_lambda)
        self.taylor_adaptive = taylor_adaptive
        self.nesterov_gamma = float(nesterov_gamma)
        self.predict_scale = float(predict_scale)
        self.sync_start_steps = sync_start_steps
        self.sync_cooldown_steps = sync_cooldown_steps
        self.total_steps = total_steps
        self._t = 0
        self._filled = False  # stash (and EF rings) allocated: an asynchronous phase is running
        self._stash: list[list[Tensor] | None] = [None] * n
        self._ef: list[list[Tensor | None] | None] = [None] * n
        self._momentum: list[Tensor | None] = [None] * n
        self._mean_square: list[Tensor | None] = [None] * n  # DC-ASGD-a
        self._change: list[Tensor | None] = [None] * n  # "predict": x_j - x_{j-1} of the newest j
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
            for i, (p, d) in enumerate(zip(self._params, self.delays)):
                if d > 0:
                    self._stash[i] = [p.detach().clone() for _ in range(d)]
                    self._ef[i] = [None] * d if self.correction == "ef" else None
                    self._change[i] = torch.zeros_like(p) if self.correction == "predict" else None
            self._filled = True
        elif not self.is_async() and self._filled:  # pipeline drains: flush EF (x <- z), free the stash
            for i, p in enumerate(self._params):
                for u in self._ef[i] or []:
                    if u is not None:
                        p.add_(u.to(p.dtype), alpha=self.ef_beta)
                self._stash[i] = self._ef[i] = self._change[i] = None
            self._filled = False

    # ------------------------------------------------------------------------------- stale versions
    def stale_tensors(self, ahead: int = 0) -> list[Tensor]:
        """The tensors holding ``x_{t+ahead-d_p}`` for every parameter (the live parameter where that is ``x_t``;
        with ``"predict"``, the predicted point ``x^_{t+ahead}`` instead).

        ``ahead`` lets a pipeline run forwards of a later step before this step's update (``0 <= ahead <=
        d_p`` for every parameter). Aliasing: the returned tensors are stash slots (or the parameters) and
        stay valid only until the next ``step()``, which writes ``x_{t+1}`` into slot ``t % d`` and swaps
        storages; clone what must outlive it. Do not modify them. (A prediction from the live weights,
        ``ahead = d_p``, is a fresh tensor.)
        """
        out = []
        for i, (p, d) in enumerate(zip(self._params, self.effective_delays())):
            if not 0 <= ahead <= d:
                raise ValueError(f"Invalid ahead: {ahead} (parameter {i} has delay {d} at step {self._t})")
            if ahead < d:
                out.append(self._stash[i][(self._t + ahead) % d])
            elif d > 0 and self._change[i] is not None:  # x^ = x_t + alpha d (x_t - x_{t-1})
                out.append(torch.add(p.detach(), self._change[i], alpha=self.predict_scale * d))
            else:
                out.append(p)
        return out

    @contextmanager
    def stale_params(self, ahead: int = 0) -> Iterator[None]:
        """Inside, every parameter holds ``x_{t+ahead-d_p}`` (storage swapped in, no copy; restored on exit).

        Run the forward and backward inside: gradients land in ``p.grad`` as usual. Do not step inside.
        """
        swapped: list[tuple[Tensor, Tensor]] = []
        try:
            for p, s in zip(self._params, self.stale_tensors(ahead)):
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

        With ``"taylor"`` the gradients are replaced in place by the compensated ones first.
        """
        t, delays = self._t, self.effective_delays()
        slot = [t % d if d else -1 for d in delays]
        delayed = [i for i, d in enumerate(delays) if d > 0]
        if self.correction == "taylor":
            self._compensate([i for i in delayed if self._params[i].grad is not None], slot)
        if isinstance(self.optimizer, UpdateOptimizer):
            self._apply(self.optimizer.compute_updates(), delays, slot)
        else:  # plain torch optimizer: x_t goes into the freed slot, then it steps the live weights
            for i in delayed:
                self._stash[i][slot[i]].copy_(self._params[i])
            self.optimizer.step()
        if self.correction == "predict":
            self._predict(delayed, delays, slot)
        self._t += 1
        self._switch_phase()

    def _compensate(self, live: list[int], slot: list[int]) -> None:
        """DC-ASGD: ``g <- g + lambda_t * g * g * (x_t - x_{t-d})`` in place (module docstring)."""
        if not live:
            return
        grads = [self._params[i].grad for i in live]
        diff = torch._foreach_sub([self._params[i] for i in live], [self._stash[i][slot[i]] for i in live])
        torch._foreach_mul_(diff, grads)
        if self.taylor_adaptive:  # lambda_t = lambda / sqrt(v_t + eps), v_t the running mean square of g
            ms = []
            for i, g in zip(live, grads):
                if self._mean_square[i] is None:
                    self._mean_square[i] = torch.zeros_like(g)
                ms.append(self._mean_square[i])
            torch._foreach_mul_(ms, DC_ASGD_A_DECAY)
            torch._foreach_addcmul_(ms, grads, grads, value=1.0 - DC_ASGD_A_DECAY)
            denom = torch._foreach_add(ms, DC_ASGD_A_EPS)
            torch._foreach_sqrt_(denom)
            torch._foreach_div_(diff, denom)
        torch._foreach_addcmul_(grads, diff, grads, value=self.taylor_lambda)

    def _predict(self, delayed: list[int], delays: list[int], slot: list[int]) -> None:
        """After the update: slot ``t % d`` holds ``x_t``; make it ``x^_{t+d} = x_t + alpha d (x_t - x_{t-1})``
        and remember ``x_{t+1} - x_t`` for the next prediction (module docstring)."""
        for i in delayed:
            x_t = self._stash[i][slot[i]]
            change = torch.sub(self._params[i].detach(), x_t)
            x_t.add_(self._change[i], alpha=self.predict_scale * delays[i])
            self._change[i] = change

    def _apply(self, updates: list[Tensor | None], delays: list[int], slot: list[int]) -> None:
        if self.correction == "nesterov":
            self._apply_nesterov(updates, delays, slot)
            return
        # x_{t+1} = x_t - c u_t + beta u_{t-d}: c = 1 + beta with EF (u_{t-d} in slot t % d), else c = 1.
        # x_{t+1} is written over a tensor that is dead after this step, in place where it can be: u_t without EF,
        # u_{t-d} with EF (an in-place write skips the read-for-ownership of a fresh destination, one memory pass).
        # That tensor becomes the parameter's storage, x_t goes into the slot, and x_{t-d}'s storage, now unused,
        # goes back to the optimizer for its next updates (module docstring, Memory).
        ef, beta = self.correction == "ef", self.ef_beta
        fresh = [(p, u) for p, u, d in zip(self._params, updates, delays) if d == 0]
        apply_updates([p for p, _ in fresh], [u for _, u in fresh])  # d = 0: EF's correction is u_t - u_t = 0
        dead = [u for _, u in fresh]  # updates nobody reads again go back to the optimizer (no page faults)
        for i, (p, u, d) in enumerate(zip(self._params, updates, delays)):
            if d == 0:
                continue
            stale = self._stash[i][slot[i]]  # x_{t-d}: its forward and backward are done
            old = self._ef[i][slot[i]] if ef else None
            if u is None:
                new = stale.copy_(p)
                if old is not None:
                    new.add_(old.to(p.dtype), alpha=beta)  # u_t = 0: x_{t+1} = x_t + beta u_{t-d}
            elif not ef and _can_hold(u, p):
                new = torch.add(p, u, alpha=-1.0, out=u)
            elif old is not None:  # the same operations wherever they write (bit-exact resume, tests)
                new = torch.add(p, old.to(p.dtype), alpha=beta, out=old if _can_hold(old, p) else stale)
                new.add_(u.to(p.dtype), alpha=-(1.0 + beta))
            else:
                new = torch.add(p, u.to(p.dtype), alpha=-(1.0 + beta) if ef else -1.0, out=stale)
            if ef:
                self._ef[i][slot[i]] = u
            dead.extend(x for x in (stale, old if ef else u) if x is not None and x is not new)  # now unused
            self._stash[i][slot[i]] = p.data  # x_t stays in the slot, x_{t+1} becomes the parameter
            p.data = new
        self._recycle(dead)

    def _recycle(self, dead: list[Tensor | None]) -> None:
        if isinstance(self.optimizer, UpdateOptimizer):
            self.optimizer.recycle(dead)

    def _apply_nesterov(self, updates: list[Tensor | None], delays: list[int], slot: list[int]) -> None:
        gamma = self.nesterov_gamma
        for i, (p, u, d) in enumerate(zip(self._params, updates, delays)):
            b = self._momentum[i]
            if u is not None:  # b_{t+1} = gamma b_t + (1 - gamma) u_t   (b_0 = 0)
                b = u.mul(1.0 - gamma) if b is None else b.mul_(gamma).add_(u, alpha=1.0 - gamma)
                self._momentum[i] = b
            new = p if d == 0 else self._stash[i][slot[i]]
            if d > 0:
                new.copy_(p)
            if u is not None:  # y_{t+1} = y_t - (1 - gamma) u_t - gamma b_{t+1}
                new.add_(u.to(p.dtype), alpha=-(1.0 - gamma))
            if b is not None:
                new.add_(b.to(p.dtype), alpha=-gamma)
            if d > 0:
                self._stash[i][slot[i]] = p.data
                p.data = new
        self._recycle(updates)  # b holds its own copy

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ----------------------------------------------------------------------------------- bookkeeping
    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the wrapper (not the model or the inner optimizer): stash, EF, Nesterov, DC-ASGD-a and
        prediction buffers."""
        def size(tensors: Sequence[Tensor | None] | None) -> int:
            return sum(x.numel() * x.element_size() for x in tensors or [] if x is not None)

        return {"stash": sum(map(size, self._stash)), "ef": sum(map(size, self._ef)), "nesterov": size(self._momentum),
                "taylor": size(self._mean_square), "predict": size(self._change)}

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, counters, stash rings, EF rings, Nesterov, DC-ASGD-a and prediction buffers (by
        reference, like torch)."""
        buffers = lambda xs: {i: b for i, b in enumerate(xs) if b is not None}  # noqa: E731
        return {"inner": self.optimizer.state_dict(), "step": self._t, "filled": self._filled,
                "delays": list(self.delays), "correction": self.correction,
                "stash": {i: list(r) for i, r in enumerate(self._stash) if r is not None},
                "ef": {i: list(r) for i, r in enumerate(self._ef) if r is not None},
                "momentum": buffers(self._momentum), "mean_square": buffers(self._mean_square),
                "change": buffers(self._change)}

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
        if len(names) != len(self._params):
            raise ValueError(f"Invalid names: {len(names)} for {len(self._params)} optimizer parameters")
        why = relayout_refusal(state, dict(zip(names, self.delays)))
        if why:
            raise UserError(f"Invalid checkpoint: {why}")
        missing = [n for n in names if n not in state["params"]]
        if missing:
            raise UserError(f"Invalid checkpoint: it holds no state for parameter {missing[0]} "
                            f"({len(missing)} of this optimizer's {len(names)} are missing)")
        saved = [state["params"][n] for n in names]
        group_of = {n: g for g in state["groups"] for n in g["params"]}
        position = {id(p): i for i, p in enumerate(self._params)}
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
        n = len(self._params)
        own = lambda x, p: None if x is None else x.to(device=p.device, copy=True)  # noqa: E731
        self._stash = [None] * n
        self._ef = [None] * n
        self._momentum = [None] * n
        self._mean_square = [None] * n
        self._change = [None] * n
        for i, ring in state["stash"].items():
            self._stash[int(i)] = [own(x, self._params[int(i)]).to(self._params[int(i)].dtype) for x in ring]
        for i, ring in state["ef"].items():
            self._ef[int(i)] = [own(u, self._params[int(i)]) for u in ring]
        for key, buffers in (("momentum", self._momentum), ("mean_square", self._mean_square),
                             ("change", self._change)):
            for i, b in state.get(key, {}).items():  # checkpoints older than a buffer lack its key
                buffers[int(i)] = own(b, self._params[int(i)])
        self._switch_phase()  # a run resumed with another total_steps may have to fill or drain now


_BUFFERS = ("stash", "ef", "momentum", "mean_square", "change")
"""The per-parameter entries of :meth:`DelayedOptimizer.state_dict` besides the inner optimizer's state."""


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
