"""One table of the project's optimizers and ``build_optimizer(model, cfg)``, which routes parameters.

Each :class:`OptimizerSpec` names the optimizer's class, which coefficient the one ``momentum`` knob
(docs/spec.md section 7) sets, whether hidden matrices get their own rule (Muon, MARS: embeddings, head, norms
and biases go to AdamW groups), and a factory for the installed reference implementation that the tests and the
benchmark compare against. Adding an optimizer is one entry in :data:`OPTIMIZERS`.

The LLM-pretraining defaults (docs/optimizers.md) are written once, in each class's constructor signature; the
spec reads them from there (:func:`class_defaults`). They are applied here alone: :func:`resolve_defaults` turns
a config's "take the default" values into them, and what it returns is what :func:`build_optimizer` builds, what
the training loop records in a run's config.toml and checkpoints, and what docs/optimizers.md tabulates
(:func:`defaults_markdown`).

Routing: a parameter is a *hidden matrix* when ``p.ndim >= 2`` and its name contains neither ``embed`` nor
``lm_head`` (tied weights appear once in ``named_parameters``), as docs/architecture.md fixes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bubblefree.config import OptimConfig
from bubblefree.optim.adamw import AdamW
from bubblefree.optim.adan import Adan
from bubblefree.optim.base import UpdateOptimizer, check_nonneg
from bubblefree.optim.lion import Lion
from bubblefree.optim.mars import MARS
from bubblefree.optim.muon import Muon
from bubblefree.optim.nadamw import NAdamW
from bubblefree.optim.soap import SOAP

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer", "class_defaults", "defaults_markdown", "is_hidden_matrix",
           "own_momentum", "param_groups", "resolve_defaults", "state_numel"]


@functools.cache
def class_defaults(cls: type) -> dict[str, Any]:
    """The default of every constructor argument of ``cls`` that has one (:func:`inspect.signature`): the one place
    an optimizer's defaults are written."""
    return {name: p.default for name, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty}


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """How to build one optimizer for LLM pretraining and what to compare it against. Its defaults (:attr:`lr`,
    :attr:`betas`, :attr:`weight_decay`, :attr:`momentum`, ...) are its class's (:func:`class_defaults`)."""

    cls: type[UpdateOptimizer]
    """The optimizer class (an :class:`~bubblefree.optim.base.UpdateOptimizer`)."""

    knob: str = "betas[0]"
    """The constructor argument the momentum knob sets: ``"betas[i]"``, the ``i``-th beta (the others keep their
    defaults), or a scalar argument (Muon's ``"momentum"``, mu). The knob's default is the class default there."""

    tied: bool = False
    """With a ``betas[i]`` knob: the other betas follow it, keeping the defaults' ratio of time constants,
    ``1 - beta_j = (1 - default_j) / (1 - default_i) * (1 - m)`` (at least 0). Lion: its knob is the memory
    ``beta2``, and ``beta1`` follows."""

    momentum_free: bool = True
    """Whether the knob at 0 leaves the rule without a running average of past gradients (a second moment is
    no momentum: it only scales). Adan's does not: its average of gradient differences (``beta2``) stays.
    With a ``route_key``, the matrix rule's: the AdamW groups keep their ``beta1`` 0.9 whatever the knob.
    ``config.KEEPS_MOMENTUM`` lists the optimizers where it is False (a test checks)."""

    route_key: str | None = None
    """Group flag that selects the matrix rule (``use_muon``, ``use_mars``); None: one rule for every parameter."""

    reference: Callable[..., torch.optim.Optimizer] | None = None
    """``reference(params_or_groups, **hparams)``: the installed implementation we are tested against."""

    state: Callable[[tuple[int, ...], int], int] | None = None
    """``state(shape, max_precond_dim)``: elements of state the rule keeps for one parameter of ``shape`` (its
    0-d ``step`` counter included) once it has stepped; None: AdamW's ``2n + 1``. Only the matrix rule's when
    ``route_key`` is set: the other parameters are AdamW's. The memory plan (``bubblefree plan``) counts with
    it; a test checks it against every optimizer's real state."""

    @property
    def defaults(self) -> dict[str, Any]:
        """The class's constructor defaults."""
        return class_defaults(self.cls)

    @property
    def lr(self) -> float:
        """Default peak learning rate."""
        return self.defaults["lr"]

    @property
    def betas(self) -> tuple[float, ...] | None:
        """Default betas (None for Muon, whose coefficient is ``momentum``)."""
        betas = self.defaults.get("betas")
        return None if betas is None else tuple(betas)

    @property
    def weight_decay(self) -> float:
        """Default decoupled weight decay of the class (``build_optimizer`` takes ``cfg.weight_decay``)."""
        return self.defaults["weight_decay"]

    @property
    def adamw_lr(self) -> float:
        """Default lr of the AdamW groups when ``route_key`` is set (else 0)."""
        return self.defaults["adamw_lr"] if self.route_key is not None else 0.0

    @property
    def max_precond_dim(self) -> int:
        """Default of the ``max_precond_dim`` option (SOAP's longest preconditioned dimension); 0: no such option."""
        return self.defaults.get("max_precond_dim", 0)

    @property
    def _knob(self) -> tuple[str, int | None]:
        name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", self.knob).groups()
        return name, None if index is None else int(index)

    @property
    def momentum(self) -> float:
        """Default value of the momentum knob: the class default of the coefficient it sets."""
        name, i = self._knob
        return self.defaults[name] if i is None else self.defaults[name][i]

    def momentum_kwargs(self, m: float) -> dict[str, Any]:
        """The constructor keyword arguments the knob at ``m`` gives (:attr:`knob`, :attr:`tied`)."""
        name, i = self._knob
        if i is None:
            return {name: m}
        default = self.defaults[name]

        def follow(b: float) -> float:  # the same time-constant ratio to the knob's beta as the defaults have
            return max(0.0, 1.0 - (1.0 - b) / (1.0 - default[i]) * (1.0 - m))

        return {name: tuple(m if j == i else follow(b) if self.tied else b for j, b in enumerate(default))}

    def momenta(self, group: dict[str, Any]) -> dict[str, float]:
        """The coefficients of ``group`` that the knob sets, by name (``{"betas[0]": 0.9}``); the knob at 0 sets
        them all to 0."""
        name, i = self._knob
        if i is None:
            return {name: group[name]}
        return {f"{name}[{j}]": b for j, b in enumerate(group[name]) if j == i or self.tied}


def _torch_adamw(params, **kw):
    return torch.optim.AdamW(params, foreach=True, **kw)


def _torch_nadamw(params, **kw):
    return torch.optim.NAdam(params, decoupled_weight_decay=True, foreach=True, **kw)


def _po(name: str) -> Callable[..., torch.optim.Optimizer]:
    def make(params, **kw):
        import pytorch_optimizer  # test/benchmark-only dependency

        return getattr(pytorch_optimizer, name)(params, **kw)

    make.__name__ = f"pytorch_optimizer.{name}"
    return make


def _adamw_state(shape: tuple[int, ...], max_precond_dim: int) -> int:
    return 2 * math.prod(shape) + 1  # exp_avg, exp_avg_sq, step


def _soap_state(shape: tuple[int, ...], max_precond_dim: int) -> int:
    # AdamW's moments in the eigenbasis, plus a Gram matrix GG and its eigenbasis Q for every dimension up to
    # max_precond_dim of a matrix (1-D parameters keep the identity basis: precondition_1d is off).
    return _adamw_state(shape, max_precond_dim) + sum(2 * n * n for n in shape if len(shape) > 1 and
                                                      n <= max_precond_dim)


def _nadamw_state(shape: tuple[int, ...], max_precond_dim: int) -> int:
    return _adamw_state(shape, max_precond_dim) + 1  # and mu_product, the momentum schedule's running product


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(cls=AdamW, reference=_torch_adamw),
    "muon": OptimizerSpec(cls=Muon, knob="momentum", route_key="use_muon", reference=torch.optim.Muon,
                          state=lambda shape, _: math.prod(shape)),  # momentum
    "lion": OptimizerSpec(cls=Lion, knob="betas[1]", tied=True, reference=_po("Lion"),
                          state=lambda shape, _: math.prod(shape) + 1),  # exp_avg, step
    "adan": OptimizerSpec(cls=Adan, reference=_po("Adan"),
                          state=lambda shape, _: 4 * math.prod(shape) + 1,  # m, n, v, previous gradient, step
                          momentum_free=False),  # n, the average of gradient differences, keeps beta2
    "mars": OptimizerSpec(cls=MARS, route_key="use_mars", reference=_po("MARS"),
                          state=lambda shape, _: 3 * math.prod(shape) + 1),  # m, v, last g
    "soap": OptimizerSpec(cls=SOAP, reference=_po("SOAP"), state=_soap_state),
    "nadamw": OptimizerSpec(cls=NAdamW, reference=_torch_nadamw, state=_nadamw_state),
}
"""The optimizers selectable as ``optim.name``."""


def own_momentum(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` keeps a momentum (a running average of past gradients) of its own, saying how to remove
    it, or None: the library's form of ``config.validate``'s rule for the corrections that are the method's
    momentum (``delay.correction = "update-ema"``, docs/delay.md).

    An optimizer of :data:`OPTIMIZERS` is read through its spec: one that is never free of a momentum
    (:attr:`OptimizerSpec.momentum_free`: Adan) is named; otherwise the coefficients the knob sets
    (:meth:`OptimizerSpec.momenta`: AdamW's beta1, Muon's mu, Lion's two betas, ...) must be 0 in the groups of
    its own rule (the knob leaves Muon's and MARS's AdamW groups at beta1 0.9, and so does the config). Another
    optimizer is read by torch's names: a group's ``momentum``, and ``betas[0]``."""
    cls = type(optimizer)
    spec = next((s for s in OPTIMIZERS.values() if s.cls is cls), None)
    if spec is not None and not spec.momentum_free:
        return f"{cls.__name__} keeps one at any setting (its average of gradient differences): choose another one"
    for group in optimizer.param_groups:
        if spec is not None and spec.route_key is not None and not group[spec.route_key]:
            continue
        if spec is not None:
            momenta = spec.momenta(group)
        else:
            momenta = {"momentum": group["momentum"]} if "momentum" in group else {}
            if "betas" in group:
                momenta["betas[0]"] = group["betas"][0]
        on = {k: v for k, v in momenta.items() if v != 0}
        if on:
            return (f"{cls.__name__} has {', '.join(f'{k} = {v}' for k, v in on.items())}: set "
                    f"{'it' if len(on) == 1 else 'them'} to 0 (in a config, optim.momentum = 0)")
    return None


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """True for parameters the matrix rules (Muon, MARS) own; see the module docstring."""
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name


def param_groups(model: nn.Module, route_key: str | None, *, adamw_lr: float) -> list[dict[str, Any]]:
    """Split trainable parameters into the matrix group and the AdamW group (empty groups are left out)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if route_key is None:
        return [{"params": [p for _, p in named]}]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    groups = [{"params": hidden, route_key: True}, {"params": rest, route_key: False, "lr": adamw_lr}]
    return [g for g in groups if g["params"]]


def state_numel(name: str, shape: tuple[int, ...], *, matrix: bool, max_precond_dim: int) -> int:
    """Elements of optimizer state ``name`` keeps for one parameter of ``shape`` (``matrix``: a hidden matrix,
    :func:`is_hidden_matrix`; ``max_precond_dim``: SOAP's, resolved). Fixed after the first step (SOAP's ``Q``
    appears there); the state's dtype is the parameter's."""
    spec = OPTIMIZERS[name]
    own = spec.route_key is None or matrix
    return (spec.state if own and spec.state is not None else _adamw_state)(tuple(shape), max_precond_dim)


def _spec(name: str) -> OptimizerSpec:
    spec = OPTIMIZERS.get(name)
    if spec is None:
        raise ValueError(f"Invalid optim.name: {name!r} (expected one of {', '.join(sorted(OPTIMIZERS))})")
    return spec


def resolve_defaults(cfg: OptimConfig) -> OptimConfig:
    """``cfg`` with every "take the default" value replaced by ``cfg.name``'s registry default: ``lr <= 0``,
    a negative ``momentum``, ``adamw_lr <= 0`` (optimizers with a ``route_key``) and ``max_precond_dim = 0``
    (optimizers with that option). A key the optimizer does not take is left as it is. The defaults equal the
    classes' own (a test checks), so a run built from the resolved config is the run built from ``cfg``."""
    spec = _spec(cfg.name)
    return dataclasses.replace(
        cfg, lr=cfg.lr if cfg.lr > 0 else spec.lr, momentum=cfg.momentum if cfg.momentum >= 0 else spec.momentum,
        adamw_lr=spec.adamw_lr if spec.route_key is not None and cfg.adamw_lr <= 0 else cfg.adamw_lr,
        max_precond_dim=spec.max_precond_dim if spec.max_precond_dim and cfg.max_precond_dim <= 0 else
        cfg.max_precond_dim)


def defaults_markdown() -> str:
    """The defaults table of docs/optimizers.md: the values :func:`resolve_defaults` gives each optimizer."""
    rows = ["| `optim.name` | class | `lr` | `momentum` | `adamw_lr` | `max_precond_dim` | betas "
            "| class weight decay |", "|---|---|---|---|---|---|---|---|"]
    for name, spec in OPTIMIZERS.items():
        r = resolve_defaults(OptimConfig(name=name))
        rows.append(f"| `{name}` | `{spec.cls.__name__}` | {r.lr:g} | {r.momentum:g} | "
                    f"{f'{r.adamw_lr:g}' if spec.route_key else '-'} | "
                    f"{r.max_precond_dim if spec.max_precond_dim else '-'} | "
                    f"{spec.betas if spec.betas else '-'} | {spec.weight_decay:g} |")
    return "\n".join(rows) + "\n"


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> UpdateOptimizer:
    """The optimizer ``cfg.name`` over ``model``'s parameters, with ``cfg``'s lr, momentum and weight decay
    (:func:`resolve_defaults` fills the ones ``cfg`` leaves to the default). Unknown names raise ValueError.
    """
    spec = _spec(cfg.name)
    check_nonneg("optim.weight_decay", cfg.weight_decay)
    if not cfg.momentum < 1:
        raise ValueError(f"Invalid optim.momentum: {cfg.momentum} (must be in [0, 1))")
    cfg = resolve_defaults(cfg)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, **spec.momentum_kwargs(cfg.momentum)}
    if spec.route_key is not None:
        kwargs.update(adamw_lr=cfg.adamw_lr, adamw_weight_decay=cfg.weight_decay)
    if spec.cls is NAdamW:
        kwargs.update(momentum_decay=cfg.momentum_decay)
    if spec.max_precond_dim:
        kwargs.update(max_precond_dim=cfg.max_precond_dim)
    groups = param_groups(model, spec.route_key, adamw_lr=cfg.adamw_lr)
    return spec.cls(groups, **kwargs)
