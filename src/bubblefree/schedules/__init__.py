"""Pipeline schedules: the one table of schedules and their per-partition delays
(:mod:`bubblefree.schedules.delays`)."""

from bubblefree.schedules.delays import (
    SCHEDULE_SPECS,
    SCHEDULES,
    ScheduleSpec,
    get_schedule,
    n_partitions,
    parameter_delays,
    stage_delays,
    weight_versions,
)

__all__ = ["SCHEDULES", "SCHEDULE_SPECS", "ScheduleSpec", "get_schedule", "n_partitions", "parameter_delays",
           "stage_delays", "weight_versions"]
