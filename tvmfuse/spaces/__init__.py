"""Spaces stage: the MetaSchedule design spaces of tvmfuse's fused kernels (chosen from the PrimFunc's shape) and the
default schedules of every kernel tuning does not improve."""

from tvmfuse.spaces.defaults import (ROW_DEFAULT, apply_default_schedules, default_kind, default_rule, default_rules,
                                     default_schedule)
from tvmfuse.spaces.table import classify, space_for

__all__ = ["ROW_DEFAULT", "apply_default_schedules", "classify", "default_kind", "default_rule", "default_rules",
           "default_schedule", "space_for"]
