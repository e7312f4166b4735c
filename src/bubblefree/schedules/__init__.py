"""Pipeline schedules: the one table of per-partition delays (:mod:`bubblefree.schedules.delays`)."""

from bubblefree.schedules.delays import SCHEDULES, n_partitions, parameter_delays, stage_delays, weight_versions

__all__ = ["SCHEDULES", "n_partitions", "parameter_delays", "stage_delays", "weight_versions"]
