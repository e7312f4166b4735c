"""The paper's experiments (arXiv 2606.30634) as suites: a list of runs plus how to tabulate and plot them.

Every run is the scale's base run (``experiments.scales``) with a few keys changed; every comparison is made
at the same ``pipeline.stages`` (so per-stage clipping is the same) and the same learning rate, the one the
synchronous sweep chose for the optimizer (``sweep_runs`` / ``choose_lrs``). Synchronous baselines always get
at least two seeds so each gap can be printed beside its noise floor (``experiments.tables``).

| suite | runs (per optimizer) | paper |
|---|---|---|
| ``optimizers`` | sync, 2BW async; six optimizers | Table 1 |
| ``error-feedback`` | sync, async, async + EF; six optimizers | Table 2 |
| ``momentum`` | sync, async at momentum 0.8 / 0.9 / 0.95 / 0.98; AdamW, Muon | momentum ablation |
| ``mitigations`` | sync start / cooldown, Taylor (+ adaptive), EF, Nesterov, prediction: default and tuned; AdamW, Muon | mitigations |
| ``schedules`` | sync, 2BW, PipeDream, WPipe at the scale's depths (2 / 4 / 8 / 16, a 32-layer model); AdamW, Muon | depth |
| ``sensitivity`` | sync, async at 0.5x / 2x batch (same tokens), 0.5x / 2x lr, wd 0 / 0.3; AdamW, Muon | ablations |
| ``moe`` | sync, async, async + EF on a small MoE; AdamW, Muon | MoE result |
| ``horizon`` | sync, async, async + EF trained to several lengths (tokens per parameter); AdamW, Muon | 50B vs 200B |
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bubblefree.errors import UserError
from bubblefree.experiments.runner import Run
from bubblefree.experiments.scales import Scale
from bubblefree.experiments.tables import (
    PAPER_360M,
    PAPER_MOE,
    fmt,
    fmt_mean,
    fmt_pct,
    gap_recovered,
    losses,
    markdown_table,
    mean,
    noise_floor,
    tokens_per_param,
)
from bubblefree.optim import OPTIMIZERS
from bubblefree.config import apply_overrides

__all__ = ["SUITES", "Knob", "Suite", "choose_lrs", "get_suite", "knob_best_runs", "knob_extension", "knob_sweep_runs",
           "mitigation_knobs", "sweep_extension", "sweep_runs", "sweep_table"]

Rows = list[dict[str, Any]]

SYNC = {"pipeline.schedule": "sync", "delay.correction": "none"}
ASYNC = {"pipeline.schedule": "2bw", "delay.correction": "none"}
EF = {"pipeline.schedule": "2bw", "delay.correction": "ef"}
ALL_OPTIMIZERS = ("adamw", "muon", "soap", "adan", "lion", "mars")  # the paper's Table 1 order
MOMENTA = (0.8, 0.9, 0.95, 0.98)
TAYLOR_LAMBDA = 0.1  # Taylor's untuned default: docs/delay.md's example value (the paper gives none we could read)


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    title: str
    optimizers: tuple[str, ...]
    """Optimizers the suite runs (each gets the synchronous learning-rate sweep first)."""

    runs: Callable[[Scale, dict[str, float]], list[Run]]
    """``runs(scale, lrs)``: the runs of the optimizers in ``lrs`` (in its order), at their chosen rates."""

    table: Callable[[Rows], str]
    plots: tuple[tuple[str, str], ...] = ()
    """``(file stem, kind)`` pairs drawn by ``experiments.plots.draw``."""

    knobs: tuple[Knob, ...] = ()
    """Settings of the suite's methods swept after the learning rate (``knob_sweep_runs``)."""


# ---------------------------------------------------------------------------------------------- run builders


def _lr_grid(scale: Scale, optimizer: str, *, extended: bool = False) -> list[float]:
    """The sweep's rates, ascending; ``extended``: with ``scale.lr_extend`` more factors beyond each end."""
    factors = list(scale.lr_factors)
    if extended and len(factors) > 1:
        ratio = factors[-1] / factors[-2]
        factors = ([factors[0] / ratio**k for k in range(scale.lr_extend, 0, -1)] + factors
                   + [factors[-1] * ratio**k for k in range(1, scale.lr_extend + 1)])
    return [float(f"{OPTIMIZERS[optimizer].lr * f:.3g}") for f in factors]


def _sweep_run(scale: Scale, optimizer: str, lr: float) -> Run:
    return Run(config=apply_overrides(scale.base, {"optim.name": optimizer, "optim.lr": lr, "train.seed": 0,
                                                   **SYNC}), variant="sweep", x=lr)


def _runs(scale: Scale, optimizer: str, lr: float, variant: str, overrides: dict[str, Any], *,
          x: float | None = None, **tags: Any) -> list[Run]:
    """One run per seed (at least two for ``sync``, for the noise floor) of the base run with ``overrides``."""
    seeds = max(2, scale.seeds) if variant == "sync" else scale.seeds
    return [Run(config=apply_overrides(scale.base, {"optim.name": optimizer, "optim.lr": lr, "train.seed": seed,
                                                    **overrides}), variant=variant, x=x, tags=tags)
            for seed in range(seeds)]


def sweep_runs(scale: Scale, optimizers: tuple[str, ...]) -> list[Run]:
    """The synchronous learning-rate sweep: seed 0, full length, the registry default times each factor.

    The run at the chosen learning rate is the very run the suites use as synchronous seed 0 (same config,
    same id), so the sweep costs ``len(lr_factors) - 1`` extra runs per optimizer (plus its extensions)."""
    return [_sweep_run(scale, opt, lr) for opt in optimizers for lr in _lr_grid(scale, opt)]


def sweep_extension(scale: Scale, rows: Rows) -> list[Run]:
    """The next sweep runs: for each optimizer in ``rows`` (the sweep's results so far) whose best rate is the
    highest (lowest) it tried, the next higher (lower) rate of the extended grid, if there is one.

    ``reproduce`` runs these until none is left, so the chosen rate is inside the rates tried unless the
    extended grid ends there (``sweep_table`` then marks it)."""
    out = []
    for opt, best in choose_lrs(rows).items():
        tried = sorted({r["x"] for r in rows if r["optimizer"] == opt})
        if len(tried) < 2 or best not in (tried[0], tried[-1]):
            continue
        grid = _lr_grid(scale, opt, extended=True)
        beyond = [lr for lr in grid if lr > best] if best == tried[-1] else [lr for lr in grid if lr < best][::-1]
        if beyond:
            out.append(_sweep_run(scale, opt, beyond[0]))
    return out


def choose_lrs(rows: Rows) -> dict[str, float]:
    """The learning rate of the lowest final validation loss per optimizer (a diverged run never wins)."""
    best: dict[str, tuple[float, float]] = {}
    for r in rows:
        loss = r["final_val_loss"] if r["final_val_loss"] is not None else math.inf
        if r["optimizer"] not in best or loss < best[r["optimizer"]][0]:
            best[r["optimizer"]] = (loss, r["x"])
    return {opt: lr for opt, (_, lr) in best.items()}


def sweep_table(rows: Rows) -> str:
    """Final validation loss of every sweep point, the chosen one in bold."""
    chosen = choose_lrs(rows)
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["x"])
        cells = [f"lr {r['x']:g}: " + (f"**{fmt(r['final_val_loss'])}**" if r["x"] == chosen[opt] else
                                       fmt(r["final_val_loss"])) for r in mine]
        # A best rate still at an end (the extended grid ends there) says the optimum may lie beyond it.
        edge = " (grid edge)" if len(mine) > 1 and chosen[opt] in (mine[0]["x"], mine[-1]["x"]) else ""
        out.append([opt, f"{chosen[opt]:g}{edge}", "; ".join(cells)])
    return markdown_table(["optimizer", "chosen lr", "sync final val loss per lr (seed 0)"], out)


def _sync_async_ef(*, ef: bool, extra: Callable[[Scale], dict[str, Any]] | None = None):
    def runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
        over = extra(scale) if extra else {}
        out = []
        for opt, lr in lrs.items():
            out += _runs(scale, opt, lr, "sync", {**SYNC, **over})
            out += _runs(scale, opt, lr, "async", {**ASYNC, **over})
            if ef:
                out += _runs(scale, opt, lr, "ef", {**EF, **over})
        return out
    return runs


@dataclass(frozen=True, kw_only=True)
class Knob:
    """A mitigation and its own setting, swept like the learning rate (``knob_sweep_runs``)."""

    method: str
    """The method's row label (the runs' ``variant``)."""

    key: str
    """The config key swept; ``delay.sync_start_steps`` / ``delay.sync_cooldown_steps`` take a fraction of the
    run's steps."""

    ladder: tuple[float, ...]
    """Every value the sweep may try, ascending: the grid and its extensions past each end."""

    grid: tuple[float, ...]
    """The first values tried (a run of consecutive ladder values)."""

    default: float
    """The untuned setting every seed runs (for the older methods, the setting the suite ran before it swept)."""

    fixed: dict[str, Any]
    """The method's other keys (schedule, correction, switches)."""

    def setting(self, steps: int, value: float) -> float | int:
        """The config value: ``value`` itself, or for a synchronous switch that fraction of ``steps`` (at least
        one step, in exact integer arithmetic so 10 % is ``steps // 10``, the suite's earlier choice)."""
        return max(1, steps * round(value * 1000) // 1000) if self.key.startswith("delay.sync_") else value

    def overrides(self, scale: Scale, value: float) -> dict[str, Any]:
        return {**self.fixed, self.key: self.setting(scale.base.train.steps, value)}

    def label(self, steps: int, value: float) -> str:
        setting = self.setting(steps, value)
        return f"{value:.3g} ({setting} steps)" if setting != value else f"{value:g}"


FRACTIONS = (0.025, 0.05, 0.1, 0.25, 0.5)
DECADES = tuple(10.0**k for k in range(-2, 7))


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
        Knob(method="Nesterov (Ajanthan et al.)", key="delay.nesterov_gamma",
             ladder=(0.5, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999), grid=(0.9, 0.95, 0.99), default=0.99,
             fixed={**ASYNC, "delay.correction": "nesterov"}),
        Knob(method="weight prediction", key="delay.predict_scale", ladder=(0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
             grid=(0.5, 1.0, 2.0), default=1.0, fixed={**ASYNC, "delay.correction": "predict"}),
    )


def _knob_run(scale: Scale, optimizer: str, lr: float, knob: Knob, value: float, role: str, *,
              seeds: bool) -> list[Run]:
    tags = {"knob": knob.key, "value": value, "role": role}
    runs = _runs(scale, optimizer, lr, knob.method, knob.overrides(scale, value), **tags)
    return runs if seeds else runs[:1]  # seed 0 only: a sweep point


def _mitigation_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync, async, and every method at its untuned default, every seed (the knob sweeps come on top)."""
    out = []
    for opt, lr in lrs.items():
        out += _runs(scale, opt, lr, "sync", SYNC) + _runs(scale, opt, lr, "async", ASYNC)
        for knob in mitigation_knobs():
            out += _knob_run(scale, opt, lr, knob, knob.default, "default", seeds=True)
    return out


def knob_sweep_runs(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...]) -> list[Run]:
    """Every knob's grid at seed 0, at the optimizer's chosen learning rate (the learning rate's protocol)."""
    return [run for opt, lr in lrs.items() for knob in knobs for v in knob.grid
            for run in _knob_run(scale, opt, lr, knob, v, "sweep", seeds=False)]


def _tried(rows: Rows, optimizer: str, knob: Knob) -> dict[float, float]:
    """``{value: final loss at seed 0}`` of the knob's sweep points so far (a diverged run is ``inf``)."""
    return {r["value"]: math.inf if r["final_val_loss"] is None else r["final_val_loss"] for r in rows
            if r["optimizer"] == optimizer and r["variant"] == knob.method and r["role"] == "sweep"}


def knob_extension(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...], rows: Rows) -> list[Run]:
    """The next sweep points: where a knob's best value is the highest (lowest) tried, the next ladder value past
    it, if the ladder has one and it lies at most ``scale.lr_extend`` steps past the grid (as ``sweep_extension``)."""
    out = []
    for opt, lr in lrs.items():
        for knob in knobs:
            tried = _tried(rows, opt, knob)
            if len(tried) < 2:
                continue
            best = min(tried, key=lambda v: (tried[v], v))
            lo, hi = knob.ladder.index(knob.grid[0]), knob.ladder.index(knob.grid[-1])
            i = knob.ladder.index(best)
            if best == max(tried) and i + 1 < len(knob.ladder) and i + 1 - hi <= scale.lr_extend:
                out += _knob_run(scale, opt, lr, knob, knob.ladder[i + 1], "sweep", seeds=False)
            elif best == min(tried) and i >= 1 and lo - (i - 1) <= scale.lr_extend:
                out += _knob_run(scale, opt, lr, knob, knob.ladder[i - 1], "sweep", seeds=False)
    return out


def knob_best_runs(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...], rows: Rows) -> list[Run]:
    """Every knob at its best sweep point, every seed (seed 0 is the sweep's run); none for a knob whose sweep
    has no finished point yet (tables of a suite under way)."""
    out = []
    for opt, lr in lrs.items():
        for knob in knobs:
            if tried := _tried(rows, opt, knob):
                best = min(tried, key=lambda v: (tried[v], v))
                out += _knob_run(scale, opt, lr, knob, best, "best", seeds=True)
    return out


def _momentum_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync / async at each of ``MOMENTA``. The optimizer's own default momentum (AdamW 0.9, Muon 0.95) is left
    unset, so those points are the base runs themselves (the ids ``error-feedback`` uses), not copies."""
    def momentum(opt: str, m: float) -> dict[str, Any]:
        return {} if m == OPTIMIZERS[opt].momentum else {"optim.momentum": m}

    return [run for opt, lr in lrs.items() for m in MOMENTA for variant, over in (("sync", SYNC), ("async", ASYNC))
            for run in _runs(scale, opt, lr, variant, {**over, **momentum(opt, m)}, x=m)]


def _schedule_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    out = []
    for opt, lr in lrs.items():
        for depth in scale.depths:
            for schedule in ("sync", "2bw", "pipedream", "wpipe"):
                over = {"model.preset": scale.deep_model, "pipeline.schedule": schedule, "pipeline.stages": depth,
                        "delay.correction": "none"}
                out += _runs(scale, opt, lr, schedule, over, x=depth)
    return out


def _horizon_overrides(scale: Scale, factor: float) -> dict[str, Any]:
    """The base run trained ``factor`` times as long (its own warmup and cosine decay); evaluations scale along,
    so at ``factor`` 1 this is the base run itself (the same run id)."""
    t = scale.base.train
    return {"train.steps": max(1, round(t.steps * factor)),
            "train.eval_every": max(1, round(t.eval_every * factor)) if t.eval_every else 0}


def _horizon_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync / async / async + EF at each of ``scale.horizons``, all at the rate the base-length sweep chose.
    Shortest horizon first, every optimizer at it, so the cheap points of every curve are in before the long ones."""
    out = []
    for factor in scale.horizons:
        over = _horizon_overrides(scale, factor)
        for opt, lr in lrs.items():
            for variant, sched in (("sync", SYNC), ("async", ASYNC), ("ef", EF)):
                out += _runs(scale, opt, lr, variant, {**sched, **over}, x=factor)
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


def _sensitivity_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    out = []
    for opt, lr in lrs.items():
        for setting, value, over in _sensitivity_settings(scale):
            over = dict(over)
            scaled = lr * over.pop("lr_factor", 1.0)
            for variant, sched in (("sync", SYNC), ("async", ASYNC)):
                out += _runs(scale, opt, scaled, variant, {**sched, **over}, x=value, setting=setting)
    return out


# ---------------------------------------------------------------------------------------------- tables


def _gap_cells(rows: Rows, **match: Any) -> tuple[list[float], list[float], str, str]:
    sync, delayed = losses(rows, variant="sync", **match), losses(rows, variant="async", **match)
    return sync, delayed, fmt(mean(delayed) - mean(sync)), fmt(noise_floor(sync))


def _optimizers_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt)
        ps, pa, _ = PAPER_360M.get(opt, (None, None, None))
        lr = next(r["config"]["optim"]["lr"] for r in rows if r["optimizer"] == opt)
        out.append([opt, f"{lr:g}", fmt_mean(sync), fmt_mean(delayed), gap, noise, fmt(ps), fmt(pa),
                    fmt(pa - ps) if ps and pa else "-"])
    return markdown_table(["optimizer", "lr", "sync", "async (2BW, d=1)", "gap", "noise floor",
                           "paper sync", "paper async", "paper gap"], out)


def _ef_table(rows: Rows, paper: Callable[[str], tuple] = lambda opt: PAPER_360M.get(opt, (None,) * 3)) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt)
        ef = losses(rows, variant="ef", optimizer=opt)
        ps, pa, pe = paper(opt)
        paper_rec = fmt_pct(gap_recovered(ps, pa, pe)) if None not in (ps, pa, pe) else "-"
        out.append([opt, fmt_mean(sync), fmt_mean(delayed), fmt_mean(ef), gap, noise,
                    fmt_pct(gap_recovered(mean(sync), mean(delayed), mean(ef))),
                    " / ".join(fmt(v) for v in (ps, pa, pe)), paper_rec])
    return markdown_table(["optimizer", "sync", "async", "async + EF", "gap", "noise floor", "gap recovered",
                           "paper sync / async / EF", "paper recovered"], out)


def _moe_table(rows: Rows) -> str:
    return _ef_table(rows, paper=lambda opt: PAPER_MOE if opt == "muon" else (None,) * 3) + (
        "\n\nThe paper's MoE numbers (10B MoE, 200B tokens, Muon presumed) are in the Muon row.")


def _momentum_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for m in MOMENTA:
            sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt, x=m)
            out.append([opt, f"{m:g}", fmt_mean(sync), fmt_mean(delayed), gap, noise])
    return markdown_table(["optimizer", "momentum", "sync", "async", "gap", "noise floor"], out)


def _mitigations_table(rows: Rows) -> str:
    """Per optimizer: sync, async, then each method at its untuned default and at its best sweep point (mean
    over seeds, gap recovered), with every sweep point (seed 0) and a best value still at the ladder's end."""
    out = []
    knobs = {k.method: k for k in mitigation_knobs()}
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == opt]
        steps = mine[0]["config"]["train"]["steps"]
        sync, delayed = losses(mine, variant="sync"), losses(mine, variant="async")
        noise = fmt(noise_floor(sync))
        out.append([opt, "sync", "", fmt_mean(sync), "", "", "", f"noise floor {noise}"])
        out.append([opt, "async (2BW, d=1)", "", fmt_mean(delayed), "", "", "", ""])
        for method in dict.fromkeys(r["variant"] for r in mine if r.get("role")):
            knob = knobs[method]
            tried = _tried(mine, opt, knob)
            best = min(tried, key=lambda v: (tried[v], v)) if tried else knob.default
            cells = []
            for role, value in (("default", knob.default), ("best", best)):
                got = losses([r for r in mine if r.get("role") == role], variant=method, value=value)
                rec = gap_recovered(mean(sync), mean(delayed), mean(got))
                cells.append((f"{knob.label(steps, value)}: {fmt_mean(got)}", fmt_pct(rec)))
            # A best value still at an end of the values tried (the budget or the ladder ended there), as for the rate.
            edge = " (grid edge)" if len(tried) > 1 and best in (min(tried), max(tried)) else ""
            sweep = "; ".join((f"**{knob.label(steps, v)}: {fmt(loss)}**" if v == best else
                               f"{knob.label(steps, v)}: {fmt(loss)}") for v, loss in sorted(tried.items()))
            out.append([opt, method, knob.key.removeprefix("delay."), *cells[0], *cells[1], f"{sweep}{edge}"])
    return markdown_table(["optimizer", "method", "knob", "untuned default: loss", "gap recovered",
                           "best setting: loss", "gap recovered", "sweep (seed 0, final val loss)"], out)


def _schedules_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for depth in sorted({r["x"] for r in rows}):
            sync = losses(rows, optimizer=opt, x=depth, variant="sync")
            gaps = [fmt(mean(losses(rows, optimizer=opt, x=depth, variant=s)) - mean(sync))
                    for s in ("2bw", "pipedream", "wpipe")]
            out.append([opt, str(depth), fmt_mean(sync), *gaps, fmt(noise_floor(sync))])
    return markdown_table(["optimizer", "depth P", "sync", "2BW gap", "PipeDream gap", "WPipe gap", "noise floor"],
                          out)


def _horizon_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for factor in sorted({r["x"] for r in rows if r["optimizer"] == opt}):
            mine = [r for r in rows if r["optimizer"] == opt and r["x"] == factor]
            sync, delayed, gap, noise = _gap_cells(mine)
            ef = losses(mine, variant="ef")
            r0 = mine[0]
            out.append([opt, str(r0["config"]["train"]["steps"]), tokens_per_param(r0), fmt_mean(sync),
                        fmt_mean(delayed), fmt_mean(ef), gap, noise,
                        fmt_pct(gap_recovered(mean(sync), mean(delayed), mean(ef)))])
    return markdown_table(["optimizer", "steps", "tokens / parameter (non-embedding)", "sync", "async",
                           "async + EF", "gap", "noise floor", "gap recovered"], out)


def _sensitivity_table(rows: Rows) -> str:
    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for value in dict.fromkeys(r["x"] for r in rows if r["setting"] == setting):
            row = [setting, f"{value:g}"]
            for opt in opts:
                sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt, setting=setting, x=value)
                row += [fmt_mean(sync), fmt_mean(delayed), gap, noise]
            out.append(row)
    header = ["setting", "value"] + [f"{opt} {c}" for opt in opts for c in ("sync", "async", "gap", "noise")]
    return markdown_table(header, out)


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite(name="optimizers", title="Sync vs PipeDream-2BW async per optimizer (the paper's Table 1)",
          optimizers=ALL_OPTIMIZERS, runs=_sync_async_ef(ef=False), table=_optimizers_table,
          plots=(("optimizers-curves", "curves"),)),
    Suite(name="error-feedback", title="Async vs async + Error Feedback per optimizer (the paper's Table 2)",
          optimizers=ALL_OPTIMIZERS, runs=_sync_async_ef(ef=True), table=_ef_table,
          plots=(("error-feedback-curves", "curves"),)),
    Suite(name="momentum", title="The sync-async gap against momentum", optimizers=("adamw", "muon"),
          runs=_momentum_runs, table=_momentum_table, plots=(("momentum-gap", "gap"),)),
    Suite(name="mitigations", title="Mitigations of the one-step delay", optimizers=("adamw", "muon"),
          runs=_mitigation_runs, table=_mitigations_table, plots=(("mitigations-curves", "curves"),),
          knobs=mitigation_knobs()),
    Suite(name="schedules", title="PipeDream vs 2BW vs WPipe against pipeline depth", optimizers=("adamw", "muon"),
          runs=_schedule_runs, table=_schedules_table, plots=(("schedules-gap", "gap"),)),
    Suite(name="sensitivity", title="Batch size, learning rate and weight decay", optimizers=("adamw", "muon"),
          runs=_sensitivity_runs, table=_sensitivity_table),
    Suite(name="moe", title="Sync / async / async + EF on a small MoE", optimizers=("adamw", "muon"),
          runs=_sync_async_ef(ef=True, extra=lambda scale: {"model.preset": scale.moe_model}),
          table=_moe_table, plots=(("moe-curves", "curves"),)),
    Suite(name="horizon", title="The sync-async gap against the training horizon", optimizers=("adamw", "muon"),
          runs=_horizon_runs, table=_horizon_table, plots=(("horizon-gap", "horizon"),)),
)}
"""Suite name -> :class:`Suite`."""


def get_suite(name: str) -> Suite:
    """The suite ``name``, or a UserError naming the suites."""
    if name not in SUITES:
        close = difflib.get_close_matches(name, list(SUITES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"Invalid suite: {name!r}{hint}; suites: {', '.join(SUITES)}")
    return SUITES[name]
