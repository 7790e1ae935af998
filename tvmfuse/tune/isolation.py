"""Per-kernel fault isolation of the tune stage (tvmfuse.isolation): a kernel whose design space raises is tuned
with the no-write-reuse space (tvmfuse.spaces.fallback) or not at all; a MetaSchedule run over several kernels
that raises is retried kernel by kernel, and only the kernels that fail alone are given up."""

from __future__ import annotations

from collections.abc import Callable

from tvmfuse.isolation import SEARCH, SPACE, reason, record
from tvmfuse.spaces.fallback import no_write_reuse_space


def generate_space(ctx) -> list:
    """The kernel's design space (MetaSchedule generates it again inside tune_tasks; this probes it first)."""
    return ctx.generate_design_space()


def probed_context(name: str, make: Callable, space, target):
    """`make(space)`'s TuneContext when its space generates; else one with the fallback space; else None (the
    failure recorded: the kernel keeps its default schedule)."""
    try:
        ctx = make(space)
        generate_space(ctx)
        return ctx
    except Exception as err:  # noqa: BLE001  (a kernel's space must not stop its siblings)
        first = reason(err)
    try:
        ctx = make(no_write_reuse_space(target))
        generate_space(ctx)
        return ctx
    except Exception as err:  # noqa: BLE001
        record(name, SPACE, f"{first}; without write reuse: {reason(err)}")
        return None


def tune_isolated(group: list, run: Callable[[list], None], stop: list) -> None:
    """`run(group)`; when it raises (not an interrupt), run each kernel of the group alone, and record those that
    still fail (their records so far stay in the database; the build replays only what applies)."""
    try:
        run(group)
        return
    except Exception as err:  # noqa: BLE001
        if stop:
            raise
        if len(group) == 1:
            record(group[0].task_name, SEARCH, err)
            return
    for ctx in group:
        try:
            run([ctx.clone()])
        except Exception as err:  # noqa: BLE001
            if stop:
                raise
            record(ctx.task_name, SEARCH, err)
