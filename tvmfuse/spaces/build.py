"""Fast MetaSchedule builder pieces: an f_build that skips the per-batch tensor-intrinsic import, and a builder factory."""

from __future__ import annotations

import os


def fast_build(mod, target, _params):
    """Build one candidate (notes section 3.1); returns a runtime.Module."""
    from tvm.driver import build as tvm_build  # pylint: disable=import-outside-toplevel
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # pylint: disable=import-outside-toplevel

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def builder(max_workers: int | None = None, timeout_sec: float = 60.0):
    """LocalBuilder with fast_build and one worker per core."""
    from tvm.s_tir import meta_schedule as ms  # pylint: disable=import-outside-toplevel

    return ms.builder.LocalBuilder(max_workers=max_workers or os.cpu_count(), timeout_sec=timeout_sec,
                                   f_build=fast_build)
