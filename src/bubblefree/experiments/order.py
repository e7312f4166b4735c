"""The runs of a suite, in the order :func:`bubblefree.experiments.reproduce.reproduce` runs them.

:func:`gather` walks a suite's plan (the synchronous sweep, its extensions, each method's knob sweep, the
suite's runs at the chosen rates, the tuned arms) and hands each batch of runs to a caller's ``execute``, whose
rows decide what comes next (a sweep's best at an end of its grid calls for an extension). The same walk serves
every reader: ``reproduce`` trains the runs, ``--dry-run`` counts those still to come, ``--report`` and
:func:`bubblefree.experiments.reproduce.tables` read the finished ones' JSON, and :func:`chosen_rates` reads the
rates a tuned suite chose.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bubblefree.errors import UserError
from bubblefree.experiments.runner import Run, pending, run_all
from bubblefree.experiments.scales import Scale
from bubblefree.experiments.sweeps import (
    Rows,
    cell_best,
    cell_extension,
    cell_report_runs,
    cell_sweep_runs,
    choose_lrs,
    knob_best_runs,
    knob_extension,
    knob_sweep_runs,
    sweep_extension,
    sweep_runs,
)
from bubblefree.optim import OPTIMIZERS

__all__ = ["chosen_rates", "gather", "sweep_cells", "tune"]


def gather(spec, scale, optimizers: tuple[str, ...], execute: Callable[[list[Run], str], Rows],
           rates_chosen: Callable[[dict[str, float]], None] = lambda lrs: None,
           ) -> tuple[Rows, dict[str, float], Rows, Rows]:
    """The suite's runs in order: the synchronous sweep (``phase`` "sweep"), its extensions past an end of
    the grid while the best rate sits there ("extension"); for a suite whose methods have knobs, each
    method's own setting swept at the chosen rate ("knobs") and extended the same way ("extension"); then
    the suite's runs at the chosen rates and best settings ("suite"); last, for a suite with tuned arms, each
    arm's own rate sweep and reported seeds ("cells", :func:`tune`). ``execute(runs, phase)`` returns their
    records; ``rates_chosen(rates)`` is called once the sweep is done. Returns ``(sweep rows, rates, suite rows,
    knob and arm rows)``."""
    if (cells := spec.tuned_cells(scale)) is not None:  # every arm tuned, one point after the other
        lrs = {o: OPTIMIZERS[o].lr for o in optimizers}  # the centre of every cell's grid
        sweep_rows, rows = tune(scale, optimizers, cells, execute, lambda: rates_chosen(lrs))
        return sweep_rows, lrs, rows, []
    sweep_rows = execute(sweep_runs(scale, optimizers), "sweep")
    # A best rate at an end: try past it. (An extension that yields no rows, one still to run when the tables
    # of a suite under way are rebuilt, ends the loop.)
    while (extension := sweep_extension(scale, sweep_rows)) and (new := execute(extension, "extension")):
        sweep_rows += new
    lrs = {o: choose_lrs(sweep_rows)[o] for o in optimizers}
    rates_chosen(lrs)
    runs = spec.runs(scale, lrs)
    knob_rows: Rows = []
    if spec.knobs:  # each method's own setting, swept at the chosen rate like the rate itself
        knob_rows = execute(knob_sweep_runs(scale, lrs, spec.knobs), "knobs")
        while (extension := knob_extension(scale, lrs, spec.knobs, knob_rows)) and (
                new := execute(extension, "extension")):
            knob_rows += new
        runs += knob_best_runs(scale, lrs, spec.knobs, knob_rows)
    rows = execute(runs, "suite")
    if spec.arms:  # the tuned arms: each optimizer's cells on their own rate sweeps, after the suite's runs
        arms = spec.arms(scale, optimizers)
        for opt in dict.fromkeys(o for o, _ in arms):
            swept, reported = tune(scale, (opt,), [cell for o, cell in arms if o == opt], execute)
            knob_rows += swept + reported
    return sweep_rows, lrs, rows, knob_rows


def tune(scale, optimizers: tuple[str, ...], cells: list, execute: Callable[[list[Run], str], Rows],
         point_done: Callable[[], None] = lambda: None) -> tuple[Rows, Rows]:
    """Tune ``cells`` one point ``x`` after the other: every cell's rate sweep at the choice seed, extended past
    an end while the best sits there, then its reported seeds at the chosen rate (``point_done`` is called in
    between). Returns ``(sweep rows, reported rows)``."""
    sweep_rows, rows = [], []
    for x in dict.fromkeys(cell.x for cell in cells):
        point = [cell for cell in cells if cell.x == x]
        swept = sweep_cells(scale, optimizers, point, execute)
        sweep_rows += swept
        point_done()
        rows += execute(cell_report_runs(scale, optimizers, point, swept), "cells")
    return sweep_rows, rows


def sweep_cells(scale, optimizers: tuple[str, ...], cells: list, execute: Callable[[list[Run], str], Rows]) -> Rows:
    """Every cell's rate sweep at the choice seed, extended past an end while the best sits there (an extension
    that yields no rows, one still to run when a suite under way is read, ends it)."""
    swept = execute(cell_sweep_runs(scale, optimizers, cells), "cells")
    while (extension := cell_extension(scale, optimizers, cells, swept)) and (new := execute(extension, "extension")):
        swept += new
    return swept


def chosen_rates(folder: str | Path, scale: Scale, optimizers: tuple[str, ...], cells: list, *, what: str,
                 hint: str = "") -> dict[tuple[str, str, float], float]:
    """``{(optimizer, variant, x): rate}`` that each of ``cells`` chose on its sweep, read from ``<folder>/runs``
    the way the suite's table reads it (:func:`sweep_cells`, ``sweeps.cell_best``). A UserError, ``what`` is not
    finished (then ``hint``), while a sweep point (the grid or an extension its best rate calls for) has no
    result yet."""
    def load(runs: list[Run], phase: str) -> Rows:
        if lacking := pending(runs, folder):
            raise UserError(f"Unfinished sweep: {what} is not finished: {len(lacking)} run(s) missing from "
                            f"{Path(folder) / 'runs'}, e.g. {min(lacking)}" + (f"; {hint}" if hint else ""))
        return run_all(runs, folder)  # only reads the finished runs' JSON

    return cell_best(sweep_cells(scale, optimizers, cells, load))
