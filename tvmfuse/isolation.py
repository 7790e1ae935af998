"""Fault isolation: one kernel never fails a job.

Every step that handles one kernel (design-space generation, search, replaying a stored record, the replayed
schedule's output check (a wrong fastest record gives way to the next right one first), template and Hopper
substitution, default-schedule application) runs that kernel inside `guard`-style try/except: a failure prints one
warning line naming the kernel and the reason, the kernel keeps its default schedule, and the job's `failures`
list (kernel, step, reason) goes into the manifest. A build with tuned kernels that fails the job's verification is
built again with them on their default schedules (step "verification"). Only a model that cannot be built, or
fails verification on default schedules, fails the job.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

SPACE, SEARCH, REPLAY, OUTPUT_CHECK, TEMPLATE, HOPPER, DEFAULT_SCHEDULE, VERIFICATION = (
    "design space", "search", "replay", "output check", "template", "hopper kernel", "default schedule",
    "verification")


def reason(err: BaseException) -> str:
    """One line for an exception: its type and the first non-empty line of its message (TVM's are long)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.startswith(f"{type(err).__name__}:"):
        text = text[len(type(err).__name__) + 1:].strip()
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


@dataclass
class Failures:
    """The per-kernel failures of one job, in order; `say` prints each one's warning line."""

    say: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))
    items: list[dict] = field(default_factory=list)

    def add(self, kernel: str, step: str, why: str) -> None:
        if any(f["kernel"] == kernel and f["step"] == step for f in self.items):
            return  # the same kernel in several functions (buckets): reported once
        self.items.append({"kernel": kernel, "step": step, "reason": why})
        self.say(f"warning: kernel {kernel}: {step} failed, keeping its default schedule ({why})")


_CURRENT: contextvars.ContextVar[Failures | None] = contextvars.ContextVar("tvmfuse_failures", default=None)


@contextlib.contextmanager
def collecting(say: Callable[[str], None] | None = None):
    """Collect the failures of the steps run inside (one job); yields the Failures."""
    failures = Failures(say) if say is not None else Failures()
    token = _CURRENT.set(failures)
    try:
        yield failures
    finally:
        _CURRENT.reset(token)


def record(kernel: str, step: str, err: BaseException | str) -> None:
    """Note a failure of `step` on `kernel` (outside `collecting`: a warning line only)."""
    why = err if isinstance(err, str) else reason(err)
    failures = _CURRENT.get()
    (failures if failures is not None else Failures()).add(kernel, step, why)


def current() -> list[dict]:
    failures = _CURRENT.get()
    return list(failures.items) if failures is not None else []
