"""``bubblefree reproduce SUITE``: sweep, run, tabulate and plot one of the paper's experiments.

Steps: (1) the synchronous learning-rate sweep of the suite's optimizers (``sweeps.sweep_runs``, extended
past an end of its grid while the best rate sits there: ``sweeps.sweep_extension``), (2) the
suite's runs at the chosen rates, (3) ``<out>/<suite>.md`` (the sweep, the table laid out like the paper's
with its numbers beside ours, the definitions, provenance) and the PNG plots. Every run leaves
``<out>/runs/<id>.json``; a re-run skips finished runs, so an interrupted suite continues where it stopped
and suites sharing runs (``optimizers`` and ``error-feedback``) share their results.

:func:`tables` rebuilds the tables of ``<suite>.md`` from a results folder's JSON alone, without running
anything: ``python -m bubblefree.docs`` splices them into docs/ (docs/results.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from bubblefree.config import apply_overrides, config_diff, config_from_dict, parse_override, read_toml, validate
from bubblefree.errors import UserError
from bubblefree.experiments.order import gather
from bubblefree.experiments.plots import draw
from bubblefree.experiments.runner import Run, commit, machine, pending, run_all, run_id
from bubblefree.experiments.scales import Scale, get_scale
from bubblefree.experiments.suites import Suite, get_suite
from bubblefree.experiments.sweeps import (
    CHOICE_SEED,
    cell_report_runs,
    cell_sweep_runs,
    cell_sweep_table,
    sweep_runs,
    sweep_table,
)
from bubblefree.experiments.tables import MARGIN
from bubblefree.optim import OPTIMIZERS
from bubblefree.train.folders import check_ours, hold
from bubblefree.train.loop import check_lengths

__all__ = ["Recorded", "default_jobs", "dry_run", "recorded", "report", "reproduce", "suite_tables", "tables",
           "with_base_overrides"]

Rows = list[dict[str, Any]]

def _definitions(loss: str = "validation") -> str:
    """The notes under a suite's table; ``loss``: which windows its losses are measured on."""
    return (
        f"Final {loss} loss (nats per token; at the long scale a token is a byte), mean ± sample std over seeds. "
        "*gap* = mean(async) - mean(sync); "
        "*noise floor* = mean |sync(seed a) - sync(seed b)| over pairs of seeds: a gap below it is not an effect; "
        "*gap recovered* = (async - corrected) / (async - sync). Paper numbers: arXiv 2606.30634 via secondary "
        "sources (docs/spec.md section 8), 360M models on FineWeb-Edu, so compare signs and orderings, not values.")


def default_jobs(scale: str) -> int:
    """Runs at once: one per core at the CPU scales (each run uses one thread), one at ``gpu`` (one device)."""
    return 1 if scale == "gpu" else max(1, os.cpu_count() or 1)


def reproduce(suite: str, *, scale: str = "cpu", out: str | Path | None = None, seeds: int | None = None,
              optimizers: tuple[str, ...] | None = None, progress: bool = True,
              command: str = "", jobs: int | None = None, config_file: str | Path | None = None,
              overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``suite`` at ``scale`` into ``out`` (default ``results/<scale>``); return paths and the chosen rates.

    ``seeds`` replaces the scale's seed count; ``optimizers`` restricts the suite to a subset of its own;
    ``command`` is recorded in the table (the CLI passes its command line); ``jobs`` runs that many runs at
    once (default :func:`default_jobs`). ``config_file`` (TOML ``[section]`` tables) then ``overrides``
    (``section.key=value``) change the scale's base run, so the study runs on the user's data, model, length
    ...; every run of the suite is built from that base as usual, the changed keys enter each run's id with
    its config, and the table lists them.
    Raises UserError (a ValueError) for an unknown suite, scale or optimizer, an invalid key or value (before
    any run starts), or ``gpu`` without a GPU.
    """
    commit()  # record the commit of the code this process imported, before the tree can move on
    spec, sc, chosen, changed, out, jobs = _setup(suite, scale, out, seeds, optimizers, jobs, config_file, overrides)
    if sc.base.train.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"Invalid scale: {sc.name!r} needs a CUDA device and none is available")
    # A results folder, or a new or empty one (work/ alone: a suite's lock, from a suite stopped at its setup).
    check_ours(out, what="--out", ours=("work",), marker="runs")
    # One process per suite and results folder (two suites may fill one folder at once: their runs are
    # separate files, and a run both need is trained once, the second refused by the run's own lock).
    with hold(out / "work" / suite, what=f"--out (suite {suite})", create=True):
        _check_record(out, suite, sc, chosen, changed)
        return _run_suite(suite, spec, sc, chosen, changed, out=out, jobs=jobs, progress=progress, command=command)


def _setup(suite, scale, out, seeds, optimizers, jobs, config_file, overrides):
    """The checked arguments of :func:`reproduce` and :func:`dry_run`: ``(suite, scale, optimizers, base-run
    changes, results folder, jobs)``."""
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise UserError(f"Invalid jobs: {jobs!r} (must be an integer >= 1)")
    spec, sc = get_suite(suite), get_scale(scale, seeds=seeds)
    sc, changed = with_base_overrides(sc, config_file, overrides)
    chosen = spec.optimizers if optimizers is None else tuple(optimizers)
    unknown = [o for o in chosen if o not in spec.optimizers]
    if unknown or not chosen:
        raise UserError(f"Invalid optimizers: {','.join(chosen)!r} (suite {suite} runs "
                         f"{', '.join(spec.optimizers)})")
    return spec, sc, chosen, changed, Path(out or f"results/{sc.name}"), jobs or default_jobs(sc.name)


def dry_run(suite: str, *, scale: str = "cpu", out: str | Path | None = None, seeds: int | None = None,
            optimizers: tuple[str, ...] | None = None, jobs: int | None = None,
            config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """What :func:`reproduce` with these arguments would still run, running nothing (``--dry-run``): the
    budget to check before a study that spans sessions.

    The suite's runs are walked in :func:`reproduce`'s order, a batch whose runs have all finished read from
    ``<out>/runs``. A batch with a run still to come stands in whole with losses that make every sweep in it
    choose the centre of its grid (the registry's rate), and from then on no extension past a grid's end is
    counted: ``to_run`` is a lower bound, exact where every sweep has finished or lands inside its grid. Each
    run to come is timed by the median ``wall_time_s`` of the finished runs under ``<out>/runs`` of the same
    model, steps, batch and schedule (any suite's: a run's time depends on its shape, not its study);
    ``minutes`` sums those it could time. Returns ``{"finished", "to_run" (ids, in order), "minutes",
    "untimed", "jobs"}``.
    """
    spec, sc, chosen, _, out, jobs = _setup(suite, scale, out, seeds, optimizers, jobs, config_file, overrides)
    finished, to_run, guessed = set(), {}, False

    def load(runs: list[Run], phase: str) -> Rows:
        nonlocal guessed
        if phase == "extension" and guessed:  # past the end of a grid whose best is not known yet: not counted
            return []
        lacking = pending(runs, out)
        finished.update(run_id(r) for r in runs if run_id(r) not in lacking)
        to_run.update((run_id(r), r) for r in runs if run_id(r) in lacking)
        if not lacking:
            return run_all(runs, out)  # only reads the finished runs' JSON
        guessed = True  # a choice made on part of a sweep would be no truer than one made on none of it
        return [_stand_in(r) for r in runs]

    gather(spec, sc, chosen, load)
    times: dict[tuple, list[float]] = {}
    for path in (out / "runs").glob("*.json") if (out / "runs").is_dir() else ():
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("wall_time_s"):
            times.setdefault(_shape(record["config"]), []).append(record["wall_time_s"])
    minutes, untimed = 0.0, 0
    for run in to_run.values():
        if got := sorted(times.get(_shape(dataclasses.asdict(run.config)), ())):
            minutes += got[len(got) // 2] / 60
        else:
            untimed += 1
    return {"finished": len(finished), "to_run": list(to_run), "minutes": minutes, "untimed": untimed,
            "jobs": jobs}


def _stand_in(run: Run) -> dict[str, Any]:
    """The row of a run still to come, for :func:`dry_run`: its loss is lowest at the registry's rate."""
    loss = 1e6 + abs(math.log(run.config.optim.lr / OPTIMIZERS[run.optimizer].lr))
    return {"final_val_loss": loss, "optimizer": run.optimizer, "variant": run.variant, "x": run.x,
            "seed": run.seed, **run.tags}


def _shape(config: dict[str, Any]) -> tuple:
    """What a run's time depends on (from its config as a dict: a run's JSON or ``dataclasses.asdict``)."""
    model, train, pipeline = config["model"], config["train"], config["pipeline"]
    return (model["preset"], train["steps"], train["batch_size"], train["seq_len"], pipeline["schedule"],
            pipeline["stages"])


def _run_suite(suite: str, spec: Suite, sc: Scale, chosen: tuple[str, ...], changed: dict[str, Any], *, out: Path,
               jobs: int, progress: bool, command: str) -> dict[str, Any]:

    # The suite's runs depend on the rates the sweep picks: until then the bar's total is an estimate made
    # at the default rates, set exactly once the sweep is done.
    if (cells := spec.tuned_cells(sc)) is not None:  # every cell's sweep and reported seeds (extensions added)
        todo = pending(cell_sweep_runs(sc, chosen, cells), out)
        estimate = pending(cell_report_runs(sc, chosen, cells, _guess(sc, chosen, cells)), out)
    else:
        todo = pending(sweep_runs(sc, chosen), out)
        estimate = pending(spec.runs(sc, {o: OPTIMIZERS[o].lr for o in chosen}), out) - todo
    tic = time.perf_counter()
    with tqdm(total=len(todo) + len(estimate), unit="run", desc=f"{suite} ({sc.name})", dynamic_ncols=True,
              disable=not progress) as bar:
        def execute(runs: list[Run], phase: str) -> Rows:
            if phase == "extension":
                bar.total += len(pending(runs, out))
            elif phase == "cells":  # a point's sweep or its reported seeds: counted at the default rates
                bar.total += len(pending(runs, out) - todo - estimate)
            elif phase == "knobs":  # the suite's runs at the chosen rates follow; counted once known
                bar.total = bar.n + len(pending(runs, out))
            elif phase == "suite":
                bar.total = bar.n + len(pending(runs, out))
                bar.refresh()
            return run_all(runs, out, bar=bar, jobs=jobs)

        def rates_chosen(lrs: dict[str, float]) -> None:  # an interrupted suite's tables can be rebuilt
            _write_record(out, suite, sc, lrs, chosen, changed, finished=False)

        sweep_rows, lrs, rows, knob_rows = gather(spec, sc, chosen, execute, rates_chosen)
    elapsed = time.perf_counter() - tic

    title = f"{spec.title}, scale {sc.name}"
    plots = draw(rows, spec.plots_at(sc), out, title=title)
    table_path = out / f"{suite}.md"
    command = command or f"reproduce({suite!r}, scale={sc.name!r})"
    table_path.write_text(_markdown(spec, sc, sweep_rows, rows + knob_rows, plots, elapsed, command, changed),
                          encoding="utf-8")
    _write_record(out, suite, sc, lrs, chosen, changed, finished=True,
                  runs=sorted({r["id"] for r in rows + knob_rows + sweep_rows}))
    return {"table": table_path, "plots": plots, "lrs": lrs, "rows": rows, "sweep": sweep_rows, "knobs": knob_rows}


def _guess(sc: Scale, optimizers: tuple[str, ...], cells: list) -> Rows:
    """Stand-in sweep rows that choose every cell's registry rate: the bar's first estimate of a tuned suite."""
    return [{"role": "sweep", "optimizer": o, "variant": c.variant, "x": c.x, "lr": OPTIMIZERS[o].lr,
             "final_val_loss": 0.0} for c in cells for o in optimizers]


def _check_record(out: Path, suite: str, sc: Scale, optimizers: tuple[str, ...],
                  changed: dict[str, tuple[Any, Any]]) -> None:
    """Refuse to run where the suite's record in ``out`` is another study's (other scale, seeds or base run):
    :func:`_write_record` would replace it, and the tables would lose what only the old record tabulates (its
    runs' JSON stays, but nothing would read it). The one change allowed is more seeds of the same study for
    every optimizer it records: the new record tabulates all the old one did, and more."""
    try:
        before = json.loads((out / f"{suite}.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return
    base = {k: b for k, (a, b) in changed.items()}
    if _same_study(before, sc, base):
        return
    others = [o for o in before.get("optimizers", ()) if o not in optimizers]
    grows = (not others and (before.get("scale"), before.get("base_changes") or {}) == (sc.name, base)
             and sc.seeds > before.get("seeds", 0))
    if not grows:
        was = f"scale {before.get('scale')}, {before.get('seeds')} seed(s)" + (
            f", base run changed ({', '.join(before['base_changes'])})" if before.get("base_changes") else "")
        raise UserError(f"Invalid --out: {out} holds the {suite} suite of {', '.join(before.get('optimizers', ()))} "
                        f"at {was}; this command (scale {sc.name}, {sc.seeds} seed(s)"
                        f"{', base run changed' if base else ''}) would replace that record: run it with the same "
                        f"settings, or give it another --out")


def _same_study(record: dict[str, Any], sc: Scale, base_changes: dict[str, Any]) -> bool:
    """Whether a suite's record (``<suite>.json``) is of the same study: scale, seeds and base run."""
    return (record.get("scale"), record.get("seeds"), record.get("base_changes") or {}) == (
        sc.name, sc.seeds, base_changes)


def _write_record(out: Path, suite: str, sc: Scale, lrs: dict[str, float], optimizers: tuple[str, ...],
                  changed: dict[str, tuple[Any, Any]], *, finished: bool, runs: list[str] = ()) -> None:
    """``<out>/<suite>.json``: what :func:`tables` needs to rebuild the tables from the runs' JSON (scale, seeds,
    optimizers, base-run changes, chosen rates). Written once the rates are chosen (``finished`` false: the
    suite's runs are under way) and again at the end with the ids of every run it used. A folder where the
    same suite ran before at the same scale, seeds and base run keeps its optimizers too (``--optimizers muon``
    then ``--optimizers adamw`` records both), in the suite's order."""
    path, base_changes = out / f"{suite}.json", {k: b for k, (a, b) in changed.items()}
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        before = {}
    if _same_study(before, sc, base_changes):
        lrs, runs = {**before.get("lrs", {}), **lrs}, sorted({*before.get("runs", ()), *runs})
        kept = {*before.get("optimizers", ()), *optimizers}
        optimizers = tuple(o for o in get_suite(suite).optimizers if o in kept)
    record = {"suite": suite, "scale": sc.name, "lrs": lrs, "optimizers": list(optimizers), "seeds": sc.seeds,
              "base_changes": base_changes, "finished": finished, "runs": list(runs)}
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _budget(spec, scale) -> list[str]:
    """The tuning budget of a suite whose methods have knobs or whose arms are tuned, in words (the table lists
    the points tried)."""
    if spec.tuned_cells(scale) is not None:
        n = len(scale.lr_factors)
        more = (f"; {scale.verdict_seeds} ({CHOICE_SEED + 1}-{CHOICE_SEED + scale.verdict_seeds}) for the arms a "
                f"verdict is read from" if scale.verdict_seeds > scale.seeds else "")
        return [(f"Tuning budget: every arm at every point sweeps its own learning rate on the same grid ({n} "
                 f"rates, extended past an end while the best sits there, up to {scale.lr_extend} beyond each end) "
                 f"at seed {CHOICE_SEED}, choosing on the validation windows; the losses below are the other seeds "
                 f"({scale.seeds}: {CHOICE_SEED + 1}-{CHOICE_SEED + scale.seeds}{more}) at the chosen rate, on the "
                 f"test windows (`train.test_split`), so no reported run chose anything. Differences are means of "
                 f"paired per-seed differences with t intervals: 95 % (excluding 0: worse / better), 90 % (inside "
                 f"± {MARGIN:g}, the margin declared before the runs: equivalent), and the one-sided 95 % bound; "
                 f"a share of the gap recovered has Fieller's 95 % interval."), ""]
    arms = ([f"The tuned arms below the main table each sweep their own rate on the synchronous sweep's grid around "
             f"their optimizer's default (seed {CHOICE_SEED}, extended past an end while the best sits there, up to "
             f"{scale.lr_extend} beyond each end); their losses are the other seeds ({scale.seeds}) at the chosen "
             f"rate, on the validation windows.", ""] if spec.arms else [])
    if not spec.knobs:
        return arms
    n = len(spec.knobs[0].grid)
    return [(f"Tuning budget: each method's own setting gets the learning rate's protocol: {n} grid points at "
             f"seed 0 and full length, at the optimizer's chosen rate, extended one ladder step at a time past an "
             f"end while the best sits there (up to {scale.lr_extend} beyond each end, as the rate's sweep); the "
             f"best point and the untuned default then run every seed ({scale.seeds}). The best is chosen on seed 0, "
             f"which its mean includes, so it is optimistic by up to the noise floor."), "", *arms]


def with_base_overrides(sc: Scale, config_file: str | Path | None,
                        overrides: list[str] | tuple[str, ...]) -> tuple[Scale, dict[str, tuple[Any, Any]]]:
    """``sc`` with its base run changed by ``config_file`` then ``overrides``, validated as a training run's
    config is (with the data file checked to exist), and ``{key: (scale's value, new value)}`` of the change."""
    if config_file is None and not overrides:
        return sc, {}
    base = sc.base
    if config_file is not None:
        base = config_from_dict(read_toml(config_file), base=base, origin=f"config file {config_file}")
    base = validate(apply_overrides(base, dict(parse_override(base, text) for text in overrides)))
    check_lengths(base)
    source = base.data.source
    if source != "embedded" and not source.startswith("hf:") and not Path(source).expanduser().exists():
        raise UserError(f"Data path not found: {source}")
    return dataclasses.replace(sc, base=base), config_diff(sc.base, base)


def _markdown(spec, scale, sweep_rows, rows, plots, elapsed: float | None, command: str,
              changed: dict[str, tuple[Any, Any]], progress: str = "") -> str:
    base = scale.base
    run_time = sum(r["wall_time_s"] for r in {r["id"]: r for r in rows + sweep_rows}.values())
    commits = sorted({r["commit"] for r in rows + sweep_rows})
    # The suite's own runs, not the base run: `schedules` trains a deeper model at several depths.
    # (A suite under way may have only sweep runs so far.)
    models = ", ".join(f"`{m}`" for m in sorted({r["config"]["model"]["preset"] for r in rows or sweep_rows}))
    depths = ", ".join(str(p) for p in sorted({r["config"]["pipeline"]["stages"] for r in rows or sweep_rows}))
    lines = [
        f"# {spec.title}", "",
        (f"Scale `{scale.name}`: model {models}, {base.train.steps} steps of {base.train.batch_size} x "
         f"{base.train.seq_len} tokens (the base run), pipeline depth {depths} (simulated), "
         f"{scale.seeds} seed(s) (sync baselines at least 2)."),
        *([f"Base run changed by the command line: "
           f"{', '.join(f'`{k}` {a!r} -> {b!r}' for k, (a, b) in changed.items())} (every run below is built "
           f"on it; the changed keys are part of each run's id)."] if changed else []),
        (f"Command: `{command}`; "
         f"commit(s) of the runs: {', '.join(commits)}; this table written at commit {commit()} on {machine()}."),
        (f"Compute: {run_time / 60:.1f} min of runs in total ({len({r['id'] for r in rows + sweep_rows})} runs)"
         + (f", this invocation {elapsed / 60:.1f} min (finished runs are skipped)." if elapsed is not None else
            ", rebuilt from the runs' JSON (nothing ran).")), "",
        suite_tables(spec, scale, sweep_rows, rows) + progress,
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def suite_tables(spec, scale, sweep_rows: Rows, rows: Rows, *, heading: str = "##") -> str:
    """The learning-rate sweep and the suite's table (``rows``: the suite's and the knob sweep's) with the
    tuning budget and the definitions: the part of ``<suite>.md`` that depends on the runs' results alone
    (no commit, machine or timing), under ``heading``-level titles."""
    tuned = spec.tuned_cells(scale) is not None
    sweep = (f"{heading} Learning-rate sweep of every arm (seed {CHOICE_SEED}, full length, validation windows)",
             "", cell_sweep_table(sweep_rows)) if tuned else (
        f"{heading} Learning-rate sweep (synchronous, seed 0, full length)", "", sweep_table(sweep_rows))
    # A suite's table titles its own parts (###) one level below the default "## Results"; nest them under
    # ``heading``'s "Results" wherever the tables are embedded deeper (docs/results.md uses ####).
    table = re.sub(r"(?m)^### ", f"{heading}# ", spec.tabulate(scale, rows))
    return "\n".join([
        *sweep, "",
        f"{heading} Results", "", *_budget(spec, scale), table, "",
        _definitions("test" if tuned else "validation"), ""])


class Recorded(NamedTuple):
    """A suite as its results folder records it (:func:`recorded`)."""

    spec: Suite
    scale: Scale
    changed: dict[str, tuple[Any, Any]]
    """``{key: (scale's value, value run)}``: the base-run changes of ``--config`` / ``--set``."""
    sweep: Rows
    lrs: dict[str, float]
    rows: Rows
    knobs: Rows
    progress: str
    """Empty for a finished suite, else a line counting the runs still to come."""


def recorded(folder: Path, suite: str, *, partial: bool) -> Recorded:
    """Everything the tables and plots of ``suite`` need, read from ``<folder>/<suite>.json`` and the runs' JSON
    (``partial``: a suite still under way, whose missing runs are left out and counted)."""
    try:
        record = json.loads((folder / f"{suite}.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"Invalid results folder: {folder} holds no {suite}.json (run bubblefree reproduce "
                        f"{suite} --out {folder})") from None
    spec, scale = get_suite(suite), get_scale(record["scale"], seeds=record.get("seeds"))
    sc = scale
    if record.get("base_changes"):  # the base run as reproduce --config/--set changed it
        sc = dataclasses.replace(sc, base=apply_overrides(sc.base, record["base_changes"]))
    planned, missing = set(), set()

    def load(runs: list[Run], phase: str) -> Rows:
        lacking = pending(runs, folder)
        if lacking and not partial:
            raise UserError(f"Invalid results folder: {folder} lacks {len(lacking)} run(s) of {suite}, e.g. "
                            f"{min(lacking)}")
        planned.update(map(run_id, runs))
        missing.update(lacking)
        return run_all([r for r in runs if run_id(r) not in lacking], folder)  # only reads finished runs' JSON

    optimizers = tuple(record.get("optimizers") or spec.optimizers)
    sweep_rows, lrs, rows, knob_rows = gather(spec, sc, optimizers, load)
    progress = (f"\n*In progress: {len(planned) - len(missing)} of {len(planned)} runs finished; "
                f"`bubblefree reproduce {suite} --scale {sc.name} --optimizers {','.join(optimizers)}` with this "
                f"results folder as `--out` continues it (finished runs are skipped).*\n") if missing else ""
    return Recorded(spec=spec, scale=sc, changed=config_diff(scale.base, sc.base), sweep=sweep_rows, lrs=lrs,
                     rows=rows, knobs=knob_rows, progress=progress)


def tables(folder: str | Path, suite: str, *, heading: str = "##", partial: bool = False) -> str:
    """:func:`suite_tables` of ``suite`` rebuilt from ``<folder>/<suite>.json`` and ``<folder>/runs/*.json``.

    The scale, optimizers and seeds are those the suite ran with (recorded in ``<suite>.json``); the runs are
    found the way :func:`reproduce` finds them. A missing run is a UserError naming it, or with ``partial``
    (a suite still under way) a ``-`` in the table and a closing line that counts the runs still to come.
    """
    got = recorded(Path(folder), suite, partial=partial)
    return suite_tables(got.spec, got.scale, got.sweep, got.rows + got.knobs, heading=heading) + got.progress


def report(folder: str | Path, suite: str, *, command: str = "") -> dict[str, Any]:
    """Rewrite ``<folder>/<suite>.md`` and its plots from the runs finished so far, running nothing: the
    picture of a suite under way (``bubblefree reproduce SUITE --report``). Returns what :func:`reproduce`
    returns."""
    folder = Path(folder)
    got = recorded(folder, suite, partial=True)
    plots = draw(got.rows, got.spec.plots_at(got.scale), folder, title=f"{got.spec.title}, scale {got.scale.name}")
    table = folder / f"{suite}.md"
    table.write_text(_markdown(got.spec, got.scale, got.sweep, got.rows + got.knobs, plots, None,
                               command or f"report({str(folder)!r}, {suite!r})", got.changed, got.progress),
                     encoding="utf-8")
    return {"table": table, "plots": plots, "lrs": got.lrs, "rows": got.rows, "sweep": got.sweep,
            "knobs": got.knobs}
