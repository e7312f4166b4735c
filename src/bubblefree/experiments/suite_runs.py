"""What each suite of ``experiments.suites`` runs: its runs at the chosen learning rates, the knobs its methods
sweep, and the cells and arms it tunes on their own rate sweeps.

Every run is the scale's base run (``experiments.scales``) with a few keys changed; every comparison is made at
the same ``pipeline.stages`` (so per-stage clipping is the same). Runs built here from ``lrs`` take the rate the
synchronous sweep chose for the optimizer (``experiments.sweeps``), and synchronous baselines get at least two
seeds so each gap can be printed beside its noise floor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bubblefree.experiments.runner import Run
from bubblefree.experiments.scales import Scale, steps_overrides
from bubblefree.experiments.sweeps import (
    ASYNC,
    DECADES,
    EF,
    FRACTIONS,
    SYNC,
    Cell,
    Knob,
    knob_runs,
    seed_runs,
)
from bubblefree.models.presets import build_model
from bubblefree.optim import OPTIMIZERS

__all__ = ["AJANTHAN", "ALL_OPTIMIZERS", "AUTHORS_DEPTH", "AUTHORS_NADAMW", "AUTHOR_ARMS", "EMA_LADDER", "MOMENTA",
    "RETUNED", "SYNC_NADAMW", "TAYLOR_LAMBDA", "UPDATE_EMA_B0", "authors_arms", "horizon_runs", "mitigation_knobs",
    "mitigation_runs", "momentum_arms", "momentum_runs", "schedule_runs", "sensitivity_runs", "steps_cells",
    "steps_overrides", "sync_async_ef"]

ALL_OPTIMIZERS = ("adamw", "muon", "soap", "adan", "lion", "mars")  # the paper's Table 1 order
MOMENTA = (0.8, 0.9, 0.95, 0.98, 0.99)
TAYLOR_LAMBDA = 0.1  # Taylor's untuned default: docs/delay.md's example value (the paper gives none we could read)


def sync_async_ef_cells(*, ef: bool, extra: Callable[[Scale], dict[str, Any]] | None = None):
    """sync, async (and async + EF) as tuned cells at one point (x = 1): the tuned form of :func:`sync_async_ef`.
    The arms a verdict is read from (sync, and EF where it runs) get ``Scale.verdict_seeds``."""
    def cells(scale: Scale) -> list[Cell]:
        over = extra(scale) if extra else {}
        verdict = scale.verdict_seeds
        return [Cell(variant="sync", x=1.0, overrides={**SYNC, **over}, seeds=verdict),
                Cell(variant="async", x=1.0, overrides={**ASYNC, **over}),
                *([Cell(variant="ef", x=1.0, overrides={**EF, **over}, seeds=verdict)] if ef else [])]
    return cells


def sync_async_ef(*, ef: bool, extra: Callable[[Scale], dict[str, Any]] | None = None):
    def runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
        over = extra(scale) if extra else {}
        out = []
        for opt, lr in lrs.items():
            out += seed_runs(scale, opt, lr, "sync", {**SYNC, **over})
            out += seed_runs(scale, opt, lr, "async", {**ASYNC, **over})
            if ef:
                out += seed_runs(scale, opt, lr, "ef", {**EF, **over})
        return out
    return runs


UPDATE_EMA_B0 = "update EMA (b_0 = 0)"
"""An outer EMA of the optimizer's updates without bias correction (``delay.correction = "nesterov"``, the name it
was first run under). It is not Ajanthan et al.'s method, which is :data:`AJANTHAN`."""
EMA_LADDER = (0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999)


def mitigation_knobs() -> tuple[Knob, ...]:
    """The ``mitigations`` suite's methods. Each grid is three consecutive ladder values, as many points as the
    learning rate's grid at the cpu, gpu and long scales (smoke's rate grid has two), and it extends past an end
    by up to ``Scale.lr_extend`` ladder values, as the rate's does.

    Taylor's term ``lambda g*g*(x_t - x_{t-d})`` is tiny beside ``g`` (gradients of 1e-3, steps of 1e-3): on the
    smoke scale the final loss moves by under 1e-6 at lambda 10, by 3e-4 at 1e3 and by 0.09-0.5 at 1e5, so its
    grid starts at 1e2; DC-ASGD-a's term grows like ``|g|`` and acts from lambda about 1e2 (measured the same
    way), so its grid is 1-100."""
    return (
        Knob(method="sync start", key="delay.sync_start_steps", ladder=FRACTIONS, grid=(0.05, 0.1, 0.25),
             default=0.1, fixed=ASYNC),
        Knob(method="sync cooldown", key="delay.sync_cooldown_steps", ladder=FRACTIONS, grid=(0.05, 0.1, 0.25),
             default=0.1, fixed=ASYNC),
        Knob(method="Taylor (DC-ASGD)", key="delay.taylor_lambda", ladder=DECADES, grid=(1e2, 1e3, 1e4),
             default=TAYLOR_LAMBDA, fixed={**ASYNC, "delay.correction": "taylor"}),
        Knob(method="Taylor adaptive (DC-ASGD-a)", key="delay.taylor_lambda", ladder=DECADES, grid=(1.0, 10.0, 100.0),
             default=1.0, fixed={**ASYNC, "delay.correction": "taylor", "delay.taylor_adaptive": True}),
        Knob(method="Error Feedback", key="delay.ef_beta", ladder=(0.125, 0.25, 0.5, 0.75, 1.0), grid=(0.5, 0.75, 1.0),
             default=1.0, fixed=EF),
        Knob(method=UPDATE_EMA_B0, key="delay.nesterov_gamma", ladder=EMA_LADDER, grid=(0.9, 0.95, 0.99),
             default=0.99, fixed={**ASYNC, "delay.correction": "nesterov"}),
        # the update EMA is the momentum itself: the optimizer inside runs without its own (config.validate)
        Knob(method="update EMA (bias-corrected)", key="delay.nesterov_gamma", ladder=EMA_LADDER,
             grid=(0.9, 0.95, 0.99), default=0.99,
             fixed={**ASYNC, "delay.correction": "update-ema", "optim.momentum": 0.0}),
        Knob(method="weight prediction", key="delay.predict_scale", ladder=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
             grid=(0.5, 1.0, 2.0), default=1.0, fixed={**ASYNC, "delay.correction": "predict"}),
    )


def mitigation_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync, async, and every method at its untuned default, every seed (the knob sweeps come on top)."""
    out = []
    for opt, lr in lrs.items():
        out += seed_runs(scale, opt, lr, "sync", SYNC) + seed_runs(scale, opt, lr, "async", ASYNC)
        for knob in mitigation_knobs():
            out += knob_runs(scale, opt, lr, knob, knob.default, "default", seeds=True)
    return out

def mitigation_cells(scale: Scale) -> list[Cell]:
    """The tuned form: sync, async, and every method at its untuned default setting, each arm on its own rate
    sweep. The methods' own settings are not swept here (a grid of them per rate would multiply every arm's
    sweep); the untuned suite sweeps them at the synchronous rate."""
    return [Cell(variant="sync", x=1.0, overrides=SYNC, seeds=scale.verdict_seeds),
            Cell(variant="async", x=1.0, overrides=ASYNC),
            *(Cell(variant=knob.method, x=1.0, overrides=knob.overrides(scale, knob.default))
              for knob in mitigation_knobs())]


AJANTHAN = "Ajanthan et al. (NAdamW, beta1 0.99)"
"""Ajanthan et al. 2025 (arXiv 2505.01099) as their code runs it: NAdamW with beta1 0.99 on the stale gradients
of weight stashing, and no correction (its look-ahead is NAdam's own)."""
SYNC_NADAMW = "sync NAdamW (beta1 0.99)"
# NAdamW's beta1 (``optim.momentum``); beta2 0.999 and momentum_decay 0.004 are the registry's, torch's and theirs.
AUTHORS_NADAMW = {"optim.momentum": 0.99}
AUTHOR_ARMS = (AJANTHAN, SYNC_NADAMW, "sync AdamW", "AdamW + EF")
AUTHORS_DEPTH = 8  # their regime: PipeDream at 8 stages


def authors_arms(scale: Scale, optimizers: tuple[str, ...]) -> list[tuple[str, Cell]]:
    """Ajanthan et al.'s method against synchronous NAdamW, synchronous AdamW (their baseline) and AdamW + EF,
    every arm on its own rate sweep, at 2BW's one-step delay (``x`` = the base run's stages) and at their regime,
    PipeDream with 8 stages (``x`` = 8, delays 7..0, the ``schedules`` suite's deep model). Run when AdamW, the
    baseline, is among the optimizers."""
    if "adamw" not in optimizers:
        return []
    out = []
    for x, regime in ((scale.base.pipeline.stages, {"pipeline.schedule": "2bw"}),
                      (AUTHORS_DEPTH, {"pipeline.schedule": "pipedream", "pipeline.stages": AUTHORS_DEPTH,
                                       "model.preset": scale.deep_model})):
        sync = {**regime, **SYNC}
        out += [("nadamw", Cell(variant=AJANTHAN, x=x, overrides={**regime, "delay.correction": "none",
                                                                   **AUTHORS_NADAMW})),
                ("nadamw", Cell(variant=SYNC_NADAMW, x=x, overrides={**sync, **AUTHORS_NADAMW})),
                ("adamw", Cell(variant="sync AdamW", x=x, overrides=sync)),
                ("adamw", Cell(variant="AdamW + EF", x=x, overrides={**regime, "delay.correction": "ef"}))]
    return out


def _momentum(opt: str, m: float) -> dict[str, Any]:
    """The optimizer's own default momentum (AdamW 0.9, Muon 0.95) is left unset, so those points are the base
    runs themselves (the ids ``error-feedback`` uses), not copies."""
    return {} if m == OPTIMIZERS[opt].momentum else {"optim.momentum": m}


def momentum_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync / async at each of ``MOMENTA``, at the rate the synchronous sweep chose at the default momentum."""
    return [run for opt, lr in lrs.items() for m in MOMENTA for variant, over in (("sync", SYNC), ("async", ASYNC))
            for run in seed_runs(scale, opt, lr, variant, {**over, **_momentum(opt, m)}, x=m)]


RETUNED = ("sync (retuned)", "async (retuned)")


def momentum_arms(scale: Scale, optimizers: tuple[str, ...]) -> list[tuple[str, Cell]]:
    """sync / async at each of ``MOMENTA``, each on its own rate sweep: the effective step of a momentum method
    scales with ``1 / (1 - momentum)`` in places, so a rate fixed across momenta confounds the two."""
    return [(opt, Cell(variant=variant, x=m, overrides={**sched, **_momentum(opt, m)}))
            for opt in optimizers for m in MOMENTA for variant, sched in zip(RETUNED, (SYNC, ASYNC))]


DEPTH_ARMS = (("sync", "sync", "none"), ("2bw", "2bw", "none"), ("2bw + EF", "2bw", "ef"),
              ("pipedream", "pipedream", "none"), ("pipedream + EF", "pipedream", "ef"))
"""The depth finding's tuned arms: (variant, schedule, correction)."""


def schedule_cells(scale: Scale) -> list[Cell]:
    """The depth finding in its tuned form: at each of ``scale.depths`` on the deep model, sync, 2BW and PipeDream,
    each delayed schedule with and without EF (:data:`DEPTH_ARMS`). WPipe is left out: its 2P partitions at depth
    16 need 32 layers, and the paper's depth finding is PipeDream's against 2BW's."""
    return [Cell(variant=variant, x=depth, overrides={"model.preset": scale.deep_model, "pipeline.stages": depth,
                                                      "pipeline.schedule": schedule, "delay.correction": correction})
            for depth in scale.depths for variant, schedule, correction in DEPTH_ARMS]


def moe_overrides(scale: Scale, *, tokens_per_param: bool) -> dict[str, Any]:
    """The MoE in place of the base model; with ``tokens_per_param`` also the steps scaled by the MoE's total
    parameters over the base model's, so both see the same tokens per (total) parameter, as the paper's MoE does.
    (The untuned suites keep the base run's steps, so their finished runs keep their ids.)"""
    over: dict[str, Any] = {"model.preset": scale.moe_model}
    if tokens_per_param:
        t = scale.base.train
        ratio = _params(scale.moe_model) / _params(scale.base.model.preset)
        over["train.steps"] = round(t.steps * ratio)
    return over


def _params(preset: str) -> int:
    """Total parameters of ``preset`` at its own vocabulary (built on the meta device: no memory)."""
    return build_model(preset, device="meta").num_params()


def momentum_cells(scale: Scale) -> list[Cell]:
    """sync / async at each of ``MOMENTA``, each on its own rate sweep (the tuned form of the momentum suite); one
    cell per optimizer, as its default momentum is left unset (:func:`_momentum`)."""
    return [Cell(variant=variant, x=m, overrides={**sched, **_momentum(opt, m)}, optimizer=opt)
            for opt in ("adamw", "muon") for m in MOMENTA for variant, sched in (("sync", SYNC), ("async", ASYNC))]


def horizon_cells(scale: Scale) -> list[Cell]:
    """sync / async / async + EF at each of ``scale.horizons``, every arm on its own rate sweep."""
    return [Cell(variant=variant, x=factor, overrides={**sched, **_horizon_overrides(scale, factor)},
                 seeds=scale.verdict_seeds if variant != "async" else 0)
            for factor in scale.horizons for variant, sched in (("sync", SYNC), ("async", ASYNC), ("ef", EF))]


def schedule_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    out = []
    for opt, lr in lrs.items():
        for depth in scale.depths:
            for schedule in ("sync", "2bw", "pipedream", "wpipe"):
                over = {"model.preset": scale.deep_model, "pipeline.schedule": schedule, "pipeline.stages": depth,
                        "delay.correction": "none"}
                out += seed_runs(scale, opt, lr, schedule, over, x=depth)
    return out


def _horizon_overrides(scale: Scale, factor: float) -> dict[str, Any]:
    """The base run trained ``factor`` times as long (its own warmup and cosine decay); evaluations scale along,
    so at ``factor`` 1 this is the base run itself (the same run id)."""
    t = scale.base.train
    return {"train.steps": max(1, round(t.steps * factor)),
            "train.eval_every": max(1, round(t.eval_every * factor)) if t.eval_every else 0}


def horizon_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync / async / async + EF at each of ``scale.horizons``, all at the rate the base-length sweep chose.
    Shortest horizon first, every optimizer at it, so the cheap points of every curve are in before the long ones."""
    out = []
    for factor in scale.horizons:
        over = _horizon_overrides(scale, factor)
        for opt, lr in lrs.items():
            for variant, sched in (("sync", SYNC), ("async", ASYNC), ("ef", EF)):
                out += seed_runs(scale, opt, lr, variant, {**sched, **over}, x=factor)
    return out


def _sensitivity_settings(scale: Scale) -> list[tuple[str, float, dict[str, Any]]]:
    """(setting, value, overrides). Batch changes keep the tokens: half the batch, twice the steps."""
    t = scale.base.train
    return [("baseline", 1.0, {})] + [
        ("batch size", t.batch_size * f, {"train.batch_size": int(t.batch_size * f),
                                          "train.steps": int(t.steps / f),
                                          "train.eval_every": int(t.eval_every / f)}) for f in (0.5, 2.0)
    ] + [("lr factor", f, {"lr_factor": f}) for f in (0.5, 2.0)] + [
        ("weight decay", wd, {"optim.weight_decay": wd}) for wd in (0.0, 0.3)]


def sensitivity_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    out = []
    for opt, lr in lrs.items():
        for setting, value, over in _sensitivity_settings(scale):
            over = dict(over)
            scaled = lr * over.pop("lr_factor", 1.0)
            for variant, sched in (("sync", SYNC), ("async", ASYNC)):
                out += seed_runs(scale, opt, scaled, variant, {**sched, **over}, x=value, setting=setting)
    return out


def steps_cells(scale: Scale) -> list[Cell]:
    """sync / async / async + EF at each of ``scale.step_factors``, in its order."""
    return [Cell(variant=variant, x=factor, overrides={**sched, **steps_overrides(scale, factor)})
            for factor in scale.step_factors for variant, sched in (("sync", SYNC), ("async", ASYNC), ("ef", EF))]
