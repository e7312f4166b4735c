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
"""  # noqa: E501 (a table's rows)

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bubblefree.errors import UserError
from bubblefree.experiments.runner import Run
from bubblefree.experiments.scales import Scale
from bubblefree.experiments.sweeps import (
    ASYNC,
    DECADES,
    EF,
    FRACTIONS,
    SYNC,
    Cell,
    Knob,
    Rows,
    cell_sweep_table,
    knob_points,
    knob_runs,
    seed_runs,
)
from bubblefree.experiments.tables import (
    PAPER_360M,
    PAPER_MOE,
    VERDICT_SEEDS,
    fmt,
    fmt_interval,
    fmt_mean,
    fmt_pct,
    gap_recovered,
    losses,
    markdown_table,
    mean,
    noise_floor,
    paired,
    paired_interval,
    share_interval,
    tokens_per_param,
    verdict,
)
from bubblefree.optim import OPTIMIZERS

__all__ = ["MOMENTA", "SUITES", "Suite", "get_suite", "mitigation_knobs"]

ALL_OPTIMIZERS = ("adamw", "muon", "soap", "adan", "lion", "mars")  # the paper's Table 1 order
MOMENTA = (0.8, 0.9, 0.95, 0.98, 0.99)
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

    cells: Callable[[Scale], list[Cell]] | None = None
    """For a suite that tunes every arm: its cells, each swept on its own instead of the synchronous sweep
    (``sweeps.cell_sweep_runs``); ``runs`` is then unused."""

    arms: Callable[[Scale, tuple[str, ...]], list[tuple[str, Cell]]] | None = None
    """``arms(scale, optimizers)``: ``(optimizer, cell)`` pairs run after the suite's runs, each cell tuned on
    its own rate sweep as a tuned suite's are (``sweeps.cell_sweep_runs``): comparisons that a rate chosen for
    another arm would confound (the mitigations suite's Ajanthan et al. arm, the momentum suite's retuned
    rates). ``optimizers`` are the suite's optimizers the command runs."""


# ---------------------------------------------------------------------------------------------- run builders


def _sync_async_ef(*, ef: bool, extra: Callable[[Scale], dict[str, Any]] | None = None):
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


def _mitigation_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync, async, and every method at its untuned default, every seed (the knob sweeps come on top)."""
    out = []
    for opt, lr in lrs.items():
        out += seed_runs(scale, opt, lr, "sync", SYNC) + seed_runs(scale, opt, lr, "async", ASYNC)
        for knob in mitigation_knobs():
            out += knob_runs(scale, opt, lr, knob, knob.default, "default", seeds=True)
    return out

AJANTHAN = "Ajanthan et al. (NAdamW, beta1 0.99)"
"""Ajanthan et al. 2025 (arXiv 2505.01099) as their code runs it: NAdamW with beta1 0.99 on the stale gradients
of weight stashing, and no correction (its look-ahead is NAdam's own)."""
SYNC_NADAMW = "sync NAdamW (beta1 0.99)"
# NAdamW's beta1 (``optim.momentum``); beta2 0.999 and momentum_decay 0.004 are the registry's, torch's and theirs.
AUTHORS_NADAMW = {"optim.momentum": 0.99}
AUTHOR_ARMS = (AJANTHAN, SYNC_NADAMW, "sync AdamW", "AdamW + EF")
AUTHORS_DEPTH = 8  # their regime: PipeDream at 8 stages


def _authors_arms(scale: Scale, optimizers: tuple[str, ...]) -> list[tuple[str, Cell]]:
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


def _momentum_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    """sync / async at each of ``MOMENTA``, at the rate the synchronous sweep chose at the default momentum."""
    return [run for opt, lr in lrs.items() for m in MOMENTA for variant, over in (("sync", SYNC), ("async", ASYNC))
            for run in seed_runs(scale, opt, lr, variant, {**over, **_momentum(opt, m)}, x=m)]


RETUNED = ("sync (retuned)", "async (retuned)")


def _momentum_arms(scale: Scale, optimizers: tuple[str, ...]) -> list[tuple[str, Cell]]:
    """sync / async at each of ``MOMENTA``, each on its own rate sweep: the effective step of a momentum method
    scales with ``1 / (1 - momentum)`` in places, so a rate fixed across momenta confounds the two."""
    return [(opt, Cell(variant=variant, x=m, overrides={**sched, **_momentum(opt, m)}))
            for opt in optimizers for m in MOMENTA for variant, sched in zip(RETUNED, (SYNC, ASYNC))]


def _schedule_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
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


def _horizon_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
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


def _sensitivity_runs(scale: Scale, lrs: dict[str, float]) -> list[Run]:
    out = []
    for opt, lr in lrs.items():
        for setting, value, over in _sensitivity_settings(scale):
            over = dict(over)
            scaled = lr * over.pop("lr_factor", 1.0)
            for variant, sched in (("sync", SYNC), ("async", ASYNC)):
                out += seed_runs(scale, opt, scaled, variant, {**sched, **over}, x=value, setting=setting)
    return out


def steps_overrides(scale: Scale, factor: int) -> dict[str, Any]:
    """The base run's tokens in ``factor`` times the steps: the batch divided by ``factor``; the warmup keeps its
    share (``train.warmup_frac``), evaluations and log lines their count, and the evaluation its windows
    (``eval_batches x batch_size`` windows, split into validation and test halves by ``train.test_split``)."""
    t, pipe = scale.base.train, scale.base.pipeline
    if factor < 1 or t.batch_size % factor:
        raise UserError(f"Invalid steps factor: {factor} (must divide train.batch_size = {t.batch_size})")
    batch = t.batch_size // factor
    return {"train.batch_size": batch, "train.steps": t.steps * factor, "train.eval_every": t.eval_every * factor,
            "train.eval_batches": t.eval_batches * factor, "train.log_every": t.log_every * factor,
            "train.test_split": True, "pipeline.microbatches": min(pipe.microbatches, batch)}


def _steps_cells(scale: Scale) -> list[Cell]:
    """sync / async / async + EF at each of ``scale.step_factors``, in its order."""
    return [Cell(variant=variant, x=factor, overrides={**sched, **steps_overrides(scale, factor)})
            for factor in scale.step_factors for variant, sched in (("sync", SYNC), ("async", ASYNC), ("ef", EF))]


# ---------------------------------------------------------------------------------------------- tables


def _val_by_seed(rows: Rows, **match: Any) -> dict[int, float]:
    """``{seed: final validation loss}`` of the rows matching ``match`` (``inf`` for a diverged run)."""
    return {r["seed"]: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
            for r in rows if all(r.get(k) == v for k, v in match.items())}


def _paired_cells(rows: Rows, variant: str, **match: Any) -> list[str]:
    """``variant`` - sync over the seeds both have: the mean with its 95 % t interval, and the verdict."""
    diffs = paired(_val_by_seed(rows, variant=variant, **match), _val_by_seed(rows, variant="sync", **match))
    m, lo, hi = paired_interval(diffs)
    return [fmt_interval(m, lo, hi), verdict(lo, hi, n=len(diffs))]


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
                    *_paired_cells(rows, "ef", optimizer=opt),
                    _share(*(_val_by_seed(rows, optimizer=opt, variant=v) for v in ("sync", "async", "ef"))),
                    " / ".join(fmt(v) for v in (ps, pa, pe)), paper_rec])
    return markdown_table(["optimizer", "sync", "async", "async + EF", "gap", "noise floor",
                           "EF - sync, paired [95 %]", "EF verdict", "gap recovered [95 %]",
                           "paper sync / async / EF", "paper recovered"], out)


def _pct_interval(share: tuple[float, float, float]) -> str:
    return f" [{fmt_pct(share[1])}, {fmt_pct(share[2])}]" if math.isfinite(share[1]) else ""


def _share(sync: dict[int, float], delayed: dict[int, float], corrected: dict[int, float]) -> str:
    """The gap recovered with its bootstrap interval from at least ``VERDICT_SEEDS`` seeds (two seeds give a
    bootstrap of four resamples: no interval)."""
    share = share_interval(sync, delayed, corrected)
    n = len(sync.keys() & delayed.keys() & corrected.keys())
    return fmt_pct(share[0]) + (_pct_interval(share) if n >= VERDICT_SEEDS else "")


def _moe_table(rows: Rows) -> str:
    return _ef_table(rows, paper=lambda opt: PAPER_MOE if opt == "muon" else (None,) * 3) + (
        "\n\nThe paper's MoE numbers (10B MoE, 200B tokens, Muon presumed) are in the Muon row.")


def _tuned_rows(rows: Rows, variants: tuple[str, ...]) -> Rows:
    """The rows of a suite's tuned arms (``Suite.arms``): their sweeps and their reported seeds."""
    return [r for r in rows if r["variant"] in variants and "lr" in r]


def _reported(rows: Rows, **match: Any) -> dict[int, float]:
    """``{seed: final val loss}`` of a tuned arm's reported seeds (role ``best``)."""
    return _val_by_seed(rows, role="best", **match)


def _lr_cell(rows: Rows, **match: Any) -> str:
    return next((f"{r['lr']:g}" for r in rows if r.get("role") == "best"
                 and all(r.get(k) == v for k, v in match.items())), "-")


def _versus(rows: Rows, arm: str, baseline: str, **match: Any) -> list[str]:
    """``arm - baseline`` over their reported seeds: the mean with its 95 % t interval, and the verdict."""
    diffs = paired(_reported(rows, variant=arm, **match), _reported(rows, variant=baseline, **match))
    m, lo, hi = paired_interval(diffs)
    return [fmt_interval(m, lo, hi), verdict(lo, hi, n=len(diffs))]


def _retuned_momentum_table(rows: Rows) -> str:
    rows = _tuned_rows(rows, RETUNED)
    if not rows:
        return ""
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for m in MOMENTA:
            mine = [r for r in rows if r["optimizer"] == opt and r["x"] == m]
            out.append([opt, f"{m:g}", " / ".join(_lr_cell(mine, variant=v) for v in RETUNED),
                        *(fmt_mean(list(_reported(mine, variant=v).values())) for v in RETUNED),
                        *_versus(mine, RETUNED[1], RETUNED[0])])
    return "\n".join([
        "", "### Learning rate retuned at each momentum", "",
        ("Each momentum's sync and async arm sweeps its own rate (seed 0, the suite's grid, extended past an "
         "end while the best sits there); the losses are the other seeds at the chosen rate."), "",
        markdown_table(["optimizer", "momentum", "lr sync / async", "sync", "async", "async - sync, paired [95 %]",
                        "verdict"], out), "",
        cell_sweep_table(rows)])


def _authors_table(rows: Rows) -> str:
    """Ajanthan et al.'s arm against its baselines, per regime (2BW, PipeDream-8), every arm at its own rate."""
    rows = _tuned_rows(rows, AUTHOR_ARMS)
    if not rows:
        return ""
    out = []
    for x in dict.fromkeys(r["x"] for r in rows):
        mine = [r for r in rows if r["x"] == x]
        regime = f"{'PipeDream' if x == AUTHORS_DEPTH else '2BW'}, P = {x:g}"
        for arm in AUTHOR_ARMS:
            got = _reported(mine, variant=arm)
            out.append([regime, arm, _lr_cell(mine, variant=arm), fmt_mean(list(got.values())),
                        *(["", ""] if arm == "sync AdamW" else _versus(mine, arm, "sync AdamW"))])
    return "\n".join([
        "", f"### {AJANTHAN}, as the authors ran it", "",
        ("NAdamW (beta1 0.99, beta2 0.999, momentum_decay 0.004: torch's default, kept as the authors keep it, "
         "not scaled to the run length) on the stale gradients of weight stashing with no correction, against "
         "synchronous NAdamW, synchronous AdamW (their baseline) and AdamW + EF; every arm sweeps its own rate "
         "(seed 0) and the losses are the other seeds at the chosen rate. 2BW is the base run's one-step delay; "
         "PipeDream, P = 8 is their regime (delays 7..0) on the deep model of the `schedules` suite."), "",
        markdown_table(["regime", "arm", "lr", "final val loss", "arm - sync AdamW, paired [95 %]", "verdict"],
                       out), "",
        cell_sweep_table(rows)])


def _momentum_table(rows: Rows) -> str:
    retuned = _retuned_momentum_table(rows)
    rows = [r for r in rows if r["variant"] not in RETUNED]
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for m in MOMENTA:
            sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt, x=m)
            out.append([opt, f"{m:g}", fmt_mean(sync), fmt_mean(delayed), gap, noise,
                        *_paired_cells(rows, "async", optimizer=opt, x=m)])
    return markdown_table(["optimizer", "momentum", "sync", "async", "gap", "noise floor",
                           "async - sync, paired [95 %]", "verdict"], out) + retuned


def _mitigations_table(rows: Rows) -> str:
    """Per optimizer: sync, async, then each method at its untuned default and at its best sweep point (mean
    over seeds, gap recovered), with every sweep point (seed 0) and a best value still at the ladder's end."""
    authors = _authors_table(rows)
    rows = [r for r in rows if r["variant"] not in AUTHOR_ARMS]
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
            tried = knob_points(mine, opt, knob)
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
                           "best setting: loss", "gap recovered", "sweep (seed 0, final val loss)"], out) + authors


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
                        fmt_mean(delayed), fmt_mean(ef), gap, noise, *_paired_cells(mine, "ef"),
                        _share(*(_val_by_seed(mine, variant=v) for v in ("sync", "async", "ef")))])
    return markdown_table(["optimizer", "steps", "tokens / parameter (non-embedding)", "sync", "async",
                           "async + EF", "gap", "noise floor", "EF - sync, paired [95 %]", "EF verdict",
                           "gap recovered [95 %]"], out)


def _test_by_seed(rows: Rows, **match: Any) -> dict[int, float]:
    """``{seed: final test loss}`` of the rows matching ``match`` (``inf`` for a diverged run)."""
    return {r["seed"]: math.inf if r.get("final_test_loss") is None else r["final_test_loss"]
            for r in rows if all(r.get(k) == v for k, v in match.items())}


def _steps_table(rows: Rows) -> str:
    """Per optimizer and point: each arm at its own rate (reported seeds, test windows), the paired gaps with
    95 % intervals and the verdict, EF's recovered share, the gaps at the synchronous rate, and 2BW + EF against
    the best synchronous point of the whole axis."""
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == opt]
        xs = sorted({r["x"] for r in mine})
        at = {x: {v: _test_by_seed(mine, x=x, variant=v, role="best") for v in ("sync", "async", "ef")} for x in xs}
        synced = [x for x in xs if at[x]["sync"]]
        best_x = min(synced, key=lambda x: mean(list(at[x]["sync"].values()))) if synced else None
        best_steps = next((r["config"]["train"]["steps"] for r in mine if r["x"] == best_x), None)
        for x in xs:
            cell = at[x]
            first = next(r for r in mine if r["x"] == x)
            t = first["config"]["train"]
            lr = {v: next((f"{r['lr']:g}" for r in mine if r["x"] == x and r["variant"] == v and r["role"] == "best"),
                          "-") for v in ("sync", "async", "ef")}
            ef_diffs = paired(cell["ef"], cell["sync"])
            gap, ef_gap = paired_interval(paired(cell["async"], cell["sync"])), paired_interval(ef_diffs)
            at_sync = [fmt_interval(*paired_interval(paired(_test_by_seed(mine, x=x, variant=v, role="sync-lr")
                                                            or cell[v], cell["sync"]))) for v in ("async", "ef")]
            best_diffs = paired(cell["ef"], at[best_x]["sync"]) if best_x is not None else []
            best = paired_interval(best_diffs)
            out.append([opt, f"{t['steps']} ({t['batch_size']} x {t['seq_len']})", " / ".join(lr.values()),
                        *(fmt_mean(list(cell[v].values())) for v in ("sync", "async", "ef")),
                        fmt_interval(*gap), fmt_interval(*ef_gap), verdict(*ef_gap[1:], n=len(ef_diffs)),
                        _share(cell["sync"], cell["async"], cell["ef"]),
                        " / ".join(at_sync),
                        f"{fmt_interval(*best)} (sync at {best_steps} steps): "
                        f"{verdict(*best[1:], n=len(best_diffs), than='it')}"
                        if best_x is not None else "-"])
    return markdown_table(["optimizer", "steps (batch)", "lr sync / 2BW / 2BW + EF", "sync", "2BW", "2BW + EF",
                           "2BW gap [95 %]", "2BW + EF gap [95 %]", "2BW + EF verdict", "EF recovered [95 %]",
                           "gap at sync's lr: 2BW / 2BW + EF", "2BW + EF - best sync on the axis"], out)


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
          runs=_momentum_runs, table=_momentum_table, plots=(("momentum-gap", "gap"),), arms=_momentum_arms),
    Suite(name="mitigations", title="Mitigations of the one-step delay", optimizers=("adamw", "muon"),
          runs=_mitigation_runs, table=_mitigations_table,
          plots=(("mitigations-curves", "curves"), ("mitigations-recovered", "recovered")),
          knobs=mitigation_knobs(), arms=_authors_arms),
    Suite(name="schedules", title="PipeDream vs 2BW vs WPipe against pipeline depth", optimizers=("adamw", "muon"),
          runs=_schedule_runs, table=_schedules_table, plots=(("schedules-gap", "gap"),)),
    Suite(name="sensitivity", title="Batch size, learning rate and weight decay", optimizers=("adamw", "muon"),
          runs=_sensitivity_runs, table=_sensitivity_table),
    Suite(name="moe", title="Sync / async / async + EF on a small MoE", optimizers=("adamw", "muon"),
          runs=_sync_async_ef(ef=True, extra=lambda scale: {"model.preset": scale.moe_model}),
          table=_moe_table, plots=(("moe-curves", "curves"),)),
    Suite(name="horizon", title="The sync-async gap against the training horizon", optimizers=("adamw", "muon"),
          runs=_horizon_runs, table=_horizon_table, plots=(("horizon-gap", "horizon"),)),
    Suite(name="steps", title="The sync-async gap against the step count at fixed tokens, every arm tuned",
          optimizers=("muon", "adamw"), runs=lambda scale, lrs: [], table=_steps_table,
          plots=(("steps-gap", "steps"),), cells=_steps_cells),
)}
"""Suite name -> :class:`Suite`."""


def get_suite(name: str) -> Suite:
    """The suite ``name``, or a UserError naming the suites."""
    if name not in SUITES:
        close = difflib.get_close_matches(name, list(SUITES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"Invalid suite: {name!r}{hint}; suites: {', '.join(SUITES)}")
    return SUITES[name]
