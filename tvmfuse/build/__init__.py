"""Build stage: apply the tuning records, give every other kernel its default schedule, compile to a VM executable
(CUDA graphs on request)."""

from tvmfuse.build.compile import DEFAULT, TUNED, apply_database, build, compile_module, schedule_kinds, tirx_kind

__all__ = ["DEFAULT", "TUNED", "apply_database", "build", "compile_module", "schedule_kinds", "tirx_kind"]
