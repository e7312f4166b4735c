"""PNG figures of a suite: loss curves (sync / async / corrected), the gap against a swept quantity, and the
share of the gap each method recovers.

matplotlib with the Agg backend (no display). Curves are the training loss averaged over seeds and smoothed
by a centred moving average over 5 logged points (validation is evaluated too rarely at small scales to draw
a curve); gaps are ``mean(variant) - mean(sync)`` at each ``x`` with the noise floor as a grey band.
A suite whose methods have a knob (``mitigations``) draws each method at its best setting in the curves, and
its untuned default beside its best in the bars.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bubblefree.experiments.tables import (
    gap_recovered,
    losses,
    mean,
    noise_floor,
    paired,
    paired_interval,
    share_interval,
)

__all__ = ["draw"]

Rows = list[dict[str, Any]]


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display). Imported on first use: matplotlib costs
    half a second, which a suite that draws nothing (a run, a report without figures) should not spend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(n_panels: int):
    plt = _pyplot()
    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), dpi=100, squeeze=False)
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return plt, fig, list(axes.flat)


def _save(plt, fig, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    fig.tight_layout(rect=rect)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def _smooth(y: np.ndarray, window: int = 5) -> np.ndarray:
    if len(y) < window:
        return y
    kernel = np.ones(window) / window
    padded = np.pad(y, (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(padded, kernel, mode="valid")


def _curves(rows: Rows, path: Path, title: str) -> None:
    rows = [r for r in rows if r.get("role") in (None, "best")]  # a method at its best setting only
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    plt, fig, axes = _figure(len(optimizers))
    for ax, opt in zip(axes, optimizers):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["optimizer"] == opt):
            runs = [r for r in rows if r["optimizer"] == opt and r["variant"] == variant and r["train_curve"]]
            n = min(len(r["train_curve"]) for r in runs) if runs else 0
            if n == 0:
                continue
            tokens = np.array([p[1] for p in runs[0]["train_curve"][:n]])
            loss = np.mean([[p[2] for p in r["train_curve"][:n]] for r in runs], axis=0)
            ax.plot(tokens, _smooth(loss), lw=1.2, label=f"{variant} (n={len(runs)})")
        ax.set_title(opt)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("train loss (smoothed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)


def _gaps(rows: Rows, path: Path, title: str, xlabel: str) -> None:
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    plt, fig, axes = _figure(len(optimizers))
    for ax, opt in zip(axes, optimizers):
        xs = sorted({r["x"] for r in rows if r["optimizer"] == opt})
        sync = {x: losses(rows, optimizer=opt, variant="sync", x=x) for x in xs}
        noise = np.array([noise_floor(sync[x]) for x in xs])
        if np.isfinite(noise).any():
            ax.fill_between(xs, -noise, noise, color="grey", alpha=0.25, label="noise floor")
        for variant in dict.fromkeys(r["variant"] for r in rows if r["optimizer"] == opt and r["variant"] != "sync"):
            gaps = [mean(losses(rows, optimizer=opt, variant=variant, x=x)) - mean(sync[x]) for x in xs]
            ax.plot(xs, gaps, "o-", lw=1.5, label=variant)
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_title(opt)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("final val loss - sync")
        if xlabel == "pipeline depth P":
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)


def _recovered(rows: Rows, path: Path, title: str) -> None:
    """Per optimizer, each method's gap recovered at its untuned default and at its best setting (mean over
    seeds, the setting in brackets), the noise floor as a share of the gap as a grey band around 0 and 100 %.
    Bars past the left edge are cut there and keep their value in the label (an untuned update EMA reached
    -1022 % at cpu scale)."""
    plt = _pyplot()

    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    methods = list(dict.fromkeys(r["variant"] for r in rows if r.get("role") in ("default", "best")))
    fig, axes = plt.subplots(1, len(optimizers), figsize=(5.2 * len(optimizers), 1.2 + 0.5 * len(methods)), dpi=100,
                             squeeze=False, sharey=True)
    lo, y = -60.0, np.arange(len(methods))
    for ax, opt in zip(axes[0], optimizers):
        mine = [r for r in rows if r["optimizer"] == opt]
        sync, delayed = losses(mine, variant="sync"), losses(mine, variant="async")
        gap = mean(delayed) - mean(sync)
        band = 100 * noise_floor(sync) / gap if gap > 0 else math.nan
        if math.isfinite(band):
            for centre in (0.0, 100.0):
                ax.axvspan(centre - band, centre + band, color="grey", alpha=0.2, lw=0)
        for offset, role, color, label in ((-0.2, "default", "C7", "untuned default"),
                                           (0.2, "best", "C0", "best setting")):
            pct, values = [], []
            for method in methods:
                got = [r for r in mine if r["variant"] == method and r.get("role") == role]
                pct.append(100 * gap_recovered(mean(sync), mean(delayed), mean(losses(got))))
                values.append(got[0]["value"] if got else None)
            ax.barh(y + offset, np.clip(np.nan_to_num(pct, nan=0.0), lo, None), height=0.4, color=color, label=label)
            for yi, p, value in zip(y + offset, pct, values):
                if math.isfinite(p):
                    ax.text(max(p, 0.0) + 2, yi, f"{p:.0f} % ({value:g})", va="center", fontsize=6)
        ax.axvline(0.0, color="black", lw=0.8)
        ax.axvline(100.0, color="black", lw=0.8, ls="--")
        ax.set_yticks(y, methods, fontsize=7)
        ax.set_xlim(lo, 150)
        ax.set_title(opt)
        ax.set_xlabel("gap recovered (%): 0 = async, 100 = sync")
        ax.grid(alpha=0.3, axis="x")
    axes[0][0].invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.suptitle(f"{title}\nshare of the async gap recovered (grey: noise floor)", fontsize=10)
    _save(plt, fig, path, rect=(0, 0.06, 1, 1))  # room for the legend below the panels


def _horizon(rows: Rows, path: Path, title: str) -> None:
    """Top: gap of async and of async + EF against tokens per parameter, the noise floor as a band; bottom:
    the share of the gap EF recovers. One column per optimizer."""
    plt = _pyplot()

    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = plt.subplots(2, len(optimizers), figsize=(4.4 * len(optimizers), 6.4), dpi=100, squeeze=False)
    for col, opt in enumerate(optimizers):
        mine = [r for r in rows if r["optimizer"] == opt]
        factors = sorted({r["x"] for r in mine})
        tpp = [next(r for r in mine if r["x"] == f)["tokens_per_param"] for f in factors]
        at = {f: {v: losses(mine, variant=v, x=f) for v in ("sync", "async", "ef")} for f in factors}
        noise = np.array([noise_floor(at[f]["sync"]) for f in factors])
        top, bottom = axes[0][col], axes[1][col]
        if np.isfinite(noise).any():
            top.fill_between(tpp, -noise, noise, color="grey", alpha=0.25, label="noise floor")
        for variant, label in (("async", "async (2BW)"), ("ef", "async + EF")):
            top.plot(tpp, [mean(at[f][variant]) - mean(at[f]["sync"]) for f in factors], "o-", lw=1.5, label=label)
        recovered = [100 * gap_recovered(mean(at[f]["sync"]), mean(at[f]["async"]), mean(at[f]["ef"]))
                     for f in factors]
        bottom.plot(tpp, recovered, "o-", lw=1.5, color="C1")
        bottom.axhline(100.0, color="black", lw=0.8, ls="--")
        top.axhline(0.0, color="black", lw=0.8)
        top.set_title(opt)
        top.set_ylabel("final val loss - sync")
        bottom.set_ylabel("gap recovered by EF (%)")
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xlabel("training tokens per parameter")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)


def _steps(rows: Rows, path: Path, title: str) -> None:
    """Top: the paired gap of 2BW and of 2BW + EF to sync (each at its own tuned rate, test windows, reported
    seeds) against the number of steps, the 95 % interval as a band; bottom: EF's share of the gap with its
    bootstrap interval. One column per optimizer."""
    plt = _pyplot()

    def by_seed(mine: Rows, x: float, variant: str) -> dict[int, float]:
        return {r["seed"]: math.inf if r.get("final_test_loss") is None else r["final_test_loss"]
                for r in mine if r["x"] == x and r["variant"] == variant and r.get("role") == "best"}

    reported = [r for r in rows if r.get("role") == "best"]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in reported))
    fig, axes = plt.subplots(2, len(optimizers), figsize=(4.4 * len(optimizers), 6.4), dpi=100, squeeze=False)
    for col, opt in enumerate(optimizers):
        mine = [r for r in reported if r["optimizer"] == opt]
        xs = sorted({r["x"] for r in mine})  # points with a reported run (a suite under way has fewer)
        steps = [next(r for r in mine if r["x"] == x)["config"]["train"]["steps"] for x in xs]
        at = {x: {v: by_seed(mine, x, v) for v in ("sync", "async", "ef")} for x in xs}
        top, bottom = axes[0][col], axes[1][col]
        for variant, label, color in (("async", "2BW", "C0"), ("ef", "2BW + EF", "C1")):
            got = np.array([paired_interval(paired(at[x][variant], at[x]["sync"])) for x in xs])
            top.plot(steps, got[:, 0], "o-", lw=1.5, color=color, label=label)
            top.fill_between(steps, got[:, 1], got[:, 2], color=color, alpha=0.2, lw=0)
        share = 100 * np.array([share_interval(at[x]["sync"], at[x]["async"], at[x]["ef"]) for x in xs])
        bottom.plot(steps, share[:, 0], "o-", lw=1.5, color="C1")
        bottom.fill_between(steps, share[:, 1], share[:, 2], color="C1", alpha=0.2, lw=0)
        bottom.axhline(100.0, color="black", lw=0.8, ls="--")
        top.axhline(0.0, color="black", lw=0.8)
        top.set_title(opt)
        top.set_ylabel("final test loss - sync (paired)")
        bottom.set_ylabel("gap recovered by EF (%)")
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xlim(min(steps) / 1.5, max(steps) * 1.5)  # also when a point has no interval yet (all NaN)
            ax.set_xlabel("optimizer steps (same tokens)")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.suptitle(f"{title}\nbands: 95 % intervals over the reported seeds", fontsize=10)
    _save(plt, fig, path)


def draw(rows: Rows, plots: Sequence[tuple[str, str]], out: str | Path, *, title: str) -> list[Path]:
    """Draw each ``(stem, kind)`` of ``plots`` (kind ``curves``, ``gap``, ``horizon``, ``recovered`` or
    ``steps``) into
    ``out/<stem>.png``."""
    paths = []
    if not rows:  # a suite under way whose reported runs have not begun: nothing to draw yet
        return paths
    for stem, kind in plots:
        path = Path(out) / f"{stem}.png"
        if kind == "curves":
            _curves(rows, path, title)
        elif kind == "gap":
            xlabel = "pipeline depth P" if stem.startswith("schedules") else "momentum"
            _gaps(rows, path, title, xlabel)
        elif kind == "horizon":
            _horizon(rows, path, title)
        elif kind == "recovered":
            _recovered(rows, path, title)
        elif kind == "steps":
            _steps(rows, path, title)
        else:
            raise ValueError(f"Invalid plot kind: {kind!r} (expected 'curves', 'gap', 'horizon', 'recovered' or "
                             f"'steps')")
        paths.append(path)
    return paths
