"""How a suite chooses its settings: the synchronous learning-rate sweep, then each mitigation's own knob.

Both follow one protocol. A grid of consecutive values runs at seed 0 and full length; while the best value is
the highest (lowest) tried, the next value past it runs, up to ``Scale.lr_extend`` values beyond the grid; the
best value's run is then a seed of the comparison itself (same config, same run id), so a sweep costs only its
other points. A table marks a best value still at the end of what was tried ("grid edge").

A suite with *cells* (``steps``) tunes every arm, not only the synchronous one, and keeps choosing and reporting
apart: each cell (an arm at a point of the suite's axis) sweeps its own rate on the same grid at the choice
seed (``CHOICE_SEED``), choosing on the validation windows; its reported runs are seeds ``1 .. Scale.seeds``
at that rate (and, for an asynchronous arm, at the synchronous arm's rate too), reported on the test windows
(``train.test_split``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bubblefree.config import apply_overrides
from bubblefree.experiments.runner import Run
from bubblefree.experiments.scales import Scale
from bubblefree.experiments.tables import fmt, markdown_table
from bubblefree.optim import OPTIMIZERS

__all__ = ["ASYNC", "CHOICE_SEED", "EF", "SYNC", "Cell", "Knob", "cell_best", "cell_extension", "cell_report_runs",
           "cell_run", "cell_sweep_runs", "cell_sweep_table", "choose_lrs", "knob_best_runs", "knob_extension",
           "knob_points", "knob_runs", "knob_sweep_runs", "seed_runs", "sweep_extension", "sweep_runs", "sweep_table"]

Rows = list[dict[str, Any]]

SYNC = {"pipeline.schedule": "sync", "delay.correction": "none"}
ASYNC = {"pipeline.schedule": "2bw", "delay.correction": "none"}
EF = {"pipeline.schedule": "2bw", "delay.correction": "ef"}


# ---------------------------------------------------------------------------------------------- learning rate


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


def seed_runs(scale: Scale, optimizer: str, lr: float, variant: str, overrides: dict[str, Any], *,
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


# ---------------------------------------------------------------------------------------------- knobs


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


def knob_runs(scale: Scale, optimizer: str, lr: float, knob: Knob, value: float, role: str, *,
              seeds: bool) -> list[Run]:
    tags = {"knob": knob.key, "value": value, "role": role}
    runs = seed_runs(scale, optimizer, lr, knob.method, knob.overrides(scale, value), **tags)
    return runs if seeds else runs[:1]  # seed 0 only: a sweep point


def knob_sweep_runs(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...]) -> list[Run]:
    """Every knob's grid at seed 0, at the optimizer's chosen learning rate (the learning rate's protocol)."""
    return [run for opt, lr in lrs.items() for knob in knobs for v in knob.grid
            for run in knob_runs(scale, opt, lr, knob, v, "sweep", seeds=False)]


def knob_points(rows: Rows, optimizer: str, knob: Knob) -> dict[float, float]:
    """``{value: final loss at seed 0}`` of the knob's sweep points so far (a diverged run is ``inf``)."""
    return {r["value"]: math.inf if r["final_val_loss"] is None else r["final_val_loss"] for r in rows
            if r["optimizer"] == optimizer and r["variant"] == knob.method and r["role"] == "sweep"}


def knob_extension(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...], rows: Rows) -> list[Run]:
    """The next sweep points: where a knob's best value is the highest (lowest) tried, the next ladder value past
    it, if the ladder has one and it lies at most ``scale.lr_extend`` steps past the grid (as ``sweep_extension``)."""
    out = []
    for opt, lr in lrs.items():
        for knob in knobs:
            tried = knob_points(rows, opt, knob)
            if len(tried) < 2:
                continue
            best = min(tried, key=lambda v: (tried[v], v))
            lo, hi = knob.ladder.index(knob.grid[0]), knob.ladder.index(knob.grid[-1])
            i = knob.ladder.index(best)
            if best == max(tried) and i + 1 < len(knob.ladder) and i + 1 - hi <= scale.lr_extend:
                out += knob_runs(scale, opt, lr, knob, knob.ladder[i + 1], "sweep", seeds=False)
            elif best == min(tried) and i >= 1 and lo - (i - 1) <= scale.lr_extend:
                out += knob_runs(scale, opt, lr, knob, knob.ladder[i - 1], "sweep", seeds=False)
    return out


def knob_best_runs(scale: Scale, lrs: dict[str, float], knobs: tuple[Knob, ...], rows: Rows) -> list[Run]:
    """Every knob at its best sweep point, every seed (seed 0 is the sweep's run); none for a knob whose sweep
    has no finished point yet (tables of a suite under way)."""
    out = []
    for opt, lr in lrs.items():
        for knob in knobs:
            if tried := knob_points(rows, opt, knob):
                best = min(tried, key=lambda v: (tried[v], v))
                out += knob_runs(scale, opt, lr, knob, best, "best", seeds=True)
    return out


# ---------------------------------------------------------------------------------------------- tuned cells

CHOICE_SEED = 0
"""The seed whose runs choose a cell's rate; the reported seeds are the ones after it."""


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One arm (``variant``: sync, async, ef) at one point ``x`` of a tuned suite's axis, with its own rate sweep."""

    variant: str
    x: float
    overrides: dict[str, Any]
    """The arm's schedule and correction plus the point's keys (batch, steps, ...)."""

    seeds: int = 0
    """Reported seeds of this arm when more than the scale's (``Scale.verdict_seeds``)."""

    optimizer: str | None = None
    """The one optimizer the cell is for (its overrides depend on it); None: every optimizer the suite runs."""


def _pairs(cells: list[Cell], optimizers: tuple[str, ...]) -> list[tuple[Cell, str]]:
    """Every (cell, optimizer) the cells stand for, cell by cell."""
    return [(cell, opt) for cell in cells for opt in optimizers if cell.optimizer in (None, opt)]


def cell_run(scale: Scale, optimizer: str, cell: Cell, lr: float, seed: int, role: str) -> Run:
    """The run of ``cell`` at ``lr`` and ``seed``: the one place a tuned cell's config is built (the suite's sweeps
    and reported seeds, and ``bench time-to-loss --point`` on the distributed runtime)."""
    config = apply_overrides(scale.base, {"optim.name": optimizer, "optim.lr": lr, "train.seed": seed,
                                          **cell.overrides})
    return Run(config=config, variant=cell.variant, x=cell.x, tags={"role": role, "lr": lr})


def cell_sweep_runs(scale: Scale, optimizers: tuple[str, ...], cells: list[Cell]) -> list[Run]:
    """Every cell's rate grid (the synchronous sweep's grid) at the choice seed."""
    return [cell_run(scale, opt, cell, lr, CHOICE_SEED, "sweep") for cell, opt in _pairs(cells, optimizers)
            for lr in _lr_grid(scale, opt)]


def _cell_points(rows: Rows) -> dict[tuple[str, str, float], dict[float, float]]:
    """``{(optimizer, variant, x): {lr: final val loss}}`` of the sweep rows (a diverged run is ``inf``)."""
    out: dict[tuple[str, str, float], dict[float, float]] = {}
    for r in rows:
        if r.get("role") == "sweep":
            loss = math.inf if r["final_val_loss"] is None else r["final_val_loss"]
            out.setdefault((r["optimizer"], r["variant"], r["x"]), {})[r["lr"]] = loss
    return out


def cell_best(rows: Rows) -> dict[tuple[str, str, float], float]:
    """``{(optimizer, variant, x): the rate of the lowest validation loss at the choice seed}``."""
    return {key: min(tried, key=lambda lr: (tried[lr], lr)) for key, tried in _cell_points(rows).items()}


def cell_extension(scale: Scale, optimizers: tuple[str, ...], cells: list[Cell], rows: Rows) -> list[Run]:
    """The next sweep point of every cell whose best rate is the highest (lowest) it tried (``sweep_extension``)."""
    points, out = _cell_points(rows), []
    for cell, opt in _pairs(cells, optimizers):
        tried = points.get((opt, cell.variant, cell.x), {})
        if len(tried) < 2:
            continue
        best = min(tried, key=lambda lr: (tried[lr], lr))
        if best not in (min(tried), max(tried)):
            continue
        grid = _lr_grid(scale, opt, extended=True)
        beyond = [lr for lr in grid if lr > best] if best == max(tried) else [lr for lr in grid if lr < best][::-1]
        if beyond:
            out.append(cell_run(scale, opt, cell, beyond[0], CHOICE_SEED, "sweep"))
    return out


def cell_report_runs(scale: Scale, optimizers: tuple[str, ...], cells: list[Cell], rows: Rows) -> list[Run]:
    """The reported seeds (``1 .. scale.seeds``, or the cell's own count when larger) of every cell whose sweep
    has a result: at its own best rate (role ``best``), and for an asynchronous arm also at the synchronous arm's
    best rate of the same point (role ``sync-lr``) when the two differ. Ordered so each point's own-rate runs
    come first."""
    best, own, at_sync = cell_best(rows), [], []
    for cell, opt in _pairs(cells, optimizers):
        seeds = range(CHOICE_SEED + 1, CHOICE_SEED + 1 + max(scale.seeds, cell.seeds))
        lr = best.get((opt, cell.variant, cell.x))
        if lr is None:
            continue
        own += [cell_run(scale, opt, cell, lr, s, "best") for s in seeds]
        sync_lr = best.get((opt, "sync", cell.x))
        if cell.variant != "sync" and sync_lr is not None and sync_lr != lr:
            at_sync += [cell_run(scale, opt, cell, sync_lr, s, "sync-lr") for s in seeds]
    return own + at_sync


def cell_sweep_table(rows: Rows) -> str:
    """Every cell's sweep: validation loss per rate at the choice seed, the chosen one in bold."""
    out = []
    for (opt, variant, x), tried in _cell_points(rows).items():
        best = min(tried, key=lambda lr: (tried[lr], lr))
        cells = [f"lr {lr:g}: " + (f"**{fmt(loss)}**" if lr == best else fmt(loss))
                 for lr, loss in sorted(tried.items())]
        edge = " (grid edge)" if len(tried) > 1 and best in (min(tried), max(tried)) else ""
        out.append([opt, f"{x:g}", variant, f"{best:g}{edge}", "; ".join(cells)])
    return markdown_table(["optimizer", "point", "arm", "chosen lr", f"final val loss per lr (seed {CHOICE_SEED})"],
                          out)
