"""Records: the tuning database (append-only JSON lines, keyed by target and TVM version), its keys, the template
knob records, and `schedules/`, the library of best records that seeds every job."""

from tvmfuse.records.database import TuningDatabase
from tvmfuse.records.library import DEFAULT_DIR as SCHEDULES_DIR
from tvmfuse.records.library import open_database

__all__ = ["SCHEDULES_DIR", "TuningDatabase", "open_database"]
