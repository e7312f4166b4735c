"""Each suite's table: markdown from the rows of its finished runs (``sweeps.Rows``), built from the statistics and
formatting of ``experiments.tables``. A row that a suite under way lacks prints as ``-``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bubblefree.experiments.suite_runs import (
    AJANTHAN,
    AUTHOR_ARMS,
    AUTHORS_DEPTH,
    MOMENTA,
    RETUNED,
    mitigation_knobs,
)
from bubblefree.experiments.sweeps import (
    Rows,
    cell_sweep_table,
    knob_points,
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
    upper_bound,
    verdict,
)

__all__ = ["ARM_LABELS", "ef_table", "horizon_table", "mitigations_table", "moe_table", "momentum_table",
    "optimizers_table", "schedules_table", "sensitivity_table", "steps_table", "tuned_table"]


def _val_by_seed(rows: Rows, **match: Any) -> dict[int, float]:
    """``{seed: final validation loss}`` of the rows matching ``match`` (``inf`` for a diverged run)."""
    return {r["seed"]: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
            for r in rows if all(r.get(k) == v for k, v in match.items())}


def _paired_cells(rows: Rows, variant: str, **match: Any) -> list[str]:
    """``variant`` - sync over the seeds both have: the mean with its 95 % t interval, and the verdict."""
    diffs = paired(_val_by_seed(rows, variant=variant, **match), _val_by_seed(rows, variant="sync", **match))
    return [fmt_interval(*paired_interval(diffs)), verdict(diffs)]


def _gap_cells(rows: Rows, **match: Any) -> tuple[list[float], list[float], str, str]:
    sync, delayed = losses(rows, variant="sync", **match), losses(rows, variant="async", **match)
    return sync, delayed, fmt(mean(delayed) - mean(sync)), fmt(noise_floor(sync))


def optimizers_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        sync, delayed, gap, noise = _gap_cells(rows, optimizer=opt)
        ps, pa, _ = PAPER_360M.get(opt, (None, None, None))
        lr = next(r["config"]["optim"]["lr"] for r in rows if r["optimizer"] == opt)
        out.append([opt, f"{lr:g}", fmt_mean(sync), fmt_mean(delayed), gap, noise, fmt(ps), fmt(pa),
                    fmt(pa - ps) if ps and pa else "-"])
    return markdown_table(["optimizer", "lr", "sync", "async (2BW, d=1)", "gap", "noise floor",
                           "paper sync", "paper async", "paper gap"], out)


def ef_table(rows: Rows, paper: Callable[[str], tuple] = lambda opt: PAPER_360M.get(opt, (None,) * 3)) -> str:
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
    return f" [{fmt_pct(share[1])}, {fmt_pct(share[2])}]" if math.isfinite(share[1]) else " [unbounded]"


def _share(sync: dict[int, float], delayed: dict[int, float], corrected: dict[int, float]) -> str:
    """The gap recovered with its Fieller interval from at least ``VERDICT_SEEDS`` seeds ("unbounded" where the
    gap itself is not distinguishable from 0)."""
    share = share_interval(sync, delayed, corrected)
    n = len(sync.keys() & delayed.keys() & corrected.keys())
    return fmt_pct(share[0]) + (_pct_interval(share) if n >= VERDICT_SEEDS else "")


def moe_table(rows: Rows) -> str:
    return ef_table(rows, paper=lambda opt: PAPER_MOE if opt == "muon" else (None,) * 3) + (
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


def _versus(rows: Rows, arm: str, baseline: str, *, than: str = "sync", **match: Any) -> list[str]:
    """``arm - baseline`` over their reported seeds: the mean with its 95 % t interval, and the verdict."""
    diffs = paired(_reported(rows, variant=arm, **match), _reported(rows, variant=baseline, **match))
    return [fmt_interval(*paired_interval(diffs)), verdict(diffs, than=than)]


def _retuned_momentum_table(rows: Rows) -> str:
    rows = _tuned_rows(rows, RETUNED)
    if not rows:
        return ""
    def gap_by_seed(opt: str, m: float) -> dict[int, float]:
        mine = [r for r in rows if r["optimizer"] == opt and r["x"] == m]
        sync, delayed = (_reported(mine, variant=v) for v in RETUNED)
        return {s: delayed[s] - sync[s] for s in delayed.keys() & sync.keys()}

    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for m in MOMENTA:
            mine = [r for r in rows if r["optimizer"] == opt and r["x"] == m]
            # Whether momentum shrinks the gap is the paper's claim: the change from the lowest momentum, paired
            # by seed, so the seed-to-seed noise both gaps share cancels.
            change = paired_interval(paired(gap_by_seed(opt, m), gap_by_seed(opt, MOMENTA[0])))
            out.append([opt, f"{m:g}", " / ".join(_lr_cell(mine, variant=v) for v in RETUNED),
                        *(fmt_mean(list(_reported(mine, variant=v).values())) for v in RETUNED),
                        *_versus(mine, RETUNED[1], RETUNED[0]),
                        "" if m == MOMENTA[0] else fmt_interval(*change)])
    return "\n".join([
        "", "", "### Learning rate retuned at each momentum", "",
        ("Each momentum's sync and async arm sweeps its own rate (seed 0, the suite's grid, extended past an "
         "end while the best sits there); the losses are the other seeds at the chosen rate."), "",
        markdown_table(["optimizer", "momentum", "lr sync / async", "sync", "async", "async - sync, paired [95 %]",
                        "verdict", f"gap - gap at {MOMENTA[0]:g}, paired [95 %]"], out), "",
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
            # Each arm against the authors' baseline, and the authors' method against each other arm (its
            # difference from sync AdamW is already the first column of its own row).
            out.append([regime, arm, _lr_cell(mine, variant=arm), fmt_mean(list(got.values())),
                        *(["", ""] if arm == "sync AdamW" else _versus(mine, arm, "sync AdamW", than="sync AdamW")),
                        *(["", ""] if arm in (AJANTHAN, "sync AdamW") else _versus(mine, AJANTHAN, arm, than=arm))])
    return "\n".join([
        "", "", f"### {AJANTHAN}, as the authors ran it", "",
        ("NAdamW (beta1 0.99, beta2 0.999, momentum_decay 0.004: torch's default, kept as the authors keep it, "
         "not scaled to the run length) on the stale gradients of weight stashing with no correction, against "
         "synchronous NAdamW, synchronous AdamW (their baseline) and AdamW + EF; every arm sweeps its own rate "
         "(seed 0) and the losses are the other seeds at the chosen rate. 2BW is the base run's one-step delay; "
         "PipeDream, P = 8 is their regime (delays 7..0) on the deep model of the `schedules` suite."), "",
        markdown_table(["regime", "arm", "lr", "final val loss", "arm - sync AdamW, paired [95 %]", "verdict",
                        "Ajanthan et al. - arm, paired [95 %]", "verdict"], out), "",
        cell_sweep_table(rows)])


def momentum_table(rows: Rows) -> str:
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


def mitigations_table(rows: Rows) -> str:
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


def schedules_table(rows: Rows) -> str:
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        for depth in sorted({r["x"] for r in rows}):
            sync = losses(rows, optimizer=opt, x=depth, variant="sync")
            gaps = [fmt(mean(losses(rows, optimizer=opt, x=depth, variant=s)) - mean(sync))
                    for s in ("2bw", "pipedream", "wpipe")]
            out.append([opt, str(depth), fmt_mean(sync), *gaps, fmt(noise_floor(sync))])
    return markdown_table(["optimizer", "depth P", "sync", "2BW gap", "PipeDream gap", "WPipe gap", "noise floor"],
                          out)


def horizon_table(rows: Rows) -> str:
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


def steps_table(rows: Rows) -> str:
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
                        fmt_interval(*gap), fmt_interval(*ef_gap), verdict(ef_diffs),
                        _share(cell["sync"], cell["async"], cell["ef"]),
                        " / ".join(at_sync),
                        f"{fmt_interval(*best)} (sync at {best_steps} steps): "
                        f"{verdict(best_diffs, than='it')}"
                        if best_x is not None else "-"])
    return markdown_table(["optimizer", "steps (batch)", "lr sync / 2BW / 2BW + EF", "sync", "2BW", "2BW + EF",
                           "2BW gap [95 %]", "2BW + EF gap [95 %]", "2BW + EF verdict", "EF recovered [95 %]",
                           "gap at sync's lr: 2BW / 2BW + EF", "2BW + EF - best sync on the axis"], out)


def sensitivity_table(rows: Rows) -> str:
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


ARM_LABELS = {"async": "2BW", "ef": "2BW + EF", "2bw": "2BW", "2bw + EF": "2BW + EF", "pipedream": "PipeDream",
              "pipedream + EF": "PipeDream + EF"}
"""How a tuned table names an arm (``variant``)."""


def tuned_table(rows: Rows, *, shares: dict[str, str]) -> str:
    """A suite in its tuned form: per optimizer and point, every arm at its own rate (reported seeds, test windows)
    against sync at the same point: the paired difference with its 95 % interval, the 90 % interval the
    equivalence test reads, the one-sided 95 % bound ("at most this much worse"), the verdict at
    :data:`~bubblefree.experiments.tables.MARGIN`, and for a corrected arm (``shares``: corrected -> delayed
    variant) the gap it recovers with Fieller's interval."""
    out = []
    reported = [r for r in rows if r.get("role") == "best"]
    for opt in dict.fromkeys(r["optimizer"] for r in reported):
        mine = [r for r in reported if r["optimizer"] == opt]
        for x in dict.fromkeys(r["x"] for r in mine):
            at = [r for r in mine if r["x"] == x]
            sync = _test_by_seed(at, variant="sync")
            for variant in dict.fromkeys(r["variant"] for r in at):
                got = _test_by_seed(at, variant=variant)
                lr = _lr_cell(at, variant=variant)
                row = [opt, f"{x:g}", ARM_LABELS.get(variant, variant), lr,
                       f"{fmt_mean(list(got.values()))} ({len(got)})"]
                if variant == "sync":
                    out.append(row + [""] * 5)
                    continue
                diffs = paired(got, sync)
                share = (_share(sync, _test_by_seed(at, variant=shares[variant]), got)
                         if variant in shares else "")
                out.append(row + [fmt_interval(*paired_interval(diffs)), fmt_interval(*paired_interval(diffs, 0.90)),
                                  fmt(upper_bound(diffs)), verdict(diffs), share])
    return markdown_table(["optimizer", "point", "arm", "lr", "test loss (seeds)", "arm - sync, paired [95 %]",
                           "[90 %]", "at most (one-sided 95 %)", "verdict", "gap recovered [Fieller 95 %]"], out)
