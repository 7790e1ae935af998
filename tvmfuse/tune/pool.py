"""MetaSchedule's local builder and runner, made once per process: their worker processes are started once, not
per tune and (the builder's) per round of candidates.

Every worker imports tvm when it starts (4-5 s of CPU; 10-15 s of wall on a busy 2-core box). TVM's LocalBuilder
starts a fresh pool for its sanity check and for every `build` call ("a known memory leak issue with the PopenPool
workers after a couple times of usage"), and each LocalBuilder or LocalRunner made runs its sanity check in a new
worker: a 4-trial tune of one kernel spent more time starting workers than building and measuring. Here the builder
keeps one pool whose workers are each replaced after WORKER_USES builds (the leak stays bounded), and
`local_builder` / `local_runner` hand out one of each per configuration for the life of the process (a job's
kernels, its bucket functions, the next job). A worker that dies or times out is restarted on its next use by
TVM's pool itself.
"""

from __future__ import annotations

import functools

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import local_builder as _local
from tvm.s_tir.meta_schedule.utils import get_global_func_with_default_on_worker
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

#: candidates one builder worker builds before it is replaced by a fresh one
WORKER_USES = 64


def _check(f_build, f_export) -> None:
    get_global_func_with_default_on_worker(name=f_build, default=None)
    get_global_func_with_default_on_worker(name=f_export, default=None)


@derived_object
class ReusedWorkersBuilder(ms.builder.LocalBuilder._cls):  # pylint: disable=protected-access  (TVM's way to subclass)
    """LocalBuilder whose worker processes live from one `build` call to the next (each replaced after
    `WORKER_USES` builds); the sanity check runs in the first of them."""

    def __init__(self, **kwargs) -> None:
        self._pool = None
        super().__init__(**kwargs)

    def _workers(self) -> PopenPoolExecutor:
        if self._pool is None:
            self._pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec,
                                           initializer=self.initializer, maximum_process_uses=WORKER_USES)
        return self._pool

    def _sanity_check(self) -> None:
        self._workers().submit(_check, self.f_build, self.f_export).result()

    def build(self, build_inputs: list) -> list:
        """As LocalBuilder.build (same worker function, same results and messages), on the kept pool."""
        results = []
        args = [(self.f_build, self.f_export, b.mod, b.target, _local._serialize_params(b.params))  # noqa: SLF001
                for b in build_inputs]
        for res in self._workers().map_with_error_catching(lambda x: _local._worker_func(*x), args):  # noqa: SLF001
            if res.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(
                    None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
            elif res.status == StatusKind.EXCEPTION:
                results.append(ms.builder.BuilderResult(None, "LocalBuilder: An exception occurred\n" + str(res.value)))
            else:
                raise ValueError(f"Unreachable: unexpected result: {res}")
        return results


@functools.lru_cache(maxsize=None)
def local_builder(max_workers: int, timeout_sec: float, f_build) -> ReusedWorkersBuilder:
    """The process's builder for these settings (made on first use)."""
    return ReusedWorkersBuilder(max_workers=max_workers, timeout_sec=timeout_sec, f_build=f_build)


@functools.lru_cache(maxsize=None)
def local_runner(timeout_sec: float, evaluator: ms.runner.EvaluatorConfig) -> ms.runner.LocalRunner:
    """The process's local runner for this timeout and evaluator config (a NamedTuple: compared by value)."""
    return ms.runner.LocalRunner(timeout_sec=timeout_sec, evaluator_config=evaluator)
