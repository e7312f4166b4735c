"""Each schedule's delays per model partition, from the schedule table (:mod:`bubblefree.schedules.table`, whose
docstring holds their definition and values), and per parameter for ``DelayedOptimizer``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bubblefree.schedules.table import ScheduleSpec, get_schedule

if TYPE_CHECKING:  # annotations only: `bubblefree --help` and the CLI's signal handling start before torch loads
    import torch
    from torch import nn

__all__ = ["n_partitions", "parameter_delays", "stage_delays", "weight_versions"]


def _check(schedule: str, n_stages: int) -> ScheduleSpec:
    spec = get_schedule(schedule)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"Invalid n_stages: {n_stages!r} (must be an integer >= 1)")
    return spec


def n_partitions(schedule: str, n_stages: int) -> int:
    """How many consecutive pieces the model is cut into: ``2P`` for ``wpipe``, ``P`` otherwise."""
    return _check(schedule, n_stages).partitions * n_stages


def stage_delays(schedule: str, n_stages: int) -> list[int]:
    """Delay (in optimizer steps) of each of the ``n_partitions(schedule, n_stages)`` model partitions.

    >>> stage_delays("2bw", 3), stage_delays("pipedream", 3), stage_delays("wpipe", 2)
    ([1, 1, 1], [2, 1, 0], [1, 1, 0, 0])
    """
    return _check(schedule, n_stages).delays(n_stages)


def weight_versions(schedule: str, n_stages: int) -> list[int]:
    """Weight versions each partition holds (live + stashed): ``d + 1`` (2BW 2, PipeDream ``P - s``, sync 1)."""
    return [d + 1 for d in stage_delays(schedule, n_stages)]


def parameter_delays(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: str | Sequence[int],
                     n_stages: int, param_stages: Mapping[str, int]) -> list[int]:
    """Per-parameter delays in the optimizer's order (flattened ``param_groups``), for ``DelayedOptimizer``.

    ``schedule`` is a schedule name or an explicit list of per-partition delays (one per partition:
    ``n_stages`` entries, or ``2 * n_stages`` for ``wpipe``-style splits). ``param_stages`` maps each
    parameter name of ``model`` to its partition (``models.split.param_stages(model, n_partitions)``); a
    parameter registered under several names (tied weights) needs only one of them.
    """
    if isinstance(schedule, str):
        delays = stage_delays(schedule, n_stages)
    else:
        delays = [int(d) for d in schedule]
        if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
            raise ValueError(f"Invalid n_stages: {n_stages!r} (must be an integer >= 1)")
        if len(delays) not in (n_stages, 2 * n_stages):
            raise ValueError(f"Invalid stage delays: {delays} (expected {n_stages} entries, one per stage)")
        if any(d < 0 for d in delays):
            raise ValueError(f"Invalid stage delays: {delays} (must be >= 0)")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            known = [n for n in names.get(id(p), []) if n in param_stages]
            if not known:
                raise ValueError(f"Invalid param_stages: no stage for the optimizer parameter of shape "
                                 f"{tuple(p.shape)} (model names: {names.get(id(p), ['<not in the model>'])})")
            stage = param_stages[known[0]]
            if not 0 <= stage < len(delays):
                raise ValueError(f"Invalid param_stages[{known[0]!r}]: {stage} (must be in [0, {len(delays)}))")
            out.append(delays[stage])
    return out
