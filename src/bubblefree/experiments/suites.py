"""The paper's experiments (arXiv 2606.30634) as suites: a list of runs plus how to tabulate and plot them.

Every run is the scale's base run (``experiments.scales``) with a few keys changed; every comparison is made
at the same ``pipeline.stages`` (so per-stage clipping is the same) and the same learning rate, the one the
synchronous sweep chose for the optimizer (``experiments.sweeps``). Synchronous baselines always get
at least two seeds so each gap can be printed beside its noise floor (``experiments.tables``).

| suite | runs (per optimizer) | paper |
|---|---|---|
| ``optimizers`` | sync, 2BW async; six optimizers | Table 1 |
| ``error-feedback`` | sync, async, async + EF; six optimizers | Table 2 |
| ``momentum`` | sync, async at momentum 0.8 / 0.9 / 0.95 / 0.98 / 0.99, at the synchronous rate and retuned at each momentum; AdamW, Muon | momentum ablation |
| ``mitigations`` | sync start / cooldown, Taylor (+ adaptive), EF, update EMA (two forms), prediction: default and tuned; AdamW, Muon; Ajanthan et al.'s NAdamW (beta1 0.99) against sync NAdamW, sync AdamW and AdamW + EF, each tuned, at 2BW and PipeDream-8 | mitigations |
| ``schedules`` | sync, 2BW, PipeDream, WPipe at the scale's depths (2 / 4 / 8 / 16, a 32-layer model); AdamW, Muon | depth |
| ``sensitivity`` | sync, async at 0.5x / 2x batch (same tokens), 0.5x / 2x lr, wd 0 / 0.3; AdamW, Muon | ablations |
| ``moe`` | sync, async, async + EF on a small MoE; AdamW, Muon | MoE result |
| ``horizon`` | sync, async, async + EF trained to several lengths (tokens per parameter); AdamW, Muon | 50B vs 200B |
| ``steps`` | sync, async, async + EF, each at its own tuned rate, the same tokens in 1x / 4x / 16x the steps; Muon, AdamW | step count |

``steps`` is the one suite that tunes every arm and keeps choosing and reporting apart (``sweeps.Cell``): its
table gives paired differences over the reported seeds with 95 % intervals and a verdict. ``mitigations`` and
``momentum`` add such tuned arms (``Suite.arms``) beside their runs at the synchronous rate.

What each suite runs is built in ``experiments.suite_runs``, its table in ``experiments.suite_tables``.
"""  # noqa: E501 (a table's rows)

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass

from bubblefree.errors import UserError
from bubblefree.experiments.runner import Run
from bubblefree.experiments.scales import Scale
from bubblefree.experiments.suite_runs import (
    ALL_OPTIMIZERS,
    authors_arms,
    horizon_cells,
    horizon_runs,
    mitigation_cells,
    mitigation_knobs,
    mitigation_runs,
    moe_overrides,
    momentum_arms,
    momentum_cells,
    momentum_runs,
    schedule_cells,
    schedule_runs,
    sensitivity_runs,
    steps_cells,
    sync_async_ef,
    sync_async_ef_cells,
)
from bubblefree.experiments.suite_tables import (
    ef_table,
    horizon_table,
    mitigations_table,
    moe_table,
    momentum_table,
    optimizers_table,
    schedules_table,
    sensitivity_table,
    steps_table,
    tuned_table,
)
from bubblefree.experiments.sweeps import Cell, Knob, Rows

__all__ = ["SUITES", "Suite", "get_suite"]


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    title: str
    optimizers: tuple[str, ...]
    """Optimizers the suite runs (each gets the synchronous learning-rate sweep first)."""

    runs: Callable[[Scale, dict[str, float]], list[Run]] | None
    """``runs(scale, lrs)``: the runs of the optimizers in ``lrs`` (in its order), at their chosen rates; None for
    a suite that always tunes every arm (``steps``)."""

    table: Callable[[Rows], str]
    plots: tuple[tuple[str, str], ...] = ()
    """``(file stem, kind)`` pairs drawn by ``experiments.plots.draw``."""

    knobs: tuple[Knob, ...] = ()
    """Settings of the suite's methods swept after the learning rate (``knob_sweep_runs``)."""

    cells: Callable[[Scale], list[Cell]] | None = None
    """The suite's arms as cells, each swept on its own instead of the synchronous sweep
    (``sweeps.cell_sweep_runs``): what it runs at a tuned scale (``Scale.tuned``), and always where it has no
    ``runs``."""

    arms: Callable[[Scale, tuple[str, ...]], list[tuple[str, Cell]]] | None = None
    """``arms(scale, optimizers)``: ``(optimizer, cell)`` pairs run after the suite's runs, each cell tuned on
    its own rate sweep as a tuned suite's are (``sweeps.cell_sweep_runs``): comparisons that a rate chosen for
    another arm would confound (the mitigations suite's Ajanthan et al. arm, the momentum suite's retuned
    rates). ``optimizers`` are the suite's optimizers the command runs."""


    shares: dict[str, str] = dataclasses.field(default_factory=lambda: {"ef": "async"})
    """In the tuned form's table: each corrected arm and the delayed arm whose gap it recovers."""

    def plots_at(self, scale: Scale) -> tuple[tuple[str, str], ...]:
        """The plots drawn at ``scale``: in a suite's tuned form only the loss curves, which read the reported
        runs alone (the other kinds read the untuned form's tags)."""
        if self.runs is not None and scale.tuned:
            return tuple(p for p in self.plots if p[1] == "curves")
        return self.plots

    def tabulate(self, scale: Scale, rows: Rows) -> str:
        """The suite's table at ``scale``: its own, or in its tuned form every arm against sync."""
        if self.runs is not None and scale.tuned:
            return tuned_table(rows, shares=self.shares)
        return self.table(rows)

    def tuned_cells(self, scale: Scale) -> list[Cell] | None:
        """The cells the suite runs at ``scale`` when it tunes every arm there, else None; a UserError for a suite
        with no tuned form at a tuned scale."""
        if self.runs is not None and not scale.tuned:
            return None
        if self.cells is None:
            tuned = ", ".join(s.name for s in SUITES.values() if s.cells)
            raise UserError(f"Invalid suite for scale {scale.name}: {self.name} has no tuned form (every arm on its "
                            f"own rate sweep); suites there: {tuned}")
        return self.cells(scale)


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite(name="optimizers", title="Sync vs PipeDream-2BW async per optimizer (the paper's Table 1)",
          optimizers=ALL_OPTIMIZERS, runs=sync_async_ef(ef=False), table=optimizers_table,
          plots=(("optimizers-curves", "curves"),), cells=sync_async_ef_cells(ef=False)),
    Suite(name="error-feedback", title="Async vs async + Error Feedback per optimizer (the paper's Table 2)",
          optimizers=ALL_OPTIMIZERS, runs=sync_async_ef(ef=True), table=ef_table,
          plots=(("error-feedback-curves", "curves"),), cells=sync_async_ef_cells(ef=True)),
    Suite(name="momentum", title="The sync-async gap against momentum", optimizers=("adamw", "muon"),
          runs=momentum_runs, table=momentum_table, plots=(("momentum-gap", "gap"),), arms=momentum_arms,
          cells=momentum_cells),
    Suite(name="mitigations", title="Mitigations of the one-step delay", optimizers=("adamw", "muon"),
          runs=mitigation_runs, table=mitigations_table,
          plots=(("mitigations-curves", "curves"), ("mitigations-recovered", "recovered")),
          knobs=mitigation_knobs(), arms=authors_arms, cells=mitigation_cells,
          shares={k.method: "async" for k in mitigation_knobs()}),
    Suite(name="schedules", title="PipeDream vs 2BW vs WPipe against pipeline depth", optimizers=("adamw", "muon"),
          runs=schedule_runs, table=schedules_table, plots=(("schedules-gap", "gap"),), cells=schedule_cells,
          shares={"2bw + EF": "2bw", "pipedream + EF": "pipedream"}),
    Suite(name="sensitivity", title="Batch size, learning rate and weight decay", optimizers=("adamw", "muon"),
          runs=sensitivity_runs, table=sensitivity_table),
    Suite(name="moe", title="Sync / async / async + EF on a small MoE", optimizers=("adamw", "muon"),
          runs=sync_async_ef(ef=True, extra=lambda scale: moe_overrides(scale, tokens_per_param=False)),
          table=moe_table, plots=(("moe-curves", "curves"),),
          cells=sync_async_ef_cells(ef=True, extra=lambda scale: moe_overrides(scale, tokens_per_param=True))),
    Suite(name="horizon", title="The sync-async gap against the training horizon", optimizers=("adamw", "muon"),
          runs=horizon_runs, table=horizon_table, plots=(("horizon-gap", "horizon"),), cells=horizon_cells),
    Suite(name="steps", title="The sync-async gap against the step count at fixed tokens, every arm tuned",
          optimizers=("muon", "adamw"), runs=None, table=steps_table,
          plots=(("steps-gap", "steps"),), cells=steps_cells),
)}
"""Suite name -> :class:`Suite`."""


def get_suite(name: str) -> Suite:
    """The suite ``name``, or a UserError naming the suites."""
    if name not in SUITES:
        close = difflib.get_close_matches(name, list(SUITES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"Invalid suite: {name!r}{hint}; suites: {', '.join(SUITES)}")
    return SUITES[name]
