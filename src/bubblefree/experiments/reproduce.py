"""``bubblefree reproduce SUITE``: sweep, run, tabulate and plot one of the paper's experiments.

Steps: (1) the synchronous learning-rate sweep of the suite's optimizers (``suites.sweep_runs``, extended
past an end of its grid while the best rate sits there: ``suites.sweep_extension``), (2) the
suite's runs at the chosen rates, (3) ``<out>/<suite>.md`` (the sweep, the table laid out like the paper's
with its numbers beside ours, the definitions, provenance) and the PNG plots. Every run leaves
``<out>/runs/<id>.json``; a re-run skips finished runs, so an interrupted suite continues where it stopped
and suites sharing runs (``optimizers`` and ``error-feedback``) share their results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bubblefree.errors import UserError
from bubblefree.experiments.plots import draw
from bubblefree.experiments.runner import commit, machine, pending, run_all
from bubblefree.experiments.scales import Scale, get_scale
from bubblefree.experiments.suites import (
    choose_lrs,
    get_suite,
    knob_best_runs,
    knob_extension,
    knob_sweep_runs,
    sweep_extension,
    sweep_runs,
    sweep_table,
)
from bubblefree.optim import OPTIMIZERS
from bubblefree.train.config import (apply_overrides, config_diff, config_from_dict, parse_override, read_toml,
                                     validate)
from bubblefree.train.loop import check_lengths

__all__ = ["default_jobs", "reproduce", "with_base_overrides"]

_DEFINITIONS = (
    "Final validation loss (nats/token), mean ± sample std over seeds. *gap* = mean(async) - mean(sync); "
    "*noise floor* = mean |sync(seed a) - sync(seed b)| over pairs of seeds: a gap below it is not an effect; "
    "*gap recovered* = (async - corrected) / (async - sync). Paper numbers: arXiv 2606.30634 via secondary "
    "sources (DESIGN.md section 2), 360M models on FineWeb-Edu, so compare signs and orderings, not values.")


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
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise UserError(f"Invalid jobs: {jobs!r} (must be an integer >= 1)")
    spec, sc = get_suite(suite), get_scale(scale, seeds=seeds)
    sc, changed = with_base_overrides(sc, config_file, overrides)
    jobs = jobs or default_jobs(sc.name)
    commit()  # record the commit of the code this process imported, before the tree can move on
    chosen = spec.optimizers if optimizers is None else tuple(optimizers)
    unknown = [o for o in chosen if o not in spec.optimizers]
    if unknown or not chosen:
        raise UserError(f"Invalid optimizers: {','.join(chosen)!r} (suite {suite} runs "
                         f"{', '.join(spec.optimizers)})")
    if sc.base.train.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"Invalid scale: {sc.name!r} needs a CUDA device and none is available")
    out = Path(out or f"results/{sc.name}")
    from tqdm.auto import tqdm

    sweep = sweep_runs(sc, chosen)
    # The suite's runs depend on the rates the sweep picks: until then the bar's total is an estimate made
    # at the default rates, set exactly once the sweep is done.
    todo = pending(sweep, out)
    estimate = pending(spec.runs(sc, {o: OPTIMIZERS[o].lr for o in chosen}), out) - todo
    tic = time.perf_counter()
    with tqdm(total=len(todo) + len(estimate), unit="run", desc=f"{suite} ({sc.name})", dynamic_ncols=True,
              disable=not progress) as bar:
        sweep_rows = run_all(sweep, out, bar=bar, jobs=jobs)
        while extension := sweep_extension(sc, sweep_rows):  # a best rate at an end: try past it
            bar.total += len(pending(extension, out))
            sweep_rows += run_all(extension, out, bar=bar, jobs=jobs)
        lrs = {o: choose_lrs(sweep_rows)[o] for o in chosen}
        runs = spec.runs(sc, lrs)
        knob_rows: list[dict[str, Any]] = []
        if spec.knobs:  # each method's own setting, swept at the chosen rate like the rate itself
            knob_runs = knob_sweep_runs(sc, lrs, spec.knobs)
            bar.total = bar.n + len(pending(runs + knob_runs, out))
            knob_rows = run_all(knob_runs, out, bar=bar, jobs=jobs)
            while extension := knob_extension(sc, lrs, spec.knobs, knob_rows):
                bar.total += len(pending(extension, out))
                knob_rows += run_all(extension, out, bar=bar, jobs=jobs)
            runs += knob_best_runs(sc, lrs, spec.knobs, knob_rows)
        bar.total = bar.n + len(pending(runs, out))
        bar.refresh()
        rows = run_all(runs, out, bar=bar, jobs=jobs)
    elapsed = time.perf_counter() - tic

    title = f"{spec.title}, scale {sc.name}"
    # The curves show each method at its best setting (its default and sweep points are in the table).
    plots = draw([r for r in rows if r.get("role") in (None, "best")], spec.plots, out, title=title)
    table_path = out / f"{suite}.md"
    command = command or f"reproduce({suite!r}, scale={sc.name!r})"
    table_path.write_text(_markdown(spec, sc, sweep_rows, rows + knob_rows, plots, elapsed, command, changed),
                          encoding="utf-8")
    (out / f"{suite}.json").write_text(json.dumps({"suite": suite, "scale": sc.name, "lrs": lrs,
                                                   "runs": sorted({r["id"] for r in rows + knob_rows + sweep_rows})},
                                                  indent=1) + "\n", encoding="utf-8")
    return {"table": table_path, "plots": plots, "lrs": lrs, "rows": rows, "sweep": sweep_rows, "knobs": knob_rows}


def _budget(spec, scale) -> list[str]:
    """The tuning budget of a suite whose methods have knobs, in words (the table lists the points tried)."""
    if not spec.knobs:
        return []
    n = len(spec.knobs[0].grid)
    return [(f"Tuning budget: each method's own setting gets the learning rate's protocol: {n} grid points at "
             f"seed 0 and full length, at the optimizer's chosen rate, extended one ladder step at a time past an "
             f"end while the best sits there (up to {scale.lr_extend} beyond each end, as the rate's sweep); the "
             f"best point and the untuned default then run every seed ({scale.seeds}). The best is chosen on seed 0, "
             f"which its mean includes, so it is optimistic by up to the noise floor."), ""]


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


def _markdown(spec, scale, sweep_rows, rows, plots, elapsed: float, command: str,
              changed: dict[str, tuple[Any, Any]]) -> str:
    base = scale.base
    run_time = sum(r["wall_time_s"] for r in {r["id"]: r for r in rows + sweep_rows}.values())
    commits = sorted({r["commit"] for r in rows + sweep_rows})
    # The suite's own runs, not the base run: `schedules` trains a deeper model at several depths.
    models = ", ".join(f"`{m}`" for m in sorted({r["config"]["model"]["preset"] for r in rows}))
    depths = ", ".join(str(p) for p in sorted({r["config"]["pipeline"]["stages"] for r in rows}))
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
        (f"Compute: {run_time / 60:.1f} min of runs in total ({len({r['id'] for r in rows + sweep_rows})} runs), "
         f"this invocation {elapsed / 60:.1f} min (finished runs are skipped)."), "",
        "## Learning-rate sweep (synchronous, seed 0, full length)", "", sweep_table(sweep_rows), "",
        "## Results", "", *_budget(spec, scale), spec.table(rows), "", _DEFINITIONS, "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"
