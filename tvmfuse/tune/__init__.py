"""Tune stage: MetaSchedule with the XGBoost cost model over every static-shape kernel (each kernel's default
measured first, so tuning never ends slower), the templates' knobs, local or RPC measurement, progress."""

from tvmfuse.tune.baseline import kernels_keeping_default, measure_baselines
from tvmfuse.tune.progress import TaskProgress, kernel_records
from tvmfuse.tune.search import TuningInterrupted, tunable_tasks, tune
from tvmfuse.tune.templates import tune_templates

__all__ = ["TaskProgress", "TuningInterrupted", "kernel_records", "kernels_keeping_default", "measure_baselines",
           "tunable_tasks", "tune", "tune_templates"]
