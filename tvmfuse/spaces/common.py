"""What the spaces share: applying a schedule function to a fresh schedule, None where it does not take the kernel."""

from __future__ import annotations

from collections.abc import Callable

from tvm import s_tir, tirx


def schedule_or_none(func: tirx.PrimFunc, schedule: Callable[[s_tir.Schedule], bool]) -> s_tir.Schedule | None:
    """`schedule` applied in place to a new Schedule of `func`; None if it returns False or raises (a fused kernel
    this schedule cannot take)."""
    try:
        sch = s_tir.Schedule(func)
        return sch if schedule(sch) else None
    except Exception:  # noqa: BLE001
        return None
