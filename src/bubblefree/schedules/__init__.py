"""Pipeline schedules: the one table of schedules (:mod:`bubblefree.schedules.table`) and their per-partition
delays (:mod:`bubblefree.schedules.delays`)."""

from bubblefree.schedules.delays import n_partitions, parameter_delays, stage_delays, weight_versions
from bubblefree.schedules.table import (
    DISTRIBUTED_SCHEDULES,
    SCHEDULE_SPECS,
    SCHEDULES,
    SIMULATED_SCHEDULES,
    ScheduleSpec,
    get_schedule,
)

__all__ = ["DISTRIBUTED_SCHEDULES", "SCHEDULES", "SCHEDULE_SPECS", "SIMULATED_SCHEDULES", "ScheduleSpec",
           "get_schedule", "n_partitions", "parameter_delays", "stage_delays", "weight_versions"]
