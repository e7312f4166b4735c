"""PNG figures of a suite: loss curves (sync / async / corrected) and the gap against a swept quantity.

matplotlib with the Agg backend (no display). Curves are the training loss averaged over seeds and smoothed
by a centred moving average over 5 logged points (validation is evaluated too rarely at small scales to draw
a curve); gaps are ``mean(variant) - mean(sync)`` at each ``x`` with the noise floor as a grey band.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bubblefree.experiments.tables import losses, mean, noise_floor

__all__ = ["draw"]

Rows = list[dict[str, Any]]


def _figure(n_panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), dpi=100, squeeze=False)
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return plt, fig, list(axes.flat)


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
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


def _horizon(rows: Rows, path: Path, title: str) -> None:
    """Top: gap of async and of async + EF against tokens per parameter, the noise floor as a band; bottom:
    the share of the gap EF recovers. One column per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bubblefree.experiments.tables import gap_recovered

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


def draw(rows: Rows, plots: Sequence[tuple[str, str]], out: str | Path, *, title: str) -> list[Path]:
    """Draw each ``(stem, kind)`` of ``plots`` (kind ``curves``, ``gap`` or ``horizon``) into ``out/<stem>.png``."""
    paths = []
    for stem, kind in plots:
        path = Path(out) / f"{stem}.png"
        if kind == "curves":
            _curves(rows, path, title)
        elif kind == "gap":
            xlabel = "pipeline depth P" if stem.startswith("schedules") else "momentum"
            _gaps(rows, path, title, xlabel)
        elif kind == "horizon":
            _horizon(rows, path, title)
        else:
            raise ValueError(f"Invalid plot kind: {kind!r} (expected 'curves', 'gap' or 'horizon')")
        paths.append(path)
    return paths
